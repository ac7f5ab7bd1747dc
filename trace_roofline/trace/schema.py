"""The output of stage 1: one typed table per event family, the `Trace` holding them, and the
assembly of decoded columns into those tables (`build_tables`).

Design notes: docs/design.md ("trace_roofline/trace/schema.py").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

DEVICE_COLUMNS = {
    "event_id": "int64",
    "name": "category",
    "kind": "category",  # kernel | memcpy | memset
    "pid": "Int64",
    "device": "int64",  # args.device, else pid, else -1
    "stream": "int64",  # args.stream, else tid, else -1
    "ts_us": "float64",
    "dur_us": "float64",
    "correlation": "Int64",
    "external_id": "Int64",
    "grid": "category",  # raw JSON text, e.g. "[132, 1, 1]"
    "block": "category",
}
CPU_OP_COLUMNS = {
    "op_id": "int64",
    "name": "category",
    "pid": "Int64",
    "tid": "Int64",
    "ts_us": "float64",
    "dur_us": "float64",
    "external_id": "Int64",
    "input_dims": "category",  # raw JSON text, e.g. "[[1, 3584], [18944, 3584]]"
    "input_types": "category",  # raw JSON text, e.g. "[\"c10::BFloat16\", \"c10::BFloat16\"]"
    "concrete_inputs": "category",  # raw JSON text
    "input_strides": "category",  # raw JSON text, e.g. "[[3584, 1], [1, 3584]]"
}
RUNTIME_COLUMNS = {
    "event_id": "int64",
    "name": "category",
    "pid": "Int64",
    "tid": "Int64",
    "ts_us": "float64",
    "dur_us": "float64",
    "correlation": "Int64",
    "external_id": "Int64",
}
ANNOTATION_COLUMNS = {
    "event_id": "int64",
    "name": "category",
    "cat": "category",  # user_annotation | gpu_user_annotation | cpu_op (old ProfilerStep#N)
    "pid": "Int64",
    "tid": "Int64",
    "ts_us": "float64",
    "dur_us": "float64",
    "external_id": "Int64",
}
PYTHON_FRAME_COLUMNS = {
    "event_id": "int64",
    "name": "category",
    "pid": "Int64",
    "tid": "Int64",
    "ts_us": "float64",
    "dur_us": "float64",
    "python_id": "Int64",
    "parent_id": "Int64",
}
FLOW_COLUMNS = {
    "event_id": "int64",
    "id": "Int64",
    "ph": "category",  # s | f
    "cat": "category",
    "pid": "Int64",
    "tid": "Int64",
    "ts_us": "float64",
}
SCHEMAS = {
    "device": DEVICE_COLUMNS,
    "cpu_ops": CPU_OP_COLUMNS,
    "runtime": RUNTIME_COLUMNS,
    "annotations": ANNOTATION_COLUMNS,
    "python_frames": PYTHON_FRAME_COLUMNS,
    "flows": FLOW_COLUMNS,
}

MAX_DUR_US = 86_400e6  # a duration longer than a day is corrupt, not a real event
# |ts| beyond this does not fit int64 nanoseconds (epoch µs of the year 2255): corrupt.
MAX_TS_US = 9e15
MISSING = -(2**63)  # an absent or unusable integer field, before it becomes <NA>
_KINDS = ["kernel", "memcpy", "memset"]  # device.kind, in the order of their codes
FLOW_PH = ["s", "f"]  # flows.ph, in the order of their codes
# meta["skipped_events"]: why single events were dropped (short key -> the reason reported)
SKIP_REASONS = {
    "type": "fields of the wrong type",
    "phase": "device/cpu category with a phase other than X",
    "missing": "complete event without ts or dur",
    "negative": "negative duration",
    "huge": "duration longer than a day",
    "far": "timestamp beyond int64 nanoseconds",
    "flow": "flow event without ts",
}

Progress = Callable[[str, int, int], None]  # (stage, done, total); stage "read" | "parse"


@dataclass(frozen=True, eq=False)
class Trace:
    """One profiler trace as typed tables (SCHEMAS) plus top-level metadata."""

    path: str
    meta: dict
    device: pd.DataFrame
    cpu_ops: pd.DataFrame
    runtime: pd.DataFrame
    annotations: pd.DataFrame
    python_frames: pd.DataFrame
    flows: pd.DataFrame

    @property
    def cpu_only(self) -> bool:
        """True when the trace has no device activity: its cpu ops are the timed units."""
        return self.device.empty


def _int64(values: np.ndarray) -> pd.arrays.IntegerArray:
    return pd.arrays.IntegerArray(values, values == MISSING)


def build_tables(cols: dict[str, dict]) -> dict[str, pd.DataFrame]:
    """Column arrays (per table: column -> array; ints use MISSING, `kind` holds codes into
    _KINDS) -> DataFrames in the declared schemas, ProfilerStep#N cpu ops moved to annotations."""
    out = {}
    for table, schema in SCHEMAS.items():
        c = cols[table]
        if not c:
            out[table] = pd.DataFrame({k: pd.Series(dtype=v) for k, v in schema.items()})
            continue
        if table == "device":
            c["kind"] = pd.Categorical.from_codes(c["kind"], categories=_KINDS)
            for k in ("device", "stream"):
                c[k] = np.where(c[k] == MISSING, -1, c[k])
        if table == "cpu_ops":
            c["op_id"] = c.pop("event_id")
        data = {}
        for col, dtype in schema.items():
            v = c[col]
            data[col] = _int64(v) if dtype == "Int64" else v
        out[table] = pd.DataFrame(data, copy=False)  # the arrays are ours: no copies
    return _move_profiler_steps(out)


def _move_profiler_steps(t: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    """Older PyTorch wrote ProfilerStep#N as cpu_op: they are step annotations."""
    ops = t["cpu_ops"]
    if ops.empty:
        return t
    names = ops["name"].cat.categories
    steps = ops["name"].cat.codes.isin(np.flatnonzero(names.str.startswith("ProfilerStep#")))
    if not steps.any():
        return t
    moved = ops[steps].rename(columns={"op_id": "event_id"}).assign(cat="cpu_op")
    ann = pd.concat([t["annotations"], moved[list(ANNOTATION_COLUMNS)]], ignore_index=True)
    ann = ann.sort_values("event_id", kind="stable", ignore_index=True)
    for col in ("name", "cat"):
        ann[col] = ann[col].astype(str).astype("category")
    t["annotations"] = ann.astype(ANNOTATION_COLUMNS)
    rest = ops[~steps].reset_index(drop=True)
    rest["name"] = rest["name"].cat.remove_unused_categories()
    t["cpu_ops"] = rest
    return t
