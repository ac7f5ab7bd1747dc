"""Decoder shapes: a frozen `ModelSpec`, presets, and loading from a Hugging Face config.json.

Design notes: docs/design.md ("trace_roofline/model/models.py").
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path

from trace_roofline.errors import InputError
from trace_roofline.files import read_json
from trace_roofline.model import dtypes, families
from trace_roofline.model.architecture import Architecture, Attention, Gemm, Mlp, Moe, Precision
from trace_roofline.model.moe import Experts
from trace_roofline.model.operators import Name

TP_DEGREES = (1, 2, 4, 8, 16, 32, 64)  # tensor-parallel degrees a trace's shapes are checked against


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of a dtype name (any spelling `dtypes.lookup` knows; packed 4-bit: < 1)."""
    d = dtypes.lookup(dtype)
    if d is None:
        raise InputError(f"unknown dtype {dtype!r} (known: {', '.join(dtypes.known())})")
    return d.bytes


@dataclass(frozen=True)
class ModelSpec:
    """A decoder's shapes (heads, head_dim = the q/k head size, intermediate_size = the dense
    MLP's, ...) and its layer layout (`architecture`); with `experts`, a mixture-of-experts
    model whose sparse layers (`sparse_layers`) route each token through `experts.top_k` of
    `experts.num_experts` expert MLPs instead."""

    name: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int
    vocab_size: int
    qkv_bias: bool
    dtype: str = "bfloat16"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    experts: Experts | None = None
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    qk_norm: bool = False  # q and k RMSNorm-ed per head before RoPE (Qwen3's q_norm, k_norm)

    @classmethod
    def from_architecture(cls, arch: Architecture) -> ModelSpec:
        """The summary of an architecture, carrying it (its layout, any family)."""
        a, e = arch.attention, arch.moe.experts if arch.moe else None
        spec = cls(
            name=arch.name, hidden_size=arch.hidden_size, num_heads=a.num_heads,
            num_kv_heads=a.num_kv_heads, head_dim=a.head_dim,
            intermediate_size=arch.mlp.intermediate_size if arch.mlp else e.intermediate_size,  # type: ignore[union-attr]
            num_layers=arch.num_layers, vocab_size=arch.vocab_size, qkv_bias=a.bias,
            dtype=arch.precision.weights, rms_norm_eps=arch.norm_eps, rope_theta=arch.rope_theta,
            tie_word_embeddings=arch.tie_word_embeddings, experts=e,
            decoder_sparse_step=arch.decoder_sparse_step, mlp_only_layers=arch.mlp_only_layers,
            qk_norm=a.qk_norm)
        object.__setattr__(spec, "_architecture", arch)  # not a field: asdict, ==, hash skip it
        return spec

    @property
    def architecture(self) -> Architecture:
        """The layer layout: the architecture this spec was built from, else the Llama/Qwen-style
        one its fields describe."""
        carried = self.__dict__.get("_architecture")
        return carried if carried is not None else _described(self)

    @property
    def assumed(self) -> tuple[str, ...]:
        """What reading its config assumed (defaults taken, a model type read from its
        fields, a guessed norm kind), one short line each; () when nothing was."""
        return self.architecture.assumed

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """Indices of the layers whose MLP is the experts (none without `experts`)."""
        return self.sparse_among(self.num_layers)

    def sparse_among(self, layers: int) -> tuple[int, ...]:
        """The sparse ones among layers 0 .. layers - 1, by the model's rule."""
        return self.architecture.sparse_among(layers)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def bytes_per_element(self) -> float:
        return dtype_bytes(self.dtype)

    def linears(self) -> dict[str, tuple[int, int, bool]]:
        """HF-named projections of a dense layer: name -> (K, N, has_bias) (Architecture.linears:
        attention and dense MLP, as the family has them: GPT-2's c_attn is qkv_proj)."""
        return _table(self.architecture.linears())

    def shard(self, tp: int) -> ModelSpec:
        """One rank's shapes under tensor parallelism over `tp` ranks (vLLM / Megatron layout,
        Architecture.shard): column-parallel q/k/v (fused qkv_proj) and gate/up (gate_up_proj)
        hold n_q/t query heads, n_kv/t KV heads (one replicated head each when t > n_kv, as
        vLLM does) and I/t of the intermediate; row-parallel o_proj and down_proj take
        K = n_q/t·d and I/t; the vocabulary-parallel embedding and lm_head hold ceil(V/t) rows
        (vLLM's padding to a multiple of 64 is ignored). A MoE model's every routed expert holds
        I/t of its intermediate (vLLM's FusedMoE without expert parallelism: w13 [E, 2I/t, H]),
        the shared expert I_s/t, the router all E. Hidden size, head_dim and depth are
        unchanged. tp 1 is the model itself; heads or intermediates not divisible by `tp` are
        an InputError."""
        if tp == 1:
            return self
        return ModelSpec.from_architecture(self.architecture.shard(tp))

    def fused_linears(self) -> dict[str, tuple[int, int, bool]]:
        """vLLM-style fused projections: qkv_proj and gate_up_proj (those the layer has)."""
        return _table(self.architecture.fused_linears())

    def moe_linears(self) -> dict[str, tuple[int, int, bool]]:
        """A sparse layer's weight GEMMs, name -> (K, N, has_bias), none for a dense model:
        the router (H -> E); each routed expert's gate and up projections, fused as HF 5.x and
        vLLM store them (experts_gate_up: H -> 2I) or not (experts_gate, experts_up: H -> I,
        as HF 4.x's w1 and w3), and its down projection (I -> H); the shared expert's gate, up
        (or fused gate_up) and down projections and its sigmoid gate (shared_expert_gate: H -> 1,
        `router` work)."""
        return _table(self.architecture.moe_linears())


