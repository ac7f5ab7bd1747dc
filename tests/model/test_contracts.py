"""The name contracts (model/contracts.py) and their verifier (attribution/verify.py), and the
decoder/encoder verdict (attribution/kind.py): each rule on rows built by hand, then on traces."""

from __future__ import annotations

import pandas as pd
import pytest

import trace_roofline as tr
from tests.builders import SAMPLES
from trace_roofline.attribution import kind, verify
from trace_roofline.model import contracts, operators
from trace_roofline.outputs.report import terminal_table
from trace_roofline.pipeline import attribute_trace

QWEN = tr.get_model("qwen2.5-7b")  # dense, no q/k norms: q_proj [3584x3584], vocab 152064


def rows(*spec: tuple[str, str, str, str]) -> pd.DataFrame:
    """An attributed table of (operator, op_name, Input Dims, kernel name) rows, 1 µs each."""
    op, op_name, dims, name = zip(*spec, strict=True)
    n = len(spec)
    return pd.DataFrame({
        "name": list(name), "op_name": list(op_name), "input_dims": list(dims),
        "concrete_inputs": [""] * n, "operator": list(op), "evidence": ["position"] * n,
        "reason": pd.Series([pd.NA] * n, dtype="str"), "dur_us": [1.0] * n,
        "model": pd.Series([pd.NA] * n, dtype="str")}).astype({"operator": "str"})


MM = ("aten::mm", "[[8, 3584], [3584, 3584]]", "sm90_gemm")
ADD = ("aten::add", "[[8, 3584], [8, 3584], []]", "elementwise_kernel")


def demoted(att: pd.DataFrame, model=None, **kw) -> list[bool]:
    out = verify.verify(att, model, **kw)
    return out["reason"].astype("string").str.contains(verify.BROKEN, regex=False).fillna(
        False).tolist()


def test_every_operator_of_the_vocabulary_has_a_contract():
    names = [n for n in operators.BY_NAME if not n.endswith(operators.GRAD_SUFFIX)]
    assert [n for n in names if contracts.contract(n) is None] == []
    assert contracts.contract("q_proj.grad") is None  # backward names: nothing checked


@pytest.mark.parametrize("name", ["residual", "input_norm", "rope", "act", "kv_cache", "loss",
                                  "attention", "sampling", "embedding"])
def test_a_weight_gemm_breaks_every_name_but_a_linears(name):
    att = rows((name, *MM), ("q_proj", *MM))
    assert demoted(att) == [True, False]
    out = verify.verify(att, None)
    assert out["operator"].tolist() == ["other", "q_proj"]
    assert out["evidence"].tolist() == ["fallback", "position"]
    assert f"{name} holds no weight gemm work" in out["reason"].iloc[0]


def test_a_linear_of_another_shape_than_the_layouts_breaks_its_name():
    k = ("k_proj", "aten::mm", "[[8, 3584], [3584, 512]]", "sm90_gemm")
    att = rows(("q_proj", *MM), ("k_proj", *MM), k, ("o_proj", *MM),
               ("down_proj", "aten::mm", "[[8, 18944], [18944, 3584]]", "sm90_gemm"))
    assert demoted(att, QWEN) == [False, True, False, False, False]
    assert demoted(att) == [False] * 5  # without a model, nothing to compare with
    reason = verify.verify(att, QWEN)["reason"].iloc[1]
    assert "not qwen2.5-7b's k_proj [3584×512]" in reason


def test_a_model_most_gemms_contradict_is_crosschecks_error_not_wrong_names():
    """(crosscheck's error names every disagreeing linear: the names stay for it)"""
    att = rows(("k_proj", *MM), ("v_proj", *MM), ("q_proj", *MM))
    assert demoted(att, QWEN) == [False, False, False]
    annotated = rows(("k_proj", *MM), ("k_proj", "aten::mm", "[[8, 3584], [3584, 512]]", "g"))
    annotated["evidence"] = "annotation"
    assert demoted(annotated, QWEN) == [False, False]


def test_the_lm_heads_padded_vocabulary_fits_and_another_n_does_not():
    gpt2 = tr.ModelSpec("gpt2-like", 768, 12, 12, 64, 3072, 12, 50257, True)
    att = rows(("lm_head", "aten::mm", "[[8, 768], [768, 50257]]", "g"),
               ("lm_head", "aten::mm", "[[8, 768], [768, 50304]]", "g"),  # padded to 64
               ("lm_head", "aten::mm", "[[8, 768], [768, 50260]]", "g"))
    assert demoted(att, gpt2) == [False, False, True]


def test_without_a_model_the_lm_head_needs_an_embedding_tables_vocabulary():
    emb = ("embedding", "aten::embedding", "[[32128, 64], [1, 7], [], [], []]", "gather")
    head = ("lm_head", "aten::mm", "[[7, 64], [64, 384]]", "g")  # an adaLN modulation's 6·H
    assert demoted(rows(emb, head)) == [False, True]
    assert demoted(rows(emb, ("lm_head", "aten::mm", "[[7, 64], [64, 32128]]", "g"))) == [
        False, False]
    assert demoted(rows(head)) == [False]  # no embedding table: nothing to compare with


def test_expert_and_qk_norm_names_need_a_model_that_has_them():
    att = rows(("router", "aten::mm", "[[8, 3584], [3584, 64]]", "g"), ("q_norm", *ADD),
               ("experts_act", *ADD))
    assert demoted(att, QWEN) == [True, True, True]
    assert demoted(att) == [False, False, False]
    assert "has no experts" in verify.verify(att, QWEN)["reason"].iloc[0]


