"""`diff`: two analyses (or report.json files) of one model compared per (phase, operator)."""

import json

import pandas as pd
import pytest

import trace_roofline as tr
from tests.builders import SAMPLES
from trace_roofline.cli import main
from trace_roofline.errors import InputError
from trace_roofline.outputs import diff
from trace_roofline.outputs.report import report_dict

EAGER = SAMPLES / "qwen2.5-7b_decode_b1_s2048_h200.json.gz"
COMPILED = SAMPLES / "qwen2.5-7b_decode_b1_s2048_compiled_noannot_h200.json.gz"
B64 = SAMPLES / "qwen2.5-7b_decode_b64_s2048_h200.json.gz"
FUSED = SAMPLES / "qwen2.5-7b_decode_b32_s2048_fused_h200.json.gz"
QWEN = tr.get_model("qwen2.5-7b")


@pytest.fixture(scope="module")
def analyses():
    return {p: tr.analyze_trace(p, QWEN) for p in (EAGER, COMPILED, B64, FUSED)}


def _report(phase_ops: list[tuple], whole: dict, steps: int | None) -> dict:
    """A hand-made one-trace report.json: operators (operator, time, flops, bytes, pct)."""
    ops = [{"operator": o, "phase": "decode", "layer": None, "time_us": t, "flops": f, "bytes": b,
            "intensity": f / b, "achieved_flops_per_s": f / (t * 1e-6), "pct_of_roof": pct,
            "bound": "memory"} for o, t, f, b, pct in phase_ops]
    w = {**whole, "intensity": whole["flops"] / whole["bytes"], "bound": "memory",
         "achieved_flops_per_s": whole["flops"] / (whole["time_us"] * 1e-6)}
    if steps:
        w["steps"] = steps
    return {"trace": "hand", "operators": ops, "whole_model_by_phase": {"decode": w}}


def test_hand_computed_rows():
    # A: 2 steps; q_proj 40 µs, 2e9 FLOPs, 1e9 bytes over both -> 20 µs, 1e9 F, 5e8 B per step.
    a = _report([("q_proj", 40.0, 2e9, 1e9, 50.0), ("rope", 10.0, 1e6, 4e6, 1.0)],
                {"time_us": 50.0, "flops": 2.001e9, "bytes": 1.004e9, "pct_of_roof": 40.0}, 2)
    # B: 1 step; q_proj 10 µs, same work per step, I = 2; qkv_proj new, rope gone.
    b = _report([("q_proj", 10.0, 1e9, 5e8, 80.0), ("qkv_proj", 5.0, 3e9, 1e9, 60.0)],
                {"time_us": 15.0, "flops": 4e9, "bytes": 1.5e9, "pct_of_roof": 70.0}, 1)
    t = diff.diff(a, b).set_index("operator")
    assert list(t.columns) == [c for c in diff.DIFF_COLUMNS if c != "operator"]
    q = t.loc["q_proj"]
    assert (q.time_a_us, q.time_b_us, q.speedup) == (20.0, 10.0, 2.0)
    assert (q.flops_a, q.flops_b, q.bytes_a, q.bytes_b) == (1e9, 1e9, 5e8, 5e8)
    assert bool(q.flops_equal) and q.delta_intensity == 0.0
    assert q.delta_pct_of_roof == pytest.approx(30.0)
    assert (q.steps_a, q.steps_b, q.presence) == (2, 1, "both")
    assert t.loc["rope"].presence == "a only" and pd.isna(t.loc["rope"].time_b_us)
    assert t.loc["qkv_proj"].presence == "b only" and pd.isna(t.loc["qkv_proj"].speedup)
    w = t.loc[diff.WHOLE]
    assert w.time_a_us == 25.0 and w.speedup == pytest.approx(25.0 / 15.0)
    assert not w.flops_equal  # 1.0005e9 vs 4e9 per step: a different workload
    assert t.index[-1] == diff.WHOLE  # whole model last, operators by time
    notes = diff.notes(diff.diff(a, b), diff.side(a), diff.side(b))
    assert any(n.startswith("DIFFERENT WORKLOAD") for n in notes)
    assert any(n == "only in A: rope (decode)" for n in notes)


def test_unknown_steps_compare_totals():
    a = _report([("q_proj", 40.0, 2e9, 1e9, 50.0)],
                {"time_us": 40.0, "flops": 2e9, "bytes": 1e9, "pct_of_roof": 50.0}, None)
    t = diff.diff(a, a)
    assert t["steps_a"].isna().all() and t["time_a_us"].iloc[0] == 40.0
    assert any("per trace" in n for n in diff.notes(t, diff.side(a), diff.side(a)))


