"""Outputs and figure honesty: each figure's derivation in every output, rows above
their roof explained and kept out of the whole model, attention's executed and useful pairs,
and one attention figure for a CUDA-graph decode whichever way its shapes came."""

from __future__ import annotations

import json
from functools import cache

import pytest

import trace_roofline as tr
from tests.builders import SAMPLES, Op, attributed
from trace_roofline.costs import attention
from trace_roofline.costs.attach import CostOptions, attach_costs
from trace_roofline.outputs import html_report, report

FLEX = SAMPLES / "training_h100" / "flex-attention-2l_prefill_b1_t512_h100.json.gz"
SGLANG = SAMPLES / "serving" / "sglang_qwen3-8b_decode_mi300x" / "sglang_Qwen3-8B_decode.json.gz"
QWEN3_8B = SAMPLES / "serving" / "configs" / "qwen3-8b" / "config.json"
GRAPHS = SAMPLES / "cuda_graphs" / "hf-qwen2-qwen2.5-7b-2l_decode_b1_s512_static1024"
DECODE = SAMPLES / "qwen2.5-7b_decode_b1_s2048_h200.json.gz"
BF = "c10::BFloat16"


@cache
def _flex() -> tr.Analysis:
    return tr.analyze_trace(FLEX)


@cache
def _sglang() -> tr.Analysis:
    return tr.analyze_trace(SGLANG, tr.get_model(str(QWEN3_8B)))


def _row(a: tr.Analysis, operator: str) -> dict:
    ops = a.operators[a.operators["layer"].isna()]
    return ops[ops["operator"].eq(operator)].iloc[0].to_dict()


# ------------------------------------------------------------------- derivation everywhere
def test_report_json_operator_records_carry_the_derivation():
    """Flex attention's template is costed from the layout; q_proj from its shapes."""
    doc = report.report_dict([_flex()])
    ops = {(o["operator"], o["layer"]): o for o in doc["traces"][0]["operators"]}
    assert ops[("attention", None)]["derivation"] == "layout"
    assert ops[("q_proj", None)]["derivation"] == "shape"
    assert all("derivation" in o for o in ops.values())


def test_terminal_and_markdown_mark_rows_not_derived_from_shapes():
    text = report.terminal_table([_flex()])
    lines = text.splitlines()
    assert any(line.startswith("attentionᴸ ") for line in lines)
    assert any(line.startswith("q_proj ") for line in lines)  # shape: no mark
    assert "derivation: ᴸ layout (unmarked: the op's recorded shapes)" in lines
    md = report.markdown([_flex()], chart=None)
    assert "| attentionᴸ | prefill |" in md
    assert "derivation: ᴸ layout (unmarked: the op's recorded shapes)" in md


def test_serving_step_rows_are_marked_step():
    """SGLang decode with the model's config: attention costed from the step annotation."""
    a = _sglang()
    assert _row(a, "attention")["derivation"] == "step"
    text = report.terminal_table([a])
    assert any(line.startswith("attentionˢ ") for line in text.splitlines())
    assert "ˢ step annotation" in text
    doc = report.report_dict([a])
    att = next(o for o in doc["traces"][0]["operators"]
               if o["operator"] == "attention" and o["layer"] is None)
    assert att["derivation"] == "step" and att["pairs_executed"] == att["pairs_useful"] > 0


def test_html_tooltip_and_table_name_the_derivation():
    rows = html_report.operator_rows([_flex()])
    att = rows[rows["operator"].eq("attention")].iloc[0]
    assert att["derivation"] == "layout"
    assert ("derivation", "@derivation") in html_report._HOVER
    page = html_report.report_html([_flex()])
    assert "<th" in page and ">derivation</th>" in page


# --------------------------------------------------------------------- attention pairs
def test_tiled_pairs_by_hand():
    """A causal flash kernel over T = S = 512 in 128-tiles: query tiles see 128, 256, 384, 512
    keys, 128·1280 = 163,840 pairs (useful: 512·513/2 = 131,328; all: 262,144); decode T = 1
    sees S; T = 200 (tiles of 128 and 72 rows) over S = 200: 128·128 + 72·200 = 30,784."""
    assert attention.tiled_pairs(512, 512) == 163_840
    assert attention.tiled_pairs(1, 1024) == 1024
    assert attention.tiled_pairs(200, 200) == 128 * 128 + 72 * 200


