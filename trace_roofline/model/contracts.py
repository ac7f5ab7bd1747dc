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

# The kinds of work a row does, told by its op (or, without one, its kernel's role):
# weight_gemm: a GEMM with a weight (mm, addmm, linear); gemm_kernel: a GEMM kernel whose op
# does not say which kind; batched_gemm: a product of two activations (an eager attention's
# Q·Kᵀ, P·V) or over stacked experts; grouped_gemm: experts' grouped GEMMs or an engine's fused
# MoE op; generic: elementwise, copies, reductions, casts (any name may hold them).
WORK: tuple[str, ...] = ("weight_gemm", "gemm_kernel", "batched_gemm", "grouped_gemm",
                         "attention", "norm", "softmax", "loss", "collective", "conv", "generic")
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

# (operators, contract): every name of the vocabulary appears once (tests/test_contracts.py)
_TABLE: tuple[tuple[tuple[str, ...], Contract], ...] = (
    (("q_proj", "k_proj", "v_proj", "qkv_proj", "kv_proj", "o_proj", "gate_proj", "up_proj",
      "gate_up_proj", "down_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"),
     _LINEAR),
    (("lm_head",), _c("weight_gemm gemm_kernel generic", "layout vocabulary decoder")),
    (("shared_gate_proj", "shared_up_proj", "shared_gate_up_proj", "shared_down_proj"),
     _c("weight_gemm gemm_kernel generic", "experts layout not_shared")),
    (("experts_gate_up", "experts_down"), _EXPERTS),
    (("router",), _c("weight_gemm gemm_kernel softmax generic", "experts")),
    (("moe_dispatch", "moe_combine", "experts_act"), _MOE_GLUE),
    (("attention",), _c("attention batched_gemm gemm_kernel softmax generic")),
    (("input_norm", "post_attention_norm", "pre_feedforward_norm", "post_feedforward_norm",
      "embedding_norm", "final_norm", "q_a_layernorm", "kv_a_layernorm"), _NORM),
    (("q_norm", "k_norm"), _c("norm generic", "qk_norm")),
    (("residual",), _NORM),  # (an engine's norm adds the residual itself)
    # (RoPE's table is an outer product: a GEMM kernel, in a graph replay with no op to say so)
    (("rope",), _c("gemm_kernel generic")),
    (("act", "embedding"), _c("generic")),
    (("kv_cache",), _c("generic", "decoder")),
    (("sampling",), _c("softmax generic", "decoder")),
    (("loss",), _c("softmax loss generic", "loss_op")),
    (("optimizer",), _c("generic")),
    (operators.COMMUNICATION, _c("collective generic")),
    # what claims nothing: no contract to break
    (("other", "unattributed", "before_window"), _ANY),
)
CONTRACTS: dict[str, Contract] = {name: c for names, c in _TABLE for name in names}


def contract(name: str) -> Contract | None:
    """The contract of an operator name; a backward name (`q_proj.grad`) and names outside the
    vocabulary (`linear[K×N]`, an op's own name) have none (nothing is checked)."""
    return CONTRACTS.get(name)
