"""Reports of one or more analysed traces: terminal text, report.json, markdown, and the bytes of
every output file.

Design notes: docs/design.md ("trace_roofline/outputs/report.py").
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from typing import SupportsFloat, cast

import pandas as pd

from trace_roofline.costs.calculator import si  # noqa: F401 (report.si: the units of every text output)
from trace_roofline.costs.crosscheck import describe
from trace_roofline.roofline import Analysis, hardware_summary, operators_frame, split_part
from trace_roofline.steptime import step_summary

SCHEMA_VERSION = 2
# Analysis column -> output name where the output's scale differs (percent -> fraction).
_RENAMED = {"pct_of_roof": "roof_fraction"}

CONVENTION_TEXT = {
    "causal": {"causal": "causal attention counts only unmasked query-key pairs",
               "full": "attention counts every query-key pair (the lesson's count)"},
    "attention_bytes": {"all": "attention bytes = Q, K, V read + O written",
                        "kv": "attention bytes = K, V read only (the lesson's count)"},
}
# Marks an operator above its roof, and what that means.
ABOVE_ROOF = "above roof"
ABOVE_ROOF_NOTE = ("above roof: achieved beats the roof. Memory-bound: the analytical minimum bytes "
                   "exceed the DRAM traffic that moved (reuse served from L2, or bytes counted too "
                   "high); compute-bound: FLOPs counted too high or the peak understated.")
# Keys of each report.json `operators` entry (the contract's first, then extras).
OPERATOR_KEYS = ["operator", "layer", "phase", "kernels", "time_us", "flops", "bytes",
                 "intensity", "achieved_flops_per_s", "achieved_bytes_per_s",
                 "attainable_flops_per_s", "roof_fraction", "bound",
                 "instances", "uncosted", "time_share", "dtype", "peak_flops_per_s",
                 "exceeds_roof", "exceeds_why", "evidence", "evidence_mix", "derivation",
                 "pairs_executed", "pairs_useful", "measured_bytes",
                 "measured_intensity", "experts_active", "experts_active_low",
                 "experts_active_high"]
# The mark after an operator's name in the terminal and report.md tables for each derivation
# but `shape` (costs/shapes.py DERIVATIONS), and the legend's words for it.
DERIVATION_MARKS = {"step": ("ˢ", "step annotation"), "layout": ("ᴸ", "layout"),
                    "kernel": ("ᵏ", "generic kernel estimate"), "unknown": ("ˀ", "unknown")}


def derivation_mark(derivation: object) -> str:
    """The mark of a row's derivation ("" for `shape` or none)."""
    return DERIVATION_MARKS.get(derivation, ("", ""))[0] if isinstance(derivation, str) else ""


def derivation_legend(derivations: pd.Series) -> str | None:
    """'derivation: ᴸ layout, ˢ step annotation (unmarked: the op's recorded shapes)' for the
    marks present in `derivations`; None without any."""
    present = set(derivations.dropna())
    marks = [f"{m} {words}" for d, (m, words) in DERIVATION_MARKS.items() if d in present]
    return (f"derivation: {', '.join(marks)} (unmarked: the op's recorded shapes)"
            if marks else None)


def conventions_line(a: Analysis) -> str:
    c = a.conventions
    return (f"--causal {c['causal']}: {CONVENTION_TEXT['causal'][c['causal']]}; "
            f"--attention-bytes {c['attention_bytes']}: "
            f"{CONVENTION_TEXT['attention_bytes'][c['attention_bytes']]}")


# ----------------------------------------------------------------------------- units
def _missing(x: object) -> bool:
    return x is None or x is pd.NA or (isinstance(x, float) and math.isnan(x))


def duration(us: object) -> str:
    """A time given in µs, in µs, ms or s: 115.1 µs, 2.315 ms, 1.5 s; '-' when missing."""
    if _missing(us):
        return "-"
    v = float(cast(SupportsFloat, us))
    for scale, unit in ((1e6, "s"), (1e3, "ms")):
        if abs(v) >= scale * 0.99995:
            return f"{v / scale:.4g} {unit}"
    return f"{v:.4g} µs"


def tenths(v: float) -> str:
    """`v` to one decimal: '<0.1' for a figure that is not zero but rounds to it, never '-0.0'."""
    if v != 0 and abs(v) < 0.05:
        return "<0.1" if v > 0 else ">-0.1"
    return f"{v:.1f}".replace("-0.0", "0.0")


def _pct(x: object) -> str:
    """A fraction (0-1) as a percentage; 'n/a' when missing."""
    return "n/a" if _missing(x) else f"{tenths(100 * float(cast(SupportsFloat, x)))}%"


def _fmt(x: object, fmt: str, scale: float = 1.0) -> str:
    """`x / scale` formatted; '-' for a missing value."""
    return "-" if _missing(x) else format(float(cast(SupportsFloat, x)) / scale, fmt)


# ----------------------------------------------------------------------------- terminal
def terminal_table(analyses: Sequence[Analysis], per_layer: bool = False) -> str:
    """Compact text: per trace, operators by device time, a whole-model line per phase,
    coverage, conventions and hardware; with `per_layer` a block per (phase, layer) after it,
    whose time% is of that layer's device time (each block sums to 100%)."""
    return "\n\n".join(_terminal_one(a, per_layer) for a in analyses)


