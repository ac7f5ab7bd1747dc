"""Honest naming: position fills the gaps between anchors, never a GEMM's or an attention's name.

Design notes: docs/design.md ("trace_roofline/attribution/naming.py").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trace_roofline.attribution.anchor_regions import Gaps
from trace_roofline.attribution.gemm_names import SUB_LINEARS
from trace_roofline.attribution.naming import Names, first_match
from trace_roofline.model import operators
from trace_roofline.model.operators import Name, Stage


@dataclass(frozen=True)
class Context:
    """What `honest` needs of explain's work."""

    gaps: Gaps
    by_name: np.ndarray  # named by its op's own name (an engine's fused MoE ops)
    rope_table: np.ndarray  # the preamble's RoPE table ops (the inverse-frequency product)
    outer: np.ndarray  # a GEMM over K <= 1: an outer product (RoPE's table), no weight
    attn_core: np.ndarray  # per row, the first eager attention op of its region (past: none)


# pseudo-stages of anchors for `_explained`: a decoder layer's STAGES, every MoE GEMM between
# the MLP's input and output, the model-level ones outside; NONE_P / NONE_N: no anchor before /
# after in the sequence
_QKV, _ATTN, _O, _MLP_IN, _MLP_OUT = (
    float(s) for s in (Stage.QKV, Stage.ATTENTION, Stage.O_PROJ, Stage.MLP_IN, Stage.MLP_OUT))
_MOE_STAGE = 5.5
_NONE_P, _EMB, _HEAD, _NONE_N = -2.0, -1.0, 7.0, 8.0
# which next anchor each anchor's gap may end at (a later stage with no anchor stage between,
# the next layer after the MLP, the model's end, the next pass after the lm_head)
_NEXT: dict[float, set[float]] = {
    _NONE_P: {_QKV, _HEAD, _EMB}, _EMB: {_QKV, _HEAD}, _HEAD: {_QKV, _HEAD, _EMB, _NONE_N},
    _QKV: {_QKV, _ATTN}, _ATTN: {_ATTN, _O}, _O: {_MLP_IN, _MOE_STAGE},
    _MLP_IN: {_MLP_IN, _MLP_OUT, _MOE_STAGE},
    _MOE_STAGE: {_MOE_STAGE, _MLP_OUT, _QKV, _HEAD, _NONE_N},
    _MLP_OUT: {_QKV, _HEAD, _NONE_N, _MOE_STAGE},
}


def _stages(names: Names, missing: float) -> np.ndarray:
    """Per row, the pseudo-stage of its anchor name (`missing` for none, NaN for a name that is
    no decoder anchor, e.g. linear[K×N])."""
    moe = operators.MOE | set(SUB_LINEARS) | {"experts_gate", "experts_up"}
    table = {**{k: float(v) for k, v in operators.STAGES.items()},
             **dict.fromkeys(moe, _MOE_STAGE), Name.EMBEDDING: _EMB, Name.LM_HEAD: _HEAD, "": missing}
    return np.array([table.get(v, np.nan) for v in names.vocab], dtype=np.float64)[names.codes]


def _explained(ctx: Context) -> np.ndarray:
    """Per row, whether its gap between two anchors is one a decoder layout explains: the
    anchors follow each other in a layer's order with no anchor missing between (q/k/v ->
    attention -> o_proj -> gate/up or the router -> down -> the next layer's q/k/v), q/k/v ->
    o_proj only with an eager attention inside, o_proj -> the next layer only with an engine's
    fused MoE op inside, attention -> attention only within one call
    (no GEMM or norm between), and the model-level gaps (before the first layer, after the
    last, after the lm_head)."""
    sp, sn = _stages(ctx.gaps.before, _NONE_P), _stages(ctx.gaps.after, _NONE_N)
    ok = np.zeros(len(sp), dtype=bool)
    for a, nexts in _NEXT.items():
        ok |= (sp == a) & np.isin(sn, list(nexts))
    ok |= (sp == _QKV) & (sn == _O) & (ctx.attn_core < ctx.gaps.regions.past)
    # an engine's fused MoE op (named by its op name, no GEMM anchor) is the layer's MLP
    ok |= (sp == _O) & np.isin(sn, [_QKV, _HEAD, _NONE_N]) & ctx.gaps.regions.any(ctx.by_name)
    same_call = ~ctx.gaps.regions.any(ctx.gaps.flags["gemmop"] | ctx.gaps.flags["normcore"])
    return ok & ~((sp == _ATTN) & (sn == _ATTN) & ~same_call)


