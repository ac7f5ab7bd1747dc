"""Honest naming: position only fills gaps between anchored names; a GEMM is named by
its shape (or module / annotation), an attention by its op or kernel family; a trace no decoder
layout explains names nothing as a decoder and says why; training steps, sampling and kernels
from before the profiled window are buckets of their own."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tests.builders import Kineto
from trace_roofline.attribution import passes
from trace_roofline.attribution.attribute import ATTRIBUTED_COLUMNS, attribute, coverage
from trace_roofline.model import operators
from trace_roofline.model.models import get_model
from trace_roofline.pipeline import attribute_trace
from trace_roofline.trace import load_trace

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"
TRAINING = SAMPLES / "training" / "qwen-tiny_train_b2_t32_l2_adamw_cpu.json.gz"
PER_LAYER = {o.name for o in operators.OPERATORS if o.per_layer}
H, Q, KV, INTER = 256, 256, 64, 768  # qwen-tiny's linears: (256, 256), (256, 64), (256, 768)


@pytest.fixture
def build(tmp_path):
    def load(k: Kineto, name: str = "t.json"):
        return load_trace(k.write(tmp_path / name))
    return load


def _gemm(k: Kineto, op: str, m: int, kk: int, n: int, kernel: str = "nvjet_sm90_tst_64x8"):
    with k.op(op, [[m, kk], [kk, n], [m, n]] if op != "nodims" else None):
        k.kernel(kernel)


def _layer(k: Kineto, gemm_op: str = "aten::mm", kernel: str = "nvjet_sm90_tst_64x8",
           norm_kernel: str = "reduce_kernel", attn_kernel: str = "flash_fwd_kernel"):
    """One decoder layer: norm, q/k/v, RoPE, SDPA, o, norm, gate/up, act, down."""
    with k.op("aten::rsqrt", [[1, 1, H]]):
        k.kernel(norm_kernel)
    for n in (Q, KV, KV):
        _gemm(k, gemm_op, 1, H, n, kernel)
    with k.op("aten::neg", [[1, 8, 1, 16]]):
        k.kernel("vectorized_elementwise_kernel<neg_kernel_cuda>")
    with k.op("aten::_scaled_dot_product_flash_attention", [[1, 8, 1, 32]] * 3):
        k.kernel(attn_kernel)
    _gemm(k, gemm_op, 1, Q, H, kernel)
    with k.op("aten::add", [[1, 1, H], [1, 1, H]]):
        k.kernel("vectorized_elementwise_kernel<CUDAFunctor_add>")
    with k.op("aten::rsqrt", [[1, 1, H]]):
        k.kernel(norm_kernel)
    for n in (INTER, INTER):
        _gemm(k, gemm_op, 1, H, n, kernel)
    with k.op("aten::silu", [[1, 1, INTER]]):
        k.kernel("vectorized_elementwise_kernel<silu_kernel>")
    _gemm(k, gemm_op, 1, INTER, H, kernel)


def _time(a: pd.DataFrame, mask) -> float:
    return float(a.loc[mask, "dur_us"].sum() / a["dur_us"].sum())


def test_reason_is_declared_once():
    assert ATTRIBUTED_COLUMNS["reason"] == "str" and ATTRIBUTED_COLUMNS["training"] == "str"


def test_inductor_gemm_templates_are_named_by_their_shape(build):
    """max-autotune's triton_tem_fused_mm_* kernels: (K, N) from their arguments, never
    `attention` by position (it once named 89% attention)."""
    k = Kineto()
    with k.ann("ProfilerStep#1"):
        for _ in range(2):
            _layer(k, gemm_op="triton_tem_fused_mm_0", kernel="triton_tem_fused_mm_0")
    a = attribute(build(k), get_model("qwen-tiny"))
    tem = a[a["op_name"] == "triton_tem_fused_mm_0"]
    assert set(tem["evidence"]) == {"shape"}
    assert tem["operator"].tolist()[:7] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                            "up_proj", "down_proj"]
    assert set(a.loc[a["operator"] == "attention", "op_name"]) == {
        "aten::_scaled_dot_product_flash_attention"}


def test_gemms_without_shapes_are_never_named_by_place(build):
    """GEMM kernels whose op carries no shape stay unattributed with a reason: no `attention`,
    no projection by position, and the SDPA op still names the attention."""
    k = Kineto()
    with k.ann("ProfilerStep#1"):
        for _ in range(2):
            _layer(k, gemm_op="nodims", kernel="triton_tem_fused_mm_0")
    a = attribute(build(k), get_model("qwen-tiny"))
    gemm = a["name"] == "triton_tem_fused_mm_0"
    assert not a.loc[gemm, "operator"].isin(PER_LAYER).any()
    assert a.loc[gemm, "reason"].notna().all()
    attn = a[a["operator"] == "attention"]
    assert set(attn["name"]) == {"flash_fwd_kernel"} and set(attn["evidence"]) == {"kernel_name"}
    assert a.loc[a["evidence"] == "position", "operator"].isin(
        ["attention", "q_proj", "o_proj", "down_proj"]).sum() == 0


def test_an_attention_kernel_names_an_unknown_op(build):
    """An engine's attention op the vocabulary does not know is attention by its kernel family;
    an Inductor pointwise kernel that fuses attention ops is not."""
    k = Kineto()
    with k.ann("ProfilerStep#1"):
        for _ in range(2):
            _layer(k)
        with k.op("myengine::paged_attn", [[1, 8, 32]]):
            k.kernel("void paged_attention_ll4mi_QKV_mfma16_kernel<0, __hip_bfloat16>")
        with k.op("triton_poi_fused__scaled_dot_product_cudnn_attention_add_3", [[1, 8]]):
            k.kernel("triton_poi_fused__scaled_dot_product_cudnn_attention_add_3")
    a = attribute(build(k), get_model("qwen-tiny"))
    row = a[a["op_name"] == "myengine::paged_attn"]
    assert row["operator"].tolist() == ["attention"] and row["evidence"].tolist() == ["kernel_name"]
    poi = a[a["op_name"].str.startswith("triton_poi", na=False)]
    assert not (poi["operator"] == "attention").any()


def test_fused_add_rmsnorm_is_a_norm_not_residual(build):
    """aiter's add_rmsnorm (kernel add_rmsnorm_quant_kernel) after o_proj: the
    post-attention norm (its residual add inside), no `residual` row."""
    k = Kineto()
    aiter = "_ZN5aiter24add_rmsnorm_quant_kernelIDF16bDF16bLi64ELi8E"
    with k.ann("ProfilerStep#1"):
        for _ in range(2):
            with k.op("aiter::rmsnorm", [[1, H], [1, H], [H], []]):
                k.kernel("_ZN7ck_tile6kentryILi1ENS_12Rmsnorm2dFwd")
            for n in (Q, KV, KV):
                _gemm(k, "aten::mm", 1, H, n)
            with k.op("aten::_scaled_dot_product_flash_attention", [[1, 8, 1, 32]] * 3):
                k.kernel("flash_fwd_kernel")
            _gemm(k, "aten::mm", 1, Q, H)
            with k.op("aiter::add_rmsnorm", [[1, H], [1, H], [1, H], [1, H], [H], []]):
                k.kernel(aiter)
            for n in (INTER, INTER):
                _gemm(k, "aten::mm", 1, H, n)
            _gemm(k, "aten::mm", 1, INTER, H)
    a = attribute(build(k), get_model("qwen-tiny"))
    assert set(a.loc[a["name"] == aiter, "operator"]) <= {"post_attention_norm", "input_norm"}
    assert "residual" not in set(a["operator"])


@pytest.mark.parametrize("name", ["cnn_b8_cpu.json.gz", "matmul_loop_cpu.json.gz"])
def test_non_decoders_carry_no_decoder_names(name):
    a = attribute(load_trace(SAMPLES / name))
    assert not a["operator"].isin(PER_LAYER).any()
    assert a["reason"].str.contains("decoder").all()


def test_an_encoder_carries_no_decoder_names(build):
    """A BERT-shaped encoder (q, k, v, o all H x H, an ungated MLP H -> 4H -> H, LayerNorm,
    SDPA): its GEMMs fit no decoder, so nothing is q_norm / attention / q_proj (it once named 93%
    under decoder names)."""
    k = Kineto()
    h = 128
    with k.ann("ProfilerStep#1"):
        for _ in range(2):
            for _ in range(3):
                _gemm(k, "aten::addmm", 8, h, h)
            with k.op("aten::_scaled_dot_product_efficient_attention", [[1, 2, 8, 64]] * 3):
                k.kernel("fmha_cutlassF_bf16_aligned_64x64_rf_sm80")
            _gemm(k, "aten::addmm", 8, h, h)
            with k.op("aten::native_layer_norm", [[1, 8, h], [], [h], [h], []]):
                k.kernel("vectorized_layer_norm_kernel")
            _gemm(k, "aten::addmm", 8, h, 4 * h)
            with k.op("aten::gelu", [[8, 4 * h]]):
                k.kernel("vectorized_elementwise_kernel<gelu_kernel>")
            _gemm(k, "aten::addmm", 8, 4 * h, h)
            with k.op("aten::native_layer_norm", [[1, 8, h], [], [h], [h], []]):
                k.kernel("vectorized_layer_norm_kernel")
    a = attribute(build(k))
    assert not a["operator"].isin(PER_LAYER).any(), a["operator"].value_counts()
    assert a["reason"].notna().all()


def test_training_step_phases_and_backward_names():
    """The committed CPU training step (forward, loss, backward, AdamW): backward GEMMs named
    after the linear they differentiate (two per linear and layer and step), loss and optimizer
    named, every row's phase its part of the step; forward rows hold no backward time."""
    tr = load_trace(TRAINING)
    for model in (get_model("qwen-tiny"), None):
        a, _, found = attribute_trace(tr, model)
        bwd = a[a["training"] == "backward"]
        counts = bwd["operator"].value_counts()
        for lin in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            assert counts[operators.grad_of(lin)] == 8, (lin, counts)
            fwd = a[a["operator"] == lin]
            assert len(fwd) == 4 and set(fwd["training"]) == {"forward"}
        assert counts["lm_head.grad"] == 4 and counts["attention.grad"] == 4
        assert set(bwd.loc[bwd["operator"].str.endswith(".grad"), "evidence"]) <= {
            "shape", "kernel_name"}
        assert set(a.loc[a["training"] == "optimizer", "operator"]) == {"optimizer"}
        assert "loss" in set(a.loc[a["training"] == "forward", "operator"])
        assert (a["phase"] == a["training"]).all()  # forward | backward | optimizer, row by row
        assert found.table["phase"].tolist() == ["forward", "forward"]
        assert {"backward", "optimizer", "forward"} <= set(passes.PHASES)


