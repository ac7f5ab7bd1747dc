"""Columnar cache of parsed traces, their attribution and finished analyses, private to the user.

Design notes: docs/design.md ("trace_roofline/cache.py").
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import shutil
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache, cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from trace_roofline import files
from trace_roofline.cachedir import (
    ANALYSIS,
    ATTRIBUTED,
    READ_ERRORS,
    SCHEMA_VERSION,
    TRACE_PART,
    CacheDir,
    CacheInfo,
    cache_base,
    cache_dir,
    code_fingerprint,
    digest,
    owned_dir,
)
from trace_roofline.model.models import ModelSpec
from trace_roofline.trace import Progress, Trace, load_trace

if TYPE_CHECKING:
    from trace_roofline.roofline import Analysis

# (the directory's names live in cachedir, which loads no pandas; kept importable from here)
__all__ = ["SCHEMA_VERSION", "CacheInfo", "CacheStatus", "TraceCache", "cache_base", "cache_dir",
           "code_fingerprint"]

CODEC = "zstd" if pa.Codec.is_available("zstd") else None  # (pyarrow's wheels all have it)
# An Analysis's frames, read whole on every hit, decompress 2-3x faster as LZ4 (~3x larger).
FRAME_CODEC = "lz4" if pa.Codec.is_available("lz4") else CODEC
_FRAME = "frame-"  # frame-<i>.arrow: an Analysis's DataFrames (written with FRAME_CODEC)
_FIELDS = "fields.json"
_ANALYSIS_TREE = "analysis.json"
_READ_ERRORS = (*READ_ERRORS, pa.ArrowException)


@dataclasses.dataclass(frozen=True)
class CacheStatus:
    """What one `TraceCache.load` did: which parts came from the cache, and why a write failed."""

    path: str
    trace_hit: bool
    attribution_hit: bool
    write_error: str | None = None  # "<what>: <reason>" when storing a part failed
    analysis_hit: bool = False  # the whole Analysis came from the cache (TraceCache.analysis)


def _model_key(model: ModelSpec | None) -> dict | None:
    """The model's fields and its architecture (family, layer layout) as the manifest's JSON
    reads them back (tuples as lists)."""
    if model is None:
        return None
    return json.loads(json.dumps({"type": type(model).__name__, **dataclasses.asdict(model),
                                  "architecture": dataclasses.asdict(model.architecture)}))


def _argument_key(value: object) -> object:
    """A JSON-able key for one analysis argument: None, bool, int, float and str as they are,
    lists, tuples and str-keyed dicts of those (AnalysisOptions.cache_key's), a dataclass
    (model, hardware) as its type name and fields, a path as its file's key (an ncu CSV: its
    content may change). TypeError for anything else (then nothing is cached)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_argument_key(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _argument_key(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"type": type(value).__name__, **dataclasses.asdict(value)}
    if isinstance(value, os.PathLike):
        return {"file": files.identity(Path(value))}
    raise TypeError(f"no cache key for {type(value).__name__}")


class TraceCache(CacheDir):
    """The cache at `directory` (default `cache_dir()`; its version directories in
    `cache_base(directory)`); `load` is the one entry point."""

    WRITE_ERRORS = (OSError, ValueError, pa.ArrowException)

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        super().__init__(directory)
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
        entry = self.entry(key["path"])
        errors: list[str] = []
        trace = self._read_trace(entry / TRACE_PART, key, str(p))
        trace_hit = trace is not None
        if trace is None:
            trace = load_trace(p, progress=progress)
            if owned_dir(entry):  # (another user's files are never removed)
                shutil.rmtree(entry, ignore_errors=True)  # stale key: every part of it is stale
            self._store(entry, TRACE_PART, key, _trace_files(trace), errors)
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
        self._store(self.entry(key["path"]), self._attributed_part(akey), akey,
                    {ATTRIBUTED: attributed}, errors)
        if errors and self.log:
            last = self.log[-1]
            self.log[-1] = dataclasses.replace(
                last, write_error="; ".join(filter(None, [last.write_error, *errors])))

    @staticmethod
    def _attributed_part(akey: dict) -> str:
        return f"{ATTRIBUTED}-{digest(akey['model'])[:16]}"

    def analysis(self, path: str | os.PathLike, arguments: Mapping[str, object],
                 compute: Callable[[], Analysis]) -> Analysis:
        """The `Analysis` of the trace at `path` under `arguments` (every argument it depends
        on but the trace: model, hardware, AnalysisOptions.cache_key's) from the cache, else
        `compute()` (which may `load` through this cache), stored. A path that is not a
        regular file, or an argument without a key (`_argument_key`), is never cached.
        On a hit, `log` gets a status with `analysis_hit` (nothing was parsed or attributed);
        on a miss, the status of compute's `load` gets any write error of the analysis."""
        p = Path(path)
        try:
            if not p.is_file():
                return compute()
            key = self._key(p)  # (the path as given: the Analysis names the trace by it)
            args = {"given": str(p), **{k: _argument_key(v) for k, v in arguments.items()}}
            args = json.loads(json.dumps(args))  # as the manifest will hold it (tuples: lists)
            args_digest = digest(args)
        except (OSError, TypeError, ValueError):  # an ncu path that is not there: compute says so
            return compute()
        entry = self.entry(key["path"])
        part = entry / f"{ANALYSIS}-{args_digest[:16]}"
        akey = {**key, ANALYSIS: args}
        cached = self._read_analysis(part, akey)
        if cached is not None:
            self._logged(CacheStatus(str(p), True, True, None, analysis_hit=True))
            return cached
        before = len(self.log)
        self._writes, self._write_errors = [], []
        try:
            result = compute()
            if self._key(p) == key:  # not when the file changed while it was analysed
                self._store(entry, part.name, akey, {ANALYSIS: result}, [])
        finally:
            for write in self._writes:
                write.result()  # (write reports its failures in _write_errors, never raises)
            if self._writer is not None:  # no thread outlives the call: the next trace's
                self._writer.shutdown()  # parse forks only from a single-threaded process
            self._writer, self._writes, errors = None, None, self._write_errors
        if errors and len(self.log) > before:
            last = self.log[-1]
            self.log[-1] = dataclasses.replace(
                last, write_error="; ".join(filter(None, [last.write_error, *errors])))
        return result

    def write_file(self, data: object, path: Path) -> None:
        """Write one rendered file: an Arrow table (compressed), or bytes as they are."""
        if isinstance(data, pa.Table):
            _write_table(data, path, FRAME_CODEC if path.name.startswith(_FRAME) else CODEC)
        else:
            super().write_file(data, path)

    # ------------------------------------------------------------------------------------------
    def _logged(self, status: CacheStatus) -> CacheStatus:
        self.log.append(status)
        return status

    @staticmethod
    def _key(p: Path) -> dict:
        return {**files.identity(p), "schema": SCHEMA_VERSION, "code": code_fingerprint(),
                "pandas": pd.__version__, "pyarrow": pa.__version__}

    def _read_trace(self, part: Path, key: dict, given: str) -> Trace | None:
        """The cached Trace, its `path` (and `meta["path"]`) spelled as the caller gave it."""
        found = self.verified(part, key)
        if found is None:
            return None
        try:
            fields = json.loads(found.pop(_FIELDS).read_bytes())
            if not isinstance(fields, dict) or not all(n.endswith(".arrow") for n in found):
                return None
            tables = {name.removesuffix(".arrow"): _read_table(f) for name, f in found.items()}
            if fields.get("meta", {}).get("path") == fields.get("path"):
                fields["meta"]["path"] = given
            return Trace(**{**fields, **tables, "path": given})
        except _READ_ERRORS:  # a manifest without one of its files, unreadable despite the CRC
            return None

    def _read_attributed(self, part: Path, key: dict) -> pd.DataFrame | None:
        found = self.verified(part, key)
        if found is None or set(found) != {ATTRIBUTED + ".arrow"}:
            return None
        try:
            return _read_table(found[ATTRIBUTED + ".arrow"])
        except _READ_ERRORS:
            return None

    def _read_analysis(self, part: Path, key: dict) -> Analysis | None:
        found = self.verified(part, key)
        if found is None or _ANALYSIS_TREE not in found:
            return None
        try:
            tree = json.loads(found.pop(_ANALYSIS_TREE).read_bytes())
            return _decode_analysis(tree, found)
        except _READ_ERRORS:  # (_decode's schema errors are ValueErrors)
            return None

    def _store(self, entry: Path, name: str, key: dict, content: dict[str, Any],
               errors: list[str]) -> None:
        """Write one part (DataFrames as Arrow, an `Analysis` as `_encode_analysis` gives it,
        anything else into fields.json) to a temporary directory, then rename it to
        entry/name. Failures are appended to `errors` (to `_write_errors` while `analysis`
        computes: the files are then rendered here, and written by the background thread)."""
        if self._writes is not None:
            errors = self._write_errors
        try:
            rendered = _render(content)
        except (ValueError, TypeError, pa.ArrowException) as e:
            errors.append(f"cannot write {name} to {self.base}: {e}")
            return
        if self._writes is None:
            self.write(entry, name, key, rendered, errors)
            return
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="trace-roofline-cache")
        self._writes.append(self._writer.submit(self.write, entry, name, key, rendered, errors))


