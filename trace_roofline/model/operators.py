"""The one operator vocabulary: every operator a kernel's time can be attributed to.

Design notes: docs/design.md ("trace_roofline/model/operators.py").
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Literal

import pandas as pd

Kind = Literal["compute", "memory", "communication", "unknown"]


class Stage(IntEnum):
    """The order of a Llama/Qwen decoder layer's operators."""

    INPUT_NORM = 0
    QKV = 1  # q/k/v projections (or the fused qkv)
    ATTENTION = 2
    O_PROJ = 3
    POST_ATTENTION_NORM = 4
    MLP_IN = 5  # gate/up projections (or the fused gate_up)
    MLP_OUT = 6  # down projection


class Name:
    """Every operator's name as a constant: code outside this module says `Name.Q_PROJ`, never
    the string (a backward's is `grad_of(Name.Q_PROJ)`)."""

    INPUT_NORM = "input_norm"
    Q_PROJ = "q_proj"
    K_PROJ = "k_proj"
    V_PROJ = "v_proj"
    QKV_PROJ = "qkv_proj"
    KV_PROJ = "kv_proj"
    Q_NORM = "q_norm"
    K_NORM = "k_norm"
    ROPE = "rope"
    KV_CACHE = "kv_cache"
    ATTENTION = "attention"
    O_PROJ = "o_proj"
    RESIDUAL = "residual"
    POST_ATTENTION_NORM = "post_attention_norm"
    GATE_PROJ = "gate_proj"
    UP_PROJ = "up_proj"
    GATE_UP_PROJ = "gate_up_proj"
    ACT = "act"
    DOWN_PROJ = "down_proj"
    SHARED_GATE_PROJ = "shared_gate_proj"
    SHARED_UP_PROJ = "shared_up_proj"
    SHARED_GATE_UP_PROJ = "shared_gate_up_proj"
    SHARED_DOWN_PROJ = "shared_down_proj"
    ROUTER = "router"
    MOE_DISPATCH = "moe_dispatch"
    EXPERTS_GATE_UP = "experts_gate_up"
    EXPERTS_ACT = "experts_act"
    EXPERTS_DOWN = "experts_down"
    MOE_COMBINE = "moe_combine"
    EMBEDDING = "embedding"
    EMBEDDING_NORM = "embedding_norm"
    FINAL_NORM = "final_norm"
    LM_HEAD = "lm_head"
    Q_A_PROJ = "q_a_proj"
    Q_B_PROJ = "q_b_proj"
    KV_A_PROJ_WITH_MQA = "kv_a_proj_with_mqa"
    KV_B_PROJ = "kv_b_proj"
    Q_A_LAYERNORM = "q_a_layernorm"
    KV_A_LAYERNORM = "kv_a_layernorm"
    PRE_FEEDFORWARD_NORM = "pre_feedforward_norm"
    POST_FEEDFORWARD_NORM = "post_feedforward_norm"
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    SEND_RECV = "send_recv"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    OTHER = "other"
    UNATTRIBUTED = "unattributed"
    SAMPLING = "sampling"
    LOSS = "loss"
    OPTIMIZER = "optimizer"
    BEFORE_WINDOW = "before_window"


@dataclass(frozen=True)
class Operator:
    """One operator of the vocabulary (see the module docstring for each field)."""

    name: str
    kind: Kind
    stage: Stage | None = None
    per_layer: bool = True
    linear: bool = False
    row_parallel: bool = False
    aliases: tuple[str, ...] = ()
    ops: re.Pattern[str] | None = None
    cost: str | None = None
    kernels: re.Pattern[str] | None = None
    bus_factor: Callable[[int], float] | None = None
    gathers: bool = False

    @property
    def collective(self) -> bool:
        return self.kind == "communication"


def _linear(name: str, stage: Stage | None, per_layer: bool = True,
            row_parallel: bool = False) -> Operator:
    return Operator(name, "compute", stage, per_layer, linear=True, row_parallel=row_parallel)


