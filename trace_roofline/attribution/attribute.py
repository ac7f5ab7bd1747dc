"""Stage 2: attribute every device microsecond of a trace to a named operator.

Design notes: docs/design.md ("trace_roofline/attribution/attribute.py").
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from trace_roofline.attribution.codes import (
    Coded,
    by_category,
    categorical,
    name_categories,
    strings,
    take,
    take_cat,
    unify,
)
from trace_roofline.attribution.instance_names import TraceOps, collective_names, name_instances
from trace_roofline.attribution.instances import instances, with_weight_shapes
from trace_roofline.attribution.nest import KeySpace
from trace_roofline.attribution.ranges import unit_ranges
from trace_roofline.attribution.tp import gemm_shapes, infer_tp
from trace_roofline.attribution.trace_models import model_shards, models_of
from trace_roofline.attribution.training import training_parts
from trace_roofline.attribution.units import cpu_units, device_units, ops_frame
from trace_roofline.model import kernels, operators
from trace_roofline.model.models import ModelSpec
from trace_roofline.model.operators import Name
from trace_roofline.trace import Trace

# One row per timed unit, in the trace's device-row order (file order of the events).
ATTRIBUTED_COLUMNS = {
    "event_id": "int64",  # trace.device event_id; for CPU-only traces the unit's op_id
    "name": "category",  # kernel name (or cpu op name): a few dozen distinct, hundreds of bytes
    "kind": "str",  # kernel | memcpy | memset | cpu_op
    "stream": "Int64",
    "ts_us": "float64",
    "dur_us": "float64",
    "op_id": "Int64",  # innermost shape-carrying cpu op (trace.cpu_ops.op_id); NA if unlinked
    # the op instance, numbered in order of first unit: one op (op_id) in one step; a unit
    # without an op is an instance of its own. shapes.attach_costs costs each once.
    "instance": "int64",
    "op_name": "str",
    "input_dims": "str",  # raw JSON text of the op's Input Dims (parse with trace.parse_dims)
    "input_types": "str",
    "concrete_inputs": "str",
    "input_strides": "str",  # raw JSON text of the op's Input Strides (0 = broadcast dim)
    "operator": "str",  # canonical operator, `linear[K×N]`, `other` or `unattributed`
    "layer": "Int64",
    "step": "Int64",  # N of the enclosing ProfilerStep#N
    "evidence": "str",  # how the operator was named: one of operators.EVIDENCE
    # why a row is `unattributed`, `other` or `linear[K×N]` (NA where its name has evidence):
    # no op launched it, a gap no layout explains, a GEMM no linear has the shape of, ...
    "reason": "str",
    # the part of a training step (forward | backward | optimizer | recompute: a checkpointed
    # layer's forward run again inside backward); NA in a trace without backward work
    "training": "str",
    # which model ran it, in a trace of several (assisted decoding: `_models`): the --model's
    # name or "hidden H, vocab V"; NA in a trace of one model (and on units no op launched)
    "model": "str",
}
OPERATOR_TABLE_COLUMNS = {
    "step": "Int64",
    "layer": "Int64",
    "operator": "str",
    "kernels": "int64",
    "ops": "int64",  # distinct op instances
    "dur_ps": "int64",  # exact integer picoseconds: these sum to coverage()'s total exactly
    "dur_us": "float64",
    "share": "float64",  # of all device time
    "ts_us": "float64",  # first unit's start
    "evidence": "str",  # the evidence that named most of its time
}

UNATTRIBUTED = operators.UNATTRIBUTED.name
FALLBACK = operators.FALLBACK
_PS_PER_US = 1_000_000
# what an engine's fused MoE op (operators.FUSED_EXPERTS: vLLM's fused_experts, moe_forward)
# runs besides its own name, experts_gate_up: by kernel role, in time order within the op, its
# expert GEMMs alternate w13 (gate_up) and w2 (down); a finalize kernel sums the top-k outputs
_FUSED_PARTS = (Name.EXPERTS_DOWN, Name.MOE_COMBINE)  # part 1, part 2 (0: the op's own name)
_UNLINKED = "no cpu op launched it (no External id, runtime launch or flow links it)"
_BEFORE_WINDOW = ("launched before the profiled window: no launch in the file, its correlation "
                  "id below the first launch's, done before the first linked kernel")
_NAMED = ("operator", "evidence", "layer", "reason")  # what name_instances returns, in order


def attribute(trace: Trace, model: ModelSpec | None = None) -> pd.DataFrame:
    """One row per timed unit with its operator, layer, step and evidence (ATTRIBUTED_COLUMNS).

    `model` names GEMMs by shape in unannotated traces, as the shard of it the trace's GEMM
    shapes show (a tensor-parallel rank: `tp.infer_tp`); without it the linears are inferred
    from the trace's own GEMM shapes when they look like a Llama/Qwen layer.
    """
    keys = KeySpace(trace.cpu_ops, trace.runtime, trace.flows, trace.annotations,
                    trace.python_frames)
    ops = ops_frame(trace.cpu_ops, keys)
    units = cpu_units(ops) if trace.cpu_only else device_units(trace, ops, keys)
    units["coll"] = collective_names(categorical(units["name"]), kernel=True)
    units["ann_name"], units["ann_layer"], units["step"] = unit_ranges(trace.annotations, units,
                                                                       keys)
    units["training"], units["node"], units["frame"] = training_parts(
        units, ops, trace.annotations, keys)
    inst = with_weight_shapes(instances(units, ops))
    inst, found = models_of(inst, ops)
    trace_ops = TraceOps(ops, trace.python_frames, keys)
    if not found:
        if model is not None:
            model = model.shard(infer_tp(gemm_shapes(trace), model))
        named = name_instances(inst, trace_ops, model, whole=True)
        return _assemble(units, ops, inst.assign(**dict(zip(_NAMED, named, strict=True))))
    inst, labels, shards = model_shards(inst, found, model)
    parts = []
    for m, shard in enumerate(shards):
        sub = inst[inst["model"].to_numpy() == m]
        named = name_instances(sub, trace_ops, shard)
        parts.append(sub.assign(**dict(zip(_NAMED, named, strict=True))))
    inst = pd.concat(parts).loc[inst.index]
    for col in ("operator", "evidence", "reason"):
        inst[col] = inst[col].astype("category")
    inst["model"] = pd.Categorical.from_codes(inst["model"].to_numpy(np.int64), labels)
    return _assemble(units, ops, inst)


def _assemble(units: pd.DataFrame, ops: pd.DataFrame, inst: pd.DataFrame) -> pd.DataFrame:
    """Per unit: its instance's name, evidence and layer; a unit without an op has only the
    range around it (or is unattributed, a fallback). Strings stay categorical codes until the
    output."""
    n = len(units)
    inst_row = np.full(len(ops), -1, dtype=np.int64)  # op index -> its instance row
    inst_row[inst.index.to_numpy()] = np.arange(len(inst))
    idx = units["op_idx"].to_numpy()
    at = take(inst_row, idx, -1)
    early = (units["early"].to_numpy(bool) if "early" in units
             else np.zeros(n, bool)) & (at < 0)
    part = np.where(at >= 0, _fused_moe_parts(units, ops), 0)
    operator, evidence, reason = _unit_names(units, inst, at, early, part)
    step = pd.array(units["step"], dtype="Int64")
    step[early] = pd.NA  # a previous step's kernels, whatever step range they end in
    model_col = (take_cat(inst["model"].array, at) if "model" in inst
                 else pd.Categorical.from_codes(np.full(n, -1, np.int8), []))
    return pd.DataFrame({
        "event_id": units["event_id"].to_numpy(np.int64),
        "name": name_categories(units["name"]),
        "kind": strings(units["kind"]),
        "stream": pd.array(units["stream"], dtype="Int64"),
        "ts_us": units["ts_us"].to_numpy(np.float64),
        "dur_us": units["dur_us"].to_numpy(np.float64),
        "op_id": ops["op_id"].astype("Int64").array.take(idx, allow_fill=True),
        "instance": _instance_ids(idx, units["step"], part),
        **{dst: strings(take_cat(categorical(ops[col]), idx)) for col, dst in _OP_COLUMNS},
        "operator": strings(operator.categorical()),
        "layer": _unit_layers(units, inst, at, operator),
        "step": step,
        "evidence": strings(evidence.categorical()),
        "reason": strings(reason.categorical()),
        "training": strings(units["training"].array),
        "model": strings(model_col),
    })


_OP_COLUMNS = (("name", "op_name"), ("input_dims", "input_dims"), ("input_types", "input_types"),
               ("concrete_inputs", "concrete_inputs"), ("input_strides", "input_strides"))


def _unit_names(units: pd.DataFrame, inst: pd.DataFrame, at: np.ndarray, early: np.ndarray,
                part: np.ndarray) -> tuple[Coded, Coded, Coded]:
    """Per unit (`at`: its instance row, -1: none), its operator, evidence and reason: its
    instance's, else its range's, else a collective kernel's own, else unattributed; a fused
    MoE op's `part` (`_fused_moe_parts`), or a unit launched before the window (`early`), by
    what it is."""
    has = at >= 0
    ann = units["ann_name"].array
    coll = units["coll"].array
    named = ~has & (ann.codes >= 0) & ~early
    lone = ~has & (coll.codes >= 0) & ~early  # a collective kernel no op links to
    (op, an, un, co, down, comb, bw), op_cats = unify(
        take_cat(inst["operator"].array, at), ann, UNATTRIBUTED, coll, *_FUSED_PARTS,
        operators.BEFORE_WINDOW.name)
    operator = np.select([part == 1, part == 2, lone, has, named], [down, comb, co, op, an], un)
    operator = np.where(early, bw, operator)
    (ev, an, un, ke), ev_cats = unify(take_cat(inst["evidence"].array, at),
                                      "annotation", FALLBACK, "kernel_name")
    evidence = np.where(lone, ke, np.where(has, ev, np.where(named, an, un)))
    (re_, nl, bwr), re_cats = unify(take_cat(inst["reason"].array, at), _UNLINKED,
                                    _BEFORE_WINDOW)
    reason = np.where(early, bwr, np.where(has, re_, np.where(named | lone, -1, nl)))
    return Coded(operator, op_cats), Coded(evidence, ev_cats), Coded(reason, re_cats)


def _unit_layers(units: pd.DataFrame, inst: pd.DataFrame, at: np.ndarray,
                 operator: Coded) -> pd.arrays.IntegerArray:
    """Per unit, its instance's layer, else its range's; none for a model-level operator."""
    has = at >= 0
    inst_layer = inst["layer"].array.take(at, allow_fill=True)
    ann_layer = units["ann_layer"].array
    return pd.arrays.IntegerArray(
        np.where(has, inst_layer.to_numpy(np.int64, na_value=0),
                 ann_layer.to_numpy(np.int64, na_value=0)),
        np.where(has, inst_layer.isna(), ann_layer.isna())
        | np.append(operator.cats.isin(operators.MODEL_LEVEL), True)[operator.codes])


def _instance_ids(op_idx: np.ndarray, step: pd.Series, part: np.ndarray) -> np.ndarray:
    """0, 1, ... per distinct (op, step, part) in order of first unit (part: of a fused MoE op,
    _fused_moe_parts); an unlinked unit (op_idx < 0) gets an id of its own."""
    step_code = pd.factorize(pd.array(step, dtype="Int64"), use_na_sentinel=False)[0]
    n_steps = int(step_code.max(initial=0)) + 1
    key = np.where(op_idx >= 0, (op_idx * n_steps + step_code) * 3 + part,
                   -1 - np.arange(len(op_idx)))
    return pd.factorize(key)[0].astype(np.int64)


def _fused_moe_parts(units: pd.DataFrame, ops: pd.DataFrame) -> np.ndarray:
    """Per unit, its part of an engine's fused MoE op (0 elsewhere): 1 for the even-numbered
    expert-GEMM kernels (in time) of each op and step, the w2 (down) halves, 2 for a finalize
    kernel (the combine); see _FUSED_PARTS."""
    out = np.zeros(len(units), dtype=np.int64)
    idx = units["op_idx"].to_numpy()
    fused_op = by_category(ops["name"], lambda c: operators.recognise(
        operators.FUSED_EXPERTS, operators.base_names(c)))
    inside = np.zeros(len(units), dtype=bool)
    inside[idx >= 0] = fused_op[idx[idx >= 0]]
    if not inside.any():
        return out
    role = np.asarray(kernels.roles(pd.Series(categorical(units["name"]))).astype(object))
    gemm, finalize = inside & (role == "moe_gemm"), inside & (role == "moe_finalize")
    out[finalize] = 2
    rows = np.flatnonzero(gemm)
    sub = pd.DataFrame({"op": idx[rows], "step": pd.array(units["step"], dtype="Int64")[rows],
                        "ts": units["ts_us"].to_numpy()[rows]})
    rank = sub.sort_values("ts", kind="stable").groupby(["op", "step"], dropna=False).cumcount()
    out[rows] = (rank.reindex(sub.index).to_numpy() % 2)
    return out


def operator_table(attributed: pd.DataFrame) -> pd.DataFrame:
    """Device time per (step, layer, operator): OPERATOR_TABLE_COLUMNS, in order of first start.

    `dur_ps` is exact integer picoseconds, so Σ dur_ps == coverage()["kernel_time_ps"]; dur_us
    is dur_ps / 1e6.
    """
    a = attributed.assign(_ps=_ps(attributed["dur_us"]))
    total = int(a["_ps"].sum())
    keys = ["step", "layer", "operator"]
    g = a.groupby(keys, dropna=False, sort=False)
    t = g.agg(kernels=("_ps", "size"), ops=("op_id", "nunique"), dur_ps=("_ps", "sum"),
              ts_us=("ts_us", "min")).reset_index()
    ev = (a.groupby([*keys, "evidence"], dropna=False, sort=False)["_ps"].sum().reset_index()
          .sort_values("_ps", ascending=False, kind="stable")
          .drop_duplicates(keys).rename(columns={"evidence": "_ev"}))
    t = t.merge(ev[[*keys, "_ev"]], on=keys, how="left")
    t["evidence"] = t.pop("_ev")
    t["dur_us"] = t["dur_ps"] / _PS_PER_US
    t["share"] = t["dur_ps"] / total if total else np.nan
    t = t.sort_values(["step", "ts_us"], kind="stable", na_position="first", ignore_index=True)
    return t.astype({"step": "Int64", "layer": "Int64", "kernels": "int64", "ops": "int64",
                     "dur_ps": "int64"})[list(OPERATOR_TABLE_COLUMNS)]


def coverage(attributed: pd.DataFrame) -> dict:
    """kernel_time_us, attributed_time_us, unattributed_time_us, fraction (attributed / total),
    kernels, unattributed_kernels, the same totals in exact integer picoseconds, and the time
    and count of kernels launched before the profiled window (`before_window`)."""
    ps = _ps(attributed["dur_us"])
    un = (attributed["operator"] == UNATTRIBUTED).to_numpy()
    early = (attributed["operator"] == operators.BEFORE_WINDOW.name).to_numpy()
    total, lost = int(ps.sum()), int(ps[un].sum())
    return {
        "kernel_time_us": total / _PS_PER_US,
        "attributed_time_us": (total - lost) / _PS_PER_US,
        "unattributed_time_us": lost / _PS_PER_US,
        "fraction": (total - lost) / total if total else float("nan"),
        "kernels": len(attributed),
        "unattributed_kernels": int(un.sum()),
        "kernel_time_ps": total,
        "attributed_time_ps": total - lost,
        # kernels of the step before the profiled window (in the totals, in no pass)
        "before_window_time_us": int(ps[early].sum()) / _PS_PER_US,
        "before_window_kernels": int(early.sum()),
    }


def _ps(dur_us: pd.Series) -> np.ndarray:
    """Durations as int64 picoseconds: exact for the ns-precision µs Kineto writes."""
    return np.rint(dur_us.to_numpy(np.float64) * _PS_PER_US).astype(np.int64)
