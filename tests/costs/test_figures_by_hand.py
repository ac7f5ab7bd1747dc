"""Figures worked out by hand, each on a committed trace:
attention from its geometry (an encoder's eager attention over every pair, MLA's d_qk and d_v
apart, flex attention's template from the layout and T), a compiled gather's bytes, no GPU
placement for a trace of CPU ops, each figure's derivation and the cross-check against the
layout."""

from __future__ import annotations

from functools import cache

import numpy as np
import pandas as pd
import pytest

import trace_roofline as tr
from tests.builders import SAMPLES
from trace_roofline.costs import attach, call, crosscheck
from trace_roofline.outputs import report
from trace_roofline.pipeline import analyze_trace_kernels, attribute_trace
from trace_roofline.roofline.placement import OPERATOR_COLUMNS

H100 = SAMPLES / "training_h100"
MISLEADING = SAMPLES / "misleading"
GPT_OSS = SAMPLES / "serving" / "vllm_gpt-oss-20b_decode_full_mi300x" / "graph_execution.json.gz"


def _config(name: str) -> str:
    return str(H100 / f"{name}.config.json")


@cache
def _analysis(path: str, config: str | None = None, hardware: str | None = None) -> tr.Analysis:
    return tr.analyze_trace(path, tr.get_model(config) if config else None,
                            tr.get_hardware(hardware) if hardware else None)


def _pairs(t: int, s: int, causal: bool) -> float:
    """Query-key pairs of one head written out: causal query i sees S - T + i + 1 keys."""
    return float(sum(s - t + i + 1 for i in range(t))) if causal else float(t * s)


# ------------------------------------------------------------------- encoders: every pair
def test_encoder_eager_attention_counts_every_pair():
    """ViT-L/16 widths, 4 layers, B=8 images of 197 tokens, eager attention: per layer Q·Kᵀ
    [128,197,64]x[128,64,197] and P·V [128,197,197]x[128,197,64], no mask. Nothing is
    masked, so each matmul computes all 197² pairs: 2 matmuls x 2·B·H·T·T·d per layer.
    Named attention (as an encoder's eager attention is), the costing used to take the causal
    share (197·198/2 of 197²), as a decoder's."""
    b, h, t, d, layers = 8, 16, 197, 64, 4
    right = layers * 2 * (2 * b * h * t * t * d)
    assert right == 5_086_773_248
    path = H100 / "vit-l-4l_eager_b8_i224_h100.json.gz"
    a = _analysis(str(path))
    assert a.kind.kind == "encoder"
    qk_pv = a.costed["op_name"].eq("aten::bmm") & a.costed["shape"].isin(
        ["128x[197,64]x[64,197]", "128x[197,197]x[197,64]"])
    assert qk_pv.sum() == 2 * layers
    assert a.costed.loc[qk_pv, "flops"].sum() == right
    # the same matmuls (the trace's only bmm) named attention: every pair in an encoder,
    # the causal half in a decoder
    kernels, _, _ = attribute_trace(tr.load_trace(path))
    named = kernels.assign(operator=kernels["operator"].where(
        ~kernels["op_name"].eq("aten::bmm"), "attention"))
    as_encoder = attach.attach_costs(named, None, attach.CostOptions(decoder=False))
    as_decoder = attach.attach_costs(named, None, attach.CostOptions(decoder=True))
    enc = as_encoder[as_encoder["operator"].eq("attention") & as_encoder["cost_kind"].eq("gemm")]
    dec = as_decoder[as_decoder["operator"].eq("attention") & as_decoder["cost_kind"].eq("gemm")]
    assert enc["flops"].sum() == right
    assert dec["flops"].sum() == pytest.approx(right * _pairs(t, t, True) / (t * t))  # old
    assert not enc["shape"].str.contains("causal").any()


@pytest.mark.parametrize("name, b, h, t, d, causal", [
    ("vit_encoder", 2, 4, 17, 16, False),  # 16 patches + CLS, is_causal False
    ("videomae_encoder", 2, 4, 32, 16, False),  # 4 frames / tubelet 2 x (32/16)² patches
    ("bert_encoder", 2, 4, 16, 16, False),
    ("plain_block", 2, 4, 32, 12, True),  # a causal LM block: is_causal True
])
def test_sdpa_attention_of_the_misleading_traces(name, b, h, t, d, causal):
    """Each SDPA call: 2 matmuls x 2·B·H·pairs·d, pairs T² (encoders) or T(T+1)/2 (causal)."""
    a = _analysis(str(MISLEADING / f"{name}_cpu.json.gz"))
    att = a.costed[a.costed["op_name"].eq("aten::scaled_dot_product_attention")]
    assert len(att)
    assert (att["flops"] == 2 * 2 * b * h * _pairs(t, t, causal) * d).all()
    assert set(att["derivation"]) == {"shape"}


