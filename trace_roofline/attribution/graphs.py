"""CUDA- and HIP-graph replays: name, and where shapes are known cost, the kernels a graph launch
replays. Each graph (a distinct replayed sequence, replays.py) is named once, from the first
template that fits (graph_align.py: a mapping trace, the captures of its step, the trace's own
eager passes, a capture in the trace), else by its place in the layer layout (graph_layout.py),
and written back to its replays (replay_write.py).

Design notes: docs/design.md ("trace_roofline/attribution/graphs.py").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from trace_roofline.attribution.graph_align import Named, by_capture, by_mapping
from trace_roofline.attribution.graph_layout import by_kernel_names
from trace_roofline.attribution.graph_mapping import Mapping, capture_mapping, mapping_from
from trace_roofline.attribution.graph_naming import GraphKernels, GraphNaming, empty_positions
from trace_roofline.attribution.graph_shapes import step_shapes
from trace_roofline.attribution.replay_write import write_back
from trace_roofline.attribution.replays import distinct_graphs, replay_rows
from trace_roofline.errors import InputError
from trace_roofline.model.models import ModelSpec
from trace_roofline.model.operators import Name
from trace_roofline.options import DecodeShapes
from trace_roofline.trace import Trace

MAPPING_MATCH = 0.8  # share of a graph's kernels a mapping's best pass must match by name
OWN_PASS_MATCH = 0.9  # the same for the replay trace's own eager passes


@dataclass(frozen=True)
class GraphReport:
    """How the replayed kernels were named: totals and one row per graph (`GRAPH_COLUMNS`)."""

    replays: int
    kernels: int
    time_us: float
    named_kernels: int
    named_time_us: float
    matched_time_us: float  # named by an aligned eager twin of the same name
    costed_time_us: float  # in instances that carry shapes
    flags: tuple[str, ...]  # what the reader must not miss: refused or unused mappings
    graphs: pd.DataFrame
    notes: tuple[str, ...] = ()  # how the replays were named (a capture folder found and used)

    @property
    def named_fraction(self) -> float:
        return self.named_time_us / self.time_us if self.time_us else float("nan")


GRAPH_COLUMNS = {
    "graph": "int64",
    "replays": "int64",
    "kernels": "int64",  # per replay
    "method": "str",  # graph_map | kernel_name | none
    "template": "str",  # mapping source and pass, for graph_map
    "matched": "int64",  # kernels per replay with an eager twin of the same name
    "attached": "int64",  # split-K reduces / memsets joined to a neighbour
    "named": "int64",
    "grid_mismatch": "int64",  # matched kernels whose grid differs from the twin's
    "time_us": "float64",  # all replays
    "named_time_us": "float64",
    "shapes": "str",  # mapping | user | none
    "note": "str",
}


def has_replays(trace: Trace) -> bool:
    """Whether a CUDA/HIP-graph launch in the trace replayed kernels."""
    return not replay_rows(trace).empty


def with_notes(report: GraphReport | None, notes: Sequence[str],
               flags: Sequence[str] = ()) -> GraphReport | None:
    """The report with `notes` (informational) and `flags` (warnings) first among its own; a
    report of no replays holding only them when there is something to say but no replay."""
    if not notes and not flags:
        return report
    if report is None:
        empty = pd.DataFrame({c: pd.Series(dtype=t) for c, t in GRAPH_COLUMNS.items()})
        return GraphReport(0, 0, 0.0, 0, 0.0, 0.0, 0.0, tuple(flags), empty, tuple(notes))
    return dataclasses.replace(report, flags=(*flags, *report.flags),
                               notes=(*notes, *report.notes))


def unused_options(report: GraphReport | None, graph_map: object,
                   shapes: DecodeShapes | None) -> list[str]:
    """A word for each graph option that changed nothing because the trace holds no replays."""
    if report is not None and report.replays:
        return []
    given = [f"--graph-map {graph_map}"] if graph_map is not None else []
    if shapes is not None:
        given.append(f"--batch {shapes.batch} --context {shapes.context}")
    return [f"{g}: not used: the trace holds no CUDA/HIP-graph replays" for g in given]


@dataclass(frozen=True)
class _Sources:
    """What a trace's graphs may be named from: the user's mapping, else the captures of each
    graph's step, the trace's own eager passes (`own`) and a capture in the trace (`in_trace`);
    the model, and the user's --batch/--context."""

    mapping: Mapping | None
    captures: tuple[Mapping, ...]
    own: Mapping | None
    in_trace: Mapping | None
    model: ModelSpec | None
    shapes: DecodeShapes | None


