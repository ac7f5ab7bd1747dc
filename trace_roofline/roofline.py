"""Roofline placement of every operator, the whole-model view, and their reconciliation.

Design notes: docs/design.md ("trace_roofline/roofline.py").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np
import pandas as pd

from trace_roofline import frames
from trace_roofline.attribution import comms, verify
from trace_roofline.attribution.kind import DECODER, Verdict
from trace_roofline.costs import crosscheck, shapes
from trace_roofline.costs.calculator import si
from trace_roofline.costs.shapes import mlp_costs, model_level_costs
from trace_roofline.errors import InputError
from trace_roofline.model import dtypes, formulas, moe
from trace_roofline.model.hardware import Hardware
from trace_roofline.model.models import ModelSpec
from trace_roofline.model.operators import EVIDENCE, FALLBACK, MODEL_LEVEL, MOE, OPERATORS
from trace_roofline.options import AnalysisOptions

if TYPE_CHECKING:
    from trace_roofline.attribution.graphs import GraphReport

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
    # a row above its roof: why its figures can beat it (`_above_roof_why`), else missing;
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
_ACTIVE = ("experts_active", "experts_active_low", "experts_active_high")
_PAIRS = ("pairs_executed", "pairs_useful")

# An instance whose FLOPs or bytes exceed this multiple of the roof in its measured time has
# shapes no device ran (`_implausible`).
IMPLAUSIBLE = 100.0
# A phase's whole-model figure is withheld (`withheld` True, not drawn, not printed) when less
# than this fraction of its device time is costed: ΣFLOPs/Σbytes of the costed rest (a CNN's
# ReLU and pooling around uncosted convolutions) would not describe the model.
MIN_COSTED = 0.5
# A row above its roof by at most this factor is the ceiling's own error (a calibration or a
# datasheet figure a little low), said so in `exceeds_why`.
ROOF_TOLERANCE = 1.05
# `exceeds_why` of a memory-bound row further above whose bytes per instance exceed the L2:
# bytes that did not all move, left out of the whole model (`whole_model`)
OVERCOUNT = "an overcount of its minimum bytes"
# Uncosted device time above this fraction is a warning naming the reasons.
UNCOSTED_WARNING = 0.01

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


_PART = " [model "


def model_part(path: str, i: int, n: int, label: str) -> str:
    """The `trace` of model i (1-based) of the n a trace runs: 'PATH [model i of n: label]'."""
    return f"{path}{_PART}{i} of {n}: {label}]"


def split_part(trace: str) -> tuple[str, str]:
    """(the path, its model part 'model i of n: label' or "") of an Analysis's `trace`."""
    path, sep, part = trace.partition(_PART)
    return path, f"model {part.removesuffix(']')}" if sep else ""


@dataclass(frozen=True)
class Analysis:
    """Everything the report and the chart need about one trace."""

    trace: str
    model: ModelSpec | None
    hardware: Hardware | None
    conventions: dict[str, str]
    costed: pd.DataFrame  # shapes.COSTED_COLUMNS
    operators: pd.DataFrame  # OPERATOR_COLUMNS
    whole_by_phase: dict[str, dict[str, object]]  # phase -> whole_model(), phases by first start
    reconciliation: pd.DataFrame
    coverage: dict[str, object]
    layers: int | None = None  # the depth `extrapolated` scales to
    extrapolated: pd.DataFrame | None = None  # EXTRAPOLATED_COLUMNS
    extrapolated_whole: dict[str, dict[str, float]] = field(default_factory=dict)
    ncu: dict[str, object] | None = None  # kernel-match summary + whole-model measured bytes
    passes: pd.DataFrame | None = None  # passes.PASS_COLUMNS: the forward passes and phases
    graphs: GraphReport | None = None  # CUDA-graph replays and how they were named
    # what the numbers cannot be trusted for (`analyze`), said before any table
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # how the analysis was made, not a warning
    tp: int | None = None  # tensor-parallel degree of the rank's shards (None: no model to tell)
    # per phase with collectives: comms.summary (time, exposed time, bus bytes, share, ...)
    communication: dict[str, dict[str, float]] = field(default_factory=dict)
    collectives: pd.DataFrame | None = None  # comms.CALL_COLUMNS: one row per collective call
    distributed: dict[str, object] | None = None  # the trace's distributedInfo (rank, world size)
    # the decoder's dimensions the trace's shapes show and the presets they fit
    # (crosscheck.inferred), with `model` and `model_tp` (the TP degree) when a model was given
    model_inferred: dict[str, object] | None = None
    # mixture-of-experts layers per phase (`moe_summary`): tokens, active experts and their
    # assumption, tokens per active expert, the experts' intensity next to the dense equivalent
    moe: dict[str, dict[str, object]] = field(default_factory=dict)
    # the trace's other models (assisted or speculative decoding: each hidden size of the
    # embedding tables a model), each analysed on its own kernels; `trace` then ends
    # " [model i of n: label]" (`model_part`)
    models: tuple[Analysis, ...] = ()
    # a decoder's trace, or an encoder's (attribution/kind.py): said on the first line
    kind: Verdict = DECODER
    # the rows the name contracts demoted to other (verify.demotions): time, kernels, by name
    demoted: dict[str, object] = field(default_factory=dict)
    steps: pd.DataFrame | None = None  # steptime.STEP_COLUMNS: one row per step (device traces)
    headroom: pd.DataFrame | None = None  # steptime.HEADROOM_COLUMNS (with hardware)

    @property
    def whole(self) -> dict[str, object]:
        """The whole model of the phase with the most device time (of the only phase, usually)."""
        return max(self.whole_by_phase.values(), key=lambda w: cast(float, w["time_us"]))


