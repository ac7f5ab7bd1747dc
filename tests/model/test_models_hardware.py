"""Presets, HF config loading, hardware lookup and JSON files."""

import json

import pytest

from tests.builders import SAMPLES
from trace_roofline.errors import InputError
from trace_roofline.model import hardware
from trace_roofline.model.models import PRESETS, dtype_bytes, from_hf_config, get_model
from trace_roofline.options import AnalysisOptions

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
    ('{"name": "x", "peak_flops": {"bf16": "fast"}, "mem_bandwidth": 1}',
     "peak_flops\\['bf16'\\] must be a number, got 'fast'"),
    ('{"name": "x", "peak_flops": {"bf16": -1}, "mem_bandwidth": 1}',
     "non-positive or non-finite ceiling for peak_flops\\['bf16'\\], got -1"),
    ('{"name": "x", "peak_flops": {"bf16": Infinity}, "mem_bandwidth": 1}', "peak_flops.*got inf"),
    ('{"name": "x", "peak_flops": {"bf16": NaN}, "mem_bandwidth": 1}', "peak_flops.*got nan"),
    ('{"name": "x", "peak_flops": {"bf16": true}, "mem_bandwidth": 1}',
     "peak_flops\\['bf16'\\] must be a number, got True"),
    ('{"name": "x", "peak_flops": {"bf16": 1}, "mem_bandwidth": -Infinity}', "mem_bandwidth"),
    ('{"name": "x", "peak_flops": {"bf16": 1}, "mem_bandwidth": 0}', "ceiling for mem_bandwidth, got 0"),
    ('{"name": "x", "peak_flops": {"bf16": 1}, "mem_bandwidth": 1, "link_bandwidth": -2}',
     "ceiling for link_bandwidth, got -2"),
    ('{"name": "x", "peak_flops": {"bf16": 1}, "mem_bandwidth": 1, "device_names": 5}',
     "device_names must be a list of strings, got 5"),
    ('{"name": "x", "peak_flops": {"bf16": 1}, "mem_bandwidth": 1, "device_names": [5]}',
     "device_names must be a list of strings"),
    ('{"name": "x", "peak_flops": {"int2": 1}, "mem_bandwidth": 1}', "unknown dtype"),
])
def test_hardware_json_errors(tmp_path, payload, msg):
    p = tmp_path / "hw.json"
    p.write_text(payload)
    with pytest.raises(InputError, match=msg) as e:
        hardware.get_hardware(str(p))
    assert str(e.value).startswith(str(p)) and "\n" not in str(e.value)


FP8_TINY = {  # qwen-tiny's shapes, stored in fp8
    "architectures": ["Qwen2ForCausalLM"], "hidden_size": 256, "intermediate_size": 768,
    "num_attention_heads": 8, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "vocab_size": 1024, "model_type": "qwen2",
}


@pytest.mark.parametrize("dtype_fields", [
    {"torch_dtype": "float8_e4m3fn"},
    {"torch_dtype": "bfloat16", "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}},
])
def test_fp8_config_extrapolates(tmp_path, dtype_fields):
    """An fp8 model loads with 1-byte elements and the fp8 peak, and --layers extrapolation adds
    its embedding and lm_head at 1 byte per element (hand-computed below)."""

    from trace_roofline.pipeline import analyze_trace

    p = tmp_path / "config.json"
    p.write_text(json.dumps({**FP8_TINY, **dtype_fields}))
    m = get_model(str(p))
    assert m.dtype == "float8_e4m3fn" and m.bytes_per_element == 1
    assert hardware.get_hardware("h200-sxm").peak(m.dtype) == 1978.9e12
    trace = SAMPLES / "qwen-tiny_decode_b2_s64_l2_cpu.json.gz"
    a = analyze_trace(trace, m, options=AnalysisOptions(layers=4))
    ext = a.extrapolated.set_index("operator")
    # decode, B=2: 2 tokens gather 2 rows of [1024, 256] (read + write) plus 2 int64 ids
    assert ext.loc["embedding", "source"] == "model"
    assert ext.loc["embedding", "bytes"] == 2 * 256 * 2 + 2 * 8
    # lm_head: [2,256]x[256,1024] at 1 byte per element
    assert ext.loc["lm_head", "flops"] == 2 * 2 * 256 * 1024
    assert ext.loc["lm_head", "bytes"] == 2 * 256 + 256 * 1024 + 2 * 1024


@pytest.mark.parametrize("spelling,short,nbytes,peak", [
    ("c10::BFloat16", "bf16", 2, "bf16"), ("bfloat16", "bf16", 2, "bf16"),
    ("BFloat16", "bf16", 2, "bf16"), ("torch.bfloat16", "bf16", 2, "bf16"),
    ("float", "fp32", 4, "fp32"), ("Float", "fp32", 4, "fp32"), ("c10::Half", "fp16", 2, "fp16"),
    ("float8_e4m3fn", "fp8", 1, "fp8"), ("c10::Float8_e4m3fn", "fp8", 1, "fp8"),
    ("c10::Float8_e5m2", "fp8", 1, "fp8"), ("long int", "int64", 8, None),
    ("int", "int32", 4, None), ("bool", "bool", 1, None), ("unsigned char", "uint8", 1, None),
    ("signed char", "int8", 1, None), ("int8", "int8", 1, None), ("double", "fp64", 8, None),
])
def test_dtype_table(spelling, short, nbytes, peak):
    from trace_roofline.model import dtypes

    d = dtypes.lookup(spelling)
    assert (d.short, d.bytes, d.peak) == (short, nbytes, peak)
    assert dtype_bytes(spelling) == nbytes
    if peak is None:
        with pytest.raises(InputError, match="no compute peak"):
            hardware.dtype_key(spelling)
    else:
        assert hardware.dtype_key(spelling) == peak


def test_dtype_table_misses_and_scalar_types():
    from trace_roofline.model import dtypes

    assert dtypes.lookup("Scalar") is None and dtypes.lookup("TensorList") is None
    assert dtypes.by_scalar_type("15").short == "bf16"
    assert dtypes.by_scalar_type("24").name == "float8_e4m3fn"
    assert dtypes.by_scalar_type("99") is None
