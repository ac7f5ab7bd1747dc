"""Mixture-of-experts decode steps replayed from CUDA graphs, on the real H200 traces of
sample_traces/cuda_graphs/hf-moe-{mixtral-8x7b,qwen3-30b-a3b}-2l_decode_b4_s512_static1024_
groupedmm_{graph,mapping}_h200 (HF transformers 5.17, grouped_mm experts, a StaticCache step in
a torch.cuda.CUDAGraph; sample_traces/README.md): named from the eager mapping run
(`--graph-map`) exactly as that run, and without one from the model and the kernel names.
vLLM's kernels (fused_moe_kernel, topk_softmax, moe_align_block_size, moe_sum) are checked on
replays made from the SYNTHETIC vLLM traces (their kernel names follow vLLM's source; no vLLM
runs on the project's GPU)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

import trace_roofline as tr
from tests import replay_factory
from tests.builders import SAMPLES, read, write
from trace_roofline.attribution import graph_align, graphs

CG = str(SAMPLES / "cuda_graphs" / "hf-moe-{}-2l_decode_b4_s512_static1024_groupedmm_{}_h200.json.gz")
REPLAYS, LAYERS, BATCH = 4, 2, 4
MOE_OPS = {"router", "moe_dispatch", "experts_gate_up", "experts_act", "experts_down",
           "moe_combine"}
GEMMS = {"q_proj", "k_proj", "v_proj", "o_proj", "router", "experts_gate_up", "experts_down",
         "lm_head"}


@pytest.fixture(scope="module", params=["mixtral-8x7b", "qwen3-30b-a3b"])
def case(request):
    model = tr.get_model(request.param)
    t = tr.load_trace(CG.format(request.param, "graph"))
    m_t = tr.load_trace(CG.format(request.param, "mapping"))
    att, m_att = tr.attribute(t, model), tr.attribute(m_t, model)
    mapping = graphs.mapping_from(m_t, m_att)
    by_map, _ = graphs.name_replays(t, att, model, mapping=mapping)
    bare, report = graphs.name_replays(t, att, model)
    rr = graphs.replay_rows(t)
    return dict(name=request.param, model=model, trace=t, mapping=mapping, by_map=by_map,
                bare=bare, report=report, replays=rr)


def test_graph_map_names_each_replay_exactly_as_the_eager_mapping(case):
    """Every replayed kernel has an eager twin of the same name in the mapping's forward pass
    (aligned in order; the pass also holds the eager argmax and copy_ between steps, which the
    graph does not) and takes its operator and layer."""
    tmpl = case["mapping"].rows
    assert len(case["mapping"].starts) == 2  # the 4 eager steps are one kernel sequence
    rr = case["replays"]
    assert rr["replay"].nunique() == REPLAYS
    t_names = tmpl["name"].astype(object).to_numpy()
    vocab = {n: i for i, n in enumerate(dict.fromkeys(t_names))}
    t_codes = np.array([vocab[n] for n in t_names])
    t_op = tmpl["operator"].to_numpy(dtype=object)
    t_layer = tmpl["layer"].astype("Int64").fillna(-1).to_numpy()
    for _, rows in rr.groupby("replay"):
        got = case["by_map"].iloc[rows["row"].to_numpy()]
        codes = np.array([vocab.get(n, -1) for n in got["name"].astype(object)])
        twin = graph_align.align(codes, t_codes)
        assert (twin >= 0).all()  # each kernel matched by name, none attached or left over
        assert (got["operator"].to_numpy(dtype=object) == t_op[twin]).all()
        assert (got["layer"].astype("Int64").fillna(-1).to_numpy() == t_layer[twin]).all()
        named = got["operator"] != "other"  # the preamble's position ids: no operator
        assert set(got.loc[named, "evidence"]) == {"graph_map"}
        assert set(got.loc[~named, "evidence"]) <= {"fallback"}
    assert set(t_op) >= MOE_OPS


def test_graph_map_costs_equal_the_mapping_run(case):
    """FLOPs and bytes per operator: the 4 replays carry the 4 eager steps' shapes."""
    name = case["name"]
    a = tr.analyze_trace(CG.format(name, "graph"), case["model"],
                         options=tr.AnalysisOptions(graph_map=CG.format(name, "mapping")))
    m = tr.analyze_trace(CG.format(name, "mapping"), case["model"])
    assert a.graphs.named_fraction == 1.0 and a.graphs.flags == ()
    got = a.costed.groupby("operator")[["flops", "bytes"]].sum()
    want = m.costed.groupby("operator")[["flops", "bytes"]].sum()
    for op in MOE_OPS | GEMMS:
        assert got.loc[op, "flops"] == pytest.approx(want.loc[op, "flops"], rel=1e-12), op
        assert got.loc[op, "bytes"] == pytest.approx(want.loc[op, "bytes"], rel=1e-12), op


