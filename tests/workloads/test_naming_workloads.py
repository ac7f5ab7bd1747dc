"""The captures behind the naming traces, on the CPU: capture_moe's `graph` command (its eager
mapping run; CUDA graphs need a GPU) and the dtype in run's trace names (the fp16 trace)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from workloads.runner import RunConfig, trace_stem  # noqa: E402


def test_trace_name_says_a_dtype_other_than_the_models():
    """--dtype float16 must not overwrite the bf16 trace of the same run."""
    assert trace_stem(RunConfig(dtype="float16"), "h200") == "qwen2.5-7b_decode_b1_s2048_fp16_h200"
    assert trace_stem(RunConfig(), "h200") == "qwen2.5-7b_decode_b1_s2048_h200"
    assert trace_stem(RunConfig(dtype="bf16"), "h200") == "qwen2.5-7b_decode_b1_s2048_h200"
    assert trace_stem(RunConfig(model="qwen-tiny", dtype="float32"), "cpu") == (
        "qwen-tiny_decode_b1_s2048_cpu")


def test_moe_graph_mapping_on_cpu(tmp_path: Path, capsys) -> None:
    """A tiny Mixtral's StaticCache decode step, eager (the mapping of its CUDA graph):
    ProfilerStep#1..N, grouped_mm experts, the workload described in the trace."""
    pytest.importorskip("transformers")
    from workloads.capture_moe import main

    assert main(["--out", str(tmp_path), "--model", "mixtral-8x7b", "--tiny", "--device",
                 "cpu", "--tokens", "16", "--cache-len", "32", "--replays", "2", "graph",
                 "--experts", "grouped_mm", "--traces", "mapping"]) == 0
    path = tmp_path / "hf-moe-mixtral-8x7b-tiny-2l_decode_b4_s16_static32_groupedmm_mapping_cpu.json.gz"
    assert capsys.readouterr().out.strip() == str(path)
    with gzip.open(path) as f:
        trace = json.load(f)
    meta = trace["trace_roofline_workload"]
    assert (meta["kind"], meta["experts_implementation"], meta["hf_class"], meta["batch"]) == (
        "hf_static_decode_mapping", "grouped_mm", "MixtralForCausalLM", 4)
    assert meta["cuda_graphs"] is False and meta["max_cache_len"] == 32
    ops = [e for e in trace["traceEvents"] if e.get("cat") == "cpu_op"]
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    assert len(steps) == 2
    assert sum(e["name"] == "aten::_grouped_mm" for e in ops) == 2 * 2 * 2  # 2 per layer, step
    assert any(e["name"] == "aten::index_copy_" for e in ops)  # the StaticCache's writes


def test_moe_graph_refuses_graphs_on_cpu(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    if torch.cuda.is_available():
        pytest.skip("checks the refusal without a GPU")
    from workloads.capture_moe import main

    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        main(["--out", str(tmp_path), "--model", "mixtral-8x7b", "--tiny", "--device", "cpu",
              "--tokens", "16", "--cache-len", "32", "graph"])
