"""Serving-engine traces on the real MI300X traces of sample_traces/serving/ (TraceLens's
test data: SGLang Qwen3-8B decode and extend, vLLM gpt-oss-20b decode; README there): HIP-graph
replays named from their capture traces or, without them, from the kernel families; step
annotations giving phases and attention; the FLOPs of every GEMM and of attention against a hand
computation; AMD / Blackwell presets; low-precision bytes; symmetric-memory all-reduce."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import trace_roofline as tr
from tests.builders import BF, SAMPLES, Kineto
from tests.replay_factory import B200_ALL_REDUCE, as_b200_tp8_prefill, as_piecewise
from trace_roofline import cli
from trace_roofline.attribution import captures, graph_naming, graphs, steps
from trace_roofline.model import dtypes, hardware
from trace_roofline.options import AnalysisOptions
from trace_roofline.outputs import report
from trace_roofline.pipeline import analyze_trace_kernels

SERVING = SAMPLES / "serving"
SGLANG_DECODE = SERVING / "sglang_qwen3-8b_decode_mi300x" / "sglang_Qwen3-8B_decode.json.gz"
SGLANG_EXTEND = SERVING / "sglang_qwen3-8b_extend_mi300x" / "sglang_Qwen3-8B_prefilldecode.json.gz"
VLLM_DECODE = SERVING / "vllm_gpt-oss-20b_decode_full_mi300x" / "graph_execution.json.gz"
QWEN3 = tr.get_model(str(SERVING / "configs" / "qwen3-8b" / "config.json"))
GPT_OSS = tr.get_model(str(SERVING / "configs" / "gpt-oss-20b" / "config.json"))

# Qwen3-8B: hidden 4096, 32 q heads, 8 kv heads, head_dim 128, intermediate 12288, 36 layers,
# vocab 151936, no biases; gpt-oss-20b: hidden 2880, 64 q heads x 64, 8 kv heads, 24 layers
# (sliding-window 128 on the even ones), 32 experts top-4 of intermediate 2880, vocab 201088,
# biases on q/k/v/o and the router
H, NQ, NKV, D, INTER, L, V = 4096, 32, 8, 128, 12288, 36, 151936
QKV = (NQ + 2 * NKV) * D  # 6144
OH, ONQ, ONKV, OD, OI, OL, OE, OK, OV = 2880, 64, 8, 64, 2880, 24, 32, 4, 201088
OQKV = (ONQ + 2 * ONKV) * OD  # 5120


def _gemm(m: int, k: int, n: int, bias: bool = False) -> float:
    return 2.0 * m * k * n + (m * n if bias else 0)


def _flops(a: tr.Analysis) -> pd.Series:
    """Per operator, the FLOPs of its GEMM (and attention) instances: the router's top-k and
    sort are router work too but no GEMM."""
    c = a.costed[a.costed["cost_kind"].isin(["gemm", "attention"])]
    return c.groupby("operator")["flops"].sum()


def _bare(tmp: Path, trace: Path) -> Path:
    """The trace alone in a folder: no capture_traces/ beside it."""
    out = tmp / trace.parent.name / trace.name
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(trace, out)
    return out


@pytest.fixture(scope="module")
def bare_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bare")


@pytest.fixture(scope="module")
def sglang_decode() -> tr.Analysis:
    return tr.analyze_trace(SGLANG_DECODE, QWEN3)


@pytest.fixture(scope="module")
def sglang_decode_bare(bare_dir) -> tr.Analysis:
    return tr.analyze_trace(_bare(bare_dir, SGLANG_DECODE), QWEN3)


@pytest.fixture(scope="module")
def sglang_extend() -> tr.Analysis:
    return tr.analyze_trace(SGLANG_EXTEND, QWEN3)


@pytest.fixture(scope="module")
def vllm_decode() -> tr.Analysis:
    return tr.analyze_trace(VLLM_DECODE, GPT_OSS)


@pytest.fixture(scope="module")
def vllm_decode_bare(bare_dir) -> tr.Analysis:
    return tr.analyze_trace(_bare(bare_dir, VLLM_DECODE), GPT_OSS)


# ------------------------------------------------------------------------------ coverage
@pytest.mark.parametrize("name", ["sglang_decode", "sglang_extend", "vllm_decode"])
def test_named_and_costed_with_captures(request, name):
    """>= 95% of kernel time named with evidence and >= 95% costed."""
    a = request.getfixturevalue(name)
    assert a.coverage["evidence_fraction"] >= 0.95, a.coverage
    assert a.coverage["costed_fraction"] >= 0.95, a.coverage


@pytest.mark.parametrize("name", ["sglang_decode_bare", "vllm_decode_bare"])
def test_named_and_costed_without_captures(request, name):
    """The capture folder removed: named from the architecture and the kernel families, costed
    from the step annotation: still >= 90% (both reach 98%)."""
    a = request.getfixturevalue(name)
    assert a.coverage["evidence_fraction"] >= 0.9, a.coverage
    assert a.coverage["costed_fraction"] >= 0.9, a.coverage
    assert set(a.graphs.graphs["method"]) == {"kernel_name"}
    assert set(a.graphs.graphs["shapes"]) == {"step"}
    assert "step annotation" in a.graphs.graphs["note"].iloc[0]


def _piecewise_kernels(tmp: Path) -> tuple[tr.Analysis, pd.DataFrame]:
    """The vLLM decode re-cut as piecewise graphs (it was 3.9% named): attention and
    its cache write run eagerly under `vllm::unified_attention_with_output` between 25 graph
    pieces, with no capture folder beside it; its analysis and named kernels."""
    doc = json.loads(gzip.decompress(VLLM_DECODE.read_bytes()))
    pw = as_piecewise(doc, r"reshape_and_cache|unified_attention|reduce_segments")
    path = tmp / "piecewise" / "piecewise.json.gz"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(json.dumps(pw).encode()))
    a, att = analyze_trace_kernels(path, GPT_OSS)
    return a, att.kernels


def test_piecewise_graphs_named_as_one_step(tmp_path, bare_dir):
    """The pieces and the eager attention between them are one replay, named from the kernel
    families and costed from the step annotation like the FULL graph: every kernel's name the
    FULL replay's (the same kernels at the same times)."""
    a, pieces = _piecewise_kernels(tmp_path)
    assert a.coverage["evidence_fraction"] >= 0.95, a.coverage
    assert a.coverage["costed_fraction"] >= 0.95, a.coverage
    assert a.graphs.replays == 1 and a.graphs.graphs["replays"].tolist() == [1]
    full, att = analyze_trace_kernels(_bare(bare_dir, VLLM_DECODE), GPT_OSS)
    key = ["ts_us", "dur_us"]
    both = pieces.merge(att.kernels, on=key, suffixes=("", "_full"))
    assert len(both) == len(pieces) == len(att.kernels)
    wrong = both["operator"] != both["operator_full"]
    assert both.loc[wrong, "dur_us"].sum() <= 0.01 * both["dur_us"].sum(), both[wrong]
    assert _flops(a)["attention"] == pytest.approx(_flops(full)["attention"])