def test_trace_against_itself(analyses):
    t = diff.diff(analyses[EAGER], analyses[EAGER])
    assert (t["speedup"] == 1.0).all() and (t["presence"] == "both").all()
    assert t["flops_equal"].fillna(True).all()
    assert (t["delta_intensity"].dropna() == 0).all()
    a = diff.side(analyses[EAGER])
    assert diff.notes(t, a, a) == []


def test_eager_vs_compiled_per_step(analyses):
    ea, co = analyses[EAGER], analyses[COMPILED]
    t = diff.diff(ea, co).set_index("operator")
    ops = ea.operators[ea.operators["layer"].isna()].set_index("operator")
    steps = ea.costed["step"].nunique()
    assert steps == 3 and t.loc["q_proj", "steps_a"] == 3
    assert t.loc["q_proj", "time_a_us"] == pytest.approx(ops.loc["q_proj", "time_us"] / steps)
    assert t.loc["q_proj", "flops_equal"] and t.loc["attention", "flops_equal"]
    w = t.loc[diff.WHOLE]
    assert w.flops_equal  # same workload: only fused elementwise FLOPs differ
    assert w.speedup == pytest.approx(ea.whole["time_us"] / co.whole["time_us"])
    assert w.speedup > 1.2  # compile fuses the norms, rope and residual kernels


def test_batch_and_fusion_are_different_workloads(analyses):
    t = diff.diff(analyses[EAGER], analyses[B64])
    assert not t.loc[t["operator"] == diff.WHOLE, "flops_equal"].iloc[0]
    q = t[t["operator"] == "q_proj"].iloc[0]
    assert q.intensity_b > 40 * q.intensity_a  # M = 64 rows per weight read instead of 1
    f = diff.diff(analyses[B64], analyses[FUSED]).set_index("operator")
    assert {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"} <= set(
        f.index[f["presence"] == "a only"])
    assert set(f.index[f["presence"] == "b only"]) == {"qkv_proj", "gate_up_proj"}


def test_report_json_matches_analysis(analyses):
    a, b = analyses[EAGER], analyses[COMPILED]
    ra, rb = (json.loads(json.dumps(report_dict([x]))) for x in (a, b))
    for r, x in ((ra, a), (rb, b)):  # a report.json that records steps diffs like the Analysis
        for p, w in r["traces"][0]["whole_model_by_phase"].items():
            w["steps"] = int(x.costed.loc[x.costed["phase"] == p, "step"].nunique())
    from_json, direct = diff.diff(ra, rb), diff.diff(a, b)
    pd.testing.assert_frame_equal(from_json, direct, check_exact=False, rtol=1e-12)


def test_bad_report_inputs():
    with pytest.raises(InputError, match="holds 2 traces"):
        diff.side({"traces": [{}, {}]}, "r.json")
    with pytest.raises(InputError, match="not a trace_roofline report.json"):
        diff.side({"trace": "x", "operators": []}, "r.json")


def test_cli_writes_outputs_and_reads_reports(tmp_path, capsys):
    out = tmp_path / "d"
    assert main(["diff", str(EAGER), str(COMPILED), "--model", "qwen2.5-7b", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "speedup" in text and "whole model" in text and "FLOPs differ" in text
    assert {p.name for p in out.iterdir()} == {"diff.csv", "diff.json", "diff.md", "diff.png"}
    rows = pd.read_csv(out / "diff.csv")
    assert list(rows.columns) == list(diff.DIFF_COLUMNS)
    doc = json.loads((out / "diff.json").read_text())
    assert doc["rows"][-1]["operator"] == diff.WHOLE and doc["a"]["steps"] == {"decode": 3}
    # report.json inputs (from `analyze --json`) are recognised by their first key
    ra, rb = tmp_path / "a.json", tmp_path / "b.json"
    for src, dst in ((EAGER, ra), (B64, rb)):
        assert main(["analyze", str(src), "--model", "qwen2.5-7b", "--json", str(dst)]) == 0
    capsys.readouterr()
    assert main(["diff", str(ra), str(rb)]) == 0
    assert "DIFFERENT WORKLOAD" in capsys.readouterr().out


def test_cli_errors(tmp_path, capsys):
    assert main(["diff", str(tmp_path / "missing.json"), str(EAGER)]) == 2
    assert "missing.json" in capsys.readouterr().err
    bad = tmp_path / "r.json"
    bad.write_text('{"traces": [{"trace": "a"}, {"trace": "b"}]}')
    assert main(["diff", str(bad), str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "holds 2 traces" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
