"""The step's time, reconciled: per step its host wall time, device busy and idle time (and
where the idle sits), the host time that issued it, a verdict (device-, launch- or
communication-bound) with its evidence; and the headroom of each operator and step to its roof.

A step is a ProfilerStep#N range; else a serving step annotation (attribution/steps.py:
vLLM's `execute_...`, SGLang's `step[...]`); else each forward pass (the host range of its
instances' ops, from a costed table's `step` column); else the whole trace. A device row belongs
to the step whose host range holds its launch (the runtime call of its correlation: every kernel
of a CUDA-graph replay belongs to the step of its graph launch), else the step whose range
holds its start. Docs: docs/step.md.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from trace_roofline.attribution import steps as serving
from trace_roofline.model import kernels
from trace_roofline.trace import Trace

STEP_COLUMNS = {
    "step": "str",  # ProfilerStep#N, the serving annotation, "forward pass N" or "trace"
    "wall_us": "float64",  # host wall time of the step's range
    "busy_us": "float64",  # union of the step's device intervals, all streams: overlap once
    "kernel_us": "float64",  # union of its compute kernels (not collectives)
    "memcpy_us": "float64",  # union of its memcpy and memset rows
    "comm_us": "float64",  # union of its collective kernels (NCCL, RCCL, custom all-reduce)
    "idle_us": "float64",  # device window (host start .. last device end) minus busy
    "idle_before_us": "float64",  # host start to the first device event
    "idle_between_us": "float64",  # gaps between the step's device events
    "idle_sync_us": "float64",  # the part of idle_us under a host synchronisation call
    "host_us": "float64",  # union of cpu ops and runtime calls in the range, syncs left out
    "launches": "int64",  # kernel launch runtime calls + graph launches
    "verdict": "str",  # device-bound | launch-bound | communication-bound
    "evidence": "str",  # one sentence with the figures
}
HEADROOM_COLUMNS = {
    "scope": "str",  # operator | step
    "name": "str",  # the operator, or the step
    "phase": "str",  # the operator's phase; missing for a step
    "measured_us": "float64",  # operator: its device time; step: its wall time
    "at_roof_us": "float64",  # operator: its time at its roof; step: wall - (busy - Σ at roof)
    "lost_us": "float64",  # measured - at roof
    "no_idle_us": "float64",  # step: its busy time (the step with no idle time); operator: NA
    "rank": "int64",  # by lost_us within the scope, 1 = loses most
}
VERDICTS = ("device-bound", "launch-bound", "communication-bound")
_PROFILER_STEP = re.compile(r"^ProfilerStep#\d+$")
_HOST_CATS = ("user_annotation", "cpu_op")  # host ranges (not gpu_user_annotation)
LAUNCH = re.compile(r"^(?:cu(?:da)?Launch(?:Cooperative)?Kernel|hip(?:Ext)?(?:Module)?LaunchKernel|"
                    r"(?:cu(?:da)?|hip)GraphLaunch)")
# host waits: the synchronize calls, and the blocking copies (cudaMemcpy, hipMemcpyWithStream)
SYNC = re.compile(r"^(?:cu(?:da)?|hip)(?:(?:Device|Stream|Event|Ctx)Synchronize|Memcpy(?:WithStream)?$)")


# ---------------------------------------------------------------------------------- steps
def step_ranges(trace: Trace, costed: pd.DataFrame | None = None) -> pd.DataFrame:
    """The steps' host ranges (columns step = 0, 1, ..., name, ts_us, end_us) by start:
    ProfilerStep#N, else serving steps, else forward passes (`costed`), else the trace."""
    ann = trace.annotations
    host = ann["cat"].astype(object).isin(_HOST_CATS) & ann["name"].astype(object).map(
        lambda n: bool(_PROFILER_STEP.match(str(n))), na_action="ignore").fillna(False).astype(bool)
    if host.any():
        a = ann[host].assign(end_us=ann["ts_us"] + ann["dur_us"], name=ann["name"].astype(str))
        t = a.groupby("name", sort=False).agg(ts_us=("ts_us", "min"), end_us=("end_us", "max"))
        return _numbered(t.reset_index())
    parsed = serving.parse(ann)
    if not parsed.empty:
        return _numbered(parsed[["name", "ts_us", "end_us"]])
    passes = _pass_ranges(trace, costed)
    if passes is not None:
        return passes
    starts = [t["ts_us"].to_numpy() for t in (trace.device, trace.cpu_ops, trace.runtime)]
    ends = [(t["ts_us"] + t["dur_us"]).to_numpy() for t in (trace.device, trace.cpu_ops,
                                                              trace.runtime)]
    lo, hi = np.concatenate(starts), np.concatenate(ends)
    whole = (float(lo.min()), float(hi.max())) if len(lo) else (0.0, 0.0)
    return _numbered(pd.DataFrame({"name": ["trace"], "ts_us": [whole[0]], "end_us": [whole[1]]}))


