"""The call model every cost rule reads: one op call (`Call`), its recorded arguments (`Arg`),
the cost it gets (`Cost`), and the helpers rules share to check and read arguments.

Design notes: docs/design.md ("trace_roofline/costs/").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import pandas as pd

from trace_roofline import frames
from trace_roofline.model import dtypes, formulas, moe
from trace_roofline.model.operators import Name

# `derivation` values, strongest first (attach.COSTED_COLUMNS)
SHAPE, STEP, LAYOUT, KERNEL, UNKNOWN = "shape", "step", "layout", "kernel", "unknown"
DERIVATIONS = (SHAPE, STEP, LAYOUT, KERNEL, UNKNOWN)


class Kind:
    """`Cost.kind` values (attach.COSTED_COLUMNS `cost_kind`)."""

    GEMM = "gemm"
    ATTENTION = Name.ATTENTION  # the attention operator's own kind
    ELEMENTWISE = "elementwise"
    NORM = "norm"
    REDUCTION = "reduction"
    COPY = "copy"
    FUSED = "fused"  # a torch.compile Triton kernel
    VIEW = "view"
    COMMUNICATION = "communication"  # a collective
    NONE = "none"  # uncosted
    MALFORMED = "malformed"  # shape data no rule can use


_INT64_MAX = 2**63 - 1


class Malformed(ValueError):
    """Shape data a cost rule cannot use, the one error attach's `_cost` catches (anything else
    a rule raises is a bug): a negative, non-integer or overflowing dim (more elements than
    int64 counts), an argument missing, not a tensor or of the wrong rank, shapes that do not
    broadcast, an unreadable `Concrete Inputs` value (an axis, a dim, an arange bound)."""


@dataclass(frozen=True)
class Cost:
    """The cost of one unique op-shape combination."""

    kind: str = Kind.NONE
    flops: float = math.nan
    bytes: float = math.nan
    dtype: str | None = None
    shape: str | None = None
    uncosted: str | None = None
    m: int | None = None
    k: int | None = None
    n: int | None = None
    batch: int | None = None
    t: int | None = None
    s: int | None = None
    causal: bool | None = None
    heads: tuple[int, int, int] | None = None  # attention (n_q, n_kv, d)
    experts: int | None = None  # E of an op over all experts' weights (not yet in `bytes`)
    expert_bytes: float | None = None  # one expert's weights read by the op, bytes
    derivation: str = SHAPE  # DERIVATIONS (an uncosted one: UNKNOWN, set by attach_costs)
    pairs: tuple[float, float] | None = None  # attention: (executed, useful) query-key pairs


@dataclass(frozen=True)
class Arg:
    """One argument of a cpu op as the trace recorded it (`args_of` checks tensor dims)."""

    dims: list
    type: str
    concrete: str
    strides: list | None = None  # Input Strides when recorded

    @property
    def is_tensor(self) -> bool:
        return dtypes.lookup(self.type) is not None

    @property
    def numel(self) -> int:
        return math.prod(self.dims)

    @property
    def distinct(self) -> int:
        """Elements a read touches: a dim of stride 0 (broadcast, expand) repeats the same ones."""
        st = self.strides
        if (not isinstance(st, list) or len(st) != len(self.dims)
                or not all(isinstance(v, int) for v in st)):
            return self.numel
        return math.prod(d for d, v in zip(self.dims, st, strict=True) if v != 0)

    @property
    def dtype(self) -> str:
        return known(self.type).short  # (asked of tensors only: `is_tensor`)

    @property
    def b(self) -> float:
        return known(self.type).bytes


def known(spelling: str) -> dtypes.DType:
    """The dtype of a spelling known to name one (a tensor's type, a constant, a short name a
    lookup gave)."""
    return cast(dtypes.DType, dtypes.lookup(spelling))


@dataclass(frozen=True)
class Call:
    """One op call to cost: its name, arguments and the counting conventions."""

    name: str  # as recorded: aten::add_, flash_attn::_flash_attn_forward, triton_poi_fused_...
    args: list[Arg]
    causal: formulas.Causal
    attention_bytes: formulas.AttentionBytes
    fallback: str | None  # short dtype of tensor lists (their dtype is not recorded)
    # what attribute() named it: a collective, or the half of a fused MoE op
    operator: str | None = None
    kernel: str | None = None  # collectives only: the first kernel's name
    group_size: int | None = None  # collectives only: ranks, when the call does not record it
    experts: moe.Experts | None = None  # the model's, for MoE ops that do not record them
    hidden: int | None = None  # the model's hidden size: an op padding it is costed at it
    expert_bits: float | None = None  # bits per routed-expert weight element (MXFP4: 4.25)
    # the trace's verdict (attribution/kind.py): an attention whose causality is not recorded
    # is causal in a decoder, bidirectional in an encoder
    decoder: bool = True

    @property
    def base(self) -> str:
        """The name without `aten::` (add_)."""
        return self.name.removeprefix("aten::")

    @property
    def plain(self) -> str:
        return plain(self.base)


def plain(base: str) -> str:
    """An op's base name without an in-place `_` (add_ -> add; __and__ stays)."""
    return base[:-1] if base.endswith("_") and not base.endswith("__") else base


