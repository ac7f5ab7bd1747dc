"""The decoder families: one `Family` entry per HF model type, and `from_hf_config`.

A family is data: its layer layout (HF module paths, q/k norm scope), norm placement and the
knobs the one generic reader (`read_decoder`) applies to a config's own fields. A config of a
model type no entry names is read by the same reader from its fields, as a Llama-style layer,
and says so (Architecture.assumed). DeepSeek's latent attention and gpt-oss's experts adjust
that reading (`Family.adjust`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from trace_roofline.errors import InputError
from trace_roofline.model.architecture import (
    PARALLEL,
    PARALLEL_ONE_NORM,
    POST,
    POST_LN,
    PRE,
    PRE_EMBEDDING_NORM,
    ROTARY,
    SANDWICH,
    SHARED_EXPERT_GATE,
    Architecture,
    Attention,
    Layout,
    Mlp,
    Moe,
    NormKind,
    Placement,
    Position,
)
from trace_roofline.model.config_reader import Config
from trace_roofline.model.operators import Name

BiasRule = Literal["qkv", "never", "always"]
GEOMETRY = ("hidden_size", "num_attention_heads", "num_hidden_layers")  # fields every reading needs


# ----------------------------------------------------------------------------- sliding windows
def _none(c: Config) -> Callable[[int], bool]:
    return lambda i: False


def _every_layer(c: Config) -> Callable[[int], bool]:
    return lambda i: True


def _even_layers(c: Config) -> Callable[[int], bool]:
    return lambda i: i % 2 == 0


def _qwen2(c: Config) -> Callable[[int], bool]:
    """Qwen2's rule: sliding from layer max_window_layers on, when use_sliding_window."""
    start, use = c.integer("max_window_layers", 0), c.flag("use_sliding_window", False)
    return lambda i: use and i >= start


def _gemma(c: Config) -> Callable[[int], bool]:
    """Gemma 2: alternate layers; Gemma 3: five of every sliding_window_pattern (6)."""
    if c.model_type == "gemma2":
        return _even_layers(c)
    pattern = c.integer("sliding_window_pattern", c.integer("_sliding_window_pattern", 6))
    return lambda i: (i + 1) % max(pattern, 1) != 0


# The layers a family's `sliding_window` applies to where the config lists no `layer_types`
WINDOW_RULES: dict[str, Callable[[Config], Callable[[int], bool]]] = {
    "none": _none, "every": _every_layer, "even": _even_layers, "qwen2": _qwen2, "gemma": _gemma}


# ----------------------------------------------------------------------------- the entry
@dataclass(frozen=True)
class Family:
    """One model type: its layer layout and what the generic reader must know beyond the
    config's fields.

    layout: HF module paths (and storage, q/k norm scope); placement: the norm placement, or
    `parallel_switch` (config field, its default, the placement when true); norm: its kind
    (None: told by which eps field the config has); norm_bias: a LayerNorm's bias;
    qk_norm_always: q/k norms no config field announces (Qwen3, OLMo2); norm_topk_prob: the
    top-k routing weights renormalised when the config does not say (None: where it counts
    its experts as Mixtral does, `num_local_experts`); bias_default: q/k/v
    bias when no field says; out_bias / mlp_bias: o_proj's / the MLP's bias `qkv` (as
    q/k/v), `never`, `always` (mlp_bias None: the config's `mlp_bias`); gated: a gated MLP;
    activation: its default; windows: WINDOW_RULES key; sqrt_embedding_scale: embeddings
    scaled by sqrt(H) (Gemma); position: rope or learned; tie_default: tied lm_head when the
    config does not say; classes: HF `architectures` names; required: fields beyond the
    geometry; text_config: the decoder is the config's `text_config` (Gemma 3); adjust: a
    reading the generic one cannot express (MLA, gpt-oss experts)."""

    layout: Layout
    placement: Placement = PRE
    parallel_switch: tuple[str, bool, Placement] | None = None
    norm: NormKind | None = "rmsnorm"
    norm_bias: bool = True
    qk_norm_always: bool = False
    norm_topk_prob: bool | None = None
    bias_default: bool = False
    out_bias: BiasRule = "qkv"
    mlp_bias: BiasRule | None = None
    gated: bool = True
    activation: str = "silu"
    windows: str = "none"
    sqrt_embedding_scale: bool = False
    position: Position = ROTARY
    tie_default: bool = False
    classes: tuple[str, ...] = ()
    required: tuple[str, ...] = ()
    text_config: bool = False
    adjust: Callable[[Config, Architecture], Architecture] | None = None