# (title, width) of each right-aligned terminal column between the phase and the bound
_COLUMNS = (("kern", 5), ("time", 10), ("time%", 6), ("FLOPs", 12), ("bytes", 10),
            ("FLOP/B", 8), ("FLOP/s", 13), ("B/s", 10), ("%roof", 6))
_NCU_COLUMNS = (("ncu bytes", 10), ("ncu/an", 6), ("ncu F/B", 8))


_EVIDENCE_WIDTH = 15


def _head(width: int, measured: bool) -> str:
    return (f"{'operator':<{width}} {'phase':<7} " + " ".join(f"{t:>{w}}" for t, w in _COLUMNS)
            + f" {'bound':<7} {'evidence':<{_EVIDENCE_WIDTH}}"
            + ("".join(f" {t:>{w}}" for t, w in _NCU_COLUMNS) if measured else "")).rstrip()


def share_text(fraction: float) -> str:
    """A share of time as a whole percentage that never rounds a part to nothing or to all:
    1 -> '100%', 0.592 -> '59%', 0.003 -> '<1%', 0.997 -> '>99%'."""
    pct = 100 * fraction
    if 0 < pct < 0.5:
        return "<1%"
    if 99.5 <= pct < 100:
        return ">99%"
    return f"{pct:.0f}%"


def evidence_text(mix: object) -> str:
    """`evidence_mix` ('shape 0.408, position 0.592': each evidence with its fraction of the
    operator's time) as percentages: 'shape 41%, position 59%'; '-' when missing."""
    if not isinstance(mix, str) or not mix:
        return "-"
    parts = []
    for part in mix.split(", "):
        name, _, value = part.rpartition(" ")
        try:
            parts.append(f"{name} {share_text(float(value))}")
        except ValueError:  # not 'name fraction': shown as written
            parts.append(part)
    return ", ".join(parts)


def evidence_cell(evidence: object, mix: object) -> str:
    """The evidence of an operator row: 'annotation', or 'annotation 97%' when other evidence
    named part of its time (`evidence_mix` lists it all)."""
    if not isinstance(evidence, str):
        return "-"
    parts = mix.split(", ") if isinstance(mix, str) else []
    if len(parts) < 2:
        return evidence
    return f"{evidence} {share_text(float(parts[0].rsplit(' ', 1)[1]))}"


def _cells(kernels, time_us, share, flops, nbytes, intensity, fps, bps, roof) -> list[str]:
    return [str(kernels), duration(time_us), "-" if _missing(share) else tenths(
                100 * float(cast(SupportsFloat, share))), si(flops, "FLOP"),
            si(nbytes, "B"), _fmt(intensity, ".2f"), si(fps, "FLOP/s"), si(bps, "B/s"),
            "-" if _missing(roof) else tenths(float(cast(SupportsFloat, roof)))]


def _row(name: str, phase: str, cells: list[str], bound: object, width: int) -> str:
    return (f"{name:<{width}.{width}} {phase:<7.7} "
            + " ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, _COLUMNS, strict=True))
            + f" {bound if isinstance(bound, str) else '-':<7}")


def _op_row(r, width: int, measured: bool, share: object = None) -> str:
    line = _row(r.operator + derivation_mark(r.derivation), r.phase, _cells(r.kernels, r.time_us,
                                            r.time_share if share is None else share, r.flops,
                                            r.bytes, r.intensity, r.achieved_flops_per_s,
                                            r.achieved_bytes_per_s, r.pct_of_roof),
                r.bound, width)
    line += f" {evidence_cell(r.evidence, r.evidence_mix):<{_EVIDENCE_WIDTH}}"
    if measured:
        line += (f" {si(r.measured_bytes, 'B'):>10} {_fmt(r.measured_bytes / r.bytes, '.2f'):>6}"
                 f" {_fmt(r.measured_intensity, '.2f'):>8}")
    return line.rstrip() + (f" ! {ABOVE_ROOF}" if _flagged(r.exceeds_roof) else "")


