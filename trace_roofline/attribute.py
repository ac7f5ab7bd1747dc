"""Stage 2: attribute every device microsecond of a trace to a named operator.

`attribute(trace, model)` returns one row per timed unit (a kernel / memcpy / memset; in a
CPU-only trace, a top-level cpu op, wrappers such as torch.compile regions skipped, so nested
ops are never counted twice) naming its operator, layer and profiler step.
`operator_table(attributed)` sums them per (step, layer, operator); `coverage(attributed)`
says how much device time found an operator. Both conserve time exactly (integer ps).

Linking a kernel to the cpu op that launched it (first that applies):
1. its `External id` (else its runtime launch's) equals a cpu op's (Kineto stamps the
   innermost op active at launch);
2. its `correlation` equals a runtime launch's (cudaLaunchKernel...; else the ac2g /
   async_cpu_to_gpu flow start with that id): the innermost cpu op on that thread around it;
3. nothing: the kernel is named only by a gpu_user_annotation around it, else `unattributed`.
From the launch point the op instance (`op_id`) is the innermost enclosing op that carries
shapes, except that everything inside an attention op belongs to the outermost one (SDPA with
its mask preparation, cuDNN kernels and memsets, or a math fallback's bmm/softmax). So a
split-K GEMM and its reduce, or an attention call, are one instance of one operator.
Nesting is found with sorted arrays and `searchsorted` per depth (_nest.Nest), never per event.

Naming an op instance, strongest evidence first (`source` column):
1. `annotation`: the innermost enclosing record_function range with a canonical name
   (`q_proj`, also `model.layers.3.self_attn.q_proj`); `layers.N` in a range name is the layer;
2. `module`: nn.Module frames of with_stack=True traces (see _naming.module_names);
3. `shape` / `compile` / `position`: GEMM (K, N) matched to the model's linears (or linears
   inferred from the trace when no model is given; unmatched GEMMs are `linear[K×N]`),
   attention / embedding by op name, Triton kernels by the ops their name fuses, and
   everything else by where it sits between those anchors (_naming.position_names).
Layers: explicit (layers.N range, decoder-layer module) or counted: a layer starts when the
stage order input_norm < q/k/v/qkv < attention < o < post_attention_norm < gate/gate_up < down
goes back, and the count restarts at each embedding. Embedding, final_norm, lm_head and
`other` (model work outside the canonical operators: masks, position ids, sampling) have no
layer. Steps: the ProfilerStep#N range around the launch (any thread, as a last resort).
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from trace_roofline import _naming
from trace_roofline._nest import KeySpace, Nest, to_ns
from trace_roofline.models import ModelSpec
from trace_roofline.trace import Trace

# One row per timed unit, in the trace's device-row order (file order of the events).
ATTRIBUTED_COLUMNS = {
    "event_id": "int64",  # trace.device event_id; for CPU-only traces the unit's op_id
    "name": "str",  # kernel name (or cpu op name)
    "kind": "str",  # kernel | memcpy | memset | cpu_op
    "stream": "Int64",
    "ts_us": "float64",
    "dur_us": "float64",
    "op_id": "Int64",  # innermost shape-carrying cpu op (trace.cpu_ops.op_id); NA if unlinked
    "op_name": "str",
    "input_dims": "str",  # raw JSON text of the op's Input Dims (parse with trace.parse_dims)
    "input_types": "str",
    "concrete_inputs": "str",
    "input_strides": "str",  # raw JSON text of the op's Input Strides (0 = broadcast dim)
    "operator": "str",  # canonical operator, `linear[K×N]`, `other` or `unattributed`
    "layer": "Int64",
    "step": "Int64",  # N of the enclosing ProfilerStep#N
    "source": "str",  # annotation | module | shape | compile | position | unattributed
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
    "source": "str",  # the evidence that named most of its time
}

CANONICAL = ("input_norm", "q_proj", "k_proj", "v_proj", "qkv_proj", "rope", "kv_cache",
             "attention", "o_proj", "residual", "post_attention_norm", "gate_proj", "up_proj",
             "gate_up_proj", "act", "down_proj", "embedding", "final_norm", "lm_head")
UNATTRIBUTED = "unattributed"
NON_LAYER = {"embedding", "final_norm", "lm_head"}
# HF module names that say which canonical operator they are
_ALIASES = {"input_layernorm": "input_norm", "post_attention_layernorm": "post_attention_norm",
            "embed_tokens": "embedding", "rotary_emb": "rope", "act_fn": "act"}
_STAGE = {"input_norm": 0, "q_proj": 1, "k_proj": 1, "v_proj": 1, "qkv_proj": 1, "attention": 2,
          "o_proj": 3,
          "post_attention_norm": 4, "gate_proj": 5, "gate_up_proj": 5, "down_proj": 6}
_LAYER_RE = re.compile(r"(?:^|[./:\s])layers?[._\s#]?(\d+)(?:$|[./:\s])")
_STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")
# cpu ops that only wrap others (torch.compile, autograd, CUDA graphs): never units or top ops
_WRAPPER_RE = re.compile(r"^(?:Torch-Compiled Region|TorchDynamo|CompiledFunction|Pregraph bytecode|"
                         r"AOTDispatcher|## |cudaGraph|autograd::engine|Optimizer\.)")
_PS_PER_US = 1_000_000


def attribute(trace: Trace, model: ModelSpec | None = None) -> pd.DataFrame:
    """One row per timed unit with its operator, layer, step and evidence (ATTRIBUTED_COLUMNS).

    `model` names GEMMs by shape in unannotated traces; without it the linears are inferred
    from the trace's own GEMM shapes when they look like a Llama/Qwen layer.
    """
    keys = KeySpace(trace.cpu_ops, trace.runtime, trace.flows, trace.annotations,
                    trace.python_frames)
    ops = _ops_frame(trace.cpu_ops, keys)
    units = _cpu_units(ops) if trace.cpu_only else _device_units(trace, ops, keys)
    units["ann_name"], units["ann_layer"], units["step"] = _annotations(trace.annotations, units,
                                                                        keys)
    inst = _instances(units, ops)
    name, source, layer = _name_instances(inst, ops, trace.python_frames, keys, model)
    return _assemble(units, ops, inst.assign(operator=name, source=source, layer=layer))


def _assemble(units: pd.DataFrame, ops: pd.DataFrame, inst: pd.DataFrame) -> pd.DataFrame:
    """Per unit: its instance's name, source and layer; a unit without an op has only the
    range around it (or is unattributed)."""
    at = inst.index.get_indexer(units["op_idx"].to_numpy())
    has = at >= 0

    def pick(col: str) -> np.ndarray:
        vals = inst[col].to_numpy(dtype=object)
        return vals[np.maximum(at, 0)] if len(vals) else np.full(len(at), None, dtype=object)

    ann = units["ann_name"].to_numpy(dtype=object)
    named = ~has & pd.notna(ann)
    operator = np.where(has, pick("operator"), np.where(named, ann, UNATTRIBUTED))
    source = np.where(has, pick("source"), np.where(named, "annotation", UNATTRIBUTED))
    layer = pd.Series(np.where(has, pick("layer"), units["ann_layer"].to_numpy(dtype=object)))
    layer = layer.where(~np.isin(operator, list(NON_LAYER | {UNATTRIBUTED})))
    idx = units["op_idx"].to_numpy()
    out = pd.DataFrame({
        "event_id": units["event_id"].to_numpy(np.int64),
        "name": units["name"].astype(str).to_numpy(dtype=object),
        "kind": units["kind"].astype(str).to_numpy(dtype=object),
        "stream": pd.array(units["stream"], dtype="Int64"),
        "ts_us": units["ts_us"].to_numpy(np.float64),
        "dur_us": units["dur_us"].to_numpy(np.float64),
        "op_id": ops["op_id"].astype("Int64").array.take(idx, allow_fill=True),
    })
    for col, dst in (("name", "op_name"), ("input_dims", "input_dims"),
                     ("input_types", "input_types"), ("concrete_inputs", "concrete_inputs"),
                     ("input_strides", "input_strides")):
        got = pd.Series(ops[col].array.take(idx, allow_fill=True)).astype(object)
        out[dst] = got.where(got.notna(), None).to_numpy()
    out["operator"] = operator.astype(object)
    out["layer"] = pd.array(pd.to_numeric(layer), dtype="Float64").astype("Int64")
    out["step"] = pd.array(units["step"], dtype="Int64")
    out["source"] = source.astype(object)
    return out[list(ATTRIBUTED_COLUMNS)]


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
    src = (a.groupby([*keys, "source"], dropna=False, sort=False)["_ps"].sum().reset_index()
           .sort_values("_ps", ascending=False, kind="stable")
           .drop_duplicates(keys).rename(columns={"source": "_src"}))
    t = t.merge(src[[*keys, "_src"]], on=keys, how="left")
    t["source"] = t.pop("_src")
    t["dur_us"] = t["dur_ps"] / _PS_PER_US
    t["share"] = t["dur_ps"] / total if total else np.nan
    t = t.sort_values(["step", "ts_us"], kind="stable", na_position="first", ignore_index=True)
    return t.astype({"step": "Int64", "layer": "Int64", "kernels": "int64", "ops": "int64",
                     "dur_ps": "int64"})[list(OPERATOR_TABLE_COLUMNS)]


def coverage(attributed: pd.DataFrame) -> dict:
    """kernel_time_us, attributed_time_us, unattributed_time_us, fraction (attributed / total),
    kernels, unattributed_kernels, and the same totals in exact integer picoseconds."""
    ps = _ps(attributed["dur_us"])
    un = (attributed["operator"] == UNATTRIBUTED).to_numpy()
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
    }


# ----------------------------------------------------------------------------------------------
# Units and their launch points
# ----------------------------------------------------------------------------------------------
def _ps(dur_us: pd.Series) -> np.ndarray:
    """Durations as int64 picoseconds: exact for the ns-precision µs Kineto writes."""
    return np.rint(dur_us.to_numpy(np.float64) * _PS_PER_US).astype(np.int64)


def _by_category(col: pd.Series, flag) -> np.ndarray:
    """Evaluate a vectorised str predicate once per distinct value of a column."""
    c = col.astype("category")
    cats = pd.Series(c.cat.categories.astype(str))
    return np.append(np.asarray(flag(cats), dtype=bool), False)[c.cat.codes.to_numpy()]


def _ops_frame(cpu_ops: pd.DataFrame, keys: KeySpace) -> pd.DataFrame:
    """cpu ops with ns bounds, thread key and per-op flags."""
    ops = cpu_ops.reset_index(drop=True).copy()
    ops["s"] = to_ns(ops["ts_us"])
    ops["e"] = ops["s"] + to_ns(ops["dur_us"])
    ops["key"] = keys.codes(ops["pid"], ops["tid"])
    ops["wrapper"] = _by_category(ops["name"], lambda c: c.str.contains(_WRAPPER_RE))
    ops["attn"] = _by_category(ops["name"], _naming.is_attention)
    ops["shaped"] = _by_category(ops["input_dims"], lambda c: c.str.contains(r"\d"))
    return ops


def _cpu_units(ops: pd.DataFrame) -> pd.DataFrame:
    """CPU-only trace: the top-level (outermost non-wrapper) cpu ops are the timed units."""
    real = ~ops["wrapper"].to_numpy()
    depth = np.full(len(ops), -1)
    depth[real] = Nest(ops["s"].to_numpy()[real], ops["e"].to_numpy()[real],
                       ops["key"].to_numpy()[real]).depth
    top = np.flatnonzero(depth == 0)
    u = ops.iloc[top]
    return pd.DataFrame({
        "event_id": u["op_id"].to_numpy(np.int64), "name": u["name"].astype(str).to_numpy(),
        "kind": "cpu_op", "stream": pd.array([pd.NA] * len(u), dtype="Int64"),
        "ts_us": u["ts_us"].to_numpy(), "dur_us": u["dur_us"].to_numpy(),
        "op_idx": top, "top_idx": top, "t": u["s"].to_numpy(), "key": u["key"].to_numpy(),
    })


def _take(values: np.ndarray, idx: np.ndarray, fill) -> np.ndarray:
    """values[idx] where idx >= 0, else fill (values may be empty)."""
    if not len(values):
        return np.full(len(idx), fill)
    return np.where(idx >= 0, values[np.maximum(idx, 0)], fill)


def _device_units(trace: Trace, ops: pd.DataFrame, keys: KeySpace) -> pd.DataFrame:
    """Device rows with their launch point (thread key, ns), launching op and op instance."""
    dev = trace.device.reset_index(drop=True)
    corr = dev["correlation"].astype("Int64").fillna(-1).to_numpy(np.int64)
    # correlation -> the runtime launch; else the flow start event with that id
    rt = trace.runtime.dropna(subset=["correlation"]).drop_duplicates("correlation")
    fl = trace.flows
    fl = fl[fl["ph"].astype(str) == "s"].dropna(subset=["id"]).drop_duplicates("id")
    ri = pd.Index(rt["correlation"].astype("int64")).get_indexer(corr)
    fi = np.where(ri >= 0, -1, pd.Index(fl["id"].astype("int64")).get_indexer(corr))
    has_pt = (ri >= 0) | (fi >= 0)
    pt_key = np.where(ri >= 0, _take(keys.codes(rt["pid"], rt["tid"]), ri, -1),
                      _take(keys.codes(fl["pid"], fl["tid"]), fi, -1))
    pt_t = np.where(ri >= 0, _take(to_ns(rt["ts_us"]), ri, 0), _take(to_ns(fl["ts_us"]), fi, 0))
    # External id of the kernel (else of its runtime launch) -> the launching cpu op
    ext = dev["external_id"].astype("Int64").fillna(-1).to_numpy(np.int64)
    rt_ext = _take(rt["external_id"].astype("Int64").fillna(-1).to_numpy(np.int64), ri, -1)
    ext = np.where(ext > 0, ext, rt_ext)
    op_ext = ops["external_id"].astype("Int64")
    unique = (~op_ext.duplicated(keep=False) & op_ext.notna() & (op_ext > 0)).to_numpy()
    ext_pos = pd.Index(op_ext[unique].astype("int64")).get_indexer(ext)
    launch = np.where((ext > 0) & (ext_pos >= 0), _take(np.flatnonzero(unique), ext_pos, -1), -1)
    s, e, k = ops["s"].to_numpy(), ops["e"].to_numpy(), ops["key"].to_numpy()
    by_time = Nest(s, e, k).innermost(pt_t, pt_key)
    launch = np.where(launch < 0, np.where(has_pt, by_time, -1), launch)
    # the launch point: the runtime call when it lies inside the launching op, else the op start
    linked = launch >= 0
    ls, le, lk = _take(s, launch, 0), _take(e, launch, 0), _take(k, launch, -1)
    inside = has_pt & linked & (pt_key == lk) & (pt_t >= ls) & (pt_t < le)
    t = np.where(inside, pt_t, np.where(linked, ls, pt_t))
    key = np.where(linked, lk, np.where(has_pt, pt_key, -1))
    op_idx = _instance_op(ops, t, key, launch)
    real = np.flatnonzero(~ops["wrapper"].to_numpy())
    top = Nest(s[real], e[real], k[real]).outermost(t, key)
    return pd.DataFrame({
        "event_id": dev["event_id"].to_numpy(np.int64), "name": dev["name"],
        "kind": dev["kind"], "stream": dev["stream"], "ts_us": dev["ts_us"],
        "dur_us": dev["dur_us"], "op_idx": op_idx,
        "top_idx": np.where(top >= 0, _take(real, top, -1), op_idx), "t": t, "key": key,
        "dev_pid": dev["pid"], "dev_stream": dev["stream"], "ts_ns": to_ns(dev["ts_us"]),
    })


def _instance_op(ops: pd.DataFrame, t: np.ndarray, key: np.ndarray,
                 launch: np.ndarray) -> np.ndarray:
    """The outermost attention op around the launch point (SDPA and everything it launches,
    mask preparation, a math fallback's bmm/softmax, are one instance), else the innermost
    shape-carrying op, else the launching op itself; -1 for unlinked units."""
    out = launch.copy()
    for flag, outermost in (("shaped", False), ("attn", True)):  # later wins
        m = np.flatnonzero(ops[flag].to_numpy())
        if len(m):
            nest = Nest(ops["s"].to_numpy()[m], ops["e"].to_numpy()[m], ops["key"].to_numpy()[m])
            hit = nest.outermost(t, key) if outermost else nest.innermost(t, key)
            out = np.where(hit >= 0, _take(m, hit, -1), out)
    return np.where(launch >= 0, out, -1)


# ----------------------------------------------------------------------------------------------
# Ranges: canonical record_function names, layers.N, ProfilerStep#N
# ----------------------------------------------------------------------------------------------
def _canonical(names: pd.Series) -> pd.Series:
    """Canonical operator of a range name: 'q_proj', 'layers.3.q_proj', 'input_layernorm'."""
    last = names.astype("string").str.strip().str.split(r"[./:\s]", regex=True).str[-1]
    last = last.replace(_ALIASES)
    return last.where(last.isin(CANONICAL)).astype(object)


def _annotations(ann: pd.DataFrame, units: pd.DataFrame, keys: KeySpace):
    """Per unit: (canonical range name, layers.N, ProfilerStep N) of the innermost ranges
    around its launch point; unlinked device rows use gpu_user_annotation ranges around them
    on their stream, and for the step any CPU ProfilerStep range around their start."""
    n = len(units)
    per_name = _naming.per_value(ann["name"], lambda u: pd.DataFrame({
        "name": _canonical(u),
        "layer": pd.to_numeric(u.str.extract(_LAYER_RE, expand=False), errors="coerce"),
        "step": pd.to_numeric(u.str.extract(_STEP_RE, expand=False), errors="coerce"),
    }))
    facts = {
        "name": per_name["name"].to_numpy(dtype=object),
        "layer": per_name["layer"].to_numpy(dtype="float64"),
        "step": per_name["step"].to_numpy(dtype="float64"),
    }
    gpu = ann["cat"].astype(str).str.lower().eq("gpu_user_annotation").to_numpy()
    s = to_ns(ann["ts_us"])
    e = s + to_ns(ann["dur_us"])
    cpu_key = keys.codes(ann["pid"], ann["tid"])
    t, key = units["t"].to_numpy(), units["key"].to_numpy()
    out = {f: np.full(n, np.nan, dtype=object) for f in facts}

    def fill(field: str, rows: np.ndarray, mask: np.ndarray, ann_key: np.ndarray,
             q_t: np.ndarray, q_key: np.ndarray) -> None:
        m = np.flatnonzero(mask & pd.notna(facts[field]))
        if not len(m) or not rows.any():
            return
        hit = Nest(s[m], e[m], ann_key[m]).innermost(q_t, q_key)
        cur = out[field][rows]
        out[field][rows] = np.where(pd.isna(cur) & (hit >= 0), _take(facts[field][m], hit, None),
                                    cur)

    everyone = np.ones(n, dtype=bool)
    for field in facts:
        fill(field, everyone, ~gpu, cpu_key, t, key)
    if "dev_pid" in units and (key < 0).any():
        lost = key < 0
        gkeys = KeySpace(pd.DataFrame({"pid": units["dev_pid"], "tid": units["dev_stream"]}))
        ann_gkey = gkeys.codes(ann["pid"], ann["tid"])
        q_t = units["ts_ns"].to_numpy()[lost]
        q_key = gkeys.codes(units["dev_pid"], units["dev_stream"])[lost]
        for field in facts:
            fill(field, lost, gpu, ann_gkey, q_t, q_key)
    # the step, as a last resort: a CPU ProfilerStep range on any thread around the launch
    # (or, for an unlinked device row, around the kernel's start)
    nostep = pd.isna(out["step"])
    if nostep.any():
        q_t = np.where(key >= 0, t, units["ts_ns"].to_numpy() if "ts_ns" in units else t)[nostep]
        fill("step", nostep, ~gpu, np.zeros(len(ann), np.int64), q_t, np.zeros(len(q_t), np.int64))
    as_int = lambda v: pd.array(pd.to_numeric(pd.Series(v), errors="coerce"),  # noqa: E731
                                dtype="Float64").astype("Int64")
    name = pd.Series(out["name"], dtype=object)
    return name.where(name.notna(), None).to_numpy(), as_int(out["layer"]), as_int(out["step"])


# ----------------------------------------------------------------------------------------------
# Op instances and their names
# ----------------------------------------------------------------------------------------------
def _instances(units: pd.DataFrame, ops: pd.DataFrame) -> pd.DataFrame:
    """One row per op instance (index: op_idx), in launch order within (step, thread)."""
    op_idx = units["op_idx"].to_numpy()
    oi, first = np.unique(op_idx, return_index=True)
    first, oi = first[oi >= 0], oi[oi >= 0]
    names = ops["name"].astype("category")

    def take(col: str) -> np.ndarray:
        return units[col].to_numpy(dtype=object)[first]

    step = units["step"].astype("Int64").to_numpy(dtype=np.int64, na_value=-1)[first]
    key = units["key"].to_numpy()[first]
    inst = pd.DataFrame({
        "t": ops["s"].to_numpy()[oi], "key": key,
        "step": pd.array(np.where(step >= 0, step, 0), dtype="Int64"),
        "ann_name": take("ann_name"),
        "ann_layer": units["ann_layer"].astype("Int64").to_numpy()[first],
        "op_name": names.to_numpy()[oi],
        "top_name": names.to_numpy()[units["top_idx"].to_numpy()[first]],
        "input_dims": ops["input_dims"].to_numpy()[oi],
    }, index=pd.Index(oi, name="op_idx"))
    inst["step"] = inst["step"].where(step >= 0)
    inst["grp"] = pd.factorize(step * (int(key.max(initial=0)) + 2) + key + 1)[0]
    return inst.sort_values(["grp", "t"], kind="stable")


def _gemm_shapes(inst: pd.DataFrame) -> pd.DataFrame:
    base = _naming.base_name(inst["op_name"]).fillna("")
    k, n = _naming.gemm_kn(base, inst["input_dims"])
    return inst.assign(K=k, N=n)


def _linears(inst: pd.DataFrame, model: ModelSpec | None) -> dict[str, tuple[int, int]] | None:
    """The model's linears if any GEMM of the trace matches them, else linears inferred."""
    gemms = inst[inst["K"] >= 0]
    seen = set(zip(gemms["K"].tolist(), gemms["N"].tolist(), strict=True))
    if model is not None:
        lin = _naming.model_linears(model)
        if seen & set(lin.values()):
            # one layout per trace: the fused projections replace the separate ones they cover
            for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")),
                                 ("gate_up_proj", ("gate_proj", "up_proj"))):
                drop = parts if lin[fused] in seen else (fused,)
                lin = {k: v for k, v in lin.items() if k not in drop}
            return lin
    per = gemms.groupby(["K", "N"]).size().rename("count").reset_index()
    return _naming.infer_linears(per) if len(per) else None


