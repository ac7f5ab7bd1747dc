"""The step's time (trace_roofline/steptime.py) on committed traces: busy and idle against a hand
sum from the raw JSON, busy + idle = the device window, the verdict of each kind of step
(HF eager decode, CUDA-graph decode, compiled training step, TP rank, serving step), headroom
and the Analysis' new fields through every output and the cache."""

from __future__ import annotations

import gzip
import json
import math
import re

import numpy as np
import pytest

from tests.builders import ROOT
from trace_roofline import steptime
from trace_roofline.cache import TraceCache
from trace_roofline.model.models import get_model
from trace_roofline.outputs import report
from trace_roofline.pipeline import Run, analyze_trace
from trace_roofline.trace import load_trace

TRACES = ROOT / "sample_traces"
EAGER_B1 = TRACES / "step_sweep" / "hf-qwen2-qwen2.5-7b-28l_decode_b1_s1024_h100.json.gz"
EAGER_B256 = TRACES / "step_sweep" / "hf-qwen2-qwen2.5-7b-28l_decode_b256_s1024_h100.json.gz"
GRAPH = TRACES / "hf-qwen2-qwen2.5-7b-2l_decode_b1_s2048_static_compiled_h200.json.gz"
COMPILED_TRAIN = TRACES / "training_h100" / "qwen2.5-0.5b-2l_train_compiled_b4_t512_h100.json.gz"
TP_RANK = TRACES / "tp2" / "tp2-qwen2.5-7b-2l_decode_b8_s2048_h200" / "rank0.json.gz"
SERVING = TRACES / "serving" / "sglang_qwen3-8b_decode_mi300x" / "sglang_Qwen3-8B_decode.json.gz"
DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def _events(path) -> list[dict]:
    with gzip.open(path) as f:
        doc = json.load(f)
    return doc["traceEvents"] if isinstance(doc, dict) else doc


def _hand(path, step_pattern: str) -> dict[str, dict[str, float]]:
    """Per step, from the raw JSON with plain Python: the host range (the annotation matching
    `step_pattern`, overlapping ones merged), its device events (launch inside the range, by
    correlation), their union (busy), the idle of the window and the first and last device
    times."""
    events = _events(path)
    ranges: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") in ("user_annotation", "cpu_op") and re.match(step_pattern, e["name"]):
            ranges.setdefault(e["name"], []).append(e["ts"])
            ranges[e["name"]].append(e["ts"] + e["dur"])
    merged: list[list] = []  # [start, end, first name] of each run of overlapping ranges
    for lo, hi, name in sorted((min(v), max(v), n) for n, v in ranges.items()):
        if merged and lo < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi, name])
    launch = {e["args"]["correlation"]: e["ts"] for e in events
              if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    out = {}
    for lo, hi, name in merged:
        mine = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in DEVICE_CATS
                      and lo <= launch.get(e["args"].get("correlation"), math.nan) <= hi)
        busy, reach = 0.0, -math.inf
        for s, t in mine:
            busy += max(0.0, t - max(s, reach))
            reach = max(reach, t)
        first, last = mine[0][0], max(t for _, t in mine)
        window = last - min(lo, first)
        out[name] = {"wall": hi - lo, "busy": busy, "idle": window - busy, "window": window,
                     "before": first - lo, "n": len(mine)}
    return out


@pytest.fixture(scope="module")
def eager_b1():
    return steptime.step_table(load_trace(EAGER_B1))


@pytest.mark.parametrize("path, pattern", [(EAGER_B1, r"ProfilerStep#\d+$"),
                                           (TP_RANK, r"ProfilerStep#\d+$"),
                                           (SERVING, r"execute_|step\[")])
