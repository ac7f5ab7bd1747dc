"""Naming a graph without a template: layers found from its fused-attention runs and GEMM
counts, checked to repeat, each GEMM named by its place in the model's layer layout and the
kernels between them as an eager trace's ops would be.

Design notes: docs/design.md ("trace_roofline/attribution/graphs.py").
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from trace_roofline.attribution import explain
from trace_roofline.attribution.graph_align import Named, align
from trace_roofline.attribution.graph_naming import (
    ATTENTION_OP,
    GEMM,
    GraphKernels,
    GraphNaming,
    empty_positions,
    kernel_ops,
    kernel_roles,
    nearest,
)
from trace_roofline.attribution.graph_shapes import (
    EXPERT_GEMMS,
    SHARED_EXPERT_GATE,
    KernelHints,
    StepShapes,
    user_shapes,
)
from trace_roofline.model import kernels, operators
from trace_roofline.model.models import ModelSpec
from trace_roofline.model.operators import Name
from trace_roofline.options import DecodeShapes

LAYER_MATCH = 0.75  # share of a layer's kernels that must repeat in the last layer (kernel_name)
_TRITON_SUFFIX = re.compile(r"_\d+$")
_PRE = {3: (Name.Q_PROJ, Name.K_PROJ, Name.V_PROJ), 1: (Name.QKV_PROJ,)}
Layouts = dict[int, tuple[str, ...]]  # GEMM count -> their operators, in launch order
_POST: Layouts = {4: (Name.O_PROJ, Name.GATE_PROJ, Name.UP_PROJ, Name.DOWN_PROJ),
                  3: (Name.O_PROJ, Name.GATE_UP_PROJ, Name.DOWN_PROJ)}
# A sparse layer's GEMMs after attention, as HF transformers 5.x runs them (grouped_mm or
# batched_mm: one GEMM for all experts' gate_up, one for down; vLLM's two fused_moe_kernel
# launches alike). With a shared expert and its sigmoid gate (Qwen2-MoE), HF runs the shared
# expert first and the gate last; vLLM the shared expert (gate_up fused) and its gate first.
_POST_MOE: Layouts = {4: (Name.O_PROJ, Name.ROUTER, Name.EXPERTS_GATE_UP, Name.EXPERTS_DOWN)}
_POST_SHARED: Layouts = {
    8: (Name.O_PROJ, Name.SHARED_GATE_PROJ, Name.SHARED_UP_PROJ, Name.SHARED_DOWN_PROJ,
        Name.ROUTER, Name.EXPERTS_GATE_UP, Name.EXPERTS_DOWN, SHARED_EXPERT_GATE),
    7: (Name.O_PROJ, Name.SHARED_GATE_UP_PROJ, Name.SHARED_DOWN_PROJ, SHARED_EXPERT_GATE,
        Name.ROUTER, Name.EXPERTS_GATE_UP, Name.EXPERTS_DOWN)}


@dataclass(frozen=True)
class Positions:
    """A graph's kernels as its layers place them, per position: kernel name, the op it runs
    (kernel_ops), whether it is named in place (`core`), a split-K reduce (joins the kernel
    before) or a copy (joins the kernel after), the GEMM the layout names there; and each
    layer's first projection."""

    names: np.ndarray
    op: np.ndarray
    core: np.ndarray
    reduce_: np.ndarray
    copy_: np.ndarray
    gemm_name: np.ndarray
    first_q: list[int]


@dataclass(frozen=True)
class _Kernels:
    """What a graph's kernel names say, per position (by_kernel_names)."""

    op: np.ndarray  # kernel_ops', a router's sort and the gathers placed
    reduce_: np.ndarray  # split-K reduces
    copy_: np.ndarray  # copies, memsets and the grouped GEMM's set-up
    gemm: np.ndarray  # weight GEMMs
    attn: np.ndarray  # attention library kernels


