"""The ecosystem sweep's oracle: what each op really is (from the HF module tree), and when the
analyzer's name for it contradicts that.

`truth_of(site)` walks `TRUTH_TABLE`, one ordered table of (condition, truth) pairs over a
`Site` (the innermost module enclosing an op: its qualified path, class, siblings, and whether
the model routes experts). `contradiction_kind(...)` walks `CONTRADICTIONS`, one table of rules
(which truths, which names, GEMMs only or any op, dense models only). An unnamed op (`other`,
`unattributed`, `linear[KxN]`) is never a contradiction.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

__all__ = ["CONTRADICTIONS", "ENCODER_FORBIDDEN", "GEMM_OPS", "TRUTH_TABLE", "Rule", "Site",
           "contradictions", "site_of", "truth_of"]


@dataclass(frozen=True)
class Site:
    """The innermost HF module enclosing an op."""

    path: str  # qualified name, '' for the top module
    cls: str  # its class name
    siblings: frozenset[str]  # leaf names of its parent's children
    moe: bool  # the model routes tokens to experts

    @property
    def leaf(self) -> str:
        return self.path.rsplit(".", 1)[-1]

    @property
    def segments(self) -> list[str]:
        return self.path.split(".")

    def under(self, pattern: str) -> bool:
        """Whether a segment above the leaf matches `pattern` (a full-match regex)."""
        return any(re.fullmatch(pattern, s) for s in self.segments[:-1])

    @property
    def in_layer(self) -> bool:
        return any(s.isdigit() for s in self.segments[:-1])


def site_of(path: str, cls: str, children: dict[str, frozenset[str]], moe: bool) -> Site:
    """The Site of module `path` (`children`: each module path's child leaf names)."""
    parent = path.rsplit(".", 1)[0] if "." in path else ""
    if path.endswith(".linear") and parent.endswith("_proj"):  # Moshi's q_proj.linear: the wrapper's
        return site_of(parent, cls, children, moe)
    return Site(path, cls, children.get(parent, frozenset()), moe)


_ATTN = r"(self_)?attn|(self_)?attention|attn_layer|self|selfattention|mixer_attn|linear_attn"
_MLP = (r"mlp|feed_forward|ffn|ff|moe|block_sparse_moe|intermediate|output|mlp_block|"
        r"feedforward|sparse_moe_block")
_Q = r"q_proj|query|q|wq|q_lin|to_q|query_proj|project_q"
_K = r"k_proj|key|k|wk|k_lin|to_k|key_proj|project_k"
_V = r"v_proj|value|v|wv|v_lin|to_v|value_proj|project_v"
_QKV = r"qkv_proj|c_attn|query_key_value|wqkv|w_pack|qkv|in_proj|qkv_lin|query_key_value_proj"
_O = r"o_proj|out_proj|dense|c_proj|wo|o|out|proj|output|out_lin|o_lin|linear|dense_proj|attention_out"
_GATE = r"gate_proj|wi_0|w1"  # w1 only where a w3 sibling makes the MLP gated
_UP = r"up_proj|wi_1|w3"
_GATE_UP = r"gate_up_proj|w13|w1_w3|gate_up|dense_h_to_4h_gated"
_MLP_IN = r"fc1|c_fc|fc_in|dense_h_to_4h|wi|lin1|linear_fc1|up|w_in|in_proj|linear1|dense|" \
          r"up_proj|gate_proj|w1"
_MLP_OUT = r"down_proj|fc2|c_proj|fc_out|dense_4h_to_h|wo|lin2|linear_fc2|down|w2|w_out|" \
           r"out_proj|linear2|dense|output|proj"
_NORM_IN = r"input_layernorm|ln_1|attention_norm|input_norm|attn_norm|ln_attn|norm1|" \
           r"self_attn_layer_norm|pre_attention_layernorm|attention_layernorm|layernorm_before|" \
           r"ln1|pre_norm|norm_1|operator_norm"
_NORM_POST = r"post_attention_layernorm|ln_2|ffn_norm|post_attention_norm|norm2|ln_mlp|" \
             r"final_layer_norm|pre_feedforward_layernorm|layernorm_after|ln2|norm_2|ffn_layernorm"


def _leaf(pattern: str) -> Callable[[Site], bool]:
    rx = re.compile(pattern, re.IGNORECASE)
    return lambda s: bool(rx.fullmatch(s.leaf))


def _cls(pattern: str) -> Callable[[Site], bool]:
    rx = re.compile(pattern)
    return lambda s: bool(rx.search(s.cls))


_in_attn = re.compile(_ATTN, re.IGNORECASE)
_in_mlp = re.compile(_MLP, re.IGNORECASE)


def _attn(s: Site) -> bool:
    return any(_in_attn.fullmatch(p) for p in s.segments[:-1]) or "Attention" in s.cls


def _mlp(s: Site) -> bool:
    return any(_in_mlp.fullmatch(p) for p in s.segments[:-1]) or bool(
        re.search(r"MLP|FeedForward|Moe|MoE|SparseMoe", s.cls))


def _norm(s: Site) -> bool:
    return "Norm" in s.cls or bool(re.search(r"norm$|layernorm", s.leaf, re.IGNORECASE))


# One ordered table: the first condition that holds gives the op's truth.
TRUTH_TABLE: tuple[tuple[Callable[[Site], bool], str], ...] = (
    (lambda s: s.path == "", "model"),
    (_cls(r"Rotary|RoPE|Rope") , "rotary"),
    (lambda s: not s.in_layer and bool(re.fullmatch(
        r"(\w+_)?lm_head|embed_out|output_layer|output|decoder|output_projection|proj_out",
        s.leaf))
        and "Norm" not in s.cls and "Embedding" not in s.cls
        and not s.path.startswith(("model.", "transformer.", "gpt_neox.")), "lm_head"),
    (lambda s: s.path.endswith(("predictions.decoder", "lm_head.decoder")), "lm_head"),
    (_cls(r"Embedding"), "embedding"),
    (lambda s: _norm(s) and not s.in_layer, "final_norm"),
    # the shared expert's sigmoid gate: the layout counts its GEMM in `router`
    # (architecture.py, op="router")
    (lambda s: s.moe and s.leaf == "shared_expert_gate", "shared_gate"),
    (lambda s: s.moe and s.under(r"shared_experts?|shared_mlp|shared_expert_gate") or
     s.leaf in ("shared_expert_gate", "shared_experts", "shared_expert"), "shared"),
    (lambda s: s.moe and (s.under("experts") or s.leaf == "experts"), "experts"),
    (lambda s: s.moe and (bool(re.fullmatch(r"gate|router|gating|router\.layer|layer", s.leaf))
                          and not _attn(s) or bool(re.search(r"Router|TopK|Topk|Gate$", s.cls))),
     "router"),
    (lambda s: _norm(s) and _attn(s) and bool(
        re.match(r"(q|k|qk|query|key)_?(norm|layernorm|ln)", s.leaf)), "qk_norm"),
    (lambda s: _norm(s) and bool(re.fullmatch(_NORM_IN, s.leaf)), "input_norm"),
    (lambda s: _norm(s) and bool(re.fullmatch(_NORM_POST, s.leaf)), "post_attention_norm"),
    (_norm, "norm"),
    (lambda s: _attn(s) and s.leaf == "q_a_proj", "q_a"),
    (lambda s: _attn(s) and s.leaf == "q_b_proj", "q_b"),
    (lambda s: _attn(s) and s.leaf == "kv_a_proj_with_mqa", "kv_a"),
    (lambda s: _attn(s) and s.leaf == "kv_b_proj", "kv_b"),
    (lambda s: _attn(s) and _leaf(_QKV)(s), "qkv"),
    (lambda s: _attn(s) and _leaf(_Q)(s), "q"),
    (lambda s: _attn(s) and _leaf(_K)(s), "k"),
    (lambda s: _attn(s) and _leaf(_V)(s), "v"),
    (lambda s: _attn(s) and _leaf(_O)(s) and "Linear" in s.cls or
     _attn(s) and _leaf(_O)(s) and "Conv1D" in s.cls, "o"),
    (lambda s: s.path.endswith(("attention.output.dense", "attention.output")), "o"),
    (_attn, "attention"),
    (lambda s: s.path.endswith("intermediate.dense"), "mlp_in"),
    (lambda s: s.path.endswith("output.dense") and s.in_layer, "mlp_out"),
    (lambda s: _mlp(s) and _leaf(_GATE_UP)(s), "gate_up"),
    (lambda s: _mlp(s) and _leaf(_GATE)(s) and (s.leaf != "w1" or "w3" in s.siblings), "gate"),
    (lambda s: _mlp(s) and _leaf(_UP)(s) and (s.leaf != "up_proj" or "gate_proj" in s.siblings),
     "up"),
    (lambda s: _mlp(s) and _leaf(_MLP_OUT)(s) and s.leaf not in ("dense",) or
     _mlp(s) and s.leaf == "dense" and "dense_h_to_4h" in s.siblings, "mlp_out"),
    (lambda s: _mlp(s) and _leaf(_MLP_IN)(s), "mlp_in"),
    (_mlp, "mlp"),
    (lambda s: s.in_layer, "layer"),
    (lambda s: True, "other"),
)


def truth_of(site: Site) -> str:
    """The first truth of TRUTH_TABLE whose condition holds for `site`."""
    return next(truth for cond, truth in TRUTH_TABLE if cond(site))


# --- contradictions ---------------------------------------------------------------------------

PROJECTION_NAMES = {  # truth -> the analyzer's linear names that fit it
    "q": {"q_proj"}, "k": {"k_proj"}, "v": {"v_proj"}, "qkv": {"qkv_proj"}, "o": {"o_proj"},
    "q_a": {"q_a_proj"}, "q_b": {"q_b_proj"}, "kv_a": {"kv_a_proj_with_mqa"},
    "kv_b": {"kv_b_proj"}, "gate": {"gate_proj"}, "up": {"up_proj"},
    "gate_up": {"gate_up_proj"}, "mlp_in": {"gate_proj", "up_proj", "gate_up_proj"},
    "mlp_out": {"down_proj"}, "lm_head": {"lm_head"}, "router": {"router"},
    "shared_gate": {"router"},
    "embedding": set(), "attention": set(), "rotary": set(), "qk_norm": set(),
    "input_norm": set(), "post_attention_norm": set(), "final_norm": set(), "norm": set(),
    "experts": {"experts_gate_up", "experts_down"},
    "shared": {"shared_gate_proj", "shared_up_proj", "shared_gate_up_proj", "shared_down_proj"},
}
LINEAR_NAMES = frozenset(
    {"q_proj", "k_proj", "v_proj", "qkv_proj", "kv_proj", "o_proj", "gate_proj", "up_proj",
     "gate_up_proj", "down_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
     "lm_head", "router", "experts_gate_up", "experts_down", "shared_gate_proj",
     "shared_up_proj", "shared_gate_up_proj", "shared_down_proj"})
ATTENTION_TRUTHS = frozenset({"q", "k", "v", "qkv", "o", "q_a", "q_b", "kv_a", "kv_b",
                              "attention", "qk_norm"})
MLP_TRUTHS = frozenset({"gate", "up", "gate_up", "mlp_in", "mlp_out", "mlp", "experts",
                        "shared", "shared_gate", "router"})
MLP_NAMES = frozenset({"gate_proj", "up_proj", "gate_up_proj", "down_proj", "act"})
ATTENTION_NAMES = frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj", "kv_proj", "o_proj",
                             "attention", "rope", "kv_cache", "q_norm", "k_norm", "q_a_proj",
                             "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "q_a_layernorm",
                             "kv_a_layernorm"})
