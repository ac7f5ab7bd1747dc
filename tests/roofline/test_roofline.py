"""roofline: placements, whole model, reconciliation, extrapolation, on synthetic layers."""

import json
import math

import numpy as np
import pandas as pd
import pytest

from tests.builders import BF, F32, SAMPLES, Op, attributed, concat, gpu_trace, qwen_layer, write
from trace_roofline import roofline
from trace_roofline.costs.attach import attach_costs
from trace_roofline.errors import InputError
from trace_roofline.model import formulas
from trace_roofline.model.hardware import Hardware, get_hardware
from trace_roofline.model.models import get_model
from trace_roofline.options import AnalysisOptions
from trace_roofline.pipeline import TraceFacts, analyze
from trace_roofline.roofline import extrapolate, place, placement, reconcile, whole_model

QWEN = get_model("qwen2.5-7b")
H200 = get_hardware("h200-sxm")  # 989.4 TFLOP/s bf16, 4.8 TB/s
H, I_FF = 3584, 18944
DECODE_US = {"q_proj": (8.0,), "k_proj": (2.5,), "v_proj": (2.5,), "o_proj": (8.0,),
             "gate_proj": (35.0,), "up_proj": (35.0,), "down_proj": (20.0, 15.0),
             "attention": (5.0,)}


def agg(ops: pd.DataFrame, operator: str, phase: str | None = None) -> pd.Series:
    rows = ops[(ops["operator"] == operator) & ops["layer"].isna()]
    if phase:
        rows = rows[rows["phase"] == phase]
    assert len(rows) == 1
    return rows.iloc[0]


@pytest.fixture(scope="module")
def decode():
    return analyze(attributed(qwen_layer(QWEN, 1, 2048, DECODE_US)), QWEN, H200,
                   AnalysisOptions(attention_bytes="kv", layers=28), facts=TraceFacts(trace="decode"))


def test_memory_bound_gemm_placement_by_hand(decode):
    g = agg(decode.operators, "gate_proj")
    flops, nbytes = 2 * H * I_FF, (H + H * I_FF + I_FF) * 2
    assert (g["flops"], g["bytes"], g["time_us"], g["kernels"]) == (flops, nbytes, 35.0, 1)
    assert g["intensity"] == flops / nbytes
    assert g["achieved_flops_per_s"] == pytest.approx(flops / 35e-6, rel=1e-12)
    assert g["achieved_bytes_per_s"] == pytest.approx(nbytes / 35e-6, rel=1e-12)
    assert g["attainable_flops_per_s"] == pytest.approx(flops / nbytes * 4.8e12, rel=1e-12)
    assert g["pct_of_roof"] == pytest.approx(100 * nbytes / 35e-6 / 4.8e12, rel=1e-12)
    assert (g["bound"], g["exceeds_roof"], g["dtype"]) == ("memory", False, "bf16")
    assert g["peak_flops_per_s"] == H200.peak("bf16")


def test_decode_gemms_near_one_attention_at_seven(decode):
    ops = decode.operators
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert agg(ops, name)["intensity"] == pytest.approx(1.0, abs=0.003)
        assert agg(ops, name)["bound"] == "memory"
    assert agg(ops, "attention")["intensity"] == 7.0
    assert agg(ops, "attention")["bound"] == "memory"


def test_compute_bound_and_above_roof():
    gemm = [Op("gate_proj", "aten::mm", [[2048, H], [H, I_FF]], [BF, BF], durs=(400.0,)),
            Op("up_proj", "aten::mm", [[1, H], [H, I_FF]], [BF, BF], durs=(10.0,))]
    ops = analyze(attributed(gemm), QWEN, H200).operators
    pre = agg(ops, "gate_proj")
    flops = 2 * 2048 * H * I_FF
    assert pre["bound"] == "compute" and pre["intensity"] > H200.ridge("bf16")
    assert pre["attainable_flops_per_s"] == H200.peak("bf16")
    assert pre["pct_of_roof"] == pytest.approx(100 * flops / 400e-6 / 989.4e12, rel=1e-12)
    fast = agg(ops, "up_proj")  # 135.8 MB in 10 µs = 13.6 TB/s > 4.8 TB/s: impossible from DRAM
    assert fast["pct_of_roof"] > 100 and fast["exceeds_roof"]


