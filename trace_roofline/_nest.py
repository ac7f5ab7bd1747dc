"""Vectorised interval nesting: which range on the same thread contains a point.

Profiler ranges on one thread (cpu ops, record_function ranges, module frames) nest properly.
Sorted by (start, -end), an interval's depth is the number of earlier intervals still open at
its start; the intervals of one depth are disjoint, so each depth answers a point query with
one `searchsorted`. A query costs O(depth · log n) and the work is a loop over depths (a few
dozen at most), never over events. Times are integer nanoseconds (`to_ns`), so that float
microsecond timestamps near 5e12 do not break nesting by one ulp.
"""

from __future__ import annotations

import numpy as np
import pandas as pd


def to_ns(us: pd.Series | np.ndarray) -> np.ndarray:
    """Float µs -> int64 ns (Kineto writes ns-precision µs: rounding recovers the exact ns)."""
    return np.rint(np.asarray(us, dtype=np.float64) * 1000.0).astype(np.int64)


class KeySpace:
    """One int code per (pid, tid) pair seen in any of the given tables (-1: unknown)."""

    _NA = -(2**62)

    def __init__(self, *frames: pd.DataFrame, cols: tuple[str, str] = ("pid", "tid")):
        pid = np.concatenate([self._ints(f[cols[0]]) for f in frames] or [np.zeros(0, np.int64)])
        tid = np.concatenate([self._ints(f[cols[1]]) for f in frames] or [np.zeros(0, np.int64)])
        self._pids = pd.Index(pd.unique(pid))
        self._tids = pd.Index(pd.unique(tid))
        self._pairs = pd.Index(pd.unique(self._pair(pid, tid)))

    @classmethod
    def _ints(cls, s: pd.Series) -> np.ndarray:
        s = pd.to_numeric(pd.Series(s), errors="coerce").astype("Int64")
        return s.fillna(cls._NA).to_numpy(np.int64)

    def _pair(self, pid: np.ndarray, tid: np.ndarray) -> np.ndarray:
        return self._pids.get_indexer(pid) * (len(self._tids) + 1) + self._tids.get_indexer(tid)

    def codes(self, pid: pd.Series, tid: pd.Series) -> np.ndarray:
        a, b = self._ints(pid), self._ints(tid)
        c = self._pairs.get_indexer(self._pair(a, b))
        return np.where((a == self._NA) | (b == self._NA), -1, c).astype(np.int64)


class Nest:
    """Properly nested intervals [start, end) grouped by an int key (e.g. a thread code)."""

    def __init__(self, start_ns: np.ndarray, end_ns: np.ndarray, key: np.ndarray):
        key = np.asarray(key, dtype=np.int64)
        self._keep = np.flatnonzero(key >= 0)  # intervals on an unknown thread never match
        start = np.asarray(start_ns, dtype=np.int64)[self._keep]
        end = np.maximum(np.asarray(end_ns, dtype=np.int64)[self._keep], start + 1)  # 0 -> 1 ns
        key = key[self._keep]
        self.n = len(start)
        lo, hi = (int(start.min()), int(end.max())) if self.n else (0, 0)
        self._lo, self._span = lo, hi - lo + 2
        if (int(key.max(initial=0)) + 1) * self._span >= 2**62:
            raise ValueError("trace too long or too many threads for interval nesting")
        s, e = self._flat(start, key), self._flat(end, key)
        # start ascending, then the longer first, then file order: a parent precedes its child
        order = np.lexsort((np.arange(self.n), -e, s))
        s_sorted, e_sorted = s[order], e[order]
        depth_sorted = np.arange(self.n) - np.searchsorted(np.sort(e), s_sorted, side="right")
        self.depth = np.full(len(np.asarray(start_ns)), -1, dtype=np.int64)
        self.depth[self._keep[order]] = depth_sorted
        self._levels = []
        for d in range(int(depth_sorted.max(initial=-1)) + 1):
            pos = np.flatnonzero(depth_sorted == d)
            self._levels.append((s_sorted[pos], e_sorted[pos], self._keep[order[pos]]))

    def _flat(self, t: np.ndarray, key: np.ndarray) -> np.ndarray:
        # offsets clipped to [-1, span-1]: a point outside every interval stays outside
        off = np.clip(np.asarray(t, dtype=np.int64) - self._lo, -1, self._span - 1)
        return key * self._span + off

    def _query(self, q_ns: np.ndarray, q_key: np.ndarray, innermost: bool) -> np.ndarray:
        q_key = np.asarray(q_key, dtype=np.int64)
        q = np.where(q_key >= 0, self._flat(q_ns, q_key), -(2**62))
        out = np.full(len(q), -1, dtype=np.int64)
        for s, e, idx in self._levels:
            j = np.searchsorted(s, q, side="right") - 1
            ok = j >= 0
            jj = np.where(ok, j, 0)
            hit = ok & (e[jj] > q)
            take = hit if innermost else hit & (out < 0)  # deeper levels overwrite, or not
            out = np.where(take, idx[jj], out)
        return out

    def innermost(self, q_ns: np.ndarray, q_key: np.ndarray) -> np.ndarray:
        """Index (into the constructor's arrays) of the innermost interval on the same key
        containing each point, or -1."""
        if self.n == 0:
            return np.full(len(q_ns), -1, dtype=np.int64)
        return self._query(q_ns, q_key, innermost=True)

    def outermost(self, q_ns: np.ndarray, q_key: np.ndarray) -> np.ndarray:
        """Index of the outermost interval with the same key containing each point, or -1."""
        if self.n == 0:
            return np.full(len(q_ns), -1, dtype=np.int64)
        return self._query(q_ns, q_key, innermost=False)
