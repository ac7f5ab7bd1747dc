"""MoE cost formulas (trace_roofline/moe.py) against hand-computed values."""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import math
from fractions import Fraction
from pathlib import Path

import pandas as pd
import pytest

from tests.builders import BF, F32, SAMPLES, Op, attributed, by_prefix, concat, read, walk
from trace_roofline.attribution import layer_linears
from trace_roofline.attribution.attribute import attribute
from trace_roofline.costs import calculator, model_level
from trace_roofline.costs.attach import attach_costs
from trace_roofline.errors import InputError
from trace_roofline.model import moe
from trace_roofline.model.hardware import Hardware
from trace_roofline.model.models import ModelSpec, from_hf_config, get_model
from trace_roofline.options import AnalysisOptions
from trace_roofline.outputs import report
from trace_roofline.pipeline import analyze
from trace_roofline.roofline import Analysis
from trace_roofline.trace import load_trace

I32 = "int"

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


# ----------------------------------------------------------------------------- models
def test_presets_carry_the_checkpoints_experts():
    mixtral = get_model("mixtral-8x7b")
    assert (mixtral.experts.num_experts, mixtral.experts.top_k,
            mixtral.experts.intermediate_size) == (8, 2, 14336)
    assert len(mixtral.sparse_layers) == mixtral.num_layers == 32
    qwen = get_model("qwen1.5-moe-a2.7b")
    assert qwen.experts == moe.Experts(60, 4, 1408, 5632, True, False)
    assert qwen.moe_linears()["shared_expert_gate"] == (2048, 1, False)
    assert get_model("qwen3-30b-a3b").experts == moe.Experts(128, 8, 768)
    assert get_model("qwen2.5-7b").sparse_layers == ()


@pytest.mark.parametrize(("cfg", "experts", "sparse"), [
    ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
      "num_experts_per_tok": 2}, moe.Experts(8, 2, 14336), 4),
    ({"architectures": ["Qwen2MoeForCausalLM"], "num_experts": 60, "num_experts_per_tok": 4,
      "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
      "norm_topk_prob": False, "decoder_sparse_step": 2, "mlp_only_layers": [3]},
     moe.Experts(60, 4, 1408, 5632, True, False), 1),  # layers 1 and 3 by the step, not 3
    ({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128, "num_experts_per_tok": 8,
      "moe_intermediate_size": 768, "norm_topk_prob": True}, moe.Experts(128, 8, 768), 4),
    ({"architectures": ["Qwen2ForCausalLM"]}, None, 0),
])
def test_hf_config_experts(tmp_path, cfg, experts, sparse):
    base = {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 14336,
            "num_hidden_layers": 4, "vocab_size": 100}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(base | cfg))
    m = from_hf_config(path)
    assert m.experts == experts
    assert len(m.sparse_layers) == sparse


def test_hf_config_bad_top_k_is_one_line_input_error(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4,
                                "intermediate_size": 96, "num_hidden_layers": 2,
                                "num_local_experts": 8, "num_experts_per_tok": 9}))
    with pytest.raises(InputError, match="config.json.*top_k"):
        from_hf_config(path)


# ----------------------------------------------------------------------------- costs
# A tiny MoE layer: H=8, E=4 experts of I=3, top-2; two tokens -> ΣM_e = 4 rows, expected
# active 4·(1 - (1/2)^2) = 3 experts, range [2, 4].
TINY_MODEL = ModelSpec("tiny-moe", 8, 2, 1, 4, 16, 4, 32, False,
                       experts=moe.Experts(4, 2, 3))
ROUTER = Op("router", "aten::mm", [[2, 8], [8, 4]], [BF, BF])
GATE_UP = [[2, 8], [4, 6, 8], [4, 8, 3], [2, 2], [2, 2], []]
GATE_UP_TYPES = [BF, BF, BF, F32, I32, ""]


def _costed(*parts: list[Op], first_ops=None) -> pd.DataFrame:
    frames, event = [], 0
    for i, ops in enumerate(parts):
        first = first_ops[i] if first_ops else 1000 + 100 * i
        frames.append(attributed(ops, first_event=event, first_op=first, t0=100.0 * i))
        event += 100
    return attach_costs(concat(*frames), TINY_MODEL)


