"""q_norm / k_norm: the per-head RMSNorms of q and k before RoPE (HF Qwen3 / Qwen3-MoE), on the
real H200 traces of sample_traces/moe/hf-moe-qwen3-30b-a3b-2l_* and
sample_traces/cuda_graphs/hf-moe-qwen3-30b-a3b-2l_* (unannotated HF transformers 5.17
captures, sample_traces/README.md), on small built traces (module frames, vLLM's fused qkv),
and their costs."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

import trace_roofline as tr
from tests.builders import BF, F32, SAMPLES, Kineto, Op, walk
from trace_roofline.attribution import graphs
from trace_roofline.attribution.attribute import operator_table
from trace_roofline.model.models import from_hf_config

QWEN3 = tr.get_model("qwen3-30b-a3b")
Q3 = "hf-moe-qwen3-30b-a3b-2l_"
# trace -> forward passes (ProfilerSteps, or generate's 1 prefill + 3 decodes)
QWEN3_TRACES = {
    f"moe/{Q3}decode_b4_s512_groupedmm_h200.json.gz": 3,
    f"moe/{Q3}decode_b4_s512_batchedmm_h200.json.gz": 3,
    f"moe/{Q3}prefill_b1_t512_groupedmm_h200.json.gz": 1,
    f"moe/{Q3}generate_b1_t512_n4_groupedmm_h200.json.gz": 4,
    f"cuda_graphs/{Q3}decode_b4_s512_static1024_groupedmm_mapping_h200.json.gz": 4,
}
LAYERS = 2
# HF's RMSNorm as aten ops: cast to fp32, pow, mean, add eps, rsqrt, mul, cast back, weight mul
NORM_KERNELS = 8
NORM_OPS = {"aten::pow", "aten::mean", "aten::rsqrt"}
NORM_KERNEL = re.compile(r"pow_tensor_scalar|pow_kernel|MeanOps|rsqrt_kernel")


@pytest.fixture(scope="module", params=sorted(QWEN3_TRACES))
def qwen3(request):
    t = tr.load_trace(SAMPLES / request.param)
    return t, tr.attribute(t, QWEN3), QWEN3_TRACES[request.param]


def test_q_and_k_norms_are_their_own_operators(qwen3):
    """8 kernels per norm, per layer, per forward pass, named by their place (evidence
    `position`), each layer's and pass's own; RoPE keeps only RoPE work."""
    _, k, passes = qwen3
    for op in ("q_norm", "k_norm"):
        rows = k[k["operator"] == op]
        assert len(rows) == NORM_KERNELS * LAYERS * passes, op
        assert set(rows["evidence"]) == {"position"}
        assert rows.groupby("layer").size().to_dict() == {0: NORM_KERNELS * passes,
                                                          1: NORM_KERNELS * passes}
        assert set(rows["op_name"]) >= NORM_OPS
    rope = k[k["operator"] == "rope"]
    assert not NORM_OPS & set(rope["op_name"])
    assert not rope["name"].str.contains(NORM_KERNEL).any()


def test_norms_see_per_head_views(qwen3):
    """q_norm's pow runs on [.., n_q = 32, d = 128], k_norm's on [.., n_kv = 4, 128]."""
    _, k, _ = qwen3
    pow_dims = k[k["op_name"] == "aten::pow"].groupby("operator")["input_dims"].unique()
    assert all(re.search(r", 32, 128\]", d) for d in pow_dims["q_norm"])
    assert all(re.search(r", 4, 128\]", d) for d in pow_dims["k_norm"])


def test_device_time_is_conserved(qwen3):
    """Every kernel lands in exactly one operator row."""
    t, k, _ = qwen3
    assert len(k) == len(t.device)
    total = np.rint(t.device["dur_us"].to_numpy() * 1e6).astype(np.int64).sum()
    assert operator_table(k)["dur_ps"].sum() == total


def test_eager_norm_costs_hand_computed():
    """Decode B=4: q_norm over [4, 1, 32, 128] (16384 elements), k_norm over [4, 1, 4, 128]
    (2048), each as its 8 aten ops (shapes.py rules, fp32 inside, bf16 in and out):
    FLOPs: pow, mean, mul, weight mul 1 per element, add eps and rsqrt 1 per row (128 / 16):
        q 4·16384 + 2·128 = 65792, k 4·2048 + 2·16 = 8224;
    bytes: cast bf16->fp32 (2+4)·n, pow (4+4)·n, mean 4·n + 4·rows, add eps 8·rows + 8 (the
    trace records eps as a 0-d fp64 tensor), rsqrt 8·rows, mul 4·n + 4·rows + 4·n,
    cast fp32->bf16 (4+2)·n, weight mul 2·128 + 2·n + 2·n:
        q 98304 + 131072 + 66048 + 1032 + 1024 + 131584 + 98304 + 65792 = 593160,
        k 12288 + 16384 + 8256 + 136 + 128 + 16448 + 12288 + 8448 = 74376."""
    a = tr.analyze_trace(SAMPLES / f"moe/{Q3}decode_b4_s512_groupedmm_h200.json.gz", QWEN3)
    c = a.costed.groupby(["operator", "step", "layer"])[["flops", "bytes"]].sum()
    for op, flops, nbytes in (("q_norm", 65792, 593160), ("k_norm", 8224, 74376)):
        assert len(c.loc[op]) == LAYERS * 3
        assert (c.loc[op, "flops"] == flops).all() and (c.loc[op, "bytes"] == nbytes).all()
    assert set(a.operators["operator"]) >= {"q_norm", "k_norm"}


def test_user_shapes_cost_one_rmsnorm_over_heads():
    """Bare replays named from kernel names, --batch 4: each q_norm / k_norm run is one RMSNorm
    over [B, heads, d] (shapes.py's rms_norm rule, 4 FLOPs per element; x read and written,
    weight [d] read): q 4·4·32·128 = 65536 FLOPs, (2·16384 + 128)·2 = 65792 bytes;
    k 4·4·4·128 = 8192 FLOPs, (2·2048 + 128)·2 = 8448 bytes; 4 replays x 2 layers."""
    path = SAMPLES / f"cuda_graphs/{Q3}decode_b4_s512_static1024_groupedmm_graph_h200.json.gz"
    a = tr.analyze_trace(path, QWEN3, options=tr.AnalysisOptions(decode_shapes=graphs.DecodeShapes(4, 1024)))
    c = a.costed
    for op, flops, nbytes in (("q_norm", 65536, 65792), ("k_norm", 8192, 8448)):
        rows = c[c["operator"] == op]
        assert len(rows) == 4 * LAYERS
        assert (rows["flops"] == flops).all() and (rows["bytes"] == nbytes).all()
        assert set(rows["evidence"]) == {"kernel_name"}


def _model_name(path: Path) -> str:
    return next(m for m in ("mixtral-8x7b", "qwen1.5-moe-a2.7b", "qwen2.5-7b") if m in path.name)


NO_QK_NORM = [p for sub in ("moe", "hf_generate", "cuda_graphs")
              for p in sorted((SAMPLES / sub).glob("*.json.gz")) if "qwen3" not in p.name]


@pytest.mark.parametrize("path", walk(NO_QK_NORM, lambda p: (p.parent, _model_name(p))))
def test_no_q_or_k_norm_without_one(path):
    """Traces of models without q/k norms (Mixtral, Qwen1.5-MoE, Qwen2.5; the synthetic vLLM
    ones) name none, with their model or none at all: without a model Qwen1.5-MoE's o_proj
    (2048 x 2048) is taken for a projection of q, k or v, and the post-attention norm after it
    normalises the whole hidden state, not one head."""
    t = tr.load_trace(path)
    for model in (tr.get_model(_model_name(path)), None):
        ops = set(tr.attribute(t, model)["operator"])
        assert not ops & {"q_norm", "k_norm"}, model


def _head_norm(operator: str, name: str, t: int, heads: int, d: int) -> Op:
    """An engine's fused RMSNorm (vLLM `_C::rms_norm(out, input, weight, eps)`) on [T, h, d]."""
    x = [t, heads, d]
    return Op(operator, name, [x, x, [d], []], [BF, BF, BF, "Scalar"])


