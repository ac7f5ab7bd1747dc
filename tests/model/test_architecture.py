"""Architecture descriptions (trace_roofline/model/architecture.py) against Hugging Face's own modules.

Each family is built from a small `AutoConfig.for_model` config and instantiated on the meta
device: every parameter of every HF layer (GEMM weights in HF's storage layout, biases, norms,
sinks) must be the one the architecture lays out, and nothing more. Then sharding, sliding
windows, precision, the unknown-model_type error and ModelSpec's agreement with the layout.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from trace_roofline.errors import InputError
from trace_roofline.model import architecture as A
from trace_roofline.model import dtypes
from trace_roofline.model import families as F
from trace_roofline.model.models import PRESETS, ModelSpec, from_hf_config, get_model
from trace_roofline.model.moe import Experts

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
             num_hidden_layers=2, vocab_size=128, pad_token_id=None, bos_token_id=None,
             eos_token_id=None)  # no special token ids beyond the tiny vocabulary
MLA = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, n_routed_experts=4,
           n_shared_experts=1, moe_intermediate_size=24, first_k_dense_replace=1, num_experts_per_tok=2)
CASES: dict[str, dict] = {
    "llama": dict(SMALL, attention_bias=True, mlp_bias=True),
    "mistral": dict(SMALL),
    "qwen2": dict(SMALL),
    "qwen3": dict(SMALL, head_dim=32),
    "qwen2_moe": dict(SMALL, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=48, shared_expert_intermediate_size=80,
                      decoder_sparse_step=2),
    "qwen3_moe": dict(SMALL, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=48, mlp_only_layers=[1]),
    "mixtral": dict(SMALL, num_local_experts=4, num_experts_per_tok=2),
    "gemma2": dict(SMALL, head_dim=32),
    "gemma3_text": dict(SMALL, head_dim=32, num_hidden_layers=3),
    "phi3": dict(SMALL),
    "gpt2": dict(n_embd=64, n_head=4, n_layer=2, vocab_size=128, bos_token_id=0, eos_token_id=0),
    "gpt_neox": dict(hidden_size=64, num_attention_heads=4, intermediate_size=96, num_hidden_layers=2,
                     vocab_size=128, bos_token_id=0, eos_token_id=0),
    "deepseek_v2": dict(SMALL, q_lora_rank=None, **MLA),
    "deepseek_v3": dict(SMALL, q_lora_rank=24, n_group=1, topk_group=1, **MLA),
    "gpt_oss": dict(SMALL, num_local_experts=4, num_experts_per_tok=2, head_dim=16),
    "olmo2": dict(SMALL, attention_bias=True),
    "olmo3": dict(SMALL, num_hidden_layers=4, sliding_window=16),
    "olmoe": dict(SMALL, num_experts=4, num_experts_per_tok=2),
    "gemma": dict(SMALL, head_dim=32),
    "glm": dict(SMALL, head_dim=16),
    "glm4": dict(SMALL, head_dim=16),
    "granite": dict(SMALL, attention_bias=True, mlp_bias=True, attention_multiplier=0.5),
    "stablelm": dict(SMALL, use_qkv_bias=True),
    "starcoder2": dict(SMALL),
    "cohere": dict(SMALL, attention_bias=True),
    "phi": dict(SMALL),
}


def _hf(model_type: str, **kw):
    """The family's small HF config and its model on the meta device."""
    cfg = transformers.AutoConfig.for_model(model_type, **kw)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return cfg, model


def _layers(model) -> list:
    base = getattr(model, "model", None) or getattr(model, "transformer", None) or model.gpt_neox
    return list(getattr(base, "layers", None) or base.h)


