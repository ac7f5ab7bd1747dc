"""Names on the H200 captures of sample_traces/families_h200 (see its README), checked against each
family's layer layout: every GEMM named as a linear has that linear's (K, N) in the family's
architecture, no operator the architecture lacks is named, and an encoder names nothing as a
decoder. A name that fails these checks is a wrong name; at most 2% of device time may carry one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import numpy as np
import pytest

import trace_roofline as tr
from tests.builders import SAMPLES, walk, wrong_names
from trace_roofline.model import operators
from trace_roofline.outputs import report

DIR = SAMPLES / "families_h200"
CONFIGS = DIR / "configs"
DECODER = set(operators.LINEARS) | {"attention", "q_norm", "k_norm", "rope", "input_norm",
                                         "post_attention_norm", "lm_head", "router",
                                         "experts_gate_up", "experts_down"}
FAMILIES = sorted((f.stem for f in CONFIGS.glob("*.json")), key=len, reverse=True)
TRACES = sorted(DIR.glob("*_h200.json.gz"))


def _family(path: Path) -> str:
    return next(f for f in FAMILIES if path.name.startswith(f + "_"))


def _capture(path: Path) -> str:
    return path.name.removesuffix("_h200.json.gz")


@pytest.mark.parametrize("path", walk(TRACES, _family, _capture))
def test_no_wrong_name_on_any_family_capture(path, tmp_path):
    family = _family(path)
    trace = tr.load_trace(path)
    if family == "bert":  # an encoder: its config is refused, and bare names no decoder op
        with pytest.raises(tr.InputError, match="'bert' is not a decoder-only language model"):
            tr.get_model(str(CONFIGS / "bert.json"))
        assert not set(tr.attribute(trace, None)["operator"].astype(str)) & DECODER
        return
    model = tr.get_model(str(CONFIGS / f"{family}.json"))
    att = tr.attribute(trace, model)
    dur = att["dur_us"].to_numpy()
    wrong = wrong_names(att, model)
    if path.name.startswith("llama_assisted"):  # the draft's rows, by the draft's layout
        draft = (att["model"] == DRAFT_LABEL).to_numpy(bool)
        wrong = np.where(draft, wrong_names(att, _draft_model(tmp_path)), wrong)
    assert dur[wrong].sum() <= 0.02 * dur.sum(), att.loc[wrong, ["operator", "op_name",
                                                                 "input_dims"]].drop_duplicates()


# llama_assisted's draft (workloads/capture_families.py: `build(..., draft=0.25)`, 1 layer):
# a quarter of Llama-3-8B's widths and heads, its head size and vocabulary
DRAFT = {"hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2,
         "intermediate_size": 3584, "num_hidden_layers": 1}
DRAFT_LABEL = "hidden 1024, vocab 128256"


def _draft_model(tmp_path: Path) -> tr.ModelSpec:
    cfg = json.loads((CONFIGS / "llama.json").read_text()) | DRAFT
    (tmp_path / "draft.json").write_text(json.dumps(cfg))
    return tr.get_model(str(tmp_path / "draft.json"))


@pytest.mark.parametrize("given", [True, False], ids=["with-model", "without"])
def test_two_models_in_one_trace_are_two_analyses(given):
    """Assisted decoding (a 2-layer target and a 1-layer draft): each embedding weight is a
    model with its own rows, passes and whole model; none of the draft's GEMMs is a fallback
    `linear[K×N]` or is added to the target's, the given model is the draft's only by shapes,
    and every kernel lands in exactly one of the two."""
    path = DIR / "llama_assisted_h200.json.gz"
    model = tr.get_model(str(CONFIGS / "llama.json")) if given else None
    a = tr.analyze_trace(path, model)
    assert len(a.models) == 1
    draft = a.models[0]
    first = "llama" if given else "hidden 4096, vocab 128256"
    assert a.trace.endswith(f"[model 1 of 2: {first}]")
    assert draft.trace.endswith(f"[model 2 of 2: {DRAFT_LABEL}]") and draft.model is None
    assert a.tp == (1 if given else None)  # (blended, the draft's shapes read as a TP=4 shard)
    for part, hidden in ((a, 4096), (draft, 1024)):
        ops = part.operators[part.operators["layer"].isna()]
        assert not ops["operator"].str.startswith("linear[").any()
        assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "attention", "lm_head"} <= set(ops["operator"])
        assert part.model_inferred["hidden_size"] == hidden
    # per generate, the target: its 513-token prefill, 6 verifications of 2 tokens, a last
    # decode; the draft: its 512-token prefill and 6 passes of 2 tokens (2 generates)
    assert len(a.passes) == 16 and len(draft.passes) == 14
    assert list(a.passes["T_max"].iloc[:8]) == [513, 2, 2, 2, 2, 2, 2, 1]
    assert list(draft.passes["T_max"].iloc[:7]) == [512, 2, 2, 2, 2, 2, 2]
    assert set(a.passes["pass"]).isdisjoint(draft.passes["pass"])
    total = tr.attribute(tr.load_trace(path), model)["dur_us"].sum()
    both = sum(cast(float, w["time_us"]) for p in (a, draft) for w in p.whole_by_phase.values())
    assert both == pytest.approx(total, rel=1e-12)
    # the draft's q_proj by hand: 14 passes of T tokens, 2·T·1024·1024 FLOPs each
    tokens = int(draft.passes["T_max"].sum())  # (one sequence per pass)
    q = draft.operators[(draft.operators["operator"] == "q_proj") & draft.operators["layer"].isna()]
    assert q["flops"].sum() == 2 * tokens * 1024 * 1024


def test_the_check_finds_swapped_and_foreign_names():
    """The oracle itself: gate_proj's GEMMs renamed down_proj ((H, I) is not down_proj's (I, H)),
    or an expert name on a dense model, are wrong names."""
    model = tr.get_model(str(CONFIGS / "qwen2.json"))
    att = tr.attribute(tr.load_trace(DIR / "qwen2_decode_h200.json.gz"), model)
    assert not wrong_names(att, model).any()
    for old, new in (("gate_proj", "down_proj"), ("act", "experts_act")):
        bad = att.assign(operator=att["operator"].astype(str).replace(old, new))
        wrong = wrong_names(bad, model)
        assert wrong.any() and (wrong == (att["operator"] == old).to_numpy()).all()


def test_a_training_step_keeps_forward_backward_and_optimizer_apart():
    """Qwen2 training step: forward rows hold only forward time, each linear's backward GEMMs
    (grad-input and grad-weight) are `<linear>.grad` at 2x the forward FLOPs, AdamW is
    `optimizer`."""
    model = tr.get_model(str(CONFIGS / "qwen2.json"))
    att = tr.attribute(tr.load_trace(DIR / "qwen2_train_h200.json.gz"), model)
    part = att["training"].astype(str)
    forward_ops = set(operators.LINEARS) | {"attention", "input_norm", "rope"}
    assert (part[att["operator"].isin(forward_ops)] == "forward").all()
    assert (part[att["operator"].astype(str).str.endswith(".grad")] == "backward").all()
    assert (part[att["operator"] == "optimizer"] == "optimizer").all()
    a = tr.analyze_trace(DIR / "qwen2_train_h200.json.gz", model)
    flops = a.costed.groupby("operator")["flops"].sum()
    for linear in ("q_proj", "k_proj", "gate_proj", "down_proj", "lm_head"):
        assert flops[f"{linear}.grad"] == pytest.approx(2 * flops[linear], rel=1e-3)

    # SDPA's backward, per layer and step: causal pairs 512·513/2 = 131,328; forward
    # 4·28 heads·128·131,328 = 1,882,718,208 FLOPs, backward 2.5x = 4,706,795,520; bytes
    # 2·(4·28·512·128 + 4·4·512·128) = 16,777,216 (Q, O, dO, dQ; K, V, dK, dV); 2 layers x 2 steps
    grad = a.costed[a.costed["operator"] == "attention.grad"]
    costed = grad[grad["flops"] > 0]
    assert len(costed) == 4 and (costed["flops"] == 4_706_795_520).all()
    assert (costed["bytes"] == 16_777_216).all()
    assert set(costed["shape"]) == {"backward of B=1 n_q=28 n_kv=4 T=512 S=512 d=128 causal"}


def test_an_encoders_attention_backward_counts_every_pair():
    """BERT's backward SDPA (is_causal False): 512² pairs, 4·16·64·262,144 = 1,073,741,824
    forward FLOPs, 2.5x = 2,684,354,560 per layer and step."""
    a = tr.analyze_trace(DIR / "bert_train_h200.json.gz")
    c = a.costed[a.costed["op_name"] == "aten::_scaled_dot_product_cudnn_attention_backward"]
    assert len(c) == 4 and (c["flops"] == 2_684_354_560).all()


def test_continuous_batching_without_recorded_ops_is_unattributed_and_says_why():
    """HF continuous batching runs its steps on a worker thread the profiler records no CPU
    op on: every kernel's launch is in the file but no op is, so nothing is named, and the
    analysis says why rather than guessing phases or operators."""
    a = tr.analyze_trace(DIR / "llama_batch_h200.json.gz",
                         tr.get_model(str(CONFIGS / "llama.json")))
    assert set(a.costed["operator"].astype(str)) == {"unattributed"}
    assert any("no linked cpu op 100.0%" in w for w in a.warnings)


def test_eager_attention_counts_the_causal_pairs_like_sdpa():
    """Gemma-2's eager attention (bmm, softcap, mask, softmax, bmm) under --causal causal: each
    bmm of a 512-token prefill is 2·8·512·256·512 = 1,073,741,824 FLOPs over every pair, counted
    at the causal share 513/1024 = 537,919,488 (the two together equal the attention rule's
    4·8·256·131,328); with --causal full, every pair; a decode's 1 x S scores stay whole."""
    model = tr.get_model(str(CONFIGS / "gemma2.json"))
    for causal, want in (("causal", 537_919_488), ("full", 1_073_741_824)):
        c = tr.analyze_trace(DIR / "gemma2_prefill_h200.json.gz", model,
                             options=tr.AnalysisOptions(causal=causal)).costed
        bmm = c[(c["operator"] == "attention") & (c["op_name"] == "aten::bmm")]
        assert len(bmm) == 8 and (bmm["flops"] == want).all()
        assert bmm["shape"].str.endswith(" (causal pairs)").all() == (causal == "causal")
    c = tr.analyze_trace(DIR / "gemma2_decode_h200.json.gz", model).costed
    bmm = c[(c["operator"] == "attention") & (c["op_name"] == "aten::bmm")]
    assert set(bmm["flops"]) == {2 * 8 * 256 * 514, 2 * 8 * 256 * 515}


