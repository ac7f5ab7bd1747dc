"""Naming a graph from a template: its kernels aligned by name with an eager pass of the same
step (or a capture's launches, by position), each matched kernel taking its eager twin's name
and, where the grids agree, its shapes.

Design notes: docs/design.md ("trace_roofline/attribution/graphs.py").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pandas as pd

from trace_roofline.attribution.graph_mapping import CARRIED, Mapping
from trace_roofline.attribution.graph_naming import (
    ATTENTION_OP,
    GEMM,
    GraphKernels,
    GraphNaming,
    empty_positions,
    kernel_ops,
    nearest,
)
from trace_roofline.attribution.graph_shapes import EXPERT_GEMMS, KernelHints, StepShapes, user_shapes
from trace_roofline.model import gemms, kernels, layouts, operators
from trace_roofline.model.models import ModelSpec
from trace_roofline.model.operators import Name
from trace_roofline.options import DecodeShapes
from trace_roofline.trace.decode import decode_args

BAND = 64  # kernels either side of the diagonal the alignment may stray
_SHAPE_COLUMNS = ["op_name", "input_dims", "input_types", "concrete_inputs", "input_strides"]
Named = tuple[pd.DataFrame | None, GraphNaming]  # a position table (None: not named) and how


@dataclass(frozen=True)
class Aligned:
    """A graph's position table as carried from its template, before the shape check: `match`,
    per kernel, its twin in the template (-1: none); the replay's grids; the template rows."""

    res: pd.DataFrame
    match: np.ndarray
    grids: np.ndarray
    tmpl: pd.DataFrame


def by_capture(k: GraphKernels, m: Mapping) -> Named:
    """The capture with as many launches as the replay has kernels, kernel k = launch k, when
    every GEMM / fused-attention / memset kernel sits where the capture launched that kind."""
    n = len(k.names)
    op = kernel_ops(pd.Series(k.names, dtype=object)).to_numpy(dtype=object)
    for t in range(len(m.starts) - 1):
        tmpl = m.rows.iloc[m.starts[t]:m.starts[t + 1]].reset_index(drop=True)
        if len(tmpl) != n:
            continue
        base = tmpl["op_name"].astype(object).fillna("").str.rsplit("::", n=1).str[-1]
        t_gemm = base.isin(gemms.GEMM_OPS).to_numpy()
        t_attn = operators.recognise(operators.ATTENTION, base).to_numpy()
        fits = ((op == GEMM) <= t_gemm) & ((op == ATTENTION_OP) <= t_attn)
        fits &= (k.kinds == "memset") == (tmpl["kind"].to_numpy(dtype=object) == "memset")
        if not fits.all():
            continue
        res = empty_positions(n)
        for c in (*CARRIED, "layer"):
            res[c] = tmpl[c].to_numpy(dtype=object) if c != "layer" else tmpl[c].array
        res["inst"] = _template_instances(tmpl)
        res["evidence"] = "graph_map"
        res["how"] = "matched"
        return res, GraphNaming(method="graph_map", template=f"{m.source} {t}", matched=n,
                                shapes="mapping")
    return None, GraphNaming()


def _template_instances(tmpl: pd.DataFrame, alone: bool = False) -> np.ndarray:
    """0, 1, ... per distinct (op, operator) of a template (an op can hold several: a fused MoE
    op's gate_up, down and combine); a row without an op is -1, or with `alone` one of its own."""
    op = tmpl["op_id"].astype("Int64").to_numpy(np.float64, na_value=np.nan)
    if alone:
        op = np.where(np.isnan(op), -1.0 - np.arange(len(tmpl)), op)
    key = pd.MultiIndex.from_arrays([op, tmpl["operator"].astype(object).to_numpy()])
    inst = pd.factorize(key)[0]
    return np.where(np.isnan(op), -1, inst)


def _best_template(k: GraphKernels, m: Mapping, t_codes: np.ndarray) -> int | None:
    """The template sharing the most kernel names with the graph (None: none shares one)."""
    best, best_n = None, 0
    for t in range(len(m.starts) - 1):
        tc = t_codes[m.starts[t]:m.starts[t + 1]]
        if len(tc) > 8 * len(k.codes) + BAND:  # too long to be this step: keeps align linear
            continue
        common = np.minimum(np.bincount(k.codes, minlength=len(k.vocab)),
                            np.bincount(tc, minlength=len(k.vocab))).sum()
        if common > best_n:
            best, best_n = t, common
    return best


