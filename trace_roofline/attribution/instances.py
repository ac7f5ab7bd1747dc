"""Op instances: one row per op that launched units, with the facts its name is read from
(ranges, op and outermost op names, shapes, kernel role, training part) and its group (one
thread's ops of one step and training part, in launch order).

Design notes: docs/design.md ("trace_roofline/attribution/attribute.py").
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from trace_roofline.attribution import gemm_operands, naming
from trace_roofline.attribution.codes import categorical, take_cat
from trace_roofline.attribution.training import TRAINING_PARTS
from trace_roofline.model import kernels
from trace_roofline.model.operators import Name

# the kinds of work that make an op's role (an attention and its split-KV reduce are one); the
# other roles (copies, elementwise, memsets, sorts) go with any of them
_ROLE_GROUPS: tuple[tuple[str, ...], ...] = (
    (Name.ATTENTION, "attention_reduce"), ("gemm", "moe_gemm"), ("conv",), ("collective",),
    ("norm", "fused_add_norm"), (Name.ROPE,), ("kv_cache_write",), ("activation",), ("quant",),
    ("moe_routing",), ("moe_finalize",), (Name.LOSS,), (Name.OPTIMIZER,), (Name.SAMPLING,))
_ROLE_GROUP = {role: i for i, group in enumerate(_ROLE_GROUPS) for role in group}


def instances(units: pd.DataFrame, ops: pd.DataFrame) -> pd.DataFrame:
    """One row per op instance (index: op_idx), in launch order within (step, thread); its
    name columns are categoricals over the trace's distinct values."""
    op_idx = units["op_idx"].to_numpy()
    oi, first, inv = np.unique(op_idx, return_index=True, return_inverse=True)
    linked = oi >= 0
    first, oi = first[linked], oi[linked]
    inv = inv - (len(linked) - len(oi))  # the unit's instance row (-1: unlinked)
    names = categorical(ops["name"])
    step = units["step"].astype("Int64").to_numpy(dtype=np.int64, na_value=-1)[first]
    key = units["key"].to_numpy()[first]
    inst = pd.DataFrame({
        "t": ops["s"].to_numpy()[oi], "key": key,
        "step": pd.arrays.IntegerArray(np.maximum(step, 0), step < 0),
        "ann_name": take_cat(units["ann_name"].array, first),
        "ann_layer": units["ann_layer"].array.take(first),
        "op_name": take_cat(names, oi),
        "top_name": take_cat(names, units["top_idx"].to_numpy()[first]),
        "input_dims": take_cat(categorical(ops["input_dims"]), oi),
        "input_strides": take_cat(categorical(ops["input_strides"]), oi),
        "kernel_coll": _first_collective(units["coll"].array, inv, len(oi)),
        "role": _instance_roles(categorical(units["name"]), inv, len(oi)),
        "training": take_cat(units["training"].array, first),
        "node": take_cat(units["node"].array, first),
        "frame": units["frame"].to_numpy()[first],
    }, index=pd.Index(oi, name="op_idx"))
    part = inst["training"].array.codes.astype(np.int64) + 1  # backward apart from forward
    # (each recomputation, a backward node's, a group of its own: one layer's forward)
    again = np.where(part == TRAINING_PARTS.index("recompute") + 1, inst["frame"].to_numpy(), -1)
    sequence = (step * (int(key.max(initial=0)) + 2) + key + 1) * (len(TRAINING_PARTS) + 1) + part
    inst["grp"] = _pair_codes(sequence, again)
    return inst.sort_values(["grp", "t"], kind="stable")


def _pair_codes(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """0, 1, ... per distinct (a, b) pair, in order of first appearance."""
    ca, cb = pd.factorize(a)[0], pd.factorize(b)[0]
    return pd.factorize(ca.astype(np.int64) * (int(cb.max(initial=0)) + 1) + cb)[0]


def _first_collective(coll: pd.Categorical, inv: np.ndarray, n: int) -> pd.Categorical:
    """Per instance, the collective of its first unit that runs a collective kernel."""
    codes = np.asarray(coll.codes, dtype=np.int64)
    rows = np.flatnonzero((codes >= 0) & (inv >= 0))
    out = np.full(n, -1, dtype=np.int64)
    at, first = np.unique(inv[rows], return_index=True)
    out[at] = codes[rows][first]
    return pd.Categorical.from_codes(out, coll.categories)


def _instance_roles(names: pd.Categorical, inv: np.ndarray, n: int) -> pd.Categorical:
    """Per instance (`inv`: each unit's instance row, -1: none), the role of its kernels
    (kernels.classify on the units' names, once per distinct name): the first in
    kernels.ROLE_PRIORITY among them; `unknown` when they do several kinds of work
    (`_ROLE_GROUP`)."""
    order = pd.Index(kernels.ROLE_PRIORITY)
    last = len(order) - 1
    role = kernels.roles(pd.Series(names)).array
    rank = np.append(order.get_indexer(role.categories), last)[role.codes]
    group = np.array([*(_ROLE_GROUP.get(c, -1) for c in role.categories), -1],
                     dtype=np.int64)[role.codes]
    linked = inv >= 0
    best = np.full(n, last, dtype=np.int64)
    np.minimum.at(best, inv[linked], rank[linked])
    grouped = linked & (group >= 0)
    lo = np.full(n, np.iinfo(np.int64).max)
    hi = np.full(n, -1, dtype=np.int64)
    np.minimum.at(lo, inv[grouped], group[grouped])
    np.maximum.at(hi, inv[grouped], group[grouped])
    # an op whose kernels do several kinds of work (a compiled region replaying a CUDA graph,
    # a wrapper) has no role of its own
    mixed = (hi >= 0) & (lo != hi)
    return pd.Categorical.from_codes(np.where(mixed, last, best), list(order))


def with_weight_shapes(inst: pd.DataFrame) -> pd.DataFrame:
    """`inst` with the (K, N) of each instance's weight GEMM and (WE, WK, WN) of its expert
    weights (gemm_operands.expert_weight_kn), parsed once per distinct (op name, Input Dims)."""
    return inst.assign(**naming.per_value(inst[["op_name", "input_dims"]], _weight_shapes))


def _weight_shapes(distinct: pd.DataFrame) -> pd.DataFrame:
    base = naming.base_name(distinct["op_name"]).fillna("")
    k, n, w = gemm_operands.gemm_kn(base, distinct["input_dims"])
    we, wk, wn = gemm_operands.expert_weight_kn(base, distinct["input_dims"])
    return pd.DataFrame({"K": k, "N": n, "W": w, "WE": we, "WK": wk, "WN": wn})
