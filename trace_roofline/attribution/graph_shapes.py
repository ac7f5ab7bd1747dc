"""Shapes for a graph named from its kernel names (which carry none): the ops of B tokens, from
the user's --batch/--context or the step annotation, written into its position table.

Design notes: docs/design.md ("trace_roofline/attribution/graphs.py").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from trace_roofline.errors import InputError
from trace_roofline.model import dtypes, moe
from trace_roofline.model.gemms import SIGNATURES
from trace_roofline.model.models import ModelSpec
from trace_roofline.model.operators import Name
from trace_roofline.options import DecodeShapes

EXPERT_GEMMS = (Name.EXPERTS_GATE_UP, Name.EXPERTS_DOWN)  # a weight gather joins these
SHARED_EXPERT_GATE = "shared_expert_gate"  # a shared expert's sigmoid gate: `router` work


@dataclass(frozen=True)
class StepShapes(DecodeShapes):
    """Shapes from a step annotation: GEMMs and the rest over its tokens; attention is left to
    the step's sums (costs/attention.py), never to a mean context."""


def step_shapes(step: pd.Series | None, given: DecodeShapes | None
                ) -> tuple[DecodeShapes | None, str | None]:
    """Shapes for a graph named from kernel names: its annotated step's (M = the step's
    tokens, context = Σk / requests; attention from the step's sums, costs/attention.py), else
    the user's --batch/--context; and a note of which, and of a given option left unused."""
    if step is None or pd.isna(step["tokens"]):
        return given, None
    keys = sum(int(step[c]) for c in ("p_sk", "d_sk") if pd.notna(step[c]))
    requests = int(step["requests"]) if pd.notna(step["requests"]) else int(step["tokens"])
    context = max(1, round(keys / max(requests, 1))) if keys else 1
    got = StepShapes(int(step["tokens"]), context)
    return got, (f"costed from the step annotation ({int(step['tokens'])} tokens, "
                 f"{step['phase']}; attention from its sums)")


@dataclass(frozen=True)
class Call:
    """An op as user_shapes writes it into a position table: name, Input Dims, and per
    argument the Input type (None: the model's dtype) and Concrete Inputs."""

    op: str
    dims: list
    types: tuple[str | None, ...] = ()
    concrete: tuple[str, ...] = ()


_NORMS = (Name.INPUT_NORM, Name.POST_ATTENTION_NORM, Name.PRE_FEEDFORWARD_NORM,
          Name.POST_FEEDFORWARD_NORM, Name.FINAL_NORM)
_AFTER_OUTPUT = (Name.POST_ATTENTION_NORM, Name.POST_FEEDFORWARD_NORM, Name.FINAL_NORM)  # add before


@dataclass(frozen=True)
class KernelHints:
    """What a graph's kernels tell user_shapes, per row of its position table: batched_mm's
    weight gathers, the GEMM the layout names there, the kernel's role (kernels.ROLES)."""

    gathers: np.ndarray | None = None
    gemms: np.ndarray | None = None
    roles: np.ndarray | None = None