def test_reconciliation_sums_to_whole_model_intensity(decode):
    rec, whole = decode.reconciliation, decode.whole
    assert whole["intensity"] == whole["flops"] / whole["bytes"]
    assert math.fsum(rec["contribution"]) == pytest.approx(whole["intensity"], rel=1e-14)
    assert math.fsum(rec["byte_share"]) == pytest.approx(1.0, rel=1e-14)
    both = rec["byte_share"] * rec["intensity"]
    assert np.allclose(both[rec["bytes"] > 0], rec.loc[rec["bytes"] > 0, "contribution"],
                       rtol=1e-12)
    costed = decode.costed
    assert whole["flops"] == pytest.approx(costed["flops"].sum(), rel=1e-14)
    assert whole["bytes"] == pytest.approx(costed["bytes"].sum(), rel=1e-14)


def test_whole_model_time_weighted_rates(decode):
    w, ops = decode.whole, decode.operators
    rows = ops[ops["layer"].isna()]
    assert w["time_us"] == pytest.approx(decode.costed["time_us"].sum(), rel=1e-14)
    weighted = (rows["achieved_flops_per_s"] * rows["costed_time_us"]).sum()
    assert w["achieved_flops_per_s"] == pytest.approx(weighted / rows["costed_time_us"].sum(),
                                                      rel=1e-12)
    assert w["achieved_flops_per_s"] == pytest.approx(w["flops"] / (w["costed_time_us"] * 1e-6))
    assert 1.0 < w["intensity"] < 1.1 and w["bound"] == "memory"


def test_per_layer_rows_sum_to_the_aggregate():
    two = concat(attributed(qwen_layer(QWEN, 1, 2048, DECODE_US), layer=0),
                 attributed(qwen_layer(QWEN, 1, 2048, DECODE_US), layer=1, first_event=100,
                            first_op=5000, t0=500.0))
    ops = analyze(two, QWEN, H200).operators
    q = ops[ops["operator"] == "q_proj"]
    per_layer, total = q[q["layer"].notna()], q[q["layer"].isna()].iloc[0]
    assert sorted(per_layer["layer"].tolist()) == [0, 1]
    assert total["flops"] == per_layer["flops"].sum() and total["time_us"] == 16.0
    assert total["kernels"] == 2 and total["instances"] == 2
    assert list(ops.columns) == list(placement.OPERATOR_COLUMNS)


def test_conventions_change_only_attention():
    layer = attributed(qwen_layer(QWEN, 2048, 2048))
    base = analyze(layer, QWEN, H200).operators  # causal, all
    full = analyze(layer, QWEN, H200, AnalysisOptions(causal="full")).operators
    kv = analyze(layer, QWEN, H200, AnalysisOptions(attention_bytes="kv")).operators
    a, f, k = (agg(t, "attention") for t in (base, full, kv))
    assert a["flops"] / f["flops"] == pytest.approx(0.5, rel=1e-3)  # causal halves prefill
    assert k["bytes"] < a["bytes"] and k["flops"] == a["flops"]
    assert f["bytes"] == a["bytes"]
    for t in (full, kv):
        other = t[t["operator"] != "attention"].reset_index(drop=True)
        ref = base[base["operator"] != "attention"].reset_index(drop=True)
        pd.testing.assert_series_equal(other["flops"], ref["flops"])
        pd.testing.assert_series_equal(other["bytes"], ref["bytes"])


