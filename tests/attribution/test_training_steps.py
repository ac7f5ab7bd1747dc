"""Issue 33's training steps on real H100 traces (sample_traces/training_h100): forward, backward
and optimizer, every linear's grad-input and grad-weight GEMMs under its own `.grad` name at 2x
its forward FLOPs, attention's backward by its formula, the optimizer costed, a checkpointed
layer's recomputed forward said (phase `recompute`). Every figure is computed here by hand."""
from __future__ import annotations

import functools

import pandas as pd
import pytest

import trace_roofline as tr
from trace_roofline.pipeline import analyze_trace_kernels

D = "sample_traces/training_h100/"
M = 4 * 512  # tokens: B = 4 sequences of T = 512
PAIRS = 512 * 513 // 2  # causal query-key pairs per sequence and head: T(T+1)/2 = 131,328
QWEN, MIXTRAL = "qwen2.5-0.5b-2l_train_{}_b4_t512", "mixtral-2l_train_eager_b4_t512"
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::_grouped_mm", "aten::bmm"}


@functools.cache
def _run(name: str):
    return analyze_trace_kernels(f"{D}{name}_h100.json.gz", tr.get_model(f"{D}{name}.config.json"))


def _rows(name: str) -> pd.DataFrame:
    ops = _run(name)[0].operators
    return ops[ops["layer"].isna()].set_index(["operator", "phase"])


def _gemm(k: int, n: int, tokens: int = M) -> int:
    return 2 * tokens * k * n


# Qwen2.5-0.5B widths, 2 layers: hidden 896, 14 heads / 2 kv of 64, intermediate 4864.
# One layer's forward GEMMs: q, o 2·2048·896·896 = 3,288,334,336; k, v 2·2048·896·128 =
# 469,762,048; gate, up, down 2·2048·896·4864 = 17,850,957,824. A .grad row holds both
# layers' grad-input and grad-weight: 2 x 2 x the forward GEMM.
QWEN_GRADS = {"q_proj": 4 * 3_288_334_336, "o_proj": 4 * 3_288_334_336,
              "k_proj": 4 * 469_762_048, "v_proj": 4 * 469_762_048,
              "gate_proj": 4 * 17_850_957_824, "up_proj": 4 * 17_850_957_824,
              "down_proj": 4 * 17_850_957_824}
# attention forward 4·B·n_q·d·pairs = 4·4·14·64·131,328 = 1,882,718,208 per layer; its
# backward 2.5x that (docs/conventions.md), two layers: 9,413,591,040
QWEN_ATTENTION_GRAD = 2 * 2.5 * 4 * 4 * 14 * 64 * PAIRS


def test_hand_figures_are_the_layout_s():
    assert _gemm(896, 896) == 3_288_334_336 and _gemm(896, 128) == 469_762_048
    assert _gemm(896, 4864) == 17_850_957_824 and PAIRS == 131_328
    assert QWEN_ATTENTION_GRAD == 9_413_591_040


@pytest.mark.parametrize("mode", ["eager", "checkpointing", "compiled"])
def test_qwen_linears_backward_under_their_own_grad_name(mode):
    rows = _rows(QWEN.format(mode))
    for linear, hand in QWEN_GRADS.items():
        grad = rows.loc[(f"{linear}.grad", "backward")]
        assert grad["flops"] == pytest.approx(hand, rel=1e-9), linear
        assert grad["instances"] == 4  # 2 layers x (grad-input, grad-weight)
        fwd = rows.loc[(linear, "forward"), "flops"]  # (q, k, v carry a bias: M·N more)
        assert grad["flops"] / fwd == pytest.approx(2.0, rel=0.02), linear


@pytest.mark.parametrize("mode", ["eager", "checkpointing", "compiled"])
def test_qwen_attention_backward_is_its_own_costed_row(mode):
    rows = _rows(QWEN.format(mode))
    grad = rows.loc[("attention.grad", "backward")]
    assert grad["flops"] == pytest.approx(QWEN_ATTENTION_GRAD, rel=1e-9)
    assert grad["flops"] / rows.loc[("attention", "forward"), "flops"] == pytest.approx(2.5, rel=0.01)


@pytest.mark.parametrize("name", [QWEN.format("eager"), QWEN.format("checkpointing"),
                                  QWEN.format("compiled"), MIXTRAL])
def test_no_backward_gemm_under_a_forward_name(name):
    k = _run(name)[1].kernels
    bwd = k[(k["training"] == "backward") & k["op_name"].isin(GEMM_OPS)]
    named = bwd["operator"].astype(str)
    assert named.str.endswith(".grad").all(), named[~named.str.endswith(".grad")].unique()
    phases = set(_run(name)[0].operators["phase"])
    assert {"forward", "backward", "optimizer"} <= phases
    back = _run(name)[0].operators.query("phase == 'backward'")["operator"].astype(str)
    assert (back.str.endswith(".grad") | back.isin(["loss", "other"])).all()


