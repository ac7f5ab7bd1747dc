"""Naming every op instance from its anchors (matched GEMMs, attention, embedding) and its place.

Design notes: docs/design.md ("trace_roofline/attribution/naming.py").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from trace_roofline.attribution.anchor_regions import Gaps, cut_at_anchors
from trace_roofline.attribution.gemm_names import MLP_IN, PROJ_IN, SUB_LINEARS
from trace_roofline.attribution.honest_names import Context, honest
from trace_roofline.attribution.naming import Names, Rule, first_match
from trace_roofline.model.architecture import ATTENTION, MLP, PRE, RESIDUAL, Placement
from trace_roofline.model.operators import Name

EXPERT_IN = {Name.EXPERTS_GATE_UP, "experts_gate", "experts_up"}
SHARED_IN = {Name.SHARED_GATE_PROJ, Name.SHARED_UP_PROJ, Name.SHARED_GATE_UP_PROJ}
# a MoE block's tail: an expert's down projection, the shared expert's, its sigmoid gate
_MOE_TAIL = [Name.EXPERTS_DOWN, Name.SHARED_DOWN_PROJ, "shared_expert_gate"]


@dataclass(frozen=True)
class _Marks:
    """Per row, places in its region the rules compare its own position with."""

    norm_start: np.ndarray  # the first norm op, or the cast right before it (past: none)
    before_norm: np.ndarray  # (a bool per row) before the norm: torch.compile fuses the
    # residual add into the norm kernel, so norm_start is that kernel
    rope0: np.ndarray  # the preamble's RoPE tables: from the GEMM or cast feeding cos/sin on
    attn_core: np.ndarray  # the first softmax / batched product (an eager attention)
    last_rope: np.ndarray  # the last RoPE op before attn_core (-1: none)
    unmatched: np.ndarray  # (a bool per row) a GEMM whose shape matches no linear


def _marks(inst: pd.DataFrame, g: Gaps) -> _Marks:
    """The places `_Marks` holds, per row."""
    regions, flags, pos = g.regions, g.flags, g.pos
    core = regions.first(flags["normcore"])
    norm_start = core - regions.any((pos == core - 1) & flags["cast"])
    # preamble RoPE tables (HF computes cos/sin once per forward): from the GEMM or cast
    # feeding the first cos/sin up to the norm
    cos_sin = regions.first(flags["cossin"])
    unmatched = (inst["K"].to_numpy() >= 0) & g.generic
    g_before = regions.last((flags["bgemm"] | unmatched) & (pos < cos_sin))
    rope0 = np.where(g_before >= 0, g_before, cos_sin)
    last_noncast = regions.last(~flags["cast"] & (pos < rope0))
    rope0 = np.where(cos_sin < regions.past, np.minimum(rope0, last_noncast + 1), regions.past)
    # between the projections and attention: RoPE, then KV-cache writes, then layout copies
    attn_core = regions.first(flags["softmax"] | flags["bgemm"] | flags["batched"])
    last_rope = regions.last(flags["ropecore"] & (pos < attn_core))
    return _Marks(norm_start, pos < norm_start, rope0, attn_core, last_rope, unmatched)


def position_names(inst: pd.DataFrame, gemm: pd.Series, qk_norm: bool | None = None
                   ) -> tuple[pd.Series, pd.Series]:
    """(operator, evidence) of `explain` (without the reasons)."""
    name, evidence, _ = explain(inst, gemm, qk_norm)
    return name, evidence


def explain(inst: pd.DataFrame, gemm: pd.Series, qk_norm: bool | None = None,
            placement: Placement | None = None) -> tuple[pd.Series, pd.Series, pd.Series]:
    """Name every instance from anchors and op names. Returns (operator, evidence, reason),
    categorical Series: `shape` for GEMMs matched to a linear (and an eager attention's batched
    Q·Kᵀ / P·V between the projections and o_proj: its geometry), `kernel_name` for ops or
    kernels recognised by their name or family (attention, embedding), `position` for the rest
    (attribute.py turns names outside the vocabulary, such as `other` and `linear[K×N]`, into
    `fallback`); `reason` says why a row is `unattributed`, `other` or `linear[K×N]` ("" where
    named). `gemm`: name_gemms(). `qk_norm`: whether the model normalises q and k per head
    (graphs.py's kernel-name naming, which has no shapes); None: the shapes say, per projection
    (`_qk_norms`). An instance's kernel `role` (kernels.py, a column of `inst` when given)
    counts like its op name: an attention kernel is an anchor, a fused add+RMSNorm a norm.

    Honesty (`honest_names.honest`): position only fills the gaps between anchored names, and
    never names a GEMM (only its shape does) or an attention (only its op, kernel family or
    eager geometry does). A trace with GEMMs none of which fits a decoder's linears has no
    decoder names at all."""
    g = cut_at_anchors(inst, gemm)
    m = _marks(inst, g)
    flags = g.flags
    p_in = g.before.isin(PROJ_IN)
    qk_name = _qk_norms(g, m, p_in & _per_head_norm(inst, g, qk_norm))
    rules: list[Rule] = [  # first match wins
        (g.is_anchor, g.anchors),  # a matched GEMM, attention, embedding
        *_fused_moe_rules(g),
        *_expert_rules(g, m, placement),
        *_router_rules(g, m),
        *_projection_rules(g, m, qk_name),
        *_layer_rules(g, m, placement),
    ]
    name = first_match(rules, Name.OTHER).renamed(SUB_LINEARS)
    in_fused = flags["fused_moe"]
    by_name = flags["fused_op"] | (in_fused & (flags["topk"] | flags["dispatch"]
                                               | (flags["acc"] & flags["rank3"])))  # MoE ops
    loss = g.before.isin([Name.LM_HEAD]) & flags["loss_op"]
    evidence = first_match([(g.is_anchor & g.known, "shape"),  # a GEMM matched to a linear
                            (g.is_anchor | flags["emb"] | by_name | loss,
                             "kernel_name")],  # op names
                           "position")
    k_dim = inst["K"].to_numpy() if "K" in inst else np.full(len(inst), -1)
    outer = ((k_dim >= 0) & (k_dim <= 1)) | (flags["last0"] == 1)  # (HF's RoPE table: K = 1)
    rope_table = (g.pos >= m.rope0) & _preamble(g)
    ctx = Context(g, by_name | loss, rope_table, outer, m.attn_core)
    return tuple(pd.Series(v.categorical(), index=inst.index)  # type: ignore[return-value]
                 for v in honest(ctx, name, evidence))


def _preamble(g: Gaps) -> np.ndarray:
    """Per row, whether it is before the first layer: at the start, after the embedding, or
    after the last pass's lm_head when the embedding is fused away (torch.compile) and no
    ProfilerStep separates the passes."""
    return g.before.isin(["", Name.EMBEDDING, Name.LM_HEAD]) & g.after.isin(PROJ_IN)


def _per_head_norm(inst: pd.DataFrame, g: Gaps, qk_norm: bool | None) -> np.ndarray:
    """Per row, whether its region holds a norm over a per-head view (its last dim below the
    projection's N), or what `qk_norm` says."""
    if qk_norm is not None:
        return np.full(len(inst), qk_norm)
    flags = g.flags
    region_n = g.regions.opening(inst["N"].to_numpy() if "N" in inst
                                 else np.full(len(inst), -1))
    return g.regions.any(flags["normopen"] & (flags["rank0"] >= 3) & (flags["last0"] > 0)
                         & (flags["last0"] < region_n))


def _fused_moe_rules(g: Gaps) -> list[Rule]:
    """An engine's fused MoE op and the ops inside it, by name."""
    flags = g.flags
    in_fused = flags["fused_moe"]
    return [
        (flags["fused_op"], Name.EXPERTS_GATE_UP),  # its fused_moe_kernel launches: attribute.py
        (in_fused & flags["topk"], Name.ROUTER),
        (in_fused & flags["dispatch"], Name.MOE_DISPATCH),
        (in_fused & flags["activation"], Name.EXPERTS_ACT),
        (in_fused & flags["acc"] & flags["rank3"], Name.MOE_COMBINE),  # moe_sum, a sum over top-k
        (in_fused, Name.ROUTER),  # casts and renormalisation of the routing weights
    ]


def _expert_rules(g: Gaps, m: _Marks, placement: Placement | None) -> list[Rule]:
    """After the router's logits GEMM (whose experts' GEMMs follow), between an expert's GEMMs
    and after a MoE block's tail (an expert's down projection, the shared expert's or its
    sigmoid gate)."""
    flags, pos, before = g.flags, g.pos, g.before
    p_router, n_expert = before.isin([Name.ROUTER]), g.after.isin(EXPERT_IN)
    p_tail = before.isin(_MOE_TAIL)
    n_start = g.after.isin(PROJ_IN)
    n_next = n_start | g.after.isin(["", Name.LM_HEAD])  # the next layer or the model's end
    last_add = g.regions.last(flags["add"] & m.before_norm)  # the residual add
    add_norm = g.regions.any(flags["addnorm"])  # ... unless the norm adds it
    return [
        # after the router's logits GEMM: softmax, top-k, renormalisation, then the dispatch
        (p_router & n_expert & (pos < g.regions.first(flags["dispatch"])), Name.ROUTER),
        (p_router & n_expert, Name.MOE_DISPATCH),
        (before.isin(EXPERT_IN) & flags["sync"], Name.MOE_DISPATCH),  # the loop's index reads
        (before.isin(EXPERT_IN), Name.EXPERTS_ACT),  # between an expert's gate_up and down
        # after an expert's down: in a loop the weighting and index_add_, then the next
        # expert's gather; after the last one the combine up to the residual add
        (p_tail & n_expert & (pos <= g.regions.last(flags["acc"])), Name.MOE_COMBINE),
        (p_tail & n_expert, Name.MOE_DISPATCH),
        (p_tail & flags["sigmoid"], Name.ROUTER),  # the shared expert's gate
        (p_tail & n_next & m.before_norm & (pos == last_add) & ~add_norm, Name.RESIDUAL),
        (p_tail & m.before_norm, Name.MOE_COMBINE),
        *_placed(g, placement, p_tail),
        (p_tail & n_start, Name.INPUT_NORM),
        (p_tail, Name.FINAL_NORM),
    ]


def _router_rules(g: Gaps, m: _Marks) -> list[Rule]:
    """After a router whose experts run inside an engine's fused op: before that op, its
    input's preparation (vLLM pads gpt-oss's hidden states), as a bare replay names it; after
    it, adding the shared expert's output, then the next layer's norm. After a router whose
    experts' GEMMs match no linear of the layout: the routing up to their dispatch, nothing
    from their first GEMM on."""
    flags, pos, regions = g.flags, g.pos, g.regions
    p_router, n_expert = g.before.isin([Name.ROUTER]), g.after.isin(EXPERT_IN)
    unmatched = p_router & ~n_expert & regions.any(m.unmatched)
    return [
        (p_router & regions.any(flags["fused_op"]) & (pos < regions.first(flags["fused_op"])),
         Name.ROUTER),
        (unmatched & (pos < regions.first(flags["dispatch"])), Name.ROUTER),
        (unmatched & (pos >= regions.first(m.unmatched)), Name.UNATTRIBUTED),
        (unmatched, Name.MOE_DISPATCH),
        (p_router & m.before_norm, Name.MOE_COMBINE),
        (p_router & g.after.isin(PROJ_IN), Name.INPUT_NORM),
        (p_router, Name.FINAL_NORM),
        (g.before.isin(SHARED_IN), Name.ACT),  # the shared expert's activation
    ]


def _projection_rules(g: Gaps, m: _Marks, qk_name: Names) -> list[Rule]:
    """Between the input projections and attention (or o_proj): q/k norms, RoPE, cache writes,
    attention's own ops; an attention that is not in reach leaves them unattributed."""
    flags, pos, after = g.flags, g.pos, g.after
    after_proj = g.before.isin(PROJ_IN) & ~after.isin(MLP_IN | {Name.DOWN_PROJ, Name.LM_HEAD})
    kv = flags["kvonly"] | ((pos > m.last_rope) & flags["kvwrite"])
    # an attention in reach of the gap: the next anchor, or an eager attention's core inside it
    has_attn = after.isin([Name.ATTENTION]) | (m.attn_core < g.regions.past)
    past_rope = after_proj & (pos > m.last_rope)
    return [
        (~qk_name.isin([""]), qk_name),  # q/k RMSNorms over the head dim, before RoPE
        (after_proj & (pos >= m.attn_core), Name.ATTENTION),  # from the first softmax / bmm on
        (after_proj & kv, Name.KV_CACHE),  # cache writes (after the last RoPE op)
        (after_proj & flags["attnprep"] & has_attn, Name.ATTENTION),  # Triton on 4-D buffers
        (past_rope & after.isin([Name.ATTENTION, Name.O_PROJ, ""]) & has_attn, Name.ATTENTION),
        (past_rope & after.isin([Name.O_PROJ, ""]) & ~has_attn, Name.UNATTRIBUTED),
        (after_proj, Name.ROPE),
    ]


def _layer_rules(g: Gaps, m: _Marks, placement: Placement | None) -> list[Rule]:
    """The norms and residual adds after o_proj and down_proj in the layout's order, the MLP's
    activation, the preamble before the first layer, the model's end and what follows the
    lm_head (a training step's loss, logits processing and sampling)."""
    flags, pos, before = g.flags, g.pos, g.before
    n_start = g.after.isin(PROJ_IN)
    after_o, after_down = before.isin([Name.O_PROJ]), before.isin([Name.DOWN_PROJ])
    after_head = before.isin([Name.LM_HEAD])
    preamble = _preamble(g)
    return [
        *_placed(g, placement, after_down, preamble),
        # up to o_proj: layout copies, masks
        (before.isin([Name.ATTENTION]) & g.after.isin([Name.O_PROJ, Name.ATTENTION]),
         Name.ATTENTION),
        (before.isin(MLP_IN), Name.ACT),  # between gate/up and down
        # after down_proj when the next layer's projections follow: residual add, then norm
        (after_down & n_start & m.before_norm, Name.RESIDUAL),
        (after_down & n_start, Name.INPUT_NORM),
        # before the first layer (after the embedding or the previous pass's lm_head, if any)
        (preamble & ~m.before_norm, Name.INPUT_NORM),
        (preamble & flags["emb"], Name.EMBEDDING),
        (preamble & (pos >= m.rope0), Name.ROPE),  # the cos/sin tables HF builds per forward
        # after o_proj: residual add, then the post-attention norm
        (after_o & m.before_norm, Name.RESIDUAL),
        (after_o, Name.POST_ATTENTION_NORM),
        # after the last down_proj: residual add, then the final norm
        (after_down & m.before_norm, Name.RESIDUAL),
        (after_down, Name.FINAL_NORM),
        (before.isin(["", Name.EMBEDDING]) & flags["emb"], Name.EMBEDDING),
        (after_head & g.regions.any(flags["loss_op"]), Name.LOSS),  # a training step's loss
        (after_head & flags["sampling_op"], Name.SAMPLING),
    ]


def _gaps(placement: Placement) -> dict[str, tuple[str, ...]]:
    """The norms and residual adds of a placement before the first layer's attention (`start`:
    the embedding norm, then the layer's own), after the attention block (`o_proj`), after the
    MLP when the next layer follows (`down_proj`) and when the model ends (`end`)."""
    order = placement.order
    a, m = order.index(ATTENTION), order.index(MLP)
    first = (Name.EMBEDDING_NORM,) if placement.embedding_norm else ()
    last = (Name.FINAL_NORM,) if placement.final_norm else ()
    return {"start": first + tuple(x for x in order[:a] if x != RESIDUAL),
            Name.O_PROJ: order[a + 1:m], Name.DOWN_PROJ: order[m + 1:] + order[:a],
            "end": order[m + 1:] + last}


_PRE_GAPS = _gaps(PRE)


def _placed(g: Gaps, placement: Placement | None, mlp_end: np.ndarray,
            preamble: np.ndarray | None = None) -> list[Rule]:
    """Rules naming the gaps after o_proj and after the MLP (`mlp_end`: regions its last GEMM
    opens) and, given the `preamble`, before the first layer, from the layout's placement,
    when it differs from a pre-norm layer's (whose gaps the rules after these name, fused
    add+norm kernels included): the k-th norm of the gap is the k-th norm the placement puts
    there (a norm opens at its first op, or the cast right before it), the residual add is the
    last add of two tensors before the norm the placement puts after it. A norm beyond the
    placement's (an LM head's own) is left to the rules after these."""
    if placement is None:
        return []
    gaps = _gaps(placement)
    if gaps == _PRE_GAPS:
        return []
    flags, pos, n_start = g.flags, g.pos, g.after.isin(PROJ_IN)
    nth = g.regions.count(g.regions.opens_norm(flags))  # the norms opened so far in the gap
    rules: list[Rule] = []
    if preamble is not None and gaps["start"]:  # ops before its first norm: the embedding's
        start = np.asarray(gaps["start"], dtype=object)
        rules.append((preamble & (nth >= 1) & (nth <= len(start)),
                      Names(np.clip(nth - 1, 0, len(start) - 1), start)))
    gap_of = [(mlp_end & n_start, gaps[Name.DOWN_PROJ]), (mlp_end & ~n_start, gaps["end"])]
    if preamble is not None:
        gap_of.append((g.before.isin([Name.O_PROJ]), gaps[Name.O_PROJ]))
    for where, seq in gap_of:
        norms = [x for x in seq if x != RESIDUAL]
        if not norms:
            continue
        res = seq.index(RESIDUAL) if RESIDUAL in seq else -1  # norms before the add
        add_at = g.regions.last(flags["add"] & flags["binary"] & (nth == res))  # residual add
        names = Names(np.clip(nth - 1, 0, len(norms) - 1), np.asarray(norms, dtype=object))
        rules += [(where & (nth == res) & (pos >= add_at) & (add_at >= 0), RESIDUAL),
                  (where & (nth == 0) & (res == 0), RESIDUAL),
                  (where & (nth <= len(norms)), names)]
    return rules


def _qk_norms(g: Gaps, m: _Marks, p_in: np.ndarray) -> Names:
    """Per instance "q_norm", "k_norm" or "": the RMSNorm of q and of k over the head dim
    (HF Qwen3 / Qwen3-MoE `q_norm`, `k_norm`; vLLM's Qwen3 after its fused qkv_proj alike), by
    its op pattern and place. `p_in`: regions opened by an input projection whose norm is per
    head (a norm over the projection's whole output, e.g. the norm after an o_proj misnamed as
    a projection of q, k or v, is not). In such a region, the ops from its first norm op (and
    the cast before it) up to RoPE (its first neg / cos / sin / rotary op, and the q·cos mul
    right before it), the first attention op or the region's end. After q_proj it is q's norm,
    after k_proj (or Inductor's kv_proj) k's (HF: q_proj, q_norm, k_proj, k_norm, v_proj,
    RoPE); after a fused qkv_proj
    (or v_proj) the first norm is q's, the next k's, each opened by its first op (pow, a fused
    rms_norm) or the cast before it. Dense Llama/Qwen2 layers have no norm op there, so nothing
    is named."""
    regions, flags, pos = g.regions, g.flags, g.pos
    last_norm = regions.last(flags["normcore"])
    rot = regions.first(flags["rotary"] & (pos > last_norm))
    q_cos = regions.any((pos == rot - 1) & flags["mul"])
    span = (p_in & (last_norm >= 0) & (pos >= m.norm_start) & (pos < rot - q_cos)
            & (pos < m.attn_core))
    opens = span & regions.opens_norm(flags)
    rules: list[Rule] = [(~span, ""), (g.before.isin([Name.Q_PROJ]), Name.Q_NORM),
                         (g.before.isin([Name.K_PROJ, Name.KV_PROJ]), Name.K_NORM),
                         (regions.count(opens) <= 1, Name.Q_NORM)]
    return first_match(rules, Name.K_NORM)
