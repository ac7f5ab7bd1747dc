"""What an analysis's numbers cannot be trusted for, said as warnings before any table, and how
much of the device time was named and costed.

Design notes: docs/design.md ("trace_roofline/roofline/").
"""

from __future__ import annotations

import math
from typing import cast

import numpy as np
import pandas as pd

from trace_roofline.costs import crosscheck
from trace_roofline.model.hardware import Hardware
from trace_roofline.model.models import ModelSpec
from trace_roofline.model.operators import EVIDENCE, FALLBACK, OPERATORS, Name
from trace_roofline.roofline import placement

# An instance whose FLOPs or bytes exceed this multiple of the roof in its measured time has
# shapes no device ran (`implausible`).
IMPLAUSIBLE = 100.0
# Uncosted device time above this fraction is a warning naming the reasons.
UNCOSTED_WARNING = 0.01


NO_DECODER = ("no decoder layer found: no time is named as a decoder-layer operator (projection, "
              "attention, norm, MLP) with evidence, so the rows below are the trace's own op names "
              "(evidence: fallback), not a model's layers")


def contradiction(costed: pd.DataFrame, model: ModelSpec | None,
                  inferred: dict[str, object] | None) -> str | None:
    """What contradicts `model` (the check holding most time first), and what the shapes fit."""
    bad = costed.dropna(subset=["check"])
    if model is None or bad.empty:
        return None
    by_time = bad.groupby("check")["time_us"].sum().sort_values(ascending=False, kind="stable")
    ops = bad.drop_duplicates("operator")["operator"].tolist()
    fits = cast(list[str], inferred["presets"]) if inferred else []
    fit = (f"they fit {', '.join(fits)}" if fits else
           "they fit no preset" + (f" (custom: {crosscheck.describe(inferred)})"
                                   if inferred else ""))
    more = f" ({len(ops)} operators disagree: {', '.join(ops)})" if len(ops) > 1 else ""
    return (f"the trace's shapes contradict model {model.name}, and no tensor-parallel shard "
            f"(TP={'/'.join(map(str, crosscheck.TP_DEGREES))}) explains them: {by_time.index[0]}"
            f"{more}; {fit}")


def host_only(attributed: pd.DataFrame, hardware: Hardware | None) -> list[str]:
    """The warning of a trace of CPU ops and no kernel events analysed with a GPU's hardware:
    its times are the host's, so nothing is placed under the GPU's roof; else none."""
    if hardware is None or "kind" not in attributed or not attributed["kind"].eq("cpu_op").all():
        return []
    return [f"no roofline placement under {hardware.name}: the trace has CPU ops and no kernel "
            "events, so its times are host times, not device times (intensities only)"]


def has_decoder(costed: pd.DataFrame) -> bool:
    """Whether any time is named as a decoder-layer operator with evidence (not a fallback)."""
    per_layer = [o.name for o in OPERATORS if o.per_layer]
    return bool((costed["operator"].isin(per_layer) & costed["evidence"].ne(FALLBACK)).any())


def uncosted(costed: pd.DataFrame) -> list[str]:
    """A warning when more than UNCOSTED_WARNING of the device time has no cost, naming the
    reasons holding most of it (e.g. 'no cost rule for aten::conv2d 78.3%')."""
    total = float(costed["time_us"].sum())
    unc = costed.loc[costed["flops"].isna(), ["time_us", "uncosted"]]
    if total <= 0 or unc["time_us"].sum() <= UNCOSTED_WARNING * total:
        return []
    why = unc.groupby(unc["uncosted"].fillna("no reason recorded"))["time_us"].sum()
    why = why.sort_values(ascending=False, kind="stable") / total
    top = ", ".join(f"{r} {100 * f:.1f}%" for r, f in why.head(4).items())
    more = f" and {len(why) - 4} more" if len(why) > 4 else ""
    return [f"{100 * unc['time_us'].sum() / total:.1f}% of device time is uncosted (no FLOPs or "
            f"bytes; not placed, not in the whole model): {top}{more}"]



def above_roof_notes(ops: pd.DataFrame, whole: dict[str, dict[str, object]]) -> list[str]:
    """Per phase with rows the whole model leaves out (`placement.above`): a warning naming them, their
    % of roof, share of the phase's time and why."""
    agg = ops[ops["layer"].isna() & placement.above(ops)]
    out = []
    for phase, g in agg.groupby("phase", sort=False):
        total = cast(float, whole[phase]["time_us"]) if phase in whole else math.nan
        rows = "; ".join(f"{r.operator} ({r.pct_of_roof:.0f}% of roof, "
                         f"{100 * r.time_us / total:.1f}% of the time: {r.exceeds_why})"
                         for r in g.itertuples())
        out.append(f"whole model ({phase}) leaves out {len(g)} row(s) above their roof, "
                   f"{100 * g['time_us'].sum() / total:.1f}% of its device time: {rows}; their "
                   "figures are not the traffic that ran, so ΣFLOPs/Σbytes is over the rest")
    return out


