"""Cost rules of the collectives (c10d, _c10d_functional, vLLM's custom all-reduce): the
message S times the collective's bus factor (operators.py), 0 FLOPs.

Design notes: docs/design.md ("trace_roofline/costs/").
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import cast

from trace_roofline.costs.call import Call, Cost, Kind, Malformed, plain, tensor
from trace_roofline.model import dtypes, operators

# c10d ops whose arguments are (output, input): the input is argument 1
_C10D_INPUT_ARG = {"allgather_": 1, "_allgather_base_": 1, "allgather_coalesced_": 1,
                   "allgather_into_tensor_coalesced_": 1, "reduce_scatter_": 1,
                   "_reduce_scatter_base_": 1, "reduce_scatter_tensor_coalesced_": 1,
                   "alltoall_": 1, "alltoall_base_": 1}
# dtype tokens of collective kernel names: NCCL's `_bf16_`, vLLM's template argument
_KERNEL_DTYPES = {"bf16": "bf16", "f16": "fp16", "f32": "fp32", "f64": "fp64", "i8": "int8",
                  "u8": "uint8", "i32": "int32", "u32": "int32", "i64": "int64",
                  "u64": "int64", "f8e4m3": "float8_e4m3fn", "f8e5m2": "float8_e5m2",
                  "__nv_bfloat16": "bf16", "nv_bfloat16": "bf16", "half": "fp16",
                  "__half": "fp16", "float": "fp32"}
_KERNEL_DTYPE = re.compile(r"_(bf16|f16|f32|f64|i8|u8|i32|u32|i64|u64|f8e4m3|f8e5m2)_|"
                           r"<\s*(__nv_bfloat16|nv_bfloat16|__half|half|float)\s*[,>]")
_KERNEL_RANKS = re.compile(r"cross_device_reduce_[12]stage<[^,>]+,\s*(\d+)\s*>")


def kernel_dtype(kernel: str | None) -> dtypes.DType | None:
    """The dtype a collective kernel's name states (ncclDevKernel_AllReduce_Sum_bf16_RING_LL ->
    bf16), or None."""
    m = _KERNEL_DTYPE.search(kernel or "")
    return dtypes.lookup(_KERNEL_DTYPES[m.group(1) or m.group(2)]) if m else None


def _group_size(c: Call) -> int | None:
    """Ranks of a collective: record_param_comms' recorded world size (its last argument),
    vLLM's custom all-reduce kernel's template argument, else the call's `group_size`."""
    if c.base.endswith("record_param_comms") and c.args:
        last = c.args[-1].concrete
        if last.isdigit() and int(last) > 0:
            return int(last)
    m = _KERNEL_RANKS.search(c.kernel or "")
    return int(m.group(1)) if m else c.group_size


# the copy-in and copy-out a symmetric-memory all-reduce (vLLM's SymmMemCommunicator: its
# buffer filled, multimem_all_reduce_, copied back) runs inside the collective op
_COLLECTIVE_COPIES = {"copy_", "copy", "_to_copy", "clone", "contiguous"}


def collective(c: Call) -> Cost:
    """S x bus factor bytes, 0 FLOPs (see docs/design.md and operators.py); a copy
    inside a collective op (a symmetric-memory all-reduce's copy-in and copy-out) is part of
    that one collective: 0 bytes of its own, so the message is counted once."""
    op = operators.BY_NAME[cast(str, c.operator)]  # a collective's call names its operator
    if plain(c.base) in _COLLECTIVE_COPIES or c.base in _COLLECTIVE_COPIES:
        return Cost(Kind.COMMUNICATION, 0.0, 0.0, None,
                    f"copy in or out of the {op.name}'s buffer (symmetric memory): its bytes "
                    "are the collective's, counted once")
    t = _group_size(c)
    if t is None:
        return Cost(uncosted=f"{c.name} ({op.name}): group size unknown (not recorded; give tp)")
    at = _C10D_INPUT_ARG.get(c.base.rsplit("::", 1)[-1], 0)
    if at >= len(c.args):
        raise Malformed(f"argument {at} (the input) missing")
    x = c.args[at]
    if x.type == "TensorList":
        numel = sum(math.prod(d) for d in x.dims)
        dt = kernel_dtype(c.kernel) or (dtypes.lookup(c.fallback) if c.fallback else None)
    else:
        numel = tensor(c.args, at).numel
        dt = dtypes.lookup(x.type)
    if dt is None:
        return Cost(uncosted=f"{c.name} ({op.name}): message dtype unknown")
    message = numel * dt.bytes * (t if op.gathers else 1)
    bus = cast("Callable[[int], float]", op.bus_factor)(t)  # every collective has one
    shape = f"{numel}x{dt.short} over {t} ranks: S {message} B x bus {bus:.3g}"
    return Cost(Kind.COMMUNICATION, 0.0, float(message * bus), dt.short, shape)

