"""Costs of operators from the model's shapes alone, by the same rules as traced ops: the
model-level operators (embedding, final norm, LM head) and one layer's MLP, dense or sparse.

Design notes: docs/design.md ("trace_roofline/costs/").
"""

from __future__ import annotations

import pandas as pd

from trace_roofline.costs.call import Arg, Call, Cost, Kind
from trace_roofline.costs.copies import gather
from trace_roofline.costs.gemm import Gemm
from trace_roofline.costs.pointwise import elementwise, norm
from trace_roofline.errors import InputError
from trace_roofline.model import dtypes, moe
from trace_roofline.model.models import ModelSpec
from trace_roofline.model.operators import SHARED_OF, Name


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
    def call(name: str, *args: Arg) -> Call:
        return Call(name, list(args), "causal", "all", None)

    rows = {
        Name.EMBEDDING: gather(call("aten::embedding", Arg([v, h], ttype, ""),
                                  Arg([tokens], "long int", ""))),
        Name.FINAL_NORM: norm(call("aten::rms_norm", Arg([tokens, h], ttype, ""),
                                 Arg([h], ttype, ""))),
        Name.LM_HEAD: Gemm(sequences, h, v, Arg([sequences, h], ttype, "")).cost(),
    }
    return _cost_frame(list(rows.items()))


def _cost_frame(rows: list[tuple[str, Cost]]) -> pd.DataFrame:
    """Costs as rows (operator, dtype, flops, bytes, shape); an operator may recur."""
    return pd.DataFrame({
        "operator": [o for o, _ in rows], "dtype": [c.dtype for _, c in rows],
        "flops": [c.flops for _, c in rows], "bytes": [c.bytes for _, c in rows],
        "shape": [c.shape for _, c in rows],
    })


def mlp_costs(model: ModelSpec, tokens: int, sparse: bool) -> pd.DataFrame:
    """One layer's MLP from the model's shapes for `tokens` tokens, by the traced ops' rules:
    dense, gate and up [T,H]x[H,I], down [T,I]x[I,H] and act (HF's silu then mul on [T, I]);
    sparse (the model's experts), the router [T,H]x[H,E], the routed experts' gate_up and down
    (moe.py: ΣM_e = T·k rows, the expected active experts' weights), their act on [ΣM_e, I],
    and the shared expert (its projections, act and sigmoid gate H -> 1, `router`) when there is
    one. The token permutation and combine (engine-specific) are not included. Columns as
    `model_level_costs`."""
    dt = dtypes.lookup(model.dtype)
    if dt is None:
        raise InputError(f"model {model.name}: unknown dtype {model.dtype!r}")
    h, ttype = model.hidden_size, dt.name

    def call(name: str, *args: Arg) -> Call:
        return Call(name, list(args), "causal", "all", None)

    def act(rows: int, inter: int) -> list[Cost]:
        x = Arg([rows, inter], ttype, "")
        return [elementwise(call("aten::silu", x)), elementwise(call("aten::mul", x, x))]

    def swiglu(shared: bool, rows: int, inter: int) -> list[tuple[str, Cost]]:
        gate, up, down = (SHARED_OF[n] if shared else n
                          for n in (Name.GATE_PROJ, Name.UP_PROJ, Name.DOWN_PROJ))
        x = Arg([rows, h], ttype, "")
        return [(gate, Gemm(rows, h, inter, x).cost()),
                (up, Gemm(rows, h, inter, x).cost()),
                *[(Name.ACT, c) for c in act(rows, inter)],
                (down, Gemm(rows, inter, h, Arg([rows, inter], ttype, "")).cost())]

    e = model.experts
    if not sparse or e is None:
        return _cost_frame(swiglu(False, tokens, model.intermediate_size))
    rows = moe.routed_rows(tokens, e.top_k)
    i, b = e.intermediate_size, dt.bytes
    active = moe.expected_active_experts(e.num_experts, e.top_k, tokens)
    out = [(Name.ROUTER, Gemm(tokens, h, e.num_experts, Arg([tokens, h], ttype, "")).cost()),
           (Name.EXPERTS_GATE_UP, Cost(Kind.GEMM, moe.gate_up_flops(rows, h, i),
                                    moe.gate_up_bytes(rows, h, i, active, b), dt.short,
                                    f"{e.num_experts} experts [{rows},{h}]x[{h},{2 * i}]")),
           *[(Name.EXPERTS_ACT, c) for c in act(rows, i)],
           (Name.EXPERTS_DOWN, Cost(Kind.GEMM, moe.down_flops(rows, h, i),
                                 moe.down_bytes(rows, h, i, active, b), dt.short,
                                 f"{e.num_experts} experts [{rows},{i}]x[{i},{h}]"))]
    if e.shared_intermediate_size:
        out += swiglu(True, tokens, e.shared_intermediate_size)
    if e.shared_gate:
        out.append((Name.ROUTER, Gemm(tokens, h, 1, Arg([tokens, h], ttype, "")).cost()))
    return _cost_frame(out)
