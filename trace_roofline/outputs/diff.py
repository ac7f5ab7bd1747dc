"""Before/after comparison of two analyses of one model: per (phase, operator) and whole model.

Design notes: docs/design.md ("trace_roofline/outputs/diff.py").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, SupportsFloat, cast

import numpy as np
import pandas as pd

from trace_roofline.costs.calculator import si
from trace_roofline.errors import InputError
from trace_roofline.roofline import Analysis

WHOLE = "whole model"
# Two operators' FLOP counts closer than this (relative) are the same work: analytical counts of
# the same shapes are bit-identical, so this only absorbs float summation order.
FLOPS_RTOL = 1e-6
# The whole model is the same workload within this: fused (torch.compile) elementwise kernels
# are counted per kernel (costs/fused.py), so eager and compiled runs of the same model differ in
# those few FLOPs; a batch, context, layer or model change moves the GEMMs' and attention's.
WORKLOAD_RTOL = 1e-2

DIFF_COLUMNS = {
    "phase": "str",
    "operator": "str",  # WHOLE for the phase's total
    "presence": "str",  # both | a only | b only
    "steps_a": "Int64",  # profiled steps of the phase; missing when unknown (totals compared)
    "steps_b": "Int64",
    "time_a_us": "float64",  # device time per step (per trace when steps are missing)
    "time_b_us": "float64",
    "speedup": "float64",  # time_a_us / time_b_us
    "flops_a": "float64",  # per step, like time
    "flops_b": "float64",
    # |ΔF| <= rtol·max(F), rtol FLOPS_RTOL (WORKLOAD_RTOL on WHOLE rows); missing when uncosted
    "flops_equal": "boolean",
    "bytes_a": "float64",
    "bytes_b": "float64",
    "intensity_a": "float64",  # FLOP/byte
    "intensity_b": "float64",
    "delta_intensity": "float64",  # b - a
    "achieved_flops_per_s_a": "float64",
    "achieved_flops_per_s_b": "float64",
    "pct_of_roof_a": "float64",
    "pct_of_roof_b": "float64",
    "delta_pct_of_roof": "float64",  # b - a, percentage points
    "bound_a": "str",
    "bound_b": "str",
}
# Per-side columns taken from an operator row or a whole-model entry.
_SIDE = ("time_us", "flops", "bytes", "intensity", "achieved_flops_per_s", "pct_of_roof", "bound")


@dataclass(frozen=True)
class Side:
    """One trace's figures in the form diff needs, from an Analysis or a report.json dict."""

    trace: str
    rows: pd.DataFrame  # phase, operator and _SIDE, aggregated rows plus one WHOLE row per phase
    steps: dict[str, int | None]  # phase -> profiled steps (None: unknown)
    hardware: dict[str, object] | None  # report.hardware_summary's keys
    # the model: the one given (--model), else the preset the trace's shapes match; None when
    # neither says
    model: str | None = None
    model_from: str = "none"  # "--model" | "shapes" | "none"


def _model(given: object, inferred: object) -> tuple[str | None, str]:
    """(model name, where it comes from) of a side: the given model, else the inferred match."""
    name = given.get("name") if isinstance(given, Mapping) else getattr(given, "name", None)
    if name:
        return str(name), "--model"
    match = inferred.get("match") if isinstance(inferred, Mapping) else None
    return (str(match), "shapes") if match else (None, "none")