def test_fused_qkv_first_norm_is_q_second_k(tmp_path):
    """vLLM's Qwen3: one qkv_proj, then rms_norm on q's heads, on k's heads, the rotary op,
    attention: the first norm is q_norm, the second k_norm, the rotary op rope."""
    spec = tr.get_model("qwen2.5-7b")
    h, d, t = spec.hidden_size, spec.head_dim, 4
    n = spec.fused_linears()["qkv_proj"][1]
    kt = Kineto()
    with kt.ann("ProfilerStep#1"):
        kt.emit([
            Op("input_norm", "_C::rms_norm", [[t, h], [t, h], [h], []], [BF, BF, BF, "Scalar"]),
            Op("qkv_proj", "aten::mm", [[t, h], [h, n]], [BF, BF]),
            _head_norm("q_norm", "_C::rms_norm", t, spec.num_heads, d),
            _head_norm("k_norm", "_C::rms_norm", t, spec.num_kv_heads, d),
            Op("rope", "_C::rotary_embedding", [[t], [t, 3584], [t, 512], [], [4096, d], []],
               ["long int", BF, BF, "Scalar", BF, "Scalar"]),
            Op("attention", "vllm::unified_attention",
               [[t, spec.num_heads, d], [t, spec.num_kv_heads, d], [t, spec.num_kv_heads, d]],
               [BF, BF, BF]),
            Op("o_proj", "aten::mm", [[t, 3584], [3584, h]], [BF, BF]),
        ], annotate=False)
    trace = tr.load_trace(kt.write(tmp_path / "vllm.json"))
    k = tr.attribute(trace, spec)
    by_op = dict(zip(k["op_name"], k["operator"], strict=False))
    names = k["operator"].tolist()
    assert names[:4] == ["input_norm", "qkv_proj", "q_norm", "k_norm"]
    assert by_op["_C::rotary_embedding"] == "rope"
    assert by_op["vllm::unified_attention"] == "attention"


