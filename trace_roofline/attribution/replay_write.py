"""Writing back: each graph's position table broadcast to its replays, overwriting their rows
of the attributed table.

Design notes: docs/design.md ("trace_roofline/attribution/graphs.py").
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from trace_roofline.attribution.graph_mapping import CARRIED
from trace_roofline.model import operators


def write_back(att: pd.DataFrame, rr: pd.DataFrame, graph: np.ndarray,
               results: list[pd.DataFrame]) -> tuple[pd.DataFrame, np.ndarray]:
    """Broadcast each graph's position table (graph g's: results[g]) to its replays (rr, graph:
    replay_rows and each row's graph) and overwrite those rows; and how each row was named."""
    sizes = np.array([len(r) for r in results], dtype=np.int64)
    goff = np.r_[0, np.cumsum(sizes)[:-1]]
    pos_table = pd.concat(results, ignore_index=True)
    at = goff[graph] + rr["pos"].to_numpy()
    rows = rr["row"].to_numpy()
    out = att.copy()
    # a name outside the vocabulary (other, linear[K×N]) rests on no evidence, as attribute says
    vocab = pos_table["operator"].isin(operators.NAMES).to_numpy()
    pos_table["evidence"] = np.where(vocab, pos_table["evidence"], operators.FALLBACK)
    for c in (*CARRIED, "evidence"):
        out[c] = _overwrite(att[c], rows, pos_table[c].to_numpy(dtype=object), at)
    layer = out["layer"].astype("Int64").array.copy()
    layer[rows] = pos_table["layer"].astype("Int64").array.take(at)
    out["layer"] = layer
    # one op instance per (replay, template instance), numbered after the trace's own; an
    # unnamed kernel is one of its own. No cpu op launched a replayed kernel: op_id stays NA.
    inst = pos_table["inst"].to_numpy()[at]
    k = int(pos_table["inst"].max()) + 1 if len(pos_table) else 0
    base = int(att["instance"].max()) + 1 if len(att) else 0
    replay = rr["replay"].to_numpy()
    alone = base + (int(replay.max()) + 1) * k + np.cumsum(inst < 0) - 1
    instance = att["instance"].to_numpy(np.int64).copy()
    instance[rows] = np.where(inst >= 0, base + replay * k + inst, alone)
    out["instance"] = instance
    op_id = out["op_id"].astype("Int64").array.copy()
    op_id[rows] = pd.NA
    out["op_id"] = op_id
    return out, pos_table["how"].to_numpy(dtype=object)[at]


def _overwrite(col: pd.Series, rows: np.ndarray, values: np.ndarray, at: np.ndarray):
    """A str column with values[at] (object, None = missing) at `rows` (arrow take and
    replace_with_mask: no per-row Python, no categorical of the whole column)."""
    order = np.argsort(rows, kind="stable")
    mask = np.zeros(len(col), dtype=bool)
    mask[rows] = True
    old = pa.array(col.array, type=pa.large_string())
    if isinstance(old, pa.ChunkedArray):
        old = old.combine_chunks()
    new = pc.take(pa.array(values, type=pa.large_string()), pa.array(at[order]))
    return pd.array(pc.replace_with_mask(old, pa.array(mask), new), dtype="str")
