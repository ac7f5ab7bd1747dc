"""The timed units of a trace (device rows, or a CPU-only trace's top-level ops), each with its
launch point (thread key, ns), launching op and the op instance it belongs to.

Design notes: docs/design.md ("trace_roofline/attribution/attribute.py").
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from trace_roofline.attribution.codes import (
    categorical,
    const,
    ints,
    lookup,
    take,
)
from trace_roofline.attribution.nest import KeySpace, Nest, to_ns
from trace_roofline.model import operators
from trace_roofline.trace import Trace

# cpu ops that only wrap others (torch.compile, autograd, CUDA graphs): never units or top ops
_WRAPPER_RE = re.compile(r"^(?:Torch-Compiled Region|TorchDynamo|CompiledFunction|Pregraph bytecode|"
                         r"AOTDispatcher|## |cudaGraph|autograd::engine|Optimizer\.|"
                         r"\w+Backward\d*$|torch::autograd::AccumulateGrad$)")
_DIGIT = re.compile(r"\d")


def matches(rx: re.Pattern, values: pd.Series) -> np.ndarray:
    """Per value (a string Series, missing: no match), whether `rx` matches in it: Python's
    regex on the few distinct values, where pandas would parse the pattern again each call."""
    return np.fromiter((isinstance(v, str) and rx.search(v) is not None for v in values),
                       dtype=bool, count=len(values))


def ops_frame(cpu_ops: pd.DataFrame, keys: KeySpace) -> pd.DataFrame:
    """cpu ops with ns bounds, thread key and per-op flags."""
    ops = cpu_ops.reset_index(drop=True)  # a new frame (copy-on-write): cpu_ops stays as is
    s = to_ns(ops["ts_us"])
    names = categorical(ops["name"])
    distinct = pd.Series(names.categories.astype(str))
    base = operators.base_names(distinct)

    def per_name(flags: object) -> np.ndarray:
        return np.append(np.asarray(flags, dtype=bool), False)[names.codes]

    dims = categorical(ops["input_dims"])
    shaped = matches(_DIGIT, pd.Series(dims.categories.astype(str)))
    return ops.assign(
        s=s, e=s + to_ns(ops["dur_us"]), key=keys.codes(ops["pid"], ops["tid"]),
        wrapper=per_name(matches(_WRAPPER_RE, distinct)),
        attn=per_name(operators.recognise(operators.ATTENTION, base)),
        dispatch=per_name(distinct.isin(operators.ATTENTION_DISPATCH)),
        shaped=np.append(shaped, False)[dims.codes])


def cpu_units(ops: pd.DataFrame) -> pd.DataFrame:
    """CPU-only trace: the top-level (outermost non-wrapper) cpu ops are the timed units."""
    key = np.where(ops["wrapper"].to_numpy(), -1, ops["key"].to_numpy())
    top = np.flatnonzero(Nest(ops["s"].to_numpy(), ops["e"].to_numpy(), key).depth == 0)
    u = ops.iloc[top]
    return pd.DataFrame({
        "event_id": u["op_id"].to_numpy(np.int64), "name": categorical(u["name"]),
        "kind": const("cpu_op", len(u)),
        "stream": pd.arrays.IntegerArray(np.zeros(len(u), np.int64), np.ones(len(u), bool)),
        "ts_us": u["ts_us"].to_numpy(), "dur_us": u["dur_us"].to_numpy(),
        "op_idx": top, "top_idx": top, "t": u["s"].to_numpy(), "key": u["key"].to_numpy(),
    })


def _launch_points(trace: Trace, corr: np.ndarray, keys: KeySpace
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per device row: its runtime launch's row (-1: none), whether a launch or flow start
    links it, and the (thread key, ns) of that launch point: the (first) runtime launch of its
    correlation id, else the (first) flow start event with that id."""
    rt, fl = trace.runtime, trace.flows
    rt_corr = rt["correlation"]
    ri = lookup(ints(rt_corr, 0), rt_corr.notna().to_numpy(), corr, unique=False)
    fl_start = (fl["ph"] == "s").to_numpy(dtype=bool) & fl["id"].notna().to_numpy()
    fi = np.where(ri >= 0, -1, lookup(ints(fl["id"], 0), fl_start, corr, unique=False))
    by_rt = ri >= 0
    rows = np.where(by_rt, ri, fi)
    pt_key = np.full(len(corr), -1, dtype=np.int64)
    pt_t = np.zeros(len(corr), dtype=np.int64)
    for table, hit in ((rt, by_rt), (fl, fi >= 0)):
        at = rows[hit]
        if len(at):
            pid, tid = (table[c].array.take(at) for c in ("pid", "tid"))
            pt_key[hit] = keys.codes(pid, tid)
            pt_t[hit] = to_ns(table["ts_us"].to_numpy(np.float64)[at])
    return ri, by_rt | (fi >= 0), pt_key, pt_t