def by_mapping(k: GraphKernels, m: Mapping, model: ModelSpec | None,
               shapes: DecodeShapes | None) -> Named:
    """Align with the best template; carry names and (checked) shapes."""
    t_codes = k.vocab.get_indexer(m.rows["name"].astype(object).to_numpy())
    best = _best_template(k, m, t_codes)
    if best is None:
        return None, GraphNaming()
    lo, hi = m.starts[best], m.starts[best + 1]
    match = align(k.codes, t_codes[lo:hi])
    tmpl = m.rows.iloc[lo:hi].reset_index(drop=True)
    n = len(k.codes)
    src = match.copy()
    how = np.where(match >= 0, "matched", "none").astype(object)
    # unmatched split-K reduces join the kernel before, memsets / memcpys the kernel after
    reduce_ = (pd.Series(k.vocab[k.codes]).str.contains(kernels.GEMM_SECOND_KERNEL).to_numpy()
               & (match < 0))
    copy_ = np.isin(k.kinds, ["memset", "memcpy"]) & (match < 0)
    prev, nxt = nearest(src, forward=True), nearest(src, forward=False)
    src = np.where(reduce_ & (prev >= 0), prev, src)
    src = np.where(copy_ & (nxt >= 0), nxt, src)
    how = np.where((how == "none") & (src >= 0), "attached", how)
    res = empty_positions(n)
    ok = src >= 0
    for c in (*CARRIED, "layer"):
        vals = tmpl[c].to_numpy(dtype=object if c != "layer" else None)
        res.loc[ok, c] = vals[src[ok]] if c != "layer" else tmpl[c].array.take(src[ok])
    inst = _template_instances(tmpl, alone=True)
    res["inst"] = np.where(ok, inst[np.maximum(src, 0)], -1)
    res["evidence"] = np.where(ok, "graph_map", operators.FALLBACK)
    res["how"] = how
    matched = int((how == "matched").sum())
    where = m.label if m.capture else f"{m.source} pass {int(tmpl['_pass'].iloc[0])}"
    named = GraphNaming(
        method="graph_map", template=where, matched=matched,
        attached=int((how == "attached").sum()),
        note=(f"aligned with {where}: {matched} of {n} kernels matched by name in order "
              f"(LCS {matched} of {len(tmpl)} template kernels, "
              f"{matched / max(n, 1):.1%} of the graph)"))
    return res, check_shapes(Aligned(res, match, k.grids, tmpl), model, shapes, named)


def _grid_check(a: Aligned) -> tuple[np.ndarray, bool, str | None]:
    """(kernels whose grid differs from their twin's, whether that refuses the shapes, why);
    attention's shapes dropped in place where only attention kernels differ."""
    res, match, grids = a.res, a.match, a.grids
    t_grid = a.tmpl["grid"].to_numpy(dtype=object)
    twin = t_grid[np.maximum(match, 0)] if len(t_grid) else np.full(len(match), None, object)
    # a replay or capture that records no grid (ROCm's replayed kernels) is not compared
    ok = (match >= 0) & pd.notna(grids) & pd.notna(twin)
    differ = ok & (grids.astype(str) != np.where(ok, twin, "").astype(str))
    in_attn = res["operator"].to_numpy(dtype=object) == Name.ATTENTION
    if (differ & ~in_attn).any():
        i = int(np.flatnonzero(differ & ~in_attn)[0])
        return differ, True, (
            f"{int((differ & ~in_attn).sum())} kernels launch other grids than in the mapping "
            f"(e.g. {res['operator'].iloc[i]} {grids[i]} vs {t_grid[match[i]]}): "
            "another batch; names carried, shapes and costs not")
    if differ.any():
        res.loc[in_attn, _SHAPE_COLUMNS] = None
        return differ, False, (
            f"{int(differ.sum())} attention kernels launch other grids than in the mapping: "
            "another context length; attention named but uncosted")
    return differ, False, None


