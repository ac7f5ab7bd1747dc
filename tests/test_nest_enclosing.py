"""Nest.enclosing over a point's innermost interval answers as a subset Nest's query there."""

import numpy as np
import pytest

from trace_roofline._nest import Nest


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


@pytest.mark.parametrize("seed", range(20))
def test_enclosing_matches_subset_queries(seed):
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
            want = sub.outermost(q, qk) if outermost else sub.innermost(q, qk)
            got = nest.enclosing(m, inner, outermost)
            np.testing.assert_array_equal(got, want)
