"""Stage 1: read a torch.profiler (Kineto) Chrome trace into typed pandas tables.

`load_trace(path)` reads a `.json`, a `.json.gz` (gzip is sniffed from the magic bytes, not the
name) or a directory holding one `tensorboard_trace_handler` file (`*.pt.trace.json[.gz]`);
`load_traces(dir)` returns one `Trace` per file. Inputs are only ever opened for reading.

How it stays fast on GB traces (figures in benchmarks/README.md): msgspec cuts `traceEvents`
into zero-copy `Raw` slices, then decodes them in batches into GC-free Structs that carry only
the fields below (everything else in an event is skipped by the C decoder). Each batch is turned
into columns at once with C-level `map`/`attrgetter`/`np.fromiter`; strings become categorical
codes and the structs are freed before the next batch, so memory stays near the file size.
Shape arrays (`Input Dims`, `Input type`, `Input Strides`, `Concrete Inputs`) stay raw JSON
text; decode them lazily, for the rows that need them, with `parse_dims`.
Files of PARALLEL_MIN_BYTES or more use a second core (msgspec holds the GIL, so a forked
process): the worker reads, splits and decodes the later half of the file while the parent
does the first half, and pipes its columns back; the result, and any error, is exactly the
one-process result (how, and why it is safe, at `_Worker`).

Schema variants handled (Kineto's ChromeTraceLogger, old and new, and HTA's test traces):
- categories: kernel/Kernel, gpu_memcpy/Memcpy, gpu_memset/Memset, cpu_op/Operator,
  cuda_runtime/cuda_driver/Runtime/any `*_runtime` or `*_driver` (hip, xpu, privateuse1),
  user_annotation/gpu_user_annotation, python_function; flows ac2g, async_cpu_to_gpu,
  async_gpu and the 2020 `async` launch flows. Matching is case-insensitive.
- `External id` or the 2020 spelling `external id`; `Input Dims` or `Input dims`; any of them
  missing; `args` missing; pid/tid as strings ("stream 7", "Spans": non-numeric labels become
  <NA>, device rows keep their `device`/`stream` from args); ts/dur as ints or floats;
  `deviceProperties` absent; a top-level JSON array of events (Chrome's "JSON Array Format").
- `cpu_op` ranges named `ProfilerStep#N` (older PyTorch) are moved to `annotations`.
- CPU-only traces (no device rows) are valid: their cpu ops are the timed units (`cpu_only`).

Bad input (policy, see tests/test_robustness.py): anything that makes the file unreadable as a
whole raises `InputError("<file>: <problem>")` -- missing file, empty directory, truncated or
malformed JSON, corrupt gzip, invalid UTF-8 in a field we read, nesting too deep, wrong
top-level type, `traceEvents` missing or not a list, and a trace with no kernels and no cpu ops.
Single bad events are skipped and counted in `meta["skipped_events"]` (reason -> count): ph,
cat, name, ts or dur of the wrong type (or a number out of float range), a complete ('X') event
without ts/dur, a negative or longer-than-a-day duration, a device/cpu category with a phase
other than 'X', a flow without ts. Timing is never dropped for a bad link: an event whose args,
pid, tid or id are malformed keeps its timing, those fields become <NA>, and it is counted in
`meta["events_with_dropped_fields"]`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import re
import signal
import sys
import threading
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import compress, count, repeat
from operator import attrgetter
from pathlib import Path
from typing import Annotated, Any

import msgspec
import numpy as np
import pandas as pd

from trace_roofline.errors import InputError

# ----------------------------------------------------------------------------------------------
# Output schema: one table per event family. Times are float µs exactly as in the file.
# "category" columns hold str (or NaN when absent); raw-JSON columns hold the JSON text.
# event_id / op_id = index of the event in traceEvents (file order); rows are in file order.
# ----------------------------------------------------------------------------------------------
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
BATCH_EVENTS = 4096  # events per batch: bounds live Python objects, keeps them in cache
PROGRESS_MIN_BYTES = 64 << 20  # progress_bar() stays silent below this file size
PARALLEL_MIN_BYTES = 64 << 20  # from this much JSON on, a forked worker decodes part of it
PARALLEL_SHARE = 0.5  # the parent's share of the events when it forks a worker

Progress = Callable[[str, int, int], None]  # (stage, done, total); stage "read" | "parse"


@dataclass(frozen=True, eq=False)
class Trace:
    """One profiler trace as typed tables (schemas above) plus top-level metadata."""

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


# ----------------------------------------------------------------------------------------------
# Decoding: typed structs holding only the fields we use. Missing ints decode to _MISSING.
# ----------------------------------------------------------------------------------------------
_MISSING = -(2**63)
_I64 = Annotated[int, msgspec.Meta(ge=_MISSING + 1, le=2**63 - 1)]
_NO_RAW = msgspec.Raw()


def _f(name: str) -> Any:
    return msgspec.field(default=_MISSING, name=name)


def _raw(name: str) -> Any:
    return msgspec.field(default=_NO_RAW, name=name)


class _Args(msgspec.Struct, frozen=True, gc=False):
    external_id: _I64 = _f("External id")
    external_id_legacy: _I64 = _f("external id")
    correlation: _I64 = _MISSING
    device: _I64 = _MISSING
    stream: _I64 | str = _MISSING  # ROCm runtime events write "0x0"
    grid: msgspec.Raw = _NO_RAW
    block: msgspec.Raw = _NO_RAW
    input_dims: msgspec.Raw = _raw("Input Dims")
    input_dims_legacy: msgspec.Raw = _raw("Input dims")
    input_types: msgspec.Raw = _raw("Input type")
    concrete_inputs: msgspec.Raw = _raw("Concrete Inputs")
    input_strides: msgspec.Raw = _raw("Input Strides")
    python_id: _I64 | None = _f("Python id")
    python_parent_id: _I64 | None = _f("Python parent id")


_NO_ARGS = _Args()


class _Event(msgspec.Struct, gc=False):
    ph: str | None = None
    cat: str | None = None
    name: str | None = None
    pid: _I64 | str | None = None
    tid: _I64 | str | None = None
    ts: float = math.nan
    dur: float = math.nan
    id: _I64 | str | None = None
    args: _Args = _NO_ARGS


class _EventLenient(msgspec.Struct, gc=False):
    """Retry shape for an event with malformed args or ids: keep its timing, drop its links.

    Only what defines the event (ph, cat, name, ts, dur) must be well typed; pid/tid/id that
    are not integers end up <NA>.
    """

    ph: str | None = None
    cat: str | None = None
    name: str | None = None
    pid: Any = None
    tid: Any = None
    ts: float = math.nan
    dur: float = math.nan
    id: Any = None


class _Top(msgspec.Struct, gc=False):
    traceEvents: list[msgspec.Raw] | None = None  # the JSON key


_TOP_EVENTS = msgspec.json.Decoder(_Top)
_TOP = msgspec.json.Decoder(dict[str, msgspec.Raw])
_RAW_LIST = msgspec.json.Decoder(list[msgspec.Raw])
_BATCH = msgspec.json.Decoder(list[_Event])
_ONE = msgspec.json.Decoder(_Event)
_ONE_LENIENT = msgspec.json.Decoder(_EventLenient)

# Table codes. Device kinds first so that kind = code - 1.
_KERNEL, _MEMCPY, _MEMSET, _CPU_OP, _RUNTIME, _ANNOT, _PYFRAME, _FLOW = range(1, 9)
_KINDS = ["kernel", "memcpy", "memset"]
_CAT_CODES = {
    "kernel": _KERNEL,
    "gpu_memcpy": _MEMCPY,
    "memcpy": _MEMCPY,
    "gpu_memset": _MEMSET,
    "memset": _MEMSET,
    "cpu_op": _CPU_OP,
    "operator": _CPU_OP,
    "runtime": _RUNTIME,
    "user_annotation": _ANNOT,
    "gpu_user_annotation": _ANNOT,
    "python_function": _PYFRAME,
    "ac2g": _FLOW,
    "async_cpu_to_gpu": _FLOW,
    "async_gpu": _FLOW,
    "async": _FLOW,
}


class _CatTable(dict):
    """cat string -> table code, classifying each new spelling once."""

    def __missing__(self, cat: Any) -> int:
        code = 0
        if isinstance(cat, str):
            low = cat.lower()
            code = _CAT_CODES.get(low, 0)
            if not code and low.endswith(("_runtime", "_driver")):
                code = _RUNTIME
        self[cat] = code
        return code


_PH_CODES = {"X": 1, "s": 2, "f": 3}  # flows: ph code - 2 indexes _FLOW_PH
_FLOW_PH = ["s", "f"]

# Per table: output column -> (attribute paths on _Event, converter). A second path fills the rows
# where the first is absent (legacy spelling, or pid/tid standing in for device/stream).
# Converters: int (Int64), str (categorical), raw (JSON text, categorical), cat/ph (reuse the
# values already read to classify the event). ts/dur are shared by every table.
_EXT = ("args.external_id", "args.external_id_legacy")
_FIELDS: dict[str, dict[str, tuple[tuple[str, ...], str]]] = {
    "device": {
        "name": (("name",), "str"),
        "pid": (("pid",), "int"),
        "device": (("args.device", "pid"), "int"),
        "stream": (("args.stream", "tid"), "int"),
        "correlation": (("args.correlation",), "int"),
        "external_id": (_EXT, "int"),
        "grid": (("args.grid",), "raw"),
        "block": (("args.block",), "raw"),
    },
    "cpu_ops": {
        "name": (("name",), "str"),
        "pid": (("pid",), "int"),
        "tid": (("tid",), "int"),
        "external_id": (_EXT, "int"),
        "input_dims": (("args.input_dims", "args.input_dims_legacy"), "raw"),
        "input_types": (("args.input_types",), "raw"),
        "concrete_inputs": (("args.concrete_inputs",), "raw"),
        "input_strides": (("args.input_strides",), "raw"),
    },
    "runtime": {
        "name": (("name",), "str"),
        "pid": (("pid",), "int"),
        "tid": (("tid",), "int"),
        "correlation": (("args.correlation",), "int"),
        "external_id": (_EXT, "int"),
    },
    "annotations": {
        "name": (("name",), "str"),
        "cat": (("cat",), "cat"),
        "pid": (("pid",), "int"),
        "tid": (("tid",), "int"),
        "external_id": (_EXT, "int"),
    },
    "python_frames": {
        "name": (("name",), "str"),
        "pid": (("pid",), "int"),
        "tid": (("tid",), "int"),
        "python_id": (("args.python_id",), "int"),
        "parent_id": (("args.python_parent_id",), "int"),
    },
    "flows": {
        "id": (("id",), "int"),
        "ph": (("ph",), "ph"),
        "cat": (("cat",), "cat"),
        "pid": (("pid",), "int"),
        "tid": (("tid",), "int"),
    },
}
_TABLE_CODES = {
    "device": (_KERNEL, _MEMCPY, _MEMSET),
    "cpu_ops": (_CPU_OP,),
    "runtime": (_RUNTIME,),
    "annotations": (_ANNOT,),
    "python_frames": (_PYFRAME,),
    "flows": (_FLOW,),
}


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def load_trace(path: str | os.PathLike, progress: Progress | None = None) -> Trace:
    """Load one trace file, or the single trace file of a tensorboard_trace_handler directory.

    `progress(stage, done, total)` is called while reading (bytes) and parsing (events); pass
    `progress_bar()` for a terminal bar. Raises InputError (one line naming the file).
    """
    p = Path(path)
    if p.is_dir():
        files = _trace_files(p)
        if len(files) > 1:
            raise InputError(
                f"{p}: directory holds {len(files)} traces; pass one file or use load_traces()"
            )
        p = files[0]
    return _load_file(p, progress)


def _load_file(p: Path, progress: Progress | None) -> Trace:
    try:
        return _parse_file(p, progress)
    except MemoryError:
        raise InputError(f"{p}: not enough memory to load this trace") from None


def load_traces(path: str | os.PathLike, progress: Progress | None = None) -> list[Trace]:
    """Load every trace in a directory (sorted by name), or the one file `path` names."""
    p = Path(path)
    files = _trace_files(p) if p.is_dir() else [p]
    return [_load_file(f, progress) for f in files]


def parse_dims(series: pd.Series) -> list:
    """Decode a raw-JSON column (input_dims, input_types, concrete_inputs) for the given rows.

    Returns a list aligned with `series`: the decoded value (e.g. [[1, 3584], [18944, 3584]]),
    or None where the text is missing or not valid JSON. Each distinct text is decoded once.
    """
    values = series.astype("category")
    decoded = [_decode_json(text) for text in values.cat.categories]
    lookup = np.empty(len(decoded) + 1, dtype=object)
    lookup[:-1] = decoded
    lookup[-1] = None
    return lookup[values.cat.codes.to_numpy()].tolist()


def progress_bar(stream=None, min_bytes: int = PROGRESS_MIN_BYTES) -> Progress | None:
    """A `progress` callback drawing a one-line bar on `stream` (stderr), or None if not a TTY.

    Files smaller than `min_bytes` draw nothing. Only the CLI should create one.
    """
    out = stream if stream is not None else sys.stderr
    if not (hasattr(out, "isatty") and out.isatty()):
        return None
    state = {"big": False, "last": None}

    def draw(stage: str, done: int, total: int) -> None:
        if stage == "read" and done == 0:
            state["big"] = total >= min_bytes
        if not state["big"] or total <= 0:
            return
        frac = min(done / total, 1.0)
        if (stage, int(1000 * frac)) == state["last"]:
            return  # redraw at most once per 0.1%
        state["last"] = (stage, int(1000 * frac))
        bar = "#" * int(30 * frac)
        out.write(f"\r{stage:5s} [{bar:<30s}] {100 * frac:5.1f}%")
        if stage == "parse" and done >= total:
            out.write("\n")
        out.flush()

    return draw


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------
def _trace_files(d: Path) -> list[Path]:
    files = sorted(d.glob("*.pt.trace.json")) + sorted(d.glob("*.pt.trace.json.gz"))
    if not files:  # not the tensorboard layout: any JSON trace in the directory
        files = sorted(d.glob("*.json")) + sorted(d.glob("*.json.gz"))
    files = [f for f in files if f.is_file()]
    if not files:
        raise InputError(f"{d}: directory holds no trace files (*.pt.trace.json[.gz], *.json)")
    return sorted(files)


def _read(p: Path, progress: Progress | None, fork: bool = False
          ) -> tuple[bytearray, _Worker | None]:
    """The file's bytes, gunzipped when it starts with the gzip magic number, and a worker.

    The worker is None unless `fork` and the file is big: for a gzip file it is forked after
    inflating and shares the bytes; for a plain file it reads the bytes from its `cut` on
    while the parent reads (only) the bytes before it (then `worker.partial`)."""
    chunk = 16 << 20
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(2)
            f.seek(0)
            if progress:
                progress("read", 0, size)
            if head == b"\x1f\x8b":
                buf = _gunzip(p, f, size, chunk, progress)
                cut = int(len(buf) * PARALLEL_SHARE)
                return buf, _Worker.start(p, buf, cut) if fork and _parallel(len(buf)) else None
            cut = int(size * PARALLEL_SHARE)
            worker = _Worker.start(p, None, cut, size) if fork and _parallel(size) else None
            if worker:
                buf = bytearray(cut + _SEARCH_BYTES)  # room for the bytes up to the boundary
                try:
                    done = _read_into(f, buf, cut, progress, size)
                except BaseException:
                    worker.__exit__()
                    raise
                if done == cut:
                    return buf, worker
                worker.__exit__()  # the file shrank: read it again in one process
                f.seek(0)
            buf = bytearray(size)
            del buf[_read_into(f, buf, size, progress, size) :]
            return buf, None
    except FileNotFoundError:
        raise InputError(f"{p}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{p}: is a directory, not a trace file") from None
    except PermissionError:
        raise InputError(f"{p}: permission denied") from None
    except OSError as e:
        raise InputError(f"{p}: cannot read ({e.strerror or e})") from None


def _read_into(f, buf, n: int, progress: Progress | None, total: int) -> int:
    """Read n bytes into buf[:n] from f's position; the number read (fewer at EOF)."""
    chunk = 16 << 20
    view, done = memoryview(buf), 0
    try:
        while done < n:
            got = f.readinto(view[done : min(done + chunk, n)])
            if not got:
                break
            done += got
            if progress:  # (the parent may read only its share while the worker reads the rest)
                progress("read", done * total // n, total)
    finally:
        view.release()
    return done


def _gunzip(p: Path, f, size: int, chunk: int, progress: Progress | None) -> bytearray:
    out = bytearray()
    d, fed, done = zlib.decompressobj(wbits=31), False, 0
    try:
        while data := f.read(chunk):
            done += len(data)
            while data:
                out += d.decompress(data)
                data, fed = b"", True
                if d.eof:  # next member of a concatenated gzip; zero padding is ignored
                    data = d.unused_data.lstrip(b"\x00")
                    d, fed = zlib.decompressobj(wbits=31), False
            if progress:
                progress("read", done, size)
    except zlib.error as e:
        raise InputError(f"{p}: corrupt gzip data ({e})") from None
    if fed and not d.eof:
        raise InputError(f"{p}: truncated gzip file (the compressed stream ends early)")
    return out


# ----------------------------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------------------------
_SKIP_REASONS = {
    "type": "fields of the wrong type",
    "phase": "device/cpu category with a phase other than X",
    "missing": "complete event without ts or dur",
    "negative": "negative duration",
    "huge": "duration longer than a day",
    "far": "timestamp beyond int64 nanoseconds",
    "flow": "flow event without ts",
}
_JSON_KINDS = {ord("["): "an array", ord("{"): "an object", ord('"'): "a string",
               ord("t"): "a boolean", ord("f"): "a boolean", ord("n"): "null"}
_PLACEHOLDER = _Event()
_ts_of, _dur_of, _cat_of, _ph_of = (attrgetter(a) for a in ("ts", "dur", "cat", "ph"))


def _parse_file(p: Path, progress: Progress | None) -> Trace:
    buf, worker = _read(p, progress, fork=True)
    if worker:
        with worker:
            got = worker.parse(p, buf, progress)
        if got:
            del buf
            return _trace(p, *got)
        if worker.partial:  # the two-process parse gave up after reading only part of the file
            buf, _ = _read(p, progress)
    try:
        meta, raws = _split_top(p, buf)  # zero-copy slices of buf, one per event
    except msgspec.DecodeError as e:
        raise InputError(f"{p}: {_why(e)}") from None
    except RecursionError:
        raise InputError(f"{p}: JSON nested too deeply") from None
    acc = _Accumulator()
    n = len(raws)
    _parse_events(p, buf, raws, acc, progress)
    del raws, buf
    return _trace(p, meta, n, acc)


def _trace(p: Path, meta: dict, n: int, acc: _Accumulator) -> Trace:
    tables = acc.finish()
    if tables["device"].empty and tables["cpu_ops"].empty:
        skipped = sum(acc.skipped.values())
        note = f"; {skipped} malformed events skipped" if skipped else ""
        raise InputError(f"{p}: no timed events (no kernel, memcpy, memset or cpu_op){note}")
    meta.update(
        path=str(p),
        event_count=n,
        skipped_events={_SKIP_REASONS[k]: v for k, v in acc.skipped.items() if v},
        events_with_dropped_fields=acc.partly_read,
    )
    return Trace(path=str(p), meta=meta, **tables)


def _parse_events(p: Path, buf, raws: list, acc: _Accumulator, progress: Progress | None,
                  first: int = 0) -> None:
    """Decode `raws` (events number `first`, `first` + 1, ...) batch by batch into `acc`."""
    base, n = _address(buf), len(raws)
    for start in range(0, n, BATCH_EVENTS):
        batch = raws[start : start + BATCH_EVENTS]
        text = _batch_text(buf, base, batch)
        acc.add(_decode_batch(p, text, batch, first + start, acc), first + start)
        if progress:
            progress("parse", min(start + BATCH_EVENTS, n), n)


# ----------------------------------------------------------------------------------------------
# Two cores. msgspec holds the GIL, so the second core is a forked process, `_Worker`:
#  1. read: for a plain file the worker reads bytes [cut, end) while the parent reads [0, cut),
#     each into its own buffer (a gzip file is inflated by the parent, then the worker is forked
#     and shares that buffer copy-on-write);
#  2. split: the worker finds the first event boundary '}' , '{' after `cut` and the closing ']'
#     of traceEvents near the end, and splits the events between them; the parent finds the
#     '[' that opens traceEvents and splits the events before the boundary. Each half is
#     decoded as a JSON array of its own, and the keys before and after the array as one object
#     ("[]" in place of the events): when all of them are valid JSON, so is the whole file, and
#     JSON's grammar leaves only one parse, so the events are exactly a one-process read's;
#     anything else (no boundary, a malformed file, a worker that dies) falls back to the
#     one-process path, which gives its usual result or error;
#  3. decode: each process decodes its half into columns; the worker pickles its columns back
#     (each categorical as its values in first-seen order plus codes) and the parent appends
#     them after its own, re-coded (`_Accumulator.absorb`): tables, category order, counters
#     and the first-bad-event error are those of one process.
# ----------------------------------------------------------------------------------------------
_WS = rb"[ \t\n\r]*"
_CUT = re.compile(rb"\}(" + _WS + rb"," + _WS + rb")\{")  # a boundary between two events
_END = re.compile(rb"\}" + _WS + rb"\]")  # the last event and the array's closing bracket
_EVENTS_KEY = re.compile(rb'"traceEvents"' + _WS + rb":" + _WS + rb"\[")
_SEARCH_BYTES = 1 << 20  # how far from the cut / the file's ends boundaries are looked for


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _parallel(size: int) -> bool:
    """Fork a worker for big files on a machine with a second core, from a single thread."""
    return (size >= max(PARALLEL_MIN_BYTES, 1) and hasattr(os, "fork")
            and threading.active_count() == 1 and _cores() >= 2)


class _Worker:
    """The parent's handle on the forked worker (protocol above); a context manager that
    always kills and reaps the child on the way out."""

    def __init__(self, pid: int, up, down, cut: int, partial: bool):
        self.pid, self.up, self.down, self.cut, self.partial = pid, up, down, cut, partial

    @classmethod
    def start(cls, p: Path, buf, cut: int, size: int = 0) -> _Worker | None:
        """Fork; the child works on `buf` (the whole document) or, when None, reads bytes
        [cut, size) of `p` itself."""
        r_down, w_down = os.pipe()
        r_up, w_up = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            for fd in (r_down, w_down, r_up, w_up):
                os.close(fd)
            return None
        if pid == 0:  # pragma: no cover - runs in the child (coverage does not follow forks)
            code = 1
            try:
                os.close(w_down)
                os.close(r_up)
                with open(r_down, "rb") as down, open(w_up, "wb") as up:
                    _work(p, buf, cut, size, up, down)
                code = 0
            finally:
                os._exit(code)
        os.close(r_down)
        os.close(w_up)
        return cls(pid, open(r_up, "rb"), open(w_down, "wb"), cut, buf is None)

    def __enter__(self) -> _Worker:
        return self

    def __exit__(self, *exc) -> None:
        for f in (self.down, self.up):
            with contextlib.suppress(OSError):  # the child may be gone
                f.close()
        # (ChildProcessError/ProcessLookupError: reaped already, e.g. under SIGCHLD = SIG_IGN)
        with contextlib.suppress(ChildProcessError, ProcessLookupError):
            if self.pid is not None and os.waitpid(self.pid, os.WNOHANG)[0] == 0:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
        self.pid = None

    def _recv(self) -> tuple:
        try:
            return pickle.load(self.up)
        except Exception:  # nothing, or half a message: the worker died
            return ("died",)

    def parse(self, p: Path, buf, progress: Progress | None
              ) -> tuple[dict, int, _Accumulator] | None:
        """(meta, event count, columns) of the whole trace, or None to fall back."""
        msg = self._recv()
        if msg[0] != "cut":
            return None
        _, s1, d, gap = msg
        if self.partial:  # buf holds bytes [0, cut) and spare room: add the bytes up to d
            buf[self.cut : d] = gap
            del buf[d:]
        head = _events_start(buf, s1)
        raws = _split_at(buf, head[0], s1) if head else None
        if not raws:
            return None
        msg = self._recv()
        if msg[0] != "split" or msg[3] != (head[1] is None):
            return None
        _, n2, tail, _ = msg
        try:
            meta = ({"device_properties": []} if head[1] is None
                    else _meta(_TOP.decode(head[1] + b"[]" + tail)))
        except (msgspec.DecodeError, RecursionError):
            return None
        n1 = len(raws)
        n = n1 + n2
        try:
            pickle.dump(("go", n1), self.down)
            self.down.flush()
        except OSError:  # pragma: no cover - the child is gone
            return None
        self.partial = True  # buf gets patched from here on: a fallback must read the file again
        acc = _Accumulator()

        def scaled(stage: str, done: int, total: int) -> None:
            progress(stage, min(done * n // total, n - 1), n)

        _parse_events(p, buf, raws, acc, scaled if progress else None)
        del raws
        msg = self._recv()
        if msg[0] == "error":  # the first malformed event: the parent's half had none
            raise InputError(msg[1])
        if msg[0] != "part":  # the worker died: start again in one process
            return None
        acc.absorb(msg[1])
        if progress:
            progress("parse", n, n)
        return meta, n, acc


def _work(p: Path, buf, cut: int, size: int, up, down) -> None:
    """The worker's side of the protocol: read, split and decode the events after `cut`."""

    def send(msg: tuple) -> None:
        pickle.dump(msg, up, protocol=pickle.HIGHEST_PROTOCOL)
        up.flush()

    base = 0  # file offset of buf[0]
    if buf is None:
        base, buf = cut, _read_tail(p, cut, size)
        if buf is None:
            return send(("failed",))
    m = _CUT.search(buf, cut - base, cut - base + _SEARCH_BYTES)
    if m is None:
        return send(("failed",))
    s1, d = m.start(1), m.end(1)
    send(("cut", base + s1, base + d, bytes(buf[cut - base : d]) if base else b""))
    end = _events_end(buf, d)
    raws = None
    if end:
        q, array_doc = end
        buf[d - 1] = 0x5B  # '[' (buf is this process's own copy)
        try:
            raws = _RAW_LIST.decode(memoryview(buf)[d - 1 : q + 1])
        except (msgspec.DecodeError, RecursionError):
            raws = None
    if not raws:
        return send(("failed",))
    send(("split", len(raws), bytes(buf[q + 1 :]), array_doc))
    msg = pickle.load(down)
    if msg[0] != "go":  # pragma: no cover - the parent closes the pipe instead
        return None
    acc = _Accumulator()
    try:
        _parse_events(p, buf, raws, acc, None, first=msg[1])
    except InputError as e:
        return send(("error", str(e)))
    del raws
    send(("part", acc.export()))


def _read_tail(p: Path, cut: int, size: int) -> bytearray | None:
    """Bytes [cut, size) of the file, or None if they cannot all be read."""
    buf = bytearray(size - cut)
    try:
        with open(p, "rb") as f:
            f.seek(cut)
            done = _read_into(f, buf, len(buf), None, 0)
    except OSError:
        return None
    return buf if done == len(buf) else None


def _events_start(buf, s1: int) -> tuple[int, bytes | None] | None:
    """(offset of the '[' opening traceEvents, the document's bytes before it) for an object
    document, (offset of '[', None) for a top-level array of events; None if not proven."""
    bom = 3 if buf[:3] == b"\xef\xbb\xbf" else 0
    kind = _kind(memoryview(buf)[bom:])
    if kind == "an array":
        return buf.index(b"[", bom), None
    if kind != "an object":
        return None
    m = _EVENTS_KEY.search(buf, bom, min(s1, bom + _SEARCH_BYTES))
    if m is None:
        return None
    a = m.end() - 1
    head = bytes(buf[bom:a])
    try:  # the bytes before the '[' are an object whose last key is traceEvents
        top = _TOP.decode(head + b"[]}")
    except (msgspec.DecodeError, RecursionError):
        return None
    return (a, head) if list(top)[-1] == "traceEvents" else None


def _split_at(buf, a: int, s1: int) -> list | None:
    """The events between the '[' at `a` and the separator at `s1`, or None if not valid JSON."""
    if not a < s1:
        return None
    keep, buf[s1] = buf[s1], 0x5D  # ']'
    try:
        return _RAW_LIST.decode(memoryview(buf)[a : s1 + 1])
    except (msgspec.DecodeError, RecursionError):
        return None
    finally:
        buf[s1] = keep


def _events_end(buf, d: int) -> tuple[int, bool] | None:
    """(offset of the ']' closing traceEvents, whether the document is a top-level array): the
    first '}' ']' in the last _SEARCH_BYTES after which the rest of the file is whitespace (an
    array document) or the rest of an object without another traceEvents key."""
    lo = max(d, len(buf) - _SEARCH_BYTES)
    for m in list(_END.finditer(buf, lo))[-16:]:  # lowest first
        q = m.end() - 1
        tail = bytes(buf[q + 1 :])
        if not tail.strip(b" \t\n\r"):
            return q, True
        try:
            rest = _TOP.decode(b'{"_":0' + tail)
        except (msgspec.DecodeError, RecursionError):
            continue
        if "traceEvents" not in rest:
            return q, False
    return None


def _address(obj) -> int:
    return np.frombuffer(obj, np.uint8).ctypes.data if len(obj) else 0


def _batch_text(buf, base: int, batch: list, patch: bool = True):
    """The batch's events as one JSON array, without copying when the slices are zero-copy.

    The events of a batch are contiguous in `buf`; the separator bytes just before the first
    and just after the last one (whitespace, ',' or the array's own brackets) are overwritten
    with '[' and ']' so that the range decodes as an array. `buf` is our private copy (or its
    bytes around this batch are ours alone); with `patch=False` the range is copied instead.
    """
    first, last = batch[0], batch[-1]
    start = _address(first) - base
    end = _address(last) - base + len(last)
    if start > 0 and end < len(buf) and start < end:
        if not patch:
            return b"[" + memoryview(buf)[start:end] + b"]"
        buf[start - 1] = 0x5B  # '['
        buf[end] = 0x5D  # ']'
        return memoryview(buf)[start - 1 : end + 1]
    return b"[" + b",".join(batch) + b"]"  # pragma: no cover - msgspec copied the slices


def _kind(view) -> str:
    head = bytes(memoryview(view)[:4096]).lstrip()
    if not head:
        return "empty"
    first = head[0]
    return _JSON_KINDS.get(first, "a number" if first in b"-0123456789" else "not JSON")


def _why(e: Exception) -> str:
    msg = str(e)
    if "truncated" in msg:
        return "truncated JSON (the file ends in the middle of the document)"
    if msg.startswith("JSON is malformed"):
        return "malformed JSON" + msg[len("JSON is malformed") :]
    if "UTF-8" in msg:
        return "text is not valid UTF-8"
    return msg.splitlines()[0] if msg else type(e).__name__


def _split_top(p: Path, buf: bytearray) -> tuple[dict, list]:
    """Top-level metadata (decoded) and one zero-copy raw slice per event, in one pass."""
    view = memoryview(buf)
    if buf[:3] == b"\xef\xbb\xbf":  # a UTF-8 byte-order mark
        view = view[3:]
    kind = _kind(view)
    if kind == "empty":
        raise InputError(f"{p}: empty file")
    if kind == "an array":  # Chrome's "JSON Array Format": the events alone
        return {"device_properties": []}, _RAW_LIST.decode(view)
    if kind != "an object":
        raise InputError(f"{p}: top level is {kind}, expected an object with traceEvents")
    try:
        raws = _TOP_EVENTS.decode(view).traceEvents
    except msgspec.ValidationError:  # traceEvents is there but not a list
        raws = None
    if raws is None:
        events = _TOP.decode(view).get("traceEvents")
        if events is None:
            raise InputError(f"{p}: no traceEvents key at the top level")
        raise InputError(f"{p}: traceEvents is {_kind(events)}, not a list")
    return _meta(_TOP.decode(_without_events(buf, view, raws))), raws


def _meta(top: dict) -> dict:
    """The top-level keys other than traceEvents (raw JSON values), decoded and normalised."""
    top.pop("traceEvents", None)
    meta = {k: _decode_json(v, keep_text=True) for k, v in top.items()}
    props = meta.get("deviceProperties")
    meta["device_properties"] = (
        [d for d in props if isinstance(d, dict)] if isinstance(props, list) else []
    )
    for src, dst in (("baseTimeNanoseconds", "base_time_ns"), ("torch_version", "torch_version"),
                     ("pytorch_version", "torch_version")):
        if src in meta:
            meta[dst] = meta[src]
    return meta


def _without_events(buf: bytearray, view: memoryview, raws: list):
    """The document with its traceEvents array emptied (small), to read the other keys."""
    if not raws:
        return view
    base = _address(buf)
    first = _address(raws[0]) - base
    last = _address(raws[-1]) - base + len(raws[-1])
    start = _address(view) - base
    if not start < first < last <= len(buf):  # pragma: no cover - msgspec copied the slices
        return view
    open_, close = buf.rfind(b"[", start, first), buf.find(b"]", last)
    return bytes(buf[start:open_]) + b"[]" + bytes(buf[close + 1 :])


def _decode_json(text: Any, keep_text: bool = False) -> Any:
    try:
        return msgspec.json.decode(text)
    except (msgspec.DecodeError, RecursionError, TypeError):
        return bytes(text).decode("utf-8", "replace") if keep_text else None


def _decode_batch(p: Path, text, batch: Sequence, start: int, acc: _Accumulator) -> list:
    """Decode a batch of events; retry one by one only if some event is malformed."""
    try:
        return _BATCH.decode(text)
    except (msgspec.ValidationError, msgspec.DecodeError):
        pass
    out = []
    for i, raw in enumerate(batch):
        try:
            out.append(_ONE.decode(raw))
            continue
        except msgspec.ValidationError:  # (a subclass of DecodeError)
            pass
        except msgspec.DecodeError as e:
            raise InputError(f"{p}: traceEvents[{start + i}]: {_why(e)}") from None
        try:
            ev = _ONE_LENIENT.decode(raw)
        except msgspec.ValidationError:
            acc.skipped["type"] += 1
            out.append(_PLACEHOLDER)
            continue
        acc.partly_read += 1
        out.append(_Event(ev.ph, ev.cat, ev.name, ev.pid, ev.tid, ev.ts, ev.dur, ev.id))
    return out


def _as_int(v: Any) -> int:
    if isinstance(v, bool):
        return _MISSING
    if isinstance(v, int):
        return v if _MISSING < v < 2**63 else _MISSING
    if isinstance(v, str):
        for base in (10, 0):
            try:
                return _as_int(int(v, base))
            except ValueError:
                continue
    return _MISSING


def _ints(rows: list, getter: Callable) -> np.ndarray:
    """int64 column; None, non-numeric strings and out-of-range values become _MISSING."""
    try:
        return np.fromiter(map(getter, rows), np.int64, len(rows))
    except (TypeError, ValueError, OverflowError):
        return np.array([_as_int(v) for v in map(getter, rows)], dtype=np.int64)


def _texts(raws: list) -> list[str]:
    """Raw JSON slices -> str ('' where absent). NUL cannot occur in JSON text outside strings."""
    parts = b"\x00".join(raws).decode("utf-8", "replace").split("\x00")
    if len(parts) != len(raws):  # a NUL inside a string: decode one by one
        parts = [bytes(r).decode("utf-8", "replace") for r in raws]
    return parts


class _Interner:
    """Assigns each distinct value a code in first-seen order: categorical without re-hashing.

    `codes()` returns provisional codes (a running counter, unique per value); `finish()` maps
    them to dense category codes, with None as -1.
    """

    def __init__(self):
        self.seen: dict = {}
        self.counter = count()

    def codes(self, values, n: int) -> np.ndarray:
        return np.fromiter(map(self.seen.setdefault, values, self.counter), np.int64, n)

    def dense(self, chunks: list[np.ndarray]) -> tuple[list, np.ndarray]:
        """(every value in first-seen order, the rows' codes into that list) to ship."""
        keys = list(self.seen)
        provisional = np.fromiter(self.seen.values(), np.int64, len(keys))
        lookup = np.zeros(int(provisional.max(initial=0)) + 1, dtype=np.int32)
        lookup[provisional] = np.arange(len(keys), dtype=np.int32)
        return keys, lookup[np.concatenate(chunks)] if chunks else np.empty(0, np.int32)

    def absorb(self, keys: list, codes: np.ndarray) -> np.ndarray:
        """Codes from `dense()` of a later part of the file -> this interner's codes. New values
        are appended in their first-seen order, so categories come out as a serial read's."""
        mine = np.fromiter(map(self.seen.setdefault, keys, self.counter), np.int64, len(keys))
        return mine[codes]

    def finish(self, chunks: list[np.ndarray]) -> pd.Categorical:
        keys = [k for k in self.seen if k is not None]
        provisional = np.fromiter((self.seen[k] for k in keys), np.int64, len(keys))
        lookup = np.full(max(self.seen.values(), default=0) + 1, -1, dtype=np.int32)
        lookup[provisional] = np.arange(len(keys), dtype=np.int32)
        codes = lookup[np.concatenate(chunks)] if chunks else np.empty(0, np.int32)
        return pd.Categorical.from_codes(codes, categories=pd.Index(keys, dtype=object).astype(str))


def _respell(text: str) -> str:
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except (ValueError, RecursionError):
        return text


class _RawGroup:
    """A table's raw-JSON columns, interned together: one key per row, split per distinct key.

    The key joins the row's raw texts (every spelling of every column) with \\x01, which JSON
    text cannot contain outside strings; a column takes its first non-empty spelling.
    """

    def __init__(self, columns: dict[str, tuple[str, ...]]):
        self.columns = columns
        paths = [p for ps in columns.values() for p in ps]
        self.width = len(paths)
        self.getter = attrgetter(*paths)
        self.interner = _Interner()

    def codes(self, rows: list) -> np.ndarray:
        raws = map(self.getter, rows)
        keys = _texts(list(raws if self.width == 1 else map(b"\x01".join, raws)))
        return self.interner.codes(keys, len(keys))

    def finish(self, chunks: list[np.ndarray]) -> dict[str, pd.Categorical]:
        seen = self.interner.seen
        keys = list(seen)
        provisional = np.fromiter(seen.values(), np.int64, len(keys))
        lookup = np.zeros(int(provisional.max(initial=0)) + 1, dtype=np.int64)
        lookup[provisional] = np.arange(len(keys))
        key_of_row = lookup[np.concatenate(chunks)]
        split = [k.split("\x01") if k.count("\x01") == self.width - 1 else [""] * self.width
                 for k in keys]
        out, i = {}, 0
        for col, paths in self.columns.items():
            texts = [next((t for t in parts[i : i + len(paths)] if t), "") for parts in split]
            values = [None if t in ("", "null") else _respell(t) for t in texts]
            codes, categories = pd.factorize(pd.Series(values, dtype=object))
            out[col] = pd.Categorical.from_codes(codes[key_of_row], categories=categories.astype(str))
            i += len(paths)
        return out


class _Accumulator:
    """Collects per-batch column chunks for every table, then concatenates them."""

    def __init__(self):
        self.cat_table = _CatTable()
        self.skipped = dict.fromkeys(_SKIP_REASONS, 0)
        self.partly_read = 0
        self.chunks: dict[str, list[dict]] = {t: [] for t in _FIELDS}
        self.getters = {
            t: {c: (tuple(attrgetter(a) for a in paths), conv)
                for c, (paths, conv) in fields.items()}
            for t, fields in _FIELDS.items()
        }
        self.interners = {
            (t, c): _Interner()
            for t, fields in _FIELDS.items()
            for c, (_, conv) in fields.items()
            if conv in ("str", "cat")
        }
        self.raw_groups = {
            t: _RawGroup({c: paths for c, (paths, conv) in fields.items() if conv == "raw"})
            for t, fields in _FIELDS.items()
            if any(conv == "raw" for _, conv in fields.values())
        }

    def add(self, evs: list, start: int) -> None:
        n = len(evs)
        cats = list(map(_cat_of, evs))
        tab = np.fromiter(map(self.cat_table.__getitem__, cats), np.int8, n)
        ph = np.fromiter(map(_PH_CODES.get, map(_ph_of, evs), repeat(0, n)), np.int8, n)
        complete = (tab >= _KERNEL) & (tab <= _PYFRAME)
        self.skipped["phase"] += int(np.count_nonzero(complete & (ph != 1)))
        keep = (complete & (ph == 1)) | ((tab == _FLOW) & (ph >= 2))
        idx = np.flatnonzero(keep)
        if not len(idx):
            return
        if len(idx) < n:
            keep_list = keep.tolist()
            evs, cats = list(compress(evs, keep_list)), list(compress(cats, keep_list))
        m = len(evs)
        ts = np.fromiter(map(_ts_of, evs), np.float64, m)
        dur = np.fromiter(map(_dur_of, evs), np.float64, m)
        t, ph = tab[idx], ph[idx]
        flow = t == _FLOW
        missing = np.isnan(ts) | (~flow & np.isnan(dur))
        negative = ~flow & (dur < 0)
        huge = ~flow & (dur > MAX_DUR_US)
        far = np.abs(ts) > MAX_TS_US
        self.skipped["missing"] += int(np.count_nonzero(missing & ~flow))
        self.skipped["flow"] += int(np.count_nonzero(missing & flow))
        self.skipped["negative"] += int(np.count_nonzero(negative))
        self.skipped["huge"] += int(np.count_nonzero(huge))
        self.skipped["far"] += int(np.count_nonzero(far & ~(missing | negative | huge)))
        valid = ~(missing | negative | huge | far)
        for table, codes in _TABLE_CODES.items():
            rows = valid & (t == codes[0]) if len(codes) == 1 else valid & np.isin(t, codes)
            if not rows.any():
                continue
            rows_list = rows.tolist()
            sub = list(compress(evs, rows_list))
            chunk = {"event_id": start + idx[rows], "ts_us": ts[rows], "dur_us": dur[rows]}
            for col, (getters, conv) in self.getters[table].items():
                if conv == "cat":
                    chunk[col] = self.interners[table, col].codes(compress(cats, rows_list), len(sub))
                elif conv == "ph":
                    chunk[col] = (ph[rows] - 2).astype(np.int8)
                elif conv != "raw":
                    chunk[col] = self._convert(table, col, sub, getters, conv)
            if table in self.raw_groups:
                chunk["raw"] = self.raw_groups[table].codes(sub)
            if table == "device":
                chunk["kind"] = (t[rows] - _KERNEL).astype(np.int8)
            self.chunks[table].append(chunk)

    def _convert(self, table, col, rows: list, getters: tuple, conv: str):
        """One int or str column for `rows`; a second getter fills ints the first lacks."""
        if conv == "int":
            out = _ints(rows, getters[0])
            gap = out == _MISSING
            if len(getters) > 1 and gap.any():
                out[gap] = _ints(list(compress(rows, gap.tolist())), getters[1])
            return out
        return self.interners[table, col].codes(map(getters[0], rows), len(rows))

    def export(self) -> dict:
        """Everything gathered so far, picklable: per table one concatenated chunk whose
        categorical columns are (values, codes) pairs (see _Interner.dense)."""
        tables = {}
        for table, chunks in self.chunks.items():
            if not chunks:
                continue
            part = {}
            for col in chunks[0]:
                parts = [c[col] for c in chunks]
                if col == "raw":
                    part[col] = self.raw_groups[table].interner.dense(parts)
                elif (table, col) in self.interners:
                    part[col] = self.interners[table, col].dense(parts)
                else:
                    part[col] = np.concatenate(parts)
            tables[table] = part
        return {"tables": tables, "skipped": self.skipped, "partly_read": self.partly_read}

    def absorb(self, part: dict) -> None:
        """Append an `export()` of the events that follow the ones added so far."""
        for table, cols in part["tables"].items():
            chunk = {}
            for col, v in cols.items():
                if col == "raw":
                    chunk[col] = self.raw_groups[table].interner.absorb(*v)
                elif (table, col) in self.interners:
                    chunk[col] = self.interners[table, col].absorb(*v)
                else:
                    chunk[col] = v
            self.chunks[table].append(chunk)
        for reason, k in part["skipped"].items():
            self.skipped[reason] += k
        self.partly_read += part["partly_read"]

    def finish(self) -> dict[str, pd.DataFrame]:
        cols: dict[str, dict] = {}
        for table, chunks in self.chunks.items():
            cols[table] = {}
            for col in chunks[0] if chunks else ():
                parts = [c[col] for c in chunks]
                if col == "raw":
                    cols[table].update(self.raw_groups[table].finish(parts))
                    continue
                interner = self.interners.get((table, col))
                cols[table][col] = interner.finish(parts) if interner else np.concatenate(parts)
            if "ph" in cols[table]:
                cols[table]["ph"] = pd.Categorical.from_codes(cols[table]["ph"], _FLOW_PH)
        return _build_tables(cols)


def _int64(values: np.ndarray) -> pd.arrays.IntegerArray:
    return pd.arrays.IntegerArray(values, values == _MISSING)


def _build_tables(cols: dict[str, dict]) -> dict[str, pd.DataFrame]:
    """Column arrays -> DataFrames in the declared schemas."""
    out = {}
    for table, schema in SCHEMAS.items():
        c = cols[table]
        if not c:
            out[table] = pd.DataFrame({k: pd.Series(dtype=v) for k, v in schema.items()})
            continue
        if table == "device":
            c["kind"] = pd.Categorical.from_codes(c["kind"], categories=_KINDS)
            for k in ("device", "stream"):
                c[k] = np.where(c[k] == _MISSING, -1, c[k])
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
