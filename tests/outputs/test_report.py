"""report: terminal text, the report.json contract, markdown."""

import json

import pytest

from tests.builders import BF, Op, attributed, concat, qwen_layer
from trace_roofline.model.hardware import get_hardware
from trace_roofline.model.models import get_model
from trace_roofline.options import AnalysisOptions
from trace_roofline.outputs.report import (
    SCHEMA_VERSION,
    duration,
    markdown,
    operators_tables,
    report_dict,
    si,
    terminal_table,
)
from trace_roofline.pipeline import TraceFacts, analyze

QWEN = get_model("qwen2.5-7b")
H200 = get_hardware("h200-sxm")
DUR = {"q_proj": (8.0,), "gate_proj": (35.0,), "up_proj": (35.0,), "down_proj": (20.0, 15.0)}

CONTRACT = {"trace", "hardware", "model", "conventions", "coverage", "operators", "whole_model"}
HARDWARE = {"name", "peak_flops_per_s", "bandwidth_bytes_per_s", "ridge"}
COVERAGE = {"kernel_time_us", "attributed_time_us", "fraction"}
OPERATOR = {"operator", "layer", "phase", "kernels", "time_us", "flops", "bytes", "intensity",
            "achieved_flops_per_s", "achieved_bytes_per_s", "attainable_flops_per_s",
            "roof_fraction", "bound"}
WHOLE = {"flops", "bytes", "intensity", "time_us", "achieved_flops_per_s"}


@pytest.fixture(scope="module")
def decode():
    ops = [*qwen_layer(QWEN, 1, 2048, DUR), Op("unattributed", None, None, None, durs=(2.0,)),
           Op("k_proj", "aten::addmm", [[512], [1, 3584], [3584, 512], [], []],
              [BF, BF, BF, "Scalar", "Scalar"], durs=(0.2,))]
    return analyze(attributed(ops), QWEN, H200, AnalysisOptions(layers=28),
                   facts=TraceFacts(trace="decode.json.gz"))


@pytest.fixture(scope="module")
def prefill():
    return analyze(attributed(qwen_layer(QWEN, 512, 512)), QWEN, H200,
                   facts=TraceFacts(trace="prefill.json.gz"))


def test_report_dict_honours_the_contract(decode):
    report = report_dict([decode])
    assert set(report) == {"schema_version", "traces"} and report["schema_version"] == 2
    (d,) = report["traces"]
    assert set(d) >= CONTRACT
    assert set(d["hardware"]) >= HARDWARE and set(d["coverage"]) >= COVERAGE
    assert set(d["whole_model"]) >= WHOLE
    assert d["trace"] == "decode.json.gz" and d["model"]["name"] == "qwen2.5-7b"
    assert d["conventions"] == {"causal": "causal", "attention_bytes": "all"}
    assert d["hardware"]["name"] == "h200-sxm"
    assert d["hardware"]["ridge"] == pytest.approx(989.4e12 / 4.8e12)
    for entry in d["operators"]:
        assert set(entry) >= OPERATOR
        assert entry["phase"] == "decode"
    agg = [e for e in d["operators"] if e["layer"] is None]
    per_layer = [e for e in d["operators"] if e["layer"] is not None]
    assert {e["operator"] for e in agg} >= {"q_proj", "attention", "unattributed"}
    assert all(e["layer"] == 0 for e in per_layer) and per_layer
    q = next(e for e in agg if e["operator"] == "q_proj")
    assert q["flops"] == 2 * 3584 * 3584 + 3584 and q["bound"] == "memory"
    assert d["coverage"]["fraction"] < 1.0
    assert d["extrapolated"]["layers"] == 28
    text = json.dumps(report, allow_nan=False)  # NaN (the unattributed row) became null
    assert json.loads(text) == report
    un = next(e for e in agg if e["operator"] == "unattributed")
    assert un["flops"] is None and un["bound"] is None


def test_report_json_has_one_shape_for_any_number_of_traces(decode, prefill):
    one, two = report_dict([decode]), report_dict([decode, prefill])
    assert set(one) == set(two) == {"schema_version", "traces"}
    assert one["schema_version"] == two["schema_version"] == SCHEMA_VERSION
    assert one["traces"][0] == two["traces"][0]
    d = two
    assert [t["trace"] for t in d["traces"]] == ["decode.json.gz", "prefill.json.gz"]
    assert {e["phase"] for e in d["traces"][1]["operators"]} == {"prefill"}
    json.dumps(d, allow_nan=False)


def test_terminal_table(decode, prefill):
    text = terminal_table([decode, prefill])
    for needle in ("trace decode.json.gz", "trace prefill.json.gz", "h200-sxm", "ridge 206",
                   "--causal causal", "--attention-bytes all", "whole model", "coverage of ",
                   "gate_proj", "attention", "extrapolated to 28 layers"):
        assert needle in text
    lines = text.splitlines()
    k = next(line for line in lines if line.startswith("k_proj "))
    assert k.endswith("! above roof")  # 3.7 MB in 0.2 µs
    first = lines.index(next(line for line in lines if line.startswith("operator")))
    assert lines[first + 1].startswith("gate_proj") or lines[first + 1].startswith("up_proj")
    assert "layer 0" not in text  # per-layer rows only on request