def test_a_gemm_batched_over_experts_is_never_the_shared_experts():
    grouped = ("aten::_grouped_mm", "[[16, 2048], [128, 2048, 1536], [4]]", "g")
    att = rows(("shared_gate_up_proj", *grouped), ("experts_gate_up", *grouped))
    assert demoted(att) == [True, False]


def test_loss_needs_a_loss_op_in_the_trace():
    lsm = ("aten::log_softmax", "[[4, 152064], [], []]", "softmax_kernel")
    assert demoted(rows(("loss", *lsm))) == [True]  # beam search's log-softmax
    nll = ("aten::nll_loss_nd", "[[4, 152064], [4], [], [], []]", "nll_loss_forward")
    assert demoted(rows(("loss", *lsm), ("loss", *nll))) == [False, False]


def test_an_encoder_has_no_decoder_only_names():
    att = rows(("kv_cache", *ADD), ("sampling", *ADD), ("q_proj", *MM), ("attention", *ADD))
    assert demoted(att, decoder=False) == [True, True, False, False]
    assert demoted(att) == [False] * 4


def test_a_clean_table_is_returned_as_it_is():
    att = rows(("q_proj", *MM), ("residual", *ADD))
    assert verify.verify(att, QWEN) is att


def test_demotions_are_summed_per_name_they_had():
    out = verify.verify(rows(("residual", *MM), ("residual", *MM), ("q_proj", *MM)), None)
    assert verify.demotions(out) == {"demoted_time_us": 2.0, "demoted_kernels": 2,
                                     "demoted_by_name": {"residual": 2.0}}


# ----------------------------------------------------------------------------- the verdict
def sdpa(q: str, k: str, mask: str = "[]", causal: str = "False") -> pd.DataFrame:
    att = rows(("attention", "aten::scaled_dot_product_attention",
                f"[{q}, {k}, {k}, {mask}, [], [], [], []]", "flash"))
    att["concrete_inputs"] = f'["", "", "", "", "0.", "{causal}", "0.125", "False"]'
    return att


@pytest.mark.parametrize(("q", "k", "mask", "causal", "verdict"), [
    ("[1, 4, 32, 16]", "[1, 4, 32, 16]", "[]", "False", "encoder"),  # BERT, ViT
    ("[1, 4, 32, 16]", "[1, 4, 32, 16]", "[1, 1, 1, 32]", "False", "encoder"),  # padding mask
    ("[1, 4, 32, 16]", "[1, 4, 32, 16]", "[]", "True", "decoder"),  # a causal prefill
    ("[1, 4, 32, 16]", "[1, 4, 32, 16]", "[1, 1, 32, 32]", "False", "decoder"),  # causal mask
    ("[1, 4, 1, 16]", "[1, 4, 33, 16]", "[]", "False", "decoder"),  # a decode step
])
def test_the_verdict_reads_attentions_causality(q, k, mask, causal, verdict):
    assert kind.judge(sdpa(q, k, mask, causal)).kind == verdict


def test_a_patch_convolution_without_an_embedding_table_is_a_vision_encoder():
    conv = ("conv", "aten::conv2d", "[[1, 3, 32, 32], [64, 3, 8, 8], [64], [], [], [], []]", "c")
    assert kind.judge(rows(conv)).kind == "vision encoder"
    emb = ("embedding", "aten::embedding", "[[1000, 64], [1, 7], [], [], []]", "gather")
    assert kind.judge(rows(conv, emb)).decoder  # a vision-language model's decoder
    assert kind.judge(rows(("q_proj", *MM))).decoder  # no evidence: a decoder


def test_bert_says_it_is_no_decoder_before_its_table():
    path = SAMPLES / "families_cpu" / "bert_prefill_cpu.json.gz"
    att, _, found = attribute_trace(tr.load_trace(path), None)
    assert found.kind.kind == "encoder"
    assert set(att["phase"].unique()) <= {"forward", "unknown"}
    assert not att["operator"].isin(["lm_head", "kv_cache", "sampling", "loss"]).any()
    first, second = terminal_table([tr.analyze_trace(path)]).splitlines()[:2]
    assert first.endswith("ENCODER, NOT A DECODER") and second.startswith("! encoder: ")


def test_a_decoder_trace_keeps_its_phases_and_names():
    path = SAMPLES / "families_cpu" / "llama_decode_cpu.json.gz"
    att, _, found = attribute_trace(tr.load_trace(path), None)
    assert found.kind.decoder and "decode" in set(att["phase"])


QK = ("attention", "aten::matmul", "[[1, 2, 32, 16], [1, 2, 16, 32]]", "gemm")


@pytest.mark.parametrize(("extra", "verdict"), [
    ((), "encoder"),  # an eager Q·Kᵀ over 32 queries, no mask: bidirectional
    ((("attention", "aten::add", "[[1, 2, 32, 32], [1, 1, 1, 32], []]", "add"),), "encoder"),
    ((("attention", "aten::add", "[[1, 2, 32, 32], [1, 1, 32, 32], []]", "add"),), "decoder"),
    ((("attention", "aten::where", "[[1, 1, 32, 32], [1, 2, 32, 32], []]", "w"),), "decoder"),
    ((("attention", "aten::matmul", "[[1, 2, 1, 16], [1, 2, 16, 33]]", "gemm"),), "decoder"),
    # RoPE's table ([1, d/2, 1] x [1, 1, S]) is no attention
    ((("rope", "aten::matmul", "[[1, 8, 1], [1, 1, 32]]", "gemm"),), "encoder"),
])
def test_the_verdict_reads_an_eager_attentions_mask(extra, verdict):
    assert kind.judge(rows(QK, *extra)).kind == verdict
