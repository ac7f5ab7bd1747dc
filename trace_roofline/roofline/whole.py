"""The whole model of a phase (ΣFLOPs/Σbytes and its time-weighted rates), its reconciliation
with the operator rows, and the extrapolation of one step to the full model's depth.

Design notes: docs/design.md ("trace_roofline/roofline/").
"""

from __future__ import annotations

import math
from typing import cast

import numpy as np
import pandas as pd

from trace_roofline.costs.model_level import mlp_costs, model_level_costs
from trace_roofline.errors import InputError
from trace_roofline.model import formulas
from trace_roofline.model.hardware import Hardware
from trace_roofline.model.models import ModelSpec
from trace_roofline.model.operators import MODEL_LEVEL, MOE, Name
from trace_roofline.roofline import placement

# A phase's whole-model figure is withheld (`withheld` True, not drawn, not printed) when less
# than this fraction of its device time is costed: ΣFLOPs/Σbytes of the costed rest (a CNN's
# ReLU and pooling around uncosted convolutions) would not describe the model.
MIN_COSTED = 0.5
# Per-operator full-model costs of one step (`extrapolate`).
EXTRAPOLATED_COLUMNS = {
    "phase": "str",
    "operator": "str",
    "source": "str",  # "trace" (as traced), "trace x<f>" (per-layer, scaled), "model" (added)
    "flops": "float64",
    "bytes": "float64",
    "intensity": "float64",
    "byte_share": "float64",
    "contribution": "float64",  # flops / Σbytes: sums to the whole-model intensity
}


def whole_model(table: pd.DataFrame, hardware: Hardware | None = None) -> dict[str, object]:
    """ΣFLOPs, Σbytes, the byte-weighted intensity ΣF/ΣB and, when the table has device times,
    the time-weighted achieved rates ΣF/Σt and ΣB/Σt over the costed time. `table` is `place`'s
    (its aggregated rows are used) or `extrapolate`'s. Rows above their roof whose bytes
    overcount what ran (`placement.above`) are left out of the sums and the rates: `excluded`
    {operator: µs}, `excluded_time_us`; the time and kernels count every row."""
    every = table[table["layer"].isna()] if "layer" in table else table
    above = placement.above(every)
    names = (every["operator"] if "operator" in every
             else pd.Series(every.index.astype(str), index=every.index))
    rows = every[~above]
    flops = float(rows["flops"].sum())
    nbytes = float(rows["bytes"].sum())
    out: dict[str, object] = {
        "flops": flops, "bytes": nbytes,
        "intensity": flops / nbytes if nbytes > 0 else math.nan,
    }
    if "time_us" not in rows:
        return out
    timed = float(rows["costed_time_us"].sum())
    secs = timed * 1e-6
    secs = secs if secs > 0 else math.nan  # (a subnormal time is 0 s: no rate)
    out.update({
        "time_us": float(every["time_us"].sum()), "costed_time_us": timed,
        "kernels": int(every["kernels"].sum()), "uncosted": int(every["uncosted"].sum()),
        "achieved_flops_per_s": flops / secs, "achieved_bytes_per_s": nbytes / secs,
        "phases": sorted(every["phase"].unique().tolist()),
        "excluded": dict(zip(names[above], every.loc[above, "time_us"].astype(float),
                             strict=True)),
        "excluded_time_us": float(every.loc[above, "costed_time_us"].sum()),
    })
    if hardware is not None and out["intensity"] == out["intensity"]:
        peak = placement.peak_for(hardware, placement.main_dtype(rows))
        i = float(cast(float, out["intensity"]))
        ridge = formulas.ridge(peak, hardware.mem_bandwidth)
        bound = formulas.bound(i, ridge)
        out.update({
            "peak_flops_per_s": peak,
            "attainable_flops_per_s": formulas.attainable(i, peak, hardware.mem_bandwidth),
            "pct_of_roof": 100.0 * (cast(float, out["achieved_bytes_per_s"]) / hardware.mem_bandwidth
                                    if bound == "memory"
                                    else cast(float, out["achieved_flops_per_s"]) / peak),
            "bound": bound,
        })
    return out


