"""Roofline placement: the per-(phase, operator, layer) table of every costed instance, each
row's compute peak and roof, and why a row can sit above it.

Design notes: docs/design.md ("trace_roofline/roofline/").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from trace_roofline import frames
from trace_roofline.attribution import comms
from trace_roofline.costs.calculator import si
from trace_roofline.errors import InputError
from trace_roofline.model import dtypes
from trace_roofline.model.hardware import Hardware
from trace_roofline.model.operators import FALLBACK

# One row per (phase, operator, layer); layer NA = aggregated over layers and steps.
OPERATOR_COLUMNS = {
    "operator": "str",
    "layer": "Int64",
    "phase": "str",  # decode|prefill|unknown
    "kernels": "int64",  # device rows (kernels, memcpy, memset)
    "instances": "int64",  # op instances
    "uncosted": "int64",  # op instances without a cost (their time is excluded from the rates)
    "time_us": "float64",  # Σ device time of all kernels
    "time_share": "float64",  # of the phase's device time
    "costed_time_us": "float64",  # Σ device time of the costed instances
    "flops": "float64",
    "bytes": "float64",
    "intensity": "float64",  # FLOP/byte
    "achieved_flops_per_s": "float64",  # flops / costed time
    "achieved_bytes_per_s": "float64",  # bytes / costed time
    "dtype": "str",  # dtype of the instance with the most FLOPs (then bytes): picks the peak
    "peak_flops_per_s": "float64",
    "attainable_flops_per_s": "float64",  # min(P, I·B_mem)
    "pct_of_roof": "float64",  # achieved / attainable, in percent
    "bound": "str",  # memory|compute; link for collectives
    # achieved > attainable. Memory-bound: the analytical minimum bytes exceed the DRAM traffic
    # that moved (reuse served from L2, or bytes counted too high); compute-bound: FLOPs counted
    # too high (e.g. --causal full) or the peak understated. Either way, or mis-timed kernels.
    "exceeds_roof": "boolean",
    # a row above its roof: why its figures can beat it (`above_roof_why`), else missing;
    # those whose bytes overcount what ran (OVERCOUNT) stay out of the whole model
    "exceeds_why": "str",
    "evidence": "str",  # the evidence (attribute.EVIDENCE) that named most of the row's time
    # every evidence with its fraction of the row's time, largest first: "annotation 0.97,
    # position 0.03" ("shape 1" when one evidence named it all)
    "evidence_mix": "str",
    # where the row's figures came from (shapes.DERIVATIONS: shape, step, layout, kernel,
    # unknown): the derivation of most of its time
    "derivation": "str",
    # attention: Σ query-key pairs executed and useful (shapes.COSTED_COLUMNS), NaN otherwise
    "pairs_executed": "float64",
    "pairs_useful": "float64",
    # routed expert GEMMs: active experts per layer (mean over the layers and steps of the row),
    # counted or expected under uniform routing, and its range (shapes.COSTED_COLUMNS)
    "experts_active": "float64",
    "experts_active_low": "float64",
    "experts_active_high": "float64",
}
EXPERTS_ACTIVE = ("experts_active", "experts_active_low", "experts_active_high")
_PAIRS = ("pairs_executed", "pairs_useful")

# A row above its roof by at most this factor is the ceiling's own error (a calibration or a
# datasheet figure a little low), said so in `exceeds_why`.
ROOF_TOLERANCE = 1.05
# `exceeds_why` of a memory-bound row further above whose bytes per instance exceed the L2:
# bytes that did not all move, left out of the whole model (`whole_model`)
OVERCOUNT = "an overcount of its minimum bytes"


def place(costed: pd.DataFrame, hardware: Hardware | None,
          measured: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per-operator roofline table (`OPERATOR_COLUMNS`): one row per (phase, operator, layer)
    and one per (phase, operator) aggregated over layers and steps (layer NA).

    `measured` (ncu.measured_by_operator over ("layer", "operator")) adds measured_bytes and
    measured_intensity = flops / measured_bytes; aggregated rows sum their layers' bytes.
    """
    inst = _Instances.of(costed)
    per_layer = _aggregate(inst, ["phase", "operator", "layer"])
    per_layer = per_layer[per_layer["layer"].notna()]  # instances outside a layer: overall only
    overall = _aggregate(inst, ["phase", "operator"]).assign(layer=pd.NA)
    ops = pd.concat([overall, per_layer], ignore_index=True)
    phase_time = costed.groupby("phase")["time_us"].sum()
    ops["time_share"] = ops["time_us"] / ops["phase"].map(phase_time)
    ops = place_rows(ops, hardware, main_dtype(costed))
    ops = ops[list(OPERATOR_COLUMNS)].astype(OPERATOR_COLUMNS)
    ops = ops.sort_values(["layer", "time_us"], ascending=[True, False], na_position="first",
                          kind="stable").reset_index(drop=True)
    if measured is not None:
        ops = _with_measured(ops, measured)
    return ops


