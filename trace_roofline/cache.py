"""Columnar cache of parsed traces and their attribution, in the user's cache directory.

A trace's tables (`Trace`) and its `attribute()` output (which depends on the trace and the model,
not on hardware or conventions) are kept as Arrow IPC files, so a re-run of the same file maps
them instead of parsing JSON again. Nothing is ever written next to the user's file.

Layout, under `cache_dir()` (`$TRACE_ROOFLINE_CACHE_DIR`, else `$XDG_CACHE_HOME/trace-roofline`,
else `~/.cache/trace-roofline`)::

    v<SCHEMA_VERSION>/<sha256(absolute path)[:32]>/     one entry per source file
        trace/                   <table>.arrow per Trace table, fields.json, manifest.json
        attributed-<model hash>/  attributed.arrow, manifest.json   (one per model, or none)

Each part (`trace/`, `attributed-*/`) is written whole into a temporary directory and renamed
into place, so it is complete or absent. Its `manifest.json` holds the key it was built for
(absolute path, size, mtime_ns and inode of the source file; SCHEMA_VERSION; a fingerprint of
the analyzer's source code, which changes with the package version and any column schema; the
pandas and pyarrow versions; the model for an attribution) and every file's length and CRC-32.
A part is used only when its key equals the current one and every file has its recorded length
and checksum (zlib's CRC-32 runs at several GB/s); anything else (stale, truncated, flipped
bytes, unreadable) is ignored and rewritten, never trusted.

Categorical columns are stored as Arrow dictionaries and everything else as plain Arrow columns
(with pandas' metadata), so a hit gives DataFrames identical to a parse, dtypes included.
String columns stay plain rather than dictionary-encoded: kernel names are long (the
attribution of a 1 GB trace holds 143 MB of them), and rebuilding them from a dictionary took
0.8 s where reading them from the map is free.
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
import re
import secrets
import shutil
import zlib
from functools import cache
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.ipc as ipc

from trace_roofline.attribute import attribute
from trace_roofline.models import ModelSpec
from trace_roofline.trace import Progress, Trace, load_trace

SCHEMA_VERSION = 1  # bump when the layout or the meaning of a cached file changes
ENV_DIR = "TRACE_ROOFLINE_CACHE_DIR"
_VERSION_DIR = re.compile(r"^v\d+$")  # `clear` removes only directories named like ours
_MANIFEST = "manifest.json"
_FIELDS = "fields.json"
_TRACE_PART = "trace"
_ATTRIBUTED = "attributed"


@dataclasses.dataclass(frozen=True)
class CacheStatus:
    """What one `TraceCache.load` did: which parts came from the cache, and why a write failed."""

    path: str
    trace_hit: bool
    attribution_hit: bool
    write_error: str | None = None  # "<what>: <reason>" when storing a part failed


@dataclasses.dataclass(frozen=True)
class CacheInfo:
    """The cache directory and what it holds (entries = cached source files)."""

    directory: Path
    entries: int
    parts: int
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


class TraceCache:
    """The cache at `directory` (default `cache_dir()`); `load` is the one entry point."""

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        self.directory = Path(directory) if directory is not None else cache_dir()
        self.root = self.directory / f"v{SCHEMA_VERSION}"
        self.log: list[CacheStatus] = []  # one status per load(), in call order

    # ------------------------------------------------------------------------------------------
    def load(self, path: str | os.PathLike, model: ModelSpec | None = None,
             progress: Progress | None = None) -> tuple[Trace, pd.DataFrame, CacheStatus]:
        """The trace at `path` and `attribute(trace, model)`, each from the cache when a valid
        part is there, else computed and stored. A directory (or anything but a regular file,
        so that load_trace reports a missing one) is loaded uncached."""
        p = Path(path)
        if not p.is_file():
            trace = load_trace(p, progress=progress)
            return trace, attribute(trace, model), self._logged(CacheStatus(str(p), False, False))
        key = self._key(p)
        entry = self.root / hashlib.sha256(key["path"].encode()).hexdigest()[:32]
        errors: list[str] = []
        trace = self._read_trace(entry / _TRACE_PART, key, str(p))
        trace_hit = trace is not None
        if trace is None:
            trace = load_trace(p, progress=progress)
            shutil.rmtree(entry, ignore_errors=True)  # stale key: every part of it is stale
            self._store(entry, _TRACE_PART, key, _trace_files(trace), errors)
        akey = {**key, "model": _model_key(model)}
        apart = f"{_ATTRIBUTED}-{_digest(akey['model'])[:16]}"
        attributed = self._read_attributed(entry / apart, akey)
        attribution_hit = attributed is not None
        if attributed is None:
            attributed = attribute(trace, model)
            self._store(entry, apart, akey, {_ATTRIBUTED: attributed}, errors)
        return trace, attributed, self._logged(
            CacheStatus(str(p), trace_hit, attribution_hit, "; ".join(errors) or None))

    def info(self) -> CacheInfo:
        """Entries, complete parts and bytes on disk (temporary leftovers included)."""
        entries = parts = size = 0
        for version in self._version_dirs():
            for entry in version.iterdir():
                found = list(entry.glob(f"*/{_MANIFEST}")) if entry.is_dir() else []
                entries += bool(found)
                parts += len(found)
            size += sum(f.stat().st_size for f in version.rglob("*") if f.is_file())
        return CacheInfo(self.directory, entries, parts, size)

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
        st = p.stat()
        return {"path": str(p.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                "inode": st.st_ino, "schema": SCHEMA_VERSION, "code": code_fingerprint(),
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

    def _store(self, entry: Path, name: str, key: dict, content: dict[str, Any],
               errors: list[str]) -> None:
        """Write one part (DataFrames as Arrow, anything else into fields.json) to a temporary
        directory, then rename it to entry/name. Failures are appended to `errors`."""
        tmp = self.root / f".tmp-{secrets.token_hex(8)}"
        try:
            tmp.mkdir(parents=True)
            manifest: dict[str, dict] = {}
            fields = {k: v for k, v in content.items() if not isinstance(v, pd.DataFrame)}
            if fields:
                text = json.dumps(fields)
                if json.loads(text) != fields:
                    raise ValueError("trace fields do not round-trip through JSON")
                (tmp / _FIELDS).write_text(text)
                manifest[_FIELDS] = {}
            for k, df in content.items():
                if isinstance(df, pd.DataFrame):
                    _write_table(df, tmp / (k + ".arrow"))
                    manifest[k + ".arrow"] = {}
            for fname, rec in manifest.items():
                rec.update(bytes=(tmp / fname).stat().st_size, crc32=_crc32(tmp / fname))
            (tmp / _MANIFEST).write_text(json.dumps({"key": key, "files": manifest}))
            entry.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(entry / name, ignore_errors=True)  # a stale or corrupt part
            os.rename(tmp, entry / name)
        except (OSError, ValueError, TypeError, pa.ArrowException) as e:
            errors.append(f"cannot write {name} to {self.directory}: "
                          f"{getattr(e, 'strerror', None) or e}")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


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


def _write_table(df: pd.DataFrame, path: Path) -> None:
    """Write `df` as one Arrow IPC file (one record batch, pandas metadata for the dtypes)."""
    table = pa.Table.from_pandas(df)
    with ipc.new_file(str(path), table.schema) as w:
        w.write_table(table)


def _read_table(path: Path) -> pd.DataFrame:
    """Memory-map one Arrow IPC file and rebuild the DataFrame: numbers and strings come
    straight from the map, categoricals from their dictionaries."""
    with pa.memory_map(str(path)) as source:
        return ipc.open_file(source).read_all().to_pandas()
