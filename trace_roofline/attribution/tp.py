"""Tensor parallelism: which shard of the model a rank's trace ran (`infer_tp`).

Design notes: docs/design.md ("trace_roofline/attribution/tp.py").
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from trace_roofline.attribution import gemm_operands, naming
from trace_roofline.errors import InputError
from trace_roofline.model import models
from trace_roofline.model.models import ModelSpec
from trace_roofline.trace import Trace


def gemm_shapes(trace: Trace) -> set[tuple[int, int]]:
    """The distinct (K, N) of the trace's weight GEMMs (cpu ops with recorded shapes)."""
    return gemm_shapes_of(trace.cpu_ops["name"], trace.cpu_ops["input_dims"])


def gemm_shapes_of(names: pd.Series, input_dims: pd.Series) -> set[tuple[int, int]]:
    """The distinct (K, N) of the weight GEMMs among ops (their names and raw Input Dims),
    parsed once per distinct (op name, Input Dims) pair, found from the categorical codes."""
    name, dims = (c.astype("category").array for c in (names, input_dims))
    if not len(name):
        return set()
    key = (name.codes.astype(np.int64) + 1) * (len(dims.categories) + 1) + dims.codes + 1
    first = np.flatnonzero(~pd.Index(key).duplicated())  # (hashed: no sort of every op)
    names = pd.Series(name.take(first), dtype="string")
    k, n, _ = gemm_operands.gemm_kn(naming.base_name(names).fillna(""),
                           pd.Series(dims.take(first), dtype="string"))
    ok = k >= 0
    return set(zip(k[ok].tolist(), n[ok].tolist(), strict=True))


def infer_tp(shapes: set[tuple[int, int]], model: ModelSpec) -> int:
    """The TP degree whose shard of `model` explains most of the GEMM `shapes` (K, N) (1 when
    none matches any): see the module docstring."""
    best, score = 1, 0
    for t in models.TP_DEGREES:
        try:
            shard = model.shard(t)
        except InputError:  # t does not divide the heads or the intermediate size
            continue
        hits = len(shapes & set(models.expected_linears(shard).values()))
        if hits > score:
            best, score = t, hits
    return best
