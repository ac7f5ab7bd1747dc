"""Columnar cache of parsed traces and their attribution, in the user's cache directory.

A trace's tables (`Trace`) and its `attribute()` output (which depends on the trace and the model,
not on hardware or conventions) are kept as Arrow IPC files, so a re-run of the same file maps
them instead of parsing JSON again; the finished `Analysis` of each set of analysis arguments
(model, hardware, conventions, ...) is kept too, so a re-run with the same arguments (another
report format, --per-layer, a diff) reads it back whole. Nothing is ever written next to the
user's file.

Layout, under `cache_dir()` (`$TRACE_ROOFLINE_CACHE_DIR`, else `$XDG_CACHE_HOME/trace-roofline`,
else `~/.cache/trace-roofline`)::

    v<SCHEMA_VERSION>/<sha256(absolute path)[:32]>/     one entry per source file
        trace/                   <table>.arrow per Trace table, fields.json, manifest.json
        attributed-<model hash>/  attributed.arrow, manifest.json   (one per model, or none)
        analysis-<arguments hash>/ analysis.pickle, manifest.json   (one per argument set)

Each part (`trace/`, `attributed-*/`) is written whole into a temporary directory and renamed
into place, so it is complete or absent. Its `manifest.json` holds the key it was built for
(absolute path, size, mtime_ns and inode of the source file; SCHEMA_VERSION; a fingerprint of
the analyzer's source code, which changes with the package version and any column schema; the
pandas and pyarrow versions; the model for an attribution, the analysis arguments for an
analysis) and every file's length and CRC-32.
A part is used only when its key equals the current one and every file has its recorded length
and checksum (zlib's CRC-32 runs at several GB/s); anything else (stale, truncated, flipped
bytes, unreadable) is ignored and rewritten, never trusted.

Categorical columns are stored as Arrow dictionaries and everything else as plain Arrow columns
(with pandas' metadata), so a hit gives DataFrames identical to a parse, dtypes included.
An `Analysis` is a tree of frozen dataclasses (model, hardware), dicts and DataFrames: it is
stored as one pickle (protocol 5, its arrays' buffers written after the stream, out of band:
pickling copies nothing big), which round-trips all of it exactly (dtypes and categories
included), and unpickled only after its key (code fingerprint included: the classes are this
code's) and its CRC-32 check out.
Files are zstd-compressed (`CODEC`: Arrow IPC's per-buffer compression, and a compressed stream
for pickles). The repeated strings of a GB trace's tables, attribution and Analysis shrink
~10-30x: on the 1 GB HF tile the cache holds 26 MB (500 MB uncompressed), a first
run's background writes and checksums take ~0.3 s instead of ~1.2 s, and a hit decompresses
(~0.1 s per 100 MB) instead of checksumming 10x the bytes. Like the rest of the cache it lives
in the user's own cache directory.
Cache writes that fail (read-only directory, disk full) never fail an analysis: they are
reported in the returned `CacheStatus`. Files are memory-mapped on a hit; the cache only ever
replaces files by rename and removes them by unlink, so a mapping is never truncated under a
reader.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import re
import secrets
import shutil
import zlib
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.ipc as ipc

from trace_roofline import files
from trace_roofline.model.models import ModelSpec
from trace_roofline.trace import Progress, Trace, load_trace

if TYPE_CHECKING:
    from trace_roofline.roofline import Analysis

SCHEMA_VERSION = 3  # bump when the layout or the meaning of a cached file changes
# (2: zstd; 3: pickles with their buffers out of band)
CODEC = "zstd" if pa.Codec.is_available("zstd") else None  # (pyarrow's wheels all have it)
ENV_DIR = "TRACE_ROOFLINE_CACHE_DIR"
_VERSION_DIR = re.compile(r"^v\d+$")  # `clear` removes only directories named like ours
_MANIFEST = "manifest.json"
_FIELDS = "fields.json"
_TRACE_PART = "trace"
_ATTRIBUTED = "attributed"
_ANALYSIS = "analysis"


@dataclasses.dataclass(frozen=True)
class CacheStatus:
    """What one `TraceCache.load` did: which parts came from the cache, and why a write failed."""

    path: str
    trace_hit: bool
    attribution_hit: bool
    write_error: str | None = None  # "<what>: <reason>" when storing a part failed
    analysis_hit: bool = False  # the whole Analysis came from the cache (TraceCache.analysis)


@dataclasses.dataclass(frozen=True)
class CacheInfo:
    """The cache directory and what it holds: entries (cached source files) and the complete
    parts of each kind, parsed trace tables (one per file), attributions (one per file and
    model) and finished analyses (one per file and argument set)."""

    directory: Path
    entries: int
    traces: int
    attributions: int
    analyses: int
    total_bytes: int


def cache_dir() -> Path:
    """`$TRACE_ROOFLINE_CACHE_DIR`, else `$XDG_CACHE_HOME/trace-roofline`, else
    `~/.cache/trace-roofline` (empty variables count as unset, as XDG says)."""
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "trace-roofline"


@cache
def code_fingerprint() -> str:
    """SHA-256 of every .py file of the analyzer package: any code change (a new release, a
    new column, a fixed rule) invalidates every cached part."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _model_key(model: ModelSpec | None) -> dict | None:
    """The model's fields as the manifest's JSON reads them back (tuples as lists)."""
    if model is None:
        return None
    return json.loads(json.dumps({"type": type(model).__name__, **dataclasses.asdict(model)}))