def _post_layouts(model: ModelSpec, layers: int) -> Layouts | str:
    """The GEMMs after attention by their count, for `layers` traced layers of `model` (its
    first ones): the dense MLP's, or a sparse layer's (_POST_MOE, _POST_SHARED); a note when
    the traced layers mix dense and sparse ones."""
    sparse = len(model.sparse_among(layers))
    if sparse == 0:
        return _POST
    if sparse < layers:
        return f"{sparse} of {layers} layers sparse: dense and sparse layers mixed"
    e = model.experts
    assert e is not None  # (sparse layers have experts)
    return _POST_SHARED if e.shared_intermediate_size and e.shared_gate else _POST_MOE


def _read_kernels(k: GraphKernels) -> _Kernels:
    """The ops of a graph's kernels and which of them are GEMMs, attention and attached."""
    names, n = k.names, len(k.names)
    op = _topk_sorts(kernel_ops(pd.Series(names, dtype=object)).to_numpy(dtype=object))
    # a row gather after the first GEMM is no embedding (vLLM's pick of the logits' rows);
    # the first kernel, a gather before any GEMM, is (SGLang's vectorized_gather_kernel)
    before = np.cumsum(op == GEMM) == 0
    op = np.where((op == "aten::embedding") & ~before, "aten::index_select", op)
    op = np.where((op == "aten::index") & before & (np.arange(n) == 0), "aten::embedding", op)
    reduce_ = pd.Series(names, dtype=object).str.contains(kernels.GEMM_SECOND_KERNEL).to_numpy()
    # (a copy, a memset and the grouped GEMM's set-up join the kernel after them)
    copy_ = np.isin(k.kinds, ["memset", "memcpy"]) | (op == kernels.GROUPED_GEMM_PREPARE)
    core = ~reduce_ & ~copy_
    # attention library kernels mark the layers; Inductor's Triton kernels that prepare SDPA's
    # inputs (named after it) are attention too but vary in number between layers
    triton = pd.Series(names, dtype=object).str.startswith("triton_").to_numpy(bool)
    return _Kernels(op, reduce_, copy_, core & (op == GEMM), core & (op == ATTENTION_OP) & ~triton)


def _layout(kn: _Kernels, model: ModelSpec | None) -> tuple[np.ndarray, int, int, Layouts] | str:
    """(the GEMMs before each layer's attention run, q/k/v GEMMs, GEMMs after, the layouts after
    attention) of a graph's layers, or why they cannot be read."""
    g_before = np.cumsum(kn.gemm) - kn.gemm  # GEMMs before each position
    clusters = np.unique(g_before[kn.attn])  # one attention run per layer: GEMMs split them
    layers = len(clusters)
    if model is None or layers < 2:
        return ("no model" if model is None else
                f"{layers} fused-attention run(s): no repeated layer to rest names on")
    per_gap = np.diff(clusters)
    if not (per_gap == per_gap[0]).all():
        return f"GEMMs between attention runs differ ({sorted(set(per_gap.tolist()))})"
    posts = _post_layouts(model, layers)
    if isinstance(posts, str):
        return posts
    layout = [(pre, post) for pre in _PRE for post in posts if pre + post == per_gap[0]]
    total = int(kn.gemm.sum())
    if len(layout) != 1 or clusters[0] < layout[0][0] or total - clusters[-1] < layout[0][1]:
        return (f"{per_gap[0]} GEMMs per layer fit no layout of {model.name}'s layers "
                f"({' / '.join(', '.join(p) for p in posts.values())} after attention)")
    return clusters, layout[0][0], layout[0][1], posts


