"""Trace shapes -> analytical costs: one row per op instance with FLOPs and minimum DRAM bytes.

Design notes: docs/design.md ("trace_roofline/costs/shapes.py").
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import pandas as pd

from trace_roofline import frames
from trace_roofline.attribution import steps
from trace_roofline.costs import crosscheck
from trace_roofline.errors import InputError
from trace_roofline.model import dtypes, formulas, kernels, layouts, moe, operators
from trace_roofline.model.models import ModelSpec
from trace_roofline.trace.decode import decode_args

# One row per op instance (op_id; a kernel with no linked op is an instance of its own).
COSTED_COLUMNS = {
    "instance": "Int64",  # attribute's `instance` id (NA only where parallel.compact merged)
    "op_id": "Int64",  # innermost shape-carrying cpu op; NA for unlinked kernels
    "op_name": "str",  # e.g. aten::addmm; missing for unlinked kernels
    "operator": "str",  # canonical operator (attribute.py)
    "evidence": "str",  # how it was named (attribute.EVIDENCE); fallback when not recorded
    "layer": "Int64",
    "step": "Int64",
    "phase": "str",  # prefill|decode|mixed of the instance's forward pass (passes.py), else unknown
    "kernels": "int64",  # device rows (kernels, memcpy, memset) of the instance
    "ts_us": "float64",  # first kernel start
    "time_us": "float64",  # Σ dur_us of the instance's kernels
    "cost_kind": "str",  # gemm|attention|elementwise|norm|reduction|copy|fused|view|none
    "dtype": "str",  # short dtype of the main operand (bf16, fp16, fp32, fp8, int64, ...)
    "flops": "float64",  # NaN when uncosted
    "bytes": "float64",  # minimum DRAM bytes; NaN when uncosted
    "M": "Int64", "K": "Int64", "N": "Int64",  # GEMM shape (per batch item), NA otherwise
    "B": "Int64", "T": "Int64", "S": "Int64",  # attention batch, query and key lengths
    "n_q": "Int64", "n_kv": "Int64", "head_dim": "Int64",  # attention heads, NA otherwise
    "causal": "boolean",  # attention: whether the op masks causally (NA otherwise)
    # attention: query-key pairs over every sequence and query head, those the kernel computes
    # (a flash kernel's causal half plus its diagonal tiles; an eager matmul's T·S) and those
    # the mask keeps; FLOPs count the convention's (--causal causal: useful, full: T·S)
    "pairs_executed": "float64",
    "pairs_useful": "float64",
    "shape": "str",  # short human-readable shape summary
    "uncosted": "str",  # why the instance has no cost; missing when costed
    "check": "str",  # contradiction with the model; missing when consistent or not checked
    # where the figures came from (`DERIVATIONS`): the op's recorded shapes, a serving step's
    # annotation, the layout (the model or the trace's verdict supplied what the op does not
    # record: flex attention's causality), a generic per-kernel estimate, or unknown (uncosted)
    "derivation": "str",
    # routed expert GEMMs (and batched_mm's weight gathers): active experts of the instance's
    # layer, exact (a loop) or the uniform-routing expectation, and the range it lies in
    "experts_active": "float64",
    "experts_active_low": "float64",
    "experts_active_high": "float64",
}

# FLOPs per output element of pointwise ops (an in-place `op_` costs as `op`).
_POINTWISE_FLOPS: dict[str, float] = {
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
_COMPARISONS = {"eq", "ne", "lt", "le", "gt", "ge", "greater", "logical_not", "logical_and"}
_REDUCTIONS = {"mean", "sum", "amax", "amin", "max", "min", "argmax", "argmin", "var", "std",
               "norm", "linalg_vector_norm", "prod", "any", "all", "logsumexp"}
_SOFTMAX = {"softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"}
_NORMS = {"rms_norm": 4.0, "_fused_rms_norm": 4.0, "layer_norm": 7.0, "native_layer_norm": 7.0}
_COPIES = {"clone", "contiguous", "_to_copy", "to"}
# Views and allocations move no data (timed units of their own in CPU-only traces).
_VIEWS = {"view", "_unsafe_view", "reshape", "transpose", "t", "permute", "slice", "select",
          "narrow", "chunk", "split", "split_with_sizes", "unbind", "alias", "expand",
          "as_strided", "unsqueeze", "squeeze", "flatten", "unflatten", "detach", "detach_",
          "lift_fresh", "view_as", "expand_as", "empty", "empty_like", "empty_strided",
          "resolve_conj", "resolve_neg", "result_type"}

_INT64_MAX = 2**63 - 1
# `derivation` values, strongest first (COSTED_COLUMNS)
SHAPE, STEP, LAYOUT, KERNEL, UNKNOWN = "shape", "step", "layout", "kernel", "unknown"
DERIVATIONS = (SHAPE, STEP, LAYOUT, KERNEL, UNKNOWN)


class Malformed(ValueError):
    """Shape data a cost rule cannot use, the one error `_cost` catches (anything else a rule
    raises is a bug): a negative, non-integer or overflowing dim (more elements than int64
    counts), an argument missing, not a tensor or of the wrong rank, shapes that do not
    broadcast, an unreadable `Concrete Inputs` value (an axis, a dim, an arange bound)."""


@dataclass(frozen=True)
class Cost:
    """The cost of one unique op-shape combination."""

    kind: str = "none"  # "malformed" for shape data no rule can use
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


_COMMUNICATION = "communication"  # Cost.kind of a collective


@dataclass(frozen=True)
class _Arg:
    """One argument of a cpu op as the trace recorded it (`_args` checks tensor dims)."""

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
        return _known(self.type).short  # (asked of tensors only: `is_tensor`)

    @property
    def b(self) -> float:
        return _known(self.type).bytes


def _known(spelling: str) -> dtypes.DType:
    """The dtype of a spelling known to name one (a tensor's type, a constant, a short name a
    lookup gave)."""
    return cast(dtypes.DType, dtypes.lookup(spelling))


@dataclass(frozen=True)
class _Call:
    """One op call to cost: its name, arguments and the counting conventions."""

    name: str  # as recorded: aten::add_, flash_attn::_flash_attn_forward, triton_poi_fused_...
    args: list[_Arg]
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
        return _plain(self.base)


def _plain(base: str) -> str:
    """An op's base name without an in-place `_` (add_ -> add; __and__ stays)."""
    return base[:-1] if base.endswith("_") and not base.endswith("__") else base


Rule = Callable[[_Call], Cost]


def attach_costs(attributed: pd.DataFrame, model: ModelSpec | None, causal: str = "causal",
                 attention_bytes: str = "all", group_size: int | None = None,
                 decoder: bool = True) -> pd.DataFrame:
    """One row per op instance (`COSTED_COLUMNS`) with FLOPs and minimum bytes from its shapes.

    `attributed` is attribute.attribute()'s table (one row per device row, its `instance`
    column naming the op instance); optional `concrete_inputs` and `input_strides` columns (raw
    JSON) supply is_causal, dtype and Triton size arguments, and broadcast (stride-0) dims.
    `causal` is "causal" (count unmasked query-key pairs) or "full"; `attention_bytes` is "all"
    (Q, K, V read and O written) or "kv" (K and V only). `group_size` is the ranks of a
    collective that does not record its own (`_collective`). `decoder` is the trace's verdict
    (attribution/kind.py, Verdict.decoder): an encoder's attention whose causality is not
    recorded (flex attention's mask, an eager attention's matmuls) counts every query-key
    pair. Each row's `derivation` says where its figures came from. Time is conserved:
    Σ time_us == Σ dur_us.
    """
    if causal not in formulas.CAUSAL_CONVENTIONS:
        raise InputError(f"`causal` must be one of {', '.join(formulas.CAUSAL_CONVENTIONS)}, "
                         f"got {causal!r}", "causal")
    if attention_bytes not in formulas.ATTENTION_BYTES_CONVENTIONS:
        raise InputError(f"`attention_bytes` must be one of "
                         f"{', '.join(formulas.ATTENTION_BYTES_CONVENTIONS)}, got {attention_bytes!r}",
                         "attention_bytes")
    inst = _instances(attributed)
    # a collective's cost also depends on which collective it is and its kernel's name (taken
    # for those rows alone: kernel names are long, hundreds of bytes each)
    coll = inst["operator"].isin(operators.COMMUNICATION)
    inst["_coll"] = inst["operator"].where(coll, None)
    inst["_kernel"] = pd.Series(pd.NA, index=inst.index, dtype="str")
    if "name" in attributed and coll.any():
        first_rows = inst.loc[coll, "row"].to_numpy()
        inst.loc[coll, "_kernel"] = attributed["name"].take(first_rows).to_numpy()
    # the part of an engine's fused MoE op attribute() named (its GEMMs cost apart)
    inst["_part"] = inst["operator"].where(_fused_experts_ops(inst["op_name"]), None)
    text = ["op_name", "input_dims", "input_types", "concrete_inputs", "input_strides", "_coll",
            "_kernel", "_part"]
    combos, codes = frames.distinct_rows(inst, text)
    fallback = _fallback_dtype(model, inst["input_types"])
    facts = _ModelFacts.of(model)
    # validated above: one of formulas.py's conventions each
    counted, convention = cast(formulas.Causal, causal), cast(formulas.AttentionBytes, attention_bytes)
    table = [
        _cost(name, dims, types, conc, counted, convention, fallback, strides,
              _Collective(op, kernel if isinstance(kernel, str) else None, group_size)
              if isinstance(op, str) else None, part if isinstance(part, str) else None,
              facts, decoder)
        for name, dims, types, conc, strides, op, kernel, part in zip(
            *(_python(combos[c]) for c in text), strict=True)
    ]
    out = inst[["instance", "op_id", "op_name", "operator", "evidence", "layer", "step",
                "kernels", "ts_us", "time_us"]]
    out = out.reset_index(drop=True)
    fields = {"cost_kind": "kind", "dtype": "dtype", "flops": "flops", "bytes": "bytes",
              "M": "m", "K": "k", "N": "n", "B": "batch", "T": "t", "S": "s",
              "causal": "causal", "shape": "shape", "uncosted": "uncosted",
              "experts": "experts", "expert_bytes": "expert_bytes",
              "derivation": "derivation"}
    for col, attr in fields.items():
        values = pd.Series([getattr(c, attr) for c in table],
                           dtype=COSTED_COLUMNS.get(col, "float64"))
        out[col] = values.take(codes).reset_index(drop=True)
    for i, col in enumerate(("n_q", "n_kv", "head_dim")):
        values = pd.Series([c.heads[i] if c.heads else None for c in table], dtype="Int64")
        out[col] = values.take(codes).reset_index(drop=True)
    for i, col in enumerate(("pairs_executed", "pairs_useful")):
        values = pd.Series([c.pairs[i] if c.pairs else None for c in table], dtype="float64")
        out[col] = values.take(codes).reset_index(drop=True)
    # An op whose kernels were attributed to several rows is costed once, on its first row
    # (per operator: a fused MoE op's gate_up and down halves are costed apart).
    _, first = frames.distinct_codes([pd.factorize(out[c].array)[0]
                                          for c in ("op_id", "operator")])
    repeated = np.ones(len(out), dtype=bool)
    repeated[first] = False
    again = out["op_id"].notna() & repeated & out["flops"].notna()
    out.loc[again, ["flops", "bytes", "expert_bytes", "pairs_executed", "pairs_useful"]] = 0.0
    # the forward pass's phase (passes.annotate) when the table has it, else per step
    out["phase"] = inst["phase"].fillna("unknown") if "phase" in inst else _phases(out)
    if "serving_step" in inst:
        _step_attention(out, inst["serving_step"], model, causal, attention_bytes)
    _eager_attention(out, causal, decoder)
    _repeated_kv(out, model)
    out["check"] = crosscheck.instance_checks(out, model)
    out = _moe_layers(out, inst, model)
    out["derivation"] = out["derivation"].where(out["flops"].notna(), UNKNOWN)
    return out[list(COSTED_COLUMNS)].astype(COSTED_COLUMNS)