def reconcile(ops: pd.DataFrame) -> pd.DataFrame:
    """Per operator (aggregated rows, per phase): byte share, intensity and contribution
    bytes_i/Σbytes · I_i = flops_i/Σbytes; contributions sum to the phase's ΣFLOPs/Σbytes (rows
    the whole model leaves out, `placement.above`, left out here too)."""
    rows = ops[ops["layer"].isna() & ops["bytes"].notna() & ~placement.above(ops)]
    out = rows[["phase", "operator", "flops", "bytes", "intensity"]].reset_index(drop=True)
    total = out.groupby("phase")["bytes"].transform("sum")
    out["byte_share"] = out["bytes"] / total
    out["contribution"] = out["flops"] / total
    return out.sort_values(["phase", "contribution"], ascending=[True, False],
                           kind="stable").reset_index(drop=True)


def extrapolate(costed: pd.DataFrame, model: ModelSpec, layers: int) -> pd.DataFrame:
    """Full-model costs of one step per (phase, operator) (`EXTRAPOLATED_COLUMNS`).

    Instances inside a decoder layer (a non-NA `layer`; without any layer information, every
    operator outside `operators.MODEL_LEVEL`) are averaged per step and per traced layer
    (distinct layers, else attention instances per step), then multiplied by `layers`; the rest
    keep their per-step cost. Embedding, final_norm and lm_head are added from the model when the trace
    lacks them (final_norm = one traced layer's input_norm when there is one, else an RMSNorm).

    A mixture-of-experts model's MLP differs by layer (ModelSpec.sparse_among(layers)): the MLP
    operators (the dense MLP's, `act`, and operators.MOE) of the traced sparse layers (those
    holding MoE operators) scale to the model's sparse layers, those of the traced dense layers
    to its dense ones; a kind of layer the model has but the trace lacks is added from the
    model's shapes (shapes.mlp_costs, source "model"). Tied embeddings change nothing here:
    the LM head reads the (shared) matrix once per step either way.
    """
    if layers < 1:
        raise InputError(f"`layers` must be >= 1, got {layers}", "layers")
    n_sparse = len(model.sparse_among(layers))
    parts = []
    for phase, c in costed[costed["flops"].notna()].groupby("phase", sort=False):
        steps = max(c["step"].nunique(), 1)
        if c["layer"].notna().any():
            in_layer = c["layer"].notna().to_numpy()
            in_trace = c["layer"].nunique()
        else:
            in_layer = (~c["operator"].isin(MODEL_LEVEL)).to_numpy()
            in_trace = max(round(c["cost_kind"].eq(Name.ATTENTION).sum() / steps), 1)
        mlp = c["operator"].isin(_MLP).to_numpy()
        sparse = _sparse_layers(c)
        traced_sparse = int(pd.Series(c["layer"][sparse]).nunique()) if sparse.any() else 0
        if not c["layer"].notna().any():
            traced_sparse = in_trace if sparse.any() else 0
        factor = np.where(in_layer, layers / in_trace, 1.0)
        for is_sparse, traced, n in ((True, traced_sparse, n_sparse),
                                     (False, in_trace - traced_sparse, layers - n_sparse)):
            rows = in_layer & mlp & (sparse == is_sparse)
            factor = np.where(rows, n / traced if traced else 0.0, factor)
        weight = factor / steps
        scaled = pd.DataFrame({"operator": c["operator"].to_numpy(), "layered": in_layer,
                               "factor": factor, "flops": c["flops"].to_numpy() * weight,
                               "bytes": c["bytes"].to_numpy() * weight})
        g = scaled.groupby("operator", sort=False)
        found = g[["flops", "bytes"]].sum().reset_index()
        found["source"] = [f"trace x{f:g}" if lay else "trace" for f, lay in
                           zip(g["factor"].max(), g["layered"].any(), strict=True)]
        tokens, sequences = _tokens(c)
        added = model_level_costs(model, tokens, sequences)
        norm = scaled[scaled["layered"] & (scaled["operator"] == Name.INPUT_NORM)]
        if len(norm):  # one layer's input norm: the same [tokens, hidden] RMSNorm
            added.loc[added["operator"] == Name.FINAL_NORM, ["flops", "bytes"]] = (
                norm[["flops", "bytes"]].sum().to_numpy() / layers)
        added = added[~added["operator"].isin(found["operator"])].assign(source="model")
        missing = [mlp_costs(model, tokens, kind).assign(
            flops=lambda d, n=n: d["flops"] * n, bytes=lambda d, n=n: d["bytes"] * n)
            for kind, traced, n in ((True, traced_sparse, n_sparse),
                                    (False, in_trace - traced_sparse, layers - n_sparse))
            if n and not traced]
        part = pd.concat([found, added[["operator", "flops", "bytes", "source"]],
                          *[m.assign(source="model")[["operator", "flops", "bytes", "source"]]
                            for m in missing]], ignore_index=True)
        part = part.groupby("operator", sort=False).agg(
            flops=("flops", "sum"), bytes=("bytes", "sum"),
            source=("source", lambda v: " + ".join(dict.fromkeys(v)))).reset_index()
        parts.append(part.assign(phase=phase))
    out = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(
        columns=list(EXTRAPOLATED_COLUMNS))
    out["intensity"] = out["flops"] / out["bytes"].where(out["bytes"] > 0)
    total = out.groupby("phase")["bytes"].transform("sum")
    out["byte_share"] = out["bytes"] / total
    out["contribution"] = out["flops"] / total
    return out[list(EXTRAPOLATED_COLUMNS)].astype(EXTRAPOLATED_COLUMNS)