def test_grouped_mm_weights_once_per_expected_active_expert():
    c = _costed([ROUTER,
                 Op("experts_gate_up", "aten::_grouped_mm", [[4, 8], [4, 8, 6], [4], [], []],
                    [BF, BF, "int", "", ""]),
                 Op("experts_down", "aten::_grouped_mm", [[4, 3], [4, 3, 8], [4], [], []],
                    [BF, BF, "int", "", ""])])
    gate_up, down = c.iloc[1], c.iloc[2]
    # 2·4·8·6; activations (4·8 + 4·6)·2 B + 3 experts · 8·6 weights · 2 B
    assert (gate_up["flops"], gate_up["bytes"]) == (384, 112 + 288)
    # 2·4·3·8; (4·3 + 4·8)·2 + 3 · 3·8 · 2
    assert (down["flops"], down["bytes"]) == (192, 88 + 144)
    assert (gate_up["experts_active"], gate_up["experts_active_low"],
            gate_up["experts_active_high"]) == (3.0, 2.0, 4.0)
    assert c.loc[0, "flops"] == 2 * 2 * 8 * 4  # the router GEMM is a plain GEMM


def test_fused_experts_halves_and_moe_forward_need_the_model_for_shapes():
    fused = ("vllm::inplace_fused_experts", GATE_UP, GATE_UP_TYPES)
    c = _costed([ROUTER], [Op("experts_gate_up", *fused)], [Op("experts_down", *fused)],
                first_ops=[1000, 2000, 2000])  # one op, split in two instances
    assert list(c["op_id"].iloc[1:]) == [2000, 2000]
    assert (c.iloc[1]["flops"], c.iloc[1]["bytes"]) == (384, 112 + 288)  # as the grouped GEMM
    assert (c.iloc[2]["flops"], c.iloc[2]["bytes"]) == (192, 88 + 144)
    newer = Op("experts_gate_up", "vllm::moe_forward", [[2, 8], [2, 4], []], [BF, BF, ""])
    c = _costed([ROUTER, newer])
    assert (c.iloc[1]["flops"], c.iloc[1]["bytes"]) == (384, 112 + 288)  # E from logits, I, k
    without = attach_costs(attributed([newer]), None).iloc[0]  # from the model
    assert math.isnan(without["flops"]) and "--model" in without["uncosted"]


def test_engine_moe_kernels_hand_computed():
    c = _costed([
        Op("router", "_moe_C::topk_softmax", [[2, 2], [2, 2], [2, 2], [2, 4]],
           [F32, I32, I32, F32]),
        Op("moe_dispatch", "_moe_C::moe_align_block_size", [[2, 2], [], [], [10], [3], [1]],
           [I32, "Scalar", "Scalar", I32, I32, I32]),
        Op("experts_act", "_C::silu_and_mul", [[4, 3], [4, 6]], [BF, BF]),
        Op("moe_combine", "_moe_C::moe_sum", [[2, 2, 8], [2, 8]], [BF, BF]),
    ])
    got = list(zip(c["flops"], c["bytes"], strict=True))
    # softmax 5·8 FLOPs, logits 8·4 B read, three [2,2] outputs of 4 B written
    # ids 4 read, 10 + 3 + 1 written, int32; silu 4 + mul 1 per output, [4,6] read, [4,3]
    # written; 2·2·8 read and added, 2·8 written
    assert got == [(40, 32 + 48), (0, (4 + 10 + 3 + 1) * 4), (60, (24 + 12) * 2), (32, 96)]


def test_batched_mm_weight_gather_reads_active_writes_every_pair():
    c = _costed([ROUTER,
                 Op("experts_gate_up", "aten::index", [[4, 6, 8], []], [BF, ""]),
                 Op("experts_gate_up", "aten::bmm", [[4, 6, 8], [4, 8, 1]], [BF, BF])])
    gather, bmm = c.iloc[1], c.iloc[2]
    # 3 active experts' [6,8] read, 4 pair copies written, 4 int64 ids
    assert (gather["cost_kind"], gather["bytes"]) == ("copy", (3 + 4) * 48 * 2 + 4 * 8)
    assert gather["experts_active"] == 3.0
    assert (bmm["flops"], bmm["bytes"]) == (2 * 4 * 6 * 8, 4 * (48 + 8 + 6) * 2)