@dataclass(frozen=True)
class _Written:
    """The attributed table with the replays named (`out`), replay_rows, each replayed row's
    graph and how it was named, and whether its step annotation's sums cost it."""

    out: pd.DataFrame
    rr: pd.DataFrame
    graph: np.ndarray
    how: np.ndarray
    by_step: np.ndarray


def name_replays(trace: Trace, attributed: pd.DataFrame, model: ModelSpec | None = None,
                 mapping: Mapping | None = None, shapes: DecodeShapes | None = None,
                 captures: Sequence[Mapping] = (), steps: pd.DataFrame | None = None,
                 step_of_row: np.ndarray | None = None
                 ) -> tuple[pd.DataFrame, GraphReport | None]:
    """Name the replayed kernels of `attributed` (attribute(trace)'s table); None when the trace
    holds no replays. Rows outside replays are returned unchanged. `captures`: profiled graph
    captures (captures.load), each graph matched to those of its step's batch size and mode
    (`for_graph`) before its own eager passes; `steps` (steps.parse) and `step_of_row` (its
    step per device row, steps.kernel_steps): the annotated step of each replay, whose batch
    statistics cost a graph named from kernel names (`step_shapes`; `shapes`, the user's
    --batch/--context, only where no step annotation gives them)."""
    rr = replay_rows(trace)
    if rr.empty:
        return attributed, None
    if len(attributed) != len(trace.device):
        raise InputError(f"{trace.path}: attributed table does not match the trace's kernels")
    rows = rr["row"].to_numpy()
    own, cap = (None, None) if mapping is not None else (_own_mapping(trace, attributed),
                                                         capture_mapping(trace, model))
    src = _Sources(mapping, tuple(captures), own, cap, model, shapes)
    dev = trace.device
    vocab, codes = _kernel_codes(dev, rows, src)
    replay = rr["replay"].to_numpy()
    graph, reps = distinct_graphs(codes, replay)
    starts = np.flatnonzero(np.r_[True, replay[1:] != replay[:-1]])
    step_of = _replay_steps(step_of_row, rows[starts])
    modes = step_modes(step_of)
    results: list[pd.DataFrame] = []
    namings: list[GraphNaming] = []
    for r in reps:
        seq = slice(starts[r], starts[r + 1] if r + 1 < len(starts) else len(rows))
        at = rows[seq]
        k = GraphKernels(codes[seq], vocab[codes[seq]].to_numpy(dtype=object),
                         dev["kind"].astype(object).to_numpy()[at],
                         dev["grid"].astype(object).to_numpy()[at], vocab)
        step = steps.iloc[step_of[r]] if steps is not None and step_of[r] >= 0 else None
        res, named = _name_one(k, step, modes[r], src, len(namings))
        results.append(res)
        namings.append(named)
    out, how = write_back(attributed, rr, graph, results)
    by_step = _step_costed(out, rows, steps, step_of_row)
    return out, _report(_Written(out, rr, graph, how, by_step), namings)


def _kernel_codes(dev: pd.DataFrame, rows: np.ndarray, src: _Sources
                  ) -> tuple[pd.Index, np.ndarray]:
    """The kernel names of the trace and of every template (vocab), and the code in it of each
    replayed row's kernel."""
    names = dev["name"].cat
    vocab = names.categories.astype(object)
    for m in (src.mapping, src.own, src.in_trace, *src.captures):
        if m is not None:
            vocab = vocab.append(pd.Index(m.rows["name"].astype(object).unique())).unique()
    codes = np.append(vocab.get_indexer(names.categories.astype(object)), -1)[
        names.codes.to_numpy()[rows]]
    return vocab, codes


