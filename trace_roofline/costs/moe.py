"""Cost rules of the mixture-of-experts ops (grouped GEMMs over every expert's weights, an
engine's fused experts, routing top-k, token alignment, the top-k sum), and the table-wide pass
that adds each MoE block's active experts' weights (`moe_layers`).

Design notes: docs/design.md ("trace_roofline/costs/").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from trace_roofline.costs.call import Arg, Call, Cost, Io, Kind, each_distinct, element_bytes, tensor, tensors
from trace_roofline.model import dtypes, formulas, gemms, operators
from trace_roofline.model.models import ModelSpec
from trace_roofline.model.operators import Name
from trace_roofline.trace.decode import decode_args


def grouped_mm(c: Call) -> Cost:
    """grouped_mm(a [S, K], w [E, K, N], offs [E]): every expert's GEMM over its rows at once.
    FLOPs and activations exact; the active experts' weights are added per layer. A backward's
    grad-weight (a [K, S], b [S, N], offs [E]) is `_grouped_weight_grad`."""
    if len(c.args) > 1 and c.args[1].is_tensor and len(c.args[1].dims) == 2:
        return _grouped_weight_grad(c)
    a, w = tensor(c.args, 0, 2), tensor(c.args, 1, 3)
    (s, k), (e, _, n) = a.dims, w.dims
    return ExpertsGemm(s, k, n, e, a, w).cost()


def _grouped_weight_grad(c: Call) -> Cost:
    """A grouped GEMM's grad-weight: Xᵀ·dY per expert over its rows, a [K, S] x b [S, N] split
    by offs [E] into E [K, N] gradients: 2·S·K·N FLOPs, a and b read, E·K·N written."""
    a, b, offs = tensor(c.args, 0, 2), tensor(c.args, 1, 2), tensor(c.args, 2, 1)
    (k, s), (_, n), e = a.dims, b.dims, offs.dims[0]
    nbytes = formulas.elementwise_bytes(k * s + s * n, e * k * n, a.b)
    return Cost(Kind.GEMM, 2.0 * s * k * n, nbytes, a.dtype, f"{e}x[{k},{s}]x[{s},{n}] (grad-weight)",
                m=s, k=k, n=n)


@dataclass(frozen=True)
class ExpertsGemm:
    """E experts' GEMMs over S rows in all, [S, K] x [E, K, N] (activation `a`, weights `w`):
    FLOPs and activations exact; one expert's weights kept apart (`Cost.expert_bytes`), added
    per layer for its active experts (`moe_layers`). `how`: appended to the shape."""

    s: int
    k: int
    n: int
    e: int
    a: Arg
    w: Arg
    how: str = ""

    def cost(self) -> Cost:
        s, k, n, a = self.s, self.k, self.n, self.a
        nbytes = formulas.elementwise_bytes(s * k, s * n, a.b)
        return Cost(Kind.GEMM, 2.0 * s * k * n, nbytes, a.dtype,
                    f"{self.e} experts [{s},{k}]x[{k},{n}]{self.how}", m=s, k=k, n=n,
                    experts=self.e, expert_bytes=float(k * n * self.w.b))


def fused_experts(c: Call) -> Cost:
    """An engine's fused MoE op, costed for the half attribute() named (`c.operator`):
    inplace/outplace_fused_experts(hidden [M, H], w13 [E, 2I, H], w2 [E, H, I],
    topk_weights [M, k], topk_ids [M, k], ...), or moe_forward(hidden [M, H], logits [M, E],
    layer name) with the model's experts. gate_up: 2·S·H·2I FLOPs, S·H read, S·2I written;
    down: 2·S·I·H, S·I read, S·H written (S = M·k); combine (its finalize kernel): S·H read and
    added, M·H written; weights per active expert added per layer,
    at the model's expert weight bits (MXFP4: 4.25) where the op does not record its weights.
    An input padded past the model's hidden size (vLLM pads gpt-oss's 2880 to 3072 for its
    MXFP4 kernels) is costed at the useful size, and the shape says so."""
    x = tensor(c.args, 0, 2)
    (m, h) = x.dims
    pad = ""
    if c.hidden is not None and c.hidden < h:
        pad, h = f"; hidden padded {c.hidden} -> {h}, costed at its useful {c.hidden}", c.hidden
    weight_b = x.b
    if c.base.endswith("moe_forward"):
        logits = tensor(c.args, 1, 2)
        if c.experts is None:
            return Cost(uncosted=f"{c.name}: expert shapes not recorded (give --model)")
        e, top_k, inter = logits.dims[1], c.experts.top_k, c.experts.intermediate_size
        weight_b = c.expert_bits / 8 if c.expert_bits else x.b
    else:
        w1, topk_ids = tensor(c.args, 1, 3), tensor(c.args, 4, 2)
        e, inter, top_k = w1.dims[0], w1.dims[1] // 2, topk_ids.dims[1]
        # the recorded w13's bytes per logical weight element (fp8: 1; packed 4-bit: 0.5)
        weight_b = w1.numel * w1.b / max(e * 2 * inter * x.dims[1], 1)
    rows = m * top_k
    if c.operator == Name.MOE_COMBINE:  # the top-k outputs [M, k, H] summed into [M, H]
        return Cost(Kind.REDUCTION, float(rows * h), formulas.elementwise_bytes(rows * h, m * h, x.b),
                    x.dtype, f"[{m},{top_k},{h}] top-{top_k} sum fused{pad}")
    halves = {Name.EXPERTS_GATE_UP: (h, 2 * inter), Name.EXPERTS_DOWN: (inter, h)}
    if c.operator not in halves:
        return Cost(uncosted=f"{c.name}: named {c.operator}, not an expert GEMM half")
    k, n = halves[c.operator]
    bits = f", weights {weight_b * 8:g} bits" if weight_b != x.b else ""
    return Cost(Kind.GEMM, 2.0 * rows * k * n, formulas.elementwise_bytes(rows * k, rows * n, x.b),
                x.dtype, f"{e} experts [{rows},{k}]x[{k},{n}] fused{bits}{pad}", m=rows, k=k,
                n=n, experts=e, expert_bytes=float(k * n * weight_b))


def topk_softmax(c: Call) -> Cost:
    """vLLM's topk_softmax(weights [M, k] fp32, ids [M, k], token_expert_indices [M, k],
    logits [M, E] fp32): reads the logits, writes the three [M, k] outputs; softmax's
    5 FLOPs per logit."""
    weights, ids, rows, logits = tensors(c.args, 4)[:4]
    nbytes = formulas.elementwise_bytes(logits.numel, 0, logits.b)
    nbytes += sum(formulas.elementwise_bytes(0, t.numel, t.b) for t in (weights, ids, rows))
    return Cost(Kind.REDUCTION, 5.0 * logits.numel, float(nbytes), logits.dtype,
                f"{logits.dims} top-{weights.dims[-1]}")


def moe_align(c: Call) -> Cost:
    """moe_align_block_size(topk_ids [M, k], E, block, sorted_ids [EM], expert_ids [EM/block],
    num_tokens_post_pad [1]): reads the ids, writes the three outputs (all recorded)."""
    ts = tensors(c.args, 2)
    ids, outs = ts[0], ts[1:]
    nbytes = formulas.elementwise_bytes(ids.numel, 0, ids.b)
    nbytes += sum(formulas.elementwise_bytes(0, t.numel, t.b) for t in outs)
    return Cost(Kind.COPY, 0.0, float(nbytes), ids.dtype, f"{ids.dims} -> {[t.dims for t in outs]}")


def moe_sum(c: Call) -> Cost:
    """moe_sum(input [M, k, H], output [M, H]): reads the top-k outputs, writes their sum."""
    x, out = tensors(c.args, 2)[:2]
    return Io(float(x.numel), [x], out.numel, out.b, Kind.REDUCTION, x.dtype).cost()


# ------------------------------------------------------------- MoE layers: active experts
# the router's logits GEMM: its own, or fused by Inductor with the norm before it
ROUTER_KINDS = (Kind.GEMM, Kind.FUSED)


@dataclass(frozen=True)
class _Blocks:
    """`moe_layers`' rows: attach_costs' `out` and `inst` tables (row for row), each row's op
    base name and MoE block (the number of router logits GEMMs up to it)."""

    out: pd.DataFrame
    inst: pd.DataFrame
    base: pd.Series
    block: pd.Series


def moe_layers(out: pd.DataFrame, inst: pd.DataFrame, model: ModelSpec | None) -> pd.DataFrame:
    """Per MoE block (from one router logits GEMM to the next, in time order): its tokens T
    (the router GEMM's M), experts E (its N, else the expert ops'), top-k (the model's, else
    the router's `topk` argument or the fused op's top-k ids, else ΣM_e / T) and active
    experts A (moe.active_experts: counted in a loop form, else the uniform-routing
    expectation; without T or k, the upper bound min(E, ΣM_e)), then
    - ops over all experts' weights (`grouped_mm`, fused): bytes += A x one expert's weights;
    - batched_mm's weight gathers (`index` of [E, N, K]): A experts' weights read, S copies
      written (S the bmm batch), S int64 indices;
    - other `index` gathers of a block (unrecorded indices): the rows of the expert GEMM they
      feed (dispatch) or follow (combine);
    and `experts_active[_low|_high]` once per block and operator on the expert GEMM (or
    gather) rows. `out` and `inst` are attach_costs' tables, row for row; the temporary
    columns `experts`, `expert_bytes` go. Shapes are decoded once per distinct value."""
    nan = np.full(len(out), np.nan)
    out = out.assign(experts_active=nan, experts_active_low=nan, experts_active_high=nan)
    op = out["operator"]
    if not (op.isin(operators.MOE).any() or out["experts"].notna().any()):
        return out.drop(columns=["experts", "expert_bytes"])
    base = pd.Series(each_distinct(out["op_name"], lambda n: n.rsplit("::", 1)[-1]
                                    if isinstance(n, str) else ""), index=out.index)
    first = each_distinct(inst["input_types"], _first_dtype)
    out["dtype"] = out["dtype"].fillna(pd.Series(first, index=out.index, dtype="str"))
    logits = (op.eq(Name.ROUTER) & out["cost_kind"].isin(ROUTER_KINDS)
              & out["N"].gt(1)).to_numpy(bool, na_value=False)
    block = pd.Series(np.cumsum(logits), index=out.index)
    rows = _Blocks(out, inst, base, block)
    blocks = _moe_blocks(rows, model, logits)
    tokens, experts, top_k = (block.map(blocks[c]).to_numpy() for c in ("T", "E", "k"))
    expected, low, high = _active(experts, top_k, tokens)
    all_weights = out["experts"].notna().to_numpy()
    upper = np.fmin(out["experts"].to_numpy(np.float64, na_value=np.nan),
                    out["M"].to_numpy(np.float64, na_value=np.nan))
    expected = np.where(all_weights & np.isnan(expected), upper, expected)
    high = np.where(all_weights & np.isnan(high), upper, high)
    out.loc[all_weights, "bytes"] += (expected[all_weights]
                                      * out.loc[all_weights, "expert_bytes"].to_numpy())
    expert_op = op.isin([Name.EXPERTS_GATE_UP, Name.EXPERTS_DOWN]).to_numpy()
    gather = expert_op & (base == "index").to_numpy() & out["flops"].isna().to_numpy()
    _weight_gathers(rows, gather, expected)
    once = ~pd.DataFrame({"b": block, "o": op}).duplicated().to_numpy()
    spread = (all_weights | gather) & once
    out.loc[spread, "experts_active"] = expected[spread]
    out.loc[spread, "experts_active_low"] = low[spread]
    out.loc[spread, "experts_active_high"] = high[spread]
    gemm = out["cost_kind"].eq(Kind.GEMM).to_numpy()
    loop = expert_op & gemm & base.isin(gemms.ONE_WEIGHT_OPS).to_numpy() & ~all_weights
    counted = pd.Series(loop & op.eq(Name.EXPERTS_DOWN).to_numpy()).groupby(block.to_numpy())
    counted = counted.transform("sum").to_numpy(np.float64)
    for col in ("experts_active", "experts_active_low", "experts_active_high"):
        out.loc[loop & once, col] = counted[loop & once]
    _block_gathers(rows, op.isin([Name.MOE_DISPATCH, Name.MOE_COMBINE]).to_numpy())
    return out.drop(columns=["experts", "expert_bytes"])


def _first_dtype(raw: object) -> str | None:
    """Short dtype of an op's first argument from its raw Input type JSON."""
    types = decode_args(raw) if isinstance(raw, str) else None
    d = dtypes.lookup(str(types[0])) if types else None
    return d.short if d else None


