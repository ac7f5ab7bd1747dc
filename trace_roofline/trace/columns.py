"""Decoded events -> columns: each batch of events becomes column chunks at once, then the
chunks become the tables of schema.py. A batch comes either as the compiled scanner's columns
(`Accumulator.scan`: its string and raw-key codes re-coded to the interners below, new values
in first-seen order) or as msgspec structs (decode.py; `Accumulator.add`, described here).

Design notes: docs/design.md ("trace_roofline/trace/columns.py").
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from itertools import compress, repeat
from operator import attrgetter
from typing import Any

import msgspec
import numpy as np
import pandas as pd

try:
    import trace_roofline.trace._scan as _scan
except ImportError:  # (not built: no C compiler at install)
    _scan = None
from trace_roofline.trace import fields
from trace_roofline.trace.fields import TABLES
from trace_roofline.trace.schema import FLOW_PH, MAX_DUR_US, MAX_TS_US, MISSING, SKIP_REASONS, build_tables

# Table codes. Device kinds first so that kind = code - 1.
_KERNEL, _MEMCPY, _MEMSET, _CPU_OP, _RUNTIME, _ANNOT, _PYFRAME, _FLOW = range(1, 9)
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


_PH_CODES = {"X": 1, "s": 2, "f": 3}
# The compiled scanner's type (see Accumulator.scan), None where it is not built; tests and
# benchmarks set it to None to read the msgspec way alone.
# A build whose columns are not fields.py's (stale) is not used either.
_SCANNED = (fields.I32_COLUMNS, fields.F64_COLUMNS, fields.I64_COLUMNS)
SCANNER = _scan.Scanner if _scan is not None and (
    _scan.I32_COLUMNS, _scan.F64_COLUMNS, _scan.I64_COLUMNS) == _SCANNED else None
_ABSENT = {None: MISSING}  # flows: ph code - 2 indexes FLOW_PH

_TABLE_CODES = {
    "device": (_KERNEL, _MEMCPY, _MEMSET),
    "cpu_ops": (_CPU_OP,),
    "runtime": (_RUNTIME,),
    "annotations": (_ANNOT,),
    "python_frames": (_PYFRAME,),
    "flows": (_FLOW,),
}


_ts_of, _dur_of, _cat_of, _ph_of, _args_of = (attrgetter(a) for a in ("ts", "dur", "cat", "ph", "args"))
# table code -> index of its table in TABLES (0 for the unkept code 0: never looked up)
_TABLE_OF_CODE = np.zeros(_FLOW + 1, dtype=np.int64)
for _i, _codes in enumerate(_TABLE_CODES.values()):
    _TABLE_OF_CODE[list(_codes)] = _i
_WITH_ARGS = {t for t, fields in TABLES.items()
              if any(p.startswith("args.") for paths, _ in fields.values() for p in paths)}


def _getter(path: str) -> tuple[str, Callable]:
    """("event" or "args", the attrgetter reading `path` there): an event's args are gathered
    once per table, so that each of their fields costs one attribute lookup."""
    source, _, name = path.rpartition(".")
    return source or "event", attrgetter(name)


def as_int(v: Any) -> int:
    """An int field's value as an int64: MISSING unless an int in range or a string of one."""
    if isinstance(v, bool):
        return MISSING
    if isinstance(v, int):
        return v if MISSING < v < 2**63 else MISSING
    if isinstance(v, str):
        for base in (10, 0):
            try:
                return as_int(int(v, base))
            except ValueError:
                continue
    return MISSING


def _ints(rows: list, getter: Callable) -> np.ndarray:
    """int64 column of as_int values. The values are ints, strings or None (decode.py makes
    them so): numpy converts ints and decimal strings as as_int does, so only a batch with
    None (absent) or other strings takes a slower way."""
    try:
        return np.fromiter(map(getter, rows), np.int64, len(rows))
    except (TypeError, ValueError, OverflowError):
        values = list(map(getter, rows))
    try:  # absent values
        return np.fromiter(map(_ABSENT.get, values, values), np.int64, len(values))
    except (TypeError, ValueError, OverflowError):
        return np.array([as_int(v) for v in values], dtype=np.int64)


def _int_column(sub: dict[str, list], getters: tuple) -> np.ndarray:
    """An int column of a table's rows (`sub`: their events and args); a second getter fills
    the rows the first leaves MISSING."""
    source, getter = getters[0]
    out = _ints(sub[source], getter)
    gap = out == MISSING
    if len(getters) > 1 and gap.any():
        source, getter = getters[1]
        out[gap] = _ints(list(compress(sub[source], gap.tolist())), getter)
    return out