def _name_instances(inst: pd.DataFrame, ops: pd.DataFrame, frames: pd.DataFrame,
                    keys: KeySpace, model: ModelSpec | None):
    """(operator, source, layer) per instance: annotation > module frames > position."""
    if inst.empty:
        empty = pd.Series(dtype=object)
        return empty, empty, pd.Series(dtype="Int64")
    inst = _gemm_shapes(inst)
    gemm = _naming.name_gemms(inst, _linears(inst, model))
    pos_name, pos_src = _naming.position_names(inst, gemm)
    mod = _naming.module_frames(frames)
    mod_name = pd.Series(pd.NA, index=inst.index, dtype="string")
    mod_layer = pd.Series(pd.NA, index=inst.index, dtype="Int64")
    if len(mod):
        mod["s"] = to_ns(mod["ts_us"])
        mod["e"] = mod["s"] + to_ns(mod["dur_us"])
        mod["key"] = keys.codes(mod["pid"], mod["tid"])
        mod_name, mod_layer = _naming.module_names(
            inst["t"].to_numpy(), inst["key"].to_numpy(), mod, pos_name)
    ann = inst["ann_name"].astype("string")
    name = ann.fillna(mod_name).fillna(pos_name)
    source = pd.Series(np.where(ann.notna(), "annotation",
                                np.where(mod_name.notna(), "module", pos_src)),
                       index=inst.index, dtype=object)
    explicit = inst["ann_layer"].astype("Int64").fillna(mod_layer)
    layer = explicit.fillna(_segment_layers(name, inst["grp"]))
    return name.astype(object), source, layer.astype("Int64")


