"""The operator, evidence, layer and reason of each op instance: annotation > module frames >
position (shapes and order), collectives by their op or kernel, a training step's backward and
optimizer apart, MLP and MoE projections by their layer.

Design notes: docs/design.md ("trace_roofline/attribution/attribute.py").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from trace_roofline.attribution import (
    explain,
    gemm_names,
    inference,
    layer_linears,
    naming,
    nn_modules,
    op_families,
)
from trace_roofline.attribution.codes import (
    Coded,
    Labels,
    by_category,
    categorical,
    coalesce,
    take_cat,
    unify,
)
from trace_roofline.attribution.nest import KeySpace, to_ns
from trace_roofline.attribution.training import training_names
from trace_roofline.model import kernels, models, operators
from trace_roofline.model.models import ModelSpec
from trace_roofline.model.operators import Name

FALLBACK = operators.FALLBACK
_NO_DECODER = "no decoder-layer operator in the trace: each op keeps its own name"
# A dense MLP's projection and the MoE operator of the same shape (a shared expert's, Mixtral's
# experts when a model also has dense layers): which one a GEMM is depends on its layer.
_DENSE_OF = {**{v: k for k, v in operators.SHARED_OF.items()},
             Name.EXPERTS_GATE_UP: Name.GATE_UP_PROJ, Name.EXPERTS_DOWN: Name.DOWN_PROJ}
_ROUTED_EVIDENCE = (Name.ROUTER, Name.MOE_DISPATCH)
_PER_LAYER = [o.name for o in operators.OPERATORS if o.per_layer]
_GROUPED_OPS = ["_grouped_mm", "inplace_fused_experts", "outplace_fused_experts"]


@dataclass(frozen=True)
class TraceOps:
    """What naming reads of the trace besides the instances: its cpu ops (units.ops_frame),
    Python frames and thread keys."""

    ops: pd.DataFrame
    frames: pd.DataFrame
    keys: KeySpace


def _collective(name: str, kernel: bool) -> str | None:
    text = name if kernel else name.rsplit("::", 1)[-1]
    for op in operators.COLLECTIVES:
        rx = op.kernels if kernel else op.ops
        if rx is not None and rx.search(text):
            return op.name
    return None


def collective_names(names: pd.Categorical, kernel: bool = False) -> pd.Categorical:
    """Per row, the collective its name is (operators.collective_of: of an op's base name, with
    `kernel` of a kernel name), read once per distinct name; missing where none."""
    per = [_collective(str(v), kernel) for v in names.categories]
    found = sorted({p for p in per if p is not None})
    index = {c: i for i, c in enumerate(found)}
    codes = np.array([*(-1 if p is None else index[p] for p in per), -1], dtype=np.int64)
    return pd.Categorical.from_codes(codes[names.codes], found)


def name_instances(inst: pd.DataFrame, trace_ops: TraceOps, model: ModelSpec | None,
                   whole: bool = False
                   ) -> tuple[pd.Categorical, pd.Categorical, pd.arrays.IntegerArray,
                              pd.Categorical]:
    """(operator, evidence, layer, reason) per instance: annotation > module frames > position;
    a name outside the vocabulary is a fallback (`_fallbacks`). `whole`: the trace's only model,
    whose attention geometry every op of the trace may show."""
    n = len(inst)
    if not n:
        empty = pd.Categorical.from_codes(np.zeros(0, np.int8), [])
        return empty, empty, pd.array([], dtype="Int64"), empty
    backward = np.asarray(inst["training"].array.isin(["backward", Name.OPTIMIZER]), dtype=bool)
    # (backward GEMMs run the transposed shapes)
    linears = _linears(inst[~backward], model, trace_ops.ops if whole else None)
    gemm = gemm_names.name_gemms(inst, linears)
    placement = model.architecture.placement if model is not None else None
    # the model's q/k norms (OLMo2's over the whole projection too), else the shapes say
    qk_norm = True if model is not None and model.qk_norm else None
    pos_name, pos_evidence, pos_reason = explain.explain(inst, gemm, qk_norm, placement)
    mod_name, mod_layer = _module_names(inst, trace_ops, pos_name)
    ann = inst["ann_name"].array
    (a, m, p), cats = unify(ann, mod_name, categorical(pos_name))
    by_range = (a >= 0) | (m >= 0)
    name = Coded(np.where(a >= 0, a, np.where(m >= 0, m, p)), cats)
    (ea, em, ep), ev_cats = unify("annotation", "module", categorical(pos_evidence))
    evidence = Coded(np.where(a >= 0, ea, np.where(m >= 0, em, ep)), ev_cats)
    pos_reason = categorical(pos_reason)
    reason = Coded(np.where(by_range, -1, pos_reason.codes.astype(np.int64)),
                   pos_reason.categories)
    name, evidence = _collectives(inst, name, evidence)
    reason = Coded(np.where(name.isin(operators.COMMUNICATION), -1, reason.codes), reason.cats)
    name, own = _without_decoder(name, inst["op_name"].array)
    if own.any():
        re_cats = reason.cats.append(pd.Index([_NO_DECODER])).unique()
        reason = Coded(np.where(own & (reason.codes < 0), re_cats.get_loc(_NO_DECODER),
                                reason.codes), re_cats)
    if backward.any():
        trained = training_names(inst, backward, Labels(name, evidence, reason), linears or {})
        name, evidence, reason = trained.name, trained.evidence, trained.reason
    grp = inst["grp"].to_numpy()
    by_place = segment_layers(name.codes, name.cats, grp)
    # (a recomputation's layer is not told by its place: backward runs the layers in reverse)
    by_place[np.asarray(inst["training"].array == "recompute", dtype=bool)] = pd.NA
    layer = coalesce(inst["ann_layer"].array, mod_layer, by_place)
    name = _mlp_by_layer(name, evidence, layer, grp)
    return name.categorical(), _fallbacks(name, evidence), layer, reason.categorical()


def _module_names(inst: pd.DataFrame, trace_ops: TraceOps, position: pd.Series
                  ) -> tuple[pd.Categorical, pd.api.extensions.ExtensionArray]:
    """Per instance, the operator and layer its nn.Module frames say (missing: none)."""
    n = len(inst)
    name = pd.Categorical.from_codes(np.full(n, -1, np.int8), [])
    layer = pd.arrays.IntegerArray(np.zeros(n, np.int64), np.ones(n, bool))
    mod = module_frames(trace_ops.frames) if len(trace_ops.frames) else trace_ops.frames
    if not len(mod):
        return name, layer
    mod["s"] = to_ns(mod["ts_us"])
    mod["e"] = mod["s"] + to_ns(mod["dur_us"])
    mod["key"] = trace_ops.keys.codes(mod["pid"], mod["tid"])
    named, by_module = nn_modules.module_names(inst["t"].to_numpy(), inst["key"].to_numpy(),
                                               mod, position)
    return categorical(named), by_module.array


def _linears(inst: pd.DataFrame, model: ModelSpec | None,
             ops: pd.DataFrame | None = None) -> dict[str, tuple[int, int]] | None:
    """The model's linears if any GEMM of the trace matches them, else linears inferred (with
    the experts of its grouped GEMMs, layer_linears.infer_moe_linears)."""
    gemms = inst.loc[inst["K"] >= 0, ["K", "N", "W"]]
    weights = inst.loc[inst["WK"] >= 0, ["WK", "WN"]].set_axis(["K", "N"], axis=1)
    seen = set(map(tuple, pd.concat([gemms[["K", "N"]], weights]).drop_duplicates()
                   .to_numpy().tolist()))
    if model is not None:
        lin = _model_linears(model, inst, gemms, seen)
        if lin is not None:
            return lin
    # an Inductor kernel of W weights counts as its W parts (gate and up, k and v): the
    # layout is inferred unfused, and name_gemms names the kernel after the fusion of its parts
    unfused = gemms.loc[gemms.index.repeat(gemms["W"].to_numpy())]
    unfused = unfused.assign(N=unfused["N"] // unfused["W"])
    per = unfused.groupby(["K", "N"]).size().rename("count").reset_index()
    if not len(per):
        return None
    moe = layer_linears.infer_moe_linears(per, _expert_weights(inst))
    kn = list(zip(per["K"], per["N"], strict=True))
    rest = per[[p not in moe.values() for p in kn]]
    calls = op_families.attention_calls(inst)
    dense = layer_linears.infer_linears(rest, calls) or {}
    if not {Name.Q_PROJ, Name.QKV_PROJ} & set(dense) and len(rest):  # a layout the counts miss
        geometry = inference.attention_geometry(inst["op_name"], inst["input_dims"])
        if geometry is None and ops is not None:  # (an eager attention's matmuls wrap bmm's)
            geometry = inference.attention_geometry(ops["name"], ops["input_dims"])
        h = layer_linears.hidden_size(per)
        counts = {(int(k), int(n)): int(x)
                  for k, n, x in rest[["K", "N", "count"]].itertuples(index=False)}
        dense = (inference.infer_layout(counts, geometry, h, calls) if geometry else None) or dense
    return dense | moe or None


def _model_linears(model: ModelSpec, inst: pd.DataFrame, gemms: pd.DataFrame,
                   seen: set) -> dict[str, tuple[int, int]] | None:
    """The model's linears, in the one form (fused or not) the trace holds, if any GEMM of
    the trace (`seen`: its (K, N)) matches them; else None."""
    lin = layer_linears.with_moe_linears(models.expected_linears(model), model)
    if not seen & set(lin.values()):
        return None
    # (K, N) of plain GEMMs: a shared expert's fused gate_up is told by those, not by the
    # routed experts' stacked GEMM of the same (K, N)
    plain = set(map(tuple, gemms.loc[inst.loc[gemms.index, "WE"] < 0, ["K", "N"]]
                    .drop_duplicates().to_numpy().tolist())) if "WE" in inst else seen
    for fused, parts in operators.FUSIONS:  # a trace holds one form
        if fused in lin:
            drop = parts if lin[fused] in (
                seen if fused.startswith("experts") else plain) else (fused,)
            lin = {k: v for k, v in lin.items() if k not in drop}
    return lin


def _expert_weights(inst: pd.DataFrame) -> pd.DataFrame:
    """The expert weights (columns E, K, N) of the grouped GEMMs that multiply all experts at
    once: `_grouped_mm`, an engine's fused experts, and batched_mm's `index` gathers of the
    [E, N, K] weights that feed a weight-first `bmm` of the same (K, N)."""
    base = naming.Names.of(inst["op_name"]).mapped(operators.base_names)
    has = (inst["WE"] >= 0).to_numpy()
    wk, wn = inst["WK"].to_numpy(np.int64), inst["WN"].to_numpy(np.int64)
    kn = wk * (int(wn.max(initial=0)) + 1) + wn  # one key per (K, N)
    gathered = base.isin(["index"]) & has & np.isin(kn, kn[has & base.isin(["bmm"])])
    grouped = base.isin(_GROUPED_OPS) | \
        by_category(inst["op_name"], lambda c: c.str.contains(kernels.INDUCTOR_GROUPED_MM))
    return inst.loc[(grouped & has) | gathered,
                    ["WE", "WK", "WN"]].set_axis(["E", "K", "N"], axis=1)


def module_frames(frames: pd.DataFrame) -> pd.DataFrame:
    """nn_modules.module_frames, evaluated once per distinct frame name and mapped back to rows
    (class and kind as categoricals)."""
    names = categorical(frames["name"])
    per = nn_modules.module_frames(pd.DataFrame({
        "name": np.asarray(names.categories, dtype=object), "_cat": np.arange(len(names.categories))
    }))
    pos = np.full(len(names.categories) + 1, -1)
    pos[per["_cat"].to_numpy(np.int64)] = np.arange(len(per))
    at = pos[names.codes]
    rows = np.flatnonzero(at >= 0)
    mod = frames.iloc[rows].reset_index(drop=True)
    for col in per.columns.difference(["name", "_cat"], sort=False):
        v = per[col]
        mod[col] = (take_cat(categorical(v), at[rows]) if pd.api.types.is_string_dtype(v)
                    else v.array.take(at[rows]))
    return mod


def _mlp_by_layer(name: Coded, evidence: Coded, layer: pd.arrays.IntegerArray,
                  grp: np.ndarray) -> Coded:
    """Dense-MLP and MoE names by layer: in a layer holding a router (or a dispatch), a GEMM
    named as a dense MLP projection is the shared expert's (gate_proj -> shared_gate_proj);
    in a layer without one, a GEMM named by its shape as a shared-expert or expert projection
    is the dense MLP's (the model's dense layers, whose shapes a MoE GEMM also has)."""
    if not np.isin(np.asarray(name.cats, dtype=object), [*_DENSE_OF, *_ROUTED_EVIDENCE]).any():
        return name  # a dense model's trace: nothing to tell apart
    cats = name.cats.append(pd.Index([v for v in [*_DENSE_OF, *_DENSE_OF.values()]
                                      if v not in name.cats])).unique()
    name = Coded(name.codes, cats)
    in_layer = ~np.asarray(layer.isna())
    if not in_layer.any():
        return name
    key = pd.DataFrame({"g": grp, "l": layer.to_numpy(np.int64, na_value=-1)})
    routed = (pd.Series(name.isin(_ROUTED_EVIDENCE)).groupby([key["g"], key["l"]])
              .transform("any").to_numpy(bool))
    code = {c: i for i, c in enumerate(cats)}
    by_shape = evidence.isin("shape")
    out = name.codes.copy()
    for moe_name, dense_name in _DENSE_OF.items():
        dense_rows = name.codes == code[dense_name]
        moe_rows = name.codes == code[moe_name]
        if moe_name in operators.SHARED_OF.values():  # the shared expert's projections
            out[dense_rows & in_layer & routed] = code[moe_name]
        out[moe_rows & in_layer & ~routed & by_shape] = code[dense_name]
    return Coded(out, cats)


def _collectives(inst: pd.DataFrame, name: Coded, evidence: Coded) -> tuple[Coded, Coded]:
    """Instances that are collectives take the collective's name, whatever else named them:
    by their op or the outermost op around it, else by a kernel (evidence `kernel_name`)."""
    by_op = collective_names(inst["op_name"].array)
    by_top = collective_names(inst["top_name"].array)
    (nm, o, t, k), cats = unify(name.categorical(), by_op, by_top, inst["kernel_coll"].array)
    op_level = np.where(o >= 0, o, t)
    named = Coded(np.where(op_level >= 0, op_level, np.where(k >= 0, k, nm)), cats)
    (er, ek), ev_cats = unify(evidence.categorical(), "kernel_name")
    return named, Coded(np.where((op_level >= 0) | (k >= 0), ek, er), ev_cats)


def _without_decoder(name: Coded, op_name: pd.Categorical) -> tuple[Coded, np.ndarray]:
    """In a trace where no instance got a decoder-layer operator's name (a CNN, a matmul loop),
    `other` would name everything: each such instance keeps its op's own name instead. Also
    returns which rows took their op's name."""
    if Name.OTHER not in name.cats or name.isin(_PER_LAYER).any():
        return name, np.zeros(len(name.codes), dtype=bool)
    (nm, op), shared = unify(name.categorical(), op_name)
    own = (nm == shared.get_loc(Name.OTHER)) & (op >= 0)
    return Coded(np.where(own, op, nm), shared), own