def _instances(att: pd.DataFrame) -> pd.DataFrame:
    """The op instances attribute() built (its `instance` column), in order of first start:
    each instance's id, its first row (`row`, a position in `att`) and that row's columns, its
    kernel count, first start and Σ duration. The argument columns costs are read from alone
    (`_ARGUMENTS`) are categoricals: they hold a few dozen distinct values, and their codes are
    taken rather than hundreds of thousands of strings."""
    need = ["instance", "dur_us", "ts_us", "op_id", "op_name", "input_dims", "input_types",
            "operator", "layer", "step"]
    missing = [c for c in need if c not in att.columns]
    if missing:
        raise InputError(f"attributed lacks columns {', '.join(missing)}")
    agg = pd.DataFrame({"instance": att["instance"].to_numpy(),
                        "row": np.arange(len(att)),
                        "ts_us": att["ts_us"].to_numpy(np.float64),
                        "dur_us": att["dur_us"].to_numpy(np.float64)})
    agg = agg.groupby("instance", sort=False).agg(
        row=("row", "first"), kernels=("dur_us", "size"), ts_us=("ts_us", "min"),
        time_us=("dur_us", "sum"))
    agg = agg.sort_values("ts_us", kind="stable")
    rows = agg["row"].to_numpy()
    inst = pd.DataFrame({
        "instance": agg.index.to_numpy(),
        "row": rows,
        "op_id": att["op_id"].astype("Int64").take(rows).to_numpy(),
        "operator": att["operator"].take(rows).array,
        "evidence": (att["evidence"] if "evidence" in att
                     else pd.Series(operators.FALLBACK, index=att.index)).take(rows).array,
        "layer": att["layer"].astype("Int64").take(rows).to_numpy(),
        "step": att["step"].astype("Int64").take(rows).to_numpy(),
        "op_name": att["op_name"].take(rows).array,
        **{c: _taken_categories(att.get(c), rows) for c in _ARGUMENTS},
        "kernels": agg["kernels"].to_numpy(),
        "ts_us": agg["ts_us"].to_numpy(),
        "time_us": agg["time_us"].to_numpy(),
    })
    if "phase" in att:  # the forward pass's phase (passes.annotate)
        inst["phase"] = att["phase"].take(rows).array
    if "serving_step" in att:  # the annotated serving step's sums (attribution/steps.py)
        inst["serving_step"] = att["serving_step"].take(rows).to_numpy()
    return inst


# attribute()'s columns of raw argument JSON, read only to cost (each distinct value once)
_ARGUMENTS = ("input_dims", "input_types", "concrete_inputs", "input_strides")


def _taken_categories(values: pd.Series | None, rows: np.ndarray) -> pd.Categorical:
    """values.take(rows) as a categorical (NA kept; all NA where `values` is None), without
    copying its strings."""
    if values is None:
        return pd.Categorical.from_codes(np.full(len(rows), -1),
                                         categories=pd.Index([], dtype="str"))
    codes, uniques = pd.factorize(values.array)
    return pd.Categorical.from_codes(codes[rows], categories=uniques)


def _python(values: pd.Series) -> list:
    """A column's values as Python objects, None where missing."""
    return values.astype("object").where(values.notna(), None).tolist()


def _fallback_dtype(model: ModelSpec | None, types: pd.Series) -> str | None:
    """Dtype for tensor lists (the trace records `TensorList`): the model's, else the commonest."""
    d = dtypes.lookup(model.dtype) if model is not None else None
    if d is not None:
        return d.short
    counts: dict[str, int] = {}
    for raw in types.dropna().unique():
        for t in decode_args(raw) or []:
            d = dtypes.lookup(str(t))
            if d is not None:
                counts[d.short] = counts.get(d.short, 0) + 1
    return max(counts, key=counts.__getitem__) if counts else None


@dataclass(frozen=True)
class _ModelFacts:
    """What the model tells the cost rules of ops that do not record it (fused MoE ops)."""

    experts: moe.Experts | None = None
    hidden: int | None = None
    expert_bits: float | None = None

    @classmethod
    def of(cls, model: ModelSpec | None) -> _ModelFacts:
        if model is None:
            return cls()
        return cls(model.experts, model.hidden_size, model.architecture.precision.expert_bits)


@dataclass(frozen=True)
class _Collective:
    """What a collective instance's cost needs beyond its op's arguments."""

    operator: str
    kernel: str | None
    group_size: int | None


def _cost(name: str | None, dims_raw: str | None, types_raw: str | None, concrete_raw: str | None,
          causal: formulas.Causal, attention_bytes: formulas.AttentionBytes, fallback: str | None,
          strides_raw: str | None = None, collective: _Collective | None = None,
          part: str | None = None, facts: _ModelFacts | None = None,
          decoder: bool = True) -> Cost:
    """Cost one unique combination (decodes its JSON once) by its rule (`rule_for`; a
    collective's by `_collective`; `part`: the half of a fused MoE op attribute() named;
    `facts`: the model's, for MoE ops that do not record their shapes; `decoder`: the
    trace's verdict)."""
    if name is None:
        return Cost(uncosted="no linked cpu op")
    dims, types = decode_args(dims_raw), decode_args(types_raw)
    if dims is None or types is None or len(dims) != len(types):
        return Cost(uncosted=f"{name}: no recorded shapes")
    rule = _collective if collective is not None else rule_for(name)
    if rule is None:
        return Cost(uncosted=f"no cost rule for {name}")
    concrete = decode_args(concrete_raw) or []
    strides = decode_args(strides_raw) or []
    extra = {"operator": part} if collective is None else {
        "operator": collective.operator, "kernel": collective.kernel,
        "group_size": collective.group_size}
    try:
        args = _args(dims, [str(t) for t in types], concrete, strides)
        facts = facts or _ModelFacts()
        cost = rule(_Call(name, args, causal, attention_bytes, fallback, **extra,
                          experts=facts.experts, hidden=facts.hidden,
                          expert_bits=facts.expert_bits, decoder=decoder))
    except Malformed as e:
        return Cost("malformed", uncosted=f"{name}: malformed shape data ({e}) in {dims_raw}")
    return cost


def _args(dims: list, types: list[str], concrete: list, strides: list) -> list[_Arg]:
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
        out.append(_Arg(d, t, str(concrete[i]) if i < len(concrete) else "",
                        strides[i] if i < len(strides) else None))
    return out


def _check_dims(dims: object, i: int) -> None:
    if not isinstance(dims, list) or not all(type(v) is int for v in dims):
        raise Malformed(f"argument {i}: non-integer dims {dims!r}")
    if any(v < 0 for v in dims):
        raise Malformed(f"argument {i}: negative dim in {dims}")
    if math.prod(dims) > _INT64_MAX:
        raise Malformed(f"argument {i}: {dims} overflows int64 elements")


def _tensor(args: list[_Arg], i: int, rank: int | None = None, min_rank: int = 0) -> _Arg:
    """Argument i, which must be a tensor of `rank` (at least `min_rank`) dims."""
    if i >= len(args) or not args[i].is_tensor:
        raise Malformed(f"argument {i} is not a tensor")
    r = len(args[i].dims)
    if (rank is not None and r != rank) or r < min_rank:
        raise Malformed(f"argument {i} is {r}-D")
    return args[i]


def _tensors(args: Sequence[_Arg], least: int = 0) -> list[_Arg]:
    """The tensor arguments; Malformed when there are fewer than `least`."""
    ts = [a for a in args if a.is_tensor]
    if len(ts) < least:
        raise Malformed(f"{len(ts)} tensor argument(s), expected at least {least}")
    return ts


def _broadcast(*shapes: Sequence[int]) -> tuple[int, ...]:
    try:
        return np.broadcast_shapes(*(tuple(s) for s in shapes))
    except ValueError:
        raise Malformed(f"shapes {', '.join(map(str, shapes))} do not broadcast") from None


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise Malformed(f"{what} {text!r} is not an integer") from None


# --------------------------------------------------------------------------------- GEMMs
def _gemm(m: int, k: int, n: int, a: _Arg, *, batch: int = 1, bias: _Arg | None = None,
          out_b: float | None = None, w_numel: int | None = None) -> Cost:
    """batch × [M,K]x[K,N] at the activation's dtype; a bias of N elements uses costs' bias term,
    a larger one (addmm's full C) is read in full; `w_numel` overrides a broadcast weight's size."""
    b = a.b
    vec_bias = bias is not None and bias.is_tensor and bias.numel == n
    flops = batch * formulas.gemm_flops(m, k, n, bias=bias is not None and bias.is_tensor)
    nbytes = batch * formulas.gemm_bytes(m, k, n, b, bias=vec_bias)
    if bias is not None and bias.is_tensor and not vec_bias:
        nbytes += formulas.elementwise_bytes(bias.numel, 0, bias.b)
    if w_numel is not None:  # one weight shared by the whole batch
        nbytes -= (batch - 1) * formulas.elementwise_bytes(w_numel, 0, b)
    if out_b is not None:  # output in another dtype than the operands (fp8 GEMMs)
        nbytes += batch * formulas.elementwise_bytes(0, m * n, out_b - b)
    shape = f"{batch}x" if batch > 1 else ""
    shape += f"[{m},{k}]x[{k},{n}]" + ("+bias" if bias is not None and bias.is_tensor else "")
    return Cost("gemm", flops, nbytes, a.dtype, shape, m=m, k=k, n=n)


def _mm(c: _Call) -> Cost:
    """mm(a [M,K], w [K,N])."""
    a, w = _tensor(c.args, 0, 2), _tensor(c.args, 1, 2)
    return _gemm(a.dims[0], a.dims[1], w.dims[1], a)


def _addmm(c: _Call) -> Cost:
    """addmm(bias, a [M,K], w [K,N]), _addmm_activation likewise."""
    a, w = _tensor(c.args, 1, 2), _tensor(c.args, 2, 2)
    return _gemm(a.dims[0], a.dims[1], w.dims[1], a, bias=c.args[0])


def _linear(c: _Call) -> Cost:
    """linear(x [.., K], weight [N, K], bias?)."""
    x, w = _tensor(c.args, 0, min_rank=1), _tensor(c.args, 1, 2)
    bias = c.args[2] if len(c.args) > 2 else None
    return _gemm(math.prod(x.dims[:-1]), x.dims[-1], w.dims[0], x, bias=bias)


def _bmm(c: _Call) -> Cost:
    """bmm(a [B,M,K], w [B,K,N])."""
    a, w = _tensor(c.args, 0, 3), _tensor(c.args, 1, 3)
    return _gemm(a.dims[1], a.dims[2], w.dims[2], a, batch=a.dims[0])


def _baddbmm(c: _Call) -> Cost:
    """baddbmm(bias, a [B,M,K], w [B,K,N])."""
    a, w = _tensor(c.args, 1, 3), _tensor(c.args, 2, 3)
    return _gemm(a.dims[1], a.dims[2], w.dims[2], a, batch=a.dims[0], bias=c.args[0])


def _matmul(c: _Call) -> Cost:
    """torch.matmul broadcasting: a 2-D weight is shared (read once) by every batch item."""
    a, w = _tensor(c.args, 0, min_rank=1), _tensor(c.args, 1, min_rank=1)
    ad = [1, *a.dims] if len(a.dims) == 1 else a.dims
    wd = [*w.dims, 1] if len(w.dims) == 1 else w.dims
    if len(wd) == 2:
        return _gemm(math.prod(ad[:-1]), ad[-1], wd[1], a)
    batch = math.prod(_broadcast(ad[:-2], wd[:-2]))
    shared = w.numel if len(wd[:-2]) == 0 or math.prod(wd[:-2]) == 1 else None
    return _gemm(ad[-2], ad[-1], wd[-1], a, batch=batch, w_numel=shared)


def _scaled_mm(c: _Call) -> Cost:
    """fp8 GEMM: operands at 1 byte, output at `out_dtype` (Concrete Inputs), scales ignored."""
    a, w, args = _tensor(c.args, 0, 2), _tensor(c.args, 1, 2), c.args
    bias = args[4] if len(args) > 4 and args[4].is_tensor else None
    out = dtypes.by_scalar_type(args[6].concrete) if len(args) > 6 else None
    return _gemm(a.dims[0], a.dims[1], w.dims[1], a, bias=bias, out_b=out.bytes if out else None)


# ------------------------------------------------------------------- mixture of experts
def _grouped_mm(c: _Call) -> Cost:
    """_grouped_mm(a [S, K], w [E, K, N], offs [E]): every expert's GEMM over its rows at once.
    FLOPs and activations exact; the active experts' weights are added per layer. A backward's
    grad-weight (a [K, S], b [S, N], offs [E]) is `_grouped_weight_grad`."""
    if len(c.args) > 1 and c.args[1].is_tensor and len(c.args[1].dims) == 2:
        return _grouped_weight_grad(c)
    a, w = _tensor(c.args, 0, 2), _tensor(c.args, 1, 3)
    (s, k), (e, _, n) = a.dims, w.dims
    return _experts_gemm(s, k, n, e, a, w)


def _grouped_weight_grad(c: _Call) -> Cost:
    """A grouped GEMM's grad-weight: Xᵀ·dY per expert over its rows, a [K, S] x b [S, N] split
    by offs [E] into E [K, N] gradients: 2·S·K·N FLOPs, a and b read, E·K·N written."""
    a, b, offs = _tensor(c.args, 0, 2), _tensor(c.args, 1, 2), _tensor(c.args, 2, 1)
    (k, s), (_, n), e = a.dims, b.dims, offs.dims[0]
    nbytes = formulas.elementwise_bytes(k * s + s * n, e * k * n, a.b)
    return Cost("gemm", 2.0 * s * k * n, nbytes, a.dtype, f"{e}x[{k},{s}]x[{s},{n}] (grad-weight)",
                m=s, k=k, n=n)


def _experts_gemm(s: int, k: int, n: int, e: int, a: _Arg, w: _Arg, how: str = "") -> Cost:
    nbytes = formulas.elementwise_bytes(s * k, s * n, a.b)
    return Cost("gemm", 2.0 * s * k * n, nbytes, a.dtype,
                f"{e} experts [{s},{k}]x[{k},{n}]{how}", m=s, k=k, n=n, experts=e,
                expert_bytes=float(k * n * w.b))