NON_GEMM_NAMES = frozenset({"input_norm", "post_attention_norm", "final_norm", "embedding_norm", "q_norm",
                            "k_norm", "pre_feedforward_norm", "post_feedforward_norm",
                            "q_a_layernorm", "kv_a_layernorm", "residual", "rope", "loss", "act",
                            "experts_act", "sampling", "embedding"})
EXPERT_NAMES = frozenset({"router", "experts_gate_up", "experts_down", "experts_act",
                          "moe_dispatch", "moe_combine", "shared_gate_proj", "shared_up_proj",
                          "shared_gate_up_proj", "shared_down_proj"})
SHARED_NAMES = frozenset(n for n in EXPERT_NAMES if n.startswith("shared_"))
ROUTED_NAMES = frozenset({"experts_gate_up", "experts_down", "experts_act"})
LAYER_NORMS = frozenset({"input_norm", "post_attention_norm", "pre_feedforward_norm",
                         "post_feedforward_norm"})
NORM_TRUTHS = frozenset({"input_norm", "post_attention_norm", "norm", "final_norm", "qk_norm"})
ENCODER_FORBIDDEN = frozenset({"lm_head", "kv_cache", "sampling", "loss"})
GEMM_OPS = re.compile(r"^(aten::)?(mm|addmm|matmul|bmm|baddbmm|linear|_grouped_mm|addbmm)$")
_KNOWN = frozenset(PROJECTION_NAMES)