def test_extrapolated_decode_model_sits_near_one(decode):
    ext = decode.extrapolated.set_index("operator")
    q = agg(decode.operators, "q_proj")
    assert ext.loc["q_proj", "flops"] == 28 * q["flops"]
    assert ext.loc["q_proj", "source"] == "trace x28"
    assert ext.loc["attention", "intensity"] == 7.0
    assert ext.loc["lm_head", "source"] == "model"
    assert ext.loc["lm_head", "flops"] == 2 * H * 152064
    assert ext.loc["embedding", "flops"] == 0
    # final_norm: the traced input_norm of one layer
    assert ext.loc["final_norm", "bytes"] == agg(decode.operators, "input_norm")["bytes"]
    whole = decode.extrapolated_whole["decode"]
    assert 0.95 < whole["intensity"] < 1.1  # weights (~14 GB) swamp the KV reads
    assert math.fsum(ext["contribution"]) == pytest.approx(whole["intensity"], rel=1e-14)
    # the weights the model reads per decode step: 28 layers + lm_head + the embedding rows
    weights = 28 * sum(k * n + (n if b else 0) for k, n, b in QWEN.linears().values())
    assert whole["bytes"] > (weights + H * 152064) * 2


def test_extrapolation_divides_by_layers_and_steps_in_the_trace():
    parts = [attributed(qwen_layer(QWEN, 1, 2048, DECODE_US), layer=lay, step=st,
                        first_event=1000 * (2 * st + lay), first_op=100_000 * (2 * st + lay + 1))
             for st in (0, 1) for lay in (0, 1)]
    costed = attach_costs(concat(*parts), QWEN)
    ext = extrapolate(costed, QWEN, 28).set_index("operator")
    one = attach_costs(parts[0], QWEN)
    assert ext.loc["q_proj", "flops"] == 28 * one.loc[one["operator"] == "q_proj", "flops"].sum()
    assert ext.loc["q_proj", "source"] == "trace x14"
    with pytest.raises(InputError, match="layers"):
        extrapolate(costed, QWEN, 0)
    with pytest.raises(InputError, match="`layers` needs `model`"):
        analyze(parts[0], None, H200, AnalysisOptions(layers=28))


def test_no_hardware_gives_intensities_without_placements():
    a = analyze(attributed(qwen_layer(QWEN, 1, 2048, DECODE_US)), QWEN, None)
    q = agg(a.operators, "q_proj")
    assert q["intensity"] == pytest.approx(1.0, abs=0.003)
    assert pd.isna(q["attainable_flops_per_s"]) and pd.isna(q["bound"])
    assert pd.isna(q["exceeds_roof"]) and "bound" not in a.whole


def test_dtype_sets_the_peak():
    ops = [Op("q_proj", "aten::mm", [[4096, 4096], [4096, 4096]], ["float", "float"],
              durs=(5000.0,)),
           Op("sampling/other", "aten::add", [[1024], [1024], []], ["long int", "long int", "Scalar"])]
    t = analyze(attributed(ops), None, H200).operators
    fp32 = agg(t, "q_proj")
    assert fp32["peak_flops_per_s"] == H200.peak("fp32") and fp32["bound"] == "compute"
    # integers have no tensor peak: the trace's main dtype (fp32 here) stands in
    assert agg(t, "sampling/other")["peak_flops_per_s"] == H200.peak("fp32")


def test_unattributed_and_uncosted_time_is_kept_but_not_rated():
    ops = [*qwen_layer(QWEN, 1, 2048, DECODE_US), Op("unattributed", None, None, None,
                                                      durs=(3.0,))]
    a = analyze(attributed(ops), QWEN, H200)
    u = agg(a.operators, "unattributed")
    assert (u["time_us"], u["uncosted"], u["costed_time_us"]) == (3.0, 1, 0.0)
    assert pd.isna(u["flops"]) and pd.isna(u["achieved_flops_per_s"])
    assert a.whole["time_us"] == a.whole["costed_time_us"] + 3.0
    assert a.coverage["attributed_time_us"] == a.coverage["kernel_time_us"] - 3.0
    assert a.coverage["uncosted_instances"] == 1