def _moe_blocks(rows: _Blocks, model: ModelSpec | None, logits: np.ndarray) -> pd.DataFrame:
    """T, E, k per block (NaN where the trace does not tell); `logits`: the router GEMM rows."""
    out, inst, base, block = rows.out, rows.inst, rows.base, rows.block
    router = out[logits].assign(block=block[logits])
    per = router.groupby("block").agg(T=("M", "max"), E=("N", "max")).astype("float64")
    per = per.reindex(pd.RangeIndex(int(block.max()) + 1))
    per["E"] = per["E"].fillna(out["experts"].groupby(block).max().astype("float64"))
    if model is not None and model.experts is not None:
        per["k"] = float(model.experts.top_k)
        return per
    topk = (base == "topk").to_numpy()
    k_arg = each_distinct(inst["concrete_inputs"], lambda raw: _concrete_at(raw, 1))
    fused = out["experts"].notna().to_numpy() & fused_experts_ops(inst["op_name"])
    k_ids = each_distinct(inst["input_dims"], lambda raw: _dims_at(raw, 4, 1))
    # numpy's stubs leave None out of ArrayLike; np.where takes it (an object element)
    ks = pd.Series(np.where(topk, k_arg, np.where(fused, k_ids, None)),  # type: ignore[call-overload]
                   dtype="float64")
    per["k"] = ks.groupby(block.to_numpy()).max()
    routed = out.loc[out["experts"].notna(), "M"].groupby(block).max().astype("float64")
    per["k"] = per["k"].fillna((routed / per["T"]).round())
    return per


