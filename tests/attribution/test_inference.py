"""attribution/inference.py: a layer's linears from the attention's geometry and GEMM counts,
on counts written out by hand from each family's config (2 layers, 1 forward pass: 2 calls)."""

from __future__ import annotations

import pandas as pd
import pytest

from trace_roofline.attribution.inference import Geometry, attention_geometry, infer_layout

CALLS = 2

# GPT-2-medium: H 1024, 16 heads x 64, Conv1D c_attn (H, 3H), c_proj, c_fc (H, 4H), c_proj
GPT2 = {(1024, 3072): 2, (1024, 1024): 2, (1024, 4096): 2, (4096, 1024): 2, (1024, 50257): 1}
# DeepSeek-V2-Lite: H 2048, 16 heads, qk 192 (128 nope + 64 rope), v 128, kv_lora_rank 512;
# layer 0 dense (I 10944), layer 1 MoE (its shared experts' 2816, the routed ones elsewhere)
MLA = {(2048, 3072): 2, (2048, 576): 2, (512, 4096): 2, (2048, 2048): 2, (2048, 10944): 2,
       (10944, 2048): 1, (2048, 5632): 1, (2816, 2048): 1, (2048, 102400): 1}
# gpt-oss-20b: H 2880, 64 heads x 64, 8 KV heads; no dense MLP (experts counted apart)
GPT_OSS = {(2880, 4096): 2, (2880, 512): 4, (4096, 2880): 2, (2880, 201088): 1}
# Llama-3-8B under max-autotune: k and v in one GEMM (H, 2·1024), q and o share (H, H)
LLAMA_KV = {(4096, 4096): 4, (4096, 2048): 2, (4096, 28672): 2, (14336, 4096): 2,
            (4096, 128256): 1}


@pytest.mark.parametrize("counts, geometry, h, want", [
    (GPT2, Geometry(16, 16, 64, 64), 1024,
     {"qkv_proj": (1024, 3072), "o_proj": (1024, 1024), "up_proj": (1024, 4096),
      "down_proj": (4096, 1024), "lm_head": (1024, 50257)}),
    (MLA, Geometry(16, 16, 192, 128), 2048,
     {"q_proj": (2048, 3072), "kv_a_proj_with_mqa": (2048, 576), "kv_b_proj": (512, 4096),
      "o_proj": (2048, 2048), "gate_proj": (2048, 10944), "up_proj": (2048, 10944),
      "down_proj": (10944, 2048), "lm_head": (2048, 102400)}),
    # (an attention op may read K and V expanded to every query head: 64 here, not 8)
    (GPT_OSS, Geometry(64, 64, 64, 64), 2880,
     {"q_proj": (2880, 4096), "k_proj": (2880, 512), "v_proj": (2880, 512),
      "o_proj": (4096, 2880), "lm_head": (2880, 201088)}),
    (LLAMA_KV, Geometry(32, 32, 128, 128), 4096,
     {"q_proj": (4096, 4096), "o_proj": (4096, 4096), "gate_up_proj": (4096, 28672),
      "down_proj": (14336, 4096), "lm_head": (4096, 128256)}),
], ids=["gpt2", "mla", "gpt-oss", "llama-fused-kv"])
def test_layouts_by_hand(counts, geometry, h, want):
    assert infer_layout(counts, geometry, h, CALLS) == want


def test_no_lm_head_no_decoder():
    """BERT's encoder layer has q/k/v, o and an ungated MLP too: without an lm_head nothing is
    inferred."""
    bert = {(1024, 1024): 8, (1024, 4096): 2, (4096, 1024): 2}
    assert infer_layout(bert, Geometry(16, 16, 64, 64), 1024, CALLS) is None


def test_no_attention_form_no_layout():
    """GEMMs whose shapes no attention form of the geometry explains: None."""
    assert infer_layout({(512, 512): 4, (512, 2048): 1}, Geometry(8, 8, 128, 128), 512,
                        CALLS) is None


def test_geometry_from_an_sdpa_op_and_from_eager_matmuls():
    sdpa = attention_geometry(
        pd.Series(["aten::_scaled_dot_product_flash_attention", "aten::mm"]),
        pd.Series(["[[1, 16, 512, 192], [1, 16, 512, 192], [1, 16, 512, 128], [], []]",
                   "[[512, 2048], [2048, 3072]]"]))
    assert sdpa == Geometry(16, 16, 192, 128) and (sdpa.q, sdpa.o) == (3072, 2048)
    eager = attention_geometry(pd.Series(["aten::matmul"] * 3),
                               pd.Series(["[[1, 64, 1, 64], [1, 64, 64, 514]]",
                                          "[[1, 64, 1, 514], [1, 64, 514, 64]]",
                                          "[[1, 1, 2880], [2880, 201088]]"]))
    assert eager == Geometry(64, 64, 64, 64)
    assert attention_geometry(pd.Series(["aten::mm"]), pd.Series(["[[2, 3], [3, 4]]"])) is None
