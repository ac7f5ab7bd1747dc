"""A layer's linears inferred without --model from its attention's geometry and its GEMM shapes.

Design notes: docs/design.md ("trace_roofline/attribution/inference.py").
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pandas as pd

from trace_roofline.model import layouts
from trace_roofline.model.operators import Name
from trace_roofline.trace.decode import decode_args

Counts = dict[tuple[int, int], int]  # GEMM (K, N) -> how many ran


@dataclass(frozen=True)
class Geometry:
    """The attention's heads and head sizes, as its op's arguments show them (one TP shard)."""

    q_heads: int
    kv_heads: int
    qk_dim: int
    v_dim: int

    @property
    def q(self) -> int:
        return self.q_heads * self.qk_dim

    @property
    def o(self) -> int:  # o_proj's input: the attention's output
        return self.q_heads * self.v_dim


def attention_geometry(op_name: pd.Series, input_dims: pd.Series) -> Geometry | None:
    """The most frequent geometry among the attention ops (layouts.ATTENTION_LAYOUTS) whose q,
    k and v arguments are 4-D, else among an eager attention's 4-D matmuls (Q·Kᵀ [B, H, T, d] x
    [B, H, d, S] then P·V [B, H, T, S] x [B, H, S, dv]); None without either."""
    rows = op_name.isin(list(layouts.ATTENTION_LAYOUTS)).to_numpy(dtype=bool)
    seen: Counter[Geometry] = Counter()
    for (name, text), count in _distinct(op_name[rows], input_dims[rows]):
        found = _geometry(layouts.ATTENTION_LAYOUTS[name][0], decode_args(text) or [])
        if found is not None:
            seen[found] += count
    if not seen:  # (heads, d, S) of each Q·Kᵀ-like product, (heads, S, dv) of each P·V-like
        eager = op_name.isin(["aten::matmul"]).to_numpy(dtype=bool)
        products: Counter[tuple[int, int, int]] = Counter()
        for (_, text), count in _distinct(op_name[eager], input_dims[eager]):
            a, b = (decode_args(text) or [None, None])[:2]
            if _is4d(a) and _is4d(b) and a[:2] == b[:2] and a[3] == b[2]:
                products[(a[1], b[2], b[3])] += count
        for (heads, d, s), count in products.items():
            for (h2, s2, dv), _ in products.items():
                if h2 == heads and s2 == s and (d, s) != (s2, dv):
                    seen[Geometry(heads, heads, d, dv)] += count
    return seen.most_common(1)[0][0] if seen else None


def _distinct(names: pd.Series, dims: pd.Series) -> list[tuple[tuple[str, str], int]]:
    """The distinct (op name, Input Dims) pairs and how often each occurs."""
    pairs = pd.DataFrame({"n": names.astype("string"), "d": dims.astype("string")}).dropna()
    return [((str(n), str(d)), int(c)) for (n, d), c in pairs.value_counts().items()]


def _is4d(t: object) -> bool:
    return isinstance(t, list) and len(t) == 4 and all(type(x) is int for x in t)


def _geometry(layout: str, args: list) -> Geometry | None:
    q, k, v = (args + [None] * 3)[:3]
    if not (_is4d(q) and _is4d(k) and _is4d(v)):
        return None
    heads = 1 if layout == "BHTD" else 2
    return Geometry(q[heads], k[heads], q[3], v[3])  # type: ignore[index]


def infer_layout(c: Counts, g: Geometry, h: int, calls: int) -> dict[str, tuple[int, int]] | None:
    """The linears of a decoder layer of hidden size `h` whose attention has geometry `g` and
    ran `calls` times (one per layer and pass; 0: unknown), from the GEMM counts `c`: the
    attention's form (q_proj and separate k, v, or a fused qkv; MLA's q_proj,
    kv_a_proj_with_mqa and kv_b_proj), o_proj, the dense MLP's (gated, fused gate_up, or
    ungated as GPT-2's), the lm_head. None when no attention form fits, or without an lm_head
    (a GEMM from H wider than every other: a language model's last one), which an encoder's
    layers of the same forms lack."""
    attention = _attention(c, g, h, calls or c.get((g.o, h), 0))
    if attention is None:
        return None
    used = set(attention.values())
    out = attention | _mlp(c, h, used)
    used = set(out.values())
    wider = [n for (k, n) in c if k == h and (k, n) not in used and n > max(n for _, n in used)]
    if not wider:  # no lm_head: an encoder's layers (BERT's) have these forms too
        return None
    return out | {Name.LM_HEAD: (h, max(wider))}


def _attention(c: Counts, g: Geometry, h: int, calls: int) -> dict[str, tuple[int, int]] | None:
    """q, k, v (or qkv, or MLA's) and o by the geometry's q and o sizes; the KV width from the
    GEMMs (an attention op's k may be expanded to the query heads), each run as often as a
    layer runs them per call: k and v of one shape twice, and once more each on q's shape when
    kv = q (and o too, when o = q: (H, H))."""
    if (g.o, h) not in c or calls <= 0:
        return None
    o = {Name.O_PROJ: (g.o, h)}
    per = {kn: cnt / calls for kn, cnt in c.items()}
    if (h, g.q) in c:
        on_q = 1 + ((g.o, h) == (h, g.q))  # q_proj, and o_proj when they share a shape
        kv = [n for (k, n) in c if k == h and n % g.qk_dim == 0 and n <= g.q
              and per[(h, n)] >= (on_q + 2 if n == g.q else 2)]
        if kv:
            return {Name.Q_PROJ: (h, g.q), Name.K_PROJ: (h, max(kv)), Name.V_PROJ: (h, max(kv))} | o
    fused = [n for (k, n) in c if k == h and n > g.q and (n - g.q) % (2 * g.qk_dim) == 0
             and n - g.q <= 2 * g.q and per[(h, n)] == 1]
    if fused:
        return {Name.QKV_PROJ: (h, min(fused))} | o
    for (r, n) in sorted(c):  # MLA: kv_b_proj (r, heads·(nope + v)), kv_a (H, r + rope)
        nope = n // g.q_heads - g.v_dim if n % g.q_heads == 0 else 0
        if r < h and 0 < nope < g.qk_dim and (h, r + g.qk_dim - nope) in c and (h, g.q) in c:
            return {Name.Q_PROJ: (h, g.q), Name.KV_A_PROJ_WITH_MQA: (h, r + g.qk_dim - nope),
                    Name.KV_B_PROJ: (r, n)} | o
    if (h, g.q) in c:  # k and v in a form of their own (Inductor's one GEMM for both)
        return {Name.Q_PROJ: (h, g.q)} | o
    return None


def _mlp(c: Counts, h: int, used: set[tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """The dense MLP whose down projection (I, H) runs most (the widest on a tie: a shared
    expert is narrower): gate and up (H, I) twice as often, fused (H, 2I) as often, or an
    ungated up (H, I) as often; none found: {}."""
    for (i, _n), down in sorted(((kn, cnt) for kn, cnt in c.items()
                                 if kn[1] == h and kn[0] != h and kn not in used),
                                key=lambda kc: (-kc[1], -kc[0][0])):
        if c.get((h, 2 * i), 0) >= down:
            return {Name.GATE_UP_PROJ: (h, 2 * i), Name.DOWN_PROJ: (i, h)}
        if c.get((h, i), 0) >= 2 * down:
            return {Name.GATE_PROJ: (h, i), Name.UP_PROJ: (h, i), Name.DOWN_PROJ: (i, h)}
        if c.get((h, i), 0) == down:
            return {Name.UP_PROJ: (h, i), Name.DOWN_PROJ: (i, h)}
    return {}
