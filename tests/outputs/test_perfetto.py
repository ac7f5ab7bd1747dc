"""`analyze --perfetto`: the trace enriched for Perfetto, read back by our own loader."""

import json
from pathlib import Path

import msgspec
import numpy as np
import pandas as pd
import pytest

import trace_roofline as tr
from tests.builders import SAMPLES, read
from trace_roofline.cli import main
from trace_roofline.errors import InputError
from trace_roofline.outputs import perfetto
from trace_roofline.pipeline import analyze_trace_kernels

EAGER = SAMPLES / "qwen2.5-7b_decode_b1_s2048_h200.json.gz"
COMPILED = SAMPLES / "qwen2.5-7b_decode_b1_s2048_compiled_noannot_h200.json.gz"
CPU = SAMPLES / "qwen-tiny_decode_b2_s64_l2_noannot_cpu.json.gz"
TP = SAMPLES / "tp2" / "tp2-qwen2.5-7b-2l_prefill_b1_t512_h200" / "rank1.json.gz"
TABLES = ("device", "cpu_ops", "runtime", "annotations", "python_frames", "flows")


def _enrich(path: Path, model: str | None, out: Path):
    a, kept = analyze_trace_kernels(path, tr.get_model(model) if model else None)
    t, att = kept.trace, kept.kernels
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
    a, kept = analyze_trace_kernels(EAGER, tr.get_model("qwen2.5-7b"))
    k = perfetto.kernel_figures(kept.trace, kept.kernels, a)
    per_op = k.groupby("op_id")[["flops", "bytes"]].sum()
    costed = a.costed.groupby("op_id")[["flops", "bytes"]].sum()
    pd.testing.assert_frame_equal(per_op, costed.loc[per_op.index], check_exact=False, rtol=1e-12,
                                  check_index_type=False)
    gemm = k[k["operator"] == "q_proj"]  # a split-K GEMM: two kernels, one instance's figures
    assert (gemm.groupby("instance").size() == 2).all()
    assert gemm.groupby("instance")["pct_of_roof"].nunique().eq(1).all()
    assert set(k["evidence"]) == {"annotation"} and set(k["lane"]) == {"GPU 0 stream 7"}
    other = analyze_trace_kernels(COMPILED, tr.get_model("qwen2.5-7b"))[0]
    with pytest.raises(ValueError, match="not computed from `attributed`"):
        perfetto.kernel_figures(kept.trace, kept.kernels, other)


def test_array_format_and_changed_file(tmp_path):
    events = read(EAGER)["traceEvents"]
    src = tmp_path / "array.json"
    src.write_text(json.dumps(events))
    out = tmp_path / "out.json"
    t, _, _, doc = _enrich(src, "qwen2.5-7b", out)
    assert isinstance(doc, list) and len(doc) > len(events)
    a, kept = analyze_trace_kernels(src)
    t, att = kept.trace, kept.kernels
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
    a, kept = analyze_trace_kernels(src)
    t, att = kept.trace, kept.kernels
    whole = b"".join(perfetto.enriched_trace(t, att, a))
    monkeypatch.setattr(perfetto, "CHUNK", 3000)
    assert b"".join(perfetto.enriched_trace(t, att, a)) == whole


# Kernel events as other producers may write them: the splice's layouts and the odd ones.
LAYOUTS = [
    (b'{"ph":"X","args":{"a":1}}', True),  # args last, compact
    (b'{\n  "ph": "X", "dur": 1.50,\n  "args": {"a": [1, {"b": "},"}]}\n  }', True),  # Kineto
    (b'{"ph":"X","args":{}}', True),
    (b'{"ph":"X","args": {  } }', True),
    (b'{"ph":"X","x":{"args":{"a":1}},"args":{"a":1}}', True),
    (b'{"ph":"X","dur":2e0}', True),  # no args: created
    (b'{"ph":"X","x\\"args":{"a":1}}', True),  # a key ending in `"args`, no args
    (b'{"args":{"a":1},"ph":"X"}', False),  # args not last
    (b'{"args":{"a":1},"x":{"args":{"a":1}}}', False),  # the last member holds an args alike
    (b'{"ph":"X","args":null}', False),
    (b'{"ph":"X","args":"text"}', False),  # not an object: left alone
    (b'{"ph":"X","args":{"roofline":1,"a":2}}', False),  # enriched before: replaced
    (b'{"ph":"X","\\u0061rgs":{"a":1}}', False),
    (b'{"ph":"X","args":{"a":1}' + b" " * (perfetto.MAX_WS + 5) + b"}", False),
]


