"""Trace shapes -> analytical costs: one row per op instance with FLOPs and minimum DRAM bytes.

The stage between `attribute` and `roofline`. Kernels are grouped into op instances (the
shape-carrying cpu op that launched them: a split-K GEMM's two kernels are one instance), and each
instance is costed from the `Input Dims` / `Input type` the trace recorded, through the formulas
of `trace_roofline.costs`. The model preset is only a cross-check (`check` names mismatches).

The raw dims JSON is decoded once per unique (op_name, input_dims, input_types, concrete_inputs,
input_strides) combination and the costs are mapped back to the instances by factorised codes.

Per-op rules (`minimum bytes` = tensor inputs read once + outputs written once, costs.py):
- Broadcast inputs: where `Input Strides` are recorded, an input is read as its distinct
  elements, the product of its dims whose stride is not 0 (an `expand`ed [512, 3584] index with
  strides [1, 0] reads 512 elements, HF's K/V expanded to n_q heads reads n_kv heads); outputs
  are written in full. Applies wherever inputs are counted (elementwise, norms, reductions,
  copies, gather indices, Triton buffers), not to GEMMs and attention.
- GEMM: mm [M,K]x[K,N]; addmm (bias, [M,K], [K,N]); linear ([..,K], weight [N,K], bias?);
  matmul (broadcast batch); bmm / baddbmm (batch x GEMM); _scaled_mm (fp8 in, out_dtype out).
  FLOPs 2·M·K·N (+ M·N for a bias add), costs.gemm_flops.
- Attention (SDPA and its flash / efficient / cudnn / CPU backends, flash_attn): Q [B,n_q,T,d],
  K,V [B,n_kv,S,d]; decode when T == 1, else prefill. The op is causal when its concrete
  `is_causal` says so, else when T > 1; with the `causal` convention only unmasked pairs count
  (costs.attention_pairs), with `full` every pair does. Bytes follow `attention_bytes` (kv|all).
- Elementwise (FLOPs per output element in `_POINTWISE_FLOPS`): out = broadcast of the tensor
  inputs, in the widest input dtype (bool for comparisons); in-place ops write their first input.
- Norms: rms_norm 4 FLOPs/element (square, sum, scale, weight), layer_norm 7; softmax 5
  (max, subtract, exp, sum, divide); reductions 1 per input element and write input/last-dim
  elements (the last dim is reduced, as in RMSNorm's mean) unless `Concrete Inputs` give the dims.
- Data movement, 0 FLOPs: copy_ (read src, write dst), clone/_to_copy (out dtype from Concrete
  Inputs when recorded), cat/stack (read and write every input), fill_/zero_/arange (write only),
  index_copy_/index_put_ (read source + index, write source-many elements), embedding /
  index_select / gather (read and write the gathered elements, plus the indices).
- torch.compile Triton kernels (`triton_*` cpu ops carry every buffer argument, whole, even
  when the kernel touches a slice of it: the KV cache and the cos/sin tables passed to a decode
  RoPE kernel that rotates one token). Each buffer moves its distinct elements once, but at
  most W of them, W being the kernel's work size: the points of its iteration space, which
  Inductor passes as the last integer arguments (`Concrete Inputs`, after any symbolic sizes
  ks0, ...): xnumel for `triton_poi_*`, xnumel·r0_numel for `triton_red_*`/`triton_per_*`;
  a tiled kernel's ynumel (znumel) is included when only the longer product is some buffer's
  size (`_work`). Each point loads or stores one element of
  a buffer at one index (RoPE's rotate-half reads a second one of the same slice), so a
  buffer cannot move more than W distinct elements. FLOPs: 1 per point, W (a placeholder of
  the right magnitude). Without recorded sizes (`triton_tem_*` templates, old traces) every
  buffer counts whole and FLOPs are the largest buffer's size. A kernel fusing `embedding`
  reads only the gathered rows of the table (index elements × row width) in any case.
- Views and allocations (view, transpose, slice, empty, ...): 0 FLOPs, 0 bytes.
Anything else (or an op without recorded shapes) is kept with NaN flops/bytes, `cost_kind`
"none" and an `uncosted` reason, and is counted in the roofline's `uncosted` columns.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import msgspec
import numpy as np
import pandas as pd

from trace_roofline import costs, dtypes
from trace_roofline.errors import InputError
from trace_roofline.models import ModelSpec

# One row per op instance (op_id; a kernel with no linked op is an instance of its own).
COSTED_COLUMNS = {
    "op_id": "Int64",  # innermost shape-carrying cpu op; NA for unlinked kernels
    "op_name": "str",  # e.g. aten::addmm; missing for unlinked kernels
    "operator": "str",  # canonical operator (attribute.py)
    "layer": "Int64",
    "step": "Int64",
    "phase": "str",  # decode|prefill of the instance's step (from its attention), else unknown
    "kernels": "int64",  # device rows (kernels, memcpy, memset) of the instance
    "ts_us": "float64",  # first kernel start
    "time_us": "float64",  # Σ dur_us of the instance's kernels
    "cost_kind": "str",  # gemm|attention|elementwise|norm|reduction|copy|fused|view|none
    "dtype": "str",  # short dtype of the main operand (bf16, fp16, fp32, fp8, int64, ...)
    "flops": "float64",  # NaN when uncosted
    "bytes": "float64",  # minimum DRAM bytes; NaN when uncosted
    "M": "Int64", "K": "Int64", "N": "Int64",  # GEMM shape (per batch item), NA otherwise
    "B": "Int64", "T": "Int64", "S": "Int64",  # attention batch, query and key lengths
    "causal": "boolean",  # attention: whether the op masks causally (NA otherwise)
    "shape": "str",  # short human-readable shape summary
    "uncosted": "str",  # why the instance has no cost; missing when costed
    "check": "str",  # model-preset mismatch; missing when consistent or not checked
}

# FLOPs per output element of pointwise ops (an in-place `op_` costs as `op`).
_POINTWISE_FLOPS: dict[str, float] = {
    **dict.fromkeys(["add", "sub", "mul", "div", "neg", "rsqrt", "sqrt", "reciprocal", "pow",
                     "exp", "log", "abs", "relu", "maximum", "minimum", "clamp", "clamp_min",
                     "clamp_max", "where", "masked_fill", "sign", "square", "cos", "sin",
                     "eq", "ne", "lt", "le", "gt", "ge", "logical_not", "logical_and",
                     "bitwise_and", "bitwise_or", "bitwise_not"], 1.0),
    "addcmul": 2.0, "addcdiv": 2.0, "lerp": 2.0,
    "sigmoid": 3.0,  # exp, add, divide
    "silu": 4.0,  # x · sigmoid(x)
    "tanh": 4.0, "erf": 4.0,
    "gelu": 8.0,  # erf form: scale, erf, add, two multiplies (erf counted as 4)
}
_COMPARISONS = {"eq", "ne", "lt", "le", "gt", "ge", "logical_not", "logical_and"}
_REDUCTIONS = {"mean", "sum", "amax", "amin", "max", "min", "argmax", "argmin", "var", "std",
               "norm", "linalg_vector_norm", "prod", "any", "all", "logsumexp"}
_SOFTMAX = {"softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"}
_NORMS = {"rms_norm": 4.0, "_fused_rms_norm": 4.0, "layer_norm": 7.0, "native_layer_norm": 7.0}
_COPIES = {"clone", "contiguous", "_to_copy", "to"}
# Views and allocations move no data (timed units of their own in CPU-only traces).
_VIEWS = {"view", "_unsafe_view", "reshape", "transpose", "t", "permute", "slice", "select",
          "narrow", "chunk", "split", "split_with_sizes", "unbind", "alias", "expand",
          "as_strided", "unsqueeze", "squeeze", "flatten", "unflatten", "detach", "detach_",
          "lift_fresh", "view_as", "expand_as", "empty", "empty_like", "empty_strided",
          "resolve_conj", "resolve_neg", "result_type"}

# Attention ops: name -> (Q/K/V layout, index of is_causal in Concrete Inputs).
# BHTD: [B, heads, T, d] (SDPA front ends); BTHD: [B, T, heads, d] (flash/efficient kernels).
_ATTENTION: dict[str, tuple[str, int]] = {
    "aten::scaled_dot_product_attention": ("BHTD", 5),
    "aten::_scaled_dot_product_flash_attention": ("BHTD", 4),
    "aten::_scaled_dot_product_flash_attention_for_cpu": ("BHTD", 4),
    "aten::_scaled_dot_product_efficient_attention": ("BHTD", 6),
    "aten::_scaled_dot_product_cudnn_attention": ("BHTD", 6),
    "aten::_cudnn_attention_forward": ("BHTD", 10),
    "aten::_flash_attention_forward": ("BTHD", 8),
    "aten::_efficient_attention_forward": ("BTHD", 9),  # custom_mask_type: 0 none, 1/2 causal
    "flash_attn::_flash_attn_forward": ("BTHD", 5),
}

_JSON = msgspec.json.Decoder()


@dataclass(frozen=True)
class Cost:
    """The cost of one unique op-shape combination."""

    kind: str = "none"
    flops: float = math.nan
    bytes: float = math.nan
    dtype: str | None = None
    shape: str | None = None
    uncosted: str | None = None
    m: int | None = None
    k: int | None = None
    n: int | None = None
    batch: int | None = None
    t: int | None = None
    s: int | None = None
    causal: bool | None = None
    heads: tuple[int, int, int] | None = None  # attention (n_q, n_kv, d)
    check: str | None = None


@dataclass(frozen=True)
class _Arg:
    """One argument of a cpu op as the trace recorded it."""

    dims: list
    type: str
    concrete: str
    strides: list | None = None  # Input Strides when recorded

    @property
    def is_tensor(self) -> bool:
        return dtypes.lookup(self.type) is not None

    @property
    def numel(self) -> int:
        return math.prod(self.dims)

    @property
    def distinct(self) -> int:
        """Elements a read touches: a dim of stride 0 (broadcast, expand) repeats the same ones."""
        st = self.strides
        if (not isinstance(st, list) or len(st) != len(self.dims)
                or not all(isinstance(v, int) for v in st)):
            return self.numel
        return math.prod(d for d, v in zip(self.dims, st, strict=True) if v != 0)

    @property
    def dtype(self) -> str:
        return dtypes.lookup(self.type).short

    @property
    def b(self) -> int:
        return dtypes.lookup(self.type).bytes


def attach_costs(attributed: pd.DataFrame, model: ModelSpec | None, causal: str = "causal",
                 attention_bytes: str = "all") -> pd.DataFrame:
    """One row per op instance (`COSTED_COLUMNS`) with FLOPs and minimum bytes from its shapes.

    `attributed` is attribute.attribute()'s table (one row per device row); optional
    `concrete_inputs` and `input_strides` columns (raw JSON) supply is_causal, dtype and Triton
    size arguments, and broadcast (stride-0) dims. `causal` is
    "causal" (count unmasked query-key pairs) or "full"; `attention_bytes` is "all" (Q, K, V read
    and O written) or "kv" (K and V only). Time is conserved: Σ time_us == Σ dur_us.
    """
    if causal not in costs.CAUSAL_CONVENTIONS:
        raise InputError(f"--causal must be one of {', '.join(costs.CAUSAL_CONVENTIONS)}, "
                         f"got {causal!r}")
    if attention_bytes not in costs.ATTENTION_BYTES_CONVENTIONS:
        raise InputError(f"--attention-bytes must be one of "
                         f"{', '.join(costs.ATTENTION_BYTES_CONVENTIONS)}, got {attention_bytes!r}")
    inst = _instances(attributed)
    text = ["op_name", "input_dims", "input_types", "concrete_inputs", "input_strides"]
    codes = inst.groupby(text, dropna=False, sort=False).ngroup().to_numpy()
    _, first = np.unique(codes, return_index=True)  # first instance of each combination
    combos = inst.iloc[first]
    fallback = _fallback_dtype(model, inst["input_types"])
    table = [
        _cost(name, dims, types, conc, causal, attention_bytes, fallback, model, strides)
        for name, dims, types, conc, strides in zip(*(combos[c].tolist() for c in text),
                                                     strict=True)
    ]
    out = inst[["op_id", "op_name", "operator", "layer", "step", "kernels", "ts_us", "time_us"]]
    out = out.reset_index(drop=True)
    fields = {"cost_kind": "kind", "dtype": "dtype", "flops": "flops", "bytes": "bytes",
              "M": "m", "K": "k", "N": "n", "B": "batch", "T": "t", "S": "s",
              "causal": "causal", "shape": "shape", "uncosted": "uncosted", "check": "check"}
    for col, attr in fields.items():
        values = pd.Series([getattr(c, attr) for c in table], dtype=COSTED_COLUMNS[col])
        out[col] = values.take(codes).reset_index(drop=True)
    # An op whose kernels were attributed to several rows is costed once, on its first row.
    again = out["op_id"].notna() & out["op_id"].duplicated() & out["flops"].notna()
    out.loc[again, ["flops", "bytes"]] = 0.0
    out["phase"] = _phases(out)
    out["check"] = out["check"].fillna(_gemm_check(out, model))
    return out[list(COSTED_COLUMNS)].astype(COSTED_COLUMNS)


def _instances(att: pd.DataFrame) -> pd.DataFrame:
    """Group device rows into op instances; each unlinked kernel is an instance of its own."""
    need = ["event_id", "dur_us", "ts_us", "op_id", "op_name", "input_dims", "input_types",
            "operator", "layer", "step"]
    missing = [c for c in need if c not in att.columns]
    if missing:
        raise InputError(f"attributed table lacks columns {', '.join(missing)}")
    op_id = att["op_id"].astype("Int64")

    def optional(col: str) -> np.ndarray:
        return (att[col] if col in att
                else pd.Series(None, index=att.index, dtype="object")).to_numpy()

    work = pd.DataFrame({
        "_inst": op_id.fillna(-1 - att["event_id"].astype("int64")).to_numpy(),
        "op_id": op_id.to_numpy(),
        "operator": att["operator"].to_numpy(),
        "layer": att["layer"].astype("Int64").to_numpy(),
        "step": att["step"].astype("Int64").to_numpy(),
        "op_name": att["op_name"].to_numpy(),
        "input_dims": att["input_dims"].to_numpy(),
        "input_types": att["input_types"].to_numpy(),
        "concrete_inputs": optional("concrete_inputs"),
        "input_strides": optional("input_strides"),
        "ts_us": att["ts_us"].astype("float64").to_numpy(),
        "dur_us": att["dur_us"].astype("float64").to_numpy(),
    })
    g = work.groupby(["_inst", "operator", "layer", "step"], dropna=False, sort=False)
    inst = g.agg(
        op_id=("op_id", "first"), op_name=("op_name", "first"),
        input_dims=("input_dims", "first"), input_types=("input_types", "first"),
        concrete_inputs=("concrete_inputs", "first"),
        input_strides=("input_strides", "first"), kernels=("dur_us", "size"),
        ts_us=("ts_us", "min"), time_us=("dur_us", "sum"),
    ).reset_index()
    inst = inst.sort_values("ts_us", kind="stable").reset_index(drop=True)
    for col in ["op_name", "input_dims", "input_types", "concrete_inputs", "input_strides"]:
        inst[col] = inst[col].astype("object").where(inst[col].notna(), None)
    return inst


def _fallback_dtype(model: ModelSpec | None, types: pd.Series) -> str | None:
    """Dtype for tensor lists (the trace records `TensorList`): the model's, else the commonest."""
    d = dtypes.lookup(model.dtype) if model is not None else None
    if d is not None:
        return d.short
    counts: dict[str, int] = {}
    for raw in types.dropna().unique():
        for t in _decode(raw) or []:
            d = dtypes.lookup(str(t))
            if d is not None:
                counts[d.short] = counts.get(d.short, 0) + 1
    return max(counts, key=counts.__getitem__) if counts else None