# ------------------------------------------------------------------------ MLA: d_qk, d_v
@pytest.mark.parametrize("name, b, t, s, causal", [
    ("deepseek-v2-lite-2l_prefill_b1_t1024", 1, 1024, 1024, True),
    ("deepseek-v2-lite-2l_decode_b8_s1024", 8, 1, 1025, False),
])
def test_mla_attention_takes_d_qk_and_d_v_apart(name, b, t, s, causal):
    """DeepSeek-V2-Lite's SDPA: q, k [B,16,T|S,192] (128 nope + 64 rope), v [B,16,S,128].
    Q·Kᵀ 2·d_qk and P·V 2·d_v per pair: 2·B·H·pairs·(192 + 128) per layer, 2 layers; bytes
    Q read and O written (T·(192 + 128)), K and V read (S·(192 + 128)), bf16, per head.
    Taking d_v = d_qk (4·B·H·pairs·192) was +20%."""
    heads, d_qk, d_v = 16, 192, 128
    pairs = _pairs(t, s, causal)
    flops = 2 * b * heads * pairs * (d_qk + d_v)
    assert flops == {True: 5_373_952_000, False: 83_968_000}[causal]
    nbytes = 2 * (b * heads * t * (d_qk + d_v) + b * heads * s * (d_qk + d_v))
    a = _analysis(str(H100 / f"{name}_h100.json.gz"), _config(name))
    att = a.costed[a.costed["op_name"].eq("aten::scaled_dot_product_attention")]
    assert len(att) == 2
    assert (att["flops"] == flops).all() and (att["bytes"] == nbytes).all()
    assert att["shape"].str.contains("d=192 d_v=128").all()
    old = 4 * b * heads * d_qk * pairs
    assert old / flops == pytest.approx(1.2)


# -------------------------------------------------------------------------- flex attention
def test_flex_attention_template_costed_from_the_layout():
    """torch.compile(flex_attention) with a causal block mask, 2 layers of Qwen2.5-7B
    attention widths (28 heads / 4 kv, d 128), B=1 T=512: one Triton template kernel per layer,
    its mask a Python function (not recorded). Causal pairs 512·513/2 = 131,328; FLOPs
    4·B·n_q·d·pairs per layer = 1,882,718,208; 2 layers 3.77 GFLOP (was 3.7 MFLOP, costed as
    an elementwise kernel over its output). Bytes: Q and O 28·512·128, K and V 4·512·128, bf16."""
    layers, n_q, n_kv, t, d = 2, 28, 4, 512, 128
    pairs = 512 * 513 // 2
    assert pairs == _pairs(t, t, True) == 131_328
    per_layer = 4 * 1 * n_q * d * pairs
    assert layers * per_layer == 3_765_436_416
    a = _analysis(str(H100 / "flex-attention-2l_prefill_b1_t512_h100.json.gz"))
    flex = a.costed[a.costed["op_name"].eq("triton_tem_fused_flex_attention_0")]
    assert len(flex) == layers and set(flex["operator"]) == {"attention"}
    assert (flex["flops"] == per_layer).all()
    assert (flex["bytes"] == 2 * (2 * n_q * t * d + 2 * n_kv * t * d)).all()
    assert set(flex["cost_kind"]) == {"attention"} and set(flex["derivation"]) == {"layout"}
    assert flex["shape"].str.contains("mask values not recorded: causal").all()
    assert not any("generic kernel" in w for w in a.warnings)
    ops = a.operators[a.operators["operator"].eq("attention") & a.operators["layer"].isna()]
    assert ops["derivation"].tolist() == ["layout"]