def test_measured_bytes_join_per_layer_and_aggregate():
    att = concat(attributed(qwen_layer(QWEN, 1, 2048, DECODE_US), layer=0),
                 attributed(qwen_layer(QWEN, 1, 2048, DECODE_US), layer=1, first_event=100,
                            first_op=5000))
    costed = attach_costs(att, QWEN)
    measured = pd.DataFrame({"layer": [0, 1, 0], "operator": ["q_proj", "q_proj", "k_proj"],
                             "measured_bytes": [30e6, 32e6, np.nan]})
    ops = place(costed, H200, measured=measured)
    q = ops[ops["operator"] == "q_proj"].set_index("layer", drop=False)
    total = q[q["layer"].isna()].iloc[0]
    assert total["measured_bytes"] == 62e6
    assert total["measured_intensity"] == total["flops"] / 62e6
    assert q.loc[0, "measured_bytes"] == 30e6
    assert pd.isna(agg(ops, "k_proj")["measured_bytes"])  # a partial measurement is no sum


def test_reconcile_is_per_phase():
    pre = attributed(qwen_layer(QWEN, 64, 64), step=0)
    dec = attributed(qwen_layer(QWEN, 1, 64), step=1, first_event=500, first_op=5000, t0=900.0)
    ops = place(attach_costs(concat(pre, dec), QWEN), H200)
    rec = reconcile(ops)
    for phase, part in rec.groupby("phase"):
        rows = ops[(ops["phase"] == phase) & ops["layer"].isna()]
        assert math.fsum(part["contribution"]) == pytest.approx(
            whole_model(rows)["intensity"], rel=1e-14)


# ------------------------------------------------ end to end on the committed H200 traces
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def sample(name: str, hardware: Hardware | None = None, **kw):
    from trace_roofline.pipeline import analyze_trace

    path = SAMPLES / f"{name}.json.gz"
    if not path.exists():
        pytest.skip(f"{path.name} not committed")
    return analyze_trace(path, QWEN, hardware, AnalysisOptions(**kw))


@pytest.fixture(scope="module")
def h200_decode():
    return sample("qwen2.5-7b_decode_b1_s2048_h200", attention_bytes="kv", layers=28)


def test_h200_decode_gemms_at_one_attention_at_seven(h200_decode):
    a = h200_decode
    assert "h200" in a.hardware.name  # auto-detected from deviceProperties
    ops = a.operators
    for name in PROJ:
        row = agg(ops, name, "decode")
        k, n, bias = QWEN.linears()[name]
        assert row["intensity"] == pytest.approx(
            formulas.gemm_flops(1, k, n, bias) / formulas.gemm_bytes(1, k, n, 2, bias), rel=1e-12)
        assert row["intensity"] == pytest.approx(1.0, abs=0.003)
        assert row["bound"] == "memory"
    attn = agg(ops, "attention", "decode")
    assert attn["intensity"] == 7.0 and attn["bound"] == "memory"
    assert 1.0 < a.whole["intensity"] < 1.1
    assert 1.0 < a.extrapolated_whole["decode"]["intensity"] < 1.1
    assert a.costed["check"].isna().all()


def test_h200_decode_time_is_conserved_and_fully_costed(h200_decode):
    from trace_roofline.trace import load_trace

    a = h200_decode
    device = load_trace(SAMPLES / "qwen2.5-7b_decode_b1_s2048_h200.json.gz").device
    assert a.whole["time_us"] == pytest.approx(device["dur_us"].sum(), rel=1e-12)
    assert a.coverage["costed_fraction"] == pytest.approx(1.0)
    assert math.fsum(a.reconciliation["contribution"]) == pytest.approx(a.whole["intensity"],
                                                                        rel=1e-13)


def test_h200_prefill_gemms_and_attention_compute_bound():
    for hw in (None, get_hardware("h200-sxm")):  # measured calibration and the datasheet
        a = sample("qwen2.5-7b_prefill_b1_t2048_h200", hardware=hw)
        for name in (*PROJ, "attention"):
            row = agg(a.operators, name, "prefill")
            assert row["bound"] == "compute", (name, row["intensity"])
        q = agg(a.operators, "q_proj", "prefill")
        assert q["intensity"] == pytest.approx(
            formulas.gemm_intensity(2048, H, H, 2, bias=True), rel=1e-12)
    full = sample("qwen2.5-7b_prefill_b1_t2048_h200", causal="full")
    causal, full = agg(a.operators, "attention"), agg(full.operators, "attention")
    assert causal["flops"] / full["flops"] == pytest.approx(2049 / 4096, rel=1e-12)