def _decode(raw: str | None) -> list | None:
    if raw is None or raw == "":
        return None
    try:
        value = _JSON.decode(raw)
    except msgspec.DecodeError:
        return None
    return value if isinstance(value, list) else None


def _cost(name: str | None, dims_raw: str | None, types_raw: str | None, concrete_raw: str | None,
          causal: str, attention_bytes: str, fallback: str | None,
          model: ModelSpec | None, strides_raw: str | None = None) -> Cost:
    """Cost one unique combination (decodes its JSON once)."""
    if name is None:
        return Cost(uncosted="no linked cpu op")
    dims, types = _decode(dims_raw), _decode(types_raw)
    if dims is None or types is None or len(dims) != len(types):
        return Cost(uncosted=f"{name}: no recorded shapes")
    concrete = _decode(concrete_raw) or []
    strides = _decode(strides_raw) or []
    args = [_Arg(d, str(t), str(concrete[i]) if i < len(concrete) else "",
                 strides[i] if i < len(strides) else None)
            for i, (d, t) in enumerate(zip(dims, types, strict=True))]
    try:
        cost = _dispatch(name, args, causal, attention_bytes, fallback)
    except (TypeError, ValueError, IndexError, KeyError, ZeroDivisionError):
        return Cost(uncosted=f"{name}: unexpected arguments {dims_raw}")
    if cost.kind == "attention" and model is not None:
        want = (model.num_heads, model.num_kv_heads, model.head_dim)
        if cost.heads != want:
            return replace(cost, check=f"attention: n_q,n_kv,d={','.join(map(str, cost.heads))}"
                                       f" but {model.name} has {','.join(map(str, want))}")
    return cost