def _concrete_at(raw: object, arg: int) -> float:
    """Concrete Inputs[arg] of a raw JSON text as a number (NaN when absent or not one)."""
    values = decode_args(raw) if isinstance(raw, str) else None
    return _num(values[arg]) if values and len(values) > arg else np.nan


def _dims_at(raw: object, arg: int, dim: int | None) -> float:
    """Input Dims[arg][dim] (dim None: the product of Input Dims[arg]) of a raw JSON text."""
    d = decode_args(raw) if isinstance(raw, str) else None
    if not d or len(d) <= arg or not isinstance(d[arg], list) or not d[arg]:
        return np.nan
    shape = d[arg]
    if not all(type(v) is int for v in shape):  # a tensor list
        return np.nan
    if dim is None:
        return float(math.prod(shape))
    return float(shape[dim]) if -len(shape) <= dim < len(shape) else np.nan


def fused_experts_ops(op_names: pd.Series) -> np.ndarray:
    """Per row, whether its op is an engine's fused MoE op (operators.FUSED_EXPERTS)."""
    return each_distinct(op_names, lambda n: isinstance(n, str)
                          and operators.cost_rule(n) == operators.FUSED_EXPERTS.cost).astype(bool)


def _num(text: object) -> float:
    try:
        return float(text)  # type: ignore[arg-type]  # any object: what float() refuses is NaN
    except (TypeError, ValueError):
        return np.nan


