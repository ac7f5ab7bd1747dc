"""Cost rules of the attention ops (SDPA and its backends, flash-attention's forward as engines
call it, SDPA's backward, Inductor's flex attention template), and the table-wide passes that
finish attention rows: an eager attention's matmuls, K and V expanded by repeat_kv, a serving
step's attention from its annotation.

Design notes: docs/design.md ("trace_roofline/costs/").
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from trace_roofline.attribution import steps
from trace_roofline.costs.call import (
    LAYOUT,
    SHAPE,
    STEP,
    Arg,
    Call,
    Cost,
    Kind,
    Malformed,
    each_distinct,
    element_bytes,
    known,
    tensor,
)
from trace_roofline.model import dtypes, formulas, layouts, operators
from trace_roofline.model.models import ModelSpec
from trace_roofline.model.operators import Name

# Attention ops whose arguments hold only the step's new tokens, with why they are uncosted.
_ATTENTION_WITHOUT_LENGTHS = {
    name: "query [T, n_q, d], key and value [T, n_kv, d] are the step's new tokens only; "
          "each sequence's key length is in vLLM's attention metadata, not among the op's "
          "arguments"
    for name in operators.ATTENTION_DISPATCH}


def attention(c: Call) -> Cost:
    """Q [B,n_q,T,d], K [B,n_kv,S,d], V [B,n_kv,S,d_v] (or BTHD; or a flash-attention forward
    over packed or paged sequences, `_varlen_attention`): formulas.attention_flops /
    attention_bytes, d and d_v apart (MLA: 192 and 128)."""
    if c.name in layouts.VARLEN_LAYOUTS:
        return _varlen_attention(c, layouts.VARLEN_LAYOUTS[c.name])
    if c.name in layouts.ATTENTION_BACKWARD_CAUSAL_AT:
        return _attention_backward(c)
    if c.name in _ATTENTION_WITHOUT_LENGTHS:
        return Cost(uncosted=f"{c.name}: {_ATTENTION_WITHOUT_LENGTHS[c.name]}")
    if c.name not in layouts.ATTENTION_LAYOUTS:
        return Cost(uncosted=f"{c.name}: attention op without a known argument layout "
                             "(its mask and sequence lengths are not recorded)")
    layout, causal_at = layouts.ATTENTION_LAYOUTS[c.name]
    q, k = tensor(c.args, 0), tensor(c.args, 1)
    if len(q.dims) != 4 or len(k.dims) != 4:
        return Cost(uncosted=f"{c.name}: variable-length attention (sequence lengths not recorded)")
    if layout == "BHTD":
        (batch, n_q, t, d), (_, n_kv, s, _) = q.dims, k.dims
    else:
        (batch, t, n_q, d), (_, s, n_kv, _) = q.dims, k.dims
    flag = c.args[causal_at].concrete if causal_at < len(c.args) else ""
    if c.name == "aten::_efficient_attention_forward" and flag:
        flag = "False" if flag == "0" else "True"
    if flag in ("False", "0") and _query_mask(c.args, t, s):
        flag = ""  # a mask over the queries, its values not recorded: the verdict decides
    return attention_cost(c, q, (batch, n_q, n_kv, t, s, d), flag, _head_dim(c.args, 2))


# SDPA's backward ops: the index of their attn_bias (the forward's mask), where they take one
_BACKWARD_MASK_AT = {"aten::_scaled_dot_product_efficient_attention_backward": 4,
                     "aten::_scaled_dot_product_cudnn_attention_backward": 8,
                     "aten::_cudnn_attention_backward": 8}


def _query_mask(args: list[Arg], t: int, s: int, at: int = 3) -> bool:
    """Whether argument `at` (SDPA's attn_mask, the efficient and cuDNN kernels' bias) is a
    square mask over T = S > 1 queries shared by the heads, [B|1, 1, T, T]: a decoder's causal
    mask's shape (attribution/kind.py reads it so), though its values are not recorded. (Not
    T < S: a cross-attention's padding mask has that shape too.)"""
    m = args[at] if len(args) > at else None
    return (1 < t == s and m is not None and m.is_tensor and len(m.dims) == 4
            and m.dims[1] == 1 and m.dims[2:] == [t, s])


def _head_dim(args: list[Arg], i: int) -> int | None:
    """V's head size: the last dim of argument i when it is a tensor with dims, else None
    (taken as d)."""
    v = args[i] if i < len(args) else None
    return v.dims[-1] if v is not None and v.is_tensor and v.dims else None


