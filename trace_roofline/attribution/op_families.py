"""Op families by an op's name, its outermost op's, its kernel's role and its Input Dims text.

Design notes: docs/design.md ("trace_roofline/attribution/naming.py").
"""

from __future__ import annotations

import functools
import re

import numpy as np
import pandas as pd

from trace_roofline.attribution.naming import (
    Names,
    base_name,
    distinct_values,
    factorized_names,
)
from trace_roofline.model import gemms, kernels, operators
from trace_roofline.model.operators import Name

# Op families, by the op's base name (after the last "::"); attention and embedding ops are
# recognised by the vocabulary (operators.py).
# the batched GEMM ops (gemms.SIGNATURES: operands [B, M, K] x [B, K, N])
BATCHED_GEMM_OPS = frozenset(op for op, sig in gemms.SIGNATURES.items() if sig.batched)
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
SAMPLING_ROLES = {Name.SAMPLING, "softmax", "sort_scan"}  # (kernels.ROLES)
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

_ACTIVATION = re.compile(r"\[\s*\d+\s*(?:,\s*\d+\s*){1,},\s*(?:[2-9]|\d{2,})\s*\]")  # >= 3-D, last > 1
# the first two arguments are both tensors (a residual add, not a norm's add of its epsilon)
_BINARY = re.compile(r"^\[\s*\[\s*\d[\d\s,]*\]\s*,\s*\[\s*\d[\d\s,]*\]")
_EMPTY = re.compile(r"\[\s*\]")  # an argument that is no tensor
_DIGIT, _INT = re.compile(r"\d"), re.compile(r"\d+")
_FIRST_ARG = re.compile(r"^\[\s*\[([\d\s,]*)\]")  # the first argument's dims
_RANK3_FIRST = re.compile(r"^\[\s*\[\s*\d+\s*,\s*\d+\s*,\s*\d+\s*\]")
_DIMS_4D = re.compile(r"\[\s*\d+\s*,\s*\d+\s*,\s*\d+\s*,\s*\d+\s*\]")  # [B, heads, S, d]
_BATCHED = re.compile(r"^\[\s*\[\s*\d+\s*(?:,\s*\d+\s*){2,3}\]\s*,\s*\[\s*\d+\s*(?:,\s*\d+\s*){1,2}"
                      r",\s*(?:[2-9]|\d{2,})\s*\]")
# weight GEMM ops (the innermost shape-carrying op of a linear); Inductor's and the libraries'
# GEMM kernels are GEMMs by their kernel family (kernels.GEMM_ROLES)
GEMM_OPS = gemms.GEMM_OPS


def _op_flags(names: pd.Series) -> pd.DataFrame:
    base = base_name(names).fillna("")
    triton = base.str.match(operators.TRITON_KERNEL_OP)
    role = kernels.roles(base).astype(str)  # an engine's op named like its kernel, Inductor's
    tri = triton.to_numpy(dtype=bool)
    fuses = {k: np.zeros(len(base), dtype=bool) for k in kernels.INDUCTOR_FUSES}
    if tri.any():  # (only Inductor kernels fuse anything)
        for k, fused in fuses.items():
            fused[tri] = kernels.inductor_fuses(base[tri], k).to_numpy(dtype=bool)
    knorm = role.isin(["norm", "fused_add_norm"])
    return pd.DataFrame({
        "triton": triton,
        "attn": operators.recognise(operators.ATTENTION, base) | role.isin(kernels.ATTENTION_ROLES),
        "emb": operators.recognise(operators.EMBEDDING, base),
        "normcore": base.isin(NORM_CORE_OPS) | fuses["norm"] | knorm,
        "normopen": base.isin(NORM_OPEN_OPS) | fuses["norm"] | knorm,
        "rotary": base.isin(ROTARY_OPS) | fuses[Name.ROPE] | role.eq(Name.ROPE),
        "mul": base == "mul",
        "addnorm": base.isin(ADD_NORM_OPS) | role.eq("fused_add_norm"),
        "cast": base.isin(CAST_OPS),
        "ropecore": base.isin(ROPE_CORE_OPS) | fuses[Name.ROPE] | role.eq(Name.ROPE),
        "cossin": base.isin({"cos", "sin"}),
        "kvwrite": base.isin(KV_WRITE_OPS) | (fuses["store"] & ~fuses[Name.ROPE])
        | role.eq("kv_cache_write"),
        "kvonly": base.isin(KV_ONLY_OPS) | role.eq("kv_cache_write"),
        "tristore": fuses["store"],
        "tricat": fuses["cat"],
        "activation": base.isin(ACT_OPS) | fuses[Name.ACT] | role.eq("activation"),
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
        "sampling_op": base.isin(SAMPLING_OPS) | role.isin(SAMPLING_ROLES),
        "loss_op": base.isin(LOSS_OPS) | role.eq(Name.LOSS),
        "fused_moe": operators.recognise(operators.FUSED_EXPERTS, base),
    })