# AdamW (foreach): 26 parameters, P = 136,134,656 (embedding, tied lm_head) + 2 x 14,912,384
# (q 896·896+896, k and v 128·896+128, o 896·896, gate/up/down 3·4864·896, 2 norms of 896)
# + 896 (final norm) = 165,960,320 bf16 elements. Its foreach ops per element: mul_ (decay:
# 1 read, 1 write), lerp_ (exp_avg with grad: 2 r, 1 w), mul_ (exp_avg_sq: 1 r, 1 w), addcmul_
# (3 r, 1 w), sqrt (1 r, 1 w), div_ (1 r, 1 w), add_ (eps: 1 r, 1 w), addcdiv_ (3 r, 1 w):
# 13 reads + 8 writes = 21 x 2 bytes x P = 6,970,333,440 bytes (+ the 26 step counters).
QWEN_PARAMS = 151936 * 896 + 2 * (896 * 896 + 896 + 2 * (128 * 896 + 128) + 896 * 896
                                  + 3 * 4864 * 896 + 2 * 896) + 896


@pytest.mark.parametrize("mode", ["eager", "checkpointing", "compiled"])
def test_qwen_optimizer_is_costed_memory_bound_work(mode):
    assert QWEN_PARAMS == 165_960_320
    opt = _rows(QWEN.format(mode)).loc[("optimizer", "optimizer")]
    assert opt["uncosted"] == 0
    assert opt["bytes"] == pytest.approx(21 * 2 * QWEN_PARAMS, rel=1e-4)
    assert opt["flops"] / opt["bytes"] < 1  # memory-bound: well under 1 FLOP/B


def test_checkpointing_recomputed_forward_is_counted_and_said():
    rows, eager = _rows(QWEN.format("checkpointing")), _rows(QWEN.format("eager"))
    # each layer's q..up run again inside backward (down's linear stops the recomputation
    # early: its output is not saved), named as their forward linear, phase `recompute`
    for linear in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"):
        again = rows.loc[(linear, "recompute")]
        assert again["flops"] == pytest.approx(rows.loc[(linear, "forward"), "flops"], rel=1e-9)
        assert again["time_us"] > 0
    assert ("attention", "recompute") in rows.index
    assert ("down_proj", "recompute") not in rows.index
    # the recomputed GEMMs are not read as grads: down_proj.grad as in the eager step
    assert rows.loc[("down_proj.grad", "backward"), "flops"] == pytest.approx(
        eager.loc[("down_proj.grad", "backward"), "flops"], rel=1e-9)
    k = _run(QWEN.format("checkpointing"))[1].kernels
    again = k[k["training"] == "recompute"]
    assert again["layer"].isna().all()  # backward runs the layers in reverse: no layer by place
    assert again["dur_us"].sum() == pytest.approx(rows.xs("recompute", level="phase")["time_us"]
                                                  .sum(), rel=1e-9)


# Mixtral-8x7B widths, 2 layers: hidden 4096, 32 heads / 8 kv of 128, 8 experts of 14336,
# top-2. q, o 2·2048·4096·4096 = 68,719,476,736 and k, v 2·2048·4096·1024 = 17,179,869,184 a
# layer; the experts run 2048·2 = 4096 token rows: gate_up 2·4096·4096·28672 =
# 962,072,674,304, down 2·4096·14336·4096 = 481,036,337,152; router 2·2048·4096·8 = 134,217,728.
MIXTRAL_GRADS = {"q_proj": 4 * 68_719_476_736, "o_proj": 4 * 68_719_476_736,
                 "k_proj": 4 * 17_179_869_184, "v_proj": 4 * 17_179_869_184,
                 "experts_gate_up": 4 * 962_072_674_304, "experts_down": 4 * 481_036_337_152,
                 "router": 4 * 134_217_728}


def test_mixtral_linears_and_experts_backward_under_their_own_grad_name():
    assert _gemm(4096, 28672, 2 * M) == 962_072_674_304
    assert _gemm(14336, 4096, 2 * M) == 481_036_337_152
    rows = _rows(MIXTRAL)
    for linear, hand in MIXTRAL_GRADS.items():
        grad = rows.loc[(f"{linear}.grad", "backward")]
        assert grad["flops"] == pytest.approx(hand, rel=1e-9), linear
        assert grad["uncosted"] == 0
        assert grad["flops"] / rows.loc[(linear, "forward"), "flops"] == pytest.approx(
            2.0, rel=0.02), linear
    # attention: 4·4·32·128·131,328 a layer forward, 2.5x backward over 2 layers
    assert rows.loc[("attention.grad", "backward"), "flops"] == pytest.approx(
        2 * 2.5 * 4 * 4 * 32 * 128 * PAIRS, rel=1e-9)
    opt = rows.loc[("optimizer", "optimizer")]
    assert opt["uncosted"] == 0 and opt["flops"] / opt["bytes"] < 1
