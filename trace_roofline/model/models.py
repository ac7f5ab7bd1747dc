"""Decoder shapes: a frozen `ModelSpec`, presets, and loading from a Hugging Face config.json.

Mixture-of-experts models (Mixtral, Qwen2-MoE / Qwen1.5-MoE, Qwen3-MoE) carry their routed and
shared experts as a `moe.Experts` and say which layers are sparse, as HF does: layer i (from 0)
has the experts when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers; the
other layers keep a dense MLP of intermediate_size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from trace_roofline.errors import InputError
from trace_roofline.files import read_json
from trace_roofline.model import dtypes
from trace_roofline.model.moe import Experts

TP_DEGREES = (1, 2, 4, 8, 16, 32, 64)  # tensor-parallel degrees a trace's shapes are checked against


def dtype_bytes(dtype: str) -> int:
    """Bytes per element for a dtype name (any spelling `dtypes.lookup` knows)."""
    d = dtypes.lookup(dtype)
    if d is None:
        raise InputError(f"unknown dtype {dtype!r} (known: {', '.join(dtypes.known())})")
    return d.bytes


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a Llama/Qwen-style decoder (GQA attention, SwiGLU MLP, RMSNorm); with
    `experts`, a mixture-of-experts model whose sparse layers (`sparse_layers`) route each
    token through `experts.top_k` of `experts.num_experts` expert MLPs instead."""

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

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """Indices of the layers whose MLP is the experts (none without `experts`)."""
        return self.sparse_among(self.num_layers)

    def sparse_among(self, layers: int) -> tuple[int, ...]:
        """The sparse ones among layers 0 .. layers - 1, by the model's rule."""
        if self.experts is None:
            return ()
        step = max(self.decoder_sparse_step, 1)
        return tuple(i for i in range(layers)
                     if (i + 1) % step == 0 and i not in self.mlp_only_layers)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def bytes_per_element(self) -> int:
        return dtype_bytes(self.dtype)

    def linears(self) -> dict[str, tuple[int, int, bool]]:
        """HF-named projections of one layer: name -> (K, N, has_bias)."""
        h, i = self.hidden_size, self.intermediate_size
        b = self.qkv_bias
        return {
            "q_proj": (h, self.q_size, b),
            "k_proj": (h, self.kv_size, b),
            "v_proj": (h, self.kv_size, b),
            "o_proj": (self.q_size, h, False),
            "gate_proj": (h, i, False),
            "up_proj": (h, i, False),
            "down_proj": (i, h, False),
        }

    def shard(self, tp: int) -> ModelSpec:
        """One rank's shapes under tensor parallelism over `tp` ranks (vLLM / Megatron layout):
        column-parallel q/k/v (fused qkv_proj) and gate/up (gate_up_proj) hold n_q/t query
        heads, n_kv/t KV heads (one replicated head each when t > n_kv, as vLLM does) and I/t
        of the intermediate; row-parallel o_proj and down_proj take K = n_q/t·d and I/t;
        the vocabulary-parallel embedding and lm_head hold ceil(V/t) rows (vLLM's padding to
        a multiple of 64 is ignored). A MoE model's every routed expert holds I/t of its
        intermediate (vLLM's FusedMoE without expert parallelism: w13 [E, 2I/t, H]), the
        shared expert I_s/t, the router all E. Hidden size, head_dim and depth are unchanged.
        tp 1 is the model itself; heads or intermediates not divisible by `tp` are an
        InputError."""
        if tp == 1:
            return self
        if tp < 1 or self.num_heads % tp or self.intermediate_size % tp:
            raise InputError(
                f"tp={tp} does not divide {self.name}'s {self.num_heads} heads and "
                f"{self.intermediate_size} intermediate size")
        if self.num_kv_heads >= tp and self.num_kv_heads % tp:
            raise InputError(f"tp={tp} does not divide {self.name}'s {self.num_kv_heads} KV heads")
        experts = self.experts
        if experts is not None:
            if experts.intermediate_size % tp or experts.shared_intermediate_size % tp:
                raise InputError(
                    f"tp={tp} does not divide {self.name}'s expert intermediate sizes "
                    f"{experts.intermediate_size}, {experts.shared_intermediate_size}")
            experts = dataclasses.replace(
                experts, intermediate_size=experts.intermediate_size // tp,
                shared_intermediate_size=experts.shared_intermediate_size // tp)
        return dataclasses.replace(
            self, name=f"{self.name} (tp{tp} rank)", num_heads=self.num_heads // tp,
            num_kv_heads=max(self.num_kv_heads // tp, 1),
            intermediate_size=self.intermediate_size // tp,
            vocab_size=-(-self.vocab_size // tp), experts=experts)

    def fused_linears(self) -> dict[str, tuple[int, int, bool]]:
        """vLLM-style fused projections: qkv_proj and gate_up_proj."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "qkv_proj": (h, self.q_size + 2 * self.kv_size, self.qkv_bias),
            "gate_up_proj": (h, 2 * i, False),
        }

    def moe_linears(self) -> dict[str, tuple[int, int, bool]]:
        """A sparse layer's weight GEMMs, name -> (K, N, has_bias), none for a dense model:
        the router (H -> E); each routed expert's gate and up projections, fused as HF 5.x and
        vLLM store them (experts_gate_up: H -> 2I) or not (experts_gate, experts_up: H -> I,
        as HF 4.x's w1 and w3), and its down projection (I -> H); the shared expert's gate, up
        (or fused gate_up) and down projections and its sigmoid gate (shared_expert_gate: H -> 1,
        `router` work)."""
        e = self.experts
        if e is None:
            return {}
        h, i = self.hidden_size, e.intermediate_size
        out = {"router": (h, e.num_experts, False), "experts_gate_up": (h, 2 * i, False),
               "experts_gate": (h, i, False), "experts_up": (h, i, False),
               "experts_down": (i, h, False)}
        if e.shared_intermediate_size:
            s = e.shared_intermediate_size
            out.update({"shared_gate_proj": (h, s, False), "shared_up_proj": (h, s, False),
                        "shared_gate_up_proj": (h, 2 * s, False), "shared_down_proj": (s, h, False)})
        if e.shared_gate:
            out["shared_expert_gate"] = (h, 1, False)
        return out


def expected_linears(model: ModelSpec) -> dict[str, tuple[int, int]]:
    """operator -> (K, N) of the model's linears, fused forms and (with a vocabulary) lm_head."""
    out = {k: (v[0], v[1]) for k, v in {**model.linears(), **model.fused_linears()}.items()}
    if model.vocab_size:
        out["lm_head"] = (model.hidden_size, model.vocab_size)
    return out



# Sources: each model's config.json on the Hugging Face Hub.
PRESETS: dict[str, ModelSpec] = {
    "qwen2.5-7b": ModelSpec(  # Qwen/Qwen2.5-7B-Instruct
        "qwen2.5-7b", 3584, 28, 4, 128, 18944, 28, 152064, True, rope_theta=1e6,
    ),
    "qwen2.5-0.5b": ModelSpec(  # Qwen/Qwen2.5-0.5B-Instruct (ties embeddings)
        "qwen2.5-0.5b", 896, 14, 2, 64, 4864, 24, 151936, True, rope_theta=1e6,
        tie_word_embeddings=True,
    ),
    "llama-3-8b": ModelSpec(  # meta-llama/Meta-Llama-3-8B
        "llama-3-8b", 4096, 32, 8, 128, 14336, 32, 128256, False, rms_norm_eps=1e-5,
        rope_theta=5e5,
    ),
    "mixtral-8x7b": ModelSpec(  # mistralai/Mixtral-8x7B-v0.1: 8 experts, top-2, no dense MLP
        "mixtral-8x7b", 4096, 32, 8, 128, 14336, 32, 32000, False, rms_norm_eps=1e-5,
        rope_theta=1e6, experts=Experts(8, 2, 14336),
    ),
    "qwen1.5-moe-a2.7b": ModelSpec(  # Qwen/Qwen1.5-MoE-A2.7B: 60 experts top-4 + a shared one
        "qwen1.5-moe-a2.7b", 2048, 16, 16, 128, 5632, 24, 151936, True, rope_theta=1e6,
        experts=Experts(60, 4, 1408, shared_intermediate_size=5632, shared_gate=True,
                        norm_topk_prob=False),
    ),
    "qwen3-30b-a3b": ModelSpec(  # Qwen/Qwen3-30B-A3B: 128 experts top-8
        "qwen3-30b-a3b", 2048, 32, 4, 128, 6144, 48, 151936, False, rope_theta=1e6,
        experts=Experts(128, 8, 768), qk_norm=True,
    ),
    # Reduced-size Qwen-shaped model for fast CPU traces and tests (not a real checkpoint).
    "qwen-tiny": ModelSpec(
        "qwen-tiny", 256, 8, 2, 32, 768, 2, 1024, True, dtype="float32", rope_theta=1e6,
    ),
}


def from_hf_config(path: str | Path) -> ModelSpec:
    """Build a ModelSpec from a Hugging Face `config.json`."""
    p = Path(path)
    cfg = read_json(p)
    if not isinstance(cfg, dict):
        raise InputError(f"{p}: expected a JSON object, got {type(cfg).__name__}")
    need = ["hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers"]
    missing = [k for k in need if k not in cfg]
    if missing:
        raise InputError(f"{p}: config.json lacks {', '.join(missing)}")
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        arch = " ".join(cfg.get("architectures") or [cfg.get("model_type", "")]).lower()
        return ModelSpec(
            name=str(cfg.get("_name_or_path") or cfg.get("model_type") or p.stem),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            vocab_size=int(cfg.get("vocab_size", 0)),
            # Qwen2 always has q/k/v bias; Llama exposes `attention_bias`.
            qkv_bias=bool(cfg.get("attention_bias", "qwen2" in arch)),
            dtype=_config_dtype(cfg),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            experts=_config_experts(cfg),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(int(v) for v in cfg.get("mlp_only_layers") or ()),
            qk_norm=_config_qk_norm(cfg),
        )
    except (TypeError, ValueError) as e:
        raise InputError(f"{p}: bad value in config.json ({e})") from None


def _config_experts(cfg: dict) -> Experts | None:
    """The experts of a Mixtral (`num_local_experts`, experts of `intermediate_size`) or
    Qwen2-MoE / Qwen3-MoE (`num_experts`, `moe_intermediate_size`, a shared expert of
    `shared_expert_intermediate_size` with a sigmoid gate) config; None for a dense model."""
    count = cfg.get("num_local_experts") or cfg.get("num_experts")
    if not count:
        return None
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    return Experts(
        num_experts=int(count),
        top_k=int(cfg.get("num_experts_per_tok") or 0),
        intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        shared_intermediate_size=shared,
        shared_gate=shared > 0,  # Qwen2-MoE: sigmoid(shared_expert_gate(x)) scales it
        # Mixtral renormalises always; Qwen's configs say so (Qwen2-MoE's default: not)
        norm_topk_prob=bool(cfg.get("norm_topk_prob", "num_local_experts" in cfg)),
    )


# HF model types whose attention always RMSNorms q and k per head (no config field says so)
QK_NORM_MODEL_TYPES = frozenset({"qwen3", "qwen3_moe"})


def _config_qk_norm(cfg: dict) -> bool:
    """Whether q and k are normalised before RoPE: the model type always does it (Qwen3,
    Qwen3-MoE), or the config says so (`use_qk_norm`: Cohere, Llama 4, GLM-4-MoE;
    `qk_layernorm`: Persimmon, Phi, StableLM)."""
    return (str(cfg.get("model_type", "")) in QK_NORM_MODEL_TYPES
            or bool(cfg.get("use_qk_norm") or cfg.get("qk_layernorm")))


def _config_dtype(cfg: dict) -> str:
    """The dtype the model's GEMMs run in: an fp8 `quantization_config` (quant_method "fp8",
    `fmt` e4m3 or e5m2) says float8_e4m3fn / float8_e5m2 whatever `torch_dtype` the
    unquantised layers keep; else `torch_dtype` (or `dtype`), else bfloat16."""
    quant = cfg.get("quantization_config")
    if isinstance(quant, dict) and str(quant.get("quant_method", "")).lower() == "fp8":
        return "float8_e5m2" if str(quant.get("fmt", "")).lower() == "e5m2" else "float8_e4m3fn"
    return str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")


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
