"""Synthetic attributed tables (attribute.py's schema) of Qwen-shaped decoder layers.

The op names, `Input Dims`, `Input type` and `Concrete Inputs` follow what torch.profiler records
on CUDA for workloads/layer.py (innermost kernel-launching ops: addmm/mm, the flash attention
forward in [B, T, heads, d] layout, copy_ for casts and cache writes, ...). Kernel durations are
chosen numbers, not measurements.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pandas as pd

from trace_roofline.models import ModelSpec

BF, F32 = "c10::BFloat16", "float"


@dataclass
class Op:
    operator: str
    name: str | None
    dims: list | None
    types: list | None
    concrete: list | None = None
    durs: tuple[float, ...] = (1.0,)
    kind: str = "kernel"
    extra: dict = field(default_factory=dict)


def _norm(operator: str, m: int, h: int) -> list[Op]:
    """Qwen2RMSNorm as aten ops: cast to fp32, pow, mean, add eps, rsqrt, mul, cast, weight mul."""
    x = [1, m, h]
    return [
        Op(operator, "aten::copy_", [x, x, []], [F32, BF, "Scalar"], ["", "", "False"]),
        Op(operator, "aten::pow", [x, []], [F32, "Scalar"], ["", "2"]),
        Op(operator, "aten::mean", [x, [], [], []], [F32, "ScalarList", "Scalar", ""],
           ["", "[-1]", "True", ""]),
        Op(operator, "aten::add", [[1, m, 1], [], []], [F32, "Scalar", "Scalar"], ["", "1e-06", "1"]),
        Op(operator, "aten::rsqrt", [[1, m, 1]], [F32], [""]),
        Op(operator, "aten::mul", [x, [1, m, 1]], [F32, F32], ["", ""]),
        Op(operator, "aten::copy_", [x, x, []], [BF, F32, "Scalar"], ["", "", "False"]),
        Op(operator, "aten::mul", [[h], x], [BF, BF], ["", ""]),
    ]


def qwen_layer(spec: ModelSpec, t: int, s: int, durs: dict[str, tuple[float, ...]] | None = None,
               splitk_down: bool = True) -> list[Op]:
    """One decoder layer at T new tokens against S keys (decode: T=1; prefill: T=S), B=1."""
    h, nq, nkv, d, inter = (spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                            spec.intermediate_size)
    durs = durs or {}
    lin = spec.linears()

    def proj(name: str) -> Op:
        k, n, bias = lin[name]
        if bias:
            return Op(name, "aten::addmm", [[n], [t, k], [k, n], [], []],
                      [BF, BF, BF, "Scalar", "Scalar"], ["", "", "", "1", "1"])
        return Op(name, "aten::mm", [[t, k], [k, n]], [BF, BF], ["", ""])

    q, kk = [1, nq, t, d], [1, nkv, t, d]
    ops = [*_norm("input_norm", t, h), proj("q_proj"), proj("k_proj"), proj("v_proj")]
    for x in (q, kk):  # rope: x*cos + rotate_half(x)*sin
        half = [*x[:-1], d // 2]
        ops += [
            Op("rope", "aten::mul", [x, [t, d]], [BF, BF]),
            Op("rope", "aten::neg", [half], [BF]),
            Op("rope", "aten::cat", [[half, half], []], ["TensorList", "Scalar"], ["", "-1"]),
            Op("rope", "aten::mul", [x, [t, d]], [BF, BF]),
            Op("rope", "aten::add", [x, x, []], [BF, BF, "Scalar"], ["", "", "1"]),
        ]
    ops += [Op("kv_cache", "aten::copy_", [kk, kk, []], [BF, BF, "Scalar"], ["", "", "False"])
            for _ in range(2)]
    causal = "True" if t > 1 else "False"
    ops.append(Op(
        "attention", "aten::_flash_attention_forward",
        [[1, t, nq, d], [1, s, nkv, d], [1, s, nkv, d], [], [], [], [], [], [], [], [], [], [], [], []],
        [BF, BF, BF, "", "", "Scalar", "Scalar", "Scalar", "Scalar", "Scalar", "Scalar", "", "",
         "", ""],
        ["", "", "", "", "", str(t), str(s), "0.", causal, "False", "0.0883", "", "", "", ""]))
    ops += [proj("o_proj"),
            Op("residual", "aten::add", [[1, t, h], [1, t, h], []], [BF, BF, "Scalar"]),
            *_norm("post_attention_norm", t, h), proj("gate_proj"), proj("up_proj"),
            Op("act", "aten::silu", [[1, t, inter]], [BF]),
            Op("act", "aten::mul", [[1, t, inter], [1, t, inter]], [BF, BF])]
    down = proj("down_proj")
    if splitk_down:  # split-K GEMM: two kernels, one op instance
        down.durs = (1.0, 1.0)
    ops += [down, Op("residual", "aten::add", [[1, t, h], [1, t, h], []], [BF, BF, "Scalar"])]
    for o in ops:
        if o.operator in durs:
            per = durs[o.operator]
            o.durs = per if len(per) == len(o.durs) else (per[0],) * len(o.durs)
    return ops


def attributed(ops: list[Op], layer: int | None = 0, step: int | None = None,
               first_event: int = 0, first_op: int = 1000, t0: float = 0.0) -> pd.DataFrame:
    """attribute.attribute()'s table for `ops`, kernels back to back from t0 (µs). Each op is one
    instance per (layer, step); a kernel without an op is an instance of its own (`concat`
    numbers the instances of joined frames afresh)."""
    rows, ts, eid = [], t0, first_event
    for i, o in enumerate(ops):
        for dur in o.durs:
            rows.append({
                "event_id": eid, "name": f"kernel_{o.name}", "kind": o.kind, "stream": 7,
                "ts_us": ts, "dur_us": float(dur), "op_id": first_op + i if o.name else None,
                "op_name": o.name,
                "input_dims": json.dumps(o.dims) if o.dims is not None else None,
                "input_types": json.dumps(o.types) if o.types is not None else None,
                "concrete_inputs": json.dumps(o.concrete) if o.concrete is not None else None,
                "operator": o.operator, "layer": layer if o.operator != "unattributed" else None,
                "step": step, "source": "annotation" if o.name else "unattributed",
            })
            ts += dur + 0.5
            eid += 1
    df = _with_instances(pd.DataFrame(rows))
    return df.astype({"op_id": "Int64", "layer": "Int64", "step": "Int64", "event_id": "int64",
                      "stream": "int64", "op_name": "object", "input_dims": "object",
                      "input_types": "object", "concrete_inputs": "object"})


def concat(*frames: pd.DataFrame) -> pd.DataFrame:
    return _with_instances(pd.concat(frames, ignore_index=True))


def _with_instances(df: pd.DataFrame) -> pd.DataFrame:
    """Number the instances as attribute() would: one per op (op_id) per (operator, layer,
    step); a kernel without an op is one of its own."""
    op = df["op_id"].astype("Int64").fillna(-1 - df["event_id"].astype("int64"))
    keys = pd.MultiIndex.from_arrays([op, df["operator"], df["layer"].astype("Int64"),
                                      df["step"].astype("Int64")])
    return df.assign(instance=pd.factorize(keys)[0].astype("int64"))
