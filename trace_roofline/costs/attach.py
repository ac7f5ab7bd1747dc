"""The costs stage's entry point (`attach_costs`): one row per op instance with FLOPs and
minimum DRAM bytes, each distinct op-shape combination costed once by its rule
(registry.rule_for), then the table-wide passes (attention, MoE blocks, the model's checks).

Design notes: docs/design.md ("trace_roofline/costs/").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np
import pandas as pd

from trace_roofline import frames
from trace_roofline.costs import attention, collectives, crosscheck, moe
from trace_roofline.costs.call import UNKNOWN, Call, Cost, Kind, Malformed, args_of
from trace_roofline.costs.registry import rule_for
from trace_roofline.errors import InputError
from trace_roofline.model import dtypes, formulas, operators
from trace_roofline.model.models import ModelSpec
from trace_roofline.model.moe import Experts
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


@dataclass(frozen=True)
class CostOptions:
    """How attach_costs counts. `causal`: "causal" (count unmasked query-key pairs) or "full";
    `attention_bytes`: "all" (Q, K, V read and O written) or "kv" (K and V only);
    `group_size`: the ranks of a collective that does not record its own; `decoder`: the
    trace's verdict (attribution/kind.py, Verdict.decoder): an encoder's attention whose
    causality is not recorded (flex attention's mask, an eager attention's matmuls) counts
    every query-key pair."""

    causal: str = "causal"
    attention_bytes: str = "all"
    group_size: int | None = None
    decoder: bool = True

    def checked(self) -> tuple[formulas.Causal, formulas.AttentionBytes]:
        """The two conventions, InputError unless each is one of formulas.py's."""
        if self.causal not in formulas.CAUSAL_CONVENTIONS:
            raise InputError(f"`causal` must be one of {', '.join(formulas.CAUSAL_CONVENTIONS)}, "
                             f"got {self.causal!r}", "causal")
        if self.attention_bytes not in formulas.ATTENTION_BYTES_CONVENTIONS:
            raise InputError(f"`attention_bytes` must be one of "
                             f"{', '.join(formulas.ATTENTION_BYTES_CONVENTIONS)}, "
                             f"got {self.attention_bytes!r}", "attention_bytes")
        return (cast(formulas.Causal, self.causal),
                cast(formulas.AttentionBytes, self.attention_bytes))


def attach_costs(attributed: pd.DataFrame, model: ModelSpec | None,
                 options: CostOptions | None = None) -> pd.DataFrame:
    """One row per op instance (`COSTED_COLUMNS`) with FLOPs and minimum bytes from its shapes.

    `attributed` is attribute.attribute()'s table (one row per device row, its `instance`
    column naming the op instance); optional `concrete_inputs` and `input_strides` columns (raw
    JSON) supply is_causal, dtype and Triton size arguments, and broadcast (stride-0) dims.
    `options`: the counting conventions (`CostOptions`). Each row's `derivation` says where its
    figures came from. Time is conserved: Σ time_us == Σ dur_us.
    """
    options = options or CostOptions()
    causal, convention = options.checked()
    inst = _keyed(_instances(attributed), attributed)
    context = _Context(causal, convention, _fallback_dtype(model, inst["input_types"]),
                       _ModelFacts.of(model), options)
    out = _costed(inst, context)
    _first_row_only(out)
    # the forward pass's phase (passes.annotate) when the table has it, else per step
    out["phase"] = inst["phase"].fillna("unknown") if "phase" in inst else _phases(out)
    if "serving_step" in inst:
        attention.step_attention(out, inst["serving_step"], model, causal, convention)
    attention.eager_attention(out, causal, options.decoder)
    attention.repeated_kv(out, model)
    out["check"] = crosscheck.instance_checks(out, model)
    out = moe.moe_layers(out, inst, model)
    out["derivation"] = out["derivation"].where(out["flops"].notna(), UNKNOWN)
    return out[list(COSTED_COLUMNS)].astype(COSTED_COLUMNS)