def _dispatch(name: str, args: list[_Arg], causal: str, attention_bytes: str,
              fallback: str | None) -> Cost:
    if name in _ATTENTION:
        return _attention(name, args, causal, attention_bytes)
    base = name.removeprefix("aten::")
    if base.startswith("triton_"):
        return _fused(base, args)
    gemm = _GEMMS.get(base) if name.startswith("aten::") else None
    if gemm is not None:
        return gemm(args)
    if not name.startswith("aten::"):
        return Cost(uncosted=f"no cost rule for {name}")
    if base in _VIEWS:
        ts = _tensors(args)
        return Cost("view", 0.0, 0.0, ts[0].dtype if ts else None, "view (no data moved)")
    plain = base[:-1] if base.endswith("_") and not base.endswith("__") else base
    inplace = plain != base
    if base in ("copy_", "fill_", "zero_") or plain in _COPIES:
        return _copy(base, args)
    if base in ("cat", "stack", "concat"):
        return _cat(args, fallback)
    if plain in ("index_copy", "index_put", "index_add"):
        return _index_write(plain, args)
    if base in ("embedding", "index_select", "gather"):
        return _gather(base, args)
    if base == "arange":
        return _arange(args)
    if plain in _NORMS:
        return _norm(plain, args)
    if plain in _SOFTMAX:
        x = _tensors(args)[0]
        return _io(x.numel * 5.0, [x], x.numel, x.b, "elementwise", x.dtype)
    if plain in _REDUCTIONS:
        return _reduction(args)
    if plain in _POINTWISE_FLOPS:
        return _pointwise(plain, args, inplace)
    return Cost(uncosted=f"no cost rule for {name}")