def _terminal_one(a: Analysis, per_layer: bool) -> str:
    agg = a.operators[a.operators["layer"].isna()].sort_values("time_us", ascending=False,
                                                               kind="stable")
    measured = "measured_intensity" in agg.columns  # ncu DRAM bytes joined
    width = max(20, *a.operators["operator"].astype(str).str.len() + 1) if len(agg) else 20
    lines = [f"trace {a.trace}" + (f"   model {a.model.name}" if a.model else "")
             + (f"   tp {a.tp}" if a.tp is not None else "")
             + ("" if a.kind.decoder else f"   {a.kind.kind.upper()}, NOT A DECODER"),
             *([] if a.kind.decoder else [f"! {a.kind.kind}: {a.kind.why}; no decoder-only "
                                          "name (lm_head, kv_cache, sampling), no prefill or "
                                          "decode phase"]),
             _hardware_line(a), f"conventions: {conventions_line(a)}"]
    shapes = shapes_line(a)
    lines += [shapes] if shapes else []
    if a.model is not None and a.model.assumed:
        lines.append(f"model {a.model.name} read with assumptions: {'; '.join(a.model.assumed)}")
    lines += [models_line(a)] if a.models else []
    lines += [f"! WARNING: {w}" for w in a.warnings]
    lines += [f"note: {n}" for n in a.notes]
    lines += steps_lines(a)
    lines += [_head(width, measured)]
    lines += [_op_row(r, width, measured) for r in agg.itertuples()]
    for phase, w in a.whole_by_phase.items():
        if w.get("withheld"):
            lines.append(f"{'whole model':<{width}} {phase:<7.7} {withheld_text(w)}")
            continue
        lines.append(_row("whole model", phase, _cells(
            w["kernels"], w["time_us"], cast(float, w["time_us"]) / _phase_time(a, phase), w["flops"],
            w["bytes"], w["intensity"], w["achieved_flops_per_s"], w["achieved_bytes_per_s"],
            w.get("pct_of_roof")), w.get("bound"), width).rstrip())
    if legend := derivation_legend(agg["derivation"]):
        lines.append(legend)
    if _flagged(a.operators["exceeds_roof"].any()):
        lines.append(f"! {ABOVE_ROOF_NOTE}")
    lines += _communication_lines(a)
    lines += passes_lines(a) + graphs_lines(a)
    lines.append(_coverage_line(a))
    lines += moe_lines(a)
    if a.ncu is not None:
        lines.append(_ncu_line(a.ncu))
    if note := below_minimum_note(a):
        lines.append(f"! {note}")
    for phase, ext in a.extrapolated_whole.items():
        lines.append(f"extrapolated to {a.layers} layers + embedding/lm_head "
                     f"({phase}, per forward pass): {si(ext['flops'], 'FLOP')}, "
                     f"{si(ext['bytes'], 'B')}, intensity {ext['intensity']:.2f} FLOP/B")
    if per_layer:
        lines += ["", *_per_layer_blocks(a, agg, width, measured)]
    return "\n".join(lines)


def _per_layer_blocks(a: Analysis, agg: pd.DataFrame, width: int, measured: bool) -> list[str]:
    """One block per (phase, layer), rows by time, time% of the layer's device time."""
    rows = a.operators[a.operators["layer"].notna()]
    if rows.empty:
        return ["per layer: no operator was placed in a decoder layer"]
    layers = rows.groupby("phase", sort=False)["layer"].nunique()
    layered = agg[agg["operator"].isin(rows["operator"])]
    if (layers == 1).all() and math.isclose(rows["time_us"].sum(), layered["time_us"].sum()):
        return ["per layer: one decoder layer per phase; its rows are the table above"]
    out = []
    for (phase, layer), g in rows.groupby(["phase", "layer"], sort=False):
        total = g["time_us"].sum()
        phase_time = _phase_time(a, phase) if phase in a.whole_by_phase else None
        out += [f"layer {layer} ({phase}): {duration(total)}, "
                f"{_pct(total / phase_time) if phase_time else 'n/a'} of the phase's device time",
                _head(width, measured)]
        out += [_op_row(r, width, measured, share=r.time_us / total)
                for r in g.sort_values("time_us", ascending=False, kind="stable").itertuples()]
    return out


_ASSUMPTIONS = {
    "counted": "counted from the per-expert GEMMs (a Python loop: exact)",
    "uniform routing": ("expected under uniform routing, E·(1-(1-k/E)^T): the trace does not "
                        "show which experts ran; their weights are charged for that many"),
    "upper bound": ("assumed min(E, ΣM_e), the upper bound: tokens or top-k unknown "
                    "(give --model)"),
}


def moe_lines(a: Analysis) -> list[str]:
    """Per phase with routed experts: the active-expert assumption and the experts' intensity
    next to the dense equivalent's (roofline.moe_summary)."""
    return [line for phase, d in a.moe.items() for line in _moe_phase(phase, d)]


def _moe_phase(phase: str, d: dict) -> list[str]:
    def num(key: str, fmt: str = "g") -> str:
        return "?" if d.get(key) is None else format(d[key], fmt)

    first = (f"experts ({phase}): {d['layers']} MoE layer run(s), {num('tokens')} tokens each, "
             f"top-{num('top_k')} of {num('experts')} experts -> {num('routed_rows')} routed "
             f"rows; active experts {num('experts_active', '.2f')} "
             f"{_ASSUMPTIONS[d['assumption']]}")
    if d["assumption"] != "counted" and d.get("experts_active_low") is not None:
        first += f" (range {num('experts_active_low')}-{num('experts_active_high')})"
    second = (f"  expert GEMMs at {num('experts_intensity', '.2f')} FLOP/B: "
              f"{num('tokens_per_active_expert', '.2f')} tokens per active expert, each "
              "active expert's weights read for only its own tokens")
    if d.get("dense_equivalent_intensity") is not None:
        second += (f"; a dense MLP doing the same FLOPs per token (intermediate top-k x I = "
                   f"{d['top_k'] * d['intermediate']:g}) would sit at "
                   f"{d['dense_equivalent_intensity']:.2f} FLOP/B, its weights read once for all "
                   f"{num('tokens')} tokens")
    return [first, second]


# Measured DRAM bytes below this fraction of the analytical minimum get a note (ncu's counters
# agree with the minimum within about 1% where every tensor does go through DRAM once).
BELOW_MINIMUM = 0.95


