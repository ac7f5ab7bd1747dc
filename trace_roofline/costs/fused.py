"""Cost rule of torch.compile's Triton kernels (`triton_*` ops): every buffer the kernel
touches, at most its work size; a grouped-GEMM template as the experts' GEMM, a flex attention
template as the attention it runs, a fused weight GEMM's 2·M·K·N.

Design notes: docs/design.md ("trace_roofline/costs/").
"""

from __future__ import annotations

import math

from trace_roofline.costs.attention import flex_attention
from trace_roofline.costs.call import KERNEL, Arg, Call, Cost, Kind, tensors
from trace_roofline.costs.moe import ExpertsGemm
from trace_roofline.model import formulas, kernels
from trace_roofline.model.operators import Name


def triton_kernel(c: Call) -> Cost:
    """A Triton kernel's cpu op lists every buffer it touches (inputs and outputs), whole (an
    Inductor grouped-GEMM template is costed as the `_grouped_mm` it runs, a flex attention
    template as the attention it runs: `attention.flex_attention`).

    Each buffer counts its distinct elements, at most the kernel's work size W (`_work`). A
    table it gathers from (`_gathered`) reads only the indexed rows. A generic estimate
    (derivation `kernel`) except a fused weight GEMM's 2·M·K·N.
    """
    name, ts = c.base, tensors(c.args)
    grouped = kernels.grouped_gemm([t.dims for t in ts]) if kernels.INDUCTOR_GROUPED_MM.match(
        name) else None
    if grouped is not None:  # the experts' grouped GEMM, as _grouped_mm
        s, k, n, e = grouped
        return ExpertsGemm(s, k, n, e, ts[0], next(t for t in ts if len(t.dims) == 3),
                           " (Inductor template)").cost()
    if _FLEX.search(name) and "backward" not in name:
        return flex_attention(c, ts)
    if not ts:
        return Cost(uncosted="triton kernel without tensor arguments")
    ts = _gathered(name, ts)
    main = max(ts, key=lambda t: t.numel)
    work = _work(name, c.args, ts)
    moved = [t.distinct if work is None else min(t.distinct, work) for t in ts]
    nbytes = sum(formulas.elementwise_bytes(n, 0, t.b) for n, t in zip(moved, ts, strict=True))
    shape = " ".join(str(t.dims) for t in ts)
    shape += f" over {work}" if work is not None else " (no sizes recorded)"
    flops = float(work if work is not None else main.numel)
    gemm = kernels.fused_gemm(name, [t.dims for t in ts])
    if gemm is None:
        return Cost(Kind.FUSED, flops, float(nbytes), main.dtype, shape, derivation=KERNEL)
    # a fused weight GEMM: its 2·M·K·N (the fused pointwise work is less), and its M, K, N
    return Cost(Kind.FUSED, formulas.gemm_flops(gemm.m, gemm.k, gemm.n), float(nbytes), main.dtype,
                f"GEMM {gemm.m}x{gemm.k}x{gemm.n} fused: {shape}", m=gemm.m, k=gemm.k, n=gemm.n)


_FLEX = kernels.BY_FAMILY["inductor_flex_attention"].pattern
_INDEX_DTYPES = ("int64", "int32")


def _gathered(name: str, ts: list[Arg]) -> list[Arg]:
    """The buffers of a Triton kernel with the table it gathers from cut to the gathered rows:
    a 2-D table [R, W] read at index elements n < R, when `embedding` is among the fused ops
    (Inductor passes the whole table to every kernel that recomputes the lookup) or another
    buffer is the gathered rows [n, W] (vLLM's compiled embedding: ids [n], the table, the
    output [n, H])."""
    index = [t for t in ts if t.dtype in _INDEX_DTYPES]
    if not index:
        return ts
    rows = sum(t.numel for t in index)
    table = max(ts, key=lambda t: t.numel)
    if len(table.dims) != 2 or rows >= table.dims[0]:
        return ts
    width = table.dims[1]
    out = any(t is not table and t.dtype not in _INDEX_DTYPES and t.dims[-1:] == [width]
              and t.numel == rows * width for t in ts)
    if not (out or Name.EMBEDDING in name.split("_")):  # aten::embedding among the fused ops
        return ts
    gathered = Arg([rows, width], table.type, table.concrete)
    return [gathered if t is table else t for t in ts]


def _work(name: str, args: list[Arg], tensors: list[Arg]) -> int | None:
    """Points in a Triton kernel's iteration space, from the sizes Inductor passes last.

    The trailing integer `Scalar` arguments end with the numels of the kernel's range trees:
    xnumel (`poi`), xnumel, r0_numel (`red`, `per`); tiled kernels add ynumel (and znumel)
    before xnumel, and symbolic sizes (ks0, ...) come first. The fewest trailing sizes (1 for
    poi, 2 for red/per, at most 3) whose product is some buffer's size are taken; when none
    is, the fewest. None for other kernels (templates) or when no sizes were recorded.
    """
    kind = name.removeprefix("triton_").split("_", 1)[0]
    least = {"poi": 1, "red": 2, "per": 2}.get(kind)
    sizes: list[int] = []
    for a in reversed(args):
        if a.type != "Scalar" or not a.concrete.isdigit():
            break
        sizes.insert(0, int(a.concrete))
    if least is None or len(sizes) < least:
        return None
    numels = {t.numel for t in tensors}
    for k in range(least, min(len(sizes), 3) + 1):
        if math.prod(sizes[-k:]) in numels:
            return math.prod(sizes[-k:])
    return math.prod(sizes[-least:])