def by_kernel_names(k: GraphKernels, model: ModelSpec | None, shapes: DecodeShapes | None,
                    named: GraphNaming) -> Named:
    """Layers from fused-attention runs and GEMM counts, checked to repeat; no table (with a
    note) when the sequence does not support naming."""
    kn = _read_kernels(k)
    found = _layout(kn, model)
    if isinstance(found, str):
        return None, dataclasses.replace(named, note=found)
    assert model is not None  # (a layout was read against it)
    clusters, pre, post, posts = found
    g_pos = np.flatnonzero(kn.gemm)
    gemm_name = np.full(len(k.names), None, dtype=object)
    first_q = []
    for c in clusters:
        for i, nm in enumerate(_PRE[pre]):
            gemm_name[g_pos[c - pre + i]] = nm
        for i, nm in enumerate(posts[post]):
            gemm_name[g_pos[c + i]] = nm
        first_q.append(g_pos[c - pre])
    rest = g_pos[clusters[-1] + post:]
    if len(rest) == 1:
        gemm_name[rest[0]] = Name.LM_HEAD
    downs = g_pos[clusters + post - 1]
    why = _layers_differ(k.names, kn.gemm, kn.attn, first_q, downs)
    if why:
        return None, dataclasses.replace(named, note=why)
    gathers = _weight_gathers(kn.op, gemm_name, np.isin(k.kinds, ["memset", "memcpy"]))
    core = ~kn.reduce_ & ~kn.copy_
    at = Positions(k.names, kn.op, core & ~gathers, kn.reduce_, kn.copy_ | gathers, gemm_name,
                   first_q)
    return _position_table(at, model, shapes, named)


def _weight_gathers(op: np.ndarray, gemm_name: np.ndarray, mem: np.ndarray) -> np.ndarray:
    """batched_mm's gathers of its experts' weights, per position: an `index` kernel whose next
    kernel, past memsets and copies (`mem`), is an expert GEMM. They join that GEMM, as an
    eager trace names the gather after the GEMM it feeds (gemm_names.name_gemms); grouped_mm's
    token gathers have the dispatch's kernels and the GEMM's prepare kernel in between."""
    n = len(op)
    later = nearest(np.where(mem, -1, np.arange(n)), False)  # the next non-copy, from here on
    nxt = np.r_[later[1:], -1]
    fed = np.where(nxt >= 0, gemm_name[np.maximum(nxt, 0)], None)  # type: ignore[call-overload]  # (stubs refuse None)
    return (op == "aten::index") & pd.Series(fed, dtype=object).isin(EXPERT_GEMMS).to_numpy()


def _topk_sorts(op: np.ndarray) -> np.ndarray:
    """torch.topk's own sort: a sort kernel right after a top-k kernel is part of the top-k
    (the router's), not the token sort of the dispatch."""
    after_topk = np.r_[False, op[:-1] == "aten::topk"]
    return np.where((op == "aten::sort") & after_topk, "aten::topk", op)


def _layers_differ(names: np.ndarray, gemm: np.ndarray, attn: np.ndarray, first_q: list[int],
                   downs: np.ndarray) -> str | None:
    """Why the layers (first projection .. down_proj) do not repeat one kernel pattern, or None:
    their GEMM kernels must be the same names in the same order around one attention run (its
    kernels may differ between layers: a sliding-window layer runs another attention kernel,
    gpt-oss's unified_attention_2d against _3d + reduce_segments), and each layer's whole
    kernel sequence must share >= LAYER_MATCH of the longer one with the last layer's (Triton
    kernels compared without their numeric suffix; torch.compile may schedule the model's RoPE
    table kernels into layer 0)."""
    canon = pd.Series(names, dtype=object).str.replace(_TRITON_SUFFIX, "", regex=True)
    codes = pd.factorize(canon)[0]
    shape = np.where(attn, -1, codes)  # every attention kernel one code
    spans = [slice(q, d + 1) for q, d in zip(first_q, downs, strict=True)]
    cores = {_runs(shape[sp][(gemm | attn)[sp]]) for sp in spans}
    if len(cores) != 1:
        return "layers do not repeat one sequence of GEMM and attention kernels"
    ref = codes[spans[-1]]
    for sp in spans[:-1]:
        body = codes[sp]
        if (align(body, ref) >= 0).sum() < LAYER_MATCH * max(len(body), len(ref)):
            return "layers do not repeat one kernel sequence"
    return None


def _runs(seq: np.ndarray) -> tuple[int, ...]:
    """The sequence with each run of equal codes kept once."""
    keep = np.r_[True, seq[1:] != seq[:-1]] if len(seq) else np.zeros(0, bool)
    return tuple(seq[keep].tolist())