# --------------------------------------------------------------------------------- GEMMs
def _gemm(m: int, k: int, n: int, a: _Arg, *, batch: int = 1, bias: _Arg | None = None,
          out_b: int | None = None, w_numel: int | None = None) -> Cost:
    """batch × [M,K]x[K,N] at the activation's dtype; a bias of N elements uses costs' bias term,
    a larger one (addmm's full C) is read in full; `w_numel` overrides a broadcast weight's size."""
    b = a.b
    vec_bias = bias is not None and bias.is_tensor and bias.numel == n
    flops = batch * costs.gemm_flops(m, k, n, bias=bias is not None and bias.is_tensor)
    nbytes = batch * costs.gemm_bytes(m, k, n, b, bias=vec_bias)
    if bias is not None and bias.is_tensor and not vec_bias:
        nbytes += costs.elementwise_bytes(bias.numel, 0, bias.b)
    if w_numel is not None:  # one weight shared by the whole batch
        nbytes -= (batch - 1) * costs.elementwise_bytes(w_numel, 0, b)
    if out_b is not None:  # output in another dtype than the operands (fp8 GEMMs)
        nbytes += batch * costs.elementwise_bytes(0, m * n, out_b - b)
    shape = f"{batch}x" if batch > 1 else ""
    shape += f"[{m},{k}]x[{k},{n}]" + ("+bias" if bias is not None and bias.is_tensor else "")
    return Cost("gemm", flops, nbytes, a.dtype, shape, m=m, k=k, n=n)