def test_markdown(decode):
    md = markdown([decode])
    assert md.startswith("# trace_roofline report")
    assert "![roofline](roofline.png)" in md
    assert "| **whole model** |" in md and "### Reconciliation" in md
    assert f"**{decode.whole['intensity']:.4f}**" in md
    assert "### Extrapolated to 28 layers" in md
    assert "--attention-bytes all" in md


def test_no_hardware_report():
    a = analyze(attributed(qwen_layer(QWEN, 1, 64)), QWEN, None, facts=TraceFacts(trace="cpu"))
    d = report_dict([a])["traces"][0]
    assert d["hardware"] is None
    assert "no placements" in terminal_table([a])
    json.dumps(d, allow_nan=False)


def test_measured_intensity_column_when_ncu_bytes_are_joined(decode):
    import dataclasses

    import pandas as pd

    from trace_roofline.roofline import place

    measured = pd.DataFrame({"layer": [0], "operator": ["q_proj"], "measured_bytes": [51.4e6]})
    ops = place(decode.costed, H200, measured=measured)
    text = terminal_table([dataclasses.replace(decode, operators=ops)])
    assert "ncu F/B" in text
    q = next(line for line in text.splitlines() if line.startswith("q_proj "))
    assert q.split()[-1] == f"{(2 * 3584 * 3584 + 3584) / 51.4e6:.2f}"
    assert "ncu F/B" not in terminal_table([decode])


@pytest.fixture(scope="module")
def generate():
    """One trace holding a prefill step, then a decode step (an HF `generate` profile)."""
    pre = attributed(qwen_layer(QWEN, 512, 512), step=0)
    dec = attributed(qwen_layer(QWEN, 1, 512, DUR), step=1, first_event=1000, first_op=10_000,
                     t0=5000.0)
    return analyze(concat(pre, dec), QWEN, H200, facts=TraceFacts(trace="generate.json.gz"))


def test_whole_model_by_phase_in_report_json(decode, generate):
    d = report_dict([decode])["traces"][0]
    assert d["whole_model_by_phase"] == {"decode": d["whole_model"]}  # single phase: as before
    g = report_dict([generate])["traces"][0]
    by_phase = g["whole_model_by_phase"]
    assert list(by_phase) == ["prefill", "decode"]  # order of first appearance
    for phase, w in by_phase.items():
        assert set(w) >= WHOLE and w["phases"] == [phase]
        assert w["intensity"] == pytest.approx(generate.whole_by_phase[phase]["intensity"])
    # whole_model: the phase with the most device time (prefill: 512 tokens, default 1 µs/kernel
    # vs decode's chosen durations)
    longest = max(by_phase, key=lambda p: by_phase[p]["time_us"])
    assert g["whole_model"] == by_phase[longest]
    assert by_phase["prefill"]["intensity"] > 100 > 2 > by_phase["decode"]["intensity"]
    json.dumps(g, allow_nan=False)


def test_terminal_has_a_whole_model_line_per_phase(generate):
    lines = terminal_table([generate]).splitlines()
    whole = [line.split() for line in lines if line.startswith("whole model")]
    assert [w[2] for w in whole] == ["prefill", "decode"]
    for w in whole:  # whole model PHASE KERNELS TIME UNIT TIME% FLOPS UNIT BYTES UNIT FLOP/B
        assert w[11] == f"{generate.whole_by_phase[w[2]]['intensity']:.2f}"
        assert w[6] == "100.0"  # of the phase's device time
    assert not any("decode/" in line or "/prefill" in line for line in lines)


def test_markdown_reconciles_each_phase(generate):
    md = markdown([generate])
    sums = [row.split("|") for row in md.splitlines() if "| **sum** |" in row]
    assert [s[1].strip() for s in sums] == ["prefill", "decode"]
    for s in sums:
        phase = s[1].strip()
        assert s[3].strip() == "100.0%"
        assert s[5].strip() == f"**{generate.whole_by_phase[phase]['intensity']:.4f}**"
    rows = [r.split("|") for r in md.splitlines() if r.startswith("| **whole model** |")]
    assert [r[2].strip() for r in rows] == ["prefill", "decode"]


def test_above_roof_is_explained(decode):
    md, text = markdown([decode]), terminal_table([decode])
    for out in (md, text):  # k_proj: 3.7 MB in 0.2 µs
        assert "served from L2" in out and "bytes counted too high" in out
    ops = qwen_layer(QWEN, 1, 2048)
    slow = analyze(attributed(qwen_layer(QWEN, 1, 2048, {o.operator: (100.0,) for o in ops})),
                   QWEN, H200)
    assert not slow.operators["exceeds_roof"].fillna(False).any()
    assert "served from L2" not in markdown([slow]) + terminal_table([slow])


