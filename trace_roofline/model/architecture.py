"""A decoder's architecture (geometry, norm placement, precision) and its layers' sub-operations.

The families and the reading of a HF config.json: families.py, config_reader.py.
Design notes: docs/design.md ("trace_roofline/model/architecture.py").
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Final, Literal

from trace_roofline.errors import InputError
from trace_roofline.model import dtypes, operators
from trace_roofline.model.moe import Experts
from trace_roofline.model.operators import Name

NormKind = Literal["rmsnorm", "layernorm"]
Position = Literal["rope", "learned"]
ROTARY: Final = "rope"  # (the position kind, not the operator)
Parallel = Literal["column", "row", "replicated"]
QkScope = Literal["head", "projection"]
# Tensor parallelism (vLLM / Megatron): row-parallel GEMMs split K (operators.row_parallel),
# replicated ones are whole
_ROW = frozenset(o.name for o in operators.OPERATORS if o.row_parallel)
# the shared expert's sigmoid gate (Qwen-MoE): a GEMM of its own, its time the router's
SHARED_EXPERT_GATE = "shared_expert_gate"
_REPLICATED = frozenset({Name.ROUTER, SHARED_EXPERT_GATE, Name.Q_A_PROJ, Name.KV_A_PROJ_WITH_MQA})


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
    """A normalisation over `size` features (H, a head, a LoRA rank) at HF module `module`;
    `bias`: a LayerNorm with a bias (Cohere's has none)."""

    op: str
    module: str
    kind: NormKind
    size: int
    bias: bool = False

    def __post_init__(self) -> None:
        _check_op(self.op)

    def hf_params(self) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {f"{self.module}.weight": (self.size,)}
        if self.bias:
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


# ----------------------------------------------------------------------------- layout data
@dataclass(frozen=True)
class Layout:
    """Where a family's sub-operations live in a HF layer (plain values: a cache stores it).

    modules: (role, HF module path inside a layer) pairs, sorted; a role is an operator name
        (`experts`: the stacked experts' module), and one the family lacks is absent;
    transposed: the GEMMs HF stores [K, N] (GPT-2's Conv1D, gpt-oss experts), sorted;
    qk_norm: the q/k norms' scope: `head` (Qwen3, Gemma 3: one norm of head_dim shared by the
        heads) or `projection` (OLMo2, OLMoE: over the whole q projection nq·d, k over nkv·d)."""

    modules: tuple[tuple[str, str], ...]
    transposed: tuple[str, ...] = ()
    qk_norm: QkScope = "head"

    @classmethod
    def of(cls, modules: Mapping[str, str], transposed: tuple[str, ...] = (),
           qk_norm: QkScope = "head") -> Layout:
        """A layout from a role -> module table."""
        return cls(tuple(sorted(modules.items())), tuple(sorted(transposed)), qk_norm)

    @cached_property
    def module(self) -> dict[str, str]:
        """role -> HF module path."""
        return dict(self.modules)


# The blocks a placement orders besides norms (a norm is named by its operator)
ATTENTION, MLP, RESIDUAL = Name.ATTENTION, "mlp", Name.RESIDUAL


@dataclass(frozen=True)
class Placement:
    """A layer's blocks in the order HF runs them: `attention` (projections to o_proj), `mlp`
    (dense or sparse), `residual` (an add) and norms, each named by its operator (its module:
    Layout.modules); and the model's own norms: one over the embeddings before the first layer
    (BERT's `embeddings.LayerNorm`, BLOOM's `word_embeddings_layernorm`), one after the last."""

    name: str
    order: tuple[str, ...]
    embedding_norm: bool = False
    final_norm: bool = True

    def __post_init__(self) -> None:
        for block in self.order:
            if block not in (ATTENTION, MLP):
                _check_op(block)
        if self.order.count(ATTENTION) != 1 or self.order.count(MLP) != 1:
            raise ValueError(f"placement {self.name!r} needs one attention and one mlp block")


PRE = Placement("pre", (Name.INPUT_NORM, ATTENTION, RESIDUAL, Name.POST_ATTENTION_NORM, MLP, RESIDUAL))
# OLMo2 / OLMo3: no pre-norms; each block's output is normalised before its residual add
POST = Placement("post", (ATTENTION, Name.POST_ATTENTION_NORM, RESIDUAL, MLP,
                          Name.POST_FEEDFORWARD_NORM, RESIDUAL))
# Gemma 2 / 3, GLM-4: norms before and after attention and MLP
SANDWICH = Placement("sandwich", (Name.INPUT_NORM, ATTENTION, Name.POST_ATTENTION_NORM, RESIDUAL,
                                  Name.PRE_FEEDFORWARD_NORM, MLP, Name.POST_FEEDFORWARD_NORM, RESIDUAL))
# BERT and the encoder-decoders' decoders (BART): each block's residual sum normalised, the
# embeddings normalised, no final norm
POST_LN = Placement("post_ln", (ATTENTION, RESIDUAL, Name.POST_ATTENTION_NORM, MLP, RESIDUAL,
                                Name.POST_FEEDFORWARD_NORM), embedding_norm=True, final_norm=False)
# BLOOM, mBART, nanochat: a pre-norm layer, the embeddings normalised too
PRE_EMBEDDING_NORM = Placement("pre_embedding_norm", PRE.order, embedding_norm=True)
# GPT-NeoX: attention and MLP both read the layer input, each through its own norm
PARALLEL = Placement("parallel", (Name.INPUT_NORM, ATTENTION, Name.POST_ATTENTION_NORM, MLP, RESIDUAL))
# Cohere, Phi-2, StableLM's parallel form: one norm feeds attention and MLP
PARALLEL_ONE_NORM = Placement("parallel_one_norm", (Name.INPUT_NORM, ATTENTION, MLP, RESIDUAL))


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
    qk_norm: bool = False  # q and k normalised before RoPE (scope: Layout.qk_norm)
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
    None where the family has none (gpt-oss). `family` names the family, `layout` places its
    sub-operations in HF's modules, `placement` orders norms, attention, MLP and residual
    adds (PRE, POST, SANDWICH, PARALLEL, ...). `assumed`: what the config reader assumed
    (defaults taken, a model type read from its fields, a guessed norm), one short line each."""

    family: str
    name: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    attention: Attention
    mlp: Mlp | None
    layout: Layout = field(kw_only=True)
    moe: Moe | None = None
    decoder_sparse_step: int = 1
    sparse_phase: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    norm: NormKind = "rmsnorm"
    norm_bias: bool = True  # a LayerNorm's bias (Cohere's LayerNorm has none)
    norm_eps: float = 1e-6
    placement: Placement = PRE
    position: Position = ROTARY
    rope_theta: float = 10000.0
    max_positions: int = 0
    tie_word_embeddings: bool = False
    embedding_scale: float = 1.0  # Gemma multiplies the embeddings by sqrt(H)
    final_softcap: float | None = None  # Gemma 2's final logit softcapping
    precision: Precision = field(default_factory=Precision)
    assumed: tuple[str, ...] = ()

    def __post_init__(self) -> None:
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
        return Gemm(Name.LM_HEAD, "lm_head.weight", self.hidden_size, self.vocab_size,
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
        qkv = lin.get(Name.QKV_PROJ) or _fuse(
            Name.QKV_PROJ, [lin.get(n) for n in (Name.Q_PROJ, Name.K_PROJ, Name.V_PROJ)])
        gate_up = lin.get(Name.GATE_UP_PROJ) or _fuse(
            Name.GATE_UP_PROJ, [lin.get(Name.GATE_PROJ), lin.get(Name.UP_PROJ)])
        return tuple(g for g in (qkv, gate_up) if g is not None)

    def moe_linears(self) -> tuple[Gemm, ...]:
        """A sparse layer's GEMMs and their other forms: router; routed experts' gate_up (HF 5.x,
        vLLM), gate and up apart (HF 4.x's w1, w3), down; the shared expert's gate, up, fused
        gate_up and down; the shared expert's sigmoid gate. Empty for a dense model."""
        layer = self.sparse_layer
        if layer is None:
            return ()
        g = {x.name: x for x in layer.gemms()}
        gate_up = g[Name.EXPERTS_GATE_UP]
        half = dataclasses.replace(gate_up, n=gate_up.n // 2)
        out: list[Gemm | None] = [
            g[Name.ROUTER], gate_up,
            *(dataclasses.replace(half, name=part, op=Name.EXPERTS_GATE_UP)
              for part in dict(operators.FUSIONS)[Name.EXPERTS_GATE_UP]),
            g[Name.EXPERTS_DOWN]]
        if Name.SHARED_GATE_PROJ in g:
            fused = _fuse(Name.SHARED_GATE_UP_PROJ,
                          [g[Name.SHARED_GATE_PROJ], g[Name.SHARED_UP_PROJ]],
                          leaf=Name.GATE_UP_PROJ)
            out += [g[Name.SHARED_GATE_PROJ], g[Name.SHARED_UP_PROJ], fused,
                    g[Name.SHARED_DOWN_PROJ]]
        if SHARED_EXPERT_GATE in g:
            out.append(g[SHARED_EXPERT_GATE])
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
def dtype_bits(dtype: str) -> float:
    """Bits per element of a dtype name, scales included (mxfp4: 4.25; 0 for one the dtype
    table does not know)."""
    d = dtypes.lookup(dtype)
    return d.bits if d is not None else 0.0


def _parallel(name: str) -> Parallel:
    return "row" if name in _ROW else "replicated" if name in _REPLICATED else "column"


def _gemm(a: Architecture, name: str, k: int, n: int, bias: bool) -> Gemm:
    """A GEMM at the family's module for `name` (the router's, and the shared expert's gate
    whose time is the router's, at the activations' precision)."""
    op = Name.ROUTER if name == SHARED_EXPERT_GATE else name
    p = a.precision
    bits = dtype_bits(p.activations) if op == Name.ROUTER else p.weight_bits
    return Gemm(name, f"{a.layout.module[name]}.weight", k, n, bias, op=op,
                transposed=name in a.layout.transposed, weight_bits=bits,
                parallel=_parallel(name))


def _experts_gemm(a: Architecture, name: str, k: int, n: int, leaf: str) -> Gemm:
    """A GEMM of the routed experts: every expert's weight stacked in the experts' module's
    parameter `leaf` (HF 5.x names it after the dense MLP's projection: `gate_up_proj`)."""
    moe = a.moe
    assert moe is not None
    return Gemm(name, f"{a.layout.module['experts']}.{leaf}", k, n, moe.expert_bias,
                experts=moe.experts.num_experts, transposed=name in a.layout.transposed,
                weight_bits=a.precision.expert_bits, parallel=_parallel(name))


def _norm(a: Architecture, op: str, size: int, kind: NormKind | None = None) -> Norm:
    kind = kind or a.norm
    return Norm(op, a.layout.module[op], kind, size, kind == "layernorm" and a.norm_bias)


def _attention_ops(a: Architecture) -> tuple[SubOp, ...]:
    """Projections, q/k norms, RoPE, attention and o_proj."""
    at, h, fam = a.attention, a.hidden_size, a.layout
    nq, nkv, d, dv = at.num_heads, at.num_kv_heads, at.head_dim, at.v_head_dim
    ops: list[SubOp]
    if at.mla:
        ops = _mla_ops(a)
    elif Name.QKV_PROJ in fam.module:
        ops = [_gemm(a, Name.QKV_PROJ, h, (nq + 2 * nkv) * d, at.bias)]
    else:
        ops = [_gemm(a, Name.Q_PROJ, h, nq * d, at.bias), _gemm(a, Name.K_PROJ, h, nkv * d, at.bias),
               _gemm(a, Name.V_PROJ, h, nkv * d, at.bias)]
    if at.qk_norm:
        q, k = (nq * d, nkv * d) if fam.qk_norm == "projection" else (d, d)
        ops += [_norm(a, Name.Q_NORM, q), _norm(a, Name.K_NORM, k)]
    if at.rope_dim:
        ops.append(Step(Name.ROPE))
    sinks = ((f"{fam.module[Name.ATTENTION]}.sinks", (nq,)),) if at.sinks else ()
    ops += [Step(Name.ATTENTION, fam.module[Name.ATTENTION], sinks),
            _gemm(a, Name.O_PROJ, nq * dv, h, at.out_bias)]
    return tuple(ops)


def _mla_ops(a: Architecture) -> list[SubOp]:
    """DeepSeek's multi-head latent attention projections (q through a LoRA when q_lora_rank)."""
    at, h = a.attention, a.hidden_size
    q_n = at.num_heads * at.head_dim
    if at.q_lora_rank is None:
        ops: list[SubOp] = [_gemm(a, Name.Q_PROJ, h, q_n, False)]
    else:
        r = at.q_lora_rank
        ops = [_gemm(a, Name.Q_A_PROJ, h, r, at.bias), _norm(a, Name.Q_A_LAYERNORM, r, "rmsnorm"),
               _gemm(a, Name.Q_B_PROJ, r, q_n, False)]
    c = at.kv_lora_rank
    return ops + [_gemm(a, Name.KV_A_PROJ_WITH_MQA, h, c + at.rope_dim, at.bias),
                  _norm(a, Name.KV_A_LAYERNORM, c, "rmsnorm"),
                  _gemm(a, Name.KV_B_PROJ, c, at.num_heads * (at.nope_head_dim + at.v_head_dim),
                        False)]


def _mlp_ops(a: Architecture) -> tuple[SubOp, ...]:
    """The dense MLP: fused gate_up (Phi-3), gate and up, or an ungated up (GPT-2, GPT-NeoX)."""
    m, h = a.mlp, a.hidden_size
    assert m is not None
    i, b = m.intermediate_size, m.bias
    act, down = Step(Name.ACT, a.layout.module[Name.ACT]), _gemm(a, Name.DOWN_PROJ, i, h, b)
    if not m.gated:
        return _gemm(a, Name.UP_PROJ, h, i, b), act, down
    if Name.GATE_UP_PROJ in a.layout.module:
        return _gemm(a, Name.GATE_UP_PROJ, h, 2 * i, b), act, down
    return _gemm(a, Name.GATE_PROJ, h, i, b), _gemm(a, Name.UP_PROJ, h, i, b), act, down


def _moe_ops(a: Architecture) -> tuple[SubOp, ...]:
    """Router, routed experts (stacked: gate_up then down) and the shared expert(s)."""
    moe, h = a.moe, a.hidden_size
    assert moe is not None
    e, i = moe.experts, moe.experts.intermediate_size
    ops: list[SubOp] = [
        _gemm(a, Name.ROUTER, h, e.num_experts, moe.router_bias), Step(Name.MOE_DISPATCH),
        _experts_gemm(a, Name.EXPERTS_GATE_UP, h, 2 * i, Name.GATE_UP_PROJ), Step(Name.EXPERTS_ACT),
        _experts_gemm(a, Name.EXPERTS_DOWN, i, h, Name.DOWN_PROJ), Step(Name.MOE_COMBINE)]
    s = e.shared_intermediate_size
    if s:
        ops += [_gemm(a, Name.SHARED_GATE_PROJ, h, s, False),
                _gemm(a, Name.SHARED_UP_PROJ, h, s, False), Step(Name.ACT),
                _gemm(a, Name.SHARED_DOWN_PROJ, s, h, False)]
    if s and e.shared_gate:
        ops.append(_gemm(a, SHARED_EXPERT_GATE, h, 1, False))
    return tuple(ops)


def _layer_ops(a: Architecture, sparse: bool) -> tuple[SubOp, ...]:
    """A layer's sub-operations in HF's order, by the norm placement."""
    blocks: dict[str, tuple[SubOp, ...]] = {
        ATTENTION: _attention_ops(a), MLP: _moe_ops(a) if sparse else _mlp_ops(a),
        RESIDUAL: (Step(RESIDUAL),)}
    return tuple(op for b in a.placement.order
                 for op in blocks.get(b) or (_norm(a, b, a.hidden_size),))