def side(x: Analysis | Mapping[str, object] | Side, label: str = "input") -> Side:
    """Normalise an Analysis or a one-trace report.json dict; `label` names it in errors."""
    if isinstance(x, Side):
        return x
    if isinstance(x, Analysis):
        from trace_roofline.roofline import hardware_summary

        ops = x.operators[x.operators["layer"].isna()]
        steps = x.costed.groupby("phase")["step"].nunique()
        return Side(x.trace, _rows(ops, x.whole_by_phase),
                    {p: max(int(steps.get(p, 0)), 1) for p in x.whole_by_phase},
                    hardware_summary(x), *_model(x.model, x.model_inferred))
    if not isinstance(x, Mapping):
        raise InputError(f"{label}: expected an Analysis or a report.json object")
    doc: Mapping[str, Any] = x  # JSON of any shape: what is not a report's raises below
    if "traces" in doc:  # schema 2: {"schema_version": 2, "traces": [one entry]}
        if len(doc["traces"]) != 1:
            raise InputError(f"{label}: report.json holds {len(doc['traces'])} traces; diff compares "
                             "one trace with one (write each trace's report separately)")
        doc = doc["traces"][0]
    try:
        ops = _percent(pd.DataFrame(doc["operators"]))
        whole = {p: _percent(w) for p, w in dict(doc["whole_model_by_phase"]).items()}
        ops = ops[ops["layer"].isna()] if "layer" in ops else ops
        steps = {p: (int(w["steps"]) if w.get("steps") else None) for p, w in whole.items()}
        return Side(str(doc.get("trace", label)), _rows(ops, whole), steps, doc.get("hardware"),
                    *_model(doc.get("model"), doc.get("model_inferred")))
    except (KeyError, TypeError, ValueError) as e:
        raise InputError(f"{label}: not a trace_roofline report.json ({type(e).__name__}: {e})") from None


def _percent(rows):
    """report.json's `roof_fraction` (0-1) as the Analysis' `pct_of_roof` (0-100)."""
    if "roof_fraction" not in rows:
        return rows
    if isinstance(rows, pd.DataFrame):
        return rows.assign(pct_of_roof=rows["roof_fraction"] * 100.0)
    fraction = rows["roof_fraction"]
    return {**rows, "pct_of_roof": None if fraction is None else fraction * 100.0}


def _rows(ops: pd.DataFrame, whole: Mapping[str, Mapping]) -> pd.DataFrame:
    """A side's `rows`: the aggregated operator rows and a WHOLE row per phase."""
    missing = [c for c in ("phase", "operator", *_SIDE) if c not in ops]
    if missing:
        raise KeyError(f"operator rows lack {', '.join(missing)}")
    totals = pd.DataFrame([{"phase": p, "operator": WHOLE, **{k: w.get(k) for k in _SIDE}}
                           for p, w in whole.items()])
    rows = pd.concat([ops[["phase", "operator", *_SIDE]], totals], ignore_index=True)
    rows = rows.astype({"phase": "str", "operator": "str", "bound": "str",
                        **{k: "float64" for k in _SIDE if k != "bound"}})
    return rows


def diff(a: Analysis | Mapping[str, object] | Side,
         b: Analysis | Mapping[str, object] | Side) -> pd.DataFrame:
    """Per (phase, operator), A against B (`DIFF_COLUMNS`); see docs/design.md."""
    sa, sb = side(a, "A"), side(b, "B")
    m = sa.rows.merge(sb.rows, on=["phase", "operator"], how="outer", suffixes=("_a", "_b"),
                      indicator=True, sort=False)
    m["presence"] = m.pop("_merge").map({"both": "both", "left_only": "a only",
                                         "right_only": "b only"}).astype("str")
    for s, sfx in ((sa, "_a"), (sb, "_b")):
        n = m["phase"].map(s.steps)
        m["steps" + sfx] = n.astype("Int64")
    per_step = m["steps_a"].notna() & m["steps_b"].notna()
    for sfx in ("_a", "_b"):
        div = m["steps" + sfx].astype("float64").where(per_step, 1.0)
        for k in ("time_us", "flops", "bytes"):
            m[k + sfx] = m[k + sfx] / div
    m.loc[~per_step, ["steps_a", "steps_b"]] = pd.NA
    m = m.rename(columns={"time_us_a": "time_a_us", "time_us_b": "time_b_us"})
    m["speedup"] = m["time_a_us"] / m["time_b_us"].where(m["time_b_us"] > 0)
    fa, fb = m["flops_a"].to_numpy(), m["flops_b"].to_numpy()
    rtol = np.where(m["operator"] == WHOLE, WORKLOAD_RTOL, FLOPS_RTOL)
    equal = np.abs(fa - fb) <= rtol * np.maximum(np.abs(fa), np.abs(fb))
    m["flops_equal"] = pd.array(equal, dtype="boolean")
    m.loc[m["flops_a"].isna() | m["flops_b"].isna(), "flops_equal"] = pd.NA
    m["delta_intensity"] = m["intensity_b"] - m["intensity_a"]
    m["delta_pct_of_roof"] = m["pct_of_roof_b"] - m["pct_of_roof_a"]
    m["_whole"] = m["operator"] == WHOLE
    m["_time"] = m[["time_a_us", "time_b_us"]].max(axis=1)
    phases = list(dict.fromkeys([*sa.steps, *sb.steps]))
    m["_phase"] = m["phase"].map({p: i for i, p in enumerate(phases)})
    m = m.sort_values(["_phase", "_whole", "_time"], ascending=[True, True, False], kind="stable")
    return m[list(DIFF_COLUMNS)].astype(DIFF_COLUMNS).reset_index(drop=True)