def test_loop_counts_active_experts_and_sizes_its_gathers():
    ops = [ROUTER, Op("moe_dispatch", "aten::index", [[2, 8], []], [BF, ""])]
    for m_e in (2, 1, 1):  # three hit experts, ΣM_e = 4
        ops += [Op("experts_gate_up", "aten::mm", [[m_e, 8], [8, 6]], [BF, BF]),
                Op("experts_down", "aten::mm", [[m_e, 3], [3, 8]], [BF, BF]),
                Op("moe_combine", "aten::index", [[2, 2, 1], []], [F32, ""])]
    c = _costed(ops)
    first = c[c["operator"].eq("experts_gate_up")].iloc[0]
    assert (first["experts_active"], first["experts_active_low"]) == (3.0, 3.0)
    assert c.loc[c["operator"].eq("experts_down"), "experts_active"].notna().sum() == 1
    # the gather feeding the first expert (M_e = 2): 2 rows of 8 read and written + 2 ids
    assert c.iloc[1]["bytes"] == (16 + 16) * 2 + 2 * 8
    # the routing-weight gathers after each down, w[tokens, slots, None] of [2,2,1] fp32:
    # one weight per routed row (M_e) read and written + M_e ids
    combine = c[c["operator"].eq("moe_combine")]["bytes"].tolist()
    assert combine == [(2 + 2) * 4 + 16, (1 + 1) * 4 + 8, (1 + 1) * 4 + 8]
    assert (c.loc[c["operator"].eq("experts_gate_up"), "flops"].sum()
            == moe.gate_up_flops(4, 8, 3))


def test_mlp_costs_from_the_model_by_hand():
    dense = model_level.mlp_costs(TINY_MODEL, tokens=2, sparse=False).groupby("operator")
    # gate, up [2,8]x[8,16]; down [2,16]x[16,8]; silu 4·32 + mul 32
    assert dense["flops"].sum().to_dict() == {"act": 160, "down_proj": 512, "gate_proj": 512,
                                              "up_proj": 512}
    sparse = model_level.mlp_costs(TINY_MODEL, tokens=2, sparse=True).groupby("operator")
    flops, nbytes = sparse["flops"].sum(), sparse["bytes"].sum()
    assert flops["experts_gate_up"] == 384 and flops["experts_down"] == 192
    assert nbytes["experts_gate_up"] == 112 + 288  # as the traced grouped GEMM, A = 3
    assert flops["router"] == 128 and flops["experts_act"] == 5 * 4 * 3


# ----------------------------------------------------------------------------- real traces
MOE = SAMPLES / "moe"
TRACES = sorted(MOE.glob("*.json.gz"))
ROUTED = {"router", "moe_dispatch", "experts_gate_up", "experts_act", "experts_down",
          "moe_combine"}


def _preset(path: Path) -> str:
    return path.name.removeprefix("hf-moe-").removeprefix("synthetic_vllm_fused_moe_").split(
        "-2l_")[0]


class _Analysed(dict):
    """An MoE sample trace's name -> its analysis with its preset, made on first use."""

    def __missing__(self, name: str) -> Analysis:
        model = get_model(_preset(MOE / name))
        self[name] = analyze(attribute(load_trace(MOE / name), model), model, None)
        return self[name]


@pytest.fixture(scope="module")
def analysed() -> dict[str, Analysis]:
    """The MoE sample traces analysed with their presets (each once for the module)."""
    return _Analysed()