def test_flex_attention_pairs_executed_and_useful():
    """2 layers, B=1, n_q=28, T=S=512, causal (a decoder's layout): per layer useful
    28·131,328, executed 28·163,840; FLOPs count the useful (--causal causal)."""
    att = _flex().costed
    att = att[att["cost_kind"].eq("attention")]
    assert att["pairs_useful"].tolist() == [28 * 131_328] * 2
    assert att["pairs_executed"].tolist() == [28 * 163_840] * 2
    assert (att["flops"] == 2 * 256 * att["pairs_useful"]).all()
    row = _row(_flex(), "attention")
    assert row["pairs_useful"] == 2 * 28 * 131_328 and row["pairs_executed"] == 2 * 28 * 163_840


def _costed(ops: list[Op], causal: str = "causal", decoder: bool = True):
    return attach_costs(attributed(ops), tr.get_model("qwen2.5-7b"),
                        CostOptions(causal=causal, decoder=decoder))


def test_eager_and_math_attention_execute_every_pair():
    """Eager QKᵀ bmm [2·28, 8, 128] x [2·28, 128, 8] (B=2, 28 heads, T=S=8): 56·64 = 3,584 pairs
    executed; a decoder's useful 56·36 = 2,016 (8·9/2 per head), an encoder's all. SDPA's math
    backend, causal, B=1 n_q=2 T=S=4: executes 2·16 = 32, useful 2·10 = 20."""
    qk = Op("attention", "aten::bmm", [[56, 8, 128], [56, 128, 8]], [BF, BF])
    dec = _costed([qk]).iloc[0]
    assert (dec["pairs_executed"], dec["pairs_useful"]) == (3584, 2016)
    assert dec["flops"] == 2 * 128 * 2016  # --causal causal: the useful pairs
    full = _costed([qk], causal="full").iloc[0]
    assert (full["pairs_useful"], full["flops"]) == (2016, 2 * 128 * 3584)
    enc = _costed([qk], decoder=False).iloc[0]
    assert enc["pairs_executed"] == enc["pairs_useful"] == 3584
    math = Op("attention", "aten::_scaled_dot_product_attention_math",
              [[1, 2, 4, 4], [1, 2, 4, 4], [1, 2, 4, 4], [], [], []],
              [BF, BF, BF, "", "Scalar", "Scalar"], ["", "", "", "", "0.0", "True"])
    m = _costed([math]).iloc[0]
    assert (m["pairs_executed"], m["pairs_useful"]) == (32, 20)


# ------------------------------------------------- one figure for a CUDA-graph decode
def test_graph_map_and_user_shapes_give_one_attention_figure():
    """The B=1 static-cache decode replayed from a CUDA graph, named by its eager twin
    (--graph-map: HF's SDPA over repeat_kv-expanded K, V) or by --batch 1 --context 1024
    (SDPA over the n_kv heads): K, V of 4 heads read once, Q and O of 28, S = 1024, d = 128,
    bf16, 2 layers x 4 replays: 8·2·(4·1024·256 + 28·256) = 16,891,904 B (was 251.8 MB under
    --graph-map: the 7x expanded K, V and the copies that expand them)."""
    model = tr.get_model("qwen2.5-7b")
    replay = f"{GRAPHS}_graph_h200.json.gz"
    mapped = tr.analyze_trace(replay, model,
                              options=tr.AnalysisOptions(graph_map=tr.load_trace(f"{GRAPHS}_mapping_h200.json.gz")))
    given = tr.analyze_trace(replay, model,
                             options=tr.AnalysisOptions(decode_shapes=tr.DecodeShapes(batch=1, context=1024)))
    by_hand = 8 * 2 * (4 * 1024 * 256 + 28 * 256)
    assert _row(given, "attention")["bytes"] == by_hand
    assert _row(mapped, "attention")["bytes"] == pytest.approx(by_hand, rel=0.01)
    copies = _row(mapped, "repeat_kv")  # the expansion copies: rows of their own
    assert copies["bytes"] == 8 * 2 * (4 + 28) * 1024 * 128 * 2


