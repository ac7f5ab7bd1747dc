"""Every formula against a hand-computed value."""

import math

import pytest

from trace_roofline.model import formulas
from trace_roofline.model.formulas import AttentionShape

H, I_FF = 3584, 18944


def test_gemm_decode_q_proj_bf16_with_bias():
    # 2·1·3584·3584 + 1·3584 bias adds
    assert formulas.gemm_flops(1, H, H, bias=True) == 25_690_112 + 3_584
    # (X 3584 + W 12,845,056 + Y 3584 + bias 3584) elements × 2 bytes
    assert formulas.gemm_bytes(1, H, H, 2, bias=True) == 25_711_616
    assert formulas.gemm_intensity(1, H, H, 2, bias=True) == pytest.approx(0.99930, abs=1e-5)


def test_gemm_without_bias_matches_lesson():
    assert formulas.gemm_flops(256, H, H) == 6_576_668_672
    assert formulas.gemm_bytes(256, H, H, 2) == 29_360_128
    assert round(formulas.gemm_intensity(256, H, H, 2), 1) == 224.0
    assert round(formulas.gemm_intensity(256, H, 512, 2), 1) == 162.9
    assert round(formulas.gemm_intensity(256, H, I_FF, 2), 1) == 236.0
    assert round(formulas.gemm_intensity(256, I_FF, H, 2), 1) == 236.0


def test_gemm_dtypes_fp32_and_fp8():
    # fp32, M=1, 4096²: 33,554,432 FLOPs over (4096 + 16,777,216 + 4096)·4 bytes
    assert formulas.gemm_bytes(1, 4096, 4096, 4) == 67_141_632
    assert formulas.gemm_intensity(1, 4096, 4096, 4) == pytest.approx(33_554_432 / 67_141_632)
    # fp8: one byte per element -> ≈ 2 FLOP/byte at M = 1
    assert formulas.gemm_intensity(1, 4096, 4096, 1) == pytest.approx(1.999, abs=1e-3)


def test_attention_decode_gqa_is_seven_for_qwen():
    decode = AttentionShape(28, 4, 1, 2048, 128)
    f = formulas.attention_flops(decode)
    assert f == 4 * 28 * 128 * 2048 == 29_360_128
    assert formulas.attention_bytes(decode, 2, "kv") == 4_194_304
    assert formulas.attention_bytes(decode, 2, "all") == 4_194_304 + 14_336
    assert formulas.attention_intensity(AttentionShape(28, 4, 1, 2048, 128, causal="full"), 2,
                                        "kv") == 7.0
    # S cancels in decode
    assert formulas.attention_intensity(AttentionShape(28, 4, 1, 128, 128, causal="full"), 2,
                                        "kv") == 7.0


def test_attention_gqa_ratio_llama():
    # Llama-3-8B: 32 query heads over 8 KV heads -> 2/2 · 4 = 4 FLOP/byte at decode
    assert formulas.attention_intensity(AttentionShape(32, 8, 1, 4096, 128, causal="full"), 2,
                                        "kv") == 4.0
    # MHA (n_q = n_kv) in fp32: 2/4 = 0.5
    assert formulas.attention_intensity(AttentionShape(8, 8, 1, 4096, 64, causal="full"), 4,
                                        "kv") == 0.5


def test_attention_prefill_conventions():
    # lesson: T = S, every pair, K/V only -> 7·S
    assert formulas.attention_intensity(AttentionShape(28, 4, 512, 512, 128, causal="full"), 2,
                                        "kv") == 3584.0
    # causal pairs for T = S = 4: 1 + 2 + 3 + 4 = 10 (of 16)
    assert formulas.attention_pairs(4, 4, "causal") == 10
    assert formulas.attention_pairs(4, 4, "full") == 16
    # chunked prefill: 2 new queries after 3 cached keys (S = 5): 4 + 5 = 9
    assert formulas.attention_pairs(2, 5, "causal") == 9
    assert formulas.attention_pairs(1, 2048, "causal") == 2048
    f_full = formulas.attention_flops(AttentionShape(28, 28, 8, 8, 128, batch=2, causal="full"))
    f_causal = formulas.attention_flops(AttentionShape(28, 28, 8, 8, 128, batch=2))
    assert f_causal / f_full == 36 / 64
    with pytest.raises(ValueError):
        formulas.attention_pairs(1, 1, "bogus")
    with pytest.raises(ValueError):
        formulas.attention_bytes(AttentionShape(1, 1, 1, 1, 1), 2, "bogus")


def test_elementwise_and_roofline_helpers():
    # RMSNorm over [1, 3584] bf16: read x and weight, write y
    assert formulas.elementwise_bytes(2 * H, H, 2) == 21_504
    assert formulas.ridge(990e12, 4.8e12) == pytest.approx(206.25)
    assert formulas.attainable(1.0, 990e12, 4.8e12) == 4.8e12
    assert formulas.attainable(1000.0, 990e12, 4.8e12) == 990e12
    assert formulas.bound(7.0, 206.25) == "memory"
    assert formulas.bound(206.25, 206.25) == "compute"


def test_m_star_matches_closed_form():
    ridge = 165.2e12 / 1008e9
    k = n = H
    # 2MKN ≥ R·b·(MK + KN + MN)  =>  M ≥ R·b·KN / (2KN − R·b·(K + N))
    closed = math.ceil(ridge * 2 * k * n / (2 * k * n - ridge * 2 * (k + n)))
    assert formulas.m_star(k, n, 2, ridge) == closed == 181
    # at M*, compute-bound; one below, memory-bound
    assert formulas.gemm_intensity(closed, k, n, 2) >= ridge > formulas.gemm_intensity(closed - 1, k, n, 2)
    # a thin GEMM that can never reach the ridge: limit 2KN/((K+N)b) = 2·64·64/(128·2) = 32
    assert formulas.m_star(64, 64, 2, ridge) is None


def test_s_star_lesson_convention():
    ridge = 165.2e12 / 1008e9  # 163.9: 7·S ≥ 163.9 -> S = 24
    assert formulas.s_star(AttentionShape(28, 4, 0, 0, 128, causal="full"), 2, ridge, "kv") == 24