# A layer's MLP operators: the dense MLP's, the activation, and the MoE ones
_MLP = frozenset({Name.GATE_PROJ, Name.UP_PROJ, Name.GATE_UP_PROJ, Name.DOWN_PROJ, Name.ACT}) | MOE


def _sparse_layers(c: pd.DataFrame) -> np.ndarray:
    """Per row: whether its (step, layer) holds MoE operators (without layers: the trace)."""
    moe_row = c["operator"].isin(MOE)
    if not c["layer"].notna().any():
        return np.full(len(c), bool(moe_row.any()))
    key = [c["step"].fillna(-1).to_numpy(), c["layer"].fillna(-1).to_numpy()]
    return moe_row.groupby(key).transform("any").to_numpy(bool) & c["layer"].notna().to_numpy()


def _tokens(c: pd.DataFrame) -> tuple[int, int]:
    """(tokens, sequences) per step: from attention B·T and B, else a GEMM's M for both."""
    attn = c[c["cost_kind"].eq(Name.ATTENTION)]
    if len(attn):
        b, t = int(attn["B"].median()), int(attn["T"].median())
        return b * t, b
    gemm = c[c["cost_kind"].eq("gemm")]
    m = int(gemm["M"].median()) if len(gemm) else 1
    return m, m


def withheld(whole: dict[str, object]) -> dict[str, object]:
    """A phase's whole model with `costed_fraction` and `withheld` (< MIN_COSTED costed)."""
    costed = cast(float, whole["costed_time_us"]) + cast(float, whole["excluded_time_us"])
    frac = costed / cast(float, whole["time_us"]) if whole.get("time_us") else math.nan
    return {**whole, "costed_fraction": frac, "withheld": not frac >= MIN_COSTED}


def withheld_notes(whole: dict[str, dict[str, object]]) -> list[str]:
    return [f"whole model ({p}) withheld: only {100 * cast(float, w['costed_fraction']):.1f}% of its device "
            f"time is costed (under {100 * MIN_COSTED:.0f}%), so ΣFLOPs/Σbytes would describe "
            "the costed rest, not the model" for p, w in whole.items() if w["withheld"]]