def attention_cost(c: Call, q: Arg, shape: tuple[int, int, int, int, int, int],
                    flag: str, d_v: int | None = None) -> Cost:
    """B sequences of T queries (n_q heads) against S keys (n_kv heads) of head_dim d, values of
    d_v (None: d); `flag` the recorded is_causal ("True"/"False", else unknown: causal in a
    decoder, bidirectional in an encoder (`Call.decoder`), and the derivation `layout`)."""
    batch, n_q, n_kv, t, s, d = shape
    # A single query token attends to every cached key; otherwise trust is_causal when recorded.
    recorded = flag in ("True", "False")
    is_causal = t > 1 and (flag == "True" if recorded else c.decoder)
    counted = c.causal if is_causal else "full"
    dv = d if d_v is None else d_v
    geometry = formulas.AttentionShape(n_q, n_kv, t, s, d, dv, batch, counted)
    flops = formulas.attention_flops(geometry)
    nbytes = formulas.attention_bytes(geometry, q.b, c.attention_bytes)
    text = (f"B={batch} n_q={n_q} n_kv={n_kv} T={t} S={s} d={d}"
            + (f" d_v={dv}" if dv != d else "") + (" causal" if is_causal else ""))
    useful = batch * n_q * formulas.attention_pairs(t, s, "causal" if is_causal else "full")
    executed = (batch * n_q * t * s if not is_causal or c.name in _MATH_ATTENTION
                else batch * n_q * tiled_pairs(t, s))
    assumed = t > 1 and not recorded
    if assumed:
        text += (" (mask values not recorded: causal, as a decoder's)" if is_causal else
                 " (mask values not recorded: every pair, as an encoder's)")
    return Cost(Kind.ATTENTION, flops, nbytes, q.dtype, text, batch=batch, t=t, s=s,
                causal=is_causal, heads=(n_q, n_kv, d), pairs=(executed, useful),
                derivation=LAYOUT if assumed else SHAPE)


# SDPA's math backend scores every pair before masking (no tiles skipped)
_MATH_ATTENTION = frozenset({"aten::_scaled_dot_product_attention_math"})
# Query and key tile of a flash-style kernel (FlashAttention-2's forward: kBlockM = 128 rows;
# Inductor's flex template: BLOCK_M = 128): a causal kernel skips the tiles wholly above the
# diagonal and computes the diagonal tiles whole.
_TILE = 128


def tiled_pairs(t: int, s: int) -> float:
    """Query-key pairs one head of a causal flash kernel computes: each tile of up to _TILE
    queries scores its keys up to its last query's, rounded up to whole tiles (at most S)."""
    start = np.arange(0, t, _TILE)
    rows = np.minimum(_TILE, t - start)
    keys = np.minimum(s, np.ceil((s - t + start + rows) / _TILE) * _TILE)
    return float((rows * keys).sum())


def _attention_backward(c: Call) -> Cost:
    """SDPA's backward (grad_out, query [B,n_q,T,d], key [B,n_kv,S,d], ...): the forward's
    geometry and causal convention (`attention_cost`), formulas.attention_backward_flops and
    attention_backward_bytes."""
    causal_at = layouts.ATTENTION_BACKWARD_CAUSAL_AT[c.name]
    q, k = tensor(c.args, 1), tensor(c.args, 2)
    if len(q.dims) != 4 or len(k.dims) != 4:
        raise Malformed(f"query {q.dims} and key {k.dims} are not [B, heads, T, d]")
    (batch, n_q, t, d), (_, n_kv, s, _) = q.dims, k.dims
    flag = c.args[causal_at].concrete if causal_at < len(c.args) else ""
    mask_at = _BACKWARD_MASK_AT.get(c.name)
    if flag == "False" and mask_at is not None and _query_mask(c.args, t, s, mask_at):
        flag = ""  # (as the forward's mask: `_query_mask`)
    dv = _head_dim(c.args, 3)
    fwd = attention_cost(c, q, (batch, n_q, n_kv, t, s, d), flag, dv)
    counted = c.causal if fwd.causal else "full"
    geometry = formulas.AttentionShape(n_q, n_kv, t, s, d, dv, batch, counted)
    return Cost(Kind.ATTENTION, formulas.attention_backward_flops(geometry),
                formulas.attention_backward_bytes(geometry, q.b), q.dtype,
                f"backward of {fwd.shape}", batch=batch, t=t, s=s, causal=fwd.causal,
                heads=(n_q, n_kv, d), pairs=fwd.pairs, derivation=fwd.derivation)


