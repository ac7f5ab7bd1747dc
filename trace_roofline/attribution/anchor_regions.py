"""Op instances cut at their anchors (matched GEMMs, attention, embedding) into regions.

Design notes: docs/design.md ("trace_roofline/attribution/naming.py").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from trace_roofline.attribution.naming import Names
from trace_roofline.attribution.op_families import classify, with_roles
from trace_roofline.model.operators import Name


@dataclass(frozen=True)
class Regions:
    """Rows cut into regions: runs of rows, each opened by a row where `opens` holds (an anchor,
    or the first row of a sequence group). A quantity of a region is reduced once per region
    (over its run of rows) and broadcast back to its rows."""

    region: np.ndarray  # per row, the number of its region
    starts: np.ndarray  # per region, its first row
    pos: np.ndarray  # per row, its position in its region (0: the row that opened it)

    @classmethod
    def cut(cls, opens: np.ndarray) -> Regions:
        """The regions opened at the rows where `opens` holds (it holds at the first row)."""
        region = np.cumsum(opens) - 1
        starts = np.flatnonzero(opens)
        return cls(region, starts, np.arange(len(opens)) - starts[region])

    @property
    def past(self) -> int:
        """A position past every row: `first` where no row of the region holds."""
        return len(self.pos) + 1

    def first(self, mask: np.ndarray) -> np.ndarray:
        """Per row, the first position in its region where mask holds (`past` if none)."""
        return np.minimum.reduceat(np.where(mask, self.pos, self.past), self.starts)[self.region]

    def last(self, mask: np.ndarray) -> np.ndarray:
        """Per row, the last position in its region where mask holds (-1 if none)."""
        return np.maximum.reduceat(np.where(mask, self.pos, -1), self.starts)[self.region]

    def any(self, mask: np.ndarray) -> np.ndarray:
        """Per row, whether mask holds at some row of its region."""
        return np.logical_or.reduceat(mask, self.starts)[self.region]

    def opening(self, values: np.ndarray) -> np.ndarray:
        """Per row, the value at the row that opened its region."""
        return values[self.starts][self.region]

    def count(self, mask: np.ndarray) -> np.ndarray:
        """Per row, at how many rows of its region up to and including it mask holds."""
        total = np.cumsum(mask)
        return total - (total - mask)[self.starts][self.region]

    def opens_norm(self, flags: dict[str, np.ndarray]) -> np.ndarray:
        """Per row, whether a norm opens there: its first op (pow, a fused rms_norm), or the
        cast right before that op in the same region."""
        pos = self.pos
        prev_cast = np.r_[False, flags["cast"][:-1]] & (pos > 0)
        next_open = np.r_[flags["normopen"][1:], False] & np.r_[pos[1:] > 0, False]
        return (flags["cast"] & next_open) | (flags["normopen"] & ~prev_cast)


@dataclass(frozen=True)
class Gaps:
    """The instances cut at their anchors: per row its region, the anchor opening the region
    (`before`: "" at a sequence group's start) and the next one in the group (`after`: "" at
    its end), with the op-family flags (classify, with the kernel roles)."""

    regions: Regions
    flags: dict[str, np.ndarray]
    before: Names
    after: Names
    anchors: Names  # per row, its own anchor's name ("": none)
    gemms: Names  # name_gemms' names
    known: np.ndarray  # a GEMM matched to a linear
    generic: np.ndarray  # a GEMM named linear[K×N]
    is_anchor: np.ndarray

    @property
    def pos(self) -> np.ndarray:
        return self.regions.pos


def op_flags(inst: pd.DataFrame) -> dict[str, np.ndarray]:
    """classify()'s flags with the kernel roles; an Inductor kernel that fused a weight GEMM
    (its K known: gemm_kn) is a GEMM."""
    flags = with_roles(classify(inst), inst)
    if "K" in inst:
        flags["gemmop"] = flags["gemmop"] | (flags["triton"] & (inst["K"].to_numpy() >= 0))
    return flags


def cut_at_anchors(inst: pd.DataFrame, gemm: pd.Series) -> Gaps:
    """The gaps between anchors: weight GEMMs matched to a linear (all of them when none is:
    each `linear[K×N]` then anchors), attention and embedding ops. An unmatched GEMM (the RoPE
    inverse-frequency product) is named by position like any other op."""
    flags = op_flags(inst)
    grp = inst["grp"].to_numpy()
    gemms = Names.of(gemm)
    generic = gemms.isin(v for v in gemms.vocab if v.startswith("linear["))
    known = ~gemms.isin([""]) & ~generic
    vocab = np.append(gemms.vocab, ["", Name.ATTENTION, Name.EMBEDDING])
    none, attention, embedding = len(vocab) - 3, len(vocab) - 2, len(vocab) - 1
    anchor = np.where(known | generic.all(), gemms.codes, none)
    anchor = np.where(flags["attn"] & (anchor == none), attention, anchor)
    anchor = np.where(flags["emb"] & (anchor == none), embedding, anchor)
    is_anchor = anchor != none
    new_grp = np.r_[True, grp[1:] != grp[:-1]] if len(inst) else np.zeros(0, bool)
    regions = Regions.cut(is_anchor | new_grp)
    reg_anchor, reg_grp = anchor[regions.starts], grp[regions.starts]
    same_grp = np.r_[reg_grp[1:] == reg_grp[:-1], False]
    nxt = np.where(same_grp, np.r_[reg_anchor[1:], none], none)
    return Gaps(regions, flags, Names(reg_anchor[regions.region], vocab),
                Names(nxt[regions.region], vocab), Names(anchor, vocab), gemms, known, generic,
                is_anchor)