# In canonical order: a layer's operators as they run, then the model-level ones.
OPERATORS: tuple[Operator, ...] = (
    Operator(Name.INPUT_NORM, "memory", Stage.INPUT_NORM, aliases=("input_layernorm",)),
    _linear(Name.Q_PROJ, Stage.QKV),
    _linear(Name.K_PROJ, Stage.QKV),
    _linear(Name.V_PROJ, Stage.QKV),
    _linear(Name.QKV_PROJ, Stage.QKV),
    # k_proj and v_proj as one GEMM: no module's, Inductor's kernel of both weights (FUSIONS)
    _linear(Name.KV_PROJ, Stage.QKV),
    # RMSNorm of each head of q and of k, before RoPE (HF Qwen3 / Qwen3-MoE `q_norm`, `k_norm`;
    # LFM2's q_layernorm, k_layernorm): no stage, HF runs them between the projections
    Operator(Name.Q_NORM, "memory", aliases=("q_layernorm",)),
    Operator(Name.K_NORM, "memory", aliases=("k_layernorm",)),
    Operator(Name.ROPE, "memory", aliases=("rotary_emb",)),
    Operator(Name.KV_CACHE, "memory"),
    # flash-attention's C++ entry points as torch ops (vLLM's _vllm_fa3_C::fwd and
    # _vllm_fa2_C::varlen_fwd / fwd_kvcache, SGLang's sgl_kernel::fwd, flash_attn_3::fwd) are
    # recognised by their bare names, the only part of a name `recognise` sees
    Operator(Name.ATTENTION, "compute", Stage.ATTENTION, ops=re.compile(
        r"scaled_dot_product|flash_attn|flash_attention|efficient_attention|cudnn_attention|"
        r"paged_attention|flex_attention|unified_attention|^attention$|attention_forward|"
        r"^(?:fwd|varlen_fwd|fwd_kvcache)$"),
        cost=Name.ATTENTION),
    _linear(Name.O_PROJ, Stage.O_PROJ, row_parallel=True),
    Operator(Name.RESIDUAL, "memory"),
    Operator(Name.POST_ATTENTION_NORM, "memory", Stage.POST_ATTENTION_NORM,
             aliases=("post_attention_layernorm",)),
    _linear(Name.GATE_PROJ, Stage.MLP_IN),
    _linear(Name.UP_PROJ, Stage.MLP_IN),
    _linear(Name.GATE_UP_PROJ, Stage.MLP_IN),
    Operator(Name.ACT, "memory", aliases=("act_fn",)),
    _linear(Name.DOWN_PROJ, Stage.MLP_OUT, row_parallel=True),
    # mixture of experts (moe.py), in the order HF's Qwen2-MoE runs them; vLLM's custom ops
    # (topk_softmax, moe_align_block_size, fused_experts / moe_forward, moe_sum) by name
    _linear(Name.SHARED_GATE_PROJ, None),
    _linear(Name.SHARED_UP_PROJ, None),
    _linear(Name.SHARED_GATE_UP_PROJ, None),
    _linear(Name.SHARED_DOWN_PROJ, None, row_parallel=True),
    Operator(Name.ROUTER, "compute", linear=True, aliases=("gate",),
             ops=re.compile(r"^(?:topk_softmax|topk_sigmoid|fused_topk|grouped_topk)$"),
             cost="topk_softmax"),
    Operator(Name.MOE_DISPATCH, "memory",
             ops=re.compile(r"^(?:moe_align_block_size|sgl_moe_align_block_size)$"),
             cost="moe_align"),
    Operator(Name.EXPERTS_GATE_UP, "compute", linear=True,
             ops=re.compile(r"^(?:inplace_fused_experts|outplace_fused_experts|fused_experts|"
                            r"fused_moe|moe_forward)$"), cost="fused_experts"),
    Operator(Name.EXPERTS_ACT, "memory"),
    Operator(Name.EXPERTS_DOWN, "compute", linear=True, row_parallel=True),
    Operator(Name.MOE_COMBINE, "memory", ops=re.compile(r"^moe_sum$"), cost="moe_sum"),
    Operator(Name.EMBEDDING, "memory", per_layer=False, aliases=("embed_tokens",),
             ops=re.compile(r"^(?:embedding|embedding_bag|_embedding_bag)$")),
    # a norm over the embeddings before the first layer (BERT, BART, BLOOM)
    Operator(Name.EMBEDDING_NORM, "memory", per_layer=False,
             aliases=("layernorm_embedding", "word_embeddings_layernorm")),
    Operator(Name.FINAL_NORM, "memory", per_layer=False),
    _linear(Name.LM_HEAD, None, per_layer=False),
    # DeepSeek's multi-head latent attention (architecture.py): q through a LoRA (q_a_proj,
    # its RMSNorm, q_b_proj), the compressed KV and shared RoPE key (kv_a_proj_with_mqa), its
    # RMSNorm, the per-head k/v expansion (kv_b_proj)
    _linear(Name.Q_A_PROJ, None),
    _linear(Name.Q_B_PROJ, None),
    _linear(Name.KV_A_PROJ_WITH_MQA, None),
    _linear(Name.KV_B_PROJ, None),
    Operator(Name.Q_A_LAYERNORM, "memory"),
    Operator(Name.KV_A_LAYERNORM, "memory"),
    # Gemma's norms around the MLP (its post_attention_norm follows o_proj)
    Operator(Name.PRE_FEEDFORWARD_NORM, "memory", aliases=("pre_feedforward_layernorm",)),
    Operator(Name.POST_FEEDFORWARD_NORM, "memory", aliases=("post_feedforward_layernorm",)),
)