def _mm(args: list[_Arg]) -> Cost:
    a, w = args[0], args[1]
    return _gemm(a.dims[0], a.dims[1], w.dims[1], a)


def _addmm(args: list[_Arg]) -> Cost:
    bias, a, w = args[0], args[1], args[2]
    return _gemm(a.dims[0], a.dims[1], w.dims[1], a, bias=bias)


def _linear(args: list[_Arg]) -> Cost:
    x, w = args[0], args[1]
    bias = args[2] if len(args) > 2 else None
    return _gemm(math.prod(x.dims[:-1]), x.dims[-1], w.dims[0], x, bias=bias)


def _bmm(args: list[_Arg]) -> Cost:
    a, w = args[0], args[1]
    return _gemm(a.dims[1], a.dims[2], w.dims[2], a, batch=a.dims[0])


def _baddbmm(args: list[_Arg]) -> Cost:
    bias, a, w = args[0], args[1], args[2]
    return _gemm(a.dims[1], a.dims[2], w.dims[2], a, batch=a.dims[0], bias=bias)


def _matmul(args: list[_Arg]) -> Cost:
    """torch.matmul broadcasting: a 2-D weight is shared (read once) by every batch item."""
    a, w = args[0], args[1]
    ad = [1, *a.dims] if len(a.dims) == 1 else a.dims
    wd = [*w.dims, 1] if len(w.dims) == 1 else w.dims
    if len(wd) == 2:
        return _gemm(math.prod(ad[:-1]), ad[-1], wd[1], a)
    batch = math.prod(np.broadcast_shapes(tuple(ad[:-2]), tuple(wd[:-2])))
    shared = w.numel if len(wd[:-2]) == 0 or math.prod(wd[:-2]) == 1 else None
    return _gemm(ad[-2], ad[-1], wd[-1], a, batch=batch, w_numel=shared)


def _scaled_mm(args: list[_Arg]) -> Cost:
    """fp8 GEMM: operands at 1 byte, output at `out_dtype` (Concrete Inputs), scales ignored."""
    a, w = args[0], args[1]
    bias = args[4] if len(args) > 4 and args[4].is_tensor else None
    out = dtypes.by_scalar_type(args[6].concrete) if len(args) > 6 else None
    return _gemm(a.dims[0], a.dims[1], w.dims[1], a, bias=bias, out_b=out.bytes if out else None)