@dataclass(frozen=True)
class Rule:
    """A contradiction: `names` on an op whose truth is in `truths` (None: any truth but those
    in `except_truths`), on GEMMs only if `gemm`, on dense models only if `dense`; a truth's
    fitting projection names (PROJECTION_NAMES) never contradict when `fits` is set."""

    kind: str
    names: frozenset[str]
    truths: frozenset[str] | None = None
    except_truths: frozenset[str] = frozenset()
    gemm: bool = False
    dense: bool = False
    fits: bool = False


# One table; an op is contradicted by the first rule that holds (its kind is reported).
CONTRADICTIONS: tuple[Rule, ...] = (
    Rule("expert name on a dense model", EXPERT_NAMES, dense=True),
    Rule("routed vs shared swapped", SHARED_NAMES, frozenset({"experts"})),
    Rule("routed vs shared swapped", ROUTED_NAMES, frozenset({"shared"})),
    Rule("lm_head on another op", frozenset({"lm_head"}), except_truths=frozenset({"lm_head"})),
    Rule("another projection's name", LINEAR_NAMES, _KNOWN, fits=True),
    Rule("MLP name inside attention", MLP_NAMES, ATTENTION_TRUTHS),
    Rule("attention name inside the MLP", ATTENTION_NAMES, MLP_TRUTHS),
    Rule("GEMM named as a non-GEMM operator", NON_GEMM_NAMES, gemm=True,
         except_truths=frozenset({"rotary", "embedding"})),
    Rule("q/k norm name on another norm", frozenset({"q_norm", "k_norm"}),
         NORM_TRUTHS - {"qk_norm"}),
    Rule("final norm vs layer norm", frozenset({"final_norm", "embedding_norm"}),
         frozenset({"input_norm", "post_attention_norm", "norm", "qk_norm"})),
    Rule("final norm vs layer norm", LAYER_NORMS, frozenset({"final_norm"})),
)


def contradictions(truth: pd.Series, name: pd.Series, op_name: pd.Series, moe: bool,
                   rules: tuple[Rule, ...] = CONTRADICTIONS) -> pd.Series:
    """Per op, the kind of the first rule its (truth, name) pair breaks, or <NA>."""
    truth, name = truth.astype(str).to_numpy(), name.astype(str).to_numpy()
    gemm = op_name.astype(str).str.match(GEMM_OPS.pattern).to_numpy()
    fitting = np.array([n in PROJECTION_NAMES.get(t, ()) for t, n in zip(truth, name, strict=True)],
                       dtype=bool)
    kind = np.full(len(truth), None, dtype=object)
    for rule in rules:
        hit = np.isin(name, list(rule.names)) & ~np.isin(truth, list(rule.except_truths))
        if rule.truths is not None:
            hit &= np.isin(truth, list(rule.truths))
        if rule.gemm:
            hit &= gemm
        if rule.dense:
            hit &= not moe
        if rule.fits:
            hit &= ~fitting
        kind = np.where(hit & (kind == None), rule.kind, kind)  # noqa: E711
    return pd.Series(kind, index=op_name.index, dtype="string")
