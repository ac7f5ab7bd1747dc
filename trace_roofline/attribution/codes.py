"""String columns as categorical codes, and integer-array lookups: str work once per distinct
value, never per row (the attribution stage's shared helpers).

Design notes: docs/design.md ("trace_roofline/attribution/attribute.py").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

_TAKE_CHUNK = 1 << 14  # rows per arrow take when decoding a string column


@dataclass(frozen=True)
class Coded:
    """A string per row as codes into categories (-1: missing)."""

    codes: np.ndarray
    cats: pd.Index

    def categorical(self) -> pd.Categorical:
        return pd.Categorical.from_codes(self.codes, self.cats)

    def isin(self, names: str | Iterable[str]) -> np.ndarray:
        """Per row, whether its value is one of `names` (a list, Index or one string)."""
        hit = (self.cats == names) if isinstance(names, str) else self.cats.isin(list(names))
        return np.append(np.asarray(hit, dtype=bool), False)[self.codes]

    def decoded(self) -> np.ndarray:
        """An object array of the values (missing: None)."""
        values = np.append(np.asarray(self.cats, dtype=object), [None])
        return values[np.where(self.codes >= 0, self.codes, len(self.cats))]

    @classmethod
    def encoded(cls, values: np.ndarray) -> Coded:
        """The codes of an object array (None: -1)."""
        codes, cats = pd.factorize(pd.Series(values, dtype=object), use_na_sentinel=True)
        return cls(codes.astype(np.int64), pd.Index(np.asarray(cats, dtype=object)))


def categorical(values: pd.Series | pd.Categorical) -> pd.Categorical:
    """A column as a Categorical (a no-op for the trace tables' category columns)."""
    if isinstance(values, pd.Categorical):
        return values
    if isinstance(values.dtype, pd.CategoricalDtype):
        return values.array
    return pd.Categorical(values)


def take_cat(values: pd.Categorical, idx: np.ndarray) -> pd.Categorical:
    """values[idx], missing where idx < 0."""
    return values.take(idx, allow_fill=True)


def const(value: str, n: int) -> pd.Categorical:
    return pd.Categorical.from_codes(np.zeros(n, dtype=np.int8), [value])


def unify(*cols: pd.Categorical | str) -> tuple[list[np.ndarray], pd.Index]:
    """The codes of several categoricals over one shared index of their categories; a str
    stands for a column holding that one value (its codes a 0-d array, broadcast)."""
    cats = pd.Index(np.concatenate([np.asarray([c] if isinstance(c, str) else c.categories,
                                               dtype=object) for c in cols]))
    cats = cats.unique()
    codes = [np.asarray(cats.get_loc(c), dtype=np.int64) if isinstance(c, str)
             else np.append(cats.get_indexer(c.categories), -1)[c.codes] for c in cols]
    return codes, cats


def name_categories(values: pd.Series | pd.Categorical) -> pd.Categorical:
    """A categorical column of the names used (missing: NaN), its categories `str` and sorted,
    so that it sorts and compares as the strings would, whatever their order in the file."""
    c = categorical(values).remove_unused_categories()
    return c.reorder_categories(c.categories.astype("str").sort_values())


def strings(values: pd.Series | pd.Categorical) -> pd.api.extensions.ExtensionArray:
    """A categorical column as the `str` dtype (missing -> NaN), decoding each category once.

    The arrow buffers are sized exactly from the category lengths and filled by takes of
    bounded row chunks: one take of all rows grows its buffer by reallocation, 2x the memory
    and up to 10x the time on 100+ MB of long kernel names. The data buffer is a bytearray, as
    numpy advises huge pages for big arrays, which makes their first touch 4x slower in VMs."""
    c = categorical(values)
    cats = pa.array(np.append(np.asarray(c.categories, dtype=object), ""), type=pa.large_string())
    codes = np.asarray(c.codes, dtype=np.int64)
    valid = codes >= 0
    codes = np.where(valid, codes, len(cats) - 1)  # missing: the empty string, masked below
    offsets = np.zeros(len(codes) + 1, dtype=np.int64)
    np.cumsum(pc.binary_length(cats).to_numpy()[codes], out=offsets[1:])
    data = bytearray(int(offsets[-1]))
    for i in range(0, len(codes), _TAKE_CHUNK):
        lo, hi = offsets[i], offsets[min(i + _TAKE_CHUNK, len(codes))]
        if hi > lo:
            part = pc.take(cats, pa.array(codes[i:i + _TAKE_CHUNK]))
            _, offs, buf = part.buffers()
            first = int(np.frombuffer(offs, np.int64, count=1, offset=8 * part.offset)[0])
            data[lo:hi] = memoryview(buf)[first:first + hi - lo]
    mask = None if valid.all() else pa.py_buffer(np.packbits(valid, bitorder="little"))
    arr = pa.LargeStringArray.from_buffers(len(codes), pa.py_buffer(offsets),
                                           pa.py_buffer(data), mask)
    return pd.array(arr, dtype="str")


def by_category(col: pd.Series | pd.Categorical,
                flag: Callable[[pd.Series], pd.Series]) -> np.ndarray:
    """Evaluate a vectorised str predicate once per distinct value of a column."""
    c = categorical(col)
    cats = pd.Series(c.categories.astype(str))
    return np.append(np.asarray(flag(cats), dtype=bool), False)[c.codes]


def ints(col: pd.Series, fill: int) -> np.ndarray:
    """An integer column as int64, `fill` where missing."""
    if col.dtype == np.int64:
        return col.to_numpy()
    return col.astype("Int64").to_numpy(np.int64, na_value=fill)


def take(values: np.ndarray, idx: np.ndarray, fill: float) -> np.ndarray:
    """values[idx] where idx >= 0, else fill (values may be empty)."""
    if not len(values):
        return np.full(len(idx), fill)
    return np.where(idx >= 0, values[np.maximum(idx, 0)], fill)


def lookup(values: np.ndarray, valid: np.ndarray, queries: np.ndarray, *,
           unique: bool) -> np.ndarray:
    """Per query, the row of `values` (among `valid` rows) equal to it: the first such row, or
    with `unique` only a value held by exactly one row; -1 where none. Sort + searchsorted
    (ids come nearly sorted, so the stable sort is cheap)."""
    rows = np.flatnonzero(valid)
    if not len(rows):
        return np.full(len(queries), -1, dtype=np.int64)
    rows = rows[np.argsort(values[rows], kind="stable")]
    v = values[rows]
    lo = np.minimum(np.searchsorted(v, queries, side="left"), len(v) - 1)
    found = v[lo] == queries
    if unique:  # the next value differs (or there is none)
        found &= np.append(v[1:] != v[:-1], True)[lo]
    return np.where(found, rows[lo], -1)


def coalesce(*arrays: pd.api.extensions.ExtensionArray) -> pd.arrays.IntegerArray:
    """The first non-missing value per row of several Int64 arrays."""
    values, miss = arrays[0].to_numpy(np.int64, na_value=0), arrays[0].isna()
    for a in arrays[1:]:
        values = np.where(miss, a.to_numpy(np.int64, na_value=0), values)
        miss = miss & a.isna()
    return pd.arrays.IntegerArray(values, np.asarray(miss))


@dataclass(frozen=True)
class Labels:
    """What names each op instance: its operator, evidence and reason (why it is unnamed)."""

    name: Coded
    evidence: Coded
    reason: Coded
