"""CUDA- and HIP-graph replays: name, and where shapes are known cost, the kernels a graph launch
replays.

Design notes: docs/design.md ("trace_roofline/attribution/graphs.py").
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from trace_roofline.attribution import explain, naming
from trace_roofline.attribution.attribute import attribute
from trace_roofline.attribution.passes import forward_passes
from trace_roofline.errors import InputError
from trace_roofline.model import dtypes, kernels, layouts, moe, operators
from trace_roofline.model.models import ModelSpec
from trace_roofline.options import DecodeShapes
from trace_roofline.trace import Trace
from trace_roofline.trace.decode import decode_args

GRAPH_LAUNCH = re.compile(r"^(?:cu(?:da)?|hip)GraphLaunch")
BAND = 64  # kernels either side of the diagonal the alignment may stray
MAPPING_MATCH = 0.8  # share of a graph's kernels a mapping's best pass must match by name
OWN_PASS_MATCH = 0.9  # the same for the replay trace's own eager passes
LAYER_MATCH = 0.75  # share of a layer's kernels that must repeat in the last layer (kernel_name)
CARRIED = ("operator", "op_name", "input_dims", "input_types", "concrete_inputs",
           "input_strides")
_TRITON_SUFFIX = re.compile(r"_\d+$")
_EXPERT_GEMMS = ("experts_gate_up", "experts_down")  # a weight gather joins these

GEMM = "gemm"  # kernel_ops' op of a weight GEMM (named by its place)
_SDPA_FUSED = re.compile(r"^triton_\w*fused_\w*(?:scaled_dot_product|attention)")
ATTENTION_OP = "aten::scaled_dot_product_attention"  # kernel_ops' op of an attention kernel
_GEMM_OPS = {"mm", "addmm", "linear", "matmul", "bmm", "baddbmm", "_addmm_activation",
             "_scaled_mm"}
_PRE = {3: ("q_proj", "k_proj", "v_proj"), 1: ("qkv_proj",)}
Layouts = dict[int, tuple[str, ...]]  # GEMM count -> their operators, in launch order
_POST: Layouts = {4: ("o_proj", "gate_proj", "up_proj", "down_proj"),
                  3: ("o_proj", "gate_up_proj", "down_proj")}
# A sparse layer's GEMMs after attention, as HF transformers 5.x runs them (grouped_mm or
# batched_mm: one GEMM for all experts' gate_up, one for down; vLLM's two fused_moe_kernel
# launches alike). With a shared expert and its sigmoid gate (Qwen2-MoE), HF runs the shared
# expert first and the gate last; vLLM the shared expert (gate_up fused) and its gate first.
_POST_MOE: Layouts = {4: ("o_proj", "router", "experts_gate_up", "experts_down")}
_POST_SHARED: Layouts = {
    8: ("o_proj", "shared_gate_proj", "shared_up_proj", "shared_down_proj", "router",
        "experts_gate_up", "experts_down", "shared_expert_gate"),
    7: ("o_proj", "shared_gate_up_proj", "shared_down_proj", "shared_expert_gate",
        "router", "experts_gate_up", "experts_down")}


@dataclass(frozen=True)
class Mapping:
    """The eager forward passes of a mapping trace, as templates: attributed rows in pass and
    time order, with their grid, and the row range of each distinct kernel sequence."""

    source: str
    rows: pd.DataFrame  # CARRIED + layer, op_id, name, kind, grid
    starts: np.ndarray  # template t = rows[starts[t]:starts[t + 1]]
    positional: bool = False  # a capture: names unknown, kernel k is the k-th launch
    batch: int | None = None  # a capture's batch size, when known (captures.py)
    mode: str | None = None  # a capture's graph mode (FULL, PIECEWISE), when known
    capture: bool = False  # a profiled capture (its kernels did not run): captures.py

    @property
    def label(self) -> str:
        """The source with the batch and mode it was captured for."""
        what = ", ".join(x for x in (f"batch {self.batch}" if self.batch else "", self.mode or "")
                         if x)
        return self.source + (f" ({what})" if what else "")


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


def replay_rows(trace: Trace) -> pd.DataFrame:
    """Device rows launched by a CUDA-graph launch: row (index into trace.device), replay (one
    per launch, in launch order), pos (order in the replay), ordered by replay then start."""
    rt = trace.runtime
    launch = _matches(rt["name"], GRAPH_LAUNCH)
    corr = rt.loc[launch, "correlation"].dropna().astype("int64").to_numpy()
    dev = trace.device
    dc = dev["correlation"].astype("Int64").to_numpy(np.int64, na_value=-1)
    # torch.compile's cudagraph trees stamp the replayed kernels with the External id of the op
    # around the launch: the correlation alone says they were replayed
    rows = np.flatnonzero(np.isin(dc, corr))
    rows, c = _piecewise(dev, rows, dc[rows])
    ts = dev["ts_us"].to_numpy(np.float64)[rows]
    first = pd.Series(ts).groupby(c).transform("min").to_numpy()
    order = np.lexsort((ts, c, first))  # by the replay's first start, then within it by start
    rows, c = rows[order], c[order]
    new = np.r_[True, c[1:] != c[:-1]] if len(rows) else np.zeros(0, bool)
    replay = np.cumsum(new) - 1
    pos = np.arange(len(rows)) - np.maximum.accumulate(np.where(new, np.arange(len(rows)), 0))
    return pd.DataFrame({"row": rows, "replay": replay, "pos": pos})


def _piecewise(dev: pd.DataFrame, rows: np.ndarray, corr: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """Piecewise graphs (vLLM's: the step captured in pieces split at each attention op, which
    runs eagerly) joined into one replay per step: two graph launches in a row whose kernels
    are separated on the device by attention and KV-cache-write kernels only (at least one
    attention) are one replay, those eager kernels included. (rows, their launch correlation,
    a piece's taking its run's first)."""
    if len(rows) == 0 or len(np.unique(corr)) < 2:
        return rows, corr
    ts = dev["ts_us"].to_numpy(np.float64)
    order = np.argsort(ts, kind="stable")
    rank = np.empty(len(ts), dtype=np.int64)
    rank[order] = np.arange(len(ts))
    names = dev["name"].astype("category")
    role = kernels.roles(pd.Series(names.cat.categories.astype(object))).astype(object)
    role = np.append(role.to_numpy(), "")[names.cat.codes.to_numpy()][order]
    attn = np.isin(role, list(kernels.ATTENTION_ROLES))
    eager_ok = attn | (role == "kv_cache_write")
    replayed = np.zeros(len(ts), dtype=bool)
    replayed[rank[rows]] = True
    cum = {k: np.r_[0, np.cumsum(v)] for k, v in
           (("attn", attn), ("ok", eager_ok & ~replayed), ("rep", replayed))}
    span = pd.DataFrame({"c": corr, "r": rank[rows]}).groupby("c")["r"].agg(["min", "max"])
    span = span.sort_values("min")
    lo, hi = span["max"].to_numpy()[:-1] + 1, span["min"].to_numpy()[1:]
    n = hi - lo
    joined = ((n > 0) & (cum["ok"][hi] - cum["ok"][lo] == n)
              & (cum["rep"][hi] - cum["rep"][lo] == 0) & (cum["attn"][hi] - cum["attn"][lo] > 0))
    if not joined.any():
        return rows, corr
    run_of = np.r_[0, np.cumsum(~joined)]
    head = span.index.to_numpy()[np.r_[0, np.flatnonzero(~joined) + 1]][run_of]
    new_corr = pd.Series(head, index=span.index).reindex(corr).to_numpy()
    gaps = [order[a:b] for a, b in zip(lo[joined], hi[joined], strict=True)]
    extra = np.concatenate(gaps)
    extra_corr = np.repeat(head[:-1][joined], [len(g) for g in gaps])
    return np.r_[rows, extra], np.r_[new_corr, extra_corr]


def _matches(names: pd.Series, rx: re.Pattern) -> np.ndarray:
    """rx.search per row of a name column, evaluated once per distinct name."""
    c = pd.Categorical(names)
    hit = pd.Series(np.asarray(c.categories, dtype=object)).str.contains(rx).to_numpy(bool)
    return np.append(hit, False)[c.codes]


def mapping_from(trace: Trace, attributed: pd.DataFrame) -> Mapping:
    """Templates from an eager trace: its forward passes (replayed kernels left out), one per
    distinct kernel-name sequence, in order of first occurrence."""
    if len(attributed) != len(trace.device):
        raise InputError(f"{trace.path}: a graph mapping needs a GPU trace")
    keep = np.ones(len(attributed), bool)
    keep[replay_rows(trace)["row"].to_numpy()] = False
    att = attributed.assign(grid=trace.device["grid"].astype(object).to_numpy(),
                            _row=np.arange(len(attributed)))[keep]
    pid = np.asarray(forward_passes(att).pass_id.to_numpy(np.int64, na_value=-1))
    if not (pid >= 0).any():  # no model structure: each ProfilerStep, else all, is one pass
        pid = pd.factorize(att["step"].astype("Int64").to_numpy(np.float64, na_value=-1.0))[0]
    att = att.assign(_pass=pid)[pid >= 0].sort_values(["_pass", "ts_us"], kind="stable")
    names = pd.Categorical(att["name"].astype(object))
    seq_pass = att["_pass"].to_numpy()
    key = _sequence_keys(names.codes.astype(np.int64), seq_pass)
    first_of = pd.Series(key).groupby(seq_pass).first()
    distinct = first_of.drop_duplicates()
    take = att["_pass"].isin(distinct.index.to_numpy()).to_numpy()
    rows = att[take].reset_index(drop=True)
    bounds = np.flatnonzero(np.r_[True, rows["_pass"].to_numpy()[1:] != rows["_pass"].to_numpy()[:-1]])
    cols = [*CARRIED, "layer", "op_id", "name", "kind", "grid", "_pass"]
    return Mapping(trace.path, rows[cols], np.r_[bounds, len(rows)])


_CAPTURE_BEGIN = re.compile(r"StreamBeginCapture")
_CAPTURE_END = re.compile(r"StreamEndCapture")
_LAUNCH = re.compile(r"^(?:cu(?:da)?LaunchKernel(?:Ex|ExC)?(?:_v\d+)?|cudaMemsetAsync|cudaMemcpyAsync|"
                     r"hip(?:Ext)?(?:Module)?LaunchKernel|hipMemsetAsync|hipMemcpyAsync)")
_MEMSET = re.compile(r"^(?:cuda|hip)MemsetAsync")
_MEMCPY = re.compile(r"^(?:cuda|hip)MemcpyAsync")


def capture_mapping(trace: Trace, model: ModelSpec | None = None,
                    launches: pd.DataFrame | None = None) -> Mapping | None:
    """Templates from graph captures in the trace itself: the kernel launches recorded between
    a cudaStreamBeginCapture and its cudaStreamEndCapture on one thread (hip* on ROCm; they
    ran no kernel; their cpu ops carry the shapes), in launch order, one template per capture.
    They are named by attributing them as if each had run a kernel at its launch (`attribute`,
    rows appended to the device table), so a captured op gets the name and shapes its eager
    twin would. With `launches` (correlation, name, grid, block: the launch args a capture
    trace recorded, captures.capture_launches) each launch's kernel carries its own name and
    grid, so the kernel families name it too and the template is aligned by name; without
    them kernel k is the k-th launch (`positional`)."""
    rt = trace.runtime.reset_index(drop=True)
    is_begin = _matches(rt["name"], _CAPTURE_BEGIN)
    if not is_begin.any():
        return None
    name = rt["name"].astype(object).fillna("")
    thread = pd.factorize(pd.MultiIndex.from_arrays([rt["pid"].fillna(-1), rt["tid"].fillna(-1)]))[0]
    ts = rt["ts_us"].to_numpy(np.float64)
    begin = np.flatnonzero(is_begin)
    end = np.flatnonzero(_matches(rt["name"], _CAPTURE_END))
    ran = set(trace.device["correlation"].dropna().astype("int64").tolist())
    corr = rt["correlation"].astype("Int64").to_numpy(np.int64, na_value=-1)
    launch = _matches(rt["name"], _LAUNCH) & ~np.isin(corr, list(ran)) & (corr >= 0)
    capture = np.full(len(rt), -1, dtype=np.int64)
    for k, b in enumerate(begin):  # captures are few: one loop step each
        e = end[(thread[end] == thread[b]) & (ts[end] > ts[b])]
        if len(e):
            inside = launch & (thread == thread[b]) & (ts > ts[b]) & (ts < ts[e].min())
            capture[inside] = k
    rows = np.flatnonzero(capture >= 0)
    if not len(rows):
        return None
    dev = trace.device
    launch_name = name.to_numpy()[rows]
    kind = np.where(_matches(pd.Series(launch_name), _MEMSET), "memset",
                    np.where(_matches(pd.Series(launch_name), _MEMCPY), "memcpy", "kernel"))
    kernel, grid, block = _launch_args(launches, corr[rows], kind)
    fake = pd.DataFrame({
        "event_id": -1 - np.arange(len(rows)), "name": kernel, "kind": kind,
        "pid": dev["pid"].iloc[0] if len(dev) else pd.NA, "device": 0, "stream": -1,
        "ts_us": ts[rows], "dur_us": 0.0, "correlation": corr[rows],
        "external_id": rt["external_id"].to_numpy()[rows], "grid": grid, "block": block,
    })
    fake = fake.astype({c: t for c, t in dev.dtypes.items() if str(t) != "category"})
    both = pd.concat([dev.astype({c: object for c, t in dev.dtypes.items()
                                  if str(t) == "category"}), fake], ignore_index=True)
    att = attribute(dataclasses.replace(trace, device=both), model).iloc[len(dev):]
    att = att.assign(grid=grid, _pass=capture[rows], _t=ts[rows])
    att = att.sort_values(["_pass", "_t"], kind="stable").reset_index(drop=True)
    cols = [*CARRIED, "layer", "op_id", "name", "kind", "grid", "_pass"]
    p = att["_pass"].to_numpy()
    bounds = np.flatnonzero(np.r_[True, p[1:] != p[:-1]])
    return Mapping(f"{trace.path} (capture)", att[cols], np.r_[bounds, len(att)],
                   positional=launches is None, capture=True)


_MEMCPY_NAMES = {"memset": "Memset (Device)", "memcpy": "Memcpy DtoD (Device -> Device)"}


def _launch_args(launches: pd.DataFrame | None, corr: np.ndarray, kind: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(kernel name, grid, block) per captured launch: its recorded args, a runtime copy's
    name for memsets and memcpys, "captured launch" where nothing is recorded."""
    default = np.array([_MEMCPY_NAMES.get(k, "captured launch") for k in kind], dtype=object)
    if launches is None:
        return default, np.full(len(corr), None, object), np.full(len(corr), None, object)
    by = launches.set_index("correlation")
    got = by.reindex(corr)
    name = got["name"].to_numpy(dtype=object)
    return (np.where(pd.notna(name), name, default), got["grid"].to_numpy(dtype=object),
            got["block"].to_numpy(dtype=object))


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
    dev = trace.device
    names = dev["name"].cat
    vocab = names.categories.astype(object)
    for m in (mapping, own, cap, *captures):
        if m is not None:
            vocab = vocab.append(pd.Index(m.rows["name"].astype(object).unique())).unique()
    codes = np.append(vocab.get_indexer(names.categories.astype(object)), -1)[
        names.codes.to_numpy()[rows]]
    replay = rr["replay"].to_numpy()
    graph, reps = _graphs(codes, replay)
    starts = np.flatnonzero(np.r_[True, replay[1:] != replay[:-1]])
    step_of = _replay_steps(step_of_row, rows[starts])
    modes = step_modes(step_of)
    results: list[pd.DataFrame] = []
    per_graph: list[dict] = []
    flags: list[str] = []
    for r in reps:
        seq = slice(starts[r], starts[r + 1] if r + 1 < len(starts) else len(rows))
        at = rows[seq]
        step = steps.iloc[step_of[r]] if steps is not None and step_of[r] >= 0 else None
        batch = _step_batch(step)
        kept, why = for_graph(list(captures), batch, modes[r])
        candidates = [(m, MAPPING_MATCH, True) for m in ([mapping] if mapping else kept)]
        if own is not None:
            candidates.append((own, OWN_PASS_MATCH, False))
        if cap is not None:
            candidates.append((cap, 1.0, False))
        g_shapes, shape_note = step_shapes(step, shapes)
        res, info = _name_graph(codes[seq], vocab[codes[seq]].to_numpy(dtype=object),
                                dev["kind"].astype(object).to_numpy()[at],
                                dev["grid"].astype(object).to_numpy()[at], vocab,
                                candidates, model, g_shapes)
        info["flags"] += [f"graph {len(per_graph)}: {why}"] * (why is not None)
        info["flags"] += _ambiguous(len(per_graph), info, batch, kept)
        info["flags"] += _unused_shapes(len(per_graph), info, shapes, shape_note)
        results.append(res)
        flags.extend(info.pop("flags"))
        per_graph.append(info)
    out, how = _write(attributed, rr, graph, results)
    by_step = _step_costed(out, rows, steps, step_of_row)
    return out, _report(out, rr, graph, how, per_graph, flags, by_step)