@dataclass(frozen=True)
class _Instances:
    """What `_aggregate` reads of a costed table, with its text as integer codes, so that
    grouping moves integers and floats, never strings."""

    # phase, operator, layer, dtype, evidence, derivation: codes, -1 missing
    codes: dict[str, np.ndarray]
    values: dict[str, object]  # the value of each code (`pd.factorize`'s uniques)
    numbers: pd.DataFrame  # kernels, _costed, time_us, _costed_time, flops, bytes, EXPERTS_ACTIVE, _PAIRS
    # the costed instances with a dtype in the order that picks a group's dtype (most FLOPs,
    # then most bytes, first in the table): each instance's rank in it (len(lead): not in
    # it), and the dtype code at each rank
    rank: np.ndarray
    lead: np.ndarray

    @classmethod
    def of(cls, costed: pd.DataFrame) -> _Instances:
        """Instances without a recorded evidence count as fallback; a table without the
        experts_active columns has none."""
        codes, values = {}, {}
        for col in ("phase", "operator", "layer", "dtype", "evidence", "derivation"):
            col_values = costed[col] if col in costed else pd.Series(
                "unknown" if col == "derivation" else FALLBACK, index=costed.index)
            codes[col], values[col] = pd.factorize(col_values.array)
        flops, nbytes, time_us = (_floats(costed[c]) for c in ("flops", "bytes", "time_us"))
        priced = ~np.isnan(flops)
        numbers = pd.DataFrame({
            "kernels": costed["kernels"].array, "_costed": priced, "time_us": time_us,
            "_costed_time": np.where(priced, time_us, 0.0), "flops": flops, "bytes": nbytes,
            **{col: _floats(costed[col]) if col in costed else np.nan
               for col in (*EXPERTS_ACTIVE, *_PAIRS)}})
        rows = np.flatnonzero(priced & (codes["dtype"] >= 0))
        order = rows[np.lexsort((np.where(np.isnan(nbytes[rows]), np.inf, -nbytes[rows]),
                                 -flops[rows]))]
        rank = np.full(len(costed), len(order), dtype=np.int64)
        rank[order] = np.arange(len(order))
        return cls(codes, values, numbers, rank, codes["dtype"][order])


def _floats(col: pd.Series) -> np.ndarray:
    return col.to_numpy(np.float64, na_value=np.nan)


def _aggregate(inst: _Instances, keys: list[str]) -> pd.DataFrame:
    """Sum the instances per group of `keys` (missing values form groups, in order of first
    appearance); rates use only the costed instances' time; active experts averaged; the
    dtype of the group's instance doing the most FLOPs (then bytes) sets its compute peak;
    `_evidence`."""
    parts = [inst.codes[k] for k in keys]
    ids, first_rows = frames.distinct_codes(parts)
    out = inst.numbers.groupby(ids, sort=False).agg(  # per column: a block sums in another order
        kernels=("kernels", "sum"), instances=("kernels", "size"),
        costed_instances=("_costed", "sum"), time_us=("time_us", "sum"),
        costed_time_us=("_costed_time", "sum"), flops=("flops", "sum"), bytes=("bytes", "sum"),
        experts_active=("experts_active", "mean"),
        experts_active_low=("experts_active_low", "mean"),
        experts_active_high=("experts_active_high", "mean"),
    ).reset_index(drop=True)
    pairs = inst.numbers[list(_PAIRS)].groupby(ids, sort=False).sum(min_count=1)
    out[list(_PAIRS)] = pairs.reset_index(drop=True)
    for key, codes in zip(keys, parts, strict=True):
        out[key] = _decode(codes[first_rows], inst.values[key])
    none = out["costed_instances"] == 0  # no costed instance: NaN, not a sum of nothing
    out[["flops", "bytes"]] = out[["flops", "bytes"]].where(~none, axis=0)
    out["uncosted"] = out["instances"] - out["costed_instances"]
    first = pd.Series(inst.rank).groupby(ids, sort=False).min().to_numpy()
    out["dtype"] = _decode(np.append(inst.lead, -1)[first], inst.values["dtype"])
    secs = out["costed_time_us"].where(out["costed_time_us"] > 0) * 1e-6
    out["intensity"] = out["flops"] / out["bytes"].where(out["bytes"] > 0)
    out["achieved_flops_per_s"] = out["flops"] / secs
    out["achieved_bytes_per_s"] = out["bytes"] / secs
    evidence, mix = _evidence(ids, inst.codes["evidence"], inst.numbers["time_us"],
                              inst.values["evidence"])
    derivation = _evidence(ids, inst.codes["derivation"], inst.numbers["time_us"],
                           inst.values["derivation"])[0]
    return out.assign(evidence=evidence, evidence_mix=mix, derivation=derivation)


