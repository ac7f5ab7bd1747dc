"""`analyze --perfetto`: the trace enriched for Perfetto, read back by our own loader."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import trace_roofline as tr
from tests.builders import SAMPLES, read
from trace_roofline import perfetto
from trace_roofline.cli import main
from trace_roofline.errors import InputError

EAGER = SAMPLES / "qwen2.5-7b_decode_b1_s2048_h200.json.gz"
COMPILED = SAMPLES / "qwen2.5-7b_decode_b1_s2048_compiled_noannot_h200.json.gz"
CPU = SAMPLES / "qwen-tiny_decode_b2_s64_l2_noannot_cpu.json.gz"
TABLES = ("device", "cpu_ops", "runtime", "annotations", "python_frames", "flows")


def _enrich(path: Path, model: str, out: Path):
    t = tr.load_trace(path)
    m = tr.get_model(model)
    att, a = tr.attribute_trace(t, m)[0], tr.analyze_trace(t, m)
    out.write_bytes(b"".join(perfetto.enriched_trace(t, att, a)))
    return t, att, a, json.loads(out.read_bytes())


@pytest.mark.parametrize(("path", "model"), [(EAGER, "qwen2.5-7b"), (COMPILED, "qwen2.5-7b"),
                                             (CPU, "qwen-tiny")])
def test_enriched_trace(tmp_path, path, model):
    out = tmp_path / "e.json"
    t, att, a, doc = _enrich(path, model, out)
    before, after = read(path)["traceEvents"], doc["traceEvents"]
    n = len(before)
    # Original events unchanged, except the analysed units' args.roofline; order kept.
    units = set(att["event_id"].tolist())
    for i, (e0, e1) in enumerate(zip(before, after[:n], strict=True)):
        if i in units:
            extra = e1["args"].pop("roofline")
            assert extra["operator"] == att.loc[att["event_id"] == i, "operator"].iloc[0]
        assert e0 == e1
    top = read(path)  # the other top-level keys too
    assert {k: v for k, v in doc.items() if k != "traceEvents"} == {
        k: v for k, v in top.items() if k != "traceEvents"}
    # Our loader reads the same tables back, and the analysis is the same.
    t2 = tr.load_trace(out)
    for name in TABLES:
        pd.testing.assert_frame_equal(getattr(t, name), getattr(t2, name))
    a2 = tr.analyze_trace(t2, tr.get_model(model))
    pd.testing.assert_frame_equal(a.operators, a2.operators)
    # Added events: one process, its name, slices that tile every unit's time, counters.
    added = after[n:]
    pid = {e["pid"] for e in added}
    assert len(pid) == 1 and pid.isdisjoint({e.get("pid") for e in before})
    meta = [e for e in added if e["ph"] == "M"]
    assert {"process_name", "thread_name"} <= {e["name"] for e in meta}
    slices = pd.DataFrame([{**e["args"], "tid": e["tid"], "ts": e["ts"], "dur": e["dur"],
                            "name": e["name"]} for e in added if e["ph"] == "X"])
    assert slices["kernels"].sum() == len(att)
    assert slices["kernel time µs"].sum() == pytest.approx(att["dur_us"].sum(), rel=1e-12)
    assert (slices["name"] == slices["operator"]).all()
    for _, s in slices.groupby("tid"):  # slices of a lane never overlap
        assert (s["ts"].to_numpy()[1:] >= (s["ts"] + s["dur"]).to_numpy()[:-1] - 1e-9).all()
    total_flops = sum(w["flops"] for w in a.whole_by_phase.values())
    assert slices["flops"].fillna(0).sum() == pytest.approx(total_flops, rel=1e-9)
    # Counters: the area under each lane's TFLOP/s is its FLOPs.
    c = pd.DataFrame([{"name": e["name"], "ts": e["ts"], "lane": k, "v": v}
                      for e in added if e["ph"] == "C" for k, v in e["args"].items()])
    area = 0.0
    for _, g in c[c["name"] == "TFLOP/s"].groupby("lane"):
        area += float((g["v"].to_numpy()[:-1] * np.diff(g["ts"].to_numpy())).sum()) * 1e6
    assert g["v"].iloc[-1] == 0.0
    assert area == pytest.approx(total_flops, rel=1e-6)


def test_kernel_shares_sum_to_their_instance():
    t = tr.load_trace(EAGER)
    m = tr.get_model("qwen2.5-7b")
    att, a = tr.attribute_trace(t, m)[0], tr.analyze_trace(t, m)
    k = perfetto.kernel_figures(t, att, a)
    per_op = k.groupby("op_id")[["flops", "bytes"]].sum()
    costed = a.costed.groupby("op_id")[["flops", "bytes"]].sum()
    pd.testing.assert_frame_equal(per_op, costed.loc[per_op.index], check_exact=False, rtol=1e-12,
                                  check_index_type=False)
    gemm = k[k["operator"] == "q_proj"]  # a split-K GEMM: two kernels, one instance's figures
    assert gemm.groupby("op_id")["pct_of_roof"].nunique().eq(1).all()
    assert set(k["evidence"]) == {"annotation"} and set(k["lane"]) == {"GPU 0 stream 7"}


def test_array_format_and_changed_file(tmp_path):
    events = read(EAGER)["traceEvents"]
    src = tmp_path / "array.json"
    src.write_text(json.dumps(events))
    out = tmp_path / "out.json"
    t, _, _, doc = _enrich(src, "qwen2.5-7b", out)
    assert isinstance(doc, list) and len(doc) > len(events)
    t = tr.load_trace(src)
    att, a = tr.attribute_trace(t)[0], tr.analyze_trace(t)
    src.write_text(json.dumps(events[:100]))  # the file shrank after the analysis
    with pytest.raises(InputError, match="changed since it was analysed"):
        b"".join(perfetto.enriched_trace(t, att, a))


def test_cli(tmp_path, capsys):
    out = tmp_path / "p" / "enriched.json.gz"
    assert main(["analyze", str(EAGER), "--perfetto", str(out), "--out", str(tmp_path / "r")]) == 0
    assert out.read_bytes()[:2] == b"\x1f\x8b" and "ui.perfetto.dev" in capsys.readouterr().out
    assert [p.name for p in out.parent.iterdir()] == ["enriched.json.gz"]  # no temporary left
    assert len(tr.load_trace(out).device) == len(tr.load_trace(EAGER).device)
    assert main(["analyze", str(EAGER), str(COMPILED), "--perfetto", str(tmp_path / "x.json")]) == 2
    assert "--perfetto takes one trace" in capsys.readouterr().err


@pytest.mark.parametrize("array", [False, True])
def test_small_chunks_split_events_exactly(tmp_path, monkeypatch, array):
    """Cut every few kB (kernel names hold '},' inside strings): the same bytes as one chunk."""
    src = EAGER
    if array:
        src = tmp_path / "array.json"
        src.write_text(json.dumps(read(EAGER)["traceEvents"], indent=1))
    t = tr.load_trace(src)
    att, a = tr.attribute_trace(t)[0], tr.analyze_trace(t)
    whole = b"".join(perfetto.enriched_trace(t, att, a))
    monkeypatch.setattr(perfetto, "CHUNK", 3000)
    assert b"".join(perfetto.enriched_trace(t, att, a)) == whole
