"""MoE cost formulas (trace_roofline/moe.py) against hand-computed values."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest

from trace_roofline import moe
from trace_roofline.errors import InputError

# Mixtral-8x7B's experts: E=8, top-2, H=4096, I=14336 (bf16, b=2)
MIXTRAL = moe.Experts(num_experts=8, top_k=2, intermediate_size=14336)
H_MIXTRAL = 4096
# a small layer whose every figure is worked out below: E=4, top-2, I=3, H=2
TINY = moe.Experts(num_experts=4, top_k=2, intermediate_size=3)


def test_routed_rows_are_tokens_times_top_k():
    assert moe.routed_rows(5, 2) == 10
    assert moe.routed_rows(0, 4) == 0
    with pytest.raises(ValueError):
        moe.routed_rows(-1, 2)


@pytest.mark.parametrize(("e", "k", "tokens", "expected"), [
    (8, 2, 1, 2.0),  # 8·(1 - 6/8): one token hits exactly its k experts
    (8, 2, 2, 3.5),  # 8·(1 - (3/4)^2) = 8·7/16
    (4, 2, 3, 3.5),  # 4·(1 - (1/2)^3) = 4·7/8
    (60, 4, 1, 4.0),  # Qwen1.5-MoE decode, one sequence: 60·(1 - 56/60)
    (60, 4, 0, 0.0),
    (8, 8, 3, 8.0),  # k = E: every expert, every time
])
def test_expected_active_experts_by_hand(e, k, tokens, expected):
    assert moe.expected_active_experts(e, k, tokens) == pytest.approx(expected, rel=1e-12)


def test_expected_active_experts_is_the_mean_over_every_uniform_routing():
    """Brute force: every assignment of a k-subset to each token, equally likely."""
    for e, k, tokens in [(4, 2, 2), (5, 2, 3), (6, 3, 2)]:
        subsets = list(itertools.combinations(range(e), k))
        total = sum(len(set().union(*pick)) for pick in itertools.product(subsets, repeat=tokens))
        mean = Fraction(total, len(subsets) ** tokens)
        assert moe.expected_active_experts(e, k, tokens) == pytest.approx(float(mean), rel=1e-12)
    # E=4, k=2, two tokens, by hand: same subset 6/36 (2 experts), complementary 6/36 (4),
    # sharing one expert 24/36 (3): (12 + 24 + 72) / 36 = 3
    assert moe.expected_active_experts(4, 2, 2) == pytest.approx(3.0)


def test_expected_active_experts_saturates_at_e():
    assert moe.expected_active_experts(8, 2, 1000) == pytest.approx(8.0)
    assert moe.expected_active_experts(128, 8, 1) == pytest.approx(8.0)  # Qwen3-30B-A3B decode


def test_expected_active_experts_rejects_bad_arguments():
    for e, k, t in [(8, 9, 1), (8, 0, 1), (8, 2, -1)]:
        with pytest.raises(ValueError):
            moe.expected_active_experts(e, k, t)


@pytest.mark.parametrize(("e", "k", "tokens", "low_high"), [
    (8, 2, 1, (2, 2)),
    (8, 2, 3, (2, 6)),  # at most ΣM_e = 6 experts can be hit
    (8, 2, 100, (2, 8)),  # at most E
    (60, 4, 0, (0, 0)),
])
def test_active_experts_range(e, k, tokens, low_high):
    assert moe.active_experts_range(e, k, tokens) == low_high


def test_active_experts_summary_and_assumptions():
    a = moe.active_experts(TINY, tokens=2)
    assert (a.expected, a.low, a.high, a.exact) == (3.0, 2, 4, False)
    assert (a.value("expected"), a.value("low"), a.value("high")) == (3.0, 2.0, 4.0)
    assert a.describe() == "3.00 active experts expected under uniform routing for 2 tokens (range 2-4)"
    with pytest.raises(ValueError):
        a.value("median")
    counted = moe.active_experts(TINY, tokens=2, counted=3)
    assert (counted.low, counted.high, counted.exact) == (3, 3, True)
    assert "counted from the trace" in counted.describe()


def test_gemm_flops_by_hand():
    # ΣM_e = 4 rows, H = 3, I = 5: gate+up 2·4·3·(2·5) = 240, down 2·4·5·3 = 120
    assert moe.gate_up_flops(4, 3, 5) == 240
    assert moe.down_flops(4, 3, 5) == 120


def test_gemm_bytes_by_hand():
    # gate+up: read 4·3 activations + 2 experts · (2·5)·3 weights, write 4·(2·5): 112 el · 2 B
    assert moe.gate_up_bytes(4, 3, 5, active=2, b=2) == (12 + 60 + 40) * 2 == 224
    # down: read 4·5 + 2 experts · 5·3 weights, write 4·3: 62 el · 2 B
    assert moe.down_bytes(4, 3, 5, active=2, b=2) == (20 + 30 + 12) * 2 == 124
    # expected (fractional) active experts scale the weight term only
    assert moe.gate_up_bytes(4, 3, 5, active=2.5, b=2) == (12 + 75 + 40) * 2
    assert moe.expert_weight_bytes(2, 3, 5, 2) == 2 * 3 * 3 * 5 * 2 == 180


def test_tiny_layer_intensity_under_each_assumption():
    # two tokens, top-2: ΣM_e = 4; FLOPs 6·4·2·3 = 144
    assert moe.experts_flops(TINY, hidden=2, tokens=2) == 144
    # expected A = 3: gate+up (8 + 3·12 + 24)·2 = 136, down (12 + 3·6 + 8)·2 = 76 -> 212 B
    assert moe.experts_bytes(TINY, 2, 2, b=2, active=3) == 212
    assert moe.experts_intensity(TINY, 2, 2, 2, "expected") == pytest.approx(144 / 212)
    # low A = 2: 112 + 64 = 176 B; high A = 4: 160 + 88 = 248 B
    assert moe.experts_intensity(TINY, 2, 2, 2, "low") == pytest.approx(144 / 176)
    assert moe.experts_intensity(TINY, 2, 2, 2, "high") == pytest.approx(144 / 248)
    # dense equivalent, intermediate k·I = 6 on 2 tokens: gate, up 2·([2,2]+[2,6]+[2,6]) el,
    # down [2,6]+[6,2]+[2,2] el -> (56 + 28)·2 = 168 B for the same 144 FLOPs
    assert moe.dense_equivalent_intensity(TINY, 2, 2, 2) == pytest.approx(144 / 168)
    assert moe.tokens_per_active_expert(TINY, 2) == pytest.approx(4 / 3)
    assert moe.tokens_per_active_expert(TINY, 2, "low") == pytest.approx(2.0)
    assert math.isnan(moe.tokens_per_active_expert(TINY, 0))


def test_mixtral_decode_one_token_matches_the_dense_equivalent():
    # one token, top-2: A = 2 experts, ΣM_e = 2; FLOPs 6·2·4096·14336
    flops = moe.experts_flops(MIXTRAL, H_MIXTRAL, 1)
    assert flops == 704_643_072
    # gate+up (2·4096 + 2·(2·14336·4096) + 2·28672)·2, down (2·14336 + 2·14336·4096 + 2·4096)·2
    nbytes = (234_946_560 + 117_477_376) * 2
    assert moe.experts_bytes(MIXTRAL, H_MIXTRAL, 1, 2, active=2) == nbytes
    assert moe.experts_intensity(MIXTRAL, H_MIXTRAL, 1, 2) == pytest.approx(flops / nbytes)
    assert moe.experts_intensity(MIXTRAL, H_MIXTRAL, 1, 2) == pytest.approx(0.99971, abs=1e-5)
    # dense SwiGLU with I = 28672, one token: 352,419,840 elements · 2 B
    assert moe.dense_equivalent_intensity(MIXTRAL, H_MIXTRAL, 1, 2) == pytest.approx(
        flops / 704_839_680)


def test_mixtral_many_tokens_fall_e_over_k_below_dense():
    # 256 decode sequences: all 8 experts active (expected 8·(1 - 0.75^256) ≈ 8)
    moe_i = moe.experts_intensity(MIXTRAL, H_MIXTRAL, 256, 2)
    dense_i = moe.dense_equivalent_intensity(MIXTRAL, H_MIXTRAL, 256, 2)
    assert moe.tokens_per_active_expert(MIXTRAL, 256) == pytest.approx(64.0)
    # same FLOPs, so the ratio is of bytes. MoE: ΣM_e = 512 rows · (2H + 3I) = 26,214,400
    # activation elements + 8 experts · 3·H·I = 1,409,286,144 weights. Dense (I = 28672):
    # 3·H·28672 = 352,321,536 weights + 256 tokens · 3·(H + 28672) = 25,165,824 activations
    assert dense_i / moe_i == pytest.approx(1_435_500_544 / 377_487_360, rel=1e-9)  # 3.80


def test_crossing_tokens_by_hand():
    # all 8 experts read: I(T) = 3·T·H·I / (T·(2H + 3I) + 12·H·I) >= R
    #   <=> T >= 12·R·H·I / (3·H·I - R·(2H + 3I)) = 133,177,540,608 / 166,483,968 = 799.94
    assert moe.crossing_tokens(MIXTRAL, H_MIXTRAL, 2, 189.0, "high") == 800
    assert moe.crossing_tokens(MIXTRAL, H_MIXTRAL, 2, 189.0, "expected") == 800
    # only k = 2 experts read: T >= 3·R·H·I / (3·H·I - R·(2H + 3I)) = 199.98
    assert moe.crossing_tokens(MIXTRAL, H_MIXTRAL, 2, 189.0, "low") == 200
    # intensity tends to 6·H·I / ((2H + 3I)·b) = 36 / 26 for H=2, I=3: never reaches 2
    assert moe.crossing_tokens(TINY, 2, 2, 2.0) is None


def test_experts_validation_names_the_parameter():
    with pytest.raises(InputError, match="top_k"):
        moe.Experts(num_experts=8, top_k=9, intermediate_size=1)
    with pytest.raises(InputError, match="top_k"):
        moe.Experts(num_experts=8, top_k=0, intermediate_size=1)
    with pytest.raises(InputError, match="intermediate_size"):
        moe.Experts(num_experts=8, top_k=2, intermediate_size=0)
    with pytest.raises(InputError, match="shared_intermediate_size"):
        moe.Experts(num_experts=8, top_k=2, intermediate_size=1, shared_intermediate_size=-1)