# ------------------------------------------------------------- rows above their roof
def test_rows_above_the_roof_are_explained_and_left_out_of_the_whole_model():
    """The bundled H200 decode placed under the H100's datasheet roof (3.35 TB/s): the MLP
    GEMVs ran at 3.5-3.9 TB/s, above it by more than 5%: flagged, explained (their 136 MB
    per instance exceed the H100's 50 MB L2: an overcount of the minimum bytes or the wrong
    roof) and left out of ΣFLOPs/Σbytes with a warning naming them and their time."""
    a = tr.analyze_trace(DECODE, tr.get_model("qwen2.5-7b"), tr.get_hardware("h100-sxm"))
    ops = a.operators[a.operators["layer"].isna()]
    above = ops[ops["pct_of_roof"] > 105]
    names = set(above["operator"])
    assert {"gate_proj", "up_proj"} <= names
    assert above["exceeds_roof"].all()
    assert above["exceeds_why"].str.startswith("an overcount of its minimum bytes").all()
    assert "exceed h100-sxm's 50 MB L2" in above["exceeds_why"].iloc[0]
    w = a.whole
    kept = ops[~ops["operator"].isin(names)]
    assert w["flops"] == pytest.approx(kept["flops"].sum())
    assert w["bytes"] == pytest.approx(kept["bytes"].sum())
    assert w["time_us"] == pytest.approx(ops["time_us"].sum())  # every row's time
    assert set(w["excluded"]) == names
    warning = next(x for x in a.warnings if x.startswith("whole model (decode) leaves out"))
    share = 100 * above["time_us"].sum() / ops["time_us"].sum()
    assert f"{share:.1f}% of its device time" in warning
    assert all(n in warning for n in names)
    doc = report.report_dict([a])["traces"][0]
    gate = next(o for o in doc["operators"] if o["operator"] == "gate_proj" and o["layer"] is None)
    assert gate["exceeds_why"].startswith("an overcount")
    assert json.dumps(doc["whole_model"]["excluded"])
    # reconciliation sums to the whole model over the kept rows
    rec = a.reconciliation
    assert rec["contribution"].sum() == pytest.approx(w["intensity"])


def test_l2_reuse_near_roof_and_compute_rows_stay_in_the_whole_model():
    """Bytes per instance within the L2 read as reuse; a row at most 5% above its roof is the
    ceiling's own error (the gemma2 decode's lm_head at 100.4%); a compute-bound row's FLOPs or
    peak; without an L2 size, reuse or an overcount: all kept in the whole model. Only bytes
    per instance beyond the L2 are left out."""
    import pandas as pd

    from trace_roofline.roofline import placement

    hw = tr.get_hardware("h200-sxm")
    ops = pd.DataFrame({"exceeds_roof": pd.array([True, True, True, True, False], dtype="boolean"),
                        "pct_of_roof": [250.0, 101.0, 130.0, 300.0, 50.0],
                        "bytes": [8e6, 3e9, 1e9, 3e8, 1e6], "instances": [2, 1, 1, 2, 1],
                        "uncosted": [0, 0, 0, 0, 0],
                        "bound": ["memory", "memory", "compute", "memory", "memory"]})
    why = placement.above_roof_why(ops, hw)
    assert why[0] == "L2 reuse: 4 MB per instance fit in h200-sxm's 50 MB L2"
    assert why[1] == "within 5% of the roof: the ceiling is that much low"
    assert why[2].startswith("compute-bound")
    assert why[3].startswith("an overcount of its minimum bytes: 150 MB per instance exceed "
                             "h200-sxm's 50 MB L2")
    assert pd.isna(why[4])
    assert placement.above(ops.assign(exceeds_why=why)).tolist() == [False, False, False, True,
                                                                      False]
    unknown = placement.above_roof_why(ops, tr.get_hardware("rtx4090"))
    assert unknown[3] == "L2 reuse or an overcount: 150 MB per instance, rtx4090's L2 size unknown"


def test_a_committed_row_above_its_roof_by_l2_reuse_stays_in_the_whole_model():
    """Qwen1.5-MoE generate on an H200 (no --model): the decode's static-cache writes (kv_cache,
    12 instances, 202.1 MB) ran at 132% of the measured bandwidth roof: 16.84 MB per instance
    fit in the H200's 50 MB L2, so the minimum bytes did not all cross DRAM; the row is
    explained and kept in the whole model, no warning."""
    a = tr.analyze_trace(SAMPLES / "moe" /
                         "hf-moe-qwen1.5-moe-a2.7b-2l_generate_b1_t512_n4_groupedmm_h200.json.gz")
    row = _row(a, "kv_cache")
    assert row["phase"] == "decode" and row["exceeds_roof"] and row["pct_of_roof"] > 130
    assert row["bytes"] / row["instances"] == pytest.approx(16.84e6, rel=1e-3)
    assert row["exceeds_why"] == "L2 reuse: 16.84 MB per instance fit in h200-measured's 50 MB L2"
    assert a.whole_by_phase["decode"]["excluded"] == {}
    assert not any(w.startswith("whole model (decode) leaves out") for w in a.warnings)
