"""CUDA-graph replays (trace_roofline.attribution.graphs): replays built from a real H200 eager trace."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import trace_roofline as tr
from tests import replay_factory as rf
from tests.builders import SAMPLES, read, write
from trace_roofline.attribution import graph_align, graphs
from trace_roofline.attribution.passes import forward_passes
from trace_roofline.costs.attach import attach_costs

STATIC = SAMPLES / "hf-qwen2-qwen2.5-7b-2l_decode_b1_s2048_static_h200.json.gz"
QWEN = tr.get_model("qwen2.5-7b")
CORE = {"q_proj", "k_proj", "v_proj", "o_proj", "attention", "gate_proj", "up_proj",
        "down_proj", "qkv_proj", "gate_up_proj"}


@pytest.fixture(scope="module")
def eager():
    t = tr.load_trace(STATIC)
    return t, tr.attribute(t, QWEN)


@pytest.fixture(scope="module")
def mapping(eager):
    return graphs.mapping_from(*eager)


@pytest.fixture(scope="module")
def doc():
    return read(STATIC)


@pytest.fixture(scope="module")
def replay(tmp_path_factory, doc):
    """The two eager steps as two replays (trace, attributed), shared: name_replays copies."""
    return _replay(tmp_path_factory.mktemp("replay"), doc)


def _replay(tmp_path: Path, doc: dict, **kw):
    t = tr.load_trace(write(rf.as_replays(doc, **kw), tmp_path / "replay.json.gz"))
    return t, tr.attribute(t, QWEN)


def _flops(att: pd.DataFrame) -> pd.Series:
    """FLOPs per operator; attention's from its attention ops only (eager HF also names a
    scalar add_ of the cache position attention: 1 FLOP)."""
    c = attach_costs(att, QWEN)
    c = c[(c["operator"] != "attention") | (c["cost_kind"] == "attention")]
    return c.groupby("operator")["flops"].sum()


def test_replays_are_found_and_unnamed_without_help(replay):
    t, att = replay
    rr = graphs.replay_rows(t)
    assert len(rr) == 276 and rr["replay"].nunique() == 2
    assert rr.groupby("replay")["pos"].max().tolist() == [137, 137]
    assert (att["operator"] == "unattributed").all()  # what attribute alone can say
    out, rep = graphs.name_replays(t, att)  # no model, no mapping, no eager pass
    assert rep.named_kernels == 0 and rep.graphs["method"].tolist() == ["none"]
    assert (out["operator"] == "unattributed").all()


def test_graph_map_carries_names_and_costs(eager, mapping, replay):
    t, att = replay
    out, rep = graphs.name_replays(t, att, QWEN, mapping=mapping)
    assert rep.named_fraction == 1.0 and rep.matched_time_us == pytest.approx(rep.time_us)
    assert rep.graphs["method"].tolist() == ["graph_map"] and rep.flags == ()
    assert rep.graphs["replays"].tolist() == [2] and rep.graphs["grid_mismatch"].tolist() == [0]
    e = eager[1]
    # the replays are the eager steps: same operator and layer per kernel, same FLOPs
    assert out["operator"].tolist() == e["operator"].tolist()
    assert out["layer"].astype("Int64").equals(e["layer"].astype("Int64"))
    other = (out["operator"] == "other").to_numpy()  # sampling, position ids: no evidence
    assert set(out["evidence"][~other]) == {"graph_map"} and set(out["evidence"][other]) == {
        "fallback"}
    pd.testing.assert_series_equal(_flops(out), _flops(e))
    # one instance per (replay, eager op): a split-K GEMM and its reduce count once
    assert out["instance"].nunique() == e["instance"].nunique()
    assert out["op_id"].isna().all()  # no cpu op of the replay trace launched them
    p = forward_passes(out).table
    assert p["phase"].tolist() == ["decode", "decode"] and p["S"].tolist() == [4096, 4096]


def test_missing_and_extra_memsets_are_tolerated(tmp_path, doc, eager, replay):
    """The replay lacks the eager lm_head memset; or the mapping lacks it and the replay has
    it: either way everything is named and lm_head's FLOPs are unchanged."""
    t, att = _replay(tmp_path, doc, drop_memsets=True)
    out, rep = graphs.name_replays(t, att, QWEN, mapping=graphs.mapping_from(*eager))
    assert rep.named_fraction == 1.0
    assert _flops(out)["lm_head"] == _flops(eager[1])["lm_head"]
    (tmp_path / "m").mkdir()
    no_memset = write({**doc, "traceEvents": [e for e in doc["traceEvents"]
                                                 if e.get("cat") != "gpu_memset"]},
                         tmp_path / "m" / "eager.json.gz")
    m_t = tr.load_trace(no_memset)
    m = graphs.mapping_from(m_t, tr.attribute(m_t, QWEN))
    t, att = replay
    out, rep = graphs.name_replays(t, att, QWEN, mapping=m)
    assert rep.named_fraction == 1.0 and rep.graphs["attached"].tolist() == [1]
    memset = (out["kind"] == "memset").to_numpy()
    assert set(out.loc[memset, "operator"]) == {"lm_head"}
    assert _flops(out)["lm_head"] == _flops(eager[1])["lm_head"]


