"""Whether a trace is a decoder's: its attention calls' causality, decode steps and embeddings.

An encoder (BERT, ViT, a diffusion model's text encoder and blocks) attends bidirectionally and
never decodes; a vision encoder embeds patches by a convolution, not tokens by a table. Such a
trace carries no decoder-only names (verify.py) and no prefill or decode phases (`forward`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from trace_roofline.attribution import naming
from trace_roofline.model import layouts, operators
from trace_roofline.trace.decode import decode_args


@dataclass(frozen=True)
class Verdict:
    """What kind of model ran (`decoder`, `encoder`, `vision encoder`) and the evidence."""

    kind: str = "decoder"
    why: str = ""

    @property
    def decoder(self) -> bool:
        return self.kind == "decoder"


DECODER = Verdict()
_PATCH_CONVS = {"conv2d", "conv3d"}


def judge(att: pd.DataFrame) -> Verdict:
    """The verdict on an attributed table (op_name, input_dims, concrete_inputs): a decoder
    when an attention call is causal or decodes (an SDPA op's is_causal or T = 1, an eager
    attention's causal mask or one-query Q·Kᵀ); else an encoder when some call attends
    bidirectionally or across to another sequence (more queries than keys: a diffusion
    block's cross-attention), or an eager Q·Kᵀ over several queries has no causal mask;
    else a vision encoder when a 2-D/3-D convolution embeds and no table does; else
    (engines' ops: no causality recorded) a decoder."""
    base = naming.base_name(att["op_name"]).fillna("")  # (once per distinct op name)
    attn = naming.per_value(base, lambda b: operators.recognise(operators.ATTENTION, b)
                            ).to_numpy(dtype=bool)
    front = att.loc[attn, ["op_name", "input_dims", "concrete_inputs"]].astype("string")
    calls = (naming.per_value(front, _calls).to_numpy(dtype=object) if len(front)
             else np.zeros(0, dtype=object))
    eager = att.loc[base.isin(_EAGER_OPS).to_numpy(dtype=bool), ["op_name", "input_dims"]]
    if len(eager):
        calls = np.append(calls, naming.per_value(eager.astype("string"), _eager).to_numpy(
            dtype=object))
    if np.isin(calls, ["causal", "decode"]).any():
        return DECODER
    if np.isin(calls, ["bidirectional", "cross", "eager"]).any():
        return Verdict("encoder", "no attention call is causal or decodes, and some attend "
                       "bidirectionally (is_causal False, no causal mask) or across to another "
                       "sequence: an encoder, not a decoder")
    if base.isin(_PATCH_CONVS).any() and not base.eq("embedding").any():
        return Verdict("vision encoder", "a convolution embeds its input and no embedding "
                       "table does: a vision or video encoder, not a decoder")
    return DECODER


def _calls(d: pd.DataFrame) -> pd.Series:
    """Per distinct attention op (op_name, input_dims, concrete_inputs): `causal`, `decode`
    (one query token), `cross` (more queries than keys, not causal), `bidirectional` (T > 1,
    is_causal False and no mask over the queries) or `unknown` (no layout, its arguments not
    recorded, or a per-head bias: ALiBi's or T5's, which may or may not mask causally)."""
    out = []
    for op, dims_raw, conc_raw in d.fillna("").itertuples(index=False):  # (distinct: a few)
        out.append(_call(str(op), decode_args(dims_raw) or [], decode_args(conc_raw) or []))
    return pd.Series(out, index=d.index, dtype=object)


_EAGER_OPS = {"matmul", "bmm", "baddbmm", "add", "add_", "where", "masked_fill", "masked_fill_"}
_SHAPE = re.compile(r"\[\s*(\d+(?:\s*,\s*\d+)*)\s*\]")


def _eager(d: pd.DataFrame) -> pd.Series:
    """Per distinct (op_name, input_dims) of an eager attention's ops: its Q·Kᵀ (a matmul of
    two 4-D activations, [B, H, T, d] x [B, H, d, S]: `decode` at T = 1, else `eager`) or its
    mask (an add, where or masked_fill of scores [B, H, T, S] with a [B, 1, T, S] mask:
    `causal`; with [B, 1, 1, S], a padding mask: `eager`); "" for anything else."""
    out = []
    for op, dims in d.fillna("").itertuples(index=False):  # (distinct ops: a few)
        shapes = [tuple(int(v) for v in m.split(",")) for m in _SHAPE.findall(str(dims))]
        four = [x for x in shapes if len(x) == 4]
        base = str(op).rsplit("::", 1)[-1]
        kind = ""
        if base in ("matmul", "bmm", "baddbmm") and len(four) >= 2 and four[0][3] == four[1][2]:
            kind = "decode" if four[0][2] == 1 else "eager"  # (not RoPE's [.., d/2, 1] table)
        elif base not in ("matmul", "bmm", "baddbmm") and len(four) >= 2:
            scores, mask = four[0], four[1]
            if base == "where":
                mask, scores = four[0], four[1]
            if mask[1] == 1 and mask[3] == scores[3] and scores[2] > 1:
                kind = "causal" if mask[2] == scores[2] else "eager" if mask[2] == 1 else ""
        out.append(kind)
    return pd.Series(out, index=d.index, dtype=object)


def _call(op: str, dims: list, conc: list) -> str:
    layout = layouts.ATTENTION_LAYOUTS.get(op)
    if layout is None or len(dims) < 2 or len(conc) <= layout[1]:
        return "unknown"
    order, causal_at = layout
    q = dims[0]
    if not isinstance(q, list) or len(q) != 4:
        return "unknown"
    k = dims[1]
    t = q[2] if order == "BHTD" else q[1]
    s = k[2] if order == "BHTD" and isinstance(k, list) and len(k) == 4 else None
    flag = str(conc[causal_at])
    if t == 1:
        return "decode"
    if flag in ("True", "1", "2"):
        return "causal"
    if flag not in ("False", "0"):
        return "unknown"
    if s is not None and t > s:
        return "cross"
    mask = dims[3] if order == "BHTD" and len(dims) > 3 else []
    if isinstance(mask, list) and len(mask) == 4 and mask[-2] != 1:
        return "causal" if mask[1] == 1 else "unknown"  # [B, 1, T, S]: a causal mask's shape
    return "bidirectional"
