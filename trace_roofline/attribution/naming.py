"""Naming op instances without annotations: GEMM shapes, op names, position, module frames.

Design notes: docs/design.md ("trace_roofline/attribution/naming.py").
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from trace_roofline.attribution.nest import Nest
from trace_roofline.frames import distinct_codes, factorized
from trace_roofline.model import kernels, operators
from trace_roofline.model.architecture import ATTENTION, MLP, PRE, RESIDUAL, Placement
from trace_roofline.model.models import ModelSpec
from trace_roofline.model.operators import Stage
from trace_roofline.trace.decode import decode_args

PROJ_IN = operators.at_stage(Stage.QKV)  # a layer opens with these
MLP_IN = operators.at_stage(Stage.MLP_IN)

# Op families, by the op's base name (after the last "::"); attention and embedding ops are
# recognised by the vocabulary (operators.py).
BATCHED_GEMM_OPS = {"bmm", "baddbmm", "addbmm"}
# (vLLM spells its fused norms rms_norm / fused_add_rms_norm, SGLang rmsnorm / fused_add_rmsnorm)
NORM_CORE_OPS = {"pow", "mean", "rsqrt", "var", "var_mean", "rms_norm", "_fused_rms_norm",
                 "layer_norm", "native_layer_norm", "fused_add_rms_norm", "rms_norm_",
                 "rmsnorm", "fused_add_rmsnorm", "add_rmsnorm"}
# an engine's norm that adds the residual itself (vLLM, SGLang): no residual add kernel before it
ADD_NORM_OPS = {"fused_add_rms_norm", "fused_add_rmsnorm", "add_rmsnorm"}
# the op that opens a norm: RMSNorm as HF writes it (x.pow(2).mean(-1)...), or a fused norm op
NORM_OPEN_OPS = NORM_CORE_OPS - {"mean", "rsqrt", "var"}
CAST_OPS = {"to", "_to_copy", "type_as", "float", "bfloat16", "half"}
ROPE_CORE_OPS = {"neg", "cos", "sin", "mul", "add", "rotary_embedding", "apply_rotary_emb",
                 "_apply_rotary_emb", "apply_rope_pos_ids_cos_sin_cache"}
# ops only RoPE runs (rotate_half's neg, the cos/sin tables, an engine's rotary op)
ROTARY_OPS = ROPE_CORE_OPS - {"mul", "add"}
KV_WRITE_OPS = {"cat", "copy_", "index_copy_", "index_copy", "index_put_", "index_put",
                "_index_put_impl_", "slice_scatter", "scatter_", "scatter", "_unsafe_index_put",
                "reshape_and_cache", "reshape_and_cache_flash", "concat_and_cache_mla",
                "store_kv_cache"}
KV_ONLY_OPS = KV_WRITE_OPS - {"cat", "copy_"}
ACT_OPS = {"silu", "silu_", "gelu", "gelu_", "sigmoid", "silu_and_mul", "gelu_and_mul",
           "gelu_tanh_and_mul", "swiglu", "relu", "relu_"}
SOFTMAX_OPS = {"softmax", "_softmax", "_safe_softmax"}
# logits processing and sampling after the lm_head (HF generate's processors and samplers,
# engines' samplers): the logits' cast, temperature, top-k / top-p (sort, cumsum, scatter),
# penalties, softmax, the draw or the argmax
# a training step's loss (HF's cross-entropy after the lm_head: log-softmax, NLL)
LOSS_OPS = {"cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss_forward", "nll_loss2d",
            "nll_loss2d_forward", "log_softmax", "_log_softmax", "mse_loss",
            "binary_cross_entropy", "binary_cross_entropy_with_logits"}
SAMPLING_OPS = {"softmax", "_softmax", "_safe_softmax", "topk",
                "argmax", "argmin", "max", "multinomial", "sort", "argsort", "cumsum", "div",
                "div_", "masked_fill", "masked_fill_", "scatter", "scatter_", "gather",
                "exponential_", "uniform_", "_to_copy", "to", "float", "lt", "where", "sub",
                "apply_penalties", "apply_repetition_penalties_", "top_k_top_p_sampling_from_probs",
                "top_p_sampling_from_probs", "sampling_from_probs", "min_p_sampling_from_probs"}
SAMPLING_ROLES = {"sampling", "softmax", "sort_scan"}
UNATTRIBUTED = operators.UNATTRIBUTED.name
# MoE: token permutation ops that open the dispatch after the router's top-k (as the op or the
# outermost op around it: sort's own copies; its arange, which opens it in a kernel sequence),
# the router's top-k, and the ops that accumulate
# the experts' outputs back into tokens
DISPATCH_OPS = {"sort", "argsort", "histc", "bincount", "one_hot", "repeat_interleave",
                "nonzero", "where", "zeros_like", "arange", "moe_align_block_size",
                "sgl_moe_align_block_size"}
SYNC_OPS = {"_local_scalar_dense", "item"}  # a loop's expert index read back to the host
TOPK_OPS = {"topk", "topk_softmax", "topk_sigmoid", "fused_topk", "grouped_topk"}
ACCUMULATE_OPS = {"index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce",
                  "scatter_reduce_", "sum", "moe_sum"}
# GEMMs of an operator named differently while positions are worked out (their regions
# differ), then renamed: the shared expert's sigmoid gate is router work; HF 4.x's separate
# expert gate (w1) and up (w3) projections are experts_gate_up
SUB_LINEARS = {"shared_expert_gate": "router", "experts_gate": "experts_gate_up",
               "experts_up": "experts_gate_up"}
LINEAR_ORDER = (*operators.LINEARS, "experts_gate", "experts_up", "shared_expert_gate")
EXPERT_IN = {"experts_gate_up", "experts_gate", "experts_up"}
SHARED_IN = {"shared_gate_proj", "shared_up_proj", "shared_gate_up_proj"}

_ACTIVATION = re.compile(r"\[\s*\d+\s*(?:,\s*\d+\s*){1,},\s*(?:[2-9]|\d{2,})\s*\]")  # >= 3-D, last > 1
# the first two arguments are both tensors (a residual add, not a norm's add of its epsilon)
_BINARY = re.compile(r"^\[\s*\[\s*\d[\d\s,]*\]\s*,\s*\[\s*\d[\d\s,]*\]")
_DIMS_4D = re.compile(r"\[\s*\d+\s*,\s*\d+\s*,\s*\d+\s*,\s*\d+\s*\]")  # [B, heads, S, d]
_BATCHED = re.compile(r"^\[\s*\[\s*\d+\s*(?:,\s*\d+\s*){2,3}\]\s*,\s*\[\s*\d+\s*(?:,\s*\d+\s*){1,2}"
                      r",\s*(?:[2-9]|\d{2,})\s*\]")
# weight GEMM ops (the innermost shape-carrying op of a linear); Inductor's and the libraries'
# GEMM kernels are GEMMs by their kernel family (kernels.GEMM_ROLES)
GEMM_OPS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_scaled_mm",
            "_grouped_mm", "_addmm_activation", "gemm_a16w16"}


def _factorized(values: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """(codes, distinct values) of a column (frames.factorized): codes index the distinct
    values (an object array); missing is one more distinct value, the last."""
    codes, uniques = factorized(values)
    return (np.where(codes < 0, len(uniques), codes),
            np.append(np.asarray(uniques, dtype=object), [None]))


def _distinct(values: pd.Series | pd.DataFrame) -> tuple[np.ndarray, pd.Series | pd.DataFrame]:
    """The distinct values of a column (a string Series), or the distinct rows of several (a
    DataFrame of string columns), and per row the index of its own."""
    if isinstance(values, pd.Series):
        codes, uniques = _factorized(values)
        return codes, pd.Series(uniques, dtype=object).astype("string")
    parts = [_factorized(values[c]) for c in values.columns]
    codes, first = distinct_codes([col_codes for col_codes, _ in parts])
    return codes, pd.DataFrame({
        c: pd.Series(col_uniques[col_codes[first]], dtype=object).astype("string")
        for c, (col_codes, col_uniques) in zip(values.columns, parts, strict=True)})


def per_value(values: pd.Series | pd.DataFrame, fn) -> pd.DataFrame | pd.Series:
    """fn evaluated once per distinct value (a string Series of them) or, for a DataFrame, once
    per distinct row (a DataFrame of string columns), broadcast back to the rows."""
    codes, distinct = _distinct(values)
    out = fn(distinct).iloc[codes]
    out.index = values.index
    return out


@dataclass(frozen=True)
class Names:
    """A name per row, as codes into a small vocabulary: a test on the names costs one look-up
    per row, not a string comparison. The empty name "" is no name."""

    codes: np.ndarray  # per row, an index into vocab
    vocab: np.ndarray  # the names (an object array of str)

    @classmethod
    def of(cls, values: pd.Series) -> Names:
        """The names of a column (missing: "")."""
        codes, uniques = _factorized(values)
        return cls(codes, np.where(pd.isna(uniques), "", uniques).astype(object))

    def isin(self, names: Iterable[str]) -> np.ndarray:
        """Per row, whether its name is one of `names`."""
        return np.isin(self.vocab, list(names))[self.codes]

    def mapped(self, fn: Callable[[pd.Series], pd.Series]) -> Names:
        """The names fn gives, evaluated once per name: fn takes a string Series of names
        (missing: no name) and returns one (missing: no name)."""
        names = pd.Series(np.where(self.vocab == "", None, self.vocab),  # type: ignore[call-overload]  # (stubs refuse None)
                          dtype="string")
        return Names(self.codes, fn(names).fillna("").to_numpy(dtype=object))

    def renamed(self, mapping: dict[str, str]) -> Names:
        """The names with those in `mapping` replaced."""
        return Names(self.codes, np.asarray([mapping.get(v, v) for v in self.vocab], dtype=object))

    def categorical(self) -> pd.Categorical:
        """The names as a Categorical of the names that occur, sorted ("": missing), as
        pd.Categorical would make of the names as strings."""
        codes, vocab = pd.factorize(self.vocab)  # one code per name
        codes = codes[self.codes]
        used = np.zeros(len(vocab), dtype=bool)
        used[codes] = True
        used &= vocab != ""
        cats = vocab[used]
        order = np.argsort(cats, kind="stable")
        new = np.full(len(vocab), -1)
        new[np.flatnonzero(used)[order]] = np.arange(len(cats))
        return pd.Categorical.from_codes(new[codes], cats[order])


Rule = tuple[np.ndarray, Names | str]  # (condition per row, name: one or per row)


def first_match(rules: list[Rule], default: str) -> Names:
    """Per row, the name of the first rule whose condition holds, else `default`: rules are
    ordered lists of (condition, name) pairs, read top to bottom like a table in the docs."""
    n = len(rules[0][0])
    which = np.full(n, len(rules))  # the index of the first rule that holds
    for i in reversed(range(len(rules))):
        np.copyto(which, i, where=rules[i][0])
    # a rule of one name is its own code; a rule of a name per row appends its vocabulary
    vocab = [name if isinstance(name, str) else "" for _, name in rules] + [default]
    codes = which.copy()
    for i, (_, name) in enumerate(rules):
        if isinstance(name, Names):
            rows = np.flatnonzero(which == i)
            codes[rows] = len(vocab) + name.codes[rows]
            vocab.extend(name.vocab)
    return Names(codes, np.asarray(vocab, dtype=object))


def base_name(names: pd.Series) -> pd.Series:
    """'aten::addmm' -> 'addmm' (Triton kernel names are kept whole)."""
    return per_value(names, operators.base_names)


def _op_flags(names: pd.Series) -> pd.DataFrame:
    base = base_name(names).fillna("")
    triton = base.str.match(operators.TRITON_KERNEL_OP)
    role = kernels.roles(base).astype(str)  # an engine's op named like its kernel, Inductor's
    fuses = {k: kernels.inductor_fuses(base, k) for k in kernels.INDUCTOR_FUSES}
    knorm = role.isin(["norm", "fused_add_norm"])
    return pd.DataFrame({
        "triton": triton,
        "attn": operators.recognise(operators.ATTENTION, base) | role.isin(kernels.ATTENTION_ROLES),
        "emb": operators.recognise(operators.EMBEDDING, base),
        "normcore": base.isin(NORM_CORE_OPS) | fuses["norm"] | knorm,
        "normopen": base.isin(NORM_OPEN_OPS) | fuses["norm"] | knorm,
        "rotary": base.isin(ROTARY_OPS) | fuses["rope"] | role.eq("rope"),
        "mul": base == "mul",
        "addnorm": base.isin(ADD_NORM_OPS) | role.eq("fused_add_norm"),
        "cast": base.isin(CAST_OPS),
        "ropecore": base.isin(ROPE_CORE_OPS) | fuses["rope"] | role.eq("rope"),
        "cossin": base.isin({"cos", "sin"}),
        "kvwrite": base.isin(KV_WRITE_OPS) | (fuses["store"] & ~fuses["rope"])
        | role.eq("kv_cache_write"),
        "kvonly": base.isin(KV_ONLY_OPS) | role.eq("kv_cache_write"),
        "tristore": fuses["store"],
        "tricat": fuses["cat"],
        "act": base.isin(ACT_OPS) | fuses["act"] | role.eq("activation"),
        "softmax": base.isin(SOFTMAX_OPS) | fuses["softmax"],
        "tribmm": fuses["bmm"],
        "bgemm": base.isin(BATCHED_GEMM_OPS),
        "matmul": base == "matmul",
        "gemmop": base.isin(GEMM_OPS) | role.isin(kernels.GEMM_ROLES),
        "dispatch": base.isin(DISPATCH_OPS),
        "topk": base.isin(TOPK_OPS),
        "acc": base.isin(ACCUMULATE_OPS),
        "sync": base.isin(SYNC_OPS),
        "add": base == "add",
        "sigmoid": base.isin({"sigmoid", "sigmoid_"}),
        "sampling": base.isin(SAMPLING_OPS) | role.isin(SAMPLING_ROLES),
        "loss": base.isin(LOSS_OPS) | role.eq("loss"),
        "fused_moe": operators.recognise(operators.FUSED_EXPERTS, base),
    })


def classify(inst: pd.DataFrame) -> dict[str, np.ndarray]:
    """Op-family flags per instance (boolean arrays; rank0 and last0 of `dims_flags` ints), from
    its own op, the outermost op around it (casts, cache writes and embeddings are recognised
    there), Triton name tokens and, for Triton kernels, their 4-D arguments: a store into a
    cache-shaped buffer or a cat growing one is a cache write (kvonly), a kernel on 4-D buffers
    only prepares attention. Worked out once per distinct (op, outermost op, Input Dims)."""
    codes, distinct = _distinct(inst[["op_name", "top_name", "input_dims"]])
    return {col: flags[codes] for col, flags in _classify_distinct(distinct).items()}


def _classify_distinct(rows: pd.DataFrame) -> dict[str, np.ndarray]:
    op = {c: v.to_numpy(dtype=bool) for c, v in per_value(rows["op_name"], _op_flags).items()}
    top = {c: v.to_numpy(dtype=bool) for c, v in per_value(rows["top_name"], _op_flags).items()}
    dims = dims_flags(rows["input_dims"])
    has4d, grows, only4d = (dims[c].to_numpy(dtype=bool) for c in ("has4d", "grows", "only4d"))
    out = {c: v for c, v in op.items() if c not in ("tristore", "tricat", "tribmm")}
    for col in ("attn", "emb", "normcore", "kvonly", "act", "softmax", "dispatch", "fused_moe",
                "loss"):
        out[col] = op[col] | top[col]
    out["attn"] = per_value(rows[["op_name", "top_name"]], _attention_ops).to_numpy(dtype=bool)
    out["cast"] = top["cast"]
    out["fused_op"] = op["fused_moe"]  # the engine's fused MoE op itself (not one inside it)
    out["kvwrite"] = top["kvwrite"] | (op["kvwrite"] & op["triton"])
    out["kvonly"] = out["kvonly"] | (op["tristore"] & has4d) | (op["tricat"] & grows)
    out["attnprep"] = op["triton"] & ~out["kvonly"] & only4d
    out["rank3"] = dims["rank3"].to_numpy(dtype=bool)
    out["binary"] = dims["binary"].to_numpy(dtype=bool)
    # an eager attention's Q·Kᵀ or P·V: a batched matmul op, or an Inductor kernel that fused a
    # bmm over two activations of 3-D or more (Gemma-2's soft-capped, gpt-oss's sink attention)
    out["batched"] = (dims["batched"].to_numpy(dtype=bool) & (op["bgemm"] | op["matmul"])) | (
        op["tribmm"] & dims["activations"].to_numpy(dtype=bool))
    out["rank0"] = dims["rank0"].to_numpy(dtype=np.int64)
    out["last0"] = dims["last0"].to_numpy(dtype=np.int64)
    return out


def dims_flags(dims: pd.Series) -> pd.DataFrame:
    """Per distinct Input Dims text: has4d (some argument is 4-D), only4d (the others are 0-d
    or no tensor), grows (a 4-D argument equals another but for a longer dim 2: a cache
    [B, h, S, d] and the same cache with the new tokens appended), rank3 (the first argument
    is 3-D: a sum over top-k of [tokens, k, H], not a renormalisation over [tokens, k]),
    rank0 and last0 (the first argument's rank and last dim; 0 and -1 when it is no tensor),
    batched (the first two arguments are both 3-D or 4-D, the second's last dim above 1: an
    eager attention's Q·Kᵀ or P·V, not a weight GEMM nor a weight-first expert GEMV),
    activations (two arguments of 3-D or more with a last dim above 1, anywhere: what an
    Inductor kernel's bmm multiplies, not RoPE's [1, d/2, 1] x [1, 1, S] table)."""
    text = dims.fillna("")
    has4d = text.str.contains(_DIMS_4D)
    rest = text.str.replace(_DIMS_4D, "", regex=True).str.replace(r"\[\s*\]", "", regex=True)
    four = text.str.findall(_DIMS_4D)  # one Python pass per distinct text, not per event

    def appended(found: list[str]) -> bool:
        shapes = [tuple(int(v) for v in f.strip("[] ").split(",")) for f in found]
        return any(a[:2] == b[:2] and a[3] == b[3] and b[2] > a[2]
                   for a in shapes for b in shapes)

    grows = [appended(f) if isinstance(f, list) and len(f) > 1 else False for f in four]
    first = text.str.extract(r"^\[\s*\[([\d\s,]*)\]")[0].fillna("").str.findall(r"\d+")
    return pd.DataFrame({"has4d": has4d, "only4d": has4d & ~rest.str.contains(r"\d"),
                         "grows": pd.Series(grows, index=text.index, dtype=bool),
                         "rank3": text.str.contains(r"^\[\s*\[\s*\d+\s*,\s*\d+\s*,\s*\d+\s*\]"),
                         "binary": text.str.contains(_BINARY),
                         "rank0": first.str.len().astype("int64"),
                         "batched": text.str.contains(_BATCHED),
                         "activations": text.str.count(_ACTIVATION) >= 2,
                         "last0": pd.to_numeric(first.str[-1], errors="coerce")
                         .fillna(-1).astype("int64")})


# ----------------------------------------------------------------------------------------------
# GEMM shapes
# ----------------------------------------------------------------------------------------------
_INTS = r"\[\s*((?:-?\d+\s*,\s*)*-?\d+)?\s*\]"  # a JSON list of ints (maybe empty)
_PAIR = r"\[\s*(\d+)\s*,\s*(\d+)\s*\]"
_SEP = r"\s*,\s*"
_GEMM_TEXT = {  # op -> (regex on the raw Input Dims text, group of the activation, K, N)
    "mm": (re.compile(r"^\[\s*" + _INTS + _SEP + _PAIR), 1, 2, 3),
    "_scaled_mm": (re.compile(r"^\[\s*" + _INTS + _SEP + _PAIR), 1, 2, 3),
    "matmul": (re.compile(r"^\[\s*" + _INTS + _SEP + _PAIR + r"\s*\]$"), 1, 2, 3),
    "addmm": (re.compile(r"^\[\s*" + _INTS + _SEP + _INTS + _SEP + _PAIR), 2, 3, 4),
    "_addmm_activation": (re.compile(r"^\[\s*" + _INTS + _SEP + _INTS + _SEP + _PAIR), 2, 3, 4),
    "linear": (re.compile(r"^\[\s*" + _INTS + _SEP + _PAIR), 1, 3, 2),  # weight is [N, K]
    "gemm_a16w16": (re.compile(r"^\[\s*" + _INTS + _SEP + _PAIR), 1, 3, 2),  # aiter: as linear
    # grouped GEMM of all experts: [S, K] x [E, K, N] with per-expert offsets
    "_grouped_mm": (re.compile(r"^\[\s*" + _INTS + _SEP + r"\[\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*\]"),
                    1, 3, 4),
}
_TRIPLE = r"\[\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*\]"
# Expert weights outside a weight GEMM: (regex, group of the leading count, of N, of K)
_WEIGHT_FIRST = re.compile(r"^\[\s*" + _TRIPLE + _SEP + r"\[\s*\d+\s*,\s*\d+\s*,\s*1\s*\]")
# every expert over its slice of tokens: [E, M, K] x [E, K, N] (Llama 4's experts)
_TOKEN_MAJOR = re.compile(r"^\[\s*\[\s*(\d+)\s*,\s*\d+\s*,\s*\d+\s*\]" + _SEP
                          + r"\[\s*\1\s*,\s*(\d+)\s*,\s*(\d+)\s*\]")
_EXPERT_WEIGHT_TEXT = {
    # weight-first batched GEMV over gathered weights: [S, N, K] x [S, K, 1] (HF batched_mm)
    "bmm": (_WEIGHT_FIRST, 1, 2, 3),
    # the gather of those weights from all experts': [E, N, K][ids] (indices are not recorded)
    "index": (re.compile(r"^\[\s*" + _TRIPLE + _SEP + r"\[\s*\]"), 1, 2, 3),
    # the experts' weights [E, K, N] of a grouped GEMM (count E)
    "_grouped_mm": (re.compile(r"^\[\s*" + _INTS + _SEP + _TRIPLE), 2, 4, 3),
    # an engine's fused MoE op: hidden [M, H], w13 [E, 2I, H], ... (count E)
    **dict.fromkeys(("inplace_fused_experts", "outplace_fused_experts"),
                    (re.compile(r"^\[\s*" + _INTS + _SEP + _TRIPLE), 2, 3, 4)),
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
    for op, (rx, ga, gk, gn) in _GEMM_TEXT.items():
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
    pairs = uniq.str.findall(_PAIR)  # the 2-D arguments in order (3-D ones do not match)

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


def with_moe_linears(linears: dict[str, tuple[int, int]],
                     model: ModelSpec) -> dict[str, tuple[int, int]]:
    """`linears` (models.expected_linears) and, for a MoE model, its sparse layers' GEMMs
    (ModelSpec.moe_linears). A dense MLP shape that a MoE GEMM also has (Mixtral's experts are
    its intermediate_size, Qwen1.5-MoE's shared expert too) is named as the MoE GEMM;
    attribute.py renames by layer where a dense layer holds it."""
    moe = {k: (v[0], v[1]) for k, v in model.moe_linears().items()}
    return {k: v for k, v in linears.items() if v not in moe.values()} | moe


def infer_moe_linears(kn: pd.DataFrame, grouped: pd.DataFrame) -> dict[str, tuple[int, int]]:
    """Expert GEMMs of a trace without a model, from its `_grouped_mm` (or fused MoE op) weights
    (columns E, K, N): one into the hidden size H (the K most GEMMs share) is experts_down, the
    other experts_gate_up; a GEMM (H, E) is the router, (H, 1) the shared expert's gate. Empty
    when the trace has neither."""
    if grouped.empty or kn.empty:
        return {}
    h = hidden_size(kn)
    out: dict[str, tuple[int, int]] = {}
    for e, k, n in grouped[["E", "K", "N"]].drop_duplicates().itertuples(index=False):
        out["experts_down" if n == h else "experts_gate_up"] = (int(k), int(n))
        out["router"] = (h, int(e))
    if ((kn["K"] == h) & (kn["N"] == 1)).any():
        out["shared_expert_gate"] = (h, 1)
    return out


def hidden_size(kn: pd.DataFrame) -> int:
    """The hidden size H of GEMM (K, N) counts (columns K, N, count): the K most GEMMs share
    (q, k, v, gate, up, router and lm_head all read H)."""
    return int(kn.groupby("K")["count"].sum().idxmax())


def attention_calls(inst: pd.DataFrame) -> int:
    """How many attention calls the instances hold (one per layer and forward pass): runs of
    consecutive attention instances in a sequence group (an attention op, or an op inside one
    that does not dispatch to others: SDPA's math path launches several kernels)."""
    if not len(inst):
        return 0
    attn = per_value(inst[["op_name", "top_name"]], _attention_ops).to_numpy(dtype=bool)
    grp = inst["grp"].to_numpy()
    opens = attn.copy()
    opens[1:] &= ~attn[:-1] | (grp[1:] != grp[:-1])
    return int(opens.sum())


def _is_attention(base: pd.Series) -> pd.Series:
    """Whether each op base name is attention: the vocabulary's attention ops, or an op named
    like an attention kernel family (aiter::mha_batch_prefill)."""
    role = kernels.roles(base.fillna("")).astype(str)
    return operators.recognise(operators.ATTENTION, base) | role.isin(kernels.ATTENTION_ROLES)


def _attention_ops(rows: pd.DataFrame) -> pd.Series:
    """Per distinct (op_name, top_name): whether the op is attention, or inside one (classify's
    `attn`). An engine's dispatching attention op does not make the ops inside it attention:
    they are instances of their own (attribute.py), a cache write among them."""
    op, top = (_is_attention(base_name(rows[c])) for c in ("op_name", "top_name"))
    dispatch = rows["top_name"].isin(operators.ATTENTION_DISPATCH)
    return (op | (top & ~dispatch)).astype(bool)


def infer_linears(kn: pd.DataFrame, calls: int = 0) -> dict[str, tuple[int, int]] | None:
    """Guess a Qwen/Llama-style layer's linears from GEMM (K, N) counts (columns K, N, count)
    and `calls`, the trace's attention calls (`attention_calls`; 0: unknown).

    The hidden size H is the K most GEMMs share (q, k, v, gate, up, router, lm_head). Two kinds
    of GEMM run into H: a dense MLP's down (I, H), whose up-projection (H, I) runs twice as
    often (gate and up) or fused (H, 2I) as often, and o_proj (q, H), whose q_proj (H, q) runs
    as often (q = H: the two share a shape). Each of q, o and a dense down runs once per
    attention call, k and v once each: (H, kv) 2·calls times, or with q and o 4·calls times
    (H, H) when kv = q = H. An MLP that runs more often than the attention is a MoE layer's
    loop over its hit experts (experts_gate_up, experts_down; the router (H, E) and a shared
    expert's gate (H, 1) then run once per call; without such a router the MLP is dense).
    With `calls`, the attention's linears must each run exactly once per call, and a trace
    without a dense MLP (every MLP a MoE layer's) still has them; without it, the largest
    MLP's down count stands in for `calls` and an MLP is required. Returns None when no
    pattern is found (not a decoder layer's GEMMs, or counts that do not add up).
    """
    c = {(int(a), int(b)): int(n) for a, b, n in kn[["K", "N", "count"]].itertuples(index=False)}
    if not c:
        return None
    h = hidden_size(kn)
    mlps = {}  # I -> fused (its up-projection (H, 2I)) for every MLP pattern into H
    for (i, n), cnt in c.items():
        if n == h and i != h and (c.get((h, i), 0) >= 2 * cnt
                                  or ((h, i) not in c and c.get((h, 2 * i), 0) >= cnt)):
            mlps[i] = (h, i) not in c
    routed = bool(_per_call(c, h, calls, set()))  # a router (H, E) backs an expert loop
    experts = [i for i in mlps if routed and c[(i, h)] > calls]
    dense = [i for i in mlps if i not in experts]
    if not dense and not calls:
        return None
    chosen = ([max(dense)] if dense else []) + experts  # (the MLP patterns that are MLPs)
    out = _attention_linears(c, h, calls or c[(max(dense), h)], calls, chosen)
    if (calls or not dense) and not _attention_runs_per_call(out, c, calls):
        return None
    if dense:
        out |= _mlp_linears(h, max(dense), mlps[max(dense)], _DENSE_MLP)
    for i in experts:
        out |= _mlp_linears(h, i, mlps[i], _EXPERTS_MLP)
    if experts:
        out |= _router(c, h, calls, set(out.values()))
    used = set(out.values())
    rest = [n for (k, n) in c if k == h and (k, n) not in used]
    if rest and max(rest) > max(n for _, n in used):
        out["lm_head"] = (h, max(rest))
    return out


def _attention_linears(c: dict[tuple[int, int], int], h: int, unit: int, calls: int,
                       mlps: list[int]) -> dict[str, tuple[int, int]]:
    """q, k, v (or a fused qkv) and o of GEMM counts `c` (infer_linears): o_proj is the GEMM
    into H, not one of the `mlps`' down projections, that runs closest to `unit` times (twice
    for (H, H), which q_proj shares; on a tie the other: (H, H) may be k and v, kv = H)."""
    out: dict[str, tuple[int, int]] = {}
    o = [(k, cnt) for (k, n), cnt in c.items() if n == h and k not in mlps]
    q = min(o, key=lambda kc: (abs(kc[1] / (2 if kc[0] == h else 1) - unit), kc[0] == h))[0] \
        if o else h
    if c.get((h, q), 0) >= (2 * unit if q == h else 1):
        out["q_proj"] = (h, q)
        kv = [(n, cnt) for (k, n), cnt in c.items() if k == h and n < q and cnt >= 2 * unit]
        if kv:
            n_kv = min(kv, key=lambda nc: abs(nc[1] - 2 * unit))[0]
            out["k_proj"] = out["v_proj"] = (h, n_kv)
        elif q == h and c[(h, h)] >= 4 * unit:
            out["k_proj"] = out["v_proj"] = (h, h)
    else:
        fused_qkv = [n for (k, n), cnt in c.items() if k == h and n > q and (n - q) % 2 == 0
                     and cnt == c.get((q, h), 0)  # as often as o_proj (not the lm_head)
                     and not any(n in (i, 2 * i) for i in mlps)]  # (not an MLP's up)
        if fused_qkv:
            out["qkv_proj"] = (h, min(fused_qkv))
    out["o_proj"] = (q, h)
    return out


def _router(c: dict[tuple[int, int], int], h: int, calls: int,
            used: set[tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """The router (H, E) of an expert loop (the narrowest of `_per_call`'s) and a shared
    expert's gate (H, 1), if it runs as often as a router may."""
    out = {}
    if c.get((h, 1), calls + 1) <= calls and (h, 1) not in used:
        out["shared_expert_gate"] = (h, 1)
    if per_call := _per_call(c, h, calls, used):
        out["router"] = (h, per_call[0])
    return out


def _per_call(c: dict[tuple[int, int], int], h: int, calls: int,
              used: set[tuple[int, int]]) -> list[int]:
    """The N of GEMMs (H, N), 2 <= N < H, no linear in `used`, that run at most once per
    attention call, as a MoE layer's router does (k and v run twice, the lm_head is wider
    than H, a q_proj narrower than H has its o_proj (N, H)), narrowest first."""
    return sorted(n for (k, n), cnt in c.items()
                  if k == h and 2 <= n < h and 0 < cnt <= calls and (k, n) not in used
                  and c.get((n, h)) != cnt)  # (not a q_proj, whose o_proj runs as often)


def _attention_runs_per_call(linears: dict[str, tuple[int, int]],
                             counts: dict[tuple[int, int], int], calls: int) -> bool:
    """Whether the attention's linears (q, k, v or a fused qkv, and o) each run exactly once
    per attention call: a shape shared by several of them as many times more. Without a dense
    MLP this is all that tells a decoder layer's GEMMs from others (a matmul loop); with one
    it keeps a MoE layer's shared expert from passing for q and o."""
    shapes = list(linears.values())
    return ("k_proj" in linears or "qkv_proj" in linears) and all(
        counts.get(shape, 0) == calls * shapes.count(shape) for shape in shapes)


_DENSE_MLP = ("gate_proj", "up_proj", "gate_up_proj", "down_proj")
_EXPERTS_MLP = ("experts_gate", "experts_up", "experts_gate_up", "experts_down")


def _mlp_linears(h: int, i: int, fused: bool, names: tuple[str, str, str, str]
                 ) -> dict[str, tuple[int, int]]:
    """An MLP's linears (names: gate, up, fused gate_up, down) of hidden size h, intermediate i."""
    gate, up, gate_up, down = names
    ups = {gate_up: (h, 2 * i)} if fused else {gate: (h, i), up: (h, i)}
    return {**ups, down: (i, h)}


def name_gemms(inst: pd.DataFrame, linears: dict[str, tuple[int, int]] | None) -> pd.Series:
    """Canonical names of weight GEMMs by (K, N); ties by order within the sequence group.

    A (K, N) shared by several linears (q/o, k/v, gate/up) cycles through them in the order of
    `LINEAR_ORDER` as it recurs: the 1st (H, q) GEMM of a step is q_proj, the 2nd o_proj, the
    3rd q_proj... GEMMs matching nothing are named `linear[K×N]`. Expert weights outside a
    weight GEMM (`expert_weight_kn`: columns WE, WK, WN) get the name of the expert GEMM whose
    (K, N) they have (an `index` gather also its expert count), else none. Returns a
    categorical Series, missing where no name.
    """
    linears = linears or {}
    names = list(_EXPERT_LINEARS)
    codes = _expert_weights(inst, linears)  # into names
    rows = np.flatnonzero(inst["K"].to_numpy() >= 0)
    if len(rows):
        k, n = inst["K"].to_numpy()[rows], inst["N"].to_numpy()[rows]
        w = inst["W"].to_numpy()[rows] if "W" in inst else np.ones(len(rows), np.int64)
        width, most = int(n.max()) + 1, int(w.max()) + 1
        pair, pairs = pd.factorize((k * width + n) * most + w)  # the distinct (K, N, W)
        in_grp = inst["grp"].to_numpy()[rows] * len(pairs) + pair
        occ = pd.Series(in_grp).groupby(in_grp, sort=False).cumcount().to_numpy()
        cycles: dict[tuple[int, ...], list[str]] = {}  # the linears of each (K, N), in order
        for name in LINEAR_ORDER:
            if name in linears and name not in operators.KERNEL_FUSIONS:
                cycles.setdefault(tuple(linears[name]), []).append(name)
        start, size = np.zeros(len(pairs), np.int64), np.zeros(len(pairs), np.int64)
        for p, key in enumerate(pairs):
            (pk, pn), pw = divmod(int(key) // most, width), int(key) % most
            if pw > 1:  # a kernel of several weights: only the fusion of its parts
                fused = _kernel_fusion(pk, pn, pw, linears)
                cycle = [fused] if fused else []
            else:
                cycle = cycles.get((pk, pn), [])
            cycle = cycle or [f"linear[{pk}×{pn}]"]
            start[p], size[p] = len(names), len(cycle)
            names.extend(cycle)
        codes[rows] = start[pair] + occ % size[pair]
        _around_attention(inst, rows, codes, names, pair, start, size)
        _routed_or_shared(inst, rows, codes, names, pair, start, size)
    unique, cats = pd.factorize(np.asarray(names, dtype=object))
    return pd.Series(pd.Categorical.from_codes(np.where(codes >= 0, unique[codes], -1), cats),
                     index=inst.index)


def _routed_or_shared(inst: pd.DataFrame, rows: np.ndarray, codes: np.ndarray,
                      names: list[str], pair: np.ndarray, start: np.ndarray,
                      size: np.ndarray) -> None:
    """Name the GEMMs of a (K, N) that routed experts share with another linear (a shared
    expert as wide as a routed one, DeepSeek's and GLM-4-MoE's) by how they run, not by how
    often the shape recurs: a GEMM over stacked expert weights (`_grouped_mm`, a batched
    expert GEMM: column WE) is a routed expert's; where the trace runs its routed experts so,
    a plain GEMM of that (K, N) is the other linear's (the shared expert's), or `linear[K×N]`
    where the layout has none. A trace that runs its experts as plain GEMMs (a loop over
    experts) keeps its cycle. Updates `codes` (into `names`, extended)."""
    if "WE" not in inst or not ((inst["WE"].to_numpy() >= 0) & (codes >= 0)).any():
        return  # no expert runs over stacked weights
    stacked = inst["WE"].to_numpy()[rows] >= 0
    grp = inst["grp"].to_numpy()[rows]
    for p in range(len(start)):
        cycle = names[start[p]:start[p] + size[p]]
        routed = [start[p] + i for i, x in enumerate(cycle) if x in _EXPERT_LINEARS]
        other = [start[p] + i for i, x in enumerate(cycle) if x not in _EXPERT_LINEARS]
        if not routed:
            continue
        plain = np.flatnonzero((pair == p) & ~stacked)
        if not other and len(plain):  # a plain GEMM that is no routed expert, and no other linear
            k, n = inst["K"].to_numpy()[rows[plain[0]]], inst["N"].to_numpy()[rows[plain[0]]]
            names.append(f"linear[{k}×{n}]")
            other = [len(names) - 1]
        for mask, choice in ((stacked, routed), (~stacked, other)):
            at = np.flatnonzero((pair == p) & mask)
            occ = pd.Series(grp[at]).groupby(grp[at], sort=False).cumcount().to_numpy()
            codes[rows[at]] = np.asarray(choice)[occ % len(choice)]


def _around_attention(inst: pd.DataFrame, rows: np.ndarray, codes: np.ndarray,
                      names: list[str], pair: np.ndarray, start: np.ndarray,
                      size: np.ndarray) -> None:
    """Name the GEMMs of a (K, N) that o_proj shares with input projections (MHA's q, k, v
    and o alike) by the layout's order around attention, not by how often the shape recurs:
    after an attention call its first such GEMM is o_proj; the next ones, after the pass's
    end if one comes between (an embedding, the lm_head), are the next call's q, k, v in
    order. One before that end (an LM head's transform, a pooler), one past the layout's
    projections or one no call follows is no projection: `linear[K×N]`.
    `pair`: each GEMM row's distinct (K, N, W), whose cycle is names[start:start + size].
    Updates `codes` (into `names`, extended); a group without attention keeps its cycle."""
    mixed = [p for p in range(len(start)) if "o_proj" in names[start[p]:start[p] + size[p]]
             and PROJ_IN & set(names[start[p]:start[p] + size[p]])]
    if not mixed:
        return
    flags = classify(inst)
    attn = flags["attn"] | (flags["batched"] & (flags["last0"] != 1))  # (not RoPE's table)
    if "WE" in inst:  # (nor an expert GEMM over stacked weights: Llama 4's batched experts)
        attn &= ~((inst["WE"].to_numpy() >= 0) & (codes >= 0))
    grp = inst["grp"].to_numpy()
    head = np.zeros(len(inst), dtype=bool)  # a pass's end: the lm_head GEMM, an embedding
    head[rows] = np.asarray(names, dtype=object)[codes[rows]] == "lm_head"
    marked = np.zeros(len(inst), dtype=bool)
    marked[rows] = True
    marked = np.flatnonzero(marked | attn)  # GEMMs and attention ops, in their group's order
    same = np.r_[False, grp[marked][1:] == grp[marked][:-1]]
    opens = np.zeros(len(inst), dtype=np.int64)
    opens[marked] = attn[marked] & ~(np.r_[False, attn[marked][:-1]] & same)  # a call's 1st op
    seen = pd.Series(opens).groupby(grp).cumsum().to_numpy()  # attention calls opened so far
    calls = pd.Series(seen).groupby(grp).transform("max").to_numpy()
    ends = pd.Series((head | flags["emb"]).astype(np.int64)).groupby(grp).cumsum().to_numpy()
    # per row, the pass ends seen when the next attention call opens (-1: none comes)
    at_open = pd.Series(ends[opens > 0], index=grp[opens > 0] * (len(inst) + 1) + seen[opens > 0])
    nxt = grp * (len(inst) + 1) + seen + 1
    ends_next = at_open.reindex(nxt).fillna(-1).to_numpy(dtype=np.int64)
    for p in mixed:
        cycle = names[start[p]:start[p] + size[p]]
        proj = np.array([cycle.index(x) for x in cycle if x in PROJ_IN])
        at = rows[pair == p]
        a, tail = seen[at], ends[at] != ends_next[at]  # tail: a pass ends before the call
        key = grp[at] * (int(a.max()) + 1) + a
        r = pd.Series(at).groupby(key).cumcount().to_numpy()  # from the call before
        o = (a > 0) & (r == 0)  # its o_proj
        lead = pd.Series(~o & ~tail).groupby(key).cumsum().to_numpy() - 1  # the next call's
        own = np.where(o, cycle.index("o_proj"),
                       np.where(~tail & (lead < len(proj)), proj[np.clip(lead, 0, len(proj) - 1)],
                                -1))
        names.append(_shape_of(inst, at[0]))
        keep = calls[at] == 0  # no attention in the group: the cycle stays
        codes[at] = np.where(keep, codes[at], np.where(own >= 0, start[p] + own, len(names) - 1))


def _shape_of(inst: pd.DataFrame, row: int) -> str:
    """`linear[K×N]` of a GEMM instance."""
    return f"linear[{int(inst['K'].to_numpy()[row])}×{int(inst['N'].to_numpy()[row])}]"


def _kernel_fusion(k: int, n: int, weights: int, linears: dict[str, tuple[int, int]]
                   ) -> str | None:
    """The fused linear (operators.FUSIONS) a kernel multiplying `weights` weights [K, n/w] at
    once runs: the one of as many parts, its own (K, N) or its parts' all (K, n/w), when no
    other linear has that part shape (MHA's q, k, v and o alike: which two? None)."""
    each = (k, n // weights)
    alike = {name for name, kn in linears.items() if tuple(kn) == each}
    for fused, parts in operators.FUSIONS:
        whole = tuple(linears.get(fused, ())) == (k, n) or all(
            tuple(linears.get(p, ())) == each for p in parts)
        if len(parts) == weights and whole and alike <= set(parts):
            return fused
    return None


_EXPERT_LINEARS = ("experts_gate_up", "experts_gate", "experts_up", "experts_down")
# a 2-D GEMM's operands: mm [a0, a1] x [b0, b1], addmm (bias, [a0, a1], [b0, b1])
# and a `_grouped_mm`'s backward: [a0, a1] x [E, b0, b1] (grad-input) or [a0, a1] x [b0, b1]
# (grad-weight, an [E, a0, b1] output)
_MM_TEXT = {"mm": re.compile(r"^\[\s*" + _PAIR + _SEP + _PAIR),
            "addmm": re.compile(r"^\[\s*" + _INTS + _SEP + _PAIR + _SEP + _PAIR),
            "_grouped_mm": re.compile(r"^\[\s*" + _PAIR + _SEP + r"\[\s*(?:\d+\s*,\s*)?(\d+)\s*,"
                                      r"\s*(\d+)\s*\]")}


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


def _expert_weights(inst: pd.DataFrame, linears: dict[str, tuple[int, int]]) -> np.ndarray:
    """Per instance, the index in _EXPERT_LINEARS of the expert GEMM whose weights it gathers
    or multiplies in a weight-first GEMV (see name_gemms), -1 elsewhere."""
    out = np.full(len(inst), -1)
    if "WK" not in inst or not (inst["WK"] >= 0).any():
        return out
    wk, wn, experts = inst["WK"].to_numpy(), inst["WN"].to_numpy(), inst["WE"].to_numpy()
    count = linears.get("router", (0, -1))[1]
    base = Names.of(inst["op_name"]).mapped(operators.base_names)
    is_index, is_bmm = base.isin(["index"]), base.isin(["bmm"])
    weight_first = is_bmm.copy()  # (the regex once per distinct bmm's dims, not per row)
    if is_bmm.any():
        weight_first[is_bmm] = per_value(inst.loc[is_bmm, "input_dims"], lambda d: d.astype(
            "string").fillna("").str.match(_WEIGHT_FIRST)).to_numpy(dtype=bool)
    for i, name in enumerate(_EXPERT_LINEARS):
        if name in linears:
            k, n = linears[name]
            hit = (wk == k) & (wn == n) & (weight_first | ((is_bmm | is_index) & (experts == count)))
            out[hit & (out < 0)] = i
    return out


# ----------------------------------------------------------------------------------------------
# Position naming
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Regions:
    """Rows cut into regions: runs of rows, each opened by a row where `opens` holds (an anchor,
    or the first row of a sequence group). A quantity of a region is reduced once per region
    (over its run of rows) and broadcast back to its rows."""

    region: np.ndarray  # per row, the number of its region
    starts: np.ndarray  # per region, its first row
    pos: np.ndarray  # per row, its position in its region (0: the row that opened it)

    @classmethod
    def cut(cls, opens: np.ndarray) -> _Regions:
        """The regions opened at the rows where `opens` holds (it holds at the first row)."""
        region = np.cumsum(opens) - 1
        starts = np.flatnonzero(opens)
        return cls(region, starts, np.arange(len(opens)) - starts[region])

    @property
    def past(self) -> int:
        """A position past every row: `first` where no row of the region holds."""
        return len(self.pos) + 1

    def first(self, mask: np.ndarray) -> np.ndarray:
        """Per row, the first position in its region where mask holds (`past` if none)."""
        return np.minimum.reduceat(np.where(mask, self.pos, self.past), self.starts)[self.region]

    def last(self, mask: np.ndarray) -> np.ndarray:
        """Per row, the last position in its region where mask holds (-1 if none)."""
        return np.maximum.reduceat(np.where(mask, self.pos, -1), self.starts)[self.region]

    def any(self, mask: np.ndarray) -> np.ndarray:
        """Per row, whether mask holds at some row of its region."""
        return np.logical_or.reduceat(mask, self.starts)[self.region]

    def opening(self, values: np.ndarray) -> np.ndarray:
        """Per row, the value at the row that opened its region."""
        return values[self.starts][self.region]

    def count(self, mask: np.ndarray) -> np.ndarray:
        """Per row, at how many rows of its region up to and including it mask holds."""
        total = np.cumsum(mask)
        return total - (total - mask)[self.starts][self.region]


def position_names(inst: pd.DataFrame, gemm: pd.Series, qk_norm: bool | None = None
                   ) -> tuple[pd.Series, pd.Series]:
    """(operator, evidence) of `explain` (without the reasons)."""
    name, evidence, _ = explain(inst, gemm, qk_norm)
    return name, evidence


def explain(inst: pd.DataFrame, gemm: pd.Series, qk_norm: bool | None = None,
            placement: Placement | None = None) -> tuple[pd.Series, pd.Series, pd.Series]:
    """Name every instance from anchors and op names. Returns (operator, evidence, reason),
    categorical Series: `shape` for GEMMs matched to a linear (and an eager attention's batched
    Q·Kᵀ / P·V between the projections and o_proj: its geometry), `kernel_name` for ops or
    kernels recognised by their name or family (attention, embedding), `position` for the rest
    (attribute.py turns names outside the vocabulary, such as `other` and `linear[K×N]`, into
    `fallback`); `reason` says why a row is `unattributed`, `other` or `linear[K×N]` ("" where
    named). `gemm`: name_gemms(). `qk_norm`: whether the model normalises q and k per head
    (graphs.py's kernel-name naming, which has no shapes); None: the shapes say, per projection
    (`_qk_norms`). An instance's kernel `role` (kernels.py, a column of `inst` when given)
    counts like its op name: an attention kernel is an anchor, a fused add+RMSNorm a norm.

    Honesty (`_honest`): position only fills the gaps between anchored names (`_explained`),
    and never names a GEMM (only its shape does) or an attention (only its op, kernel family or
    eager geometry does). A trace with GEMMs none of which fits a decoder's linears has no
    decoder names at all."""
    F = _with_roles(classify(inst), inst)
    if "K" in inst:  # an Inductor kernel that fused a weight GEMM is a GEMM (gemm_kn)
        F["gemmop"] = F["gemmop"] | (F["triton"] & (inst["K"].to_numpy() >= 0))
    n = len(inst)
    grp = inst["grp"].to_numpy()
    # weight GEMMs matched to a linear are anchors; an unmatched one (`linear[K×N]`, e.g. the
    # RoPE inverse-frequency product) is named by position like any other op
    gemms = Names.of(gemm)
    generic = gemms.isin(v for v in gemms.vocab if v.startswith("linear["))
    known = ~gemms.isin([""]) & ~generic
    vocab = np.append(gemms.vocab, ["", "attention", "embedding"])
    none, attention, embedding = len(vocab) - 3, len(vocab) - 2, len(vocab) - 1
    anchor = np.where(known | generic.all(), gemms.codes, none)
    anchor = np.where(F["attn"] & (anchor == none), attention, anchor)
    anchor = np.where(F["emb"] & (anchor == none), embedding, anchor)
    is_anchor = anchor != none
    new_grp = np.r_[True, grp[1:] != grp[:-1]] if n else np.zeros(0, bool)
    R = _Regions.cut(is_anchor | new_grp)
    pos = R.pos
    # P: the anchor opening the region; N: the anchor opening the next region of the same grp
    reg_anchor, reg_grp = anchor[R.starts], grp[R.starts]
    same_grp = np.r_[reg_grp[1:] == reg_grp[:-1], False]
    nxt = np.where(same_grp, np.r_[reg_anchor[1:], none], none)
    P, N = Names(reg_anchor[R.region], vocab), Names(nxt[R.region], vocab)

    core = R.first(F["normcore"])
    norm_start = core - R.any((pos == core - 1) & F["cast"])  # a cast right before the norm
    # torch.compile fuses the residual add into the norm kernel: norm_start is that kernel
    before_norm = pos < norm_start

    # preamble RoPE tables (HF computes cos/sin once per forward): from the GEMM or cast
    # feeding the first cos/sin up to the norm
    cs = R.first(F["cossin"])
    unmatched = (inst["K"].to_numpy() >= 0) & generic
    g_before = R.last((F["bgemm"] | unmatched) & (pos < cs))
    rope0 = np.where(g_before >= 0, g_before, cs)
    last_noncast = R.last(~F["cast"] & (pos < rope0))
    rope0 = np.where(cs < R.past, np.minimum(rope0, last_noncast + 1), R.past)

    # between the projections and attention: RoPE, then KV-cache writes, then layout copies
    attn_core = R.first(F["softmax"] | F["bgemm"] | F["batched"])
    last_rope = R.last(F["ropecore"] & (pos < attn_core))

    # a layer opens with its input projections (torch.compile may schedule k_proj before q_proj)
    p_in, n_start = P.isin(PROJ_IN), N.isin(PROJ_IN)
    if qk_norm is None:  # a norm over a per-head view: its last dim below the projection's N
        region_n = R.opening(inst["N"].to_numpy() if "N" in inst else np.full(n, -1))
        per_head = R.any(F["normopen"] & (F["rank0"] >= 3) & (F["last0"] > 0)
                         & (F["last0"] < region_n))
    else:
        per_head = np.full(n, qk_norm)
    qk_name = _qk_norms(R, F, P, p_in & per_head, norm_start, attn_core)
    # before the first layer: at the start, after the embedding, or after the last pass's
    # lm_head when the embedding is fused away (torch.compile) and no ProfilerStep separates
    # the passes
    preamble = P.isin(["", "embedding", "lm_head"]) & n_start
    after_proj = p_in & ~N.isin(MLP_IN | {"down_proj", "lm_head"})
    kv = F["kvonly"] | ((pos > last_rope) & F["kvwrite"])
    after_o, after_down = P.isin(["o_proj"]), P.isin(["down_proj"])
    # mixture of experts: after the router GEMM (whose logits the experts' GEMMs follow), after
    # an expert's down projection, the shared expert's or its sigmoid gate (a block's tail)
    p_router, n_expert = P.isin(["router"]), N.isin(EXPERT_IN)
    p_tail = P.isin(["experts_down", "shared_down_proj", "shared_expert_gate"])
    n_next = n_start | N.isin(["", "lm_head"])  # the next layer or the model's end
    dispatch_start = R.first(F["dispatch"])
    last_acc = R.last(F["acc"])  # the last accumulation into tokens
    last_add = R.last(F["add"] & before_norm)  # the residual add
    add_norm = R.any(F["addnorm"])  # ... unless the norm adds it
    in_fused = F["fused_moe"]  # an engine's fused MoE op, or an op inside one
    # an attention in reach of the gap: the next anchor, or an eager attention's core inside it
    has_attn = N.isin(["attention"]) | (attn_core < R.past)
    after_head = P.isin(["lm_head"])  # logits processing and sampling, then the loop's own work
    rules: list[Rule] = [  # P: the anchor before, N: the anchor after; first match wins
        (is_anchor, Names(anchor, vocab)),  # a matched GEMM, attention, embedding
        # an engine's fused MoE op and the ops inside it, by name
        (F["fused_op"], "experts_gate_up"),  # its fused_moe_kernel launches: attribute.py
        (in_fused & F["topk"], "router"),
        (in_fused & F["dispatch"], "moe_dispatch"),
        (in_fused & F["act"], "experts_act"),
        (in_fused & F["acc"] & F["rank3"], "moe_combine"),  # moe_sum, a sum over top-k
        (in_fused, "router"),  # casts and renormalisation of the routing weights
        # after the router's logits GEMM: softmax, top-k, renormalisation, then the dispatch
        (p_router & n_expert & (pos < dispatch_start), "router"),
        (p_router & n_expert, "moe_dispatch"),
        (P.isin(EXPERT_IN) & F["sync"], "moe_dispatch"),  # the loop's index reads
        (P.isin(EXPERT_IN), "experts_act"),  # between an expert's gate_up and down
        # after an expert's down: in a loop the weighting and index_add_, then the next
        # expert's gather; after the last one the combine up to the residual add
        (p_tail & n_expert & (pos <= last_acc), "moe_combine"),
        (p_tail & n_expert, "moe_dispatch"),
        (p_tail & F["sigmoid"], "router"),  # the shared expert's gate
        (p_tail & n_next & before_norm & (pos == last_add) & ~add_norm, "residual"),
        (p_tail & before_norm, "moe_combine"),
        *_placed(R, F, P, n_start, placement, p_tail),
        (p_tail & n_start, "input_norm"),
        (p_tail, "final_norm"),
        # after a router whose experts run inside an engine's fused op: before that op, its
        # input's preparation (vLLM pads gpt-oss's hidden states), as a bare replay names it;
        # after it, adding the shared expert's output, then the next layer's norm
        (p_router & R.any(F["fused_op"]) & (pos < R.first(F["fused_op"])), "router"),
        # experts whose GEMMs match no linear of the layout: the routing up to their dispatch,
        # nothing from their first GEMM on
        (p_router & ~n_expert & R.any(unmatched) & (pos < dispatch_start), "router"),
        (p_router & ~n_expert & R.any(unmatched) & (pos >= R.first(unmatched)), UNATTRIBUTED),
        (p_router & ~n_expert & R.any(unmatched), "moe_dispatch"),
        (p_router & before_norm, "moe_combine"),
        (p_router & n_start, "input_norm"),
        (p_router, "final_norm"),
        (P.isin(SHARED_IN), "act"),  # the shared expert's activation
        # between the input projections and attention (or o_proj)
        (~qk_name.isin([""]), qk_name),  # q/k RMSNorms over the head dim, before RoPE
        (after_proj & (pos >= attn_core), "attention"),  # from the first softmax / bmm on
        (after_proj & kv, "kv_cache"),  # cache writes (after the last RoPE op)
        (after_proj & F["attnprep"] & has_attn, "attention"),  # Triton kernels on 4-D buffers
        (after_proj & (pos > last_rope) & N.isin(["attention", "o_proj", ""]) & has_attn,
         "attention"),
        (after_proj & (pos > last_rope) & N.isin(["o_proj", ""]) & ~has_attn, UNATTRIBUTED),
        (after_proj, "rope"),
        # the norms and residual adds after o_proj and down_proj, in the layout's order
        *_placed(R, F, P, n_start, placement, after_down, preamble),
        # up to o_proj: layout copies, masks
        (P.isin(["attention"]) & N.isin(["o_proj", "attention"]), "attention"),
        (P.isin(MLP_IN), "act"),  # between gate/up and down
        # after down_proj when the next layer's projections follow: residual add, then norm
        (after_down & n_start & before_norm, "residual"),
        (after_down & n_start, "input_norm"),
        # before the first layer (after the embedding or the previous pass's lm_head, if any)
        (preamble & ~before_norm, "input_norm"),
        (preamble & F["emb"], "embedding"),
        (preamble & (pos >= rope0), "rope"),  # the cos/sin tables HF builds once per forward
        # after o_proj: residual add, then the post-attention norm
        (after_o & before_norm, "residual"),
        (after_o, "post_attention_norm"),
        # after the last down_proj: residual add, then the final norm
        (after_down & before_norm, "residual"),
        (after_down, "final_norm"),
        (P.isin(["", "embedding"]) & F["emb"], "embedding"),
        (after_head & R.any(F["loss"]), "loss"),  # a training step's loss and its inputs
        (after_head & F["sampling"], "sampling"),
    ]
    name = first_match(rules, "other").renamed(SUB_LINEARS)
    by_name = F["fused_op"] | (in_fused & (F["topk"] | F["dispatch"]
                                           | (F["acc"] & F["rank3"])))  # MoE ops by name
    evidence = first_match([(is_anchor & known, "shape"),  # a GEMM matched to a linear
                            (is_anchor | F["emb"] | by_name | (after_head & F["loss"]),
                             "kernel_name")],  # op names
                           "position")
    k_dim = inst["K"].to_numpy() if "K" in inst else np.full(n, -1)
    outer = ((k_dim >= 0) & (k_dim <= 1)) | (F["last0"] == 1)  # (HF's RoPE table: K = 1)
    ctx = _Context(R, F, P, N, gemms, known, generic, is_anchor, by_name | (after_head & F["loss"]),
                   (pos >= rope0) & preamble, outer, attn_core)
    return tuple(pd.Series(v.categorical(), index=inst.index)  # type: ignore[return-value]
                 for v in _honest(ctx, name, evidence))


def _gaps(placement: Placement) -> dict[str, tuple[str, ...]]:
    """The norms and residual adds of a placement before the first layer's attention (`start`:
    the embedding norm, then the layer's own), after the attention block (`o_proj`), after the
    MLP when the next layer follows (`down_proj`) and when the model ends (`end`)."""
    order = placement.order
    a, m = order.index(ATTENTION), order.index(MLP)
    first = ("embedding_norm",) if placement.embedding_norm else ()
    last = ("final_norm",) if placement.final_norm else ()
    return {"start": first + tuple(x for x in order[:a] if x != RESIDUAL),
            "o_proj": order[a + 1:m], "down_proj": order[m + 1:] + order[:a],
            "end": order[m + 1:] + last}


_PRE_GAPS = _gaps(PRE)


def _placed(R: _Regions, F: dict[str, np.ndarray], P: Names, n_start: np.ndarray,
            placement: Placement | None, mlp_end: np.ndarray,
            preamble: np.ndarray | None = None) -> list[Rule]:
    """Rules naming the gaps after o_proj and after the MLP (`mlp_end`: regions its last GEMM
    opens) and, given the `preamble`, before the first layer, from the layout's placement,
    when it differs from a pre-norm layer's (whose gaps the rules after these name, fused
    add+norm kernels included): the k-th norm of the gap is the k-th norm the placement puts
    there (a norm opens at its first op, or the cast right before it), the residual add is the
    last add of two tensors before the norm the placement puts after it. A norm beyond the
    placement's (an LM head's own) is left to the rules after these."""
    if placement is None:
        return []
    gaps = _gaps(placement)
    if gaps == _PRE_GAPS:
        return []
    pos = R.pos
    prev_cast = np.r_[False, F["cast"][:-1]] & (pos > 0)
    next_open = np.r_[F["normopen"][1:], False] & np.r_[pos[1:] > 0, False]
    opens = (F["cast"] & next_open) | (F["normopen"] & ~prev_cast)
    nth = R.count(opens)  # the norms opened so far in the gap
    rules: list[Rule] = []
    if preamble is not None and gaps["start"]:  # ops before its first norm: the embedding's
        start = np.asarray(gaps["start"], dtype=object)
        rules.append((preamble & (nth >= 1) & (nth <= len(start)),
                       Names(np.clip(nth - 1, 0, len(start) - 1), start)))
    gap_of = [(mlp_end & n_start, gaps["down_proj"]), (mlp_end & ~n_start, gaps["end"])]
    if preamble is not None:
        gap_of.append((P.isin(["o_proj"]), gaps["o_proj"]))
    for where, seq in gap_of:
        norms = [x for x in seq if x != RESIDUAL]
        if not norms:
            continue
        res = seq.index(RESIDUAL) if RESIDUAL in seq else -1  # norms before the add
        add_at = R.last(F["add"] & F["binary"] & (nth == res))  # the residual add
        names = Names(np.clip(nth - 1, 0, len(norms) - 1), np.asarray(norms, dtype=object))
        rules += [(where & (nth == res) & (pos >= add_at) & (add_at >= 0), RESIDUAL),
                  (where & (nth == 0) & (res == 0), RESIDUAL),
                  (where & (nth <= len(norms)), names)]
    return rules


def _qk_norms(R: _Regions, F: dict[str, np.ndarray], P: Names, p_in: np.ndarray,
              norm_start: np.ndarray, attn_core: np.ndarray) -> Names:
    """Per instance "q_norm", "k_norm" or "": the RMSNorm of q and of k over the head dim
    (HF Qwen3 / Qwen3-MoE `q_norm`, `k_norm`; vLLM's Qwen3 after its fused qkv_proj alike), by
    its op pattern and place. `p_in`: regions opened by an input projection whose norm is per
    head (a norm over the projection's whole output, e.g. the norm after an o_proj misnamed as
    a projection of q, k or v, is not). In such a region, the ops from its first norm op (and
    the cast before it) up to RoPE (its first neg / cos / sin / rotary op, and the q·cos mul
    right before it), the first attention op or the region's end. After q_proj it is q's norm,
    after k_proj (or Inductor's kv_proj) k's (HF: q_proj, q_norm, k_proj, k_norm, v_proj,
    RoPE); after a fused qkv_proj
    (or v_proj) the first norm is q's, the next k's, each opened by its first op (pow, a fused
    rms_norm) or the cast before it. Dense Llama/Qwen2 layers have no norm op there, so nothing
    is named."""
    pos = R.pos
    last_norm = R.last(F["normcore"])
    rot = R.first(F["rotary"] & (pos > last_norm))
    q_cos = R.any((pos == rot - 1) & F["mul"])
    span = (p_in & (last_norm >= 0) & (pos >= norm_start) & (pos < rot - q_cos)
            & (pos < attn_core))
    same_prev = pos > 0
    same_next = np.r_[pos[1:] > 0, False]
    prev_cast = np.r_[False, F["cast"][:-1]] & same_prev
    next_open = np.r_[F["normopen"][1:], False] & same_next
    opens = span & ((F["cast"] & next_open) | (F["normopen"] & ~prev_cast))
    rules: list[Rule] = [(~span, ""), (P.isin(["q_proj"]), "q_norm"),
                         (P.isin(["k_proj", "kv_proj"]), "k_norm"),
                         (R.count(opens) <= 1, "q_norm")]
    return first_match(rules, "k_norm")


# ----------------------------------------------------------------------------------------------
# Honest naming: position fills gaps between anchors, never a GEMM's or an attention's name
# ----------------------------------------------------------------------------------------------
def _with_roles(F: dict[str, np.ndarray], inst: pd.DataFrame) -> dict[str, np.ndarray]:
    """classify()'s flags with the instance's own kernel role (inst["role"], kernels.ROLES, when
    the table has it) counted like its op name: an attention kernel is attention, a GEMM
    kernel a GEMM, a (fused add) RMSNorm kernel a norm, ..."""
    if "role" not in inst:
        return F
    col = inst["role"]
    if isinstance(col.dtype, pd.CategoricalDtype):  # codes as they are: no string per row
        codes = col.cat.codes.to_numpy()
        vocab = np.append(np.asarray(col.cat.categories, dtype=object), "")
        role = Names(np.where(codes < 0, len(vocab) - 1, codes), vocab)
    else:
        role = Names.of(col.astype("string"))
    out = dict(F)
    for flag, roles in (("attn", kernels.ATTENTION_ROLES), ("gemmop", kernels.GEMM_ROLES),
                        ("normcore", {"norm", "fused_add_norm"}),
                        ("normopen", {"norm", "fused_add_norm"}), ("addnorm", {"fused_add_norm"}),
                        ("rotary", {"rope"}), ("ropecore", {"rope"}),
                        ("kvonly", {"kv_cache_write"}), ("kvwrite", {"kv_cache_write"}),
                        ("act", {"activation"}), ("sampling", SAMPLING_ROLES)):
        out[flag] = F[flag] | role.isin(roles)
    return out


@dataclass(frozen=True)
class _Context:
    """What `_honest` needs of position_names' work."""

    R: _Regions
    F: dict[str, np.ndarray]
    P: Names  # the anchor opening each row's region
    N: Names  # the anchor after it
    gemms: Names  # name_gemms' names
    known: np.ndarray  # a GEMM matched to a linear
    generic: np.ndarray  # a GEMM named linear[K×N]
    is_anchor: np.ndarray
    by_name: np.ndarray  # named by its op's own name (an engine's fused MoE ops)
    rope_table: np.ndarray  # the preamble's RoPE table ops (the inverse-frequency product)
    outer: np.ndarray  # a GEMM over K <= 1: an outer product (RoPE's table), no weight
    attn_core: np.ndarray  # per row, the first eager attention op of its region (R.past: none)


# pseudo-stages of anchors for `_explained`: a decoder layer's STAGES, every MoE GEMM between
# the MLP's input and output, the model-level ones outside; NONE_P / NONE_N: no anchor before /
# after in the sequence
_MOE_STAGE = 5.5
_NONE_P, _EMB, _HEAD, _NONE_N = -2.0, -1.0, 7.0, 8.0
# which next anchor each anchor's gap may end at (a later stage with no anchor stage between,
# the next layer after the MLP, the model's end, the next pass after the lm_head)
_NEXT: dict[float, set[float]] = {
    _NONE_P: {1.0, _HEAD, _EMB}, _EMB: {1.0, _HEAD}, _HEAD: {1.0, _HEAD, _EMB, _NONE_N},
    1.0: {1.0, 2.0}, 2.0: {2.0, 3.0}, 3.0: {5.0, _MOE_STAGE},
    5.0: {5.0, 6.0, _MOE_STAGE}, _MOE_STAGE: {_MOE_STAGE, 6.0, 1.0, _HEAD, _NONE_N},
    6.0: {1.0, _HEAD, _NONE_N, _MOE_STAGE},
}


def _stages(names: Names, missing: float) -> np.ndarray:
    """Per row, the pseudo-stage of its anchor name (`missing` for none, NaN for a name that is
    no decoder anchor, e.g. linear[K×N])."""
    moe = operators.MOE | set(SUB_LINEARS) | {"experts_gate", "experts_up"}
    table = {**{k: float(v) for k, v in operators.STAGES.items()},
             **dict.fromkeys(moe, _MOE_STAGE), "embedding": _EMB, "lm_head": _HEAD, "": missing}
    return np.array([table.get(v, np.nan) for v in names.vocab], dtype=np.float64)[names.codes]


def _explained(ctx: _Context) -> np.ndarray:
    """Per row, whether its gap between two anchors is one a decoder layout explains: the
    anchors follow each other in a layer's order with no anchor missing between (q/k/v ->
    attention -> o_proj -> gate/up or the router -> down -> the next layer's q/k/v), q/k/v ->
    o_proj only with an eager attention inside, o_proj -> the next layer only with an engine's
    fused MoE op inside, attention -> attention only within one call
    (no GEMM or norm between), and the model-level gaps (before the first layer, after the
    last, after the lm_head)."""
    sp, sn = _stages(ctx.P, _NONE_P), _stages(ctx.N, _NONE_N)
    ok = np.zeros(len(sp), dtype=bool)
    for a, nexts in _NEXT.items():
        ok |= (sp == a) & np.isin(sn, list(nexts))
    ok |= (sp == 1.0) & (sn == 3.0) & (ctx.attn_core < ctx.R.past)
    # an engine's fused MoE op (named by its op name, no GEMM anchor) is the layer's MLP
    ok |= (sp == 3.0) & np.isin(sn, [1.0, _HEAD, _NONE_N]) & ctx.R.any(ctx.by_name)
    same_call = ~ctx.R.any(ctx.F["gemmop"] | ctx.F["normcore"])
    return ok & ~((sp == 2.0) & (sn == 2.0) & ~same_call)


def _honest(ctx: _Context, name: Names, evidence: Names) -> tuple[Names, Names, Names]:
    """(name, evidence, reason) per row ("": no reason), after the honesty rules: a GEMM not
    matched by its shape keeps its `linear[K×N]` (else is unattributed), but for an eager
    attention's batched product (evidence `shape`: its geometry), the RoPE table's product and
    an outer product (K <= 1: no weight);
    a position name in a gap no layout explains is unattributed; a trace whose GEMMs all miss
    the decoder's linears has no decoder names (`other` everywhere but the embedding)."""
    n = len(name.codes)
    every = np.ones(n, dtype=bool)
    if ctx.generic.any() and not ctx.known.any():  # GEMMs with shapes, none a decoder's
        # a GEMM loop keeps its linear[K×N] names, elsewhere `other` becomes the op's own name
        # (attribute.py)
        emb = ctx.F["emb"]
        return (first_match([(ctx.generic & ctx.generic.all(), ctx.gemms), (emb, "embedding")],
                            "other"),
                first_match([(emb, "kernel_name")], "position"),
                Names(np.zeros(n, dtype=np.int64), np.asarray([
                    "no decoder layout: no GEMM of the trace fits a decoder's linears (an "
                    "encoder, a CNN, a recommendation model?)"], dtype=object)))
    positional = evidence.isin(["position"])
    gemm = ctx.F["gemmop"] & ~(ctx.is_anchor & ctx.known) & ~ctx.by_name & ~ctx.outer
    # an eager attention's batched products (ops, or Inductor kernels that fused them)
    eager = (gemm | ctx.F["triton"]) & ctx.F["batched"] & name.isin(["attention"])
    table = gemm & ctx.rope_table & name.isin(["rope"])
    lost = gemm & ~eager & ~table
    # (`other` claims nothing: it stays, with the gap as its reason)
    unexplained = positional & ~gemm & ~_explained(ctx) & ~name.isin([UNATTRIBUTED])
    nm = first_match([(lost & ctx.generic, ctx.gemms), (lost, UNATTRIBUTED),
                      (unexplained & ~name.isin(["other"]), UNATTRIBUTED), (every, name)], "")
    ev = first_match([(eager, "shape"), (every, evidence)], "")
    rule = positional & nm.isin([UNATTRIBUTED]) & ~unexplained & ~lost
    said = unexplained | rule  # the rows whose reason names their neighbours
    why = first_match([
        (lost & ctx.generic, "a GEMM whose (K, N) is no linear of the layout"),
        (lost, "a GEMM kernel with no shape to match: never named by its place"),
        (said, _gap_reasons(ctx, said, unexplained)),
        (nm.isin(["other"]), "model work outside the operator vocabulary")], "")
    return nm, ev, why


def _gap_reasons(ctx: _Context, said: np.ndarray, unexplained: np.ndarray) -> Names:
    """Per row, "between P and N: why", worked out once per distinct (P, N, why) of the `said`
    rows ("" elsewhere)."""
    rows = np.flatnonzero(said)
    codes = np.zeros(len(said), dtype=np.int64)
    if not len(rows):
        return Names(codes, np.asarray([""], dtype=object))
    key = (ctx.P.codes[rows] * (len(ctx.N.vocab) + 1) + ctx.N.codes[rows]) * 2 + unexplained[rows]
    _, first, which = np.unique(key, return_index=True, return_inverse=True)
    at = rows[first]
    pn, nn = (np.where(v == "", empty, v).astype(object) for v, empty in (
        (ctx.P.vocab[ctx.P.codes[at]], "the start"), (ctx.N.vocab[ctx.N.codes[at]], "the end")))
    tail = np.where(unexplained[at], ": no layout explains this gap", ": no attention in reach")
    codes[rows] = 1 + which
    return Names(codes, np.asarray(["", *("between " + pn + " and " + nn + tail)], dtype=object))


# ----------------------------------------------------------------------------------------------
# Module frames (with_stack=True): nn.Module: Qwen2Attention_0 > Linear_2
# ----------------------------------------------------------------------------------------------
MODULE_KINDS = {
    "layer": re.compile(r"(?:DecoderLayer|EncoderLayer|TransformerLayer|Block)$"),
    "attn": re.compile(r"Attention$|Attn$|SelfAttention"),
    "mlp": re.compile(r"MLP$|Mlp$|FeedForward$|FFN$"),
    "linear": re.compile(r"Linear$"),
    "norm": re.compile(r"Norm$|RMSNorm|LayerNorm"),
    "rope": re.compile(r"Rotary"),
    "emb": re.compile(r"Embedding$"),
    "act": re.compile(r"Activation$|^SiLU$|^GELU$|AndMul$|^Act"),
}
# vLLM-style parallel linears name their role in the class
LINEAR_CLASSES = {"QKVParallelLinear": "qkv_proj", "MergedColumnParallelLinear": "gate_up_proj"}


def module_frames(frames: pd.DataFrame) -> pd.DataFrame:
    """nn.Module frames with their class, instance suffix and kind ('' when not recognised)."""
    is_module = per_value(frames["name"], lambda u: u.str.startswith("nn.Module: ").fillna(False))
    m = frames[is_module.to_numpy(dtype=bool)].copy()
    full = m["name"].astype("string").str.slice(len("nn.Module: "))
    parts = full.str.extract(r"^(?P<cls>.*?)(?:_(?P<idx>\d+))?$")
    m["cls"] = parts["cls"].fillna("")
    m["idx"] = pd.to_numeric(parts["idx"], errors="coerce").astype("Int64")
    kind = pd.Series("", index=m.index, dtype="string")
    for k in ("linear", "rope", "emb", "norm", "act", "mlp", "attn", "layer"):  # specific first
        hit = (kind == "") & m["cls"].str.contains(MODULE_KINDS[k])
        kind = kind.mask(hit, k)
    m["kind"] = kind
    return m.reset_index(drop=True)


def module_names(inst_t: np.ndarray, inst_key: np.ndarray, frames: pd.DataFrame,
                 position: pd.Series) -> tuple[pd.Series, pd.Series]:
    """Operator name (categorical, missing where no module names it) and layer of each instance
    from the nn.Module frames around it.

    `frames` is module_frames() plus int columns s, e (ns) and key. Linears are named by their
    HF class when it says (QKVParallelLinear) or else by call order inside their parent:
    attention q,k,v,o (or qkv,o), MLP gate,up,down (or gate_up,down); a Linear outside every
    decoder layer is lm_head. Norms: 1st in a layer input_norm, 2nd post_attention_norm,
    outside layers final_norm; inside attention the 1st q_norm, the 2nd k_norm. Inside
    attention but no submodule: q/k norm / RoPE / KV cache / attention from `position`; inside
    the MLP: act; inside the layer only: residual.
    Layer = the instance suffix of the enclosing decoder-layer frame (Qwen2DecoderLayer_3 -> 3).
    """
    n = len(inst_t)
    layer = pd.Series(pd.NA, index=position.index, dtype="Int64")
    if frames.empty or n == 0:
        return pd.Series(pd.Categorical.from_codes(np.full(n, -1), []), index=position.index), layer
    sub, hit = {}, {}
    for kind in ("layer", "attn", "mlp", "linear", "norm", "rope", "emb", "act"):
        f = frames[frames["kind"] == kind].reset_index(drop=True)
        sub[kind] = f
        nest = Nest(f["s"].to_numpy(), f["e"].to_numpy(), f["key"].to_numpy())
        hit[kind] = (nest, nest.innermost(inst_t, inst_key))

    def parent_of(child: pd.DataFrame, kind: str) -> np.ndarray:
        return hit[kind][0].innermost(child["s"].to_numpy(), child["key"].to_numpy())

    lin = sub["linear"].copy()
    lin_name = Names(np.zeros(len(lin), np.intp), np.asarray([""], dtype=object))
    if len(lin):
        pa, pm, pl = parent_of(lin, "attn"), parent_of(lin, "mlp"), parent_of(lin, "layer")
        parent = np.where(pa >= 0, pa, np.where(pm >= 0, 10**12 + pm, -1))
        lin["_parent"], lin["_order"] = parent, lin["s"]
        srt = lin.sort_values(["_parent", "_order"])
        rank = srt.groupby("_parent").cumcount().reindex(lin.index).to_numpy()
        size = lin.groupby("_parent")["s"].transform("size").to_numpy()
        in_a, in_m, in_l = pa >= 0, pm >= 0, pl >= 0
        in_mlp = in_m & ~in_a

        def by_order(names: tuple[str, ...]) -> Names:
            return Names(np.minimum(rank, len(names) - 1), np.asarray(names, dtype=object))

        cls = Names.of(lin["cls"])
        last = rank == size - 1  # other sizes: only the output projection is sure
        rules: list[Rule] = [
            (cls.isin(LINEAR_CLASSES), cls.renamed(LINEAR_CLASSES)),  # the class says its role
            # by call order inside the parent, for the parent's number of linears
            (in_a & (size == 4), by_order(("q_proj", "k_proj", "v_proj", "o_proj"))),
            (in_a & (size == 2), by_order(("qkv_proj", "o_proj"))),
            (in_mlp & (size == 3), by_order(("gate_proj", "up_proj", "down_proj"))),
            (in_mlp & (size == 2), by_order(("gate_up_proj", "down_proj"))),
            (in_a & last, "o_proj"),
            (in_mlp & last, "down_proj"),
            # a Linear outside every decoder layer (when the model has some) is the LM head
            (~in_a & ~in_m & ~in_l & (len(sub["layer"]) > 0), "lm_head"),
        ]
        lin_name = first_match(rules, "")
    nrm = sub["norm"]
    nrm_name = Names(np.zeros(len(nrm), np.intp), np.asarray([""], dtype=object))
    if len(nrm):
        pl, pa = parent_of(nrm, "layer"), parent_of(nrm, "attn")
        start = pd.Series(nrm["s"].to_numpy())
        # the layer's own norms rank among themselves, q/k norms inside attention apart
        rank = start.where(pa < 0).groupby(pl).rank(method="first").to_numpy() - 1
        in_attn = start.groupby(pa).rank(method="first").to_numpy() - 1
        rules = [
            # inside attention: q's norm, then k's (HF Qwen3 q_norm, k_norm), not layer norms
            ((pa >= 0) & (in_attn == 0), "q_norm"),
            ((pa >= 0) & (in_attn == 1), "k_norm"),
            (pa >= 0, ""),
            (pl < 0, "final_norm"),  # outside every decoder layer
            (rank == 0, "input_norm"),  # a layer's 1st norm
            (rank == 1, "post_attention_norm"),  # its 2nd
        ]
        nrm_name = first_match(rules, "")

    def pick(kind: str, names: Names | str) -> Names:
        """Per instance, the name of the innermost module of `kind` around it ("" if none)."""
        idx = hit[kind][1]
        if isinstance(names, str):
            return Names((idx < 0).astype(np.intp), np.asarray([names, ""], dtype=object))
        return Names(np.append(names.codes, len(names.vocab))[idx], np.append(names.vocab, ""))

    pos = Names.of(position)
    by_pos = np.isin(pos.vocab, ["q_norm", "k_norm", "rope", "kv_cache", "attention"])
    in_attn = Names(np.where(hit["attn"][1] >= 0, pos.codes, len(pos.vocab)),
                    np.append(np.where(by_pos, pos.vocab, "attention"), ""))
    # the innermost module of each kind around the instance that names it, most specific first
    candidates = [
        pick("linear", lin_name), pick("norm", nrm_name), pick("emb", "embedding"),
        pick("rope", "rope"), pick("act", "act"),
        in_attn,  # inside attention, no submodule
        pick("mlp", "act"),  # inside the MLP, no Linear
        pick("layer", "residual"),  # inside the layer only
    ]
    name = first_match([(~c.isin([""]), c) for c in candidates], "").categorical()
    li = hit["layer"][1]
    idx = sub["layer"]["idx"].to_numpy(dtype="float64", na_value=np.nan)
    lay = np.where(li >= 0, idx[np.maximum(li, 0)] if len(idx) else np.nan, np.nan)
    layer[:] = pd.array(np.where(np.isnan(lay), pd.NA, lay), dtype="Int64") if n else layer
    return pd.Series(name, index=position.index), layer