def test_units_scale_with_size():
    assert si(407.51e6, "B") == "407.5 MB" and si(14.28e9, "B") == "14.28 GB"
    assert si(1026.0, "FLOP") == "1.026 kFLOP" and si(3.541e12, "FLOP/s") == "3.541 TFLOP/s"
    assert si(0.0, "FLOP") == "0 FLOP" and si(12.0, "B") == "12 B" and si(None, "B") == "-"
    assert si(999.99e9, "B") == "1 TB"  # rounds up into the next prefix, not "1000 GB"
    assert duration(115.13) == "115.1 µs" and duration(2315.0) == "2.315 ms"
    assert duration(1.5e6) == "1.5 s" and duration(0.5) == "0.5 µs"


def test_a_cpu_sized_run_prints_no_zero_figures():
    """The qwen-tiny CPU decode layer: kFLOP, kB and MB/s where fixed GFLOP/GB/s columns
    printed 0.000 and 0."""
    tiny = get_model("qwen-tiny")
    a = analyze(attributed(qwen_layer(tiny, 1, 64, {"q_proj": (500.0,)})), tiny, None,
                facts=TraceFacts(trace="cpu"))
    q = next(line for line in terminal_table([a]).splitlines() if line.startswith("q_proj "))
    assert "131.3 kFLOP" in q and "132.6 kB" in q and "500 µs" in q
    assert "262.7 MFLOP/s" in q and "265.2 MB/s" in q  # 131328 FLOP, 132608 B in 500 µs


@pytest.fixture(scope="module")
def two_layers():
    layer = {"q_proj": (8.0,), "down_proj": (20.0, 15.0)}
    return analyze(concat(attributed(qwen_layer(QWEN, 1, 2048, layer), layer=0),
                          attributed(qwen_layer(QWEN, 1, 2048, layer), layer=1, first_event=1000,
                                     first_op=10_000, t0=5000.0)), QWEN, H200, facts=TraceFacts(trace="l2"))


def _block(text: str, title: str) -> list[list[str]]:
    """The rows (split) of the terminal block whose title line starts with `title`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    start += 1 if title == "operator" else 2  # past the block's title and column header
    end = next((i for i in range(start, len(lines))
                if not lines[i] or lines[i].startswith(("layer ", "whole model", "coverage"))),
               len(lines))
    return [line.split() for line in lines[start:end]]


def test_per_layer_blocks_each_sum_to_100_percent(two_layers):
    text = terminal_table([two_layers], per_layer=True)
    top = _block(text, "operator")
    assert sum(float(r[5]) for r in top) == pytest.approx(100, abs=0.1)
    for layer in (0, 1):
        rows = _block(text, f"layer {layer} (decode)")
        assert len(rows) == 14 and sum(float(r[5]) for r in rows) == pytest.approx(100, abs=0.1)
        assert all(r[0] in {o.operator for o in qwen_layer(QWEN, 1, 1)} for r in rows)
    assert "layer 0 (decode): " in text and "50.0% of the phase's device time" in text
    assert "[0]" not in text and "[1]" not in text  # the layer is a heading, not a name suffix


def test_one_layer_trace_prints_its_rows_once(decode):
    text = terminal_table([decode], per_layer=True)
    assert sum(line.startswith("q_proj ") for line in text.splitlines()) == 1
    assert "one decoder layer per phase; its rows are the table above" in text


def test_by_shape_rows_keep_the_layer_apart():
    by_shape = analyze(concat(attributed(qwen_layer(QWEN, 1, 2048), layer=0),
                              attributed(qwen_layer(QWEN, 1, 2048), layer=1, first_event=1000,
                                         first_op=10_000)), QWEN, H200,
                       AnalysisOptions(by_shape=True), TraceFacts(trace="s"))
    text = terminal_table([by_shape], per_layer=True)
    assert "down_proj [1,18944]x[18944,3584]" in text
    assert "][0]" not in text and "][1]" not in text


def test_tables_use_fractions_and_an_integer_layer(two_layers):
    tables = operators_tables([two_layers])
    agg, by_layer = tables["aggregate"], tables["by_layer"]
    assert "layer" not in agg.columns and str(by_layer["layer"].dtype) == "int64"
    assert "pct_of_roof" not in agg.columns
    assert agg["time_share"].sum() == pytest.approx(1.0)
    q = two_layers.operators.query("operator == 'q_proj' and layer.isna()").iloc[0]
    assert agg.set_index("operator").loc["q_proj", "roof_fraction"] == q["pct_of_roof"] / 100


def test_a_figure_rounding_to_zero_prints_as_below_a_tenth_never_minus_zero():
    from trace_roofline.outputs.text import pct, tenths
    assert [tenths(v) for v in (0.0, -0.0, 0.04, -0.04, 0.05, 12.34, -0.049999)] == [
        "0.0", "0.0", "<0.1", ">-0.1", "0.1", "12.3", ">-0.1"]
    assert pct(0.0004) == "<0.1%" and pct(0.0) == "0.0%" and pct(float("nan")) == "n/a"