def notes(table: pd.DataFrame, a: Side, b: Side) -> list[str]:
    """What a reader must know before trusting the speed-ups: a different model, a different
    workload, a different device, totals compared instead of per-step figures (`headline`:
    printed before the table), then operators whose FLOPs differ and operators on one side only."""
    return headline(table, a, b) + _operator_notes(table)


def headline(table: pd.DataFrame, a: Side, b: Side) -> list[str]:
    """The notes that change how the whole table reads, said first."""
    out = []
    if a.model and b.model and a.model != b.model:
        out.append(f"DIFFERENT MODEL: A is {a.model} (from {_model_source(a)}), B is {b.model} "
                   f"(from {_model_source(b)}); every speed-up compares different models' work")
    whole = table[table["operator"] == WHOLE]
    for r in whole[whole["flops_equal"].eq(False)].itertuples():
        out.append(f"DIFFERENT WORKLOAD ({r.phase}): whole-model FLOPs per step "
                   f"{si(r.flops_a, 'FLOP')} (A) vs {si(r.flops_b, 'FLOP')} (B); speed-ups "
                   "compare different work (model, batch, context, dtype, layers or fusion "
                   "changed)")
    ha, hb = (_device(s) for s in (a, b))
    if ha != hb:
        out.append(f"different devices: A on {ha}, B on {hb}; % of roof is against each one's "
                   "own roofs")
    if table["steps_a"].isna().any():
        out.append("step counts unknown for some phases: their times, FLOPs and bytes are per "
                   "trace, not per step")
    return out


def _model_source(s: Side) -> str:
    return "--model" if s.model_from == "--model" else "the trace's shapes"


def _device(s: Side) -> str:
    name = s.hardware.get("name") if s.hardware else None
    return str(name) if name else "no device (a CPU trace without --hardware: no roofs)"


def _operator_notes(table: pd.DataFrame) -> list[str]:
    out = []
    whole = table[table["operator"] == WHOLE]
    changed = whole["flops_equal"].eq(False).any()
    ops = table[(table["operator"] != WHOLE) & table["flops_equal"].eq(False)]
    if len(ops):
        why = "" if changed else (
            "; the whole model is the same workload, so this is fusion or kernel choice (a "
            "fused kernel's FLOPs are counted per kernel): compare their time, not their % of roof")
        out.append(f"FLOPs differ for {len(ops)} operator(s): " + ", ".join(
            f"{r.operator} ({r.phase})" for r in ops.itertuples()) + why)
    for who, tag in (("a only", "A"), ("b only", "B")):
        only = table[table["presence"] == who]
        if len(only):
            out.append(f"only in {tag}: " + ", ".join(f"{r.operator} ({r.phase})"
                                                      for r in only.itertuples()))
    return out


