"""Nest queries on random properly nested intervals against brute force: innermost/outermost
of a subset Nest, and Nest.enclosing over a point's innermost interval, which answer alike."""

import numpy as np
import pytest

from trace_roofline.attribution.nest import Nest


def _tree(rng, lo: int, hi: int, depth: int, out: list) -> None:
    """Random disjoint children of [lo, hi), each with a random subtree: proper nesting."""
    t = lo
    while depth < 6 and t < hi - 2 and rng.random() < 0.8:
        s = int(rng.integers(t, hi - 1))
        e = int(rng.integers(s + 1, min(hi, s + 1 + (hi - lo) // 2) + 1))
        out.append((s, e))
        _tree(rng, s, e, depth + 1, out)
        t = e


def _intervals(rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    s, e, k = [], [], []
    for key in (-1, 0, 1, 3):  # -1: an unknown thread, never matched
        iv: list = []
        _tree(rng, 0, 400, 0, iv)
        iv += [(x, x) for x in rng.integers(0, 400, 15).tolist()]  # zero-length (1 ns)
        iv += [iv[i] for i in rng.integers(0, len(iv), 10)]  # exact duplicates
        s += [a for a, _ in iv]
        e += [b for _, b in iv]
        k += [key] * len(iv)
    order = rng.permutation(len(s))  # file order need not be start order
    return tuple(np.asarray(x, dtype=np.int64)[order] for x in (s, e, k))


def _brute(s, e, k, m, q, qk, outermost: bool) -> np.ndarray:
    """Among the intervals where m holds holding each point: the shortest, the later in file
    order of equals (innermost), or the longest, the earlier of equals (outermost); else -1."""
    length = np.maximum(e, s + 1) - s
    held = m & (k == qk[:, None]) & (s <= q[:, None]) & (q[:, None] < s + length) & (k >= 0)
    sign = 1 if outermost else -1
    rank = -sign * length * (2 * len(s)) + sign * np.arange(len(s))
    best = np.argmin(np.where(held, rank, np.iinfo(np.int64).max), axis=1)
    return np.where(held.any(axis=1), best, -1)


@pytest.mark.parametrize("seed", range(20))
def test_queries_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    s, e, k = _intervals(rng)
    nest = Nest(s, e, k)
    q = np.concatenate([rng.integers(-2, 403, 500), s, e])
    qk = np.concatenate([rng.choice([-1, 0, 1, 2, 3], 500), k, k])  # 2: a key with no intervals
    inner = nest.innermost(q, qk)
    for m in (rng.random(len(s)) < 0.3, rng.random(len(s)) < 0.8, np.zeros(len(s), bool),
              np.ones(len(s), bool)):
        sub = nest.subset(m)
        for outermost in (False, True):
            want = _brute(s, e, k, m, q, qk, outermost)
            np.testing.assert_array_equal(sub.outermost(q, qk) if outermost
                                          else sub.innermost(q, qk), want)
            np.testing.assert_array_equal(nest.enclosing(m, inner, outermost), want)


def test_a_child_ending_past_its_parent_does_not_hold_the_next_sibling():
    """Whole microseconds (older Kineto): B, a child of A, ends 1 µs past A, rounded. C starts
    where A ends: a top-level op, not A's descendant, so its launches' outermost op is C
    (before: A, which had ended). B is cut back to A's end."""
    s = np.array([100, 106, 110, 112]) * 1000  # A, B (in A), C, D (in C)
    e = np.array([110, 111, 120, 115]) * 1000
    nest = Nest(s, e, np.zeros(4, np.int64))
    np.testing.assert_array_equal(nest.depth, [0, 1, 0, 1])
    q = np.array([105_000, 108_000, 110_500, 113_000, 125_000])
    qk = np.zeros(len(q), np.int64)
    np.testing.assert_array_equal(nest.innermost(q, qk), [0, 1, 2, 3, -1])
    np.testing.assert_array_equal(nest.outermost(q, qk), [0, 0, 2, 2, -1])


@pytest.mark.parametrize(("s", "e", "depth", "inner", "outer"), [
    # siblings B and C under A, B rounded 1 µs into C: B ends where C starts (a launch at 25 µs
    # is C's, as it was before any mending)
    ([0, 10, 20], [100, 21, 90], [0, 1, 1], [1, 2, 2], [0, 0, 0]),
    # A and B start in the same µs, B rounded past A (so B, the longer, holds A) and 1 µs into
    # the next op C: B ends where C starts, C is a top-level op and D's outermost
    ([100, 100, 110, 112], [110, 111, 120, 115], [1, 0, 0, 1], [0, 2, 3], [1, 2, 2]),
    # an overlap far beyond rounding is left as it is
    ([0, 10, 50], [100, 60, 90], [0, 1, 2], [1, 1, 1], [0, 0, 0]),
    # B past A by 1 µs and C starting at A's end inside B: B cut back to A's end, C never cut
    # back to nothing (before the guard: an empty interval, and a crash)
    ([0, 10, 50], [50, 51, 51], [0, 1, 0], [1, 1, 2], [0, 0, 2]),
])
def test_siblings_rounded_into_each_other(s, e, depth, inner, outer):
    """Whole microseconds: an interval that seems to hold another which ends well after it
    only reaches into it by rounding (<= 1 µs): the two are siblings."""
    q = {3: np.array([15_000, 20_500, 25_000]), 4: np.array([105_000, 110_500, 113_000])}[len(s)]
    if e[-1] == 51:
        q = np.array([15_000, 49_500, 50_500])
    nest = Nest(np.array(s) * 1000, np.array(e) * 1000, np.zeros(len(s), np.int64))
    qk = np.zeros(len(q), np.int64)
    np.testing.assert_array_equal(nest.depth, depth)
    np.testing.assert_array_equal(nest.innermost(q, qk), inner)
    np.testing.assert_array_equal(nest.outermost(q, qk), outer)


@pytest.mark.parametrize("seed", range(10))
def test_overhanging_children_answer_as_if_cut_back(seed):
    """Random proper trees whose children end up to 3 ns past their parents (a third of them):
    every query answers as on the trees with those ends cut back to the parents' ends."""
    rng = np.random.default_rng(100 + seed)
    s, e, k = _intervals(rng)
    proper = Nest(s, e, k)
    par = np.full(len(s), -1)
    par[proper._sorted[0]] = np.where(proper._parent >= 0,
                                      proper._sorted[0][np.maximum(proper._parent, 0)], -1)
    grow = ((par >= 0) & (rng.random(len(s)) < 0.3) & (e == np.where(par >= 0, e[par], -1))
            & (s > np.where(par >= 0, s[par], s)))  # (equal starts: the longer is the parent)
    rough = e + np.where(grow, rng.integers(1, 4, len(s)), 0)
    nest = Nest(s, rough, k)
    q = np.concatenate([rng.integers(-2, 403, 500), s, e])
    qk = np.concatenate([rng.choice([-1, 0, 1, 3], 500), k, k])
    np.testing.assert_array_equal(nest.depth, proper.depth)
    np.testing.assert_array_equal(nest.innermost(q, qk), proper.innermost(q, qk))
    np.testing.assert_array_equal(nest.outermost(q, qk), proper.outermost(q, qk))


def test_a_chain_of_roundings_is_mended_link_by_link():
    """A [0, 21) holds B [10, 20.8); C [20.5, 90) starts inside B. Mended once, B ends where
    C starts (siblings under A), but A still reaches 0.5 µs into C; mended again, A ends
    there too: C is a top-level op, the outermost op of its launches (before: A)."""
    s, e = np.array([0, 10_000, 20_500]), np.array([21_000, 20_800, 90_000])
    nest = Nest(s, e, np.zeros(3, np.int64))
    q = np.array([20_700, 30_000])
    np.testing.assert_array_equal(nest.depth, [0, 1, 0])
    np.testing.assert_array_equal(nest.outermost(q, np.zeros(2, np.int64)), [2, 2])