def test_kernels_from_before_the_window_are_a_bucket_of_their_own():
    """A profiler schedule over unsynchronised 8192-token prefills: the window opens while 63
    kernels of the previous step still run (no launch in the file, correlation ids below the
    first launch's). They are `before_window`, in no forward pass, uncosted and said; the
    recorded step is one prefill pass of its own kernels."""
    path = DIR / "qwen2_schedule-t8192_h200.json.gz"
    model = tr.get_model(str(CONFIGS / "qwen2.json"))
    att = tr.attribute(tr.load_trace(path), model)
    early = att["operator"] == "before_window"
    assert early.sum() == 63 and att.loc[early, "step"].isna().all()
    assert not att.loc[~early, "step"].isna().any()
    a = tr.analyze_trace(path, model)
    assert a.coverage["fallback_by_operator"]["before_window"] == pytest.approx(
        att.loc[early, "dur_us"].sum())
    assert list(a.passes["phase"]) == ["prefill"]
    assert a.whole_by_phase["prefill"]["kernels"] == (~early).sum()


def test_packed_continuous_batching_steps_are_not_passed_off_as_plain_prefills():
    """HF continuous batching with its ops recorded: SDPA packs every request's tokens into one
    sequence, so 4 decode tokens of 4 requests (T = 4, S = 537) look like a 4-token prefill
    chunk. The footer says which passes score more keys than queries and that their phase
    rests on T alone."""
    from trace_roofline.outputs.report import passes_lines

    a = tr.analyze_trace(DIR / "llama_batch-ops_h200.json.gz",
                         tr.get_model(str(CONFIGS / "llama.json")))
    p = a.passes
    packed = p[(p["phase"] == "prefill") & (p["S"] > p["T_max"])]
    assert len(packed) == 8 and sorted(set(packed["T_max"])) == [4, 21, 256]
    lines = passes_lines(a)
    assert lines[1].startswith("8 prefill pass(es) score more keys than queries (T < S)")
    assert "continuous batching" in lines[1] and "by T alone" in lines[1]
    plain = tr.analyze_trace(DIR / "qwen2_prefill_h200.json.gz",
                             tr.get_model(str(CONFIGS / "qwen2.json")))
    assert len(passes_lines(plain)) == 1  # T = S: nothing to say


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_max_autotune_decode_gemvs_are_named_by_their_weights(family):
    """Under max-autotune Inductor fuses each decode GEMV into a reduction kernel with the norm
    or activation around it (triton_red_fused_..._mm_...). Each is named after the linear whose
    weight buffer its arguments hold (gate and up in one kernel: gate_up_proj) and costed as
    that GEMM: per pass and layer 2·K·N FLOPs (M = 1)."""
    model = tr.get_model(str(CONFIGS / f"{family}.json"))
    a = tr.analyze_trace(DIR / f"{family}_max-autotune_h200.json.gz", model)
    assert a.coverage["evidence_fraction"] > 0.99
    ops = a.operators[a.operators["layer"].isna()].set_index("operator")
    passes = len(a.passes)  # 2 decode steps of 2 layers
    h, i, v = model.hidden_size, model.intermediate_size, model.vocab_size
    assert ops.loc["lm_head", "flops"] == passes * 2 * h * v
    assert ops.loc["gate_up_proj", "flops"] == passes * 2 * 2 * h * 2 * i
    assert ops.loc["down_proj", "flops"] == passes * 2 * 2 * i * h
    assert not ops.index.str.startswith("linear[").any()


