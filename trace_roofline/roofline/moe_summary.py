"""The mixture-of-experts layers of a trace, per phase: tokens, active experts, and the experts'
intensity next to a dense MLP's doing the same FLOPs.

Design notes: docs/design.md ("trace_roofline/roofline/").
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from trace_roofline.costs.moe import ROUTER_KINDS
from trace_roofline.model import dtypes, moe
from trace_roofline.model.gemms import ONE_WEIGHT_OPS
from trace_roofline.model.operators import Name
from trace_roofline.roofline.placement import EXPERTS_ACTIVE

_EXPERTS = [Name.EXPERTS_GATE_UP, Name.EXPERTS_DOWN]


def moe_summary(costed: pd.DataFrame) -> dict[str, dict[str, object]]:
    """Per phase with routed-expert GEMMs: the MoE layers' figures from the costed instances.

    layers: MoE blocks (router logits GEMMs); tokens T: their mean M; experts E: their N;
    routed rows ΣM_e per layer from the down GEMMs' FLOPs (2·ΣM_e·I·H, whatever the form);
    top_k = ΣM_e / T; experts_active (and _low, _high): the layers' mean, `assumption`
    "counted" (a loop's per-expert GEMMs), "uniform routing" (the expectation of moe.py) or
    "upper bound" (tokens or top-k unknown); tokens_per_active_expert = ΣM_e / A;
    experts_intensity: ΣFLOPs / Σbytes of the experts_gate_up and experts_down rows (batched_mm's
    weight gathers included); dense_equivalent_intensity: moe.dense_equivalent_intensity for
    the same T, E, k, H, I and dtype. Figures the trace does not give are None."""
    out: dict[str, dict[str, object]] = {}
    routed = costed["operator"].isin(_EXPERTS) & costed["flops"].notna()
    if not routed.any():  # a dense model: no take of the whole table
        return out
    costed = costed[costed["flops"].notna()]
    for phase, c in costed.groupby("phase", sort=False):
        experts = c[c["operator"].isin(_EXPERTS)]
        if experts.empty:
            continue
        gemm = c["cost_kind"].eq("gemm")
        router = c[c["cost_kind"].isin(ROUTER_KINDS) & c["operator"].eq(Name.ROUTER)
                   & c["N"].gt(1).fillna(False)]
        down = c[gemm & c["operator"].eq(Name.EXPERTS_DOWN)]
        # the weight of one expert's down projection: [K, N], or [M, K] for a weight-first GEMV
        w = np.where(down["N"] > 1, down["K"] * down["N"], down["M"] * down["K"]).astype(float)
        hidden = float(np.where(down["N"] > 1, down["N"], down["M"]).max()) if len(down) else None
        inter = float(down["K"].max()) if len(down) else None
        total_rows = float((down["flops"] / (2.0 * w)).sum())
        blocks = len(router)
        tokens = float(router["M"].mean()) if blocks else None
        rows = total_rows / blocks if blocks else None
        top_k = round(total_rows / float(router["M"].sum())) if blocks and total_rows else None
        n_experts = float(router["N"].median()) if blocks else None
        active = {col: _mean(experts[col]) for col in EXPERTS_ACTIVE}
        base = down["op_name"].astype("object").fillna("").str.rsplit("::", n=1).str[-1]
        counted = bool(base.isin(ONE_WEIGHT_OPS).any())  # a loop: one expert's weight a GEMM
        known = tokens is not None and bool(top_k)
        summary: dict[str, object] = {
            "layers": blocks, "tokens": tokens, "experts": n_experts, "top_k": top_k,
            "routed_rows": rows, "hidden": hidden, "intermediate": inter, **active,
            "assumption": ("counted" if counted else "uniform routing" if known
                           else "upper bound"),
            "tokens_per_active_expert": (rows / active["experts_active"]
                                         if rows and active["experts_active"] else None),
            "experts_intensity": float(experts["flops"].sum() / experts["bytes"].sum()),
            "dense_equivalent_intensity": None,
        }
        b = dtypes.lookup(str(experts["dtype"].iloc[0]))
        if (known and tokens is not None and top_k is not None  # (known: both are)
                and n_experts and hidden and inter and b and top_k <= n_experts):
            spec = moe.Experts(int(n_experts), int(top_k), int(inter))
            summary["dense_equivalent_intensity"] = moe.dense_equivalent_intensity(
                spec, int(hidden), round(tokens), b.bytes)
        out[phase] = summary
    return out


def _mean(values: pd.Series) -> float | None:
    v = values.dropna()
    return float(v.mean()) if len(v) else None