def _decode(codes: np.ndarray, values: object) -> object:
    """The values (`pd.factorize`'s uniques) of `codes`; -1: missing."""
    return pd.api.extensions.take(values, codes, allow_fill=True)


def _evidence(ids: np.ndarray, evidence: np.ndarray, time_us: pd.Series, values: object
              ) -> tuple[object, list[str]]:
    """Per group number of `ids` (0, 1, ...): the evidence naming most of its time, and every
    evidence's fraction of it ("annotation 0.97, position 0.03"); `evidence`: codes of
    `values`."""
    pair, first = frames.distinct_codes([ids, evidence])
    t = pd.DataFrame({"group": ids[first], "evidence": _decode(evidence[first], values),
                      "time_us": time_us.groupby(pair, sort=False).sum().to_numpy()})
    by = t.groupby("group", sort=False)["time_us"]
    t["share"] = (t["time_us"] / by.transform("sum")).fillna(1.0 / by.transform("size"))
    t = t.sort_values("share", ascending=False, kind="stable")
    t["text"] = t["evidence"] + " " + t["share"].map("{:.3g}".format).astype("str")
    g = t.groupby("group", sort=True)
    return g["evidence"].first().to_numpy(), g["text"].agg(", ".join).tolist()


def main_dtype(table: pd.DataFrame) -> str | None:
    """The dtype carrying the most FLOPs in a costed or operator table (the compute dtype)."""
    flops = table.groupby("dtype")["flops"].sum()
    return str(flops.idxmax()) if len(flops) and flops.max() > 0 else None


def peak_key(hardware: Hardware, dtype: str | None, main: str | None = None) -> str:
    """The `hardware.peak_flops` key that rules `dtype`: its own for a floating-point dtype a
    hardware file can list (bf16, fp16, fp32, tf32, fp8), an InputError when `hardware` lacks it;
    for the rest (integers, bool, fp64, complex, none) `main`'s by the same rule, and with no
    such `main` (no floating-point work) bf16's, else the highest listed."""
    for d in (dtype, main):
        key = _listable(d)
        if key is None:
            continue
        if key not in hardware.peak_flops:
            raise InputError(
                f"`hardware` {hardware.name!r} has no {key} peak (has: "
                f"{', '.join(hardware.peak_flops)}) for the {key} operators; add \"{key}\" to "
                "peak_flops in a hardware JSON file", "hardware")
        return key
    if "bf16" in hardware.peak_flops:
        return "bf16"
    return max(hardware.peak_flops, key=hardware.peak_flops.__getitem__)


def peak_for(hardware: Hardware, dtype: str | None, main: str | None = None) -> float:
    """The compute peak that rules `dtype` (`peak_key`)."""
    return hardware.peak_flops[peak_key(hardware, dtype, main)]


def _listable(dtype: str | None) -> str | None:
    """The peak key of a dtype a hardware file can list a peak for, else None."""
    d = dtypes.lookup(dtype) if dtype is not None else None
    return d.peak if d is not None else None


def place_rows(ops: pd.DataFrame, hardware: Hardware | None, main: str | None) -> pd.DataFrame:
    """Peak, attainable, % of roof, bound and the exceeds flag for each row of `ops` (columns
    operator, dtype, flops, bytes, intensity, achieved_*_per_s); `main`: the compute dtype
    (`main_dtype`). Collectives are placed under the link roof."""
    ops = ops.copy()
    nan = pd.Series(np.nan, index=ops.index)
    link = comms.is_collective(ops["operator"])
    ops.loc[link, "intensity"] = np.nan  # bus bytes, no FLOPs: not on the FLOP/byte axis
    if hardware is None:
        ops[["peak_flops_per_s", "attainable_flops_per_s", "pct_of_roof"]] = np.nan
        ops["bound"] = pd.Series(None, index=ops.index, dtype="str")
        ops["exceeds_roof"] = pd.Series(pd.NA, index=ops.index, dtype="boolean")
        ops["exceeds_why"] = pd.Series(pd.NA, index=ops.index, dtype="str")
        return ops
    dtypes = ops["dtype"].astype("object").where(ops["dtype"].notna(), None)
    peaks = {d: peak_for(hardware, d, main) for d in dtypes.unique()}
    peak = dtypes.map(peaks).astype("float64")
    bw = hardware.mem_bandwidth
    intensity = ops["intensity"].where(ops["bytes"] > 0, nan)
    # A 0-byte, 0-FLOP instance has no intensity; a 0-FLOP copy has I = 0 (memory-bound).
    ops["peak_flops_per_s"] = peak
    ops["attainable_flops_per_s"] = np.minimum(peak, intensity * bw)
    memory = intensity < peak / bw
    pct = np.where(memory, ops["achieved_bytes_per_s"] / bw, ops["achieved_flops_per_s"] / peak)
    ops["pct_of_roof"] = pd.Series(pct, index=ops.index).where(intensity.notna()) * 100.0
    ops["bound"] = pd.Series(np.where(memory, "memory", "compute"), index=ops.index,
                             dtype="str").where(intensity.notna())
    if link.any():  # the interconnect is their roof: bus bytes/s over link bytes/s
        lbw = hardware.link_bandwidth or np.nan
        ops.loc[link, ["peak_flops_per_s", "attainable_flops_per_s"]] = np.nan
        ops.loc[link, "pct_of_roof"] = ops.loc[link, "achieved_bytes_per_s"] / lbw * 100.0
        ops.loc[link, "bound"] = "link"
    ops["exceeds_roof"] = (ops["pct_of_roof"] > 100.0).astype("boolean").where(
        ops["pct_of_roof"].notna(), pd.NA)
    ops["exceeds_why"] = above_roof_why(ops, hardware)
    return ops


