"""(K, N) of weight GEMMs and of expert weights, read from the raw Input Dims text.

Design notes: docs/design.md ("trace_roofline/attribution/naming.py").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from trace_roofline.frames import distinct_codes
from trace_roofline.model import gemms, kernels, operators
from trace_roofline.model.gemms import Signature
from trace_roofline.trace.decode import decode_args

INTS = r"\[\s*((?:-?\d+\s*,\s*)*-?\d+)?\s*\]"  # a JSON list of ints (maybe empty)
PAIR = r"\[\s*(\d+)\s*,\s*(\d+)\s*\]"
TRIPLE = r"\[\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*\]"
SEP = r"\s*,\s*"


@dataclass(frozen=True)
class OperandText:
    """Where a GEMM op's operands sit in its raw Input Dims text: a regex and its groups."""

    regex: re.Pattern[str]
    activation: int  # the group of the activation's dims (a list of ints)
    k: int
    n: int


def operand_text(sig: Signature) -> OperandText:
    """The regex reading K and N of a GEMM of signature `sig` (gemms.SIGNATURES): the arguments
    before the activation (a bias), the activation, then the weight, [K, N] or [N, K] (or every
    expert's [E, K, N]). An op whose activation may be of any rank and takes no bias (matmul)
    has its weight last: a matmul of two activations is no weight GEMM."""
    lead = (INTS + SEP) * sig.activation
    weight = TRIPLE if sig.experts else PAIR
    end = r"\s*\]$" if sig.activation_any_rank and sig.bias is None else ""
    act = sig.activation + 1
    w0, w1 = (act + 2, act + 3) if sig.experts else (act + 1, act + 2)
    k, n = (w1, w0) if sig.weight_nk else (w0, w1)
    return OperandText(re.compile(r"^\[\s*" + lead + INTS + SEP + weight + end), act, k, n)


# the weight GEMMs of one weight per call (or every expert's, stacked), by op
_GEMM_TEXT = {op: operand_text(sig) for op, sig in gemms.SIGNATURES.items() if not sig.batched}
# Expert weights outside a weight GEMM: (regex, group of the leading count, of N, of K)
WEIGHT_FIRST = re.compile(r"^\[\s*" + TRIPLE + SEP + r"\[\s*\d+\s*,\s*\d+\s*,\s*1\s*\]")
# every expert over its slice of tokens: [E, M, K] x [E, K, N] (Llama 4's experts)
_TOKEN_MAJOR = re.compile(r"^\[\s*\[\s*(\d+)\s*,\s*\d+\s*,\s*\d+\s*\]" + SEP
                          + r"\[\s*\1\s*,\s*(\d+)\s*,\s*(\d+)\s*\]")
_EXPERT_WEIGHT_TEXT = {
    # weight-first batched GEMV over gathered weights: [S, N, K] x [S, K, 1] (HF batched_mm)
    "bmm": (WEIGHT_FIRST, 1, 2, 3),
    # the gather of those weights from all experts': [E, N, K][ids] (indices are not recorded)
    "index": (re.compile(r"^\[\s*" + TRIPLE + SEP + r"\[\s*\]"), 1, 2, 3),
    # the experts' weights [E, K, N] of a grouped GEMM (count E)
    "_grouped_mm": (_GEMM_TEXT["_grouped_mm"].regex, _GEMM_TEXT["_grouped_mm"].activation + 1,
                    _GEMM_TEXT["_grouped_mm"].n, _GEMM_TEXT["_grouped_mm"].k),
    # an engine's fused MoE op: hidden [M, H], w13 [E, 2I, H], ... (count E)
    **dict.fromkeys(("inplace_fused_experts", "outplace_fused_experts"),
                    (re.compile(r"^\[\s*" + INTS + SEP + TRIPLE), 2, 3, 4)),
}