def _render(content: dict[str, Any]) -> dict[str, pa.Table | bytes]:
    """A part's files: an `Analysis` (the `ANALYSIS` name) as `_encode_analysis` gives it,
    each other DataFrame as an Arrow table (<name>.arrow), everything else together as
    fields.json."""
    out: dict[str, pa.Table | bytes] = {}
    fields = {}
    for k, v in content.items():
        if k == ANALYSIS:
            out.update(_encode_analysis(v))
        elif isinstance(v, pd.DataFrame):
            out[k + ".arrow"] = pa.Table.from_pandas(v)
        else:
            fields[k] = v
    if fields:
        text = json.dumps(fields)
        if json.loads(text) != fields:
            raise ValueError("trace fields do not round-trip through JSON")
        out[_FIELDS] = text.encode()
    return out


def _trace_files(trace: Trace) -> dict[str, Any]:
    """Every field of the Trace: tables as DataFrames, the rest (path, meta, ...) as is."""
    return {f.name: getattr(trace, f.name) for f in dataclasses.fields(trace)}


def _write_table(table: pa.Table, path: Path, codec: str | None = CODEC) -> None:
    """Write `table` (from_pandas: with pandas metadata for the dtypes) as one Arrow IPC
    file, its buffers compressed with `codec`."""
    options = ipc.IpcWriteOptions(compression=codec)
    with ipc.new_file(str(path), table.schema, options=options) as w:
        w.write_table(table)


