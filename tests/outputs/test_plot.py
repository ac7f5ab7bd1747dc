"""plot.roofline_figure: the artists the chart must have, and labels that do not overlap."""

import dataclasses
import io
import itertools

import numpy as np
import pandas as pd
import pytest
from matplotlib.text import Text

from tests.builders import attributed, concat, qwen_layer
from trace_roofline.model.hardware import get_hardware
from trace_roofline.model.models import get_model
from trace_roofline.options import AnalysisOptions
from trace_roofline.outputs.plot import roofline_figure
from trace_roofline.pipeline import TraceFacts, analyze
from trace_roofline.roofline import place

QWEN = get_model("qwen2.5-7b")
H200 = get_hardware("h200-sxm")
DEC = {"q_proj": (8.0,), "k_proj": (2.5,), "v_proj": (2.4,), "o_proj": (7.9,),
       "gate_proj": (35.0,), "up_proj": (34.0,), "down_proj": (20.0, 15.0), "attention": (5.0,),
       "rope": (1.8,), "input_norm": (1.6,), "post_attention_norm": (1.7,), "act": (2.5,),
       "residual": (1.9,), "kv_cache": (1.7,)}
PRE = {"q_proj": (70.0,), "k_proj": (16.0,), "v_proj": (15.0,), "o_proj": (71.0,),
       "gate_proj": (330.0,), "up_proj": (331.0,), "down_proj": (200.0, 150.0),
       "attention": (120.0,), "rope": (9.0,), "input_norm": (8.0,), "post_attention_norm": (8.5,),
       "act": (45.0,), "residual": (8.0,), "kv_cache": (3.0,)}


@pytest.fixture(scope="module")
def analyses():
    dec = analyze(attributed(qwen_layer(QWEN, 1, 2048, DEC)), QWEN, H200, AnalysisOptions(layers=28),
                  facts=TraceFacts(trace="decode"))
    pre = analyze(attributed(qwen_layer(QWEN, 2048, 2048, PRE)), QWEN, H200, AnalysisOptions(layers=28),
                  facts=TraceFacts(trace="prefill"))
    return [dec, pre]


@pytest.fixture(scope="module")
def fig(analyses):
    return roofline_figure(analyses)


def test_log_log_with_roof_and_ridge(fig):
    ax = fig.axes[0]
    assert (ax.get_xscale(), ax.get_yscale()) == ("log", "log")
    peak, bw = H200.peak("bf16"), H200.mem_bandwidth
    roof = ax.get_lines()[0]
    x, y = roof.get_xdata(), roof.get_ydata()
    assert np.allclose(y, np.minimum(peak, x * bw))
    assert x[1] == pytest.approx(peak / bw)
    ridge = ax.get_lines()[1]
    assert ridge.get_xdata()[0] == pytest.approx(peak / bw)
    texts = " ".join(t.get_text() for t in ax.texts)
    assert "ridge I* = 206" in texts and "989.4 TFLOP/s" in texts and "4.8 TB/s" in texts


def test_one_labelled_point_per_operator_and_whole_model(fig, analyses):
    ax = fig.axes[0]
    names = [t.get_text() for t in ax.texts]
    for a in analyses:
        ops = a.operators[a.operators["layer"].isna() & (a.operators["flops"] > 0)]
        for op in ops["operator"]:
            assert op in names
    assert names.count("whole model") == 2
    assert names.count("28 layers: I = 1.05") == 1
    n_points = sum(len(a.operators[a.operators["layer"].isna() & (a.operators["flops"] > 0)])
                   for a in analyses) + 2 + 2
    assert len(ax.collections) == n_points
    notes = " ".join(t.get_text() for t in fig.texts)
    assert "kv_cache (2 traces)" in notes and "--attention-bytes all" in notes


def test_decode_and_prefill_are_distinguished(fig):
    legend = fig.axes[0].get_legend()
    texts = [t.get_text() for t in legend.get_texts()]
    assert "decode (decode)" in texts and "prefill (prefill)" in texts
    handles = legend.legend_handles
    dec, pre = handles[texts.index("decode (decode)")], handles[texts.index("prefill (prefill)")]
    assert dec.get_marker() == "o" and pre.get_marker() == "s"
    assert dec.get_color() != pre.get_color()


def test_labels_do_not_overlap(fig):
    renderer = fig.canvas.get_renderer()
    fig.draw_without_rendering()
    ax = fig.axes[0]
    # The text itself (an Annotation's own extent would include its leader line).
    boxes = [(t.get_text(), Text.get_window_extent(t, renderer)) for t in ax.texts
             if not t.get_rotation()]
    for (a, ba), (b, bb) in itertools.combinations(boxes, 2):
        assert not ba.overlaps(bb), f"{a!r} overlaps {b!r}"
    frame = ax.get_window_extent(renderer)
    for name, box in boxes:
        assert frame.x0 - 1 <= box.x0 and box.x1 <= frame.x1 + 1, name


def test_measured_points_are_hollow_and_linked(analyses):
    a = analyses[0]
    measured = pd.DataFrame({"layer": [0, 0], "operator": ["q_proj", "attention"],
                             "measured_bytes": [40e6, 6e6]})
    ops = place(a.costed, H200, measured=measured)
    fig = roofline_figure([dataclasses.replace(a, operators=ops)])
    ax = fig.axes[0]
    hollow = [c for c in ax.collections if len(c.get_facecolor()) == 0
              or c.get_facecolor()[0][3] == 0]
    assert len(hollow) == 2 + 1 + 1  # two measured points, the extrapolated triangle, the star
    links = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
    assert len(links) == 2
    q = ops[(ops["operator"] == "q_proj") & ops["layer"].isna()].iloc[0]
    xs = {round(float(x), 6) for ln in links for x in ln.get_xdata()}
    assert round(q["flops"] / 40e6, 6) in xs