def test_piecewise_mixed_step_attention_from_the_annotation(tmp_path):
    """A vLLM mixed step of 9 prefill chunks and 37 decodes replayed from
    piecewise graphs, with its capture (attention read 17 GFLOP from the capture's shapes, not the
    annotation's Σq·k terms): the Qwen3 decode replay re-cut as piecewise graphs (paged
    attention and the cache write eager between them), its annotation that mixed step, its
    capture folder beside it. The capture (batch 32, FULL) is said not to match the step and
    attention is costed from the annotation: causal pairs of the chunks Σq·k - (Σq² - Σq)/2,
    plus Σk for the decodes, 4·n_q·d FLOPs a pair, every layer."""
    doc = json.loads(gzip.decompress(SGLANG_DECODE.read_bytes()))
    pw = as_piecewise(doc, r"store_kvcache|paged_attention")
    chunks = dict(n=9, q=4608, k=9216, qq=9 * 512 * 512, qk=9 * 512 * 1024)  # q 512, k 1024
    dec = dict(n=37, k=37 * 2000)
    step = (f"execute_{chunks['q'] + dec['n']}_context_{chunks['n']}(sq{chunks['q']}"
            f"sk{chunks['k']}sqsq{chunks['qq']}sqsk{chunks['qk']})_generation_{dec['n']}"
            f"(sq{dec['n']}sk{dec['k']}sqsq{dec['n']}sqsk{dec['k']})")
    for e in pw["traceEvents"]:
        if e.get("cat") == "user_annotation":
            e["name"] = step if e["name"].startswith("execute_") else (
                f"step[MIXED bs=46 toks={chunks['q'] + dec['n']}]")
    folder = tmp_path / "mixed"
    shutil.copytree(SGLANG_DECODE.parent / "capture_traces", folder / "capture_traces")
    path = folder / "mixed_step.json.gz"
    path.write_bytes(gzip.compress(json.dumps(pw).encode()))
    a, att = analyze_trace_kernels(path, QWEN3)
    assert set(att.kernels["phase"]) == {"mixed"}
    assert any("no capture of its step's batch" in f for f in a.graphs.flags)
    pairs = chunks["qk"] - (chunks["qq"] - chunks["q"]) / 2 + dec["k"]  # 3,615,248
    c = a.costed[a.costed["cost_kind"] == "attention"]
    assert set(c["derivation"]) == {"step"}
    assert c["flops"].sum() == pytest.approx(4 * NQ * D * pairs * L, rel=1e-12)  # 2.132 TFLOP
    assert a.coverage["evidence_fraction"] >= 0.95 and a.coverage["costed_fraction"] >= 0.95


