"""The cost-rule registry: which rule costs a cpu op (`rule_for`), by its operator's rule, its
name's prefix (torch.compile's Triton kernels, an optimizer's `_foreach_*`), the aten table
below, or an engine's own table (engines.ENGINE_RULES).

Design notes: docs/design.md ("trace_roofline/costs/").
"""

from __future__ import annotations

from collections.abc import Iterable

from trace_roofline.costs import attention, copies, engines, fused, gemm, moe, pointwise, training
from trace_roofline.costs.call import Rule, plain
from trace_roofline.model import operators
from trace_roofline.model.operators import Name

# aten ops by base name (an in-place `op_` also finds `op`'s rule), as (names, rule) pairs.
_ATEN_RULES: tuple[tuple[Iterable[str], Rule], ...] = (
    (("mm", "addmm", "_addmm_activation", "linear", "bmm", "baddbmm"), gemm.gemm),
    (("matmul",), gemm.matmul),
    (("_scaled_mm",), gemm.scaled_mm),
    (copies.VIEWS, copies.view),
    (("copy_", "fill_", "zero_", *copies.COPIES), copies.copy),
    (("cat", "stack", "concat"), copies.cat),
    (("index_copy", "index_put", "index_add", "_index_put_impl", "scatter"), copies.index_write),
    # (aten::embedding: the embedding operator's op)
    ((Name.EMBEDDING, "index_select", "gather"), copies.gather),
    (("arange",), copies.arange),
    (("_local_scalar_dense",), copies.scalar_read),
    (("_grouped_mm",), moe.grouped_mm),
    (("topk",), pointwise.topk),
    (("sort", "argsort"), pointwise.sort),
    (("cumsum",), pointwise.scan),
    (("histc",), pointwise.histc),
    (("nonzero",), pointwise.nonzero),
    (pointwise.NORMS, pointwise.norm),
    (pointwise.SOFTMAX, pointwise.softmax),
    (pointwise.REDUCTIONS, pointwise.reduction),
    (pointwise.POINTWISE_FLOPS, pointwise.elementwise),
    (training.BACKWARD_FLOPS, training.backward_pointwise),
    (("_fused_adam", "_fused_adamw"), training.fused_adam),
    (("nll_loss_forward", "nll_loss_backward"), training.nll_loss),
    (("embedding_dense_backward",), training.embedding_backward),
)
# Rules an operator of the vocabulary names for every op it recognises (operators.cost_rule).
_OPERATOR_RULES: dict[str | None, Rule] = {
    operators.ATTENTION.cost: attention.attention,
    operators.BY_NAME[Name.ROUTER].cost: moe.topk_softmax,
    operators.BY_NAME[Name.MOE_DISPATCH].cost: moe.moe_align,
    operators.FUSED_EXPERTS.cost: moe.fused_experts,
    operators.BY_NAME[Name.MOE_COMBINE].cost: moe.moe_sum,
}


def _index(pairs: tuple[tuple[Iterable[str], Rule], ...]) -> dict[str, Rule]:
    out: dict[str, Rule] = {}
    for names, rule in pairs:
        for name in names:
            if name in out:
                raise ValueError(f"cost rule for {name!r} registered twice")
            out[name] = rule
    return out


ATEN_RULES = _index(_ATEN_RULES)


def rule_for(op_name: str) -> Rule | None:
    """The cost rule of a cpu op, first that applies: its operator's (every attention op),
    torch.compile's Triton kernels' (`triton_*`), an aten op's by base name, an engine's
    own op's by base name (`engines.ENGINE_RULES`), else None."""
    by_operator = operators.cost_rule(op_name)
    if by_operator is not None:
        return _OPERATOR_RULES[by_operator]
    base = op_name.removeprefix("aten::")
    if base.startswith("triton_"):
        return fused.triton_kernel
    if base.startswith("_foreach_"):
        return training.foreach
    if not op_name.startswith("aten::"):
        return (engines.ENGINE_RULES.get(op_name)
                or engines.ENGINE_RULES.get(op_name.rsplit("::", 1)[-1]))
    return ATEN_RULES.get(base) or ATEN_RULES.get(plain(base))