@pytest.mark.parametrize("path", walk(TRACES, by_prefix, lambda p: p.name))
def test_every_layer_names_router_experts_and_shared(path, analysed):
    c = analysed[path.name].costed
    layers = c[c["layer"].notna()].groupby(["step", "layer"], dropna=False)["operator"]
    shared = {"shared_gate_up_proj" if "synthetic" in path.name else "shared_gate_proj",
              "shared_down_proj"}
    want = ROUTED | (shared if "qwen1.5" in path.name else set())
    for key, ops in layers:
        assert want <= set(ops), (key, want - set(ops))
    assert not (c["operator"].isin(["gate_proj", "up_proj", "down_proj", "gate_up_proj"])).any()


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name)
def test_expert_flops_are_exact(path, analysed):
    """Σ gate_up FLOPs = 2·ΣM_e·H·2I and Σ down = 2·ΣM_e·I·H, ΣM_e = top_k x the tokens of
    every router GEMM (the router's M), whatever the form."""
    a = analysed[path.name]
    c, e, h = a.costed, a.model.experts, a.model.hidden_size
    tokens = c.loc[c["operator"].eq("router") & c["cost_kind"].eq("gemm") & (c["N"] > 1), "M"]
    rows = int(tokens.sum()) * e.top_k
    flops = c.groupby("operator")["flops"].sum()
    assert flops["experts_gate_up"] == moe.gate_up_flops(rows, h, e.intermediate_size)
    assert flops["experts_down"] == moe.down_flops(rows, h, e.intermediate_size)


@pytest.mark.parametrize("path", walk([p for p in TRACES if "qwen3" not in p.name], by_prefix,
                                      lambda p: p.name))
def test_no_elementwise_operator_holds_more_than_its_usual_share(path, analysed):
    """The issue: residual held 50-61% (Qwen1.5-MoE) and post_attention_norm 86-89% (Mixtral)."""
    ops = analysed[path.name].operators
    share = ops[ops["layer"].isna()].groupby("operator")["time_share"].sum()
    for op in ("residual", "input_norm", "post_attention_norm", "final_norm", "act", "rope"):
        assert share.get(op, 0.0) < 0.08, (op, share.get(op))
    experts = share.get("experts_gate_up", 0) + share.get("experts_down", 0)
    assert experts > 0.15


def test_active_experts_per_form(analysed):
    """Loop: counted; grouped_mm, batched_mm, fused: the uniform-routing expectation."""
    def summary(name: str) -> dict:
        return analysed[name].moe[next(iter(analysed[name].moe))]

    grouped = summary("hf-moe-mixtral-8x7b-2l_decode_b4_s512_groupedmm_h200.json.gz")
    # 4 tokens, top-2 of 8: 8·(1 - (3/4)^4) = 5.46875
    assert grouped["experts_active"] == pytest.approx(5.46875)
    assert (grouped["assumption"], grouped["experts_active_low"],
            grouped["experts_active_high"]) == ("uniform routing", 2.0, 8.0)
    assert grouped["tokens_per_active_expert"] == pytest.approx(8 / 5.46875)
    assert grouped["dense_equivalent_intensity"] == pytest.approx(
        moe.dense_equivalent_intensity(get_model("mixtral-8x7b").experts, 4096, 4, 2))
    assert summary("hf-moe-mixtral-8x7b-2l_decode_b4_s512_batchedmm_h200.json.gz")[
        "experts_active"] == pytest.approx(5.46875)
    loop = summary("hf-moe-mixtral-8x7b-2l_decode_b4_s512_eager_h200.json.gz")
    costed = analysed["hf-moe-mixtral-8x7b-2l_decode_b4_s512_eager_h200.json.gz"].costed
    downs = costed[costed["operator"].eq("experts_down")].groupby(["step", "layer"]).size()
    assert loop["assumption"] == "counted"
    assert loop["experts_active"] == pytest.approx(downs.mean())  # one down GEMM per expert
    vllm = summary("synthetic_vllm_fused_moe_mixtral-8x7b-2l_decode_b8_s512.json.gz")
    assert vllm["experts_active"] == pytest.approx(8 * (1 - 0.75 ** 8))


def test_report_prints_the_assumption_and_the_dense_equivalent(analysed):
    names = {"hf-moe-mixtral-8x7b-2l_decode_b4_s512_groupedmm_h200.json.gz": "uniform routing",
             "hf-moe-qwen1.5-moe-a2.7b-2l_decode_b4_s512_eager_h200.json.gz": "counted from"}
    for name, said in names.items():
        text = report.terminal_table([analysed[name]])
        assert said in text and "dense MLP doing the same FLOPs per token" in text
        entry = json.loads(report.report_json([analysed[name]]))["traces"][0]
        assert "explanation" in entry["moe"]["decode"]
        gate_up = next(o for o in entry["operators"]
                       if o["operator"] == "experts_gate_up" and o["layer"] is None)
        assert gate_up["experts_active"] > 0 and gate_up["experts_active_low"] >= 2


