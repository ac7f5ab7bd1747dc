"""The real H200 traces of sample_traces/hf_generate and sample_traces/cuda_graphs:
forward passes and their phases, CUDA-graph replays named and costed (see sample_traces/README.md
for how each trace was captured)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

import trace_roofline as tr
from tests.builders import SAMPLES, read, write
from trace_roofline.attribution import graphs

GEN = SAMPLES / "hf_generate" / "hf-qwen2-qwen2.5-7b-2l_{}_h200.json.gz"
CG = SAMPLES / "cuda_graphs" / "hf-qwen2-qwen2.5-7b-2l_{}_h200.json.gz"
QWEN = tr.get_model("qwen2.5-7b")
H, T, LAYERS = 3584, 512, 2
CORE = ["q_proj", "k_proj", "v_proj", "o_proj", "attention", "gate_proj", "up_proj",
        "down_proj", "qkv_proj", "gate_up_proj"]
LAYER_OPS = [*CORE, "input_norm", "post_attention_norm", "rope", "kv_cache", "residual", "act",
             "embedding", "final_norm", "lm_head"]


def _analyze(path: Path, **kw) -> tr.Analysis:
    return tr.analyze_trace(path, QWEN, options=tr.AnalysisOptions(**kw))


def _flops(a: tr.Analysis, phase: str | None = None):
    c = a.costed if phase is None else a.costed[a.costed["phase"] == phase]
    return c.groupby("operator")["flops"].sum()


@pytest.mark.parametrize("name", ["generate_b1_t512_n5", "generate_b1_t512_n5_eager"])
def test_generate_is_one_prefill_and_four_decode_passes(name):
    """`model.generate(max_new_tokens=5)` without a profiler schedule: 5 forward passes, opened
    by their embeddings; exact FLOPs per phase, whatever the attention implementation."""
    a = _analyze(Path(str(GEN).format(name)))
    p = a.passes
    assert p["phase"].tolist() == ["prefill"] + ["decode"] * 4
    assert p["opened_by"].tolist() == ["trace_start"] + ["embedding"] * 4
    assert p["T_max"].tolist() == [T, 1, 1, 1, 1]
    assert set(p["evidence"]) == {"eager_attention" if "eager" in name else "attention"}
    pre, dec = _flops(a, "prefill"), _flops(a, "decode")
    # q_proj (bias): 2·M·K·N + M·N per layer; prefill M = T, decode M = 1 in each of 4 passes
    assert pre["q_proj"] == LAYERS * (2 * T * H * H + T * H)
    assert dec["q_proj"] == 4 * LAYERS * (2 * H * H + H)
    assert pre["k_proj"] == LAYERS * (2 * T * H * 512 + T * 512)
    # lm_head: the last position only, H x vocab
    assert pre["lm_head"] == 2 * H * 152064 and dec["lm_head"] == 4 * 2 * H * 152064
    assert set(a.whole_by_phase) == {"prefill", "decode"}
    if "eager" not in name:  # SDPA: causal prefill over 512 keys, decode over 513..516 keys
        assert pre["attention"] == LAYERS * 4 * 28 * 128 * (T * (T + 1) / 2)
        assert dec["attention"] == LAYERS * 4 * 28 * 128 * sum(range(513, 517))
        att = a.costed[a.costed["cost_kind"] == "attention"]
        assert (att.loc[att["T"] == 1, "phase"] == "decode").all()  # no T=1 row is prefill


@pytest.mark.parametrize("name, phase, passes", [
    ("prefill_b1_t512_eager", "prefill", 2), ("decode_b1_s512_eager", "decode", 3)])
def test_eager_attention_has_its_phase(name, phase, passes):
    a = _analyze(Path(str(GEN).format(name)))
    assert a.passes["phase"].tolist() == [phase] * passes
    assert a.passes["evidence"].eq("eager_attention").all()
    assert set(a.costed["phase"]) == {phase}


def _named(a: tr.Analysis, ops=None) -> float:
    """Share of the replayed kernels' time named (with `ops`: named one of them)."""
    g = a.graphs
    assert g is not None
    if ops is None:
        return g.named_fraction
    c = a.costed
    return c.loc[c["operator"].isin(ops), "time_us"].sum() / c["time_us"].sum()


