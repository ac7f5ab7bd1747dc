"""Reports of one or more analysed traces: terminal text, report.json, markdown, and the bytes of
every output file.

Design notes: docs/design.md ("trace_roofline/outputs/report.py").
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import SupportsFloat, cast

import pandas as pd

from trace_roofline.costs.calculator import si
from trace_roofline.outputs.text import (
    ABOVE_ROOF,
    ABOVE_ROOF_NOTE,
    below_minimum_note,
    communication_lines,
    conventions_line,
    coverage_line,
    derivation_legend,
    derivation_mark,
    duration,
    evidence_cell,
    evidence_text,
    flagged,
    fmt,
    graphs_lines,
    hardware_line,
    missing,
    models_line,
    moe_lines,
    moe_phase,
    ncu_line,
    passes_lines,
    pct,
    phase_time,
    shapes_line,
    step_roof,
    steps_lines,
    tenths,
    withheld_text,
)
from trace_roofline.roofline import Analysis, hardware_summary, operators_frame
from trace_roofline.steptime import step_summary

SCHEMA_VERSION = 2
# Analysis column -> output name where the output's scale differs (percent -> fraction).
_RENAMED = {"pct_of_roof": "roof_fraction"}

# Keys of each report.json `operators` entry (the contract's first, then extras).
OPERATOR_KEYS = ["operator", "layer", "phase", "kernels", "time_us", "flops", "bytes",
                 "intensity", "achieved_flops_per_s", "achieved_bytes_per_s",
                 "attainable_flops_per_s", "roof_fraction", "bound",
                 "instances", "uncosted", "time_share", "dtype", "peak_flops_per_s",
                 "exceeds_roof", "exceeds_why", "evidence", "evidence_mix", "derivation",
                 "pairs_executed", "pairs_useful", "measured_bytes",
                 "measured_intensity", "experts_active", "experts_active_low",
                 "experts_active_high"]

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


def _cells(figures: Mapping[str, object], share: object) -> list[str]:
    """The cells of an operator row or a whole model (`figures`: its kernels, time_us, flops,
    bytes, intensity, achieved rates and pct_of_roof) at `share` of the time."""
    f, roof = figures.get, figures.get("pct_of_roof")
    return [str(f("kernels")), duration(f("time_us")), "-" if missing(share) else tenths(
                100 * float(cast(SupportsFloat, share))), si(f("flops"), "FLOP"),
            si(f("bytes"), "B"), fmt(f("intensity"), ".2f"),
            si(f("achieved_flops_per_s"), "FLOP/s"), si(f("achieved_bytes_per_s"), "B/s"),
            "-" if missing(roof) else tenths(float(cast(SupportsFloat, roof)))]


def _row(name: str, phase: str, cells: list[str], bound: object, width: int) -> str:
    return (f"{name:<{width}.{width}} {phase:<7.7} "
            + " ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, _COLUMNS, strict=True))
            + f" {_bound(bound):<7}")


def _op_row(r, width: int, measured: bool, share: object = None) -> str:
    line = _row(r.operator + derivation_mark(r.derivation), r.phase,
                _cells(r._asdict(), r.time_share if share is None else share), r.bound, width)
    line += f" {evidence_cell(r.evidence, r.evidence_mix):<{_EVIDENCE_WIDTH}}"
    if measured:
        line += (f" {si(r.measured_bytes, 'B'):>10} {fmt(r.measured_bytes / r.bytes, '.2f'):>6}"
                 f" {fmt(r.measured_intensity, '.2f'):>8}")
    return line.rstrip() + (f" ! {ABOVE_ROOF}" if flagged(r.exceeds_roof) else "")


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
             hardware_line(a), f"conventions: {conventions_line(a)}"]
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
        share = cast(float, w["time_us"]) / phase_time(a, phase)
        lines.append(_row("whole model", phase, _cells(w, share), w.get("bound"), width).rstrip())
    if legend := derivation_legend(agg["derivation"]):
        lines.append(legend)
    if flagged(a.operators["exceeds_roof"].any()):
        lines.append(f"! {ABOVE_ROOF_NOTE}")
    lines += communication_lines(a)
    lines += passes_lines(a) + graphs_lines(a)
    lines.append(coverage_line(a))
    lines += moe_lines(a)
    if a.ncu is not None:
        lines.append(ncu_line(a.ncu))
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
        of_phase = phase_time(a, phase) if phase in a.whole_by_phase else None
        out += [f"layer {layer} ({phase}): {duration(total)}, "
                f"{pct(total / of_phase) if of_phase else 'n/a'} of the phase's device time",
                _head(width, measured)]
        out += [_op_row(r, width, measured, share=r.time_us / total)
                for r in g.sort_values("time_us", ascending=False, kind="stable").itertuples()]
    return out


# --------------------------------------------------------------------------------- JSON
def report_dict(analyses: Sequence[Analysis], ranks: dict | None = None) -> dict[str, object]:
    """report.json: {"schema_version": 2, "traces": [one entry per analysis]} and, for a set of
    rank traces, "ranks" (ranks.CrossRank.to_dict)."""
    doc = {"schema_version": SCHEMA_VERSION, "traces": [_entry(a) for a in analyses]}
    return doc | ({"ranks": ranks} if ranks is not None else {})


def _shares(d: dict) -> dict:
    """A whole-model dict with percentages turned into fractions (`roof_fraction`)."""
    out = {_RENAMED.get(k, k): v for k, v in d.items()}
    if "roof_fraction" in out and not missing(out["roof_fraction"]):
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
        entry["moe"] = {p: {**d, "explanation": " ".join(moe_phase(p, d))}
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
        out += [*_md_header(a), *_md_operators(a), *_md_reconciliation(a),
                *_md_extrapolated(a)]
        checks = sorted(a.costed["check"].dropna().unique())
        if checks:
            out += ["", "### Contradictions with the model", "", *[f"- {c}" for c in checks]]
        out.append("")
    return "\n".join(out)


def _md_header(a: Analysis) -> list[str]:
    """A trace's heading and its bullet lines: hardware, conventions, coverage, passes, graphs,
    communication, model, shapes; then its warnings, MoE lines and step table."""
    out = [f"## {a.trace}", "", f"- {hardware_line(a)}", f"- conventions: {conventions_line(a)}",
           f"- {coverage_line(a)}", *(f"- {x}" for x in passes_lines(a) + graphs_lines(a)),
           *[f"- {c}" for c in communication_lines(a)]]
    if a.model:
        out.append(f"- model: {a.model.name}" + (f", tp {a.tp}" if a.tp is not None else ""))
    shapes = shapes_line(a)
    out += [f"- {shapes}"] if shapes else []
    if a.warnings:
        out += ["", "### ⚠ Warnings", "", *[f"- **{w}**" for w in a.warnings]]
    out += [f"- {line.strip()}" for line in moe_lines(a)]
    if a.steps is not None:
        out += ["", "### Steps", "", "```text", *steps_lines(a), "```"]
    return out


def _md_operators(a: Analysis) -> list[str]:
    """The aggregated operator table, a whole-model row per phase, and its notes."""
    out = ["", "### Operators (aggregated over layers and steps, by device time)", "",
           "| operator | phase | kernels | time | time % | FLOPs | bytes | FLOP/B | FLOP/s "
           "| B/s | % of roof | bound | evidence |", "|" + "---|" * 13]
    ops = a.operators[a.operators["layer"].isna()]
    for r in ops.sort_values("time_us", ascending=False, kind="stable").itertuples():
        flag = f" ⚠ {ABOVE_ROOF}" if flagged(r.exceeds_roof) else ""
        out.append(_md_row(r.operator + derivation_mark(r.derivation), r.phase,
                           _cells(r._asdict(), r.time_share), _bound(r.bound) + flag,
                           evidence_text(r.evidence_mix)))
    for phase, w in a.whole_by_phase.items():
        if w.get("withheld"):
            out.append(f"| **whole model** | {phase} | {withheld_text(w)} |" + " |" * 11)
            continue
        share = cast(float, w["time_us"]) / phase_time(a, phase)
        out.append(_md_row("**whole model**", phase, _cells(w, share), _bound(w.get("bound")),
                           "sum of the rows"))
    if legend := derivation_legend(ops["derivation"]):
        out += ["", legend]
    if flagged(ops["exceeds_roof"].any()):
        out += ["", f"⚠ {ABOVE_ROOF_NOTE}"]
    if a.ncu is not None:
        out += ["", f"- {ncu_line(a.ncu)}"]
    if note := below_minimum_note(a):
        out += ["", f"- ⚠ {note}"]
    return out


def _md_reconciliation(a: Analysis) -> list[str]:
    """Per phase: each operator's byte share, intensity and contribution, and their sums."""
    out = ["", "### Reconciliation: ΣFLOPs/Σbytes = Σ byte share × intensity, per phase", "",
           "| phase | operator | byte share | intensity | contribution |", "|---|---|---|---|---|"]
    for phase in a.whole_by_phase:
        rec = a.reconciliation[a.reconciliation["phase"] == phase]
        if rec.empty:
            continue
        for r in rec.itertuples():
            out.append(f"| {phase} | {r.operator} | {pct(r.byte_share)} | "
                       f"{fmt(r.intensity, '.2f')} | {fmt(r.contribution, '.4f')} |")
        # Column sums: 100% and the phase's ΣFLOPs/Σbytes (whole-model row above).
        out.append(f"| {phase} | **sum** | {pct(math.fsum(rec['byte_share']))} | | "
                   f"**{fmt(math.fsum(rec['contribution']), '.4f')}** |")
    return out