# --------------------------------------------------------------------- gathers: the rows
def test_compiled_embedding_gather_reads_the_gathered_rows():
    """vLLM gpt-oss-20b decode (B=32): Inductor's triton_poi_fused_0 gathers the 32 token ids'
    rows of the [201088, 2880] bf16 table into [32, 2880] (and casts the [131072, 64] fp32
    RoPE table to bf16). Charged the whole table it read 1.209 GB in 10.6 µs (2152% of the
    MI300X's roof); the rows gathered are 32 x 2880 x 2 B = 184,320 B."""
    a = _analysis(str(GPT_OSS), str(SAMPLES / "serving" / "configs" / "gpt-oss-20b"
                                    / "config.json"), "mi300x")
    row = a.costed[a.costed["op_name"].eq("triton_poi_fused_0")]
    assert len(row) == 1
    rows = 32 * 2880 * 2
    ids, rope_in, rope_out, out = 32 * 4, 131072 * 64 * 4, 131072 * 64 * 2, 32 * 2880 * 2
    assert row["bytes"].iloc[0] == ids + rows + rope_in + rope_out + out == 50_700_416
    assert row["derivation"].iloc[0] == "kernel"
    assert not a.operators["exceeds_roof"].fillna(False).any()
    # the whole model no longer holds the 1.2 GB: ΣFLOPs/Σbytes 14.75 -> 15.83 FLOP/B
    assert a.whole["intensity"] == pytest.approx(15.83, abs=0.01)


# ---------------------------------------------------------- CPU ops: no GPU placement
def test_cpu_trace_gets_no_gpu_placement():
    """qwen-tiny prefill captured on the CPU (no kernel events) with --hardware h100-sxm: its
    times are the host's, so no % of roof (it was placed under the GPU's roof: the issue saw
    "235% of roof" on an A100)."""
    a = _analysis(str(SAMPLES / "qwen-tiny_prefill_b1_t32_l2_cpu.json.gz"), None, "h100-sxm")
    assert a.hardware is None
    assert a.operators["pct_of_roof"].isna().all() and a.operators["bound"].isna().all()
    assert any("no kernel events" in w and "h100-sxm" in w for w in a.warnings)
    assert a.whole["flops"] > 0  # intensities stay


# ------------------------------------------------------------------------- derivation
def test_derivation_column_in_every_table():
    """`derivation` in the costed and operator tables, the CSV/Parquet tables and its values
    from shapes.DERIVATIONS; a serving step's attention is `step`, an uncosted row `unknown`."""
    assert "derivation" in attach.COSTED_COLUMNS and "derivation" in OPERATOR_COLUMNS
    a = _analysis(str(SAMPLES / "serving" / "sglang_qwen3-8b_decode_mi300x"
                      / "sglang_Qwen3-8B_decode.json.gz"),
                  str(SAMPLES / "serving" / "configs" / "qwen3-8b" / "config.json"))
    c = a.costed
    assert set(c["derivation"]) <= set(call.DERIVATIONS)
    assert set(c.loc[c["operator"].eq("attention") & c["cost_kind"].eq("attention"),
                     "derivation"]) == {"step"}
    assert (c.loc[c["flops"].isna(), "derivation"] == "unknown").all()
    tables = report.operators_tables([a])
    assert "derivation" in tables["all"] and tables["aggregate"]["derivation"].notna().all()


def test_step_attention_without_a_model_says_the_model_costs_it():
    """SGLang decode without --model: 22% uncosted; the reason says --model costs it (99.7%)."""
    a = _analysis(str(SAMPLES / "serving" / "sglang_qwen3-8b_decode_mi300x"
                      / "sglang_Qwen3-8B_decode.json.gz"))
    reasons = a.costed.loc[a.costed["operator"].eq("attention"), "uncosted"].dropna()
    assert len(reasons) and reasons.str.contains("give --model").all()


def test_named_attention_costed_by_a_generic_kernel_is_said():
    """The flex trace's attention costed, as before, by the generic Triton rule (its kernel's
    buffers) is a warning naming it, not printed silently as the operator's cost."""
    a = _analysis(str(H100 / "flex-attention-2l_prefill_b1_t512_h100.json.gz"))
    flex = a.costed["op_name"].eq("triton_tem_fused_flex_attention_0")
    generic = a.costed.assign(derivation=a.costed["derivation"].where(~flex, "kernel"),
                              cost_kind=a.costed["cost_kind"].where(~flex, "fused"))
    said = crosscheck.generic_named(generic)
    assert said is not None and "attention" in said
    assert crosscheck.generic_named(a.costed) is None


