"""Whether a trace is a decoder's: its attention calls' causality, decode steps and embeddings.

An encoder (BERT, ViT, a diffusion model's text encoder and blocks) attends bidirectionally and
never decodes; a vision encoder embeds patches by a convolution, not tokens by a table. Such a
trace carries no decoder-only names (verify.py) and no prefill or decode phases (`forward`).
"""

from __future__ import annotations

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
_CALL = ("causal", "decode", "bidirectional", "unknown")
_PATCH_CONVS = {"conv2d", "conv3d"}


def judge(att: pd.DataFrame) -> Verdict:
    """The verdict on an attributed table (op_name, input_dims, concrete_inputs): a decoder
    unless every attention call with recorded causality is bidirectional and none decodes
    (an encoder), or, with no such call, a 2-D/3-D convolution embeds and no table does (a
    vision encoder). Attention without recorded causality (eager, engines' ops) says decoder."""
    base = operators.base_names(att["op_name"]).fillna("")
    attn = operators.recognise(operators.ATTENTION, base).to_numpy(dtype=bool)
    front = att.loc[attn, ["op_name", "input_dims", "concrete_inputs"]].astype("string")
    calls = (naming.per_value(front, _calls).to_numpy(dtype=object) if len(front)
             else np.zeros(0, dtype=object))
    if np.isin(calls, ["causal", "decode", "unknown"]).any():
        return DECODER
    if (calls == "bidirectional").any():
        return Verdict("encoder", "every attention call attends bidirectionally (is_causal "
                       "False, no causal mask) and none decodes: an encoder, not a decoder")
    if base.isin(_PATCH_CONVS).any() and not base.eq("embedding").any():
        return Verdict("vision encoder", "a convolution embeds its input and no embedding "
                       "table does: a vision or video encoder, not a decoder")
    return DECODER


def _calls(d: pd.DataFrame) -> pd.Series:
    """Per distinct attention op (op_name, input_dims, concrete_inputs): `causal`, `decode`
    (one query token), `bidirectional` (T > 1, is_causal False and no mask over the queries)
    or `unknown` (no layout, or its arguments not recorded)."""
    out = []
    for op, dims_raw, conc_raw in d.itertuples(index=False):  # (distinct ops: a few)
        out.append(_call(str(op), decode_args(dims_raw) or [], decode_args(conc_raw) or []))
    return pd.Series(out, index=d.index, dtype=object)


def _call(op: str, dims: list, conc: list) -> str:
    layout = layouts.ATTENTION_LAYOUTS.get(op)
    if layout is None or len(dims) < 2 or len(conc) <= layout[1]:
        return "unknown"
    order, causal_at = layout
    q = dims[0]
    if not isinstance(q, list) or len(q) != 4:
        return "unknown"
    t = q[2] if order == "BHTD" else q[1]
    flag = str(conc[causal_at])
    if t == 1:
        return "decode"
    if flag in ("True", "1", "2"):
        return "causal"
    mask = dims[3] if order == "BHTD" and len(dims) > 3 else []
    if isinstance(mask, list) and len(mask) >= 2 and mask[-2] != 1:
        return "causal"  # a mask over queries and keys: a causal one, as far as shapes tell
    return "bidirectional" if flag in ("False", "0") else "unknown"