def test_h200_fused_layout_and_hf_kv_cache_copies():
    fused = sample("qwen2.5-7b_decode_b32_s2048_fused_h200")
    qkv = agg(fused.operators, "qkv_proj", "decode")
    assert qkv["intensity"] == pytest.approx(formulas.gemm_intensity(32, H, 4608, 2, bias=True),
                                             rel=1e-12)
    assert fused.costed["check"].isna().all()
    hf = sample("hf-qwen2-qwen2.5-7b-2l_decode_b1_s512_h200")
    cache = hf.costed[hf.costed["operator"] == "kv_cache"]
    # HF's DynamicCache concatenates: each step reads and rewrites the whole K (or V) cache
    assert cache["bytes"].max() >= 2 * 511 * 4 * 128 * 2
    assert agg(hf.operators, "attention", "decode")["bound"] == "memory"


def test_extrapolation_keeps_work_outside_the_layers_unscaled():
    layer = attributed(qwen_layer(QWEN, 1, 2048, DECODE_US), layer=0)
    outside = attributed([Op("other", "aten::add", [[1, 512], [1, 512], []], [BF, BF, "Scalar"])],
                         layer=None, first_event=900, first_op=9000)
    ext = extrapolate(attach_costs(concat(layer, outside), QWEN), QWEN, 28).set_index("operator")
    assert ext.loc["other", "source"] == "trace" and ext.loc["other", "flops"] == 512
    assert ext.loc["q_proj", "source"] == "trace x28"


def test_an_empty_trace_is_one_clear_error():
    empty = attributed(qwen_layer(QWEN, 1, 64)).iloc[0:0]
    with pytest.raises(InputError, match="empty.json: no kernels or timed ops"):
        analyze(empty, QWEN, H200, facts=TraceFacts(trace="empty.json"))


# ------------------------------------------------ traces holding prefill and decode steps
def join(*frames: pd.DataFrame) -> pd.DataFrame:
    """Attributed tables of separate traces as one trace (an HF `generate` profile: a prefill
    step, then decode steps): later frames get fresh step numbers, ids and start times."""
    out, step, ids, t = [], 0, 0, 0.0
    for f in frames:
        f = f.assign(step=f["step"] - f["step"].min() + step, op_id=f["op_id"] + ids,
                     event_id=f["event_id"] + ids, ts_us=f["ts_us"] - f["ts_us"].min() + t)
        out.append(f)
        step = int(f["step"].max()) + 1
        ids = int(max(f["op_id"].max(), f["event_id"].max())) + 1
        t = float((f["ts_us"] + f["dur_us"]).max()) + 50.0
    return concat(*out)


def assert_whole_per_phase(mixed, singles: dict) -> None:
    """Each phase of `mixed` has the whole model of its own trace, reconciled within the phase."""
    assert list(mixed.whole_by_phase) == list(singles)
    for phase, single in singles.items():
        w, ref = mixed.whole_by_phase[phase], single.whole
        assert w["phases"] == [phase]
        for key in ("flops", "bytes", "intensity", "time_us", "kernels", "achieved_flops_per_s",
                    "pct_of_roof"):
            assert w[key] == pytest.approx(ref[key], rel=1e-12), (phase, key)
        assert w["bound"] == ref["bound"]
        rec = mixed.reconciliation[mixed.reconciliation["phase"] == phase]
        assert math.fsum(rec["byte_share"]) == pytest.approx(1.0, rel=1e-14)
        assert math.fsum(rec["contribution"]) == pytest.approx(w["intensity"], rel=1e-14)
    assert mixed.whole is max(mixed.whole_by_phase.values(), key=lambda w: w["time_us"])