def _gemm_modules(layer) -> set[str]:
    """HF's GEMM holders in a layer: nn.Linear and Conv1D modules, MoE routers, stacked experts
    (by their gate_up_proj parameter)."""
    from transformers.pytorch_utils import Conv1D

    return {n for n, m in layer.named_modules()
            if isinstance(m, (torch.nn.Linear, Conv1D)) or "gate_up_proj" in m._parameters
            or type(m).__name__.endswith("Router")}


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_every_hf_parameter_of_every_layer_is_the_architectures(model_type):
    cfg, model = _hf(model_type, **CASES[model_type])
    arch = F.from_hf_config(cfg.to_dict(), f"{model_type}/config.json")
    layers = _layers(model)
    assert arch.num_layers == len(layers) and arch.family in F.FAMILIES
    for i, hf in enumerate(layers):
        mine = arch.layer(i)
        params = {n: tuple(p.shape) for n, p in hf.named_parameters()}
        assert mine.hf_params() == params, (model_type, i)  # shapes, biases, nothing missed
        gemms = mine.gemms()
        assert {g.weight.rsplit(".", 1)[0] for g in gemms} == _gemm_modules(hf), (model_type, i)
        assert mine.sparse == any(g.experts for g in gemms)
        for g in gemms:  # linears of the vocabulary; its row-parallel ones split K
            op = A.operators.BY_NAME[g.op]
            assert op.linear and (g.parallel == "row" or not op.row_parallel)
    out = model.get_output_embeddings().weight
    assert tuple(out.shape) == (arch.lm_head.n, arch.lm_head.k) == (arch.vocab_size, arch.hidden_size)
    assert arch.tie_word_embeddings == bool(cfg.tie_word_embeddings)


def test_gemma3_multimodal_config_is_its_text_decoder():
    text = dict(SMALL, head_dim=32, num_hidden_layers=6)
    cfg = transformers.AutoConfig.for_model("gemma3", text_config=text).to_dict()
    arch = F.from_hf_config(cfg, "gemma3/config.json")
    _, model = _hf("gemma3_text", **text)
    for i, hf in enumerate(_layers(model)):
        assert arch.layer(i).hf_params() == {n: tuple(p.shape) for n, p in hf.named_parameters()}
    assert arch.placement == A.SANDWICH and arch.attention.qk_norm
    assert arch.embedding_scale == pytest.approx(8.0) and arch.mlp.activation == "gelu_pytorch_tanh"


# ----------------------------------------------------------------------------- config fields
def test_gpt2_fields_learned_positions_and_an_ungated_mlp(tmp_path):
    cfg = {"model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 12, "n_inner": None,
           "n_positions": 1024, "vocab_size": 50257, "activation_function": "gelu_new"}
    arch = F.from_hf_config(cfg, "gpt2")
    assert (arch.mlp.intermediate_size, arch.mlp.gated, arch.mlp.activation) == (3072, False, "gelu_new")
    assert (arch.position, arch.max_positions, arch.norm) == ("learned", 1024, "layernorm")
    assert arch.attention.rope_dim == 0 and arch.placement == A.PRE
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    spec = get_model(str(path))  # no longer "config.json lacks hidden_size"
    assert spec.linears() == {"qkv_proj": (768, 2304, True), "o_proj": (768, 768, True),
                              "up_proj": (768, 3072, True), "down_proj": (3072, 768, True)}
    assert spec.fused_linears() == {"qkv_proj": (768, 2304, True)}  # no gate_up to invent
    assert spec.moe_linears() == {} and spec.architecture.family == "gpt2"
    assert F.from_hf_config({**cfg, "n_inner": 1000}, "gpt2").mlp.intermediate_size == 1000


def test_deepseek_head_dim_is_nope_plus_rope_not_the_saved_head_dim():
    cfg = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128,
           "num_key_value_heads": 128, "head_dim": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
           "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
           "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256,
           "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
           "moe_layer_freq": 1, "num_hidden_layers": 61, "vocab_size": 129280,
           "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}
    arch = F.from_hf_config(cfg, "dsv3")
    at = arch.attention
    assert (at.head_dim, at.v_head_dim, at.rope_dim, at.num_kv_heads) == (192, 128, 64, 128)
    assert arch.sparse_among(5) == (3, 4) and not arch.layer(2).sparse and arch.layer(3).sparse
    spec = ModelSpec.from_architecture(arch)
    assert spec.head_dim == 192 and spec.dtype == "float8_e4m3fn" and spec.sparse_among(5) == (3, 4)
    assert spec.experts == Experts(256, 8, 2048, 2048, False, True)
    assert spec.linears() == {
        "q_a_proj": (7168, 1536, False), "q_b_proj": (1536, 128 * 192, False),
        "kv_a_proj_with_mqa": (7168, 576, False), "kv_b_proj": (512, 128 * 256, False),
        "o_proj": (128 * 128, 7168, False), "gate_proj": (7168, 18432, False),
        "up_proj": (7168, 18432, False), "down_proj": (18432, 7168, False)}
    # the fp8 weights carry one float32 scale per 128x128 block; the router stays bf16
    assert arch.dense_layer.gemm("q_a_proj").weight_bits == 8 + 32 / 128**2
    assert arch.sparse_layer.gemm("router").weight_bits == 16
    v2 = F.from_hf_config({**cfg, "model_type": "deepseek_v2", "q_lora_rank": None}, "dsv2")
    assert v2.dense_layer.gemm("q_proj").n == 128 * 192 and v2.dense_layer.gemm("q_a_proj") is None


