"""`trace-roofline analyze` end to end on committed H200 traces: outputs, ncu join, errors."""

import gzip
import json
import os
import shutil
from pathlib import Path

import pandas as pd
import pytest

from tests.builders import SAMPLES, attributed, qwen_layer, run_cli
from trace_roofline.cli import main
from trace_roofline.errors import InputError
from trace_roofline.files import write_files
from trace_roofline.model.hardware import get_hardware
from trace_roofline.model.models import get_model
from trace_roofline.outputs.report import report_dict
from trace_roofline.pipeline import TraceFacts, analyze

DECODE = SAMPLES / "qwen2.5-7b_decode_b1_s2048_h200.json.gz"
PREFILL = SAMPLES / "qwen2.5-7b_prefill_b1_t2048_h200.json.gz"
NCU = SAMPLES / "qwen2.5-7b_decode_b1_s2048_h200.ncu.csv"
OUTPUTS = {"operators.csv", "operators_by_layer.csv", "operators.parquet", "report.json",
           "report.md", "report.html", "roofline.png", "roofline.svg"}


def entry(path: Path) -> dict:
    """The one trace's entry of a report.json."""
    (only,) = json.loads(path.read_text())["traces"]
    return only


def test_decode_and_prefill_side_by_side(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["analyze", str(DECODE), str(PREFILL), "--model", "qwen2.5-7b",
                 "--layers", "28", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "whole model" in text
    assert "100.0% named with evidence (annotation 100.0%), 0.0% fallback;" in text
    assert {p.name for p in out.iterdir()} == OUTPUTS  # no temporary files left behind
    report = json.loads((out / "report.json").read_text())
    decode, prefill = report["traces"]
    # the committed calibration is the default for a trace from an H200
    assert decode["hardware"]["name"] == "h200-measured"
    assert decode["conventions"] == {"causal": "causal", "attention_bytes": "all"}
    for entry in (decode, prefill):
        cov = entry["coverage"]
        assert cov["attributed_time_us"] == pytest.approx(cov["kernel_time_us"], rel=0, abs=1e-9)
        for key in ("flops", "bytes", "intensity", "time_us", "achieved_flops_per_s"):
            assert key in entry["whole_model"]
    ops = {(o["phase"], o["operator"]): o for o in decode["operators"] + prefill["operators"]
           if o["layer"] is None}
    assert ops["decode", "down_proj"]["bound"] == "memory"
    assert ops["decode", "down_proj"]["intensity"] == pytest.approx(1.0, abs=0.01)
    assert ops["prefill", "down_proj"]["bound"] == "compute"
    # the lesson's point: decode attention near 7, the 28-layer model near 1
    assert ops["decode", "attention"]["intensity"] == pytest.approx(6.98, abs=0.01)
    assert decode["extrapolated"]["whole_model"]["decode"]["intensity"] == pytest.approx(1.05, abs=0.02)
    csv = pd.read_csv(out / "operators.csv")
    by_layer = pd.read_csv(out / "operators_by_layer.csv")
    parquet = pd.read_parquet(out / "operators.parquet")
    assert len(csv) + len(by_layer) == len(parquet)
    assert set(csv["trace"]) == {str(DECODE), str(PREFILL)}
    assert csv["time_us"].sum() == pytest.approx(parquet.loc[parquet["layer"].isna(), "time_us"].sum())
    # one scale for shares: fractions, named by unit; the layer reads back as an integer
    assert "pct_of_roof" not in csv.columns and "pct_of_roof" not in parquet.columns
    down = csv.set_index(["trace", "operator"]).loc[(str(DECODE), "down_proj")]
    assert down["roof_fraction"] == pytest.approx(ops["decode", "down_proj"]["roof_fraction"])
    assert 0.7 < down["roof_fraction"] < 0.9 and 0 < down["time_share"] < 1
    assert by_layer["layer"].dtype == "int64" and set(by_layer["layer"]) == {0}
    assert (out / "roofline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "report.md").read_text().startswith("# trace_roofline report")


def test_conventions_change_attention_only(tmp_path):
    def attention(*conv: str) -> dict:
        path = tmp_path / f"{'_'.join(conv) or 'default'}.json"
        assert main(["analyze", str(PREFILL), "--json", str(path), *conv]) == 0
        report = entry(path)
        assert report["conventions"]["causal"] in ("causal", "full")
        return {o["operator"]: o for o in report["operators"] if o["layer"] is None}

    causal, full = attention(), attention("--causal", "full", "--attention-bytes", "kv")
    # T = S = 2048: causal pairs 2048·2049/2 of 2048², K/V bytes only 1/8 of Q,K,V,O here
    assert causal["attention"]["flops"] / full["attention"]["flops"] == pytest.approx(2049 / 4096)
    assert full["attention"]["bytes"] < causal["attention"]["bytes"]
    assert causal["q_proj"]["flops"] == full["q_proj"]["flops"]


def test_ncu_measured_bytes(tmp_path, capsys):
    path = tmp_path / "report.json"
    assert main(["analyze", str(DECODE), "--ncu", str(NCU), "--json", str(path)]) == 0
    assert "138 of 138 trace kernels matched" in capsys.readouterr().out
    report = entry(path)
    assert report["ncu"]["trace_unmatched"] == 0
    down = next(o for o in report["operators"] if o["operator"] == "down_proj" and o["layer"] is None)
    # a decode GEMM reads its weights once: measured DRAM bytes within 2% of the analytical minimum
    assert down["measured_bytes"] / down["bytes"] == pytest.approx(1.0, abs=0.02)


@pytest.mark.parametrize("make,msg", [
    (lambda d: d / "missing.json.gz", "no such file"),
    (lambda d: (d / "t.json.gz").write_bytes(gzip.compress(b'{"traceEvents": [')) and d / "t.json.gz",
     "t.json.gz"),
    (lambda d: (d / "t.json").write_text('{"traceEvents": 5}') and d / "t.json", "t.json"),
])
def test_bad_trace_is_one_line_exit_2_no_outputs(tmp_path, make, msg):
    bad = make(tmp_path)
    out = tmp_path / "out"
    r = run_cli("analyze", str(DECODE), str(bad), "--out", str(out))
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and msg in r.stderr
    assert not out.exists()


def test_bad_arguments(tmp_path):
    for args in (["analyze", str(DECODE), "--ncu", str(NCU), "--ncu", str(NCU)],
                 ["analyze", str(DECODE), "--hardware", "tpu"],
                 ["analyze", str(DECODE), "--ncu", str(DECODE)],
                 ["analyze", str(DECODE), "--causal", "half"],
                 ["analyze"]):
        r = run_cli(*args)
        assert r.returncode == 2, args
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    (tmp_path / "keep.txt").write_text("user file")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.csv").mkdir()  # a directory where the second output should go
    with pytest.raises(InputError, match="is a directory"):
        write_files({tmp_path / "a.csv": b"1", tmp_path / "sub" / "b.csv": b"2"})
    with pytest.raises(InputError, match="keep.txt: exists and is not a directory"):
        write_files({tmp_path / "a.csv": b"1", tmp_path / "keep.txt" / "b.csv": b"2"})
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o500)  # staging the second file fails after the first was staged
    try:
        if not os.access(tmp_path / "ro", os.W_OK):  # root ignores permissions
            with pytest.raises(InputError, match="cannot write output"):
                write_files({tmp_path / "a.csv": b"1", tmp_path / "ro" / "b.csv": b"2"})
    finally:
        (tmp_path / "ro").chmod(0o700)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt", "ro", "sub"]
    assert write_files({tmp_path / "a.csv": b"1"}) == [tmp_path / "a.csv"]
    # created with the user's umask, not mkstemp's private 0600
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "a.csv").stat().st_mode & 0o777 == 0o666 & ~umask


def test_outputs_are_all_or_nothing(tmp_path):
    blocked = tmp_path / "r"
    blocked.mkdir()
    (blocked / "report.json").mkdir()  # one output path is taken by a directory
    r = run_cli("analyze", str(DECODE), "--out", str(blocked), "--json", str(tmp_path / "j.json"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["r", "report.json"]
    for args in (["--json", str(tmp_path)], ["--out", str(DECODE)]):
        r = run_cli("analyze", str(DECODE), *args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["r", "report.json"]


def test_by_shape_places_each_m_of_the_sweep(tmp_path):
    path = tmp_path / "sweep.json"
    sweep = SAMPLES / "qwen2.5-7b_msweep_q_proj_bf16_h200.json.gz"
    assert main(["analyze", str(sweep), "--by-shape", "--json", str(path)]) == 0
    ops = {o["operator"]: o for o in entry(path)["operators"] if o["layer"] is None}
    # q_proj at M: I = 2·M·K·N / ((M·K + K·N + M·N)·2) = M·3584 / (2·M + 3584) with K = N = 3584
    for m in (1, 16, 64, 256, 1024):
        op = ops[f"q_proj [{m},3584]x[3584,3584]"]
        assert op["intensity"] == pytest.approx(m * 3584 / (2 * m + 3584))
        assert op["bound"] == ("memory" if m <= 64 else "compute")


@pytest.mark.parametrize("variant", ["compiled", "static", "static_compiled"])
def test_hf_compile_and_static_cache_placements(tmp_path, variant):
    path = tmp_path / "r.json"
    trace = SAMPLES / f"hf-qwen2-qwen2.5-7b-2l_decode_b1_s2048_{variant}_h200.json.gz"
    assert main(["analyze", str(trace), "--model", "qwen2.5-7b", "--attention-bytes", "kv",
                 "--json", str(path)]) == 0
    ops = {o["operator"]: o for o in entry(path)["operators"] if o["layer"] is None}
    for name in ("q_proj", "down_proj"):  # decode GEMMs read their weights once: I ≈ 1
        assert ops[name]["bound"] == "memory"
        assert ops[name]["intensity"] == pytest.approx(1.0, abs=0.01)
    if "compiled" in variant:
        # HF repeats K/V to all 28 heads when it passes SDPA a mask (StaticCache, compiled
        # graphs); the attention reads K and V of its 4 KV heads once, whichever way its shapes
        # came: I = 4·n_q·S·d FLOPs / (2·n_kv·S·d·2 B) = n_q/n_kv = 7 under kv bytes. The two
        # Triton kernels expanding K and V are a `repeat_kv` row of their own (copies: they read
        # n_kv heads and write n_q, well under 1 FLOP/B).
        assert ops["attention"]["intensity"] == pytest.approx(28 / 4, abs=0.01)
        assert ops["repeat_kv"]["intensity"] < 1


def test_directory_of_traces(tmp_path, capsys):
    d = tmp_path / "tb"
    d.mkdir()
    for src in (DECODE, PREFILL):  # the tensorboard_trace_handler layout
        (d / src.name.replace(".json.gz", ".pt.trace.json.gz")).write_bytes(src.read_bytes())
    path = tmp_path / "r.json"
    assert main(["analyze", str(d), "--json", str(path)]) == 0
    assert len(json.loads(path.read_text())["traces"]) == 2
    r = run_cli("analyze", str(DECODE), "--ncu", str(tmp_path))
    assert r.returncode == 2 and "is a directory" in r.stderr


def test_directory_skips_files_that_are_not_traces(tmp_path, capsys):
    """sample_traces/ holds a sweep's .results.json, a bandwidth JSON, an ncu CSV, a PNG and a
    README beside its traces (sub-folders are not descended into): its files that are not
    traces, and two of its traces, copied into a folder of their own."""
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    others = [p for p in SAMPLES.iterdir() if p.is_file() and not p.name.endswith(".json.gz")]
    for f in [*others, DECODE, PREFILL]:
        shutil.copy(f, d / f.name)
    shutil.copy(DECODE, d / "sub" / "not_descended.json.gz")
    path = tmp_path / "r.json"
    assert main(["analyze", str(d), "--json", str(path)]) == 0
    traces = json.loads(path.read_text())["traces"]
    assert sorted(Path(t["trace"]).name for t in traces) == sorted([DECODE.name, PREFILL.name])
    note = capsys.readouterr().err
    assert f"skipped {len(others)} file(s) that are not traces" in note
    for name in ("qwen2.5-7b_msweep_q_proj_bf16_h200.results.json", "README.md",
                 "h200x2_allreduce_busbw.json",
                 "qwen2.5-7b_decode_b1_s2048_h200.ncu.csv"):
        assert name in note


def test_tensorboard_plugin_layout(tmp_path, capsys):
    """tensorboard_trace_handler(logdir): logdir/plugins/profile/<run>/<host>.pt.trace.json.gz."""
    for i, src in enumerate((DECODE, PREFILL)):
        run = tmp_path / "logs" / "plugins" / "profile" / f"run{i}"
        run.mkdir(parents=True)
        (run / f"host_{i}.123.pt.trace.json.gz").write_bytes(src.read_bytes())
        (run / f"host_{i}.results.json").write_text('{"kind": "m_sweep"}')
    path = tmp_path / "r.json"
    assert main(["analyze", str(tmp_path / "logs"), "--json", str(path)]) == 0
    assert [Path(t["trace"]).name for t in json.loads(path.read_text())["traces"]] == [
        "host_0.123.pt.trace.json.gz", "host_1.123.pt.trace.json.gz"]


def test_a_sweep_output_directory_analyses(tmp_path):
    """`sweep` writes <stem>.json.gz next to <stem>.results.json; `analyze DIR` takes it."""
    sweep = "qwen2.5-7b_msweep_q_proj_bf16_h200"
    for suffix in (".json.gz", ".results.json"):
        (tmp_path / f"{sweep}{suffix}").write_bytes((SAMPLES / f"{sweep}{suffix}").read_bytes())
    r = run_cli("analyze", str(tmp_path), "--by-shape")
    assert r.returncode == 0, r.stderr
    assert "q_proj [1024,3584]x[3584,3584]" in r.stdout and ".results.json" in r.stderr


def test_a_directory_without_traces_is_one_line(tmp_path):
    (tmp_path / "notes.json").write_text('{"a": 1}')
    r = run_cli("analyze", str(tmp_path))
    assert r.returncode == 2 and "directory holds no trace files" in r.stderr


def test_model_may_be_a_hugging_face_model_directory(tmp_path):
    """--model DIR reads DIR/config.json (Qwen2.5-7B-Instruct's, the fields that matter)."""
    model = tmp_path / "Qwen2.5-7B-Instruct"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
        "intermediate_size": 18944, "num_attention_heads": 28, "num_hidden_layers": 28,
        "num_key_value_heads": 4, "vocab_size": 152064, "torch_dtype": "bfloat16",
        "tie_word_embeddings": False, "rms_norm_eps": 1e-06}))
    got, want = tmp_path / "dir.json", tmp_path / "preset.json"
    assert main(["analyze", str(DECODE), "--model", str(model), "--layers", "28",
                 "--json", str(got)]) == 0
    assert main(["analyze", str(DECODE), "--model", "qwen2.5-7b", "--layers", "28",
                 "--json", str(want)]) == 0
    g, w = entry(got), entry(want)
    assert g["extrapolated"]["whole_model"] == w["extrapolated"]["whole_model"]
    assert g["operators"] == w["operators"]
    r = run_cli("analyze", str(DECODE), "--model", str(tmp_path))
    assert r.returncode == 2 and f"{tmp_path}: directory holds no config.json" in r.stderr


def test_a_builder_trace_analyses_like_its_op_table(tmp_path, kineto, trace_file):
    """tests/builders.py: the trace `Kineto.emit` writes for an op list and the attributed table
    of the same list give the same operators, kernels, FLOPs and bytes."""
    tiny = get_model("qwen-tiny")
    ops = qwen_layer(tiny, 1, 64)
    kineto.emit(ops)
    path = tmp_path / "r.json"
    assert main(["analyze", str(trace_file(kineto)), "--model", "qwen-tiny", "--json",
                 str(path)]) == 0
    table = report_dict([analyze(attributed(ops), tiny, get_hardware("h200-measured"),
                                 facts=TraceFacts(trace="t"))])

    def rows(report: dict) -> dict:
        return {o["operator"]: (o["kernels"], o["flops"], o["bytes"])
                for o in report["traces"][0]["operators"] if o["layer"] is None}

    assert rows(json.loads(path.read_text())) == rows(table)
    assert len(rows(table)) == 14


def test_a_config_of_an_unlisted_family_is_read_and_its_assumptions_said(tmp_path, capsys):
    cfg = {"model_type": "foobar", "hidden_size": 3584, "num_attention_heads": 28,
           "num_key_value_heads": 4, "num_hidden_layers": 28, "vocab_size": 152064,
           "intermediate_size": 18944, "attention_bias": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "r"
    assert main(["analyze", str(DECODE), "--model", str(tmp_path / "config.json"), "--no-cache",
                 "--out", str(out)]) == 0
    header = capsys.readouterr().out.splitlines()[:5]
    said = [line for line in header if line.startswith("model foobar read with assumptions: ")]
    assert said and "'foobar' is not a known family" in said[0]
    assert any("foobar" in a for a in entry(out / "report.json")["model_assumed"])
