"""Templates of a replayed step: the eager forward passes of a mapping trace and the graph
captures a trace recorded, their kernels attributed as an eager step's would be.

Design notes: docs/design.md ("trace_roofline/attribution/graphs.py").
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from trace_roofline.attribution.attribute import attribute
from trace_roofline.attribution.passes import forward_passes
from trace_roofline.attribution.replays import matches, replay_rows, sequence_keys
from trace_roofline.errors import InputError
from trace_roofline.model.models import ModelSpec
from trace_roofline.trace import Trace

CARRIED = ("operator", "op_name", "input_dims", "input_types", "concrete_inputs",
           "input_strides")


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
    key = sequence_keys(names.codes.astype(np.int64), seq_pass)
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
    is_begin = matches(rt["name"], _CAPTURE_BEGIN)
    if not is_begin.any():
        return None
    name = rt["name"].astype(object).fillna("")
    thread = pd.factorize(pd.MultiIndex.from_arrays([rt["pid"].fillna(-1), rt["tid"].fillna(-1)]))[0]
    ts = rt["ts_us"].to_numpy(np.float64)
    begin = np.flatnonzero(is_begin)
    end = np.flatnonzero(matches(rt["name"], _CAPTURE_END))
    ran = set(trace.device["correlation"].dropna().astype("int64").tolist())
    corr = rt["correlation"].astype("Int64").to_numpy(np.int64, na_value=-1)
    launch = matches(rt["name"], _LAUNCH) & ~np.isin(corr, list(ran)) & (corr >= 0)
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
    kind = np.where(matches(pd.Series(launch_name), _MEMSET), "memset",
                    np.where(matches(pd.Series(launch_name), _MEMCPY), "memcpy", "kernel"))
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