def _bias(rule: BiasRule, qkv: bool) -> bool:
    return {"qkv": qkv, "never": False, "always": True}[rule]


# ----------------------------------------------------------------------------- the reader
def read_decoder(c: Config, f: Family, family: str) -> Architecture:
    """A decoder from the config's fields, as family `f` lays it out."""
    c.need(*GEOMETRY, *f.required)
    h, nq, layers = c.integer("hidden_size"), c.integer("num_attention_heads"), c.integer("num_hidden_layers")
    nkv = c.integer("num_key_value_heads", nq)
    if nq % nkv:
        raise c.error(f"num_key_value_heads {nkv} does not divide num_attention_heads {nq}")
    if not c.has("head_dim") and h % nq:
        raise c.error(f"hidden_size {h} is not a multiple of num_attention_heads {nq} "
                      "(and no head_dim)")
    d = c.integer("head_dim", h // nq)
    bias = c.flag("attention_bias", f.bias_default)
    qpas = c.maybe("query_pre_attn_scalar")
    if qpas is not None and qpas <= 0:
        raise c.error(f"query_pre_attn_scalar must be positive, got {qpas}")
    scale = qpas ** -0.5 if qpas else c.maybe("attention_multiplier")
    att = Attention(nq, nkv, d, d, bias=bias, out_bias=_bias(f.out_bias, bias),
                    qk_norm=f.qk_norm_always or c.flag("qk_norm", False),
                    windows=c.windows(layers, WINDOW_RULES[f.windows](c)),
                    softcap=c.maybe("attn_logit_softcapping"), scale=scale,
                    rope_dim=int(d * c.rotary_fraction()) if f.position == ROTARY else 0)
    if not c.has("intermediate_size"):
        c.assume("intermediate_size absent: 4·hidden_size")
    mlp_bias = (c.flag("mlp_bias", False) if f.mlp_bias is None else _bias(f.mlp_bias, bias))
    mlp = Mlp(c.integer("intermediate_size", 4 * h), gated=f.gated, bias=mlp_bias,
              activation=c.text("hidden_act", f.activation))
    placement = f.placement
    if f.parallel_switch is not None:
        key, default, parallel = f.parallel_switch
        placement = parallel if c.flag(key, default) else placement
    norm = f.norm or _guess_norm(c)
    eps_keys = ("rms_norm_eps", "layer_norm_eps")[::1 if norm == "rmsnorm" else -1]
    eps = c.number(eps_keys[0], c.number(eps_keys[1], 1e-6 if norm == "rmsnorm" else 1e-5))
    embedding_scale = (math.sqrt(h) if f.sqrt_embedding_scale
                       else c.number("embedding_multiplier", 1.0))
    arch = Architecture(
        family, c.name(), h, layers, c.integer("vocab_size", 0), att, mlp, layout=f.layout,
        moe=_experts(c, f), decoder_sparse_step=c.integer("decoder_sparse_step", 1),
        mlp_only_layers=c.ints("mlp_only_layers"), norm=norm, norm_bias=f.norm_bias,
        norm_eps=eps, placement=placement, position=f.position,
        rope_theta=c.rope_theta(), max_positions=c.integer("max_position_embeddings", 0),
        tie_word_embeddings=c.flag("tie_word_embeddings", f.tie_default),
        embedding_scale=embedding_scale, final_softcap=c.maybe("final_logit_softcapping"),
        precision=c.precision())
    arch = f.adjust(c, arch) if f.adjust else arch
    return dataclasses.replace(arch, assumed=tuple(c.assumed))


def _guess_norm(c: Config) -> NormKind:
    """A family that does not say: LayerNorm where the config has a LayerNorm epsilon and no
    RMSNorm one, else RMSNorm (said)."""
    if c.has("layer_norm_eps") and not c.has("rms_norm_eps"):
        c.assume(f"norm kind guessed from {c.lookup('layer_norm_eps')[0]}: LayerNorm")
        return "layernorm"
    if not c.has("rms_norm_eps"):
        c.assume("no norm epsilon field: RMSNorm assumed")
    return "rmsnorm"


def _experts(c: Config, f: Family) -> Moe | None:
    """Routed experts (`num_experts` of `moe_intermediate_size`, else of `intermediate_size`)
    and a shared MLP (`shared_expert_intermediate_size`: with a sigmoid gate, Qwen-MoE;
    `n_shared_experts` experts as one MLP, DeepSeek); None without experts."""
    if not c.has("num_experts"):
        return None
    inter = c.integer("moe_intermediate_size", c.integer("intermediate_size", 0) or None)
    gated_shared = c.integer("shared_expert_intermediate_size", 0)
    shared = gated_shared or c.integer("n_shared_experts", 0) * inter
    renormalise = f.norm_topk_prob if f.norm_topk_prob is not None else "num_local_experts" in c.cfg
    if f.norm_topk_prob is None and not c.has("norm_topk_prob"):
        c.assume(f"norm_topk_prob absent: top-k routing weights {'' if renormalise else 'not '}"
                 "renormalised")
    return Moe(c.experts(inter, shared, shared_gate=gated_shared > 0, norm_default=renormalise))


# transformers/models/deepseek_v2/modeling_deepseek_v2.py, deepseek_v3/modeling_deepseek_v3.py
def _deepseek(c: Config, arch: Architecture) -> Architecture:
    """DeepSeek-V2 / V3: multi-head latent attention (the saved `head_dim` is the RoPE part,
    not the head size), the first first_k_dense_replace layers dense (then every
    moe_layer_freq-th sparse)."""
    rope = c.integer("qk_rope_head_dim")
    q_lora = c.integer("q_lora_rank", 0) or None
    att = dataclasses.replace(
        arch.attention, num_kv_heads=arch.attention.num_heads,
        head_dim=c.integer("qk_nope_head_dim") + rope, v_head_dim=c.integer("v_head_dim"),
        out_bias=arch.attention.bias, qk_norm=False, rope_dim=rope, q_lora_rank=q_lora,
        kv_lora_rank=c.integer("kv_lora_rank"), windows=(None,) * arch.num_layers)
    return dataclasses.replace(
        arch, attention=att, decoder_sparse_step=c.integer("moe_layer_freq", 1),
        sparse_phase=0, mlp_only_layers=tuple(range(c.integer("first_k_dense_replace", 0))))


# transformers/models/gpt_oss/modeling_gpt_oss.py
def _gpt_oss(c: Config, arch: Architecture) -> Architecture:
    """gpt-oss: attention sinks, every layer sparse (router and experts [E, H, 2I] with
    biases, SwiGLU clamped to swiglu_limit, MXFP4 experts), no dense MLP."""
    assert arch.moe is not None
    moe = dataclasses.replace(arch.moe, activation="swiglu_clamped", router_bias=True,
                              expert_bias=True, swiglu_limit=c.number("swiglu_limit", 7.0))
    return dataclasses.replace(arch, attention=dataclasses.replace(arch.attention, sinks=True),
                               mlp=None, moe=moe)


# transformers/models/llama4/modeling_llama4.py
def _llama4(c: Config, arch: Architecture) -> Architecture:
    """Llama 4: a shared expert as wide as a routed one in every MoE layer (`moe_layers`, else
    every interleave_moe_layer_step-th), the dense layers' MLP of intermediate_size_mlp."""
    assert arch.moe is not None and arch.mlp is not None
    experts = arch.moe.experts
    moe = dataclasses.replace(arch.moe, experts=dataclasses.replace(
        experts, shared_intermediate_size=experts.intermediate_size))
    mlp = dataclasses.replace(arch.mlp, intermediate_size=c.integer(
        "intermediate_size_mlp", arch.mlp.intermediate_size))
    sparse = set(c.ints("moe_layers")) or {
        i for i in range(arch.num_layers)
        if (i + 1) % max(c.integer("interleave_moe_layer_step", 1), 1) == 0}
    dense = tuple(i for i in range(arch.num_layers) if i not in sparse)
    return dataclasses.replace(arch, moe=moe, mlp=mlp, mlp_only_layers=dense)


# ----------------------------------------------------------------------------- module tables
_ATTN = {Name.INPUT_NORM: "input_layernorm", Name.Q_PROJ: "self_attn.q_proj", Name.K_PROJ: "self_attn.k_proj",
         Name.V_PROJ: "self_attn.v_proj", Name.Q_NORM: "self_attn.q_norm", Name.K_NORM: "self_attn.k_norm",
         Name.ATTENTION: "self_attn", Name.O_PROJ: "self_attn.o_proj",
         Name.POST_ATTENTION_NORM: "post_attention_layernorm"}
_MLP = {Name.GATE_PROJ: "mlp.gate_proj", Name.UP_PROJ: "mlp.up_proj", Name.ACT: "mlp.act_fn",
        Name.DOWN_PROJ: "mlp.down_proj"}
_MOE = {Name.ROUTER: "mlp.gate", "experts": "mlp.experts",
        Name.SHARED_GATE_PROJ: "mlp.shared_expert.gate_proj",
        Name.SHARED_UP_PROJ: "mlp.shared_expert.up_proj",
        Name.SHARED_DOWN_PROJ: "mlp.shared_expert.down_proj",
        SHARED_EXPERT_GATE: "mlp.shared_expert_gate"}
_FFN_NORMS = {Name.PRE_FEEDFORWARD_NORM: "pre_feedforward_layernorm",
              Name.POST_FEEDFORWARD_NORM: "post_feedforward_layernorm"}
LLAMA = Layout.of({**_ATTN, **_MLP, **_MOE})
QK_PROJECTION = Layout.of({**_ATTN, **_MLP, **_MOE, **_FFN_NORMS}, qk_norm="projection")
PHI3 = Layout.of({**{k: v for k, v in _ATTN.items() if k not in (Name.Q_PROJ, Name.K_PROJ, Name.V_PROJ)},
               Name.QKV_PROJ: "self_attn.qkv_proj", Name.GATE_UP_PROJ: "mlp.gate_up_proj",
               Name.ACT: "mlp.activation_fn", Name.DOWN_PROJ: "mlp.down_proj"})
GEMMA = Layout.of({**_ATTN, **_MLP, **_FFN_NORMS})
_GLM = {**_ATTN, Name.GATE_UP_PROJ: "mlp.gate_up_proj", Name.ACT: "mlp.activation_fn",
        Name.DOWN_PROJ: "mlp.down_proj"}
GLM = Layout.of(_GLM)
# GLM-4's sandwich: post_self_attn_layernorm after attention, post_attention_layernorm before the MLP
GLM4 = Layout.of({**_GLM, Name.POST_ATTENTION_NORM: "post_self_attn_layernorm",
               Name.PRE_FEEDFORWARD_NORM: "post_attention_layernorm",
               Name.POST_FEEDFORWARD_NORM: "post_mlp_layernorm"})
_C_FC = {Name.UP_PROJ: "mlp.c_fc", Name.ACT: "mlp.act", Name.DOWN_PROJ: "mlp.c_proj"}
GPT2 = Layout.of({Name.INPUT_NORM: "ln_1", Name.QKV_PROJ: "attn.c_attn", Name.ATTENTION: "attn",
               Name.O_PROJ: "attn.c_proj", Name.POST_ATTENTION_NORM: "ln_2", **_C_FC},
              transposed=(Name.QKV_PROJ, Name.O_PROJ, Name.UP_PROJ, Name.DOWN_PROJ))
STARCODER2 = Layout.of({**_ATTN, **_C_FC})
PHI = Layout.of({**_ATTN, Name.Q_NORM: "self_attn.q_layernorm", Name.K_NORM: "self_attn.k_layernorm",
              Name.O_PROJ: "self_attn.dense", Name.UP_PROJ: "mlp.fc1", Name.ACT: "mlp.activation_fn",
              Name.DOWN_PROJ: "mlp.fc2"})
GPT_NEOX = Layout.of({Name.INPUT_NORM: "input_layernorm", Name.QKV_PROJ: "attention.query_key_value",
                   Name.ATTENTION: "attention", Name.O_PROJ: "attention.dense",
                   Name.POST_ATTENTION_NORM: "post_attention_layernorm", Name.UP_PROJ: "mlp.dense_h_to_4h",
                   Name.ACT: "mlp.act", Name.DOWN_PROJ: "mlp.dense_4h_to_h"})
DEEPSEEK = Layout.of({
    **_ATTN, **_MLP, **{k: v for k, v in _MOE.items() if k.startswith((Name.ROUTER, "experts"))},
    Name.Q_A_PROJ: "self_attn.q_a_proj", Name.Q_A_LAYERNORM: "self_attn.q_a_layernorm",
    Name.Q_B_PROJ: "self_attn.q_b_proj", Name.KV_A_PROJ_WITH_MQA: "self_attn.kv_a_proj_with_mqa",
    Name.KV_A_LAYERNORM: "self_attn.kv_a_layernorm", Name.KV_B_PROJ: "self_attn.kv_b_proj",
    Name.SHARED_GATE_PROJ: "mlp.shared_experts.gate_proj",
    Name.SHARED_UP_PROJ: "mlp.shared_experts.up_proj",
    Name.SHARED_DOWN_PROJ: "mlp.shared_experts.down_proj"})
GPT_OSS = Layout.of({**_ATTN, Name.ROUTER: "mlp.router", "experts": "mlp.experts"},
                 transposed=(Name.EXPERTS_GATE_UP, Name.EXPERTS_DOWN))
# BERT's layer (its causal LM: BertLMHeadModel, RobertaForCausalLM, ... with is_decoder)
BERT = Layout.of({Name.Q_PROJ: "attention.self.query", Name.K_PROJ: "attention.self.key",
                  Name.V_PROJ: "attention.self.value", Name.ATTENTION: "attention.self",
                  Name.O_PROJ: "attention.output.dense",
                  Name.POST_ATTENTION_NORM: "attention.output.LayerNorm",
                  Name.UP_PROJ: "intermediate.dense", Name.ACT: "intermediate.intermediate_act_fn",
                  Name.DOWN_PROJ: "output.dense", Name.POST_FEEDFORWARD_NORM: "output.LayerNorm"})
# RoBERTa-PreLayerNorm: BERT's modules, each block's norm before it
BERT_PRE = Layout.of({**{k: v for k, v in BERT.module.items() if not k.endswith("_norm")},
                      Name.INPUT_NORM: "attention.LayerNorm",
                      Name.POST_ATTENTION_NORM: "intermediate.LayerNorm"})
# the decoder layer of BART and its kin (their ForCausalLM: the decoder alone)
_BART_ATTN = {Name.Q_PROJ: "self_attn.q_proj", Name.K_PROJ: "self_attn.k_proj",
              Name.V_PROJ: "self_attn.v_proj", Name.ATTENTION: "self_attn", Name.O_PROJ: "self_attn.out_proj",
              Name.UP_PROJ: "fc1", Name.ACT: "activation_fn", Name.DOWN_PROJ: "fc2"}
BART = Layout.of({**_BART_ATTN, Name.POST_ATTENTION_NORM: "self_attn_layer_norm",
                  Name.POST_FEEDFORWARD_NORM: "final_layer_norm"})
BART_PRE = Layout.of({**_BART_ATTN, Name.INPUT_NORM: "self_attn_layer_norm",
                      Name.POST_ATTENTION_NORM: "final_layer_norm"})
BLOOM = Layout.of({Name.INPUT_NORM: "input_layernorm", Name.QKV_PROJ: "self_attention.query_key_value",
                   Name.ATTENTION: "self_attention", Name.O_PROJ: "self_attention.dense",
                   Name.POST_ATTENTION_NORM: "post_attention_layernorm",
                   Name.UP_PROJ: "mlp.dense_h_to_4h", Name.ACT: "mlp.gelu_impl",
                   Name.DOWN_PROJ: "mlp.dense_4h_to_h"})
HYPERCLOVAX = Layout.of({**_ATTN, **_MLP, Name.POST_ATTENTION_NORM: "post_norm1",
                         Name.PRE_FEEDFORWARD_NORM: "post_attention_layernorm",
                         Name.POST_FEEDFORWARD_NORM: "post_norm2"})
AFMOE = Layout.of({**_ATTN, **_MLP, **_MOE, Name.PRE_FEEDFORWARD_NORM: "pre_mlp_layernorm",
                   Name.POST_FEEDFORWARD_NORM: "post_mlp_layernorm"})
_FEED_FORWARD = {Name.GATE_PROJ: "feed_forward.gate_proj", Name.UP_PROJ: "feed_forward.up_proj",
                 Name.ACT: "feed_forward.activation_fn",
                 Name.DOWN_PROJ: "feed_forward.down_proj", Name.ROUTER: "feed_forward.router",
                 "experts": "feed_forward.experts",
                 Name.SHARED_GATE_PROJ: "feed_forward.shared_expert.gate_proj",
                 Name.SHARED_UP_PROJ: "feed_forward.shared_expert.up_proj",
                 Name.SHARED_DOWN_PROJ: "feed_forward.shared_expert.down_proj"}
# (its q/k norm: one parameterless L2 norm module applied to both)
LLAMA4 = Layout.of({**_ATTN, Name.Q_NORM: "self_attn.qk_norm", Name.K_NORM: "self_attn.qk_norm",
                    **_FEED_FORWARD}, transposed=(Name.EXPERTS_GATE_UP, Name.EXPERTS_DOWN))
_MLA_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_GEMMA = Family(GEMMA, activation="gelu_pytorch_tanh", sqrt_embedding_scale=True, tie_default=True)
_LAYERNORM_GELU = {"norm": "layernorm", "bias_default": True, "out_bias": "always",
                   "mlp_bias": "always", "gated": False, "activation": "gelu", "tie_default": True}
_BERT = Family(BERT, placement=POST_LN, position="learned", **_LAYERNORM_GELU)  # type: ignore[arg-type]
_BART = Family(BART, placement=POST_LN, position="learned", **_LAYERNORM_GELU)  # type: ignore[arg-type]
# BERT-derived encoders and encoder-decoders whose config with `is_decoder` builds a causal LM
BERT_LIKE = ("bert", "bert-generation", "roberta", "xlm-roberta", "camembert", "data2vec-text",
             "ernie", "electra", "big_bird", "roc_bert", "rembert", "xmod")


# ----------------------------------------------------------------------------- the registry
# transformers/models/<model_type>/modeling_<model_type>.py for each
FAMILIES: dict[str, Family] = {
    "llama": Family(LLAMA, classes=("LlamaForCausalLM",)),
    "mistral": Family(LLAMA, out_bias="never", windows="every", classes=("MistralForCausalLM",)),
    "qwen2": Family(LLAMA, bias_default=True, out_bias="never", windows="qwen2",
                    classes=("Qwen2ForCausalLM",)),
    "qwen3": Family(LLAMA, qk_norm_always=True, windows="qwen2", classes=("Qwen3ForCausalLM",)),
    "qwen2_moe": Family(LLAMA, bias_default=True, out_bias="never", windows="qwen2", norm_topk_prob=False,
                        classes=("Qwen2MoeForCausalLM",)),
    "qwen3_moe": Family(LLAMA, qk_norm_always=True, windows="qwen2", norm_topk_prob=False,
                        classes=("Qwen3MoeForCausalLM",)),
    "mixtral": Family(LLAMA, out_bias="never", windows="every", norm_topk_prob=True,
                      classes=("MixtralForCausalLM",)),
    "olmo2": Family(QK_PROJECTION, placement=POST, qk_norm_always=True,
                    classes=("Olmo2ForCausalLM",)),
    "olmo3": Family(QK_PROJECTION, placement=POST, qk_norm_always=True,
                    classes=("Olmo3ForCausalLM",)),
    "olmoe": Family(QK_PROJECTION, qk_norm_always=True, norm_topk_prob=False,
                    classes=("OlmoeForCausalLM",)),
    "granite": Family(LLAMA, classes=("GraniteForCausalLM",)),
    # Cohere's use_qk_norm LayerNorms ([heads, head_dim] weights) and StableLM's qk_layernorm
    # (one LayerNorm per head) are laid out as one head_dim norm each: right in cost, not in
    # their HF parameters
    "cohere": Family(LLAMA, placement=PARALLEL_ONE_NORM, norm="layernorm", norm_bias=False,
                     tie_default=True, classes=("CohereForCausalLM",)),
    "stablelm": Family(LLAMA, parallel_switch=("use_parallel_residual", False, PARALLEL_ONE_NORM),
                       norm="layernorm", out_bias="never", classes=("StableLmForCausalLM",)),
    "starcoder2": Family(STARCODER2, norm="layernorm", bias_default=True, mlp_bias="qkv",
                         gated=False, activation="gelu_pytorch_tanh", windows="every",
                         tie_default=True, classes=("Starcoder2ForCausalLM",)),
    "gemma": dataclasses.replace(_GEMMA, classes=("GemmaForCausalLM",)),
    "gemma2": dataclasses.replace(_GEMMA, placement=SANDWICH, windows="gemma",
                     classes=("Gemma2ForCausalLM",)),
    "gemma3": dataclasses.replace(_GEMMA, placement=SANDWICH, qk_norm_always=True, windows="gemma",
                     classes=("Gemma3ForConditionalGeneration",), text_config=True),
    "gemma3_text": dataclasses.replace(_GEMMA, placement=SANDWICH, qk_norm_always=True, windows="gemma",
                          classes=("Gemma3ForCausalLM",)),
    # (q/k/v norms: which are q's and k's the shapes tell, per projection)
    "gemma4_unified_text": dataclasses.replace(_GEMMA, placement=SANDWICH, windows="gemma"),
    "gemma4_unified": dataclasses.replace(_GEMMA, placement=SANDWICH, windows="gemma",
                                          text_config=True),
    "glm": Family(GLM, bias_default=True, out_bias="never", classes=("GlmForCausalLM",)),
    "glm4": Family(GLM4, placement=SANDWICH, bias_default=True, out_bias="never",
                   classes=("Glm4ForCausalLM",)),
    "phi3": Family(PHI3, windows="every", classes=("Phi3ForCausalLM",)),
    "phi": Family(PHI, placement=PARALLEL_ONE_NORM, norm="layernorm", bias_default=True,
                  out_bias="always", mlp_bias="always", gated=False, activation="gelu_new",
                  classes=("PhiForCausalLM",)),
    "gpt2": Family(GPT2, norm="layernorm", bias_default=True, out_bias="always",
                   mlp_bias="always", gated=False, activation="gelu_new", position="learned",
                   tie_default=True, classes=("GPT2LMHeadModel",)),
    "gpt_neox": Family(GPT_NEOX, parallel_switch=("use_parallel_residual", True, PARALLEL),
                       norm="layernorm", bias_default=True, mlp_bias="always",
                       gated=False, activation="gelu", classes=("GPTNeoXForCausalLM",)),
    "deepseek_v2": Family(DEEPSEEK, required=_MLA_FIELDS, adjust=_deepseek, norm_topk_prob=False,
                          classes=("DeepseekV2ForCausalLM",)),
    "deepseek_v3": Family(DEEPSEEK, required=_MLA_FIELDS, adjust=_deepseek, norm_topk_prob=True,
                          classes=("DeepseekV3ForCausalLM",)),
    "gpt_oss": Family(GPT_OSS, bias_default=True, windows="even", adjust=_gpt_oss, norm_topk_prob=True,
                      classes=("GptOssForCausalLM",)),
    **dict.fromkeys(BERT_LIKE, _BERT),
    "roformer": dataclasses.replace(_BERT, position=ROTARY),
    "roberta-prelayernorm": dataclasses.replace(_BERT, layout=BERT_PRE, placement=PRE_EMBEDDING_NORM),
    **dict.fromkeys(("bart", "plbart", "blenderbot-small", "marian", "trocr", "mvp"), _BART),
    "git": _BERT,  # GIT's text decoder: BERT's layers and embedding norm
    "mbart": dataclasses.replace(_BART, layout=BART_PRE, placement=PRE_EMBEDDING_NORM),
    **dict.fromkeys(("pegasus", "blenderbot"), dataclasses.replace(_BART, layout=BART_PRE,
                                                                   placement=PRE)),
    "bloom": Family(BLOOM, placement=PRE_EMBEDDING_NORM, position="learned",
                    **_LAYERNORM_GELU),  # type: ignore[arg-type]
    "nanochat": Family(QK_PROJECTION, placement=PRE_EMBEDDING_NORM, qk_norm_always=True),
    "exaone4": Family(QK_PROJECTION, placement=POST, qk_norm_always=True, windows="every"),
    "flex_olmo": Family(QK_PROJECTION, placement=POST, qk_norm_always=True, norm_topk_prob=False),
    # Peri-LN: a norm after each block too (use_post_norm), its pre-MLP norm HF's post_attention
    "llama4_text": Family(LLAMA4, adjust=_llama4, norm_topk_prob=False,
                          classes=("Llama4ForCausalLM",)),
    "llama4": Family(LLAMA4, adjust=_llama4, norm_topk_prob=False, text_config=True,
                     classes=("Llama4ForConditionalGeneration",)),
    # (its attention layers' placement: its linear-attention layers' pre-norms then carry the
    # post-norm names of the same place, a layer's norms either way)
    "olmo_hybrid": Family(QK_PROJECTION, placement=POST, qk_norm_always=True),
    "afmoe": Family(AFMOE, placement=SANDWICH, qk_norm_always=True),
    "hyperclovax": Family(HYPERCLOVAX, parallel_switch=("use_post_norm", True, SANDWICH)),
}
# A model type no entry names: its fields read as a Llama-style layer, the norm guessed
GENERIC = Family(LLAMA, norm=None)
# Model types that are no decoder-only LM (encoders, encoder-decoders, vision and speech
# models): refused, whatever fields their config shares with a decoder's.
NOT_DECODERS = frozenset({
    "bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2",
    "mpnet", "modernbert", "camembert", "ernie", "t5", "mt5", "umt5", "bart", "mbart", "pegasus",
    "marian", "whisper", "wav2vec2", "hubert", "vit", "clip", "siglip", "dinov2", "swin", "convnext",
    "resnet"})  # (those with a family: unless the config is a causal LM's, `_causal`)


def register(model_type: str, family: Family) -> None:
    """Add (or replace) a family: one entry, nothing else to edit."""
    FAMILIES[model_type] = family


def _causal(cfg: dict) -> bool:
    """A config that builds a causal LM: `is_decoder`, or a `*ForCausalLM` / `*LMHeadModel` class
    (an encoder's or encoder-decoder's model type, such as BERT's or BART's, then names its
    decoder)."""
    classes = cfg.get("architectures")
    return cfg.get("is_decoder") is True or isinstance(classes, list) and any(
        isinstance(a, str) and a.endswith(("ForCausalLM", "LMHeadModel")) for a in classes)


def _supported() -> str:
    return f"known families: {', '.join(FAMILIES)}"


def model_type(cfg: dict, source: str = "config.json") -> str:
    """The config's `model_type`, else the one its `architectures` class names, else ""."""
    mt = cfg.get("model_type")
    if mt is not None and not isinstance(mt, str):
        raise InputError(f"{source}: bad value in config.json: model_type must be a string, "
                         f"got {mt!r}")
    if mt:
        return mt
    classes = cfg.get("architectures")
    by_class = {cls: t for t, f in FAMILIES.items() for cls in f.classes}
    return next((by_class[a] for a in classes if isinstance(a, str) and a in by_class), "") \
        if isinstance(classes, list) else ""


def from_hf_config(cfg: dict, source: str) -> Architecture:
    """The architecture of a HF config.json's contents (`source` names it in errors).

    The family is `model_type` (or, without one, the `architectures` class); a model type no
    family names is read from its fields as a Llama-style decoder (said in `assumed`), one of
    NOT_DECODERS is refused. Missing fields and bad values are one-line InputErrors."""
    if not isinstance(cfg, dict):
        raise InputError(f"{source}: expected a JSON object, got {type(cfg).__name__}")
    mt = model_type(cfg, source)
    if mt in NOT_DECODERS and not (mt in FAMILIES and _causal(cfg)):
        raise InputError(f"{source}: model_type {mt!r} is not a decoder-only language model "
                         "(an encoder, encoder-decoder or vision/speech model): there is no "
                         f"decoder layer layout to name its kernels by ({_supported()})")
    family = FAMILIES.get(mt, GENERIC)
    if family.text_config and isinstance(cfg.get("text_config"), dict):
        outer = ("_name_or_path", "torch_dtype", "quantization_config")
        cfg = {**cfg["text_config"], **{k: cfg[k] for k in outer if k in cfg}}
        mt = str(cfg.get("model_type") or mt)
    c = Config(cfg, source, mt)
    if family is GENERIC:
        unknown = f"model_type {mt!r} is not a known family" if mt else "no model_type"
        missing = c.missing(*GEOMETRY)
        if missing:
            raise InputError(f"{source}: {unknown}, and config.json lacks {', '.join(missing)} "
                             f"to read it from its fields ({_supported()})")
        c.assume(f"{unknown}: read from its fields as a Llama-style layer")
    try:
        return read_decoder(c, family, mt or "generic")
    except InputError as e:
        if str(e).startswith(source):
            raise
        raise InputError(f"{source}: bad value in config.json ({e})") from None
    except (TypeError, ValueError, AttributeError, ArithmeticError) as e:
        raise InputError(f"{source}: bad value in config.json ({e})") from None