def test_bare_replays_named_from_kernel_names(case):
    """No mapping: the model's sparse-layer GEMM order (q, k, v | o, router, experts_gate_up,
    experts_down; the grouped GEMM's prepare kernel joins it) and the MoE kernels by name.
    Against the mapping's names: every GEMM, MoE and norm kernel the same; the only kernels
    named otherwise are StaticCache's position counter (an add_ after RoPE that SDPA's mask
    reads: `attention` in eager, where the op is add_, `rope` from its kernel, an add)."""
    rep = case["report"]
    assert rep.named_fraction == 1.0 and rep.graphs["method"].tolist() == ["kernel_name"]
    rows = case["replays"]["row"].to_numpy()
    m_op = case["by_map"]["operator"].to_numpy(dtype=object)[rows]
    b_op = case["bare"]["operator"].to_numpy(dtype=object)[rows]
    m_layer = case["by_map"]["layer"].astype("Int64").fillna(-1).to_numpy()[rows]
    b_layer = case["bare"]["layer"].astype("Int64").fillna(-1).to_numpy()[rows]
    differ = (m_op != b_op) | (m_layer != b_layer)
    assert set(zip(m_op[differ], b_op[differ], strict=True)) == {("attention", "rope")}
    assert differ.sum() == REPLAYS * LAYERS
    dur = case["trace"].device["dur_us"].to_numpy()[rows]
    assert dur[~differ].sum() / dur.sum() >= 0.995
    ev = case["bare"]["evidence"].to_numpy(dtype=object)[rows]
    assert set(ev[np.isin(b_op, list(MOE_OPS | GEMMS))]) == {"kernel_name"}
    assert set(b_op) >= MOE_OPS
    if case["model"].qk_norm:
        assert {"q_norm", "k_norm"} <= set(b_op)


def test_bare_replays_costed_from_user_shapes(case):
    """--batch 4 --context 1024: the router [4, H] x [H, E] and the experts as one grouped GEMM
    each over B·k routed rows, weights charged for the expected active experts, as the eager
    run's own _grouped_mm: FLOPs and bytes equal the mapping's; FLOPs by hand
    2·(B·k)·H·2I (gate_up) and 2·(B·k)·I·H (down) per layer and replay."""
    name, model = case["name"], case["model"]
    e, h = model.experts, model.hidden_size
    a = tr.analyze_trace(CG.format(name, "graph"), model,
                         options=tr.AnalysisOptions(decode_shapes=graphs.DecodeShapes(BATCH, 1024)))
    m = tr.analyze_trace(CG.format(name, "mapping"), model)
    got = a.costed.groupby("operator")[["flops", "bytes"]].sum()
    want = m.costed.groupby("operator")[["flops", "bytes"]].sum()
    rows = BATCH * e.top_k
    n = REPLAYS * LAYERS
    assert got.loc["experts_gate_up", "flops"] == n * 2 * rows * h * 2 * e.intermediate_size
    assert got.loc["experts_down", "flops"] == n * 2 * rows * e.intermediate_size * h
    for op in ("experts_gate_up", "experts_down"):
        for col in ("flops", "bytes"):
            assert got.loc[op, col] == pytest.approx(want.loc[op, col], rel=1e-12), (op, col)
    router = a.costed[(a.costed["operator"] == "router") & a.costed["flops"].notna()]
    assert (router["flops"] == 2 * BATCH * h * e.num_experts).all() and len(router) == n
    assert a.passes["phase"].tolist() == ["decode"] * REPLAYS