def flex_attention(c: Call, ts: list[Arg]) -> Cost:
    """Inductor's flex attention template (triton_tem_fused_flex_attention_0: Q [B,n_q,T,d],
    K [B,n_kv,S,d], V [B,n_kv,S,d_v], then the logsumexp, the block mask and the output) as
    the attention it runs (`attention_cost`). Its mask is a Python function and its block
    mask's values are not recorded: causal in a decoder, every pair in an encoder
    (`Call.decoder`), derivation `layout`, said in the shape. Block-sparse skipping is not
    modelled: a sliding window's or a document mask's FLOPs are the upper bound."""
    four = [t for t in ts if len(t.dims) == 4]
    if len(four) < 3:
        return Cost(uncosted=f"{c.name}: flex attention without Q, K, V [B, heads, T, d]")
    q, k, v = four[:3]
    (batch, n_q, t, d), (_, n_kv, s, _) = q.dims, k.dims
    return attention_cost(c, q, (batch, n_q, n_kv, t, s, d), "", v.dims[-1])


def eager_attention(out: pd.DataFrame, causal: str, decoder: bool) -> None:
    """An eager attention's QKᵀ and P·V matmuls (bmm/matmul rows named attention) compute every
    query-key pair of a prefill's square T x T scores (QKᵀ: M = N = T; P·V: M = K = T; T > 1):
    the QKᵀ row holds the pairs, all executed, a decoder's causal share (pairs/(T·T)) useful,
    an encoder's all. Under --causal causal a decoder's two matmuls count their causal share
    of FLOPs, as the attention rule does, the shape says so. Bytes stay those the GEMM moved;
    other shapes (T = 1, chunks) are left at every pair."""
    m, k, n = (out[c].to_numpy(dtype=np.float64, na_value=np.nan) for c in ("M", "K", "N"))
    flops = out["flops"].to_numpy(np.float64)
    rows = ((out["operator"] == Name.ATTENTION).to_numpy(bool)
            & out["op_name"].isin(layouts.EAGER_ATTENTION_GEMMS).to_numpy(bool)
            & (m > 1) & ((n == m) | (k == m)) & (flops > 0))
    if not rows.any():
        return
    sizes, at = np.unique(m[rows], return_inverse=True)
    share = (np.array([formulas.attention_pairs(int(t), int(t), "causal") / (t * t)
                       for t in sizes]) if decoder else np.ones(len(sizes)))[at]  # (per T)
    scores = rows & (n == m) & (k != m)
    executed = flops[scores] / (2.0 * k[scores])
    out.loc[scores, "pairs_executed"] = executed
    out.loc[scores, "pairs_useful"] = executed * share[scores[rows]]
    if causal == "causal" and decoder:
        out.loc[rows, "flops"] = flops[rows] * share
        out.loc[rows, "shape"] = out.loc[rows, "shape"].astype(str) + " (causal pairs)"


def repeated_kv(out: pd.DataFrame, model: ModelSpec | None) -> None:
    """A GQA model's attention run over K and V expanded to the query heads (HF's repeat_kv
    before an SDPA: n_kv = n_q recorded) reads K and V of the model's n_kv heads once, its
    GQA-aware minimum bytes, whether its shapes came from the op or a graph map; the copies
    that expand them are rows of their own (`repeat_kv`, copy kind), not attention's bytes."""
    if model is None or model.num_kv_heads >= model.num_heads:
        return
    att = out["operator"].eq(Name.ATTENTION).to_numpy(bool)
    expanded = (att & out["cost_kind"].eq(Kind.ATTENTION).to_numpy(bool, na_value=False)
                & out["n_kv"].eq(out["n_q"]).to_numpy(bool, na_value=False)
                & out["derivation"].eq(SHAPE).to_numpy(bool)
                & ~out["shape"].astype(str).str.startswith("backward").to_numpy(bool))
    # (the model's heads, or a TP shard of them: a wrong model's are left alone)
    nq = out["n_q"].to_numpy(np.float64, na_value=np.nan)
    expanded &= (model.num_heads % np.nan_to_num(nq, nan=np.inf) == 0) & (
        nq * model.num_kv_heads % model.num_heads == 0)
    if expanded.any():
        e = out.loc[expanded]
        nq = nq[expanded]
        nkv = nq * model.num_kv_heads / model.num_heads
        b = element_bytes(e["dtype"])
        d = e["head_dim"].to_numpy(np.float64)
        kv = e["B"].to_numpy(np.float64) * e["S"].to_numpy(np.float64) * 2.0 * d * b
        out.loc[expanded, "bytes"] = e["bytes"].to_numpy(np.float64) - (nq - nkv) * kv
        out.loc[expanded, "n_kv"] = nkv.astype(np.int64)
        out.loc[expanded, "shape"] = (e["shape"].astype(str)
                                      + " (K, V expanded by repeat_kv: read as the model's n_kv)")
    # eager: copy_ of the expand [B, n_kv, n_rep, S, d]; compiled: a Triton kernel reading
    # [B, n_kv, S, d] and writing [B, n_kv·n_rep, S, d]
    shape = out["shape"].astype(str)
    heads = shape.str.extract(r"^\[\d+, (\d+), \d+, \d+\] \[\d+, (\d+), \d+, \d+\] over"
                              ).astype(float).to_numpy()
    copies = att & (
        (out["cost_kind"].eq(Kind.COPY) & shape.str.match(r"\[\d+, \d+, \d+, \d+, \d+\] ->")
         ).to_numpy(bool, na_value=False)
        | (out["cost_kind"].eq(Kind.FUSED).to_numpy(bool, na_value=False)
           & (heads[:, 1] == heads[:, 0] * model.num_heads / model.num_kv_heads)))
    out.loc[copies, "operator"] = "repeat_kv"