def _reference(raw: bytes, extra: dict) -> object:
    """What an event with args.roofline `extra` reads as (a non-object args: unchanged)."""
    event = json.loads(raw)
    if event.get("args") is None:
        event["args"] = {"roofline": extra}
    elif isinstance(event["args"], dict):
        event["args"]["roofline"] = extra
    return event


def test_splice_layouts(monkeypatch):
    """Each layout reads back as args.roofline added to the event; those the splice takes keep
    their bytes around the inserted text, the rest (only those) are decoded and re-encoded.
    Events without a kernel row are untouched. The args text is KernelArgs' encoding."""
    n = len(LAYOUTS)
    rows = pd.DataFrame({
        "operator": ["q_proj", 'a "quoted", name'] * (n // 2), "layer": pd.array(
            [None, *range(1, n)], dtype="Int64"), "step": pd.array([0] * n, dtype="Int64"),
        "phase": ["decode"] * n, "evidence": ["shape"] * n, "instance": range(n),
        "op_id": pd.array([None, *range(1, n)], dtype="Int64"), "shape": ["[1,2]"] * n,
        "flops": [1.5e12, float("nan"), *range(2, n)], "bytes": [0.1] * n,
        "intensity": [1 / 3] * n, "pct_of_roof": [50.0] * n, "bound": ["memory", None] * (n // 2),
    })
    encoded = [msgspec.json.encode(perfetto.KernelArgs(
        **{f: None if pd.isna(v) else v for f, v in r.items()}))
        for r in rows.astype(object).to_dict("records")]
    assert perfetto._rows_json(perfetto.KernelArgs, rows).to_pylist() == encoded
    decoded: list[bytes] = []
    real = perfetto._with_args
    monkeypatch.setattr(perfetto, "_with_args",
                        lambda raw, extra: (decoded.append(bytes(raw)), real(raw, extra))[1])
    plain = b'{"ph":"i","args":{"a":1}}'
    batch = [msgspec.Raw(x) for raw, _ in LAYOUTS for x in (plain, raw)]
    out = msgspec.json.decode(b"[" + perfetto._enriched(batch, np.arange(1, 2 * n, 2), rows)
                              + b"]", type=list[msgspec.Raw])
    assert len(out) == 2 * n and all(bytes(out[i]) == plain for i in range(0, 2 * n, 2))
    assert decoded == [raw for raw, spliced in LAYOUTS if not spliced]
    for (raw, spliced), got, extra in zip(LAYOUTS, out[1::2], encoded, strict=True):
        assert json.loads(bytes(got)) == _reference(raw, json.loads(extra)), raw
        if spliced:  # raw with one piece of text inserted, the rest byte for byte
            head = next(i for i, (x, y) in enumerate(zip(raw, bytes(got), strict=False)) if x != y)
            assert bytes(got).startswith(raw[:head]) and bytes(got).endswith(raw[head:])
            assert extra in bytes(got)


def test_added_events_are_msgspecs_encoding():
    """The slices and counters, written column by column, are byte for byte what msgspec
    writes for each event's struct (a float written as an int, a missing quote: not so)."""
    a, kept = analyze_trace_kernels(TP, tr.get_model("qwen2.5-7b"))
    b = perfetto.bands(perfetto.kernel_figures(kept.trace, kept.kernels, a), a)
    assert b["intensity"].isna().any()  # (all_reduce: null among the values)
    text = b",".join(perfetto._added_events(b, 99))
    events = msgspec.json.decode(b"[" + text + b"]", type=list[msgspec.Raw])
    kinds = {"M": perfetto._Meta, "X": perfetto._Slice, "C": perfetto._Counter}
    count = dict.fromkeys(kinds, 0)
    for raw in events:
        ph = msgspec.json.decode(raw, type=dict)["ph"]
        count[ph] += 1
        assert msgspec.json.encode(msgspec.json.decode(raw, type=kinds[ph])) == bytes(raw)
    assert count["X"] == len(b) and count["C"] >= 2 * len(b) and count["M"] == 2 + b["lane"].nunique()