def test_layers_extrapolate_sparse_and_dense_layers():
    path = MOE / "hf-moe-qwen1.5-moe-a2.7b-2l_decode_b4_s512_groupedmm_h200.json.gz"
    model = get_model("qwen1.5-moe-a2.7b")
    att = attribute(load_trace(path), model)
    every = analyze(att, model, None, AnalysisOptions(layers=24)).extrapolated.set_index("operator")
    # 4 tokens per step, top-4, H 2048, I 1408: 24 sparse layers of 2·16·2048·2816
    assert every.loc["experts_gate_up", "flops"] == 24 * moe.gate_up_flops(16, 2048, 1408)
    assert every.loc["experts_gate_up", "source"] == "trace x12"
    half = dataclasses.replace(model, decoder_sparse_step=2)  # layers 1, 3, ... sparse
    ext = analyze(att, half, None, AnalysisOptions(layers=24)).extrapolated.set_index("operator")
    assert ext.loc["experts_gate_up", "flops"] == 12 * moe.gate_up_flops(16, 2048, 1408)
    assert ext.loc["experts_gate_up", "source"] == "trace x6"
    assert ext.loc["q_proj", "source"] == "trace x12"  # attention runs in every layer
    # the 12 dense layers' MLP (intermediate 5632) from the model: 2·4·2048·5632 each
    assert ext.loc["down_proj", "source"] == "model"
    assert ext.loc["down_proj", "flops"] == 12 * 2 * 4 * 5632 * 2048


def test_intensity_calculator_moe_section():
    hw = Hardware("ridge-189", {"bf16": 189e12}, 1e12, "test")
    table = calculator.intensity_table(get_model("mixtral-8x7b"), hw, calculator.Sweep(ms=(1, 8)))
    m = table["moe"]
    assert m["crossing_tokens"] == {"expected": 800, "low": 200, "high": 800}  # by hand above
    assert [r["experts_active"] for r in m["rows"]] == pytest.approx([2.0, 8 * (1 - 0.75 ** 8)])
    assert "gate_proj" not in {g["operator"] for g in table["gemm"]}  # no dense MLP in Mixtral
    text = calculator.format_intensity(table)
    assert "routed experts: 8 experts, top-2" in text and "compute-bound from 800 tokens" in text
    assert calculator.intensity_table(get_model("qwen2.5-7b"), hw)["moe"] is None


def test_dense_and_shared_mlp_named_by_their_layer(kineto, trace_file):
    """A shared expert as wide as the dense MLP (Qwen1.5-MoE): the same GEMM shapes are the
    shared expert's in a layer with a router and the dense MLP's in a layer without one."""
    model = ModelSpec("tiny-mixed", 8, 2, 1, 4, 16, 2, 32, False, decoder_sparse_step=2,
                      experts=moe.Experts(6, 2, 3, shared_intermediate_size=16))
    t = 2

    def mm(k: int, n: int) -> None:
        with kineto.op("aten::mm", [[t, k], [k, n]], [BF, BF]):
            kineto.kernel("gemm", 2.0)

    with kineto.ann("ProfilerStep#1"):
        for sparse in (False, True):
            mm(8, 8), mm(8, 4), mm(8, 4)  # q, k, v
            with kineto.op("aten::scaled_dot_product_attention",
                           [[1, 2, t, 4], [1, 1, t, 4], [1, 1, t, 4]], [BF, BF, BF]):
                kineto.kernel("flash", 2.0)
            mm(8, 8)  # o
            mm(8, 16), mm(8, 16), mm(16, 8)  # gate, up, down: dense MLP or shared expert
            if sparse:
                mm(8, 6)  # router
                for w in ([6, 8, 6], [6, 3, 8]):
                    with kineto.op("aten::_grouped_mm", [[4, w[1]], w, [6], [], []],
                                   [BF, BF, "int", "", ""]):
                        kineto.kernel("grouped", 2.0)
    a = attribute(load_trace(trace_file(kineto)), model)
    names = a.groupby("layer")["operator"].agg(lambda s: list(dict.fromkeys(s)))
    assert names[0] == ["q_proj", "k_proj", "v_proj", "attention", "o_proj", "gate_proj",
                        "up_proj", "down_proj"]
    assert names[1] == ["q_proj", "k_proj", "v_proj", "attention", "o_proj", "shared_gate_proj",
                        "shared_up_proj", "shared_down_proj", "router", "experts_gate_up",
                        "experts_down"]


