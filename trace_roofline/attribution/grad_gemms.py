"""A training step's backward GEMMs named after the linear they differentiate (`q_proj.grad`).

Design notes: docs/design.md ("trace_roofline/attribution/naming.py").
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from trace_roofline.attribution.gemm_names import LINEAR_ORDER, SUB_LINEARS
from trace_roofline.attribution.gemm_operands import INTS, PAIR, SEP
from trace_roofline.attribution.naming import base_name, per_value
from trace_roofline.model import gemms, operators
from trace_roofline.model.gemms import Signature

# a 2-D GEMM's operands: mm [a0, a1] x [b0, b1], addmm (bias, [a0, a1], [b0, b1])
# and a `_grouped_mm`'s backward: [a0, a1] x [E, b0, b1] (grad-input) or [a0, a1] x [b0, b1]
# (grad-weight, an [E, a0, b1] output)
_MAYBE_EXPERTS = r"\[\s*(?:\d+\s*,\s*)?(\d+)\s*,\s*(\d+)\s*\]"  # [b0, b1] or [E, b0, b1]


def _operands_text(sig: Signature) -> re.Pattern[str]:
    """The regex of a backward GEMM's two operands after those before its activation (gemms
    SIGNATURES: a bias): groups a0, a1, b0, b1 last."""
    return re.compile(r"^\[\s*" + (INTS + SEP) * sig.activation + PAIR + SEP
                      + (_MAYBE_EXPERTS if sig.experts else PAIR))


_MM_TEXT = {op: _operands_text(gemms.SIGNATURES[op]) for op in ("mm", "addmm", "_grouped_mm")}


def backward_gemms(inst: pd.DataFrame, linears: dict[str, tuple[int, int]],
                   rows: np.ndarray) -> np.ndarray:
    """Per instance among `rows` (backward work), the backward operator of the linear a GEMM
    differentiates, else None. For Y = X·W ([M, K] x [K, N]) autograd runs the grad-input
    dX = dY·Wᵀ ([M, N] x [N, K]) and the grad-weight dW = Xᵀ·dY ([K, M] x [M, N], or of a
    [N, K] weight dYᵀ·X, [N, M] x [M, K]): the first of those readings whose (K, N) is a
    linear's names it (`q_proj.grad`): for a node's (inst["frame"]) first GEMM the grad-input
    reading first, for its second the grad-weight's (mm_backward's order); the node's first
    GEMM names them both. Linears sharing a shape (q/o, k/v, gate/up) are told apart by order:
    backward visits them last layer first, o before q, v before k, up before gate. A node of
    several GEMMs of a shape (torch.compile's one backward graph) pairs its i-th grad-input with
    its i-th grad-weight of that shape, each pair a linear in that order."""
    out = np.full(len(inst), None, dtype=object)
    if not linears or not rows.any():
        return out
    cols = ["op_name", "input_dims", *(["input_strides"] if "input_strides" in inst else [])]
    dims = per_value(inst[cols], _mm_operands)
    a0, a1, b1 = (dims[c].to_numpy(np.int64) for c in ("a0", "a1", "b1"))
    at = dims["a_t"].to_numpy(bool)  # the first operand is a transposed view: dYᵀ or Xᵀ
    cycles: dict[tuple[int, ...], list[str]] = {}
    for name in reversed(LINEAR_ORDER):
        if name in linears:
            cycles.setdefault(tuple(linears[name]), []).append(SUB_LINEARS.get(name, name))
    keys = pd.Index(list(cycles))
    gemm = rows & (a0 >= 0)
    shape = np.full(len(inst), -1, dtype=np.int64)
    # grad-input dY·W (K = b1, N = a1); grad-weight dYᵀ·X of a [N, K] weight (K = b1, N = a0),
    # or Xᵀ·dY (K = a0, N = b1)
    weight = np.zeros(len(inst), dtype=bool)  # read as a grad-weight
    for k, n, which in ((b1, a1, ~at), (b1, a0, at), (a0, b1, at)):
        code = keys.get_indexer(list(zip(k.tolist(), n.tolist(), strict=True)))
        new = (shape < 0) & (code >= 0) & gemm & which
        shape, weight = np.where(new, code, shape), weight | (new & at)
    hit = np.flatnonzero(shape >= 0)
    if not len(hit):
        return out
    # the linears (inst["frame"]: one autograd node; its i-th grad-input and i-th grad-weight of
    # a shape: one linear) of a shape cycle its names
    frame = inst["frame"].to_numpy() if "frame" in inst else np.arange(len(inst))
    node = pd.DataFrame({"f": frame[hit], "s": shape[hit], "w": weight[hit],
                         "g": inst["grp"].to_numpy()[hit]})
    node["i"] = node.groupby(["f", "s", "w"]).cumcount()
    firsts = node.drop_duplicates(["f", "s", "i"])
    occ = pd.Series(firsts.groupby(["g", "s"]).cumcount().to_numpy(),
                    index=pd.MultiIndex.from_frame(firsts[["f", "s", "i"]]))
    node["occ"] = occ.reindex(pd.MultiIndex.from_frame(node[["f", "s", "i"]])).to_numpy()
    for i, names in enumerate(cycles.values()):
        sel = (node["s"] == i).to_numpy()
        pick = np.asarray(names, dtype=object)[node["occ"].to_numpy()[sel] % len(names)]
        out[hit[sel]] = [operators.grad_of(p) for p in pick]
    return out


def _mm_operands(distinct: pd.DataFrame) -> pd.DataFrame:
    """(a0, a1, b1, a_t) of mm / addmm operands per distinct (op_name, input_dims[,
    input_strides]): a_t when the first operand is a transposed view (its first stride 1); -1
    elsewhere or where the inner dims differ."""
    base = base_name(distinct["op_name"]).fillna("")
    text = distinct["input_dims"].astype("string").fillna("")
    strides = (distinct["input_strides"].astype("string").fillna("")
               if "input_strides" in distinct else pd.Series("", index=distinct.index))
    out = pd.DataFrame(-1, index=distinct.index, columns=["a0", "a1", "b1"], dtype=np.int64)
    out["a_t"] = False
    for op, rx in _MM_TEXT.items():
        rows = (base == op).to_numpy()
        if not rows.any():
            continue
        m = text[rows].str.extract(rx)
        v = m[m.columns[-4:]].apply(pd.to_numeric, errors="coerce").fillna(-1)
        v = v.astype(np.int64).to_numpy()  # a0, a1, b0, b1
        ok = v[:, 1] == v[:, 2]
        out.loc[rows, ["a0", "a1", "b1"]] = np.where(ok[:, None], v[:, [0, 1, 3]], -1)
        st = strides[rows].str.extract(rx)
        # (strides that are missing or do not parse, as MTIA traces record them: not transposed)
        s_a = st[st.columns[-4:-2]].apply(pd.to_numeric, errors="coerce").to_numpy(
            dtype=np.float64, na_value=np.nan)
        out.loc[rows, "a_t"] = (s_a[:, 0] == 1) & (v[:, 1] > 1)
    return out