Rule = Callable[[Call], Cost]


def args_of(dims: list, types: list[str], concrete: list, strides: list) -> list[Arg]:
    """The arguments, their tensor (and tensor-list) dims checked: lists of non-negative ints
    whose product fits int64 (Malformed otherwise)."""
    out = []
    for i, (d, t) in enumerate(zip(dims, types, strict=True)):
        if dtypes.lookup(t) is not None:
            _check_dims(d, i)
        elif t == "TensorList":
            if not isinstance(d, list):
                raise Malformed(f"argument {i}: tensor list dims {d!r}")
            for item in d:
                _check_dims(item, i)
        out.append(Arg(d, t, str(concrete[i]) if i < len(concrete) else "",
                       strides[i] if i < len(strides) else None))
    return out


def _check_dims(dims: object, i: int) -> None:
    if not isinstance(dims, list) or not all(type(v) is int for v in dims):
        raise Malformed(f"argument {i}: non-integer dims {dims!r}")
    if any(v < 0 for v in dims):
        raise Malformed(f"argument {i}: negative dim in {dims}")
    if math.prod(dims) > _INT64_MAX:
        raise Malformed(f"argument {i}: {dims} overflows int64 elements")


def tensor(args: list[Arg], i: int, rank: int | None = None, min_rank: int = 0) -> Arg:
    """Argument i, which must be a tensor of `rank` (at least `min_rank`) dims."""
    if i >= len(args) or not args[i].is_tensor:
        raise Malformed(f"argument {i} is not a tensor")
    r = len(args[i].dims)
    if (rank is not None and r != rank) or r < min_rank:
        raise Malformed(f"argument {i} is {r}-D")
    return args[i]


def tensors(args: Sequence[Arg], least: int = 0) -> list[Arg]:
    """The tensor arguments; Malformed when there are fewer than `least`."""
    ts = [a for a in args if a.is_tensor]
    if len(ts) < least:
        raise Malformed(f"{len(ts)} tensor argument(s), expected at least {least}")
    return ts


def broadcast(*shapes: Sequence[int]) -> tuple[int, ...]:
    try:
        return np.broadcast_shapes(*(tuple(s) for s in shapes))
    except ValueError:
        raise Malformed(f"shapes {', '.join(map(str, shapes))} do not broadcast") from None


def integer(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise Malformed(f"{what} {text!r} is not an integer") from None


def last_dim(x: Arg) -> int:
    if not x.dims:
        raise Malformed("a 0-d tensor where rows of a hidden dim are expected")
    return x.dims[-1]


@dataclass(frozen=True)
class Io:
    """Data movement: every tensor in `reads` read once (its distinct elements), `out_numel`
    elements of `out_b` bytes written, `flops` FLOPs."""

    flops: float
    reads: Sequence[Arg]
    out_numel: float
    out_b: float
    kind: str
    dtype: str
    extra_read_bytes: float = 0.0

    def cost(self) -> Cost:
        nbytes = sum(formulas.elementwise_bytes(r.distinct, 0, r.b) for r in self.reads)
        nbytes += formulas.elementwise_bytes(0, self.out_numel, self.out_b) + self.extra_read_bytes
        shape = " ".join(str(r.dims) for r in self.reads) + f" -> {int(self.out_numel)}"
        return Cost(self.kind, float(self.flops), float(nbytes), self.dtype, shape)


# ------------------------------------------------ helpers of the table-wide passes
def each_distinct(values: pd.Series, fn: Callable[[Any], object]) -> np.ndarray:
    """fn of each row's value, evaluated once per distinct value (an object array)."""
    codes, uniques = frames.factorized(values)
    return np.asarray([fn(u) for u in uniques] + [fn(None)], dtype=object)[codes]


def element_bytes(short: pd.Series) -> np.ndarray:
    """Bytes per element of each row's short dtype (NaN where unknown)."""
    sizes = {v: d.bytes for v in short.dropna().unique() if (d := dtypes.lookup(v))}
    return short.map(sizes).to_numpy(np.float64)