def below_minimum_note(a: Analysis) -> str | None:
    """With ncu bytes joined: the operators whose measured DRAM bytes are under the analytical
    minimum (ncu/an < BELOW_MINIMUM), and what that means, in one line; None when there are none."""
    ops = a.operators[a.operators["layer"].isna()]
    if "measured_bytes" not in ops.columns:
        return None
    ratio = ops["measured_bytes"] / ops["bytes"].where(ops["bytes"] > 0)
    low = ops.assign(ratio=ratio)[ratio < BELOW_MINIMUM].sort_values("ratio", kind="stable")
    if low.empty:
        return None
    names = ", ".join(f"{r.operator} ({r.phase}, {r.ratio:.2f}x)" for r in low.itertuples())
    return (f"ncu measured fewer DRAM bytes than the analytical minimum for {names}: the minimum "
            "reads every input and writes every output once through DRAM, so part of this "
            "traffic was served from L2 (a tensor the previous kernel left there): the measured "
            "intensity (ncu F/B) is the one this kernel saw, above the analytical")


def _ncu_line(n: dict) -> str:
    line = (f"ncu {n['file']}: {n['matched']} of {n['trace_kernels']} trace kernels matched "
            f"({n['ncu_kernels']} in the CSV), whole model measured "
            f"{si(n['whole_model_measured_bytes'], 'B')}, "
            f"intensity {_fmt(n['whole_model_measured_intensity'], '.2f')} FLOP/B")
    if n["trace_unmatched"] or n["ncu_unmatched"]:
        line += (f"; WARNING {n['trace_unmatched']} trace / {n['ncu_unmatched']} ncu kernels "
                 "unmatched: is the CSV from the same workload?")
    return line


def _flagged(value: object) -> bool:
    return value is not None and value is not pd.NA and bool(value)


def _hardware_line(a: Analysis) -> str:
    h = hardware_summary(a)
    if h is None:
        return "hardware: none given or known from the trace: intensities only, no placements"
    link = h["link_bandwidth_bytes_per_s"]
    return (f"hardware {h['name']}: {si(h['peak_flops_per_s'], 'FLOP/s')} {h['dtype']}, "
            f"{si(h['bandwidth_bytes_per_s'], 'B/s')}, ridge {h['ridge']:.0f} FLOP/B"
            + (f", link {si(link, 'B/s')} per direction" if link else ""))


# (share of device time, fraction of the link roof) above / below which collectives are flagged
SLOW_COMMUNICATION = (0.25, 0.05)


def _phase_time(a: Analysis, phase: str) -> float:
    """A phase's device time: the whole model's (HBM operators) plus its collectives'."""
    whole = cast(float, a.whole_by_phase[phase]["time_us"])
    return whole + a.communication.get(phase, {}).get("time_us", 0.0)


def _communication_lines(a: Analysis) -> list[str]:
    """Per phase with collectives: their time, exposed time, bus bytes and link fraction,
    outside the whole model."""
    out = []
    for phase, c in a.communication.items():
        link = (f" = {_pct(c['link_fraction'])} of the link roof"
                if not _missing(c["link_fraction"]) else " (no link bandwidth for this hardware)")
        out.append(
            f"communication ({phase}): {c['kernels']} collective kernel(s), "
            f"{duration(c['time_us'])} ({_pct(c['time_share'])} of device time), "
            f"{duration(c['exposed_time_us'])} exposed (not overlapped by compute), "
            f"{si(c['bytes'], 'B')} bus bytes at {si(c['bus_bytes_per_s'], 'B/s')}{link}; "
            "not in the whole model (its roof is the link, not HBM)")
        if c["time_share"] > SLOW_COMMUNICATION[0] and c["link_fraction"] < SLOW_COMMUNICATION[1]:
            out.append(f"! communication ({phase}) takes {_pct(c['time_share'])} of device time "
                       f"at {_pct(c['link_fraction'])} of the link roof: latency-bound small "
                       "messages, or this rank waits in its collectives for a slower one; "
                       "analyse every rank's trace together to tell")
    return out


def _coverage_line(a: Analysis) -> str:
    """'coverage of 612.7 µs device time: 98.4% named with evidence (shape 78.5%, position
    18.4%, ...), 1.6% fallback (other 1.6%); 100.0% costed, 0 uncosted op instance(s)'."""
    c = a.coverage
    total = cast(float, c["kernel_time_us"])

    def parts(d: dict[str, float]) -> str:
        share = {k: v / total for k, v in d.items() if total > 0}
        return ", ".join(f"{k} {_pct(v)}" for k, v in sorted(share.items(), key=lambda kv: -kv[1]))

    by_evidence = cast("dict[str, float]", c["by_evidence"])
    named = {k: v for k, v in by_evidence.items() if k != "fallback"}
    fallback = parts(cast("dict[str, float]", c["fallback_by_operator"]))
    return (f"coverage of {duration(total)} device time: {_pct(c['evidence_fraction'])} named "
            f"with evidence ({parts(named) or 'none'}), {_pct(c['fallback_fraction'])} fallback"
            + (f" ({fallback})" if fallback else "")
            + f"; {_pct(c['costed_fraction'])} costed, {c['uncosted_instances']} uncosted op "
            "instance(s)" + _demoted(a.demoted, total))


