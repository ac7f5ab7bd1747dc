"""`trace-roofline project`: the what-if projection against hand-computed values,
and against the measured step times of the committed H100 sweep (sample_traces/step_sweep):
each trace's projection of the other points of its phase within 15% (decode) and 20%
(prefill), except the pairs docs/project.md lists as outside the bar."""

from __future__ import annotations

import json
import math
from functools import cache

import pytest

import trace_roofline as tr
from tests.builders import SAMPLES, walk
from trace_roofline import project as pj
from trace_roofline.cli import main
from trace_roofline.model import formulas
from trace_roofline.model.hardware import get_hardware
from trace_roofline.roofline import Analysis
from trace_roofline.trace import Trace, load_trace

SWEEP = SAMPLES / "step_sweep"
RESULTS = json.loads((SWEEP / "step_sweep_results.json").read_text())["points"]
DECODE, PREFILL = [1, 4, 16, 64, 256], [256, 512, 1024, 2048, 4096]
BAR = {"decode": 0.15, "prefill": 0.20}
# docs/project.md ("Where it does not"): B=1 decode measures 15.95 ms, 4.5 ms under the host
# time every trace shows (its own and B=4's: the same ATen ops and launches, B=4 measures 20.5 ms);
# timed in turn, B=1 and B=4 take the same time (test_batch_one_is_the_host_s_drift_not_the_batch_s)
OUTSIDE = {("decode", 1)}
MODEL = tr.get_model("qwen2.5-7b")


def _key(p: dict) -> tuple[str, int]:
    return p["phase"], p["batch"] if p["phase"] == "decode" else p["tokens"]


MEASURED = {_key(p): p for p in RESULTS}


@cache
def _analysed(phase: str, size: int) -> tuple[Trace, Analysis]:
    trace = load_trace(SWEEP / MEASURED[phase, size]["trace"])
    return trace, tr.analyze_trace(trace, MODEL)


def _point(phase: str, size: int) -> pj.Point:
    return pj.Point(size, 1024, 1) if phase == "decode" else pj.Point(1, 0, size)


@pytest.mark.parametrize("phase,source", walk(
    [("decode", b) for b in DECODE] + [("prefill", t) for t in PREFILL], lambda v: v[0],
    lambda v: f"{v[0]}-{v[1]}"))
def test_each_sweep_trace_projects_the_measured_step_times_of_its_phase(phase, source):
    trace, analysis = _analysed(phase, source)
    sizes = DECODE if phase == "decode" else PREFILL
    got = pj.project(analysis, [_point(phase, s) for s in sizes], trace=trace).points
    assert got["measured"].sum() == 1 and len(got) == len(sizes)
    for size in sizes:
        p = _point(phase, size)
        row = got[(got["batch"] == p.batch) & (got["tokens"] == p.tokens)].iloc[0]
        measured = MEASURED[phase, size]["step_ms"]["median"]
        err = row["step_ms"] / measured - 1
        if (phase, size) in OUTSIDE:  # documented: over the bar, and by how much at most
            assert BAR[phase] < err < 0.35, (size, row["step_ms"], measured)
        else:
            assert abs(err) <= BAR[phase], (size, row["step_ms"], measured)


def test_measured_point_reproduces_the_traced_device_time_and_host_time_by_hand():
    trace, analysis = _analysed("decode", 4)
    got = pj.project(analysis, [], trace=trace).points.iloc[0]
    assert got["measured"] and (got["batch"], got["context"], got["tokens"]) == (4, 1024, 1)
    assert got["device_ms"] == pytest.approx(analysis.whole["time_us"] / 1e3, rel=1e-9)
    # by hand: the step's start to its last runtime call, less the device syncs inside it,
    # less 1.7 µs per CPU op and runtime call recorded before that end
    step = trace.annotations[trace.annotations["cat"] == "user_annotation"].iloc[0]
    rt = trace.runtime
    inside = rt[(rt["ts_us"] >= step["ts_us"]) & (rt["ts_us"] < step["ts_us"] + step["dur_us"])]
    end = float((inside["ts_us"] + inside["dur_us"]).max())
    syncs = inside[inside["name"].astype(str) == "cudaDeviceSynchronize"]["dur_us"].sum()
    ops = trace.cpu_ops[(trace.cpu_ops["ts_us"] >= step["ts_us"]) & (trace.cpu_ops["ts_us"] < end)]
    host = end - step["ts_us"] - syncs - (len(inside) + len(ops)) * pj.PROFILER_EVENT_US
    assert got["host_ms"] == pytest.approx(host / 1e3, rel=1e-6)  # (µs timestamps near 6e12)
    assert got["step_ms"] == max(got["host_ms"], got["device_ms"])


def test_linear_flops_and_bytes_at_a_new_batch_are_the_gemm_formulas():
    _, analysis = _analysed("decode", 4)
    ops = pj.project(analysis, [pj.Point(64, 1024, 1)]).operators
    at = ops[ops["point"] == ops.loc[ops["flops"].idxmax(), "point"]].set_index("operator")
    k, n = MODEL.hidden_size, MODEL.q_size
    assert at.loc["q_proj", "flops"] == pytest.approx(28 * (2 * 64 * k * n + 64 * n))  # + bias
    assert at.loc["q_proj", "bytes"] == pytest.approx(28 * (64 * k + k * n + 64 * n + n) * 2)
    i = MODEL.intermediate_size
    assert at.loc["down_proj", "flops"] == pytest.approx(28 * 2 * 64 * i * k)
    pairs = formulas.attention_flops(formulas.AttentionShape(
        MODEL.num_heads, MODEL.num_kv_heads, 1, 1025, MODEL.head_dim, batch=64))
    assert at.loc["attention", "flops"] == pytest.approx(28 * pairs)