# the columns a cost is keyed by: its op and arguments, and for a collective which one it is
# and its kernel's name (for those rows alone: kernel names are long, hundreds of bytes each),
# for an engine's fused MoE op the part attribute() named (its GEMMs cost apart)
_KEY = ["op_name", "input_dims", "input_types", "concrete_inputs", "input_strides", "_coll",
        "_kernel", "_part"]


def _keyed(inst: pd.DataFrame, attributed: pd.DataFrame) -> pd.DataFrame:
    """`inst` with the key columns beyond the op's arguments: `_coll`, `_kernel`, `_part`."""
    coll = inst["operator"].isin(operators.COMMUNICATION)
    inst["_coll"] = inst["operator"].where(coll, None)
    inst["_kernel"] = pd.Series(pd.NA, index=inst.index, dtype="str")
    if "name" in attributed and coll.any():
        first_rows = inst.loc[coll, "row"].to_numpy()
        inst.loc[coll, "_kernel"] = attributed["name"].take(first_rows).to_numpy()
    inst["_part"] = inst["operator"].where(moe.fused_experts_ops(inst["op_name"]), None)
    return inst


# Cost's fields by output column
_FIELDS = {"cost_kind": "kind", "dtype": "dtype", "flops": "flops", "bytes": "bytes",
           "M": "m", "K": "k", "N": "n", "B": "batch", "T": "t", "S": "s",
           "causal": "causal", "shape": "shape", "uncosted": "uncosted",
           "experts": "experts", "expert_bytes": "expert_bytes", "derivation": "derivation"}


def _costed(inst: pd.DataFrame, context: _Context) -> pd.DataFrame:
    """The instances' columns and their costs: each distinct key (`_KEY`) costed once, its
    figures taken for every instance of it at once."""
    combos, codes = frames.distinct_rows(inst, _KEY)
    table = [_cost(_Combination(*values), context)
             for values in zip(*(_python(combos[c]) for c in _KEY), strict=True)]
    per = pd.DataFrame({col: pd.Series([getattr(c, attr) for c in table],
                                       dtype=COSTED_COLUMNS.get(col, "float64"))
                        for col, attr in _FIELDS.items()})
    for i, col in enumerate(("n_q", "n_kv", "head_dim")):
        per[col] = pd.Series([c.heads[i] if c.heads else None for c in table], dtype="Int64")
    for i, col in enumerate(("pairs_executed", "pairs_useful")):
        per[col] = pd.Series([c.pairs[i] if c.pairs else None for c in table], dtype="float64")
    out = inst[["instance", "op_id", "op_name", "operator", "evidence", "layer", "step",
                "kernels", "ts_us", "time_us"]].reset_index(drop=True)
    return pd.concat([out, per.take(codes).reset_index(drop=True)], axis=1)


def _first_row_only(out: pd.DataFrame) -> None:
    """An op whose kernels were attributed to several rows is costed once, on its first row
    (per operator: a fused MoE op's gate_up and down halves are costed apart); in place."""
    _, first = frames.distinct_codes([pd.factorize(out[c].array)[0]
                                      for c in ("op_id", "operator")])
    repeated = np.ones(len(out), dtype=bool)
    repeated[first] = False
    again = out["op_id"].notna() & repeated & out["flops"].notna()
    out.loc[again, ["flops", "bytes", "expert_bytes", "pairs_executed", "pairs_useful"]] = 0.0


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
    agg = _per_instance(att)
    rows = agg["row"]
    inst = pd.DataFrame({
        "instance": agg["instance"],
        "row": rows,
        "op_id": att["op_id"].astype("Int64").take(rows).to_numpy(),
        "operator": att["operator"].take(rows).array,
        "evidence": (att["evidence"] if "evidence" in att
                     else pd.Series(operators.FALLBACK, index=att.index)).take(rows).array,
        "layer": att["layer"].astype("Int64").take(rows).to_numpy(),
        "step": att["step"].astype("Int64").take(rows).to_numpy(),
        "op_name": att["op_name"].take(rows).array,
        **{c: _taken_categories(att.get(c), rows) for c in _ARGUMENTS},
        "kernels": agg["kernels"],
        "ts_us": agg["ts_us"],
        "time_us": agg["time_us"],
    })
    if "phase" in att:  # the forward pass's phase (passes.annotate)
        inst["phase"] = att["phase"].take(rows).array
    if "serving_step" in att:  # the annotated serving step's sums (attribution/steps.py)
        inst["serving_step"] = att["serving_step"].take(rows).to_numpy()
    return inst


