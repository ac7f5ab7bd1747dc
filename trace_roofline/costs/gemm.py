"""Cost rules of the GEMM ops (mm, addmm, linear, bmm, baddbmm, matmul, _scaled_mm): FLOPs and
minimum bytes of batch × [M, K] x [K, N], their operands where model/gemms.py's SIGNATURES
put them.

Design notes: docs/design.md ("trace_roofline/costs/").
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from trace_roofline.costs.call import Arg, Call, Cost, Kind, broadcast, tensor
from trace_roofline.model import dtypes, formulas, gemms


@dataclass(frozen=True)
class Gemm:
    """batch × [M,K]x[K,N] at the activation `a`'s dtype. A bias of N elements uses formulas'
    bias term, a larger one (addmm's full C) is read in full; `out_b`: the output's bytes per
    element when not the operands' (fp8 GEMMs); `w_numel`: one weight of that many elements
    shared by the whole batch (read once)."""

    m: int
    k: int
    n: int
    a: Arg
    batch: int = 1
    bias: Arg | None = None
    out_b: float | None = None
    w_numel: int | None = None

    def cost(self) -> Cost:
        m, k, n, a, batch, bias = self.m, self.k, self.n, self.a, self.batch, self.bias
        b = a.b
        has_bias = bias is not None and bias.is_tensor
        vec_bias = bias is not None and has_bias and bias.numel == n
        flops = batch * formulas.gemm_flops(m, k, n, bias=has_bias)
        nbytes = batch * formulas.gemm_bytes(m, k, n, b, bias=vec_bias)
        if bias is not None and has_bias and not vec_bias:
            nbytes += formulas.elementwise_bytes(bias.numel, 0, bias.b)
        if self.w_numel is not None:  # one weight shared by the whole batch
            nbytes -= (batch - 1) * formulas.elementwise_bytes(self.w_numel, 0, b)
        if self.out_b is not None:  # output in another dtype than the operands (fp8 GEMMs)
            nbytes += batch * formulas.elementwise_bytes(0, m * n, self.out_b - b)
        shape = f"{batch}x" if batch > 1 else ""
        shape += f"[{m},{k}]x[{k},{n}]" + ("+bias" if has_bias else "")
        return Cost(Kind.GEMM, flops, nbytes, a.dtype, shape, m=m, k=k, n=n)


def _laid_out(c: Call) -> Gemm:
    """The GEMM of an op laid out as its gemms.SIGNATURES entry says: activation [M, K]
    ([.., K] where any rank; [B, M, K] batched), weight [K, N] ([N, K] when weight_nk;
    [B, K, N] batched), the bias argument where it takes one."""
    sig = gemms.SIGNATURES[c.plain]
    rank = 3 if sig.batched else 2
    a = (tensor(c.args, sig.activation, min_rank=1) if sig.activation_any_rank
         else tensor(c.args, sig.activation, rank))
    w = tensor(c.args, sig.weight, rank)
    bias = c.args[sig.bias] if sig.bias is not None and sig.bias < len(c.args) else None
    n = w.dims[0] if sig.weight_nk else w.dims[-1]
    if sig.batched:
        return Gemm(a.dims[1], a.dims[2], n, a, batch=a.dims[0], bias=bias)
    return Gemm(math.prod(a.dims[:-1]), a.dims[-1], n, a, bias=bias)


def gemm(c: Call) -> Cost:
    """mm, addmm, _addmm_activation, linear, bmm, baddbmm (`_laid_out`)."""
    return _laid_out(c).cost()


def matmul(c: Call) -> Cost:
    """torch.matmul broadcasting: a 2-D weight is shared (read once) by every batch item."""
    sig = gemms.SIGNATURES[c.plain]
    a = tensor(c.args, sig.activation, min_rank=1)
    w = tensor(c.args, sig.weight, min_rank=1)
    ad = [1, *a.dims] if len(a.dims) == 1 else a.dims
    wd = [*w.dims, 1] if len(w.dims) == 1 else w.dims
    if len(wd) == 2:
        return Gemm(math.prod(ad[:-1]), ad[-1], wd[1], a).cost()
    batch = math.prod(broadcast(ad[:-2], wd[:-2]))
    shared = w.numel if len(wd[:-2]) == 0 or math.prod(wd[:-2]) == 1 else None
    return Gemm(ad[-2], ad[-1], wd[-1], a, batch=batch, w_numel=shared).cost()


def scaled_mm(c: Call) -> Cost:
    """fp8 GEMM: operands at 1 byte, output at `out_dtype` (Concrete Inputs), scales ignored."""
    g = _laid_out(c)
    out = dtypes.by_scalar_type(c.args[6].concrete) if len(c.args) > 6 else None
    return dataclasses.replace(g, out_b=out.bytes if out else None).cost()