def _read_table(path: Path) -> pd.DataFrame:
    """Memory-map one Arrow IPC file and rebuild the DataFrame: columns decompressed from the
    map, categoricals from their dictionaries."""
    with pa.memory_map(str(path)) as source:
        return ipc.open_file(source).read_all().to_pandas()


# ---------------------------------------------------------------------------------------------
# The Analysis codec: a JSON tree of allow-listed types, its DataFrames as Arrow files.

# The modules whose dataclasses an Analysis is made of: only these are ever built from a cache.
_CLASS_MODULES = ("trace_roofline.roofline", "trace_roofline.model.models",
                  "trace_roofline.model.moe", "trace_roofline.model.hardware",
                  "trace_roofline.model.architecture", "trace_roofline.attribution.graphs",
                  "trace_roofline.attribution.kind")
# Attributes an instance may carry besides its fields: the architecture a ModelSpec was built
# from (ModelSpec.from_architecture). Any other one (but a cached_property's) is refused.
_EXTRA_STATE: dict[str, tuple[str, ...]] = {"trace_roofline.model.models.ModelSpec": ("_architecture",)}
_NUMPY_KINDS = "biuf"  # numpy scalars and columns of bool, int, uint and float are stored
_MASKED = {"boolean", *(f"{k}{n}" for k in ("Int", "UInt") for n in (8, 16, 32, 64)),
           "Float32", "Float64"}