def test_busy_and_idle_match_a_hand_sum_of_the_raw_json(path, pattern):
    hand = _hand(path, pattern)
    table = steptime.step_table(load_trace(path))
    assert len(table) == len(hand)
    for row, (name, h) in zip(table.itertuples(), hand.items(), strict=True):
        assert row.step.split(" | ")[0] == name
        for col, key in (("wall_us", "wall"), ("busy_us", "busy"), ("idle_us", "idle"),
                         ("idle_before_us", "before")):
            assert getattr(row, col) == pytest.approx(h[key], rel=1e-6, abs=1e-6), (name, col)


@pytest.mark.parametrize("path", [EAGER_B1, GRAPH, COMPILED_TRAIN, TP_RANK, SERVING])
def test_busy_plus_idle_is_the_device_window_and_idle_splits(path):
    """busy + idle = the window from the step's start to its last device end; idle = before +
    between; the category unions lie within busy; the syncs' idle within idle."""
    trace = load_trace(path)
    table = steptime.step_table(trace)
    ranges = steptime.step_ranges(trace)
    of_row = steptime.device_steps(trace, ranges)
    end = (trace.device["ts_us"] + trace.device["dur_us"]).to_numpy()
    for i, row in enumerate(table.itertuples()):
        mine = of_row == i
        lo = min(ranges["ts_us"].iloc[i], trace.device["ts_us"].to_numpy()[mine].min())
        assert row.busy_us + row.idle_us == pytest.approx(end[mine].max() - lo, rel=1e-9)
        assert row.idle_us == pytest.approx(row.idle_before_us + row.idle_between_us, rel=1e-9)
        assert max(row.kernel_us, row.memcpy_us, row.comm_us) <= row.busy_us + 1e-6
        assert row.busy_us <= row.kernel_us + row.memcpy_us + row.comm_us + 1e-6
        assert 0 <= row.idle_sync_us <= row.idle_us + 1e-6
        assert row.host_us <= row.wall_us + 1e-6
    assert list(table.columns) == list(steptime.STEP_COLUMNS)


def test_eager_b1_decode_is_launch_bound(eager_b1):
    """HF eager decode at B=1 on the H100 (sample_traces/step_sweep/README.md): the profiled
    step is ~30 ms, its kernels ~7.9 ms: the device idles most of the step between kernels
    while the host issues them, one launch per kernel or memset."""
    (row,) = eager_b1.itertuples()
    events = _events(EAGER_B1)
    device = [e for e in events if e.get("cat") in DEVICE_CATS]
    kernel_sum = sum(e["dur"] for e in device)
    # one stream, yet the profiler's timestamps overlap by 5.5 µs in all: counted once
    assert 0.999 * kernel_sum < row.busy_us < kernel_sum
    assert 7_000 < row.busy_us < 9_000 and 29_000 < row.wall_us < 31_000
    assert row.idle_us > 2 * row.busy_us and row.idle_between_us > 0.9 * row.idle_us
    launches = sum(1 for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
                   and re.match(r"cu(da)?LaunchKernel", e["name"]))
    assert row.launches == launches == len([e for e in device if e["cat"] == "kernel"])
    assert row.verdict == "launch-bound"
    assert "22.3 ms" in row.evidence and "7.9 ms" in row.evidence


def test_verdict_of_a_large_batch_decode_is_device_bound():
    """The same model at B=256: the kernels fill the step."""
    (row,) = steptime.step_table(load_trace(EAGER_B256)).itertuples()
    assert row.busy_us > 0.9 * (row.busy_us + row.idle_us)
    assert row.verdict == "device-bound"


def test_verdict_of_a_cuda_graph_decode_of_two_layers_is_launch_bound():
    """A compiled, static-cache decode of 2 layers: two steps, ~660 µs of kernels each in a
    ~2.3-2.6 ms step (the host's Python and graph bookkeeping dominate so small a model)."""
    table = steptime.step_table(load_trace(GRAPH))
    hand = _hand(GRAPH, r"ProfilerStep#\d+$")
    assert list(table["step"]) == list(hand)
    for row, h in zip(table.itertuples(), hand.values(), strict=True):
        assert row.busy_us == pytest.approx(h["busy"], rel=1e-6)
        assert h["idle"] > h["busy"]
        assert row.verdict == "launch-bound"


