"""Vectorised interval nesting: which range on the same thread contains a point.

Design notes: docs/design.md ("trace_roofline/attribution/nest.py").
"""

from __future__ import annotations

import numpy as np
import pandas as pd

ROUNDING_NS = 1000  # how far whole-microsecond timestamps may push an interval's end
MENDS = 8  # rounds of mending improperly nested intervals (each mends one more link of a chain)


def to_ns(us: pd.Series | np.ndarray) -> np.ndarray:
    """Float µs -> int64 ns (Kineto writes ns-precision µs: rounding recovers the exact ns)."""
    return np.rint(np.asarray(us, dtype=np.float64) * 1000.0).astype(np.int64)


class KeySpace:
    """One int code per (pid, tid) pair seen in any of the given tables (-1: unknown).

    Profiler rows come in runs on one thread, so pairs are looked up once per run."""

    _NA = -(2**62)

    def __init__(self, *frames: pd.DataFrame, cols: tuple[str, str] = ("pid", "tid")):
        firsts = [self._runs(self._ints(f[cols[0]]), self._ints(f[cols[1]]))[:2]
                  for f in frames]
        pid = np.concatenate([p for p, _ in firsts] or [np.zeros(0, np.int64)])
        tid = np.concatenate([t for _, t in firsts] or [np.zeros(0, np.int64)])
        self._pids = pd.Index(pd.unique(pid))
        self._tids = pd.Index(pd.unique(tid))
        self._pairs = pd.Index(pd.unique(self._pair(pid, tid)))

    @classmethod
    def _ints(cls, s: pd.Series) -> np.ndarray:
        if not isinstance(s.dtype, pd.Int64Dtype):
            s = pd.to_numeric(pd.Series(s), errors="coerce").astype("Int64")
        return s.to_numpy(np.int64, na_value=cls._NA)

    @staticmethod
    def _runs(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(a, b) at the start of each run of equal consecutive pairs, and each row's run."""
        start = np.ones(len(a), dtype=bool)
        start[1:] = (a[1:] != a[:-1]) | (b[1:] != b[:-1])
        return a[start], b[start], np.cumsum(start) - 1

    def _pair(self, pid: np.ndarray, tid: np.ndarray) -> np.ndarray:
        return self._pids.get_indexer(pid) * (len(self._tids) + 1) + self._tids.get_indexer(tid)

    def codes(self, pid: pd.Series, tid: pd.Series) -> np.ndarray:
        a, b, run = self._runs(self._ints(pid), self._ints(tid))
        c = self._pairs.get_indexer(self._pair(a, b))
        return np.where((a == self._NA) | (b == self._NA), -1, c).astype(np.int64)[run]


class Nest:
    """Properly nested intervals [start, end) grouped by an int key (e.g. a thread code)."""

    def __init__(self, start_ns: np.ndarray, end_ns: np.ndarray, key: np.ndarray):
        key = np.asarray(key, dtype=np.int64)
        start = np.asarray(start_ns, dtype=np.int64)
        end = np.asarray(end_ns, dtype=np.int64)
        self._len = len(key)
        rows = np.flatnonzero(key >= 0)  # intervals on an unknown thread never match
        if len(rows) < self._len:
            start, end, key = start[rows], end[rows], key[rows]
        end = np.maximum(end, start + 1)  # 0 -> 1 ns
        lo, hi = (int(start.min()), int(end.max())) if len(rows) else (0, 0)
        self._lo, self._span, self._grid = lo, hi - lo + 2, None
        if (int(key.max(initial=0)) + 1) * self._span >= 2**62:
            # Too long a time range for (key, ns) packed in int64 (e.g. one stray event at ts 0
            # among epoch timestamps on many threads): work on ranks of the distinct boundaries.
            self._grid = np.unique(np.concatenate([start, end]))
            self._lo, self._span = 0, 2 * len(self._grid) + 2
        s, e = self._flat(start, key), self._flat(end, key)
        del start, end, key
        rows, s, e = _in_start_order(rows, s, e)
        for _ in range(MENDS + 1):  # improperly nested: mend, build again (a chain: again)
            by_end = np.argsort(e, kind="stable")
            self._build(rows, s, e, rows[by_end], e[by_end])
            clamped = self._clamped_ends()
            if clamped is None or (clamped == e).all():
                break
            rows, s, e = _in_start_order(rows, s, clamped)

    def _clamped_ends(self) -> np.ndarray | None:
        """None when every interval ends within its parent (proper nesting); else the ends
        mended where a profiler that writes whole microseconds rounded them across each
        other (by up to ROUNDING_NS), level by level from the top:
        - a child that ends past its parent by that much is cut back to its parent's end
          (kept, the overhang would hold the next sibling's start open and make that sibling
          the child's, one level down);
        - a parent whose end reaches that far into an interval it seems to hold, but which
          ends well after it, is cut back to that interval's start: the two are siblings.
        A child cut back never ends at or before its own start. Other overlaps are left as
        they are; so are times on the rank grid (`_grid`: a trace spanning more than int64
        nanoseconds per thread allow, where no tolerance in ns applies)."""
        e, par = self._sorted[2], self._parent
        has = par >= 0
        if self._grid is not None or not (e[has] > e[par[has]]).any():
            return None
        s, out = self._sorted[1], e.copy()
        for level in self._levels[1:]:
            up = par[level]
            over = out[level] - out[up]
            child = (over > 0) & (over <= ROUNDING_NS) & (s[level] < out[up])
            out[level[child]] = out[up[child]]
            sibling = (over > ROUNDING_NS) & (out[up] - s[level] <= ROUNDING_NS)
            np.minimum.at(out, up[sibling], s[level[sibling]])
        return out

    def _build(self, rows: np.ndarray, s: np.ndarray, e: np.ndarray, end_rows: np.ndarray,
               ends: np.ndarray) -> None:
        """Depths, levels and parents from the intervals in start order (rows: constructor
        indices; s, e: flat times) and the same intervals in end order (end_rows, ends)."""
        self._sorted = (rows, s, e, end_rows, ends)
        self.n = len(rows)
        # depth = intervals opened before mine (in start order) not yet closed at my start
        depth = np.arange(self.n) - np.searchsorted(ends, s, side="right")
        self._depth = depth
        # the start-order positions of each depth, ascending
        small = depth.astype(np.int16) if self.n and depth.max() < 2**15 else depth
        by_depth = np.argsort(small, kind="stable")  # radix sort for int16
        cuts = np.cumsum(np.bincount(depth, minlength=1))[:-1]
        self._levels = [p for p in np.split(by_depth, cuts) if len(p)]
        # parent: the last interval one level up opened before it (start-order position, -1)
        self._parent = np.full(self.n, -1, dtype=np.int64)
        for up, p in zip(self._levels[:-1], self._levels[1:], strict=True):
            self._parent[p] = up[np.searchsorted(up, p) - 1]
        self._parent_rows: list[tuple[np.ndarray, np.ndarray]] | None = None  # on first use

    @property
    def depth(self) -> np.ndarray:
        """Per constructor row: the number of enclosing intervals (-1: unknown thread)."""
        out = np.full(self._len, -1, dtype=np.int64)
        out[self._sorted[0]] = self._depth
        return out

    def enclosing(self, mask: np.ndarray, at: np.ndarray, outermost: bool = False) -> np.ndarray:
        """Per index in `at` (as `innermost` returns them; -1: none): the innermost (or
        outermost) interval where `mask` holds among that interval and those enclosing it
        (its index, or -1).

        At a point whose innermost interval is i, this is what `subset(mask).innermost` answers
        there (`outermost`: `subset(mask).outermost`), as the intervals around a point are i
        and its ancestors: one query then serves any number of masks. The answer is carried
        down the tree one depth level at a time."""
        at = np.asarray(at, dtype=np.int64)
        if self.n == 0:
            return np.full(len(at), -1, dtype=np.int64)
        pick = np.where(np.asarray(mask, dtype=bool), np.arange(self._len), -1)
        for rows, parents in self._parents():
            own, up = pick[rows], pick[parents]
            pick[rows] = np.where(up >= 0, up, own) if outermost else np.where(own >= 0, own, up)
        return np.where(at >= 0, pick[at], -1)

    def _parents(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per depth level >= 1: its intervals and their parents, as constructor indices."""
        if self._parent_rows is None:
            rows = self._sorted[0]
            self._parent_rows = [(rows[p], rows[self._parent[p]]) for p in self._levels[1:]]
        return self._parent_rows

    def subset(self, mask: np.ndarray) -> Nest:
        """The Nest of the intervals where `mask` (over the constructor's arrays) holds, with
        the same indices; built from this one's sorted arrays, without sorting again."""
        mask = np.asarray(mask, dtype=bool)
        out = object.__new__(Nest)
        out._len, out._lo, out._span, out._grid = self._len, self._lo, self._span, self._grid
        rows, s, e, end_rows, ends = self._sorted
        a, b = mask[rows], mask[end_rows]
        out._build(rows[a], s[a], e[a], end_rows[b], ends[b])
        return out

    def _rank(self, t: np.ndarray) -> np.ndarray:
        """Order-preserving map onto the boundary grid: a boundary -> 2·i, a time strictly
        between boundaries i-1 and i -> 2·i - 1, so s <= t < e holds exactly as on times."""
        grid = self._grid
        assert grid is not None  # (only called on the rank grid)
        i = np.searchsorted(grid, t, side="left")
        exact = grid[np.minimum(i, len(grid) - 1)] == t
        return 2 * i - (~exact)

    def _flat(self, t: np.ndarray, key: np.ndarray) -> np.ndarray:
        # offsets clipped to [-1, span-1]: a point outside every interval stays outside
        t = np.asarray(t, dtype=np.int64)
        if self._grid is not None:
            t = self._rank(t)
        off = np.subtract(t, self._lo)
        np.clip(off, -1, self._span - 1, out=off)
        off += key * self._span
        return off

    def innermost(self, q_ns: np.ndarray, q_key: np.ndarray) -> np.ndarray:
        """Index (into the constructor's arrays) of the innermost interval on the same key
        containing each point, or -1: the last interval opened at or before the point (the
        shortest of equal starts, then the later in file order), else its nearest ancestor
        still open there."""
        q_key = np.asarray(q_key, dtype=np.int64)
        out = np.full(len(q_key), -1, dtype=np.int64)
        if self.n == 0:
            return out
        rows, s, e = self._sorted[:3]
        q = np.where(q_key >= 0, self._flat(q_ns, q_key), -(2**62))
        j = np.searchsorted(s, q, side="right") - 1
        todo = np.flatnonzero(j >= 0)
        j, q = j[todo], q[todo]
        while len(todo):  # at most depth + 1 rounds, on fewer points each
            hit = e[j] > q
            out[todo[hit]] = rows[j[hit]]
            miss = ~hit
            j, q, todo = self._parent[j[miss]], q[miss], todo[miss]
            up = j >= 0
            j, q, todo = j[up], q[up], todo[up]
        return out

    def outermost(self, q_ns: np.ndarray, q_key: np.ndarray) -> np.ndarray:
        """Index of the outermost interval with the same key containing each point, or -1:
        the root of the innermost one's tree."""
        return self.enclosing(np.ones(self._len, dtype=bool), self.innermost(q_ns, q_key),
                              outermost=True)


def _in_start_order(rows: np.ndarray, s: np.ndarray, e: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Intervals sorted by start ascending, then the longer first, then file order: a parent
    precedes its child. Profiler tables usually come in that order already; else two stable
    sorts (= lexsort; timsort is fast on events nearly in time order)."""
    later = s[1:] > s[:-1]
    if (later | ((s[1:] == s[:-1]) & (e[1:] <= e[:-1]))).all():
        return rows, s, e
    order = np.argsort(-e, kind="stable")
    order = order[np.argsort(s[order], kind="stable")]
    return rows[order], s[order], e[order]