def _table(gemms: tuple[Gemm, ...]) -> dict[str, tuple[int, int, bool]]:
    return {g.name: (g.k, g.n, g.bias) for g in gemms}


def _described(spec: ModelSpec) -> Architecture:
    """The architecture a spec's fields describe (cached while the spec is hashable)."""
    try:
        return _described_cached(spec)
    except TypeError:  # a field holds a list
        return _describe(spec)


@functools.lru_cache(maxsize=256)
def _described_cached(spec: ModelSpec) -> Architecture:
    return _describe(spec)


def _describe(spec: ModelSpec) -> Architecture:
    """A Llama/Qwen-style decoder of the spec's fields: GQA (q/k/v bias by qkv_bias, q/k norms
    by qk_norm), SwiGLU MLP of intermediate_size, the spec's experts in its sparse layers."""
    e = spec.experts
    family = (("qwen3_moe" if spec.qk_norm else "qwen2_moe") if e is not None
              else "qwen3" if spec.qk_norm else "qwen2" if spec.qkv_bias else "llama")
    d = dtypes.lookup(spec.dtype)
    bits = d.bits if d is not None else 0.0
    attention = Attention(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.head_dim,
                          bias=spec.qkv_bias, qk_norm=spec.qk_norm, rope_dim=spec.head_dim)
    return Architecture(
        family, spec.name, spec.hidden_size, spec.num_layers, spec.vocab_size, attention,
        Mlp(spec.intermediate_size), layout=families.FAMILIES[family].layout,
        moe=Moe(e) if e is not None else None,
        decoder_sparse_step=spec.decoder_sparse_step, mlp_only_layers=tuple(spec.mlp_only_layers),
        norm_eps=spec.rms_norm_eps, rope_theta=spec.rope_theta,
        tie_word_embeddings=spec.tie_word_embeddings,
        precision=Precision(spec.dtype, spec.dtype, bits, spec.dtype, bits))


def expected_linears(model: ModelSpec) -> dict[str, tuple[int, int]]:
    """operator -> (K, N) of the model's linears, fused forms and (with a vocabulary) lm_head."""
    out = {k: (v[0], v[1]) for k, v in {**model.linears(), **model.fused_linears()}.items()}
    if model.vocab_size:
        out[Name.LM_HEAD] = (model.hidden_size, model.vocab_size)
    return out



def _preset(name: str, cfg: dict) -> ModelSpec:
    """A preset: its config.json's fields read by the family's builder, named `name`."""
    arch = families.from_hf_config(cfg, name)
    return ModelSpec.from_architecture(dataclasses.replace(arch, name=name))


