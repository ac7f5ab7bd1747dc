"""The text every report shares: units and cells (durations, percentages, evidence), and the
sentences of each section (hardware, coverage, communication, steps, passes, CUDA graphs, MoE).

Design notes: docs/design.md ("trace_roofline/outputs/report.py").
"""

from __future__ import annotations

import math
from typing import SupportsFloat, cast

import pandas as pd

from trace_roofline.costs.calculator import si
from trace_roofline.costs.crosscheck import describe
from trace_roofline.roofline import Analysis, hardware_summary, split_part
from trace_roofline.steptime import step_summary

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

# The mark after an operator's name in the terminal and report.md tables for each derivation
# but `shape` (costs/call.py DERIVATIONS), and the legend's words for it.
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



def missing(x: object) -> bool:
    return x is None or x is pd.NA or (isinstance(x, float) and math.isnan(x))


def duration(us: object) -> str:
    """A time given in µs, in µs, ms or s: 115.1 µs, 2.315 ms, 1.5 s; '-' when missing."""
    if missing(us):
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


def pct(x: object) -> str:
    """A fraction (0-1) as a percentage; 'n/a' when missing."""
    return "n/a" if missing(x) else f"{tenths(100 * float(cast(SupportsFloat, x)))}%"


def fmt(x: object, fmt: str, scale: float = 1.0) -> str:
    """`x / scale` formatted; '-' for a missing value."""
    return "-" if missing(x) else format(float(cast(SupportsFloat, x)) / scale, fmt)



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
    return [line for phase, d in a.moe.items() for line in moe_phase(phase, d)]


def moe_phase(phase: str, d: dict) -> list[str]:
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


def ncu_line(n: dict) -> str:
    line = (f"ncu {n['file']}: {n['matched']} of {n['trace_kernels']} trace kernels matched "
            f"({n['ncu_kernels']} in the CSV), whole model measured "
            f"{si(n['whole_model_measured_bytes'], 'B')}, "
            f"intensity {fmt(n['whole_model_measured_intensity'], '.2f')} FLOP/B")
    if n["trace_unmatched"] or n["ncu_unmatched"]:
        line += (f"; WARNING {n['trace_unmatched']} trace / {n['ncu_unmatched']} ncu kernels "
                 "unmatched: is the CSV from the same workload?")
    return line


def flagged(value: object) -> bool:
    return value is not None and value is not pd.NA and bool(value)


def hardware_line(a: Analysis) -> str:
    h = hardware_summary(a)
    if h is None:
        return "hardware: none given or known from the trace: intensities only, no placements"
    link = h["link_bandwidth_bytes_per_s"]
    return (f"hardware {h['name']}: {si(h['peak_flops_per_s'], 'FLOP/s')} {h['dtype']}, "
            f"{si(h['bandwidth_bytes_per_s'], 'B/s')}, ridge {h['ridge']:.0f} FLOP/B"
            + (f", link {si(link, 'B/s')} per direction" if link else ""))


# (share of device time, fraction of the link roof) above / below which collectives are flagged
SLOW_COMMUNICATION = (0.25, 0.05)


def phase_time(a: Analysis, phase: str) -> float:
    """A phase's device time: the whole model's (HBM operators) plus its collectives'."""
    whole = cast(float, a.whole_by_phase[phase]["time_us"])
    return whole + a.communication.get(phase, {}).get("time_us", 0.0)


def communication_lines(a: Analysis) -> list[str]:
    """Per phase with collectives: their time, exposed time, bus bytes and link fraction,
    outside the whole model."""
    out = []
    for phase, c in a.communication.items():
        link = (f" = {pct(c['link_fraction'])} of the link roof"
                if not missing(c["link_fraction"]) else " (no link bandwidth for this hardware)")
        out.append(
            f"communication ({phase}): {c['kernels']} collective kernel(s), "
            f"{duration(c['time_us'])} ({pct(c['time_share'])} of device time), "
            f"{duration(c['exposed_time_us'])} exposed (not overlapped by compute), "
            f"{si(c['bytes'], 'B')} bus bytes at {si(c['bus_bytes_per_s'], 'B/s')}{link}; "
            "not in the whole model (its roof is the link, not HBM)")
        if c["time_share"] > SLOW_COMMUNICATION[0] and c["link_fraction"] < SLOW_COMMUNICATION[1]:
            out.append(f"! communication ({phase}) takes {pct(c['time_share'])} of device time "
                       f"at {pct(c['link_fraction'])} of the link roof: latency-bound small "
                       "messages, or this rank waits in its collectives for a slower one; "
                       "analyse every rank's trace together to tell")
    return out


def coverage_line(a: Analysis) -> str:
    """'coverage of 612.7 µs device time: 98.4% named with evidence (shape 78.5%, position
    18.4%, ...), 1.6% fallback (other 1.6%); 100.0% costed, 0 uncosted op instance(s)'."""
    c = a.coverage
    total = cast(float, c["kernel_time_us"])

    def parts(d: dict[str, float]) -> str:
        share = {k: v / total for k, v in d.items() if total > 0}
        return ", ".join(f"{k} {pct(v)}" for k, v in sorted(share.items(), key=lambda kv: -kv[1]))

    by_evidence = cast("dict[str, float]", c["by_evidence"])
    named = {k: v for k, v in by_evidence.items() if k != "fallback"}
    fallback = parts(cast("dict[str, float]", c["fallback_by_operator"]))
    return (f"coverage of {duration(total)} device time: {pct(c['evidence_fraction'])} named "
            f"with evidence ({parts(named) or 'none'}), {pct(c['fallback_fraction'])} fallback"
            + (f" ({fallback})" if fallback else "")
            + f"; {pct(c['costed_fraction'])} costed, {c['uncosted_instances']} uncosted op "
            "instance(s)" + _demoted(a.demoted, total))


def _demoted(c: dict[str, object], total: float) -> str:
    """'; 2.1% demoted by the name contracts (residual 2.1%): named, then shown not to be so'."""
    time = cast(float, c.get("demoted_time_us", 0.0))
    if not time or total <= 0:
        return ""
    by = cast("dict[str, float]", c["demoted_by_name"])
    names = ", ".join(f"{k} {pct(v / total)}" for k, v in by.items())
    return (f"; {pct(time / total)} demoted to other by the name contracts ({names}: their "
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
    return (f"roofline against the step ({d['step']}): kernels at {pct(d['pct_of_roof'] / 100)} "
            f"of roof; the step at {pct(share(d['kernels_at_roof_us']))} of what its kernels "
            f"at their roof would allow ({duration(d['kernels_at_roof_us'])} of "
            f"{duration(wall)}), its kernels busy {pct(share(d['busy_us']))} of it; every "
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
    return (f"withheld: only {pct(w['costed_fraction'])} of its device time is costed "
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
            f"kernels, {duration(g.time_us)}; named {pct(g.named_fraction)} of their time "
            f"({pct(share(g.matched_time_us))} by an aligned eager kernel of the same name), "
            f"costed {pct(share(g.costed_time_us))}; evidence: {methods}"]