def _pass_ranges(trace: Trace, costed: pd.DataFrame | None) -> pd.DataFrame | None:
    """Each forward pass's host range: from the first start to the last end of the cpu ops
    its costed instances ran (`op_id`); None without passes or ops."""
    if costed is None or costed.empty:
        return None
    ops = trace.cpu_ops.set_index("op_id")[["ts_us", "dur_us"]]
    inst = costed[["step", "op_id"]].dropna()
    inst = inst[inst["op_id"].isin(ops.index)]
    if inst.empty:
        return None
    op = ops.loc[inst["op_id"].to_numpy(np.int64)]
    t = pd.DataFrame({"pass": inst["step"].to_numpy(np.int64), "ts_us": op["ts_us"].to_numpy(),
                      "end_us": (op["ts_us"] + op["dur_us"]).to_numpy()})
    t = t.groupby("pass").agg(ts_us=("ts_us", "min"), end_us=("end_us", "max")).reset_index()
    return _numbered(t.assign(name="forward pass " + t["pass"].astype(str)))


def _numbered(t: pd.DataFrame) -> pd.DataFrame:
    t = t.sort_values("ts_us", kind="stable").reset_index(drop=True)
    return pd.DataFrame({"step": np.arange(len(t)), "name": t["name"].astype(str).to_numpy(),
                         "ts_us": t["ts_us"].to_numpy(np.float64),
                         "end_us": t["end_us"].to_numpy(np.float64)})


def device_steps(trace: Trace, ranges: pd.DataFrame) -> np.ndarray:
    """Per device row, its step (index into `ranges`): the step holding its launch
    (steps.kernel_steps), else the one holding its start; -1 for none."""
    out = serving.kernel_steps(trace, ranges)
    lost = out < 0
    if lost.any():
        out[lost] = _containing(ranges, trace.device["ts_us"].to_numpy(np.float64)[lost])
    return out


def _containing(ranges: pd.DataFrame, at: np.ndarray) -> np.ndarray:
    """Per time, the step whose [ts, end] holds it (the latest-starting one); -1 for none."""
    start, end = ranges["ts_us"].to_numpy(), ranges["end_us"].to_numpy()
    i = np.searchsorted(start, at, side="right") - 1
    j = np.maximum(i, 0)
    return np.where((i >= 0) & (at <= end[j]), j, -1) if len(start) else np.full(len(at), -1)


# ------------------------------------------------------------------------------ intervals
def _union(group: np.ndarray, start: np.ndarray, end: np.ndarray, n: int
           ) -> tuple[np.ndarray, np.ndarray, pd.DataFrame]:
    """Per group 0..n-1: the union length of its intervals, the total of the gaps between
    them, and the gaps themselves (columns group, ts_us, end_us)."""
    order = np.lexsort((start, group))
    g, s, e = group[order], start[order], end[order]
    reach = pd.Series(e).groupby(g).cummax().to_numpy()
    first = np.r_[True, g[1:] != g[:-1]] if len(g) else np.zeros(0, bool)
    before = np.where(first, -np.inf, np.r_[-np.inf, reach[:-1]])
    covered = np.maximum(e - np.maximum(s, before), 0.0)
    gap = np.where(first, 0.0, np.maximum(s - before, 0.0))
    union = np.bincount(g, weights=covered, minlength=n)
    gaps = np.bincount(g, weights=gap, minlength=n)
    has = gap > 0
    return union, gaps, pd.DataFrame({"group": g[has], "ts_us": before[has], "end_us": s[has]})