def _argument_key(value: object) -> object:
    """A JSON-able key for one analysis argument: None, bool, int, float and str as they are,
    a dataclass (model, hardware) as its type name and fields, a path as its file's key (an
    ncu CSV: its content may change). TypeError for anything else (then nothing is cached)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"type": type(value).__name__, **dataclasses.asdict(value)}
    if isinstance(value, os.PathLike):
        return {"file": files.identity(Path(value))}
    raise TypeError(f"no cache key for {type(value).__name__}")


class TraceCache:
    """The cache at `directory` (default `cache_dir()`); `load` is the one entry point."""

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        self.directory = Path(directory) if directory is not None else cache_dir()
        self.root = self.directory / f"v{SCHEMA_VERSION}"
        self.log: list[CacheStatus] = []  # one status per load(), in call order
        # While `analysis` computes: parts are written by a background thread (the disk writes
        # and checksums release the GIL, so they overlap attribution and costing on another
        # core); their errors are collected here and joined into the log at the end. The
        # thread lives only while `analysis` runs (so a TraceCache between calls pickles).
        self._writes: list[Future] | None = None
        self._write_errors: list[str] = []
        self._writer: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------------------------------
    def load(self, path: str | os.PathLike, model: ModelSpec | None = None,
             progress: Progress | None = None) -> tuple[Trace, pd.DataFrame | None]:
        """The trace at `path` (from the cache when a valid part is there, else parsed and
        stored) and its cached attribution under `model`, None when there is none (the caller
        attributes and `store_attributed`s it). A directory (or anything but a regular file, so
        that load_trace reports a missing one) is loaded uncached."""
        p = Path(path)
        if not p.is_file():
            self._logged(CacheStatus(str(p), False, False))
            return load_trace(p, progress=progress), None
        key = self._key(p)
        entry = self._entry(key)
        errors: list[str] = []
        trace = self._read_trace(entry / _TRACE_PART, key, str(p))
        trace_hit = trace is not None
        if trace is None:
            trace = load_trace(p, progress=progress)
            shutil.rmtree(entry, ignore_errors=True)  # stale key: every part of it is stale
            self._store(entry, _TRACE_PART, key, _trace_files(trace), errors)
        akey = {**key, "model": _model_key(model)}
        attributed = self._read_attributed(entry / self._attributed_part(akey), akey)
        self._logged(CacheStatus(str(p), trace_hit, attributed is not None,
                                 "; ".join(errors) or None))
        return trace, attributed

    def store_attributed(self, trace: Trace, model: ModelSpec | None,
                         attributed: pd.DataFrame) -> None:
        """Keep `attribute(trace, model)`'s table for the next `load` of the same file and
        model (not when the file changed since it was loaded, or is not a regular file)."""
        p = Path(trace.path)
        if not p.is_file():
            return
        key = self._key(p)
        akey = {**key, "model": _model_key(model)}
        errors: list[str] = []
        self._store(self._entry(key), self._attributed_part(akey), akey,
                    {_ATTRIBUTED: attributed}, errors)
        if errors and self.log:
            last = self.log[-1]
            self.log[-1] = dataclasses.replace(
                last, write_error="; ".join(filter(None, [last.write_error, *errors])))

    def _entry(self, key: dict) -> Path:
        return self.root / hashlib.sha256(key["path"].encode()).hexdigest()[:32]

    @staticmethod
    def _attributed_part(akey: dict) -> str:
        return f"{_ATTRIBUTED}-{_digest(akey['model'])[:16]}"

    def analysis(self, path: str | os.PathLike, arguments: Mapping[str, object],
                 compute: Callable[[], Analysis]) -> Analysis:
        """The `Analysis` of the trace at `path` under `arguments` (every argument it depends
        on but the trace: model, hardware, conventions, ...; an ncu CSV by path) from the
        cache, else `compute()` (which may `load` through this cache), stored. A path that is
        not a regular file, or an argument without a key (`_argument_key`), is never cached.
        On a hit, `log` gets a status with `analysis_hit` (nothing was parsed or attributed);
        on a miss, the status of compute's `load` gets any write error of the analysis."""
        p = Path(path)
        try:
            if not p.is_file():
                return compute()
            key = self._key(p)  # (the path as given: the Analysis names the trace by it)
            args = {"given": str(p), **{k: _argument_key(v) for k, v in arguments.items()}}
            args = json.loads(json.dumps(args))  # as the manifest will hold it (tuples: lists)
            digest = _digest(args)
        except (OSError, TypeError, ValueError):  # an ncu path that is not there: compute says so
            return compute()
        entry = self._entry(key)
        part = entry / f"{_ANALYSIS}-{digest[:16]}"
        akey = {**key, _ANALYSIS: args}
        cached = self._read_analysis(part, akey)
        if cached is not None:
            self._logged(CacheStatus(str(p), True, True, None, analysis_hit=True))
            return cached
        before = len(self.log)
        self._writes, self._write_errors = [], []
        try:
            result = compute()
            if self._key(p) == key:  # not when the file changed while it was analysed
                self._store(entry, part.name, akey, {_ANALYSIS + ".pickle": result}, [])
        finally:
            for write in self._writes:
                write.result()  # (_write reports its failures in _write_errors, never raises)
            if self._writer is not None:  # no thread outlives the call: the next trace's
                self._writer.shutdown()  # parse forks only from a single-threaded process
            self._writer, self._writes, errors = None, None, self._write_errors
        if errors and len(self.log) > before:
            last = self.log[-1]
            self.log[-1] = dataclasses.replace(
                last, write_error="; ".join(filter(None, [last.write_error, *errors])))
        return result

    def info(self) -> CacheInfo:
        """Entries, complete parts of each kind and bytes on disk (temporary leftovers
        included)."""
        entries = size = 0
        kinds: list[str] = []  # one per complete part: "trace", "attributed" or "analysis"
        for version in self._version_dirs():
            for entry in version.iterdir():
                found = list(entry.glob(f"*/{_MANIFEST}")) if entry.is_dir() else []
                entries += bool(found)
                kinds += (m.parent.name.partition("-")[0] for m in found)
            size += sum(f.stat().st_size for f in version.rglob("*") if f.is_file())
        return CacheInfo(self.directory, entries, kinds.count(_TRACE_PART),
                         kinds.count(_ATTRIBUTED), kinds.count(_ANALYSIS), size)

    def clear(self) -> int:
        """Remove every cached part (only the `v<N>` directories this module creates); return
        the bytes freed."""
        freed = self.info().total_bytes
        for version in self._version_dirs():
            shutil.rmtree(version, ignore_errors=True)
        return freed

    # ------------------------------------------------------------------------------------------
    def _logged(self, status: CacheStatus) -> CacheStatus:
        self.log.append(status)
        return status

    def _version_dirs(self) -> list[Path]:
        if not self.directory.is_dir():
            return []
        return [d for d in self.directory.iterdir() if d.is_dir() and _VERSION_DIR.match(d.name)]

    @staticmethod
    def _key(p: Path) -> dict:
        return {**files.identity(p), "schema": SCHEMA_VERSION, "code": code_fingerprint(),
                "pandas": pd.__version__, "pyarrow": pa.__version__}

    def _read_trace(self, part: Path, key: dict, given: str) -> Trace | None:
        """The cached Trace, its `path` (and `meta["path"]`) spelled as the caller gave it."""
        files = _verified(part, key)
        if files is None:
            return None
        try:
            fields = json.loads(files.pop(_FIELDS).read_bytes())
            tables = {name.removesuffix(".arrow"): _read_table(f) for name, f in files.items()}
        except (OSError, ValueError, pa.ArrowException):  # unreadable despite the checksum
            return None
        if fields.get("meta", {}).get("path") == fields.get("path"):
            fields["meta"]["path"] = given
        return Trace(**{**fields, **tables, "path": given})

    def _read_attributed(self, part: Path, key: dict) -> pd.DataFrame | None:
        files = _verified(part, key)
        if files is None:
            return None
        try:
            return _read_table(files[_ATTRIBUTED + ".arrow"])
        except (OSError, ValueError, pa.ArrowException):
            return None

    def _read_analysis(self, part: Path, key: dict) -> Analysis | None:
        files = _verified(part, key)
        if files is None:
            return None
        try:
            return _read_pickle(files[_ANALYSIS + ".pickle"])
        except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError,
                AttributeError, ImportError, IndexError,
                pa.ArrowException):  # unreadable despite the checksum
            return None

    def _store(self, entry: Path, name: str, key: dict, content: dict[str, Any],
               errors: list[str]) -> None:
        """Write one part (DataFrames as Arrow, a `*.pickle` name's value pickled, anything
        else into fields.json) to a temporary directory, then rename it to entry/name.
        Failures are appended to `errors` (to `_write_errors` while `analysis` computes: the
        files are then rendered here, and written by the background thread)."""
        if self._writes is not None:
            errors = self._write_errors
        try:
            files = _render(content)
        except (ValueError, TypeError, pa.ArrowException, pickle.PicklingError) as e:
            errors.append(f"cannot write {name} to {self.directory}: {e}")
            return
        if self._writes is None:
            self._write(entry, name, key, files, errors)
            return
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="trace-roofline-cache")
        self._writes.append(self._writer.submit(self._write, entry, name, key, files, errors))

    def _write(self, entry: Path, name: str, key: dict, files: dict[str, pa.Table | _Pickled | bytes],
               errors: list[str]) -> None:
        """Write rendered files (Arrow tables, bytes) and their manifest to a temporary
        directory, then rename it to entry/name; no pandas here (it runs on the writer
        thread)."""
        tmp = self.root / f".tmp-{secrets.token_hex(8)}"
        try:
            tmp.mkdir(parents=True)
            manifest: dict[str, dict] = {}
            for fname, data in files.items():
                if isinstance(data, pa.Table):
                    _write_table(data, tmp / fname)
                elif isinstance(data, _Pickled):
                    _write_pickle(data, tmp / fname)
                else:
                    (tmp / fname).write_bytes(data)
                manifest[fname] = {}
            for fname, rec in manifest.items():
                rec.update(bytes=(tmp / fname).stat().st_size, crc32=_crc32(tmp / fname))
            (tmp / _MANIFEST).write_text(json.dumps({"key": key, "files": manifest}))
            entry.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(entry / name, ignore_errors=True)  # a stale or corrupt part
            os.rename(tmp, entry / name)
        except (OSError, ValueError, pa.ArrowException) as e:
            errors.append(f"cannot write {name} to {self.directory}: "
                          f"{getattr(e, 'strerror', None) or e}")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class _Pickled:
    """A value pickled with its large buffers out of band (pickle protocol 5): `stream` refers
    to `buffers` (views of the value's own arrays) by position. Pickling copies nothing big;
    the buffers are read by `_write_pickle` on the writer thread, before `analysis` returns."""

    stream: bytes
    buffers: list[pickle.PickleBuffer]


