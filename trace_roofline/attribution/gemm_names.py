"""Weight GEMMs named by their (K, N): the linears of the layout, in the order they recur.

Design notes: docs/design.md ("trace_roofline/attribution/naming.py").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from trace_roofline.attribution.gemm_operands import WEIGHT_FIRST
from trace_roofline.attribution.naming import Names, per_value
from trace_roofline.attribution.op_families import classify
from trace_roofline.model import operators
from trace_roofline.model.operators import Name, Stage

PROJ_IN = operators.at_stage(Stage.QKV)  # a layer opens with these
MLP_IN = operators.at_stage(Stage.MLP_IN)
# GEMMs of an operator named differently while positions are worked out (their regions
# differ), then renamed: the shared expert's sigmoid gate is router work; HF 4.x's separate
# expert gate (w1) and up (w3) projections are experts_gate_up
SUB_LINEARS = {"shared_expert_gate": Name.ROUTER, "experts_gate": Name.EXPERTS_GATE_UP,
               "experts_up": Name.EXPERTS_GATE_UP}
LINEAR_ORDER = (*operators.LINEARS, "experts_gate", "experts_up", "shared_expert_gate")
_EXPERT_LINEARS = (Name.EXPERTS_GATE_UP, "experts_gate", "experts_up", Name.EXPERTS_DOWN)


@dataclass(frozen=True)
class _Cycles:
    """The weight GEMM rows of an instance table and their names as `name_gemms` cycles them:
    per row its distinct (K, N, W) `pair`, whose cycle is names[start:start + size]; `codes`
    (per instance, into `names`) and `names` are updated in place as rules rename rows."""

    rows: np.ndarray  # the GEMM rows (instances with a K)
    codes: np.ndarray  # per instance, an index into names (-1: no name)
    names: list[str]
    pair: np.ndarray  # per GEMM row, its distinct (K, N, W)
    start: np.ndarray  # per pair, where its cycle starts in names
    size: np.ndarray  # per pair, its cycle's length

    def cycle(self, p: int) -> list[str]:
        """The names pair p cycles through."""
        return self.names[self.start[p]:self.start[p] + self.size[p]]


def name_gemms(inst: pd.DataFrame, linears: dict[str, tuple[int, int]] | None) -> pd.Series:
    """Canonical names of weight GEMMs by (K, N); ties by order within the sequence group.

    A (K, N) shared by several linears (q/o, k/v, gate/up) cycles through them in the order of
    `LINEAR_ORDER` as it recurs: the 1st (H, q) GEMM of a step is q_proj, the 2nd o_proj, the
    3rd q_proj... GEMMs matching nothing are named `linear[K×N]`. Expert weights outside a
    weight GEMM (`expert_weight_kn`: columns WE, WK, WN) get the name of the expert GEMM whose
    (K, N) they have (an `index` gather also its expert count), else none. Returns a
    categorical Series, missing where no name.
    """
    linears = linears or {}
    names = list(_EXPERT_LINEARS)
    codes = _expert_weights(inst, linears)  # into names
    rows = np.flatnonzero(inst["K"].to_numpy() >= 0)
    if len(rows):
        k, n = inst["K"].to_numpy()[rows], inst["N"].to_numpy()[rows]
        w = inst["W"].to_numpy()[rows] if "W" in inst else np.ones(len(rows), np.int64)
        width, most = int(n.max()) + 1, int(w.max()) + 1
        pair, pairs = pd.factorize((k * width + n) * most + w)  # the distinct (K, N, W)
        in_grp = inst["grp"].to_numpy()[rows] * len(pairs) + pair
        occ = pd.Series(in_grp).groupby(in_grp, sort=False).cumcount().to_numpy()
        cycles: dict[tuple[int, ...], list[str]] = {}  # the linears of each (K, N), in order
        for name in LINEAR_ORDER:
            if name in linears and name not in operators.KERNEL_FUSIONS:
                cycles.setdefault(tuple(linears[name]), []).append(name)
        start, size = np.zeros(len(pairs), np.int64), np.zeros(len(pairs), np.int64)
        for p, key in enumerate(pairs):
            (pk, pn), pw = divmod(int(key) // most, width), int(key) % most
            if pw > 1:  # a kernel of several weights: only the fusion of its parts
                fused = _kernel_fusion(pk, pn, pw, linears)
                cycle = [fused] if fused else []
            else:
                cycle = cycles.get((pk, pn), [])
            cycle = cycle or [f"linear[{pk}×{pn}]"]
            start[p], size[p] = len(names), len(cycle)
            names.extend(cycle)
        codes[rows] = start[pair] + occ % size[pair]
        cycles_of = _Cycles(rows, codes, names, pair, start, size)
        _around_attention(inst, cycles_of)
        _routed_or_shared(inst, cycles_of)
    unique, cats = pd.factorize(np.asarray(names, dtype=object))
    return pd.Series(pd.Categorical.from_codes(np.where(codes >= 0, unique[codes], -1), cats),
                     index=inst.index)


def _routed_or_shared(inst: pd.DataFrame, cyc: _Cycles) -> None:
    """Name the GEMMs of a (K, N) that routed experts share with another linear (a shared
    expert as wide as a routed one, DeepSeek's and GLM-4-MoE's) by how they run, not by how
    often the shape recurs: a GEMM over stacked expert weights (`_grouped_mm`, a batched
    expert GEMM: column WE) is a routed expert's; where the trace runs its routed experts so,
    a plain GEMM of that (K, N) is the other linear's (the shared expert's), or `linear[K×N]`
    where the layout has none. A trace that runs its experts as plain GEMMs (a loop over
    experts) keeps its cycle. Updates the cycles' codes (into their names, extended)."""
    rows, codes, names, pair, start = cyc.rows, cyc.codes, cyc.names, cyc.pair, cyc.start
    if "WE" not in inst or not ((inst["WE"].to_numpy() >= 0) & (codes >= 0)).any():
        return  # no expert runs over stacked weights
    stacked = inst["WE"].to_numpy()[rows] >= 0
    grp = inst["grp"].to_numpy()[rows]
    for p in range(len(start)):
        cycle = cyc.cycle(p)
        routed = [start[p] + i for i, x in enumerate(cycle) if x in _EXPERT_LINEARS]
        other = [start[p] + i for i, x in enumerate(cycle) if x not in _EXPERT_LINEARS]
        if not routed:
            continue
        plain = np.flatnonzero((pair == p) & ~stacked)
        if not other and len(plain):  # a plain GEMM that is no routed expert, and no other linear
            k, n = inst["K"].to_numpy()[rows[plain[0]]], inst["N"].to_numpy()[rows[plain[0]]]
            names.append(f"linear[{k}×{n}]")
            other = [len(names) - 1]
        for mask, choice in ((stacked, routed), (~stacked, other)):
            at = np.flatnonzero((pair == p) & mask)
            occ = pd.Series(grp[at]).groupby(grp[at], sort=False).cumcount().to_numpy()
            codes[rows[at]] = np.asarray(choice)[occ % len(choice)]


