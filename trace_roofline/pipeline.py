"""The main job as one call: trace → attribute → costs → roofline (+ optional ncu measurements)."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

import pandas as pd

from trace_roofline import ncu as ncu_csv
from trace_roofline.attribute import attribute
from trace_roofline.hardware import Hardware, for_device_name
from trace_roofline.models import ModelSpec
from trace_roofline.roofline import Analysis, analyze
from trace_roofline.tp import gemm_shapes, infer_tp
from trace_roofline.trace import Progress, Trace, load_trace

if TYPE_CHECKING:
    from trace_roofline.cache import TraceCache


def trace_hardware(trace: Trace) -> Hardware | None:
    """The device a trace ran on, from `deviceProperties` (a committed calibration wins)."""
    for props in trace.meta.get("device_properties", []):
        hw = for_device_name(str(props.get("name", "")))
        if hw is not None:
            return hw
    return None


def analyze_trace(
    trace: Trace | str | os.PathLike,
    model: ModelSpec | None = None,
    hardware: Hardware | None = None,
    *,
    causal: str = "causal",
    attention_bytes: str = "all",
    layers: int | None = None,
    ncu: str | os.PathLike | None = None,
    by_shape: bool = False,
    force: bool = False,
    progress: Progress | None = None,
    cache: TraceCache | None = None,
    tp: int | None = None,
) -> Analysis:
    """Analyse one trace end to end and return the `Analysis` (DataFrames and summaries).

    `hardware` defaults to the trace's own GPU (`trace_hardware`); with neither, operators get
    intensities but no roofline placement. `ncu` is an Nsight Compute raw CSV of the same
    workload: its DRAM bytes become each operator's measured bytes and measured intensity.
    With `cache`, a trace given by path and its attribution come from (and go to) that
    `TraceCache`; what it did is appended to `cache.log`.
    Tensor parallelism: `tp` says the trace is one rank of `model` sharded `tp` ways; without
    it the shard is inferred from the GEMM shapes (tp.infer_tp), and each rank is costed from
    its own shapes against `model.shard(tp)`. Collectives that do not record their group size
    take tp (> 1), else `distributedInfo.world_size`.
    Shapes that contradict `model` are an InputError unless `force` (roofline.analyze).
    """
    attributed = None
    if model is not None and tp is not None:
        model = model.shard(tp)
    if not isinstance(trace, Trace) and cache is not None:
        trace, attributed, _ = cache.load(trace, model, progress=progress)
    elif not isinstance(trace, Trace):
        trace = load_trace(trace, progress=progress)
    hw = hardware or trace_hardware(trace)
    if attributed is None:
        attributed = attribute(trace, model)
    if model is not None:  # attribute() names GEMMs as the shard the shapes show
        more = infer_tp(gemm_shapes(trace), model)
        model, tp = model.shard(more), (tp or 1) * more
    info = trace.meta.get("distributedInfo")
    world = info.get("world_size") if isinstance(info, dict) else None
    group = tp if tp and tp > 1 else (world if isinstance(world, int) and world > 0 else None)
    common = dict(trace=trace.path, causal=causal, attention_bytes=attention_bytes,
                  layers=layers, by_shape=by_shape, tp=tp, group_size=group, force=force)
    if ncu is None:
        return dataclasses.replace(analyze(attributed, model, hw, **common),
                                   distributed=info if isinstance(info, dict) else None)
    matched, summary = ncu_csv.match_kernels(attributed, ncu_csv.read_ncu_csv(ncu),
                                             device=trace.device)
    a = analyze(attributed, model, hw, measured=ncu_csv.measured_by_operator(matched), **common)
    # Whole trace (every phase): NaN unless every kernel was measured (a partial sum understates).
    whole_bytes = float(ncu_csv.measured_by_operator(matched, by=())["measured_bytes"].iloc[0])
    flops = sum(float(w["flops"]) for w in a.whole_by_phase.values())
    summary = {**summary, "file": str(ncu), "whole_model_measured_bytes": whole_bytes,
               "whole_model_measured_intensity": flops / whole_bytes}
    return dataclasses.replace(a, ncu=summary, distributed=info if isinstance(info, dict) else None)


def operators_frame(analyses: list[Analysis]) -> pd.DataFrame:
    """All analyses' operator tables stacked, with a leading `trace` column (operators.csv)."""
    return pd.concat(
        [a.operators.assign(trace=a.trace)[["trace", *a.operators.columns]] for a in analyses],
        ignore_index=True,
    )