def _step_costed(out: pd.DataFrame, rows: np.ndarray, steps: pd.DataFrame | None,
                 step_of_row: np.ndarray | None) -> np.ndarray:
    """Per replayed row, whether its step annotation's sums cost it (attention in a step with
    the detailed sums: costs/shapes.py), though it carries no shapes."""
    if steps is None or step_of_row is None or steps.empty:
        return np.zeros(len(rows), dtype=bool)
    has = steps[["p_sq", "d_sq"]].notna().all(axis=1).to_numpy()
    s = np.asarray(step_of_row)[rows]
    attn = out["operator"].to_numpy(dtype=object)[rows] == "attention"
    return attn & (s >= 0) & has[np.maximum(s, 0)]


def _ambiguous(g: int, info: dict, batch: int | None, kept: list[Mapping]) -> list[str]:
    """A flag when a graph of unknown batch (no step annotation) was matched to one of several
    captures of other batch sizes: kernel names alone may not tell the batch."""
    batches = {c.batch for c in kept}
    if batch is not None or len(batches) < 2 or info["method"] != "graph_map":
        return []
    return [f"graph {g}: its batch is unknown (no step annotation): matched to "
            f"{info['template']}, the first of {len(kept)} captures ({', '.join(c.label for c in kept)}) "
            "that fits; profile with the step annotation or give --graph-map that capture"]


