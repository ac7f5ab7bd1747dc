"""A training step's parts (forward, backward, optimizer, a checkpointed layer's recompute) per
unit, and the names of its backward and optimizer instances.

Design notes: docs/design.md ("trace_roofline/attribution/attribute.py").
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from trace_roofline.attribution import grad_gemms
from trace_roofline.attribution.codes import Coded, Labels, categorical, take
from trace_roofline.attribution.nest import KeySpace, Nest, to_ns
from trace_roofline.attribution.ranges import is_gpu_range
from trace_roofline.attribution.units import matches
from trace_roofline.model import operators
from trace_roofline.model.operators import Name

TRAINING_PARTS = ("forward", "backward", Name.OPTIMIZER, "recompute")
_BACKWARD_FRAME = "autograd::engine::evaluate_function: "
_OPTIMIZER_RE = re.compile(r"^Optimizer\.(?:step|zero_grad)#")
_OPTIMIZER_OPS = re.compile(r"^(?:_foreach_|_fused_adam|_fused_sgd|_fused_adagrad)")
# ops only a forward calls (autograd's backward formulas call mm, silu_backward, ...): inside a
# backward node they are an activation-checkpointed layer's forward, run again
_FORWARD_ONLY = re.compile(r"^(?:linear|scaled_dot_product_attention|_scaled_dot_product_\w+"
                           r"_attention|_flash_attention_forward|_efficient_attention_forward|"
                           r"embedding|silu|gelu|rms_norm|_fused_rms_norm|layer_norm)$")
_GRAD_NODES = (  # autograd node -> the backward operator it is, when the node says
    (re.compile(r"Attention|Sdpa|SDPA|Flash"), operators.grad_of(Name.ATTENTION)),
    (re.compile(r"^Embedding"), operators.grad_of(Name.EMBEDDING)),
    (re.compile(r"^(?:Silu|Gelu|Sigmoid|Relu|Tanh)"), operators.grad_of(Name.ACT)),
    (re.compile(r"^(?:NllLoss|LogSoftmax|CrossEntropy|MseLoss)"), operators.LOSS.name),
)
_BACKWARD_GEMM_NODES = re.compile(r"^(?:Mm|Addmm|Bmm|Baddbmm|Linear|Matmul)Backward")
# an op (or an Inductor kernel, by the aten ops its name fuses) that says what it
# differentiates, where its node does not (a compiled graph's CompiledFunctionBackward): named
# only when one operator's backward matches
_GRAD_OPS = {
    operators.grad_of(Name.ATTENTION): re.compile(r"attention\w*_backward|flash_bwd|attn_bwd"),
    operators.LOSS.name: re.compile(r"nll_loss|log_softmax_backward|cross_entropy"),
    operators.grad_of(Name.EMBEDDING): re.compile(r"embedding_dense_backward"),
    operators.grad_of(Name.ACT): re.compile(r"(?:silu|gelu)_backward"),
}


def _per_op_name(names: pd.Categorical, rx: re.Pattern, base: bool = False) -> np.ndarray:
    """Per op row, whether `rx` matches its name (its base name, `aten::` stripped, with
    `base`), evaluated once per distinct name."""
    distinct = pd.Series(np.asarray(names.categories, dtype=object), dtype="string")
    if base:
        distinct = operators.base_names(distinct)
    return np.append(matches(rx, distinct.astype(object)), False)[names.codes]


def _in_optimizer(units: pd.DataFrame, ops: pd.DataFrame, ann: pd.DataFrame,
                  keys: KeySpace) -> np.ndarray:
    """Per unit, whether it runs inside an `Optimizer.step#` / `Optimizer.zero_grad#` range
    (a CPU annotation or op) or is a foreach / fused optimizer op."""
    names = categorical(ops["name"])
    opt_op = _per_op_name(names, _OPTIMIZER_RE)
    ann_names = categorical(ann["name"])
    opt_ann = np.append(matches(_OPTIMIZER_RE, pd.Series(np.asarray(ann_names.categories,
                                                                    dtype=object))),
                        False)[ann_names.codes]
    opt_ann &= ~is_gpu_range(ann["cat"]) & (ann_names.codes >= 0)
    s_ann = to_ns(ann["ts_us"])
    s, e, k = ops["s"].to_numpy(), ops["e"].to_numpy(), ops["key"].to_numpy()
    inside = Nest(np.r_[s_ann[opt_ann], s[opt_op]],
                  np.r_[s_ann[opt_ann] + to_ns(ann["dur_us"])[opt_ann], e[opt_op]],
                  np.r_[keys.codes(ann["pid"], ann["tid"])[opt_ann], k[opt_op]]
                  ).innermost(units["t"].to_numpy(), units["key"].to_numpy()) >= 0
    return inside | take(_per_op_name(names, _OPTIMIZER_OPS, base=True),
                         units["op_idx"].to_numpy(), False)


def training_parts(units: pd.DataFrame, ops: pd.DataFrame, ann: pd.DataFrame, keys: KeySpace
                   ) -> tuple[pd.Categorical, pd.Categorical, np.ndarray]:
    """Per unit, its part of a training step and, in backward, the autograd node it runs and
    that node's frame (an op index, -1 outside backward):
    `backward` inside an `autograd::engine::evaluate_function: XBackward0` frame (node
    `XBackward0`), `recompute` the start of such a frame up to its last forward-only op
    (`_FORWARD_ONLY`: activation checkpointing runs the layer's forward there before the node's
    own work), `optimizer` inside an `Optimizer.step#` / `Optimizer.zero_grad#` range (or a
    foreach / fused optimizer op), else `forward`; all missing when the trace has no backward."""
    n = len(units)
    names = categorical(ops["name"])
    frames = np.flatnonzero(np.append([str(c).startswith(_BACKWARD_FRAME)
                                       for c in names.categories], False)[names.codes])
    t, key = units["t"].to_numpy(), units["key"].to_numpy()
    if not len(frames):
        none = pd.Categorical.from_codes(np.full(n, -1, np.int8), [])
        return none, none, np.full(n, -1, np.int64)
    s, k = ops["s"].to_numpy(), ops["key"].to_numpy()
    nest = Nest(s[frames], ops["e"].to_numpy()[frames], k[frames])
    frame = nest.innermost(t, key)
    at = np.where(frame >= 0, frames[np.maximum(frame, 0)], -1)
    node = names.take(at, allow_fill=True).remove_unused_categories()
    node = node.rename_categories([str(c)[len(_BACKWARD_FRAME):] for c in node.categories])
    in_opt = _in_optimizer(units, ops, ann, keys)
    # (over cpu ops: the op that completes a recomputation may launch nothing, stopped early)
    fwd_only = np.flatnonzero(_per_op_name(names, _FORWARD_ONLY, base=True))
    starts = s[fwd_only]
    in_frame = nest.innermost(starts, k[fwd_only])
    last = pd.Series(starts[in_frame >= 0]).groupby(frames[in_frame[in_frame >= 0]]).max()
    recompute = (at >= 0) & (t <= last.reindex(at).fillna(-np.inf).to_numpy())
    part = np.where(in_opt, 2, np.where(recompute, 3, np.where(frame >= 0, 1, 0)))
    return pd.Categorical.from_codes(part, list(TRAINING_PARTS)), node, at


def _grad_ops(inst: pd.DataFrame, node: pd.Series) -> np.ndarray:
    """Per instance, the backward operator its autograd node says (`_GRAD_NODES`), else the one
    its op or kernel name alone says (`_GRAD_OPS`); None where neither does."""
    by_node = pd.Series(None, index=inst.index, dtype=object)
    for rx, op in _GRAD_NODES:
        by_node = by_node.mask(by_node.isna() & node.str.contains(rx).fillna(False), op)
    hits = {op: _per_op_name(inst["op_name"].array, rx) for op, rx in _GRAD_OPS.items()}
    one = np.sum(list(hits.values()), axis=0) == 1
    for op, hit in hits.items():
        by_node = by_node.mask(by_node.isna() & one & hit, op)
    return by_node.to_numpy(dtype=object)


def training_names(inst: pd.DataFrame, backward: np.ndarray, labels: Labels,
                   linears: dict[str, tuple[int, int]]) -> Labels:
    """Backward and optimizer instances of a training step, named apart from the forward ones:
    a backward GEMM after the linear it differentiates (`grad_gemms.backward_gemms`:
    `q_proj.grad`, evidence `shape`), an autograd node that says what it differentiates
    (`_GRAD_NODES`), else its op or kernel name (`_GRAD_OPS`; both evidence `kernel_name`),
    every optimizer op `optimizer` (evidence `annotation`: the Optimizer.step range); the rest of
    backward stays `other`, with the node as its reason."""
    nm, ev, why = labels.name.decoded(), labels.evidence.decoded(), labels.reason.decoded()
    part = np.asarray(inst["training"].astype("string").fillna(""), dtype=object)
    node = inst["node"].astype("string").fillna("")
    bwd, opt = backward & (part == "backward"), part == Name.OPTIMIZER
    gemm = grad_gemms.backward_gemms(inst, linears, bwd)
    node_op = _grad_ops(inst, node)
    gemm_node = node.str.contains(_BACKWARD_GEMM_NODES).fillna(False).to_numpy(bool)
    has_gemm, has_node = pd.notna(gemm), pd.notna(node_op)
    nm = np.where(bwd, np.where(has_gemm, gemm, np.where(has_node, node_op, Name.OTHER)), nm)
    ev = np.where(bwd, np.where(has_gemm, "shape", np.where(has_node, "kernel_name",
                                                           "position")), ev)
    lost = bwd & ~has_gemm & ~has_node
    forward_why = np.where(bwd, None, why)  # type: ignore[call-overload]  # (stubs refuse None)
    why = np.where(lost, "backward of " + node.to_numpy(dtype=object) + ": not named by place"
                   + np.where(gemm_node, " (no linear has its shape)", ""), forward_why)
    nm, ev = np.where(opt, Name.OPTIMIZER, nm), np.where(opt, "annotation", ev)
    why = np.where(opt, None, why)  # type: ignore[call-overload,assignment]  # (None)
    return Labels(Coded.encoded(nm), Coded.encoded(ev), Coded.encoded(why))
