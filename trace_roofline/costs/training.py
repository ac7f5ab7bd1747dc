"""Cost rules of a training step's own ops: activations' and softmax's backward, an embedding's
backward, the NLL loss, an optimizer's `_foreach_*` and fused Adam steps.

Design notes: docs/design.md ("trace_roofline/costs/").
"""

from __future__ import annotations

import math

from trace_roofline.costs.call import Call, Cost, Io, Kind, integer, known, plain, tensor, tensors
from trace_roofline.costs.pointwise import POINTWISE_FLOPS

_ADAM_FLOPS = 12.0  # per parameter: decay 2, exp_avg 2, exp_avg_sq 3, sqrt, divide, eps, update 2
BACKWARD_FLOPS = {"silu_backward": 5.0, "gelu_backward": 10.0, "threshold_backward": 1.0,
                   "sigmoid_backward": 2.0, "tanh_backward": 2.0,
                   "_softmax_backward_data": 3.0, "_log_softmax_backward_data": 3.0}


def foreach(c: Call) -> Cost:
    """An optimizer's `_foreach_<op>` over tensor lists (their dtype: `c.fallback`): `<op>`'s
    FLOPs per element of the first list; every tensor list (and tensor) read once, the first
    list's elements written (in place, or a new list of its size)."""
    lists = [a for a in c.args if a.type == "TensorList"]
    if not lists or c.fallback is None:
        return Cost(uncosted=f"{c.name}: tensor lists of unknown dtype")
    b = known(c.fallback).bytes
    sizes = [sum(math.prod(d) for d in a.dims) for a in lists]
    reads = sum(sizes) * b + sum(t.numel * t.b for t in tensors(c.args))
    op = plain(c.base.removeprefix("_foreach_"))
    flops = POINTWISE_FLOPS.get(op, 1.0) * sizes[0]
    return Cost(Kind.ELEMENTWISE, float(flops), float(reads + sizes[0] * b), c.fallback,
                f"{len(lists[0].dims)} tensors, {sizes[0]} elements x {len(lists)} list(s)")


def fused_adam(c: Call) -> Cost:
    """A fused Adam/AdamW step (`fused_adam(w)_`: params, grads, exp_avgs, exp_avg_sqs, ...):
    per parameter element param, grad, exp_avg and exp_avg_sq read, param, exp_avg and
    exp_avg_sq written (7 accesses), `_ADAM_FLOPS` FLOPs."""
    lists = [a for a in c.args if a.type == "TensorList"]
    if len(lists) < 4 or c.fallback is None:
        return Cost(uncosted=f"{c.name}: params, grads and states not recorded as tensor lists")
    p = sum(math.prod(d) for d in lists[0].dims)
    b = known(c.fallback).bytes
    return Cost(Kind.ELEMENTWISE, _ADAM_FLOPS * p, float(7 * p * b), c.fallback,
                f"{len(lists[0].dims)} params, {p} elements: 4 read, 3 written")


def backward_pointwise(c: Call) -> Cost:
    """An activation's or softmax's backward (grad_out, saved input or output, ...):
    `BACKWARD_FLOPS` per element of the first tensor; the tensors read, its size written."""
    ts = tensors(c.args, 2)
    g = ts[0]
    return Io(BACKWARD_FLOPS[c.plain] * g.numel, ts, g.numel, g.b, Kind.ELEMENTWISE, g.dtype).cost()


def nll_loss(c: Call) -> Cost:
    """nll_loss_forward(input [N, C], target [N], ...): one log-probability gathered per target
    and summed (N FLOPs; N elements and the targets read). nll_loss_backward(grad, input
    [N, C], target [N], ...): the [N, C] gradient written (zeros but one per row), targets read."""
    backward = c.plain == "nll_loss_backward"
    x, target = tensor(c.args, 1 if backward else 0), tensor(c.args, 2 if backward else 1)
    rows = target.numel
    if backward:
        return Io(float(rows), [target], x.numel, x.b, Kind.ELEMENTWISE, x.dtype).cost()
    return Cost(Kind.REDUCTION, float(rows), float(rows * x.b + target.numel * target.b + x.b),
                x.dtype, f"{x.dims} at {target.dims} -> 1")


def embedding_backward(c: Call) -> Cost:
    """embedding_dense_backward(grad [.., H], indices [..], num_weights, ...): each gradient row
    added into the row of its index: grad and indices read, the rows touched written (at most
    num_weights), one add per element."""
    g, idx = tensor(c.args, 0, min_rank=1), tensor(c.args, 1)
    h = g.dims[-1]
    return Io(float(g.numel), [g, idx], min(idx.numel, integer(c.args[2].concrete, "num_weights"))
               * h, g.b, Kind.ELEMENTWISE, g.dtype).cost()

