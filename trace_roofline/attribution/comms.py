"""Communication: exposed collective time on one rank, and which rank waits for which.

Design notes: docs/design.md ("trace_roofline/attribution/comms.py").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from trace_roofline.attribution import naming
from trace_roofline.model import operators

# One row per collective call of one trace (`calls`).
CALL_COLUMNS = {
    "phase": "str",
    "operator": "str",
    "layer": "Int64",
    "step": "Int64",
    "ts_us": "float64",  # first kernel's start
    "time_us": "float64",  # Σ its kernels' device time
    "exposed_us": "float64",  # of which no compute kernel overlaps
    "kernels": "int64",
}
# One row per (phase, collective, rank) over a set of rank traces.
WAITING_COLUMNS = {
    "phase": "str",
    "operator": "str",
    "rank": "str",
    "collectives": "int64",  # calls paired across ranks (the fewest any rank made)
    "time_us": "float64",  # Σ device time of those calls on this rank
    "wait_us": "float64",  # Σ (time - the shortest rank's time) per call
    "wait_share": "float64",  # wait / time
    "waits_for": "str",  # the straggler it waits for; missing when it waits for none
    "mostly_waits": "bool",  # wait_share > MOSTLY
}
MOSTLY = 0.5


def is_collective(operator: pd.Series) -> np.ndarray:
    """Whether each operator name is a collective (operators.COMMUNICATION), also as the first
    word of a by-shape row name ('all_reduce 28672xbf16 ...')."""
    first_word = naming.per_value(operator, lambda names: names.str.split(" ", n=1).str[0])
    return first_word.isin(operators.COMMUNICATION).to_numpy(dtype=bool)


def exposed_us(ts_us: np.ndarray, dur_us: np.ndarray, collective: np.ndarray,
               compute: np.ndarray) -> np.ndarray:
    """Per row: for a `collective` row the µs of its [ts, ts + dur) that no `compute` row
    overlaps; 0 for the other rows (see the module docstring)."""
    ts = np.asarray(ts_us, dtype=np.float64)
    dur = np.asarray(dur_us, dtype=np.float64)
    out = np.zeros(len(ts))
    if not collective.any():
        return out
    ts = ts - ts.min()  # epoch µs keep ~1 ns; relative times keep the sums exact to far below
    end = ts + dur
    a, b = ts[collective], end[collective]
    s, e = ts[compute], end[compute]
    if not len(s):
        out[collective] = dur[collective]
        return out
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    run = np.maximum.accumulate(e)
    new = np.r_[True, s[1:] > run[:-1]]  # a start after every earlier end: a new segment
    starts = np.flatnonzero(new)
    seg_s = s[starts]
    seg_e = run[np.r_[starts[1:] - 1, len(s) - 1]]  # the running max at a segment's last row
    before = np.r_[0.0, np.cumsum(seg_e - seg_s)]  # merged length before segment i

    def covered(x: np.ndarray) -> np.ndarray:
        i = np.searchsorted(seg_s, x, side="right") - 1
        j = np.maximum(i, 0)
        inside = np.clip(x - seg_s[j], 0.0, seg_e[j] - seg_s[j])
        return np.where(i >= 0, before[j] + inside, 0.0)

    out[collective] = dur[collective] - (covered(b) - covered(a))
    return out


def calls(attributed: pd.DataFrame, costed: pd.DataFrame) -> pd.DataFrame:
    """One row per collective call (op instance) of a trace, in order of start (CALL_COLUMNS):
    its kernels' time and exposed time (`exposed_us` against the trace's other kernels); the
    phase is its step's (from `costed`). Small: what `waiting` pairs across ranks."""
    rows = is_collective(attributed["operator"])
    kernel = (attributed["kind"] == "kernel").to_numpy(dtype=bool) & ~rows
    exposed = exposed_us(attributed["ts_us"].to_numpy(), attributed["dur_us"].to_numpy(),
                         rows, kernel)
    c = attributed.loc[rows, ["instance", "operator", "layer", "step", "ts_us", "dur_us"]]
    c = c.assign(exposed_us=exposed[rows], instance=_copies_joined(attributed, rows))
    out = c.groupby("instance", sort=False).agg(
        operator=("operator", "first"), layer=("layer", "first"), step=("step", "first"),
        ts_us=("ts_us", "min"), time_us=("dur_us", "sum"), exposed_us=("exposed_us", "sum"),
        kernels=("dur_us", "size")).reset_index(drop=True)
    phase_of = costed.groupby(costed["step"].astype("Int64").fillna(-1))["phase"].first()
    out["phase"] = out["step"].astype("Int64").fillna(-1).map(phase_of).fillna("unknown")
    out = out.sort_values("ts_us", kind="stable", ignore_index=True)
    return out[list(CALL_COLUMNS)].astype(CALL_COLUMNS)


_COPY_OPS = ("aten::copy_", "aten::copy", "aten::_to_copy", "aten::clone", "aten::contiguous")