def _render(content: dict[str, Any]) -> dict[str, pa.Table | _Pickled | bytes]:
    """A part's files: each DataFrame as an Arrow table (<name>.arrow), a `*.pickle` name's
    value pickled (`_Pickled`), everything else together as fields.json."""
    files: dict[str, pa.Table | _Pickled | bytes] = {}
    fields = {}
    for k, v in content.items():
        if k.endswith(".pickle"):
            buffers: list[pickle.PickleBuffer] = []
            stream = pickle.dumps(v, protocol=5, buffer_callback=buffers.append)
            files[k] = _Pickled(stream, buffers)
        elif isinstance(v, pd.DataFrame):
            files[k + ".arrow"] = pa.Table.from_pandas(v)
        else:
            fields[k] = v
    if fields:
        text = json.dumps(fields)
        if json.loads(text) != fields:
            raise ValueError("trace fields do not round-trip through JSON")
        files[_FIELDS] = text.encode()
    return files


def _trace_files(trace: Trace) -> dict[str, Any]:
    """Every field of the Trace: tables as DataFrames, the rest (path, meta, ...) as is."""
    return {f.name: getattr(trace, f.name) for f in dataclasses.fields(trace)}


def _crc32(path: Path) -> int:
    with pa.memory_map(str(path)) as m:
        return zlib.crc32(m.read_buffer())


