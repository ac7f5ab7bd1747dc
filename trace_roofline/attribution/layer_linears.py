"""A layer's linears (K, N) from a model, or inferred from a trace's GEMM counts.

Design notes: docs/design.md ("trace_roofline/attribution/naming.py").
"""

from __future__ import annotations

import pandas as pd

from trace_roofline.model.models import ModelSpec
from trace_roofline.model.operators import Name


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
        out[Name.EXPERTS_DOWN if n == h else Name.EXPERTS_GATE_UP] = (int(k), int(n))
        out[Name.ROUTER] = (h, int(e))
    if ((kn["K"] == h) & (kn["N"] == 1)).any():
        out["shared_expert_gate"] = (h, 1)
    return out


def hidden_size(kn: pd.DataFrame) -> int:
    """The hidden size H of GEMM (K, N) counts (columns K, N, count): the K most GEMMs share
    (q, k, v, gate, up, router and lm_head all read H)."""
    return int(kn.groupby("K")["count"].sum().idxmax())


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
        out[Name.LM_HEAD] = (h, max(rest))
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
        out[Name.Q_PROJ] = (h, q)
        kv = [(n, cnt) for (k, n), cnt in c.items() if k == h and n < q and cnt >= 2 * unit]
        if kv:
            n_kv = min(kv, key=lambda nc: abs(nc[1] - 2 * unit))[0]
            out[Name.K_PROJ] = out[Name.V_PROJ] = (h, n_kv)
        elif q == h and c[(h, h)] >= 4 * unit:
            out[Name.K_PROJ] = out[Name.V_PROJ] = (h, h)
    else:
        fused_qkv = [n for (k, n), cnt in c.items() if k == h and n > q and (n - q) % 2 == 0
                     and cnt == c.get((q, h), 0)  # as often as o_proj (not the lm_head)
                     and not any(n in (i, 2 * i) for i in mlps)]  # (not an MLP's up)
        if fused_qkv:
            out[Name.QKV_PROJ] = (h, min(fused_qkv))
    out[Name.O_PROJ] = (q, h)
    return out


def _router(c: dict[tuple[int, int], int], h: int, calls: int,
            used: set[tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """The router (H, E) of an expert loop (the narrowest of `_per_call`'s) and a shared
    expert's gate (H, 1), if it runs as often as a router may."""
    out = {}
    if c.get((h, 1), calls + 1) <= calls and (h, 1) not in used:
        out["shared_expert_gate"] = (h, 1)
    if per_call := _per_call(c, h, calls, used):
        out[Name.ROUTER] = (h, per_call[0])
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
    return (Name.K_PROJ in linears or Name.QKV_PROJ in linears) and all(
        counts.get(shape, 0) == calls * shapes.count(shape) for shape in shapes)


_DENSE_MLP = (Name.GATE_PROJ, Name.UP_PROJ, Name.GATE_UP_PROJ, Name.DOWN_PROJ)
_EXPERTS_MLP = ("experts_gate", "experts_up", Name.EXPERTS_GATE_UP, Name.EXPERTS_DOWN)


def _mlp_linears(h: int, i: int, fused: bool, names: tuple[str, str, str, str]
                 ) -> dict[str, tuple[int, int]]:
    """An MLP's linears (names: gate, up, fused gate_up, down) of hidden size h, intermediate i."""
    gate, up, gate_up, down = names
    ups = {gate_up: (h, 2 * i)} if fused else {gate: (h, i), up: (h, i)}
    return {**ups, down: (i, h)}