def _ring_all_reduce(t: int) -> float:
    return 2.0 * (t - 1) / t


def _ring(t: int) -> float:
    return (t - 1) / t


def _one(t: int) -> float:
    return 1.0


def _collective(name: str, ops: str, kernels: str | None, bus: Callable[[int], float],
                aliases: tuple[str, ...] = (), gathers: bool = False) -> Operator:
    """A collective: cpu op base names (c10d, _c10d_functional, vllm) and kernel names."""
    return Operator(name, "communication", aliases=aliases, ops=re.compile(ops),
                    kernels=re.compile(kernels) if kernels else None, bus_factor=bus,
                    gathers=gathers)


_NCCL = r"^nccl(?:Dev)?Kernel_"
COLLECTIVES: tuple[Operator, ...] = (
    _collective(Name.ALL_REDUCE,
                r"^(?:allreduce_|allreduce_coalesced_|all_reduce_?|all_reduce_coalesced_?|"
                r"inplace_all_reduce|outplace_all_reduce|custom_all_reduce)$",
                _NCCL + r"AllReduce|cross_device_reduce_[12]stage|(?:one|two)_shot_all_reduce",
                _ring_all_reduce, aliases=("allreduce",)),
    _collective(Name.ALL_GATHER,
                r"^(?:allgather_|_allgather_base_|allgather_coalesced_|"
                r"allgather_into_tensor_coalesced_|all_gather_into_tensor(?:_out|_coalesced)?|"
                r"all_gather)$",
                _NCCL + r"AllGather", _ring,
                aliases=("allgather", "all_gather_into_tensor"), gathers=True),
    _collective(Name.REDUCE_SCATTER,
                r"^(?:reduce_scatter_|_reduce_scatter_base_|reduce_scatter_tensor_coalesced_|"
                r"reduce_scatter_tensor(?:_coalesced)?|reduce_scatter)$",
                _NCCL + r"ReduceScatter", _ring, aliases=("reduce_scatter_tensor",)),
    # NCCL runs all-to-all as grouped sends and receives: only the op names it
    _collective(Name.ALL_TO_ALL, r"^(?:alltoall_|alltoall_base_|all_to_all_single|all_to_all)$",
                None, _ring, aliases=("alltoall", "all_to_all_single")),
    _collective(Name.SEND_RECV, r"^(?:send|recv_|recv_any_source_|batch_isend_irecv)$",
                _NCCL + r"(?:SendRecv|Send|Recv)(?:_|\(|$)", _one, aliases=("sendrecv",)),
    _collective(Name.BROADCAST, r"^(?:broadcast_|broadcast)$", _NCCL + r"Broadcast", _one),
    _collective(Name.REDUCE, r"^reduce_$", _NCCL + r"Reduce_", _one),
)