def honest(ctx: Context, name: Names, evidence: Names) -> tuple[Names, Names, Names]:
    """(name, evidence, reason) per row ("": no reason), after the honesty rules: a GEMM not
    matched by its shape keeps its `linear[K×N]` (else is unattributed), but for an eager
    attention's batched product (evidence `shape`: its geometry), the RoPE table's product and
    an outer product (K <= 1: no weight);
    a position name in a gap no layout explains is unattributed; a trace whose GEMMs all miss
    the decoder's linears has no decoder names (`other` everywhere but the embedding)."""
    n = len(name.codes)
    every = np.ones(n, dtype=bool)
    if ctx.gaps.generic.any() and not ctx.gaps.known.any():  # GEMMs with shapes, none a decoder's
        # a GEMM loop keeps its linear[K×N] names, elsewhere `other` becomes the op's own name
        # (attribute.py)
        emb, generic = ctx.gaps.flags["emb"], ctx.gaps.generic
        return (first_match([(generic & generic.all(), ctx.gaps.gemms), (emb, Name.EMBEDDING)],
                            Name.OTHER),
                first_match([(emb, "kernel_name")], "position"),
                Names(np.zeros(n, dtype=np.int64), np.asarray([
                    "no decoder layout: no GEMM of the trace fits a decoder's linears (an "
                    "encoder, a CNN, a recommendation model?)"], dtype=object)))
    positional = evidence.isin(["position"])
    gemm = ctx.gaps.flags["gemmop"] & ~(ctx.gaps.is_anchor & ctx.gaps.known) & ~ctx.by_name & ~ctx.outer
    # an eager attention's batched products (ops, or Inductor kernels that fused them)
    eager = (gemm | ctx.gaps.flags["triton"]) & ctx.gaps.flags["batched"] & name.isin([Name.ATTENTION])
    table = gemm & ctx.rope_table & name.isin([Name.ROPE])
    lost = gemm & ~eager & ~table
    # (`other` claims nothing: it stays, with the gap as its reason)
    unexplained = positional & ~gemm & ~_explained(ctx) & ~name.isin([Name.UNATTRIBUTED])
    nm = first_match([(lost & ctx.gaps.generic, ctx.gaps.gemms), (lost, Name.UNATTRIBUTED),
                      (unexplained & ~name.isin([Name.OTHER]), Name.UNATTRIBUTED), (every, name)], "")
    ev = first_match([(eager, "shape"), (every, evidence)], "")
    rule = positional & nm.isin([Name.UNATTRIBUTED]) & ~unexplained & ~lost
    said = unexplained | rule  # the rows whose reason names their neighbours
    why = first_match([
        (lost & ctx.gaps.generic, "a GEMM whose (K, N) is no linear of the layout"),
        (lost, "a GEMM kernel with no shape to match: never named by its place"),
        (said, _gap_reasons(ctx, said, unexplained)),
        (nm.isin([Name.OTHER]), "model work outside the operator vocabulary")], "")
    return nm, ev, why


def _gap_reasons(ctx: Context, said: np.ndarray, unexplained: np.ndarray) -> Names:
    """Per row, "between P and N: why", worked out once per distinct (P, N, why) of the `said`
    rows ("" elsewhere)."""
    rows = np.flatnonzero(said)
    codes = np.zeros(len(said), dtype=np.int64)
    if not len(rows):
        return Names(codes, np.asarray([""], dtype=object))
    before, after = ctx.gaps.before, ctx.gaps.after
    key = (before.codes[rows] * (len(after.vocab) + 1) + after.codes[rows]) * 2 + unexplained[rows]
    _, first, which = np.unique(key, return_index=True, return_inverse=True)
    at = rows[first]
    pn, nn = (np.where(v == "", empty, v).astype(object) for v, empty in (
        (before.vocab[before.codes[at]], "the start"), (after.vocab[after.codes[at]], "the end")))
    tail = np.where(unexplained[at], ": no layout explains this gap", ": no attention in reach")
    codes[rows] = 1 + which
    return Names(codes, np.asarray(["", *("between " + pn + " and " + nn + tail)], dtype=object))