_GEMMS = {"mm": _mm, "addmm": _addmm, "_addmm_activation": _addmm, "linear": _linear,
          "bmm": _bmm, "baddbmm": _baddbmm, "matmul": _matmul, "_scaled_mm": _scaled_mm}


# ----------------------------------------------------------------------------- attention
def _attention(name: str, args: list[_Arg], causal: str, attention_bytes: str) -> Cost:
    layout, causal_at = _ATTENTION[name]
    q, k = args[0], args[1]
    if len(q.dims) != 4 or len(k.dims) != 4:
        return Cost(uncosted=f"{name}: variable-length attention (sequence lengths not recorded)")
    if layout == "BHTD":
        (batch, n_q, t, d), (_, n_kv, s, _) = q.dims, k.dims
    else:
        (batch, t, n_q, d), (_, s, n_kv, _) = q.dims, k.dims
    flag = args[causal_at].concrete if causal_at < len(args) else ""
    if name == "aten::_efficient_attention_forward" and flag:
        flag = "False" if flag == "0" else "True"
    # A single query token attends to every cached key; otherwise trust is_causal when recorded.
    is_causal = t > 1 and (flag == "True" if flag in ("True", "False") else True)
    counted = causal if is_causal else "full"
    flops = costs.attention_flops(batch, n_q, t, s, d, causal=counted)
    nbytes = costs.attention_bytes(batch, n_q, n_kv, t, s, d, q.b, convention=attention_bytes)
    shape = (f"B={batch} n_q={n_q} n_kv={n_kv} T={t} S={s} d={d}"
             + (" causal" if is_causal else ""))
    return Cost("attention", flops, nbytes, q.dtype, shape, batch=batch, t=t, s=s,
                causal=is_causal, heads=(n_q, n_kv, d))


# ---------------------------------------------------------------------- elementwise & co.
def _tensors(args: Sequence[_Arg]) -> list[_Arg]:
    return [a for a in args if a.is_tensor]


def _io(flops: float, reads: Sequence[_Arg], out_numel: float, out_b: int, kind: str,
        dtype: str, extra_read_bytes: float = 0.0) -> Cost:
    """Read every tensor in `reads` once (its distinct elements), write `out_numel` elements of
    `out_b` bytes."""
    nbytes = sum(costs.elementwise_bytes(r.distinct, 0, r.b) for r in reads)
    nbytes += costs.elementwise_bytes(0, out_numel, out_b) + extra_read_bytes
    shape = " ".join(str(r.dims) for r in reads) + f" -> {int(out_numel)}"
    return Cost(kind, float(flops), float(nbytes), dtype, shape)


def _pointwise(op: str, args: list[_Arg], inplace: bool) -> Cost:
    ts = _tensors(args)
    if not ts:
        return Cost(uncosted=f"aten::{op}: no tensor inputs")
    if inplace:
        out_numel, out_b = ts[0].numel, ts[0].b
    else:
        out_numel = math.prod(np.broadcast_shapes(*(tuple(t.dims) for t in ts)))
        # Type promotion, roughly: the widest dtype among the non-0-d tensors wins.
        ranked = [t for t in ts if t.dims] or ts
        out_b = 1 if op in _COMPARISONS else max(t.b for t in ranked)
    main = max(ts, key=lambda t: t.numel)
    return _io(_POINTWISE_FLOPS[op] * out_numel, ts, out_numel, out_b, "elementwise", main.dtype)


def _norm(op: str, args: list[_Arg]) -> Cost:
    ts = _tensors(args)
    x = ts[0]
    return _io(_NORMS[op] * x.numel, ts, x.numel, x.b, "norm", x.dtype)


def _reduction(args: list[_Arg]) -> Cost:
    x = _tensors(args)[0]
    reduced = x.dims[-1:] if x.dims else []
    spec = args[1].concrete if len(args) > 1 else ""
    if spec.startswith("["):
        axes = [int(v) for v in spec.strip("[]").split(",") if v.strip()]
        reduced = [x.dims[a] for a in axes] if axes else x.dims
    out = x.numel / max(math.prod(reduced), 1)
    return _io(x.numel, [x], out, x.b, "reduction", x.dtype)