class _Malformed(ValueError):
    """A cached analysis tree that is not one `_encode` writes."""


@cache
def _classes() -> dict[str, type]:
    """Every dataclass defined in `_CLASS_MODULES`, by module-qualified name."""
    out: dict[str, type] = {}
    for name in _CLASS_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:  # (a checkout without that module: no such classes)
            if e.name != name:
                raise
            continue
        for obj in vars(module).values():
            if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == name:
                out[f"{name}.{obj.__qualname__}"] = obj
    return out


def _analysis_class() -> type:
    return _classes()["trace_roofline.roofline.Analysis"]


def _encode_analysis(analysis: Analysis) -> dict[str, pa.Table | bytes]:
    """analysis.json (the tree) and frame-<i>.arrow (its DataFrames); TypeError when it holds
    a value of any type but those `_Encoder` stores."""
    if type(analysis) is not _analysis_class():
        raise TypeError(f"{type(analysis).__name__} is not an Analysis")
    enc = _Encoder()
    tree = enc.node(analysis)
    return {_ANALYSIS_TREE: json.dumps(tree, separators=(",", ":")).encode(), **enc.frames}


def _decode_analysis(tree: object, found: dict[str, Path]) -> Analysis:
    """The Analysis `_encode_analysis` wrote, its frames read from `found` (name -> file);
    _Malformed unless the tree, its classes, fields, files and dtypes are exactly as written
    (every file used once)."""
    dec = _Decoder(found)
    value = dec.node(tree)
    if type(value) is not _analysis_class() or dec.unused():
        raise _Malformed("not one Analysis with each of its frames")
    return cast("Analysis", value)


class _Encoder:
    """Values as JSON nodes: None, bool, int, float and str as they are; a list as a JSON
    array; a list or str-keyed dict of nothing but those as {"$": "json", "value": it} (read
    back as json.loads gives it: the calibration data of a measured Hardware, coverage, ...);
    {"$": "tuple" | "dict" | "np" | "frame" | "dataclass", ...} for the rest."""

    def __init__(self) -> None:
        self.frames: dict[str, pa.Table] = {}

    def node(self, v: object) -> object:
        t = type(v)
        if v is None or t in (bool, int, float, str):
            return v
        if t in (list, dict) and _plain(v):
            return {"$": "json", "value": v}
        if t is list:
            return [self.node(x) for x in v]  # type: ignore[attr-defined]
        if t is tuple:
            return {"$": "tuple", "items": [self.node(x) for x in v]}  # type: ignore[attr-defined]
        if t is dict:
            return {"$": "dict", "items": [[self.node(k), self.node(x)]
                                           for k, x in v.items()]}  # type: ignore[attr-defined]
        if isinstance(v, np.generic) and v.dtype.kind in _NUMPY_KINDS:
            return {"$": "np", "dtype": v.dtype.name, "value": v.item()}
        if t is pd.DataFrame:
            return self._frame(v)  # type: ignore[arg-type]
        if dataclasses.is_dataclass(v) and _classes().get(_qualified(t)) is t:
            return self._dataclass(v)
        raise TypeError(f"a {t.__module__}.{t.__qualname__} is not cached")

    def _dataclass(self, v: Any) -> dict:
        name = _qualified(type(v))
        fields = {f.name: self.node(getattr(v, f.name)) for f in dataclasses.fields(v)}
        state = {}
        for k, x in getattr(v, "__dict__", {}).items():
            if k in fields or isinstance(getattr(type(v), k, None), cached_property):
                continue  # (a cached_property is derived: computed again after a hit)
            if k not in _EXTRA_STATE.get(name, ()):
                raise TypeError(f"a {name} with attribute {k!r} is not cached")
            state[k] = self.node(x)
        return {"$": "dataclass", "class": name, "fields": fields, "state": state}

    def _frame(self, df: pd.DataFrame) -> dict:
        if df.attrs:
            raise TypeError("a DataFrame with attrs is not cached")
        columns = list(df.columns)
        if (type(df.columns) is not pd.Index or not all(type(c) is str for c in columns)
                or len(set(columns)) != len(columns)):
            raise TypeError("a DataFrame whose column names are not unique strings is not cached")
        index = df.index
        if (type(index) is not pd.RangeIndex and not (type(index) is pd.Index
                                                       and _storable(index.dtype))
                or not (index.name is None or type(index.name) is str)):
            raise TypeError(f"a DataFrame with a {type(index).__name__} is not cached")
        for c, d in df.dtypes.items():
            if not _storable(d):
                raise TypeError(f"a DataFrame column {c!r} of dtype {d} is not cached")
        name = f"{_FRAME}{len(self.frames)}.arrow"
        table, packed = _packed(pa.Table.from_pandas(df))
        self.frames[name] = table
        return {"$": "frame", "file": name, "columns": columns, "packed": packed,
                "dtypes": [_dtype_name(d) for d in df.dtypes], "index": _index_name(index)}