def test_verdict_of_a_compiled_training_step_is_device_bound():
    hand = _hand(COMPILED_TRAIN, r"ProfilerStep#\d+$")["ProfilerStep#1"]
    (row,) = steptime.step_table(load_trace(COMPILED_TRAIN)).itertuples()
    assert row.busy_us == pytest.approx(hand["busy"], rel=1e-6)
    assert hand["busy"] > hand["idle"] and row.memcpy_us > 0
    assert row.verdict == "device-bound"


def test_verdict_of_a_tp_rank_is_communication_bound_where_nccl_dominates():
    """Rank 0 of a TP=2 decode: the NCCL all-reduces, not overlapped by any compute, are most
    of busy in steps 3 and 4; step 2 idles longer than it is busy."""
    events = _events(TP_RANK)
    hand = _hand(TP_RANK, r"ProfilerStep#\d+$")
    table = steptime.step_table(load_trace(TP_RANK))
    launch = {e["args"]["correlation"]: e["ts"] for e in events
              if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e["args"]}
    ranges = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in events
              if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")}
    for row in table.itertuples():
        lo, hi = ranges[row.step]
        nccl = sum(e["dur"] for e in events if e.get("cat") == "kernel"
                   and e["name"].startswith("ncclDevKernel")
                   and lo <= launch.get(e["args"]["correlation"], math.nan) <= hi)
        assert row.comm_us == pytest.approx(nccl, rel=1e-6)  # one stream: sum = union
        want = ("launch-bound" if hand[row.step]["idle"] > hand[row.step]["busy"] else
                "communication-bound" if nccl > row.busy_us - nccl else "device-bound")
        assert row.verdict == want
    assert list(table["verdict"]) == ["launch-bound", "communication-bound", "communication-bound"]


def test_serving_step_idles_in_a_blocking_copy():
    """SGLang's decode step on an MI300X: one merged step (vLLM-style and SGLang annotations),
    one HIP-graph launch holding 544 kernels; a hipMemcpyWithStream blocks the host ~463 ms
    while the device idles: the idle sits at a host sync, and the step is host-bound."""
    events = _events(SERVING)
    (row,) = steptime.step_table(load_trace(SERVING)).itertuples()
    copy = next(e for e in events if e.get("name") == "hipMemcpyWithStream")
    assert row.idle_sync_us > 0.99 * copy["dur"] and row.idle_sync_us <= copy["dur"]
    assert row.launches == sum(1 for e in events if re.match(r"hip(Module)?LaunchKernel|hipGraphLaunch",
                                                            e.get("name", "")))
    assert row.host_us < row.wall_us - 0.99 * copy["dur"]  # the wait is not issuing
    assert row.verdict == "launch-bound" and "at host syncs" in row.evidence


def test_step_summary_spread():
    table = steptime.step_table(load_trace(TP_RANK))
    s = steptime.step_summary(table)
    assert s["steps"] == 3 and s["verdicts"] == {"launch-bound": 1, "communication-bound": 2}
    wall = sorted(table["wall_us"])
    assert s["wall_us"] == {"min": wall[0], "median": wall[1], "max": wall[2]}


def test_whole_trace_is_one_step_without_annotations():
    """A CUDA-graph replay trace with no step annotation and no forward pass of its own: one
    step, the whole trace, holding every device row."""
    path = TRACES / "cuda_graphs" / "hf-qwen2-qwen2.5-7b-2l_decode_b1_s512_static1024_graph_h200.json.gz"
    trace = load_trace(path)
    (row,) = steptime.step_table(trace).itertuples()
    assert row.step == "trace"
    assert (steptime.device_steps(trace, steptime.step_ranges(trace)) == 0).all()