def test_b200_tp8_prefill_of_bmm_experts_named(tmp_path, bare_dir):
    """gpt-oss on a B200, TP=8, bf16 x MXFP4 expert `bmm_*` (it read 38% `residual`,
    no prefill phase, qkv FLOPs 0): the vLLM replay as a B200 TP=8 rank runs a prefill of
    4 x 2048 tokens (its kernels renamed, an all-reduce after each o_proj and MoE). Every kernel
    the MI300X replay names from its capture gets the same name (the eager lm_head may stay an
    unnamed aten::mm: its recorded shape is the unsharded vocabulary), the all-reduces are
    all_reduce, every kernel is in the prefill phase and qkv_proj's FLOPs are the hand value."""
    doc = json.loads(gzip.decompress(VLLM_DECODE.read_bytes()))
    path = tmp_path / "b200" / "gpt-oss_prefill_tp8_b200.json.gz"
    path.parent.mkdir()
    path.write_bytes(gzip.compress(json.dumps(as_b200_tp8_prefill(doc)).encode()))
    a, att = analyze_trace_kernels(path, GPT_OSS, options=AnalysisOptions(tp=8))
    _, truth = analyze_trace_kernels(VLLM_DECODE, GPT_OSS)
    k = att.kernels.sort_values("ts_us")
    reduce_ = k["name"] == B200_ALL_REDUCE
    assert set(k.loc[reduce_, "operator"]) == {"all_reduce"} and reduce_.sum() == 2 * OL
    k, t = k[~reduce_], truth.kernels.sort_values("ts_us")
    got, want = k["operator"].to_numpy(), t["operator"].to_numpy()
    unnamed = k["evidence"].eq("fallback").to_numpy()
    wrong = (got != want) & ~unnamed
    assert t["dur_us"].to_numpy()[wrong].sum() <= 0.02 * t["dur_us"].sum()
    assert (got == "residual").sum() == 0
    assert set(k["phase"]) == {"prefill"}
    tokens, shard = 4 * 2048, OQKV // 8
    qkv = OL * (_gemm(tokens, OH, shard) + tokens * shard)
    assert _flops(a)["qkv_proj"] == pytest.approx(qkv)  # 724,901,560,320


# ---------------------------------------------------------------------- HIP graph replays
def test_hip_graph_launch_replays():
    """hipGraphLaunch is a graph launch: its 544 kernels share its correlation id."""
    t = tr.load_trace(SGLANG_DECODE)
    rr = graphs.replay_rows(t)
    assert len(rr) == 544 and rr["replay"].nunique() == 1
    launch = t.runtime.loc[t.runtime["name"] == "hipGraphLaunch", "correlation"]
    assert set(t.device["correlation"].iloc[rr["row"]]) == set(launch.astype(int))


def test_capture_found_beside_the_trace_and_said(sglang_decode, vllm_decode):
    for a in (sglang_decode, vllm_decode):
        # said as a note, not a warning: nothing went wrong
        said = [n for n in a.notes if n.startswith("graph captures: found")]
        assert len(said) == 1 and "capture_traces" in said[0]
        assert not any("graph captures: found" in w for w in a.warnings)
        text = report.terminal_table([a])
        assert f"note: {said[0]}" in text and f"WARNING: {said[0]}" not in text
        g = a.graphs.graphs.iloc[0]
        assert g["method"] == "graph_map" and "(batch 32, FULL)" in g["template"]
        # the alignment's quality: every replayed kernel matched by name, in order (LCS)
        assert g["matched"] == g["kernels"] and "100.0% of the graph" in g["note"]
        assert a.graphs.named_fraction == 1.0 and a.graphs.costed_time_us == a.graphs.time_us


