"""Reports of one or more analysed traces: terminal table text, the report.json dict, markdown.

Library code: every function returns a string or a dict; the CLI prints and writes files.

report.json, per trace (several traces go under `traces`): `trace`, `hardware` {name, dtype,
peak_flops_per_s, bandwidth_bytes_per_s, ridge, source}, `model`, `conventions`, `coverage`,
`operators` [{operator, layer, phase, ...}], `reconciliation` [{phase, operator, flops, bytes,
intensity, byte_share, contribution}], and the whole model per phase: `whole_model_by_phase`
{phase: {flops, bytes, intensity, time_us, costed_time_us, kernels, uncosted,
achieved_flops_per_s, achieved_bytes_per_s, phases, [peak_flops_per_s, attainable_flops_per_s,
pct_of_roof, bound]}}, phases in order of first appearance, always present; `whole_model` is the
entry of the phase with the most device time (the only phase of a decode or prefill trace; its
`phases` names it). A trace holding both phases (an HF `generate` profile) gets no blended
figure: the reconciliation's contributions sum to each phase's ΣFLOPs/Σbytes. Also:
`preset_mismatches`, `uncosted` {reason: instances}, with --ncu `ncu`, with --layers
`extrapolated` {layers, whole_model {phase: {flops, bytes, intensity}}, operators}.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict

import pandas as pd

from trace_roofline.hardware import Hardware
from trace_roofline.roofline import Analysis, main_dtype, peak_key

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
                 "attainable_flops_per_s", "pct_of_roof", "bound",
                 "instances", "uncosted", "time_share", "dtype", "peak_flops_per_s",
                 "exceeds_roof", "measured_bytes", "measured_intensity"]


def hardware_summary(a: Analysis, hardware: Hardware | None = None) -> dict[str, object] | None:
    """The device's ceilings (`hardware`, else the analysis's) at the trace's compute dtype."""
    hw = hardware or a.hardware
    if hw is None:
        return None
    dtype = peak_key(hw, main_dtype(a.costed))
    peak = hw.peak_flops[dtype]
    return {"name": hw.name, "dtype": dtype, "peak_flops_per_s": peak,
            "bandwidth_bytes_per_s": hw.mem_bandwidth, "ridge": peak / hw.mem_bandwidth,
            "source": hw.source}


def conventions_line(a: Analysis) -> str:
    c = a.conventions
    return (f"--causal {c['causal']}: {CONVENTION_TEXT['causal'][c['causal']]}; "
            f"--attention-bytes {c['attention_bytes']}: "
            f"{CONVENTION_TEXT['attention_bytes'][c['attention_bytes']]}")


# ----------------------------------------------------------------------------- terminal
def terminal_table(analyses: Sequence[Analysis], per_layer: bool = False) -> str:
    """Compact text: per trace, operators by device time, a whole-model line per phase,
    coverage, conventions and hardware."""
    return "\n\n".join(_terminal_one(a, per_layer) for a in analyses)


def _head(width: int) -> str:
    return (f"{'operator':<{width}} {'phase':<7} {'kern':>5} {'time µs':>10} {'time%':>6} {'GFLOP':>9} "
            f"{'MB':>9} {'FLOP/B':>8} {'TFLOP/s':>8} {'GB/s':>7} {'%roof':>6} {'bound':<7}")


def _terminal_one(a: Analysis, per_layer: bool) -> str:
    ops = a.operators if per_layer else a.operators[a.operators["layer"].isna()]
    ops = ops.sort_values("time_us", ascending=False, kind="stable")
    measured = "measured_intensity" in ops.columns  # ncu DRAM bytes joined
    names = ops["operator"].astype(str) + ops["layer"].map(lambda x: "" if pd.isna(x) else f"[{x}]")
    width = max(20, *names.str.len()) if len(ops) else 20
    lines = [f"trace {a.trace}" + (f"   model {a.model.name}" if a.model else ""),
             _hardware_line(a), f"conventions: {conventions_line(a)}",
             _head(width) + (f" {'ncu MB':>9} {'ncu/an':>6} {'ncu F/B':>8}" if measured else "")]
    for name, r in zip(names.to_numpy(), ops.itertuples(), strict=True):
        flag = f" ! {ABOVE_ROOF}" if _flagged(r.exceeds_roof) else ""
        ncu = (f" {_fmt(r.measured_bytes, '.2f', 1e6):>9} {_fmt(r.measured_bytes / r.bytes, '.2f'):>6}"
               f" {_fmt(r.measured_intensity, '.2f'):>8}") if measured else ""
        lines.append(_row(name, r.phase, r.kernels, r.time_us, r.time_share, r.flops, r.bytes,
                          r.intensity, r.achieved_flops_per_s, r.achieved_bytes_per_s,
                          r.pct_of_roof, r.bound, width) + ncu + flag)
    for phase, w in a.whole_by_phase.items():
        lines.append(_row("whole model", phase, w["kernels"], w["time_us"], 1.0, w["flops"],
                          w["bytes"], w["intensity"], w["achieved_flops_per_s"],
                          w["achieved_bytes_per_s"], w.get("pct_of_roof"), w.get("bound"),
                          width))
    if _flagged(ops["exceeds_roof"].any()):
        lines.append(f"! {ABOVE_ROOF_NOTE}")
    lines.append(_coverage_line(a))
    lines += passes_lines(a) + graphs_lines(a)
    if a.ncu is not None:
        lines.append(_ncu_line(a.ncu))
    for phase, ext in a.extrapolated_whole.items():
        lines.append(f"extrapolated to {a.layers} layers + embedding/lm_head "
                     f"({phase}, per forward pass): {ext['flops'] / 1e9:.2f} GFLOP, "
                     f"{ext['bytes'] / 1e9:.3f} GB, intensity {ext['intensity']:.2f} FLOP/B")
    checks = a.costed["check"].dropna().unique()
    if len(checks):
        lines.append(f"preset cross-check: {len(checks)} mismatch(es): {checks[0]}"
                     + (" ..." if len(checks) > 1 else ""))
    return "\n".join(lines)


