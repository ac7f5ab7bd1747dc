"""Every name carries its evidence, fallbacks are counted as fallbacks, and
what the analyzer cannot explain is said before the table: shapes contradicting --model (an
error unless --force; TP shards accepted), the model the shapes show, no decoder layer, uncosted
time and a withheld whole model, an irregular operator order."""

from __future__ import annotations

import dataclasses
import json
import random

import pandas as pd
import pytest

import trace_roofline as tr
from tests.builders import SAMPLES, Kineto, attributed, qwen_layer, read, run_cli
from trace_roofline import pipeline, roofline
from trace_roofline.costs import crosscheck
from trace_roofline.errors import InputError
from trace_roofline.model import models
from trace_roofline.model.hardware import get_hardware
from trace_roofline.model.operators import EVIDENCE
from trace_roofline.options import AnalysisOptions
from trace_roofline.outputs.report import report_dict, terminal_table
from trace_roofline.roofline import caveats

CNN = SAMPLES / "cnn_b8_cpu.json.gz"  # real: workloads/non_llm.py on this machine's CPU
MATMUL = SAMPLES / "matmul_loop_cpu.json.gz"
HF = SAMPLES / "hf-qwen2-qwen2.5-7b-2l_decode_b1_s512_h200.json.gz"  # unannotated HF generate
QWEN = tr.get_model("qwen2.5-7b")
H200 = get_hardware("h200-sxm")


# ------------------------------------------------------------------------------ evidence
def test_every_kernel_and_operator_row_carries_evidence():
    """HF's unannotated trace: GEMMs by shape, attention/embedding by op name, the rest by
    position, and the unexplained `other` a fallback; coverage splits them, exactly."""
    a = tr.analyze_trace(HF)
    att = tr.attribute(tr.load_trace(HF))
    assert set(att["evidence"]) <= set(EVIDENCE) and att["evidence"].notna().all()
    by_op = att.groupby("operator")["evidence"].agg(set)
    assert by_op["q_proj"] == {"shape"} and by_op["lm_head"] == {"shape"}
    assert by_op["attention"] == {"kernel_name"} and by_op["embedding"] == {"kernel_name"}
    assert by_op["rope"] == {"position"} and by_op["other"] == {"fallback"}
    ops = a.operators[a.operators["layer"].isna()].set_index("operator")
    assert ops.loc["down_proj", "evidence"] == "shape"
    assert ops.loc["down_proj", "evidence_mix"] == "shape 1"
    assert ops.loc["other", "evidence"] == "fallback"
    c = a.coverage
    other = float(att.loc[att["operator"] == "other", "dur_us"].sum())
    assert c["fallback_time_us"] == pytest.approx(other) and other > 0
    assert c["fallback_by_operator"] == {"other": pytest.approx(other)}
    assert sum(c["by_evidence"].values()) == pytest.approx(c["kernel_time_us"])
    assert c["evidence_time_us"] + c["fallback_time_us"] == pytest.approx(c["kernel_time_us"])
    assert c["fallback_fraction"] == pytest.approx(0.0164, abs=1e-4)
    footer = terminal_table([a]).splitlines()[-1]
    assert footer.startswith("coverage of 2.082 ms device time: 98.4% named with evidence "
                             "(shape 77.6%, position 18.4%, kernel_name 2.4%), 1.6% fallback "
                             "(other 1.6%); 100.0% costed")


def test_mixed_evidence_is_the_dominant_one_with_the_mix():
    """An operator named partly by a range and partly by position: the evidence naming most
    of its time, and every evidence's fraction of it (time conserved per row)."""
    ops = qwen_layer(QWEN, 1, 64, durs={"q_proj": (3.0,), "k_proj": (1.0,)})
    df = attributed(ops)
    df.loc[df["operator"] == "k_proj", "operator"] = "q_proj"  # 3 µs annotated + 1 µs by position
    df.loc[df["op_name"].eq("aten::addmm") & (df["dur_us"] == 1.0) & (df["operator"] == "q_proj"),
           "evidence"] = "position"
    placed = roofline.place(tr.attach_costs(df, None), H200)
    q = placed[placed["layer"].isna()].set_index("operator").loc["q_proj"]
    assert q["evidence"] == "annotation" and q["evidence_mix"] == "annotation 0.75, position 0.25"