def _name_one(k: GraphKernels, step: pd.Series | None, mode: str | None, src: _Sources,
              g: int) -> tuple[pd.DataFrame, GraphNaming]:
    """Graph g's position table and naming: its step's captures (else the user's mapping),
    its own eager passes and in-trace capture as candidates, its step's shapes or the user's."""
    batch = _step_batch(step)
    kept, why = for_graph(list(src.captures), batch, mode)
    candidates = [(m, MAPPING_MATCH, True) for m in ([src.mapping] if src.mapping else kept)]
    if src.own is not None:
        candidates.append((src.own, OWN_PASS_MATCH, False))
    if src.in_trace is not None:
        candidates.append((src.in_trace, 1.0, False))
    g_shapes, shape_note = step_shapes(step, src.shapes)
    res, named = _name_graph(k, candidates, src.model, g_shapes)
    named = named.flagged(*([f"graph {g}: {why}"] if why is not None else []))
    named = named.flagged(*_ambiguous(g, named, batch, kept))
    named, unused = _unused_shapes(g, named, src.shapes, shape_note)
    return res, named.flagged(*unused)


def _name_graph(k: GraphKernels, candidates: list[tuple[Mapping, float, bool]],
                model: ModelSpec | None, shapes: DecodeShapes | None
                ) -> tuple[pd.DataFrame, GraphNaming]:
    """(position table, naming) of one graph: the position table has one row per kernel of the
    replay (graph_naming.empty_positions). `candidates`: (Mapping, needed match share,
    explicit) to try in order; a refused explicit one's flag is kept by the next."""
    carried: tuple[str, ...] = ()
    for m, need, explicit in candidates:
        got: Named = by_capture(k, m) if m.positional else by_mapping(k, m, model, shapes)
        res, named = got[0], dataclasses.replace(got[1], flags=(*carried, *got[1].flags))
        if res is not None and named.matched >= need * len(k.codes):
            return res, named
        carried = (f"graph mapping {m.label}: its best pass matches {named.matched} of the "
                   f"graph's {len(k.codes)} kernels (< {need:.0%}): not the replayed step, not "
                   "used",) if explicit else ()
    res, named = by_kernel_names(k, model, shapes, GraphNaming(flags=carried))
    return (res if res is not None else empty_positions(len(k.codes))), named


def _own_mapping(trace: Trace, attributed: pd.DataFrame) -> Mapping | None:
    """The replay trace's own eager passes (kernels not replayed) as templates, if any."""
    try:
        m = mapping_from(trace, attributed)
    except InputError:
        return None
    return m if len(m.rows) else None


def _step_costed(out: pd.DataFrame, rows: np.ndarray, steps: pd.DataFrame | None,
                 step_of_row: np.ndarray | None) -> np.ndarray:
    """Per replayed row, whether its step annotation's sums cost it (attention in a step with
    the detailed sums: costs/attention.py), though it carries no shapes."""
    if steps is None or step_of_row is None or steps.empty:
        return np.zeros(len(rows), dtype=bool)
    has = steps[["p_sq", "d_sq"]].notna().all(axis=1).to_numpy()
    s = np.asarray(step_of_row)[rows]
    attn = out["operator"].to_numpy(dtype=object)[rows] == Name.ATTENTION
    return attn & (s >= 0) & has[np.maximum(s, 0)]


def _ambiguous(g: int, named: GraphNaming, batch: int | None, kept: list[Mapping]) -> list[str]:
    """A flag when a graph of unknown batch (no step annotation) was matched to one of several
    captures of other batch sizes: kernel names alone may not tell the batch."""
    batches = {c.batch for c in kept}
    if batch is not None or len(batches) < 2 or named.method != "graph_map":
        return []
    return [f"graph {g}: its batch is unknown (no step annotation): matched to "
            f"{named.template}, the first of {len(kept)} captures ({', '.join(c.label for c in kept)}) "
            "that fits; profile with the step annotation or give --graph-map that capture"]


