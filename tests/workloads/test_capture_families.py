"""workloads.capture_families runs each family's HF model under the profiler (CPU, small sizes)."""

from __future__ import annotations

import gzip
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from workloads.capture_families import FAMILIES, MODES, capture  # noqa: E402


@pytest.mark.parametrize("family,mode", [("gpt2", "prefill"), ("qwen2", "train"),
                                         ("qwen2", "schedule"), ("llama", "batch")])
def test_a_small_capture_holds_the_family_and_its_ops(tmp_path, family, mode):
    path = capture(family, mode, tmp_path, tokens=16, device="cpu", dtype="float32", steps=1,
                   scale=0.03, progress=lambda _: None)
    doc = json.loads(gzip.decompress(path.read_bytes()))
    workload = doc["trace_roofline_workload"]
    workload = json.loads(workload) if isinstance(workload, str) else workload
    assert workload["family"] == family and workload["mode"] == mode
    names = {e.get("name") for e in doc["traceEvents"] if e.get("cat") == "cpu_op"}
    assert {"aten::addmm", "aten::linear", "aten::mm"} & names
    if mode == "train":
        assert any("Backward" in (n or "") for n in names) or any(
            "evaluate_function" in (e.get("name") or "") for e in doc["traceEvents"])


def test_every_family_and_mode_is_known():
    assert {"gpt2", "deepseek_v2", "gpt_oss", "gemma2", "bert"} <= set(FAMILIES)
    assert {"train", "assisted", "max-autotune"} <= set(MODES)