def _demoted(c: dict[str, object], total: float) -> str:
    """'; 2.1% demoted by the name contracts (residual 2.1%): named, then shown not to be so'."""
    time = cast(float, c.get("demoted_time_us", 0.0))
    if not time or total <= 0:
        return ""
    by = cast("dict[str, float]", c["demoted_by_name"])
    names = ", ".join(f"{k} {_pct(v / total)}" for k, v in by.items())
    return (f"; {_pct(time / total)} demoted to other by the name contracts ({names}: their "
            "kernels' work breaks the name's contract, see the reason column)")


def shapes_line(a: Analysis) -> str | None:
    """What the trace's shapes show: without a model, the inferred dimensions and the preset
    they match (or custom); with one, the TP degree when the shapes are one rank's shard."""
    d = a.model_inferred
    if d is None:
        return None if a.model else "shapes: no projection or attention shapes to infer a model from"
    if a.model is None:
        presets = cast("list[str]", d["presets"])
        custom = "custom" + (f" ({d['layout']})" if d.get("layout") else "")
        return f"shapes (no --model): {describe(d)}: {', '.join(presets) or custom}"
    if (cast("int | None", d.get("model_tp")) or 1) > 1:
        return (f"shapes: consistent with {a.model.name} at TP={d['model_tp']} (one rank's shard "
                "of each sharded linear and of attention's heads)")
    return None


def models_line(a: Analysis) -> str:
    """What a trace of several models (`Analysis.models`) holds, said with its first model."""
    return (f"models: this trace runs {1 + len(a.models)} models (each hidden size of its "
            "embedding tables is one: assisted or speculative decoding); each is analysed on its "
            "own kernels, with its own passes and whole model, this one first, then "
            + ", ".join(split_part(m.trace)[1] for m in a.models))


# Steps shown in the terminal's step table (the first ones; the spread line covers them all).
SHOWN_STEPS = 8
_STEP_CELLS = (("wall", "wall_us"), ("busy", "busy_us"), ("idle", "idle_us"),
               ("before", "idle_before_us"), ("between", "idle_between_us"),
               ("at syncs", "idle_sync_us"), ("host", "host_us"))


def steps_lines(a: Analysis) -> list[str]:
    """The step table (steptime.step_table: the first SHOWN_STEPS steps), the spread over
    steps, each verdict with its evidence, the roofline read against the step and the
    operators losing most to their roof; nothing without a step table."""
    t = a.steps
    if t is None or t.empty:
        return []
    width = max(12, min(40, int(t["step"].str.len().max())))
    lines = [f"{'step':<{width}} " + " ".join(f"{h:>9}" for h, _ in _STEP_CELLS)
             + f" {'launches':>8}  verdict"]
    for r in t.head(SHOWN_STEPS).itertuples():
        lines.append(f"{r.step:<{width}.{width}} "
                     + " ".join(f"{duration(getattr(r, c)):>9}" for _, c in _STEP_CELLS)
                     + f" {r.launches:>8}  {r.verdict}")
    if len(t) > SHOWN_STEPS:
        lines.append(f"... {len(t) - SHOWN_STEPS} more step(s) in report.json")
    if len(t) > 1:
        s = step_summary(t)
        spread = "; ".join(f"{k.removesuffix('_us')} {duration(cast(dict, s[k])['min'])} / "
                           f"{duration(cast(dict, s[k])['median'])} / "
                           f"{duration(cast(dict, s[k])['max'])}"
                           for k in ("wall_us", "busy_us", "idle_us"))
        lines.append(f"over {len(t)} steps (min / median / max): {spread}")
    shown = t.drop_duplicates("verdict") if len(t) > 1 else t
    lines += [f"verdict: {r.verdict}" + (f" ({r.step})" if len(t) > 1 else "")
              + f": {r.evidence}" for r in shown.itertuples()]
    if (line := roofline_step_line(a)) is not None:
        lines.append(line)
    lines += headroom_lines(a)
    return lines


def step_roof(a: Analysis) -> dict[str, float] | None:
    """The whole-model % of roof read against the step with the most wall time: its kernels'
    busy time, their time at their roof, its wall time, and the step at its roof; None
    without headroom."""
    h = a.headroom
    if h is None or a.steps is None or a.steps.empty:
        return None
    steps = h[h["scope"] == "step"]
    r = steps.loc[steps["measured_us"].idxmax()]
    busy, wall = float(r["no_idle_us"]), float(r["measured_us"])
    return {"step": r["name"], "wall_us": wall, "busy_us": busy,
            "kernels_at_roof_us": busy - float(r["lost_us"]), "at_roof_us": float(r["at_roof_us"]),
            "pct_of_roof": cast(float, a.whole.get("pct_of_roof", math.nan))}


def roofline_step_line(a: Analysis) -> str | None:
    """'kernels at 54% of roof; the step at 14% of what its kernels at their roof would
    allow ...' (step_roof); None without it."""
    d = step_roof(a)
    if d is None:
        return None
    wall = d["wall_us"]
    share = (lambda us: us / wall) if wall > 0 else (lambda us: math.nan)
    return (f"roofline against the step ({d['step']}): kernels at {_pct(d['pct_of_roof'] / 100)} "
            f"of roof; the step at {_pct(share(d['kernels_at_roof_us']))} of what its kernels "
            f"at their roof would allow ({duration(d['kernels_at_roof_us'])} of "
            f"{duration(wall)}), its kernels busy {_pct(share(d['busy_us']))} of it; every "
            f"kernel at its roof: {duration(d['at_roof_us'])}, no idle time: "
            f"{duration(d['busy_us'])}")