def _position_table(at: Positions, model: ModelSpec, shapes: DecodeShapes | None,
                    named: GraphNaming) -> Named:
    """Name the core kernels as eager ops would be named (position_names), attach reduces and
    copies, give layers, group instances and add user shapes."""
    names, op = at.names, at.op
    n = len(names)
    idx = np.flatnonzero(at.core)
    is_gemm = np.isin(op[idx], [GEMM, kernels.FP32_GEMM])
    pseudo = np.where(is_gemm, "aten::mm", np.where(op[idx] == "", "kernel", op[idx]))
    inst = pd.DataFrame({
        "grp": np.zeros(len(idx), np.int64),
        "op_name": pd.Series(pseudo, dtype=object),
        "top_name": pd.Series(pseudo, dtype=object),
        "input_dims": pd.Series([None] * len(idx), dtype=object),
        "K": np.where(is_gemm, 0, -1),
        "role": kernel_roles(names[idx]),  # the registry's: a norm, RoPE, KV write, ... kernel
    })
    # a GEMM that is no weight of the model (the fp32 RoPE table product) is named by its place,
    # as an unmatched `linear[K×N]` GEMM of an eager trace is
    gemm = pd.Series(np.where((op[idx] == kernels.FP32_GEMM), "linear[fp32]", at.gemm_name[idx]),
                     dtype="string")
    found, _ = explain.position_names(inst, gemm, qk_norm=model.qk_norm)
    name = np.full(n, None, dtype=object)
    name[idx] = found.to_numpy(dtype=object)
    src = np.where(at.core, np.arange(n), -1)
    prev, nxt = nearest(src, True), nearest(src, False)
    take = np.where(at.reduce_, prev, np.where(at.copy_, nxt, src))
    name = np.where(take >= 0, name[np.maximum(take, 0)], None)  # type: ignore[call-overload]
    # a collective kernel (a TP rank's all-reduce) is its collective wherever it sits
    coll = operators.collective_of(pd.Series(names, dtype=object), kernel=True)
    name = np.where(coll.notna().to_numpy() & at.core,
                    coll.to_numpy(dtype=object, na_value=None), name)
    cats = pd.Index(pd.unique(name[pd.notna(name)]))
    codes = cats.get_indexer(name)
    lay = _layers(name, at.first_q)
    res = empty_positions(n)
    res["operator"] = np.where(pd.notna(name), name, Name.UNATTRIBUTED)
    res["layer"] = pd.arrays.IntegerArray(np.maximum(lay, 0), lay < 0)
    gathers = at.copy_ & (op == "aten::index")  # batched_mm's weight gathers (_weight_gathers)
    change = (codes[1:] != codes[:-1]) | (lay[1:] != lay[:-1]) | gathers[1:] | gathers[:-1]
    # a run of one operator in one layer; a weight gather is an instance of its own, as eager
    res["inst"] = np.cumsum(np.r_[True, change]) - 1
    res["evidence"] = np.where(pd.notna(name), "kernel_name", operators.FALLBACK)
    res["how"] = np.where(pd.notna(name), "named", "none")
    named = dataclasses.replace(named, method="kernel_name")
    if shapes is not None:
        user_shapes(res, model, shapes, KernelHints(
            gathers, at.gemm_name, np.asarray(kernel_roles(names).astype(object))))
        named = dataclasses.replace(
            named, shapes="step" if isinstance(shapes, StepShapes) else "user")
    return res, named


def _layers(name: np.ndarray, first_q: list[int]) -> np.ndarray:
    """Layer per position (-1: none): layer k starts at its input norm (the input_norm kernels
    right before its first projection), so the residual add after down_proj stays in the layer
    before; model-level operators have none."""
    starts = []
    for q in first_q:  # one step per layer
        b = q
        while b > 0 and name[b - 1] == Name.INPUT_NORM:
            b -= 1
        starts.append(b)
    lay = np.searchsorted(np.asarray(starts), np.arange(len(name)), side="right") - 1
    model_level = pd.Series(name, dtype=object).isin(operators.MODEL_LEVEL).to_numpy()
    return np.where(model_level | pd.isna(name), -1, lay)