# ----------------------------------------------------------------------------- sharding
def test_dense_shard_by_hand_llama_3_8b():
    spec = get_model("llama-3-8b")
    assert spec.shard(8).linears() == {
        "q_proj": (4096, 512, False), "k_proj": (4096, 128, False), "v_proj": (4096, 128, False),
        "o_proj": (512, 4096, False), "gate_proj": (4096, 1792, False),
        "up_proj": (4096, 1792, False), "down_proj": (1792, 4096, False)}
    rank = spec.shard(16)  # 8 KV heads over 16 ranks: one replicated head each
    assert rank.num_kv_heads == 1 and rank.linears()["k_proj"] == (4096, 128, False)
    assert rank.fused_linears()["qkv_proj"] == (4096, 2 * 128 + 2 * 128, False)
    assert rank.vocab_size == 128256 // 16 and rank.architecture.lm_head.n == 8016
    layer = spec.architecture.shard(8).dense_layer
    assert {g.name: g.parallel for g in layer.gemms()} == {
        "q_proj": "column", "k_proj": "column", "v_proj": "column", "o_proj": "row",
        "gate_proj": "column", "up_proj": "column", "down_proj": "row"}
    with pytest.raises(InputError, match="`tp` 3 does not divide llama-3-8b's 32 heads"):
        spec.shard(3)


def test_moe_shard_by_hand_qwen15_moe_and_deepseek_mla():
    rank = get_model("qwen1.5-moe-a2.7b").shard(4)
    assert rank.moe_linears() == {
        "router": (2048, 60, False), "experts_gate_up": (2048, 704, False),
        "experts_gate": (2048, 352, False), "experts_up": (2048, 352, False),
        "experts_down": (352, 2048, False), "shared_gate_proj": (2048, 1408, False),
        "shared_up_proj": (2048, 1408, False), "shared_gate_up_proj": (2048, 2816, False),
        "shared_down_proj": (1408, 2048, False), "shared_expert_gate": (2048, 1, False)}
    cfg = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128,
           "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
           "v_head_dim": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048,
           "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
           "first_k_dense_replace": 3, "num_hidden_layers": 61, "vocab_size": 129280}
    arch = F.from_hf_config(cfg, "dsv3").shard(8)
    kn = {g.name: (g.k, g.n) for g in (*arch.dense_layer.gemms(), *arch.sparse_layer.gemms())}
    assert kn == {"q_a_proj": (7168, 1536), "q_b_proj": (1536, 16 * 192),  # q_a replicated
                  "kv_a_proj_with_mqa": (7168, 576), "kv_b_proj": (512, 16 * 256),
                  "o_proj": (16 * 128, 7168), "gate_proj": (7168, 2304), "up_proj": (7168, 2304),
                  "down_proj": (2304, 7168), "router": (7168, 256), "experts_gate_up": (7168, 512),
                  "experts_down": (256, 7168), "shared_gate_proj": (7168, 256),
                  "shared_up_proj": (7168, 256), "shared_down_proj": (256, 7168)}
    assert arch.sparse_layer.gemm("experts_gate_up").experts == 256