def headroom_lines(a: Analysis, n: int = 3) -> list[str]:
    """The `n` operators losing most time to their roof (steptime.headroom)."""
    h = a.headroom
    if h is None:
        return []
    ops = h[(h["scope"] == "operator") & (h["lost_us"] > 0)].head(n)
    if ops.empty:
        return []
    return ["headroom (time lost to the roof, most first): " + ", ".join(
        f"{r.name} ({r.phase}) {duration(r.lost_us)} of {duration(r.measured_us)}"
        for r in ops.itertuples())]


def withheld_text(w: dict) -> str:
    return (f"withheld: only {_pct(w['costed_fraction'])} of its device time is costed "
            "(see the warning above)")


def passes_lines(a: Analysis) -> list[str]:
    """How many forward passes each phase holds, and that its figures are sums over them."""
    t = a.passes
    if t is None or t.empty:
        return []
    parts = []
    for phase, g in t.groupby("phase", sort=False):
        lo, hi = g["T_min"].min(), g["T_max"].max()
        tokens = "" if pd.isna(lo) else f" (T={lo})" if lo == hi else f" (T={lo}..{hi})"
        parts.append(f"{len(g)} {phase}{tokens}")
    evidence = ", ".join(sorted(t["evidence"].unique()))
    lines = [f"forward passes: {', '.join(parts)} (phase from {evidence}); each phase's time, "
             "FLOPs and bytes are summed over its passes (per pass: divide by their number)"]
    longer = (t["phase"] == "prefill") & (t["S"] > t["T_max"]).fillna(False)
    if longer.any():
        lines.append(f"{int(longer.sum())} prefill pass(es) score more keys than queries (T < S): "
                     "a chunked prefill, a speculative verification, several requests' prefill "
                     "and decode tokens packed into one sequence (continuous batching) and a "
                     "static cache's prefill look alike in the shapes; their phase is prefill "
                     "by T alone")
    return lines


def graphs_lines(a: Analysis) -> list[str]:
    """CUDA-graph replays: how much of their time was named and costed, on what evidence (a
    refused mapping is among the analysis's warnings)."""
    g = a.graphs
    if g is None:
        return []
    methods = ", ".join(f"{r.method}" + (f" ({r.template})" if isinstance(r.template, str) else "")
                        for r in g.graphs.itertuples())
    share = (lambda us: us / g.time_us) if g.time_us else (lambda us: math.nan)
    return [f"CUDA graphs: {g.replays} replay(s) of {len(g.graphs)} graph(s), {g.kernels} "
            f"kernels, {duration(g.time_us)}; named {_pct(g.named_fraction)} of their time "
            f"({_pct(share(g.matched_time_us))} by an aligned eager kernel of the same name), "
            f"costed {_pct(share(g.costed_time_us))}; evidence: {methods}"]


# --------------------------------------------------------------------------------- JSON
def report_dict(analyses: Sequence[Analysis], ranks: dict | None = None) -> dict[str, object]:
    """report.json: {"schema_version": 2, "traces": [one entry per analysis]} and, for a set of
    rank traces, "ranks" (ranks.CrossRank.to_dict)."""
    doc = {"schema_version": SCHEMA_VERSION, "traces": [_entry(a) for a in analyses]}
    return doc | ({"ranks": ranks} if ranks is not None else {})


def _shares(d: dict) -> dict:
    """A whole-model dict with percentages turned into fractions (`roof_fraction`)."""
    out = {_RENAMED.get(k, k): v for k, v in d.items()}
    if "roof_fraction" in out and not _missing(out["roof_fraction"]):
        out["roof_fraction"] = out["roof_fraction"] / 100.0
    return out


def _entry(a: Analysis) -> dict[str, object]:
    ops = _fractions(a.operators)
    cols = [k for k in OPERATOR_KEYS if k in ops.columns]
    reasons = a.costed["uncosted"].value_counts()
    entry: dict[str, object] = {
        "trace": a.trace,
        "hardware": hardware_summary(a),
        "model": asdict(a.model) if a.model else None,
        "tp": a.tp,
        "conventions": dict(a.conventions),
        "coverage": dict(a.coverage),
        "warnings": list(a.warnings), "notes": list(a.notes),
        "model_kind": {"kind": a.kind.kind, "why": a.kind.why},
        "demoted": a.demoted,
        "model_assumed": list(a.model.assumed) if a.model is not None else [],
        "model_inferred": a.model_inferred,
        "operators": _records(ops[cols]),
        "whole_model": _shares(a.whole),
        "whole_model_by_phase": {p: _shares(w) for p, w in a.whole_by_phase.items()},
        "reconciliation": _records(a.reconciliation),
        "preset_mismatches": sorted(a.costed["check"].dropna().unique().tolist()),
        "uncosted": {str(k): int(v) for k, v in reasons.items()},
        "communication": {p: dict(c) for p, c in a.communication.items()},
    }
    if a.passes is not None:
        entry["forward_passes"] = {
            "per_phase": {str(k): int(v) for k, v in a.passes["phase"].value_counts(sort=False).items()},
            "figures_are": "sums over each phase's passes",
            "passes": _records(a.passes),
        }
    if a.graphs is not None:
        g = a.graphs
        entry["cuda_graphs"] = {
            "replays": g.replays, "kernels": g.kernels, "time_us": g.time_us,
            "named_time_us": g.named_time_us, "named_fraction": g.named_fraction,
            "matched_time_us": g.matched_time_us, "costed_time_us": g.costed_time_us,
            "flags": list(g.flags), "notes": list(g.notes), "graphs": _records(g.graphs),
        }
    if a.steps is not None:
        entry["steps"] = {"summary": step_summary(a.steps), "steps": _records(a.steps),
                          "roofline_vs_step": step_roof(a),
                          "headroom": _records(a.headroom) if a.headroom is not None else None}
    if a.moe:
        entry["moe"] = {p: {**d, "explanation": " ".join(_moe_phase(p, d))}
                        for p, d in a.moe.items()}
    if a.ncu is not None:
        entry["ncu"] = dict(a.ncu)
    if a.extrapolated is not None:
        entry["extrapolated"] = {
            "layers": a.layers,
            "whole_model": a.extrapolated_whole,
            "operators": _records(a.extrapolated),
        }
    return cast("dict[str, object]", _clean(entry))