@pytest.fixture(scope="module")
def analysis_b1():
    return analyze_trace(EAGER_B1, get_model("qwen2.5-7b"))


def test_headroom_reads_the_roof_of_each_operator(analysis_b1):
    """An operator at its roof takes FLOPs / peak or bytes / bandwidth, whichever is longer
    (computed here from the hardware, not from % of roof); the step at its roof saves what
    its kernels lose, and with no idle time takes busy."""
    a = analysis_b1
    hw = a.hardware
    ops = a.operators[a.operators["layer"].isna()].set_index("operator")
    h = a.headroom
    op = h[h["scope"] == "operator"].set_index("name")
    peak = hw.peak_flops["bf16"]
    for name in ("gate_proj", "attention", "rope"):
        r = ops.loc[name]
        roof = max(r["flops"] / peak, r["bytes"] / hw.mem_bandwidth) * 1e6
        assert op.loc[name, "at_roof_us"] == pytest.approx(min(roof, r["time_us"]), rel=1e-6)
    assert (op["lost_us"] >= 0).all() and list(op["rank"]) == list(range(1, len(op) + 1))
    assert op["lost_us"].is_monotonic_decreasing
    step = h[h["scope"] == "step"].iloc[0]
    row = a.steps.iloc[0]
    assert step["measured_us"] == row["wall_us"] and step["no_idle_us"] == row["busy_us"]
    lost = op["lost_us"].sum()  # one step: every operator's loss is the step's
    assert step["lost_us"] == pytest.approx(lost, rel=1e-6)
    # the whole model at 54% of roof: its kernels at their roof take ~54% of their time
    kernels_at_roof = step["no_idle_us"] - step["lost_us"]
    assert kernels_at_roof / a.whole["time_us"] == pytest.approx(a.whole["pct_of_roof"] / 100,
                                                                 rel=0.02)


def test_outputs_carry_the_steps(analysis_b1):
    text = report.terminal_table([analysis_b1])
    assert "verdict: launch-bound" in text and "ProfilerStep#1" in text
    line = next(x for x in text.splitlines() if x.startswith("roofline against the step"))
    assert re.search(r"kernels at 5\d\.\d% of roof; the step at 1\d\.\d% of what", line)
    doc = json.loads(report.report_json([analysis_b1]))
    steps = doc["traces"][0]["steps"]
    assert steps["steps"][0]["verdict"] == "launch-bound"
    assert steps["summary"]["steps"] == 1
    assert steps["headroom"][0]["scope"] == "operator"
    assert steps["roofline_vs_step"]["wall_us"] == pytest.approx(analysis_b1.steps["wall_us"][0])
    from trace_roofline.outputs.html_report import report_html

    page = report_html([analysis_b1])
    assert "<h4>Steps</h4>" in page and "launch-bound" in page
    # the step's bar: its segments' widths add up to its whole wall (the longest step's), the
    # busy segment's share and µs those of the table
    bar = re.search(r'<div class="stepbar">.*?</div></div>', page).group(0)
    widths = [float(w) for w in re.findall(r"width:([\d.]+)%;background", bar)]
    assert sum(widths) == pytest.approx(100, abs=0.01)
    busy = analysis_b1.steps["busy_us"][0]
    assert f"device busy: {busy:,.1f} µs" in bar
    assert f"width:{100 * busy / analysis_b1.steps['wall_us'][0]:.3f}%" in bar


def test_steps_survive_the_cache(tmp_path):
    cache = TraceCache(tmp_path)
    first = analyze_trace(GRAPH, run=Run(cache=cache))
    again = analyze_trace(GRAPH, run=Run(cache=cache))
    assert cache.log[-1].analysis_hit
    assert again.steps.equals(first.steps) and again.headroom.equals(first.headroom)
    assert np.array_equal(again.steps.dtypes.astype(str), first.steps.dtypes.astype(str))