def test_capture_launches_carry_kernel_names():
    """A capture's launches hold their kernel's name and grid in args (the kernels never ran)."""
    p = SERVING / "sglang_qwen3-8b_decode_mi300x" / "capture_traces" / "bs_32_rank0.json.gz"
    launches = captures.capture_launches(p)
    assert launches["name"].str.startswith("Cijk_Alik_Bljk").sum() >= 36 * 4
    (m,) = captures.load(p.parent, QWEN3)
    assert (m.batch, m.mode, m.capture) == (32, "FULL", True)
    assert len(m.rows) == 544 and m.rows["operator"].eq("qkv_proj").sum() == 36


def test_graph_map_takes_a_capture_or_a_folder():
    capture = SERVING / "vllm_gpt-oss-20b_decode_full_mi300x" / "capture_traces"
    for given in (capture, next(capture.glob("*.pt.trace.json.gz"))):
        a = tr.analyze_trace(VLLM_DECODE, GPT_OSS, options=tr.AnalysisOptions(graph_map=given))
        assert not any(w.startswith("graph captures: found") for w in a.warnings)
        assert a.graphs.graphs["method"].tolist() == ["graph_map"]


def test_capture_of_another_batch_is_not_used(tmp_path):
    """A capture whose execution_details say batch 64 is not matched to the batch-32 step."""
    src = SERVING / "sglang_qwen3-8b_decode_mi300x"
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    details = dst / "capture_traces" / "execution_details.json"
    details.write_text(json.dumps([{"file": "bs_32_rank0.json.gz", "batch_size": 64,
                                    "mode": "FULL"}]))
    a = tr.analyze_trace(dst / SGLANG_DECODE.name, QWEN3)
    assert any("no capture of its step's batch 32" in f for f in a.graphs.flags)
    assert a.graphs.graphs["method"].tolist() == ["kernel_name"]


def test_options_that_change_nothing_say_so(sglang_decode):
    """--graph-map or --batch/--context with no replays; --batch/--context where the step
    annotation or the capture gives the shapes."""
    a = tr.analyze_trace(SGLANG_EXTEND, QWEN3,
                         options=tr.AnalysisOptions(
                             decode_shapes=graphs.DecodeShapes(32, 1024),
                             graph_map=SERVING / "sglang_qwen3-8b_decode_mi300x" / "capture_traces"))
    said = " ".join(a.warnings)
    assert "--batch 32 --context 1024: not used: the trace holds no CUDA/HIP-graph" in said
    assert "--graph-map" in said and "not used" in said
    b = tr.analyze_trace(SGLANG_DECODE, QWEN3,
                         options=tr.AnalysisOptions(decode_shapes=graphs.DecodeShapes(32, 1024)))
    assert any("--batch 32 --context 1024 not used" in w for w in b.warnings)


# ------------------------------------------------------------------------ step annotations
def test_step_annotations_parse():
    t = tr.load_trace(SGLANG_DECODE)
    s = steps.parse(t.annotations)
    assert len(s) == 1  # execute_... and step[DECODE bs=32] nest: one step
    row = s.iloc[0]
    assert (row["phase"], row["engine"], row["mode"], row["tokens"]) == ("decode", "vllm",
                                                                         "DECODE", 32)
    assert (row["decodes"], row["d_sq"], row["d_sk"], row["chunks"]) == (32, 32, 32785, 0)
    e = steps.parse(tr.load_trace(SGLANG_EXTEND).annotations).iloc[0]
    assert (e["phase"], e["chunks"], e["p_sq"], e["p_sqsq"]) == ("prefill", 15, 15360, 15728640)
    sg = steps.parse(pd.DataFrame({"name": ["step[EXTEND bs=4 toks=900]", "step[MIXED bs=9]"],
                                   "cat": "user_annotation", "pid": 1, "tid": 1,
                                   "ts_us": [0.0, 10.0], "dur_us": [5.0, 5.0]}))
    assert sg["phase"].tolist() == ["prefill", "mixed"] and sg["tokens"].tolist()[0] == 900


def test_step_attention_pairs():
    """Causal pairs Σq·k - (Σq² - Σq)/2 for the chunks, Σk for the decodes; a window bounds
    them at W·Σq, an upper bound said as such."""
    s = steps.StepSums(chunks=2, decodes=3, p_sq=10, p_sk=30, p_sqsq=50, p_sqsk=150,
                       d_sq=3, d_sk=700)
    # chunks (q, k) = (5, 15), (5, 15): 5·15 - 5·4/2 = 65 each
    assert steps.attention(s).pairs == 130 + 700
    assert steps.attention(s, causal="full").pairs == 150 + 700
    w = steps.attention(s, window=8)
    assert w.pairs == min(130, 8 * 10) + min(700, 8 * 3) and not w.exact
    assert "upper bound" in w.note
    assert steps.parse_text(f"step 0 (mixed): {s.text()}") == s