class _Decoder:
    """`_Encoder`'s nodes back to values, checking every node against what it writes."""

    def __init__(self, found: dict[str, Path]) -> None:
        self.found = found
        self.used: set[str] = set()

    def unused(self) -> set[str]:
        return set(self.found) - self.used

    def node(self, n: object) -> object:
        t = type(n)
        if n is None or t in (bool, int, float, str):
            return n
        if t is list:
            return [self.node(x) for x in n]  # type: ignore[attr-defined]
        if t is not dict:
            raise _Malformed(f"a {t.__name__} node")
        d = cast("dict[str, object]", n)  # json.loads' dict: str keys
        tag = d.get("$")
        if tag == "json":
            (value,) = _only(d, "value")  # (as json.loads built it: only JSON's own types)
            return value
        if tag == "tuple":
            (items,) = _only(d, "items")
            return tuple(self.node(x) for x in _list(items))
        if tag == "dict":
            (items,) = _only(d, "items")
            pairs = [_list(p) for p in _list(items)]
            if any(len(p) != 2 for p in pairs):
                raise _Malformed("a dict item is not a pair")
            return {self.node(k): self.node(x) for k, x in pairs}
        if tag == "np":
            return _numpy_scalar(*_only(d, "dtype", "value"))
        if tag == "frame":
            return self._frame(*_only(d, "file", "columns", "packed", "dtypes", "index"))
        if tag == "dataclass":
            return self._dataclass(*_only(d, "class", "fields", "state"))
        raise _Malformed(f"node tag {tag!r}")

    def _dataclass(self, name: object, fields: object, state: object) -> object:
        cls = _classes().get(name) if isinstance(name, str) else None
        if cls is None or not isinstance(fields, dict) or not isinstance(state, dict):
            raise _Malformed(f"class {name!r}")
        declared = dataclasses.fields(cls)
        if set(fields) != {f.name for f in declared}:
            raise _Malformed(f"the fields of {name}")
        if not set(state) <= set(_EXTRA_STATE.get(cast(str, name), ())):  # a str: `cls` was found
            raise _Malformed(f"the attributes of {name}")
        values = {k: self.node(v) for k, v in fields.items()}
        obj = cls(**{f.name: values[f.name] for f in declared if f.init})
        for f in declared:
            if not f.init:
                object.__setattr__(obj, f.name, values[f.name])
        for k, v in state.items():
            object.__setattr__(obj, k, self.node(v))
        return obj

    def _frame(self, name: object, columns: object, packed: object, dtypes: object,
               index: object) -> pd.DataFrame:
        if not isinstance(name, str) or name not in self.found or name in self.used:
            raise _Malformed(f"frame file {name!r}")
        self.used.add(name)
        with pa.memory_map(str(self.found[name])) as source:
            df = _unpacked(ipc.open_file(source).read_all(), packed).to_pandas()
        if (list(df.columns) != columns or [_dtype_name(d) for d in df.dtypes] != dtypes
                or _index_name(df.index) != index):
            raise _Malformed(f"{name}: not the columns, dtypes or index it was written with")
        return df