def place_costed(costed: pd.DataFrame, attributed: pd.DataFrame, model: ModelSpec | None,
                 hardware: Hardware | None, options: AnalysisOptions, *, trace: str = "",
                 measured: pd.DataFrame | None = None, tp: int | None = None) -> Analysis:
    """Place, reconcile (and with `options.layers`, extrapolate) one trace's costed instances
    (costs.shapes.attach_costs of `attributed`).

    `options.by_shape` places each (operator, shape) on its own; measured bytes then stay per
    operator only. `model` is the rank's shard under tensor parallelism, `tp` is reported.
    Collectives are placed under the link roof and kept out of the whole model.
    Shapes that contradict `model` (crosscheck.instance_checks: not explained by a TP shard)
    are an InputError naming the operator, its shape and the presets the shapes fit, unless
    `options.force`: then a warning, and no extrapolation. `warnings` also say: no decoder
    layer, an irregular operator order, uncosted time, whole-model figures withheld
    (MIN_COSTED), malformed and implausible shapes, and an extrapolation skipped.
    """
    if attributed.empty:
        raise InputError(f"{trace or 'trace'}: no kernels or timed ops to analyse")
    host = _host_only(attributed, hardware)
    hardware = None if host else hardware
    layers, by_shape, force = options.layers, options.by_shape, options.force
    inferred = crosscheck.inferred(costed)
    contradiction = _contradiction(costed, model, inferred)
    if contradiction and not force:
        raise InputError(f"{trace or 'trace'}: {contradiction}; pass `force` to analyse anyway "
                         "(no extrapolation)", "force")
    if model is not None and inferred is not None:
        degrees = crosscheck.tp_degrees(costed, model)
        inferred = {**inferred, "model": model.name, "model_tp": max(degrees, default=None)}
    phases = (costed[["ts_us", "phase"]].sort_values("ts_us", kind="stable")["phase"]
              .unique().tolist())
    try:
        costed, implausible = _implausible(costed, hardware)
        if by_shape:
            shaped = costed.assign(operator=costed["operator"].where(
                costed["shape"].isna(), costed["operator"] + " " + costed["shape"].astype(object)))
            ops = place(shaped, hardware)
        else:
            ops = place(costed, hardware, measured=measured)
        hbm = ops[~comms.is_collective(ops["operator"])]
        whole = {p: _withheld(whole_model(hbm[hbm["phase"] == p], hardware)) for p in phases}
    except InputError as e:  # a floating-point dtype without a peak: name the trace too
        raise InputError(f"{trace or 'trace'}: {e}", *e.parameters) from None
    calls = comms.calls(attributed, costed)
    decoder = _has_decoder(costed)
    warnings = [*host, *([f"{contradiction}: analysed anyway (force)"] if contradiction else []),
                *([] if decoder else [NO_DECODER]),
                *filter(None, [crosscheck.irregular_order(costed)]),
                *_uncosted(costed), *_withheld_notes(whole), *_above_roof_notes(ops, whole),
                *_malformed(costed), *implausible]
    ext: pd.DataFrame | None = None
    ext_whole: dict[str, dict[str, float]] = {}
    if layers is not None:
        if model is None:
            raise InputError("`layers` needs `model` (embedding and lm_head come from the model)",
                             "layers", "model")
        why = ("the shapes contradict the model" if contradiction else
               None if decoder else "the trace has no decoder layer")
        if why is None:
            ext = extrapolate(costed[~comms.is_collective(costed["operator"])], model, layers)
            # (extrapolate's table has no device times: its whole models are flops, bytes, intensity)
            ext_whole = {p: cast(dict[str, float], whole_model(g))
                         for p, g in ext.groupby("phase", sort=False)}
        else:
            warnings.append(f"not extrapolated to {layers} layers: {why}")
    return Analysis(
        trace=trace, model=model, hardware=hardware,
        conventions={"causal": options.causal, "attention_bytes": options.attention_bytes},
        costed=costed, operators=ops, whole_by_phase=whole,
        reconciliation=reconcile(hbm), coverage=coverage(costed),
        demoted=verify.demotions(attributed),
        layers=layers if ext is not None else None, extrapolated=ext,
        extrapolated_whole=ext_whole, warnings=tuple(warnings), model_inferred=inferred, tp=tp,
        communication=comms.summary(calls, costed, hardware.link_bandwidth if hardware else None),
        collectives=calls, moe=moe_summary(costed),
    )