@pytest.mark.parametrize("name, phase", [("sglang_decode", "decode"),
                                         ("sglang_extend", "prefill"),
                                         ("vllm_decode", "decode"),
                                         ("sglang_decode_bare", "decode"),
                                         ("vllm_decode_bare", "decode")])
def test_phases_from_the_step_annotation(request, name, phase):
    a = request.getfixturevalue(name)
    assert a.passes["phase"].tolist() == [phase]
    assert a.passes["evidence"].tolist() == ["step_annotation"]
    named = a.costed[a.costed["evidence"] != "fallback"]
    assert set(named["phase"]) == {phase}


# ------------------------------------------------------------------ FLOPs by hand
def _qwen3_decode_flops() -> dict[str, float]:
    b, keys = 32, 32785
    return {"qkv_proj": L * _gemm(b, H, QKV), "o_proj": L * _gemm(b, NQ * D, H),
            "gate_up_proj": L * _gemm(b, H, 2 * INTER), "down_proj": L * _gemm(b, INTER, H),
            "lm_head": _gemm(b, H, V),
            # decode: one query per request, Σk = 32785 keys over the batch, per layer
            "attention": L * 4.0 * NQ * D * keys}


@pytest.mark.parametrize("name", ["sglang_decode", "sglang_decode_bare"])
def test_qwen3_decode_flops_by_hand(request, name):
    got = _flops(request.getfixturevalue(name))
    for op, want in _qwen3_decode_flops().items():
        assert got[op] == pytest.approx(want, rel=1e-12), op


def test_qwen3_extend_flops_by_hand(sglang_extend):
    """15 fresh chunks of 1024 tokens: M = 15360; causal pairs
    Σq·k - (Σq² - Σq)/2 = 15728640 - (15728640 - 15360)/2 = 7872000; lm_head on the 15 last."""
    m, pairs = 15360, 15728640 - (15728640 - 15360) / 2
    got = _flops(sglang_extend)
    want = {"qkv_proj": L * _gemm(m, H, QKV), "o_proj": L * _gemm(m, NQ * D, H),
            "gate_up_proj": L * _gemm(m, H, 2 * INTER), "down_proj": L * _gemm(m, INTER, H),
            "lm_head": _gemm(15, H, V), "attention": L * 4.0 * NQ * D * pairs}
    assert pairs == 7872000
    for op, value in want.items():
        assert got[op] == pytest.approx(value, rel=1e-12), op


def _gpt_oss_decode_flops() -> dict[str, float]:
    b, keys, window = 32, 55086, 128
    return {"qkv_proj": OL * _gemm(b, OH, OQKV, bias=True),
            "o_proj": OL * _gemm(b, ONQ * OD, OH, bias=True),
            "router": OL * _gemm(b, OH, OE, bias=True),
            "experts_gate_up": OL * _gemm(b * OK, OH, 2 * OI),
            "lm_head": _gemm(b, OH, OV),
            # 12 full layers over Σk keys, 12 sliding ones over at most 128 keys per request
            "attention": 2.0 * ONQ * 2 * OD * (12 * keys + 12 * min(keys, window * b))}


@pytest.mark.parametrize("name", ["vllm_decode", "vllm_decode_bare"])
def test_gpt_oss_decode_flops_by_hand(request, name):
    got = _flops(request.getfixturevalue(name))
    for op, want in _gpt_oss_decode_flops().items():
        assert got[op] == pytest.approx(want, rel=1e-12), op


def test_gpt_oss_experts_down_by_hand_bare(vllm_decode_bare):
    got = _flops(vllm_decode_bare)
    assert got["experts_down"] == pytest.approx(OL * _gemm(32 * OK, OI, OH), rel=1e-12)


def test_gpt_oss_experts_down_by_hand_capture(vllm_decode):
    """The capture's vllm::moe_forward launches both triton_kernels _matmul_ogs GEMMs and the
    finalize: w13 (gate_up), w2 (down) and the top-k sum (moe_combine), each costed apart."""
    got = _flops(vllm_decode)
    assert got.get("experts_down", 0.0) == pytest.approx(OL * _gemm(32 * OK, OI, OH), rel=1e-12)
    c = vllm_decode.costed
    comb = c[(c["operator"] == "moe_combine") & c["op_name"].eq("vllm::moe_forward")]
    assert len(comb) == OL
    assert (comb["flops"] == 32 * OK * OH).all()  # one add per top-k output element
    assert (comb["bytes"] == (32 * OK * OH + 32 * OH) * 2).all()  # [32,4,2880] read, [32,2880] written