def _copy(base: str, args: list[_Arg]) -> Cost:
    ts = _tensors(args)
    if base in ("fill_", "zero_"):
        return _io(0.0, [], ts[0].numel, ts[0].b, "copy", ts[0].dtype)
    if base == "copy_":  # copy_(dst, src): read src, write dst (src may broadcast)
        dst, src = ts[0], ts[1]
        return _io(0.0, [src], dst.numel, dst.b, "copy", dst.dtype)
    x = ts[0]
    # _to_copy(self, dtype, ...), to(self, [device,] dtype, ...): the dtype, when recorded.
    out = next(filter(None, (dtypes.by_scalar_type(a.concrete) for a in args[1:3])), None)
    return _io(0.0, [x], x.numel, out.bytes if out else x.b, "copy", out.short if out else x.dtype)


def _cat(args: list[_Arg], fallback: str | None) -> Cost:
    """cat(tensors, dim): the list's dims are nested; its dtype is not recorded (`fallback`)."""
    first = args[0]
    if first.type != "TensorList" or fallback is None:
        return Cost(uncosted="aten::cat: tensor-list dtype unknown")
    n = sum(math.prod(d) for d in first.dims)
    b = dtypes.lookup(fallback).bytes
    shape = f"{len(first.dims)} tensors -> {n}"
    return Cost("copy", 0.0, costs.elementwise_bytes(n, n, b), fallback, shape)


def _index_write(op: str, args: list[_Arg]) -> Cost:
    """index_copy_(self, dim, index, source) / index_put_(self, indices, values): only the
    written slots of `self` move."""
    ts = _tensors(args)
    dst, src = ts[0], ts[-1]
    index_bytes = sum(costs.elementwise_bytes(t.distinct, 0, t.b) for t in ts[1:-1])
    flops = float(src.numel) if op == "index_add" else 0.0
    return _io(flops, [src], src.numel, dst.b, "copy", dst.dtype, index_bytes)


def _gather(base: str, args: list[_Arg]) -> Cost:
    """embedding(weight, ids) / index_select(self, dim, index) / gather(self, dim, index): read
    and write the chosen elements, plus the indices (their distinct elements: HF's gather passes
    a [T, H] index expanded from T ids)."""
    ts = _tensors(args)
    table, index = ts[0], ts[1]
    if base == "embedding":
        rows = index.numel * table.dims[-1]
    elif base == "gather":
        rows = index.numel
    else:
        dim = int(args[1].concrete or 0)
        rows = table.numel // table.dims[dim] * index.numel
    nbytes = costs.elementwise_bytes(rows, rows, table.b)
    nbytes += costs.elementwise_bytes(index.distinct, 0, index.b)
    return Cost("copy", 0.0, nbytes, table.dtype, f"{table.dims}[{index.dims}] -> {rows}")


def _arange(args: list[_Arg]) -> Cost:
    """arange([start,] end[, step]): writes ceil((end - start) / step) elements (Concrete Inputs);
    int64 unless a bound is fractional."""
    nums = []
    for a in args:
        try:
            nums.append(float(a.concrete))
        except ValueError:
            break
    if not nums:
        return Cost(uncosted="aten::arange: bounds not recorded")
    start, end, step = (0.0, nums[0], 1.0) if len(nums) == 1 else (nums[0], nums[1],
                                                                   nums[2] if len(nums) > 2 else 1.0)
    n = max(math.ceil((end - start) / step), 0)
    short = "int64" if all(v.is_integer() for v in (start, end, step)) else "fp32"
    nbytes = costs.elementwise_bytes(0, n, dtypes.lookup(short).bytes)
    return Cost("copy", 0.0, nbytes, short, f"arange -> {n}")


def _fused(name: str, args: list[_Arg]) -> Cost:
    """A Triton kernel's cpu op lists every buffer it touches (inputs and outputs), whole.

    Each buffer counts its distinct elements, at most the kernel's work size W (`_work`). With
    `embedding` among the fused ops, the largest 2-D buffer is the table it gathers from: only
    the indexed rows are read (index elements x row width), not the whole table, which Inductor
    passes to every kernel that recomputes the lookup.
    """
    ts = _tensors(args)
    if not ts:
        return Cost(uncosted="triton kernel without tensor arguments")
    index = [t for t in ts if t.dtype in ("int64", "int32")]
    if "embedding" in name.split("_") and index:
        table = max(ts, key=lambda t: t.numel)
        if len(table.dims) == 2:
            rows = sum(t.numel for t in index)
            gathered = _Arg([min(rows, table.dims[0]), table.dims[1]], table.type, table.concrete)
            ts = [gathered if t is table else t for t in ts]
    main = max(ts, key=lambda t: t.numel)
    work = _work(name, args, ts)
    moved = [t.distinct if work is None else min(t.distinct, work) for t in ts]
    nbytes = sum(costs.elementwise_bytes(n, 0, t.b) for n, t in zip(moved, ts, strict=True))
    shape = " ".join(str(t.dims) for t in ts)
    shape += f" over {work}" if work is not None else " (no sizes recorded)"
    flops = work if work is not None else main.numel
    return Cost("fused", float(flops), float(nbytes), main.dtype, shape)