# What is left: model work outside the vocabulary (masks, position ids, sampling), and device
# time no evidence links to any op. Never named by a range or module, never in a layer.
OTHER = Operator(Name.OTHER, "unknown", per_layer=False)
UNATTRIBUTED = Operator(Name.UNATTRIBUTED, "unknown", per_layer=False)

# How a kernel's operator was named, strongest evidence first (attribute.py): a record_function
# range, an nn.Module frame, a GEMM's shape (and order) against the model's linears, the op's or
# kernel's own name, a CUDA graph's map, its position between those; `fallback`: a name outside
# this vocabulary given without evidence (`other`, `unattributed`, `linear[K×N]`, an op's name).
EVIDENCE = ("annotation", "module", "shape", "kernel_name", "graph_map", "position", "fallback")
FALLBACK = "fallback"

BY_NAME: dict[str, Operator] = {o.name: o for o in (*OPERATORS, *COLLECTIVES, OTHER,
                                                    UNATTRIBUTED)}
# names a range or module may carry
NAMES: tuple[str, ...] = tuple(o.name for o in (*OPERATORS, *COLLECTIVES))
ALIASES: dict[str, str] = {a: o.name for o in (*OPERATORS, *COLLECTIVES) for a in o.aliases}
COMMUNICATION: tuple[str, ...] = tuple(o.name for o in COLLECTIVES)
LINEARS: tuple[str, ...] = tuple(o.name for o in OPERATORS if o.linear)
STAGES: dict[str, int] = {o.name: int(o.stage) for o in OPERATORS if o.stage is not None}
MODEL_LEVEL: tuple[str, ...] = tuple(n for n, o in BY_NAME.items() if not o.per_layer)
ATTENTION = BY_NAME[Name.ATTENTION]
# attention ops that only dispatch to a backend's attention op and record the step's new tokens
# alone (the key lengths are in the engine's attention metadata): the ops inside one (the
# backend's flash-attention forward, a cache write) are instances of their own (attribute.py)
ATTENTION_DISPATCH: frozenset[str] = frozenset({"vllm::unified_attention",
                                                "vllm::unified_attention_with_output"})
EMBEDDING = BY_NAME[Name.EMBEDDING]
FUSED_EXPERTS = BY_NAME[Name.EXPERTS_GATE_UP]  # an engine's fused MoE op: both expert GEMMs
MOE: frozenset[str] = frozenset({Name.ROUTER, Name.MOE_DISPATCH, Name.EXPERTS_GATE_UP, Name.EXPERTS_ACT,
                                 Name.EXPERTS_DOWN, Name.MOE_COMBINE, Name.SHARED_GATE_PROJ,
                                 Name.SHARED_UP_PROJ, Name.SHARED_GATE_UP_PROJ, Name.SHARED_DOWN_PROJ})
# fused projections and the separate linears they cover (a trace holds one form or the other);
# the kernel-only ones are no module of any model, only an Inductor kernel multiplying the
# parts' weights at once: never the name of one weight's GEMM
FUSIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (Name.QKV_PROJ, (Name.Q_PROJ, Name.K_PROJ, Name.V_PROJ)),
    (Name.KV_PROJ, (Name.K_PROJ, Name.V_PROJ)),
    (Name.GATE_UP_PROJ, (Name.GATE_PROJ, Name.UP_PROJ)),
    (Name.EXPERTS_GATE_UP, ("experts_gate", "experts_up")),
    (Name.SHARED_GATE_UP_PROJ, (Name.SHARED_GATE_PROJ, Name.SHARED_UP_PROJ)))