def _around_attention(inst: pd.DataFrame, cyc: _Cycles) -> None:
    """Name the GEMMs of a (K, N) that o_proj shares with input projections (MHA's q, k, v
    and o alike) by the layout's order around attention, not by how often the shape recurs:
    after an attention call its first such GEMM is o_proj; the next ones, after the pass's
    end if one comes between (an embedding, the lm_head), are the next call's q, k, v in
    order. One before that end (an LM head's transform, a pooler), one past the layout's
    projections or one no call follows is no projection: `linear[K×N]`.
    Updates the cycles' codes (into their names, extended); a group without attention keeps its
    cycle."""
    rows, codes, names, pair, start = cyc.rows, cyc.codes, cyc.names, cyc.pair, cyc.start
    mixed = [p for p in range(len(start))
             if Name.O_PROJ in cyc.cycle(p) and PROJ_IN & set(cyc.cycle(p))]
    if not mixed:
        return
    flags = classify(inst)
    attn = flags["attn"] | (flags["batched"] & (flags["last0"] != 1))  # (not RoPE's table)
    if "WE" in inst:  # (nor an expert GEMM over stacked weights: Llama 4's batched experts)
        attn &= ~((inst["WE"].to_numpy() >= 0) & (codes >= 0))
    grp = inst["grp"].to_numpy()
    head = np.zeros(len(inst), dtype=bool)  # a pass's end: the lm_head GEMM, an embedding
    head[rows] = np.asarray(names, dtype=object)[codes[rows]] == Name.LM_HEAD
    marked = np.zeros(len(inst), dtype=bool)
    marked[rows] = True
    marked = np.flatnonzero(marked | attn)  # GEMMs and attention ops, in their group's order
    same = np.r_[False, grp[marked][1:] == grp[marked][:-1]]
    opens = np.zeros(len(inst), dtype=np.int64)
    opens[marked] = attn[marked] & ~(np.r_[False, attn[marked][:-1]] & same)  # a call's 1st op
    seen = pd.Series(opens).groupby(grp).cumsum().to_numpy()  # attention calls opened so far
    calls = pd.Series(seen).groupby(grp).transform("max").to_numpy()
    ends = pd.Series((head | flags["emb"]).astype(np.int64)).groupby(grp).cumsum().to_numpy()
    # per row, the pass ends seen when the next attention call opens (-1: none comes)
    at_open = pd.Series(ends[opens > 0], index=grp[opens > 0] * (len(inst) + 1) + seen[opens > 0])
    nxt = grp * (len(inst) + 1) + seen + 1
    ends_next = at_open.reindex(nxt).fillna(-1).to_numpy(dtype=np.int64)
    for p in mixed:
        cycle = cyc.cycle(p)
        proj = np.array([cycle.index(x) for x in cycle if x in PROJ_IN])
        at = rows[pair == p]
        a, tail = seen[at], ends[at] != ends_next[at]  # tail: a pass ends before the call
        key = grp[at] * (int(a.max()) + 1) + a
        r = pd.Series(at).groupby(key).cumcount().to_numpy()  # from the call before
        o = (a > 0) & (r == 0)  # its o_proj
        lead = pd.Series(~o & ~tail).groupby(key).cumsum().to_numpy() - 1  # the next call's
        own = np.where(o, cycle.index(Name.O_PROJ),
                       np.where(~tail & (lead < len(proj)), proj[np.clip(lead, 0, len(proj) - 1)],
                                -1))
        names.append(_shape_of(inst, at[0]))
        keep = calls[at] == 0  # no attention in the group: the cycle stays
        codes[at] = np.where(keep, codes[at], np.where(own >= 0, start[p] + own, len(names) - 1))