def _segment_layers(name: pd.Series, grp: pd.Series) -> pd.Series:
    """Count layers along each sequence: a new one starts where the stage order goes back, and
    the count restarts at each embedding (several forward passes in one profiler step)."""
    emb = name.eq("embedding").to_numpy()
    g_arr = grp.to_numpy()
    first_emb = emb & ~np.r_[False, emb[:-1] & (g_arr[1:] == g_arr[:-1])]
    fwd = pd.Series(first_emb.astype(int), index=name.index).groupby(grp).cumsum()
    seq = pd.Series(pd.factorize(pd.MultiIndex.from_arrays([g_arr, fwd.to_numpy()]))[0],
                    index=name.index)
    stage = name.map(_STAGE).astype("float64")
    st = stage.dropna()
    g = seq.loc[st.index]
    prev = st.groupby(g).shift(1)
    new = prev.isna() | (st < prev)
    at_stage = new.astype(int).groupby(g).cumsum() - 1
    layer = pd.Series(np.nan, index=name.index)
    layer.loc[at_stage.index] = at_stage.to_numpy()
    layer = layer.groupby(seq).ffill()
    layer = layer.where(~name.isin(NON_LAYER | {"other"}))
    return pd.Series(pd.array(layer, dtype="Float64").astype("Int64"), index=name.index)