def _scanned_ints(ints: dict[str, np.ndarray], paths: tuple[str, ...], at: np.ndarray) -> np.ndarray:
    """An int column from the scanner's columns: the rows `at` of the first path, a second path
    filling the rows the first leaves MISSING."""
    out = ints[paths[0]][at]
    if len(paths) > 1:
        out = np.where(out == MISSING, ints[paths[1]][at], out)
    return out


def _room(a: np.ndarray, n: int, fill: int) -> np.ndarray:
    """`a` with room for at least n entries (at least doubled when it grows; new ones `fill`)."""
    if len(a) >= n:
        return a
    grown = np.full(max(n, 2 * len(a)), fill, a.dtype)
    grown[: len(a)] = a
    return grown


@dataclass(frozen=True)
class _Kept:
    """A batch's kept events: their numbers in the file, times, and table and phase codes."""

    event_id: np.ndarray
    ts: np.ndarray
    dur: np.ndarray
    table_code: np.ndarray
    phase: np.ndarray

    def chunk(self, table: str, rows: np.ndarray) -> dict[str, np.ndarray]:
        """`table`'s chunk of `rows` (of these events) with the columns every way of reading
        fills alike (ids, times, and the flows' phase or the device rows' kind, from their
        codes)."""
        chunk = {"event_id": self.event_id[rows], "ts_us": self.ts[rows], "dur_us": self.dur[rows]}
        if table == "flows":
            chunk["ph"] = (self.phase[rows] - 2).astype(np.int8)
        if table == "device":
            chunk["kind"] = (self.table_code[rows] - _KERNEL).astype(np.int8)
        return chunk


class _Codes(dict):
    """value -> code: 0, 1, 2, ... in first-seen order (a new value gets the next one)."""

    def __missing__(self, value: Any) -> int:
        code = self[value] = len(self)
        return code


class _Interner:
    """Assigns each distinct value a code in first-seen order: categorical without re-hashing.

    `codes()` returns dense codes (int32) into the values seen so far; `finish()` makes them
    category codes, with None as -1.
    """

    def __init__(self):
        self.seen = _Codes()
        self.lut = np.empty(0, np.int32)  # the compiled scanner's code -> code (-1: not yet)

    def codes(self, values, n: int) -> np.ndarray:
        return np.fromiter(map(self.seen.__getitem__, values), np.int32, n)

    def recode(self, g: np.ndarray, values: list) -> np.ndarray:
        """Codes of the scanner's codes `g` (indexes into `values`, every value it has seen),
        new values taken in their first-seen order, as `codes` takes them."""
        lut = self.lut = _room(self.lut, len(values), -1)
        out = lut[g]
        new = out < 0
        if new.any():
            u, first = np.unique(g[new], return_index=True)
            for v in u[np.argsort(first)].tolist():
                lut[v] = self.seen[values[v]]
            out = lut[g]
        return out

    def dense(self, chunks: list[np.ndarray]) -> tuple[list, np.ndarray]:
        """(every value in first-seen order, the rows' codes into that list) to ship."""
        return list(self.seen), _joined(chunks)

    def absorb(self, keys: list, codes: np.ndarray) -> np.ndarray:
        """Codes from `dense()` of a later part of the file -> this interner's codes. New values
        are appended in their first-seen order, so categories come out as a serial read's."""
        return np.fromiter(map(self.seen.__getitem__, keys), np.int32, len(keys))[codes]

    def finish(self, chunks: list[np.ndarray]) -> pd.Categorical:
        keys, codes = list(self.seen), _joined(chunks)
        none = self.seen.get(None)
        if none is not None:  # None is no category: -1, the values after it one code down
            del keys[none]
            lookup = np.arange(len(keys) + 1, dtype=np.int32)
            lookup[none + 1 :] -= 1
            lookup[none] = -1
            codes = lookup[codes]
        return pd.Categorical.from_codes(codes, categories=pd.Index(keys, dtype=object).astype(str))