@pytest.mark.parametrize("replay, mapping", [
    ("decode_b1_s512_static1024_graph", "decode_b1_s512_static1024_mapping"),
    ("decode_b4_s512_static1024_graph", "decode_b4_s512_static1024_mapping"),
    ("decode_b1_s512_static1024_compiled-ro", "decode_b1_s512_static1024_compiled"),
])
def test_replays_with_their_mapping(replay, mapping):
    """The eager run's operators and FLOPs, x replays (4 replays, 4 mapping steps)."""
    a = _analyze(Path(str(CG).format(replay)), graph_map=Path(str(CG).format(mapping)))
    m = _analyze(Path(str(CG).format(mapping)))
    g = a.graphs
    assert g.named_fraction >= 0.95 and g.named_fraction == 1.0
    assert g.matched_time_us / g.time_us >= 0.95 and g.costed_time_us / g.time_us >= 0.95
    assert set(g.graphs["method"]) == {"graph_map"} and g.flags == ()
    got, want = _flops(a), _flops(m)
    for op in LAYER_OPS:
        if op in want:
            assert got[op] == pytest.approx(want[op], rel=1e-12), op
    assert a.passes["phase"].tolist() == ["decode"] * 4


def test_replay_at_another_batch_than_its_mapping_is_refused():
    """B=4 replays against the B=1 mapping: other grids (and some other GEMM kernels); the
    mapping's shapes are not carried, the flag says why, nothing is costed from it."""
    a = _analyze(Path(str(CG).format("decode_b4_s512_static1024_graph")),
                 graph_map=Path(str(CG).format("decode_b1_s512_static1024_mapping")))
    g = a.graphs
    assert len(g.flags) == 1 and "another batch" in g.flags[0]
    assert g.flags[0] in a.warnings  # said before the table
    assert g.costed_time_us == 0.0 and g.graphs["shapes"].tolist() == ["none"]
    assert set(a.passes["phase"]) == {"unknown"}  # no shapes, no phase
    b = _analyze(Path(str(CG).format("decode_b4_s512_static1024_compiled-ro")),
                 graph_map=Path(str(CG).format("decode_b1_s512_static1024_compiled")))
    assert b.graphs.costed_time_us == 0.0 and "another batch" in b.graphs.flags[0]


@pytest.mark.parametrize("replay, agree", [("decode_b1_s512_static1024_graph", 0.99),
                                           ("decode_b1_s512_static1024_compiled-ro", 0.98)])
def test_bare_replays_named_from_kernel_names(replay, agree):
    """No mapping: named from the model and the kernel sequence; >= 90% of the replayed time
    under canonical operators, and as the mapping would name it for >= `agree` of the time."""
    path = Path(str(CG).format(replay))
    a = _analyze(path)
    assert a.graphs.named_fraction == 1.0 and set(a.graphs.graphs["method"]) == {"kernel_name"}
    assert _named(a, LAYER_OPS) >= 0.9
    assert a.graphs.costed_time_us == 0.0  # named, not costed, without --batch/--context
    mapping = "decode_b1_s512_static1024_" + ("mapping" if "graph" in replay else "compiled")
    t = tr.load_trace(path)
    att = tr.attribute(t, QWEN)
    m_t = tr.load_trace(Path(str(CG).format(mapping)))
    by_map, _ = graphs.name_replays(t, att, QWEN, mapping=graphs.mapping_from(
        m_t, tr.attribute(m_t, QWEN)))
    bare, _ = graphs.name_replays(t, att, QWEN)
    rows = graphs.replay_rows(t)["row"].to_numpy()
    dur = att["dur_us"].to_numpy()[rows]
    same = (by_map["operator"].to_numpy()[rows] == bare["operator"].to_numpy()[rows]) & (
        by_map["layer"].astype("Int64").fillna(-1).to_numpy()[rows]
        == bare["layer"].astype("Int64").fillna(-1).to_numpy()[rows])
    assert dur[same].sum() / dur.sum() >= agree
    # with the shapes from the user: decode passes, projections and attention costed
    c = _analyze(path, decode_shapes=graphs.DecodeShapes(1, 1024))
    assert c.passes["phase"].tolist() == ["decode"] * 4
    assert _flops(c)["q_proj"] == 4 * LAYERS * (2 * H * H + H)