def _shape_of(inst: pd.DataFrame, row: int) -> str:
    """`linear[K×N]` of a GEMM instance."""
    return f"linear[{int(inst['K'].to_numpy()[row])}×{int(inst['N'].to_numpy()[row])}]"


def _kernel_fusion(k: int, n: int, weights: int, linears: dict[str, tuple[int, int]]
                   ) -> str | None:
    """The fused linear (operators.FUSIONS) a kernel multiplying `weights` weights [K, n/w] at
    once runs: the one of as many parts, its own (K, N) or its parts' all (K, n/w), when no
    other linear has that part shape (MHA's q, k, v and o alike: which two? None)."""
    each = (k, n // weights)
    alike = {name for name, kn in linears.items() if tuple(kn) == each}
    for fused, parts in operators.FUSIONS:
        whole = tuple(linears.get(fused, ())) == (k, n) or all(
            tuple(linears.get(p, ())) == each for p in parts)
        if len(parts) == weights and whole and alike <= set(parts):
            return fused
    return None


def _expert_weights(inst: pd.DataFrame, linears: dict[str, tuple[int, int]]) -> np.ndarray:
    """Per instance, the index in _EXPERT_LINEARS of the expert GEMM whose weights it gathers
    or multiplies in a weight-first GEMV (see name_gemms), -1 elsewhere."""
    out = np.full(len(inst), -1)
    if "WK" not in inst or not (inst["WK"] >= 0).any():
        return out
    wk, wn, experts = inst["WK"].to_numpy(), inst["WN"].to_numpy(), inst["WE"].to_numpy()
    count = linears.get(Name.ROUTER, (0, -1))[1]
    base = Names.of(inst["op_name"]).mapped(operators.base_names)
    is_index, is_bmm = base.isin(["index"]), base.isin(["bmm"])
    weight_first = is_bmm.copy()  # (the regex once per distinct bmm's dims, not per row)
    if is_bmm.any():
        weight_first[is_bmm] = per_value(inst.loc[is_bmm, "input_dims"], lambda d: d.astype(
            "string").fillna("").str.match(WEIGHT_FIRST)).to_numpy(dtype=bool)
    for i, name in enumerate(_EXPERT_LINEARS):
        if name in linears:
            k, n = linears[name]
            hit = (wk == k) & (wn == n) & (weight_first | ((is_bmm | is_index) & (experts == count)))
            out[hit & (out < 0)] = i
    return out
