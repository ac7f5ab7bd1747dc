"""Cost rules of the pointwise ops, norms, softmax and reductions (top-k, sort, scan,
histogram, nonzero): FLOPs per element by the tables below, bytes read and written once.

Design notes: docs/design.md ("trace_roofline/costs/").
"""

from __future__ import annotations

import math

from trace_roofline.costs.call import Call, Cost, Io, Kind, Malformed, broadcast, integer, tensors
from trace_roofline.model import dtypes, formulas

# FLOPs per output element of pointwise ops (an in-place `op_` costs as `op`).
POINTWISE_FLOPS: dict[str, float] = {
    **dict.fromkeys(["add", "sub", "mul", "div", "floor_divide", "remainder", "neg", "rsqrt",
                     "sqrt", "reciprocal", "pow", "exp", "log", "abs", "relu", "maximum",
                     "minimum", "clamp", "clamp_min",
                     "clamp_max", "where", "masked_fill", "sign", "square", "cos", "sin",
                     "eq", "ne", "lt", "le", "gt", "ge", "logical_not", "logical_and",
                     "bitwise_and", "bitwise_or", "bitwise_not", "greater"], 1.0),
    "addcmul": 2.0, "addcdiv": 2.0, "lerp": 2.0,
    "sigmoid": 3.0,  # exp, add, divide
    "silu": 4.0,  # x · sigmoid(x)
    "tanh": 4.0, "erf": 4.0,
    "gelu": 8.0,  # erf form: scale, erf, add, two multiplies (erf counted as 4)
}
COMPARISONS = {"eq", "ne", "lt", "le", "gt", "ge", "greater", "logical_not", "logical_and"}
REDUCTIONS = {"mean", "sum", "amax", "amin", "max", "min", "argmax", "argmin", "var", "std",
               "norm", "linalg_vector_norm", "prod", "any", "all", "logsumexp"}
SOFTMAX = {"softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"}
NORMS = {"rms_norm": 4.0, "_fused_rms_norm": 4.0, "layer_norm": 7.0, "native_layer_norm": 7.0}


def elementwise(c: Call) -> Cost:
    """`POINTWISE_FLOPS` per output element; out = the inputs' broadcast (in place: the first)."""
    op, ts = c.plain, tensors(c.args)
    if not ts:
        return Cost(uncosted=f"aten::{op}: no tensor inputs")
    if c.plain != c.base:  # in place
        out_numel, out_b = ts[0].numel, ts[0].b
    else:
        out_numel = math.prod(broadcast(*(t.dims for t in ts)))
        # Type promotion, roughly: the widest dtype among the non-0-d tensors wins.
        ranked = [t for t in ts if t.dims] or ts
        out_b = 1 if op in COMPARISONS else max(t.b for t in ranked)
    main = max(ts, key=lambda t: t.numel)
    return Io(POINTWISE_FLOPS[op] * out_numel, ts, out_numel, out_b, Kind.ELEMENTWISE, main.dtype).cost()


def norm(c: Call) -> Cost:
    """`NORMS` FLOPs per element of the first tensor; reads every tensor, writes the first's size."""
    ts = tensors(c.args, 1)
    x = ts[0]
    return Io(NORMS[c.plain] * x.numel, ts, x.numel, x.b, Kind.NORM, x.dtype).cost()


def softmax(c: Call) -> Cost:
    """5 FLOPs per element (max, subtract, exp, sum, divide)."""
    x = tensors(c.args, 1)[0]
    return Io(x.numel * 5.0, [x], x.numel, x.b, Kind.ELEMENTWISE, x.dtype).cost()


def reduction(c: Call) -> Cost:
    """1 FLOP per input element; the last dim reduced unless Concrete Inputs give the dims."""
    x, args = tensors(c.args, 1)[0], c.args
    reduced = x.dims[-1:] if x.dims else []
    spec = args[1].concrete if len(args) > 1 else ""
    if spec.startswith("["):
        axes = [integer(v, "reduction dim") for v in spec.strip("[]").split(",") if v.strip()]
        if any(not -len(x.dims) <= a < len(x.dims) for a in axes):
            raise Malformed(f"reduction dims {axes} out of range for {x.dims}")
        reduced = [x.dims[a] for a in axes] if axes else x.dims
    out = x.numel / max(math.prod(reduced), 1)
    return Io(x.numel, [x], out, x.b, Kind.REDUCTION, x.dtype).cost()


def sort(c: Call) -> Cost:
    """sort / argsort(x): reads x, writes the sorted values and their int64 indices (argsort
    only the indices); no FLOPs counted (comparisons, not arithmetic)."""
    x = tensors(c.args, 1)[0]
    out = x.numel * (8 + (0 if c.plain == "argsort" else x.b))
    return Cost(Kind.COPY, 0.0, float(formulas.elementwise_bytes(x.numel, 0, x.b) + out), x.dtype,
                f"{x.dims} sorted")


def scan(c: Call) -> Cost:
    """cumsum(x, dim, dtype?): one add per element, output in `dtype` when recorded."""
    x = tensors(c.args, 1)[0]
    out = dtypes.by_scalar_type(c.args[2].concrete) if len(c.args) > 2 else None
    return Io(float(x.numel), [x], x.numel, out.bytes if out else x.b, Kind.REDUCTION,
               x.dtype).cost()


def histc(c: Call) -> Cost:
    """histc(x, bins, min, max): reads x, writes `bins` counts; one increment per element."""
    x = tensors(c.args, 1)[0]
    bins = integer(c.args[1].concrete, "histc bins") if len(c.args) > 1 else 100
    return Io(float(x.numel), [x], bins, x.b, Kind.REDUCTION, x.dtype).cost()


def nonzero(c: Call) -> Cost:
    """nonzero(x): one comparison per element read; its data-dependent output (count x rank
    int64 indices) is not counted, so the bytes are the input only."""
    x = tensors(c.args, 1)[0]
    return Io(float(x.numel), [x], 0, 8, Kind.REDUCTION, x.dtype).cost()


def topk(c: Call) -> Cost:
    """topk(x [.., E], k, dim, ...): reads x, writes k values and k int64 indices per row;
    one comparison per element."""
    x = tensors(c.args, 1)[0]
    if len(c.args) < 2 or not c.args[1].concrete:
        return Cost(uncosted=f"{c.name}: k not recorded")
    k = integer(c.args[1].concrete, "topk k")
    rows = x.numel // max(x.dims[-1] if x.dims else 1, 1)
    nbytes = formulas.elementwise_bytes(x.numel, rows * k, x.b) + rows * k * 8
    return Cost(Kind.REDUCTION, float(x.numel), float(nbytes), x.dtype, f"{x.dims} top-{k}")