def _copies_joined(attributed: pd.DataFrame, rows: np.ndarray) -> np.ndarray:
    """Per collective row, its call: its instance, but a copy inside a collective op (a
    symmetric-memory all-reduce's copy-in and copy-out) joins the collective kernel nearest in
    time (the next for a copy-in, the last for a copy-out), so one all-reduce is one call."""
    inst = attributed["instance"].to_numpy()[rows]
    names = attributed.get("op_name")
    if names is None:
        return inst
    copy = names.isin(_COPY_OPS).to_numpy(dtype=bool)[rows]
    if not copy.any() or copy.all():
        return inst
    order = np.argsort(attributed["ts_us"].to_numpy()[rows], kind="stable")
    ts = attributed["ts_us"].to_numpy(np.float64)[rows][order]
    end = ts + attributed["dur_us"].to_numpy(np.float64)[rows][order]
    own = np.where(copy[order], -1, np.arange(len(order)))
    prev = np.maximum.accumulate(own)
    nxt = np.minimum.accumulate(np.where(own < 0, len(own), own)[::-1])[::-1]
    gap_prev = np.where(prev >= 0, ts - end[np.maximum(prev, 0)], np.inf)
    gap_next = np.where(nxt < len(own), ts[np.minimum(nxt, len(own) - 1)] - end, np.inf)
    pick = np.where(gap_next <= gap_prev, nxt, prev)
    joined = inst[order].copy()
    take = copy[order] & (pick >= 0) & (pick < len(own))
    joined[take] = inst[order][pick[take]]
    out = np.empty_like(inst)
    out[order] = joined
    return out


def summary(calls_table: pd.DataFrame, costed: pd.DataFrame,
            link_bandwidth: float | None) -> dict[str, dict[str, float]]:
    """Per phase: the collectives' device time, exposed time, bus bytes, share of the phase's
    device time, kernels, achieved bus bytes/s and its fraction of `link_bandwidth`. Phases
    without collectives are left out. Times from `calls_table` (`calls`), bytes from `costed`."""
    coll = is_collective(costed["operator"])
    if not coll.any():
        return {}
    exposed = calls_table.groupby("phase")["exposed_us"].sum()
    phase_time = costed.groupby("phase")["time_us"].sum()
    out: dict[str, dict[str, float]] = {}
    for phase, g in costed[coll].groupby("phase", sort=False):
        t, nbytes = float(g["time_us"].sum()), float(g["bytes"].sum())
        timed = float(g.loc[g["bytes"].notna(), "time_us"].sum())
        rate = nbytes / (timed * 1e-6) if timed > 0 else float("nan")
        out[str(phase)] = {
            "time_us": t, "exposed_time_us": float(exposed.get(phase, 0.0)),
            "bytes": nbytes, "kernels": int(g["kernels"].sum()),
            "time_share": t / float(phase_time[phase]) if phase_time[phase] > 0 else float("nan"),
            "bus_bytes_per_s": rate,
            "link_fraction": rate / link_bandwidth if link_bandwidth else float("nan"),
        }
    return out


def waiting(ranks: Sequence[str], per_rank: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """WAITING_COLUMNS over rank traces: `per_rank[i]` is rank `ranks[i]`'s collective calls
    (`calls`, Analysis.collectives; any table with operator, phase, ts_us, time_us). Calls pair
    by order per (phase, collective); see the module docstring."""
    rows = []
    labels = np.asarray(ranks, dtype=object)
    calls = [c[is_collective(c["operator"])].sort_values("ts_us", kind="stable")
             for c in per_rank]
    keys = pd.concat([c[["phase", "operator"]] for c in calls]).drop_duplicates()
    for phase, op in keys.itertuples(index=False):  # one iteration per (phase, collective)
        per = [c.loc[(c["phase"] == phase) & (c["operator"] == op), "time_us"].to_numpy()
               for c in calls]
        n = min(len(p) for p in per)
        if n == 0:
            continue
        d = np.stack([p[:n] for p in per])  # ranks x calls
        wait = d - d.min(axis=0)
        straggler = d.argmin(axis=0)
        for r in range(len(labels)):
            w = wait[r]
            share = w.sum() / d[r].sum() if d[r].sum() > 0 else np.nan
            # the straggler of the calls this rank waited in, weighted by its wait
            by = pd.Series(w).groupby(straggler).sum()
            by = by[by.index != r]
            waits_for = labels[int(by.idxmax())] if len(by) and by.max() > 0 else None
            rows.append((phase, op, labels[r], n, float(d[r].sum()), float(w.sum()), share,
                         waits_for, bool(share > MOSTLY)))
    out = pd.DataFrame(rows, columns=list(WAITING_COLUMNS))
    return out.astype(WAITING_COLUMNS)


def waiting_lines(table: pd.DataFrame) -> list[str]:
    """One line per rank that mostly waits in a collective: how long, and for whom."""
    return [f"rank {r.rank} mostly waits in {r.operator} ({r.phase}): {r.wait_us:.1f} of "
            f"{r.time_us:.1f} µs ({100 * r.wait_share:.0f}%) over {r.collectives} calls, for "
            f"rank {r.waits_for} (the straggler: its kernels are the short ones)"
            for r in table[table["mostly_waits"]].itertuples(index=False)]