def _plain(v: object) -> bool:
    """Made of JSON's own types only: None, bool, int, float, str, lists and str-keyed dicts."""
    t = type(v)
    if v is None or t in (bool, int, float, str):
        return True
    if t is list:
        return all(map(_plain, v))  # type: ignore[call-overload]
    if t is dict:
        return all(type(k) is str for k in v) and all(map(_plain, v.values()))  # type: ignore[attr-defined]
    return False


def _packed(table: pa.Table) -> tuple[pa.Table, list[int]]:
    """The table with its string columns dictionary-encoded (a costed frame's repeated names:
    ~3x smaller files, read as fast), and their positions."""
    packed = [i for i, t in enumerate(table.schema.types)
              if pa.types.is_string(t) or pa.types.is_large_string(t)]
    for i in packed:
        column = pc.dictionary_encode(table.column(i))
        table = table.set_column(i, pa.field(table.schema.field(i).name, column.type), column)
    return table, packed


def _unpacked(table: pa.Table, packed: object) -> pa.Table:
    """`_packed`'s table back: the listed columns, dictionaries of strings, as plain strings."""
    if type(packed) is not list or not all(type(i) is int for i in packed):
        raise _Malformed("packed columns")
    columns = table.columns
    for i in packed:
        if not 0 <= i < len(columns):
            raise _Malformed(f"packed column {i}")
        t = columns[i].type
        if not (pa.types.is_dictionary(t) and (pa.types.is_string(t.value_type)
                                               or pa.types.is_large_string(t.value_type))):
            raise _Malformed(f"packed column {i} is a {t}")
        columns[i] = columns[i].cast(t.value_type)
    return pa.Table.from_arrays(columns, names=table.column_names, metadata=table.schema.metadata)


def _only(n: dict, *keys: str) -> list:
    """The values of exactly these keys (besides the tag) of a node."""
    if set(n) != {"$", *keys}:
        raise _Malformed(f"node keys {sorted(n)}")
    return [n[k] for k in keys]


def _list(v: object) -> list:
    if type(v) is not list:
        raise _Malformed("not a list")
    return v  # type: ignore[return-value]


def _numpy_scalar(dtype: object, value: object) -> np.generic:
    if not isinstance(dtype, str) or type(value) not in (bool, int, float):
        raise _Malformed("numpy scalar")
    try:
        d = np.dtype(dtype)
    except TypeError:
        raise _Malformed(f"numpy dtype {dtype!r}") from None
    if d.kind not in _NUMPY_KINDS or d.name != dtype:
        raise _Malformed(f"numpy dtype {dtype!r}")
    return d.type(value)


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _storable(d: object) -> bool:
    """A column dtype whose values Arrow gives back exactly: numpy bool/int/uint/float, the
    masked ones (Int64, boolean, ...), strings, and categoricals of those."""
    if isinstance(d, pd.CategoricalDtype):
        return _storable(d.categories.dtype)
    if isinstance(d, np.dtype):
        return d.kind in _NUMPY_KINDS
    return isinstance(d, pd.StringDtype) or getattr(d, "name", None) in _MASKED


def _dtype_name(d: object) -> str:
    """A dtype exactly (a string column's storage and missing value included), a categorical
    by its categories' dtype and order flag (not its categories)."""
    if isinstance(d, pd.CategoricalDtype):
        return f"category[{_dtype_name(d.categories.dtype)}, ordered={d.ordered}]"
    return repr(d)


def _index_name(index: pd.Index) -> str:
    if type(index) is pd.RangeIndex:
        return f"range({index.start}, {index.stop}, {index.step}, name={index.name!r})"
    return f"{_dtype_name(index.dtype)}, name={index.name!r}"