def test_gpt_oss_attention_evidence(vllm_decode):
    """The sliding layers' count says it is a bound, the sinks are said."""
    att = vllm_decode.costed[vllm_decode.costed["operator"] == "attention"]
    shapes = att.loc[att["flops"] > 0, "shape"]
    sliding = shapes[shapes.str.contains("sliding window 128")]
    assert len(sliding) == 12 and sliding.str.contains("upper bound").all()
    assert shapes.str.contains("sinks").all() and len(shapes) == 24


def test_mxfp4_experts_bytes(vllm_decode_bare):
    """The experts' weights at 4.25 bits, charged per expected active expert."""
    c = vllm_decode_bare.costed
    up = c[c["operator"] == "experts_gate_up"]
    active = up["experts_active"].dropna().iloc[0]
    assert active == pytest.approx(OE * (1 - (1 - OK / OE) ** 32))
    weights = active * OH * 2 * OI * 4.25 / 8
    acts = (32 * OK) * (OH + 2 * OI) * 2
    assert up["bytes"].iloc[0] == pytest.approx(weights + acts, rel=1e-9)


def test_padded_experts_costed_at_their_useful_size(vllm_decode):
    """vLLM pads gpt-oss's hidden 2880 to 3072 for its MXFP4 kernels: costed at 2880, said."""
    up = vllm_decode.costed[vllm_decode.costed["operator"] == "experts_gate_up"]
    costed = up[up["flops"] > 0]
    assert costed["shape"].str.contains("hidden padded 2880 -> 3072").all()
    assert (costed["K"] == OH).all()


def test_fused_add_rmsnorm_is_a_norm_with_the_residual_bytes(sglang_decode, sglang_extend):
    """aiter's add_rmsnorm: input and residual read, out and residual written, weight read."""
    for a, m in ((sglang_decode, 32), (sglang_extend, 15360)):
        c = a.costed[a.costed["operator"] == "post_attention_norm"]
        assert (c["cost_kind"] == "norm").all()
        assert c["bytes"].iloc[0] == 4 * m * H * 2 + H * 2
        assert c["flops"].iloc[0] == 5 * m * H


# ---------------------------------------------------------------------- kernel families
@pytest.mark.parametrize("kernel, op", [
    ("Cijk_Alik_Bljk_BBS_BH_Bias_HA_S_SAV_UserArgs_MT64x32x256_MI16x16x1_SN", graph_naming.GEMM),
    ("_matmul_ogs_NNT_bf16xbf16xmxfp4_16x128x256x1_swiglu", graph_naming.GEMM),
    ("void paged_attention_ll4mi_QKV_mfma16_kernel<0, __hip_bfloat16>", graph_naming.ATTENTION_OP),
    ("void paged_attention_ll4mi_reduce_kernel<__hip_bfloat16>", graph_naming.ATTENTION_OP),
    ("kernel_unified_attention_3d", graph_naming.ATTENTION_OP),
    ("reduce_segments", graph_naming.ATTENTION_OP),
    ("void vllm::rotary_embedding_kernel<c10::BFloat16, true>(long const*)", ""),
    ("void at::native::vectorized_gather_kernel<16, long>(char*)", "aten::index"),
])
def test_kernel_families_of_bare_replays(kernel, op):
    assert graph_naming.kernel_ops(pd.Series([kernel])).iloc[0] == op


# ------------------------------------------------------------------------------ hardware
def test_presets_cite_their_datasheets():
    for name in ("mi300x", "mi325x", "mi355x", "b200", "gb200", "h20", "l40s"):
        hw = hardware.get_hardware(name)
        assert "data sheet" in hw.source.lower() or "datasheet" in hw.source.lower() or \
            "product brief" in hw.source.lower(), name
        assert hw.peak("bf16") > 0 and hw.mem_bandwidth > 0 and hw.link_bandwidth
    assert hardware.get_hardware("mi300x").peak("bf16") == 1307.4e12
    assert hardware.get_hardware("mi300x").mem_bandwidth == 5.3e12
    assert hardware.get_hardware("b200").peak("mxfp4") == 9000e12
    assert hardware.get_hardware("mi355x").peak("fp4") == 10066.3e12


@pytest.mark.parametrize("name, preset", [("AMD Instinct MI300X", "mi300x"),
                                          ("AMD Instinct MI300X VF", "mi300x"),
                                          ("AMD Instinct MI325X", "mi325x"),
                                          ("AMD Instinct MI355X", "mi355x"),
                                          ("NVIDIA B200", "b200"), ("NVIDIA H20", "h20"),
                                          ("NVIDIA L40S", "l40s"), ("NVIDIA GB200", "gb200")])