def check_shapes(a: Aligned, model: ModelSpec | None, shapes: DecodeShapes | None,
                 named: GraphNaming) -> GraphNaming:
    """Drop carried shapes the replay does not share (module docstring, shape check): in place
    in a.res; the naming with the check's counts, note and flag."""
    differ, refuse, why = _grid_check(a)
    if shapes is not None and not refuse:
        m = _template_m(a.tmpl)
        if m is not None and m != shapes.batch:
            refuse = True
            why = (f"the mapping's q_proj has M = {m} tokens but the given decode batch is "
                   f"{shapes.batch}: "
                   "names carried, the mapping's shapes not")
    got = "mapping"
    if refuse:
        res = a.res
        # batched_mm's weight gathers, as the mapping names their op, before its shapes go
        gathers = (res["operator"].isin(EXPERT_GEMMS)
                   & res["op_name"].eq("aten::index")).to_numpy(dtype=bool)
        res.loc[:, _SHAPE_COLUMNS] = None
        got = "none"
        if shapes is not None and model is not None:
            user_shapes(res, model, shapes, KernelHints(gathers=gathers))
            got = "step" if isinstance(shapes, StepShapes) else "user"
            assert why is not None  # (a refusal says why)
            why += ("; costed from the step annotation instead" if got == "step"
                    else "; costed from the given decode shapes instead")
    named = dataclasses.replace(named, grid_mismatch=int(differ.sum()), shapes=got)
    if why:
        named = named.noted(why).flagged(f"graph mapping {named.template}: {why}")
    return named


def _template_m(tmpl: pd.DataFrame) -> int | None:
    """Tokens (M) of the template's first q_proj / qkv_proj, from its Input Dims."""
    q = tmpl[tmpl["operator"].isin([Name.Q_PROJ, Name.QKV_PROJ]) & tmpl["input_dims"].notna()]
    if q.empty:
        return None
    dims = decode_args(str(q["input_dims"].iloc[0]))
    return layouts.gemm_tokens(str(q["op_name"].iloc[0]), dims) if dims else None


def align(a: np.ndarray, b: np.ndarray, band: int = BAND) -> np.ndarray:
    """For each position of `a`, its partner in `b` (-1: none) in a longest common subsequence
    of the two code sequences whose path stays within `band` of the diagonal band between
    (0, 0) and (len(a), len(b)). O((n + m)·(|n - m| + 2·band)) time and memory."""
    n, m = len(a), len(b)
    out = np.full(n, -1, dtype=np.int64)
    if n == m and np.array_equal(a, b):
        return np.arange(n)
    if not n or not m:
        return out
    dmin, dmax = min(0, m - n), max(0, m - n)
    width = dmax - dmin + 2 * band + 1
    off = dmin - band  # column c of row i is j = i + off + c
    cols = np.arange(width)
    rows = np.full((n + 1, width), -1, dtype=np.int32)
    j0 = off + cols
    rows[0] = np.where((j0 >= 0) & (j0 <= m), 0, -1)
    bpad = np.r_[-2, b]  # bpad[j] = b[j - 1]; j = 0 never equals a code
    for i in range(1, n + 1):
        js = i + off + cols
        valid = (js >= 0) & (js <= m)
        prev = rows[i - 1]
        up = np.r_[prev[1:], -1]  # D[i-1][js]
        diag = prev  # D[i-1][js-1]
        eq = (bpad[np.clip(js, 0, m)] == a[i - 1]) & (js >= 1)
        cand = np.maximum(up, np.where(diag >= 0, diag + eq, -1))
        cand = np.where(js == 0, 0, cand)
        cand = np.where(valid, cand, -1)
        row = np.maximum.accumulate(cand)
        rows[i] = np.where(valid, row, -1)
    i, j = n, m
    while i > 0 and j > 0:
        c = j - (i + off)
        cur = rows[i, c]
        if a[i - 1] == b[j - 1] and rows[i - 1, c] >= 0 and rows[i - 1, c] + 1 == cur:
            out[i - 1] = j - 1
            i, j = i - 1, j - 1
        elif c + 1 < width and rows[i - 1, c + 1] == cur:
            i -= 1
        else:
            j -= 1
    return out