def test_generic_gemm_names_are_fallbacks():
    """A plain matmul loop (real CPU trace): its GEMMs match no decoder, so `linear[512×512]`
    is a fallback; the trace says it has no decoder layer, and the whole model stands (costed)."""
    a = tr.analyze_trace(MATMUL)
    assert a.operators["operator"].unique().tolist() == ["linear[512×512]"]
    assert set(a.operators["evidence"]) == {"fallback"}
    assert a.coverage["fallback_fraction"] == 1.0 and a.coverage["evidence_fraction"] == 0.0
    assert a.warnings == (caveats.NO_DECODER,)
    # fp32 [256, 512] x [512, 512]: 2·256·512² FLOPs / 4·(2·256·512 + 512²) bytes = 64
    assert not a.whole["withheld"] and a.whole["intensity"] == pytest.approx(64.0)


# ------------------------------------------------------------------------- no decoder
def test_cnn_says_no_decoder_names_uncosted_convolutions_and_withholds_the_whole_model(tmp_path):
    """A real CPU trace of Conv2d → ReLU → MaxPool2d ×2 → Linear: rows are the aten ops (fallback),
    conv2d and max_pool2d have no cost rule, and 6.9% costed is no whole model."""
    r = run_cli("analyze", str(CNN), "--out", str(tmp_path / "r"))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("operator "))
    warned = [i for i, line in enumerate(lines) if line.startswith("! WARNING: ")]
    assert len(warned) == 3 and max(warned) < header  # before the table
    assert lines[warned[0]].startswith("! WARNING: no decoder layer found")
    assert "no cost rule for aten::max_pool2d" in lines[warned[1]]
    assert "no cost rule for aten::conv2d" in lines[warned[1]]
    assert "whole model (unknown) withheld" in lines[warned[2]]
    assert any(line.startswith("whole model") and "withheld" in line for line in lines[header:])
    rows = {line.split()[0] for line in lines[header + 1:] if line.startswith("aten::")}
    # (an uncosted row's name carries the derivation mark ˀ: unknown)
    assert rows == {"aten::conv2dˀ", "aten::relu", "aten::max_pool2dˀ", "aten::flatten",
                    "aten::linear"}
    entry = json.loads((tmp_path / "r" / "report.json").read_text())["traces"][0]
    assert entry["warnings"] == [w.removeprefix("! WARNING: ") for w in
                                 (lines[i] for i in warned)]
    assert entry["whole_model"]["withheld"] is True
    assert entry["model_inferred"] is None
    assert entry["coverage"]["fallback_fraction"] == 1.0
    assert {o["evidence"] for o in entry["operators"]} == {"fallback"}
    md = (tmp_path / "r" / "report.md").read_text()
    assert "### ⚠ Warnings" in md and md.index("Warnings") < md.index("### Operators")


def test_cnn_with_a_model_is_not_extrapolated():
    a = tr.analyze_trace(CNN, QWEN, options=tr.AnalysisOptions(layers=28))
    assert a.extrapolated is None and a.layers is None
    assert a.warnings[-1] == "not extrapolated to 28 layers: the trace has no decoder layer"


# -------------------------------------------------------------------- --model cross-check
def test_wrong_model_is_an_error_naming_the_operator_shape_and_the_fitting_preset(tmp_path):
    """`--model llama-3-8b --layers 32` on a Qwen trace: exit 2, one line, no output files."""
    r = run_cli("analyze", str(HF), "--model", "llama-3-8b", "--layers", "32", "--out",
             str(tmp_path / "r"))
    assert r.returncode == 2 and r.stdout == ""
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and str(HF) in err
    assert "contradict model llama-3-8b" in err
    assert "lm_head: K,N=3584,152064 but llama-3-8b has 4096,128256" in err  # most time
    assert "q_proj" in err and "they fit qwen2.5-7b" in err and "pass --force" in err
    assert not (tmp_path / "r").exists()