def _active(experts: np.ndarray, top_k: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, ...]:
    """moe.active_experts over arrays: expectation E·(1 - (1 - k/E)^T), range [min(k, E),
    min(E, T·k)]; NaN where E, k or T is unknown."""
    e, k, t = (np.asarray(v, dtype=np.float64) for v in (experts, top_k, tokens))
    ok = (e >= 1) & (k >= 1) & (k <= e) & (t >= 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        expected = np.where(k >= e, e, -e * np.expm1(t * np.log1p(-k / e)))
    return (np.where(ok, expected, np.nan), np.where(ok, np.minimum(k, e), np.nan),
            np.where(ok, np.minimum(e, t * k), np.nan))


def _set_copy(out: pd.DataFrame, ok: np.ndarray, nbytes: np.ndarray) -> None:
    """Cost the `ok` rows as data movement of `nbytes`, in place."""
    out.loc[ok, "flops"] = 0.0
    out.loc[ok, "bytes"] = nbytes[ok]
    out.loc[ok, "cost_kind"] = Kind.COPY
    out.loc[ok, "uncosted"] = None


def _weight_gathers(rows: _Blocks, gather: np.ndarray, expected: np.ndarray) -> None:
    """batched_mm's `index` gathers of the [E, N, K] expert weights, in place: A (`expected`)
    experts' weights read, S copies written, S int64 indices; S = the batch of the bmm of the
    same operator in the block."""
    if not gather.any():
        return
    out, inst, base, block = rows.out, rows.inst, rows.base, rows.block
    bmm = (base == "bmm").to_numpy()
    batch = np.where(bmm, each_distinct(inst["input_dims"], lambda r: _dims_at(r, 0, 0)),
                     np.nan).astype(np.float64)
    key = pd.DataFrame({"b": block, "o": out["operator"].astype("object")})
    s = pd.Series(batch).groupby([key["b"].to_numpy(), key["o"].to_numpy()]).transform("max")
    numel = each_distinct(inst["input_dims"], lambda r: _dims_at(r, 0, None)).astype(np.float64)
    experts = each_distinct(inst["input_dims"], lambda r: _dims_at(r, 0, 0)).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):  # a 0-dim: NaN, left uncosted
        size = numel / experts  # one expert's weight elements
    nbytes = (expected + s.to_numpy()) * size * element_bytes(out["dtype"]) + s.to_numpy() * 8
    _set_copy(out, gather & np.isfinite(nbytes), nbytes)