def _varlen_attention(c: Call, at: layouts.Varlen) -> Cost:
    """flash-attention's forward as engines call it: q [total_q, n_q, d] with cu_seqlens_q
    [B + 1] (or [B, T, n_q, d]); k, v packed [total_k, n_kv, d], paged [pages, page_size, n_kv,
    d] (with a page table) or dense [B, S, n_kv, d]. Costed by `attention_cost` where the
    recorded shapes fix every sequence's T and S: one sequence (T = total_q, S = max_seqlen_k,
    else the packed keys' total), or a dense batch of equal lengths. Several packed or paged
    sequences are uncosted: their lengths are tensor values (cu_seqlens, seqused_k), which the
    trace does not record."""
    q, k = tensor(c.args, 0), tensor(c.args, 1)
    if len(q.dims) not in (3, 4) or len(k.dims) not in (3, 4):
        raise Malformed(f"query {q.dims} and key {k.dims} are not [tokens, heads, d] or "
                        "[B, T, heads, d]")

    def given(i: int) -> bool:
        return i < len(c.args) and c.args[i].is_tensor

    if len(q.dims) == 4:
        batch, t = q.dims[0], q.dims[1]
    elif given(at.cu_seqlens_q):
        batch, t = c.args[at.cu_seqlens_q].numel - 1, q.dims[0]
    else:
        raise Malformed("packed query [tokens, heads, d] without cu_seqlens_q")
    if batch < 1:
        raise Malformed(f"{batch} sequences")
    max_k = c.args[at.max_seqlen_k].concrete if at.max_seqlen_k < len(c.args) else ""
    dense = len(k.dims) == 4 and not given(at.page_table) and not given(at.seqused_k)
    if batch == 1 and max_k.isdigit():
        s = int(max_k)
    elif batch == 1 and len(k.dims) == 3:
        s = k.dims[0]
    elif dense and len(q.dims) == 4:
        s = k.dims[1]
    else:
        bound = f" (max_seqlen_k {max_k} bounds them)" if max_k.isdigit() else ""
        return Cost(uncosted=f"{c.name}: {batch} packed or paged sequence(s): each one's query "
                             f"and key lengths are tensor values the trace does not record{bound}")
    flag = next((a.concrete for a in c.args[at.causal_from:] if a.concrete in ("True", "False")),
                "")
    return attention_cost(c, q, (batch, q.dims[-2], k.dims[-2], t, s, q.dims[-1]), flag,
                           _head_dim(c.args, 2))


_BORROWED = "graph_map"  # evidence of a replayed kernel named (and shaped) from a capture
_BORROWED = "graph_map"  # evidence of a replayed kernel named (and shaped) from a capture
_STEP_NEEDS_MODEL = (": its sequence lengths are not among its arguments, but its serving "
                     "step's annotation holds the batch's query and key sums: give --model (the "
                     "model's config.json) and they cost it")