def _unused_shapes(g: int, named: GraphNaming, given: DecodeShapes | None, step_note: str | None
                   ) -> tuple[GraphNaming, list[str]]:
    """The naming with a note on the shapes a graph was costed from (the step annotation's), and
    a flag for --batch/--context given but not used (the step or the mapping gave shapes)."""
    if named.shapes == "step" and step_note:
        named = named.noted(step_note.split("; ")[0])
    if given is None or named.shapes == "user":
        return named, []
    why = ("the step annotation gives the shapes" if named.shapes == "step" else
           f"its kernels carry the shapes of {named.template}" if named.shapes == "mapping"
           else "nothing in it was costed from them")
    return named, [f"graph {g}: --batch {given.batch} --context {given.context} not used: {why}"]


def _replay_steps(step_of_row: np.ndarray | None, first_rows: np.ndarray) -> np.ndarray:
    """Per replay, the annotated step of its first kernel (-1: none)."""
    if step_of_row is None:
        return np.full(len(first_rows), -1, dtype=np.int64)
    return np.asarray(step_of_row, dtype=np.int64)[first_rows]


def _step_batch(step: pd.Series | None) -> int | None:
    """The tokens of an annotated step (its batch for decode graphs), None without one."""
    if step is None or pd.isna(step["tokens"]):
        return None
    return int(step["tokens"])


def step_modes(replay_step: np.ndarray) -> np.ndarray:
    """Per replay, its graph mode from the replays its step holds: FULL for one (the whole
    forward in one graph), PIECEWISE for several (None outside an annotated step)."""
    s = pd.Series(replay_step)
    count = s.map(s[s >= 0].value_counts()).to_numpy()
    return np.where(replay_step < 0, None,  # type: ignore[call-overload]  # (stubs refuse None)
                    np.where(count == 1, "FULL", "PIECEWISE"))


GRAPH_MODES = ("FULL", "PIECEWISE")  # vLLM's cudagraph modes; a capture's "DECODE" is a phase


def for_graph(captures: list[Mapping], batch: int | None, mode: str | None
              ) -> tuple[list[Mapping], str | None]:
    """The captures a graph of this batch size and graph mode may be matched to, in order (an
    unknown batch or mode matches any), and a note when none is left for it."""
    def fits(c: Mapping) -> bool:
        same_batch = batch is None or c.batch is None or c.batch == batch
        both = c.mode in GRAPH_MODES and mode in GRAPH_MODES
        return same_batch and (not both or c.mode == mode)
    kept = [c for c in captures if fits(c)]
    if kept or not captures:
        return kept, None
    want = f"batch {batch}" + (f", {mode}" if mode else "")
    return kept, (f"no capture of its step's {want} among "
                  f"{', '.join(c.label for c in captures)}: not matched to one")


def _report(w: _Written, namings: list[GraphNaming]) -> GraphReport:
    """Totals and the per-graph table (GRAPH_COLUMNS), one row per naming."""
    out, rr, graph, how = w.out, w.rr, w.graph, w.how
    rows = rr["row"].to_numpy()
    dur = out["dur_us"].to_numpy(np.float64)[rows]
    named = how != "none"
    t = pd.DataFrame([n.row() for n in namings])
    t.insert(0, "graph", np.arange(len(t)))
    g = pd.DataFrame({"graph": graph, "replay": rr["replay"].to_numpy(), "dur": dur,
                      "named": named, "named_t": np.where(named, dur, 0.0)}).groupby("graph")
    t["replays"] = g["replay"].nunique().to_numpy()
    t["kernels"] = g.size().to_numpy() // t["replays"].to_numpy()
    t["named"] = g["named"].sum().to_numpy() // t["replays"].to_numpy()
    t["time_us"] = g["dur"].sum().to_numpy()
    t["named_time_us"] = g["named_t"].sum().to_numpy()
    return GraphReport(
        replays=int(rr["replay"].max()) + 1, kernels=len(rows), time_us=float(dur.sum()),
        named_kernels=int(named.sum()), named_time_us=float(dur[named].sum()),
        matched_time_us=float(dur[how == "matched"].sum()),
        costed_time_us=float(dur[(out["input_dims"].notna().to_numpy()[rows] | w.by_step)
                                 & named].sum()),
        flags=tuple(dict.fromkeys(f for n in namings for f in n.flags)),
        graphs=t[list(GRAPH_COLUMNS)].astype(GRAPH_COLUMNS),
    )