def _joined(chunks: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(chunks) if chunks else np.empty(0, np.int32)


def _respell(text: str) -> str:
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except (ValueError, RecursionError):
        return text


class _RawGroup:
    """A table's raw-JSON columns, interned together: one key per row, split per distinct key.

    The key joins the row's raw bytes (every spelling of every column) with \\x01, which JSON
    text cannot contain; a column takes its first non-empty spelling, decoded as UTF-8 (an
    invalid sequence becomes U+FFFD) only once per distinct key.
    """

    def __init__(self, columns: dict[str, tuple[str, ...]]):
        self.columns = columns
        paths = [p for ps in columns.values() for p in ps]
        self.width = len(paths)
        self.getter = attrgetter(*(p.removeprefix("args.") for p in paths))
        self.interner = _Interner()

    def codes(self, args: list) -> np.ndarray:
        """Provisional codes of the rows whose args are `args`."""
        raws = map(self.getter, args)
        return self.interner.codes(map(bytes, raws) if self.width == 1 else map(b"\x01".join, raws),
                                   len(args))

    def finish(self, chunks: list[np.ndarray]) -> dict[str, pd.Categorical]:
        keys, key_of_row = list(self.interner.seen), _joined(chunks)
        split = [k.split(b"\x01") if k.count(b"\x01") == self.width - 1 else [b""] * self.width
                 for k in keys]
        out, i = {}, 0
        for col, paths in self.columns.items():
            texts = [next((t for t in parts[i : i + len(paths)] if t), b"") for parts in split]
            values = [None if t in (b"", b"null") else _respell(t.decode("utf-8", "replace"))
                      for t in texts]
            codes, categories = pd.factorize(pd.Series(values, dtype=object))
            out[col] = pd.Categorical.from_codes(codes[key_of_row], categories=categories.astype(str))
            i += len(paths)
        return out


class Accumulator:
    """Collects per-batch column chunks for every table, then concatenates them."""

    def __init__(self) -> None:
        self.cat_table = _CatTable()
        self.skipped = dict.fromkeys(SKIP_REASONS, 0)
        self.partly_read = 0
        self.chunks: dict[str, list[dict]] = {t: [] for t in TABLES}
        self.getters = {
            t: {c: (tuple(_getter(a) for a in paths), conv)
                for c, (paths, conv) in fields.items() if conv != "raw"}
            for t, fields in TABLES.items()
        }
        self.interners = {
            (t, c): _Interner()
            for t, fields in TABLES.items()
            for c, (_, conv) in fields.items()
            if conv == "str"
        }
        self.scanner = SCANNER() if SCANNER is not None else None
        self.declined: dict[str, int] = {}
        self._strings: list = [None]  # scanner string code + 1 -> value (0: absent or null)
        self._cat_lut = np.zeros(1, np.int8)  # ... -> table code
        self._ph_lut = np.zeros(1, np.int8)  # ... -> phase code
        self._raws: list[bytes] = []  # scanner raw code -> key
        self.raw_groups = {
            t: _RawGroup({c: paths for c, (paths, conv) in fields.items() if conv == "raw"})
            for t, fields in TABLES.items()
            if any(conv == "raw" for _, conv in fields.values())
        }

    def add(self, evs: list, start: int) -> None:
        """Append the columns of `evs`, events number `start`, `start` + 1, ... of the file."""
        n = len(evs)
        tab = np.fromiter(map(self.cat_table.__getitem__, map(_cat_of, evs)), np.int8, n)
        ph = np.fromiter(map(_PH_CODES.get, map(_ph_of, evs), repeat(0, n)), np.int8, n)
        keep = self._kept(tab, ph)
        idx = np.flatnonzero(keep)
        if not len(idx):
            return
        if len(idx) < n:
            evs = list(compress(evs, keep.tolist()))
        m = len(evs)
        ts = np.fromiter(map(_ts_of, evs), np.float64, m)
        dur = np.fromiter(map(_dur_of, evs), np.float64, m)
        kept = _Kept(start + idx, ts, dur, tab[idx], ph[idx])
        order, bounds = self._grouped(kept.table_code, ts, dur)
        grouped = list(map(evs.__getitem__, order.tolist()))
        for k, table in enumerate(TABLES):
            lo, hi = bounds[k], bounds[k + 1]
            if lo == hi:
                continue
            rows = order[lo:hi]
            # the rows' events, and their args (None for a table without args: never read then)
            sub: dict[str, Any] = {"event": grouped[lo:hi]}
            sub["args"] = list(map(_args_of, sub["event"])) if table in _WITH_ARGS else None
            chunk = kept.chunk(table, rows)
            for col, (getters, conv) in self.getters[table].items():
                if conv == "int":
                    chunk[col] = _int_column(sub, getters)
                elif conv == "str":
                    source, getter = getters[0]
                    chunk[col] = self.interners[table, col].codes(map(getter, sub[source]), hi - lo)
            if table in self.raw_groups:
                chunk["raw"] = self.raw_groups[table].codes(sub["args"])
            self.chunks[table].append(chunk)

    def _kept(self, tab: np.ndarray, ph: np.ndarray) -> np.ndarray:
        """Which events to keep, from their table and phase codes: complete events ('X') of a
        kept category and flow events ('s', 'f'); complete categories in another phase are
        counted as skipped."""
        complete = (tab >= _KERNEL) & (tab <= _PYFRAME)
        self.skipped["phase"] += int(np.count_nonzero(complete & (ph != 1)))
        return (complete & (ph == 1)) | ((tab == _FLOW) & (ph >= 2))

    def _grouped(self, t: np.ndarray, ts: np.ndarray, dur: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """(the kept events' order grouped by table, stable; the table bounds in it): events with
        unusable times are counted by reason and left out."""
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
        # group the rows by table (stable: file order within a table), one slice per table
        table_of = np.where(valid, _TABLE_OF_CODE[t], len(TABLES))
        order = np.argsort(table_of, kind="stable")
        return order, np.searchsorted(table_of[order], np.arange(len(TABLES) + 1)).tolist()

    def scan(self, buf, lo: int, hi: int, start: int) -> int | None:
        """Append the columns of the events in buf[lo:hi] (a JSON array's content), numbered
        from `start`, read by the compiled scanner; their number, or None where it declines
        (the reason counted in `declined`) or is not built: then decode them with msgspec."""
        if self.scanner is None:
            return None
        got = self.scanner.scan(buf, lo, hi)
        if isinstance(got, str):
            self.declined[got] = self.declined.get(got, 0) + 1
            return None
        n, i32, f64, i64 = got
        self._learn()
        if not n:
            return 0
        strs = dict(zip(_scan.I32_COLUMNS, np.frombuffer(i32, np.int32).reshape(-1, n), strict=True))
        floats = dict(zip(_scan.F64_COLUMNS, np.frombuffer(f64, np.float64).reshape(-1, n), strict=True))
        ints = dict(zip(_scan.I64_COLUMNS, np.frombuffer(i64, np.int64).reshape(-1, n), strict=True))
        tab, ph = self._cat_lut[strs["cat"]], self._ph_lut[strs["ph"]]
        idx = np.flatnonzero(self._kept(tab, ph))
        if not len(idx):
            return n
        kept = _Kept(start + idx, floats["ts"][idx], floats["dur"][idx], tab[idx], ph[idx])
        order, bounds = self._grouped(kept.table_code, kept.ts, kept.dur)
        for k, table in enumerate(TABLES):
            if bounds[k] < bounds[k + 1]:
                rows = order[bounds[k] : bounds[k + 1]]
                chunk = kept.chunk(table, rows)
                self.chunks[table].append(self._scanned(table, chunk, idx[rows], strs, ints))
        return n

    def _scanned(self, table: str, chunk: dict, at: np.ndarray, strs: dict, ints: dict) -> dict:
        """`chunk` of `table` completed from the scanner's columns (`strs`: string and raw-key
        codes, `ints`) at the batch's rows `at`."""
        for col, (paths, conv) in TABLES[table].items():
            if conv == "int":
                chunk[col] = _scanned_ints(ints, paths, at)
            elif conv == "str":
                chunk[col] = self.interners[table, col].recode(strs[paths[0]][at], self._strings)
        if table in self.raw_groups:
            chunk["raw"] = self.raw_groups[table].interner.recode(strs[f"raw.{table}"][at], self._raws)
        return chunk

    def _learn(self) -> None:
        """Take the scanner's new string and raw keys (string keys decoded once each, and
        classified as categories and phases)."""
        assert self.scanner is not None  # (only `scan` asks, with a scanner)
        new = [msgspec.json.decode(b'"' + k + b'"') for k in self.scanner.strings()]
        if new:
            at = len(self._strings)
            self._strings += new
            self._cat_lut = _room(self._cat_lut, len(self._strings), 0)
            self._ph_lut = _room(self._ph_lut, len(self._strings), 0)
            self._cat_lut[at:len(self._strings)] = list(map(self.cat_table.__getitem__, new))
            self._ph_lut[at:len(self._strings)] = [_PH_CODES.get(v, 0) for v in new]
        self._raws += self.scanner.raws()

    def export(self) -> dict:
        """Everything gathered so far, picklable: per table one concatenated chunk whose
        categorical columns are (values, codes) pairs (see _Interner.dense)."""
        tables = {}
        for table, chunks in self.chunks.items():
            if not chunks:
                continue
            part: dict[str, Any] = {}  # column -> array, or (values, codes) for a categorical
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

    def absorb(self, part: dict, first: int) -> None:
        """Append an `export()` of the events that follow the ones added so far, numbered from
        0 there and from `first` here."""
        for table, cols in part["tables"].items():
            chunk = {}
            for col, v in cols.items():
                if col == "event_id":
                    chunk[col] = v + first
                elif col == "raw":
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
                cols[table]["ph"] = pd.Categorical.from_codes(cols[table]["ph"], FLOW_PH)
        return build_tables(cols)
