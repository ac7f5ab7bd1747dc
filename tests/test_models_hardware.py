"""Presets, HF config loading, hardware lookup and JSON files."""

import json

import pytest

from trace_roofline import hardware
from trace_roofline.errors import InputError
from trace_roofline.models import PRESETS, dtype_bytes, from_hf_config, get_model

QWEN_7B_CONFIG = {  # Qwen/Qwen2.5-7B-Instruct config.json (abridged, real values)
    "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584, "intermediate_size": 18944,
    "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "torch_dtype": "bfloat16",
    "vocab_size": 152064, "model_type": "qwen2", "tie_word_embeddings": False,
}


def test_qwen_preset_shapes():
    m = get_model("Qwen2.5-7B")
    assert m.linears() == {
        "q_proj": (3584, 3584, True), "k_proj": (3584, 512, True), "v_proj": (3584, 512, True),
        "o_proj": (3584, 3584, False), "gate_proj": (3584, 18944, False),
        "up_proj": (3584, 18944, False), "down_proj": (18944, 3584, False),
    }
    assert m.fused_linears() == {"qkv_proj": (3584, 4608, True), "gate_up_proj": (3584, 37888, False)}
    assert m.bytes_per_element == 2
    assert {"qwen2.5-7b", "qwen2.5-0.5b", "llama-3-8b"} <= set(PRESETS)
    assert get_model("llama-3-8b").qkv_bias is False


def test_hf_config_roundtrip(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(QWEN_7B_CONFIG))
    m = from_hf_config(p)
    ref = PRESETS["qwen2.5-7b"]
    for f in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
              "num_layers", "vocab_size", "qkv_bias", "dtype", "rope_theta"):
        assert getattr(m, f) == getattr(ref, f), f
    assert get_model(str(p)) == m


@pytest.mark.parametrize("text,msg", [
    ("{", "not valid JSON"), ("[1, 2]", "expected a JSON object"),
    ('{"hidden_size": 8}', "lacks num_attention_heads"),
    ('{"hidden_size": "x", "num_attention_heads": 2, "intermediate_size": 8, '
     '"num_hidden_layers": 1}', "bad value"),
])
def test_hf_config_errors(tmp_path, text, msg):
    p = tmp_path / "config.json"
    p.write_text(text)
    with pytest.raises(InputError, match=msg) as e:
        from_hf_config(p)
    assert str(p) in str(e.value) and "\n" not in str(e.value)


def test_unknown_names():
    with pytest.raises(InputError, match="unknown model"):
        get_model("gpt-5")
    with pytest.raises(InputError, match="unknown hardware"):
        hardware.get_hardware("tpu-v9")
    with pytest.raises(InputError, match="unknown dtype"):
        dtype_bytes("int3")


def test_hardware_presets_and_ridge():
    h = hardware.get_hardware("h200-sxm")
    assert h.peak("c10::BFloat16") == 989.4e12
    assert h.ridge("bf16") == pytest.approx(989.4e12 / 4.8e12)
    assert h.peak("torch.float8_e4m3fn") == 1978.9e12
    assert {"rtx4090", "rtx3080", "a100-sxm", "h100-sxm", "h200-sxm"} <= set(hardware.PRESETS)
    with pytest.raises(InputError, match="no fp8 peak"):
        hardware.get_hardware("a100-sxm").peak("fp8")


def test_lookup_by_trace_device_name():
    assert hardware.for_device_name("NVIDIA H200", prefer_measured=False).name == "h200-sxm"
    assert hardware.for_device_name("NVIDIA GeForce RTX 4090").name == "rtx4090"
    assert hardware.for_device_name("Some Unknown GPU") is None


def test_hardware_json_roundtrip(tmp_path):
    p = tmp_path / "hw.json"
    h = hardware.get_hardware("rtx3080")
    p.write_text(json.dumps({**h.to_json(), "date": "2026-11-29"}))
    back = hardware.get_hardware(str(p))
    assert back.peak_flops == h.peak_flops and back.mem_bandwidth == h.mem_bandwidth
    assert back.extra == {"date": "2026-11-29"}


@pytest.mark.parametrize("payload,msg", [
    ("nope", "not valid JSON"),
    ("[]", "must hold a JSON object"),
    ('{"name": "x", "peak_flops": {"bf16": 1}}', "lacks mem_bandwidth"),
    ('{"name": "x", "peak_flops": {}, "mem_bandwidth": 1}', "non-empty"),
    ('{"name": "x", "peak_flops": {"bf16": "fast"}, "mem_bandwidth": 1}', "must be numbers"),
    ('{"name": "x", "peak_flops": {"bf16": -1}, "mem_bandwidth": 1}', "non-positive"),
    ('{"name": "x", "peak_flops": {"int2": 1}, "mem_bandwidth": 1}', "unknown dtype"),
])
def test_hardware_json_errors(tmp_path, payload, msg):
    p = tmp_path / "hw.json"
    p.write_text(payload)
    with pytest.raises(InputError, match=msg) as e:
        hardware.get_hardware(str(p))
    assert str(p) in str(e.value)