_LOOP_OPS = {"linear", "mm", "addmm", "matmul"}  # one expert's 2-D weight per GEMM
_EXPERTS = ["experts_gate_up", "experts_down"]


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
        router = c[c["cost_kind"].isin(shapes.ROUTER_KINDS) & c["operator"].eq("router")
                   & c["N"].gt(1).fillna(False)]
        down = c[gemm & c["operator"].eq("experts_down")]
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
        active = {col: _mean(experts[col]) for col in _ACTIVE}
        base = down["op_name"].astype("object").fillna("").str.rsplit("::", n=1).str[-1]
        counted = bool(base.isin(_LOOP_OPS).any())
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


NO_DECODER = ("no decoder layer found: no time is named as a decoder-layer operator (projection, "
              "attention, norm, MLP) with evidence, so the rows below are the trace's own op names "
              "(evidence: fallback), not a model's layers")


def _contradiction(costed: pd.DataFrame, model: ModelSpec | None,
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


def _host_only(attributed: pd.DataFrame, hardware: Hardware | None) -> list[str]:
    """The warning of a trace of CPU ops and no kernel events analysed with a GPU's hardware:
    its times are the host's, so nothing is placed under the GPU's roof; else none."""
    if hardware is None or "kind" not in attributed or not attributed["kind"].eq("cpu_op").all():
        return []
    return [f"no roofline placement under {hardware.name}: the trace has CPU ops and no kernel "
            "events, so its times are host times, not device times (intensities only)"]


def _has_decoder(costed: pd.DataFrame) -> bool:
    """Whether any time is named as a decoder-layer operator with evidence (not a fallback)."""
    per_layer = [o.name for o in OPERATORS if o.per_layer]
    return bool((costed["operator"].isin(per_layer) & costed["evidence"].ne(FALLBACK)).any())


def _uncosted(costed: pd.DataFrame) -> list[str]:
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


def _withheld(whole: dict[str, object]) -> dict[str, object]:
    """A phase's whole model with `costed_fraction` and `withheld` (< MIN_COSTED costed)."""
    costed = cast(float, whole["costed_time_us"]) + cast(float, whole["excluded_time_us"])
    frac = costed / cast(float, whole["time_us"]) if whole.get("time_us") else math.nan
    return {**whole, "costed_fraction": frac, "withheld": not frac >= MIN_COSTED}


def _withheld_notes(whole: dict[str, dict[str, object]]) -> list[str]:
    return [f"whole model ({p}) withheld: only {100 * cast(float, w['costed_fraction']):.1f}% of its device "
            f"time is costed (under {100 * MIN_COSTED:.0f}%), so ΣFLOPs/Σbytes would describe "
            "the costed rest, not the model" for p, w in whole.items() if w["withheld"]]


def _above(ops: pd.DataFrame) -> np.ndarray:
    """Per row of an operator table: whether its figures overcount what ran (`exceeds_why`
    OVERCOUNT), which leaves it out of the whole model."""
    if "exceeds_why" not in ops:
        return np.zeros(len(ops), bool)
    return ops["exceeds_why"].str.startswith(OVERCOUNT).to_numpy(bool, na_value=False)


def _above_roof_why(ops: pd.DataFrame, hardware: Hardware) -> pd.Series:
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


def _above_roof_notes(ops: pd.DataFrame, whole: dict[str, dict[str, object]]) -> list[str]:
    """Per phase with rows the whole model leaves out (`_above`): a warning naming them, their
    % of roof, share of the phase's time and why."""
    agg = ops[ops["layer"].isna() & _above(ops)]
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


def _malformed(costed: pd.DataFrame) -> list[str]:
    """A warning when shape data were malformed (shapes.Malformed): those instances are
    uncosted, counted in `uncosted`, and named here."""
    bad = costed[costed["cost_kind"] == "malformed"]
    if bad.empty:
        return []
    names = bad["op_name"].value_counts()
    return [f"{len(bad)} op instance(s) left uncosted for malformed shape data (negative, "
            f"non-integer or overflowing dims, or arguments their cost rule cannot read): "
            + ", ".join(f"{op} x{n}" for op, n in names.items())]


def _implausible(costed: pd.DataFrame, hardware: Hardware | None
                 ) -> tuple[pd.DataFrame, list[str]]:
    """Instances whose FLOPs or bytes are more than IMPLAUSIBLE x what `hardware` could do in
    their measured time (no hardware: none) have shapes no real run had: they are made
    uncosted (cost_kind "implausible"), so never placed, and a warning per op name says so."""
    if hardware is None:
        return costed, []
    secs = costed["time_us"] * 1e-6
    main = main_dtype(costed)
    codes, uniq = pd.factorize(costed["dtype"].array, use_na_sentinel=False)
    peaks = np.array([peak_for(hardware, None if pd.isna(d) else d, main) for d in uniq],
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
    attributed = float(costed.loc[costed["operator"] != "unattributed", "time_us"].sum())
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
    numbers: pd.DataFrame  # kernels, _costed, time_us, _costed_time, flops, bytes, _ACTIVE, _PAIRS
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
               for col in (*_ACTIVE, *_PAIRS)}})
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
    ops["exceeds_why"] = _above_roof_why(ops, hardware)
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