def _md_extrapolated(a: Analysis) -> list[str]:
    """The full-model view (`Analysis.extrapolated`), none without it."""
    if a.extrapolated is None:
        return []
    out = ["", f"### Extrapolated to {a.layers} layers + embedding, final norm, lm_head"
           " (one forward pass)", "",
           "| phase | operator | source | FLOPs | bytes | FLOP/B | byte share | contribution |",
           "|---|---|---|---|---|---|---|---|"]
    for r in a.extrapolated.itertuples():
        out.append(f"| {r.phase} | {r.operator} | {r.source} | {si(r.flops, 'FLOP')}"
                   f" | {si(r.bytes, 'B')} | {fmt(r.intensity, '.2f')} | "
                   f"{pct(r.byte_share)} | {fmt(r.contribution, '.4f')} |")
    for phase, e in a.extrapolated_whole.items():
        out.append(f"| {phase} | **whole model** | | {si(e['flops'], 'FLOP')} | "
                   f"{si(e['bytes'], 'B')} | {e['intensity']:.2f} | 100% | "
                   f"{e['intensity']:.4f} |")
    return out


def _bound(bound: object) -> str:
    return bound if isinstance(bound, str) else "-"


def _md_row(name: str, phase: str, cells: list[str], bound: str, evidence: str) -> str:
    return "| " + " | ".join([name, phase, *cells, bound, evidence]) + " |"