def step_attention(out: pd.DataFrame, step_text: pd.Series, model: ModelSpec | None,
                    causal: str, attention_bytes: str) -> None:
    """Cost, in place, the attention instances their ops left uncosted (paged, packed or
    new-token-only arguments), and those whose shapes a graph replay borrowed from a capture
    of another batch (evidence graph_map), inside a serving step whose annotation holds the
    batch sums
    (attribution/steps.py): per layer the step's query-key pairs (its window, if any) of the
    model's heads, 2·n_q·(d + d_v) FLOPs per pair; bytes Q read and O written for Σq tokens,
    K and V of the keys read (`attention_bytes` kv: those only); the evidence in `shape`. A
    layer's further attention instances in the same step (a split kernel named apart) cost
    nothing more. Without a model they stay uncosted, their reason saying that --model costs
    them. Vectorised: each distinct (step, window) is worked out once."""
    text = pd.Series(step_text, index=out.index, dtype=object)
    attention = out["operator"].eq(Name.ATTENTION).to_numpy(bool)
    uncosted = attention & out["flops"].isna().to_numpy(bool)
    # a replay named from a capture carries the capture's shapes (its batch), not this step's
    borrowed = attention & (out["evidence"].eq(_BORROWED) & out["cost_kind"].eq(Kind.ATTENTION)
                            ).to_numpy(bool, na_value=False)
    annotated = each_distinct(text, lambda t: isinstance(t, str)
                               and steps.parse_text(t) is not None).astype(bool)
    todo = (uncosted | borrowed) & annotated
    if not todo.any():
        return
    if model is None:  # the step's sums are there; the heads are the model's
        ask = uncosted & annotated
        out.loc[ask, "uncosted"] = (out.loc[ask, "op_name"].astype(str) + _STEP_NEEDS_MODEL)
        return
    arch = model.architecture
    att = arch.attention
    layer = out["layer"].astype("Int64").to_numpy(np.float64, na_value=np.nan)
    at = np.flatnonzero(todo)
    seen = pd.DataFrame({"t": text.to_numpy()[at], "l": np.nan_to_num(layer[at], nan=-1.0)})
    first = at[~seen.duplicated().to_numpy()]
    rest = np.setdiff1d(at, first)
    # each layer's sliding window (NaN: full attention; the last entry for no layer)
    wins = np.array([np.nan if v is None else float(v) for v in att.windows] + [np.nan])
    lay = np.nan_to_num(layer[first], nan=-1.0).astype(np.int64)
    w = wins[np.where((lay >= 0) & (lay < len(wins) - 1), lay, -1)]
    t = steps.attention_table(text.iloc[first], w, causal)
    dt = dtypes.lookup(arch.precision.activations) or known("bf16")
    nq, nkv, d, dv = att.num_heads, att.num_kv_heads, att.head_dim, att.v_head_dim
    kv = t["keys"].to_numpy() * nkv * (d + dv) * dt.bytes
    qo = t["queries"].to_numpy() * nq * (d + dv) * dt.bytes
    sinks = ("; sinks: one learned logit per head and query, no key: no matmul FLOPs"
             if att.sinks else "")
    label = text.iloc[first].str.split(":").str[0].to_numpy(dtype=object)
    idx = out.index[first]
    out.loc[idx, "cost_kind"] = Kind.ATTENTION
    out.loc[idx, "flops"] = 2.0 * nq * (d + dv) * t["pairs"].to_numpy()
    out.loc[idx, "bytes"] = kv + (qo if attention_bytes == "all" else 0.0)
    out.loc[idx, "dtype"] = dt.short
    out.loc[idx, "shape"] = [f"{lb}: {q:.0f} queries; {n}{sinks}" for lb, q, n in
                             zip(label, t["queries"], t["note"], strict=True)]
    out.loc[idx, "uncosted"] = None
    out.loc[idx, "derivation"] = STEP
    # a paged or varlen kernel's tiles are not recorded: its executed pairs are taken as useful
    out.loc[idx, ["pairs_executed", "pairs_useful"]] = np.repeat(
        nq * t["pairs"].to_numpy(np.float64)[:, None], 2, axis=1)
    out.loc[idx, "B"] = t["requests"].to_numpy()
    out.loc[idx, "T"] = t["queries"].to_numpy()
    out.loc[idx, ["n_q", "n_kv", "head_dim"]] = [nq, nkv, d]
    out.loc[idx, "causal"] = (t["chunks"].to_numpy() > 0) & (causal == "causal")
    ridx = out.index[rest]
    out.loc[ridx, ["cost_kind", "flops", "bytes", "uncosted", "derivation", "pairs_executed",
                   "pairs_useful"]] = [Kind.ATTENTION, 0.0, 0.0, None, STEP, 0.0, 0.0]
    out.loc[ridx, "shape"] = "counted in this layer's first attention instance of the step"

