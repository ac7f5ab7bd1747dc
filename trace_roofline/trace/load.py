"""The entry points: load_trace / load_traces (reading, then the one- or two-process parse),
parse_dims for the raw-JSON shape columns, and progress_bar."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TypedDict

import numpy as np
import pandas as pd

from trace_roofline.errors import InputError
from trace_roofline.trace.columns import Accumulator
from trace_roofline.trace.decode import decode_json, decode_raw, decode_spans
from trace_roofline.trace.parallel import parse_streamed, parse_two, use_worker
from trace_roofline.trace.read import FileChanged, Unstreamed, open_document, trace_files
from trace_roofline.trace.schema import SKIP_REASONS, Progress, Trace

PROGRESS_MIN_BYTES = 64 << 20  # progress_bar() stays silent below this file size


def load_trace(path: str | os.PathLike, progress: Progress | None = None,
               workers: int | None = None) -> Trace:
    """Load one trace file, or the single trace file of a tensorboard_trace_handler directory.

    `progress(stage, done, total)` is called while reading (bytes: inflating a gzip file, or
    reading a document whole) and parsing (bytes of the events decoded, or events when the
    document is read the Raw way: see decode.py); pass `progress_bar()` for a terminal bar.
    Raises InputError (one line naming the file, or the parameter).

    `workers` is how many processes parse the file; the result (tables, metadata, and the
    error for a bad file) is the same whichever is used:
    - None (automatic): two when the JSON (inflated, for gzip) is parallel.PARALLEL_MIN_BYTES
      (64 MiB) or more, the system can fork (not Windows), this process runs a single thread
      and may use at least two CPU cores; else one. Automatic is thus one process inside a program
      that runs other threads, e.g. a Jupyter notebook kernel (its heartbeat and IO threads),
      a web server or a thread pool, since forking a threaded process can deadlock the child.
    - 1: one process.
    - 2: two processes whenever the system can fork and this process runs a single thread,
      whatever the file's size or the cores; else one.
    Even with two, a file whose parts cannot be proven to be its events (see parallel.py),
    or whose worker dies after claiming part of it, is parsed again in one process.
    """
    _check_workers(workers)
    p = Path(path)
    if p.is_dir():
        files = trace_files(p)
        if len(files) > 1:
            raise InputError(
                f"{p}: directory holds {len(files)} traces; pass one file or use load_traces()"
            )
        p = files[0]
    return _load_file(p, progress, workers)


def load_traces(path: str | os.PathLike, progress: Progress | None = None,
                workers: int | None = None) -> list[Trace]:
    """Load every trace in a directory (sorted by name), or the one file `path` names
    (`progress` and `workers` as for load_trace)."""
    _check_workers(workers)
    p = Path(path)
    files = trace_files(p) if p.is_dir() else [p]
    return [_load_file(f, progress, workers) for f in files]


def _check_workers(workers: object) -> None:
    if not (workers is None or type(workers) is int and workers in (1, 2)):
        raise InputError(f"workers must be None (automatic), 1 or 2, not {workers!r}")


def _load_file(p: Path, progress: Progress | None, workers: int | None) -> Trace:
    try:
        return _parse_file(p, progress, workers)
    except MemoryError:
        raise InputError(f"{p}: not enough memory to load this trace") from None


def _parse_file(p: Path, progress: Progress | None, workers: int | None,
                stream: bool = True) -> Trace:
    """The trace of file `p`, of one version of it: a file rewritten while it was read is read
    again, whole and the Raw way, as it is now; rewritten during that read too, it is an
    InputError ("changed while it was being read")."""
    try:
        with open_document(p, progress, stream=stream) as doc:  # (one file, one descriptor)
            if doc.inflater is not None:  # a gzip file, parsed while it is inflated
                got = parse_streamed(doc, progress, workers)
            else:
                got = parse_two(doc, progress) if use_worker(doc.size, workers) else None
            if got is None:  # one process: batch by batch, else (unproven) the Raw way
                got = decode_spans(doc, progress) or decode_raw(p, doc.whole(progress), progress)
            doc.check()  # (every read checked it; a change after the last one counts too)
    except Unstreamed:  # read again, inflated first: its own error, if any, is reported
        return _parse_file(p, progress, workers, stream=False)
    except FileChanged:
        with open_document(p, progress) as doc:
            got = decode_raw(p, doc.whole(progress), progress)
            doc.check()
    return _trace(p, *got)


def _trace(p: Path, meta: dict, n: int, acc: Accumulator) -> Trace:
    tables = acc.finish()
    if tables["device"].empty and tables["cpu_ops"].empty:
        skipped = sum(acc.skipped.values())
        note = f"; {skipped} malformed events skipped" if skipped else ""
        raise InputError(f"{p}: no timed events (no kernel, memcpy, memset or cpu_op){note}")
    meta.update(
        path=str(p),
        event_count=n,
        skipped_events={SKIP_REASONS[k]: v for k, v in acc.skipped.items() if v},
        events_with_dropped_fields=acc.partly_read,
    )
    return Trace(path=str(p), meta=meta, **tables)


def parse_dims(series: pd.Series) -> list:
    """Decode a raw-JSON column (input_dims, input_types, concrete_inputs) for the given rows.

    Returns a list aligned with `series`: the decoded value (e.g. [[1, 3584], [18944, 3584]]),
    or None where the text is missing or not valid JSON. Each distinct text is decoded once.
    """
    values = series.astype("category")
    decoded = [decode_json(text) for text in values.cat.categories]
    lookup = np.empty(len(decoded) + 1, dtype=object)
    lookup[:-1] = decoded
    lookup[-1] = None
    return lookup[values.cat.codes.to_numpy()].tolist()


class _BarState(TypedDict):
    big: bool  # the file is big enough for a bar
    last: tuple[str, int] | None  # (stage, per-mille) last drawn


def progress_bar(stream=None, min_bytes: int = PROGRESS_MIN_BYTES) -> Progress | None:
    """A `progress` callback drawing a one-line bar on `stream` (stderr), or None if not a TTY.

    Files smaller than `min_bytes` draw nothing. Only the CLI should create one.
    """
    out = stream if stream is not None else sys.stderr
    if not (hasattr(out, "isatty") and out.isatty()):
        return None
    state: _BarState = {"big": False, "last": None}

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
