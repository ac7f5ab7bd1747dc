"""The main job as one call: trace → attribute → costs → roofline (+ optional ncu measurements)."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, cast

import pandas as pd

from trace_roofline import steptime
from trace_roofline.attribution import captures, graphs, kind, passes, steps, verify
from trace_roofline.attribution.attribute import attribute
from trace_roofline.attribution.tp import gemm_shapes, gemm_shapes_of, infer_tp
from trace_roofline.costs import crosscheck
from trace_roofline.costs.attach import CostOptions, attach_costs
from trace_roofline.errors import InputError
from trace_roofline.model.hardware import Hardware, trace_device
from trace_roofline.model.models import ModelSpec
from trace_roofline.options import AnalysisOptions
from trace_roofline.roofline import Analysis, Subject, model_part, place_costed
from trace_roofline.trace import Progress, Trace, load_trace
from trace_roofline.trace import ncu as ncu_csv

if TYPE_CHECKING:
    from trace_roofline.cache import TraceCache


def trace_hardware(trace: Trace) -> Hardware | None:
    """The device a trace ran on, from `deviceProperties` (hardware.trace_device: by its name,
    a committed calibration winning, else by its properties)."""
    return trace_device(trace.meta.get("device_properties", []))[0]


@dataclasses.dataclass(frozen=True)
class Run:
    """How an analysis runs, which changes none of its figures: the `cache` (cache.TraceCache)
    a trace given by path, its attribution and the finished Analysis come from and go to (what
    it did is appended to `cache.log`), and the `progress` drawn while a trace loads."""

    cache: TraceCache | None = None
    progress: Progress | None = None


def analyze_trace(trace: Trace | str | os.PathLike, model: ModelSpec | None = None,
                  hardware: Hardware | None = None, options: AnalysisOptions | None = None,
                  run: Run | None = None) -> Analysis:
    """Analyse one trace end to end and return the `Analysis` (DataFrames and summaries).

    `options` (default AnalysisOptions()) say everything else the analysis depends on, `run`
    (default Run()) where its parts are cached and how its loading is drawn. `hardware`
    defaults to the trace's own GPU (`trace_hardware`); with neither, operators get
    intensities but no roofline placement. The model is sharded as `options.tp` says and as
    the GEMM shapes show (tp.infer_tp).
    """
    return _run(trace, model, hardware, options or AnalysisOptions(), run or Run())[0]


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
                          hardware: Hardware | None = None, options: AnalysisOptions | None = None,
                          run: Run | None = None) -> tuple[Analysis, Attributed]:
    """`analyze_trace(...)` and the attributed kernels its Analysis was computed from (the
    rows `perfetto.enriched_trace` enriches). On an Analysis cache hit, the kernels come from
    the cached trace and attribution parts (`attribute` does not run again)."""
    options, run = options or AnalysisOptions(), run or Run()
    analysis, made = _run(trace, model, hardware, options, run)
    return analysis, made if made is not None else _attributed(trace, model, options, run)


def _run(trace: Trace | str | os.PathLike, model: ModelSpec | None, hardware: Hardware | None,
         options: AnalysisOptions, run: Run) -> tuple[Analysis, Attributed | None]:
    """analyze_trace, through the Analysis cache where it applies, and the `Attributed` the
    Analysis was computed from (None on a cache hit)."""
    made: Attributed | None = None

    def compute() -> Analysis:
        nonlocal made
        made = _attributed(trace, model, options, run)
        return _analyze(made, hardware, options)

    key = options.cache_key()
    if run.cache is not None and not isinstance(trace, Trace) and key is not None:
        analysis = run.cache.analysis(trace, {"model": model, "hardware": hardware, **key},
                                      compute)
    else:
        analysis = compute()
    return analysis, made


def _attributed(trace: Trace | str | os.PathLike, model: ModelSpec | None,
                options: AnalysisOptions, run: Run) -> Attributed:
    """The trace (and `attribute`'s table) from `cache` or parsed, the model sharded as given
    (`options.tp`) and as the GEMM shapes show, then `attribute_trace`'s replays and passes."""
    attributed, tp, cache = None, options.tp, run.cache
    if model is not None and tp is not None:
        model = model.shard(tp)
    if not isinstance(trace, Trace) and cache is not None:
        trace, attributed = cache.load(trace, model, progress=run.progress)
    elif not isinstance(trace, Trace):
        trace = load_trace(trace, progress=run.progress)
    if attributed is None:
        attributed = attribute(trace, model)
        if cache is not None:
            cache.store_attributed(trace, model, attributed)
    if model is not None:  # attribute() names GEMMs as the shard the shapes show
        if attributed["model"].notna().any():  # its own GEMMs, in a trace of several models
            own = attributed[attributed["model"] == model.name]
            shapes = gemm_shapes_of(own["op_name"], own["input_dims"])
        else:
            shapes = gemm_shapes(trace)
        more = infer_tp(shapes, model)
        model, tp = model.shard(more), (tp or 1) * more
    kernels, replays, found = attribute_trace(trace, model, options, attributed=attributed,
                                              progress=run.progress)
    return Attributed(trace, kernels, model, tp, replays, found)


@dataclasses.dataclass(frozen=True)
class TraceFacts:
    """What `analyze` is told of the trace an attributed table came from: its name (`trace`),
    the TP degree reported (`tp`), the ranks of collectives that do not record theirs
    (`group_size`), ncu's bytes per operator (`measured`) and the trace's verdict (`decoder`,
    kind.Verdict.decoder: an encoder's unrecorded masks count every pair)."""

    trace: str = ""
    tp: int | None = None
    group_size: int | None = None
    measured: pd.DataFrame | None = None
    decoder: bool = True


def analyze(attributed: pd.DataFrame, model: ModelSpec | None = None,
            hardware: Hardware | None = None, options: AnalysisOptions | None = None,
            facts: TraceFacts | None = None) -> Analysis:
    """Cost (costs.attach.attach_costs) and place (roofline.place_costed) one attributed trace
    of `model` (the rank's shard), with what `facts` (default TraceFacts()) say of its trace."""
    options, facts = options or AnalysisOptions(), facts or TraceFacts()
    costed = attach_costs(attributed, model, CostOptions(
        options.causal, options.attention_bytes, facts.group_size, facts.decoder))
    return place_costed(costed, attributed, options,
                        Subject(model, hardware, facts.trace, facts.measured, facts.tp))


def _analyze(att: Attributed, hardware: Hardware | None, options: AnalysisOptions) -> Analysis:
    """Cost and place the attributed kernels, with ncu's measured bytes: in a trace of several
    models, each model's kernels on their own (`_model_parts`), the others in `models`."""
    parts = _model_parts(att)
    if len(parts) == 1:
        return _analyze_one(att, att.trace.path, hardware, options)
    done = [_analyze_one(part, model_part(att.trace.path, i + 1, len(parts), label), hardware,
                         options) for i, (label, part) in enumerate(parts)]
    return dataclasses.replace(done[0], models=tuple(done[1:]))


def _model_parts(att: Attributed) -> list[tuple[str, Attributed]]:
    """Each model's kernels (attribute's `model` column) as an Attributed of its own: the
    --model's first (with the units no op launched), then the others by device time, an
    encoder-decoder's encoder last (its passes one `forward`, no decoder-only name), without a
    model (their linears inferred) and without graph replays. One part for a one-model trace."""
    label = att.kernels["model"]
    if label.nunique() < 2:
        return [("", att)]
    time = att.kernels["dur_us"].groupby(label).sum()
    first = [att.model.name] if att.model is not None and att.model.name in time.index else []
    order = first + sorted((m for m in time.sort_values(ascending=False, kind="stable").index
                            if m not in first),
                           key=lambda m: str(m).startswith(kind.ENCODER_LABEL))
    out = []
    for i, m in enumerate(order):
        rows = (label == m).to_numpy(bool) | (i == 0) & label.isna().to_numpy(bool)
        kernels = att.kernels[rows]
        table = att.passes.table[att.passes.table["pass"].isin(kernels["step"].dropna())]
        found = dataclasses.replace(att.passes, pass_id=kernels["step"].array,
                                    phase=kernels["phase"].array, table=table)
        own = i == 0
        if str(m).startswith(kind.ENCODER_LABEL):
            kernels = verify.verify(kernels, None, decoder=False)
            kernels, found = passes.as_forward(kernels, found, kind.ENCODER_PART)
        out.append((str(m), Attributed(att.trace, kernels, att.model if own else None,
                                       att.tp if own else None, att.replays if own else None,
                                       found)))
    return out


def _analyze_one(att: Attributed, name: str, hardware: Hardware | None,
                 options: AnalysisOptions) -> Analysis:
    """Cost and place one model's attributed kernels, with ncu's measured bytes."""
    trace, attributed, model, tp, replays = (att.trace, att.kernels, att.model, att.tp,
                                             att.replays)
    hw = hardware or trace_hardware(trace)
    props = trace.meta.get("device_properties", [])  # a device no preset knows: say so
    unknown = (trace_device(props)[1],) if hw is None and props else ()
    info = trace.meta.get("distributedInfo")
    world = info.get("world_size") if isinstance(info, dict) else None
    group = tp if tp and tp > 1 else (world if isinstance(world, int) and world > 0 else None)
    facts = TraceFacts(trace=name, tp=tp, group_size=group, decoder=att.passes.kind.decoder)
    extra = {"passes": att.passes.table, "graphs": replays, "kind": att.passes.kind,
             "distributed": info if isinstance(info, dict) else None}
    if options.ncu is None:
        a = analyze(attributed, model, hw, options, facts)
        return _with_steps(dataclasses.replace(
            a, warnings=(*unknown, *_with_graph_flags(a, replays, att, options)),
            notes=replays.notes if replays is not None else (), **extra), trace)
    matched, summary = ncu_csv.match_kernels(attributed, ncu_csv.read_ncu_csv(options.ncu),
                                             device=trace.device)
    a = analyze(attributed, model, hw, options,
                dataclasses.replace(facts, measured=ncu_csv.measured_by_operator(matched)))
    # Whole trace (every phase): NaN unless every kernel was measured (a partial sum understates).
    whole_bytes = float(ncu_csv.measured_by_operator(matched, by=())["measured_bytes"].iloc[0])
    flops = sum(float(cast(float, w["flops"])) for w in a.whole_by_phase.values())
    summary = {**summary, "file": str(options.ncu), "whole_model_measured_bytes": whole_bytes,
               "whole_model_measured_intensity": flops / whole_bytes}
    return _with_steps(dataclasses.replace(
        a, ncu=summary, warnings=(*unknown, *_with_graph_flags(a, replays, att, options)),
        notes=replays.notes if replays is not None else (), **extra), trace)


def _with_steps(a: Analysis, trace: Trace) -> Analysis:
    """The analysis with its step table (steptime.step_table; none for a trace without device
    activity) and, with hardware, its headroom (steptime.headroom)."""
    if trace.cpu_only:
        return a
    table = steptime.step_table(trace, a.costed)
    room = (steptime.headroom(a.operators, table, a.costed, trace) if a.hardware is not None
            else None)
    return dataclasses.replace(a, steps=table, headroom=room)


def _with_graph_flags(a: Analysis, replays: graphs.GraphReport | None, att: Attributed,
                      options: AnalysisOptions) -> tuple[str, ...]:
    """The analysis's warnings plus each refused or unused graph mapping, then the named
    operators costed generically and the figures that disagree with the layout
    (crosscheck.generic_named, against_layout)."""
    return (*a.warnings, *(replays.flags if replays is not None else ()),
            *filter(None, [crosscheck.generic_named(a.costed)]),
            *crosscheck.against_layout(a.costed, att.model, att.passes.table, options.causal,
                                       att.passes.kind.decoder))


def attribute_trace(
    trace: Trace,
    model: ModelSpec | None = None,
    options: AnalysisOptions | None = None,
    *,
    attributed: pd.DataFrame | None = None,
    progress: Progress | None = None,
) -> tuple[pd.DataFrame, graphs.GraphReport | None, passes.Passes]:
    """Every kernel of `trace` with its operator, layer, evidence, forward pass (`step`) and
    phase: `attribute` (or `attributed`, its table already at hand), then CUDA/HIP-graph
    replays named (`graphs.name_replays`: from `options.graph_map`, an eager trace of the same
    step attributed with the same model, or graph captures (a capture trace or a folder of
    them, captures.py); without it a `capture_traces/` folder beside the trace, said in the
    output), then the passes (`passes.annotate`), then the serving steps' annotations
    (steps.py: each annotated step's phase on its kernels and passes, its batch statistics in
    `serving_step`). Returns the table, the replays' report (None without replays and
    without anything to say) and the passes."""
    options = options or AnalysisOptions()
    if options.decode_shapes is not None and model is None:
        raise InputError("`decode_shapes` need `model` (the shapes of its linears)",
                         "decode_shapes", "model")
    mapping, found_captures, notes = captures.graph_sources(trace, model, options.graph_map,
                                                            progress)
    if attributed is None:
        attributed = attribute(trace, model)
    step_table = steps.parse(trace.annotations)
    of_row = steps.kernel_steps(trace, step_table)
    attributed, replays = graphs.name_replays(trace, attributed, model, mapping=mapping,
                                              shapes=options.decode_shapes,
                                              captures=found_captures, steps=step_table,
                                              step_of_row=of_row)
    unused = graphs.unused_options(replays, options.graph_map, options.decode_shapes)
    replays = graphs.with_notes(replays, notes, unused)
    verdict = kind.judge(attributed)
    attributed = verify.verify(attributed, model, decoder=verdict.decoder)
    attributed, found = passes.annotate(attributed)
    if not step_table.empty:
        attributed, table = steps.apply(attributed, found.table, step_table, of_row)
        found = dataclasses.replace(found, phase=attributed["phase"].array, table=table)
    if not verdict.decoder:  # an encoder's passes neither prefill nor decode
        attributed, found = passes.as_forward(attributed, found, verdict)
    return attributed, replays, found