def test_dense_and_sparse_layers_mixed_are_not_named():
    """A model whose traced layers are dense and sparse (decoder_sparse_step 2: layer 0 dense)
    does not fit the kernel sequence's repeated layers: left unattributed, with the reason."""
    mixed = dataclasses.replace(tr.get_model("mixtral-8x7b"), decoder_sparse_step=2)
    t = tr.load_trace(CG.format("mixtral-8x7b", "graph"))
    out, rep = graphs.name_replays(t, tr.attribute(t, mixed), mixed)
    assert rep.named_fraction == 0.0
    assert "dense and sparse layers mixed" in rep.graphs["note"].iloc[0]


def _synthetic_replays(name: str, tmp: Path, shuffle_seed: int | None = None) -> Path:
    """The synthetic vLLM trace's two ProfilerSteps as two CUDA-graph replays (its steps'
    ranges overlap, as a CPU running ahead of the GPU writes them: each is cut at the next's
    start so that every kernel falls in its own step)."""
    doc = read(SAMPLES / "moe" / f"synthetic_vllm_fused_moe_{name}.json.gz")
    steps = sorted((e for e in doc["traceEvents"]
                    if str(e.get("name")).startswith("ProfilerStep#")), key=lambda e: e["ts"])
    for a, b in zip(steps, steps[1:], strict=False):
        a["dur"] = b["ts"] - a["ts"]
    return write(replay_factory.as_replays(doc, shuffle_seed=shuffle_seed),
                 tmp / f"{name}_replays.json.gz")