def malformed(costed: pd.DataFrame) -> list[str]:
    """A warning when shape data were malformed (shapes.Malformed): those instances are
    uncosted, counted in `uncosted`, and named here."""
    bad = costed[costed["cost_kind"] == "malformed"]
    if bad.empty:
        return []
    names = bad["op_name"].value_counts()
    return [f"{len(bad)} op instance(s) left uncosted for malformed shape data (negative, "
            f"non-integer or overflowing dims, or arguments their cost rule cannot read): "
            + ", ".join(f"{op} x{n}" for op, n in names.items())]


def implausible(costed: pd.DataFrame, hardware: Hardware | None
                 ) -> tuple[pd.DataFrame, list[str]]:
    """Instances whose FLOPs or bytes are more than IMPLAUSIBLE x what `hardware` could do in
    their measured time (no hardware: none) have shapes no real run had: they are made
    uncosted (cost_kind "implausible"), so never placed, and a warning per op name says so."""
    if hardware is None:
        return costed, []
    secs = costed["time_us"] * 1e-6
    main = placement.main_dtype(costed)
    codes, uniq = pd.factorize(costed["dtype"].array, use_na_sentinel=False)
    peaks = np.array([placement.peak_for(hardware, None if pd.isna(d) else d, main) for d in uniq],
                     dtype=np.float64)
    peak = pd.Series(peaks[codes], index=costed.index)
    ratio = np.fmax(costed["flops"] / (secs * peak), costed["bytes"] / (secs * hardware.mem_bandwidth))
    bad = ((secs > 0) & (ratio > IMPLAUSIBLE)).to_numpy()
    if not bad.any():
        return costed, []
    out = costed.copy()
    reason = (f"shapes imply more than {IMPLAUSIBLE:g}x {hardware.name}'s roof in the measured "
              "time")
    out.loc[bad, ["flops", "bytes"]] = np.nan
    out.loc[bad, "cost_kind"] = "implausible"
    out.loc[bad, "uncosted"] = out.loc[bad, "op_name"].fillna("?") + ": " + reason
    warnings = []
    worst = costed[bad].assign(_ratio=ratio[bad]).sort_values("_ratio", ascending=False)
    for op, g in worst.groupby("op_name", sort=False, dropna=False):
        w = g.iloc[0]
        warnings.append(
            f"{op} ({', '.join(g['operator'].unique())}): {len(g)} instance(s) at up to "
            f"{w['_ratio']:.3g}x {hardware.name}'s roof ({w['flops']:.3g} FLOPs, "
            f"{w['bytes']:.3g} bytes in {w['time_us']:.3g} us): implausible shapes, left "
            "uncosted and unplaced")
    return out, warnings


def coverage(costed: pd.DataFrame) -> dict[str, object]:
    """Device time attributed to a named operator, named with evidence or by a fallback
    (`by_evidence`: µs per attribute.EVIDENCE value present; `fallback_by_operator`: µs per
    fallback name, largest first), and time of instances that carry a cost."""
    total = float(costed["time_us"].sum())
    attributed = float(costed.loc[costed["operator"] != Name.UNATTRIBUTED, "time_us"].sum())
    priced = float(costed.loc[costed["flops"].notna(), "time_us"].sum())
    fallback = costed["evidence"].eq(FALLBACK).to_numpy()
    by = costed.groupby("evidence")["time_us"].sum()
    named = float(costed.loc[~fallback, "time_us"].sum())
    fb = costed.loc[fallback, ["operator", "time_us"]].groupby("operator")["time_us"].sum()
    fb = fb.sort_values(ascending=False, kind="stable")
    def share(part: float) -> float:  # (a quotient: 1/total overflows for a subnormal total)
        return part / total if total > 0 else math.nan

    return {
        "kernel_time_us": total, "attributed_time_us": attributed,
        "fraction": share(attributed),
        "evidence_time_us": named, "evidence_fraction": share(named),
        "fallback_time_us": total - named, "fallback_fraction": share(total - named),
        "by_evidence": {e: float(by[e]) for e in EVIDENCE if e in by.index},
        "fallback_by_operator": {str(k): float(v) for k, v in fb.items()},
        "costed_time_us": priced, "costed_fraction": share(priced),
        "uncosted_instances": int(costed["flops"].isna().sum()),
        "preset_mismatches": int(costed["check"].notna().sum()),
    }
