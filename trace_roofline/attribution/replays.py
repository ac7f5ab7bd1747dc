"""Finding CUDA/HIP-graph replays: the kernels each graph launch replayed, a piecewise graph's
pieces joined into one replay per step, and the distinct replayed kernel sequences (graphs).

Design notes: docs/design.md ("trace_roofline/attribution/graphs.py").
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from trace_roofline.model import kernels
from trace_roofline.trace import Trace

GRAPH_LAUNCH = re.compile(r"^(?:cu(?:da)?|hip)GraphLaunch")


def replay_rows(trace: Trace) -> pd.DataFrame:
    """Device rows launched by a CUDA-graph launch: row (index into trace.device), replay (one
    per launch, in launch order), pos (order in the replay), ordered by replay then start."""
    rt = trace.runtime
    launch = matches(rt["name"], GRAPH_LAUNCH)
    corr = rt.loc[launch, "correlation"].dropna().astype("int64").to_numpy()
    dev = trace.device
    dc = dev["correlation"].astype("Int64").to_numpy(np.int64, na_value=-1)
    # torch.compile's cudagraph trees stamp the replayed kernels with the External id of the op
    # around the launch: the correlation alone says they were replayed
    rows = np.flatnonzero(np.isin(dc, corr))
    rows, c = _piecewise(dev, rows, dc[rows])
    ts = dev["ts_us"].to_numpy(np.float64)[rows]
    first = pd.Series(ts).groupby(c).transform("min").to_numpy()
    order = np.lexsort((ts, c, first))  # by the replay's first start, then within it by start
    rows, c = rows[order], c[order]
    new = np.r_[True, c[1:] != c[:-1]] if len(rows) else np.zeros(0, bool)
    replay = np.cumsum(new) - 1
    pos = np.arange(len(rows)) - np.maximum.accumulate(np.where(new, np.arange(len(rows)), 0))
    return pd.DataFrame({"row": rows, "replay": replay, "pos": pos})


def _piecewise(dev: pd.DataFrame, rows: np.ndarray, corr: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """Piecewise graphs (vLLM's: the step captured in pieces split at each attention op, which
    runs eagerly) joined into one replay per step: two graph launches in a row whose kernels
    are separated on the device by attention and KV-cache-write kernels only (at least one
    attention) are one replay, those eager kernels included. (rows, their launch correlation,
    a piece's taking its run's first)."""
    if len(rows) == 0 or len(np.unique(corr)) < 2:
        return rows, corr
    ts = dev["ts_us"].to_numpy(np.float64)
    order = np.argsort(ts, kind="stable")
    rank = np.empty(len(ts), dtype=np.int64)
    rank[order] = np.arange(len(ts))
    names = dev["name"].astype("category")
    role = kernels.roles(pd.Series(names.cat.categories.astype(object))).astype(object)
    role = np.append(role.to_numpy(), "")[names.cat.codes.to_numpy()][order]
    attn = np.isin(role, list(kernels.ATTENTION_ROLES))
    eager_ok = attn | (role == "kv_cache_write")
    replayed = np.zeros(len(ts), dtype=bool)
    replayed[rank[rows]] = True
    cum = {k: np.r_[0, np.cumsum(v)] for k, v in
           (("attn", attn), ("ok", eager_ok & ~replayed), ("rep", replayed))}
    span = pd.DataFrame({"c": corr, "r": rank[rows]}).groupby("c")["r"].agg(["min", "max"])
    span = span.sort_values("min")
    lo, hi = span["max"].to_numpy()[:-1] + 1, span["min"].to_numpy()[1:]
    n = hi - lo
    joined = ((n > 0) & (cum["ok"][hi] - cum["ok"][lo] == n)
              & (cum["rep"][hi] - cum["rep"][lo] == 0) & (cum["attn"][hi] - cum["attn"][lo] > 0))
    if not joined.any():
        return rows, corr
    run_of = np.r_[0, np.cumsum(~joined)]
    head = span.index.to_numpy()[np.r_[0, np.flatnonzero(~joined) + 1]][run_of]
    new_corr = pd.Series(head, index=span.index).reindex(corr).to_numpy()
    gaps = [order[a:b] for a, b in zip(lo[joined], hi[joined], strict=True)]
    extra = np.concatenate(gaps)
    extra_corr = np.repeat(head[:-1][joined], [len(g) for g in gaps])
    return np.r_[rows, extra], np.r_[new_corr, extra_corr]


def matches(names: pd.Series, rx: re.Pattern) -> np.ndarray:
    """rx.search per row of a name column, evaluated once per distinct name."""
    c = pd.Categorical(names)
    hit = pd.Series(np.asarray(c.categories, dtype=object)).str.contains(rx).to_numpy(bool)
    return np.append(hit, False)[c.codes]


def sequence_keys(codes: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """Per row, a key of its whole sequence (rows of one sequence are contiguous): two
    position-weighted 64-bit hashes and the length, equal for equal sequences."""
    n = len(codes)
    new = np.r_[True, seq[1:] != seq[:-1]] if n else np.zeros(0, bool)
    start = np.maximum.accumulate(np.where(new, np.arange(n), 0))
    pos = np.arange(n) - start
    rng = np.random.default_rng(0x5EED)
    width = int(pos.max()) + 1 if n else 0
    w1, w2 = (rng.integers(1, 2**63, size=width, dtype=np.uint64) | np.uint64(1)
              for _ in range(2))
    c = codes.astype(np.uint64) + np.uint64(1)
    with np.errstate(over="ignore"):
        h1 = np.add.reduceat(c * w1[pos], np.flatnonzero(new)) if n else np.zeros(0, np.uint64)
        h2 = np.add.reduceat(c * c * w2[pos], np.flatnonzero(new)) if n else h1
    length = np.diff(np.r_[np.flatnonzero(new), n])
    keys = pd.MultiIndex.from_arrays([h1, h2, length])
    per_seq = pd.factorize(keys)[0]
    return np.repeat(per_seq, length)


def distinct_graphs(codes: np.ndarray, replay: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Graph number per row and the first replay of each graph; each replay is checked equal
    to its graph's first replay, kernel for kernel."""
    key = sequence_keys(codes, replay)
    starts = np.flatnonzero(np.r_[True, replay[1:] != replay[:-1]])
    per_replay = key[starts]
    graph_of_replay, _ = pd.factorize(per_replay)
    reps = pd.Series(np.arange(len(starts))).groupby(graph_of_replay).first().tolist()
    graph = np.repeat(graph_of_replay, np.diff(np.r_[starts, len(codes)]))
    pos = np.arange(len(codes)) - np.repeat(starts, np.diff(np.r_[starts, len(codes)]))
    rep_start = starts[np.asarray(reps)[graph]]
    if not np.array_equal(codes, codes[rep_start + pos]):
        raise AssertionError("replays of one graph key differ: hash collision")
    return graph, reps