def test_other_batch_mapping_is_refused(tmp_path, doc, mapping):
    """Elementwise grids twice as wide: the replay ran another batch; names are carried but the
    mapping's shapes are not, and the flag says why."""
    t, att = _replay(tmp_path, doc, grid_scale=2)
    out, rep = graphs.name_replays(t, att, QWEN, mapping=mapping)
    assert rep.named_fraction == 1.0 and rep.costed_time_us == 0.0
    assert rep.graphs["shapes"].tolist() == ["none"] and rep.graphs["grid_mismatch"].iloc[0] > 0
    assert len(rep.flags) == 1 and "another batch" in rep.flags[0]
    assert out["input_dims"].isna().all()


def test_mapping_batch_differs_from_user_batch(mapping, replay):
    t, att = replay
    out, rep = graphs.name_replays(t, att, QWEN, mapping=mapping,
                                   shapes=graphs.DecodeShapes(batch=4, context=4096))
    assert "M = 1" in rep.flags[0] and "decode batch is 4" in rep.flags[0]
    assert rep.graphs["shapes"].tolist() == ["user"]  # the user's shapes, not the mapping's
    q = attach_costs(out, QWEN).query("operator == 'q_proj'")
    assert q["M"].tolist() == [4] * 4


def test_own_eager_passes_are_the_mapping(tmp_path, doc):
    """One eager step (the warm-up) and one replay in the same trace."""
    d = rf.as_replays(doc)
    # step 1 eager (the original's events), step 2 replayed (the replay version's)
    s1 = next(e for e in doc["traceEvents"] if e.get("name") == "ProfilerStep#1")
    lo, hi = s1["ts"], s1["ts"] + s1["dur"]

    def in_step1(e: dict) -> bool:
        return lo <= e.get("ts", -1) < hi + 2000 if e.get("cat") in rf.DEVICE_CATS \
            else lo <= e.get("ts", -1) < hi

    first = [e for e in doc["traceEvents"] if e.get("ph") != "M" and in_step1(e)]
    second = [e for e in d["traceEvents"] if e.get("ph") == "M" or not in_step1(e)]
    path = write({**doc, "traceEvents": first + second}, tmp_path / "mixed.json.gz")
    t = tr.load_trace(path)
    att = tr.attribute(t, QWEN)
    out, rep = graphs.name_replays(t, att, QWEN)
    assert rep.replays == 1 and rep.named_fraction == 1.0
    assert rep.graphs["method"].tolist() == ["graph_map"]
    assert str(path) in rep.graphs["template"].iloc[0]


def test_kernel_names_alone(eager, replay):
    """No mapping: layers from the attention runs and GEMM counts, checked to repeat."""
    t, att = replay
    out, rep = graphs.name_replays(t, att, QWEN)
    assert rep.graphs["method"].tolist() == ["kernel_name"] and rep.named_fraction == 1.0
    e = eager[1]
    dur = e["dur_us"].to_numpy()
    same = out["operator"].to_numpy() == e["operator"].to_numpy()
    assert dur[same].sum() / dur.sum() > 0.99  # as named from the eager ops' shapes
    canonical = ~out["operator"].isin(["other", "unattributed"]).to_numpy()
    assert dur[canonical].sum() / dur.sum() > 0.9
    core = out["operator"].isin(CORE).to_numpy()
    assert (out["operator"].to_numpy()[core] == e["operator"].to_numpy()[core]).all()
    assert (out.loc[core, "layer"].astype("Int64") == e.loc[core, "layer"].astype("Int64")).all()
    assert out.loc[out["operator"].isin(CORE), "evidence"].eq("kernel_name").all()
    assert rep.costed_time_us == 0.0  # named, but no shapes without --batch/--context