def test_a_trace_with_both_phases_gets_a_whole_model_per_phase():
    pre = attributed(qwen_layer(QWEN, 64, 64), step=0)
    dec = attributed(qwen_layer(QWEN, 1, 64, DECODE_US), step=0)
    mixed = analyze(join(pre, dec), QWEN, H200)
    assert_whole_per_phase(mixed, {"prefill": analyze(pre, QWEN, H200),
                                   "decode": analyze(dec, QWEN, H200)})
    assert mixed.whole["phases"] == ["decode"]  # 127.5 µs of decode vs 32 µs of prefill


def test_h200_prefill_then_decode_in_one_trace():
    """The committed prefill T=512 and decode S=2048 traces joined: before, one blended line
    said 180.79 FLOP/B while the phases' contributions summed to 278.95 and 1.05."""
    from trace_roofline.attribution.attribute import attribute
    from trace_roofline.pipeline import trace_hardware
    from trace_roofline.trace import load_trace

    paths = [SAMPLES / f"qwen2.5-7b_{n}_h200.json.gz" for n in ("prefill_b1_t512", "decode_b1_s2048")]
    if not all(p.exists() for p in paths):
        pytest.skip("H200 sample traces not committed")
    traces = [load_trace(p) for p in paths]
    hw = trace_hardware(traces[0])
    pre, dec = (attribute(t, QWEN) for t in traces)
    mixed = analyze(join(pre, dec), QWEN, hw, facts=TraceFacts(trace="generate.json"))
    singles = {"prefill": analyze(pre, QWEN, hw), "decode": analyze(dec, QWEN, hw)}
    assert_whole_per_phase(mixed, singles)
    assert mixed.whole_by_phase["prefill"]["intensity"] == pytest.approx(278.95, abs=0.01)
    assert mixed.whole_by_phase["decode"]["intensity"] == pytest.approx(1.052, abs=0.001)
    assert mixed.whole["phases"] == ["prefill"]  # 1505 µs of prefill vs 613 µs of decode
    device = sum(t.device["dur_us"].sum() for t in traces)
    assert math.fsum(w["time_us"] for w in mixed.whole_by_phase.values()) == pytest.approx(
        device, rel=1e-12)


# ---------------------------------------------------------------- peaks per dtype
def hardware(peaks: dict[str, float]) -> Hardware:
    return Hardware("lab-gpu", {k: v * 1e12 for k, v in peaks.items()}, 4.8e12, "test")


def test_a_float_dtype_the_hardware_lacks_is_an_input_error(tmp_path):
    path = tmp_path / "fp8_only.json"
    path.write_text(json.dumps({"name": "fp8-only", "peak_flops": {"fp8": 1978.9e12},
                                "mem_bandwidth": 4.8e12}))
    fp8_only = get_hardware(str(path))
    bf16 = attributed([Op("q_proj", "aten::mm", [[1, H], [H, H]], [BF, BF])])
    with pytest.raises(InputError, match=r"^decode.json: `hardware` 'fp8-only' has no bf16 peak "
                                         r"\(has: fp8\) .*add \"bf16\" to peak_flops"):
        analyze(bf16, QWEN, fp8_only, facts=TraceFacts(trace="decode.json"))
    # no fp32 -> tf32 alias: the trace says fp32, and fp32 is what torch runs by default
    fp32 = attributed([Op("q_proj", "aten::mm", [[64, H], [H, H]], [F32, F32])])
    with pytest.raises(InputError, match=r"no fp32 peak \(has: bf16, tf32\)"):
        analyze(fp32, QWEN, hardware({"bf16": 989.4, "tf32": 494.7}))
    # a bf16 layer's RMSNorm computes in fp32: its roof needs the fp32 peak too
    with pytest.raises(InputError, match="no fp32 peak"):
        analyze(attributed(qwen_layer(QWEN, 1, 64)), QWEN, hardware({"bf16": 989.4}))
    assert analyze(bf16, QWEN, hardware({"bf16": 989.4})).whole["bound"] == "memory"


