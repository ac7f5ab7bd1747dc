"""The main job as one call: trace → attribute → costs → roofline (+ optional ncu measurements)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from trace_roofline.attribution import graphs, passes
from trace_roofline.attribution.attribute import attribute
from trace_roofline.attribution.tp import gemm_shapes, infer_tp
from trace_roofline.errors import InputError
from trace_roofline.model.hardware import Hardware, for_device_name
from trace_roofline.model.models import ModelSpec
from trace_roofline.roofline import Analysis, analyze
from trace_roofline.trace import Progress, Trace, load_trace
from trace_roofline.trace import ncu as ncu_csv

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
    graph_map: Trace | str | os.PathLike | None = None,
    decode_shapes: graphs.DecodeShapes | None = None,
    progress: Progress | None = None,
    cache: TraceCache | None = None,
    tp: int | None = None,
) -> Analysis:
    """Analyse one trace end to end and return the `Analysis` (DataFrames and summaries).

    `hardware` defaults to the trace's own GPU (`trace_hardware`); with neither, operators get
    intensities but no roofline placement. `ncu` is an Nsight Compute raw CSV of the same
    workload: its DRAM bytes become each operator's measured bytes and measured intensity.
    With `cache`, a trace given by path, its attribution and the finished Analysis (per set of
    the other arguments) come from (and go to) that `TraceCache`; what it did is appended to
    `cache.log`.
    Tensor parallelism: `tp` says the trace is one rank of `model` sharded `tp` ways; without
    it the shard is inferred from the GEMM shapes (tp.infer_tp), and each rank is costed from
    its own shapes against `model.shard(tp)`. Collectives that do not record their group size
    take tp (> 1), else `distributedInfo.world_size`.
    Shapes that contradict `model` are an InputError unless `force` (roofline.analyze).
    CUDA-graph replays are named by `graphs.name_replays`: from `graph_map` (an eager trace of
    the same step, attributed with the same model) when given, else from the trace's own eager
    passes or capture, else from the model and the kernel names, costed there from
    `decode_shapes` (B, S). Then every kernel gets its forward pass (`step`) and that pass's
    phase (`passes.annotate`); `Analysis.passes` and `.graphs` say what was found.
    """
    analysis, _ = _run(trace, model, hardware, causal=causal, attention_bytes=attention_bytes,
                       layers=layers, ncu=ncu, by_shape=by_shape, force=force,
                       graph_map=graph_map, decode_shapes=decode_shapes, progress=progress,
                       cache=cache, tp=tp)
    return analysis


@dataclasses.dataclass(frozen=True)
class Attributed:
    """A trace with every kernel named, as its `Analysis` was computed from it."""

    trace: Trace
    kernels: pd.DataFrame  # attribute_trace's table: attribute.ATTRIBUTED_COLUMNS, pass, phase
    model: ModelSpec | None  # the model as the rank holds it (its TP shard)
    tp: int | None  # the TP degree the analysis used (given x inferred)
    replays: graphs.GraphReport | None
    passes: passes.Passes


def analyze_trace_kernels(trace: Trace | str | os.PathLike, model: ModelSpec | None = None,
                          hardware: Hardware | None = None, **options: Any
                          ) -> tuple[Analysis, Attributed]:
    """`analyze_trace(trace, model, hardware, **options)` and the attributed kernels its
    Analysis was computed from (the rows `perfetto.enriched_trace` enriches): the same names
    as the analysis's tables, the graph-map trace loaded once. When `options["cache"]` holds
    the Analysis, the kernels come from its cached trace and attribution parts (`attribute`
    does not run again; replays are named and passes found from them as before)."""
    return _run(trace, model, hardware, kernels=True, **options)


def _run(trace: Trace | str | os.PathLike, model: ModelSpec | None, hardware: Hardware | None,
         *, kernels: bool = False, causal: str = "causal",
         attention_bytes: str = "all", layers: int | None = None, ncu: str | os.PathLike | None = None,
         by_shape: bool = False, force: bool = False,
         graph_map: Trace | str | os.PathLike | None = None,
         decode_shapes: graphs.DecodeShapes | None = None, progress: Progress | None = None,
         cache: TraceCache | None = None, tp: int | None = None,
         ) -> tuple[Analysis, Attributed | None]:
    """analyze_trace, through the Analysis cache where it applies, and the `Attributed` the
    Analysis came from when `kernels` asks for it (on a cache hit: from the cached trace and
    attribution parts), else None."""
    made: Attributed | None = None  # what compute() attributed, when `kernels` asks for it

    def attributed() -> Attributed:
        return _attributed(trace, model, tp=tp, cache=cache, graph_map=graph_map,
                           decode_shapes=decode_shapes, progress=progress)

    def compute() -> Analysis:
        nonlocal made
        att = attributed()
        if kernels:
            made = att
        return _analyze(att, hardware, causal=causal, attention_bytes=attention_bytes,
                         layers=layers, ncu=ncu, by_shape=by_shape, force=force)

    cached = (cache is not None and not isinstance(trace, Trace)
              and graph_map is None and decode_shapes is None)  # those two: not in its key
    if cached:
        args = dict(model=model, hardware=hardware, causal=causal,
                    attention_bytes=attention_bytes, layers=layers,
                    ncu=None if ncu is None else Path(ncu), by_shape=by_shape, force=force, tp=tp)
        analysis = cache.analysis(trace, args, compute)
    else:
        analysis = compute()
    if not kernels:
        return analysis, None
    return analysis, made if made is not None else attributed()  # None: a cache hit


def _attributed(trace: Trace | str | os.PathLike, model: ModelSpec | None, *, tp: int | None,
                cache: TraceCache | None, graph_map: Trace | str | os.PathLike | None,
                decode_shapes: graphs.DecodeShapes | None, progress: Progress | None
                ) -> Attributed:
    """The trace (and `attribute`'s table) from `cache` or parsed, the model sharded as given
    (`tp`) and as the GEMM shapes show, then `attribute_trace`'s replays and passes."""
    attributed = None
    if model is not None and tp is not None:
        model = model.shard(tp)
    if not isinstance(trace, Trace) and cache is not None:
        trace, attributed, _ = cache.load(trace, model, progress=progress)
    elif not isinstance(trace, Trace):
        trace = load_trace(trace, progress=progress)
    if attributed is None:
        attributed = attribute(trace, model)
    if model is not None:  # attribute() names GEMMs as the shard the shapes show
        more = infer_tp(gemm_shapes(trace), model)
        model, tp = model.shard(more), (tp or 1) * more
    kernels, replays, found = attribute_trace(trace, model, attributed=attributed,
                                              graph_map=graph_map, decode_shapes=decode_shapes,
                                              progress=progress)
    return Attributed(trace, kernels, model, tp, replays, found)


def _analyze(att: Attributed, hardware: Hardware | None, *, causal: str, attention_bytes: str,
              layers: int | None, ncu: str | os.PathLike | None, by_shape: bool,
              force: bool) -> Analysis:
    """Cost and place the attributed kernels (roofline.analyze), with ncu's measured bytes."""
    trace, attributed, model, tp, replays = (att.trace, att.kernels, att.model, att.tp,
                                             att.replays)
    hw = hardware or trace_hardware(trace)
    info = trace.meta.get("distributedInfo")
    world = info.get("world_size") if isinstance(info, dict) else None
    group = tp if tp and tp > 1 else (world if isinstance(world, int) and world > 0 else None)
    common = dict(trace=trace.path, causal=causal, attention_bytes=attention_bytes,
                  layers=layers, by_shape=by_shape, tp=tp, group_size=group, force=force)
    extra = {"passes": att.passes.table, "graphs": replays,
             "distributed": info if isinstance(info, dict) else None}
    if ncu is None:
        a = analyze(attributed, model, hw, **common)
        return dataclasses.replace(a, warnings=_with_graph_flags(a, replays), **extra)
    matched, summary = ncu_csv.match_kernels(attributed, ncu_csv.read_ncu_csv(ncu),
                                             device=trace.device)
    a = analyze(attributed, model, hw, measured=ncu_csv.measured_by_operator(matched), **common)
    # Whole trace (every phase): NaN unless every kernel was measured (a partial sum understates).
    whole_bytes = float(ncu_csv.measured_by_operator(matched, by=())["measured_bytes"].iloc[0])
    flops = sum(float(w["flops"]) for w in a.whole_by_phase.values())
    summary = {**summary, "file": str(ncu), "whole_model_measured_bytes": whole_bytes,
               "whole_model_measured_intensity": flops / whole_bytes}
    return dataclasses.replace(a, ncu=summary, warnings=_with_graph_flags(a, replays), **extra)


def _with_graph_flags(a: Analysis, replays: graphs.GraphReport | None) -> tuple[str, ...]:
    """The analysis's warnings plus each refused or unused graph mapping."""
    return (*a.warnings, *(replays.flags if replays is not None else ()))


def attribute_trace(
    trace: Trace,
    model: ModelSpec | None = None,
    *,
    attributed: pd.DataFrame | None = None,
    graph_map: Trace | str | os.PathLike | None = None,
    decode_shapes: graphs.DecodeShapes | None = None,
    progress: Progress | None = None,
) -> tuple[pd.DataFrame, graphs.GraphReport | None, passes.Passes]:
    """Every kernel of `trace` with its operator, layer, evidence, forward pass (`step`) and
    phase: `attribute` (or `attributed`, its table already at hand), then CUDA-graph replays
    named (`graphs.name_replays`: from `graph_map`, an eager trace of the same step attributed
    with the same model, when given), then the passes (`passes.annotate`). Returns the table,
    the replays' report (None without replays) and the passes."""
    if decode_shapes is not None and model is None:
        raise InputError("decode shapes need `model` (the shapes of its linears)")
    mapping = None
    if graph_map is not None:
        m_trace = graph_map if isinstance(graph_map, Trace) else load_trace(graph_map,
                                                                            progress=progress)
        mapping = graphs.mapping_from(m_trace, attribute(m_trace, model))
    if attributed is None:
        attributed = attribute(trace, model)
    attributed, replays = graphs.name_replays(trace, attributed, model, mapping=mapping,
                                              shapes=decode_shapes)
    attributed, found = passes.annotate(attributed)
    return attributed, replays, found