@pytest.mark.parametrize("name, model", [
    ("mixtral-8x7b-2l_decode_b8_s512", "mixtral-8x7b"),
    ("mixtral-8x7b-2l_decode_b8_s512_moeforward", "mixtral-8x7b"),
    ("qwen1.5-moe-a2.7b-2l_decode_b8_s512", "qwen1.5-moe-a2.7b"),
])
def test_vllm_fused_moe_kernels_by_name(tmp_path, name, model):
    """SYNTHETIC vLLM layers replayed: fused qkv, rotary, reshape_and_cache, FA3, o, the router
    GEMM, topk_softmax (moeSoftmax + moeTopK for 60 experts), moe_align_block_size, the two
    fused_moe_kernel launches (w13 -> experts_gate_up, w2 -> experts_down), silu_and_mul,
    moe_sum; Qwen1.5-MoE's shared expert (fused gate_up) and sigmoid gate first. Named as the
    eager trace names them, the KV-cache store inside vLLM's attention op included (`kv_cache`:
    the dispatching op gathers nothing)."""
    spec = tr.get_model(model)
    path = _synthetic_replays(name, tmp_path)
    t = tr.load_trace(path)
    att = tr.attribute(t, spec)
    bare, rep = graphs.name_replays(t, att, spec)
    assert rep.replays == 2 and rep.named_fraction == 1.0
    assert set(rep.graphs["method"]) == {"kernel_name"}
    src = tr.load_trace(SAMPLES / "moe" / f"synthetic_vllm_fused_moe_{name}.json.gz")
    by_map, _ = graphs.name_replays(t, att, spec,
                                    mapping=graphs.mapping_from(src, tr.attribute(src, spec)))
    rows = graphs.replay_rows(t)["row"].to_numpy()
    m_op = by_map["operator"].to_numpy(dtype=object)[rows]
    b_op = bare["operator"].to_numpy(dtype=object)[rows]
    assert (m_op == b_op).all(), set(zip(m_op[m_op != b_op], b_op[m_op != b_op], strict=True))
    kernels = bare["name"].to_numpy(dtype=object)[rows]
    fused = np.flatnonzero(kernels == "fused_moe_kernel")
    assert b_op[fused].tolist() == ["experts_gate_up", "experts_down"] * (len(fused) // 2)
    assert set(b_op) >= MOE_OPS
    # --batch 8: the experts over 8·k rows; the router's logits GEMM and, where a shared
    # expert's sigmoid gate (H -> 1) is also named router (Qwen1.5-MoE), that gate's GEMM:
    # each router instance takes the shape of the GEMM the layout names in it
    a = tr.analyze_trace(path, spec, options=tr.AnalysisOptions(decode_shapes=graphs.DecodeShapes(8, 512)))
    flops = a.costed.groupby("operator")["flops"].sum()
    e, h, n = spec.experts, spec.hidden_size, 2 * LAYERS
    assert flops["experts_gate_up"] == n * 2 * 8 * e.top_k * h * 2 * e.intermediate_size
    assert flops["experts_down"] == n * 2 * 8 * e.top_k * e.intermediate_size * h
    assert flops["router"] == n * 2 * 8 * h * (e.num_experts + (1 if e.shared_gate else 0))


@pytest.mark.parametrize("seed", [0, 1])
def test_shuffled_moe_replays_are_not_named(tmp_path, seed):
    """Shaped to mislead: the same MoE kernels (fused_moe_kernel, topk_softmax, moe_sum, ...)
    in another order within each replay. Kernel names alone never name them: no repeated
    layer pattern, nothing named, every kernel unattributed."""
    spec = tr.get_model("mixtral-8x7b")
    t = tr.load_trace(_synthetic_replays("mixtral-8x7b-2l_decode_b8_s512", tmp_path, seed))
    bare, rep = graphs.name_replays(t, tr.attribute(t, spec), spec)
    assert rep.replays == 2 and rep.named_kernels == 0
    rows = graphs.replay_rows(t)["row"].to_numpy()
    assert (bare["operator"].to_numpy(dtype=object)[rows] == "unattributed").all()


# ------------------------------------------- batched_mm and Qwen1.5-MoE's shared expert
FORMS = str(SAMPLES / "cuda_graphs" / "hf-moe-{}-2l_decode_b4_s512_static1024_{}_{}_h200.json.gz")


@pytest.mark.parametrize(("model", "form"), [
    ("mixtral-8x7b", "batchedmm"), ("qwen3-30b-a3b", "batchedmm"),
    ("qwen1.5-moe-a2.7b", "batchedmm"), ("qwen1.5-moe-a2.7b", "groupedmm")])
def test_more_forms_named_from_kernel_names_as_their_mapping(model, form):
    """Real H200 replays of batched_mm (each (token, expert) pair's weights gathered by
    `index`, then one bmm) and of Qwen1.5-MoE's shared expert. With the mapping: every kernel
    as the eager run. From kernel names: as the mapping but for StaticCache's position counter
    (`rope` here, `attention` eager, as above) and batched_mm's cast and clamp of the expert
    ids (`router` here, `moe_dispatch` eager). The weight gathers join the expert GEMM they
    feed (before: `router` and `experts_act`, 56% of Mixtral's step); cuBLAS's second kernel
    of the shared expert's gate GEMV (reduce_1Block_kernel) joins its first (before: 12 GEMMs
    per layer, refused)."""
    spec = tr.get_model(model)
    t = tr.load_trace(FORMS.format(model, form, "graph"))
    m_t = tr.load_trace(FORMS.format(model, form, "mapping"))
    att = tr.attribute(t, spec)
    by_map, map_rep = graphs.name_replays(
        t, att, spec, mapping=graphs.mapping_from(m_t, tr.attribute(m_t, spec)))
    bare, rep = graphs.name_replays(t, att, spec)
    assert map_rep.named_fraction == 1.0 and rep.named_fraction == 1.0
    assert rep.graphs["method"].tolist() == ["kernel_name"]
    rows = graphs.replay_rows(t)["row"].to_numpy()
    m_op = by_map["operator"].to_numpy(dtype=object)[rows]
    b_op = bare["operator"].to_numpy(dtype=object)[rows]
    differ = m_op != b_op
    allowed = {("attention", "rope")} | ({("moe_dispatch", "router")} if form == "batchedmm"
                                         else set())
    assert set(zip(m_op[differ], b_op[differ], strict=True)) <= allowed
    dur = t.device["dur_us"].to_numpy()[rows]
    assert dur[~differ].sum() / dur.sum() >= 0.99
    kernels = bare["name"].astype(str).to_numpy()[rows]
    gathers = np.char.find(kernels.astype(str), "vectorized_gather_kernel") >= 0
    fed = np.isin(m_op, ["experts_gate_up", "experts_down"]) & gathers
    assert (b_op[fed] == m_op[fed]).all()
    assert fed.sum() == (2 * REPLAYS * LAYERS if form == "batchedmm" else 0)
    routed = MOE_OPS - ({"moe_dispatch"} if form == "batchedmm" else set())  # no token sort
    assert set(b_op) >= routed | ({"shared_gate_proj", "shared_down_proj"}
                                  if model.startswith("qwen1.5") else set())


@pytest.mark.parametrize(("model", "form"), [
    ("mixtral-8x7b", "batchedmm"), ("qwen3-30b-a3b", "batchedmm"),
    ("qwen1.5-moe-a2.7b", "batchedmm"), ("qwen1.5-moe-a2.7b", "groupedmm")])
def test_replays_costed_from_user_shapes_as_eager(model, form):
    """--batch 4 --context 1024: batched_mm's weight gathers each an `index` of the [E, 2I, H]
    (or [E, H, I]) weights, A active experts read and B·k copies written, its GEMM a bmm over
    the B·k copies (before: a grouped GEMM reading the weights once, a quarter of Mixtral's
    bytes); Qwen1.5-MoE's router logits [B, H] x [H, 60] and shared expert gate [B, H] x
    [H, 1] each in its own `router` instance (before: neither shaped, the routing unknown and
    the gathers uncosted). The experts' FLOPs and bytes equal the eager mapping run's."""
    spec = tr.get_model(model)
    a = tr.analyze_trace(FORMS.format(model, form, "graph"), spec,
                         options=tr.AnalysisOptions(decode_shapes=graphs.DecodeShapes(BATCH, 1024)))
    m = tr.analyze_trace(FORMS.format(model, form, "mapping"), spec)
    got = a.costed.groupby(["operator", "op_name"])[["flops", "bytes"]].sum()
    want = m.costed.groupby(["operator", "op_name"])[["flops", "bytes"]].sum()
    calls = ("aten::index", "aten::bmm") if form == "batchedmm" else ("aten::_grouped_mm",)
    for op in ("experts_gate_up", "experts_down"):
        for call in calls:
            for col in ("flops", "bytes"):
                assert got.loc[(op, call), col] == pytest.approx(want.loc[(op, call), col],
                                                                  rel=1e-12), (op, call, col)


def test_refused_mapping_shapes_cost_batched_mm_from_user_shapes():
    """A mapping run at B = 4 with --batch 8: its names are carried, its shapes refused, and
    the batched_mm experts costed from the given shapes as batched_mm (a gather, then a bmm
    over B·k = 16 rows; before: both as one grouped GEMM). FLOPs by hand: 2·16·2I·H per layer
    and replay for gate_up, 2·16·H·I for down."""
    spec = tr.get_model("mixtral-8x7b")
    e, h = spec.experts, spec.hidden_size
    a = tr.analyze_trace(FORMS.format("mixtral-8x7b", "batchedmm", "graph"), spec,
                         options=tr.AnalysisOptions(
                             graph_map=FORMS.format("mixtral-8x7b", "batchedmm", "mapping"),
                             decode_shapes=graphs.DecodeShapes(8, 1024)))
    assert "costed from the given decode shapes" in a.graphs.flags[0]
    got = a.costed.groupby(["operator", "op_name"])["flops"].sum()
    n, rows = REPLAYS * LAYERS, 8 * e.top_k
    assert got[("experts_gate_up", "aten::bmm")] == n * 2 * rows * 2 * e.intermediate_size * h
    assert got[("experts_down", "aten::bmm")] == n * 2 * rows * e.intermediate_size * h
    assert got[("experts_gate_up", "aten::index")] == 0