def _fractions(ops: pd.DataFrame) -> pd.DataFrame:
    """An operator table with its percentage columns as fractions, renamed by unit."""
    out = ops.rename(columns=_RENAMED)
    if "roof_fraction" in out.columns:
        out["roof_fraction"] = out["roof_fraction"] / 100.0
    return out


def _records(df: pd.DataFrame) -> list[dict[str, object]]:
    return [dict(zip(df.columns, row, strict=True)) for row in df.itertuples(index=False)]


def _clean(x: object) -> object:
    """JSON-safe: NaN/NA -> None, numpy scalars -> Python numbers."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if x is None or x is pd.NA:
        return None
    if hasattr(x, "item"):  # numpy scalar
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def report_json(analyses: Sequence[Analysis], ranks: dict | None = None) -> bytes:
    """report.json's bytes (NaN written as null)."""
    return json.dumps(report_dict(analyses, ranks), indent=2).encode() + b"\n"


# ------------------------------------------------------------------------------- tables
def operators_tables(analyses: Sequence[Analysis]) -> dict[str, pd.DataFrame]:
    """The operator tables of every analysis, a leading `trace` column, shares as fractions:
    `aggregate` (one row per trace, phase, operator; no layer column), `by_layer` (one per
    trace, phase, layer, operator; `layer` an int64 column) and `all` (both, `layer` nullable)."""
    table = _fractions(operators_frame(list(analyses)))
    layered = table["layer"].notna()
    return {"aggregate": table[~layered].drop(columns="layer").reset_index(drop=True),
            "by_layer": table[layered].astype({"layer": "int64"}).reset_index(drop=True),
            "all": table}


# A text cell a spreadsheet would read as a formula (CSV injection): it starts with = + - @, a
# tab or a carriage return (OWASP's list). Such cells get a leading `'`, which spreadsheets
# take as "text" and do not show.
_FORMULA = r"[=+\-@\t\r]"


def neutralised(frame: pd.DataFrame) -> pd.DataFrame:
    """`frame` with each text cell that starts like a formula (`_FORMULA`) prefixed with `'`;
    numbers (-0.5 included), missing values and other cells unchanged."""
    out = frame.copy(deep=False)
    for col in out.columns:
        values = out[col]
        if not (values.dtype == object or isinstance(values.dtype, (pd.StringDtype,
                                                                     pd.CategoricalDtype))):
            continue
        text = values.astype(object)
        if pd.api.types.infer_dtype(text, skipna=True) not in ("string", "mixed"):
            continue  # (no text cell)
        risky = text.str.match(_FORMULA, na=False).astype(bool)  # (non-text cells: NaN)
        if risky.any():
            text = text.copy()
            text[risky] = "'" + text[risky].astype(str)
            out[col] = text
    return out


def csv_bytes(frame: pd.DataFrame) -> bytes:
    """A table as the CSV bytes every CSV output is written as: no index, formula-like text
    cells neutralised (`neutralised`)."""
    return neutralised(frame).to_csv(index=False).encode()


def output_files(analyses: Sequence[Analysis], chart: bool = True,
                 ranks: dict | None = None) -> dict[str, bytes]:
    """Every output file's name and bytes, rendered in memory: operators.csv (aggregates),
    operators_by_layer.csv, operators.parquet (both), report.json, report.md and, with
    `chart`, roofline.png and roofline.svg."""
    tables = operators_tables(analyses)
    parquet = io.BytesIO()
    tables["all"].to_parquet(parquet, index=False)
    files = {
        "operators.csv": csv_bytes(tables["aggregate"]),
        "operators_by_layer.csv": csv_bytes(tables["by_layer"]),
        "operators.parquet": parquet.getvalue(),
        "report.json": report_json(analyses, ranks),
        "report.md": markdown(analyses, chart="roofline.png" if chart else None).encode(),
    }
    if chart:
        from trace_roofline.outputs import plot  # matplotlib: only when a chart is drawn

        fig = plot.roofline_figure(analyses)
        for fmt in ("png", "svg"):
            buf = io.BytesIO()
            fig.savefig(buf, format=fmt)
            files[f"roofline.{fmt}"] = buf.getvalue()
    return files