def _fused_experts(c: _Call) -> Cost:
    """An engine's fused MoE op, costed for the half attribute() named (`c.operator`):
    inplace/outplace_fused_experts(hidden [M, H], w13 [E, 2I, H], w2 [E, H, I],
    topk_weights [M, k], topk_ids [M, k], ...), or moe_forward(hidden [M, H], logits [M, E],
    layer name) with the model's experts. gate_up: 2·S·H·2I FLOPs, S·H read, S·2I written;
    down: 2·S·I·H, S·I read, S·H written (S = M·k); combine (its finalize kernel): S·H read and
    added, M·H written; weights per active expert added per layer,
    at the model's expert weight bits (MXFP4: 4.25) where the op does not record its weights.
    An input padded past the model's hidden size (vLLM pads gpt-oss's 2880 to 3072 for its
    MXFP4 kernels) is costed at the useful size, and the shape says so."""
    x = _tensor(c.args, 0, 2)
    (m, h) = x.dims
    pad = ""
    if c.hidden is not None and c.hidden < h:
        pad, h = f"; hidden padded {c.hidden} -> {h}, costed at its useful {c.hidden}", c.hidden
    weight_b = x.b
    if c.base.endswith("moe_forward"):
        logits = _tensor(c.args, 1, 2)
        if c.experts is None:
            return Cost(uncosted=f"{c.name}: expert shapes not recorded (give --model)")
        e, top_k, inter = logits.dims[1], c.experts.top_k, c.experts.intermediate_size
        weight_b = c.expert_bits / 8 if c.expert_bits else x.b
    else:
        w1, topk_ids = _tensor(c.args, 1, 3), _tensor(c.args, 4, 2)
        e, inter, top_k = w1.dims[0], w1.dims[1] // 2, topk_ids.dims[1]
        # the recorded w13's bytes per logical weight element (fp8: 1; packed 4-bit: 0.5)
        weight_b = w1.numel * w1.b / max(e * 2 * inter * x.dims[1], 1)
    rows = m * top_k
    if c.operator == "moe_combine":  # the top-k outputs [M, k, H] summed into [M, H]
        return Cost("reduction", float(rows * h), formulas.elementwise_bytes(rows * h, m * h, x.b),
                    x.dtype, f"[{m},{top_k},{h}] top-{top_k} sum fused{pad}")
    halves = {"experts_gate_up": (h, 2 * inter), "experts_down": (inter, h)}
    if c.operator not in halves:
        return Cost(uncosted=f"{c.name}: named {c.operator}, not an expert GEMM half")
    k, n = halves[c.operator]
    bits = f", weights {weight_b * 8:g} bits" if weight_b != x.b else ""
    return Cost("gemm", 2.0 * rows * k * n, formulas.elementwise_bytes(rows * k, rows * n, x.b),
                x.dtype, f"{e} experts [{rows},{k}]x[{k},{n}] fused{bits}{pad}", m=rows, k=k,
                n=n, experts=e, expert_bytes=float(k * n * weight_b))


def _topk(c: _Call) -> Cost:
    """topk(x [.., E], k, dim, ...): reads x, writes k values and k int64 indices per row;
    one comparison per element."""
    x = _tensors(c.args, 1)[0]
    if len(c.args) < 2 or not c.args[1].concrete:
        return Cost(uncosted=f"{c.name}: k not recorded")
    k = _int(c.args[1].concrete, "topk k")
    rows = x.numel // max(x.dims[-1] if x.dims else 1, 1)
    nbytes = formulas.elementwise_bytes(x.numel, rows * k, x.b) + rows * k * 8
    return Cost("reduction", float(x.numel), float(nbytes), x.dtype, f"{x.dims} top-{k}")


