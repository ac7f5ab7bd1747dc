"""What each operator name may hold: the kinds of work its kernels may do, and what it needs.

A name is a claim about the kernels under it. `CONTRACTS` says, for every operator of the
vocabulary, which kinds of work (`WORK`) back that claim and which preconditions the trace or
the model must meet; attribution/verify.py checks every named row against it last and demotes
a row that breaks its name's contract to `other`, with the reason. Design: docs/evidence.md
("Contracts").
"""

from __future__ import annotations

from dataclasses import dataclass

from trace_roofline.model import operators
from trace_roofline.model.operators import Name

# The kinds of work a row does, told by its op (or, without one, its kernel's role):
# weight_gemm: a GEMM with a weight (mm, addmm, linear); gemm_kernel: a GEMM kernel whose op
# does not say which kind; batched_gemm: a product of two activations (an eager attention's
# Q·Kᵀ, P·V) or over stacked experts; grouped_gemm: experts' grouped GEMMs or an engine's fused
# MoE op; generic: elementwise, copies, reductions, casts (any name may hold them).
# (attention's and a loss's own work is named after their operators)
WORK: tuple[str, ...] = ("weight_gemm", "gemm_kernel", "batched_gemm", "grouped_gemm",
                         Name.ATTENTION, "norm", "softmax", Name.LOSS, "collective", "conv",
                         "generic")
# Preconditions: `layout` (a linear's (K, N) is the layout's, when the model is known),
# `experts` (the model has routed experts), `qk_norm` (the model normalises q and k),
# `vocabulary` (N is the vocabulary: the model's, else an embedding table's in the trace),
# `loss_op` (the trace runs a loss: nll_loss, cross_entropy, ...), `not_shared` (no grouped
# GEMM: that is the routed experts'), `decoder` (the trace is a decoder's: never on an encoder)
NEEDS: tuple[str, ...] = ("layout", "experts", "qk_norm", "vocabulary", "loss_op", "not_shared",
                          "decoder")


@dataclass(frozen=True)
class Contract:
    """The work an operator's rows may do and the preconditions its name needs."""

    holds: frozenset[str]
    needs: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        assert self.holds <= set(WORK), self.holds - set(WORK)
        assert self.needs <= set(NEEDS), self.needs - set(NEEDS)


def _c(holds: str, needs: str = "") -> Contract:
    return Contract(frozenset(holds.split()), frozenset(needs.split()))


_LINEAR = _c("weight_gemm gemm_kernel generic", "layout")
_EXPERTS = _c("weight_gemm gemm_kernel batched_gemm grouped_gemm generic", "experts layout")
_MOE_GLUE = _c("batched_gemm softmax generic", "experts")
_NORM = _c("norm generic")
_ANY = Contract(frozenset(WORK))

# (operators, contract): every name of the vocabulary appears once (tests/model/test_contracts.py)
_TABLE: tuple[tuple[tuple[str, ...], Contract], ...] = (
    ((Name.Q_PROJ, Name.K_PROJ, Name.V_PROJ, Name.QKV_PROJ, Name.KV_PROJ, Name.O_PROJ,
      Name.GATE_PROJ, Name.UP_PROJ, Name.GATE_UP_PROJ, Name.DOWN_PROJ, Name.Q_A_PROJ,
      Name.Q_B_PROJ, Name.KV_A_PROJ_WITH_MQA, Name.KV_B_PROJ), _LINEAR),
    ((Name.LM_HEAD,), _c("weight_gemm gemm_kernel generic", "layout vocabulary decoder")),
    ((Name.SHARED_GATE_PROJ, Name.SHARED_UP_PROJ, Name.SHARED_GATE_UP_PROJ, Name.SHARED_DOWN_PROJ),
     _c("weight_gemm gemm_kernel generic", "experts layout not_shared")),
    ((Name.EXPERTS_GATE_UP, Name.EXPERTS_DOWN), _EXPERTS),
    ((Name.ROUTER,), _c("weight_gemm gemm_kernel softmax generic", "experts")),
    ((Name.MOE_DISPATCH, Name.MOE_COMBINE, Name.EXPERTS_ACT), _MOE_GLUE),
    ((Name.ATTENTION,), _c("attention batched_gemm gemm_kernel softmax generic")),
    ((Name.INPUT_NORM, Name.POST_ATTENTION_NORM, Name.PRE_FEEDFORWARD_NORM,
      Name.POST_FEEDFORWARD_NORM, Name.EMBEDDING_NORM, Name.FINAL_NORM, Name.Q_A_LAYERNORM,
      Name.KV_A_LAYERNORM), _NORM),
    ((Name.Q_NORM, Name.K_NORM), _c("norm generic", "qk_norm")),
    ((Name.RESIDUAL,), _NORM),  # (an engine's norm adds the residual itself)
    # (RoPE's table is an outer product: a GEMM kernel, in a graph replay with no op to say so)
    ((Name.ROPE,), _c("gemm_kernel generic")),
    ((Name.ACT, Name.EMBEDDING), _c("generic")),
    ((Name.KV_CACHE,), _c("generic", "decoder")),
    ((Name.SAMPLING,), _c("softmax generic", "decoder")),
    ((Name.LOSS,), _c("softmax loss generic", "loss_op")),
    ((Name.OPTIMIZER,), _c("generic")),
    (operators.COMMUNICATION, _c("collective generic")),
    # what claims nothing: no contract to break
    ((Name.OTHER, Name.UNATTRIBUTED, Name.BEFORE_WINDOW), _ANY),
)
CONTRACTS: dict[str, Contract] = {name: c for names, c in _TABLE for name in names}


def contract(name: str) -> Contract | None:
    """The contract of an operator name; a backward name (`q_proj.grad`) and names outside the
    vocabulary (`linear[K×N]`, an op's own name) have none (nothing is checked)."""
    return CONTRACTS.get(name)