def _work(name: str, args: list[_Arg], tensors: list[_Arg]) -> int | None:
    """Points in a Triton kernel's iteration space, from the sizes Inductor passes last.

    The trailing integer `Scalar` arguments end with the numels of the kernel's range trees:
    xnumel (`poi`), xnumel, r0_numel (`red`, `per`); tiled kernels add ynumel (and znumel)
    before xnumel, and symbolic sizes (ks0, ...) come first. The fewest trailing sizes (1 for
    poi, 2 for red/per, at most 3) whose product is some buffer's size are taken; when none
    is, the fewest. None for other kernels (templates) or when no sizes were recorded.
    """
    kind = name.removeprefix("triton_").split("_", 1)[0]
    least = {"poi": 1, "red": 2, "per": 2}.get(kind)
    sizes: list[int] = []
    for a in reversed(args):
        if a.type != "Scalar" or not a.concrete.isdigit():
            break
        sizes.insert(0, int(a.concrete))
    if least is None or len(sizes) < least:
        return None
    numels = {t.numel for t in tensors}
    for k in range(least, min(len(sizes), 3) + 1):
        if math.prod(sizes[-k:]) in numels:
            return math.prod(sizes[-k:])
    return math.prod(sizes[-least:])


# ---------------------------------------------------------------------- phase and checks
def _phases(out: pd.DataFrame) -> pd.Series:
    """decode|prefill per step from its attention instances (T == 1 -> decode)."""
    step = out["step"].fillna(-1)
    attn = out["T"].notna()
    if not attn.any():
        return pd.Series("unknown", index=out.index, dtype="str")
    per_step = out.loc[attn, "T"].groupby(step[attn]).max()
    label = pd.Series(np.where(per_step.to_numpy() == 1, "decode", "prefill"), per_step.index)
    whole = label.iloc[0] if label.nunique() == 1 else "unknown"
    return step.map(label).fillna(whole).astype("str")


def _gemm_check(out: pd.DataFrame, model: ModelSpec | None) -> pd.Series:
    """Message where a projection GEMM's K,N differ from the model preset's."""
    check = pd.Series(None, index=out.index, dtype="str")
    if model is None:
        return check
    expect = {**model.linears(), **model.fused_linears(),
              "lm_head": (model.hidden_size, model.vocab_size, False)}
    gemm = out["cost_kind"].eq("gemm") & out["operator"].isin(list(expect))
    if gemm.any():
        op = out.loc[gemm, "operator"]
        k_exp = op.map({o: v[0] for o, v in expect.items()}).astype("Int64")
        n_exp = op.map({o: v[1] for o, v in expect.items()}).astype("Int64")
        k, n = out.loc[gemm, "K"], out.loc[gemm, "N"]
        bad = ((k != k_exp) | (n != n_exp)).fillna(True)
        msg = (op + ": K,N=" + k.astype("str") + "," + n.astype("str")
               + f" but {model.name} has " + k_exp.astype("str") + "," + n_exp.astype("str"))
        check.loc[bad[bad].index] = msg[bad]
    return check


# ------------------------------------------------------------------ model-level operators
def model_level_costs(model: ModelSpec, tokens: int, sequences: int) -> pd.DataFrame:
    """Costs of the operators outside the decoder layers, from the model's shapes, by the same
    rules as traced ops: embedding (gather `tokens` rows of the table), final_norm (an RMSNorm
    over tokens x hidden) and lm_head (logits for the last position of each of `sequences`
    sequences, as HF generate and vLLM compute them). Columns operator, dtype, flops, bytes, shape.
    """
    dt = dtypes.lookup(model.dtype)
    if dt is None:
        raise InputError(f"model {model.name}: unknown dtype {model.dtype!r}")
    ttype = dt.name
    h, v = model.hidden_size, model.vocab_size
    rows = {
        "embedding": _gather("embedding", [_Arg([v, h], ttype, ""), _Arg([tokens], "long int", "")]),
        "final_norm": _norm("rms_norm", [_Arg([tokens, h], ttype, ""), _Arg([h], ttype, "")]),
        "lm_head": _gemm(sequences, h, v, _Arg([sequences, h], ttype, "")),
    }
    return pd.DataFrame({
        "operator": list(rows), "dtype": [c.dtype for c in rows.values()],
        "flops": [c.flops for c in rows.values()], "bytes": [c.bytes for c in rows.values()],
        "shape": [c.shape for c in rows.values()],
    })