# ----------------------------------------------------------------------------- markdown
def markdown(analyses: Sequence[Analysis], chart: str | None = "roofline.png") -> str:
    """A markdown report: hardware, conventions, per-trace operator tables, reconciliation and
    (when extrapolated) the full-model view."""
    out = ["# trace_roofline report", ""]
    if chart:
        out += [f"![roofline]({chart})", ""]
    for a in analyses:
        out += [f"## {a.trace}", "", f"- {_hardware_line(a)}", f"- conventions: {conventions_line(a)}",
                f"- {_coverage_line(a)}", *(f"- {x}" for x in passes_lines(a) + graphs_lines(a)),
                *[f"- {c}" for c in _communication_lines(a)]]
        if a.model:
            out.append(f"- model: {a.model.name}" + (f", tp {a.tp}" if a.tp is not None else ""))
        shapes = shapes_line(a)
        out += [f"- {shapes}"] if shapes else []
        if a.warnings:
            out += ["", "### ⚠ Warnings", "", *[f"- **{w}**" for w in a.warnings]]
        out += [f"- {line.strip()}" for line in moe_lines(a)]
        if a.steps is not None:
            out += ["", "### Steps", "", "```text", *steps_lines(a), "```"]
        out += ["", "### Operators (aggregated over layers and steps, by device time)", "",
                "| operator | phase | kernels | time | time % | FLOPs | bytes | FLOP/B | FLOP/s "
                "| B/s | % of roof | bound | evidence |", "|" + "---|" * 13]
        ops = a.operators[a.operators["layer"].isna()]
        for r in ops.sort_values("time_us", ascending=False, kind="stable").itertuples():
            flag = f" ⚠ {ABOVE_ROOF}" if _flagged(r.exceeds_roof) else ""
            out.append(_md_row(r.operator + derivation_mark(r.derivation), r.phase, _cells(
                r.kernels, r.time_us, r.time_share, r.flops, r.bytes, r.intensity,
                r.achieved_flops_per_s, r.achieved_bytes_per_s, r.pct_of_roof), r.bound, flag,
                evidence_text(r.evidence_mix)))
        for phase, w in a.whole_by_phase.items():
            if w.get("withheld"):
                out.append(f"| **whole model** | {phase} | {withheld_text(w)} |" + " |" * 11)
                continue
            out.append(_md_row("**whole model**", phase, _cells(
                w["kernels"], w["time_us"], cast(float, w["time_us"]) / _phase_time(a, phase), w["flops"],
                w["bytes"], w["intensity"],
                w["achieved_flops_per_s"], w["achieved_bytes_per_s"], w.get("pct_of_roof")),
                w.get("bound"), "", "sum of the rows"))
        if legend := derivation_legend(ops["derivation"]):
            out += ["", legend]
        if _flagged(ops["exceeds_roof"].any()):
            out += ["", f"⚠ {ABOVE_ROOF_NOTE}"]
        if a.ncu is not None:
            out += ["", f"- {_ncu_line(a.ncu)}"]
        if note := below_minimum_note(a):
            out += ["", f"- ⚠ {note}"]
        out += ["", "### Reconciliation: ΣFLOPs/Σbytes = Σ byte share × intensity, per phase", "",
                "| phase | operator | byte share | intensity | contribution |", "|---|---|---|---|---|"]
        for phase in a.whole_by_phase:
            rec = a.reconciliation[a.reconciliation["phase"] == phase]
            if rec.empty:
                continue
            for r in rec.itertuples():
                out.append(f"| {phase} | {r.operator} | {_pct(r.byte_share)} | "
                           f"{_fmt(r.intensity, '.2f')} | {_fmt(r.contribution, '.4f')} |")
            # Column sums: 100% and the phase's ΣFLOPs/Σbytes (whole-model row above).
            out.append(f"| {phase} | **sum** | {_pct(math.fsum(rec['byte_share']))} | | "
                       f"**{_fmt(math.fsum(rec['contribution']), '.4f')}** |")
        if a.extrapolated is not None:
            out += ["", f"### Extrapolated to {a.layers} layers + embedding, final norm, lm_head"
                    " (one forward pass)", "",
                    "| phase | operator | source | FLOPs | bytes | FLOP/B | byte share | contribution |",
                    "|---|---|---|---|---|---|---|---|"]
            for r in a.extrapolated.itertuples():
                out.append(f"| {r.phase} | {r.operator} | {r.source} | {si(r.flops, 'FLOP')}"
                           f" | {si(r.bytes, 'B')} | {_fmt(r.intensity, '.2f')} | "
                           f"{_pct(r.byte_share)} | {_fmt(r.contribution, '.4f')} |")
            for phase, e in a.extrapolated_whole.items():
                out.append(f"| {phase} | **whole model** | | {si(e['flops'], 'FLOP')} | "
                           f"{si(e['bytes'], 'B')} | {e['intensity']:.2f} | 100% | "
                           f"{e['intensity']:.4f} |")
        checks = sorted(a.costed["check"].dropna().unique())
        if checks:
            out += ["", "### Contradictions with the model", "", *[f"- {c}" for c in checks]]
        out.append("")
    return "\n".join(out)


def _md_row(name: str, phase: str, cells: list[str], bound: object, flag: str,
            evidence: str) -> str:
    cells = [name, phase, *cells, (bound if isinstance(bound, str) else "-") + flag, evidence]
    return "| " + " | ".join(cells) + " |"