def test_a_linear_changes_regime_at_its_m_star_and_its_time_follows_the_compute_roof():
    _, analysis = _analysed("decode", 4)
    h100 = get_hardware("h100-sxm")
    result = pj.project(analysis, [], sweep=pj.Sweep(hardware=[h100]))
    m_star = int(result.crossings.set_index("operator").loc["gate_proj", "m_star"])
    ridge = h100.peak_flops["bf16"] / h100.mem_bandwidth
    k, n = MODEL.hidden_size, MODEL.intermediate_size
    assert formulas.gemm_intensity(m_star, k, n, 2) >= ridge > formulas.gemm_intensity(
        m_star - 1, k, n, 2)
    got = pj.project(analysis, [pj.Point(m_star - 1, 1024, 1), pj.Point(m_star, 1024, 1),
                                pj.Point(4 * m_star, 1024, 1)])
    ops = got.operators[got.operators["operator"] == "gate_proj"].set_index("point")
    batch = got.points["batch"]
    below, at, far = (int(batch[batch == b].index[0]) for b in (m_star - 1, m_star, 4 * m_star))
    assert ops.loc[below, "bound"] == "memory" and ops.loc[at, "bound"] == "compute"
    assert "gate_proj memory->compute" in got.points.loc[at, "crossed"]
    # past the ridge its time is FLOPs over the same fraction of the peak: 4x the tokens, ~4x
    ratio = (ops.loc[far, "time_us"] - ops.loc[at, "time_us"]) / ops.loc[at, "time_us"]
    assert ratio == pytest.approx(3.0, rel=0.05)


def test_layers_scale_per_layer_work_and_the_host():
    trace, analysis = _analysed("decode", 4)
    got = pj.project(analysis, [pj.Point(4, 1024, 1, layers=56)], trace=trace).points
    base, deep = got[got["measured"]].iloc[0], got[~got["measured"]].iloc[0]
    assert deep["host_ms"] == pytest.approx(2 * base["host_ms"])
    lm_head = 2 * 4 * MODEL.hidden_size * MODEL.vocab_size  # lm_head is not per layer
    assert deep["flops"] - lm_head == pytest.approx(2 * (base["flops"] - lm_head), rel=1e-3)
    assert math.isclose(deep["tokens_per_s"], 4 / (deep["step_ms"] / 1e3))


def test_cli_prints_the_table_and_assumptions_and_writes_json_and_chart(tmp_path, capsys):
    path = SWEEP / MEASURED["decode", 4]["trace"]
    out, js = tmp_path / "proj", tmp_path / "p.json"
    assert main(["project", str(path), "--model", "qwen2.5-7b", "--batch", "1,64",
                 "--json", str(js), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "(measured)" in text and "assumptions:" in text and "M*=" in text
    doc = json.loads(js.read_text())
    assert [(p["batch"], p["measured"]) for p in doc["points"]] == [(1, False), (4, True), (64, False)]
    for key in ("batch", "context", "tokens", "hardware", "step_ms", "device_ms", "tokens_per_s"):
        assert key in doc["points"][0]
    assert doc["assumptions"] and sorted(p.name for p in out.iterdir()) == [
        "projection.json", "projection.png"]


@pytest.mark.parametrize("args,says", [
    (["--batch", "0"], "--batch: expected positive integers"),
    (["--hardware", "h100-sxn"], "unknown hardware"),
    (["--context", "x"], "--context: expected comma-separated integers"),
])
def test_cli_bad_input_is_one_line_exit_2_and_no_files(tmp_path, capsys, args, says):
    path = SWEEP / MEASURED["decode", 4]["trace"]
    out = tmp_path / "proj"
    code = main_code(["project", str(path), "--model", "qwen2.5-7b", "--out", str(out), *args])
    err = capsys.readouterr().err
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_cli_missing_trace_and_misspelt_flag(tmp_path, capsys):
    assert main_code(["project", str(tmp_path / "none.json.gz"), "--model", "qwen2.5-7b"]) == 2
    assert "none.json.gz" in capsys.readouterr().err
    assert main_code(["project", "x.json", "--model", "qwen2.5-7b", "--bacth", "4"]) == 2
    assert "did you mean --batch?" in capsys.readouterr().err


def main_code(argv: list[str]) -> int:
    """main's exit code, argparse's SystemExit included."""
    try:
        return main(argv)
    except SystemExit as e:
        return int(e.code or 0)


def test_batch_one_is_the_host_s_drift_not_the_batch_s():
    """The documented exception, timed again in turn on another H100 (step_timing_rounds.json):
    B=1 and B=4 take the same time within 3%, as every trace's projection says (within 5%)."""
    rounds = json.loads((SWEEP / "step_timing_rounds.json").read_text())["rounds"]
    median = {b: sorted(r["step_ms"]["median"] for r in rounds if r["batch"] == b)[1]
              for b in (1, 4)}
    measured = median[1] / median[4]
    assert abs(measured - 1) <= 0.03, median
    for source in DECODE:
        trace, analysis = _analysed("decode", source)
        got = pj.project(analysis, [_point("decode", 1), _point("decode", 4)],
                         trace=trace).points.set_index("batch")["step_ms"]
        assert got[1] / got[4] == pytest.approx(measured, rel=0.05), (source, got.to_dict())

