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
    Operator("input_norm", "memory", Stage.INPUT_NORM, aliases=("input_layernorm",)),
    _linear("q_proj", Stage.QKV),
    _linear("k_proj", Stage.QKV),
    _linear("v_proj", Stage.QKV),
    _linear("qkv_proj", Stage.QKV),
    # k_proj and v_proj as one GEMM: no module's, Inductor's kernel of both weights (FUSIONS)
    _linear("kv_proj", Stage.QKV),
    # RMSNorm of each head of q and of k, before RoPE (HF Qwen3 / Qwen3-MoE `q_norm`, `k_norm`;
    # LFM2's q_layernorm, k_layernorm): no stage, HF runs them between the projections
    Operator("q_norm", "memory", aliases=("q_layernorm",)),
    Operator("k_norm", "memory", aliases=("k_layernorm",)),
    Operator("rope", "memory", aliases=("rotary_emb",)),
    Operator("kv_cache", "memory"),
    # flash-attention's C++ entry points as torch ops (vLLM's _vllm_fa3_C::fwd and
    # _vllm_fa2_C::varlen_fwd / fwd_kvcache, SGLang's sgl_kernel::fwd, flash_attn_3::fwd) are
    # recognised by their bare names, the only part of a name `recognise` sees
    Operator("attention", "compute", Stage.ATTENTION, ops=re.compile(
        r"scaled_dot_product|flash_attn|flash_attention|efficient_attention|cudnn_attention|"
        r"paged_attention|flex_attention|unified_attention|^attention$|attention_forward|"
        r"^(?:fwd|varlen_fwd|fwd_kvcache)$"),
        cost="attention"),
    _linear("o_proj", Stage.O_PROJ, row_parallel=True),
    Operator("residual", "memory"),
    Operator("post_attention_norm", "memory", Stage.POST_ATTENTION_NORM,
             aliases=("post_attention_layernorm",)),
    _linear("gate_proj", Stage.MLP_IN),
    _linear("up_proj", Stage.MLP_IN),
    _linear("gate_up_proj", Stage.MLP_IN),
    Operator("act", "memory", aliases=("act_fn",)),
    _linear("down_proj", Stage.MLP_OUT, row_parallel=True),
    # mixture of experts (moe.py), in the order HF's Qwen2-MoE runs them; vLLM's custom ops
    # (topk_softmax, moe_align_block_size, fused_experts / moe_forward, moe_sum) by name
    _linear("shared_gate_proj", None),
    _linear("shared_up_proj", None),
    _linear("shared_gate_up_proj", None),
    _linear("shared_down_proj", None, row_parallel=True),
    Operator("router", "compute", linear=True, aliases=("gate",),
             ops=re.compile(r"^(?:topk_softmax|topk_sigmoid|fused_topk|grouped_topk)$"),
             cost="topk_softmax"),
    Operator("moe_dispatch", "memory",
             ops=re.compile(r"^(?:moe_align_block_size|sgl_moe_align_block_size)$"),
             cost="moe_align"),
    Operator("experts_gate_up", "compute", linear=True,
             ops=re.compile(r"^(?:inplace_fused_experts|outplace_fused_experts|fused_experts|"
                            r"fused_moe|moe_forward)$"), cost="fused_experts"),
    Operator("experts_act", "memory"),
    Operator("experts_down", "compute", linear=True, row_parallel=True),
    Operator("moe_combine", "memory", ops=re.compile(r"^moe_sum$"), cost="moe_sum"),
    Operator("embedding", "memory", per_layer=False, aliases=("embed_tokens",),
             ops=re.compile(r"^(?:embedding|embedding_bag|_embedding_bag)$")),
    # a norm over the embeddings before the first layer (BERT, BART, BLOOM)
    Operator("embedding_norm", "memory", per_layer=False,
             aliases=("layernorm_embedding", "word_embeddings_layernorm")),
    Operator("final_norm", "memory", per_layer=False),
    _linear("lm_head", None, per_layer=False),
    # DeepSeek's multi-head latent attention (architecture.py): q through a LoRA (q_a_proj,
    # its RMSNorm, q_b_proj), the compressed KV and shared RoPE key (kv_a_proj_with_mqa), its
    # RMSNorm, the per-head k/v expansion (kv_b_proj)
    _linear("q_a_proj", None),
    _linear("q_b_proj", None),
    _linear("kv_a_proj_with_mqa", None),
    _linear("kv_b_proj", None),
    Operator("q_a_layernorm", "memory"),
    Operator("kv_a_layernorm", "memory"),
    # Gemma's norms around the MLP (its post_attention_norm follows o_proj)
    Operator("pre_feedforward_norm", "memory", aliases=("pre_feedforward_layernorm",)),
    Operator("post_feedforward_norm", "memory", aliases=("post_feedforward_layernorm",)),
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
    _collective("all_reduce",
                r"^(?:allreduce_|allreduce_coalesced_|all_reduce_?|all_reduce_coalesced_?|"
                r"inplace_all_reduce|outplace_all_reduce|custom_all_reduce)$",
                _NCCL + r"AllReduce|cross_device_reduce_[12]stage|(?:one|two)_shot_all_reduce",
                _ring_all_reduce, aliases=("allreduce",)),
    _collective("all_gather",
                r"^(?:allgather_|_allgather_base_|allgather_coalesced_|"
                r"allgather_into_tensor_coalesced_|all_gather_into_tensor(?:_out|_coalesced)?|"
                r"all_gather)$",
                _NCCL + r"AllGather", _ring,
                aliases=("allgather", "all_gather_into_tensor"), gathers=True),
    _collective("reduce_scatter",
                r"^(?:reduce_scatter_|_reduce_scatter_base_|reduce_scatter_tensor_coalesced_|"
                r"reduce_scatter_tensor(?:_coalesced)?|reduce_scatter)$",
                _NCCL + r"ReduceScatter", _ring, aliases=("reduce_scatter_tensor",)),
    # NCCL runs all-to-all as grouped sends and receives: only the op names it
    _collective("all_to_all", r"^(?:alltoall_|alltoall_base_|all_to_all_single|all_to_all)$",
                None, _ring, aliases=("alltoall", "all_to_all_single")),
    _collective("send_recv", r"^(?:send|recv_|recv_any_source_|batch_isend_irecv)$",
                _NCCL + r"(?:SendRecv|Send|Recv)(?:_|\(|$)", _one, aliases=("sendrecv",)),
    _collective("broadcast", r"^(?:broadcast_|broadcast)$", _NCCL + r"Broadcast", _one),
    _collective("reduce", r"^reduce_$", _NCCL + r"Reduce_", _one),
)