def classify(inst: pd.DataFrame) -> dict[str, np.ndarray]:
    """Op-family flags per instance (boolean arrays; rank0 and last0 of `dims_flags` ints), from
    its own op, the outermost op around it (casts, cache writes and embeddings are recognised
    there), Triton name tokens and, for Triton kernels, their 4-D arguments: a store into a
    cache-shaped buffer or a cat growing one is a cache write (kvonly), a kernel on 4-D buffers
    only prepares attention. Worked out once per distinct (op, outermost op, Input Dims)."""
    codes, distinct = distinct_values(inst[["op_name", "top_name", "input_dims"]])
    return {col: flags[codes] for col, flags in _classify_distinct(distinct).items()}


@functools.lru_cache(maxsize=4)
def _flags_of_names(names: tuple[str | None, ...]) -> dict[str, np.ndarray]:
    """_op_flags of distinct op names (None: missing), kept for the next call on the same names
    (name_gemms and explain classify the same instances)."""
    return {c: v.to_numpy(dtype=bool)
            for c, v in _op_flags(pd.Series(names, dtype=object).astype("string")).items()}


def _name_flags(op_name: pd.Series, top_name: pd.Series
                ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """_op_flags of each op name and each outermost op name, once per distinct name of both."""
    codes, names = factorized_names(pd.concat([op_name, top_name], ignore_index=True))
    flags = _flags_of_names(tuple(names.tolist()))
    op, top = codes[:len(op_name)], codes[len(op_name):]
    return {c: v[op] for c, v in flags.items()}, {c: v[top] for c, v in flags.items()}


@functools.lru_cache(maxsize=4)
def _dims_of_texts(texts: tuple[str | None, ...]) -> pd.DataFrame:
    """dims_flags of distinct Input Dims texts, kept for the next call on the same texts."""
    return dims_flags(pd.Series(texts, dtype=object).astype("string"))


def _attention(op: dict[str, np.ndarray], top: dict[str, np.ndarray],
               top_name: pd.Series) -> np.ndarray:
    """Whether the op is attention, or inside one (classify's `attn`): the vocabulary's
    attention ops or an op named like an attention kernel family (aiter::mha_batch_prefill).
    An engine's dispatching attention op does not make the ops inside it attention: they are
    instances of their own (attribute.py), a cache write among them."""
    dispatch = top_name.isin(operators.ATTENTION_DISPATCH).to_numpy(dtype=bool)
    return op["attn"] | (top["attn"] & ~dispatch)


def _classify_distinct(rows: pd.DataFrame) -> dict[str, np.ndarray]:
    op, top = _name_flags(rows["op_name"], rows["top_name"])
    dcodes, texts = factorized_names(rows["input_dims"])
    dims = {c: v.to_numpy(dtype=np.int64 if c in ("rank0", "last0") else bool)[dcodes]
            for c, v in _dims_of_texts(tuple(texts.tolist())).items()}
    has4d, grows, only4d = (dims[c] for c in ("has4d", "grows", "only4d"))
    out = {c: v for c, v in op.items() if c not in ("tristore", "tricat", "tribmm")}
    for col in ("attn", "emb", "normcore", "kvonly", "activation", "softmax", "dispatch",
                "fused_moe", "loss_op"):
        out[col] = op[col] | top[col]
    out["attn"] = _attention(op, top, rows["top_name"])
    out["cast"] = top["cast"]
    out["fused_op"] = op["fused_moe"]  # the engine's fused MoE op itself (not one inside it)
    out["kvwrite"] = top["kvwrite"] | (op["kvwrite"] & op["triton"])
    out["kvonly"] = out["kvonly"] | (op["tristore"] & has4d) | (op["tricat"] & grows)
    out["attnprep"] = op["triton"] & ~out["kvonly"] & only4d
    out["rank3"] = dims["rank3"]
    out["binary"] = dims["binary"]
    # an eager attention's Q·Kᵀ or P·V: a batched matmul op, or an Inductor kernel that fused a
    # bmm over two activations of 3-D or more (Gemma-2's soft-capped, gpt-oss's sink attention)
    out["batched"] = (dims["batched"] & (op["bgemm"] | op["matmul"])) | (
        op["tribmm"] & dims["activations"])
    out["rank0"] = dims["rank0"]
    out["last0"] = dims["last0"]
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
    rest = text.str.replace(_DIMS_4D, "", regex=True).str.replace(_EMPTY, "", regex=True)
    four = text.str.findall(_DIMS_4D)  # one Python pass per distinct text, not per event

    def appended(found: list[str]) -> bool:
        shapes = [tuple(int(v) for v in f.strip("[] ").split(",")) for f in found]
        return any(a[:2] == b[:2] and a[3] == b[3] and b[2] > a[2]
                   for a in shapes for b in shapes)

    grows = [appended(f) if isinstance(f, list) and len(f) > 1 else False for f in four]
    first = text.str.extract(_FIRST_ARG)[0].fillna("").str.findall(_INT)
    return pd.DataFrame({"has4d": has4d, "only4d": has4d & ~rest.str.contains(_DIGIT),
                         "grows": pd.Series(grows, index=text.index, dtype=bool),
                         "rank3": text.str.contains(_RANK3_FIRST),
                         "binary": text.str.contains(_BINARY),
                         "rank0": first.str.len().astype("int64"),
                         "batched": text.str.contains(_BATCHED),
                         "activations": text.str.count(_ACTIVATION) >= 2,
                         "last0": pd.to_numeric(first.str[-1], errors="coerce")
                         .fillna(-1).astype("int64")})


def attention_calls(inst: pd.DataFrame) -> int:
    """How many attention calls the instances hold (one per layer and forward pass): runs of
    consecutive attention instances in a sequence group (an attention op, or an op inside one
    that does not dispatch to others: SDPA's math path launches several kernels)."""
    if not len(inst):
        return 0
    attn = _attention(*_name_flags(inst["op_name"], inst["top_name"]), inst["top_name"])
    grp = inst["grp"].to_numpy()
    opens = attn.copy()
    opens[1:] &= ~attn[:-1] | (grp[1:] != grp[:-1])
    return int(opens.sum())


# the flags a kernel's role (kernels.ROLES; RoPE's is spelt as the operator) raises
_ROLE_FLAGS: list[tuple[str, frozenset[str] | set[str]]] = [
    ("attn", kernels.ATTENTION_ROLES), ("gemmop", kernels.GEMM_ROLES),
    ("normcore", {"norm", "fused_add_norm"}), ("normopen", {"norm", "fused_add_norm"}),
    ("addnorm", {"fused_add_norm"}), ("rotary", {Name.ROPE}), ("ropecore", {Name.ROPE}),
    ("kvonly", {"kv_cache_write"}), ("kvwrite", {"kv_cache_write"}),
    ("activation", {"activation"}), ("sampling_op", SAMPLING_ROLES),
]


def with_roles(flags: dict[str, np.ndarray], inst: pd.DataFrame) -> dict[str, np.ndarray]:
    """classify()'s flags with the instance's own kernel role (inst["role"], kernels.ROLES, when
    the table has it) counted like its op name: an attention kernel is attention, a GEMM
    kernel a GEMM, a (fused add) RMSNorm kernel a norm, ..."""
    if "role" not in inst:
        return flags
    col = inst["role"]
    if isinstance(col.dtype, pd.CategoricalDtype):  # codes as they are: no string per row
        codes = col.cat.codes.to_numpy()
        vocab = np.append(np.asarray(col.cat.categories, dtype=object), "")
        role = Names(np.where(codes < 0, len(vocab) - 1, codes), vocab)
    else:
        role = Names.of(col.astype("string"))
    out = dict(flags)
    for flag, roles in _ROLE_FLAGS:
        out[flag] = flags[flag] | role.isin(roles)
    return out