def test_device_names_traces_carry(name, preset):
    assert hardware.for_device_name(name).name == preset


def test_device_without_a_name_known_by_its_properties():
    """vLLM's ROCm trace leaves deviceProperties' names empty: gfx 9.4, 304 CUs, 192 GiB."""
    props = tr.load_trace(VLLM_DECODE).meta["device_properties"]
    assert props[0]["name"] == ""
    hw, why = hardware.trace_device(props)
    assert hw.name == "mi300x" and "304 multiprocessors" in why
    hw, why = hardware.trace_device([{"name": "NVIDIA B300"}])
    assert hw is None and "'NVIDIA B300'" in why and "--hardware" in why


def test_low_precision_bytes_per_element():
    assert dtypes.lookup("mxfp4").bits == 4.25 and dtypes.lookup("nvfp4").bits == 4.5
    assert dtypes.lookup("c10::Float8_e4m3fn").bytes == 1
    assert hardware.dtype_key("nvfp4") == hardware.dtype_key("mxfp4") == "fp4"


# --------------------------------------------------------------------------- collectives
def test_symmetric_memory_all_reduce_counted_once(tmp_path):
    """vLLM's symmetric-memory all-reduce: a copy into the buffer, multimem_all_reduce_, a copy
    back, all inside vllm::all_reduce: one collective of S x 2(t-1)/t bytes, one call."""
    k, m, h, t = Kineto(), 512, 7168, 8
    with k.ann("ProfilerStep#1"), k.op("vllm::all_reduce", [[m, h], []], [BF, "Scalar"],
                                        concrete=["", "tp:0"]):
        with k.op("aten::copy_", [[m * h], [m * h], []], [BF, BF, "Scalar"]):
            k.kernel("Memcpy DtoD (Device -> Device)", 3.0, kind="memcpy")
        with k.op("symm_mem::multimem_all_reduce_", [[m * h], [], []], [BF, "", ""],
                  concrete=["", "sum", "tp:0"]):
            k.kernel("void c10d::symmetric_memory::multimem_all_reduce_kernel"
                     "<c10::BFloat16, 8>(c10::BFloat16*)", 10.0)
        with k.op("aten::copy_", [[m, h], [m * h], []], [BF, BF, "Scalar"]):
            k.kernel("Memcpy DtoD (Device -> Device)", 3.0, kind="memcpy")
    a = tr.analyze_trace(k.write(tmp_path / "symm.json", device="NVIDIA B200"),
                         options=tr.AnalysisOptions(tp=t))
    c = a.costed[a.costed["operator"] == "all_reduce"]
    assert c["bytes"].sum() == m * h * 2 * 2 * (t - 1) / t
    assert len(a.collectives) == 1 and a.collectives["kernels"].iloc[0] == 3
    assert a.hardware.name == "b200"


# ---------------------------------------------------------------- outputs on serving traces
def test_perfetto_html_and_diff_read_right(tmp_path, capsys):
    """--perfetto carries the replayed kernels' operators and phase; report.html is written;
    diff of the capture-named and the bare trace finds the same workload."""
    perfetto, out = tmp_path / "p.json.gz", tmp_path / "out"
    assert cli.main(["analyze", str(SGLANG_DECODE), "--model", str(SERVING / "configs" /
                     "qwen3-8b" / "config.json"), "--no-cache", "--perfetto", str(perfetto),
                     "--out", str(out)]) == 0
    ev = json.loads(gzip.decompress(perfetto.read_bytes()))["traceEvents"]
    kernels = [e["args"]["roofline"] for e in ev if e.get("cat") == "kernel"
               and "roofline" in e.get("args", {})]
    assert {k["phase"] for k in kernels} == {"decode"}
    assert sum(k["operator"] == "qkv_proj" for k in kernels) == 36
    assert (out / "report.html").stat().st_size > 0
    report = json.loads((out / "report.json").read_text())
    assert report["traces"][0]["cuda_graphs"]["graphs"][0]["method"] == "graph_map"
    capsys.readouterr()
    bare = _bare(tmp_path, SGLANG_DECODE)
    assert cli.main(["diff", str(SGLANG_DECODE), str(bare), "--model",
                     str(SERVING / "configs" / "qwen3-8b" / "config.json")]) == 0
    text = capsys.readouterr().out
    line = next(x for x in text.splitlines() if x.startswith("whole model"))
    assert "=" in line.split()[-1] and np.isfinite(float(line.split()[4]))