KERNEL_FUSIONS: frozenset[str] = frozenset({Name.KV_PROJ})
# the dense MLP's operators and the shared expert's, which has the same structure
SHARED_OF: dict[str, str] = {Name.GATE_PROJ: Name.SHARED_GATE_PROJ,
                             Name.UP_PROJ: Name.SHARED_UP_PROJ,
                             Name.GATE_UP_PROJ: Name.SHARED_GATE_UP_PROJ,
                             Name.DOWN_PROJ: Name.SHARED_DOWN_PROJ}


def at_stage(stage: Stage) -> frozenset[str]:
    """The operators at one stage of a layer (Stage.QKV: q/k/v/qkv_proj)."""
    return frozenset(n for n, s in STAGES.items() if s == stage)


# torch.compile's Triton kernel ops: triton_{poi,red,per,tem}_fused_<aten ops>_<n>
TRITON_KERNEL_OP = re.compile(r"^triton_[a-z]+_fused")


def base_names(op_names: pd.Series) -> pd.Series:
    """'aten::addmm' -> 'addmm', 'flash_attn::_flash_attn_forward' -> '_flash_attn_forward'."""
    return op_names.astype("string").str.rsplit("::", n=1).str[-1]


def recognise(op: Operator, base: pd.Series) -> pd.Series:
    """Whether each op base name is `op` by name alone (False for triton_* kernel ops)."""
    if op.ops is None:
        return pd.Series(False, index=base.index)
    b = base.fillna("")
    return (b.str.contains(op.ops) & ~b.str.match(TRITON_KERNEL_OP)).astype(bool)


def cost_rule(op_name: str) -> str | None:
    """The cost rule of the operator that recognises a cpu op by name, if that operator has one
    (every attention op goes to the `attention` rule), else None."""
    base = op_name.rsplit("::", 1)[-1]
    if TRITON_KERNEL_OP.match(base):
        return None
    return next((o.cost for o in OPERATORS if o.ops is not None and o.cost is not None
                 and o.ops.search(base)), None)


def collective_of(op_base: pd.Series, kernel: bool = False) -> pd.Series:
    """The collective each cpu op base name (with `kernel`, each kernel name) is, else NA."""
    out = pd.Series(pd.NA, index=op_base.index, dtype="string")
    text = op_base.astype("string").fillna("")
    for op in COLLECTIVES:
        rx = op.kernels if kernel else op.ops
        if rx is not None:
            out = out.mask(out.isna() & text.str.contains(rx), op.name)
    return out


# ----------------------------------------------------------------------------------------------
# Model-level buckets and training steps (attribution/naming.py, attribute.py, passes.py),
# appended to the tables above
# ----------------------------------------------------------------------------------------------
# logits processing and sampling after the lm_head (softmax, top-k / top-p, penalties, argmax,
# multinomial); a training step's loss (log-softmax, NLL) and optimizer (AdamW's foreach or
# fused kernels, zero_grad); kernels launched before the profiled window (outside every pass)
SAMPLING = Operator(Name.SAMPLING, "memory", per_layer=False)
LOSS = Operator(Name.LOSS, "memory", per_layer=False)
OPTIMIZER = Operator(Name.OPTIMIZER, "memory", per_layer=False)
BEFORE_WINDOW = Operator(Name.BEFORE_WINDOW, "unknown", per_layer=False)
# a backward op is named after the forward operator it differentiates, `q_proj.grad` (its
# grad-input and grad-weight GEMMs): a name of its own, so that no forward row holds backward
# time; model-level (the autograd thread does not say the layer)
GRAD_SUFFIX = ".grad"
GRADS: tuple[Operator, ...] = tuple(Operator(o.name + GRAD_SUFFIX, o.kind, per_layer=False)
                                    for o in OPERATORS)
_APPENDED = (SAMPLING, LOSS, OPTIMIZER, *GRADS)
BY_NAME.update({o.name: o for o in (*_APPENDED, BEFORE_WINDOW)})
NAMES = (*NAMES, *(o.name for o in _APPENDED))
MODEL_LEVEL = tuple(n for n, o in BY_NAME.items() if not o.per_layer)


def grad_of(name: str) -> str:
    """The backward operator of a forward one: 'q_proj' -> 'q_proj.grad'."""
    return name + GRAD_SUFFIX