def user_shapes(res: pd.DataFrame, model: ModelSpec, shapes: DecodeShapes,
                hints: KernelHints | None = None) -> None:
    """Write shapes of B = shapes.batch tokens (--batch/--context: decode, one token per
    sequence attending to S keys; a step annotation's StepShapes: the step's tokens) into a
    position table's named operators, in place: the projections and lm_head as [B, K] x [K, N];
    attention as SDPA Q [B, n_q, 1, d] over K, V [B, n_kv, S, d] (not for StepShapes: the
    step's sums cost it, costs/attention.py); the norms as engine RMSNorms over [B, H] (a fused
    residual add where the kernel's role says so, or where no `residual` kernel runs and the
    norm follows a sublayer's output); q/k norms over [B, heads, d]; RoPE over q [B, n_q·d],
    k [B, n_kv·d]; the KV-cache write of B tokens; the gated activation [B, 2I] -> [B, I];
    the embedding's B rows. For a model with experts the router's logits GEMM [B, H] x [H, E],
    the routed experts' gate_up and down as one grouped GEMM over the B·k routed rows
    ([B·k, H] x [E, H, 2I], [B·k, I] x [E, I, H], the weights at the experts' dtype (MXFP4):
    charged per expected active expert, costs/moe.py) and the shared expert's projections. Where
    the expert GEMMs hold batched_mm's weight gathers (`hints.gathers`), as HF's batched_mm
    runs them: each gather an `index` of the [E, 2I, H] (or [E, H, I]) weights, the GEMM a bmm
    over the B·k gathered copies ([B·k, 2I, H] x [B·k, H, 1]). A shared expert's sigmoid gate
    (H -> 1) is named `router` too: with `hints.gemms`
    each `router` instance takes the shape of its own GEMM, without them neither is given one.
    `hints.roles` tells a fused add+RMSNorm kernel and the experts'
    finalize kernel (moe_combine: the top-k outputs [B, k, H] summed into [B, H]). Other
    operators stay without shapes."""
    d = dtypes.lookup(model.dtype)
    if d is None:
        raise InputError(f"model {model.name}: unknown dtype {model.dtype!r}")
    ttype = next((sp for sp in d.spellings if sp.startswith("c10::")),
                 d.spellings[0] if d.spellings else d.name)
    b, e = shapes.batch, model.experts
    hints = hints or KernelHints()
    gathers, gemms, roles = hints.gathers, hints.gemms, hints.roles
    op = res["operator"].to_numpy(dtype=object)
    calls = [(op == name, call) for name, call in _dense_calls(model, shapes).items()]
    calls += _norm_calls(res, op, model, b, roles)
    if e is not None and roles is not None:  # the routed outputs' weighted sum (its kernel)
        finalize = (op == Name.MOE_COMBINE) & (np.asarray(roles, dtype=object) == "moe_finalize")
        calls.append((finalize, Call("_moe_C::moe_sum", [[b, e.top_k, model.hidden_size],
                                                         [b, model.hidden_size]])))
    if e is not None:
        moe_lin = model.moe_linears()
        batched = gathers is not None and gathers[np.isin(op, EXPERT_GEMMS)].any()
        calls += _expert_calls(op, model, b, gathers if batched else None)
        router = op == Name.ROUTER
        if not e.shared_gate:
            calls.append((router, _gemm_call(b, *moe_lin[Name.ROUTER])))
        elif gemms is not None:  # each router instance by the GEMM in it
            role = pd.Series(gemms, dtype=object).groupby(res["inst"].to_numpy()).transform(
                "first").to_numpy(dtype=object)
            calls += [(router & (role == name), _gemm_call(b, *moe_lin[name]))
                      for name in (Name.ROUTER, SHARED_EXPERT_GATE)]
    for hit, call in calls:
        _write_call(res, hit, call, ttype)


def _dense_calls(model: ModelSpec, shapes: DecodeShapes) -> dict[str, Call]:
    """Operator -> its op over B tokens, for the operators every layer layout shares."""
    b, s, h = shapes.batch, shapes.context, model.hidden_size
    lin = {**model.linears(), **model.fused_linears(), Name.LM_HEAD: (h, model.vocab_size, False)}
    if model.experts is not None:
        lin |= {k: v for k, v in model.moe_linears().items()
                if k.startswith("shared_") and k != SHARED_EXPERT_GATE}
    table = {name: _gemm_call(b, *kn) for name, kn in lin.items()}
    nq, nkv, hd = model.num_heads, model.num_kv_heads, model.head_dim
    if not isinstance(shapes, StepShapes):
        table[Name.ATTENTION] = Call("aten::scaled_dot_product_attention",
                                  [[b, nq, 1, hd], [b, nkv, s, hd], [b, nkv, s, hd]])
    if model.qk_norm:
        table[Name.Q_NORM] = Call("aten::rms_norm", [[b, nq, hd], [hd]])
        table[Name.K_NORM] = Call("aten::rms_norm", [[b, nkv, hd], [hd]])
    rot = model.architecture.attention.rope_dim or hd
    table[Name.ROPE] = Call("_C::rotary_embedding",
                         [[b], [b, nq * hd], [b, nkv * hd], [], [b, rot], []],
                         ("long int", None, None, "Scalar", None, "Scalar"),
                         ("", "", "", str(hd), "", "True"))
    table[Name.KV_CACHE] = Call("_C_cache_ops::reshape_and_cache_flash",
                             [[b, nkv, hd], [b, nkv, hd], [1, nkv, hd], [1, nkv, hd], [b]],
                             (None, None, None, None, "long int"))
    table[Name.EMBEDDING] = Call("aten::embedding", [[model.vocab_size, h], [b]], (None, "long int"))
    mlp = model.architecture.mlp
    if mlp is not None and mlp.gated:
        i = mlp.intermediate_size
        table[Name.ACT] = Call("_C::gelu_and_mul" if "gelu" in mlp.activation else "_C::silu_and_mul",
                            [[b, i], [b, 2 * i]])
    return table