# -------------------------------------------------------------------- steps and modes, unit
def test_each_kernel_takes_its_steps_phase(tmp_path):
    """Three annotated steps (prefill, decode, mixed) each launching a GEMM: each kernel's
    phase is its step's, whatever its own shapes say."""
    k = Kineto()
    names = ["execute_64_context_2(sq64sk64sqsq2048sqsk2048)_generation_0(sq0sk0sqsq0sqsk0)",
             "execute_4_context_0(sq0sk0sqsq0sqsk0)_generation_4(sq4sk400sqsq4sqsk400)",
             "execute_34_context_1(sq30sk90sqsq900sqsk2700)_generation_4(sq4sk40sqsq4sqsk40)"]
    for name in names:
        with k.ann(name), k.op("aten::mm", [[8, 64], [64, 64]], [BF, BF]):
            k.kernel("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", 2.0)
    t = tr.load_trace(k.write(tmp_path / "steps.json"))
    s = steps.parse(t.annotations)
    assert s["phase"].tolist() == ["prefill", "decode", "mixed"]
    assert steps.kernel_steps(t, s).tolist() == [0, 1, 2]
    att, _, _ = tr.attribute_trace(t)
    assert att["phase"].tolist() == ["prefill", "decode", "mixed"]
    assert att["serving_step"].astype(str).str.startswith(("step 0", "step 1", "step 2")).all()


def test_captures_for_a_graph_by_batch_and_mode():
    rows = pd.DataFrame()
    full32 = graphs.Mapping("a", rows, np.array([0]), batch=32, mode="FULL", capture=True)
    piece32 = graphs.Mapping("b", rows, np.array([0]), batch=32, mode="PIECEWISE", capture=True)
    decode8 = graphs.Mapping("c", rows, np.array([0]), batch=8, mode="DECODE", capture=True)
    caps = [full32, piece32, decode8]
    assert graphs.for_graph(caps, 32, "FULL") == ([full32], None)
    assert graphs.for_graph(caps, 8, "FULL") == ([decode8], None)  # DECODE is no graph mode
    kept, why = graphs.for_graph(caps, 64, "FULL")
    assert kept == [] and "no capture of its step's batch 64, FULL" in why
    assert graphs.for_graph(caps, None, None)[0] == caps
    modes = graphs.step_modes(np.array([0, 0, 1, -1]))
    assert modes.tolist() == ["PIECEWISE", "PIECEWISE", "FULL", None]


def test_capture_of_an_unannotated_replay_is_said_ambiguous(tmp_path):
    """Without a step annotation the batch is unknown: of two captures that fit, the first is
    used and a flag says the batch could not be told."""
    run = tmp_path / "run"
    shutil.copytree(SGLANG_DECODE.parent, run)
    doc = json.loads(gzip.decompress(SGLANG_DECODE.read_bytes()))
    doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("cat") != "user_annotation"]
    trace = run / SGLANG_DECODE.name
    trace.write_bytes(gzip.compress(json.dumps(doc).encode()))
    shutil.copy(run / "capture_traces" / "bs_32_rank0.json.gz", run / "capture_traces" / "b.json.gz")
    (run / "capture_traces" / "execution_details.json").write_text(json.dumps([
        {"file": "bs_32_rank0.json.gz", "batch_size": 32, "mode": "FULL"},
        {"file": "b.json.gz", "batch_size": 64, "mode": "FULL"}]))
    a = tr.analyze_trace(trace, QWEN3)
    assert a.graphs.graphs["template"].iloc[0].startswith("bs_32_rank0.json.gz")
    assert any("its batch is unknown" in f for f in a.graphs.flags)


def test_a_capture_trace_is_read_as_a_regular_file_within_the_inflation_limit(tmp_path, monkeypatch):
    """A FIFO among the captures is refused without blocking; a truncated gzip and a gzip bomb
    (here past a lowered limit) are one-line errors naming the file."""
    import os

    from trace_roofline.errors import InputError
    from trace_roofline.trace import read

    fifo = tmp_path / "bs_1_rank0.json"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="not a regular file"):
        captures._read_bytes(fifo)
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(gzip.compress(b'{"traceEvents": []}' * 100)[:40])
    with pytest.raises(InputError, match="cut.json.gz"):
        captures._read_bytes(cut)
    bomb = tmp_path / "bomb.json.gz"
    bomb.write_bytes(gzip.compress(b" " * (8 << 20)))
    monkeypatch.setattr(read, "inflation_limit", lambda size: 1 << 20)
    with pytest.raises(InputError, match="bomb.json.gz"):
        captures._read_bytes(bomb)
