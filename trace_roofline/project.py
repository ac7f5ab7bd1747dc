"""What-if projection: one analysed trace's step at another batch, context, tokens, depth or GPU.

Each operator's FLOPs and bytes are recomputed at the new shape from the model's formulas
(model/formulas.py: a linear's 2·M·K·N, attention's pairs), its time from what it achieved in
the trace, and the step is the larger of the host time the trace showed and the device time.
The rules are returned with the numbers (`Projection.assumptions`); docs/project.md says where
the projection holds on the committed H100 sweep and where it does not.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import product
from typing import Any, cast

import numpy as np
import pandas as pd

from trace_roofline.errors import InputError
from trace_roofline.model import formulas
from trace_roofline.model.hardware import Hardware
from trace_roofline.model.models import ModelSpec, expected_linears
from trace_roofline.model.operators import Name
from trace_roofline.roofline import Analysis
from trace_roofline.roofline.placement import main_dtype, peak_for
from trace_roofline.trace import Trace

# torch.profiler's host cost per recorded CPU op or CUDA runtime call (µs): the median of
# docs/profiler_overhead.py's loops on an H100 host, torch 2.11
# (sample_traces/provenance/profiler_overhead_h100.json); taken out of the profiled host time.
PROFILER_EVENT_US = 1.7
# A kernel's device time that does not shrink with its work (launch, ramp-up, tail), µs: an
# operator's time per kernel up to this is latency, the rest throughput (`_classes`).
KERNEL_LATENCY_US = 2.5
# CUDA runtime calls that block the host until the device catches up: their time is the
# device's, not the host's (`host_time_us`).
SYNC_CALLS = r"Synchronize|cudaMemcpy(?!Async)|cudaStreamWaitEvent"
# An operator whose time beyond its kernels' latency is under this share of its time tells
# little of its throughput: it takes the trace's efficiency over the other operators instead.
THROUGHPUT_SHARE = 0.5

# One row per projected point (Projection.points).
POINT_COLUMNS = {
    "batch": "int64", "context": "int64", "tokens": "int64", "layers": "int64",
    "hardware": "str",
    "step_ms": "float64", "device_ms": "float64", "host_ms": "float64",
    "bound": "str",  # host|device: which one sets the step
    "tokens_per_s": "float64",  # batch x tokens per step time
    "flops": "float64", "bytes": "float64",
    "intensity": "float64",  # whole model: ΣFLOPs / Σbytes
    "dominant": "str", "dominant_share": "float64",  # the operator with most device time
    "crossed": "str",  # operators in another regime than at the measured point
    "measured": "bool",
}
# One row per (point, operator) (Projection.operators): the stacked bars.
OPERATOR_COLUMNS = {"point": "int64", "operator": "str", "flops": "float64",
                    "bytes": "float64", "time_us": "float64", "bound": "str"}


@dataclass(frozen=True)
class Point:
    """A step shape: `batch` sequences, each with `context` cached keys and `tokens` new tokens
    (1 in decode, the prompt length in prefill), through `layers` decoder layers (None: as
    traced) on `hardware` (None: the trace's)."""

    batch: int
    context: int
    tokens: int
    layers: int | None = None
    hardware: Hardware | None = None


@dataclass(frozen=True)
class Projection:
    """Projected steps (`points`, POINT_COLUMNS, sorted, the measured one marked), their operators
    (`operators`, OPERATOR_COLUMNS), where each linear and attention crosses the ridge
    (`crossings`) and the rules the numbers follow (`assumptions`)."""

    trace: str
    phase: str
    points: pd.DataFrame
    operators: pd.DataFrame
    crossings: pd.DataFrame
    assumptions: tuple[str, ...]


def measured_point(analysis: Analysis) -> Point:
    """The traced step's shape: batch, tokens and context (keys before the step) from its
    attention calls, the traced layers, the analysis's hardware."""
    rows = _phase_rows(analysis)[0]
    attn = rows[rows["cost_kind"].eq(Name.ATTENTION) & rows["B"].notna()]
    if attn.empty:
        raise InputError(f"{analysis.trace}: no attention call with shapes: the step's batch "
                         "and context are unknown, nothing to project from")
    b, t, s = (int(attn[c].median()) for c in ("B", "T", "S"))
    return Point(b, s - t, t, _traced_layers(rows), analysis.hardware)


@dataclass(frozen=True)
class Sweep:
    """The values a projection's grid combines (`grid`); one not given is the measured point's."""

    batch: Sequence[int] | None = None
    context: Sequence[int] | None = None
    tokens: Sequence[int] | None = None
    layers: int | None = None
    hardware: Sequence[Hardware] | None = None


def grid(analysis: Analysis, sweep: Sweep) -> list[Point]:
    """Every combination of the values of `sweep`, the measured point's where one is not given."""
    m = measured_point(analysis)
    return [Point(b, c, t, sweep.layers or m.layers, h) for h, b, c, t in product(
        sweep.hardware or [cast(Hardware, m.hardware)], sweep.batch or [m.batch],
        sweep.context or [m.context], sweep.tokens or [m.tokens])]


def project(analysis: Analysis, points: Sequence[Point] | None = None, *,
            trace: Trace | None = None, host_us: float | None = None,
            sweep: Sweep = Sweep()) -> Projection:
    """The step of `analysis` (its phase with most device time, per forward pass) at each of
    `points` (default: the `grid` of `sweep`) and at the measured point, marked. The host time
    per step is `host_us`, else the profiled step's in `trace` less the profiler's cost
    (`host_time_us`), else none (the step is its device time)."""
    model = analysis.model
    if model is None:
        raise InputError(f"{analysis.trace}: projection needs `model` (the layout it "
                         "recomputes FLOPs and bytes from)", "model")
    rows, phase, passes = _phase_rows(analysis)
    m = measured_point(analysis)
    if m.hardware is None and (points is None and not sweep.hardware
                               or any(p.hardware is None for p in points or [])):
        raise InputError(f"{analysis.trace}: the trace names no GPU this tool knows: pass "
                         "`hardware`", "hardware")
    wanted = list(points) if points is not None else grid(analysis, sweep)
    for p in wanted:
        _check(p)
    host, host_note = _host(trace, passes, host_us)
    costed = rows[rows["flops"].notna()]
    classes, default_eff = _classes(costed, cast(Hardware, m.hardware), passes)
    fixed = rows[rows["flops"].isna()].groupby("operator")["time_us"].sum() / passes
    traced = _Traced(costed, classes, default_eff, fixed, model, m, passes)
    done: list[dict] = []
    ops: list[pd.DataFrame] = []
    seen: set[tuple] = set()
    for p in [m, *wanted]:
        p = dataclasses.replace(p, layers=p.layers or m.layers, hardware=p.hardware or m.hardware)
        key = (p.batch, p.context, p.tokens, p.layers, cast(Hardware, p.hardware).name)
        if key in seen:
            continue
        seen.add(key)
        per_op = _operators(traced, p)
        done.append(_summary(per_op, p, m, host, first=not done))
        ops.append(per_op.assign(point=len(done) - 1))
    table = pd.DataFrame(done)
    table["crossed"] = _crossed(ops)
    order = table.sort_values(["hardware", "layers", "batch", "context", "tokens"],
                              kind="stable").index
    operators = pd.concat(ops, ignore_index=True)[list(OPERATOR_COLUMNS)]
    operators["point"] = operators["point"].map(pd.Series(np.arange(len(order)), index=order))
    table = table.loc[order].reset_index(drop=True)
    return Projection(
        trace=analysis.trace, phase=phase,
        points=table[list(POINT_COLUMNS)].astype(POINT_COLUMNS),
        operators=operators.astype(OPERATOR_COLUMNS),
        crossings=_crossings(costed, model, m, {p.hardware.name: p.hardware for p in
                                                [m, *wanted] if p.hardware is not None},
                             analysis.conventions),
        assumptions=_assumptions(host_note, default_eff, float(fixed.sum()), phase, passes))


def _check(p: Point) -> None:
    for name in ("batch", "tokens"):
        if getattr(p, name) < 1:
            raise InputError(f"`{name}` must be >= 1, got {getattr(p, name)}", name)
    if p.context < 0:
        raise InputError(f"`context` must be >= 0, got {p.context}", "context")
    if p.layers is not None and p.layers < 1:
        raise InputError(f"`layers` must be >= 1, got {p.layers}", "layers")


def _phase_rows(analysis: Analysis) -> tuple[pd.DataFrame, str, int]:
    """The costed instances of the phase with most device time, the phase, its passes."""
    if not analysis.whole_by_phase:
        raise InputError(f"{analysis.trace}: no kernels to project from")
    phase = max(analysis.whole_by_phase,
                key=lambda p: cast(float, analysis.whole_by_phase[p].get("time_us", 0.0)))
    rows = analysis.costed[analysis.costed["phase"] == phase]
    return rows, phase, max(int(rows["step"].nunique()), 1)


def _traced_layers(rows: pd.DataFrame) -> int:
    """Decoder layers in the trace (distinct `layer`, else attention calls per pass)."""
    n = int(rows["layer"].nunique())
    if n:
        return n
    attn = rows["cost_kind"].eq(Name.ATTENTION)
    return max(round(int(attn.sum()) / max(int(rows["step"].nunique()), 1)), 1)


# ------------------------------------------------------------------------------ host time
def host_time_us(trace: Trace) -> tuple[float, int, float]:
    """(host µs, recorded events, profiled host µs) of the trace's steps, summed. A step's
    profiled host time runs from its start (its ProfilerStep; without one, the first CPU op) to
    the end of its last CUDA runtime call, less the calls that wait for the device
    (synchronisations, `SYNC_CALLS`); its host time is that less PROFILER_EVENT_US per CPU op
    and runtime call recorded in it."""
    ann = trace.annotations
    steps = ann[ann["name"].astype(str).str.startswith("ProfilerStep#")
                & ~ann["cat"].astype(str).str.startswith("gpu_")]
    rt, ops = trace.runtime, trace.cpu_ops
    if rt.empty or ops.empty:
        return 0.0, 0, 0.0
    if steps.empty:
        start = np.array([ops["ts_us"].min()])
        end = np.array([(rt["ts_us"] + rt["dur_us"]).max()])
    else:
        start = steps["ts_us"].to_numpy(float)
        end = start + steps["dur_us"].to_numpy(float)
    rt_ts, rt_end = rt["ts_us"].to_numpy(float), (rt["ts_us"] + rt["dur_us"]).to_numpy(float)
    waits = rt["name"].astype(str).str.contains(SYNC_CALLS).to_numpy()
    op_ts = ops["ts_us"].to_numpy(float)
    wall, events = 0.0, 0
    for s0, s1 in zip(start, end, strict=True):
        inside = (rt_ts >= s0) & (rt_ts < s1)
        if not inside.any():
            continue
        last = float(rt_end[inside].max())
        wall += last - s0 - float((rt_end - rt_ts)[inside & waits].sum())
        events += int(inside.sum()) + int(((op_ts >= s0) & (op_ts < last)).sum())
    return max(wall - events * PROFILER_EVENT_US, 0.0), events, wall


def _host(trace: Trace | None, passes: int, host_us: float | None) -> tuple[float, str]:
    """Host µs per forward pass and how it was found."""
    if host_us is not None:
        if not host_us >= 0:
            raise InputError(f"`host_ms` must be >= 0, got {host_us / 1e3}", "host_ms")
        return host_us, f"host time {host_us / 1e3:.2f} ms per step, as given"
    if trace is None:
        return 0.0, "no host time (no trace given): the step is its device time"
    host, events, wall = host_time_us(trace)
    if events == 0:
        return 0.0, "no host time (the trace records no CPU ops): the step is its device time"
    per = host / passes
    return per, (f"host time {per / 1e3:.2f} ms per step: the profiled host wall "
                 f"({wall / 1e3:.2f} ms) less {PROFILER_EVENT_US:g} µs per recorded CPU op and "
                 f"runtime call ({events}; torch.profiler's cost per event, "
                 "sample_traces/provenance/profiler_overhead_h100.json), over "
                 f"{passes} pass(es); the same at every shape (eager host work does not "
                 "depend on it), scaled with layers")


# ------------------------------------------------------------------------------ device time
def _roof_us(flops: pd.Series, nbytes: pd.Series, dtype: pd.Series, hw: Hardware,
             main: str | None) -> np.ndarray:
    """Each instance's time at its roof, µs: max(FLOPs / peak of its dtype, bytes / bandwidth)."""
    codes, uniq = pd.factorize(dtype.astype(object).where(dtype.notna(), None),
                               use_na_sentinel=False)
    peaks = np.array([peak_for(hw, d, main) for d in uniq], dtype=float)[codes]
    return np.maximum(flops.to_numpy(float) / peaks,
                      nbytes.to_numpy(float) / hw.mem_bandwidth) * 1e6


def _classes(costed: pd.DataFrame, hw: Hardware, passes: int
             ) -> tuple[pd.DataFrame, float]:
    """Per operator, per pass: kernels, efficiency and latency µs per kernel. The efficiency is
    its time at the roof over its time beyond KERNEL_LATENCY_US per kernel (at most its time
    per kernel), at most 1; an operator with under THROUGHPUT_SHARE of its time beyond that
    takes the default: the same ratio over the others (1 where there are none). The latency is
    then what its measured time leaves beyond the roof at that efficiency, so the measured
    point is reproduced."""
    roof = _roof_us(costed["flops"], costed["bytes"], costed["dtype"], hw, main_dtype(costed))
    g = costed.assign(roof=roof).groupby("operator")
    c = pd.DataFrame({"time": g["time_us"].sum(), "kernels": g["kernels"].sum(),
                      "roof": g["roof"].sum()}) / passes
    c["latency"] = np.minimum(KERNEL_LATENCY_US, c["time"] / c["kernels"].where(c["kernels"] > 0))
    c["latency"] = c["latency"].fillna(0.0)
    rest = c["time"] - c["kernels"] * c["latency"]
    own = rest >= THROUGHPUT_SHARE * c["time"]
    default = float(min(c.loc[own, "roof"].sum() / rest[own].sum(), 1.0)) if own.any() else 1.0
    c["efficiency"] = np.where(own & (c["roof"] > 0), np.minimum(c["roof"] / rest.where(own), 1.0),
                               default)
    # the latency is what the measured time leaves beyond the roof at that efficiency
    c["latency"] = (np.maximum(c["time"] - c["roof"] / c["efficiency"], 0.0)
                    / c["kernels"].where(c["kernels"] > 0)).fillna(0.0)
    return c, default


def _scaled(costed: pd.DataFrame, model: ModelSpec, m: Point, p: Point
            ) -> tuple[pd.Series, pd.Series]:
    """Each instance's FLOPs and bytes at point `p` (per pass as traced): linears and attention
    through the formulas at the new shape (the ratio to the traced shape's, so the trace's cost
    conventions carry over), a whole-cache copy with batch x keys, the rest with tokens; per-layer
    instances with layers."""
    tok = (p.batch * p.tokens) / (m.batch * m.tokens)
    f = pd.Series(tok, index=costed.index, dtype=float)
    fb = f.copy()
    linears = expected_linears(model)
    bias = {k: v[2] for k, v in {**model.linears(), **model.fused_linears()}.items()}
    lin = costed["cost_kind"].eq("gemm") & costed["operator"].isin(list(linears)) \
        & costed["M"].notna()
    if lin.any():
        r = costed[lin]
        per_seq = (r["operator"].eq(Name.LM_HEAD) & (m.tokens > 1) & r["M"].eq(m.batch)).to_numpy()
        new_m = np.where(per_seq, p.batch, np.maximum(np.rint(r["M"].to_numpy(float) * tok), 1))
        shapes = pd.DataFrame({"m": r["M"].astype(int).to_numpy(), "new": new_m.astype(int),
                               "k": r["K"].astype(int).to_numpy(), "n": r["N"].astype(int).to_numpy(),
                               "bias": r["operator"].map(bias).fillna(False).astype(bool).to_numpy()})
        ratio = _per_distinct(shapes, lambda s: (
            formulas.gemm_flops(s.new, s.k, s.n, s.bias) / formulas.gemm_flops(s.m, s.k, s.n, s.bias),
            formulas.gemm_bytes(s.new, s.k, s.n, 1.0, s.bias)
            / formulas.gemm_bytes(s.m, s.k, s.n, 1.0, s.bias)))
        f[lin], fb[lin] = ratio[:, 0], ratio[:, 1]
    attn = costed["cost_kind"].eq(Name.ATTENTION) & costed["B"].notna() & costed["n_q"].notna()
    if attn.any():
        r = costed[attn]
        shapes = pd.DataFrame({c: r[c].astype(int).to_numpy() for c in
                               ("B", "T", "S", "n_q", "n_kv", "head_dim")})
        shapes["causal"] = np.where(r["causal"].fillna(True).astype(bool), "causal", "full")
        new_b = np.maximum(np.rint(shapes["B"] * p.batch / m.batch), 1).astype(int)
        shapes = shapes.assign(nb=new_b, nt=p.tokens, ns=p.context + p.tokens)

        def attention(s: Any) -> tuple[float, float]:
            def cost(b: int, t: int, k: int) -> tuple[float, float]:
                a = formulas.AttentionShape(s.n_q, s.n_kv, t, k, s.head_dim, batch=b,
                                            causal=s.causal)
                return formulas.attention_flops(a), formulas.attention_bytes(a, 1.0)
            new, old = cost(s.nb, s.nt, s.ns), cost(s.B, s.T, s.S)
            return new[0] / old[0], new[1] / old[1]

        ratio = _per_distinct(shapes, attention)
        f[attn], fb[attn] = ratio[:, 0], ratio[:, 1]
    cache = costed["operator"].eq(Name.KV_CACHE) & (
        costed["bytes"] >= 1.9 * m.batch * (m.context + m.tokens) * model.kv_size
        * model.bytes_per_element)
    keys = (p.batch * (p.context + p.tokens)) / (m.batch * (m.context + m.tokens))
    f[cache], fb[cache] = keys, keys
    depth = np.where(costed["layer"].notna(), cast(int, p.layers) / cast(int, m.layers), 1.0)
    return costed["flops"] * f * depth, costed["bytes"] * fb * depth


def _per_distinct(shapes: pd.DataFrame, fn: Callable[[Any], tuple[float, float]]
                  ) -> np.ndarray:
    """fn(row) -> (a, b) once per distinct row of `shapes`, as an [n, 2] array in row order."""
    codes, uniq = pd.MultiIndex.from_frame(shapes).factorize()
    rows = pd.DataFrame(list(uniq), columns=shapes.columns)
    values = [fn(r) for r in rows.itertuples(index=False)]
    return np.array(values, dtype=float).reshape(-1, 2)[codes]


@dataclass(frozen=True)
class _Traced:
    """What every projected point is scaled from: the phase's costed instances, their operators'
    latency and efficiency (`_classes`, `default_eff` for the rest), the uncosted time per
    operator and pass (`fixed`), the model, the measured point (`m`) and its passes."""

    costed: pd.DataFrame
    classes: pd.DataFrame
    default_eff: float
    fixed: pd.Series
    model: ModelSpec
    m: Point
    passes: int


def _operators(traced: _Traced, p: Point) -> pd.DataFrame:
    """Per operator at point `p`, per pass: FLOPs, bytes, time (kernels x latency + time at
    the roof / efficiency, `_classes`) and bound; uncosted time as traced (with layers)."""
    costed, classes, fixed, m = traced.costed, traced.classes, traced.fixed, traced.m
    default_eff, passes = traced.default_eff, traced.passes
    hw = cast(Hardware, p.hardware)
    flops, nbytes = _scaled(costed, traced.model, m, p)
    roof = _roof_us(flops, nbytes, costed["dtype"], hw, main_dtype(costed))
    g = pd.DataFrame({"operator": costed["operator"].to_numpy(), "flops": flops.to_numpy(),
                      "bytes": nbytes.to_numpy(), "roof": roof}).groupby("operator").sum() / passes
    c = classes.reindex(g.index)
    depth = cast(int, p.layers) / cast(int, m.layers)
    g["time_us"] = c["kernels"] * c["latency"] + g["roof"] / c["efficiency"].fillna(default_eff)
    extra = fixed.reindex(g.index.union(fixed.index), fill_value=0.0) * depth
    g = g.reindex(extra.index, fill_value=0.0)
    g["time_us"] += extra
    ridge = peak_for(hw, main_dtype(costed)) / hw.mem_bandwidth
    intensity = g["flops"] / g["bytes"].where(g["bytes"] > 0)
    g["bound"] = np.where(intensity.isna(), "", np.where(intensity >= ridge, "compute", "memory"))
    return g.reset_index()


def _summary(ops: pd.DataFrame, p: Point, m: Point, host: float, first: bool) -> dict:
    """One point's row of Projection.points (without `crossed`)."""
    device = float(ops["time_us"].sum())
    host_p = host * cast(int, p.layers) / cast(int, m.layers)
    step = max(device, host_p)
    top = ops.loc[ops["time_us"].idxmax()]
    flops, nbytes = float(ops["flops"].sum()), float(ops["bytes"].sum())
    return {"batch": p.batch, "context": p.context, "tokens": p.tokens, "layers": p.layers,
            "hardware": cast(Hardware, p.hardware).name, "step_ms": step / 1e3,
            "device_ms": device / 1e3, "host_ms": host_p / 1e3,
            "bound": "device" if device >= host_p else "host",
            "tokens_per_s": p.batch * p.tokens / (step * 1e-6) if step > 0 else math.nan,
            "flops": flops, "bytes": nbytes, "intensity": flops / nbytes if nbytes else math.nan,
            "dominant": str(top["operator"]),
            "dominant_share": float(top["time_us"]) / device if device else math.nan,
            "measured": first}


def _crossed(ops: list[pd.DataFrame]) -> list[str]:
    """Per point, the operators whose bound differs from the measured point's ("q_proj
    memory->compute")."""
    base = ops[0].set_index("operator")["bound"]
    out = []
    for o in ops:
        b = o.set_index("operator")["bound"]
        diff = b[(b != base.reindex(b.index)) & (b != "") & base.reindex(b.index).ne("")]
        out.append(", ".join(f"{op} {base[op]}->{new}" for op, new in diff.items()))
    return out


def _crossings(costed: pd.DataFrame, model: ModelSpec, m: Point, hws: dict[str, Hardware],
               conventions: dict[str, str]) -> pd.DataFrame:
    """Per hardware and traced linear: M* (tokens in flight where it turns compute-bound) and
    the batch that gives at the measured tokens per sequence; attention's S* (the prefill
    length where it turns compute-bound)."""
    b = model.bytes_per_element
    gemms = costed[costed["cost_kind"].eq("gemm")
                   & costed["operator"].isin(list(expected_linears(model)))]
    shapes = gemms.drop_duplicates("operator")
    bias = {k: v[2] for k, v in {**model.linears(), **model.fused_linears()}.items()}
    rows = []
    dtype = main_dtype(costed)
    for name, hw in hws.items():
        ridge = peak_for(hw, dtype) / hw.mem_bandwidth
        for r in shapes.itertuples(index=False):
            ms = formulas.m_star(int(r.K), int(r.N), b, ridge, bias.get(str(r.operator), False))
            rows.append({"hardware": name, "operator": r.operator, "m_star": ms,
                         "batch_star": math.ceil(ms / m.tokens) if ms else None, "s_star": None})
        if costed["cost_kind"].eq(Name.ATTENTION).any():
            heads = formulas.AttentionShape(
                model.num_heads, model.num_kv_heads, 0, 0, model.head_dim,
                causal=cast(formulas.Causal, conventions.get("causal", "causal")))
            s = formulas.s_star(heads, b, ridge, cast(formulas.AttentionBytes,
                                                      conventions.get("attention_bytes", "all")))
            rows.append({"hardware": name, "operator": Name.ATTENTION, "m_star": None,
                         "batch_star": None, "s_star": s})
    return pd.DataFrame(rows, columns=["hardware", "operator", "m_star", "batch_star", "s_star"]
                        ).astype({"m_star": "Int64", "batch_star": "Int64", "s_star": "Int64"})


def _assumptions(host_note: str, default_eff: float, uncosted_us: float, phase: str,
                 passes: int) -> tuple[str, ...]:
    return (
        f"the {phase} phase, per forward pass ({passes} in the trace)",
        "FLOPs and bytes from the model's formulas at the new shape: linears 2·M·K·N with "
        "M = batch x tokens (lm_head per sequence where the trace computes it per sequence); "
        "attention from batch, tokens and keys = context + tokens (the analysis's causal and "
        "attention-bytes conventions); a KV-cache op copying the whole cache (HF DynamicCache's "
        "cat) with batch x keys; every other operator (norms, RoPE, activation, residual, "
        "embedding, ...) in proportion to batch x tokens; per-layer operators with layers",
        f"time per operator = kernels x latency + max(FLOPs / (e·peak), bytes / (e·bandwidth)): "
        f"e its achieved fraction of its roof in the trace once {KERNEL_LATENCY_US:g} µs per "
        "kernel (or its measured time per kernel, if less) is taken out, the same on either "
        "roof, so an operator changes regime where it crosses the ridge; an operator with "
        f"under {THROUGHPUT_SHARE:.0%} of its time beyond that takes the others' fraction "
        f"({default_eff:.0%}); the latency is what its measured time leaves at that fraction "
        "(the measured point is reproduced)",
        "the traced kernels at every shape: a library choosing other kernels (split-K, tiles, "
        "another attention backend) is not modelled",
        *([f"uncosted time ({uncosted_us:.1f} µs per pass) as traced"] if uncosted_us else []),
        host_note,
        "step time = max(host time, device time): the device runs back to back when it is "
        "slower, else the host sets the pace; on another GPU the achieved fractions, latency "
        "and host are the trace's",
    )


# ------------------------------------------------------------------------------ outputs
def swept(points: pd.DataFrame) -> str:
    """The column the points vary over (batch, context, tokens, layers, hardware), the first
    that varies; batch when none does."""
    return next((c for c in ("batch", "context", "tokens", "layers", "hardware")
                 if points[c].nunique() > 1), "batch")


def to_json(projection: Projection) -> dict[str, object]:
    """The projection as JSON-ready data: points (their operators' times under `operators`),
    crossings and assumptions."""
    ops = projection.operators
    points = []
    for i, row in projection.points.iterrows():
        own = ops[ops["point"] == i]
        point = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in row.items()}
        point["operators"] = {str(o): round(float(t), 3) for o, t in
                              zip(own["operator"], own["time_us"], strict=True)}
        points.append(point)
    crossings = projection.crossings.astype(object).where(projection.crossings.notna(), None)
    return {"trace": projection.trace, "phase": projection.phase, "points": points,
            "crossings": crossings.to_dict("records"),
            "assumptions": list(projection.assumptions)}