def _per_instance(att: pd.DataFrame) -> dict[str, np.ndarray]:
    """Per instance (rows of a missing instance id left out), in order of first start (ties:
    of first row): its id, first row, kernel count, first start and Σ duration."""
    codes, ids = pd.factorize(att["instance"].to_numpy())
    pos = np.flatnonzero(codes >= 0)
    of = codes[pos]
    first = pos[np.unique(of, return_index=True)[1]]  # codes number ids by first appearance
    start = np.full(len(ids), np.nan)
    np.fmin.at(start, of, att["ts_us"].to_numpy(np.float64)[pos])  # (NaN starts skipped)
    total = pd.Series(att["dur_us"].to_numpy(np.float64)[pos]).groupby(of).sum().to_numpy()
    order = np.argsort(start, kind="stable")
    return {"instance": np.asarray(ids)[order], "row": first[order],
            "kernels": np.bincount(of, minlength=len(ids))[order], "ts_us": start[order],
            "time_us": total[order]}


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
    return [None if pd.isna(v) else v for v in values.tolist()]


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

    experts: Experts | None = None
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


@dataclass(frozen=True)
class _Combination:
    """One distinct key (`_KEY`) as recorded: the op's name, its raw JSON argument columns,
    which collective it is and its first kernel's name, the fused MoE op's part."""

    name: str | None
    dims: str | None
    types: str | None
    concrete: str | None
    strides: str | None
    collective: str | None
    kernel: str | None
    part: str | None


@dataclass(frozen=True)
class _Context:
    """What every combination of one table is costed under."""

    causal: formulas.Causal
    attention_bytes: formulas.AttentionBytes
    fallback: str | None  # short dtype of tensor lists (`_fallback_dtype`)
    facts: _ModelFacts
    options: CostOptions


def _cost(key: _Combination, context: _Context) -> Cost:
    """Cost one unique combination (decodes its JSON once) by its rule (`rule_for`; a
    collective's by collectives.collective; `part`: the half of a fused MoE op attribute()
    named; the model's facts for MoE ops that do not record their shapes)."""
    name = key.name
    if name is None:
        return Cost(uncosted="no linked cpu op")
    dims, types = decode_args(key.dims), decode_args(key.types)
    if dims is None or types is None or len(dims) != len(types):
        return Cost(uncosted=f"{name}: no recorded shapes")
    coll = (_Collective(key.collective, key.kernel, context.options.group_size)
            if key.collective is not None else None)
    rule = collectives.collective if coll is not None else rule_for(name)
    if rule is None:
        return Cost(uncosted=f"no cost rule for {name}")
    extra = {"operator": key.part} if coll is None else {
        "operator": coll.operator, "kernel": coll.kernel, "group_size": coll.group_size}
    facts = context.facts
    try:
        args = args_of(dims, [str(t) for t in types], decode_args(key.concrete) or [],
                       decode_args(key.strides) or [])
        return rule(Call(name, args, context.causal, context.attention_bytes, context.fallback,
                         **extra, experts=facts.experts, hidden=facts.hidden,
                         expert_bits=facts.expert_bits, decoder=context.options.decoder))
    except Malformed as e:
        return Cost(Kind.MALFORMED,
                    uncosted=f"{name}: malformed shape data ({e}) in {key.dims}")


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