def test_generate_with_auto_compiled_static_cache():
    """generate(cache_implementation="static"): an eager prefill, then 4 decode forwards
    replayed from Inductor CUDA graphs."""
    path = Path(str(CG).format("generate_b1_t512_n5_static_compiled-ro"))
    a = _analyze(path)
    assert a.graphs.replays == 4 and a.graphs.named_fraction == 1.0
    assert a.passes["phase"].tolist() == ["prefill"] + ["unknown"] * 4
    b = _analyze(path, decode_shapes=graphs.DecodeShapes(1, 1024))
    assert b.passes["phase"].tolist() == ["prefill"] + ["decode"] * 4


def test_capture_in_the_trace():
    """Warm-up + capture + 2 replays: the warm-up names the replays; without its kernels, the
    capture's launches (cpu ops with shapes, no kernels) name them position by position."""
    path = Path(str(CG).format("decode_b1_s512_static1024_graphcapture"))
    a = _analyze(path)
    assert a.graphs.named_fraction == 1.0 and a.graphs.costed_time_us == a.graphs.time_us
    assert "(capture)" not in a.graphs.graphs["template"].iloc[0]
    t = tr.load_trace(path)
    keep = np.zeros(len(t.device), bool)
    keep[graphs.replay_rows(t)["row"].to_numpy()] = True
    t = dataclasses.replace(t, device=t.device[keep].reset_index(drop=True))
    out, rep = graphs.name_replays(t, tr.attribute(t, QWEN), QWEN)
    assert rep.graphs["template"].iloc[0].endswith("(capture) 0")
    assert rep.named_fraction == 1.0 and rep.costed_time_us == rep.time_us
    full = _flops(a)
    costs = tr.attach_costs(tr.attribute_trace(t, QWEN, attributed=out)[0], QWEN)
    assert costs.groupby("operator")["flops"].sum()["q_proj"] == full["q_proj"] / 2  # 2 of 4


@pytest.mark.parametrize("seed", [0, 1])
def test_shuffled_real_replay_is_not_named(tmp_path, seed):
    """The real replays' kernels in a shuffled order: no layer pattern, nothing named."""
    from tests import replay_factory as rf

    doc = read(Path(str(CG).format("decode_b1_s512_static1024_graph")))
    by_corr: dict = {}
    for e in doc["traceEvents"]:
        if e.get("cat") in rf.DEVICE_CATS and "External id" not in e.get("args", {}):
            by_corr.setdefault(e["args"]["correlation"], []).append(e)
    rng = np.random.default_rng(seed)
    for kernels in by_corr.values():
        ts = sorted(e["ts"] for e in kernels)
        for e, t in zip(rng.permutation(kernels), ts, strict=True):
            e["ts"] = t
    t = tr.load_trace(write(doc, tmp_path / "shuffled.json.gz"))
    out, rep = graphs.name_replays(t, tr.attribute(t, QWEN), QWEN,
                                   shapes=graphs.DecodeShapes(1, 1024))
    assert rep.named_kernels == 0
    rows = graphs.replay_rows(t)["row"].to_numpy()
    assert (out["operator"].to_numpy()[rows] == "unattributed").all()


def test_every_name_carries_its_evidence():
    path = Path(str(CG).format("decode_b1_s512_static1024_graph"))
    t = tr.load_trace(path)
    att, _, _ = tr.attribute_trace(t, QWEN, tr.AnalysisOptions(graph_map=Path(str(CG).format(
        "decode_b1_s512_static1024_mapping"))))
    rows = graphs.replay_rows(t)["row"].to_numpy()
    replayed = np.zeros(len(att), bool)
    replayed[rows] = True
    ev = att["evidence"].to_numpy(dtype=object)
    named_other = (att["operator"] == "other").to_numpy()
    assert set(ev[replayed & ~named_other]) == {"graph_map"}
    assert set(ev[named_other]) == {"fallback"}  # sampling's argmax and cudagraph copies
    bare, _, _ = tr.attribute_trace(t, QWEN)
    assert set(bare["evidence"].to_numpy(dtype=object)[replayed & ~named_other]) == {"kernel_name"}
    eager, _, _ = tr.attribute_trace(tr.load_trace(SAMPLES / "qwen2.5-7b_decode_b1_s2048_h200.json.gz"))
    assert set(eager["evidence"]) == {"annotation"}