def test_synthetic_vllm_traces_are_what_their_generator_writes(tmp_path):
    """The committed synthetic traces are reproducible from workloads/synth_fused_moe.py."""
    from workloads import synth_fused_moe

    assert synth_fused_moe.main(["--out", str(tmp_path)]) == 0
    written = sorted(tmp_path.glob("*.json.gz"))
    assert [p.name for p in written] == sorted(p.name for p in MOE.glob("synthetic_*"))
    for p in written:
        assert p.read_bytes() == (MOE / p.name).read_bytes(), p.name
        doc = read(p)
        assert doc["trace_roofline_workload"]["synthetic"] is True


def test_tensor_parallel_shard_splits_every_expert():
    """vLLM's FusedMoE without expert parallelism: each rank holds every expert's I/t."""
    rank = get_model("qwen1.5-moe-a2.7b").shard(4)
    assert rank.experts == moe.Experts(60, 4, 352, 1408, True, False)
    assert rank.moe_linears()["experts_gate_up"] == (2048, 704, False)
    assert rank.moe_linears()["router"] == (2048, 60, False)  # replicated
    odd = dataclasses.replace(get_model("qwen1.5-moe-a2.7b"), experts=moe.Experts(60, 4, 1410))
    with pytest.raises(InputError, match="expert intermediate"):
        odd.shard(4)


def test_grouped_mm_reads_only_active_experts_weights_on_the_h200():
    """Measured (Nsight Compute, H200, workloads/moe_grouped_ncu.py): torch's grouped GEMM at
    Mixtral's shapes reads A x one expert's weights when A of the 8 experts have rows."""
    lines = (SAMPLES / "provenance" / "moe_grouped_mm_ncu_h200.csv").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    ncu = pd.read_csv(io.StringIO("\n".join(lines[start:])), skiprows=[1], thousands=",")
    grouped = ncu[ncu["Kernel Name"].str.startswith("void cutlass::device_kernel")]
    reads = grouped["dram__bytes_read.sum"].astype(float).to_numpy()
    assert len(reads) == 16  # (gate_up, down) x A in (1, 2, 4, 8), twice
    h, i = 4096, 14336
    expected = [a * w for a in (1, 2, 4, 8) * 2 for w in (2 * i * h * 2, i * h * 2)]
    assert reads / expected == pytest.approx(1.0, abs=0.004)


def test_grouped_mm_trace_without_a_model():
    """No --model: the experts from _grouped_mm's [E, K, N] weights, the router (H, E) and
    top-k from the trace's own topk call."""
    path = MOE / "hf-moe-mixtral-8x7b-2l_decode_b4_s512_groupedmm_h200.json.gz"
    a = analyze(attribute(load_trace(path)), None, None)
    layers = a.costed[a.costed["layer"].notna()].groupby(["step", "layer"])["operator"]
    assert all(set(ops) >= ROUTED for _, ops in layers)
    s = a.moe["decode"]
    assert (s["top_k"], s["experts"], s["assumption"]) == (2, 8.0, "uniform routing")
    assert s["experts_active"] == pytest.approx(5.46875)


HF_TRACES = [p for p in TRACES if p.name.startswith("hf-moe-")] + sorted(
    (SAMPLES / "cuda_graphs").glob("hf-moe-*_mapping_h200.json.gz"))


@pytest.mark.parametrize("path", walk(HF_TRACES, lambda p: (p.parent, by_prefix(p)),
                                      lambda p: p.name))
def test_without_a_model_every_kernel_is_named_as_with_its_preset(path):
    """No --model: the linears inferred from the trace's GEMM counts name every kernel, and
    give it its layer, as the preset does, in every form (eager loop, grouped_mm, batched_mm).
    Before, Qwen3-MoE's q_proj and o_proj were an MLP's gate/up and down, Qwen1.5-MoE's shared
    expert gate (H, 1) was k_proj, and 98% of Mixtral's batched_mm step was `attention`."""
    trace = load_trace(path)
    inferred, preset = attribute(trace), attribute(trace, get_model(_preset(path)))
    assert inferred["operator"].astype(str).tolist() == preset["operator"].astype(str).tolist()
    assert inferred["layer"].equals(preset["layer"])


