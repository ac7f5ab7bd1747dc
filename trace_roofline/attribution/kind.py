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

from trace_roofline.attribution import naming, tp
from trace_roofline.model import layouts, operators
from trace_roofline.model.operators import Name
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
CAUSAL_ENCODER = Verdict("encoder", "attention is causal, but nothing decodes and no GEMM "
                         "projects onto the vocabulary of its embedding table: a causally masked "
                         "encoder (CLIP's text tower), not a language model")
# an encoder-decoder's encoder, a model of its own in the trace (trace_models.models_of)
ENCODER_PART = Verdict("encoder", "an encoder-decoder's encoder: its forward attends "
                       "bidirectionally and never decodes; the decoder is the trace's model")
ENCODER_LABEL = "encoder, "  # the label of such a part starts so
_PATCH_CONVS = {"conv2d", "conv3d"}


def judge(att: pd.DataFrame) -> Verdict:
    """The verdict on an attributed table (op_name, input_dims, concrete_inputs): a decoder
    when an attention call is causal or decodes (an SDPA op's is_causal or T = 1, an eager
    attention's causal mask or one-query Q·Kᵀ); else an encoder when some call attends
    bidirectionally or across to another sequence (more queries than keys: a diffusion
    block's cross-attention), an eager Q·Kᵀ or softmax over several queries has no causal
    mask, its square mask is a padding mask's outer product (DeBERTa) or Fourier transforms mix
    the tokens (FNet); a vision encoder when a 2-D/3-D convolution embeds, no table does and
    no call is causal (a patch grid of one token reads as one query); else (engines' ops: no
    causality recorded) a decoder."""
    base = naming.base_name(att["op_name"]).fillna("")  # (once per distinct op name)
    attn = naming.per_value(base, lambda b: operators.recognise(operators.ATTENTION, b)
                            ).to_numpy(dtype=bool)
    front = att.loc[attn, ["op_name", "input_dims", "concrete_inputs"]].astype("string")
    calls = (naming.per_value(front, attention_calls).to_numpy(dtype=object) if len(front)
             else np.zeros(0, dtype=object))
    eager = att.loc[base.isin(_EAGER_OPS).to_numpy(dtype=bool), ["op_name", "input_dims"]]
    if len(eager):
        calls = np.append(calls, naming.per_value(eager.astype("string"), _eager).to_numpy(
            dtype=object))
    if "padding" in calls:  # a square mask built as a padding mask's outer product
        calls = calls[calls != "masked"]
    patches = bool(base.isin(_PATCH_CONVS).any() and not base.eq(Name.EMBEDDING).any())
    if not patches and np.isin(calls, ["decode"]).any():
        return DECODER
    if np.isin(calls, ["causal", "masked"]).any():
        return DECODER if _lm_head(att, base) else CAUSAL_ENCODER
    if np.isin(calls, ["bidirectional", "cross", "eager"]).any() or base.isin(_MIXING).any():
        return Verdict("encoder", "no attention call is causal or decodes, and some attend "
                       "bidirectionally (is_causal False, no causal mask) or across to another "
                       "sequence, or Fourier transforms mix the tokens: an encoder, not a "
                       "decoder")
    if patches:
        return Verdict("vision encoder", "a convolution embeds its input and no embedding "
                       "table does: a vision or video encoder, not a decoder")
    return DECODER


def _lm_head(att: pd.DataFrame, base: pd.Series) -> bool:
    """Whether a language model's head can have run: no embedding table is recorded (a layer's
    trace), or some GEMM's N is most of an embedding table's V (its rows: the vocabulary, which
    may also hold prompt or padding rows the head does not score: CPM-Ant's)."""
    emb = att.loc[base.eq(Name.EMBEDDING).to_numpy(dtype=bool), "input_dims"].astype("string")
    vocab = {d[0][0] for d in (decode_args(x) for x in emb.dropna().unique())
             if d and isinstance(d[0], list) and len(d[0]) == 2}
    if not vocab:
        return True
    outs = {n for _, n in tp.gemm_shapes_of(att["op_name"], att["input_dims"])}
    return any(HEAD_SHARE * v <= n <= v for n in outs for v in vocab)


HEAD_SHARE = 0.4  # the least share of the vocabulary table an LM head's N scores


def attention_calls(d: pd.DataFrame) -> pd.Series:
    """Per distinct attention op (op_name, input_dims, concrete_inputs): `causal`, `decode`
    (one query token), `cross` (more queries than keys, not causal), `bidirectional` (T > 1,
    is_causal False and no mask over the queries) or `unknown` (no layout, its arguments not
    recorded, or a per-head bias: ALiBi's or T5's, which may or may not mask causally)."""
    out = []
    for op, dims_raw, conc_raw in d.fillna("").itertuples(index=False):  # (distinct: a few)
        out.append(_call(str(op), decode_args(dims_raw) or [], decode_args(conc_raw) or []))
    return pd.Series(out, index=d.index, dtype=object)


_EAGER_OPS = {"matmul", "bmm", "baddbmm", "add", "add_", "where", "masked_fill", "masked_fill_",
              "mul", "softmax", "_softmax"}
_MIXING = {"fft_fftn", "fft_fft2"}  # FNet: a 2-D Fourier transform over tokens and features
_GEMMS = ("matmul", "bmm", "baddbmm")
_SHAPE = re.compile(r"\[\s*(\d+(?:\s*,\s*\d+)*)\s*\]")


def _eager(d: pd.DataFrame) -> pd.Series:
    """Per distinct (op_name, input_dims) of an eager attention's ops: its Q·Kᵀ (a matmul of
    two 4-D activations, [B, H, T, d] x [B, H, d, S]: `decode` at T = 1, else `eager`), its
    softmax over 4-D scores [B, H, T, S] (the same by T), its mask (an add, where or masked_fill of
    scores [B, H, T, S] with a [B, 1, T, S] mask: `masked`; with [B, 1, 1, S], a padding
    mask: `eager`) or a padding mask's outer product ([B, 1, 1, S] x [B, 1, S, 1]:
    `padding`); "" for anything else."""
    out = []
    for op, dims in d.fillna("").itertuples(index=False):  # (distinct ops: a few)
        shapes = [tuple(int(v) for v in m.split(",")) for m in _SHAPE.findall(str(dims))]
        four = [x for x in shapes if len(x) == 4]
        base = str(op).rsplit("::", 1)[-1]
        kind = ""
        if base in _GEMMS and len(four) >= 2 and four[0][3] == four[1][2]:
            kind = "decode" if four[0][2] == 1 else "eager"  # (not RoPE's [.., d/2, 1] table)
        elif base in ("softmax", "_softmax"):
            t, s_ = (four[0][2], four[0][3]) if four else (0, 0)
            kind = "" if s_ < 2 or t < 1 else "decode" if t == 1 else "eager"
        elif base == "mul":
            pad = len(four) == 2 and four[0][1:3] == (1, 1) and four[1][1] == 1
            kind = "padding" if pad and four[1][3] == 1 and four[1][2] == four[0][3] > 1 else ""
        elif base not in _GEMMS and len(four) >= 2:
            scores, mask = four[0], four[1]
            if base == "where":
                mask, scores = four[0], four[1]
            if mask[1] == 1 and mask[3] == scores[3] and scores[2] > 1:
                kind = "masked" if mask[2] == scores[2] else "eager" if mask[2] == 1 else ""
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
