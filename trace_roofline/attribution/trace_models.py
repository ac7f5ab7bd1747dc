"""Several models in one trace (assisted or speculative decoding, an encoder-decoder): which
model each op instance belongs to, told by the embedding tables its forwards read.

Design notes: docs/design.md ("trace_roofline/attribution/attribute.py").
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from trace_roofline.attribution import kind, naming
from trace_roofline.attribution.nest import Nest
from trace_roofline.attribution.tp import infer_tp
from trace_roofline.model import models, operators
from trace_roofline.model.models import ModelSpec
from trace_roofline.model.operators import Name
from trace_roofline.trace import parse_dims

Found = list[tuple[int, int, bool]]  # per model: (largest V, H, whether an encoder's forward)


def attention_call_kinds(calls: pd.DataFrame) -> np.ndarray:
    """How each attention call attends (kind.attention_calls: `causal`, `decode`, `cross`,
    `bidirectional`, `unknown`), read once per distinct call. `calls`: one row per attention
    op call, its columns the op name, Input Dims and Concrete Inputs in that order (strings or
    categoricals)."""
    if not len(calls):
        return np.zeros(0, dtype=object)
    return naming.per_value(calls, kind.attention_calls).to_numpy(dtype=object)


def embedding_weight(dims: pd.Series) -> pd.DataFrame:
    """(V, H) of an embedding's weight (its first argument: V the vocabulary, H the hidden
    size) per row of Input Dims, read once per distinct value; -1, -1 where it has none."""
    def one(d: object) -> tuple[int, int]:
        w = d[0] if isinstance(d, list) and d else None
        ok = isinstance(w, list) and len(w) == 2 and all(type(x) is int and x > 0 for x in w)
        return (w[0], w[1]) if ok else (-1, -1)  # type: ignore[index]

    def per_distinct(distinct: pd.Series) -> pd.DataFrame:
        return pd.DataFrame([one(d) for d in parse_dims(distinct)], index=distinct.index,
                            columns=["V", "H"], dtype=np.int64)

    if isinstance(dims.dtype, pd.CategoricalDtype):
        dims = dims.cat.remove_unused_categories()  # (per_value reads every category)
    return naming.per_value(dims, per_distinct)


def models_of(inst: pd.DataFrame, ops: pd.DataFrame) -> tuple[pd.DataFrame, Found]:
    """Several models in one trace: each hidden size H of the embedding weights (V, H) is a
    model (one model's tables, of tokens, positions and token types, share its H), and an
    encoder's forward (`_encoder_forwards`) a model apart from the decoder of its H, as
    (largest V, H, encoder), widest first, the decoder before the encoder. An instance belongs
    to the model of the last embedding before it in its group (the group's first one before
    any; model 0 in a group without one), and each model's instances are groups of their own.
    With one model or none, `inst` unchanged and no models."""
    emb = np.flatnonzero(naming.Names.of(ops["name"]).mapped(operators.base_names)
                         .isin([Name.EMBEDDING]))
    vh = embedding_weight(ops["input_dims"].iloc[emb])
    v, h = vh["V"].to_numpy(np.int64), vh["H"].to_numpy(np.int64)
    emb, v, h = emb[h > 0], v[h > 0], h[h > 0]
    enc = _encoder_forwards(ops, emb)
    keys = pd.MultiIndex.from_arrays([-h, enc]).unique().sort_values()  # widest, decoder first
    if len(keys) < 2:
        return inst, []
    code = keys.get_indexer(pd.MultiIndex.from_arrays([-h, enc]))
    vocab = pd.Series(v).groupby(code).max()
    found = [(int(vocab[i]), -int(nh), bool(e)) for i, (nh, e) in enumerate(keys)]
    inside = Nest(ops["s"].to_numpy()[emb], ops["e"].to_numpy()[emb],
                  ops["key"].to_numpy()[emb]).innermost(inst["t"].to_numpy(),
                                                        inst["key"].to_numpy())
    grp = inst["grp"].to_numpy()
    per = pd.Series(np.where(inside >= 0, code[np.maximum(inside, 0)], np.nan)).groupby(grp)
    model = per.ffill().fillna(per.bfill()).fillna(0).to_numpy(np.int64)
    inst = inst.assign(model=model, grp=pd.factorize(grp * len(found) + model)[0])
    return inst.sort_values(["grp", "t"], kind="stable"), found


def _encoder_forwards(ops: pd.DataFrame, emb: np.ndarray) -> np.ndarray:
    """Per embedding call (`emb`, indices into ops): whether its forward (the calls up to the
    next embedding after some attention) is an encoder's: some attention call attends
    bidirectionally and none is causal, decodes or attends across (kind's reading)."""
    attn = np.flatnonzero(ops["attn"].to_numpy(dtype=bool))
    out = np.zeros(len(emb), dtype=bool)
    if not len(attn) or not len(emb):
        return out
    calls = attention_call_kinds(ops.iloc[attn][["name", "input_dims", "concrete_inputs"]])
    start = ops["s"].to_numpy()
    order = np.argsort(start[emb], kind="stable")
    at = np.searchsorted(start[emb][order], start[attn], side="right") - 1
    seen = np.zeros(len(emb) + 1, dtype=np.int64)
    np.add.at(seen, at + 1, 1)  # attention calls after each embedding, before the next
    fwd = np.cumsum(np.r_[True, seen[1:-1] > 0])  # a forward: embeddings with no call between
    ok = at >= 0
    per = pd.DataFrame({"f": fwd[at[ok]], "bi": calls[ok] == "bidirectional",
                        "dec": np.isin(calls[ok], ["causal", "decode", "cross"])})
    g = per.groupby("f")[["bi", "dec"]].any()
    encoder = g["bi"] & ~g["dec"]
    out[order] = encoder.reindex(fwd, fill_value=False).to_numpy(dtype=bool)
    return out


def model_shards(inst: pd.DataFrame, found: Found, model: ModelSpec | None
                 ) -> tuple[pd.DataFrame, list[str], list[ModelSpec | None]]:
    """The models `models_of` found, labelled, each with the spec its GEMMs are named by:
    `model` (as the shard its shapes show) for the one whose GEMMs it explains best, placed
    first; the others none (their linears inferred from their own GEMMs)."""
    labels = [f"{kind.ENCODER_LABEL * e}hidden {h}, vocab {v}" for v, h, e in found]
    shards: list[ModelSpec | None] = [None] * len(found)
    if model is not None:
        best, hits = 0, -1
        for m in range(len(found)):
            rows = (inst["model"].to_numpy() == m) & (inst["K"].to_numpy() >= 0)
            shapes = set(zip(inst["K"].to_numpy()[rows].tolist(),
                             inst["N"].to_numpy()[rows].tolist(), strict=True))
            shard = model.shard(infer_tp(shapes, model))
            n = len(shapes & set(models.expected_linears(shard).values()))
            if n > hits:
                best, hits, shards[0] = m, n, shard
        order = [best, *(m for m in range(len(found)) if m != best)]
        labels = [model.name if i == 0 else labels[m] for i, m in enumerate(order)]
        inst = inst.assign(model=np.argsort(order)[inst["model"].to_numpy()])
    return inst, labels, shards