# What is left: model work outside the vocabulary (masks, position ids, sampling), and device
# time no evidence links to any op. Never named by a range or module, never in a layer.
OTHER = Operator("other", "unknown", per_layer=False)
UNATTRIBUTED = Operator("unattributed", "unknown", per_layer=False)

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
ATTENTION = BY_NAME["attention"]
# attention ops that only dispatch to a backend's attention op and record the step's new tokens
# alone (the key lengths are in the engine's attention metadata): the ops inside one (the
# backend's flash-attention forward, a cache write) are instances of their own (attribute.py)
ATTENTION_DISPATCH: frozenset[str] = frozenset({"vllm::unified_attention",
                                                "vllm::unified_attention_with_output"})
EMBEDDING = BY_NAME["embedding"]
FUSED_EXPERTS = BY_NAME["experts_gate_up"]  # an engine's fused MoE op: both expert GEMMs
MOE: frozenset[str] = frozenset({"router", "moe_dispatch", "experts_gate_up", "experts_act",
                                 "experts_down", "moe_combine", "shared_gate_proj",
                                 "shared_up_proj", "shared_gate_up_proj", "shared_down_proj"})
# fused projections and the separate linears they cover (a trace holds one form or the other);
# the kernel-only ones are no module of any model, only an Inductor kernel multiplying the
# parts' weights at once: never the name of one weight's GEMM
FUSIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("kv_proj", ("k_proj", "v_proj")),
    ("gate_up_proj", ("gate_proj", "up_proj")),
    ("experts_gate_up", ("experts_gate", "experts_up")),
    ("shared_gate_up_proj", ("shared_gate_proj", "shared_up_proj")))
KERNEL_FUSIONS: frozenset[str] = frozenset({"kv_proj"})
# the dense MLP's operators and the shared expert's, which has the same structure
SHARED_OF: dict[str, str] = {"gate_proj": "shared_gate_proj", "up_proj": "shared_up_proj",
                             "gate_up_proj": "shared_gate_up_proj", "down_proj": "shared_down_proj"}


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
SAMPLING = Operator("sampling", "memory", per_layer=False)
LOSS = Operator("loss", "memory", per_layer=False)
OPTIMIZER = Operator("optimizer", "memory", per_layer=False)
BEFORE_WINDOW = Operator("before_window", "unknown", per_layer=False)
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