def _ncu_line(n: dict) -> str:
    line = (f"ncu {n['file']}: {n['matched']} of {n['trace_kernels']} trace kernels matched "
            f"({n['ncu_kernels']} in the CSV), whole model measured "
            f"{_fmt(n['whole_model_measured_bytes'], '.2f', 1e6)} MB, "
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
        return "hardware: none given (no device in the trace): intensities only, no placements"
    return (f"hardware {h['name']}: {h['peak_flops_per_s'] / 1e12:.0f} TFLOP/s {h['dtype']}, "
            f"{h['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s, ridge {h['ridge']:.0f} FLOP/B")


def _coverage_line(a: Analysis) -> str:
    c = a.coverage
    return (f"coverage: {_pct(c['fraction'])} of {c['kernel_time_us']:.1f} µs measured time "
            f"attributed to operators, {_pct(c['costed_fraction'])} costed; "
            f"{c['uncosted_instances']} uncosted op instance(s)")


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
    return [f"forward passes: {', '.join(parts)} (phase from {evidence}); each phase's time, "
            "FLOPs and bytes are summed over its passes (per pass: divide by their number)"]


def graphs_lines(a: Analysis) -> list[str]:
    """CUDA-graph replays: how much of their time was named and costed, on what evidence."""
    g = a.graphs
    if g is None:
        return []
    methods = ", ".join(f"{r.method}" + (f" ({r.template})" if isinstance(r.template, str) else "")
                        for r in g.graphs.itertuples())
    share = (lambda us: us / g.time_us) if g.time_us else (lambda us: math.nan)
    return [f"CUDA graphs: {g.replays} replay(s) of {len(g.graphs)} graph(s), {g.kernels} "
            f"kernels, {g.time_us:.1f} µs; named {_pct(g.named_fraction)} of their time "
            f"({_pct(share(g.matched_time_us))} by an aligned eager kernel of the same name), "
            f"costed {_pct(share(g.costed_time_us))}; evidence: {methods}"] + [
        f"! {f}" for f in g.flags]


def _pct(x: float) -> str:
    return "n/a" if x is None or x != x else f"{100 * x:.1f}%"


def _row(name, phase, kernels, time_us, share, flops, nbytes, intensity, fps, bps, pct,
         bound, width: int = 20) -> str:
    return (f"{name:<{width}.{width}} {phase:<7.7} {kernels:>5} {_fmt(time_us, '.1f'):>10} "
            f"{_fmt(share, '.1f', 0.01):>6} {_fmt(flops, '.3f', 1e9):>9} "
            f"{_fmt(nbytes, '.2f', 1e6):>9} {_fmt(intensity, '.2f'):>8} "
            f"{_fmt(fps, '.2f', 1e12):>8} {_fmt(bps, '.0f', 1e9):>7} "
            f"{_fmt(pct, '.1f'):>6} {bound if isinstance(bound, str) else '-':<7}")


# --------------------------------------------------------------------------------- JSON
def report_dict(analyses: Sequence[Analysis]) -> dict[str, object]:
    """report.json: one entry per trace; several traces go under `traces`."""
    entries = [_entry(a) for a in analyses]
    return entries[0] if len(entries) == 1 else {"traces": entries}


def _entry(a: Analysis) -> dict[str, object]:
    ops = a.operators
    cols = [k for k in OPERATOR_KEYS if k in ops.columns]
    reasons = a.costed["uncosted"].value_counts()
    entry: dict[str, object] = {
        "trace": a.trace,
        "hardware": hardware_summary(a),
        "model": asdict(a.model) if a.model else None,
        "conventions": dict(a.conventions),
        "coverage": dict(a.coverage),
        "operators": _records(ops[cols]),
        "whole_model": dict(a.whole),
        "whole_model_by_phase": {p: dict(w) for p, w in a.whole_by_phase.items()},
        "reconciliation": _records(a.reconciliation),
        "preset_mismatches": sorted(a.costed["check"].dropna().unique().tolist()),
        "uncosted": {str(k): int(v) for k, v in reasons.items()},
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
            "flags": list(g.flags), "graphs": _records(g.graphs),
        }
    if a.ncu is not None:
        entry["ncu"] = dict(a.ncu)
    if a.extrapolated is not None:
        entry["extrapolated"] = {
            "layers": a.layers,
            "whole_model": a.extrapolated_whole,
            "operators": _records(a.extrapolated),
        }
    return _clean(entry)


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


# ----------------------------------------------------------------------------- markdown
def markdown(analyses: Sequence[Analysis], chart: str | None = "roofline.png") -> str:
    """A markdown report: hardware, conventions, per-trace operator tables, reconciliation and
    (when extrapolated) the full-model view."""
    out = ["# trace_roofline report", ""]
    if chart:
        out += [f"![roofline]({chart})", ""]
    for a in analyses:
        out += [f"## {a.trace}", "", f"- {_hardware_line(a)}", f"- conventions: {conventions_line(a)}",
                f"- {_coverage_line(a)}", *(f"- {x}" for x in passes_lines(a) + graphs_lines(a))]
        if a.model:
            out.append(f"- model: {a.model.name}")
        out += ["", "### Operators (aggregated over layers and steps, by device time)", "",
                "| operator | phase | kernels | time µs | time % | GFLOP | MB | FLOP/B | TFLOP/s "
                "| GB/s | % of roof | bound |", "|" + "---|" * 12]
        ops = a.operators[a.operators["layer"].isna()]
        for r in ops.sort_values("time_us", ascending=False, kind="stable").itertuples():
            flag = f" ⚠ {ABOVE_ROOF}" if _flagged(r.exceeds_roof) else ""
            out.append(_md_row(r.operator, r.phase, r.kernels, r.time_us, r.time_share, r.flops,
                               r.bytes, r.intensity, r.achieved_flops_per_s,
                               r.achieved_bytes_per_s, r.pct_of_roof, r.bound, flag))
        for phase, w in a.whole_by_phase.items():
            out.append(_md_row("**whole model**", phase, w["kernels"], w["time_us"], 1.0,
                               w["flops"], w["bytes"], w["intensity"], w["achieved_flops_per_s"],
                               w["achieved_bytes_per_s"], w.get("pct_of_roof"), w.get("bound"),
                               ""))
        if _flagged(ops["exceeds_roof"].any()):
            out += ["", f"⚠ {ABOVE_ROOF_NOTE}"]
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
                    "| phase | operator | source | GFLOP | MB | FLOP/B | byte share | contribution |",
                    "|---|---|---|---|---|---|---|---|"]
            for r in a.extrapolated.itertuples():
                out.append(f"| {r.phase} | {r.operator} | {r.source} | {_fmt(r.flops, '.3f', 1e9)}"
                           f" | {_fmt(r.bytes, '.2f', 1e6)} | {_fmt(r.intensity, '.2f')} | "
                           f"{_pct(r.byte_share)} | {_fmt(r.contribution, '.4f')} |")
            for phase, e in a.extrapolated_whole.items():
                out.append(f"| {phase} | **whole model** | | {e['flops'] / 1e9:.3f} | "
                           f"{e['bytes'] / 1e6:.2f} | {e['intensity']:.2f} | 100% | "
                           f"{e['intensity']:.4f} |")
        checks = sorted(a.costed["check"].dropna().unique())
        if checks:
            out += ["", "### Model-preset cross-check", "", *[f"- {c}" for c in checks]]
        out.append("")
    return "\n".join(out)


def _fmt(x: object, fmt: str, scale: float = 1.0) -> str:
    """`x / scale` formatted; '-' for a missing value."""
    if x is None or x is pd.NA or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(float(x) / scale, fmt)


def _md_row(name, phase, kernels, time_us, share, flops, nbytes, intensity, fps, bps, pct,
            bound, flag) -> str:
    cells = [name, phase, str(kernels), _fmt(time_us, ".1f"), _pct(share),
             _fmt(flops, ".3f", 1e9), _fmt(nbytes, ".2f", 1e6), _fmt(intensity, ".2f"),
             _fmt(fps, ".2f", 1e12), _fmt(bps, ".0f", 1e9), _fmt(pct, ".1f"),
             (bound if isinstance(bound, str) else "-") + flag]
    return "| " + " | ".join(cells) + " |"