def _triton_topk(c: _Call) -> Cost:
    """triton_kernels' routing top-k as vLLM records it, `TopK(logits [M, E], k, ...)`: reads
    the logits, writes the k values (their dtype) and int16 indices per row and the [M, E/32]
    uint32 bitmatrix of chosen experts; one comparison per logit."""
    x = _tensor(c.args, 0, 2)
    if len(c.args) < 2 or not c.args[1].concrete:
        return Cost(uncosted=f"{c.name}: k not recorded")
    k = _int(c.args[1].concrete, "TopK k")
    m, e = x.dims
    nbytes = formulas.elementwise_bytes(x.numel, m * k, x.b) + m * k * 2 + m * -(-e // 32) * 4
    return Cost("reduction", float(x.numel), float(nbytes), x.dtype, f"{x.dims} top-{k}")


def _triton_sort_tokens(c: _Call) -> Cost:
    """triton_kernels' routing data, `SortTokens(expt_scal [M, k], expt_indx [M, k], E)`:
    reads the chosen experts and their weights, writes the gather and scatter indices (int32
    per routed row) and the E per-expert counts; no FLOPs (a sort by expert)."""
    scal, indx = _tensor(c.args, 0, 2), _tensor(c.args, 1, 2)
    experts = _int(c.args[2].concrete, "SortTokens E") if len(c.args) > 2 and \
        c.args[2].concrete else 0
    nbytes = (formulas.elementwise_bytes(scal.numel, 0, scal.b)
              + formulas.elementwise_bytes(indx.numel, 0, indx.b)
              + formulas.elementwise_bytes(0, 2 * indx.numel + experts, 4))
    return Cost("copy", 0.0, float(nbytes), scal.dtype, f"{indx.dims} -> {experts} experts")


def _topk_softmax(c: _Call) -> Cost:
    """vLLM's topk_softmax(weights [M, k] fp32, ids [M, k], token_expert_indices [M, k],
    logits [M, E] fp32): reads the logits, writes the three [M, k] outputs; softmax's
    5 FLOPs per logit."""
    weights, ids, rows, logits = _tensors(c.args, 4)[:4]
    nbytes = formulas.elementwise_bytes(logits.numel, 0, logits.b)
    nbytes += sum(formulas.elementwise_bytes(0, t.numel, t.b) for t in (weights, ids, rows))
    return Cost("reduction", 5.0 * logits.numel, float(nbytes), logits.dtype,
                f"{logits.dims} top-{weights.dims[-1]}")


def _moe_align(c: _Call) -> Cost:
    """moe_align_block_size(topk_ids [M, k], E, block, sorted_ids [EM], expert_ids [EM/block],
    num_tokens_post_pad [1]): reads the ids, writes the three outputs (all recorded)."""
    ts = _tensors(c.args, 2)
    ids, outs = ts[0], ts[1:]
    nbytes = formulas.elementwise_bytes(ids.numel, 0, ids.b)
    nbytes += sum(formulas.elementwise_bytes(0, t.numel, t.b) for t in outs)
    return Cost("copy", 0.0, float(nbytes), ids.dtype, f"{ids.dims} -> {[t.dims for t in outs]}")


def _moe_sum(c: _Call) -> Cost:
    """moe_sum(input [M, k, H], output [M, H]): reads the top-k outputs, writes their sum."""
    x, out = _tensors(c.args, 2)[:2]
    return _io(float(x.numel), [x], out.numel, out.b, "reduction", x.dtype)


# -------------------------------------------------------- serving engines' own kernels
# vLLM's `_C` / `_C_cache_ops` and SGLang's `sgl_kernel` (FlashInfer's) ops, by base name
# (`ENGINE_RULES`), their argument order from vllm csrc/torch_bindings.cpp and sgl-kernel
# csrc/common_extension.cc. Minimum bytes as everywhere: what the kernel must read once and
# write once; FLOPs by the aten ops' conventions (`_NORMS`, `_POINTWISE_FLOPS`).
_ROPE_FLOPS = 3.0  # per rotated element: x·cos - y·sin (two multiplies, one add)


def _last_dim(x: _Arg) -> int:
    if not x.dims:
        raise Malformed("a 0-d tensor where rows of a hidden dim are expected")
    return x.dims[-1]


def _engine_rms_norm(c: _Call) -> Cost:
    """rms_norm(out [.., H], input [.., H], weight [H], eps) (vLLM `_C::rms_norm`, SGLang
    `rmsnorm`): reads input and weight, writes out; `_NORMS["rms_norm"]` FLOPs per element."""
    out, x, w = _tensor(c.args, 0), _tensor(c.args, 1), _tensor(c.args, 2, 1)
    if out.numel != x.numel or w.dims[0] != _last_dim(x):
        raise Malformed(f"rms_norm out {out.dims}, input {x.dims}, weight {w.dims}")
    return _io(_NORMS["rms_norm"] * x.numel, [x, w], out.numel, out.b, "norm", x.dtype)


def _fused_add_rms_norm(c: _Call) -> Cost:
    """fused_add_rms_norm(input [.., H], residual [.., H], weight [H], eps) (vLLM; SGLang's
    fused_add_rmsnorm), in place: residual += input, then input = RMSNorm(residual) · weight.
    Reads input, residual and weight, writes residual and input; the add's FLOP plus
    `_NORMS["rms_norm"]` per element."""
    x, res, w = _tensor(c.args, 0), _tensor(c.args, 1), _tensor(c.args, 2, 1)
    if x.dims != res.dims or w.dims[0] != _last_dim(x):
        raise Malformed(f"fused_add_rms_norm input {x.dims}, residual {res.dims}, "
                        f"weight {w.dims}")
    flops = (_POINTWISE_FLOPS["add"] + _NORMS["rms_norm"]) * x.numel
    nbytes = (formulas.elementwise_bytes(x.numel, x.numel, x.b)
              + formulas.elementwise_bytes(res.numel, res.numel, res.b)
              + formulas.elementwise_bytes(w.numel, 0, w.b))
    return Cost("norm", flops, float(nbytes), x.dtype,
                f"{x.dims} + residual {res.dims} -> both, weight {w.dims}")


def _aiter_rms_norm(c: _Call) -> Cost:
    """aiter's rms_norm(input [.., H], weight [H], eps, ...) (vLLM's ROCm path), out returned:
    reads input and weight, writes input's size; `_NORMS["rms_norm"]` FLOPs per element."""
    x, w = _tensor(c.args, 0), _tensor(c.args, 1, 1)
    if w.dims[0] != _last_dim(x):
        raise Malformed(f"rms_norm input {x.dims}, weight {w.dims}")
    return _io(_NORMS["rms_norm"] * x.numel, [x, w], x.numel, x.b, "norm", x.dtype)


def _add_rms_norm_out(c: _Call) -> Cost:
    """A fused residual add + RMSNorm with its outputs apart: aiter's add_rmsnorm /
    rmsnorm2d_fwd_with_add[_ck](out, input, residual_in, residual_out, weight, eps, ...)
    (SGLang, vLLM on ROCm): residual_out = input + residual_in, out = RMSNorm(residual_out) ·
    weight. A norm with the residual add's bytes: input, residual_in and weight read, out and
    residual_out written; the add's FLOP plus `_NORMS["rms_norm"]` per element."""
    out, x, res_in, res_out = (_tensor(c.args, i) for i in range(4))
    w = _tensor(c.args, 4, 1)
    if not (out.dims == x.dims == res_in.dims == res_out.dims) or w.dims[0] != _last_dim(x):
        raise Malformed(f"add_rmsnorm out {out.dims}, input {x.dims}, residual {res_in.dims} "
                        f"-> {res_out.dims}, weight {w.dims}")
    flops = (_POINTWISE_FLOPS["add"] + _NORMS["rms_norm"]) * x.numel
    nbytes = (formulas.elementwise_bytes(x.distinct + res_in.distinct, 0, x.b)
              + formulas.elementwise_bytes(w.numel, 0, w.b)
              + formulas.elementwise_bytes(0, out.numel + res_out.numel, out.b))
    return Cost("norm", flops, float(nbytes), x.dtype,
                f"{x.dims} + residual {res_in.dims} -> out, residual; weight {w.dims}")


def _store_cache(c: _Call) -> Cost:
    """SGLang's store_cache(k [T, n_kv·d], v [T, n_kv·d], k_cache, v_cache, loc [T], ...) (its
    ROCm path, `sglang::store_cache`): `_cache_write` of k and v at loc."""
    k, v = _tensor(c.args, 0, min_rank=1), _tensor(c.args, 1, min_rank=1)
    return _cache_write([k, v], [_tensor(c.args, 2), _tensor(c.args, 3)], _tensor(c.args, 4, 1))


def _rope(heads: Sequence[_Arg], tokens: int, head: int, table: _Arg, pos: _Arg) -> Cost:
    """Rotate the first rot_dim = table.dims[1] dims of every head of the `heads` tensors
    ([tokens, .. heads·head ..]) in place, each token's cos|sin row gathered from `table`
    [max_position, rot_dim] at its position: rotated elements read and written, the rows read
    (at most the table's), the positions read; `_ROPE_FLOPS` per rotated element."""
    rot = table.dims[1]
    if tokens < 1 or head < 1 or rot > head:
        raise Malformed(f"{tokens} tokens, head_size {head}, rot_dim {rot}")
    nbytes, rotated = 0.0, 0
    for x in heads:
        if x.numel % (tokens * head):
            raise Malformed(f"{x.dims} is not {tokens} tokens of heads of {head}")
        n = x.numel // head * rot
        rotated += n
        nbytes += formulas.elementwise_bytes(n, n, x.b)
    nbytes += formulas.elementwise_bytes(min(tokens, table.dims[0]) * rot, 0, table.b)
    nbytes += formulas.elementwise_bytes(pos.distinct, 0, pos.b)
    shape = " ".join(str(x.dims) for x in heads) + f" rot {rot} of head {head}"
    return Cost("elementwise", _ROPE_FLOPS * rotated, float(nbytes), heads[0].dtype, shape)


def _rotary_embedding(c: _Call) -> Cost:
    """vLLM's rotary_embedding(positions [T] or [B, S], query [.., n_q·d] or [.., n_q, d],
    key (likewise, or None), head_size, cos_sin_cache [max_position, rot_dim], is_neox):
    `_rope` over query and key, T = positions' elements, head_size from Concrete Inputs."""
    pos, q, table = _tensor(c.args, 0), _tensor(c.args, 1), _tensor(c.args, 4, 2)
    if not c.args[3].concrete:
        return Cost(uncosted=f"{c.name}: head_size not recorded (Concrete Inputs)")
    head = _int(c.args[3].concrete, "rotary_embedding head_size")
    key = [c.args[2]] if c.args[2].is_tensor else []
    return _rope([q, *key], pos.numel, head, table, pos)


def _apply_rope_cos_sin_cache(c: _Call) -> Cost:
    """SGLang's (FlashInfer's) apply_rope_pos_ids_cos_sin_cache(q [T, n_q, d], k [T, n_kv, d],
    q_rope, k_rope, cos_sin_cache [max_position, rot_dim], pos_ids [T], interleave, ...):
    `_rope` over q and k (SGLang passes q and k as their own outputs). A fused KV-cache store
    (the later `v, k_buffer, v_buffer, kv_cache_loc` arguments, when tensors) adds
    `_cache_write` of the rotated k and v."""
    q, k = _tensor(c.args, 0, 3), _tensor(c.args, 1, 3)
    table, pos = _tensor(c.args, 4, 2), _tensor(c.args, 5)
    rope = _rope([q, k], pos.numel, q.dims[-1], table, pos)
    if len(c.args) > 12 and all(c.args[i].is_tensor for i in (9, 10, 11, 12)):
        v, k_buf, v_buf, loc = (c.args[i] for i in (9, 10, 11, 12))
        store = _cache_write([k, v], [k_buf, v_buf], loc)
        # the rotated part of k is already read by the RoPE: the store reads the rest and v
        rotated_k = k.numel // q.dims[-1] * table.dims[1]
        extra = store.bytes - formulas.elementwise_bytes(rotated_k, 0, k.b)
        return Cost(rope.kind, rope.flops, rope.bytes + extra, rope.dtype,
                    f"{rope.shape}; {store.shape}")
    return rope


def _act_and_mul(c: _Call) -> Cost:
    """silu_and_mul / gelu_and_mul / gelu_tanh_and_mul(out [.., I], input [.., 2I]) (vLLM,
    SGLang): act(gate) · up; reads input, writes out, the activation's FLOPs plus 1 per output
    element."""
    out, x = _tensor(c.args, 0), _tensor(c.args, 1)
    if 2 * out.numel != x.numel or 2 * _last_dim(out) != _last_dim(x):
        raise Malformed(f"{c.base} out {out.dims}, input {x.dims}: input is not [.., 2 x out]")
    per = _POINTWISE_FLOPS["gelu" if "gelu" in c.base else "silu"] + 1.0
    return _io(per * out.numel, [x], out.numel, out.b, "elementwise", x.dtype)


def _cache_write(sources: Sequence[_Arg], caches: Sequence[_Arg], slots: _Arg) -> Cost:
    """Write slots.numel tokens of each source ([tokens(+padding), ..]) into its cache, at the
    cache's dtype (an fp8 cache takes 1 byte): those rows read and written, the slot indices
    read. Never the whole cache: only the slots written move. 0 FLOPs (an fp8 cache's
    scaling multiply is not counted)."""
    tokens = slots.numel
    nbytes = formulas.elementwise_bytes(slots.distinct, 0, slots.b)
    for src, cache in zip(sources, caches, strict=True):
        if not src.dims or src.dims[0] < tokens:
            raise Malformed(f"{src.dims} holds fewer than the {tokens} tokens of slot_mapping")
        moved = src.numel // src.dims[0] * tokens if tokens else 0
        nbytes += formulas.elementwise_bytes(moved, 0, src.b) + formulas.elementwise_bytes(
            0, moved, cache.b)
    shape = " ".join(str(s.dims) for s in sources) + f" -> {tokens} slots"
    return Cost("copy", 0.0, float(nbytes), sources[0].dtype, shape)


def _reshape_and_cache(c: _Call) -> Cost:
    """vLLM's reshape_and_cache[_flash](key [T, n_kv, d], value [T, n_kv, d], key_cache,
    value_cache, slot_mapping [T'], kv_cache_dtype, k_scale, v_scale): `_cache_write` of the
    first T' = slot_mapping's tokens (vLLM V1 pads key for CUDA graphs, not slot_mapping),
    plus the scales."""
    key, value = _tensor(c.args, 0, min_rank=1), _tensor(c.args, 1, min_rank=1)
    caches = [_tensor(c.args, 2), _tensor(c.args, 3)]
    out = _cache_write([key, value], caches, _tensor(c.args, 4, 1))
    scales = sum(formulas.elementwise_bytes(a.distinct, 0, a.b) for a in c.args[6:8] if a.is_tensor)
    return Cost(out.kind, out.flops, out.bytes + scales, out.dtype, out.shape)


def _concat_and_cache_mla(c: _Call) -> Cost:
    """vLLM's concat_and_cache_mla(kv_c [T, kv_lora_rank], k_pe [T, rope_dim], kv_cache
    [blocks, block_size, kv_lora_rank + rope_dim], slot_mapping [T'], kv_cache_dtype, scale):
    both parts of T' tokens written into the one cache (`_cache_write`), plus the scale."""
    kv_c, k_pe, cache = _tensor(c.args, 0, 2), _tensor(c.args, 1, 2), _tensor(c.args, 2)
    out = _cache_write([kv_c, k_pe], [cache, cache], _tensor(c.args, 3, 1))
    scale = sum(formulas.elementwise_bytes(a.distinct, 0, a.b) for a in c.args[5:6] if a.is_tensor)
    return Cost(out.kind, out.flops, out.bytes + scale, out.dtype, out.shape)


def _store_kv_cache(c: _Call) -> Cost:
    """SGLang's store_kv_cache(k_cache, v_cache, out_loc [T], k [T, n_kv, d], v [T, n_kv, d]):
    `_cache_write` of k and v at out_loc."""
    caches = [_tensor(c.args, 0), _tensor(c.args, 1)]
    loc = _tensor(c.args, 2, 1)
    return _cache_write([_tensor(c.args, 3, min_rank=1), _tensor(c.args, 4, min_rank=1)],
                        caches, loc)


# ----------------------------------------------------------------------------- attention
# Attention ops whose arguments hold only the step's new tokens, with why they are uncosted.
_ATTENTION_WITHOUT_LENGTHS = {
    name: "query [T, n_q, d], key and value [T, n_kv, d] are the step's new tokens only; "
          "each sequence's key length is in vLLM's attention metadata, not among the op's "
          "arguments"
    for name in operators.ATTENTION_DISPATCH}


def _attention(c: _Call) -> Cost:
    """Q [B,n_q,T,d], K [B,n_kv,S,d], V [B,n_kv,S,d_v] (or BTHD; or a flash-attention forward
    over packed or paged sequences, `_varlen_attention`): formulas.attention_flops /
    attention_bytes, d and d_v apart (MLA: 192 and 128)."""
    if c.name in layouts.VARLEN_LAYOUTS:
        return _varlen_attention(c, layouts.VARLEN_LAYOUTS[c.name])
    if c.name in layouts.ATTENTION_BACKWARD_CAUSAL_AT:
        return _attention_backward(c)
    if c.name in _ATTENTION_WITHOUT_LENGTHS:
        return Cost(uncosted=f"{c.name}: {_ATTENTION_WITHOUT_LENGTHS[c.name]}")
    if c.name not in layouts.ATTENTION_LAYOUTS:
        return Cost(uncosted=f"{c.name}: attention op without a known argument layout "
                             "(its mask and sequence lengths are not recorded)")
    layout, causal_at = layouts.ATTENTION_LAYOUTS[c.name]
    q, k = _tensor(c.args, 0), _tensor(c.args, 1)
    if len(q.dims) != 4 or len(k.dims) != 4:
        return Cost(uncosted=f"{c.name}: variable-length attention (sequence lengths not recorded)")
    if layout == "BHTD":
        (batch, n_q, t, d), (_, n_kv, s, _) = q.dims, k.dims
    else:
        (batch, t, n_q, d), (_, s, n_kv, _) = q.dims, k.dims
    flag = c.args[causal_at].concrete if causal_at < len(c.args) else ""
    if c.name == "aten::_efficient_attention_forward" and flag:
        flag = "False" if flag == "0" else "True"
    if flag in ("False", "0") and _query_mask(c.args, t, s):
        flag = ""  # a mask over the queries, its values not recorded: the verdict decides
    return _attention_cost(c, q, (batch, n_q, n_kv, t, s, d), flag, _head_dim(c.args, 2))


# SDPA's backward ops: the index of their attn_bias (the forward's mask), where they take one
_BACKWARD_MASK_AT = {"aten::_scaled_dot_product_efficient_attention_backward": 4,
                     "aten::_scaled_dot_product_cudnn_attention_backward": 8,
                     "aten::_cudnn_attention_backward": 8}


def _query_mask(args: list[_Arg], t: int, s: int, at: int = 3) -> bool:
    """Whether argument `at` (SDPA's attn_mask, the efficient and cuDNN kernels' bias) is a
    square mask over T = S > 1 queries shared by the heads, [B|1, 1, T, T]: a decoder's causal
    mask's shape (attribution/kind.py reads it so), though its values are not recorded. (Not
    T < S: a cross-attention's padding mask has that shape too.)"""
    m = args[at] if len(args) > at else None
    return (1 < t == s and m is not None and m.is_tensor and len(m.dims) == 4
            and m.dims[1] == 1 and m.dims[2:] == [t, s])


def _head_dim(args: list[_Arg], i: int) -> int | None:
    """V's head size: the last dim of argument i when it is a tensor with dims, else None
    (taken as d)."""
    v = args[i] if i < len(args) else None
    return v.dims[-1] if v is not None and v.is_tensor and v.dims else None


def _attention_cost(c: _Call, q: _Arg, shape: tuple[int, int, int, int, int, int],
                    flag: str, d_v: int | None = None) -> Cost:
    """B sequences of T queries (n_q heads) against S keys (n_kv heads) of head_dim d, values of
    d_v (None: d); `flag` the recorded is_causal ("True"/"False", else unknown: causal in a
    decoder, bidirectional in an encoder (`_Call.decoder`), and the derivation `layout`)."""
    batch, n_q, n_kv, t, s, d = shape
    # A single query token attends to every cached key; otherwise trust is_causal when recorded.
    recorded = flag in ("True", "False")
    is_causal = t > 1 and (flag == "True" if recorded else c.decoder)
    counted = c.causal if is_causal else "full"
    dv = d if d_v is None else d_v
    flops = formulas.attention_flops(batch, n_q, t, s, d, causal=counted, d_v=dv)
    nbytes = formulas.attention_bytes(batch, n_q, n_kv, t, s, d, q.b,
                                      convention=c.attention_bytes, d_v=dv)
    text = (f"B={batch} n_q={n_q} n_kv={n_kv} T={t} S={s} d={d}"
            + (f" d_v={dv}" if dv != d else "") + (" causal" if is_causal else ""))
    useful = batch * n_q * formulas.attention_pairs(t, s, "causal" if is_causal else "full")
    executed = (batch * n_q * t * s if not is_causal or c.name in _MATH_ATTENTION
                else batch * n_q * _tiled_pairs(t, s))
    assumed = t > 1 and not recorded
    if assumed:
        text += (" (mask values not recorded: causal, as a decoder's)" if is_causal else
                 " (mask values not recorded: every pair, as an encoder's)")
    return Cost("attention", flops, nbytes, q.dtype, text, batch=batch, t=t, s=s,
                causal=is_causal, heads=(n_q, n_kv, d), pairs=(executed, useful),
                derivation=LAYOUT if assumed else SHAPE)


# SDPA's math backend scores every pair before masking (no tiles skipped)
_MATH_ATTENTION = frozenset({"aten::_scaled_dot_product_attention_math"})
# Query and key tile of a flash-style kernel (FlashAttention-2's forward: kBlockM = 128 rows;
# Inductor's flex template: BLOCK_M = 128): a causal kernel skips the tiles wholly above the
# diagonal and computes the diagonal tiles whole.
_TILE = 128


def _tiled_pairs(t: int, s: int) -> float:
    """Query-key pairs one head of a causal flash kernel computes: each tile of up to _TILE
    queries scores its keys up to its last query's, rounded up to whole tiles (at most S)."""
    start = np.arange(0, t, _TILE)
    rows = np.minimum(_TILE, t - start)
    keys = np.minimum(s, np.ceil((s - t + start + rows) / _TILE) * _TILE)
    return float((rows * keys).sum())


def _attention_backward(c: _Call) -> Cost:
    """SDPA's backward (grad_out, query [B,n_q,T,d], key [B,n_kv,S,d], ...): the forward's
    geometry and causal convention (`_attention_cost`), formulas.attention_backward_flops and
    attention_backward_bytes."""
    causal_at = layouts.ATTENTION_BACKWARD_CAUSAL_AT[c.name]
    q, k = _tensor(c.args, 1), _tensor(c.args, 2)
    if len(q.dims) != 4 or len(k.dims) != 4:
        raise Malformed(f"query {q.dims} and key {k.dims} are not [B, heads, T, d]")
    (batch, n_q, t, d), (_, n_kv, s, _) = q.dims, k.dims
    flag = c.args[causal_at].concrete if causal_at < len(c.args) else ""
    mask_at = _BACKWARD_MASK_AT.get(c.name)
    if flag == "False" and mask_at is not None and _query_mask(c.args, t, s, mask_at):
        flag = ""  # (as the forward's mask: `_query_mask`)
    dv = _head_dim(c.args, 3)
    fwd = _attention_cost(c, q, (batch, n_q, n_kv, t, s, d), flag, dv)
    counted = c.causal if fwd.causal else "full"
    return Cost("attention", formulas.attention_backward_flops(batch, n_q, t, s, d, counted, dv),
                formulas.attention_backward_bytes(batch, n_q, n_kv, t, s, d, q.b, dv), q.dtype,
                f"backward of {fwd.shape}", batch=batch, t=t, s=s, causal=fwd.causal,
                heads=(n_q, n_kv, d), pairs=fwd.pairs, derivation=fwd.derivation)


def _eager_attention(out: pd.DataFrame, causal: str, decoder: bool) -> None:
    """An eager attention's QKᵀ and P·V matmuls (bmm/matmul rows named attention) compute every
    query-key pair of a prefill's square T x T scores (QKᵀ: M = N = T; P·V: M = K = T; T > 1):
    the QKᵀ row holds the pairs, all executed, a decoder's causal share (pairs/(T·T)) useful,
    an encoder's all. Under --causal causal a decoder's two matmuls count their causal share
    of FLOPs, as the attention rule does, the shape says so. Bytes stay those the GEMM moved;
    other shapes (T = 1, chunks) are left at every pair."""
    m, k, n = (out[c].to_numpy(dtype=np.float64, na_value=np.nan) for c in ("M", "K", "N"))
    flops = out["flops"].to_numpy(np.float64)
    rows = ((out["operator"] == "attention").to_numpy(bool)
            & out["op_name"].isin(layouts.EAGER_ATTENTION_GEMMS).to_numpy(bool)
            & (m > 1) & ((n == m) | (k == m)) & (flops > 0))
    if not rows.any():
        return
    sizes, at = np.unique(m[rows], return_inverse=True)
    share = (np.array([formulas.attention_pairs(int(t), int(t), "causal") / (t * t)
                       for t in sizes]) if decoder else np.ones(len(sizes)))[at]  # (per T)
    scores = rows & (n == m) & (k != m)
    executed = flops[scores] / (2.0 * k[scores])
    out.loc[scores, "pairs_executed"] = executed
    out.loc[scores, "pairs_useful"] = executed * share[scores[rows]]
    if causal == "causal" and decoder:
        out.loc[rows, "flops"] = flops[rows] * share
        out.loc[rows, "shape"] = out.loc[rows, "shape"].astype(str) + " (causal pairs)"


def _repeated_kv(out: pd.DataFrame, model: ModelSpec | None) -> None:
    """A GQA model's attention run over K and V expanded to the query heads (HF's repeat_kv
    before an SDPA: n_kv = n_q recorded) reads K and V of the model's n_kv heads once, its
    GQA-aware minimum bytes, whether its shapes came from the op or a graph map; the copies
    that expand them are rows of their own (`repeat_kv`, copy kind), not attention's bytes."""
    if model is None or model.num_kv_heads >= model.num_heads:
        return
    att = out["operator"].eq("attention").to_numpy(bool)
    expanded = (att & out["cost_kind"].eq("attention").to_numpy(bool, na_value=False)
                & out["n_kv"].eq(out["n_q"]).to_numpy(bool, na_value=False)
                & out["derivation"].eq(SHAPE).to_numpy(bool)
                & ~out["shape"].astype(str).str.startswith("backward").to_numpy(bool))
    # (the model's heads, or a TP shard of them: a wrong model's are left alone)
    nq = out["n_q"].to_numpy(np.float64, na_value=np.nan)
    expanded &= (model.num_heads % np.nan_to_num(nq, nan=np.inf) == 0) & (
        nq * model.num_kv_heads % model.num_heads == 0)
    if expanded.any():
        e = out.loc[expanded]
        nq = nq[expanded]
        nkv = nq * model.num_kv_heads / model.num_heads
        b = _element_bytes(e["dtype"])
        d = e["head_dim"].to_numpy(np.float64)
        kv = e["B"].to_numpy(np.float64) * e["S"].to_numpy(np.float64) * 2.0 * d * b
        out.loc[expanded, "bytes"] = e["bytes"].to_numpy(np.float64) - (nq - nkv) * kv
        out.loc[expanded, "n_kv"] = nkv.astype(np.int64)
        out.loc[expanded, "shape"] = (e["shape"].astype(str)
                                      + " (K, V expanded by repeat_kv: read as the model's n_kv)")
    # eager: copy_ of the expand [B, n_kv, n_rep, S, d]; compiled: a Triton kernel reading
    # [B, n_kv, S, d] and writing [B, n_kv·n_rep, S, d]
    shape = out["shape"].astype(str)
    heads = shape.str.extract(r"^\[\d+, (\d+), \d+, \d+\] \[\d+, (\d+), \d+, \d+\] over"
                              ).astype(float).to_numpy()
    copies = att & (
        (out["cost_kind"].eq("copy") & shape.str.match(r"\[\d+, \d+, \d+, \d+, \d+\] ->")
         ).to_numpy(bool, na_value=False)
        | (out["cost_kind"].eq("fused").to_numpy(bool, na_value=False)
           & (heads[:, 1] == heads[:, 0] * model.num_heads / model.num_kv_heads)))
    out.loc[copies, "operator"] = "repeat_kv"


def _varlen_attention(c: _Call, at: layouts.Varlen) -> Cost:
    """flash-attention's forward as engines call it: q [total_q, n_q, d] with cu_seqlens_q
    [B + 1] (or [B, T, n_q, d]); k, v packed [total_k, n_kv, d], paged [pages, page_size, n_kv,
    d] (with a page table) or dense [B, S, n_kv, d]. Costed by `_attention_cost` where the
    recorded shapes fix every sequence's T and S: one sequence (T = total_q, S = max_seqlen_k,
    else the packed keys' total), or a dense batch of equal lengths. Several packed or paged
    sequences are uncosted: their lengths are tensor values (cu_seqlens, seqused_k), which the
    trace does not record."""
    q, k = _tensor(c.args, 0), _tensor(c.args, 1)
    if len(q.dims) not in (3, 4) or len(k.dims) not in (3, 4):
        raise Malformed(f"query {q.dims} and key {k.dims} are not [tokens, heads, d] or "
                        "[B, T, heads, d]")

    def given(i: int) -> bool:
        return i < len(c.args) and c.args[i].is_tensor

    if len(q.dims) == 4:
        batch, t = q.dims[0], q.dims[1]
    elif given(at.cu_seqlens_q):
        batch, t = c.args[at.cu_seqlens_q].numel - 1, q.dims[0]
    else:
        raise Malformed("packed query [tokens, heads, d] without cu_seqlens_q")
    if batch < 1:
        raise Malformed(f"{batch} sequences")
    max_k = c.args[at.max_seqlen_k].concrete if at.max_seqlen_k < len(c.args) else ""
    dense = len(k.dims) == 4 and not given(at.page_table) and not given(at.seqused_k)
    if batch == 1 and max_k.isdigit():
        s = int(max_k)
    elif batch == 1 and len(k.dims) == 3:
        s = k.dims[0]
    elif dense and len(q.dims) == 4:
        s = k.dims[1]
    else:
        bound = f" (max_seqlen_k {max_k} bounds them)" if max_k.isdigit() else ""
        return Cost(uncosted=f"{c.name}: {batch} packed or paged sequence(s): each one's query "
                             f"and key lengths are tensor values the trace does not record{bound}")
    flag = next((a.concrete for a in c.args[at.causal_from:] if a.concrete in ("True", "False")),
                "")
    return _attention_cost(c, q, (batch, q.dims[-2], k.dims[-2], t, s, q.dims[-1]), flag,
                           _head_dim(c.args, 2))


_BORROWED = "graph_map"  # evidence of a replayed kernel named (and shaped) from a capture
_STEP_NEEDS_MODEL = (": its sequence lengths are not among its arguments, but its serving "
                     "step's annotation holds the batch's query and key sums: give --model (the "
                     "model's config.json) and they cost it")


def _step_attention(out: pd.DataFrame, step_text: pd.Series, model: ModelSpec | None,
                    causal: str, attention_bytes: str) -> None:
    """Cost, in place, the attention instances their ops left uncosted (paged, packed or
    new-token-only arguments), and those whose shapes a graph replay borrowed from a capture
    of another batch (evidence graph_map), inside a serving step whose annotation holds the
    batch sums
    (attribution/steps.py): per layer the step's query-key pairs (its window, if any) of the
    model's heads, 2·n_q·(d + d_v) FLOPs per pair; bytes Q read and O written for Σq tokens,
    K and V of the keys read (`attention_bytes` kv: those only); the evidence in `shape`. A
    layer's further attention instances in the same step (a split kernel named apart) cost
    nothing more. Without a model they stay uncosted, their reason saying that --model costs
    them. Vectorised: each distinct (step, window) is worked out once."""
    text = pd.Series(step_text, index=out.index, dtype=object)
    attention = out["operator"].eq("attention").to_numpy(bool)
    uncosted = attention & out["flops"].isna().to_numpy(bool)
    # a replay named from a capture carries the capture's shapes (its batch), not this step's
    borrowed = attention & (out["evidence"].eq(_BORROWED) & out["cost_kind"].eq("attention")
                            ).to_numpy(bool, na_value=False)
    annotated = _each_distinct(text, lambda t: isinstance(t, str)
                               and steps.parse_text(t) is not None).astype(bool)
    todo = (uncosted | borrowed) & annotated
    if not todo.any():
        return
    if model is None:  # the step's sums are there; the heads are the model's
        ask = uncosted & annotated
        out.loc[ask, "uncosted"] = (out.loc[ask, "op_name"].astype(str) + _STEP_NEEDS_MODEL)
        return
    arch = model.architecture
    att = arch.attention
    layer = out["layer"].astype("Int64").to_numpy(np.float64, na_value=np.nan)
    at = np.flatnonzero(todo)
    seen = pd.DataFrame({"t": text.to_numpy()[at], "l": np.nan_to_num(layer[at], nan=-1.0)})
    first = at[~seen.duplicated().to_numpy()]
    rest = np.setdiff1d(at, first)
    # each layer's sliding window (NaN: full attention; the last entry for no layer)
    wins = np.array([np.nan if v is None else float(v) for v in att.windows] + [np.nan])
    lay = np.nan_to_num(layer[first], nan=-1.0).astype(np.int64)
    w = wins[np.where((lay >= 0) & (lay < len(wins) - 1), lay, -1)]
    t = steps.attention_table(text.iloc[first], w, causal)
    dt = dtypes.lookup(arch.precision.activations) or _known("bf16")
    nq, nkv, d, dv = att.num_heads, att.num_kv_heads, att.head_dim, att.v_head_dim
    kv = t["keys"].to_numpy() * nkv * (d + dv) * dt.bytes
    qo = t["queries"].to_numpy() * nq * (d + dv) * dt.bytes
    sinks = ("; sinks: one learned logit per head and query, no key: no matmul FLOPs"
             if att.sinks else "")
    label = text.iloc[first].str.split(":").str[0].to_numpy(dtype=object)
    idx = out.index[first]
    out.loc[idx, "cost_kind"] = "attention"
    out.loc[idx, "flops"] = 2.0 * nq * (d + dv) * t["pairs"].to_numpy()
    out.loc[idx, "bytes"] = kv + (qo if attention_bytes == "all" else 0.0)
    out.loc[idx, "dtype"] = dt.short
    out.loc[idx, "shape"] = [f"{lb}: {q:.0f} queries; {n}{sinks}" for lb, q, n in
                             zip(label, t["queries"], t["note"], strict=True)]
    out.loc[idx, "uncosted"] = None
    out.loc[idx, "derivation"] = STEP
    # a paged or varlen kernel's tiles are not recorded: its executed pairs are taken as useful
    out.loc[idx, ["pairs_executed", "pairs_useful"]] = np.repeat(
        nq * t["pairs"].to_numpy(np.float64)[:, None], 2, axis=1)
    out.loc[idx, "B"] = t["requests"].to_numpy()
    out.loc[idx, "T"] = t["queries"].to_numpy()
    out.loc[idx, ["n_q", "n_kv", "head_dim"]] = [nq, nkv, d]
    out.loc[idx, "causal"] = (t["chunks"].to_numpy() > 0) & (causal == "causal")
    ridx = out.index[rest]
    out.loc[ridx, ["cost_kind", "flops", "bytes", "uncosted", "derivation", "pairs_executed",
                   "pairs_useful"]] = ["attention", 0.0, 0.0, None, STEP, 0.0, 0.0]
    out.loc[ridx, "shape"] = "counted in this layer's first attention instance of the step"


# ---------------------------------------------------------------------- elementwise & co.
def _io(flops: float, reads: Sequence[_Arg], out_numel: float, out_b: float, kind: str,
        dtype: str, extra_read_bytes: float = 0.0) -> Cost:
    """Read every tensor in `reads` once (its distinct elements), write `out_numel` elements of
    `out_b` bytes."""
    nbytes = sum(formulas.elementwise_bytes(r.distinct, 0, r.b) for r in reads)
    nbytes += formulas.elementwise_bytes(0, out_numel, out_b) + extra_read_bytes
    shape = " ".join(str(r.dims) for r in reads) + f" -> {int(out_numel)}"
    return Cost(kind, float(flops), float(nbytes), dtype, shape)


def _view(c: _Call) -> Cost:
    """Views and allocations: no data moves."""
    ts = _tensors(c.args)
    return Cost("view", 0.0, 0.0, ts[0].dtype if ts else None, "view (no data moved)")


def _pointwise(c: _Call) -> Cost:
    """`_POINTWISE_FLOPS` per output element; out = the inputs' broadcast (in place: the first)."""
    op, ts = c.plain, _tensors(c.args)
    if not ts:
        return Cost(uncosted=f"aten::{op}: no tensor inputs")
    if c.plain != c.base:  # in place
        out_numel, out_b = ts[0].numel, ts[0].b
    else:
        out_numel = math.prod(_broadcast(*(t.dims for t in ts)))
        # Type promotion, roughly: the widest dtype among the non-0-d tensors wins.
        ranked = [t for t in ts if t.dims] or ts
        out_b = 1 if op in _COMPARISONS else max(t.b for t in ranked)
    main = max(ts, key=lambda t: t.numel)
    return _io(_POINTWISE_FLOPS[op] * out_numel, ts, out_numel, out_b, "elementwise", main.dtype)


def _norm(c: _Call) -> Cost:
    """`_NORMS` FLOPs per element of the first tensor; reads every tensor, writes the first's size."""
    ts = _tensors(c.args, 1)
    x = ts[0]
    return _io(_NORMS[c.plain] * x.numel, ts, x.numel, x.b, "norm", x.dtype)


def _softmax(c: _Call) -> Cost:
    """5 FLOPs per element (max, subtract, exp, sum, divide)."""
    x = _tensors(c.args, 1)[0]
    return _io(x.numel * 5.0, [x], x.numel, x.b, "elementwise", x.dtype)


def _reduction(c: _Call) -> Cost:
    """1 FLOP per input element; the last dim reduced unless Concrete Inputs give the dims."""
    x, args = _tensors(c.args, 1)[0], c.args
    reduced = x.dims[-1:] if x.dims else []
    spec = args[1].concrete if len(args) > 1 else ""
    if spec.startswith("["):
        axes = [_int(v, "reduction dim") for v in spec.strip("[]").split(",") if v.strip()]
        if any(not -len(x.dims) <= a < len(x.dims) for a in axes):
            raise Malformed(f"reduction dims {axes} out of range for {x.dims}")
        reduced = [x.dims[a] for a in axes] if axes else x.dims
    out = x.numel / max(math.prod(reduced), 1)
    return _io(x.numel, [x], out, x.b, "reduction", x.dtype)


def _copy(c: _Call) -> Cost:
    """fill_/zero_ write; copy_(dst, src) reads src, writes dst; clone/_to_copy/to read and write
    (out dtype from Concrete Inputs when recorded)."""
    if c.base in ("fill_", "zero_"):
        x = _tensors(c.args, 1)[0]
        return _io(0.0, [], x.numel, x.b, "copy", x.dtype)
    if c.base == "copy_":  # src may broadcast
        dst, src = _tensors(c.args, 2)[:2]
        return _io(0.0, [src], dst.numel, dst.b, "copy", dst.dtype)
    x = _tensors(c.args, 1)[0]
    # _to_copy(self, dtype, ...), to(self, [device,] dtype, ...): the dtype, when recorded.
    out = next(filter(None, (dtypes.by_scalar_type(a.concrete) for a in c.args[1:3])), None)
    return _io(0.0, [x], x.numel, out.bytes if out else x.b, "copy", out.short if out else x.dtype)


def _cat(c: _Call) -> Cost:
    """cat(tensors, dim): the list's dims are nested; its dtype is not recorded (`fallback`)."""
    first = c.args[0] if c.args else None
    if first is None or first.type != "TensorList" or c.fallback is None:
        return Cost(uncosted="aten::cat: tensor-list dtype unknown")
    n = sum(math.prod(d) for d in first.dims)
    b = _known(c.fallback).bytes
    shape = f"{len(first.dims)} tensors -> {n}"
    return Cost("copy", 0.0, formulas.elementwise_bytes(n, n, b), c.fallback, shape)


def _index_write(c: _Call) -> Cost:
    """index_copy_(self, dim, index, source) / index_put_(self, indices, values): only the
    written slots of `self` move."""
    ts = _tensors(c.args, 2)
    dst, src = ts[0], ts[-1]
    index_bytes = sum(formulas.elementwise_bytes(t.distinct, 0, t.b) for t in ts[1:-1])
    flops = float(src.numel) if c.plain == "index_add" else 0.0
    return _io(flops, [src], src.numel, dst.b, "copy", dst.dtype, index_bytes)


def _gather(c: _Call) -> Cost:
    """embedding(weight, ids) / index_select(self, dim, index) / gather(self, dim, index): read
    and write the chosen elements, plus the indices (their distinct elements: HF's gather passes
    a [T, H] index expanded from T ids)."""
    table, index = _tensors(c.args, 2)[:2]
    if c.base == "embedding":
        rows = index.numel * (table.dims[-1] if table.dims else 1)
    elif c.base == "gather":
        rows = index.numel
    else:
        dim = _int(c.args[1].concrete or "0", "index_select dim")
        if not -len(table.dims) <= dim < len(table.dims):
            raise Malformed(f"index_select dim {dim} out of range for {table.dims}")
        rest = [d for i, d in enumerate(table.dims) if i != dim % len(table.dims)]
        rows = math.prod(rest) * index.numel
    nbytes = formulas.elementwise_bytes(rows, rows, table.b)
    nbytes += formulas.elementwise_bytes(index.distinct, 0, index.b)
    return Cost("copy", 0.0, nbytes, table.dtype, f"{table.dims}[{index.dims}] -> {rows}")


def _sort(c: _Call) -> Cost:
    """sort / argsort(x): reads x, writes the sorted values and their int64 indices (argsort
    only the indices); no FLOPs counted (comparisons, not arithmetic)."""
    x = _tensors(c.args, 1)[0]
    out = x.numel * (8 + (0 if c.plain == "argsort" else x.b))
    return Cost("copy", 0.0, float(formulas.elementwise_bytes(x.numel, 0, x.b) + out), x.dtype,
                f"{x.dims} sorted")


def _scan(c: _Call) -> Cost:
    """cumsum(x, dim, dtype?): one add per element, output in `dtype` when recorded."""
    x = _tensors(c.args, 1)[0]
    out = dtypes.by_scalar_type(c.args[2].concrete) if len(c.args) > 2 else None
    return _io(float(x.numel), [x], x.numel, out.bytes if out else x.b, "reduction",
               x.dtype)


def _histc(c: _Call) -> Cost:
    """histc(x, bins, min, max): reads x, writes `bins` counts; one increment per element."""
    x = _tensors(c.args, 1)[0]
    bins = _int(c.args[1].concrete, "histc bins") if len(c.args) > 1 else 100
    return _io(float(x.numel), [x], bins, x.b, "reduction", x.dtype)


def _nonzero(c: _Call) -> Cost:
    """nonzero(x): one comparison per element read; its data-dependent output (count x rank
    int64 indices) is not counted, so the bytes are the input only."""
    x = _tensors(c.args, 1)[0]
    return _io(float(x.numel), [x], 0, 8, "reduction", x.dtype)


def _scalar_read(c: _Call) -> Cost:
    """_local_scalar_dense (`.item()`): one element copied to the host."""
    x = _tensors(c.args, 1)[0]
    return _io(0.0, [x], 1, x.b, "copy", x.dtype)


def _arange(c: _Call) -> Cost:
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
    nbytes = formulas.elementwise_bytes(0, n, _known(short).bytes)
    return Cost("copy", 0.0, nbytes, short, f"arange -> {n}")


def _fused(c: _Call) -> Cost:
    """A Triton kernel's cpu op lists every buffer it touches (inputs and outputs), whole (an
    Inductor grouped-GEMM template is costed as the `_grouped_mm` it runs, a flex attention
    template as the attention it runs: `_flex_attention`).

    Each buffer counts its distinct elements, at most the kernel's work size W (`_work`). A
    table it gathers from (`_gathered`) reads only the indexed rows. A generic estimate
    (derivation `kernel`) except a fused weight GEMM's 2·M·K·N.
    """
    name, ts = c.base, _tensors(c.args)
    grouped = kernels.grouped_gemm([t.dims for t in ts]) if kernels.INDUCTOR_GROUPED_MM.match(
        name) else None
    if grouped is not None:  # the experts' grouped GEMM, as _grouped_mm
        s, k, n, e = grouped
        return _experts_gemm(s, k, n, e, ts[0], next(t for t in ts if len(t.dims) == 3),
                             " (Inductor template)")
    if _FLEX.search(name) and "backward" not in name:
        return _flex_attention(c, ts)
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
        return Cost("fused", flops, float(nbytes), main.dtype, shape, derivation=KERNEL)
    # a fused weight GEMM: its 2·M·K·N (the fused pointwise work is less), and its M, K, N
    return Cost("fused", formulas.gemm_flops(gemm.m, gemm.k, gemm.n), float(nbytes), main.dtype,
                f"GEMM {gemm.m}x{gemm.k}x{gemm.n} fused: {shape}", m=gemm.m, k=gemm.k, n=gemm.n)


_FLEX = kernels.BY_FAMILY["inductor_flex_attention"].pattern
_INDEX_DTYPES = ("int64", "int32")


def _flex_attention(c: _Call, ts: list[_Arg]) -> Cost:
    """Inductor's flex attention template (triton_tem_fused_flex_attention_0: Q [B,n_q,T,d],
    K [B,n_kv,S,d], V [B,n_kv,S,d_v], then the logsumexp, the block mask and the output) as
    the attention it runs (`_attention_cost`). Its mask is a Python function and its block
    mask's values are not recorded: causal in a decoder, every pair in an encoder
    (`_Call.decoder`), derivation `layout`, said in the shape. Block-sparse skipping is not
    modelled: a sliding window's or a document mask's FLOPs are the upper bound."""
    four = [t for t in ts if len(t.dims) == 4]
    if len(four) < 3:
        return Cost(uncosted=f"{c.name}: flex attention without Q, K, V [B, heads, T, d]")
    q, k, v = four[:3]
    (batch, n_q, t, d), (_, n_kv, s, _) = q.dims, k.dims
    return _attention_cost(c, q, (batch, n_q, n_kv, t, s, d), "", v.dims[-1])


def _gathered(name: str, ts: list[_Arg]) -> list[_Arg]:
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
    if not (out or "embedding" in name.split("_")):
        return ts
    gathered = _Arg([rows, width], table.type, table.concrete)
    return [gathered if t is table else t for t in ts]


def _work(name: str, args: list[_Arg], tensors: list[_Arg]) -> int | None:
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


# --------------------------------------------------------------------------- collectives
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


def _group_size(c: _Call) -> int | None:
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


def _collective(c: _Call) -> Cost:
    """S x bus factor bytes, 0 FLOPs (see docs/design.md and operators.py); a copy
    inside a collective op (a symmetric-memory all-reduce's copy-in and copy-out) is part of
    that one collective: 0 bytes of its own, so the message is counted once."""
    op = operators.BY_NAME[cast(str, c.operator)]  # a collective's call names its operator
    if _plain(c.base) in _COLLECTIVE_COPIES or c.base in _COLLECTIVE_COPIES:
        return Cost(_COMMUNICATION, 0.0, 0.0, None,
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
        numel = _tensor(c.args, at).numel
        dt = dtypes.lookup(x.type)
    if dt is None:
        return Cost(uncosted=f"{c.name} ({op.name}): message dtype unknown")
    message = numel * dt.bytes * (t if op.gathers else 1)
    bus = cast("Callable[[int], float]", op.bus_factor)(t)  # every collective has one
    shape = f"{numel}x{dt.short} over {t} ranks: S {message} B x bus {bus:.3g}"
    return Cost(_COMMUNICATION, 0.0, float(message * bus), dt.short, shape)


# ------------------------------------------------------------ training: backward, optimizer
_ADAM_FLOPS = 12.0  # per parameter: decay 2, exp_avg 2, exp_avg_sq 3, sqrt, divide, eps, update 2
_BACKWARD_FLOPS = {"silu_backward": 5.0, "gelu_backward": 10.0, "threshold_backward": 1.0,
                   "sigmoid_backward": 2.0, "tanh_backward": 2.0,
                   "_softmax_backward_data": 3.0, "_log_softmax_backward_data": 3.0}


def _foreach(c: _Call) -> Cost:
    """An optimizer's `_foreach_<op>` over tensor lists (their dtype: `c.fallback`): `<op>`'s
    FLOPs per element of the first list; every tensor list (and tensor) read once, the first
    list's elements written (in place, or a new list of its size)."""
    lists = [a for a in c.args if a.type == "TensorList"]
    if not lists or c.fallback is None:
        return Cost(uncosted=f"{c.name}: tensor lists of unknown dtype")
    b = _known(c.fallback).bytes
    sizes = [sum(math.prod(d) for d in a.dims) for a in lists]
    reads = sum(sizes) * b + sum(t.numel * t.b for t in _tensors(c.args))
    op = _plain(c.base.removeprefix("_foreach_"))
    flops = _POINTWISE_FLOPS.get(op, 1.0) * sizes[0]
    return Cost("elementwise", float(flops), float(reads + sizes[0] * b), c.fallback,
                f"{len(lists[0].dims)} tensors, {sizes[0]} elements x {len(lists)} list(s)")


def _fused_adam(c: _Call) -> Cost:
    """A fused Adam/AdamW step (`_fused_adam(w)_`: params, grads, exp_avgs, exp_avg_sqs, ...):
    per parameter element param, grad, exp_avg and exp_avg_sq read, param, exp_avg and
    exp_avg_sq written (7 accesses), `_ADAM_FLOPS` FLOPs."""
    lists = [a for a in c.args if a.type == "TensorList"]
    if len(lists) < 4 or c.fallback is None:
        return Cost(uncosted=f"{c.name}: params, grads and states not recorded as tensor lists")
    p = sum(math.prod(d) for d in lists[0].dims)
    b = _known(c.fallback).bytes
    return Cost("elementwise", _ADAM_FLOPS * p, float(7 * p * b), c.fallback,
                f"{len(lists[0].dims)} params, {p} elements: 4 read, 3 written")


def _backward_pointwise(c: _Call) -> Cost:
    """An activation's or softmax's backward (grad_out, saved input or output, ...):
    `_BACKWARD_FLOPS` per element of the first tensor; the tensors read, its size written."""
    ts = _tensors(c.args, 2)
    g = ts[0]
    return _io(_BACKWARD_FLOPS[c.plain] * g.numel, ts, g.numel, g.b, "elementwise", g.dtype)


def _nll_loss(c: _Call) -> Cost:
    """nll_loss_forward(input [N, C], target [N], ...): one log-probability gathered per target
    and summed (N FLOPs; N elements and the targets read). nll_loss_backward(grad, input
    [N, C], target [N], ...): the [N, C] gradient written (zeros but one per row), targets read."""
    backward = c.plain == "nll_loss_backward"
    x, target = _tensor(c.args, 1 if backward else 0), _tensor(c.args, 2 if backward else 1)
    rows = target.numel
    if backward:
        return _io(float(rows), [target], x.numel, x.b, "elementwise", x.dtype)
    return Cost("reduction", float(rows), float(rows * x.b + target.numel * target.b + x.b),
                x.dtype, f"{x.dims} at {target.dims} -> 1")


def _embedding_backward(c: _Call) -> Cost:
    """embedding_dense_backward(grad [.., H], indices [..], num_weights, ...): each gradient row
    added into the row of its index: grad and indices read, the rows touched written (at most
    num_weights), one add per element."""
    g, idx = _tensor(c.args, 0, min_rank=1), _tensor(c.args, 1)
    h = g.dims[-1]
    return _io(float(g.numel), [g, idx], min(idx.numel, _int(c.args[2].concrete, "num_weights"))
               * h, g.b, "elementwise", g.dtype)


# ------------------------------------------------------------------------- the registry
# aten ops by base name (an in-place `op_` also finds `op`'s rule), as (names, rule) pairs.
_ATEN_RULES: tuple[tuple[Iterable[str], Rule], ...] = (
    (("mm",), _mm),
    (("addmm", "_addmm_activation"), _addmm),
    (("linear",), _linear),
    (("bmm",), _bmm),
    (("baddbmm",), _baddbmm),
    (("matmul",), _matmul),
    (("_scaled_mm",), _scaled_mm),
    (_VIEWS, _view),
    (("copy_", "fill_", "zero_", *_COPIES), _copy),
    (("cat", "stack", "concat"), _cat),
    (("index_copy", "index_put", "index_add", "_index_put_impl", "scatter"), _index_write),
    (("embedding", "index_select", "gather"), _gather),
    (("arange",), _arange),
    (("_grouped_mm",), _grouped_mm),
    (("topk",), _topk),
    (("sort", "argsort"), _sort),
    (("cumsum",), _scan),
    (("histc",), _histc),
    (("_local_scalar_dense",), _scalar_read),
    (("nonzero",), _nonzero),
    (_NORMS, _norm),
    (_SOFTMAX, _softmax),
    (_REDUCTIONS, _reduction),
    (_POINTWISE_FLOPS, _pointwise),
    (_BACKWARD_FLOPS, _backward_pointwise),
    (("_fused_adam", "_fused_adamw"), _fused_adam),
    (("nll_loss_forward", "nll_loss_backward"), _nll_loss),
    (("embedding_dense_backward",), _embedding_backward),
)
# Rules an operator of the vocabulary names for every op it recognises (operators.cost_rule).
_OPERATOR_RULES: dict[str, Rule] = {"attention": _attention, "topk_softmax": _topk_softmax,
                                    "moe_align": _moe_align, "fused_experts": _fused_experts,
                                    "moe_sum": _moe_sum}
# An engine's own kernels outside aten (vLLM's `_C::`, SGLang's `sgl_kernel::`), by base name.
ENGINE_RULES: dict[str, Rule] = {
    **dict.fromkeys(("rms_norm", "rmsnorm"), _engine_rms_norm),
    **dict.fromkeys(("fused_add_rms_norm", "fused_add_rmsnorm"), _fused_add_rms_norm),
    "rotary_embedding": _rotary_embedding,
    "apply_rope_pos_ids_cos_sin_cache": _apply_rope_cos_sin_cache,
    **dict.fromkeys(("silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul"), _act_and_mul),
    **dict.fromkeys(("reshape_and_cache", "reshape_and_cache_flash"), _reshape_and_cache),
    "concat_and_cache_mla": _concat_and_cache_mla,
    "store_kv_cache": _store_kv_cache,
    # by full name where a library's op of the same base name takes other arguments
    "aiter::rms_norm": _aiter_rms_norm,
    **dict.fromkeys(("aiter::add_rmsnorm", "aiter::rmsnorm2d_fwd_with_add",
                     "aiter::rmsnorm2d_fwd_with_add_ck"), _add_rms_norm_out),
    "sglang::store_cache": _store_cache,
    "TopK": _triton_topk,  # triton_kernels' routing, as vLLM records it (no namespace)
    "SortTokens": _triton_sort_tokens,
}


def _index(pairs: tuple[tuple[Iterable[str], Rule], ...]) -> dict[str, Rule]:
    out: dict[str, Rule] = {}
    for names, rule in pairs:
        for name in names:
            if name in out:
                raise ValueError(f"cost rule for {name!r} registered twice")
            out[name] = rule
    return out


ATEN_RULES = _index(_ATEN_RULES)


def rule_for(op_name: str) -> Rule | None:
    """The cost rule of a cpu op, first that applies: its operator's (every attention op),
    torch.compile's Triton kernels' (`triton_*`), an aten op's by base name, an engine's
    own op's by base name (`ENGINE_RULES`), else None."""
    by_operator = operators.cost_rule(op_name)
    if by_operator is not None:
        return _OPERATOR_RULES[by_operator]
    base = op_name.removeprefix("aten::")
    if base.startswith("triton_"):
        return _fused
    if base.startswith("_foreach_"):
        return _foreach
    if not op_name.startswith("aten::"):
        return ENGINE_RULES.get(op_name) or ENGINE_RULES.get(op_name.rsplit("::", 1)[-1])
    return ATEN_RULES.get(base) or ATEN_RULES.get(_plain(base))


# ------------------------------------------------------------- MoE layers: active experts
_LOOP_GEMMS = {"linear", "mm", "addmm", "matmul"}  # one 2-D expert weight per GEMM


# the router's logits GEMM: its own, or fused by Inductor with the norm before it
ROUTER_KINDS = ("gemm", "fused")


def _moe_layers(out: pd.DataFrame, inst: pd.DataFrame, model: ModelSpec | None) -> pd.DataFrame:
    """Per MoE block (from one router logits GEMM to the next, in time order): its tokens T
    (the router GEMM's M), experts E (its N, else the expert ops'), top-k (the model's, else
    the router's `topk` argument or the fused op's top-k ids, else ΣM_e / T) and active
    experts A (moe.active_experts: counted in a loop form, else the uniform-routing
    expectation; without T or k, the upper bound min(E, ΣM_e)), then
    - ops over all experts' weights (`_grouped_mm`, fused): bytes += A x one expert's weights;
    - batched_mm's weight gathers (`index` of [E, N, K]): A experts' weights read, S copies
      written (S the bmm batch), S int64 indices;
    - other `index` gathers of a block (unrecorded indices): the rows of the expert GEMM they
      feed (dispatch) or follow (combine);
    and `experts_active[_low|_high]` once per block and operator on the expert GEMM (or
    gather) rows. `out` and `inst` are attach_costs' tables, row for row; the temporary
    columns `experts`, `expert_bytes` go. Shapes are decoded once per distinct value."""
    nan = np.full(len(out), np.nan)
    out = out.assign(experts_active=nan, experts_active_low=nan, experts_active_high=nan)
    op = out["operator"]
    if not (op.isin(operators.MOE).any() or out["experts"].notna().any()):
        return out.drop(columns=["experts", "expert_bytes"])
    base = pd.Series(_each_distinct(out["op_name"], lambda n: n.rsplit("::", 1)[-1]
                                    if isinstance(n, str) else ""), index=out.index)
    first = _each_distinct(inst["input_types"], _first_dtype)
    out["dtype"] = out["dtype"].fillna(pd.Series(first, index=out.index, dtype="str"))
    logits = (op.eq("router") & out["cost_kind"].isin(ROUTER_KINDS)
              & out["N"].gt(1)).to_numpy(bool, na_value=False)
    block = pd.Series(np.cumsum(logits), index=out.index)
    blocks = _moe_blocks(out, inst, model, base, block, logits)
    tokens, experts, top_k = (block.map(blocks[c]).to_numpy() for c in ("T", "E", "k"))
    expected, low, high = _active(experts, top_k, tokens)
    all_weights = out["experts"].notna().to_numpy()
    rows = out["M"].to_numpy(np.float64, na_value=np.nan)
    upper = np.fmin(out["experts"].to_numpy(np.float64, na_value=np.nan), rows)
    expected = np.where(all_weights & np.isnan(expected), upper, expected)
    high = np.where(all_weights & np.isnan(high), upper, high)
    out.loc[all_weights, "bytes"] += (expected[all_weights]
                                      * out.loc[all_weights, "expert_bytes"].to_numpy())
    expert_op = op.isin(["experts_gate_up", "experts_down"]).to_numpy()
    gather = expert_op & (base == "index").to_numpy() & out["flops"].isna().to_numpy()
    out = _weight_gathers(out, inst, gather, expected, block, base)
    once = ~pd.DataFrame({"b": block, "o": op}).duplicated().to_numpy()
    spread = (all_weights | gather) & once
    out.loc[spread, "experts_active"] = expected[spread]
    out.loc[spread, "experts_active_low"] = low[spread]
    out.loc[spread, "experts_active_high"] = high[spread]
    gemm = out["cost_kind"].eq("gemm").to_numpy()
    loop = expert_op & gemm & base.isin(_LOOP_GEMMS).to_numpy() & ~all_weights
    counted = pd.Series(loop & op.eq("experts_down").to_numpy()).groupby(block.to_numpy())
    counted = counted.transform("sum").to_numpy(np.float64)
    for col in ("experts_active", "experts_active_low", "experts_active_high"):
        out.loc[loop & once, col] = counted[loop & once]
    out = _block_gathers(out, inst, op.isin(["moe_dispatch", "moe_combine"]).to_numpy(), base,
                         block)
    return out.drop(columns=["experts", "expert_bytes"])


def _first_dtype(raw: object) -> str | None:
    """Short dtype of an op's first argument from its raw Input type JSON."""
    types = decode_args(raw) if isinstance(raw, str) else None
    d = dtypes.lookup(str(types[0])) if types else None
    return d.short if d else None


def _moe_blocks(out: pd.DataFrame, inst: pd.DataFrame, model: ModelSpec | None,
                base: pd.Series, block: pd.Series, logits: np.ndarray) -> pd.DataFrame:
    """T, E, k per block (NaN where the trace does not tell)."""
    router = out[logits].assign(block=block[logits])
    per = router.groupby("block").agg(T=("M", "max"), E=("N", "max")).astype("float64")
    per = per.reindex(pd.RangeIndex(int(block.max()) + 1))
    per["E"] = per["E"].fillna(out["experts"].groupby(block).max().astype("float64"))
    if model is not None and model.experts is not None:
        per["k"] = float(model.experts.top_k)
        return per
    topk = (base == "topk").to_numpy()
    k_arg = _each_distinct(inst["concrete_inputs"], lambda raw: _concrete_at(raw, 1))
    fused = out["experts"].notna().to_numpy() & _fused_experts_ops(inst["op_name"])
    k_ids = _each_distinct(inst["input_dims"], lambda raw: _dims_at(raw, 4, 1))
    # numpy's stubs leave None out of ArrayLike; np.where takes it (an object element)
    ks = pd.Series(np.where(topk, k_arg, np.where(fused, k_ids, None)),  # type: ignore[call-overload]
                   dtype="float64")
    per["k"] = ks.groupby(block.to_numpy()).max()
    rows = out.loc[out["experts"].notna(), "M"].groupby(block).max().astype("float64")
    per["k"] = per["k"].fillna((rows / per["T"]).round())
    return per


def _concrete_at(raw: object, arg: int) -> float:
    """Concrete Inputs[arg] of a raw JSON text as a number (NaN when absent or not one)."""
    values = decode_args(raw) if isinstance(raw, str) else None
    return _num(values[arg]) if values and len(values) > arg else np.nan


def _dims_at(raw: object, arg: int, dim: int | None) -> float:
    """Input Dims[arg][dim] (dim None: the product of Input Dims[arg]) of a raw JSON text."""
    d = decode_args(raw) if isinstance(raw, str) else None
    if not d or len(d) <= arg or not isinstance(d[arg], list) or not d[arg]:
        return np.nan
    shape = d[arg]
    if not all(type(v) is int for v in shape):  # a tensor list
        return np.nan
    if dim is None:
        return float(math.prod(shape))
    return float(shape[dim]) if -len(shape) <= dim < len(shape) else np.nan


def _fused_experts_ops(op_names: pd.Series) -> np.ndarray:
    """Per row, whether its op is an engine's fused MoE op (operators.FUSED_EXPERTS)."""
    return _each_distinct(op_names, lambda n: isinstance(n, str)
                          and operators.cost_rule(n) == "fused_experts").astype(bool)


def _each_distinct(values: pd.Series, fn) -> np.ndarray:
    """fn of each row's value, evaluated once per distinct value (an object array)."""
    codes, uniques = frames.factorized(values)
    return np.asarray([fn(u) for u in uniques] + [fn(None)], dtype=object)[codes]


def _num(text: object) -> float:
    try:
        return float(text)  # type: ignore[arg-type]  # any object: what float() refuses is NaN
    except (TypeError, ValueError):
        return np.nan


def _active(experts: np.ndarray, top_k: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, ...]:
    """moe.active_experts over arrays: expectation E·(1 - (1 - k/E)^T), range [min(k, E),
    min(E, T·k)]; NaN where E, k or T is unknown."""
    e, k, t = (np.asarray(v, dtype=np.float64) for v in (experts, top_k, tokens))
    ok = (e >= 1) & (k >= 1) & (k <= e) & (t >= 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        expected = np.where(k >= e, e, -e * np.expm1(t * np.log1p(-k / e)))
    return (np.where(ok, expected, np.nan), np.where(ok, np.minimum(k, e), np.nan),
            np.where(ok, np.minimum(e, t * k), np.nan))


def _element_bytes(short: pd.Series) -> np.ndarray:
    """Bytes per element of each row's short dtype (NaN where unknown)."""
    sizes = {v: d.bytes for v in short.dropna().unique() if (d := dtypes.lookup(v))}
    return short.map(sizes).to_numpy(np.float64)


def _set_copy(out: pd.DataFrame, ok: np.ndarray, nbytes: np.ndarray) -> pd.DataFrame:
    """Cost the `ok` rows as data movement of `nbytes`."""
    out.loc[ok, "flops"] = 0.0
    out.loc[ok, "bytes"] = nbytes[ok]
    out.loc[ok, "cost_kind"] = "copy"
    out.loc[ok, "uncosted"] = None
    return out


def _weight_gathers(out: pd.DataFrame, inst: pd.DataFrame, gather: np.ndarray,
                    expected: np.ndarray, block: pd.Series, base: pd.Series) -> pd.DataFrame:
    """batched_mm's `index` gathers of the [E, N, K] expert weights: A experts' weights read,
    S copies written, S int64 indices; S = the batch of the bmm of the same operator in the
    block."""
    if not gather.any():
        return out
    bmm = (base == "bmm").to_numpy()
    batch = np.where(bmm, _each_distinct(inst["input_dims"], lambda r: _dims_at(r, 0, 0)),
                     np.nan).astype(np.float64)
    key = pd.DataFrame({"b": block, "o": out["operator"].astype("object")})
    s = pd.Series(batch).groupby([key["b"].to_numpy(), key["o"].to_numpy()]).transform("max")
    numel = _each_distinct(inst["input_dims"], lambda r: _dims_at(r, 0, None)).astype(np.float64)
    experts = _each_distinct(inst["input_dims"], lambda r: _dims_at(r, 0, 0)).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):  # a 0-dim: NaN, left uncosted
        size = numel / experts  # one expert's weight elements
    nbytes = (expected + s.to_numpy()) * size * _element_bytes(out["dtype"]) + s.to_numpy() * 8
    return _set_copy(out, gather & np.isfinite(nbytes), nbytes)


def _block_gathers(out: pd.DataFrame, inst: pd.DataFrame, in_block: np.ndarray,
                   base: pd.Series, block: pd.Series) -> pd.DataFrame:
    """Uncosted `index` gathers of the dispatch and combine (their indices are not recorded):
    as many rows as the expert GEMM they feed (the next gate_up) or follow (the last down)
    moves: those rows (of the input's row width; one element per row of a [.., 1] input) read
    (at most the input) and written, plus an int64 index per row."""
    todo = in_block & (base == "index").to_numpy() & out["flops"].isna().to_numpy()
    if not todo.any():
        return out
    op = out["operator"].astype("object")
    rows_in = out["M"].where(op.eq("experts_gate_up") & out["cost_kind"].eq("gemm"))
    rows_out = out["M"].where(op.eq("experts_down") & out["cost_kind"].eq("gemm"))
    feeds = rows_in.astype("float64").groupby(block).bfill().to_numpy()
    follows = rows_out.astype("float64").groupby(block).ffill().to_numpy()
    rows = np.where(op.eq("moe_dispatch").to_numpy(), feeds, follows)
    numel = _each_distinct(inst["input_dims"], lambda r: _dims_at(r, 0, None)).astype(np.float64)
    lead = _each_distinct(inst["input_dims"], lambda r: _dims_at(r, 0, 0)).astype(np.float64)
    last = _each_distinct(inst["input_dims"], lambda r: _dims_at(r, 0, -1)).astype(np.float64)
    # rows of the input's row width; a [.., 1] input (HF's routing weights w[tokens, slots,
    # None]) is indexed in every dim but the last: one element per row
    with np.errstate(divide="ignore", invalid="ignore"):  # a 0-dim: NaN, left uncosted
        moved = rows * np.where(last == 1, 1.0, numel / lead)
    nbytes = (np.fmin(moved, numel) + moved) * _element_bytes(out["dtype"]) + rows * 8
    ok = todo & np.isfinite(nbytes)
    out = _set_copy(out, ok, nbytes)
    out.loc[ok, "shape"] = ("gather of " + pd.Series(rows[ok]).astype(int).astype(str)
                            + " rows").to_numpy()
    return out


# ---------------------------------------------------------------------- phase and checks
def _phases(out: pd.DataFrame) -> pd.Series:
    """decode|prefill per step from its attention instances (T == 1 -> decode)."""
    step = out["step"].fillna(-1)
    attn = out["T"].notna()
    if not attn.any():
        return pd.Series("unknown", index=out.index, dtype="str")
    per_step = out.loc[attn, "T"].groupby(step[attn]).max()
    label = pd.Series(np.where(per_step.to_numpy() == 1, "decode", "prefill"), per_step.index)
    whole = label.iloc[0] if label.nunique() == 1 else "unknown"
    return step.map(label).fillna(whole).astype("str")


# ------------------------------------------------------------------ model-level operators
def model_level_costs(model: ModelSpec, tokens: int, sequences: int) -> pd.DataFrame:
    """Costs of the operators outside the decoder layers, from the model's shapes, by the same
    rules as traced ops: embedding (gather `tokens` rows of the table), final_norm (an RMSNorm
    over tokens x hidden) and lm_head (logits for the last position of each of `sequences`
    sequences, as HF generate and vLLM compute them). Columns operator, dtype, flops, bytes, shape.
    """
    dt = dtypes.lookup(model.dtype)
    if dt is None:
        raise InputError(f"model {model.name}: unknown dtype {model.dtype!r}")
    ttype = dt.name
    h, v = model.hidden_size, model.vocab_size
    def call(name: str, *args: _Arg) -> _Call:
        return _Call(name, list(args), "causal", "all", None)

    rows = {
        "embedding": _gather(call("aten::embedding", _Arg([v, h], ttype, ""),
                                  _Arg([tokens], "long int", ""))),
        "final_norm": _norm(call("aten::rms_norm", _Arg([tokens, h], ttype, ""),
                                 _Arg([h], ttype, ""))),
        "lm_head": _gemm(sequences, h, v, _Arg([sequences, h], ttype, "")),
    }
    return _cost_frame(list(rows.items()))


def _cost_frame(rows: list[tuple[str, Cost]]) -> pd.DataFrame:
    """Costs as rows (operator, dtype, flops, bytes, shape); an operator may recur."""
    return pd.DataFrame({
        "operator": [o for o, _ in rows], "dtype": [c.dtype for _, c in rows],
        "flops": [c.flops for _, c in rows], "bytes": [c.bytes for _, c in rows],
        "shape": [c.shape for _, c in rows],
    })


def mlp_costs(model: ModelSpec, tokens: int, sparse: bool) -> pd.DataFrame:
    """One layer's MLP from the model's shapes for `tokens` tokens, by the traced ops' rules:
    dense, gate and up [T,H]x[H,I], down [T,I]x[I,H] and act (HF's silu then mul on [T, I]);
    sparse (the model's experts), the router [T,H]x[H,E], the routed experts' gate_up and down
    (moe.py: ΣM_e = T·k rows, the expected active experts' weights), their act on [ΣM_e, I],
    and the shared expert (its projections, act and sigmoid gate H -> 1, `router`) when there is
    one. The token permutation and combine (engine-specific) are not included. Columns as
    `model_level_costs`."""
    dt = dtypes.lookup(model.dtype)
    if dt is None:
        raise InputError(f"model {model.name}: unknown dtype {model.dtype!r}")
    h, ttype = model.hidden_size, dt.name

    def call(name: str, *args: _Arg) -> _Call:
        return _Call(name, list(args), "causal", "all", None)

    def act(rows: int, inter: int) -> list[Cost]:
        x = _Arg([rows, inter], ttype, "")
        return [_pointwise(call("aten::silu", x)), _pointwise(call("aten::mul", x, x))]

    def swiglu(prefix: str, rows: int, inter: int, act_name: str) -> list[tuple[str, Cost]]:
        x = _Arg([rows, h], ttype, "")
        return [(f"{prefix}gate_proj", _gemm(rows, h, inter, x)),
                (f"{prefix}up_proj", _gemm(rows, h, inter, x)),
                *[(act_name, c) for c in act(rows, inter)],
                (f"{prefix}down_proj", _gemm(rows, inter, h, _Arg([rows, inter], ttype, "")))]

    e = model.experts
    if not sparse or e is None:
        return _cost_frame(swiglu("", tokens, model.intermediate_size, "act"))
    rows = moe.routed_rows(tokens, e.top_k)
    i, b = e.intermediate_size, dt.bytes
    active = moe.expected_active_experts(e.num_experts, e.top_k, tokens)
    out = [("router", _gemm(tokens, h, e.num_experts, _Arg([tokens, h], ttype, ""))),
           ("experts_gate_up", Cost("gemm", moe.gate_up_flops(rows, h, i),
                                    moe.gate_up_bytes(rows, h, i, active, b), dt.short,
                                    f"{e.num_experts} experts [{rows},{h}]x[{h},{2 * i}]")),
           *[("experts_act", c) for c in act(rows, i)],
           ("experts_down", Cost("gemm", moe.down_flops(rows, h, i),
                                 moe.down_bytes(rows, h, i, active, b), dt.short,
                                 f"{e.num_experts} experts [{rows},{i}]x[{i},{h}]"))]
    if e.shared_intermediate_size:
        out += swiglu("shared_", tokens, e.shared_intermediate_size, "act")
    if e.shared_gate:
        out.append(("router", _gemm(tokens, h, 1, _Arg([tokens, h], ttype, ""))))
    return _cost_frame(out)