def _verified(part: Path, key: dict) -> dict[str, Any] | None:
    """name -> file of the part, when it was built for `key` and every file has its recorded
    length and CRC-32; else None."""
    try:
        manifest = json.loads((part / _MANIFEST).read_bytes())
        if manifest.get("key") != key:
            return None
        files: dict[str, Any] = {}
        for name, rec in manifest["files"].items():
            f = part / name
            if f.stat().st_size != rec["bytes"] or _crc32(f) != rec["crc32"]:
                return None
            files[name] = f
        return files
    except (OSError, ValueError, KeyError, TypeError, AttributeError, pa.ArrowException):
        return None


def _write_table(table: pa.Table, path: Path) -> None:
    """Write `table` (from_pandas: with pandas metadata for the dtypes) as one Arrow IPC
    file, its buffers compressed with CODEC."""
    options = ipc.IpcWriteOptions(compression=CODEC)
    with ipc.new_file(str(path), table.schema, options=options) as w:
        w.write_table(table)


def _write_pickle(data: _Pickled, path: Path) -> None:
    """Write a `_Pickled` as one CODEC-compressed stream (plain without a codec): the lengths
    of the pickle stream and of each buffer (little-endian uint64, the count first), then the
    stream, then the buffers."""
    chunks = [data.stream, *(b.raw() for b in data.buffers)]
    lengths = np.array([len(chunks) - 1, *(memoryview(c).nbytes for c in chunks)], dtype="<u8")
    with (pa.CompressedOutputStream(str(path), CODEC) if CODEC else pa.OSFile(str(path), "wb")
          ) as out:
        out.write(lengths.tobytes())
        for c in chunks:
            out.write(c)


def _read_pickle(path: Path) -> Any:
    """The value `_write_pickle` wrote. Its buffers are slices of one writable bytearray, so
    the arrays unpickled over them are writable and nothing is copied twice."""
    with (pa.CompressedInputStream(pa.OSFile(str(path)), CODEC) if CODEC
          else pa.OSFile(str(path))) as stream:
        count = int(np.frombuffer(stream.read(8), dtype="<u8")[0])
        lengths = np.frombuffer(stream.read(8 * (count + 1)), dtype="<u8").astype(np.int64)
        data = bytearray(int(lengths.sum()))
        view, got = memoryview(data), 0
        while got < len(data):
            n = stream.readinto(view[got:])
            if not n:
                raise EOFError(f"{path}: shorter than its lengths say")
            got += n
    ends = np.cumsum(lengths).tolist()
    parts = [view[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]
    return pickle.loads(parts[0], buffers=parts[1:])


def _read_table(path: Path) -> pd.DataFrame:
    """Memory-map one Arrow IPC file and rebuild the DataFrame: columns decompressed from the
    map, categoricals from their dictionaries."""
    with pa.memory_map(str(path)) as source:
        return ipc.open_file(source).read_all().to_pandas()