def test_renders_png(fig):
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    assert buf.getvalue()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_hardware_there_is_no_roof(analyses):
    bare = [dataclasses.replace(a, hardware=None) for a in analyses]
    ax = roofline_figure(bare).axes[0]
    assert ax.get_lines() == []
    assert "no device given" in ax.get_title()
    assert not any("roof" in t.get_text() for t in ax.get_legend().get_texts())


def test_one_whole_model_star_per_phase_of_a_mixed_trace(analyses):
    pre = attributed(qwen_layer(QWEN, 2048, 2048, PRE), step=0)
    dec = attributed(qwen_layer(QWEN, 1, 2048, DEC), step=1, first_event=1000, first_op=10_000,
                     t0=5000.0)
    mixed = analyze(concat(pre, dec), QWEN, H200, facts=TraceFacts(trace="generate"))
    fig = roofline_figure([mixed])
    ax = fig.axes[0]
    names = [t.get_text() for t in ax.texts]
    assert "whole model" not in names
    assert names.count("whole model (prefill)") == 1 and names.count("whole model (decode)") == 1
    legend = {t.get_text(): h for t, h in zip(ax.get_legend().get_texts(),
                                              ax.get_legend().legend_handles, strict=True)}
    assert legend["decode"].get_marker() == "o" and legend["prefill"].get_marker() == "s"
    stars = [c for c in ax.collections if c.get_sizes()[0] == 320]
    at = sorted(tuple(c.get_offsets()[0]) for c in stars)
    want = sorted((w["intensity"], w["achieved_flops_per_s"]) for w in mixed.whole_by_phase.values())
    assert np.allclose(at, want, rtol=1e-12)
    # each star sits on its own phase's single-trace whole model
    single = {a.trace: a.whole for a in analyses}
    assert mixed.whole_by_phase["decode"]["intensity"] == single["decode"]["intensity"]
    assert mixed.whole_by_phase["prefill"]["intensity"] == single["prefill"]["intensity"]


# ------------------------------------------------------------- one panel per hardware (item 4)
def test_each_trace_is_placed_under_its_own_hardware(analyses):
    dec, pre = analyses
    cpu = dataclasses.replace(dec, trace="cpu.json", hardware=None)
    rtx = dataclasses.replace(pre, trace="rtx.json", hardware=get_hardware("rtx4090"))
    fig = roofline_figure([dec, cpu, pre, rtx])
    titles = [ax.get_title() for ax in fig.axes]
    assert len(fig.axes) == 3  # h200 (decode and prefill), no device, rtx4090
    assert "2 trace(s) on h200-sxm" in titles[0] and "no device given" in titles[1]
    assert "1 trace(s) on rtx4090" in titles[2]
    h200, bare, rtx_ax = fig.axes
    assert bare.get_lines() == [] and not any("on h200" in t for t in titles[1:])
    legend = [t.get_text() for t in h200.get_legend().get_texts()]
    assert "cpu (decode)" not in legend and "cpu (decode)" in [
        t.get_text() for t in bare.get_legend().get_texts()]
    rtx_peak = get_hardware("rtx4090").peak("bf16")
    assert max(rtx_ax.get_lines()[0].get_ydata()) == pytest.approx(rtx_peak)


# ------------------------------------------------------------ multi-trace legibility (item 11)
def six(analyses) -> list:
    return [dataclasses.replace(analyses[i % 2], trace=f"t{i}.json.gz") for i in range(6)]


def test_traces_differ_in_colour_and_marker_and_the_legend_is_outside(analyses):
    fig = roofline_figure(six(analyses))
    (ax,) = fig.axes
    legend = ax.get_legend()
    handles = [h for h, t in zip(legend.legend_handles, legend.get_texts(), strict=True)
               if t.get_text().startswith("t")]
    assert len(handles) == 6
    assert len({h.get_color() for h in handles}) == 6
    assert len({h.get_marker() for h in handles}) == 6
    renderer = fig.canvas.get_renderer()
    assert legend.get_window_extent(renderer).x0 >= ax.get_window_extent(renderer).x1


def test_every_label_has_a_leader_line(fig):
    labels = [t for t in fig.axes[0].texts if hasattr(t, "arrow_patch") and t.get_color() != "k"
              and "roof" not in t.get_text() and "ridge" not in t.get_text()
              and "slope" not in t.get_text()]
    assert len(labels) > 20 and all(t.arrow_patch is not None for t in labels)


def test_the_whole_model_star_hides_no_point(fig):
    ax = fig.axes[0]
    stars = [c for c in ax.collections if c.get_sizes()[0] == 320]
    points = [c for c in ax.collections if c.get_sizes()[0] not in (320, 110)]
    assert len(stars) == 2 and points
    for star in stars:
        assert star.get_facecolor().size == 0 or star.get_facecolor()[0][3] == 0  # outline only
        assert star.get_zorder() < min(c.get_zorder() for c in points)


def test_more_than_six_traces_become_small_multiples(analyses):
    many = [dataclasses.replace(analyses[i % 2], trace=f"run{i}.json.gz") for i in range(8)]
    fig = roofline_figure(many)
    assert len(fig.axes) == 8
    for i, ax in enumerate(fig.axes):
        assert ax.get_title().startswith(f"run{i}\non h200-sxm")
        labels = [t.get_text() for t in ax.texts if hasattr(t, "arrow_patch")
                  and t.arrow_patch is not None]
        assert 1 <= len(labels) <= 4 + 2  # the largest operators, the star, the 28-layer mark
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    assert buf.getvalue()[:8] == b"\x89PNG\r\n\x1a\n"