def _unused_shapes(g: int, info: dict, given: DecodeShapes | None, step_note: str | None
                   ) -> list[str]:
    """Notes on the shapes a graph was costed from: the step annotation's (in its note), and
    a flag for --batch/--context given but not used (the step or the mapping gave shapes)."""
    if info["shapes"] == "step" and step_note:
        info["note"] = "; ".join(x for x in (info["note"], step_note.split("; ")[0]) if x)
    if given is None or info["shapes"] == "user":
        return []
    why = ("the step annotation gives the shapes" if info["shapes"] == "step" else
           f"its kernels carry the shapes of {info['template']}" if info["shapes"] == "mapping"
           else "nothing in it was costed from them")
    return [f"graph {g}: --batch {given.batch} --context {given.context} not used: {why}"]


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


def step_shapes(step: pd.Series | None, given: DecodeShapes | None
                ) -> tuple[DecodeShapes | None, str | None]:
    """Shapes for a graph named from kernel names: its annotated step's (M = the step's
    tokens, context = Σk / requests; attention from the step's sums, costs/shapes.py), else
    the user's --batch/--context; and a note of which, and of a given option left unused."""
    if step is None or pd.isna(step["tokens"]):
        return given, None
    keys = sum(int(step[c]) for c in ("p_sk", "d_sk") if pd.notna(step[c]))
    requests = int(step["requests"]) if pd.notna(step["requests"]) else int(step["tokens"])
    context = max(1, round(keys / max(requests, 1))) if keys else 1
    got = StepShapes(int(step["tokens"]), context)
    return got, (f"costed from the step annotation ({int(step['tokens'])} tokens, "
                 f"{step['phase']}; attention from its sums)")


@dataclass(frozen=True)
class StepShapes(DecodeShapes):
    """Shapes from a step annotation: GEMMs and the rest over its tokens; attention is left to
    the step's sums (costs/shapes.py), never to a mean context."""


