"""Profiled graph captures: the launches a CUDA/HIP-graph capture recorded, as templates that
name the kernels its graph replays.

Design notes: docs/design.md ("trace_roofline/attribution/captures.py").
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import cast

import msgspec
import pandas as pd

from trace_roofline.attribution import graphs
from trace_roofline.attribution.attribute import attribute
from trace_roofline.errors import InputError
from trace_roofline.files import find_traces, open_regular, read_json
from trace_roofline.model.models import ModelSpec
from trace_roofline.trace import Progress, Trace, load_trace, read

FOLDER = "capture_traces"  # TraceLens's (and this tool's) capture folder beside a trace
DETAILS = "execution_details.json"
_ANNOTATION = re.compile(r"^capture_(\d+)_([A-Za-z]+)$")
_FILE_BATCH = re.compile(r"(?:^|[_-])bs_?(\d+)(?:[_.-]|$)")


class _LaunchArgs(msgspec.Struct, gc=False):
    correlation: object = None
    kernel: object = None
    grid: object = None
    block: object = None


class _Event(msgspec.Struct, gc=False):
    cat: str = ""
    args: _LaunchArgs | None = None


class _Document(msgspec.Struct, gc=False):
    traceEvents: list[_Event] = []


def capture_launches(path: Path) -> pd.DataFrame:
    """correlation, name, grid, block of every runtime event whose args name a kernel."""
    raw = _read_bytes(path)
    try:
        doc = msgspec.json.decode(raw, type=_Document)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise InputError(f"{path}: not a capture trace ({e})") from None
    rows = [(e.args.correlation, e.args.kernel, e.args.grid, e.args.block)
            for e in doc.traceEvents
            if e.args is not None and isinstance(e.args.kernel, str)
            and isinstance(e.args.correlation, int) and e.cat.endswith(("_runtime", "_driver"))]
    t = pd.DataFrame(rows, columns=["correlation", "name", "grid", "block"])
    t["grid"] = t["grid"].map(lambda g: str(g) if isinstance(g, list) else None)
    t["block"] = t["block"].map(lambda g: str(g) if isinstance(g, list) else None)
    return t.drop_duplicates("correlation")


def _read_bytes(path: Path) -> bytes:
    """A capture trace's bytes, inflated within the bomb limit (trace.read.gunzip); only a
    regular file is opened."""
    try:
        with open_regular(path) as f:
            head = f.read(2)
            f.seek(0)
            if head != b"\x1f\x8b":
                return f.read()
            return bytes(read.gunzip(path, f, os.fstat(f.fileno()).st_size, read.CHUNK_BYTES, None))
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e})") from None


def is_capture(trace: Trace) -> bool:
    """Whether a trace profiled a graph capture (a stream capture began in it)."""
    return bool(trace.runtime["name"].astype("string").str.contains("StreamBeginCapture")
                .fillna(False).any())


def beside(trace_path: str | Path) -> Path | None:
    """The `capture_traces/` folder next to a trace file, if there is one (none for a trace
    that is not a file: a directory of traces, one built in memory)."""
    p = Path(trace_path) if trace_path else None
    if p is None or not p.is_file():
        return None
    d = p.parent / FOLDER
    return d if d.is_dir() else None


def load(source: str | os.PathLike[str] | Trace, model: ModelSpec | None
         ) -> list[graphs.Mapping]:
    """The captures of `source`: a capture trace (path or loaded), or a folder of them (its
    execution_details.json listing them, else every trace file in it). Each becomes a
    template (graphs.capture_mapping with the launches' kernel names); a file whose capture
    holds no launches is an InputError naming it."""
    if isinstance(source, Trace):
        return [_capture(source, Path(source.path), model, None, None)]
    p = Path(source)
    if not p.is_dir():
        return [_capture(load_trace(p), p, model, None, None)]
    return [_capture(load_trace(f), f, model, b, m) for f, b, m in _listed(p)]


def _listed(folder: Path) -> list[tuple[Path, int | None, str | None]]:
    """(file, batch, mode) of a capture folder: execution_details.json, else its traces."""
    details = folder / DETAILS
    if details.is_file():
        entries = read_json(details)
        if not isinstance(entries, list):
            raise InputError(f"{details}: expected a list of {{file, batch_size, mode}}")
        out = []
        for e in entries:
            if not isinstance(e, dict) or "file" not in e:
                raise InputError(f"{details}: an entry without 'file': {e!r}")
            batch = e.get("batch_size")
            out.append((folder / str(e["file"]), int(batch) if isinstance(batch, int) else None,
                        str(e["mode"]) if e.get("mode") else None))
        return out
    files, _ = find_traces(folder)  # an InputError when it holds none
    return [(f, None, None) for f in files]


def _capture(trace: Trace, path: Path, model: ModelSpec | None, batch: int | None,
             mode: str | None) -> graphs.Mapping:
    launches = capture_launches(path)
    mapping = graphs.capture_mapping(trace, model, launches)
    if mapping is None:
        raise InputError(f"{path}: no graph capture in it (no kernel launched between a "
                         "StreamBeginCapture and its StreamEndCapture)")
    a_batch, a_mode = _annotated(trace, path)
    return graphs.Mapping(path.name, mapping.rows, mapping.starts, batch=batch or a_batch,
                          mode=(mode or a_mode or "").upper() or None, capture=True)


def _annotated(trace: Trace, path: Path) -> tuple[int | None, str | None]:
    """Batch and mode from a `capture_{bs}_{mode}` range, else a `bs_{N}` in the file name."""
    names = trace.annotations["name"].astype("string").dropna()
    hit = names.str.extract(_ANNOTATION).dropna()
    if len(hit):
        return int(hit.iloc[0, 0]), str(hit.iloc[0, 1])
    m = _FILE_BATCH.search(path.name)
    return (int(m.group(1)) if m else None), None


def graph_sources(trace: Trace, model: ModelSpec | None, graph_map: object,
                  progress: Progress | None = None
                  ) -> tuple[graphs.Mapping | None, list[graphs.Mapping], list[str]]:
    """(an eager mapping, graph captures, notes) naming a trace's replays: `graph_map` (the
    --graph-map option) is an eager trace of the same step, a capture trace or a folder of
    captures; without it, the captures of a `capture_traces/` folder beside the trace (a note
    says so)."""
    source, notes = cast("Trace | str | os.PathLike[str] | None", graph_map), []
    if source is None:
        found = beside(trace.path) if graphs.has_replays(trace) else None
        if found is None:
            return None, [], []
        notes.append(f"graph captures: found {found} beside the trace and used it "
                     "(--graph-map names others)")
        source = found
    if not isinstance(source, Trace) and Path(source).is_dir():
        return None, load(source, model), notes
    m_trace = source if isinstance(source, Trace) else load_trace(source, progress=progress)
    if is_capture(m_trace):
        return None, load(m_trace, model), notes
    return graphs.mapping_from(m_trace, attribute(m_trace, model)), [], notes