_QWEN2 = {"model_type": "qwen2", "rope_theta": 1e6, "rms_norm_eps": 1e-6}
# Sources: each model's config.json on the Hugging Face Hub (the fields the layout reads).
PRESET_CONFIGS: dict[str, dict] = {
    "qwen2.5-7b": {**_QWEN2,  # Qwen/Qwen2.5-7B-Instruct
                   "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
                   "intermediate_size": 18944, "num_hidden_layers": 28, "vocab_size": 152064},
    "qwen2.5-0.5b": {**_QWEN2,  # Qwen/Qwen2.5-0.5B-Instruct (ties embeddings)
                     "hidden_size": 896, "num_attention_heads": 14, "num_key_value_heads": 2,
                     "intermediate_size": 4864, "num_hidden_layers": 24, "vocab_size": 151936,
                     "tie_word_embeddings": True},
    "llama-3-8b": {  # meta-llama/Meta-Llama-3-8B
        "model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
        "num_key_value_heads": 8, "intermediate_size": 14336, "num_hidden_layers": 32,
        "vocab_size": 128256, "attention_bias": False, "rms_norm_eps": 1e-5, "rope_theta": 5e5},
    "mixtral-8x7b": {  # mistralai/Mixtral-8x7B-v0.1: 8 experts, top-2, no dense MLP
        "model_type": "mixtral", "hidden_size": 4096, "num_attention_heads": 32,
        "num_key_value_heads": 8, "intermediate_size": 14336, "num_hidden_layers": 32,
        "vocab_size": 32000, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "num_local_experts": 8,
        "num_experts_per_tok": 2},
    "qwen1.5-moe-a2.7b": {**_QWEN2,  # Qwen/Qwen1.5-MoE-A2.7B: 60 experts top-4 + a shared one
                          "model_type": "qwen2_moe", "hidden_size": 2048,
                          "num_attention_heads": 16, "num_key_value_heads": 16,
                          "intermediate_size": 5632, "num_hidden_layers": 24,
                          "vocab_size": 151936, "num_experts": 60, "num_experts_per_tok": 4,
                          "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                          "norm_topk_prob": False},
    "qwen3-30b-a3b": {**_QWEN2,  # Qwen/Qwen3-30B-A3B: 128 experts top-8
                      "model_type": "qwen3_moe", "hidden_size": 2048, "num_attention_heads": 32,
                      "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                      "num_hidden_layers": 48, "vocab_size": 151936, "attention_bias": False,
                      "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                      "norm_topk_prob": True},
    # Reduced-size Qwen-shaped model for fast CPU traces and tests (not a real checkpoint).
    "qwen-tiny": {**_QWEN2, "hidden_size": 256, "num_attention_heads": 8,
                  "num_key_value_heads": 2, "intermediate_size": 768, "num_hidden_layers": 2,
                  "vocab_size": 1024, "torch_dtype": "float32"},
}
PRESETS: dict[str, ModelSpec] = {k: _preset(k, v) for k, v in PRESET_CONFIGS.items()}


def from_hf_config(path: str | Path) -> ModelSpec:
    """A ModelSpec of a Hugging Face `config.json`, built by its family (families.FAMILIES);
    a config of no known family is read from its own fields as a Llama-style decoder, and
    `assumed` says so."""
    p = Path(path)
    cfg = read_json(p)
    if not isinstance(cfg, dict):
        raise InputError(f"{p}: expected a JSON object, got {type(cfg).__name__}")
    arch = families.from_hf_config(cfg, str(p))
    return ModelSpec.from_architecture(arch)


def get_model(name_or_path: str) -> ModelSpec:
    """A preset by name (case-insensitive) or a path to a HF config.json."""
    key = name_or_path.lower()
    if key in PRESETS:
        return PRESETS[key]
    if name_or_path.endswith(".json") or Path(name_or_path).exists():
        return from_hf_config(name_or_path)
    raise InputError(
        f"unknown model {name_or_path!r} (presets: {', '.join(PRESETS)}; or a config.json path)"
    )