def _counts(counts: dict[tuple[int, int], int]) -> pd.DataFrame:
    return pd.DataFrame([(k, n, c) for (k, n), c in counts.items()], columns=["K", "N", "count"])


# GEMM (K, N) counts of real 2-layer decode traces (3 passes: 6 attention calls; Qwen1.5: 4)
QWEN3_MOE = {(2048, 4096): 6, (4096, 2048): 6, (2048, 512): 12, (2048, 128): 6,
             (2048, 151936): 3}
MIXTRAL_LOOP = {(4096, 4096): 12, (4096, 1024): 12, (4096, 8): 6, (4096, 28672): 33,
                (14336, 4096): 33, (4096, 32000): 3}
QWEN15_LOOP = {(2048, 2048): 16, (2048, 5632): 8, (5632, 2048): 4, (2048, 2816): 58,
               (1408, 2048): 58, (2048, 60): 4, (2048, 1): 4, (2048, 151936): 2}


def test_inferred_attention_without_a_dense_mlp():
    """Qwen3-MoE: q (2048 -> 4096) runs as often as o (4096 -> 2048), not twice as often, so
    the pair is attention, not an MLP; k and v run 2 x 6 times, the router (2048, 128) once
    per call. Without the attention count an MLP is required."""
    got = layer_linears.infer_linears(_counts(QWEN3_MOE), calls=6)
    assert got == {"q_proj": (2048, 4096), "k_proj": (2048, 512), "v_proj": (2048, 512),
                   "o_proj": (4096, 2048), "lm_head": (2048, 151936)}
    assert layer_linears.infer_linears(_counts(QWEN3_MOE)) is None


def test_inferred_expert_loop_runs_more_often_than_the_attention():
    """Mixtral's eager loop: the fused gate_up (4096, 28672) and down (14336, 4096) of the 33
    hit experts of 6 layer passes are experts, (4096, 8) the router; q and o share (4096,
    4096). Before, the unit was the down count (33), so q_proj looked fused and the lm_head
    (4096, 32000) became qkv_proj."""
    assert layer_linears.infer_linears(_counts(MIXTRAL_LOOP), calls=6) == {
        "q_proj": (4096, 4096), "k_proj": (4096, 1024), "v_proj": (4096, 1024),
        "o_proj": (4096, 4096), "experts_gate_up": (4096, 28672),
        "experts_down": (14336, 4096), "router": (4096, 8), "lm_head": (4096, 32000)}


def test_inferred_shared_expert_and_heads_without_gqa():
    """Qwen1.5-MoE: 16 kv heads of 16, so q, k, v and o all are (2048, 2048), 4 x 4 times; the
    shared expert (5632) runs once per call, the 58 hit experts (1408, fused 2816) more often;
    (2048, 1) is the shared expert's gate, (2048, 60) the router. Before, k and v were
    (2048, 1)."""
    assert layer_linears.infer_linears(_counts(QWEN15_LOOP), calls=4) == {
        "q_proj": (2048, 2048), "k_proj": (2048, 2048), "v_proj": (2048, 2048),
        "o_proj": (2048, 2048), "gate_proj": (2048, 5632), "up_proj": (2048, 5632),
        "down_proj": (5632, 2048), "experts_gate_up": (2048, 2816),
        "experts_down": (1408, 2048), "shared_expert_gate": (2048, 1),
        "router": (2048, 60), "lm_head": (2048, 151936)}


# Qwen3-0.6B-like: H 1024, q 2048 (16 x 128), kv 1024 = H, I 3072; 6 attention calls
QWEN3_SMALL = {(1024, 2048): 6, (1024, 1024): 12, (2048, 1024): 6, (1024, 3072): 12,
               (3072, 1024): 6, (1024, 151936): 3}