def format_projection(projection: Projection) -> str:
    """The points as a terminal table, the ridge crossings, then the assumptions."""
    p = projection.points
    lines = [f"trace {projection.trace}   phase {projection.phase} (per forward pass)",
             f"{'batch':>6} {'context':>8} {'tokens':>7} {'layers':>6} {'hardware':<14}"
             f"{'step ms':>9} {'device ms':>10} {'host ms':>8} {'bound':<7}{'tokens/s':>10} "
             f"{'FLOP/B':>7}  dominant"]
    for r in p.itertuples(index=False):
        mark = "  (measured)" if r.measured else ""
        crossed = f"; crossed: {r.crossed}" if r.crossed else ""
        lines.append(f"{r.batch:>6} {r.context:>8} {r.tokens:>7} {r.layers:>6} "
                     f"{r.hardware:<14}{r.step_ms:>9.2f} {r.device_ms:>10.2f} {r.host_ms:>8.2f} "
                     f"{r.bound:<7}{r.tokens_per_s:>10.4g} {r.intensity:>7.1f}  {r.dominant} "
                     f"{100 * r.dominant_share:.0f}%{crossed}{mark}")
    c = projection.crossings
    if len(c):
        lines.append("ridge crossings (compute-bound from):")
        for hw, g in c.groupby("hardware", sort=False):
            parts = [f"{r.operator} M*={r.m_star} (batch {r.batch_star})" if pd.notna(r.m_star)
                     else f"{r.operator} (prefill) S*={r.s_star}" if pd.notna(r.s_star)
                     else f"{r.operator} never" for r in g.itertuples(index=False)]
            lines.append(f"  {hw}: " + ", ".join(parts))
    lines.append("assumptions:")
    lines += [f"  - {a}" for a in projection.assumptions]
    return "\n".join(lines)