def test_kernel_names_with_user_shapes(eager, replay):
    t, att = replay
    out, rep = graphs.name_replays(t, att, QWEN, shapes=graphs.DecodeShapes(1, 4096))
    got, want = _flops(out), _flops(eager[1])
    for op in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               "lm_head", "attention"):
        assert got[op] == pytest.approx(want[op], rel=1e-12), op
    # 2 replays x 2 layers of q_proj at M = 1: 2·M·K·N + M·N (bias)
    assert got["q_proj"] == 4 * (2 * 3584 * 3584 + 3584)
    c = attach_costs(out, QWEN)
    norm = c[c["operator"] == "input_norm"]
    # an RMSNorm over the [B, H] = [1, 3584] tokens (4 FLOPs per element); HF's residual adds
    # are kernels of their own, so no fused add
    assert len(norm) and (norm["flops"] == 4 * 3584).all()
    p = forward_passes(out).table
    assert p["phase"].tolist() == ["decode", "decode"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shuffled_order_is_not_named(tmp_path, doc, mapping, seed):
    """The same kernels in another order: no repeated layer pattern, no name; a mapping does
    not match it either."""
    t, att = _replay(tmp_path, doc, shuffle_seed=seed)
    out, rep = graphs.name_replays(t, att, QWEN, shapes=graphs.DecodeShapes(1, 4096))
    assert rep.named_kernels == 0 and (out["operator"] == "unattributed").all()
    out, rep = graphs.name_replays(t, att, QWEN, mapping=mapping)
    assert rep.named_kernels == 0 and "not the replayed step" in rep.flags[0]


def test_align_is_banded_lcs():
    a = np.array([1, 2, 3, 4, 5, 6, 7, 8])
    b = np.array([1, 9, 2, 3, 5, 6, 7, 8, 8])
    m = graph_align.align(a, b, band=2)
    assert m.tolist() == [0, 2, 3, -1, 4, 5, 6, 8]  # the last 8 of b: traceback from the end
    assert graph_align.align(a, a).tolist() == list(range(8))
    # a subsequence far off the diagonal is out of a narrow band, found with a wide one
    long = np.r_[np.arange(100, 140), a]
    assert (graph_align.align(a, long, band=1) >= 0).sum() == 8  # |n - m| widens the band
    assert graph_align.align(np.array([5]), np.array([], dtype=int)).tolist() == [-1]


# A real replay trace: tests/data/cuda_graph_probe_h200.json.gz, captured on the project's H200
# (torch 2.11.0+cu130, CUDA 13.0, 2026-11-30) by
#   lin1 = nn.Linear(1024, 1024), lin2 = nn.Linear(1024, 4096) (bf16); x = randn(4, 1024)
#   step(x) = silu(lin2(lin1(x))).sum()
#   with profile(CPU, CUDA, record_shapes=True): two eager warm-up steps on a side stream,
#   torch.cuda.graph capture of step(x), g.replay() x 3, synchronize.
# Kernels of a replay: two nvjet GEMMs, silu, sum; all with the cudaGraphLaunch's correlation.
PROBE = Path(__file__).resolve().parents[1] / "data" / "cuda_graph_probe_h200.json.gz"
PROBE_FLOPS = 3 * (2 * 4 * 1024 * 1024 + 4 * 1024 + 2 * 4 * 1024 * 4096 + 4 * 4096)


def _probe_check(t, out, rep):
    """Without a model every op is `other` (fallback evidence), but carries its shapes."""
    assert rep.replays == 3 and rep.kernels == 12 and rep.named_fraction == 1.0
    c = attach_costs(out.iloc[graphs.replay_rows(t)["row"].to_numpy()], None)
    gemm = c[c["cost_kind"] == "gemm"]
    assert len(gemm) == 6 and gemm["flops"].sum() == PROBE_FLOPS


def test_real_replay_named_by_its_warm_up():
    t = tr.load_trace(PROBE)
    att = tr.attribute(t)
    assert (att["operator"] == "unattributed").sum() == 12  # the 3 replays
    out, rep = graphs.name_replays(t, att)
    assert rep.graphs["method"].tolist() == ["graph_map"]
    assert "(capture)" not in rep.graphs["template"].iloc[0]  # the eager warm-up came first
    _probe_check(t, out, rep)


def test_real_replay_named_by_its_capture():
    """Without the warm-up kernels, the capture's launches (cpu ops with shapes, no kernels)
    name the replays position by position."""
    t = tr.load_trace(PROBE)
    dev = t.device
    eager = dev["external_id"].notna().to_numpy()
    t = dataclasses.replace(t, device=dev[~eager].reset_index(drop=True))
    att = tr.attribute(t)
    out, rep = graphs.name_replays(t, att)
    assert rep.graphs["template"].iloc[0].endswith("(capture) 0")
    assert out["op_name"].tolist()[-4:] == ["aten::addmm", "aten::addmm", "aten::silu",
                                             "aten::sum"]
    _probe_check(t, out, rep)


def test_cli_graph_map_and_user_shapes(tmp_path, doc, capsys):
    from trace_roofline.cli import main

    path = write(rf.as_replays(doc), tmp_path / "replay.json.gz")
    assert main(["analyze", str(path), "--model", "qwen2.5-7b", "--graph-map", str(STATIC),
                 "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "forward passes: 2 decode (T=1)" in out
    assert "CUDA graphs: 2 replay(s) of 1 graph(s), 276 kernels" in out
    assert "named 100.0% of their time (100.0% by an aligned eager kernel" in out
    rep = json.loads((tmp_path / "r.json").read_text())["traces"][0]
    assert rep["forward_passes"]["per_phase"] == {"decode": 2}
    assert rep["cuda_graphs"]["named_fraction"] == 1.0
    assert main(["analyze", str(path), "--model", "qwen2.5-7b", "--batch", "1",
                 "--context", "4096"]) == 0
    assert "evidence: kernel_name" in capsys.readouterr().out
    assert main(["analyze", str(path), "--batch", "1"]) == 2
    assert "--batch and --context go together" in capsys.readouterr().err
    assert main(["analyze", str(path), "--batch", "1", "--context", "9"]) == 2
    assert "need --model" in capsys.readouterr().err
