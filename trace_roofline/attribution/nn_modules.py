"""Naming op instances from the nn.Module frames around them (with_stack=True traces).

Design notes: docs/design.md ("trace_roofline/attribution/nn_modules.py").
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from trace_roofline.attribution.naming import Names, Rule, first_match, per_value
from trace_roofline.attribution.nest import Nest

MODULE_KINDS = {
    "layer": re.compile(r"(?:DecoderLayer|EncoderLayer|TransformerLayer|Block)$"),
    "attn": re.compile(r"Attention$|Attn$|SelfAttention"),
    "mlp": re.compile(r"MLP$|Mlp$|FeedForward$|FFN$"),
    "linear": re.compile(r"Linear$"),
    "norm": re.compile(r"Norm$|RMSNorm|LayerNorm"),
    "rope": re.compile(r"Rotary"),
    "emb": re.compile(r"Embedding$"),
    "act": re.compile(r"Activation$|^SiLU$|^GELU$|AndMul$|^Act"),
}
# vLLM-style parallel linears name their role in the class
LINEAR_CLASSES = {"QKVParallelLinear": "qkv_proj", "MergedColumnParallelLinear": "gate_up_proj"}


def module_frames(frames: pd.DataFrame) -> pd.DataFrame:
    """nn.Module frames with their class, instance suffix and kind ('' when not recognised)."""
    is_module = per_value(frames["name"], lambda u: u.str.startswith("nn.Module: ").fillna(False))
    m = frames[is_module.to_numpy(dtype=bool)].copy()
    full = m["name"].astype("string").str.slice(len("nn.Module: "))
    parts = full.str.extract(r"^(?P<cls>.*?)(?:_(?P<idx>\d+))?$")
    m["cls"] = parts["cls"].fillna("")
    m["idx"] = pd.to_numeric(parts["idx"], errors="coerce").astype("Int64")
    kind = pd.Series("", index=m.index, dtype="string")
    for k in ("linear", "rope", "emb", "norm", "act", "mlp", "attn", "layer"):  # specific first
        hit = (kind == "") & m["cls"].str.contains(MODULE_KINDS[k])
        kind = kind.mask(hit, k)
    m["kind"] = kind
    return m.reset_index(drop=True)


def module_names(inst_t: np.ndarray, inst_key: np.ndarray, frames: pd.DataFrame,
                 position: pd.Series) -> tuple[pd.Series, pd.Series]:
    """Operator name (categorical, missing where no module names it) and layer of each instance
    from the nn.Module frames around it.

    `frames` is module_frames() plus int columns s, e (ns) and key. Linears are named by their
    HF class when it says (QKVParallelLinear) or else by call order inside their parent:
    attention q,k,v,o (or qkv,o), MLP gate,up,down (or gate_up,down); a Linear outside every
    decoder layer is lm_head. Norms: 1st in a layer input_norm, 2nd post_attention_norm,
    outside layers final_norm; inside attention the 1st q_norm, the 2nd k_norm. Inside
    attention but no submodule: q/k norm / RoPE / KV cache / attention from `position`; inside
    the MLP: act; inside the layer only: residual.
    Layer = the instance suffix of the enclosing decoder-layer frame (Qwen2DecoderLayer_3 -> 3).
    """
    n = len(inst_t)
    layer = pd.Series(pd.NA, index=position.index, dtype="Int64")
    if frames.empty or n == 0:
        return pd.Series(pd.Categorical.from_codes(np.full(n, -1), []), index=position.index), layer
    sub, hit = {}, {}
    for kind in ("layer", "attn", "mlp", "linear", "norm", "rope", "emb", "act"):
        f = frames[frames["kind"] == kind].reset_index(drop=True)
        sub[kind] = f
        nest = Nest(f["s"].to_numpy(), f["e"].to_numpy(), f["key"].to_numpy())
        hit[kind] = (nest, nest.innermost(inst_t, inst_key))

    def parent_of(child: pd.DataFrame, kind: str) -> np.ndarray:
        return hit[kind][0].innermost(child["s"].to_numpy(), child["key"].to_numpy())

    lin = sub["linear"].copy()
    lin_name = Names(np.zeros(len(lin), np.intp), np.asarray([""], dtype=object))
    if len(lin):
        pa, pm, pl = parent_of(lin, "attn"), parent_of(lin, "mlp"), parent_of(lin, "layer")
        parent = np.where(pa >= 0, pa, np.where(pm >= 0, 10**12 + pm, -1))
        lin["_parent"], lin["_order"] = parent, lin["s"]
        srt = lin.sort_values(["_parent", "_order"])
        rank = srt.groupby("_parent").cumcount().reindex(lin.index).to_numpy()
        size = lin.groupby("_parent")["s"].transform("size").to_numpy()
        in_a, in_m, in_l = pa >= 0, pm >= 0, pl >= 0
        in_mlp = in_m & ~in_a

        def by_order(names: tuple[str, ...]) -> Names:
            return Names(np.minimum(rank, len(names) - 1), np.asarray(names, dtype=object))

        cls = Names.of(lin["cls"])
        last = rank == size - 1  # other sizes: only the output projection is sure
        rules: list[Rule] = [
            (cls.isin(LINEAR_CLASSES), cls.renamed(LINEAR_CLASSES)),  # the class says its role
            # by call order inside the parent, for the parent's number of linears
            (in_a & (size == 4), by_order(("q_proj", "k_proj", "v_proj", "o_proj"))),
            (in_a & (size == 2), by_order(("qkv_proj", "o_proj"))),
            (in_mlp & (size == 3), by_order(("gate_proj", "up_proj", "down_proj"))),
            (in_mlp & (size == 2), by_order(("gate_up_proj", "down_proj"))),
            (in_a & last, "o_proj"),
            (in_mlp & last, "down_proj"),
            # a Linear outside every decoder layer (when the model has some) is the LM head
            (~in_a & ~in_m & ~in_l & (len(sub["layer"]) > 0), "lm_head"),
        ]
        lin_name = first_match(rules, "")
    nrm = sub["norm"]
    nrm_name = Names(np.zeros(len(nrm), np.intp), np.asarray([""], dtype=object))
    if len(nrm):
        pl, pa = parent_of(nrm, "layer"), parent_of(nrm, "attn")
        start = pd.Series(nrm["s"].to_numpy())
        # the layer's own norms rank among themselves, q/k norms inside attention apart
        rank = start.where(pa < 0).groupby(pl).rank(method="first").to_numpy() - 1
        in_attn = start.groupby(pa).rank(method="first").to_numpy() - 1
        rules = [
            # inside attention: q's norm, then k's (HF Qwen3 q_norm, k_norm), not layer norms
            ((pa >= 0) & (in_attn == 0), "q_norm"),
            ((pa >= 0) & (in_attn == 1), "k_norm"),
            (pa >= 0, ""),
            (pl < 0, "final_norm"),  # outside every decoder layer
            (rank == 0, "input_norm"),  # a layer's 1st norm
            (rank == 1, "post_attention_norm"),  # its 2nd
        ]
        nrm_name = first_match(rules, "")

    def pick(kind: str, names: Names | str) -> Names:
        """Per instance, the name of the innermost module of `kind` around it ("" if none)."""
        idx = hit[kind][1]
        if isinstance(names, str):
            return Names((idx < 0).astype(np.intp), np.asarray([names, ""], dtype=object))
        return Names(np.append(names.codes, len(names.vocab))[idx], np.append(names.vocab, ""))

    pos = Names.of(position)
    by_pos = np.isin(pos.vocab, ["q_norm", "k_norm", "rope", "kv_cache", "attention"])
    in_attn = Names(np.where(hit["attn"][1] >= 0, pos.codes, len(pos.vocab)),
                    np.append(np.where(by_pos, pos.vocab, "attention"), ""))
    # the innermost module of each kind around the instance that names it, most specific first
    candidates = [
        pick("linear", lin_name), pick("norm", nrm_name), pick("emb", "embedding"),
        pick("rope", "rope"), pick("act", "act"),
        in_attn,  # inside attention, no submodule
        pick("mlp", "act"),  # inside the MLP, no Linear
        pick("layer", "residual"),  # inside the layer only
    ]
    name = first_match([(~c.isin([""]), c) for c in candidates], "").categorical()
    li = hit["layer"][1]
    idx = sub["layer"]["idx"].to_numpy(dtype="float64", na_value=np.nan)
    lay = np.where(li >= 0, idx[np.maximum(li, 0)] if len(idx) else np.nan, np.nan)
    layer[:] = pd.array(np.where(np.isnan(lay), pd.NA, lay), dtype="Int64") if n else layer
    return pd.Series(name, index=position.index), layer