def _qwen3_norm_ops(t: int, heads: int, d: int, operator: str) -> list[Op]:
    """HF Qwen3RMSNorm on q or k viewed per head, [1, T, heads, d]."""
    x, r = [1, t, heads, d], [1, t, heads, 1]
    return [Op(operator, "aten::copy_", [x, x, []], [F32, BF, "Scalar"]),
            Op(operator, "aten::pow", [x, []], [F32, "Scalar"]),
            Op(operator, "aten::mean", [x, [], [], []], [F32, "ScalarList", "Scalar", ""]),
            Op(operator, "aten::add", [r, [], []], [F32, "Scalar", "Scalar"]),
            Op(operator, "aten::rsqrt", [r], [F32]),
            Op(operator, "aten::mul", [x, r], [F32, F32]),
            Op(operator, "aten::copy_", [x, x, []], [BF, F32, "Scalar"]),
            Op(operator, "aten::mul", [[d], x], [BF, BF])]


def test_module_frames_name_the_norms_inside_attention(tmp_path):
    """with_stack traces: the 1st RMSNorm module inside the attention module is q_norm, the 2nd
    k_norm (evidence `module`); the layer's own norms stay input_norm / post_attention_norm."""
    spec = dataclasses.replace(QWEN3, experts=None, intermediate_size=6144)
    h, d, t = spec.hidden_size, spec.head_dim, 1
    kt = Kineto()

    def linear(name: str, idx: int, k: int, n: int) -> None:
        with kt.module("Linear", idx):
            kt._emit_ops([Op(name, "aten::mm", [[t, k], [k, n]], [BF, BF])])

    def norm(idx: int, ops: list[Op]) -> None:
        with kt.module("Qwen3RMSNorm", idx):
            kt._emit_ops(ops)

    flat = [h]
    with kt.ann("ProfilerStep#1"), kt.module("Qwen3DecoderLayer", 0):
        norm(0, [Op("input_norm", "aten::pow", [[1, t, h], []], [F32, "Scalar"]),
                 Op("input_norm", "aten::mul", [flat, [1, t, h]], [BF, BF])])
        with kt.module("Qwen3Attention", 0):
            linear("q_proj", 0, h, spec.q_size)
            norm(1, _qwen3_norm_ops(t, spec.num_heads, d, "q_norm"))
            linear("k_proj", 1, h, spec.kv_size)
            norm(2, _qwen3_norm_ops(t, spec.num_kv_heads, d, "k_norm"))
            linear("v_proj", 2, h, spec.kv_size)
            kt._emit_ops([Op("rope", "aten::neg", [[1, spec.num_heads, t, d // 2]], [BF]),
                          Op("attention", "aten::scaled_dot_product_attention",
                             [[1, spec.num_heads, t, d], [1, spec.num_kv_heads, 8, d],
                              [1, spec.num_kv_heads, 8, d]], [BF, BF, BF])])
            linear("o_proj", 3, spec.q_size, h)
        norm(3, [Op("post_attention_norm", "aten::pow", [[1, t, h], []], [F32, "Scalar"])])
    trace = tr.load_trace(kt.write(tmp_path / "stack.json"))
    k = tr.attribute(trace, spec)
    got = k.groupby("operator")["evidence"].agg(set).to_dict()
    assert got["q_norm"] == {"module"} and got["k_norm"] == {"module"}
    assert (k["operator"] == "q_norm").sum() == NORM_KERNELS
    assert (k["operator"] == "k_norm").sum() == NORM_KERNELS
    assert set(k.loc[k["op_name"] == "aten::neg", "operator"]) == {"rope"}
    assert {"input_norm", "post_attention_norm"} <= set(k["operator"])


@pytest.mark.parametrize("config, qk", [
    ({"model_type": "qwen3_moe"}, True), ({"model_type": "qwen3"}, True),
    ({"model_type": "qwen2"}, False), ({"model_type": "mixtral"}, False),
    ({"model_type": "cohere", "use_qk_norm": True}, True),
    ({"model_type": "phi", "qk_layernorm": True}, True),
    ({"model_type": "cohere", "use_qk_norm": False}, False),
])
def test_hf_config_says_whether_q_and_k_are_normalised(tmp_path, config, qk):
    import json

    cfg = {"hidden_size": 2048, "num_attention_heads": 32, "intermediate_size": 6144,
           "num_hidden_layers": 2, **config}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert from_hf_config(tmp_path / "config.json").qk_norm is qk
    assert tr.get_model("qwen3-30b-a3b").qk_norm and not tr.get_model("qwen2.5-7b").qk_norm