def _length(group: np.ndarray, start: np.ndarray, end: np.ndarray, n: int) -> np.ndarray:
    return _union(group, start, end, n)[0]


def _clipped(table: pd.DataFrame, ranges: pd.DataFrame, keep: np.ndarray | None = None
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host events of `table` (rows `keep`) by the step holding their start, clipped to it."""
    t = table if keep is None else table[keep]
    ts = t["ts_us"].to_numpy(np.float64)
    step = _containing(ranges, ts)
    inside = step >= 0
    step, ts = step[inside], ts[inside]
    end = np.minimum(ts + t["dur_us"].to_numpy(np.float64)[inside],
                     ranges["end_us"].to_numpy()[step])
    return step, ts, end


def _named(table: pd.DataFrame, rx: re.Pattern) -> np.ndarray:
    """Rows of `table` whose name matches `rx` (each distinct name matched once)."""
    codes, names = pd.factorize(table["name"].astype(object))
    hit = np.fromiter((bool(rx.match(str(n))) for n in names), bool, len(names))
    return np.append(hit, False)[np.where(codes < 0, len(names), codes)]


# ---------------------------------------------------------------------------------- table
def step_table(trace: Trace, costed: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per step (module docstring) in STEP_COLUMNS.

    Verdict, in this order: **launch-bound** (host-bound) when the device idles longer than it
    is busy (idle_us > busy_us): it waits on the host, issuing the next kernel (the gaps
    outside syncs) or blocked in a sync (idle_sync_us, said in the evidence); **communication-bound**
    when collectives not overlapped by any compute or copy (busy minus the union of the
    non-collective rows) take more than half of busy_us; else **device-bound**. `costed` (a
    costed table, for its forward passes) is used only when the trace annotates no step."""
    ranges = step_ranges(trace, costed)
    n = len(ranges)
    dev = trace.device
    step = device_steps(trace, ranges)
    mine = step >= 0
    s = step[mine]
    ts = dev["ts_us"].to_numpy(np.float64)[mine]
    end = ts + dev["dur_us"].to_numpy(np.float64)[mine]
    kind = dev["kind"].astype(object).to_numpy()[mine]
    comm = (kernels.roles(dev["name"]).to_numpy() == "collective")[mine] if len(dev) else \
        np.zeros(0, bool)
    copy = kind != "kernel"
    compute = ~copy & ~comm
    busy, between, gaps = _union(s, ts, end, n)
    start = ranges["ts_us"].to_numpy()
    first = np.full(n, np.inf)
    np.minimum.at(first, s, ts)
    last = np.full(n, -np.inf)
    np.maximum.at(last, s, end)
    seen = np.isfinite(first)
    lo = np.where(seen, np.minimum(start, first), start)
    window = np.where(seen, last - lo, 0.0)
    before = np.where(seen, first - lo, 0.0)
    # gaps before and between, and the syncs over them: |G ∩ S| = |G| + |S| - |G ∪ S|
    g = pd.concat([gaps, pd.DataFrame({"group": np.flatnonzero(before > 0),
                                       "ts_us": lo[before > 0],
                                       "end_us": first[before > 0]})], ignore_index=True)
    sync_step, sync_ts, sync_end = _clipped(trace.runtime, ranges, _named(trace.runtime, SYNC))
    sync_end = np.minimum(sync_end, np.where(seen, last, start)[sync_step])
    sync_ts = np.maximum(sync_ts, lo[sync_step])
    gs, gt, ge = (g[c].to_numpy() for c in ("group", "ts_us", "end_us"))
    ok = sync_end > sync_ts
    syncs = _length(sync_step[ok], sync_ts[ok], sync_end[ok], n)
    idle_sync = (_length(gs.astype(np.int64), gt, ge, n) + syncs
                 - _length(np.r_[gs, sync_step[ok]].astype(np.int64), np.r_[gt, sync_ts[ok]],
                           np.r_[ge, sync_end[ok]], n))
    host = _host(trace, ranges)
    launch_step = _containing(ranges, trace.runtime["ts_us"].to_numpy(np.float64)[
        _named(trace.runtime, LAUNCH)])
    launches = np.bincount(launch_step[launch_step >= 0], minlength=n)
    non_comm = _length(s[~comm], ts[~comm], end[~comm], n)
    t = pd.DataFrame({
        "step": ranges["name"].to_numpy(), "wall_us": ranges["end_us"].to_numpy() - start,
        "busy_us": busy, "kernel_us": _length(s[compute], ts[compute], end[compute], n),
        "memcpy_us": _length(s[copy], ts[copy], end[copy], n),
        "comm_us": _length(s[comm], ts[comm], end[comm], n),
        "idle_us": window - busy, "idle_before_us": before, "idle_between_us": between,
        "idle_sync_us": np.maximum(idle_sync, 0.0), "host_us": host, "launches": launches,
    })
    t["verdict"], t["evidence"] = _verdicts(t, busy - non_comm)
    return t[list(STEP_COLUMNS)].astype(STEP_COLUMNS)


def _host(trace: Trace, ranges: pd.DataFrame) -> np.ndarray:
    """Per step, the union of its cpu ops and runtime calls minus the syncs in them:
    |A \\ S| = |A ∪ S| - |S|."""
    n = len(ranges)
    parts = [_clipped(trace.cpu_ops, ranges), _clipped(trace.runtime, ranges)]
    sync = _clipped(trace.runtime, ranges, _named(trace.runtime, SYNC))
    group, start, end = (np.concatenate(x) for x in zip(*parts, sync, strict=True))
    return _length(group, start, end, n) - _length(*sync, n)


def _verdicts(t: pd.DataFrame, exposed_comm: np.ndarray) -> tuple[list[str], list[str]]:
    """The verdict and its evidence sentence per step (step_table's docstring has the rule)."""
    verdicts, evidence = [], []
    for r, comm in zip(t.itertuples(), exposed_comm, strict=True):  # one per step
        if r.idle_us > r.busy_us:
            verdicts.append("launch-bound")
            evidence.append(
                f"device idle {_ms(r.idle_us)} of {_ms(r.idle_us + r.busy_us)} "
                f"({_ms(r.idle_before_us)} before the first kernel, {_ms(r.idle_between_us)} "
                f"between kernels, {_ms(r.idle_sync_us)} of it at host syncs), "
                f"busy {_ms(r.busy_us)}, while the host spent {_ms(r.host_us)} issuing "
                f"{r.launches} launches")
        elif comm > r.busy_us - comm:
            verdicts.append("communication-bound")
            evidence.append(f"collectives not overlapped by compute {_ms(comm)} of "
                            f"{_ms(r.busy_us)} busy ({100 * comm / r.busy_us:.0f}%)")
        else:
            verdicts.append("device-bound")
            window = r.idle_us + r.busy_us
            share = f" ({100 * r.busy_us / window:.0f}%)" if window > 0 else ""
            evidence.append(f"device busy {_ms(r.busy_us)} of {_ms(window)}{share}, idle "
                            f"{_ms(r.idle_us)}, collectives not overlapped {_ms(comm)}")
    return verdicts, evidence


def _ms(us: float) -> str:
    return f"{us / 1e3:.3g} ms" if abs(us) >= 999.5 else f"{us:.3g} µs"


def step_summary(table: pd.DataFrame) -> dict[str, object]:
    """The steps' count, verdicts (count each) and min / median / max of wall, busy and idle."""
    out: dict[str, object] = {"steps": len(table),
                              "verdicts": {str(k): int(v) for k, v in
                                           table["verdict"].value_counts(sort=False).items()}}
    for col in ("wall_us", "busy_us", "idle_us"):
        v = table[col]
        out[col] = {"min": float(v.min()), "median": float(v.median()), "max": float(v.max())}
    return out


# -------------------------------------------------------------------------------- headroom
def headroom(operators: pd.DataFrame, steps: pd.DataFrame, costed: pd.DataFrame,
             trace: Trace) -> pd.DataFrame:
    """Per operator (`operators`: roofline.place's table, its rows over all layers) and per
    step (`steps`: step_table's) the measured time, the time at the roof and what is lost
    (HEADROOM_COLUMNS), ranked by lost time.

    An operator's time at its roof is its costed time x its % of roof (FLOPs over the peak,
    or bytes over the bandwidth, or bus bytes over the link, as roofline.place_rows placed it)
    plus its uncosted time as measured; an operator above its roof loses nothing. A step's
    kernels lose Σ (each instance's time x (1 - its operator's at-roof / measured)); the step
    at its roof is wall minus that loss (at most busy): wall - (busy - Σ at roof) where its
    kernels do not overlap. With no idle time the step takes busy."""
    ops = operators[operators["layer"].isna()]
    costed_us = ops["costed_time_us"].to_numpy(np.float64)
    at_roof = costed_us * ops["pct_of_roof"].to_numpy(np.float64) / 100.0
    measured = ops["time_us"].to_numpy(np.float64)
    at_roof = np.minimum(np.where(np.isnan(at_roof), costed_us, at_roof)
                         + (measured - costed_us), measured)
    op = pd.DataFrame({"scope": "operator", "name": ops["operator"].to_numpy(),
                       "phase": ops["phase"].to_numpy(), "measured_us": measured,
                       "at_roof_us": at_roof, "lost_us": measured - at_roof,
                       "no_idle_us": np.nan})
    ratio = pd.Series(np.where(measured > 0, at_roof / np.where(measured > 0, measured, 1.0),
                               1.0), index=pd.MultiIndex.from_arrays(
        [op["phase"].astype(object), op["name"].astype(object)]))
    key = pd.MultiIndex.from_arrays([costed["phase"].astype(object),
                                     costed["operator"].astype(object)])
    inst_ratio = ratio[~ratio.index.duplicated()].reindex(key).fillna(1.0).to_numpy()
    step = _instance_steps(trace, costed)
    keep = step >= 0
    time = costed["time_us"].to_numpy(np.float64)[keep]
    lost = np.bincount(step[keep], weights=time * (1.0 - inst_ratio[keep]), minlength=len(steps))
    wall, busy = steps["wall_us"].to_numpy(), steps["busy_us"].to_numpy()
    at_step = wall - np.minimum(busy, lost)
    st = pd.DataFrame({"scope": "step", "name": steps["step"].to_numpy(), "phase": None,
                       "measured_us": wall, "at_roof_us": at_step, "lost_us": wall - at_step,
                       "no_idle_us": busy})
    parts = []
    for part in (op, st):
        part = part.sort_values("lost_us", ascending=False, kind="stable")
        parts.append(part.assign(rank=np.arange(1, len(part) + 1)))
    return pd.concat(parts, ignore_index=True)[list(HEADROOM_COLUMNS)].astype(HEADROOM_COLUMNS)


def _instance_steps(trace: Trace, costed: pd.DataFrame) -> np.ndarray:
    """Per costed instance, its step (as step_table numbers them): the step of the device row
    at its first kernel's start; -1 for none."""
    of_row = pd.Series(device_steps(trace, step_ranges(trace, costed)),
                       index=trace.device["ts_us"].to_numpy())
    of_row = of_row[~of_row.index.duplicated()]
    return of_row.reindex(costed["ts_us"].to_numpy()).fillna(-1).to_numpy(np.int64)