def _fallbacks(name: Coded, evidence: Coded) -> pd.Categorical:
    """The evidence per instance, `fallback` wherever the name is outside the vocabulary
    (`other`, `linear[K×N]`, an op's own name): whatever rule gave it, no evidence backs it."""
    ev_cats = evidence.cats.append(pd.Index([FALLBACK])).unique()
    return pd.Categorical.from_codes(np.where(name.isin(operators.NAMES), evidence.codes,
                                              ev_cats.get_loc(FALLBACK)), ev_cats)


def segment_layers(name: np.ndarray, cats: pd.Index, grp: np.ndarray) -> pd.arrays.IntegerArray:
    """Count layers along each sequence: a new one starts where the stage order goes back, and
    the count restarts at each embedding, or after an lm_head (several forward passes in one
    profiler step; torch.compile fuses the embedding into the first norm).

    `name` holds codes into `cats` (-1: none); rows are sorted by `grp` (then launch time), so
    a group, and a forward pass inside it, is a run of rows."""
    n = len(name)
    emb = np.append(cats == operators.EMBEDDING.name, False)[name]
    new_grp = np.r_[True, grp[1:] != grp[:-1]]
    first_emb = emb & ~np.r_[False, emb[:-1] & ~new_grp[1:]]  # not after one in its group
    head = np.append(cats == Name.LM_HEAD, False)[name]
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