# ----------------------------------------------------------------------------- attention
def test_sliding_window_patterns():
    oss = {"model_type": "gpt_oss", **SMALL, "num_hidden_layers": 4, "num_local_experts": 4,
           "experts_per_token": 2, "head_dim": 16, "sliding_window": 128}
    assert F.from_hf_config(oss, "oss").attention.windows == (128, None, 128, None)
    types = ["full_attention", "sliding_attention", "full_attention", "full_attention"]
    got = F.from_hf_config({**oss, "layer_types": types}, "oss").attention
    assert got.windows == (None, 128, None, None) and got.sinks
    g3 = {"model_type": "gemma3_text", **SMALL, "num_hidden_layers": 12, "sliding_window": 512}
    w = F.from_hf_config(g3, "g3").attention.windows
    assert [i for i, x in enumerate(w) if x is None] == [5, 11] and set(w) == {512, None}
    hf = transformers.AutoConfig.for_model("gemma3_text", **{k: v for k, v in g3.items()
                                                             if k != "model_type"})
    assert F.from_hf_config(hf.to_dict(), "g3").attention.windows == w  # HF's own layer_types
    g2 = F.from_hf_config({"model_type": "gemma2", **SMALL, "num_hidden_layers": 4,
                           "sliding_window": 4096, "attn_logit_softcapping": 50.0,
                           "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 256}, "g2")
    assert g2.attention.windows == (4096, None, 4096, None) and g2.attention.softcap == 50.0
    assert g2.final_softcap == 30.0 and g2.attention.scale == 256 ** -0.5
    mistral = F.from_hf_config({"model_type": "mistral", **SMALL, "sliding_window": 4096}, "m")
    assert mistral.attention.windows == (4096, 4096)
    assert F.from_hf_config({"model_type": "llama", **SMALL}, "l").attention.windows == (None, None)


def test_mxfp4_experts_are_4_25_bits():
    cfg = {"model_type": "gpt_oss", "hidden_size": 2880, "num_attention_heads": 64,
           "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2880,
           "num_hidden_layers": 24, "num_local_experts": 32, "num_experts_per_tok": 4,
           "vocab_size": 201088, "torch_dtype": "bfloat16", "attention_bias": True,
           "quantization_config": {"quant_method": "mxfp4"}}
    arch = F.from_hf_config(cfg, "gpt-oss-20b")
    assert dtypes.MXFP4_BITS == 4 + 8 / 32  # e2m1 elements, one 8-bit scale per 32
    layer = arch.layer(0)
    bits = {g.name: g.weight_bits for g in layer.gemms()}
    assert bits == {"q_proj": 16, "k_proj": 16, "v_proj": 16, "o_proj": 16, "router": 16,
                    "experts_gate_up": 4.25, "experts_down": 4.25}
    assert arch.precision.expert_weights == "mxfp4" and arch.moe.activation == "swiglu_clamped"
    spec = ModelSpec.from_architecture(arch)
    assert spec.dtype == "bfloat16" and spec.linears() == {  # no dense MLP invented
        "q_proj": (2880, 4096, True), "k_proj": (2880, 512, True), "v_proj": (2880, 512, True),
        "o_proj": (4096, 2880, True)}
    assert spec.moe_linears()["experts_gate_up"] == (2880, 5760, True)
    assert spec.sparse_layers == tuple(range(24))


# ----------------------------------------------------------------------------- errors
def test_unknown_model_type_without_the_fields_is_one_line_naming_them(tmp_path):
    with pytest.raises(InputError) as e:
        F.from_hf_config({"model_type": "rwkv", "d_model": 512}, "rwkv/config.json")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(
        "rwkv/config.json: model_type 'rwkv' is not a known family, and config.json lacks "
        "num_attention_heads (or n_head, num_heads, n_heads, decoder_attention_heads), "
        "num_hidden_layers (or n_layer, ")
    assert all(f in msg for f in F.FAMILIES) and "hidden_size" not in msg  # d_model is one
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "rwkv", "d_model": 512}))
    with pytest.raises(InputError, match="'rwkv' is not a known family"):
        get_model(str(path))
    # an encoder's config has every field a Llama reading needs, and is still no decoder
    bert = {"model_type": "bert", "hidden_size": 64, "num_attention_heads": 4,
            "intermediate_size": 256, "num_hidden_layers": 2, "vocab_size": 100}
    for cfg in (bert, {"model_type": "t5", "d_model": 512}):
        path.write_text(json.dumps(cfg))
        with pytest.raises(InputError, match=f"'{cfg['model_type']}' is not a decoder-only"):
            get_model(str(path))
    with pytest.raises(InputError, match="config.json lacks num_attention_heads .or n_head"):
        F.from_hf_config({"model_type": "gpt2", "n_embd": 8, "n_layer": 1}, "g")