@pytest.mark.parametrize("path", walk([p for p in TRACES if _family(p) != "bert"], _family,
                                      _capture))
def test_no_wrong_name_without_a_model(path, tmp_path):
    """Without --model the layout is inferred from the GEMM shapes and the attention's
    geometry; what it names must still fit the family's real layout (each model's own, in
    the assisted capture)."""
    att = tr.attribute(tr.load_trace(path), None)
    wrong = wrong_names(att, tr.get_model(str(CONFIGS / f"{_family(path)}.json")))
    if path.name.startswith("llama_assisted"):
        draft = (att["model"] == DRAFT_LABEL).to_numpy(bool)
        wrong = np.where(draft, wrong_names(att, _draft_model(tmp_path)), wrong)
    dur = att["dur_us"].to_numpy()
    assert dur[wrong].sum() <= 0.02 * dur.sum(), att.loc[wrong, ["operator", "op_name",
                                                                 "input_dims"]].drop_duplicates()


@pytest.mark.parametrize("capture, layout, names", [
    ("gpt2_prefill", "fused qkv, ungated MLP", {"qkv_proj", "o_proj", "up_proj", "down_proj"}),
    ("deepseek_v2_prefill", "MLA attention, routed experts, gated MLP",
     {"q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "down_proj"}),
    ("gpt_oss_decode", "q/k/v, routed experts", {"q_proj", "k_proj", "v_proj", "o_proj"}),
])
def test_the_layout_is_inferred_and_said_without_a_model(capture, layout, names):
    """GPT-2 (Conv1D addmm: a fused qkv, an ungated MLP), DeepSeek-V2-Lite (MLA) and gpt-oss
    (an eager attention with sinks, no dense MLP): the Llama-style counting finds none of them;
    the attention's geometry (its op's q and v, or its eager matmuls) and the GEMM shapes do.
    The header says the layout it found."""
    a = tr.analyze_trace(DIR / f"{capture}_h200.json.gz")
    assert a.model_inferred["layout"] == layout
    assert report.shapes_line(a).endswith(f": custom ({layout})")
    ops = set(a.operators["operator"])
    assert names <= ops and not any(o.startswith("linear[") for o in names & ops)
    # (DeepSeek's shared expert, 2 x 1408 wide, has the routed experts' fused gate_up shape:
    # without a config its plain GEMMs are linear[2048×2816], no routed expert's, 1.6%)
    assert a.coverage["evidence_fraction"] > (0.88 if capture.startswith("deepseek") else 0.9)


@pytest.mark.parametrize("family, top_k", [("mixtral", 2), ("gpt_oss", 4)])
def test_max_autotune_experts_are_inductor_grouped_gemms(family, top_k):
    """Max-autotune runs the experts' _grouped_mm as an Inductor template
    (triton_tem_fused__grouped_mm_...: tokens [S, K], all experts' weights, offsets, out
    [S, N]); each is named by its weights' (K, N) and costed as the grouped GEMM it runs, with
    only the active experts' weights read: at B = 1, S = top_k rows, 2·S·K·N FLOPs per layer and
    pass (2 of each), under the memory roof."""
    model = tr.get_model(str(CONFIGS / f"{family}.json"))
    a = tr.analyze_trace(DIR / f"{family}_max-autotune_h200.json.gz", model)
    assert a.coverage["evidence_fraction"] > 0.95
    ops = a.operators[a.operators["layer"].isna()].set_index("operator")
    h, i = model.hidden_size, model.experts.intermediate_size
    assert ops.loc["experts_gate_up", "flops"] == 4 * 2 * top_k * h * 2 * i
    assert ops.loc["experts_down", "flops"] == 4 * 2 * top_k * i * h
    assert (ops.loc[["experts_gate_up", "experts_down"], "pct_of_roof"] < 100).all()
    # the router's logits GEMM, fused with the norm before it, marks each MoE block
    moe = a.moe["decode"]
    assert (moe["layers"], moe["tokens"], moe["top_k"]) == (4, 1.0, top_k)
    assert moe["assumption"] == "uniform routing"


def test_max_autotune_k_and_v_in_one_kernel_are_kv_proj():
    """Gemma-2's k and v (4 heads x 256 each) run as one max-autotune kernel of two weights
    whose N, 2048, is also its q_proj's: kv_proj, never q_proj."""
    model = tr.get_model(str(CONFIGS / "gemma2.json"))
    a = tr.analyze_trace(DIR / "gemma2_max-autotune_h200.json.gz", model)
    ops = a.operators[a.operators["layer"].isna()].set_index("operator")
    h, kv, q = model.hidden_size, model.num_kv_heads * model.head_dim, model.num_heads * model.head_dim
    assert ops.loc["kv_proj", "flops"] == 4 * 2 * h * 2 * kv
    assert ops.loc["q_proj", "flops"] == 4 * 2 * h * q


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_max_autotune_eager_attention_in_triton_kernels_is_attention(family):
    """Gemma-2's soft-capped and gpt-oss's sink attention run eagerly; max-autotune fuses
    their Q·Kᵀ and P·V into Triton reduction kernels (triton_red/per_fused_..._bmm_...) over two
    activations, with the softmax kernels between them: all attention, the products by their
    geometry (evidence shape), and nothing of it named RoPE."""
    model = tr.get_model(str(CONFIGS / f"{family}.json"))
    a = tr.analyze_trace(DIR / f"{family}_max-autotune_h200.json.gz", model)
    assert a.coverage["evidence_fraction"] == 1.0
    att = tr.attribute(tr.load_trace(DIR / f"{family}_max-autotune_h200.json.gz"), model)
    name = att["op_name"].astype(str)
    products = (name.str.match(r"triton_(?:red|per)_fused_.*bmm") & ~name.str.contains("_mm_")
                & ~name.str.contains("softmax"))
    assert (att.loc[products, "operator"] == "attention").all()
    assert (att.loc[products, "evidence"] == "shape").all()
    # (over 4-D scores [B, heads, T, S]; the router's and the sampler's are not attention's)
    softmax = name.str.contains("prepare_softmax_online") & att["input_dims"].astype(str).str.match(
        r"\[\[\d+, \d+, \d+, \d+\]")
    assert softmax.any() and (att.loc[softmax, "operator"] == "attention").all()