@pytest.mark.parametrize("calls", [0, 6])
def test_inferred_dense_layer_whose_kv_width_is_the_hidden_size(calls):
    """k and v (H, H) run 2 x 6 times, as often per call as q and o would if they shared
    (H, H): on that tie o_proj is the other GEMM into H, (2048, 1024). Fused, qkv (1024, 4096)
    is twice an MLP's width (2048, which o_proj's shape mimics), not the lm_head."""
    assert layer_linears.infer_linears(_counts(QWEN3_SMALL), calls) == {
        "q_proj": (1024, 2048), "k_proj": (1024, 1024), "v_proj": (1024, 1024),
        "o_proj": (2048, 1024), "gate_proj": (1024, 3072), "up_proj": (1024, 3072),
        "down_proj": (3072, 1024), "lm_head": (1024, 151936)}
    fused = {(1024, 4096): 6, (2048, 1024): 6, (1024, 6144): 6, (3072, 1024): 6,
             (1024, 151936): 3}
    assert layer_linears.infer_linears(_counts(fused), calls) == {
        "qkv_proj": (1024, 4096), "o_proj": (2048, 1024), "gate_up_proj": (1024, 6144),
        "down_proj": (3072, 1024), "lm_head": (1024, 151936)}


def test_a_router_running_less_often_than_attention_is_still_the_router():
    """A MoE whose first layer is dense runs its router less often than the attention: still
    its router. (A hybrid whose MLP runs more often than its attention but without a router:
    test_counts_that_do_not_add_up_name_nothing_rather_than_the_wrong_gemm.)"""
    first_dense = {(4096, 4096): 12, (4096, 1024): 12, (4096, 8): 4, (4096, 28672): 22,
                   (14336, 4096): 22, (4096, 32000): 3}  # 6 calls, 2 of them dense layers
    got = layer_linears.infer_linears(_counts(first_dense), calls=6)
    assert got["router"] == (4096, 8) and got["experts_down"] == (14336, 4096)


def test_counts_that_do_not_add_up_name_nothing_rather_than_the_wrong_gemm():
    """An MLA-like layer (q through a low-rank (1024, 640), (640, 2048) pair): no q or fused
    qkv runs as often as o_proj. The lm_head (1024, 50000) is never qkv_proj (before: it
    was); with the attention calls the counts do not add up to a layer: nothing named. A
    hybrid whose q (2048 -> 1024) runs once per call has no router: its MLP is dense. At
    calls = 0 (eager matmul attention) Qwen1.5-MoE's k and v are (H, H), not its router."""
    mla = {(1024, 1024): 6, (1024, 640): 6, (640, 2048): 6, (1024, 3072): 12,
           (3072, 1024): 6, (1024, 50000): 3}
    got = layer_linears.infer_linears(_counts(mla), 0)
    assert "qkv_proj" not in got and got["lm_head"] == (1024, 50000)
    assert layer_linears.infer_linears(_counts(mla), 6) is None
    hybrid = {(2048, 1024): 3, (1024, 2048): 3, (2048, 256): 6, (2048, 8192): 16,
              (8192, 2048): 8}
    got = layer_linears.infer_linears(_counts(hybrid), 3)
    assert got["down_proj"] == (8192, 2048) and "experts_down" not in got
    got = layer_linears.infer_linears(_counts(QWEN15_LOOP), 0)
    assert got["k_proj"] == got["v_proj"] == (2048, 2048)


@pytest.mark.parametrize("calls", [0, 3])
def test_no_linears_inferred_from_gemms_of_no_decoder_layer(calls):
    """A matmul loop, or a classifier head after some attention: no MLP and no o_proj."""
    assert layer_linears.infer_linears(_counts({(512, 512): 100}), calls) is None
    assert layer_linears.infer_linears(_counts({(64, 10): 5, (64, 64): 2}), calls) is None


def test_fused_moe_trace_without_a_model():
    """No --model: the experts from the fused op's w13 [E, 2I, H], the router (H, E), top-k from
    its top-k ids."""
    path = MOE / "synthetic_vllm_fused_moe_mixtral-8x7b-2l_decode_b8_s512.json.gz"
    s = next(iter(analyze(attribute(load_trace(path)), None, None).moe.values()))
    assert (s["top_k"], s["experts"], s["tokens"]) == (2, 8.0, 8.0)
    assert s["experts_active"] == pytest.approx(8 * (1 - 0.75 ** 8))
