"""Stage 2: attribute every device microsecond of a trace to a named operator.

Design notes: docs/design.md ("trace_roofline/attribution/attribute.py").
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from trace_roofline.attribution import inference, kind, naming
from trace_roofline.attribution.nest import KeySpace, Nest, to_ns
from trace_roofline.attribution.tp import gemm_shapes, infer_tp
from trace_roofline.model import kernels, models, operators
from trace_roofline.model.models import ModelSpec
from trace_roofline.trace import Trace, parse_dims

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
_LAYER_RE = re.compile(r"(?:^|[./:\s])layers?[._\s#]?(\d+)(?:$|[./:\s])")
_STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")
# cpu ops that only wrap others (torch.compile, autograd, CUDA graphs): never units or top ops
_WRAPPER_RE = re.compile(r"^(?:Torch-Compiled Region|TorchDynamo|CompiledFunction|Pregraph bytecode|"
                         r"AOTDispatcher|## |cudaGraph|autograd::engine|Optimizer\.|"
                         r"\w+Backward\d*$|torch::autograd::AccumulateGrad$)")
_PS_PER_US = 1_000_000
# what an engine's fused MoE op (operators.FUSED_EXPERTS: vLLM's fused_experts, moe_forward)
# runs besides its own name, experts_gate_up: by kernel role, in time order within the op, its
# expert GEMMs alternate w13 (gate_up) and w2 (down); a finalize kernel sums the top-k outputs
_FUSED_PARTS = ("experts_down", "moe_combine")  # part 1, part 2 (0: the op's own name)
_TAKE_CHUNK = 1 << 14  # rows per arrow take when decoding a string column
_BACKWARD_FRAME = "autograd::engine::evaluate_function: "
_OPTIMIZER_RE = re.compile(r"^Optimizer\.(?:step|zero_grad)#")
_OPTIMIZER_OPS = re.compile(r"^(?:_foreach_|_fused_adam|_fused_sgd|_fused_adagrad)")
# ops only a forward calls (autograd's backward formulas call mm, silu_backward, ...): inside a
# backward node they are an activation-checkpointed layer's forward, run again
_FORWARD_ONLY = re.compile(r"^(?:linear|scaled_dot_product_attention|_scaled_dot_product_\w+"
                           r"_attention|_flash_attention_forward|_efficient_attention_forward|"
                           r"embedding|silu|gelu|rms_norm|_fused_rms_norm|layer_norm)$")
TRAINING_PARTS = ("forward", "backward", "optimizer", "recompute")
_UNLINKED = "no cpu op launched it (no External id, runtime launch or flow links it)"
_BEFORE_WINDOW = ("launched before the profiled window: no launch in the file, its correlation "
                  "id below the first launch's, done before the first linked kernel")
_NO_DECODER = "no decoder-layer operator in the trace: each op keeps its own name"


def attribute(trace: Trace, model: ModelSpec | None = None) -> pd.DataFrame:
    """One row per timed unit with its operator, layer, step and evidence (ATTRIBUTED_COLUMNS).

    `model` names GEMMs by shape in unannotated traces, as the shard of it the trace's GEMM
    shapes show (a tensor-parallel rank: `tp.infer_tp`); without it the linears are inferred
    from the trace's own GEMM shapes when they look like a Llama/Qwen layer.
    """
    keys = KeySpace(trace.cpu_ops, trace.runtime, trace.flows, trace.annotations,
                    trace.python_frames)
    ops = _ops_frame(trace.cpu_ops, keys)
    units = _cpu_units(ops) if trace.cpu_only else _device_units(trace, ops, keys)
    units["coll"] = _categorical(naming.per_value(units["name"], _kernel_collective))
    units["ann_name"], units["ann_layer"], units["step"] = _annotations(trace.annotations, units,
                                                                        keys)
    units["training"], units["node"], units["frame"] = _training(units, ops, trace.annotations,
                                                                 keys)
    inst = _gemm_shapes(_instances(units, ops))
    inst, found = _models(inst, ops)
    if not found:
        if model is not None:
            model = model.shard(infer_tp(gemm_shapes(trace), model))
        named = _name_instances(inst, ops, trace.python_frames, keys, model, whole=True)
        return _assemble(units, ops, inst.assign(**dict(zip(_NAMED, named, strict=True))))
    inst, labels, shards = _model_shards(inst, found, model)
    parts = []
    for m, shard in enumerate(shards):
        sub = inst[inst["model"].to_numpy() == m]
        named = _name_instances(sub, ops, trace.python_frames, keys, shard)
        parts.append(sub.assign(**dict(zip(_NAMED, named, strict=True))))
    inst = pd.concat(parts).loc[inst.index]
    for col in ("operator", "evidence", "reason"):
        inst[col] = inst[col].astype("category")
    inst["model"] = pd.Categorical.from_codes(inst["model"].to_numpy(np.int64), labels)
    return _assemble(units, ops, inst)


_NAMED = ("operator", "evidence", "layer", "reason")  # what _name_instances returns, in order


def _models(inst: pd.DataFrame, ops: pd.DataFrame
            ) -> tuple[pd.DataFrame, list[tuple[int, int, bool]]]:
    """Several models in one trace (assisted or speculative decoding, an encoder-decoder): each
    hidden size H of the embedding weights (V, H) is a model (one model's tables, of tokens,
    positions and token types, share its H), and an encoder's forward (`_encoder_forwards`)
    a model apart from the decoder of its H, as (largest V, H, encoder), widest first, the
    decoder before the encoder. An instance belongs to the model of the last embedding before
    it in its group (the group's first one before any; model 0 in a group without one), and
    each model's instances are groups of their own. With one model or none, `inst` unchanged
    and no models."""
    emb = np.flatnonzero(naming.Names.of(ops["name"]).mapped(operators.base_names)
                         .isin(["embedding"]))
    vh = naming.per_value(ops["input_dims"].iloc[emb].astype("string"), _embedding_weight)
    v, h = vh["V"].to_numpy(np.int64), vh["H"].to_numpy(np.int64)
    emb, v, h = emb[h > 0], v[h > 0], h[h > 0]
    enc = _encoder_forwards(ops, emb)
    keys = pd.MultiIndex.from_arrays([-h, enc]).unique().sort_values()  # widest, decoder first
    if len(keys) < 2:
        return inst, []
    code = keys.get_indexer(pd.MultiIndex.from_arrays([-h, enc]))
    vocab = pd.Series(v).groupby(code).max()
    found = [(int(vocab[i]), -int(nh), bool(e)) for i, (nh, e) in enumerate(keys)]
    inside = Nest(ops["s"].to_numpy()[emb], ops["e"].to_numpy()[emb],
                  ops["key"].to_numpy()[emb]).innermost(inst["t"].to_numpy(),
                                                        inst["key"].to_numpy())
    grp = inst["grp"].to_numpy()
    per = pd.Series(np.where(inside >= 0, code[np.maximum(inside, 0)], np.nan)).groupby(grp)
    model = per.ffill().fillna(per.bfill()).fillna(0).to_numpy(np.int64)
    inst = inst.assign(model=model, grp=pd.factorize(grp * len(found) + model)[0])
    return inst.sort_values(["grp", "t"], kind="stable"), found


def _encoder_forwards(ops: pd.DataFrame, emb: np.ndarray) -> np.ndarray:
    """Per embedding call (`emb`, indices into ops): whether its forward (the calls up to the
    next embedding after some attention) is an encoder's: some attention call attends
    bidirectionally and none is causal, decodes or attends across (kind's reading)."""
    attn = np.flatnonzero(ops["attn"].to_numpy(dtype=bool))
    out = np.zeros(len(emb), dtype=bool)
    if not len(attn) or not len(emb):
        return out
    front = ops.iloc[attn][["name", "input_dims", "concrete_inputs"]].astype("string")
    calls = naming.per_value(front, kind.attention_calls).to_numpy(dtype=object)
    start = ops["s"].to_numpy()
    order = np.argsort(start[emb], kind="stable")
    at = np.searchsorted(start[emb][order], start[attn], side="right") - 1
    seen = np.zeros(len(emb) + 1, dtype=np.int64)
    np.add.at(seen, at + 1, 1)  # attention calls after each embedding, before the next
    fwd = np.cumsum(np.r_[True, seen[1:-1] > 0])  # a forward: embeddings with no call between
    ok = at >= 0
    per = pd.DataFrame({"f": fwd[at[ok]], "bi": calls[ok] == "bidirectional",
                        "dec": np.isin(calls[ok], ["causal", "decode", "cross"])})
    g = per.groupby("f")[["bi", "dec"]].any()
    encoder = g["bi"] & ~g["dec"]
    out[order] = encoder.reindex(fwd, fill_value=False).to_numpy(dtype=bool)
    return out


def _embedding_weight(dims: pd.Series) -> pd.DataFrame:
    """(V, H) of an embedding's weight (its first argument) per distinct Input Dims; -1, -1
    where it has none."""
    def one(d: object) -> tuple[int, int]:
        w = d[0] if isinstance(d, list) and d else None
        ok = isinstance(w, list) and len(w) == 2 and all(type(x) is int and x > 0 for x in w)
        return (w[0], w[1]) if ok else (-1, -1)  # type: ignore[index]

    return pd.DataFrame([one(d) for d in parse_dims(dims)], index=dims.index, columns=["V", "H"])


def _model_shards(inst: pd.DataFrame, found: list[tuple[int, int, bool]],
                  model: ModelSpec | None
                  ) -> tuple[pd.DataFrame, list[str], list[ModelSpec | None]]:
    """The models `_models` found, labelled, each with the spec its GEMMs are named by: `model`
    (as the shard its shapes show) for the one whose GEMMs it explains best, placed first; the
    others none (their linears inferred from their own GEMMs)."""
    labels = [f"{kind.ENCODER_LABEL * e}hidden {h}, vocab {v}" for v, h, e in found]
    shards: list[ModelSpec | None] = [None] * len(found)
    if model is not None:
        best, hits = 0, -1
        for m in range(len(found)):
            rows = (inst["model"].to_numpy() == m) & (inst["K"].to_numpy() >= 0)
            shapes = set(zip(inst["K"].to_numpy()[rows].tolist(),
                             inst["N"].to_numpy()[rows].tolist(), strict=True))
            shard = model.shard(infer_tp(shapes, model))
            n = len(shapes & set(models.expected_linears(shard).values()))
            if n > hits:
                best, hits, shards[0] = m, n, shard
        order = [best, *(m for m in range(len(found)) if m != best)]
        labels = [model.name if i == 0 else labels[m] for i, m in enumerate(order)]
        inst = inst.assign(model=np.argsort(order)[inst["model"].to_numpy()])
    return inst, labels, shards


def _assemble(units: pd.DataFrame, ops: pd.DataFrame, inst: pd.DataFrame) -> pd.DataFrame:
    """Per unit: its instance's name, evidence and layer; a unit without an op has only the
    range around it (or is unattributed, a fallback). Strings stay categorical codes until the output."""
    n = len(units)
    inst_row = np.full(len(ops), -1, dtype=np.int64)  # op index -> its instance row
    inst_row[inst.index.to_numpy()] = np.arange(len(inst))
    at = _take(inst_row, units["op_idx"].to_numpy(), -1)
    has = at >= 0
    ann = units["ann_name"].array
    named = ~has & (ann.codes >= 0)
    coll = units["coll"].array
    lone = ~has & (coll.codes >= 0)  # a collective kernel no op links to
    early = (units["before_window"].to_numpy(bool) if "before_window" in units
             else np.zeros(n, bool)) & ~has
    named &= ~early
    lone &= ~early
    part = np.where(has, _fused_moe_parts(units, ops), 0)
    (op, an, un, co, down, comb, bw), op_cats = _unify(
        _take_cat(inst["operator"].array, at), ann, _const(UNATTRIBUTED, n), coll,
        *(_const(p, n) for p in _FUSED_PARTS), _const(operators.BEFORE_WINDOW.name, n))
    operator = np.select([part == 1, part == 2, lone, has, named], [down, comb, co, op, an], un)
    operator = np.where(early, bw, operator)
    (ev, an, un, ke), ev_cats = _unify(_take_cat(inst["evidence"].array, at),
                                       _const("annotation", n), _const(FALLBACK, n),
                                       _const("kernel_name", n))
    evidence = np.where(lone, ke, np.where(has, ev, np.where(named, an, un)))
    (re_, nl, bwr), re_cats = _unify(_take_cat(inst["reason"].array, at), _const(_UNLINKED, n),
                                     _const(_BEFORE_WINDOW, n))
    reason = np.where(early, bwr, np.where(has, re_, np.where(named | lone, -1, nl)))
    inst_layer = inst["layer"].array.take(at, allow_fill=True)
    ann_layer = units["ann_layer"].array
    no_layer = np.append(op_cats.isin(operators.MODEL_LEVEL), True)[operator]
    layer = pd.arrays.IntegerArray(
        np.where(has, inst_layer.to_numpy(np.int64, na_value=0),
                 ann_layer.to_numpy(np.int64, na_value=0)),
        np.where(has, inst_layer.isna(), ann_layer.isna()) | no_layer)
    idx = units["op_idx"].to_numpy()
    out = pd.DataFrame({
        "event_id": units["event_id"].to_numpy(np.int64),
        "name": _name_categories(units["name"]),
        "kind": _strings(units["kind"]),
        "stream": pd.array(units["stream"], dtype="Int64"),
        "ts_us": units["ts_us"].to_numpy(np.float64),
        "dur_us": units["dur_us"].to_numpy(np.float64),
        "op_id": ops["op_id"].astype("Int64").array.take(idx, allow_fill=True),
        "instance": _instance_ids(idx, units["step"], part),
    })
    for col, dst in (("name", "op_name"), ("input_dims", "input_dims"),
                     ("input_types", "input_types"), ("concrete_inputs", "concrete_inputs"),
                     ("input_strides", "input_strides")):
        out[dst] = _strings(_take_cat(_categorical(ops[col]), idx))
    out["operator"] = _strings(pd.Categorical.from_codes(operator, op_cats))
    out["layer"] = layer
    step = pd.array(units["step"], dtype="Int64")
    step[early] = pd.NA  # a previous step's kernels, whatever step range they end in
    out["step"] = step
    out["evidence"] = _strings(pd.Categorical.from_codes(evidence, ev_cats))
    out["reason"] = _strings(pd.Categorical.from_codes(reason, re_cats))
    out["training"] = _strings(units["training"].array)
    models_of = (inst["model"].array if "model" in inst
                 else pd.Categorical.from_codes(np.zeros(0, np.int8), []))
    out["model"] = _strings(_take_cat(models_of, np.where(has, at, -1)) if len(models_of)
                            else pd.Categorical.from_codes(np.full(n, -1, np.int8), []))
    return out[list(ATTRIBUTED_COLUMNS)]


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
    fused_op = _by_category(ops["name"], lambda c: operators.recognise(
        operators.FUSED_EXPERTS, operators.base_names(c)))
    inside = np.zeros(len(units), dtype=bool)
    inside[idx >= 0] = fused_op[idx[idx >= 0]]
    if not inside.any():
        return out
    role = np.asarray(kernels.roles(pd.Series(_categorical(units["name"]))).astype(object))
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


# ----------------------------------------------------------------------------------------------
# String columns as categorical codes: str work once per distinct value, never per row
# ----------------------------------------------------------------------------------------------
def _categorical(values: pd.Series | pd.Categorical) -> pd.Categorical:
    """A column as a Categorical (a no-op for the trace tables' category columns)."""
    if isinstance(values, pd.Categorical):
        return values
    if isinstance(values.dtype, pd.CategoricalDtype):
        return values.array
    return pd.Categorical(values)


def _take_cat(values: pd.Categorical, idx: np.ndarray) -> pd.Categorical:
    """values[idx], missing where idx < 0."""
    return values.take(idx, allow_fill=True)


def _const(value: str, n: int) -> pd.Categorical:
    return pd.Categorical.from_codes(np.zeros(n, dtype=np.int8), [value])


def _unify(*cols: pd.Categorical) -> tuple[list[np.ndarray], pd.Index]:
    """The codes of several categoricals over one shared index of their categories."""
    cats = pd.Index(np.concatenate([np.asarray(c.categories, dtype=object) for c in cols]))
    cats = cats.unique()
    codes = [np.append(cats.get_indexer(c.categories), -1)[c.codes] for c in cols]
    return codes, cats


def _name_categories(values: pd.Series | pd.Categorical) -> pd.Categorical:
    """A categorical column of the names used (missing: NaN), its categories `str` and sorted,
    so that it sorts and compares as the strings would, whatever their order in the file."""
    c = _categorical(values).remove_unused_categories()
    return c.reorder_categories(c.categories.astype("str").sort_values())


def _strings(values: pd.Series | pd.Categorical) -> pd.api.extensions.ExtensionArray:
    """A categorical column as the `str` dtype (missing -> NaN), decoding each category once.

    The arrow buffers are sized exactly from the category lengths and filled by takes of
    bounded row chunks: one take of all rows grows its buffer by reallocation, 2x the memory
    and up to 10x the time on 100+ MB of long kernel names. The data buffer is a bytearray, as
    numpy advises huge pages for big arrays, which makes their first touch 4x slower in VMs."""
    c = _categorical(values)
    cats = pa.array(np.append(np.asarray(c.categories, dtype=object), ""), type=pa.large_string())
    codes = np.asarray(c.codes, dtype=np.int64)
    valid = codes >= 0
    codes = np.where(valid, codes, len(cats) - 1)  # missing: the empty string, masked below
    offsets = np.zeros(len(codes) + 1, dtype=np.int64)
    np.cumsum(pc.binary_length(cats).to_numpy()[codes], out=offsets[1:])
    data = bytearray(int(offsets[-1]))
    for i in range(0, len(codes), _TAKE_CHUNK):
        lo, hi = offsets[i], offsets[min(i + _TAKE_CHUNK, len(codes))]
        if hi > lo:
            part = pc.take(cats, pa.array(codes[i:i + _TAKE_CHUNK]))
            _, offs, buf = part.buffers()
            first = int(np.frombuffer(offs, np.int64, count=1, offset=8 * part.offset)[0])
            data[lo:hi] = memoryview(buf)[first:first + hi - lo]
    mask = None if valid.all() else pa.py_buffer(np.packbits(valid, bitorder="little"))
    arr = pa.LargeStringArray.from_buffers(len(codes), pa.py_buffer(offsets),
                                           pa.py_buffer(data), mask)
    return pd.array(arr, dtype="str")


# ----------------------------------------------------------------------------------------------
# Units and their launch points
# ----------------------------------------------------------------------------------------------
def _ps(dur_us: pd.Series) -> np.ndarray:
    """Durations as int64 picoseconds: exact for the ns-precision µs Kineto writes."""
    return np.rint(dur_us.to_numpy(np.float64) * _PS_PER_US).astype(np.int64)


def _by_category(col: pd.Series, flag) -> np.ndarray:
    """Evaluate a vectorised str predicate once per distinct value of a column."""
    c = _categorical(col)
    cats = pd.Series(c.categories.astype(str))
    return np.append(np.asarray(flag(cats), dtype=bool), False)[c.codes]


def _ints(col: pd.Series, fill: int) -> np.ndarray:
    return col.astype("Int64").to_numpy(np.int64, na_value=fill)


def _ops_frame(cpu_ops: pd.DataFrame, keys: KeySpace) -> pd.DataFrame:
    """cpu ops with ns bounds, thread key and per-op flags."""
    ops = cpu_ops.reset_index(drop=True)  # a new frame (copy-on-write): cpu_ops stays as is
    ops["s"] = to_ns(ops["ts_us"])
    ops["e"] = ops["s"] + to_ns(ops["dur_us"])
    ops["key"] = keys.codes(ops["pid"], ops["tid"])
    ops["wrapper"] = _by_category(ops["name"], lambda c: c.str.contains(_WRAPPER_RE))
    ops["attn"] = _by_category(
        ops["name"], lambda c: operators.recognise(operators.ATTENTION, operators.base_names(c)))
    ops["dispatch"] = _by_category(ops["name"], lambda c: c.isin(operators.ATTENTION_DISPATCH))
    ops["shaped"] = _by_category(ops["input_dims"], lambda c: c.str.contains(r"\d"))
    return ops


def _cpu_units(ops: pd.DataFrame) -> pd.DataFrame:
    """CPU-only trace: the top-level (outermost non-wrapper) cpu ops are the timed units."""
    key = np.where(ops["wrapper"].to_numpy(), -1, ops["key"].to_numpy())
    top = np.flatnonzero(Nest(ops["s"].to_numpy(), ops["e"].to_numpy(), key).depth == 0)
    u = ops.iloc[top]
    return pd.DataFrame({
        "event_id": u["op_id"].to_numpy(np.int64), "name": _categorical(u["name"]),
        "kind": _const("cpu_op", len(u)),
        "stream": pd.arrays.IntegerArray(np.zeros(len(u), np.int64), np.ones(len(u), bool)),
        "ts_us": u["ts_us"].to_numpy(), "dur_us": u["dur_us"].to_numpy(),
        "op_idx": top, "top_idx": top, "t": u["s"].to_numpy(), "key": u["key"].to_numpy(),
    })


def _take(values: np.ndarray, idx: np.ndarray, fill) -> np.ndarray:
    """values[idx] where idx >= 0, else fill (values may be empty)."""
    if not len(values):
        return np.full(len(idx), fill)
    return np.where(idx >= 0, values[np.maximum(idx, 0)], fill)


def _lookup(values: np.ndarray, valid: np.ndarray, queries: np.ndarray, *,
            unique: bool) -> np.ndarray:
    """Per query, the row of `values` (among `valid` rows) equal to it: the first such row, or
    with `unique` only a value held by exactly one row; -1 where none. Sort + searchsorted
    (ids come nearly sorted, so the stable sort is cheap)."""
    rows = np.flatnonzero(valid)
    if not len(rows):
        return np.full(len(queries), -1, dtype=np.int64)
    rows = rows[np.argsort(values[rows], kind="stable")]
    v = values[rows]
    lo = np.minimum(np.searchsorted(v, queries, side="left"), len(v) - 1)
    found = v[lo] == queries
    if unique:  # the next value differs (or there is none)
        found &= np.append(v[1:] != v[:-1], True)[lo]
    return np.where(found, rows[lo], -1)


def _device_units(trace: Trace, ops: pd.DataFrame, keys: KeySpace) -> pd.DataFrame:
    """Device rows with their launch point (thread key, ns), launching op and op instance."""
    dev = trace.device.reset_index(drop=True)
    corr = _ints(dev["correlation"], -1)
    # correlation -> the (first) runtime launch; else the (first) flow start event with that id
    rt, fl = trace.runtime, trace.flows
    ri = _lookup(_ints(rt["correlation"], 0), rt["correlation"].notna().to_numpy(), corr,
                 unique=False)
    fl_start = (fl["ph"] == "s").to_numpy(dtype=bool) & fl["id"].notna().to_numpy()
    fi = np.where(ri >= 0, -1, _lookup(_ints(fl["id"], 0), fl_start, corr, unique=False))
    has_pt = (ri >= 0) | (fi >= 0)

    def at(table: pd.DataFrame, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(thread key, ns) of the given rows of a table (-1, 0 where rows < 0)."""
        pid, tid = (table[c].array.take(rows, allow_fill=True) for c in ("pid", "tid"))
        return keys.codes(pid, tid), to_ns(_take(table["ts_us"].to_numpy(np.float64), rows, 0))

    (rt_key, rt_t), (fl_key, fl_t) = at(rt, ri), at(fl, fi)
    pt_key, pt_t = np.where(ri >= 0, rt_key, fl_key), np.where(ri >= 0, rt_t, fl_t)
    # External id of the kernel (else of its runtime launch) -> the launching cpu op, when one
    # op alone carries it
    ext = _ints(dev["external_id"], -1)
    ext = np.where(ext > 0, ext, _take(_ints(rt["external_id"], -1), ri, -1))
    op_ext = _ints(ops["external_id"], -1)
    launch = np.where(ext > 0, _lookup(op_ext, op_ext > 0, ext, unique=True), -1)
    s, e, k = ops["s"].to_numpy(), ops["e"].to_numpy(), ops["key"].to_numpy()
    nest = Nest(s, e, k)
    by_time = np.flatnonzero((launch < 0) & has_pt)
    launch[by_time] = nest.innermost(pt_t[by_time], pt_key[by_time])
    # the launch point: the runtime call when it lies inside the launching op, else the op start
    linked = launch >= 0
    ls, le, lk = _take(s, launch, 0), _take(e, launch, 0), _take(k, launch, -1)
    inside = has_pt & linked & (pt_key == lk) & (pt_t >= ls) & (pt_t < le)
    t = np.where(inside, pt_t, np.where(linked, ls, pt_t))
    key = np.where(linked, lk, np.where(has_pt, pt_key, -1))
    inner = nest.innermost(t, key)  # the ops around t: this one and its ancestors
    op_idx = _instance_op(ops, nest, inner, launch)
    top = nest.enclosing(~ops["wrapper"].to_numpy(), inner, outermost=True)
    return pd.DataFrame({
        "event_id": dev["event_id"].to_numpy(np.int64), "name": _categorical(dev["name"]),
        "kind": _categorical(dev["kind"]), "stream": dev["stream"], "ts_us": dev["ts_us"],
        "dur_us": dev["dur_us"], "op_idx": op_idx,
        "top_idx": np.where(top >= 0, top, op_idx), "t": t, "key": key,
        "dev_pid": dev["pid"], "dev_stream": dev["stream"], "ts_ns": to_ns(dev["ts_us"]),
        "before_window": _before_window(dev, corr, has_pt, rt),
    })


def _before_window(dev: pd.DataFrame, corr: np.ndarray, has_pt: np.ndarray,
                   rt: pd.DataFrame) -> np.ndarray:
    """Device rows launched before the profiled window (a profiler schedule's previous step):
    no launch in the file, a correlation id below every runtime launch's, and done before the
    first kernel that a launch links (operators.BEFORE_WINDOW)."""
    if not has_pt.any() or not rt["correlation"].notna().any():
        return np.zeros(len(dev), dtype=bool)
    first_corr = int(_ints(rt["correlation"], 0)[rt["correlation"].notna().to_numpy()].min())
    start = to_ns(dev["ts_us"])
    end = start + to_ns(dev["dur_us"])
    first_linked = int(start[has_pt].min())
    return ~has_pt & (corr >= 0) & (corr < first_corr) & (end <= first_linked)


def _instance_op(ops: pd.DataFrame, nest: Nest, inner: np.ndarray,
                 launch: np.ndarray) -> np.ndarray:
    """The outermost attention op around the launch point (SDPA and everything it launches,
    mask preparation, a math fallback's bmm/softmax, are one instance), else the innermost
    shape-carrying op, else the launching op itself; -1 for unlinked units. An engine's
    dispatching attention op (operators.ATTENTION_DISPATCH, which records no key lengths) does
    not gather the ops inside it: the flash-attention forward it runs (whose arguments say the
    sequences' lengths) and an older vLLM's cache write in it are instances of their own.
    `inner`: the innermost op around each unit's launch point (-1: none)."""
    out = launch.copy()
    attention = ops["attn"].to_numpy() & ~ops["dispatch"].to_numpy()
    for m, outermost in ((ops["shaped"].to_numpy(), False), (attention, True)):  # later wins
        hit = nest.enclosing(m, inner, outermost)
        out = np.where(hit >= 0, hit, out)
    return np.where(launch >= 0, out, -1)


# ----------------------------------------------------------------------------------------------
# Ranges: canonical record_function names, layers.N, ProfilerStep#N
# ----------------------------------------------------------------------------------------------
def _canonical(names: pd.Series) -> pd.Series:
    """Canonical operator of a range name: 'q_proj', 'layers.3.q_proj', 'input_layernorm'."""
    last = names.astype("string").str.strip().str.split(r"[./:\s]", regex=True).str[-1]
    last = last.replace(operators.ALIASES)
    return last.where(last.isin(operators.NAMES)).astype(object)


def _annotations(ann: pd.DataFrame, units: pd.DataFrame, keys: KeySpace):
    """Per unit: (canonical range name, layers.N, ProfilerStep N) of the innermost ranges
    around its launch point; unlinked device rows use gpu_user_annotation ranges around them
    on their stream, and for the step any CPU ProfilerStep range around their start."""
    n = len(units)
    # the facts of each distinct range name, then per range row by its code
    names = _categorical(ann["name"])
    u = pd.Series(np.asarray(names.categories, dtype=object), dtype="string")
    canon = _categorical(_canonical(u))
    facts = {
        "name": np.append(canon.codes, -1)[names.codes],
        "layer": np.append(pd.to_numeric(u.str.extract(_LAYER_RE, expand=False),
                                         errors="coerce").to_numpy("float64", na_value=np.nan),
                           np.nan)[names.codes],
        "step": np.append(pd.to_numeric(u.str.extract(_STEP_RE, expand=False),
                                        errors="coerce").to_numpy("float64", na_value=np.nan),
                          np.nan)[names.codes],
    }
    missing: dict[str, Callable[[np.ndarray], np.ndarray]] = {
        "name": lambda v: v < 0, "layer": np.isnan, "step": np.isnan}
    gpu = _by_category(ann["cat"], lambda c: c.str.lower().eq("gpu_user_annotation"))
    s = to_ns(ann["ts_us"])
    e = s + to_ns(ann["dur_us"])
    t, key = units["t"].to_numpy(), units["key"].to_numpy()
    out = {"name": np.full(n, -1, dtype=np.int64), "layer": np.full(n, np.nan),
           "step": np.full(n, np.nan)}

    def fill(field: str, rows: np.ndarray, nest: Nest, q_t: np.ndarray,
             q_key: np.ndarray) -> None:
        m = ~missing[field](facts[field])
        if not m.any() or not rows.any():
            return
        hit = nest.subset(m).innermost(q_t, q_key)
        cur = out[field][rows]
        fact = _take(facts[field], hit, -1 if field == "name" else np.nan)
        out[field][rows] = np.where(missing[field](cur) & (hit >= 0), fact, cur)

    everyone = np.ones(n, dtype=bool)
    cpu = Nest(s, e, np.where(gpu, -1, keys.codes(ann["pid"], ann["tid"])))
    for field in facts:
        fill(field, everyone, cpu, t, key)
    if "dev_pid" in units and (key < 0).any():
        lost = key < 0
        gkeys = KeySpace(pd.DataFrame({"pid": units["dev_pid"], "tid": units["dev_stream"]}))
        on_stream = Nest(s, e, np.where(gpu, gkeys.codes(ann["pid"], ann["tid"]), -1))
        q_t = units["ts_ns"].to_numpy()[lost]
        q_key = gkeys.codes(units["dev_pid"], units["dev_stream"])[lost]
        for field in facts:
            fill(field, lost, on_stream, q_t, q_key)
    # the step, as a last resort: a CPU ProfilerStep range on any thread around the launch
    # (or, for an unlinked device row, around the kernel's start)
    nostep = np.isnan(out["step"])
    if nostep.any():
        q_t = np.where(key >= 0, t, units["ts_ns"].to_numpy() if "ts_ns" in units else t)[nostep]
        anywhere = Nest(s, e, np.where(gpu, -1, 0))
        fill("step", nostep, anywhere, q_t, np.zeros(len(q_t), np.int64))

    def as_int(v: np.ndarray) -> pd.api.extensions.ExtensionArray:
        return pd.array(v, dtype="Float64").astype("Int64")

    return (pd.Categorical.from_codes(out["name"], canon.categories), as_int(out["layer"]),
            as_int(out["step"]))


# ----------------------------------------------------------------------------------------------
# Op instances and their names
# ----------------------------------------------------------------------------------------------
def _instances(units: pd.DataFrame, ops: pd.DataFrame) -> pd.DataFrame:
    """One row per op instance (index: op_idx), in launch order within (step, thread); its
    name columns are categoricals over the trace's distinct values."""
    op_idx = units["op_idx"].to_numpy()
    oi, first = np.unique(op_idx, return_index=True)
    first, oi = first[oi >= 0], oi[oi >= 0]
    names = _categorical(ops["name"])
    step = units["step"].astype("Int64").to_numpy(dtype=np.int64, na_value=-1)[first]
    key = units["key"].to_numpy()[first]
    inst = pd.DataFrame({
        "t": ops["s"].to_numpy()[oi], "key": key,
        "step": pd.array(np.where(step >= 0, step, 0), dtype="Int64"),
        "ann_name": _take_cat(units["ann_name"].array, first),
        "ann_layer": units["ann_layer"].array.take(first),
        "op_name": _take_cat(names, oi),
        "top_name": _take_cat(names, units["top_idx"].to_numpy()[first]),
        "input_dims": _take_cat(_categorical(ops["input_dims"]), oi),
        "input_strides": _take_cat(_categorical(ops["input_strides"]), oi),
    }, index=pd.Index(oi, name="op_idx"))
    inst["step"] = inst["step"].where(step >= 0)
    coll = units["coll"].array
    hit = (coll.codes >= 0) & (op_idx >= 0)
    first_coll = pd.Series(coll.codes[hit]).groupby(op_idx[hit]).first()
    codes = first_coll.reindex(oi).fillna(-1).to_numpy(np.int64)
    inst["kernel_coll"] = pd.Categorical.from_codes(codes, coll.categories)
    inst["role"] = _instance_roles(units["name"], op_idx, oi)
    inst["training"] = _take_cat(units["training"].array, first)
    inst["node"] = _take_cat(units["node"].array, first)
    inst["frame"] = units["frame"].to_numpy()[first]
    part = inst["training"].array.codes.astype(np.int64) + 1  # backward apart from forward
    # (each recomputation, a backward node's, a group of its own: one layer's forward)
    again = np.where(part == TRAINING_PARTS.index("recompute") + 1, inst["frame"].to_numpy(), -1)
    inst["grp"] = pd.factorize(pd.MultiIndex.from_arrays(
        [(step * (int(key.max(initial=0)) + 2) + key + 1) * (len(TRAINING_PARTS) + 1) + part,
         again]))[0]
    return inst.sort_values(["grp", "t"], kind="stable")


def _training(units: pd.DataFrame, ops: pd.DataFrame, ann: pd.DataFrame, keys: KeySpace
              ) -> tuple[pd.Categorical, pd.Categorical, np.ndarray]:
    """Per unit, its part of a training step and, in backward, the autograd node it runs and
    that node's frame (an op index, -1 outside backward):
    `backward` inside an `autograd::engine::evaluate_function: XBackward0` frame (node
    `XBackward0`), `recompute` the start of such a frame up to its last forward-only op
    (`_FORWARD_ONLY`: activation checkpointing runs the layer's forward there before the node's
    own work), `optimizer` inside an `Optimizer.step#` / `Optimizer.zero_grad#` range (or a
    foreach / fused optimizer op), else `forward`; all missing when the trace has no backward."""
    n = len(units)
    names = _categorical(ops["name"])
    cats = pd.Series(np.asarray(names.categories, dtype=object), dtype="string")
    bwd = np.append(cats.str.startswith(_BACKWARD_FRAME).fillna(False).to_numpy(bool),
                    False)[names.codes]
    t, key = units["t"].to_numpy(), units["key"].to_numpy()
    if not bwd.any():
        none = pd.Categorical.from_codes(np.full(n, -1, np.int8), [])
        return none, none, np.full(n, -1, np.int64)
    frame = Nest(ops["s"].to_numpy()[bwd], ops["e"].to_numpy()[bwd],
                 ops["key"].to_numpy()[bwd]).innermost(t, key)
    node = _take_cat(names, np.where(frame >= 0, np.flatnonzero(bwd)[np.maximum(frame, 0)], -1))
    node = pd.Categorical(pd.Series(node).astype("string").str.slice(len(_BACKWARD_FRAME)))
    opt_op = np.append(cats.str.contains(_OPTIMIZER_RE).fillna(False).to_numpy(bool),
                       False)[names.codes]
    ann_names = _categorical(ann["name"])
    opt_ann = _by_category(ann["name"], lambda c: c.str.contains(_OPTIMIZER_RE))
    gpu = _by_category(ann["cat"], lambda c: c.str.lower().eq("gpu_user_annotation"))
    opt_ann &= ~gpu & (ann_names.codes >= 0)
    s_ann = to_ns(ann["ts_us"])
    in_opt = Nest(np.r_[s_ann[opt_ann], ops["s"].to_numpy()[opt_op]],
                  np.r_[s_ann[opt_ann] + to_ns(ann["dur_us"])[opt_ann], ops["e"].to_numpy()[opt_op]],
                  np.r_[keys.codes(ann["pid"], ann["tid"])[opt_ann], ops["key"].to_numpy()[opt_op]]
                  ).innermost(t, key) >= 0
    opt_named = _by_category(ops["name"], lambda c: operators.base_names(c).fillna("")
                             .str.contains(_OPTIMIZER_OPS))
    in_opt |= _take(opt_named, units["op_idx"].to_numpy(), False)
    at = np.where(frame >= 0, np.flatnonzero(bwd)[np.maximum(frame, 0)], -1)
    # (over cpu ops: the op that completes a recomputation may launch nothing, stopped early)
    fwd_only = np.flatnonzero(_by_category(ops["name"], lambda c: operators.base_names(c)
                                           .fillna("").str.contains(_FORWARD_ONLY)))
    starts = ops["s"].to_numpy()[fwd_only]
    in_frame = Nest(ops["s"].to_numpy()[bwd], ops["e"].to_numpy()[bwd], ops["key"].to_numpy()[bwd]
                    ).innermost(starts, ops["key"].to_numpy()[fwd_only])
    hosts = np.flatnonzero(bwd)[in_frame[in_frame >= 0]]
    last = pd.Series(starts[in_frame >= 0]).groupby(hosts).max()
    recompute = (at >= 0) & (t <= last.reindex(at).fillna(-np.inf).to_numpy())
    part = np.where(in_opt, 2, np.where(recompute, 3, np.where(frame >= 0, 1, 0)))
    return pd.Categorical.from_codes(part, list(TRAINING_PARTS)), node, at


# the kinds of work that make an op's role (an attention and its split-KV reduce are one); the
# other roles (copies, elementwise, memsets, sorts) go with any of them
_ROLE_GROUP = {"attention": 0, "attention_reduce": 0, "gemm": 1, "moe_gemm": 1, "conv": 2,
               "collective": 3, "norm": 4, "fused_add_norm": 4, "rope": 5, "kv_cache_write": 6,
               "activation": 7, "quant": 8, "moe_routing": 9, "moe_finalize": 10, "loss": 11,
               "optimizer": 12, "sampling": 13}


def _instance_roles(names: pd.Series, op_idx: np.ndarray, oi: np.ndarray) -> pd.Categorical:
    """Per instance (op indices `oi`), the role of its kernels (kernels.classify on the units'
    names, once per distinct name): the first in kernels.ROLE_PRIORITY among them; `unknown`
    when they do several kinds of work (`_ROLE_GROUP`)."""
    role = kernels.roles(pd.Series(_categorical(names)))
    order = pd.Index(kernels.ROLE_PRIORITY)
    rank = np.append(order.get_indexer(role.cat.categories), len(order) - 1)[role.cat.codes]
    group = np.append(pd.Series(np.asarray(role.cat.categories, dtype=object))
                      .map(_ROLE_GROUP).to_numpy(np.float64), np.nan)[role.cat.codes]
    linked = op_idx >= 0
    by_op = pd.DataFrame({"rank": rank[linked], "group": group[linked]}).groupby(op_idx[linked])
    best = by_op["rank"].min().reindex(oi)
    # an op whose kernels do several kinds of work (a compiled region replaying a CUDA graph,
    # a wrapper) has no role of its own
    mixed = (by_op["group"].nunique() > 1).reindex(oi, fill_value=False).to_numpy(bool)
    codes = np.where(mixed, len(order) - 1, best.fillna(len(order) - 1).to_numpy(np.int64))
    return pd.Categorical.from_codes(codes, list(order))


def _gemm_shapes(inst: pd.DataFrame) -> pd.DataFrame:
    """(K, N) of each instance's weight GEMM and (WE, WK, WN) of its expert weights
    (naming.expert_weight_kn), parsed once per distinct (op name, Input Dims) pair."""
    return inst.assign(**naming.per_value(inst[["op_name", "input_dims"]], _weight_shapes))


def _weight_shapes(distinct: pd.DataFrame) -> pd.DataFrame:
    base = naming.base_name(distinct["op_name"]).fillna("")
    k, n, w = naming.gemm_kn(base, distinct["input_dims"])
    we, wk, wn = naming.expert_weight_kn(base, distinct["input_dims"])
    return pd.DataFrame({"K": k, "N": n, "W": w, "WE": we, "WK": wk, "WN": wn})


def _linears(inst: pd.DataFrame, model: ModelSpec | None,
             ops: pd.DataFrame | None = None) -> dict[str, tuple[int, int]] | None:
    """The model's linears if any GEMM of the trace matches them, else linears inferred (with
    the experts of its grouped GEMMs, naming.infer_moe_linears)."""
    gemms = inst.loc[inst["K"] >= 0, ["K", "N", "W"]]
    weights = inst.loc[inst["WK"] >= 0, ["WK", "WN"]].set_axis(["K", "N"], axis=1)
    seen = set(map(tuple, pd.concat([gemms[["K", "N"]], weights]).drop_duplicates()
                   .to_numpy().tolist()))
    # (K, N) of plain GEMMs: a shared expert's fused gate_up is told by those, not by the
    # routed experts' stacked GEMM of the same (K, N)
    plain = set(map(tuple, gemms.loc[inst.loc[gemms.index, "WE"] < 0, ["K", "N"]]
                    .drop_duplicates().to_numpy().tolist())) if "WE" in inst else seen
    if model is not None:
        lin = naming.with_moe_linears(models.expected_linears(model), model)
        if seen & set(lin.values()):
            for fused, parts in operators.FUSIONS:  # a trace holds one form
                if fused in lin:
                    drop = parts if lin[fused] in (
                        seen if fused.startswith("experts") else plain) else (fused,)
                    lin = {k: v for k, v in lin.items() if k not in drop}
            return lin
    # an Inductor kernel of W weights counts as its W parts (gate and up, k and v): the
    # layout is inferred unfused, and name_gemms names the kernel after the fusion of its parts
    unfused = gemms.loc[gemms.index.repeat(gemms["W"].to_numpy())]
    unfused = unfused.assign(N=unfused["N"] // unfused["W"])
    per = unfused.groupby(["K", "N"]).size().rename("count").reset_index()
    if not len(per):
        return None
    moe = naming.infer_moe_linears(per, _expert_weights(inst))
    kn = list(zip(per["K"], per["N"], strict=True))
    rest = per[[p not in moe.values() for p in kn]]
    calls = naming.attention_calls(inst)
    dense = naming.infer_linears(rest, calls) or {}
    if not {"q_proj", "qkv_proj"} & set(dense) and len(rest):  # a layout the counts miss
        geometry = inference.attention_geometry(inst["op_name"], inst["input_dims"])
        if geometry is None and ops is not None:  # (an eager attention's matmuls wrap bmm's)
            geometry = inference.attention_geometry(ops["name"], ops["input_dims"])
        h = naming.hidden_size(per)
        counts = {(int(k), int(n)): int(x)
                  for k, n, x in rest[["K", "N", "count"]].itertuples(index=False)}
        dense = (inference.infer_layout(counts, geometry, h, calls) if geometry else None) or dense
    return dense | moe or None


def _expert_weights(inst: pd.DataFrame) -> pd.DataFrame:
    """The expert weights (columns E, K, N) of the grouped GEMMs that multiply all experts at
    once: `_grouped_mm`, an engine's fused experts, and batched_mm's `index` gathers of the
    [E, N, K] weights that feed a weight-first `bmm` of the same (K, N)."""
    base = naming.Names.of(inst["op_name"]).mapped(operators.base_names)
    has = (inst["WE"] >= 0).to_numpy()
    wk, wn = inst["WK"].to_numpy(np.int64), inst["WN"].to_numpy(np.int64)
    kn = wk * (int(wn.max(initial=0)) + 1) + wn  # one key per (K, N)
    gathered = base.isin(["index"]) & has & np.isin(kn, kn[has & base.isin(["bmm"])])
    grouped = base.isin(["_grouped_mm", "inplace_fused_experts", "outplace_fused_experts"]) | \
        _by_category(inst["op_name"], lambda c: c.str.contains(kernels.INDUCTOR_GROUPED_MM))
    return inst.loc[(grouped & has) | gathered,
                    ["WE", "WK", "WN"]].set_axis(["E", "K", "N"], axis=1)


def _module_frames(frames: pd.DataFrame) -> pd.DataFrame:
    """naming.module_frames, evaluated once per distinct frame name and mapped back to rows
    (class and kind as categoricals)."""
    names = _categorical(frames["name"])
    per = naming.module_frames(pd.DataFrame({
        "name": np.asarray(names.categories, dtype=object), "_cat": np.arange(len(names.categories))
    }))
    pos = np.full(len(names.categories) + 1, -1)
    pos[per["_cat"].to_numpy(np.int64)] = np.arange(len(per))
    at = pos[names.codes]
    rows = np.flatnonzero(at >= 0)
    mod = frames.iloc[rows].reset_index(drop=True)
    for col in per.columns.difference(["name", "_cat"], sort=False):
        v = per[col]
        mod[col] = (_take_cat(_categorical(v), at[rows]) if pd.api.types.is_string_dtype(v)
                    else v.array.take(at[rows]))
    return mod


def _name_instances(inst: pd.DataFrame, ops: pd.DataFrame, frames: pd.DataFrame,
                    keys: KeySpace, model: ModelSpec | None, whole: bool = False):
    """(operator, evidence, layer) per instance: annotation > module frames > position; a name
    outside the vocabulary is a fallback (`_fallbacks`)."""
    n = len(inst)
    if not n:
        empty = pd.Categorical.from_codes(np.zeros(0, np.int8), [])
        return empty, empty, pd.array([], dtype="Int64"), empty
    backward = np.asarray(inst["training"].array.isin(["backward", "optimizer"]), dtype=bool)
    # (backward GEMMs run the transposed shapes; `whole`: the trace's only model, whose
    # attention geometry every op of the trace may show)
    linears = _linears(inst[~backward], model, ops if whole else None)
    gemm = naming.name_gemms(inst, linears)
    placement = model.architecture.placement if model is not None else None
    # the model's q/k norms (OLMo2's over the whole projection too), else the shapes say
    qk_norm = True if model is not None and model.qk_norm else None
    pos_name, pos_evidence, pos_reason = naming.explain(inst, gemm, qk_norm, placement)
    mod = _module_frames(frames)
    mod_name = pd.Categorical.from_codes(np.full(n, -1, np.int8), [])
    mod_layer = pd.arrays.IntegerArray(np.zeros(n, np.int64), np.ones(n, bool))
    if len(mod):
        mod["s"] = to_ns(mod["ts_us"])
        mod["e"] = mod["s"] + to_ns(mod["dur_us"])
        mod["key"] = keys.codes(mod["pid"], mod["tid"])
        named, layer = naming.module_names(inst["t"].to_numpy(), inst["key"].to_numpy(), mod,
                                            pos_name)
        mod_name, mod_layer = _categorical(named), layer.array
    ann = inst["ann_name"].array
    (a, m, p), cats = _unify(ann, mod_name, _categorical(pos_name))
    name = np.where(a >= 0, a, np.where(m >= 0, m, p))
    (ea, em, ep), ev_cats = _unify(_const("annotation", n), _const("module", n),
                                   _categorical(pos_evidence))
    evidence = np.where(a >= 0, ea, np.where(m >= 0, em, ep))
    reason = _categorical(pos_reason).codes.astype(np.int64)
    re_cats = _categorical(pos_reason).categories
    reason = np.where((a >= 0) | (m >= 0), -1, reason)
    name, cats, evidence, ev_cats = _collectives(inst, name, cats, evidence, ev_cats)
    reason = np.where(np.append(cats.isin(operators.COMMUNICATION), False)[name], -1, reason)
    name, cats, own = _without_decoder(name, cats, inst["op_name"].array)
    if own.any():
        re_cats = re_cats.append(pd.Index([_NO_DECODER])).unique()
        reason = np.where(own & (reason < 0), re_cats.get_loc(_NO_DECODER), reason)
    if backward.any():
        (name, cats), (evidence, ev_cats), (reason, re_cats) = _training_names(
            inst, backward, (name, cats), (evidence, ev_cats), (reason, re_cats), linears or {})
    by_place = _segment_layers(name, cats, inst["grp"].to_numpy())
    # (a recomputation's layer is not told by its place: backward runs the layers in reverse)
    by_place[np.asarray(inst["training"].array == "recompute", dtype=bool)] = pd.NA
    layer = _coalesce(inst["ann_layer"].array, mod_layer, by_place)
    name, cats = _mlp_by_layer(name, cats, evidence, ev_cats, layer, inst["grp"].to_numpy())
    return (pd.Categorical.from_codes(name, cats), _fallbacks(name, cats, evidence, ev_cats),
            layer, pd.Categorical.from_codes(reason, re_cats))


# A dense MLP's projection and the MoE operator of the same shape (a shared expert's, Mixtral's
# experts when a model also has dense layers): which one a GEMM is depends on its layer.
_DENSE_OF = {**{v: k for k, v in operators.SHARED_OF.items()},
             "experts_gate_up": "gate_up_proj", "experts_down": "down_proj"}
_ROUTED_EVIDENCE = ("router", "moe_dispatch")


_GRAD_NODES = (  # autograd node -> the backward operator it is, when the node says
    (re.compile(r"Attention|Sdpa|SDPA|Flash"), operators.grad_of("attention")),
    (re.compile(r"^Embedding"), operators.grad_of("embedding")),
    (re.compile(r"^(?:Silu|Gelu|Sigmoid|Relu|Tanh)"), operators.grad_of("act")),
    (re.compile(r"^(?:NllLoss|LogSoftmax|CrossEntropy|MseLoss)"), operators.LOSS.name),
)
_BACKWARD_GEMM_NODES = re.compile(r"^(?:Mm|Addmm|Bmm|Baddbmm|Linear|Matmul)Backward")
# an op (or an Inductor kernel, by the aten ops its name fuses) that says what it
# differentiates, where its node does not (a compiled graph's CompiledFunctionBackward): named
# only when one operator's backward matches
_GRAD_OPS = {
    operators.grad_of("attention"): re.compile(r"attention\w*_backward|flash_bwd|attn_bwd"),
    operators.LOSS.name: re.compile(r"nll_loss|log_softmax_backward|cross_entropy"),
    operators.grad_of("embedding"): re.compile(r"embedding_dense_backward"),
    operators.grad_of("act"): re.compile(r"(?:silu|gelu)_backward"),
}


def _training_names(inst: pd.DataFrame, backward: np.ndarray, name: tuple, evidence: tuple,
                    reason: tuple, linears: dict[str, tuple[int, int]]) -> tuple:
    """Backward and optimizer instances of a training step, named apart from the forward ones
    (each argument a (codes, categories) pair; the same returned): a backward GEMM after the
    linear it differentiates (`naming.backward_gemms`: `q_proj.grad`, evidence `shape`), an
    autograd node that says what it differentiates (`_GRAD_NODES`), else its op or kernel
    name (`_GRAD_OPS`; both evidence `kernel_name`),
    every optimizer op `optimizer` (evidence `annotation`: the Optimizer.step range); the rest of
    backward stays `other`, with the node as its reason."""
    nm, ev, why = (_decoded(*pair) for pair in (name, evidence, reason))
    part = np.asarray(inst["training"].astype("string").fillna(""), dtype=object)
    node = inst["node"].astype("string").fillna("")
    bwd, opt = backward & (part == "backward"), part == "optimizer"
    gemm = naming.backward_gemms(inst, linears, bwd)
    by_node = pd.Series(None, index=inst.index, dtype=object)
    for rx, op in _GRAD_NODES:
        by_node = by_node.mask(by_node.isna() & node.str.contains(rx).fillna(False), op)
    hits = {op: _by_category(inst["op_name"], lambda c, rx=rx: c.str.contains(rx))
            for op, rx in _GRAD_OPS.items()}
    one = np.sum(list(hits.values()), axis=0) == 1
    for op, hit in hits.items():
        by_node = by_node.mask(by_node.isna() & one & hit, op)
    node_op = by_node.to_numpy(dtype=object)
    gemm_node = node.str.contains(_BACKWARD_GEMM_NODES).fillna(False).to_numpy(bool)
    has_gemm, has_node = pd.notna(gemm), pd.notna(node_op)
    nm = np.where(bwd, np.where(has_gemm, gemm, np.where(has_node, node_op, "other")), nm)
    ev = np.where(bwd, np.where(has_gemm, "shape", np.where(has_node, "kernel_name",
                                                           "position")), ev)
    lost = bwd & ~has_gemm & ~has_node
    forward_why = np.where(bwd, None, why)  # type: ignore[call-overload]  # (stubs refuse None)
    why = np.where(lost, "backward of " + node.to_numpy(dtype=object) + ": not named by place"
                   + np.where(gemm_node, " (no linear has its shape)", ""), forward_why)
    nm, ev = np.where(opt, "optimizer", nm), np.where(opt, "annotation", ev)
    why = np.where(opt, None, why)  # type: ignore[call-overload,assignment]  # (None)
    return tuple(_codes_of(a) for a in (nm, ev, why))


def _decoded(codes: np.ndarray, cats: pd.Index) -> np.ndarray:
    """An object array of the categories of `codes` (-1: None)."""
    values = np.append(np.asarray(cats, dtype=object), [None])
    return values[np.where(codes >= 0, codes, len(cats))]


def _codes_of(values: np.ndarray) -> tuple[np.ndarray, pd.Index]:
    """(codes, categories) of an object array (None: -1)."""
    codes, cats = pd.factorize(pd.Series(values, dtype=object), use_na_sentinel=True)
    return codes.astype(np.int64), pd.Index(np.asarray(cats, dtype=object))


def _mlp_by_layer(name: np.ndarray, cats: pd.Index, evidence: np.ndarray, ev_cats: pd.Index,
                  layer: pd.arrays.IntegerArray, grp: np.ndarray) -> tuple[np.ndarray, pd.Index]:
    """Dense-MLP and MoE names by layer: in a layer holding a router (or a dispatch), a GEMM
    named as a dense MLP projection is the shared expert's (gate_proj -> shared_gate_proj);
    in a layer without one, a GEMM named by its shape as a shared-expert or expert projection
    is the dense MLP's (the model's dense layers, whose shapes a MoE GEMM also has)."""
    if not np.isin(np.asarray(cats, dtype=object), [*_DENSE_OF, *_ROUTED_EVIDENCE]).any():
        return name, cats  # a dense model's trace: nothing to tell apart
    cats = cats.append(pd.Index([v for v in [*_DENSE_OF, *_DENSE_OF.values()]
                                 if v not in cats])).unique()
    has = np.isin(np.asarray(cats, dtype=object), _ROUTED_EVIDENCE)
    routed_row = np.append(has, False)[name]
    in_layer = ~np.asarray(layer.isna())
    if not in_layer.any():
        return name, cats
    key = pd.DataFrame({"g": grp, "l": layer.to_numpy(np.int64, na_value=-1)})
    routed = pd.Series(routed_row).groupby([key["g"], key["l"]]).transform("any").to_numpy(bool)
    code = {c: i for i, c in enumerate(cats)}
    by_shape = np.append(np.asarray(ev_cats == "shape"), False)[evidence]
    out = name.copy()
    for moe_name, dense_name in _DENSE_OF.items():
        dense_rows = name == code[dense_name]
        moe_rows = name == code[moe_name]
        if moe_name in operators.SHARED_OF.values():  # the shared expert's projections
            out[dense_rows & in_layer & routed] = code[moe_name]
        out[moe_rows & in_layer & ~routed & by_shape] = code[dense_name]
    return out, cats


def _kernel_collective(names: pd.Series) -> pd.Series:
    return operators.collective_of(names, kernel=True)


def _op_collective(names: pd.Series) -> pd.Series:
    return operators.collective_of(operators.base_names(names))


def _collectives(inst: pd.DataFrame, name: np.ndarray, cats: pd.Index, evidence: np.ndarray,
                 ev_cats: pd.Index) -> tuple[np.ndarray, pd.Index, np.ndarray, pd.Index]:
    """Instances that are collectives take the collective's name, whatever else named them:
    by their op or the outermost op around it, else by a kernel (evidence `kernel_name`)."""
    n = len(inst)
    by_op = naming.Names.of(inst["op_name"]).mapped(_op_collective).categorical()
    by_top = naming.Names.of(inst["top_name"]).mapped(_op_collective).categorical()
    (nm, o, t, k), cats = _unify(pd.Categorical.from_codes(name, cats), by_op, by_top,
                                 inst["kernel_coll"].array)
    op_level = np.where(o >= 0, o, t)
    name = np.where(op_level >= 0, op_level, np.where(k >= 0, k, nm))
    (er, ek), ev_cats = _unify(pd.Categorical.from_codes(evidence, ev_cats),
                               _const("kernel_name", n))
    evidence = np.where((op_level >= 0) | (k >= 0), ek, er)
    return name, cats, evidence, ev_cats


def _without_decoder(name: np.ndarray, cats: pd.Index, op_name: pd.Categorical
                     ) -> tuple[np.ndarray, pd.Index, np.ndarray]:
    """In a trace where no instance got a decoder-layer operator's name (a CNN, a matmul loop),
    `other` would name everything: each such instance keeps its op's own name instead. Also
    returns which rows took their op's name."""
    per_layer = [o.name for o in operators.OPERATORS if o.per_layer]
    if (operators.OTHER.name not in cats
            or np.append(cats.isin(per_layer), False)[name].any()):
        return name, cats, np.zeros(len(name), dtype=bool)
    (nm, op), shared = _unify(pd.Categorical.from_codes(name, cats), op_name)
    own = (nm == shared.get_loc(operators.OTHER.name)) & (op >= 0)
    return np.where(own, op, nm), shared, own


def _fallbacks(name: np.ndarray, cats: pd.Index, evidence: np.ndarray,
               ev_cats: pd.Index) -> pd.Categorical:
    """The evidence per instance, `fallback` wherever the name is outside the vocabulary
    (`other`, `linear[K×N]`, an op's own name): whatever rule gave it, no evidence backs it."""
    ev_cats = ev_cats.append(pd.Index([FALLBACK])).unique()
    vocab = np.append(cats.isin(operators.NAMES), False)[name]
    return pd.Categorical.from_codes(np.where(vocab, evidence, ev_cats.get_loc(FALLBACK)),
                                     ev_cats)


def _coalesce(*arrays: pd.api.extensions.ExtensionArray) -> pd.arrays.IntegerArray:
    """The first non-missing value per row of several Int64 arrays."""
    values, miss = arrays[0].to_numpy(np.int64, na_value=0), arrays[0].isna()
    for a in arrays[1:]:
        values = np.where(miss, a.to_numpy(np.int64, na_value=0), values)
        miss = miss & a.isna()
    return pd.arrays.IntegerArray(values, np.asarray(miss))


def _segment_layers(name: np.ndarray, cats: pd.Index, grp: np.ndarray) -> pd.arrays.IntegerArray:
    """Count layers along each sequence: a new one starts where the stage order goes back, and
    the count restarts at each embedding, or after an lm_head (several forward passes in one
    profiler step; torch.compile fuses the embedding into the first norm).

    `name` holds codes into `cats` (-1: none); rows are sorted by `grp` (then launch time), so
    a group, and a forward pass inside it, is a run of rows."""
    n = len(name)
    emb = np.append(cats == operators.EMBEDDING.name, False)[name]
    new_grp = np.r_[True, grp[1:] != grp[:-1]]
    first_emb = emb & ~np.r_[False, emb[:-1] & ~new_grp[1:]]  # not after one in its group
    head = np.append(cats == "lm_head", False)[name]
    after_head = np.r_[False, head[:-1] & ~head[1:]]  # the next pass, its embedding fused away
    seq = np.cumsum(new_grp | first_emb | after_head) - 1  # one forward pass of one group
    stage = np.append(pd.Series(cats, dtype=object).map(operators.STAGES).to_numpy(np.float64),
                      np.nan)[name]
    staged = np.flatnonzero(~np.isnan(stage))
    st, sq = stage[staged], seq[staged]
    cont = np.r_[False, sq[1:] == sq[:-1]]  # not the first staged row of its pass
    new = ~cont | (st < np.r_[np.nan, st[:-1]])  # the stage order goes back: a new layer
    count = np.cumsum(new)
    first = np.maximum.accumulate(np.where(cont, 0, np.arange(len(st))))
    at_stage = np.zeros(n, np.int64)
    at_stage[staged] = count - count[first]
    # every row: the layer of the last staged row before it in its pass
    last = np.maximum.accumulate(np.where(~np.isnan(stage), np.arange(n), -1))
    ok = (last >= 0) & (seq[np.maximum(last, 0)] == seq)
    ok &= ~np.append(cats.isin(operators.MODEL_LEVEL), False)[name]
    return pd.arrays.IntegerArray(np.where(ok, at_stage[np.maximum(last, 0)], 0), ~ok)
