"""What every way of naming a graph shares: the op a replayed kernel's name says it runs, the
graph's kernels as seen, its position table and the record of how it was named.

Design notes: docs/design.md ("trace_roofline/attribution/graphs.py").
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from trace_roofline.attribution import naming
from trace_roofline.attribution.graph_mapping import CARRIED
from trace_roofline.model import kernels, operators
from trace_roofline.model.operators import Name

GEMM = "gemm"  # kernel_ops' op of a weight GEMM (named by its place)
_SDPA_FUSED = re.compile(r"^triton_\w*fused_\w*(?:scaled_dot_product|attention)")
ATTENTION_OP = "aten::scaled_dot_product_attention"  # kernel_ops' op of an attention kernel


@dataclass(frozen=True)
class GraphKernels:
    """One graph's kernels (those of its first replay), in order: their codes in `vocab` (the
    trace's and the mappings' kernel names), names, kinds (kernel, memset, memcpy) and grids."""

    codes: np.ndarray
    names: np.ndarray
    kinds: np.ndarray
    grids: np.ndarray
    vocab: pd.Index


@dataclass(frozen=True)
class GraphNaming:
    """How one graph was named: its row of the report's per-graph table (GRAPH_COLUMNS) less the
    counts, and the flags the reader must not miss."""

    method: str = "none"  # graph_map | kernel_name | none
    template: str | None = None  # mapping source and pass, for graph_map
    matched: int = 0  # kernels with an eager twin of the same name
    attached: int = 0  # split-K reduces / memsets joined to a neighbour
    grid_mismatch: int = 0  # matched kernels whose grid differs from the twin's
    shapes: str = "none"  # mapping | user | step | none
    note: str | None = None
    flags: tuple[str, ...] = ()

    def noted(self, more: str) -> GraphNaming:
        """The naming with `more` appended to its note."""
        return dataclasses.replace(self, note="; ".join(x for x in (self.note, more) if x))

    def flagged(self, *flags: str) -> GraphNaming:
        """The naming with `flags` appended to its own."""
        return dataclasses.replace(self, flags=(*self.flags, *flags))

    def row(self) -> dict[str, object]:
        """The per-graph table's columns it fills."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "flags"}


def kernel_ops(names: pd.Series) -> pd.Series:
    """The op each kernel name runs, evaluated once per distinct name, first that applies:
    RoPE's fp32 SIMT GEMM and the grouped GEMM's set-up (kernels.KERNEL_OPS' first two), GEMM for the
    registry's weight-GEMM roles (kernels.GEMM_ROLES), ATTENTION_OP for its attention roles, a
    Triton kernel's own name (its fused ops), kernels.KERNEL_OPS' ATen or engine op, else "" (nothing
    said)."""
    first, rest = kernels.KERNEL_OPS[:2], kernels.KERNEL_OPS[2:]

    def per(u: pd.Series) -> pd.Series:
        text = u.fillna("")
        out = pd.Series("", index=u.index, dtype=object)
        role = kernels.roles(text).astype(object).to_numpy()
        triton = text.str.startswith("triton_").to_numpy(bool)
        steps: list[tuple[np.ndarray, str | None]] = [
            (text.str.contains(rx).to_numpy(bool), op) for rx, op in first]
        steps += [(np.isin(role, list(kernels.GEMM_ROLES)), GEMM),
                  (np.isin(role, list(kernels.ATTENTION_ROLES)), ATTENTION_OP),
                  # Inductor's kernels fused into SDPA's inputs run inside the attention op
                  (triton & text.str.contains(_SDPA_FUSED).to_numpy(bool), ATTENTION_OP),
                  (triton, None)]
        steps += [(text.str.contains(rx).to_numpy(bool), op) for rx, op in rest]
        left = np.ones(len(u), dtype=bool)
        for hit, op in steps:
            take = left & hit
            out[take] = u[take] if op is None else op
            left &= ~take
        return out
    return naming.per_value(names, per)


def kernel_roles(names: np.ndarray) -> pd.Categorical:
    """The registry's role of each kernel name (kernels.ROLES)."""
    return pd.Categorical(kernels.roles(pd.Series(names, dtype=object)))


def empty_positions(n: int) -> pd.DataFrame:
    """A position table of n kernels, none named: CARRIED, layer, inst (instance within the
    replay, -1 none), evidence, how (matched | attached | named | none)."""
    t = pd.DataFrame({c: pd.Series([None] * n, dtype=object) for c in CARRIED})
    t["operator"] = Name.UNATTRIBUTED
    t["layer"] = pd.array([pd.NA] * n, dtype="Int64")
    t["inst"] = np.full(n, -1, np.int64)
    t["evidence"] = operators.FALLBACK
    t["how"] = "none"
    return t


def nearest(src: np.ndarray, forward: bool) -> np.ndarray:
    """Per position, the last (forward) or next matched template index, -1 if none."""
    n = len(src)
    idx = np.arange(n) if forward else np.arange(n)[::-1]
    s = src[idx]
    at = np.maximum.accumulate(np.where(s >= 0, np.arange(n), -1))
    out = np.where(at >= 0, s[np.maximum(at, 0)], -1)
    return out if forward else out[::-1]