def test_force_warns_and_never_extrapolates(tmp_path):
    r = run_cli("analyze", str(HF), "--model", "llama-3-8b", "--layers", "32", "--force",
             "--json", str(tmp_path / "r.json"))
    assert r.returncode == 0, r.stderr
    assert "extrapolated to 32 layers + embedding" not in r.stdout
    lines = r.stdout.splitlines()
    assert lines[3].startswith("! WARNING: the trace's shapes contradict model llama-3-8b")
    assert lines[4] == "! WARNING: not extrapolated to 32 layers: the shapes contradict the model"
    entry = json.loads((tmp_path / "r.json").read_text())["traces"][0]
    # (besides the figures' cross-checks against the forced model's layout)
    own = [w for w in entry["warnings"] if not w.startswith("cross-check")]
    assert "extrapolated" not in entry and len(own) == 2, own
    assert entry["model_inferred"]["match"] == "qwen2.5-7b"


def _sharded(t: int, spec=QWEN):
    """One rank's layer under TP=t: heads and intermediate divided by t."""
    return dataclasses.replace(spec, num_heads=spec.num_heads // t,
                               num_kv_heads=max(spec.num_kv_heads // t, 1),
                               intermediate_size=spec.intermediate_size // t)


@pytest.mark.parametrize("t", [2, 4])
def test_tp_shards_are_not_contradictions(t):
    """q/k/v/gate/up N/t (column-parallel), o/down K/t (row-parallel), heads/t: consistent
    with the preset at TP=t, said before the table; extrapolation still allowed."""
    df = attributed(qwen_layer(_sharded(t), 1, 512))
    a = pipeline.analyze(df, QWEN, H200, AnalysisOptions(layers=28))
    assert a.costed["check"].isna().all() and a.extrapolated is not None
    assert a.model_inferred["model_tp"] == t
    assert a.model_inferred["presets"] == [f"qwen2.5-7b (TP={t})"]
    assert f"shapes: consistent with qwen2.5-7b at TP={t}" in terminal_table([a])


def test_a_shard_no_tp_degree_explains_is_a_contradiction():
    spec = dataclasses.replace(QWEN, intermediate_size=QWEN.intermediate_size // 3)
    with pytest.raises(InputError, match=r"down_proj: K,N=6314,3584 but qwen2\.5-7b has "
                                         r"18944,3584 \(3 operators disagree: gate_proj, up_proj, "
                                         r"down_proj\); they fit no preset \(custom: hidden 3584"):
        pipeline.analyze(attributed(qwen_layer(spec, 1, 512)), QWEN, H200)


def test_without_a_model_the_shapes_name_their_preset_or_custom():
    a = tr.analyze_trace(HF)
    d = a.model_inferred
    assert (d["hidden_size"], d["q_size"], d["kv_size"], d["intermediate_size"],
            d["vocab_size"]) == (3584, 3584, 512, 18944, 152064)
    assert (d["num_heads"], d["num_kv_heads"], d["head_dim"]) == (28, 4, 128)
    assert d["presets"] == ["qwen2.5-7b"] and d["match"] == "qwen2.5-7b"
    text = terminal_table([a])
    assert ("shapes (no --model): hidden 3584, q 3584 (28 heads x 128), kv 512 (4 heads), "
            "intermediate 18944, vocab 152064: qwen2.5-7b") in text
    assert report_dict([a])["traces"][0]["model_inferred"] == d
    custom = dataclasses.replace(QWEN, hidden_size=1024, intermediate_size=4096)
    c = pipeline.analyze(attributed(qwen_layer(custom, 1, 64)), None, H200).model_inferred
    assert c["match"] == "custom" and c["presets"] == [] and c["hidden_size"] == 1024
    tiny = tr.analyze_trace(SAMPLES / "qwen-tiny_decode_b2_s64_l2_noannot_cpu.json.gz")
    assert tiny.model_inferred["match"] == "qwen-tiny"


def test_expected_linears_and_degrees():
    assert models.expected_linears(QWEN)["down_proj"] == (18944, 3584)
    costed = pd.DataFrame({"operator": ["q_proj", "o_proj", "o_proj"], "cost_kind": "gemm",
                           "K": pd.array([3584, 896, 3584], dtype="Int64"),
                           "N": pd.array([896, 3584, 896], dtype="Int64"),
                           "n_q": pd.array([None] * 3, dtype="Int64"),
                           "n_kv": pd.array([None] * 3, dtype="Int64"),
                           "head_dim": pd.array([None] * 3, dtype="Int64")})
    checks = crosscheck.instance_checks(costed, QWEN)
    # q_proj column-parallel N/4, o_proj row-parallel K/4; an o_proj sharded along N is not
    assert checks.isna().tolist() == [True, True, False]
    assert checks.iloc[2] == "o_proj: K,N=3584,896 but qwen2.5-7b has 3584,3584"
    assert crosscheck.tp_degrees(costed.iloc[:2], QWEN) == {4}


# ----------------------------------------------------------------------- misleading traces
def test_shuffled_event_order_in_the_file_changes_nothing(tmp_path):
    """Kineto writes events in no guaranteed order: permuting them gives the same names,
    evidence, layers and analysis."""
    doc = read(HF)
    random.Random(7).shuffle(doc["traceEvents"])
    shuffled = tmp_path / "shuffled.json"
    shuffled.write_text(json.dumps(doc))
    cols = ["ts_us", "name", "operator", "evidence", "layer", "step"]

    def table(path):
        att = tr.attribute(tr.load_trace(path))
        return att[cols].sort_values(["ts_us", "name"], kind="stable").reset_index(drop=True)

    pd.testing.assert_frame_equal(table(HF), table(shuffled))
    assert tr.analyze_trace(shuffled).coverage == tr.analyze_trace(HF).coverage


def test_shuffled_operator_order_is_warned_not_trusted(tmp_path):
    """Each layer's ops launched in a random order (unannotated): the stage order counts far
    more layers than attention runs, and the analyzer says so before the table."""
    rng = random.Random(1)
    k = Kineto()
    for step in (1, 2):
        with k.ann(f"ProfilerStep#{step}"):
            for _ in range(2):
                ops = qwen_layer(QWEN, 1, 512)
                rng.shuffle(ops)
                k.emit(ops, annotate=False)
    a = tr.analyze_trace(k.write(tmp_path / "shuffled.json"), QWEN)
    irregular = [w for w in a.warnings if w.startswith("the operator order is irregular")]
    assert len(irregular) == 1 and "runs attention 2 time(s)" in irregular[0]
    ordered = Kineto()
    for step in (1, 2):
        with ordered.ann(f"ProfilerStep#{step}"):
            for _ in range(2):
                ordered.emit(qwen_layer(QWEN, 1, 512), annotate=False)
    # (the builder's 1-µs kernels put rows above their roof: the only other warning)
    said = tr.analyze_trace(ordered.write(tmp_path / "ordered.json"), QWEN).warnings
    assert [w for w in said if "above their roof" not in w] == []


def test_readme_documents_every_evidence_value_and_the_warnings():
    section = (SAMPLES.parent / "docs" / "evidence.md").read_text()
    for value in EVIDENCE:
        assert f"| `{value}` |" in section
    for needle in ("--force", "TP=t", "model_inferred", "withheld", "no decoder layer",
                   "irregular operator order", "coverage of "):
        assert needle in section
