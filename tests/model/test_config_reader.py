"""Reading any decoder's config.json (model/config_reader.py, model/families.py): its fields
under their spellings, what the reader assumed, a family added as one entry, and bad values as
one-line InputErrors naming the field."""

from __future__ import annotations

import json

import pytest

from trace_roofline.errors import InputError
from trace_roofline.model import architecture as A
from trace_roofline.model import families as F
from trace_roofline.model.config_reader import MAX_LAYERS, SPELLINGS
from trace_roofline.model.models import PRESETS, get_model
from trace_roofline.model.moe import Experts

BASE = {"model_type": "foo", "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 96, "num_hidden_layers": 3,
        "vocab_size": 128, "rms_norm_eps": 1e-5}


def _spec(tmp_path, cfg: dict):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return get_model(str(path))


# ----------------------------------------------------------------------------- unlisted families
def test_an_unlisted_model_type_is_read_from_its_fields_and_says_what_it_assumed(tmp_path):
    falcon_like = {"model_type": "foo", "n_embd": 64, "n_head": 4, "n_layer": 3,
                   "multi_query": True, "layer_norm_epsilon": 1e-5, "vocab_size": 128,
                   "bias": True}
    spec = _spec(tmp_path, falcon_like)
    assert (spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (64, 4, 1, 16)
    assert spec.intermediate_size == 256 and spec.num_layers == 3 and spec.qkv_bias
    assert spec.assumed == ("model_type 'foo' is not a known family: read from its fields as a "
                            "Llama-style layer", "intermediate_size absent: 4·hidden_size",
                            "norm kind guessed from layer_norm_epsilon: LayerNorm")
    arch = spec.architecture
    assert arch.norm == "layernorm" and arch.norm_eps == 1e-5 and arch.family == "foo"
    assert arch.placement == A.PRE and arch.shard(2).assumed == spec.assumed
    # a known family's complete config assumes nothing; nor do the presets
    assert _spec(tmp_path, {**BASE, "model_type": "llama"}).assumed == ()
    assert all(p.assumed == () for p in PRESETS.values())
    assert _spec(tmp_path, {k: v for k, v in BASE.items() if k != "model_type"}).assumed[0] \
        == "no model_type: read from its fields as a Llama-style layer"


CANONICAL = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 96, "num_hidden_layers": 3, "head_dim": 32}


@pytest.mark.parametrize(("field", "spelling"), [
    (f, s) for f in CANONICAL for s in SPELLINGS[f][1:] if s != "multi_query"])
def test_every_spelling_of_a_field_reads_the_same(tmp_path, field, spelling):
    want = F.from_hf_config({**BASE, **CANONICAL}, "c")
    cfg = {k: v for k, v in {**BASE, **CANONICAL}.items() if k != field}
    got = F.from_hf_config({**cfg, spelling: CANONICAL[field]}, "c")
    assert got.layer(0) == want.layer(0) and got.num_layers == want.num_layers


def test_moe_qk_norm_tie_and_bias_fields_under_their_spellings():
    moe = F.from_hf_config({**BASE, "moe_num_experts": 8, "moe_top_k": 2,
                            "expert_intermediate_size": 32}, "c")
    assert moe.moe.experts == Experts(8, 2, 32, norm_topk_prob=False)
    assert "norm_topk_prob absent: top-k routing weights not renormalised" in moe.assumed
    ds = F.from_hf_config({**BASE, "n_routed_experts": 8, "num_experts_per_tok": 2,
                           "moe_intermediate_size": 32, "n_shared_experts": 2}, "c")
    assert (ds.moe.experts.shared_intermediate_size, ds.moe.experts.shared_gate) == (64, False)
    qwen = F.from_hf_config({**BASE, "num_experts": 8, "top_k": 2, "moe_intermediate_size": 32,
                             "shared_expert_intermediate_size": 48}, "c")
    assert qwen.sparse_layer.gemm("shared_expert_gate") is not None
    for key in ("use_qk_norm", "qk_layernorm"):
        assert F.from_hf_config({**BASE, key: True}, "c").dense_layer.gemm("q_proj") is not None
        assert [n.op for n in F.from_hf_config({**BASE, key: True}, "c").dense_layer.norms()] \
            == ["input_norm", "q_norm", "k_norm", "post_attention_norm"]
    tied = F.from_hf_config({**BASE, "tie_word_embeddings": True, "attention_bias": True}, "c")
    assert tied.tie_word_embeddings and tied.dense_layer.gemm("o_proj").bias
    assert F.from_hf_config({**BASE, "kv_channels": 8}, "c").attention.head_dim == 8


# ----------------------------------------------------------------------------- the model's norms
BERT_CFG = {"model_type": "roberta", "hidden_size": 64, "num_attention_heads": 4,
            "num_hidden_layers": 2, "intermediate_size": 176, "vocab_size": 100,
            "hidden_act": "gelu", "layer_norm_eps": 1e-12}


def test_a_bert_decoder_is_post_norm_with_an_embedding_norm_and_no_final_norm():
    arch = F.from_hf_config({**BERT_CFG, "is_decoder": True}, "roberta")
    assert arch.placement is A.POST_LN and arch.norm == "layernorm" and arch.assumed == ()
    assert [o.op for o in arch.layer(0).ops] == [
        "q_proj", "k_proj", "v_proj", "attention", "o_proj", "residual", "post_attention_norm",
        "up_proj", "act", "down_proj", "residual", "post_feedforward_norm"]
    assert arch.layer(0).hf_params()["output.LayerNorm.weight"] == (64,)
    # the same model type as an encoder (masked LM) is refused; its causal LM's class is read
    with pytest.raises(InputError, match="not a decoder-only language model"):
        F.from_hf_config(BERT_CFG, "roberta")
    assert F.from_hf_config({**BERT_CFG, "architectures": ["RobertaForCausalLM"]}, "r").placement \
        is A.POST_LN


