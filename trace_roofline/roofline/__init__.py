"""Roofline placement of every operator, the whole-model view, and their reconciliation: one
trace's `Analysis`.

Design notes: docs/design.md ("trace_roofline/roofline/").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import pandas as pd

from trace_roofline.attribution import comms, verify
from trace_roofline.attribution.kind import DECODER, Verdict
from trace_roofline.costs import crosscheck
from trace_roofline.errors import InputError
from trace_roofline.model.hardware import Hardware
from trace_roofline.model.models import ModelSpec
from trace_roofline.options import AnalysisOptions
from trace_roofline.roofline import caveats
from trace_roofline.roofline.caveats import coverage
from trace_roofline.roofline.moe_summary import moe_summary
from trace_roofline.roofline.placement import main_dtype, peak_key, place
from trace_roofline.roofline.whole import (
    extrapolate,
    reconcile,
    whole_model,
    withheld,
    withheld_notes,
)

if TYPE_CHECKING:
    from trace_roofline.attribution.graphs import GraphReport

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
    operators: pd.DataFrame  # placement.OPERATOR_COLUMNS
    whole_by_phase: dict[str, dict[str, object]]  # phase -> whole_model(), phases by first start
    reconciliation: pd.DataFrame
    coverage: dict[str, object]
    layers: int | None = None  # the depth `extrapolated` scales to
    extrapolated: pd.DataFrame | None = None  # whole.EXTRAPOLATED_COLUMNS
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


@dataclass(frozen=True)
class Subject:
    """What `place_costed` places one trace's instances under: the model (the rank's shard under
    tensor parallelism), the hardware, the trace's name, ncu's measured bytes per (layer,
    operator) and the tensor-parallel degree reported."""

    model: ModelSpec | None = None
    hardware: Hardware | None = None
    trace: str = ""
    measured: pd.DataFrame | None = None
    tp: int | None = None


def place_costed(costed: pd.DataFrame, attributed: pd.DataFrame, options: AnalysisOptions,
                 subject: Subject) -> Analysis:
    """Place, reconcile (and with `options.layers`, extrapolate) one trace's costed instances
    (costs.attach.attach_costs of `attributed`).

    `options.by_shape` places each (operator, shape) on its own; measured bytes then stay per
    operator only. Collectives are placed under the link roof and kept out of the whole model.
    Shapes that contradict `subject.model` (crosscheck.instance_checks: not explained by a TP
    shard) are an InputError naming the operator, its shape and the presets the shapes fit,
    unless `options.force`: then a warning, and no extrapolation. `warnings` also say: no
    decoder layer, an irregular operator order, uncosted time, whole-model figures withheld
    (whole.MIN_COSTED), malformed and implausible shapes, and an extrapolation skipped.
    """
    name, model = subject.trace or "trace", subject.model
    if attributed.empty:
        raise InputError(f"{name}: no kernels or timed ops to analyse")
    host = caveats.host_only(attributed, subject.hardware)
    hardware = None if host else subject.hardware
    inferred = crosscheck.inferred(costed)
    contradiction = caveats.contradiction(costed, model, inferred)
    if contradiction and not options.force:
        raise InputError(f"{name}: {contradiction}; pass `force` to analyse anyway "
                         "(no extrapolation)", "force")
    if model is not None and inferred is not None:
        degrees = crosscheck.tp_degrees(costed, model)
        inferred = {**inferred, "model": model.name, "model_tp": max(degrees, default=None)}
    phases = (costed[["ts_us", "phase"]].sort_values("ts_us", kind="stable")["phase"]
              .unique().tolist())
    try:
        costed, implausible = caveats.implausible(costed, hardware)
        ops = _placed(costed, hardware, options.by_shape, subject.measured)
        hbm = ops[~comms.is_collective(ops["operator"])]
        whole = {p: withheld(whole_model(hbm[hbm["phase"] == p], hardware)) for p in phases}
    except InputError as e:  # a floating-point dtype without a peak: name the trace too
        raise InputError(f"{name}: {e}", *e.parameters) from None
    calls = comms.calls(attributed, costed)
    decoder = caveats.has_decoder(costed)
    warnings = [*host, *([f"{contradiction}: analysed anyway (force)"] if contradiction else []),
                *([] if decoder else [caveats.NO_DECODER]),
                *filter(None, [crosscheck.irregular_order(costed)]),
                *caveats.uncosted(costed), *withheld_notes(whole),
                *caveats.above_roof_notes(ops, whole), *caveats.malformed(costed), *implausible]
    skip = ("the shapes contradict the model" if contradiction else
            None if decoder else "the trace has no decoder layer")
    ext, ext_whole = _extrapolated(costed, model, options.layers, skip, warnings)
    return Analysis(
        trace=subject.trace, model=model, hardware=hardware,
        conventions={"causal": options.causal, "attention_bytes": options.attention_bytes},
        costed=costed, operators=ops, whole_by_phase=whole,
        reconciliation=reconcile(hbm), coverage=coverage(costed),
        demoted=verify.demotions(attributed),
        layers=options.layers if ext is not None else None, extrapolated=ext,
        extrapolated_whole=ext_whole, warnings=tuple(warnings), model_inferred=inferred,
        tp=subject.tp,
        communication=comms.summary(calls, costed, hardware.link_bandwidth if hardware else None),
        collectives=calls, moe=moe_summary(costed),
    )


def _placed(costed: pd.DataFrame, hardware: Hardware | None, by_shape: bool,
            measured: pd.DataFrame | None) -> pd.DataFrame:
    """`place`'s table; `by_shape`: each (operator, shape) a row of its own, no measured bytes."""
    if not by_shape:
        return place(costed, hardware, measured=measured)
    shaped = costed.assign(operator=costed["operator"].where(
        costed["shape"].isna(), costed["operator"] + " " + costed["shape"].astype(object)))
    return place(shaped, hardware)


def _extrapolated(costed: pd.DataFrame, model: ModelSpec | None, layers: int | None,
                  skip: str | None, warnings: list[str]
                  ) -> tuple[pd.DataFrame | None, dict[str, dict[str, float]]]:
    """The extrapolation to `layers` (none without them) and its whole model per phase; `skip`:
    why not (appended to `warnings`)."""
    if layers is None:
        return None, {}
    if model is None:
        raise InputError("`layers` needs `model` (embedding and lm_head come from the model)",
                         "layers", "model")
    if skip is not None:
        warnings.append(f"not extrapolated to {layers} layers: {skip}")
        return None, {}
    ext = extrapolate(costed[~comms.is_collective(costed["operator"])], model, layers)
    # (extrapolate's table has no device times: its whole models are flops, bytes, intensity)
    return ext, {p: cast(dict[str, float], whole_model(g))
                 for p, g in ext.groupby("phase", sort=False)}


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