def test_dtypes_without_a_listable_peak_borrow_the_main_dtypes():
    hw = hardware({"bf16": 989.4, "fp8": 1978.9})
    ops = [Op("q_proj", "aten::mm", [[1, H], [H, H]], [BF, BF]),
           Op("sampling/other", "aten::add", [[1024], [1024], []], ["long int", "long int", "Scalar"]),
           Op("other", "aten::mul", [[64], [64]], ["double", "double"])]
    t = analyze(attributed(ops), None, hw).operators
    assert agg(t, "sampling/other")["peak_flops_per_s"] == 989.4e12
    assert agg(t, "other")["peak_flops_per_s"] == 989.4e12  # fp64: no key a file can list
    assert roofline.peak_key(hw, "int64", "bf16") == "bf16"
    # no floating-point work at all: bf16's peak, else the highest listed
    assert roofline.peak_key(hw, "int64", None) == "bf16"
    assert roofline.peak_key(hardware({"fp16": 900.0, "fp8": 1800.0}), "int64", "int64") == "fp8"
    assert placement.peak_for(hw, "fp8") == 1978.9e12


def test_malformed_and_implausible_shapes_are_warnings_not_placements(tmp_path):
    """A trace whose Input Dims hold -4 (malformed: uncosted, counted, warned) and 10**15 rows
    (a q_proj GEMM of 2·10^15·3584² FLOPs in 3.5 µs, ~10^13x the H200's roof: warned, never
    placed); the attention op stays costed and placed."""
    from trace_roofline.pipeline import analyze_trace

    doc = gpu_trace(steps=1)
    bad = {"q_proj": [[10**15, 3584], [3584, 3584]], "k_proj": [[-4, 3584], [3584, 512]]}
    names = iter(["q_proj", "k_proj", "attention"])
    for ev in doc["traceEvents"]:
        if ev.get("cat") == "cpu_op":
            name = next(names)
            if name in bad:
                ev["args"]["Input Dims"] = bad[name]
    a = analyze_trace(write(doc, tmp_path / "bad.json"), hardware=get_hardware("h200-sxm"))
    c = a.costed.set_index("operator")
    assert c.loc["q_proj", "cost_kind"] == "implausible" and math.isnan(c.loc["q_proj", "flops"])
    assert c.loc["k_proj", "cost_kind"] == "malformed" and math.isnan(c.loc["k_proj", "flops"])
    assert c.loc["attention", "cost_kind"] == "attention"
    # said before anything else: most time uncosted, so no whole-model figure either
    uncosted, withheld, malformed, implausible = a.warnings
    assert uncosted.startswith("59.7% of device time is uncosted")
    assert "malformed shape data" in uncosted and "h200-sxm's roof" in uncosted
    assert withheld.startswith("whole model (decode) withheld: only 40.3%")
    assert a.whole["withheld"] and a.whole["costed_fraction"] == pytest.approx(0.403, abs=1e-3)
    assert malformed.startswith("1 op instance(s) left uncosted for malformed shape data")
    assert "aten::mm x1" in malformed
    assert implausible.startswith("aten::mm (q_proj): 1 instance(s) at up to ")
    assert "h200-sxm's roof" in implausible and "unplaced" in implausible
    ops = a.operators[a.operators["layer"].isna()].set_index("operator")
    assert ops.loc["q_proj", "uncosted"] == 1 and pd.isna(ops.loc["q_proj", "pct_of_roof"])
    assert ops.loc["k_proj", "uncosted"] == 1 and pd.isna(ops.loc["k_proj", "bound"])
    assert ops.loc["attention", "pct_of_roof"] > 0
    assert a.coverage["uncosted_instances"] == 3  # and the memset no op launched


def test_a_sample_trace_raises_no_warnings():
    from trace_roofline.pipeline import analyze_trace

    assert analyze_trace(SAMPLES / "qwen2.5-7b_decode_b1_s2048_h200.json.gz", QWEN).warnings == ()