# ------------------------------------------------------------------------ cross-check
def test_cross_check_names_both_figures():
    """DeepSeek-V2-Lite decode, B=8: HF's MLA runs kv_b_proj over every cached latent (1025
    per sequence), 2·8·1025·512·4096 per layer, where the layout's 2·M·K·N for the pass's 8
    tokens is 2·8·512·4096: 1025x, said with both figures. The prefill (M = 1024 tokens)
    agrees: no line."""
    decode = _analysis(str(H100 / "deepseek-v2-lite-2l_decode_b8_s1024_h100.json.gz"),
                       _config("deepseek-v2-lite-2l_decode_b8_s1024"))
    costed, layout = 2 * 2 * 8 * 1025 * 512 * 4096, 2 * 2 * 8 * 512 * 4096
    line = [w for w in decode.warnings if w.startswith("cross-check: kv_b_proj")]
    assert len(line) == 1
    assert f"{costed:.4g} FLOP costed" in line[0] and f"{layout:.4g} FLOP from the layout" in line[0]
    prefill = _analysis(str(H100 / "deepseek-v2-lite-2l_prefill_b1_t1024_h100.json.gz"),
                        _config("deepseek-v2-lite-2l_prefill_b1_t1024"))
    assert not [w for w in prefill.warnings if w.startswith("cross-check")]


def test_cross_check_attention_against_its_geometry():
    """Qwen2.5-0.5B widths, compiled training step B=4 T=512: cuDNN SDPA with is_causal False
    and a [4,1,512,512] mask (a decoder's causal mask) is the causal count 2·B·n_q·pairs·(d + d)
    = 2·4·14·131,328·128 per layer, which the layout's geometry agrees with; a figure off by
    more than 1% is one line per operator."""
    name = "qwen2.5-0.5b-2l_train_compiled_b4_t512"
    a = _analysis(str(H100 / f"{name}_h100.json.gz"), _config(name))
    fwd = a.costed[a.costed["op_name"].eq("aten::_scaled_dot_product_cudnn_attention")]
    assert (fwd["flops"] == 2 * 4 * 14 * 131_328 * 128).all() and len(fwd) == 2
    assert not [w for w in a.warnings if w.startswith("cross-check: attention")]
    passes = pd.DataFrame({"pass": [0], "B": [4], "T_min": [512], "T_max": [512], "S": [512]})
    doubled = a.costed.assign(flops=np.where(a.costed.index.isin(fwd.index),
                                             2 * a.costed["flops"], a.costed["flops"]))
    lines = crosscheck.against_layout(doubled, a.model, passes)
    assert [w for w in lines if w.startswith("cross-check: attention in pass 0")]


# ------------------------------------------------------- serving steps: the step's own sums
def test_replayed_attention_with_a_captures_shapes_costed_from_the_step():
    """A replayed attention named from a graph capture carries the capture's shapes (its batch),
    not this step's (a vLLM mixed step's attention read 17 GFLOP from them, its
    annotation's Σq·k terms 773-997 GFLOP). The gpt-oss FULL decode with its attention ops
    given a capture's costable shapes (one causal sequence of 32 tokens) is still costed from
    the step annotation: the same FLOPs as the unshaped ops, derivation `step`."""
    gpt_oss = tr.get_model(str(SAMPLES / "serving" / "configs" / "gpt-oss-20b" / "config.json"))
    a, att = analyze_trace_kernels(GPT_OSS, gpt_oss)
    k = att.kernels
    rows = (k["operator"].eq("attention") & k["evidence"].eq("graph_map")).to_numpy(bool)
    assert rows.any()
    fa = {"op_name": "flash_attn::_flash_attn_forward",
          "input_dims": "[[1, 32, 64, 64], [1, 32, 8, 64], [1, 32, 8, 64], [], [], []]",
          "input_types": '["c10::BFloat16", "c10::BFloat16", "c10::BFloat16", "Scalar", '
                         '"Scalar", "Scalar"]',
          "concrete_inputs": '["", "", "", "0.", "0.125", "True"]'}
    shaped = k.copy()
    for col, value in fa.items():
        shaped[col] = shaped[col].astype(object)
        shaped.loc[rows, col] = value
    costed = attach.attach_costs(shaped, att.model)
    step = costed[costed["operator"].eq("attention")]
    before = a.costed[a.costed["operator"].eq("attention")]
    assert set(step["derivation"]) == {"step"}
    assert step["flops"].sum() == before["flops"].sum() > 0
