"""The GPU captures of sample_traces/step_sweep and sample_traces/training_<gpu>:
each committed trace loads and holds kernels, and each results JSON has every point
(see the folders' README.md for what ran and where)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import trace_roofline as tr
from tests.builders import SAMPLES

SWEEP = SAMPLES / "step_sweep"
TRAINING = sorted(SAMPLES.glob("training_h[12]00"))
DECODE_BATCHES, PREFILL_TOKENS = [1, 4, 16, 64, 256], [256, 512, 1024, 2048, 4096]
TRACES = sorted(SWEEP.glob("*.json.gz")) + sorted(p for d in TRAINING for p in d.glob("*.json.gz"))


def _results(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name.removesuffix(".json.gz"))
def test_each_capture_loads_with_kernels_in_one_profiler_step(path):
    trace = tr.load_trace(path)
    assert not trace.cpu_only
    assert (trace.device["kind"] == "kernel").sum() > 0
    steps = trace.annotations["name"].astype(str).str.startswith("ProfilerStep#")
    assert steps.any()


def test_sweep_results_have_every_point_with_its_trace_and_step_times():
    res = _results(SWEEP / "step_sweep_results.json")
    assert res["layers"] == 28 and res["model"] == "qwen2.5-7b" and res["device"].startswith("NVIDIA")
    points = {(p["phase"], p["batch"], p["tokens"]) for p in res["points"]}
    assert points == ({("decode", b, b) for b in DECODE_BATCHES}
                      | {("prefill", 1, t) for t in PREFILL_TOKENS})
    for p in res["points"]:
        assert "error" not in p, p
        ms = p["step_ms"]
        assert 0 < ms["min"] <= ms["median"] <= ms["max"]
        assert p["context"] == (1024 if p["phase"] == "decode" else 0)
        assert (SWEEP / p["trace"]).is_file()


@pytest.mark.parametrize("folder", TRAINING, ids=lambda p: p.name)
def test_training_results_name_a_trace_and_config_for_each_capture(folder):
    captures = _results(folder / "training_results.json")["captures"]
    assert len(captures) >= 1
    for c in captures:
        if "error" in c:  # recorded failures commit no trace
            assert not (folder / c["trace"]).exists()
            continue
        assert (folder / c["trace"]).is_file() and (folder / c["config"]).is_file()
        assert c["step_ms"]["median"] > 0
