"""Ranks of a distributed run: which rank each trace is, and how each operator varies across ranks.

Design notes: docs/design.md ("trace_roofline/attribution/ranks.py").
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from trace_roofline.attribution import comms
from trace_roofline.errors import InputError

# Coordinates of a rank in a multi-dimensional parallel layout, in this (canonical) order.
COORDINATES = ("dp", "pp", "tp", "ep")

# (pattern over the file name, what its digits are), tried in order; the first match wins.
NAME_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"(?<![a-z0-9])(?<!local_)(?<!local-)rank[_-]?(\d+)(?![0-9])", re.I), "rank"),
    (re.compile(r"(?<![a-z0-9])(dp|pp|tp|ep)(\d+)(?![a-z0-9])", re.I), "coordinates"),
)

# One row per (phase, operator), plus a `device time` row per phase: all of a rank's device
# time, collectives included (a rank's whole model, on the HBM roof, leaves them out).
SUMMARY_COLUMNS = {
    "phase": "str",
    "operator": "str",
    "ranks": "int64",  # ranks on which the operator ran (others count 0 µs)
    "min_time_us": "float64",
    "median_time_us": "float64",
    "max_time_us": "float64",
    "skew": "float64",  # max / median; NaN when the median is 0
    "slowest_rank": "str",  # label of the rank with the most time (the first such, in rank order)
    "fastest_rank": "str",
}
WHOLE = "device time"


@dataclass(frozen=True)
class RankInfo:
    """Which rank one trace is, and what says so."""

    path: str
    rank: int | None = None  # global rank (distributedInfo, or `rank<N>` in the file name)
    coords: tuple[tuple[str, int], ...] = ()  # (("dp", 0), ("tp", 1)) from a vLLM-style name
    world_size: int | None = None  # from distributedInfo
    source: str = "none"  # distributedInfo | file name | none

    @property
    def ranked(self) -> bool:
        return self.rank is not None or bool(self.coords)

    @property
    def label(self) -> str:
        """`3` for a global rank, `dp0_tp1` for coordinates, `?` without a rank."""
        if self.rank is not None:
            return str(self.rank)
        return "_".join(f"{k}{v}" for k, v in self.coords) or "?"

    @property
    def order(self) -> tuple:
        """Sort key: global ranks first by number, then coordinates."""
        return (self.rank is None, self.rank or 0, self.coords)


def rank_info(path: str | Path, meta: Mapping[str, object] | None = None) -> RankInfo:
    """The rank of the trace at `path` whose top-level keys are `meta` (Trace.meta).

    `distributedInfo.rank` must be a non-negative integer (or its decimal text) when present;
    anything else is an InputError naming the file.
    """
    info = (meta or {}).get("distributedInfo")
    if isinstance(info, Mapping) and "rank" in info:
        return RankInfo(str(path), rank=_number(path, "rank", info["rank"]),
                        world_size=_number(path, "world_size", info.get("world_size")),
                        source="distributedInfo")
    return rank_from_name(path)


def rank_from_name(path: str | Path) -> RankInfo:
    """The rank the file name states (`NAME_RULES`), or a RankInfo without one."""
    name = Path(path).name
    for pattern, kind in NAME_RULES:
        found = pattern.findall(name)
        if not found:
            continue
        if kind == "rank":
            return RankInfo(str(path), rank=int(found[0]), source="file name")
        coords = dict((k.lower(), int(v)) for k, v in found)  # a repeated token: the last wins
        return RankInfo(str(path), coords=tuple((k, coords[k]) for k in COORDINATES if k in coords),
                        source="file name")
    return RankInfo(str(path))


def _number(path: str | Path, key: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InputError(f"{path}: distributedInfo.{key} is {value!r}, not a non-negative integer")
    return value


def rank_order(infos: Sequence[RankInfo]) -> list[int] | None:
    """Indices of `infos` in rank order, or None when the traces are not a set of ranks (fewer
    than two, or one without a rank). Two traces claiming one rank is an InputError."""
    if len(infos) < 2 or not all(i.ranked for i in infos):
        return None
    order = sorted(range(len(infos)), key=lambda i: infos[i].order)
    for a, b in zip([infos[i] for i in order], [infos[i] for i in order[1:]], strict=False):
        if a.rank == b.rank and a.coords == b.coords:
            raise InputError(
                f"{a.path} and {b.path} both claim rank {a.label} ({a.source}, {b.source}): a "
                "cross-rank summary takes one trace per rank; analyse each run or profiler "
                "window on its own")
    return order


def unranked_note(infos: Sequence[RankInfo]) -> str | None:
    """One line when some traces have a rank and others none (no cross-rank summary)."""
    ranked = [i for i in infos if i.ranked]
    if not ranked or len(ranked) == len(infos):
        return None
    bare = next(i for i in infos if not i.ranked)
    return (f"no cross-rank summary: {bare.path} has no rank (no distributedInfo, no rank in its "
            f"name) while {ranked[0].path} is rank {ranked[0].label}")


def summarize(ranks: Sequence[RankInfo], operators: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """Per (phase, operator) statistics of device time over ranks (`SUMMARY_COLUMNS`).

    `operators[i]` is rank `ranks[i]`'s operator table (ranks with distinct labels, as
    `rank_order` checks) (roofline.OPERATOR_COLUMNS; its
    aggregate rows, layer NA, are used). Rows come per phase in order of first appearance, by
    median time (descending), each phase's `device time` row first.
    """
    labels = [r.label for r in ranks]
    long = pd.concat(
        [t.loc[t["layer"].isna(), ["phase", "operator", "time_us"]].assign(rank=label)
         for label, t in zip(labels, operators, strict=True)],
        ignore_index=True,
    )
    whole = long.groupby(["phase", "rank"], sort=False)["time_us"].sum().reset_index()
    long = pd.concat([whole.assign(operator=WHOLE), long], ignore_index=True)
    wide = long.pivot_table(index=["phase", "operator"], columns="rank", values="time_us",
                            aggfunc="sum", sort=False)
    ran = wide.notna().sum(axis=1)
    times = wide.reindex(columns=labels).fillna(0.0).to_numpy()
    median = np.median(times, axis=1)
    out = pd.DataFrame({
        "phase": wide.index.get_level_values("phase"),
        "operator": wide.index.get_level_values("operator"),
        "ranks": ran.to_numpy(),
        "min_time_us": times.min(axis=1),
        "median_time_us": median,
        "max_time_us": times.max(axis=1),
        "skew": times.max(axis=1) / np.where(median > 0, median, np.nan),
        "slowest_rank": np.asarray(labels)[times.argmax(axis=1)],
        "fastest_rank": np.asarray(labels)[times.argmin(axis=1)],
    })
    phases = {p: i for i, p in enumerate(long["phase"].drop_duplicates())}
    out = out.assign(_p=out["phase"].map(phases), _w=out["operator"] != WHOLE)
    out = out.sort_values(["_p", "_w", "median_time_us"], ascending=[True, True, False],
                          kind="stable")
    return out[list(SUMMARY_COLUMNS)].astype(SUMMARY_COLUMNS).reset_index(drop=True)


@dataclass(frozen=True)
class CrossRank:
    """A set of rank traces and their cross-rank summary (`summarize`)."""

    ranks: tuple[RankInfo, ...]  # in rank order
    summary: pd.DataFrame  # SUMMARY_COLUMNS
    waiting: pd.DataFrame | None = None  # comms.WAITING_COLUMNS, when collectives were given

    @classmethod
    def of(cls, infos: Sequence[RankInfo], operators: Sequence[pd.DataFrame],
           collectives: Sequence[pd.DataFrame | None] | None = None) -> CrossRank | None:
        """The summary of traces `infos` with operator tables `operators` (same order), or None
        when they are not a set of ranks (`rank_order`). With each rank's `collectives`
        (Analysis.collectives), `waiting` says which rank waits in them, for which straggler."""
        order = rank_order(infos)
        if order is None:
            return None
        ranks = tuple(infos[i] for i in order)
        waiting = None
        if collectives is not None and all(collectives[i] is not None for i in order):
            waiting = comms.waiting([r.label for r in ranks], [collectives[i] for i in order])
        return cls(ranks, summarize(ranks, [operators[i] for i in order]), waiting)

    def text(self) -> str:
        """Terminal text: which file is which rank, then one row per (phase, operator)."""
        sources = ", ".join(sorted({r.source for r in self.ranks}))
        lines = [f"cross-rank summary: {len(self.ranks)} ranks (rank from {sources}); "
                 "skew = max / median time over ranks",
                 *(f"  rank {r.label}: {r.path}" for r in self.ranks),
                 f"{'operator':<20} {'phase':<7} {'ranks':>5} {'min µs':>10} {'median µs':>10} "
                 f"{'max µs':>10} {'skew':>6} {'slowest':>8} {'fastest':>8}"]
        for r in self.summary.itertuples():
            skew = "-" if pd.isna(r.skew) else f"{r.skew:.2f}"
            lines.append(f"{r.operator:<20.20} {r.phase:<7.7} {r.ranks:>5} "
                         f"{r.min_time_us:>10.1f} {r.median_time_us:>10.1f} "
                         f"{r.max_time_us:>10.1f} {skew:>6} {r.slowest_rank:>8} "
                         f"{r.fastest_rank:>8}")
        if self.waiting is not None:
            lines += comms.waiting_lines(self.waiting)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, object]:
        """JSON-safe: `skew_definition`, `ranks` [{path, rank, coords, world_size, source,
        label}], `summary` [SUMMARY_COLUMNS rows, NaN as null]."""
        return {
            "skew_definition": "max_time_us / median_time_us over ranks",
            "ranks": [{**asdict(r), "coords": dict(r.coords), "label": r.label} for r in self.ranks],
            "summary": json.loads(self.summary.to_json(orient="records")),
            "waiting": (None if self.waiting is None
                        else json.loads(self.waiting.to_json(orient="records"))),
        }