def device_units(trace: Trace, ops: pd.DataFrame, keys: KeySpace) -> pd.DataFrame:
    """Device rows with their launch point (thread key, ns), launching op and op instance."""
    dev = trace.device.reset_index(drop=True)
    corr = ints(dev["correlation"], -1)
    ri, has_pt, pt_key, pt_t = _launch_points(trace, corr, keys)
    # External id of the kernel (else of its runtime launch) -> the launching cpu op, when one
    # op alone carries it
    ext = ints(dev["external_id"], -1)
    ext = np.where(ext > 0, ext, take(ints(trace.runtime["external_id"], -1), ri, -1))
    op_ext = ints(ops["external_id"], -1)
    launch = np.where(ext > 0, lookup(op_ext, op_ext > 0, ext, unique=True), -1)
    s, e, k = ops["s"].to_numpy(), ops["e"].to_numpy(), ops["key"].to_numpy()
    nest = Nest(s, e, k)
    by_time = np.flatnonzero((launch < 0) & has_pt)
    launch[by_time] = nest.innermost(pt_t[by_time], pt_key[by_time])
    # the launch point: the runtime call when it lies inside the launching op, else the op start
    linked = launch >= 0
    ls, le, lk = take(s, launch, 0), take(e, launch, 0), take(k, launch, -1)
    inside = has_pt & linked & (pt_key == lk) & (pt_t >= ls) & (pt_t < le)
    t = np.where(inside, pt_t, np.where(linked, ls, pt_t))
    key = np.where(linked, lk, np.where(has_pt, pt_key, -1))
    inner = nest.innermost(t, key)  # the ops around t: this one and its ancestors
    op_idx = _instance_op(ops, nest, inner, launch)
    top = nest.enclosing(~ops["wrapper"].to_numpy(), inner, outermost=True)
    ts_ns = to_ns(dev["ts_us"])
    return pd.DataFrame({
        "event_id": dev["event_id"].to_numpy(np.int64), "name": categorical(dev["name"]),
        "kind": categorical(dev["kind"]), "stream": dev["stream"], "ts_us": dev["ts_us"],
        "dur_us": dev["dur_us"], "op_idx": op_idx,
        "top_idx": np.where(top >= 0, top, op_idx), "t": t, "key": key,
        "dev_pid": dev["pid"], "dev_stream": dev["stream"], "ts_ns": ts_ns,
        "early": _before_window(dev, ts_ns, corr, has_pt, trace.runtime),
    })


def _before_window(dev: pd.DataFrame, start: np.ndarray, corr: np.ndarray, has_pt: np.ndarray,
                   rt: pd.DataFrame) -> np.ndarray:
    """Device rows launched before the profiled window (a profiler schedule's previous step):
    no launch in the file, a correlation id below every runtime launch's, and done before the
    first kernel that a launch links (operators.BEFORE_WINDOW). `start`: their ns starts."""
    linked_rt = rt["correlation"].notna().to_numpy()
    if not has_pt.any() or not linked_rt.any():
        return np.zeros(len(dev), dtype=bool)
    first_corr = int(ints(rt["correlation"], 0)[linked_rt].min())
    end = start + to_ns(dev["dur_us"])
    first_linked = int(start[has_pt].min())
    return ~has_pt & (corr >= 0) & (corr < first_corr) & (end <= first_linked)


def _instance_op(ops: pd.DataFrame, nest: Nest, inner: np.ndarray,
                 launch: np.ndarray) -> np.ndarray:
    """The outermost attention op around the launch point (SDPA and everything it launches,
    mask preparation, a math fallback's bmm/softmax, are one instance), else the innermost
    shape-carrying op, else the launching op itself; -1 for unlinked units. An engine's
    dispatching attention op (operators.ATTENTION_DISPATCH, which records no key lengths) does
    not gather the ops inside it: the flash-attention forward it runs (whose arguments say the
    sequences' lengths) and an older vLLM's cache write in it are instances of their own.
    `inner`: the innermost op around each unit's launch point (-1: none)."""
    out = launch.copy()
    attention = ops["attn"].to_numpy() & ~ops["dispatch"].to_numpy()
    for m, outermost in ((ops["shaped"].to_numpy(), False), (attention, True)):  # later wins
        hit = nest.enclosing(m, inner, outermost)
        out = np.where(hit >= 0, hit, out)
    return np.where(launch >= 0, out, -1)