def _fmt(v: object, spec: str, scale: float = 1.0) -> str:
    """`v / scale` formatted; '-' when missing. Zero is never `-0.0` or `+0.0`: zero or a change
    ('+' in `spec`) that rounds to zero prints `0.0`, a figure that is not zero `<0.1`."""
    if v is None or v is pd.NA or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    x = float(cast(SupportsFloat, v)) / scale
    text = format(x, spec)
    if float(text) != 0:
        return text
    if x == 0 or "+" in spec:  # no change, or none that shows: no sign
        return format(0.0, spec.replace("+", ""))
    least = format(10.0 ** -int(spec.split(".")[1].rstrip("f")), spec)  # ".1f" -> "0.1"
    return f"<{least}" if x > 0 else f">-{least}"


def _flops_flag(v: object) -> str:
    return "-" if v is pd.NA or v is None else "=" if v else "CHANGED"


_HEAD = ("operator", "phase", "in", "A µs", "B µs", "speedup", "A F/B", "B F/B", "ΔF/B",
         "A %roof", "B %roof", "Δ%roof", "FLOPs")


def _cells(r) -> tuple[str, ...]:
    return (r.operator, r.phase, {"both": "A+B", "a only": "A", "b only": "B"}[r.presence],
            _fmt(r.time_a_us, ".1f"), _fmt(r.time_b_us, ".1f"), _fmt(r.speedup, ".2f") + "x"
            if r.speedup == r.speedup else "-", _fmt(r.intensity_a, ".2f"),
            _fmt(r.intensity_b, ".2f"), _fmt(r.delta_intensity, "+.2f"),
            _fmt(r.pct_of_roof_a, ".1f"), _fmt(r.pct_of_roof_b, ".1f"),
            _fmt(r.delta_pct_of_roof, "+.1f"), _flops_flag(r.flops_equal))


def _who(s: Side) -> str:
    return f"{s.trace}" + (f"   model {s.model}" if s.model else "")


def format_table(table: pd.DataFrame, a: Side, b: Side) -> str:
    """The terminal text: the two traces, the headline notes (a different model, workload or
    device: before any figure), the unit of time, one line per row, then the operator notes."""
    rows = [_HEAD, *(_cells(r) for r in table.itertuples())]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_HEAD))]
    unit = "per step" if table["steps_a"].notna().all() else "per trace where steps are unknown"
    lines = [f"A {_who(a)}", f"B {_who(b)}", *(f"! {n}" for n in headline(table, a, b)),
             f"device time {unit}; speedup = A/B (>1: B faster)"]
    for row in rows:
        lines.append(" ".join(c.ljust(w) if i < 3 else c.rjust(w)
                              for i, (c, w) in enumerate(zip(row, widths, strict=True))))
    return "\n".join(lines + [f"! {n}" for n in _operator_notes(table)])


def markdown(table: pd.DataFrame, a: Side, b: Side, chart: str | None = "diff.png") -> str:
    """diff.md: the traces, the chart, the table and the notes."""
    out = ["# trace_roofline diff", "", f"- A: `{a.trace}`" + (f" ({a.model})" if a.model else ""),
           f"- B: `{b.trace}`" + (f" ({b.model})" if b.model else ""), ""]
    out += [f"**{n}**" for n in headline(table, a, b)] + ([""] if headline(table, a, b) else [])
    if chart:
        out += [f"![A to B on the roofline]({chart})", ""]
    out += ["| " + " | ".join(_HEAD) + " |", "|" + "---|" * len(_HEAD)]
    out += ["| " + " | ".join(_cells(r)) + " |" for r in table.itertuples()]
    out += ["", "speedup = time A / time B (above 1: B is faster); FLOPs `CHANGED` = a different "
            "workload for that operator.", ""]
    out += [f"- **{n}**" for n in _operator_notes(table)]
    return "\n".join(out) + "\n"


def to_json(table: pd.DataFrame, a: Side, b: Side) -> dict[str, object]:
    """diff.json: {a, b, notes, rows}, NaN/NA as null."""
    rows = table.astype(object).where(table.notna(), None).to_dict(orient="records")
    return {"a": {"trace": a.trace, "model": a.model, "hardware": a.hardware, "steps": a.steps},
            "b": {"trace": b.trace, "model": b.model, "hardware": b.hardware, "steps": b.steps},
            "notes": notes(table, a, b), "rows": rows}
