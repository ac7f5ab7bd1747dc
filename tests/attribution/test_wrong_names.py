"""Every committed LLM trace outside families_h200 (whose own walk is
tests/attribution/test_families_h200.py), named as `analyze --model` names it, against its
model's layout: at most 2% of its device time may carry a name that layout contradicts
(tests/builders.wrong_names)."""

from __future__ import annotations

from pathlib import Path

import pytest

import trace_roofline as tr
from tests.builders import SAMPLES, walk, wrong_names
from trace_roofline.attribution.tp import gemm_shapes, infer_tp
from trace_roofline.pipeline import attribute_trace

SERVING = SAMPLES / "serving"
# (file pattern under sample_traces/, the model they ran), first match wins
MODELS = (
    ("*qwen-tiny*", "qwen-tiny"), ("training/*", "qwen-tiny"),
    ("**/*mixtral-8x7b*", "mixtral-8x7b"), ("**/*qwen1.5-moe-a2.7b*", "qwen1.5-moe-a2.7b"),
    ("**/*qwen3-30b-a3b*", "qwen3-30b-a3b"),
    ("serving/sglang_*/*", str(SERVING / "configs" / "qwen3-8b" / "config.json")),
    ("serving/vllm_*/*", str(SERVING / "configs" / "gpt-oss-20b" / "config.json")),
    ("**/*qwen2.5-7b*", "qwen2.5-7b"), ("tp2/*/*", "qwen2.5-7b"),
)
RUNS: dict[Path, str] = {}  # trace -> its model
for _pattern, _name in MODELS:
    for _p in sorted(SAMPLES.glob(_pattern)):
        if (_p.name.endswith(".json.gz") and "capture_traces" not in _p.parts
                and "families_" not in str(_p.parent)):
            RUNS.setdefault(_p, _name)
TRACES = sorted(RUNS)


@pytest.mark.parametrize("path", walk(TRACES, group=lambda p: (p.parent, RUNS[p])))
def test_no_wrong_name_on_any_committed_trace(path):
    trace = tr.load_trace(path)
    model = tr.get_model(RUNS[path])
    kernels, _, _ = attribute_trace(trace, model)
    shard = model.shard(infer_tp(gemm_shapes(trace), model))
    dur = kernels["dur_us"].to_numpy()
    wrong = wrong_names(kernels, shard)
    assert dur[wrong].sum() <= 0.02 * dur.sum(), kernels.loc[
        wrong, ["operator", "op_name", "input_dims"]].drop_duplicates()


def test_the_walk_covers_every_folder():
    """Each folder of LLM traces is walked (families_h200 by its own test)."""
    folders = {p.parent.relative_to(SAMPLES).parts[:1] for p in TRACES}
    assert {("cuda_graphs",), ("hf_generate",), ("moe",), ("tp2",), ("serving",),
            ("training",), ()} <= folders, folders
    assert len(TRACES) >= 60, len(TRACES)
