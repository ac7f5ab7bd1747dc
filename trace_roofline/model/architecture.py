"""One architecture description per decoder family, built from a Hugging Face config.json.

Design notes: docs/architecture.md ("trace_roofline/model/architecture.py").
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from trace_roofline.errors import InputError
from trace_roofline.model import dtypes, operators
from trace_roofline.model.moe import Experts

NormKind = Literal["rmsnorm", "layernorm"]
Placement = Literal["pre", "sandwich", "parallel"]
Position = Literal["rope", "learned"]
Parallel = Literal["column", "row", "replicated"]

_SCALE_BITS = 32  # fp8 checkpoints keep one float32 scale per weight block
# Tensor parallelism (vLLM / Megatron): row-parallel GEMMs split K, replicated ones are whole
_ROW = frozenset({"o_proj", "down_proj", "experts_down", "shared_down_proj"})
_REPLICATED = frozenset({"router", "shared_expert_gate", "q_a_proj", "kv_a_proj_with_mqa"})


# ----------------------------------------------------------------------------- sub-operations
def _check_op(op: str) -> None:
    if op not in operators.BY_NAME:
        raise ValueError(f"{op!r} is not in the operator vocabulary")


@dataclass(frozen=True)
class Gemm:
    """One weight GEMM of a layer, Y[M, N] = X[M, K]·W[K, N] (+ bias).

    name: unique within the layer (an operator name, or `shared_expert_gate`);
    op: the vocabulary operator its time goes to ("" = `name`);
    weight: the HF parameter path inside the layer (`self_attn.q_proj.weight`,
        `mlp.experts.gate_up_proj`); the bias is `...bias` or `..._bias` beside it;
    experts: routed experts stacked in one parameter [E, ...] (HF 5.x), 0 for one weight;
    transposed: HF stores [K, N] (GPT-2's Conv1D, gpt-oss experts), not nn.Linear's [N, K];
    weight_bits: bits per weight element, scales included (dtypes.MXFP4_BITS: 4.25)."""

    name: str
    weight: str
    k: int
    n: int
    bias: bool = False
    op: str = ""
    experts: int = 0
    transposed: bool = False
    weight_bits: float = 16.0
    parallel: Parallel = "column"

    def __post_init__(self) -> None:
        if not self.op:
            object.__setattr__(self, "op", self.name)
        _check_op(self.op)

    @property
    def bias_param(self) -> str:
        """The HF path of the bias: `x.weight` -> `x.bias`, `x.gate_up_proj` -> `x.gate_up_proj_bias`."""
        base, _, leaf = self.weight.rpartition(".")
        return f"{base}.bias" if leaf == "weight" else f"{self.weight}_bias"

    def hf_params(self) -> dict[str, tuple[int, ...]]:
        """HF parameter path -> shape of the weight (and bias)."""
        stack = (self.experts,) if self.experts else ()
        w = (self.k, self.n) if self.transposed else (self.n, self.k)
        out = {self.weight: (*stack, *w)}
        if self.bias:
            out[self.bias_param] = (*stack, self.n)
        return out


@dataclass(frozen=True)
class Norm:
    """A normalisation over `size` features (H, a head, a LoRA rank) at HF module `module`."""

    op: str
    module: str
    kind: NormKind
    size: int

    def __post_init__(self) -> None:
        _check_op(self.op)

    def hf_params(self) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {f"{self.module}.weight": (self.size,)}
        if self.kind == "layernorm":
            out[f"{self.module}.bias"] = (self.size,)
        return out


@dataclass(frozen=True)
class Step:
    """A sub-operation without a weight GEMM (rope, attention, act, residual, ...); `params`
    lists the HF parameters it owns (gpt-oss attention sinks)."""

    op: str
    module: str = ""
    params: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def __post_init__(self) -> None:
        _check_op(self.op)

    def hf_params(self) -> dict[str, tuple[int, ...]]:
        return dict(self.params)


SubOp = Gemm | Norm | Step


@dataclass(frozen=True)
class Layer:
    """One decoder layer: whether its MLP is the experts, its sliding window, its sub-operations
    in the order HF runs them."""

    sparse: bool
    window: int | None
    ops: tuple[SubOp, ...]

    def gemms(self) -> tuple[Gemm, ...]:
        return tuple(o for o in self.ops if isinstance(o, Gemm))

    def gemm(self, name: str) -> Gemm | None:
        return next((g for g in self.gemms() if g.name == name), None)

    def norms(self) -> tuple[Norm, ...]:
        return tuple(o for o in self.ops if isinstance(o, Norm))

    def hf_params(self) -> dict[str, tuple[int, ...]]:
        """Every HF parameter of the layer -> its shape, as the architecture expects it."""
        return {k: v for o in self.ops for k, v in o.hf_params().items()}


# ----------------------------------------------------------------------------- geometry
@dataclass(frozen=True)
class Attention:
    """Attention geometry. head_dim is the q/k head size (MLA: nope + rope), v_head_dim the v
    head size; windows[i] is layer i's sliding window (None: full attention); rope_dim the
    rotated dims per head (0: no RoPE); MLA (kv_lora_rank > 0) compresses q through
    q_lora_rank (None: a plain q_proj) and k/v through kv_lora_rank."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    bias: bool = False  # q/k/v (fused qkv; MLA: q_a/kv_a) projections
    out_bias: bool = False  # o_proj
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE
    windows: tuple[int | None, ...] = ()
    sinks: bool = False  # a learned per-head sink logit (gpt-oss)
    softcap: float | None = None  # tanh logit softcapping (Gemma 2)
    scale: float | None = None  # softmax scale when not head_dim ** -0.5
    rope_dim: int = 0
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def nope_head_dim(self) -> int:
        """MLA's per-head q/k dims without RoPE."""
        return self.head_dim - self.rope_dim

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if 0 <= layer < len(self.windows) else None


@dataclass(frozen=True)
class Mlp:
    """A dense MLP: gated (down(act(gate(x))·up(x))) or not (down(act(up(x))))."""

    intermediate_size: int
    gated: bool = True
    bias: bool = False
    activation: str = "silu"


@dataclass(frozen=True)
class Moe:
    """A sparse MLP: the routed (and shared) experts, their activation (gpt-oss: SwiGLU with
    its inputs clamped to `swiglu_limit`) and which of router and experts carry biases."""

    experts: Experts
    activation: str = "silu"
    swiglu_limit: float | None = None
    router_bias: bool = False
    expert_bias: bool = False


@dataclass(frozen=True)
class Precision:
    """Dtypes: the activations', the weights' (fp8 under an fp8 quantization_config) and the
    routed experts' (gpt-oss: mxfp4), with bits per weight element, scales included."""

    activations: str = "bfloat16"
    weights: str = "bfloat16"
    weight_bits: float = 16.0
    expert_weights: str = "bfloat16"
    expert_bits: float = 16.0


@dataclass(frozen=True)
class Architecture:
    """A decoder: geometry, placement of its sparse layers, norms, positions and precision.

    Layer i is sparse when `moe` is set, i is not in `mlp_only_layers` and
    (i + sparse_phase) % decoder_sparse_step == 0 (Qwen-MoE: phase 1; DeepSeek: phase 0 with
    the first_k_dense_replace layers listed dense). `mlp` is the dense MLP of the other layers,
    None where the family has none (gpt-oss). placement: `pre` (pre-norm, post_attention_norm
    before the MLP), `sandwich` (Gemma: norms before and after attention and MLP), `parallel`
    (GPT-NeoX: attention and MLP both read the layer input)."""

    family: str
    name: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    attention: Attention
    mlp: Mlp | None
    moe: Moe | None = None
    decoder_sparse_step: int = 1
    sparse_phase: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    norm: NormKind = "rmsnorm"
    norm_eps: float = 1e-6
    placement: Placement = "pre"
    position: Position = "rope"
    rope_theta: float = 10000.0
    max_positions: int = 0
    tie_word_embeddings: bool = False
    embedding_scale: float = 1.0  # Gemma multiplies the embeddings by sqrt(H)
    final_softcap: float | None = None  # Gemma 2's final logit softcapping
    precision: Precision = field(default_factory=Precision)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise InputError(f"unknown architecture family {self.family!r} ({_supported()})")
        if self.mlp is None and self.moe is None:
            raise InputError(f"{self.name}: a decoder needs a dense MLP or experts")

    # ---- layers
    def is_sparse(self, layer: int) -> bool:
        if self.moe is None or layer in self.mlp_only_layers:
            return False
        return (layer + self.sparse_phase) % max(self.decoder_sparse_step, 1) == 0

    def sparse_among(self, layers: int) -> tuple[int, ...]:
        """The sparse ones among layers 0 .. layers - 1."""
        return tuple(i for i in range(layers) if self.is_sparse(i))

    @cached_property
    def _ops(self) -> dict[bool, tuple[SubOp, ...]]:
        kinds = [False] if self.mlp is not None else []
        return {s: _layer_ops(self, s) for s in (kinds + ([True] if self.moe else []))}

    def layer(self, i: int) -> Layer:
        """Layer i: its MLP kind, window and sub-operations (every layer of a family without a
        dense MLP is sparse)."""
        sparse = self.is_sparse(i) or self.mlp is None
        return Layer(sparse, self.attention.window(i), self._ops[sparse])

    @property
    def dense_layer(self) -> Layer | None:
        """The layout of a dense layer (None without a dense MLP)."""
        return Layer(False, None, self._ops[False]) if self.mlp is not None else None

    @property
    def sparse_layer(self) -> Layer | None:
        """The layout of a sparse layer (None without experts)."""
        return Layer(True, None, self._ops[True]) if self.moe is not None else None

    @property
    def lm_head(self) -> Gemm:
        return Gemm("lm_head", "lm_head.weight", self.hidden_size, self.vocab_size,
                    weight_bits=self.precision.weight_bits, parallel="column")

    # ---- views the analyzer uses (ModelSpec.linears, fused_linears, moe_linears)
    def linears(self) -> tuple[Gemm, ...]:
        """The GEMMs of a dense layer: attention and dense MLP (without one, the attention's)."""
        layer = self.dense_layer or self.sparse_layer
        assert layer is not None
        return tuple(g for g in layer.gemms() if g.op not in operators.MOE)

    def fused_linears(self) -> tuple[Gemm, ...]:
        """vLLM's fused forms of the layer's q/k/v (qkv_proj) and gate/up (gate_up_proj)."""
        lin = {g.name: g for g in self.linears()}
        qkv = lin.get("qkv_proj") or _fuse("qkv_proj", [lin.get(n) for n in ("q_proj", "k_proj", "v_proj")])
        gate_up = lin.get("gate_up_proj") or _fuse("gate_up_proj", [lin.get("gate_proj"), lin.get("up_proj")])
        return tuple(g for g in (qkv, gate_up) if g is not None)

    def moe_linears(self) -> tuple[Gemm, ...]:
        """A sparse layer's GEMMs and their other forms: router; routed experts' gate_up (HF 5.x,
        vLLM), gate and up apart (HF 4.x's w1, w3), down; the shared expert's gate, up, fused
        gate_up and down; the shared expert's sigmoid gate. Empty for a dense model."""
        layer = self.sparse_layer
        if layer is None:
            return ()
        g = {x.name: x for x in layer.gemms()}
        gate_up = g["experts_gate_up"]
        half = dataclasses.replace(gate_up, n=gate_up.n // 2)
        out: list[Gemm | None] = [
            g["router"], gate_up, dataclasses.replace(half, name="experts_gate", op="experts_gate_up"),
            dataclasses.replace(half, name="experts_up", op="experts_gate_up"), g["experts_down"]]
        if "shared_gate_proj" in g:
            fused = _fuse("shared_gate_up_proj", [g["shared_gate_proj"], g["shared_up_proj"]],
                          leaf="gate_up_proj")
            out += [g["shared_gate_proj"], g["shared_up_proj"], fused, g["shared_down_proj"]]
        if "shared_expert_gate" in g:
            out.append(g["shared_expert_gate"])
        return tuple(x for x in out if x is not None)

    # ---- tensor parallelism
    def shard(self, tp: int) -> Architecture:
        """One rank's architecture under tensor parallelism over `tp` ranks (vLLM / Megatron):
        n_q/t query heads, n_kv/t KV heads (one replicated head each when t > n_kv), I/t of
        every dense, routed and shared intermediate, ceil(V/t) vocabulary rows; the layout
        then gives column-parallel GEMMs N/t and row-parallel ones K/t, while the router and
        MLA's q_a/kv_a projections stay whole. Indivisible sizes are an InputError."""
        return self if tp == 1 else _shard(self, tp)

    @property
    def _experts(self) -> Experts:
        assert self.moe is not None
        return self.moe.experts


@functools.lru_cache(maxsize=256)
def _shard(arch: Architecture, tp: int) -> Architecture:
    """Architecture.shard (cached: tensor-parallel inference shards a model at every degree)."""
    a = arch.attention
    inter = arch.mlp.intermediate_size if arch.mlp else arch._experts.intermediate_size
    if tp < 1 or a.num_heads % tp or inter % tp:
        raise InputError(f"`tp` {tp} does not divide {arch.name}'s {a.num_heads} heads and "
                         f"{inter} intermediate size", "tp")
    if a.num_kv_heads >= tp and a.num_kv_heads % tp:
        raise InputError(f"`tp` {tp} does not divide {arch.name}'s {a.num_kv_heads} KV heads",
                         "tp")
    moe = arch.moe
    if moe is not None:
        e = moe.experts
        if e.intermediate_size % tp or e.shared_intermediate_size % tp:
            raise InputError(
                f"`tp` {tp} does not divide {arch.name}'s expert intermediate sizes "
                f"{e.intermediate_size}, {e.shared_intermediate_size}", "tp")
        moe = dataclasses.replace(moe, experts=dataclasses.replace(
            e, intermediate_size=e.intermediate_size // tp,
            shared_intermediate_size=e.shared_intermediate_size // tp))
    mlp = arch.mlp and dataclasses.replace(arch.mlp, intermediate_size=arch.mlp.intermediate_size // tp)
    attention = dataclasses.replace(a, num_heads=a.num_heads // tp,
                                    num_kv_heads=max(a.num_kv_heads // tp, 1))
    return dataclasses.replace(arch, name=f"{arch.name} (tp{tp} rank)", attention=attention,
                               mlp=mlp, moe=moe, vocab_size=-(-arch.vocab_size // tp))


def _fuse(name: str, parts: list[Gemm | None], leaf: str = "") -> Gemm | None:
    """One GEMM doing `parts` side by side (same K, N summed), as vLLM's merged linears."""
    if not parts or any(p is None for p in parts):
        return None
    ps = [p for p in parts if p is not None]
    module = ps[0].weight.rsplit(".", 2)[0]
    return Gemm(name, f"{module}.{leaf or name}.weight", ps[0].k, sum(p.n for p in ps),
                any(p.bias for p in ps), weight_bits=ps[0].weight_bits, parallel=ps[0].parallel)


# ----------------------------------------------------------------------------- layout
def _gemm(a: Architecture, fam: Family, name: str, k: int, n: int, bias: bool, *,
          op: str = "", experts: int = 0, leaf: str = "weight") -> Gemm:
    """A GEMM at the family's module for `name` (stacked experts: the parameter `leaf`)."""
    module = fam.modules["experts" if experts else name]
    p = a.precision
    bits = p.expert_bits if experts else (_bits(p.activations) if (op or name) == "router"
                                          else p.weight_bits)
    parallel: Parallel = ("row" if name in _ROW else "replicated" if name in _REPLICATED
                          else "column")
    return Gemm(name, f"{module}.{leaf}", k, n, bias, op=op, experts=experts,
                transposed=name in fam.transposed, weight_bits=bits, parallel=parallel)


def _norm(a: Architecture, fam: Family, op: str, size: int, kind: NormKind | None = None) -> Norm:
    return Norm(op, fam.modules[op], kind or a.norm, size)


def _attention_ops(a: Architecture, fam: Family) -> tuple[SubOp, ...]:
    """Projections, q/k norms, RoPE, attention and o_proj."""
    at, h = a.attention, a.hidden_size
    nq, nkv, d, dv = at.num_heads, at.num_kv_heads, at.head_dim, at.v_head_dim
    ops: list[SubOp]
    if at.mla:
        ops = _mla_ops(a, fam)
    elif "qkv_proj" in fam.modules:
        ops = [_gemm(a, fam, "qkv_proj", h, (nq + 2 * nkv) * d, at.bias)]
    else:
        ops = [_gemm(a, fam, "q_proj", h, nq * d, at.bias), _gemm(a, fam, "k_proj", h, nkv * d, at.bias),
               _gemm(a, fam, "v_proj", h, nkv * d, at.bias)]
    if at.qk_norm:
        ops += [_norm(a, fam, "q_norm", d, "rmsnorm"), _norm(a, fam, "k_norm", d, "rmsnorm")]
    if at.rope_dim:
        ops.append(Step("rope"))
    sinks = ((f"{fam.modules['attention']}.sinks", (nq,)),) if at.sinks else ()
    ops += [Step("attention", fam.modules["attention"], sinks),
            _gemm(a, fam, "o_proj", nq * dv, h, at.out_bias)]
    return tuple(ops)


def _mla_ops(a: Architecture, fam: Family) -> list[SubOp]:
    """DeepSeek's multi-head latent attention projections (q through a LoRA when q_lora_rank)."""
    at, h = a.attention, a.hidden_size
    q_n = at.num_heads * at.head_dim
    if at.q_lora_rank is None:
        ops: list[SubOp] = [_gemm(a, fam, "q_proj", h, q_n, False)]
    else:
        r = at.q_lora_rank
        ops = [_gemm(a, fam, "q_a_proj", h, r, at.bias), _norm(a, fam, "q_a_layernorm", r, "rmsnorm"),
               _gemm(a, fam, "q_b_proj", r, q_n, False)]
    c = at.kv_lora_rank
    return ops + [_gemm(a, fam, "kv_a_proj_with_mqa", h, c + at.rope_dim, at.bias),
                  _norm(a, fam, "kv_a_layernorm", c, "rmsnorm"),
                  _gemm(a, fam, "kv_b_proj", c, at.num_heads * (at.nope_head_dim + at.v_head_dim), False)]


def _mlp_ops(a: Architecture, fam: Family) -> tuple[SubOp, ...]:
    """The dense MLP: fused gate_up (Phi-3), gate and up, or an ungated up (GPT-2, GPT-NeoX)."""
    m, h = a.mlp, a.hidden_size
    assert m is not None
    i, b = m.intermediate_size, m.bias
    act, down = Step("act", fam.modules["act"]), _gemm(a, fam, "down_proj", i, h, b)
    if not m.gated:
        return _gemm(a, fam, "up_proj", h, i, b), act, down
    if "gate_up_proj" in fam.modules:
        return _gemm(a, fam, "gate_up_proj", h, 2 * i, b), act, down
    return _gemm(a, fam, "gate_proj", h, i, b), _gemm(a, fam, "up_proj", h, i, b), act, down


def _moe_ops(a: Architecture, fam: Family) -> tuple[SubOp, ...]:
    """Router, routed experts (stacked: gate_up then down) and the shared expert(s)."""
    moe, h = a.moe, a.hidden_size
    assert moe is not None
    e, i, bias = moe.experts, moe.experts.intermediate_size, moe.expert_bias
    n = e.num_experts
    ops: list[SubOp] = [
        _gemm(a, fam, "router", h, n, moe.router_bias), Step("moe_dispatch"),
        _gemm(a, fam, "experts_gate_up", h, 2 * i, bias, experts=n, leaf="gate_up_proj"),
        Step("experts_act"),
        _gemm(a, fam, "experts_down", i, h, bias, experts=n, leaf="down_proj"), Step("moe_combine")]
    s = e.shared_intermediate_size
    if s:
        ops += [_gemm(a, fam, "shared_gate_proj", h, s, False), _gemm(a, fam, "shared_up_proj", h, s, False),
                Step("act"), _gemm(a, fam, "shared_down_proj", s, h, False)]
    if s and e.shared_gate:
        ops.append(_gemm(a, fam, "shared_expert_gate", h, 1, False, op="router"))
    return tuple(ops)


def _layer_ops(a: Architecture, sparse: bool) -> tuple[SubOp, ...]:
    """A layer's sub-operations in HF's order, by the norm placement."""
    fam = FAMILIES[a.family]
    attn = _attention_ops(a, fam)
    mlp = _moe_ops(a, fam) if sparse else _mlp_ops(a, fam)
    h, res = a.hidden_size, Step("residual")
    pre, post = _norm(a, fam, "input_norm", h), _norm(a, fam, "post_attention_norm", h)
    if a.placement == "sandwich":
        return (pre, *attn, post, res, _norm(a, fam, "pre_feedforward_norm", h), *mlp,
                _norm(a, fam, "post_feedforward_norm", h), res)
    if a.placement == "parallel":
        return (pre, *attn, post, *mlp, res)
    return (pre, *attn, res, post, *mlp, res)


# ----------------------------------------------------------------------------- config reading
class _Config:
    """A config.json's fields with the reader's checks: `need` reports missing fields as
    "<source>: config.json lacks ...", bad values as "<source>: bad value in config.json"."""

    def __init__(self, cfg: dict, source: str, model_type: str):
        self.cfg, self.source, self.model_type = cfg, source, model_type

    def need(self, *keys: str) -> None:
        missing = [k for k in keys if self.cfg.get(k) is None]
        if missing:
            raise InputError(f"{self.source}: config.json lacks {', '.join(missing)}")

    def get_int(self, key: str, default: int | None = None) -> int:
        """An int field; with a default, also for a missing, null or 0 value."""
        v = self.cfg.get(key)
        if default is not None and not v:
            return default
        return int(v)  # type: ignore[arg-type]

    def get(self, key: str, default: Any = None) -> Any:
        v = self.cfg.get(key)
        return default if v is None else v

    def name(self) -> str:
        return str(self.cfg.get("_name_or_path") or self.cfg.get("model_type") or Path(self.source).stem)

    def rope_theta(self) -> float:
        """`rope_theta`, or HF 5.x's `rope_parameters` (Gemma 3: the full-attention layers')."""
        if self.cfg.get("rope_theta") is not None:
            return float(self.cfg["rope_theta"])
        rp = self.cfg.get("rope_parameters") or {}
        rp = rp.get("full_attention", rp) if isinstance(rp, dict) else {}
        return float(rp.get("rope_theta", self.cfg.get("rotary_emb_base", 10000.0)))

    def rotary_fraction(self) -> float:
        rp = self.cfg.get("rope_parameters") or {}
        return float(self.get("rotary_pct", rp.get("partial_rotary_factor", 1.0)
                              if isinstance(rp, dict) else 1.0))

    def windows(self, layers: int, default: Callable[[int], bool]) -> tuple[int | None, ...]:
        """Per-layer sliding windows: `layer_types` where the config lists them, else the
        family's rule `default(i)`; None for full attention or without `sliding_window`."""
        w = self.cfg.get("sliding_window")
        types = self.cfg.get("layer_types")
        sliding = ([t == "sliding_attention" for t in types] if isinstance(types, list)
                   else [default(i) for i in range(layers)])
        return tuple(int(w) if w and s else None for s in sliding[:layers])

    def precision(self) -> Precision:
        """Dtypes from `torch_dtype` (or `dtype`) and `quantization_config`: fp8 (`fmt` e4m3 or
        e5m2; a float32 scale per `weight_block_size` block) or mxfp4 (the routed experts)."""
        act = str(self.cfg.get("torch_dtype") or self.cfg.get("dtype") or "bfloat16")
        quant = self.cfg.get("quantization_config")
        method = str(quant.get("quant_method", "")).lower() if isinstance(quant, dict) else ""
        if method == "fp8":
            assert isinstance(quant, dict)
            w = "float8_e5m2" if str(quant.get("fmt", "")).lower() == "e5m2" else "float8_e4m3fn"
            block = quant.get("weight_block_size")
            bits = 8.0 + (_SCALE_BITS / math.prod(block) if block else 0.0)
            return Precision(act, w, bits, w, bits)
        if method == "mxfp4":
            return Precision(act, act, _bits(act), "mxfp4", _bits("mxfp4"))
        return Precision(act, act, _bits(act), act, _bits(act))

    def experts(self, count_key: str, inter_key: str, shared: int = 0,
                shared_gate: bool = False, norm_default: bool = True) -> Experts:
        return Experts(
            num_experts=self.get_int(count_key), top_k=self.get_int("num_experts_per_tok",
                                                           self.get("experts_per_token", 0)),
            intermediate_size=self.get_int(inter_key), shared_intermediate_size=shared,
            shared_gate=shared_gate, norm_topk_prob=bool(self.get("norm_topk_prob", norm_default)))


def _bits(dtype: str) -> float:
    """Bits per element of a dtype name, scales included (mxfp4: 4.25; 0 for one the dtype
    table does not know)."""
    d = dtypes.lookup(dtype)
    return d.bits if d is not None else 0.0


def _none(i: int) -> bool:
    return False


def _every_layer(i: int) -> bool:
    return True


def _even_layers(i: int) -> bool:
    return i % 2 == 0


# HF model types whose attention always RMSNorms q and k per head (no config field says so)
QK_NORM_MODEL_TYPES = frozenset({"qwen3", "qwen3_moe", "gemma3", "gemma3_text"})


def _qk_norm(c: _Config) -> bool:
    """Qwen3 / Gemma 3 always; others where the config says (`use_qk_norm`, `qk_layernorm`)."""
    return c.model_type in QK_NORM_MODEL_TYPES or bool(c.get("use_qk_norm") or c.get("qk_layernorm"))


def _common(c: _Config, family: str, **kw: Any) -> Architecture:
    """The fields every family reads alike; `kw` sets the family's own."""
    base: dict[str, Any] = dict(
        family=family, name=c.name(), vocab_size=c.get_int("vocab_size", 0),
        norm_eps=float(c.get("rms_norm_eps", c.get("layer_norm_eps", c.get("layer_norm_epsilon", 1e-6)))),
        rope_theta=c.rope_theta(), max_positions=c.get_int("max_position_embeddings", 0),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)), precision=c.precision())
    return Architecture(**{**base, **kw})


def _gqa(c: _Config, bias_default: bool = False,
         window_rule: Callable[[int], bool] = _none) -> tuple[int, int, Attention]:
    """hidden, layers and the grouped-query attention of a Llama-style config."""
    h, nq, layers = c.get_int("hidden_size"), c.get_int("num_attention_heads"), c.get_int("num_hidden_layers")
    d = c.get_int("head_dim", h // nq)
    bias = bool(c.get("attention_bias", c.get("qkv_bias", bias_default)))
    att = Attention(nq, c.get_int("num_key_value_heads", nq), d, d, bias=bias,
                    qk_norm=_qk_norm(c), windows=c.windows(layers, window_rule),
                    rope_dim=int(d * c.rotary_fraction()))
    return h, layers, att


def _qwen2_windows(c: _Config) -> Callable[[int], bool]:
    """Qwen2's rule: sliding from layer max_window_layers on, when use_sliding_window."""
    start = c.get_int("max_window_layers", 0)
    use = bool(c.get("use_sliding_window", False))
    return lambda i: use and i >= start


def _llama_experts(c: _Config) -> Moe | None:
    """Mixtral's (`num_local_experts` of `intermediate_size`) or Qwen-MoE's (`num_experts` of
    `moe_intermediate_size`, a shared expert with a sigmoid gate) experts; None for none."""
    count_key = "num_local_experts" if c.get("num_local_experts") else "num_experts"
    if not c.get(count_key):
        return None
    shared = c.get_int("shared_expert_intermediate_size", 0)
    inter = "moe_intermediate_size" if c.get("moe_intermediate_size") else "intermediate_size"
    # Mixtral renormalises always; Qwen's configs say so (Qwen2-MoE's default: not)
    e = c.experts(count_key, inter, shared, shared_gate=shared > 0,
                  norm_default="num_local_experts" in c.cfg)
    return Moe(e)


# transformers/models/{llama,mistral,qwen2,qwen3,qwen2_moe,qwen3_moe,mixtral}/modeling_*.py
def _read_llama(c: _Config) -> Architecture:
    """Llama, Mistral, Qwen2/3 and their MoE forms, Mixtral: GQA, SwiGLU, RMSNorm, RoPE."""
    mt = c.model_type
    rule: Callable[[int], bool] = {"mistral": _every_layer, "mixtral": _every_layer,
                                   "qwen2": _qwen2_windows(c), "qwen2_moe": _qwen2_windows(c),
                                   "qwen3": _qwen2_windows(c), "qwen3_moe": _qwen2_windows(c)
                                   }.get(mt, _none)
    # Qwen2's q/k/v always have a bias; others say so by `attention_bias`
    arch = " ".join(c.get("architectures") or [mt]).lower()
    h, layers, att = _gqa(c, bias_default="qwen2" in arch, window_rule=rule)
    # Llama's and Qwen3's o_proj follow attention_bias; Qwen2's and Mistral's have none
    att = dataclasses.replace(att, out_bias=att.bias and mt in ("llama", "qwen3", "qwen3_moe"))
    mlp = Mlp(c.get_int("intermediate_size"), bias=bool(c.get("mlp_bias", False)),
              activation=str(c.get("hidden_act", "silu")))
    family = mt if mt in FAMILIES else "llama"
    return _common(c, family, hidden_size=h, num_layers=layers, attention=att, mlp=mlp,
                   moe=_llama_experts(c), decoder_sparse_step=c.get_int("decoder_sparse_step", 1),
                   mlp_only_layers=tuple(int(v) for v in c.get("mlp_only_layers", ())))


# transformers/models/phi3/modeling_phi3.py
def _read_phi3(c: _Config) -> Architecture:
    """Phi-3: a Llama layer with HF's own fused qkv_proj and gate_up_proj."""
    h, layers, att = _gqa(c, window_rule=_every_layer)
    mlp = Mlp(c.get_int("intermediate_size"), activation=str(c.get("hidden_act", "silu")))
    return _common(c, "phi3", hidden_size=h, num_layers=layers, attention=att, mlp=mlp)


# transformers/models/gemma2/modeling_gemma2.py, gemma3/modeling_gemma3.py
def _read_gemma(c: _Config) -> Architecture:
    """Gemma 2 / 3 text: head_dim 256, four norms, GeGLU, sqrt(H)-scaled embeddings, sliding
    windows on alternate layers (Gemma 3: five of every six), softcapping (Gemma 2)."""
    gemma2 = c.model_type == "gemma2"
    pattern = int(c.get("sliding_window_pattern", c.get("_sliding_window_pattern", 6)))
    rule = _even_layers if gemma2 else (lambda i: (i + 1) % pattern != 0)
    h, layers, att = _gqa(c, window_rule=rule)
    qpas = c.get("query_pre_attn_scalar")
    att = dataclasses.replace(att, out_bias=att.bias, softcap=c.get("attn_logit_softcapping"),
                              scale=float(qpas) ** -0.5 if qpas else None)
    mlp = Mlp(c.get_int("intermediate_size"),
              activation=str(c.get("hidden_activation", c.get("hidden_act", "gelu_pytorch_tanh"))))
    return _common(c, "gemma2" if gemma2 else "gemma3_text", hidden_size=h, num_layers=layers,
                   attention=att, mlp=mlp, placement="sandwich", embedding_scale=math.sqrt(h),
                   final_softcap=c.get("final_logit_softcapping"),
                   tie_word_embeddings=bool(c.get("tie_word_embeddings", True)))


# transformers/models/gpt2/modeling_gpt2.py
def _read_gpt2(c: _Config) -> Architecture:
    """GPT-2: Conv1D c_attn (fused qkv) / c_proj / c_fc / c_proj with biases, LayerNorm,
    gelu_new, learned positions, an ungated MLP of n_inner (None: 4·n_embd)."""
    h, n, layers = c.get_int("n_embd"), c.get_int("n_head"), c.get_int("n_layer")
    att = Attention(n, n, h // n, h // n, bias=True, out_bias=True, windows=c.windows(layers, _none))
    mlp = Mlp(c.get_int("n_inner", 4 * h), gated=False, bias=True,
              activation=str(c.get("activation_function", "gelu_new")))
    return _common(c, "gpt2", hidden_size=h, num_layers=layers, attention=att, mlp=mlp,
                   norm="layernorm", norm_eps=float(c.get("layer_norm_epsilon", 1e-5)),
                   position="learned", max_positions=c.get_int("n_positions", 1024),
                   tie_word_embeddings=bool(c.get("tie_word_embeddings", True)))


# transformers/models/gpt_neox/modeling_gpt_neox.py
def _read_gpt_neox(c: _Config) -> Architecture:
    """GPT-NeoX / Pythia: fused query_key_value, dense_h_to_4h / dense_4h_to_h with biases,
    LayerNorm, GELU, partial RoPE (rotary_pct), attention and MLP in parallel."""
    h, layers, att = _gqa(c, bias_default=True)
    att = dataclasses.replace(att, num_kv_heads=att.num_heads, out_bias=att.bias)
    mlp = Mlp(c.get_int("intermediate_size"), gated=False, bias=True,
              activation=str(c.get("hidden_act", "gelu")))
    parallel = bool(c.get("use_parallel_residual", True))
    return _common(c, "gpt_neox", hidden_size=h, num_layers=layers, attention=att, mlp=mlp,
                   norm="layernorm", norm_eps=float(c.get("layer_norm_eps", 1e-5)),
                   placement="parallel" if parallel else "pre")


# transformers/models/deepseek_v2/modeling_deepseek_v2.py, deepseek_v3/modeling_deepseek_v3.py
def _read_deepseek(c: _Config) -> Architecture:
    """DeepSeek-V2 / V3: multi-head latent attention (the saved `head_dim` is the RoPE part,
    not the head size), routed experts plus n_shared_experts as one MLP, the first
    first_k_dense_replace layers dense (then every moe_layer_freq-th sparse)."""
    h, nq, layers = c.get_int("hidden_size"), c.get_int("num_attention_heads"), c.get_int("num_hidden_layers")
    rope = c.get_int("qk_rope_head_dim")
    q_lora = c.get("q_lora_rank")
    att = Attention(nq, nq, c.get_int("qk_nope_head_dim") + rope, c.get_int("v_head_dim"),
                    bias=bool(c.get("attention_bias", False)),
                    out_bias=bool(c.get("attention_bias", False)), rope_dim=rope,
                    q_lora_rank=int(q_lora) if q_lora is not None else None,
                    kv_lora_rank=c.get_int("kv_lora_rank"), windows=(None,) * layers)
    moe = None
    if c.get("n_routed_experts"):
        shared = c.get_int("n_shared_experts", 0) * c.get_int("moe_intermediate_size")
        moe = Moe(c.experts("n_routed_experts", "moe_intermediate_size", shared,
                            norm_default=c.model_type == "deepseek_v3"))
    return _common(c, c.model_type, hidden_size=h, num_layers=layers, attention=att,
                   mlp=Mlp(c.get_int("intermediate_size")), moe=moe,
                   decoder_sparse_step=c.get_int("moe_layer_freq", 1), sparse_phase=0,
                   mlp_only_layers=tuple(range(c.get_int("first_k_dense_replace", 0))))


# transformers/models/gpt_oss/modeling_gpt_oss.py
def _read_gpt_oss(c: _Config) -> Architecture:
    """gpt-oss: GQA with biases and sinks, alternating sliding (128) / full layers, every layer
    sparse (router with bias, experts [E, H, 2I] with biases, clamped SwiGLU, MXFP4)."""
    h, layers, att = _gqa(c, bias_default=True, window_rule=_even_layers)
    att = dataclasses.replace(att, out_bias=att.bias, sinks=True)
    count = "num_local_experts" if c.get("num_local_experts") else "num_experts"
    moe = Moe(c.experts(count, "intermediate_size"), activation="swiglu_clamped",
              swiglu_limit=float(c.get("swiglu_limit", 7.0)), router_bias=True, expert_bias=True)
    return _common(c, "gpt_oss", hidden_size=h, num_layers=layers, attention=att, mlp=None, moe=moe)


# ----------------------------------------------------------------------------- the registry
_LLAMA_FIELDS = ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers")
@dataclass(frozen=True)
class Family:
    """How to read one model type's config.json and where its sub-operations live in a HF layer.

    modules: role -> HF module path inside a layer (`experts`: the stacked experts' module);
    transposed: the GEMMs HF stores [K, N]; classes: its HF `architectures` class names;
    required: the config fields it cannot do without; text_config: a multimodal config whose
    `text_config` is the decoder (Gemma 3)."""

    read: Callable[[_Config], Architecture]
    modules: dict[str, str]
    transposed: frozenset[str] = frozenset()
    classes: tuple[str, ...] = ()
    required: tuple[str, ...] = _LLAMA_FIELDS
    text_config: bool = False


_ATTN = {"input_norm": "input_layernorm", "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
         "v_proj": "self_attn.v_proj", "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
         "attention": "self_attn", "o_proj": "self_attn.o_proj",
         "post_attention_norm": "post_attention_layernorm"}
_MLP = {"gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "act": "mlp.act_fn",
        "down_proj": "mlp.down_proj"}
_MOE = {"router": "mlp.gate", "experts": "mlp.experts",
        "shared_gate_proj": "mlp.shared_expert.gate_proj", "shared_up_proj": "mlp.shared_expert.up_proj",
        "shared_down_proj": "mlp.shared_expert.down_proj", "shared_expert_gate": "mlp.shared_expert_gate"}
LLAMA = {**_ATTN, **_MLP, **_MOE}
PHI3 = {**{k: v for k, v in _ATTN.items() if k not in ("q_proj", "k_proj", "v_proj")},
        "qkv_proj": "self_attn.qkv_proj", "gate_up_proj": "mlp.gate_up_proj",
        "act": "mlp.activation_fn", "down_proj": "mlp.down_proj"}
GEMMA = {**_ATTN, **_MLP, "pre_feedforward_norm": "pre_feedforward_layernorm",
         "post_feedforward_norm": "post_feedforward_layernorm"}
GPT2 = {"input_norm": "ln_1", "qkv_proj": "attn.c_attn", "attention": "attn", "o_proj": "attn.c_proj",
        "post_attention_norm": "ln_2", "up_proj": "mlp.c_fc", "act": "mlp.act", "down_proj": "mlp.c_proj"}
GPT_NEOX = {"input_norm": "input_layernorm", "qkv_proj": "attention.query_key_value",
            "attention": "attention", "o_proj": "attention.dense",
            "post_attention_norm": "post_attention_layernorm", "up_proj": "mlp.dense_h_to_4h",
            "act": "mlp.act", "down_proj": "mlp.dense_4h_to_h"}
DEEPSEEK = {**_ATTN, **_MLP, **{k: v for k, v in _MOE.items() if k.startswith(("router", "experts"))},
            "q_a_proj": "self_attn.q_a_proj", "q_a_layernorm": "self_attn.q_a_layernorm",
            "q_b_proj": "self_attn.q_b_proj", "kv_a_proj_with_mqa": "self_attn.kv_a_proj_with_mqa",
            "kv_a_layernorm": "self_attn.kv_a_layernorm", "kv_b_proj": "self_attn.kv_b_proj",
            "shared_gate_proj": "mlp.shared_experts.gate_proj",
            "shared_up_proj": "mlp.shared_experts.up_proj",
            "shared_down_proj": "mlp.shared_experts.down_proj"}
GPT_OSS = {**_ATTN, "router": "mlp.router", "experts": "mlp.experts"}
_MLA_FIELDS = (*_LLAMA_FIELDS, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")

FAMILIES: dict[str, Family] = {
    "llama": Family(_read_llama, LLAMA, classes=("LlamaForCausalLM",)),
    "mistral": Family(_read_llama, LLAMA, classes=("MistralForCausalLM",)),
    "qwen2": Family(_read_llama, LLAMA, classes=("Qwen2ForCausalLM",)),
    "qwen3": Family(_read_llama, LLAMA, classes=("Qwen3ForCausalLM",)),
    "qwen2_moe": Family(_read_llama, LLAMA, classes=("Qwen2MoeForCausalLM",)),
    "qwen3_moe": Family(_read_llama, LLAMA, classes=("Qwen3MoeForCausalLM",)),
    "mixtral": Family(_read_llama, LLAMA, classes=("MixtralForCausalLM",)),
    "gemma2": Family(_read_gemma, GEMMA, classes=("Gemma2ForCausalLM",)),
    "gemma3": Family(_read_gemma, GEMMA, classes=("Gemma3ForConditionalGeneration",),
                     text_config=True),
    "gemma3_text": Family(_read_gemma, GEMMA, classes=("Gemma3ForCausalLM",)),
    "phi3": Family(_read_phi3, PHI3, classes=("Phi3ForCausalLM",)),
    "gpt2": Family(_read_gpt2, GPT2, frozenset({"qkv_proj", "o_proj", "up_proj", "down_proj"}),
                   classes=("GPT2LMHeadModel",), required=("n_embd", "n_head", "n_layer")),
    "gpt_neox": Family(_read_gpt_neox, GPT_NEOX, classes=("GPTNeoXForCausalLM",)),
    "deepseek_v2": Family(_read_deepseek, DEEPSEEK, classes=("DeepseekV2ForCausalLM",),
                          required=_MLA_FIELDS),
    "deepseek_v3": Family(_read_deepseek, DEEPSEEK, classes=("DeepseekV3ForCausalLM",),
                          required=_MLA_FIELDS),
    "gpt_oss": Family(_read_gpt_oss, GPT_OSS, frozenset({"experts_gate_up", "experts_down"}),
                      classes=("GptOssForCausalLM",)),
}
_BY_CLASS = {cls: mt for mt, f in FAMILIES.items() for cls in f.classes}
# Model types that are no decoder-only LM (encoders, encoder-decoders, vision and speech
# models): never read as the fallback family, whatever fields their config shares with it.
NOT_DECODERS = frozenset({
    "bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2",
    "mpnet", "modernbert", "camembert", "ernie", "t5", "mt5", "umt5", "bart", "mbart", "pegasus",
    "marian", "whisper", "wav2vec2", "hubert", "vit", "clip", "siglip", "dinov2", "swin", "convnext",
    "resnet"})


def _supported() -> str:
    return f"supported: {', '.join(FAMILIES)}"


def model_type(cfg: dict) -> str:
    """The config's `model_type`, else the one its `architectures` class names, else ""."""
    mt = cfg.get("model_type")
    if mt:
        return str(mt)
    return next((_BY_CLASS[a] for a in cfg.get("architectures") or () if a in _BY_CLASS), "")


def from_hf_config(cfg: dict, source: str, fallback: str | None = None) -> Architecture:
    """The architecture of a HF config.json's contents (`source` names it in errors).

    The family is `model_type` (or, without one, the `architectures` class). With `fallback`
    (a family), a config naming neither, or an unknown model type whose config has the
    fallback's required fields, is read as the fallback's (models.py: the Llama-style reading
    the analyzer applied before families); any other unknown model type is an InputError."""
    if not isinstance(cfg, dict):
        raise InputError(f"{source}: expected a JSON object, got {type(cfg).__name__}")
    mt = model_type(cfg)
    if mt in NOT_DECODERS:
        raise InputError(f"{source}: model_type {mt!r} is not a decoder-only language model "
                         "(an encoder, encoder-decoder or vision/speech model): there is no "
                         f"decoder layer layout to name its kernels by ({_supported()})")
    family = FAMILIES.get(mt)
    if family is None and fallback is not None:
        fits = all(cfg.get(k) is not None for k in FAMILIES[fallback].required)
        family = FAMILIES[fallback] if fits or not mt else None
    if family is None:
        raise InputError(f"{source}: unknown model_type {mt!r} ({_supported()})")
    if family.text_config and isinstance(cfg.get("text_config"), dict):
        outer = ("_name_or_path", "torch_dtype", "quantization_config")
        cfg = {**cfg["text_config"], **{k: cfg[k] for k in outer if k in cfg}}
        mt = str(cfg.get("model_type") or mt)
    c = _Config(cfg, source, mt)
    c.need(*family.required)
    try:
        return family.read(c)
    except InputError as e:
        if str(e).startswith(source):
            raise
        raise InputError(f"{source}: bad value in config.json ({e})") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise InputError(f"{source}: bad value in config.json ({e})") from None