def gemm_kn(op_base: pd.Series, dims_text: pd.Series
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(K, N, W) of weight GEMMs from the raw Input Dims text; K = N = -1 where not a
    2-D-weight GEMM. W counts the weights of one shape an Inductor kernel multiplies at once
    (N is their sum: a fused gate and up, k and v); 1 elsewhere.

    mm/_scaled_mm [M,K]x[K,N]; addmm (bias, [M,K], [K,N]); linear ([..,K], weight [N,K]);
    matmul ([..,K], [K,N]) only with a 2-D second operand; the activation must be >= 2-D.
    Parsed with one regex per op kind over the distinct texts, no per-row Python.
    """
    k = np.full(len(op_base), -1, dtype=np.int64)
    n = k.copy()
    w = np.ones(len(op_base), dtype=np.int64)
    text = dims_text.astype("string").fillna("")
    for op, (rx, ga, gk, gn) in ((op, (t.regex, t.activation, t.k, t.n))
                                 for op, t in _GEMM_TEXT.items()):
        rows = (op_base == op).to_numpy()
        if not rows.any():
            continue
        uniq = pd.Series(text[rows].unique(), dtype="string")
        m = uniq.str.extract(rx)
        ok = m[gk - 1].notna() & m[ga - 1].fillna("").str.contains(",")
        kk = pd.to_numeric(m[gk - 1].where(ok), errors="coerce").fillna(-1).astype("int64")
        nn = pd.to_numeric(m[gn - 1].where(ok), errors="coerce").fillna(-1).astype("int64")
        pos = pd.Index(uniq).get_indexer(text[rows])
        k[rows], n[rows] = kk.to_numpy()[pos], nn.to_numpy()[pos]
    base = op_base.fillna("")
    triton = base.str.match(operators.TRITON_KERNEL_OP).to_numpy(dtype=bool)
    fused = triton & base.str.contains(kernels.INDUCTOR_MATMUL).to_numpy(dtype=bool)
    if fused.any():
        k[fused], n[fused], w[fused] = _fused_kn(base[fused], text[fused])
    grouped = triton & base.str.contains(kernels.INDUCTOR_GROUPED_MM).to_numpy(dtype=bool)
    if grouped.any():
        _, k[grouped], n[grouped] = _grouped_ekn(text[grouped])
    tem = (k < 0) & ~grouped & triton & kernels.roles(base).isin(kernels.GEMM_ROLES).to_numpy(
        dtype=bool)
    if tem.any():
        k[tem], n[tem] = _template_kn(text[tem])
    return k, n, w


def _fused_kn(names: pd.Series, text: pd.Series) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(K, N, W) of the weight GEMM an Inductor kernel fused (kernels.fused_gemm), -1, -1, 1
    where none fits. Once per distinct (kernel, Input Dims)."""
    pairs = pd.DataFrame({"n": names.to_numpy(dtype=object), "d": text.to_numpy(dtype=object)})
    codes, first = distinct_codes([pd.factorize(pairs[c])[0] for c in ("n", "d")])
    found = [kernels.fused_gemm(str(n), decode_args(str(d)) or [])
             for n, d in pairs.iloc[first].itertuples(index=False)]
    got = np.array([(g.k, g.n, g.weights) if g else (-1, -1, 1) for g in found],
                   dtype=np.int64).reshape(-1, 3)
    return got[codes, 0], got[codes, 1], got[codes, 2]


def _grouped_ekn(text: pd.Series) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(E, K, N) of Inductor grouped-GEMM templates (kernels.grouped_gemm), -1 where their
    arguments do not fit. Once per distinct Input Dims."""
    uniq = pd.Series(text.unique(), dtype="string")
    found = [kernels.grouped_gemm(decode_args(str(d)) or []) for d in uniq]
    got = np.array([(g[3], g[1], g[2]) if g else (-1, -1, -1) for g in found],
                   dtype=np.int64).reshape(-1, 3)
    at = pd.Index(uniq).get_indexer(text)
    return got[at, 0], got[at, 1], got[at, 2]


def _template_kn(text: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """(K, N) of Inductor GEMM template launches (triton_tem_fused_mm_0 ...), whose arguments
    are the activation [M, K] and the weight, as [K, N] or as its [N, K] buffer (a bias first):
    the first two 2-D arguments sharing K; -1 where none do. Once per distinct text."""
    uniq = pd.Series(text.unique(), dtype="string")
    pairs = uniq.str.findall(PAIR)  # the 2-D arguments in order (3-D ones do not match)

    def kn(found: list) -> tuple[int, int]:
        dims = [(int(a), int(b)) for a, b in found] if isinstance(found, list) else []
        if len(dims) < 2:
            return -1, -1
        (_, ka), (b0, b1) = dims[0], dims[1]
        return (ka, b1) if ka == b0 else (ka, b0) if ka == b1 else (-1, -1)

    got = np.array([kn(f) for f in pairs], dtype=np.int64).reshape(-1, 2)
    at = pd.Index(uniq).get_indexer(text)
    return got[at, 0], got[at, 1]


def expert_weight_kn(op_base: pd.Series, dims_text: pd.Series) -> tuple[np.ndarray, ...]:
    """(count, K, N) of expert weights: a weight-first `bmm` [S, N, K] x [S, K, 1] (count S), a
    token-major one [E, M, K] x [E, K, N] (count E: an expert GEMM only where E is the router's), an
    `index` gather of the [E, N, K] weights (count E), a `_grouped_mm`'s [E, K, N] (or its
    Inductor template's, kernels.grouped_gemm) and an
    engine's fused MoE op's w13 [E, 2I, H] (count E); -1 elsewhere. The first two are expert
    GEMMs only when (K, N) (and E) are the model's; the last two tell a trace's experts
    (infer_moe_linears)."""
    out = [np.full(len(op_base), -1, dtype=np.int64) for _ in range(3)]
    text = dims_text.astype("string").fillna("")
    grouped = op_base.fillna("").str.contains(kernels.INDUCTOR_GROUPED_MM).to_numpy(dtype=bool)
    if grouped.any():  # Inductor's grouped-GEMM template: its weights [E, N, K] or [E, K, N]
        for arr, got in zip(out, _grouped_ekn(text[grouped]), strict=True):
            arr[grouped] = got
    for op, (rx, gc, gn, gk) in (*_EXPERT_WEIGHT_TEXT.items(), ("bmm", (_TOKEN_MAJOR, 1, 3, 2))):
        rows = (op_base == op).to_numpy() & (out[0] < 0)  # (the first form that fits)
        if not rows.any():
            continue
        uniq = pd.Series(text[rows].unique(), dtype="string")
        m = uniq.str.extract(rx)
        pos = pd.Index(uniq).get_indexer(text[rows])
        for arr, g in zip(out, (gc, gk, gn), strict=True):
            vals = pd.to_numeric(m[g - 1], errors="coerce").fillna(-1).astype("int64")
            arr[rows] = vals.to_numpy()[pos]
    return tuple(out)