def whole_model(table: pd.DataFrame, hardware: Hardware | None = None) -> dict[str, object]:
    """ΣFLOPs, Σbytes, the byte-weighted intensity ΣF/ΣB and, when the table has device times,
    the time-weighted achieved rates ΣF/Σt and ΣB/Σt over the costed time. `table` is `place`'s
    (its aggregated rows are used) or `extrapolate`'s. Rows above their roof whose bytes
    overcount what ran (`_above`) are left out of the sums and the rates: `excluded`
    {operator: µs}, `excluded_time_us`; the time and kernels count every row."""
    every = table[table["layer"].isna()] if "layer" in table else table
    above = _above(every)
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
        peak = peak_for(hardware, main_dtype(rows))
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
    the whole model leaves out, `_above`, left out here too)."""
    rows = ops[ops["layer"].isna() & ops["bytes"].notna() & ~_above(ops)]
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
            in_trace = max(round(c["cost_kind"].eq("attention").sum() / steps), 1)
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
        norm = scaled[scaled["layered"] & (scaled["operator"] == "input_norm")]
        if len(norm):  # one layer's input norm: the same [tokens, hidden] RMSNorm
            added.loc[added["operator"] == "final_norm", ["flops", "bytes"]] = (
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
_MLP = frozenset({"gate_proj", "up_proj", "gate_up_proj", "down_proj", "act"}) | MOE


def _sparse_layers(c: pd.DataFrame) -> np.ndarray:
    """Per row: whether its (step, layer) holds MoE operators (without layers: the trace)."""
    moe_row = c["operator"].isin(MOE)
    if not c["layer"].notna().any():
        return np.full(len(c), bool(moe_row.any()))
    key = [c["step"].fillna(-1).to_numpy(), c["layer"].fillna(-1).to_numpy()]
    return moe_row.groupby(key).transform("any").to_numpy(bool) & c["layer"].notna().to_numpy()


def _tokens(c: pd.DataFrame) -> tuple[int, int]:
    """(tokens, sequences) per step: from attention B·T and B, else a GEMM's M for both."""
    attn = c[c["cost_kind"].eq("attention")]
    if len(attn):
        b, t = int(attn["B"].median()), int(attn["T"].median())
        return b * t, b
    gemm = c[c["cost_kind"].eq("gemm")]
    m = int(gemm["M"].median()) if len(gemm) else 1
    return m, m


def hardware_summary(a: Analysis, hardware: Hardware | None = None) -> dict[str, object] | None:
    """The device's ceilings (`hardware`, else the analysis's) at the trace's compute dtype."""
    hw = hardware or a.hardware
    if hw is None:
        return None
    dtype = peak_key(hw, main_dtype(a.costed))
    peak = hw.peak_flops[dtype]
    return {"name": hw.name, "dtype": dtype, "peak_flops_per_s": peak,
            "bandwidth_bytes_per_s": hw.mem_bandwidth, "ridge": peak / hw.mem_bandwidth,
            "source": hw.source, "link_bandwidth_bytes_per_s": hw.link_bandwidth,
            "link_source": hw.link_source or None}


def operators_frame(analyses: list[Analysis]) -> pd.DataFrame:
    """All analyses' operator tables stacked, with a leading `trace` column (operators.csv)."""
    return pd.concat(
        [a.operators.assign(trace=a.trace)[["trace", *a.operators.columns]] for a in analyses],
        ignore_index=True,
    )