def test_sampling_after_the_lm_head(build):
    """Logits processing and sampling after the lm_head are `sampling` (model-level)."""
    k = Kineto()
    with k.ann("ProfilerStep#1"):
        for _ in range(2):
            _layer(k)
        _gemm(k, "aten::mm", 1, H, 1024)  # lm_head
        for op, kern in (("aten::div", "vectorized_elementwise_kernel<DivFunctor>"),
                         ("aten::softmax", "softmax_warp_forward"),
                         ("aten::multinomial", "distribution_elementwise_grid_stride_kernel"),
                         ("aten::argmax", "reduce_kernel<ArgMaxOps<float>>")):
            with k.op(op, [[1, 1024]]):
                k.kernel(kern)
    a = attribute(build(k), get_model("qwen-tiny"))
    tail = a[a["op_name"].isin(["aten::div", "aten::softmax", "aten::multinomial",
                                "aten::argmax"])]
    assert set(tail["operator"]) == {"sampling"} and tail["layer"].isna().all()
    assert "sampling" in operators.MODEL_LEVEL


def test_kernels_from_before_the_window_are_a_bucket(build):
    """Kernels with no launch in the file, correlation ids below the first launch and done
    before the first linked kernel: `before_window`, in no pass, counted in coverage."""
    k = Kineto()
    k.corr = 500
    for i in range(3):  # the previous step's tail: launched before profiling started
        k.events.append({"ph": "X", "cat": "kernel", "name": "nvjet_sm90_tst_64x8", "pid": 0,
                         "tid": 7, "ts": 999_000.0 + 10 * i, "dur": 5.0,
                         "args": {"device": 0, "stream": 7, "correlation": 10 + i}})
    with k.ann("ProfilerStep#1"):
        for _ in range(2):
            _layer(k)
    a, _, found = attribute_trace(build(k), get_model("qwen-tiny"))
    early = a[a["operator"] == "before_window"]
    assert len(early) == 3 and early["step"].isna().all()
    assert set(early["phase"]) == {"before_window"} and early["reason"].notna().all()
    cov = coverage(a)
    assert cov["before_window_kernels"] == 3 and cov["before_window_time_us"] == 15.0
    assert np.isclose(found.table["time_us"].sum(), a.loc[a["step"].notna(), "dur_us"].sum())
    assert not (a["operator"] == "unattributed").any()


