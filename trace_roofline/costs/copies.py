"""Cost rules of the ops that move data without arithmetic: views and allocations, copies
and casts, concatenation, index writes, gathers (embedding lookups), arange, `.item()`.

Design notes: docs/design.md ("trace_roofline/costs/").
"""

from __future__ import annotations

import math

from trace_roofline.costs.call import Call, Cost, Io, Kind, Malformed, integer, known, tensors
from trace_roofline.model import dtypes, formulas
from trace_roofline.model.operators import Name

COPIES = {"clone", "contiguous", "_to_copy", "to"}
# Views and allocations move no data (timed units of their own in CPU-only traces).
VIEWS = {"view", "_unsafe_view", "reshape", "transpose", "t", "permute", "slice", "select",
          "narrow", "chunk", "split", "split_with_sizes", "unbind", "alias", "expand",
          "as_strided", "unsqueeze", "squeeze", "flatten", "unflatten", "detach", "detach_",
          "lift_fresh", "view_as", "expand_as", "empty", "empty_like", "empty_strided",
          "resolve_conj", "resolve_neg", "result_type"}


def view(c: Call) -> Cost:
    """Views and allocations: no data moves."""
    ts = tensors(c.args)
    return Cost(Kind.VIEW, 0.0, 0.0, ts[0].dtype if ts else None, "view (no data moved)")


def copy(c: Call) -> Cost:
    """fill_/zero_ write; copy_(dst, src) reads src, writes dst; clone/_to_copy/to read and write
    (out dtype from Concrete Inputs when recorded)."""
    if c.base in ("fill_", "zero_"):
        x = tensors(c.args, 1)[0]
        return Io(0.0, [], x.numel, x.b, Kind.COPY, x.dtype).cost()
    if c.base == "copy_":  # src may broadcast
        dst, src = tensors(c.args, 2)[:2]
        return Io(0.0, [src], dst.numel, dst.b, Kind.COPY, dst.dtype).cost()
    x = tensors(c.args, 1)[0]
    # _to_copy(self, dtype, ...), to(self, [device,] dtype, ...): the dtype, when recorded.
    out = next(filter(None, (dtypes.by_scalar_type(a.concrete) for a in c.args[1:3])), None)
    return Io(0.0, [x], x.numel, out.bytes if out else x.b, Kind.COPY, out.short if out else x.dtype).cost()


def cat(c: Call) -> Cost:
    """cat(tensors, dim): the list's dims are nested; its dtype is not recorded (`fallback`)."""
    first = c.args[0] if c.args else None
    if first is None or first.type != "TensorList" or c.fallback is None:
        return Cost(uncosted="aten::cat: tensor-list dtype unknown")
    n = sum(math.prod(d) for d in first.dims)
    b = known(c.fallback).bytes
    shape = f"{len(first.dims)} tensors -> {n}"
    return Cost(Kind.COPY, 0.0, formulas.elementwise_bytes(n, n, b), c.fallback, shape)


def index_write(c: Call) -> Cost:
    """index_copy_(self, dim, index, source) / index_put_(self, indices, values): only the
    written slots of `self` move."""
    ts = tensors(c.args, 2)
    dst, src = ts[0], ts[-1]
    index_bytes = sum(formulas.elementwise_bytes(t.distinct, 0, t.b) for t in ts[1:-1])
    flops = float(src.numel) if c.plain == "index_add" else 0.0
    return Io(flops, [src], src.numel, dst.b, Kind.COPY, dst.dtype, index_bytes).cost()


def gather(c: Call) -> Cost:
    """embedding(weight, ids) / index_select(self, dim, index) / gather(self, dim, index): read
    and write the chosen elements, plus the indices (their distinct elements: HF's gather passes
    a [T, H] index expanded from T ids)."""
    table, index = tensors(c.args, 2)[:2]
    if c.base == Name.EMBEDDING:  # aten::embedding
        rows = index.numel * (table.dims[-1] if table.dims else 1)
    elif c.base == "gather":
        rows = index.numel
    else:
        dim = integer(c.args[1].concrete or "0", "index_select dim")
        if not -len(table.dims) <= dim < len(table.dims):
            raise Malformed(f"index_select dim {dim} out of range for {table.dims}")
        rest = [d for i, d in enumerate(table.dims) if i != dim % len(table.dims)]
        rows = math.prod(rest) * index.numel
    nbytes = formulas.elementwise_bytes(rows, rows, table.b)
    nbytes += formulas.elementwise_bytes(index.distinct, 0, index.b)
    return Cost(Kind.COPY, 0.0, nbytes, table.dtype, f"{table.dims}[{index.dims}] -> {rows}")


def scalar_read(c: Call) -> Cost:
    """_local_scalar_dense (`.item()`): one element copied to the host."""
    x = tensors(c.args, 1)[0]
    return Io(0.0, [x], 1, x.b, Kind.COPY, x.dtype).cost()


def arange(c: Call) -> Cost:
    """arange([start,] end[, step]): writes ceil((end - start) / step) elements (Concrete Inputs);
    int64 unless a bound is fractional."""
    nums = []
    for a in c.args:
        try:
            nums.append(float(a.concrete))
        except ValueError:
            break
    if not nums:
        return Cost(uncosted="aten::arange: bounds not recorded")
    start, end, step = (0.0, nums[0], 1.0) if len(nums) == 1 else (nums[0], nums[1],
                                                                   nums[2] if len(nums) > 2 else 1.0)
    if step == 0 or not all(math.isfinite(v) for v in (start, end, step)):
        raise Malformed(f"arange bounds {start}, {end}, {step}")
    n = max(math.ceil((end - start) / step), 0)
    short = "int64" if all(v.is_integer() for v in (start, end, step)) else "fp32"
    nbytes = formulas.elementwise_bytes(0, n, known(short).bytes)
    return Cost(Kind.COPY, 0.0, nbytes, short, f"arange -> {n}")