# ----------------------------------------------------------------------------------------------
# Graphs: distinct replayed sequences
# ----------------------------------------------------------------------------------------------
def _sequence_keys(codes: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """Per row, a key of its whole sequence (rows of one sequence are contiguous): two
    position-weighted 64-bit hashes and the length, equal for equal sequences."""
    n = len(codes)
    new = np.r_[True, seq[1:] != seq[:-1]] if n else np.zeros(0, bool)
    start = np.maximum.accumulate(np.where(new, np.arange(n), 0))
    pos = np.arange(n) - start
    rng = np.random.default_rng(0x5EED)
    width = int(pos.max()) + 1 if n else 0
    w1, w2 = (rng.integers(1, 2**63, size=width, dtype=np.uint64) | np.uint64(1)
              for _ in range(2))
    c = codes.astype(np.uint64) + np.uint64(1)
    with np.errstate(over="ignore"):
        h1 = np.add.reduceat(c * w1[pos], np.flatnonzero(new)) if n else np.zeros(0, np.uint64)
        h2 = np.add.reduceat(c * c * w2[pos], np.flatnonzero(new)) if n else h1
    length = np.diff(np.r_[np.flatnonzero(new), n])
    keys = pd.MultiIndex.from_arrays([h1, h2, length])
    per_seq = pd.factorize(keys)[0]
    return np.repeat(per_seq, length)


def _graphs(codes: np.ndarray, replay: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Graph number per row and the first replay of each graph; each replay is checked equal
    to its graph's first replay, kernel for kernel."""
    key = _sequence_keys(codes, replay)
    starts = np.flatnonzero(np.r_[True, replay[1:] != replay[:-1]])
    per_replay = key[starts]
    graph_of_replay, _ = pd.factorize(per_replay)
    reps = pd.Series(np.arange(len(starts))).groupby(graph_of_replay).first().tolist()
    graph = np.repeat(graph_of_replay, np.diff(np.r_[starts, len(codes)]))
    pos = np.arange(len(codes)) - np.repeat(starts, np.diff(np.r_[starts, len(codes)]))
    rep_start = starts[np.asarray(reps)[graph]]
    if not np.array_equal(codes, codes[rep_start + pos]):
        raise AssertionError("replays of one graph key differ: hash collision")
    return graph, reps


# ----------------------------------------------------------------------------------------------
# One graph
# ----------------------------------------------------------------------------------------------
def _own_mapping(trace: Trace, attributed: pd.DataFrame) -> Mapping | None:
    """The replay trace's own eager passes (kernels not replayed) as templates, if any."""
    try:
        m = mapping_from(trace, attributed)
    except InputError:
        return None
    return m if len(m.rows) else None


def _name_graph(codes, names, kinds, grids, vocab, candidates, model, shapes):
    """(position table, info) of one graph: the position table has one row per kernel of the
    replay with CARRIED, layer, inst (instance within the replay, -1 none), evidence, how.
    `candidates`: (Mapping, needed match share, explicit) to try in order."""
    info = _fresh_info()
    for m, need, explicit in candidates:
        res = (_by_capture(names, kinds, m, info) if m.positional
               else _by_mapping(codes, kinds, grids, vocab, m, model, shapes, info))
        if res is not None and info["matched"] >= need * len(codes):
            return res, info
        flags = [f"graph mapping {m.label}: its best pass matches {info['matched']} of the "
                 f"graph's {len(codes)} kernels (< {need:.0%}): not the replayed step, not "
                 "used"] if explicit else []
        info = _fresh_info(flags)
    res = _by_kernel_names(names, kinds, model, shapes, info)
    if res is not None:
        return res, info
    return _empty(len(codes)), info


def _fresh_info(flags: list[str] | None = None) -> dict:
    return {"method": "none", "template": None, "matched": 0, "attached": 0,
            "grid_mismatch": 0, "shapes": "none", "note": None, "flags": flags or []}


def _by_capture(names, kinds, m: Mapping, info) -> pd.DataFrame | None:
    """The capture with as many launches as the replay has kernels, kernel k = launch k, when
    every GEMM / fused-attention / memset kernel sits where the capture launched that kind."""
    n = len(names)
    op = kernel_ops(pd.Series(names, dtype=object)).to_numpy(dtype=object)
    for t in range(len(m.starts) - 1):
        tmpl = m.rows.iloc[m.starts[t]:m.starts[t + 1]].reset_index(drop=True)
        if len(tmpl) != n:
            continue
        base = tmpl["op_name"].astype(object).fillna("").str.rsplit("::", n=1).str[-1]
        t_gemm = base.isin(_GEMM_OPS).to_numpy()
        t_attn = operators.recognise(operators.ATTENTION, base).to_numpy()
        fits = ((op == GEMM) <= t_gemm) & ((op == ATTENTION_OP) <= t_attn)
        fits &= (kinds == "memset") == (tmpl["kind"].to_numpy(dtype=object) == "memset")
        if not fits.all():
            continue
        res = _empty(n)
        for c in (*CARRIED, "layer"):
            res[c] = tmpl[c].to_numpy(dtype=object) if c != "layer" else tmpl[c].array
        res["inst"] = _template_instances(tmpl)
        res["evidence"] = "graph_map"
        res["how"] = "matched"
        info.update(method="graph_map", template=f"{m.source} {t}", matched=n, shapes="mapping")
        return res
    return None


def _template_instances(tmpl: pd.DataFrame, alone: bool = False) -> np.ndarray:
    """0, 1, ... per distinct (op, operator) of a template (an op can hold several: a fused MoE
    op's gate_up, down and combine); a row without an op is -1, or with `alone` one of its own."""
    op = tmpl["op_id"].astype("Int64").to_numpy(np.float64, na_value=np.nan)
    if alone:
        op = np.where(np.isnan(op), -1.0 - np.arange(len(tmpl)), op)
    key = pd.MultiIndex.from_arrays([op, tmpl["operator"].astype(object).to_numpy()])
    inst = pd.factorize(key)[0]
    return np.where(np.isnan(op), -1, inst)


def _empty(n: int) -> pd.DataFrame:
    t = pd.DataFrame({c: pd.Series([None] * n, dtype=object) for c in CARRIED})
    t["operator"] = "unattributed"
    t["layer"] = pd.array([pd.NA] * n, dtype="Int64")
    t["inst"] = np.full(n, -1, np.int64)
    t["evidence"] = operators.FALLBACK
    t["how"] = "none"
    return t


def _by_mapping(codes, kinds, grids, vocab, m: Mapping, model, shapes, info
                ) -> pd.DataFrame | None:
    """Align with the best template; carry names and (checked) shapes."""
    t_codes = vocab.get_indexer(m.rows["name"].astype(object).to_numpy())
    best, best_n = None, 0
    for t in range(len(m.starts) - 1):
        tc = t_codes[m.starts[t]:m.starts[t + 1]]
        if len(tc) > 8 * len(codes) + BAND:  # too long to be this step: keeps align linear
            continue
        common = np.minimum(np.bincount(codes, minlength=len(vocab)),
                            np.bincount(tc, minlength=len(vocab))).sum()
        if common > best_n:
            best, best_n = t, common
    if best is None:
        return None
    lo, hi = m.starts[best], m.starts[best + 1]
    tc = t_codes[lo:hi]
    match = align(codes, tc)
    tmpl = m.rows.iloc[lo:hi].reset_index(drop=True)
    n = len(codes)
    src = match.copy()
    how = np.where(match >= 0, "matched", "none").astype(object)
    # unmatched split-K reduces join the kernel before, memsets / memcpys the kernel after
    reduce_ = pd.Series(vocab[codes]).str.contains(kernels.GEMM_SECOND_KERNEL).to_numpy() & (match < 0)
    copy_ = np.isin(kinds, ["memset", "memcpy"]) & (match < 0)
    prev = _ffill(src, forward=True)
    nxt = _ffill(src, forward=False)
    src = np.where(reduce_ & (prev >= 0), prev, src)
    src = np.where(copy_ & (nxt >= 0), nxt, src)
    how = np.where((how == "none") & (src >= 0), "attached", how)
    res = _empty(n)
    ok = src >= 0
    for c in (*CARRIED, "layer"):
        vals = tmpl[c].to_numpy(dtype=object if c != "layer" else None)
        res.loc[ok, c] = vals[src[ok]] if c != "layer" else tmpl[c].array.take(src[ok])
    inst = _template_instances(tmpl, alone=True)
    res["inst"] = np.where(ok, inst[np.maximum(src, 0)], -1)
    res["evidence"] = np.where(ok, "graph_map", operators.FALLBACK)
    res["how"] = how
    matched = int((how == "matched").sum())
    where = m.label if m.capture else f"{m.source} pass {int(tmpl['_pass'].iloc[0])}"
    info.update(method="graph_map", template=where, matched=matched,
                attached=int((how == "attached").sum()),
                note=(f"aligned with {where}: {matched} of {n} kernels matched by name in order "
                      f"(LCS {matched} of {len(tmpl)} template kernels, "
                      f"{matched / max(n, 1):.1%} of the graph)"))
    _check_shapes(res, match, grids, tmpl, model, shapes, info)
    return res


def _ffill(src: np.ndarray, forward: bool) -> np.ndarray:
    """Per position, the last (forward) or next matched template index, -1 if none."""
    n = len(src)
    idx = np.arange(n) if forward else np.arange(n)[::-1]
    s = src[idx]
    at = np.maximum.accumulate(np.where(s >= 0, np.arange(n), -1))
    out = np.where(at >= 0, s[np.maximum(at, 0)], -1)
    return out if forward else out[::-1]


def _check_shapes(res, match, grids, tmpl, model, shapes, info) -> None:
    """Drop carried shapes the replay does not share (module docstring, shape check)."""
    t_grid = tmpl["grid"].to_numpy(dtype=object)
    twin = t_grid[np.maximum(match, 0)] if len(t_grid) else np.full(len(match), None, object)
    # a replay or capture that records no grid (ROCm's replayed kernels) is not compared
    ok = (match >= 0) & pd.notna(grids) & pd.notna(twin)
    differ = ok & (grids.astype(str) != np.where(ok, twin, "").astype(str))
    info["grid_mismatch"] = int(differ.sum())
    in_attn = res["operator"].to_numpy(dtype=object) == "attention"
    refuse, why = False, cast("str | None", None)
    if (differ & ~in_attn).any():
        i = int(np.flatnonzero(differ & ~in_attn)[0])
        refuse = True
        why = (f"{int((differ & ~in_attn).sum())} kernels launch other grids than in the mapping "
               f"(e.g. {res['operator'].iloc[i]} {grids[i]} vs {t_grid[match[i]]}): "
               "another batch; names carried, shapes and costs not")
    elif differ.any():
        res.loc[in_attn, ["op_name", "input_dims", "input_types", "concrete_inputs",
                          "input_strides"]] = None
        why = (f"{int(differ.sum())} attention kernels launch other grids than in the mapping: "
               "another context length; attention named but uncosted")
    if shapes is not None and not refuse:
        m = _template_m(tmpl)
        if m is not None and m != shapes.batch:
            refuse = True
            why = (f"the mapping's q_proj has M = {m} tokens but the given decode batch is "
                   f"{shapes.batch}: "
                   "names carried, the mapping's shapes not")
    info["shapes"] = "mapping"
    if refuse:
        # batched_mm's weight gathers, as the mapping names their op, before its shapes go
        gathers = (res["operator"].isin(_EXPERT_GEMMS)
                   & res["op_name"].eq("aten::index")).to_numpy(dtype=bool)
        res.loc[:, ["op_name", "input_dims", "input_types", "concrete_inputs",
                    "input_strides"]] = None
        info["shapes"] = "none"
        if shapes is not None and model is not None:
            user_shapes(res, model, shapes, gathers)
            info["shapes"] = "step" if isinstance(shapes, StepShapes) else "user"
            assert why is not None  # (a refusal says why)
            why += ("; costed from the step annotation instead" if info["shapes"] == "step"
                    else "; costed from the given decode shapes instead")
    if why:
        info["note"] = "; ".join(x for x in (info["note"], why) if x)
        info["flags"].append(f"graph mapping {info['template']}: {why}")


def _template_m(tmpl: pd.DataFrame) -> int | None:
    """Tokens (M) of the template's first q_proj / qkv_proj, from its Input Dims."""
    q = tmpl[tmpl["operator"].isin(["q_proj", "qkv_proj"]) & tmpl["input_dims"].notna()]
    if q.empty:
        return None
    dims = decode_args(str(q["input_dims"].iloc[0]))
    return layouts.gemm_tokens(str(q["op_name"].iloc[0]), dims) if dims else None


def align(a: np.ndarray, b: np.ndarray, band: int = BAND) -> np.ndarray:
    """For each position of `a`, its partner in `b` (-1: none) in a longest common subsequence
    of the two code sequences whose path stays within `band` of the diagonal band between
    (0, 0) and (len(a), len(b)). O((n + m)·(|n - m| + 2·band)) time and memory."""
    n, m = len(a), len(b)
    out = np.full(n, -1, dtype=np.int64)
    if n == m and np.array_equal(a, b):
        return np.arange(n)
    if not n or not m:
        return out
    dmin, dmax = min(0, m - n), max(0, m - n)
    width = dmax - dmin + 2 * band + 1
    off = dmin - band  # column c of row i is j = i + off + c
    cols = np.arange(width)
    rows = np.full((n + 1, width), -1, dtype=np.int32)
    j0 = off + cols
    rows[0] = np.where((j0 >= 0) & (j0 <= m), 0, -1)
    bpad = np.r_[-2, b]  # bpad[j] = b[j - 1]; j = 0 never equals a code
    for i in range(1, n + 1):
        js = i + off + cols
        valid = (js >= 0) & (js <= m)
        prev = rows[i - 1]
        up = np.r_[prev[1:], -1]  # D[i-1][js]
        diag = prev  # D[i-1][js-1]
        eq = (bpad[np.clip(js, 0, m)] == a[i - 1]) & (js >= 1)
        cand = np.maximum(up, np.where(diag >= 0, diag + eq, -1))
        cand = np.where(js == 0, 0, cand)
        cand = np.where(valid, cand, -1)
        row = np.maximum.accumulate(cand)
        rows[i] = np.where(valid, row, -1)
    i, j = n, m
    while i > 0 and j > 0:
        c = j - (i + off)
        cur = rows[i, c]
        if a[i - 1] == b[j - 1] and rows[i - 1, c] >= 0 and rows[i - 1, c] + 1 == cur:
            out[i - 1] = j - 1
            i, j = i - 1, j - 1
        elif c + 1 < width and rows[i - 1, c + 1] == cur:
            i -= 1
        else:
            j -= 1
    return out


# ----------------------------------------------------------------------------------------------
# No mapping: the model and the kernel sequence
# ----------------------------------------------------------------------------------------------
def kernel_ops(names: pd.Series) -> pd.Series:
    """The op each kernel name runs, evaluated once per distinct name, first that applies:
    RoPE's fp32 SIMT GEMM and the grouped GEMM's set-up (kernels.KERNEL_OPS' first two), GEMM for the
    registry's weight-GEMM roles (kernels.GEMM_ROLES), ATTENTION_OP for its attention roles, a
    Triton kernel's own name (its fused ops), kernels.KERNEL_OPS' ATen or engine op, else "" (nothing
    said)."""
    first, rest = kernels.KERNEL_OPS[:2], kernels.KERNEL_OPS[2:]

    def per(u: pd.Series) -> pd.Series:
        text = u.fillna("")
        out = pd.Series("", index=u.index, dtype=object)
        role = kernels.roles(text).astype(object).to_numpy()
        triton = text.str.startswith("triton_").to_numpy(bool)
        steps: list[tuple[np.ndarray, str | None]] = [
            (text.str.contains(rx).to_numpy(bool), op) for rx, op in first]
        steps += [(np.isin(role, list(kernels.GEMM_ROLES)), GEMM),
                  (np.isin(role, list(kernels.ATTENTION_ROLES)), ATTENTION_OP),
                  # Inductor's kernels fused into SDPA's inputs run inside the attention op
                  (triton & text.str.contains(_SDPA_FUSED).to_numpy(bool), ATTENTION_OP),
                  (triton, None)]
        steps += [(text.str.contains(rx).to_numpy(bool), op) for rx, op in rest]
        left = np.ones(len(u), dtype=bool)
        for hit, op in steps:
            take = left & hit
            out[take] = u[take] if op is None else op
            left &= ~take
        return out
    return naming.per_value(names, per)


def kernel_roles(names: np.ndarray) -> pd.Categorical:
    """The registry's role of each kernel name (kernels.ROLES)."""
    return pd.Categorical(kernels.roles(pd.Series(names, dtype=object)))


def _post_layouts(model: ModelSpec, layers: int) -> Layouts | str:
    """The GEMMs after attention by their count, for `layers` traced layers of `model` (its
    first ones): the dense MLP's, or a sparse layer's (_POST_MOE, _POST_SHARED); a note when
    the traced layers mix dense and sparse ones."""
    sparse = len(model.sparse_among(layers))
    if sparse == 0:
        return _POST
    if sparse < layers:
        return f"{sparse} of {layers} layers sparse: dense and sparse layers mixed"
    e = model.experts
    assert e is not None  # (sparse layers have experts)
    return _POST_SHARED if e.shared_intermediate_size and e.shared_gate else _POST_MOE


def _by_kernel_names(names, kinds, model, shapes, info) -> pd.DataFrame | None:
    """Layers from fused-attention runs and GEMM counts, checked to repeat; None (with a note)
    when the sequence does not support naming."""
    n = len(names)
    op = _topk_sorts(kernel_ops(pd.Series(names, dtype=object)).to_numpy(dtype=object))
    # a row gather after the first GEMM is no embedding (vLLM's pick of the logits' rows);
    # the first kernel, a gather before any GEMM, is (SGLang's vectorized_gather_kernel)
    before = np.cumsum(op == GEMM) == 0
    op = np.where((op == "aten::embedding") & ~before, "aten::index_select", op)
    op = np.where((op == "aten::index") & before & (np.arange(n) == 0), "aten::embedding", op)
    reduce_ = pd.Series(names, dtype=object).str.contains(kernels.GEMM_SECOND_KERNEL).to_numpy()
    # (a copy, a memset and the grouped GEMM's set-up join the kernel after them)
    copy_ = np.isin(kinds, ["memset", "memcpy"]) | (op == kernels.GROUPED_GEMM_PREPARE)
    core = ~reduce_ & ~copy_
    gemm = core & (op == GEMM)
    # attention library kernels mark the layers; Inductor's Triton kernels that prepare SDPA's
    # inputs (named after it) are attention too but vary in number between layers
    triton = pd.Series(names, dtype=object).str.startswith("triton_").to_numpy(bool)
    attn = core & (op == ATTENTION_OP) & ~triton
    g_before = np.cumsum(gemm) - gemm  # GEMMs before each position
    clusters = np.unique(g_before[attn])  # one attention run per layer: GEMMs split them
    layers = len(clusters)
    if model is None or layers < 2:
        info["note"] = ("no model" if model is None else
                        f"{layers} fused-attention run(s): no repeated layer to rest names on")
        return None
    per_gap = np.diff(clusters)
    if not (per_gap == per_gap[0]).all():
        info["note"] = f"GEMMs between attention runs differ ({sorted(set(per_gap.tolist()))})"
        return None
    posts = _post_layouts(model, layers)
    if isinstance(posts, str):
        info["note"] = posts
        return None
    layout = [(pre, post) for pre in _PRE for post in posts if pre + post == per_gap[0]]
    total = int(gemm.sum())
    if len(layout) != 1 or clusters[0] < layout[0][0] or total - clusters[-1] < layout[0][1]:
        info["note"] = (f"{per_gap[0]} GEMMs per layer fit no layout of {model.name}'s layers "
                        f"({' / '.join(', '.join(p) for p in posts.values())} after attention)")
        return None
    pre, post = layout[0]
    g_pos = np.flatnonzero(gemm)
    gemm_name = np.full(n, None, dtype=object)
    first_q = []
    for c in clusters:
        for i, nm in enumerate(_PRE[pre]):
            gemm_name[g_pos[c - pre + i]] = nm
        for i, nm in enumerate(posts[post]):
            gemm_name[g_pos[c + i]] = nm
        first_q.append(g_pos[c - pre])
    rest = g_pos[clusters[-1] + post:]
    if len(rest) == 1:
        gemm_name[rest[0]] = "lm_head"
    downs = g_pos[clusters + post - 1]
    why = _layers_differ(names, gemm, attn, first_q, downs)
    if why:
        info["note"] = why
        return None
    gathers = _weight_gathers(op, gemm_name, np.isin(kinds, ["memset", "memcpy"]))
    return _position_table(names, op, core & ~gathers, reduce_, copy_ | gathers, gemm_name,
                           first_q, model, shapes, info)


def _weight_gathers(op: np.ndarray, gemm_name: np.ndarray, mem: np.ndarray) -> np.ndarray:
    """batched_mm's gathers of its experts' weights, per position: an `index` kernel whose next
    kernel, past memsets and copies (`mem`), is an expert GEMM. They join that GEMM, as an
    eager trace names the gather after the GEMM it feeds (gemm_names.name_gemms); grouped_mm's
    token gathers have the dispatch's kernels and the GEMM's prepare kernel in between."""
    n = len(op)
    later = _ffill(np.where(mem, -1, np.arange(n)), False)  # the next non-copy, from here on
    nxt = np.r_[later[1:], -1]
    fed = np.where(nxt >= 0, gemm_name[np.maximum(nxt, 0)], None)  # type: ignore[call-overload]  # (stubs refuse None)
    return (op == "aten::index") & pd.Series(fed, dtype=object).isin(_EXPERT_GEMMS).to_numpy()


def _topk_sorts(op: np.ndarray) -> np.ndarray:
    """torch.topk's own sort: a sort kernel right after a top-k kernel is part of the top-k
    (the router's), not the token sort of the dispatch."""
    after_topk = np.r_[False, op[:-1] == "aten::topk"]
    return np.where((op == "aten::sort") & after_topk, "aten::topk", op)


def _layers_differ(names: np.ndarray, gemm: np.ndarray, attn: np.ndarray, first_q: list[int],
                   downs: np.ndarray) -> str | None:
    """Why the layers (first projection .. down_proj) do not repeat one kernel pattern, or None:
    their GEMM kernels must be the same names in the same order around one attention run (its
    kernels may differ between layers: a sliding-window layer runs another attention kernel,
    gpt-oss's unified_attention_2d against _3d + reduce_segments), and each layer's whole
    kernel sequence must share >= LAYER_MATCH of the longer one with the last layer's (Triton
    kernels compared without their numeric suffix; torch.compile may schedule the model's RoPE
    table kernels into layer 0)."""
    canon = pd.Series(names, dtype=object).str.replace(_TRITON_SUFFIX, "", regex=True)
    codes = pd.factorize(canon)[0]
    shape = np.where(attn, -1, codes)  # every attention kernel one code
    spans = [slice(q, d + 1) for q, d in zip(first_q, downs, strict=True)]
    cores = {_runs(shape[sp][(gemm | attn)[sp]]) for sp in spans}
    if len(cores) != 1:
        return "layers do not repeat one sequence of GEMM and attention kernels"
    ref = codes[spans[-1]]
    for sp in spans[:-1]:
        body = codes[sp]
        if (align(body, ref) >= 0).sum() < LAYER_MATCH * max(len(body), len(ref)):
            return "layers do not repeat one kernel sequence"
    return None


def _runs(seq: np.ndarray) -> tuple[int, ...]:
    """The sequence with each run of equal codes kept once."""
    keep = np.r_[True, seq[1:] != seq[:-1]] if len(seq) else np.zeros(0, bool)
    return tuple(seq[keep].tolist())


def _position_table(names, op, core, reduce_, copy_, gemm_name, first_q, model, shapes, info):
    """Name the core kernels as eager ops would be named (position_names), attach reduces and
    copies, give layers, group instances and add user shapes."""
    n = len(names)
    idx = np.flatnonzero(core)
    is_gemm = np.isin(op[idx], [GEMM, kernels.FP32_GEMM])
    pseudo = np.where(is_gemm, "aten::mm", np.where(op[idx] == "", "kernel", op[idx]))
    inst = pd.DataFrame({
        "grp": np.zeros(len(idx), np.int64),
        "op_name": pd.Series(pseudo, dtype=object),
        "top_name": pd.Series(pseudo, dtype=object),
        "input_dims": pd.Series([None] * len(idx), dtype=object),
        "K": np.where(is_gemm, 0, -1),
        "role": kernel_roles(names[idx]),  # the registry's: a norm, RoPE, KV write, ... kernel
    })
    # a GEMM that is no weight of the model (the fp32 RoPE table product) is named by its place,
    # as an unmatched `linear[K×N]` GEMM of an eager trace is
    gemm = pd.Series(np.where((op[idx] == kernels.FP32_GEMM), "linear[fp32]", gemm_name[idx]),
                     dtype="string")
    named, _ = explain.position_names(inst, gemm, qk_norm=model.qk_norm)
    name = np.full(n, None, dtype=object)
    name[idx] = named.to_numpy(dtype=object)
    src = np.where(core, np.arange(n), -1)
    prev, nxt = _ffill(src, True), _ffill(src, False)
    take = np.where(reduce_, prev, np.where(copy_, nxt, src))
    name = np.where(take >= 0, name[np.maximum(take, 0)], None)
    # a collective kernel (a TP rank's all-reduce) is its collective wherever it sits
    coll = operators.collective_of(pd.Series(names, dtype=object), kernel=True)
    name = np.where(coll.notna().to_numpy() & core, coll.to_numpy(dtype=object, na_value=None),
                    name)
    cats = pd.Index(pd.unique(name[pd.notna(name)]))
    codes = cats.get_indexer(name)
    lay = _layers(name, first_q)
    res = _empty(n)
    res["operator"] = np.where(pd.notna(name), name, "unattributed")
    res["layer"] = pd.arrays.IntegerArray(np.maximum(lay, 0), lay < 0)
    gathers = copy_ & (op == "aten::index")  # batched_mm's weight gathers (_weight_gathers)
    change = (codes[1:] != codes[:-1]) | (lay[1:] != lay[:-1]) | gathers[1:] | gathers[:-1]
    # a run of one operator in one layer; a weight gather is an instance of its own, as eager
    res["inst"] = np.cumsum(np.r_[True, change]) - 1
    res["evidence"] = np.where(pd.notna(name), "kernel_name", operators.FALLBACK)
    res["how"] = np.where(pd.notna(name), "named", "none")
    info.update(method="kernel_name")
    if shapes is not None:
        user_shapes(res, model, shapes, gathers, gemm_name,
                    np.asarray(kernel_roles(names).astype(object)))
        info["shapes"] = "step" if isinstance(shapes, StepShapes) else "user"
    return res


def _layers(name: np.ndarray, first_q: list[int]) -> np.ndarray:
    """Layer per position (-1: none): layer k starts at its input norm (the input_norm kernels
    right before its first projection), so the residual add after down_proj stays in the layer
    before; model-level operators have none."""
    starts = []
    for q in first_q:  # one step per layer
        b = q
        while b > 0 and name[b - 1] == "input_norm":
            b -= 1
        starts.append(b)
    lay = np.searchsorted(np.asarray(starts), np.arange(len(name)), side="right") - 1
    model_level = pd.Series(name, dtype=object).isin(operators.MODEL_LEVEL).to_numpy()
    return np.where(model_level | pd.isna(name), -1, lay)


@dataclass(frozen=True)
class Call:
    """An op as user_shapes writes it into a position table: name, Input Dims, and per
    argument the Input type (None: the model's dtype) and Concrete Inputs."""

    op: str
    dims: list
    types: tuple[str | None, ...] = ()
    concrete: tuple[str, ...] = ()


_NORMS = ("input_norm", "post_attention_norm", "pre_feedforward_norm", "post_feedforward_norm",
          "final_norm")
_AFTER_OUTPUT = ("post_attention_norm", "post_feedforward_norm", "final_norm")  # add before


def user_shapes(res: pd.DataFrame, model: ModelSpec, shapes: DecodeShapes,
                gathers: np.ndarray | None = None, gemms: np.ndarray | None = None,
                roles: np.ndarray | None = None) -> None:
    """Write shapes of B = shapes.batch tokens (--batch/--context: decode, one token per
    sequence attending to S keys; a step annotation's StepShapes: the step's tokens) into a
    position table's named operators, in place: the projections and lm_head as [B, K] x [K, N];
    attention as SDPA Q [B, n_q, 1, d] over K, V [B, n_kv, S, d] (not for StepShapes: the
    step's sums cost it, costs/shapes.py); the norms as engine RMSNorms over [B, H] (a fused
    residual add where the kernel's role says so, or where no `residual` kernel runs and the
    norm follows a sublayer's output); q/k norms over [B, heads, d]; RoPE over q [B, n_q·d],
    k [B, n_kv·d]; the KV-cache write of B tokens; the gated activation [B, 2I] -> [B, I];
    the embedding's B rows. For a model with experts the router's logits GEMM [B, H] x [H, E],
    the routed experts' gate_up and down as one grouped GEMM over the B·k routed rows
    ([B·k, H] x [E, H, 2I], [B·k, I] x [E, I, H], the weights at the experts' dtype (MXFP4):
    charged per expected active expert, shapes.py) and the shared expert's projections. Where
    the expert GEMMs hold batched_mm's weight gathers (`gathers`, per row), as HF's batched_mm
    runs them: each gather an `index` of the [E, 2I, H] (or [E, H, I]) weights, the GEMM a bmm
    over the B·k gathered copies ([B·k, 2I, H] x [B·k, H, 1]). A shared expert's sigmoid gate
    (H -> 1) is named `router` too: with `gemms` (per row, the GEMM its layout names there)
    each `router` instance takes the shape of its own GEMM, without them neither is given one.
    `roles` (per row, kernels.ROLES) tells a fused add+RMSNorm kernel and the experts'
    finalize kernel (moe_combine: the top-k outputs [B, k, H] summed into [B, H]). Other
    operators stay without shapes."""
    d = dtypes.lookup(model.dtype)
    if d is None:
        raise InputError(f"model {model.name}: unknown dtype {model.dtype!r}")
    ttype = next((sp for sp in d.spellings if sp.startswith("c10::")),
                 d.spellings[0] if d.spellings else d.name)
    b, e = shapes.batch, model.experts
    op = res["operator"].to_numpy(dtype=object)
    calls = [(op == name, call) for name, call in _dense_calls(model, shapes).items()]
    calls += _norm_calls(res, op, model, b, roles)
    if e is not None and roles is not None:  # the routed outputs' weighted sum (its kernel)
        finalize = (op == "moe_combine") & (np.asarray(roles, dtype=object) == "moe_finalize")
        calls.append((finalize, Call("_moe_C::moe_sum", [[b, e.top_k, model.hidden_size],
                                                         [b, model.hidden_size]])))
    if e is not None:
        moe_lin = model.moe_linears()
        batched = gathers is not None and gathers[np.isin(op, _EXPERT_GEMMS)].any()
        calls += _expert_calls(op, model, b, gathers if batched else None)
        router = op == "router"
        if not e.shared_gate:
            calls.append((router, _gemm_call(b, *moe_lin["router"])))
        elif gemms is not None:  # each router instance by the GEMM in it
            role = pd.Series(gemms, dtype=object).groupby(res["inst"].to_numpy()).transform(
                "first").to_numpy(dtype=object)
            calls += [(router & (role == name), _gemm_call(b, *moe_lin[name]))
                      for name in ("router", "shared_expert_gate")]
    for hit, call in calls:
        _write_call(res, hit, call, ttype)


def _dense_calls(model: ModelSpec, shapes: DecodeShapes) -> dict[str, Call]:
    """Operator -> its op over B tokens, for the operators every layer layout shares."""
    b, s, h = shapes.batch, shapes.context, model.hidden_size
    lin = {**model.linears(), **model.fused_linears(), "lm_head": (h, model.vocab_size, False)}
    if model.experts is not None:
        lin |= {k: v for k, v in model.moe_linears().items()
                if k.startswith("shared_") and k != "shared_expert_gate"}
    table = {name: _gemm_call(b, *kn) for name, kn in lin.items()}
    nq, nkv, hd = model.num_heads, model.num_kv_heads, model.head_dim
    if not isinstance(shapes, StepShapes):
        table["attention"] = Call("aten::scaled_dot_product_attention",
                                  [[b, nq, 1, hd], [b, nkv, s, hd], [b, nkv, s, hd]])
    if model.qk_norm:
        table["q_norm"] = Call("aten::rms_norm", [[b, nq, hd], [hd]])
        table["k_norm"] = Call("aten::rms_norm", [[b, nkv, hd], [hd]])
    rot = model.architecture.attention.rope_dim or hd
    table["rope"] = Call("_C::rotary_embedding",
                         [[b], [b, nq * hd], [b, nkv * hd], [], [b, rot], []],
                         ("long int", None, None, "Scalar", None, "Scalar"),
                         ("", "", "", str(hd), "", "True"))
    table["kv_cache"] = Call("_C_cache_ops::reshape_and_cache_flash",
                             [[b, nkv, hd], [b, nkv, hd], [1, nkv, hd], [1, nkv, hd], [b]],
                             (None, None, None, None, "long int"))
    table["embedding"] = Call("aten::embedding", [[model.vocab_size, h], [b]], (None, "long int"))
    mlp = model.architecture.mlp
    if mlp is not None and mlp.gated:
        i = mlp.intermediate_size
        table["act"] = Call("_C::gelu_and_mul" if "gelu" in mlp.activation else "_C::silu_and_mul",
                            [[b, i], [b, 2 * i]])
    return table


def _norm_calls(res: pd.DataFrame, op: np.ndarray, model: ModelSpec, b: int,
                roles: np.ndarray | None) -> list[tuple[np.ndarray, Call]]:
    """The layer and final norms as engine RMSNorms over [B, H]: a fused residual add where
    the kernel's role is fused_add_norm, or where no `residual` kernel runs and the norm
    follows a sublayer's output (post-attention, post-MLP, a later layer's input, final);
    never the first layer's input norm (no residual yet: SGLang runs add_rmsnorm_quant's
    no-add variant there)."""
    h = model.hidden_size
    norm = np.isin(op, _NORMS)
    layer = res["layer"].astype("Int64").to_numpy(np.float64, na_value=np.nan)
    fused_role = (np.asarray(roles, dtype=object) == "fused_add_norm") if roles is not None \
        else np.zeros(len(op), dtype=bool)
    after_output = np.isin(op, _AFTER_OUTPUT) | ((op == "input_norm") & (layer > 0))
    no_residual = not (op == "residual").any()
    first = (op == "input_norm") & (layer == 0)  # nothing to add to yet
    fused = norm & ~first & (fused_role | (after_output & no_residual))
    return [(fused, Call("_C::fused_add_rms_norm", [[b, h], [b, h], [h]])),
            (norm & ~fused, Call("_C::rms_norm", [[b, h], [b, h], [h]]))]


def _gemm_call(b: int, k: int, n: int, bias: bool, weight: str | None = None) -> Call:
    """A linear's op over B rows: addmm with its bias, else mm (`weight`: its Input type)."""
    if bias:
        return Call("aten::addmm", [[n], [b, k], [k, n]], (None, None, weight))
    return Call("aten::mm", [[b, k], [k, n]], (None, weight))


def _expert_calls(op: np.ndarray, model: ModelSpec, b: int, gathers: np.ndarray | None
                  ) -> list[tuple[np.ndarray, Call]]:
    """The routed experts' ops over the B·k routed rows (user_shapes): one grouped GEMM each,
    its weights at the experts' dtype, or with batched_mm's weight `gathers` an index of the
    weights and a bmm."""
    e, h = model.experts, model.hidden_size
    assert e is not None  # (expert operators come from a model with experts)
    rows, i, ne = moe.routed_rows(b, e.top_k), e.intermediate_size, e.num_experts
    weights = model.architecture.precision.expert_weights
    w = weights if dtypes.lookup(weights) is not None else None
    up, down = op == "experts_gate_up", op == "experts_down"
    if gathers is None:
        return [(up, Call("aten::_grouped_mm", [[rows, h], [ne, h, 2 * i], [ne]],
                          (None, w, "int"))),
                (down, Call("aten::_grouped_mm", [[rows, i], [ne, i, h], [ne]],
                            (None, w, "int")))]
    return [(up & ~gathers, Call("aten::bmm", [[rows, 2 * i, h], [rows, h, 1]])),
            (down & ~gathers, Call("aten::bmm", [[rows, h, i], [rows, i, 1]])),
            (up & gathers, Call("aten::index", [[ne, 2 * i, h], []])),
            (down & gathers, Call("aten::index", [[ne, h, i], []]))]


def _write_call(res: pd.DataFrame, hit: np.ndarray, call: Call, ttype: str) -> None:
    """Give the rows `hit` of a position table the op `call` (its types defaulting to ttype)."""
    if hit.any():
        types = [t or ttype for t in (call.types or (None,) * len(call.dims))]
        res.loc[hit, "op_name"] = call.op
        res.loc[hit, "input_dims"] = str(call.dims)
        res.loc[hit, "input_types"] = str(types).replace("'", '"')
        res.loc[hit, "concrete_inputs"] = (str(list(call.concrete)).replace("'", '"')
                                           if call.concrete else None)
        res.loc[hit, "input_strides"] = None


# ----------------------------------------------------------------------------------------------
# Writing back
# ----------------------------------------------------------------------------------------------
def _write(att: pd.DataFrame, rr: pd.DataFrame, graph: np.ndarray,
           results: list[pd.DataFrame]) -> pd.DataFrame:
    """Broadcast each graph's position table to its replays and overwrite those rows."""
    sizes = np.array([len(r) for r in results], dtype=np.int64)
    goff = np.r_[0, np.cumsum(sizes)[:-1]]
    pos_table = pd.concat(results, ignore_index=True)
    at = goff[graph] + rr["pos"].to_numpy()
    rows = rr["row"].to_numpy()
    out = att.copy()
    # a name outside the vocabulary (other, linear[K×N]) rests on no evidence, as attribute says
    vocab = pos_table["operator"].isin(operators.NAMES).to_numpy()
    pos_table["evidence"] = np.where(vocab, pos_table["evidence"], operators.FALLBACK)
    for c in (*CARRIED, "evidence"):
        out[c] = _overwrite(att[c], rows, pos_table[c].to_numpy(dtype=object), at)
    layer = out["layer"].astype("Int64").array.copy()
    layer[rows] = pos_table["layer"].astype("Int64").array.take(at)
    out["layer"] = layer
    # one op instance per (replay, template instance), numbered after the trace's own; an
    # unnamed kernel is one of its own. No cpu op launched a replayed kernel: op_id stays NA.
    inst = pos_table["inst"].to_numpy()[at]
    k = int(pos_table["inst"].max()) + 1 if len(pos_table) else 0
    base = int(att["instance"].max()) + 1 if len(att) else 0
    replay = rr["replay"].to_numpy()
    alone = base + (int(replay.max()) + 1) * k + np.cumsum(inst < 0) - 1
    instance = att["instance"].to_numpy(np.int64).copy()
    instance[rows] = np.where(inst >= 0, base + replay * k + inst, alone)
    out["instance"] = instance
    op_id = out["op_id"].astype("Int64").array.copy()
    op_id[rows] = pd.NA
    out["op_id"] = op_id
    return out, pos_table["how"].to_numpy(dtype=object)[at]


def _overwrite(col: pd.Series, rows: np.ndarray, values: np.ndarray, at: np.ndarray):
    """A str column with values[at] (object, None = missing) at `rows` (arrow take and
    replace_with_mask: no per-row Python, no categorical of the whole column)."""
    order = np.argsort(rows, kind="stable")
    mask = np.zeros(len(col), dtype=bool)
    mask[rows] = True
    old = pa.array(col.array, type=pa.large_string())
    if isinstance(old, pa.ChunkedArray):
        old = old.combine_chunks()
    new = pc.take(pa.array(values, type=pa.large_string()), pa.array(at[order]))
    return pd.array(pc.replace_with_mask(old, pa.array(mask), new), dtype="str")


def _report(out, rr, graph, how, per_graph, flags, by_step) -> GraphReport:
    """Totals and the per-graph table (GRAPH_COLUMNS); `by_step`: rows costed from their step
    annotation's sums."""
    rows = rr["row"].to_numpy()
    dur = out["dur_us"].to_numpy(np.float64)[rows]
    named = how != "none"
    t = pd.DataFrame(per_graph)
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
        costed_time_us=float(dur[(out["input_dims"].notna().to_numpy()[rows] | by_step)
                                 & named].sum()),
        flags=tuple(dict.fromkeys(flags)), graphs=t[list(GRAPH_COLUMNS)].astype(GRAPH_COLUMNS),
    )
