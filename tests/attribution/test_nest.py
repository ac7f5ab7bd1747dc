"""Interval nesting stays exact when (thread, ns) no longer fits one int64 (rank fallback)."""

import numpy as np

from trace_roofline.attribution.nest import Nest


def _brute(s, e, k, q, qk, innermost):
    """Reference: the shortest (innermost) or longest (outermost) interval holding each query."""
    out = []
    for t, key in zip(q, qk, strict=True):
        hits = [i for i in range(len(s)) if k[i] == key and s[i] <= t < max(e[i], s[i] + 1)]
        pick = min if innermost else max
        out.append(pick(hits, key=lambda i: (e[i] - s[i], -i if innermost else i)) if hits else -1)
    return np.array(out)


def test_huge_time_range_uses_ranks_and_matches_brute_force():
    rng = np.random.default_rng(0)
    base = 1_700_000_000_000_000_000  # epoch ns, as Kineto writes them
    s, e, k = [], [], []
    for key in range(0, 1200, 7):  # many threads
        t = base + int(rng.integers(0, 10**6))
        for _ in range(3):  # a parent with two nested children
            s += [t, t + 10, t + 50]
            e += [t + 100, t + 40, t + 90]
            k += [key] * 3
            t += 200
    s.append(0)  # one stray event at ts 0
    e.append(5)
    k.append(0)
    s, e, k = (np.array(x, dtype=np.int64) for x in (s, e, k))
    nest = Nest(s, e, k)
    assert nest._grid is not None  # the packed range would overflow
    q = np.concatenate([s + 20, s, e - 1, e, [3, 10**18]])
    qk = np.concatenate([k, k, k, k, [0, 7]])
    for innermost in (True, False):
        got = nest.innermost(q, qk) if innermost else nest.outermost(q, qk)
        np.testing.assert_array_equal(got, _brute(s, e, k, q, qk, innermost))
    np.testing.assert_array_equal(nest.depth[:3], [0, 1, 1])
    sub = nest.subset(k != 0)
    assert sub.innermost(np.array([3]), np.array([0]))[0] == -1