FAMILIES = SAMPLES / "families_cpu"


def test_real_bert_encoder_has_no_decoder_names():
    """sample_traces/families_cpu's BertModel step: its GEMMs fit no decoder, so nothing of it
    is q_proj, q_norm or attention, and every row says why."""
    a = attribute(load_trace(FAMILIES / "bert_prefill_cpu.json.gz"))
    assert not a["operator"].isin(PER_LAYER).any()
    assert a["reason"].str.contains("no decoder").all()


def test_real_qwen2_training_step():
    """families_cpu's qwen2 training step (HF Qwen2, forward + loss + backward + AdamW)."""
    a, _, found = attribute_trace(load_trace(FAMILIES / "qwen2_train_cpu.json.gz"))
    assert set(a["training"]) == {"forward", "backward", "optimizer"}
    bwd = a[a["training"] == "backward"]
    grads = bwd["operator"].value_counts()
    for lin in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert grads[operators.grad_of(lin)] == 4  # grad-input and grad-weight, 2 layers
        assert set(a.loc[a["operator"] == lin, "training"]) == {"forward"}
    assert found.table["phase"].tolist() == ["forward"]
    assert set(a.loc[a["training"] == "optimizer", "operator"]) == {"optimizer"}


def test_real_generate_samples():
    """families_cpu's llama generate with top-k / top-p sampling: after each lm_head the
    logits processing and the draw are `sampling`, one prefill then decodes."""
    a, _, found = attribute_trace(load_trace(FAMILIES / "llama_generate_cpu.json.gz"))
    s = a[a["operator"] == "sampling"]
    assert s["op_name"].isin(["aten::topk", "aten::sort", "aten::softmax", "aten::multinomial",
                              "aten::cumsum"]).any() and s["layer"].isna().all()
    phases = found.table["phase"].tolist()
    assert phases[0] == "prefill" and set(phases[1:]) == {"decode"}


def test_real_eager_attention_matmuls_are_attention():
    """families_cpu's gemma2 decode runs eager attention (matmul, softmax, matmul): its batched
    Q·Kᵀ and P·V are attention by their geometry (evidence `shape`), not RoPE by position."""
    a = attribute(load_trace(FAMILIES / "gemma2_decode_cpu.json.gz"))
    mm = a[a["op_name"] == "aten::matmul"]
    four = mm[mm["input_dims"].str.match(r"^\[\[\d+, \d+, \d+, \d+\], \[\d+, \d+, \d+, \d+\]")]
    assert len(four) and set(four["operator"]) == {"attention"}
    assert set(four["evidence"]) == {"shape"}