def _with_measured(ops: pd.DataFrame, measured: pd.DataFrame) -> pd.DataFrame:
    """Join measured DRAM bytes per (layer, operator); an aggregated row sums its operator's
    measured rows, and is NaN when any of them is (a partial sum would understate traffic)."""
    m = measured[["layer", "operator", "measured_bytes"]].astype(
        {"layer": "Int64", "operator": "str", "measured_bytes": "float64"})
    keyed = ops[["layer", "operator"]].merge(m, on=["layer", "operator"], how="left")
    whole = m.groupby("operator")["measured_bytes"].agg(
        lambda s: s.sum() if s.notna().all() else np.nan)
    agg = ops["layer"].isna()
    ops = ops.copy()
    ops["measured_bytes"] = keyed["measured_bytes"].to_numpy(dtype="float64")
    ops.loc[agg, "measured_bytes"] = ops.loc[agg, "operator"].map(whole).to_numpy("float64")
    ops["measured_intensity"] = ops["flops"] / ops["measured_bytes"].where(ops["measured_bytes"] > 0)
    return ops



def above(ops: pd.DataFrame) -> np.ndarray:
    """Per row of an operator table: whether its figures overcount what ran (`exceeds_why`
    OVERCOUNT), which leaves it out of the whole model."""
    if "exceeds_why" not in ops:
        return np.zeros(len(ops), bool)
    return ops["exceeds_why"].str.startswith(OVERCOUNT).to_numpy(bool, na_value=False)


def above_roof_why(ops: pd.DataFrame, hardware: Hardware) -> pd.Series:
    """Why each row above its roof (`exceeds_roof`) can beat it, else missing: within
    ROOF_TOLERANCE, the ceiling's own error; compute-bound, FLOPs counted too high or the peak
    understated; memory-bound, its bytes per costed instance fit in the device's L2 (reuse: the
    minimum bytes did not all cross DRAM), or they do not (OVERCOUNT: bytes that did not move),
    or the L2's size is unknown."""
    out = pd.Series(pd.NA, index=ops.index, dtype="str")
    above = ops["exceeds_roof"].fillna(False).to_numpy(bool)
    if not above.any():
        return out
    rows = ops[above]
    # (a per-kernel table, place_rows' for Perfetto, has one instance a row)
    n = (rows["instances"] - rows["uncosted"] if {"instances", "uncosted"} <= set(rows)
         else pd.Series(1, index=rows.index))
    per = rows["bytes"] / n.where(lambda k: k > 0)
    l2 = hardware.l2_bytes
    each = per.map(lambda b: si(b, "B")) + " per instance"
    fits = (per <= l2).to_numpy(bool) if l2 else np.zeros(len(rows), bool)
    memory = rows["bound"].eq("memory").to_numpy(bool)
    near = (rows["pct_of_roof"] <= 100.0 * ROOF_TOLERANCE).to_numpy(bool)
    cache = f"{hardware.name}'s {si(l2, 'B')} L2"
    beyond = ("L2 reuse or an overcount: " + each + f", {hardware.name}'s L2 size unknown"
              if not l2 else f"{OVERCOUNT}: " + each + " exceed " + cache
              + " (or the bandwidth roof is understated)")
    out[above] = np.where(
        near, f"within {100 * (ROOF_TOLERANCE - 1):.0f}% of the roof: the ceiling is that much "
              "low",
        np.where(~memory, "compute-bound: its FLOPs counted too high or the peak understated",
                 np.where(fits, "L2 reuse: " + each + " fit in " + cache, beyond)))
    return out
