"""Naming op instances from the nn.Module frames around them (with_stack=True traces).

Design notes: docs/design.md ("trace_roofline/attribution/naming.py").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from trace_roofline.attribution.naming import Names, Rule, first_match, per_value
from trace_roofline.attribution.nest import Nest
from trace_roofline.model.operators import Name

MODULE_KINDS = {
    "layer": re.compile(r"(?:DecoderLayer|EncoderLayer|TransformerLayer|Block)$"),
    "attn": re.compile(r"Attention$|Attn$|SelfAttention"),
    "mlp": re.compile(r"MLP$|Mlp$|FeedForward$|FFN$"),
    "linear": re.compile(r"Linear$"),
    "norm": re.compile(r"Norm$|RMSNorm|LayerNorm"),
    "rotary": re.compile(r"Rotary"),
    "emb": re.compile(r"Embedding$"),
    "activation": re.compile(r"Activation$|^SiLU$|^GELU$|AndMul$|^Act"),
}
_SPECIFIC_FIRST = ("linear", "rotary", "emb", "norm", "activation", "mlp", "attn", "layer")
# vLLM-style parallel linears name their role in the class
LINEAR_CLASSES = {"QKVParallelLinear": Name.QKV_PROJ, "MergedColumnParallelLinear": Name.GATE_UP_PROJ}
# a module's linears by call order, for its number of linears
_ATTENTION_LINEARS = {4: (Name.Q_PROJ, Name.K_PROJ, Name.V_PROJ, Name.O_PROJ),
                      2: (Name.QKV_PROJ, Name.O_PROJ)}
_MLP_LINEARS = {3: (Name.GATE_PROJ, Name.UP_PROJ, Name.DOWN_PROJ),
                2: (Name.GATE_UP_PROJ, Name.DOWN_PROJ)}
# inside attention but no submodule: what position says, when it is one of these
_BY_POSITION = [Name.Q_NORM, Name.K_NORM, Name.ROPE, Name.KV_CACHE, Name.ATTENTION]


def module_frames(frames: pd.DataFrame) -> pd.DataFrame:
    """nn.Module frames with their class, instance suffix and kind ('' when not recognised)."""
    is_module = per_value(frames["name"], lambda u: u.str.startswith("nn.Module: ").fillna(False))
    m = frames[is_module.to_numpy(dtype=bool)].copy()
    full = m["name"].astype("string").str.slice(len("nn.Module: "))
    parts = full.str.extract(r"^(?P<cls>.*?)(?:_(?P<idx>\d+))?$")
    m["cls"] = parts["cls"].fillna("")
    m["idx"] = pd.to_numeric(parts["idx"], errors="coerce").astype("Int64")
    kind = pd.Series("", index=m.index, dtype="string")
    for k in _SPECIFIC_FIRST:
        hit = (kind == "") & m["cls"].str.contains(MODULE_KINDS[k])
        kind = kind.mask(hit, k)
    m["kind"] = kind
    return m.reset_index(drop=True)


@dataclass(frozen=True)
class _Modules:
    """The module frames of each kind, and per instance the innermost of each around it."""

    frames: dict[str, pd.DataFrame]
    nests: dict[str, Nest]
    around: dict[str, np.ndarray]  # per instance, the index of the innermost frame (-1: none)

    def parent_of(self, child: pd.DataFrame, kind: str) -> np.ndarray:
        """Per frame of `child`, the index of the innermost frame of `kind` around it."""
        return self.nests[kind].innermost(child["s"].to_numpy(), child["key"].to_numpy())

    def pick(self, kind: str, names: Names | str) -> Names:
        """Per instance, the name of the innermost module of `kind` around it ("" if none)."""
        idx = self.around[kind]
        if isinstance(names, str):
            return Names((idx < 0).astype(np.intp), np.asarray([names, ""], dtype=object))
        return Names(np.append(names.codes, len(names.vocab))[idx], np.append(names.vocab, ""))


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
    sub, nests, around = {}, {}, {}
    for kind in MODULE_KINDS:
        f = frames[frames["kind"] == kind].reset_index(drop=True)
        sub[kind] = f
        nests[kind] = Nest(f["s"].to_numpy(), f["e"].to_numpy(), f["key"].to_numpy())
        around[kind] = nests[kind].innermost(inst_t, inst_key)
    mods = _Modules(sub, nests, around)
    pos = Names.of(position)
    by_pos = np.isin(pos.vocab, _BY_POSITION)
    in_attn = Names(np.where(around["attn"] >= 0, pos.codes, len(pos.vocab)),
                    np.append(np.where(by_pos, pos.vocab, Name.ATTENTION), ""))
    # the innermost module of each kind around the instance that names it, most specific first
    candidates = [
        mods.pick("linear", _linear_names(mods)), mods.pick("norm", _norm_names(mods)),
        mods.pick("emb", Name.EMBEDDING), mods.pick("rotary", Name.ROPE),
        mods.pick("activation", Name.ACT),
        in_attn,  # inside attention, no submodule
        mods.pick("mlp", Name.ACT),  # inside the MLP, no Linear
        mods.pick("layer", Name.RESIDUAL),  # inside the layer only
    ]
    name = first_match([(~c.isin([""]), c) for c in candidates], "").categorical()
    li = around["layer"]
    idx = sub["layer"]["idx"].to_numpy(dtype="float64", na_value=np.nan)
    lay = np.where(li >= 0, idx[np.maximum(li, 0)] if len(idx) else np.nan, np.nan)
    layer[:] = pd.array(np.where(np.isnan(lay), pd.NA, lay), dtype="Int64") if n else layer
    return pd.Series(name, index=position.index), layer


def _linear_names(mods: _Modules) -> Names:
    """Per Linear frame, its operator: by its class when it says, else by its call order inside
    its attention or MLP; outside every decoder layer the LM head."""
    lin = mods.frames["linear"].copy()
    if not len(lin):
        return Names(np.zeros(0, np.intp), np.asarray([""], dtype=object))
    pa, pm = mods.parent_of(lin, "attn"), mods.parent_of(lin, "mlp")
    pl = mods.parent_of(lin, "layer")
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
        *((in_a & (size == k), by_order(names)) for k, names in _ATTENTION_LINEARS.items()),
        *((in_mlp & (size == k), by_order(names)) for k, names in _MLP_LINEARS.items()),
        (in_a & last, Name.O_PROJ),
        (in_mlp & last, Name.DOWN_PROJ),
        # a Linear outside every decoder layer (when the model has some) is the LM head
        (~in_a & ~in_m & ~in_l & (len(mods.frames["layer"]) > 0), Name.LM_HEAD),
    ]
    return first_match(rules, "")


def _norm_names(mods: _Modules) -> Names:
    """Per norm frame, its operator: inside attention q's then k's norm; in a layer its 1st
    and 2nd norms; outside every layer the final norm."""
    nrm = mods.frames["norm"]
    if not len(nrm):
        return Names(np.zeros(0, np.intp), np.asarray([""], dtype=object))
    pl, pa = mods.parent_of(nrm, "layer"), mods.parent_of(nrm, "attn")
    start = pd.Series(nrm["s"].to_numpy())
    # the layer's own norms rank among themselves, q/k norms inside attention apart
    rank = start.where(pa < 0).groupby(pl).rank(method="first").to_numpy() - 1
    in_attn = start.groupby(pa).rank(method="first").to_numpy() - 1
    rules: list[Rule] = [
        # inside attention: q's norm, then k's (HF Qwen3 q_norm, k_norm), not layer norms
        ((pa >= 0) & (in_attn == 0), Name.Q_NORM),
        ((pa >= 0) & (in_attn == 1), Name.K_NORM),
        (pa >= 0, ""),
        (pl < 0, Name.FINAL_NORM),  # outside every decoder layer
        (rank == 0, Name.INPUT_NORM),  # a layer's 1st norm
        (rank == 1, Name.POST_ATTENTION_NORM),  # its 2nd
    ]
    return first_match(rules, "")