def test_bart_decoders_read_their_decoder_fields_and_placement():
    bart = {"model_type": "bart", "d_model": 64, "decoder_attention_heads": 4,
            "encoder_attention_heads": 8, "decoder_layers": 2, "decoder_ffn_dim": 176,
            "vocab_size": 100, "activation_function": "gelu", "is_decoder": True}
    arch = F.from_hf_config(bart, "bart")
    assert (arch.attention.num_heads, arch.num_layers, arch.mlp.intermediate_size) == (4, 2, 176)
    assert arch.placement is A.POST_LN
    mbart = F.from_hf_config({**bart, "model_type": "mbart"}, "mbart")
    assert mbart.placement.embedding_norm and mbart.placement.final_norm
    assert mbart.placement.order == A.PRE.order
    assert not F.from_hf_config({**bart, "model_type": "pegasus"}, "p").placement.embedding_norm


# ----------------------------------------------------------------------------- one entry
def test_a_family_with_a_new_norm_placement_is_one_registry_entry(monkeypatch):
    monkeypatch.setattr(F, "FAMILIES", dict(F.FAMILIES))  # the registration ends with the test
    peri = A.Placement("peri", ("input_norm", A.ATTENTION, "post_attention_norm", A.RESIDUAL,
                                A.MLP, "post_feedforward_norm", A.RESIDUAL))
    layout = A.Layout.of({**F.LLAMA.module, "post_attention_norm": "attn_out_norm",
                       "post_feedforward_norm": "mlp_out_norm"})
    F.register("toy_peri", F.Family(layout, placement=peri, classes=("ToyPeriForCausalLM",)))
    arch = F.from_hf_config({**BASE, "model_type": "toy_peri"}, "toy")
    layer = arch.layer(0)
    assert [o.op for o in layer.ops] == [
        "input_norm", "q_proj", "k_proj", "v_proj", "rope", "attention", "o_proj",
        "post_attention_norm", "residual", "gate_proj", "up_proj", "act", "down_proj",
        "post_feedforward_norm", "residual"]
    assert layer.hf_params()["attn_out_norm.weight"] == (64,)
    assert "mlp_out_norm.weight" in layer.hf_params() and arch.assumed == ()
    assert F.model_type({"architectures": ["ToyPeriForCausalLM"]}) == "toy_peri"


# ----------------------------------------------------------------------------- bad values
@pytest.mark.parametrize(("field", "value", "msg"), [
    ("num_attention_heads", 0, "num_attention_heads must be an integer from 1 to"),
    ("hidden_size", 0, "hidden_size must be an integer from 1 to .*got 0"),
    ("hidden_size", True, "hidden_size .*got True"),
    ("hidden_size", float("inf"), "hidden_size .*got inf"),
    ("hidden_size", 1e30, "hidden_size .*got 1e\\+30"),
    ("hidden_size", -3584, "hidden_size .*got -3584"),
    ("hidden_size", "x", "hidden_size .*got 'x'"),
    ("num_hidden_layers", -1, f"num_hidden_layers must be an integer from 1 to {MAX_LAYERS}"),
    ("num_hidden_layers", 0, "num_hidden_layers .*got 0"),
    ("num_hidden_layers", 10**12, "num_hidden_layers .*got 1000000000000"),
    ("head_dim", 0, "head_dim .*got 0"),
    ("num_experts", 0, "num_experts .*got 0"),
    ("model_type", 5, "model_type must be a string, got 5"),
    ("num_key_value_heads", True, "num_key_value_heads .*got True"),
    ("intermediate_size", False, "intermediate_size .*got False"),
    ("num_key_value_heads", 3, "num_key_value_heads 3 does not divide num_attention_heads 4"),
    ("rms_norm_eps", float("nan"), "rms_norm_eps must be a finite number"),
    ("rope_theta", "big", "rope_theta must be a finite number"),
    ("mlp_only_layers", 3, "mlp_only_layers must be a list"),
    ("partial_rotary_factor", 2, "rotary fraction must be in"),
    ("sliding_window", -4, "sliding_window .*got -4"),
])
def test_a_bad_value_is_one_line_naming_the_field(tmp_path, field, value, msg):
    cfg = {**BASE, "num_experts_per_tok": 2, field: value}
    if field == "num_experts":
        cfg["moe_intermediate_size"] = 32
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))  # Infinity / NaN as Python's json writes them
    with pytest.raises(InputError, match=msg) as e:
        get_model(str(path))
    assert str(e.value).startswith(f"{path}: ") and "\n" not in str(e.value)


def test_the_deepest_model_reads_without_per_layer_work_beyond_its_bound():
    arch = F.from_hf_config({**BASE, "num_hidden_layers": MAX_LAYERS, "sliding_window": 8,
                             "model_type": "mistral"}, "deep")
    assert arch.num_layers == MAX_LAYERS and arch.layer(MAX_LAYERS - 1).window == 8
    with pytest.raises(InputError, match="num_hidden_layers"):
        F.from_hf_config({**BASE, "num_hidden_layers": MAX_LAYERS + 1}, "deeper")