def _block_gathers(rows: _Blocks, in_block: np.ndarray) -> None:
    """Uncosted `index` gathers of the dispatch and combine (their indices are not recorded):
    as many rows as the expert GEMM they feed (the next gate_up) or follow (the last down)
    moves: those rows (of the input's row width; one element per row of a [.., 1] input) read
    (at most the input) and written, plus an int64 index per row; in place."""
    out, inst, base, block = rows.out, rows.inst, rows.base, rows.block
    todo = in_block & (base == "index").to_numpy() & out["flops"].isna().to_numpy()
    if not todo.any():
        return
    op = out["operator"].astype("object")
    rows_in = out["M"].where(op.eq(Name.EXPERTS_GATE_UP) & out["cost_kind"].eq(Kind.GEMM))
    rows_out = out["M"].where(op.eq(Name.EXPERTS_DOWN) & out["cost_kind"].eq(Kind.GEMM))
    feeds = rows_in.astype("float64").groupby(block).bfill().to_numpy()
    follows = rows_out.astype("float64").groupby(block).ffill().to_numpy()
    n = np.where(op.eq(Name.MOE_DISPATCH).to_numpy(), feeds, follows)
    numel = each_distinct(inst["input_dims"], lambda r: _dims_at(r, 0, None)).astype(np.float64)
    lead = each_distinct(inst["input_dims"], lambda r: _dims_at(r, 0, 0)).astype(np.float64)
    last = each_distinct(inst["input_dims"], lambda r: _dims_at(r, 0, -1)).astype(np.float64)
    # rows of the input's row width; a [.., 1] input (HF's routing weights w[tokens, slots,
    # None]) is indexed in every dim but the last: one element per row
    with np.errstate(divide="ignore", invalid="ignore"):  # a 0-dim: NaN, left uncosted
        moved = n * np.where(last == 1, 1.0, numel / lead)
    nbytes = (np.fmin(moved, numel) + moved) * element_bytes(out["dtype"]) + n * 8
    ok = todo & np.isfinite(nbytes)
    _set_copy(out, ok, nbytes)
    out.loc[ok, "shape"] = ("gather of " + pd.Series(n[ok]).astype(int).astype(str)
                            + " rows").to_numpy()