def _norm_calls(res: pd.DataFrame, op: np.ndarray, model: ModelSpec, b: int,
                roles: np.ndarray | None) -> list[tuple[np.ndarray, Call]]:
    """The layer and final norms as engine RMSNorms over [B, H]: a fused residual add where
    the kernel's role is fused_add_norm, or where no `residual` kernel runs and the norm
    follows a sublayer's output (post-attention, post-MLP, a later layer's input, final);
    never the first layer's input norm (no residual yet: SGLang runs add_rmsnorm_quant's
    no-add variant there)."""
    h = model.hidden_size
    norm = np.isin(op, _NORMS)
    layer = res["layer"].astype("Int64").to_numpy(np.float64, na_value=np.nan)
    fused_role = (np.asarray(roles, dtype=object) == "fused_add_norm") if roles is not None \
        else np.zeros(len(op), dtype=bool)
    after_output = np.isin(op, _AFTER_OUTPUT) | ((op == Name.INPUT_NORM) & (layer > 0))
    no_residual = not (op == Name.RESIDUAL).any()
    first = (op == Name.INPUT_NORM) & (layer == 0)  # nothing to add to yet
    fused = norm & ~first & (fused_role | (after_output & no_residual))
    return [(fused, Call("_C::fused_add_rms_norm", [[b, h], [b, h], [h]])),
            (norm & ~fused, Call("_C::rms_norm", [[b, h], [b, h], [h]]))]


def _gemm_call(b: int, k: int, n: int, bias: bool, weight: str | None = None) -> Call:
    """A linear's op over B rows: addmm with its bias, else mm (`weight`: its Input type), its
    arguments where gemms.SIGNATURES places them."""
    op = "addmm" if bias else "mm"
    sig = SIGNATURES[op]
    args = {sig.activation: ([b, k], None), sig.weight: ([n, k] if sig.weight_nk else [k, n], weight)}
    if sig.bias is not None:
        args[sig.bias] = ([n], None)
    at = sorted(args)
    return Call(f"aten::{op}", [args[i][0] for i in at], tuple(args[i][1] for i in at))


def _expert_calls(op: np.ndarray, model: ModelSpec, b: int, gathers: np.ndarray | None
                  ) -> list[tuple[np.ndarray, Call]]:
    """The routed experts' ops over the B·k routed rows (user_shapes): one grouped GEMM each,
    its weights at the experts' dtype, or with batched_mm's weight `gathers` an index of the
    weights and a bmm."""
    e, h = model.experts, model.hidden_size
    assert e is not None  # (expert operators come from a model with experts)
    rows, i, ne = moe.routed_rows(b, e.top_k), e.intermediate_size, e.num_experts
    weights = model.architecture.precision.expert_weights
    w = weights if dtypes.lookup(weights) is not None else None
    up, down = op == Name.EXPERTS_GATE_UP, op == Name.EXPERTS_DOWN
    if gathers is None:
        return [(up, Call("aten::_grouped_mm", [[rows, h], [ne, h, 2 * i], [ne]],
                          (None, w, "int"))),
                (down, Call("aten::_grouped_mm", [[rows, i], [ne, i, h], [ne]],
                            (None, w, "int")))]
    return [(up & ~gathers, Call("aten::bmm", [[rows, 2 * i, h], [rows, h, 1]])),
            (down & ~gathers, Call("aten::bmm", [[rows, h, i], [rows, i, 1]])),
            (up & gathers, Call("aten::index", [[ne, 2 * i, h], []])),
            (down & gathers, Call("aten::index", [[ne, h, i], []]))]


def _write_call(res: pd.DataFrame, hit: np.ndarray, call: Call, ttype: str) -> None:
    """Give the rows `hit` of a position table the op `call` (its types defaulting to ttype)."""
    if hit.any():
        types = [t or ttype for t in (call.types or (None,) * len(call.dims))]
        res.loc[hit, "op_name"] = call.op
        res.loc[hit, "input_dims"] = str(call.dims)
        res.loc[hit, "input_types"] = str(types).replace("'", '"')
        res.loc[hit, "concrete_inputs"] = (str(list(call.concrete)).replace("'", '"')
                                           if call.concrete else None)
        res.loc[hit, "input_strides"] = None