# ----------------------------------------------------------------------------- ModelSpec
OLD_PRESETS = {  # the presets as ModelSpec literals before they were built from configs
    "qwen2.5-7b": ModelSpec("qwen2.5-7b", 3584, 28, 4, 128, 18944, 28, 152064, True, rope_theta=1e6),
    "qwen2.5-0.5b": ModelSpec("qwen2.5-0.5b", 896, 14, 2, 64, 4864, 24, 151936, True,
                              rope_theta=1e6, tie_word_embeddings=True),
    "llama-3-8b": ModelSpec("llama-3-8b", 4096, 32, 8, 128, 14336, 32, 128256, False,
                            rms_norm_eps=1e-5, rope_theta=5e5),
    "mixtral-8x7b": ModelSpec("mixtral-8x7b", 4096, 32, 8, 128, 14336, 32, 32000, False,
                              rms_norm_eps=1e-5, rope_theta=1e6, experts=Experts(8, 2, 14336)),
    "qwen1.5-moe-a2.7b": ModelSpec("qwen1.5-moe-a2.7b", 2048, 16, 16, 128, 5632, 24, 151936, True,
                                   rope_theta=1e6, experts=Experts(60, 4, 1408, 5632, True, False)),
    "qwen3-30b-a3b": ModelSpec("qwen3-30b-a3b", 2048, 32, 4, 128, 6144, 48, 151936, False,
                               rope_theta=1e6, experts=Experts(128, 8, 768), qk_norm=True),
    "qwen-tiny": ModelSpec("qwen-tiny", 256, 8, 2, 32, 768, 2, 1024, True, dtype="float32",
                           rope_theta=1e6),
}


@pytest.mark.parametrize("name", sorted(OLD_PRESETS))
def test_presets_and_their_layouts_are_unchanged(name):
    """Presets built through the family builders equal the old literals; the carried layout and
    the one the fields describe agree (linears, fused, MoE, shards), in order."""
    new, old = PRESETS[name], OLD_PRESETS[name]
    assert new == old and dataclasses.asdict(new) == dataclasses.asdict(old)
    assert "_architecture" in new.__dict__ and "_architecture" not in old.__dict__
    for t in (1, 2, 4):
        try:
            a, b = new.shard(t), old.shard(t)
        except InputError:
            continue
        assert a == b
        for view in ("linears", "fused_linears", "moe_linears"):
            assert list(getattr(a, view)().items()) == list(getattr(b, view)().items())
        assert a.sparse_among(7) == b.sparse_among(7)


def test_modelspec_views_derive_from_the_architecture():
    spec = dataclasses.replace(get_model("mixtral-8x7b"), decoder_sparse_step=2)
    arch = spec.architecture  # described by the fields (replace keeps fields only)
    assert spec.sparse_layers == arch.sparse_among(32) == tuple(range(1, 32, 2))
    assert spec.linears() == {g.name: (g.k, g.n, g.bias) for g in arch.dense_layer.gemms()}
    assert list(spec.moe_linears())[:2] == ["router", "experts_gate_up"]
    assert math.isclose(arch.precision.weight_bits, 16)


@pytest.mark.parametrize("model_type", ["qwen2", "llama", "qwen3_moe", "mixtral"])
def test_config_json_through_the_registry_matches_hf(model_type, tmp_path):
    cfg, model = _hf(model_type, **CASES[model_type])
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json_string())
    spec = from_hf_config(path)
    layer = _layers(model)[0]
    for name, (k, n, bias) in spec.linears().items():
        if name in ("gate_proj", "up_proj", "down_proj") and spec.experts is not None \
                and spec.architecture.is_sparse(0):
            continue  # the dense MLP of layers the sparse rule leaves dense
        linear = layer.get_submodule(spec.architecture.dense_layer.gemm(name).weight[:-len(".weight")])
        assert (linear.in_features, linear.out_features, linear.bias is not None) == (k, n, bias)
