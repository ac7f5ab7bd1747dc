"""What a newcomer hits: the CLI without a command or without torch, diff's notes,
evidence as percentages, SI units everywhere, one roof per (hardware, dtype) in report.html,
the --ncu note, and the charts' legibility (slope label, small multiples, crowded panels, ranks,
the diff chart's colours)."""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from tests.builders import ROOT, SAMPLES, attributed, qwen_layer, run_cli, sweep_lines
from trace_roofline.costs.calculator import format_intensity, intensity_table, si
from trace_roofline.model.hardware import Hardware, get_hardware
from trace_roofline.model.models import get_model
from trace_roofline.outputs import diff as diffmod
from trace_roofline.outputs.report import evidence_text, markdown, terminal_table
from trace_roofline.pipeline import TraceFacts
from trace_roofline.roofline import place

try:  # the library's analyze of an attributed table (moving from roofline to pipeline)
    from trace_roofline.pipeline import analyze
except ImportError:
    from trace_roofline.roofline import analyze

QWEN = get_model("qwen2.5-7b")
H200 = get_hardware("h200-sxm")
CPU = Hardware("xeon-measured", {"bf16": 1.508e12, "fp16": 1.508e12, "fp32": 0.75e12}, 8.5e9,
               "a CPU hardware JSON")
DEC = {"q_proj": (8.0,), "k_proj": (2.5,), "v_proj": (2.4,), "o_proj": (7.9,),
       "gate_proj": (35.0,), "up_proj": (34.0,), "down_proj": (20.0, 15.0), "attention": (5.0,),
       "rope": (1.8,), "input_norm": (1.6,), "post_attention_norm": (1.7,), "act": (2.5,),
       "residual": (1.9,), "kv_cache": (1.7,)}


@pytest.fixture(scope="module")
def decode():
    return analyze(attributed(qwen_layer(QWEN, 1, 2048, DEC)), QWEN, H200,
                   facts=TraceFacts(trace="decode.json.gz"))


def fp16(table: pd.DataFrame) -> pd.DataFrame:
    return table.assign(input_types=table["input_types"].str.replace("c10::BFloat16", "c10::Half"))


@pytest.fixture(scope="module")
def decode_fp16():
    return analyze(fp16(attributed(qwen_layer(QWEN, 1, 2048, DEC))), QWEN, H200,
                   facts=TraceFacts(trace="decode_fp16.json.gz"))


# ------------------------------------------------------------------- the CLI's first contact
def test_no_command_prints_the_usage_and_the_commands():
    r = run_cli()
    assert r.returncode == 2
    assert "usage: trace-roofline" in r.stderr and "arguments are required" not in r.stderr
    for command in ("intensity", "analyze", "diff", "cache"):
        assert re.search(rf"^\s+{command}\b", r.stderr, re.M), command


def test_version():
    from importlib.metadata import version

    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"trace-roofline {version('trace-roofline')}"


def test_help_texts():
    cache = run_cli("cache", "--help").stdout
    action = cache.split("info: location")[1].split("\n\n")[0]
    assert "default" not in action  # a required positional has no default
    force = run_cli("diff", "--help").stdout.split("--force")[-1].split("--causal")[0]
    assert "--layers" not in force  # diff has no --layers
    assert "--layers" in run_cli("analyze", "--help").stdout.split("--force")[-1]
    options = run_cli("intensity", "--help").stdout.split("options:")[1]
    hardware = options.split("--hardware HARDWARE")[1].split("--m M")[0]
    assert "default: rtx4090" in hardware and "unlike analyze" in " ".join(hardware.split())


# `import torch` fails as on a machine with the analyzer only (README command 1): a finder
# first on sys.meta_path; then each command line, its exit code and stderr, as JSON.
_NO_TORCH = """
import contextlib, io, json, sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTorch())
from trace_roofline.cli import main
from workloads.cli import main as workloads_main
out = []
for args in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = (workloads_main(args[1:]) if args[0] == "-m" else main(args))
        except SystemExit as e:
            code = e.code
        except BaseException as e:
            code, err = "raised", io.StringIO(repr(e))
    out.append([args, code, err.getvalue()])
print(json.dumps(out))
"""
WORKLOADS = [["run"], ["sweep"], ["calibrate"], ["run", "--device", "tpu"],
             ["run", "--phase", "prefill", "--tokens", "16"], ["-m", "hf-capture"]]


def test_workload_commands_without_torch_say_what_to_install():
    import json

    r = subprocess.run([sys.executable, "-c", _NO_TORCH, json.dumps(WORKLOADS)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    for args, code, err in json.loads(r.stdout):
        command = args[1] if args[0] == "-m" else args[0]
        assert code == 2, (args, code, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in err, (args, err)
        assert re.match(rf"(trace-roofline|python -m workloads): error: `{command}` needs torch",
                        lines[0]), (args, err)
        assert "pip install 'trace-roofline[workloads]'" in lines[0]


# ------------------------------------------------------------------------------ units
def test_si_keeps_four_significant_digits():
    assert si(1.508e12, "FLOP/s") == "1.508 TFLOP/s"
    assert si(8.5e9, "B/s") == "8.5 GB/s"
    assert si(407_510_000, "B") == "407.5 MB"
    assert si(999.96, "B") == "1 kB" and si(0, "FLOP") == "0 FLOP"
    assert si(None, "B") == "-" and si(math.nan, "B") == "-"


def test_cpu_chart_titles_and_roof_labels(decode):
    from trace_roofline.outputs.plot import roofline_figure

    cpu = dataclasses.replace(decode, trace="cpu.json.gz", hardware=CPU)
    ax = roofline_figure([cpu]).axes[0]
    texts = [ax.get_title(), *(t.get_text() for t in ax.texts)]
    assert "xeon-measured: 1.508 TFLOP/s bf16, 8.5 GB/s" in texts[0]
    assert any("1.508 TFLOP/s bf16" in t for t in texts[1:])  # compute roof
    assert any(t == "memory slope 8.5 GB/s" for t in texts)
    assert not any(re.search(r"\b(2 TFLOP/s|0\.01 TB/s)", t) for t in texts)


def test_intensity_names_the_hardware_it_used():
    text = format_intensity(intensity_table(QWEN, CPU))
    head = text.splitlines()[:2]
    assert "on xeon-measured" in head[0] and "(1.508 TFLOP/s / 8.5 GB/s)" in head[0]
    assert head[1].startswith("hardware xeon-measured (--hardware")
    r = run_cli("intensity")
    assert r.returncode == 0 and r.stdout.splitlines()[1].startswith("hardware rtx4090 (--hardware")


def test_sweep_on_cpu_prints_si_rates():
    lines = sweep_lines(verbose=False)
    rows = [x for x in lines if re.match(r"\[sweep\] M=\s*\d+: ", x)]  # not the progress lines
    assert len(rows) == 2
    assert all(re.search(r"\d (|k|M|G|T)FLOP/s", x) for x in rows), rows
    assert not any("0.00 TFLOP/s" in x for x in rows)


# --------------------------------------------------------------------------- evidence
def test_evidence_as_percentages(decode):
    assert evidence_text("annotation 1") == "annotation 100%"
    assert evidence_text("shape 0.408, position 0.592") == "shape 41%, position 59%"
    assert evidence_text("annotation 0.997, position 0.003") == "annotation >99%, position <1%"
    mixed = decode.operators.assign(evidence_mix="shape 0.408, position 0.592")
    md = markdown([dataclasses.replace(decode, operators=mixed)])
    assert "| shape 41%, position 59% |" in md and "0.592" not in md
    assert "| annotation 100% |" in markdown([decode])


# ------------------------------------------------------------------------ the ncu note
def test_measured_bytes_below_the_minimum_get_a_note(decode):
    act = decode.operators.query("operator == 'act' and layer.isna()").iloc[0]
    measured = pd.DataFrame({"layer": [0, 0], "operator": ["act", "q_proj"],
                             "measured_bytes": [0.71 * act.bytes, 51.4e6]})
    a = dataclasses.replace(decode, operators=place(decode.costed, H200, measured=measured))
    note = [x for x in terminal_table([a]).splitlines() if "fewer DRAM bytes" in x]
    assert len(note) == 1 and "act (decode, 0.71x)" in note[0] and "q_proj" not in note[0]
    assert "L2" in note[0]
    assert "fewer DRAM bytes than the analytical minimum for act" in markdown([a])
    assert "fewer DRAM bytes" not in terminal_table([decode])


# ------------------------------------------------------------------------------- diff
def _side(trace: str, model: str | None, hardware: dict | None, flops: float = 1e9,
          time: float = 100.0) -> diffmod.Side:
    ops = pd.DataFrame([{"phase": "decode", "operator": "q_proj", "time_us": time, "flops": flops,
                         "bytes": flops, "intensity": 1.0, "achieved_flops_per_s": flops / time * 1e6,
                         "pct_of_roof": 50.0, "bound": "memory"}])
    whole = {"decode": {k: ops.iloc[0][k] for k in ops.columns if k not in ("phase", "operator")}}
    return diffmod.Side(trace, diffmod._rows(ops, whole), {"decode": 1}, hardware, model,
                        "shapes" if model else "none")


def test_diff_says_different_model_and_workload_before_the_table():
    h = {"name": "h200-measured", "dtype": "bf16", "peak_flops_per_s": 8e14, "ridge": 189,
         "bandwidth_bytes_per_s": 4.4e12}
    a, b = _side("qwen.json.gz", "qwen2.5-7b", h), _side("mixtral.json.gz", "mixtral-8x7b", h, 4e9)
    text = diffmod.format_table(diffmod.diff(a, b), a, b).splitlines()
    head = text.index(next(x for x in text if x.startswith("operator ")))
    model = next(i for i, x in enumerate(text) if x.startswith("! DIFFERENT MODEL"))
    work = next(i for i, x in enumerate(text) if x.startswith("! DIFFERENT WORKLOAD"))
    assert model < work < head
    assert "A is qwen2.5-7b (from the trace's shapes), B is mixtral-8x7b" in text[model]
    assert text[0] == "A qwen.json.gz   model qwen2.5-7b"
    md = diffmod.markdown(diffmod.diff(a, b), a, b)
    assert md.index("DIFFERENT MODEL") < md.index("| operator |")
    assert diffmod.to_json(diffmod.diff(a, b), a, b)["b"]["model"] == "mixtral-8x7b"


def test_diff_names_a_side_without_a_device():
    h = {"name": "h200-measured", "dtype": "bf16", "peak_flops_per_s": 8e14, "ridge": 189,
         "bandwidth_bytes_per_s": 4.4e12}
    a, b = _side("cpu.json.gz", "qwen-tiny", None), _side("gpu.json.gz", "qwen-tiny", h)
    notes = diffmod.notes(diffmod.diff(a, b), a, b)
    device = next(n for n in notes if n.startswith("different devices"))
    assert "None" not in device and "A on no device" in device
    assert not any("DIFFERENT MODEL" in n for n in notes)


def test_diff_of_real_traces_of_two_models():
    """A Qwen trace against a Mixtral trace, models from their shapes (no --model)."""
    r = run_cli("diff", str(SAMPLES / "hf-qwen2-qwen2.5-7b-2l_decode_b1_s512_h200.json.gz"),
                str(SAMPLES / "moe" / "hf-moe-mixtral-8x7b-2l_decode_b4_s512_eager_h200.json.gz"))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[2].startswith("! DIFFERENT MODEL: A is qwen2.5-7b") and "mixtral-8x7b" in lines[2]
    assert lines[3].startswith("! DIFFERENT WORKLOAD")


def test_diff_arrow_within_two_percent_is_neutral():
    from trace_roofline.outputs.plot_diff import FASTER, NEUTRAL, SLOWER, arrow_colour

    assert arrow_colour(1.0) == arrow_colour(0.995) == arrow_colour(1.02) == NEUTRAL
    assert arrow_colour(0.97) == SLOWER and arrow_colour(1.06) == FASTER


def test_diff_labels_avoid_the_a_markers(decode):
    from trace_roofline.outputs.plot_diff import diff_figure

    slow = dataclasses.replace(decode, trace="b.json.gz")
    ops = slow.operators.copy()
    ops["time_us"] = ops["time_us"] * 2
    ops["achieved_flops_per_s"] = ops["achieved_flops_per_s"] / 2
    slow = dataclasses.replace(slow, operators=ops)
    a, b = diffmod.side(decode), diffmod.side(slow)
    table = diffmod.diff(a, b)  # the operators where a label can be placed clear of every marker
    table = table[table["operator"].isin(["act", "attention", "rope", "residual", "input_norm"])]
    fig = diff_figure(table, a, b)
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    hollow = [c for c in ax.collections if c.get_facecolor().size == 0
              or c.get_facecolor()[0][3] == 0]
    labels = [t for t in ax.texts if "x" in t.get_text() and t.get_text().split()[0] in set(
        ops["operator"]) | {"whole"}]
    assert labels and hollow
    marks = [ax.transData.transform(c.get_offsets()[0]) for c in hollow]
    overlapping = [t.get_text() for t in labels for (x, y) in marks
                   if t.get_window_extent(renderer).contains(x, y)]
    assert overlapping == []


# --------------------------------------------------------------------------- report.html
import bokeh  # noqa: E402,F401  (a base dependency: report.html)


def _figures(chart):
    """The charts of `_charts`' layout, top to bottom."""
    return list(getattr(chart, "children", [chart]))


def test_html_one_roof_per_hardware_and_dtype(decode, decode_fp16):
    from trace_roofline.outputs.html_report import _charts, operator_rows

    cpu = dataclasses.replace(decode, trace="cpu.json.gz", hardware=None)
    analyses = [decode, cpu, decode_fp16]
    figs = _figures(_charts(analyses, operator_rows(analyses)))
    titles = [f.title.text for f in figs]
    assert len(figs) == 3, titles
    assert titles[0].startswith("Roofline on h200-sxm") and " bf16," in titles[0]
    assert "without a device" in titles[1]
    assert titles[2].startswith("Roofline on h200-sxm") and " fp16," in titles[2]
    for fig, trace in zip(figs, ("decode", "cpu", "decode_fp16"), strict=True):
        traces = {t for r in fig.renderers for t in r.data_source.data.get("trace", [])}
        assert traces == {trace}, (fig.title.text, traces)
    fp16_roof = next(r for r in figs[2].renderers if "trace" not in r.data_source.data)
    assert max(fp16_roof.data_source.data["y"]) == pytest.approx(H200.peak("fp16"))


def test_html_legend_ridge_label_and_units(decode):
    from bokeh.models import Label

    from trace_roofline.outputs.html_report import _charts, operator_rows, report_html

    small = dataclasses.replace(decode, trace="small.json.gz")
    rows = operator_rows([decode, small])
    (fig,) = _figures(_charts([decode, small], rows))
    items = fig.legend[0].items
    stars = [i for i in items for r in i.renderers if getattr(r.glyph, "marker", None) == "star"]
    assert len(stars) == 1 and "whole model" in stars[0].label.value  # once, not per trace
    for item in items:
        if " · " in item.label.value:  # a trace's entry: its marker, and it hides its star too
            assert all(getattr(r.glyph, "marker", None) != "star" for r in item.renderers)
            assert item.renderers[0].js_property_callbacks  # visible -> the star's visible
    (label,) = [x for x in fig.center if isinstance(x, Label)]
    assert label.text.startswith("ridge I*") and label.level == "overlay"
    assert label.angle == pytest.approx(math.pi / 2) and label.background_fill_color == "white"
    page = report_html([decode])
    table = page.split("<h2>Operators</h2>")[1].split("</table>")[0]
    cells = re.findall(r">([^<]*)</td>", table)
    assert "0.000" not in cells and any(re.fullmatch(r"\d+(\.\d+)? kFLOP", c) for c in cells)
    assert "annotation 100%" in cells and "annotation 1" not in cells


# ------------------------------------------------------------------------------ charts
def test_memory_slope_label_covers_no_point(decode):
    from trace_roofline.outputs.plot import roofline_figure

    # decode points pressed against the memory roof, where the slope label sits by default
    ops = decode.operators.copy()
    ops["intensity"] = np.geomspace(0.08, 1.2, len(ops))
    ops["achieved_flops_per_s"] = ops["intensity"] * H200.mem_bandwidth * 0.9
    a = dataclasses.replace(decode, operators=ops)
    fig = roofline_figure([a])
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    (slope,) = [t for t in ax.texts if t.get_text().startswith("memory slope")]
    box = slope.get_window_extent(renderer)
    diag = np.linspace((box.x0, box.y0), (box.x1, box.y1), 60)
    for c in ax.collections:
        for x, y in ax.transData.transform(c.get_offsets()):
            r = math.sqrt(c.get_sizes()[0]) * fig.dpi / 72 / 2
            assert not np.any(np.hypot(diag[:, 0] - x, diag[:, 1] - y) < r), slope.xyann


def test_small_multiples_with_another_panel_stay_inside_the_figure(decode):
    from trace_roofline.outputs.plot import roofline_figure

    many = [dataclasses.replace(decode, trace=f"run{i}.json.gz") for i in range(7)]
    cpu = dataclasses.replace(decode, trace="cpu.json.gz", hardware=None)
    fig = roofline_figure([*many, cpu])
    renderer = fig.canvas.get_renderer()
    width = fig.bbox.width
    for ax in fig.axes:
        assert ax.get_window_extent(renderer).x1 <= width
        legend = ax.get_legend()
        assert legend is None or legend.get_window_extent(renderer).x1 <= width


def test_a_panel_of_five_traces_labels_only_their_largest_operators(decode):
    from trace_roofline.outputs.plot import roofline_figure

    five = [dataclasses.replace(decode, trace=f"cpu{i}.json.gz", hardware=None) for i in range(5)]
    fig = roofline_figure(five)
    (ax,) = [a for a in fig.axes]
    labels = [t.get_text() for t in ax.texts if getattr(t, "arrow_patch", None) is not None]
    assert len(labels) <= 12, labels  # not 5 x 15: each operator once, its traces counted
    assert "gate_proj (5 traces)" in labels and "whole model (5 traces)" in labels
    assert any("largest operators" in t.get_text() for t in fig.texts)


def test_tp_ranks_are_named_and_both_visible():
    from trace_roofline.outputs.plot import roofline_figure

    folder = SAMPLES / "tp2" / "tp2-qwen2.5-7b-2l_decode_b8_s2048_h200"
    import trace_roofline as tr

    ranks = [tr.analyze_trace(folder / f"rank{i}.json.gz", QWEN) for i in (0, 1)]
    fig = roofline_figure(ranks)
    ax = fig.axes[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[:2] == ["rank 0 (decode)", "rank 1 (decode)"]
    assert "2 rank(s) of tp2-qwen2.5-7b-2l_decode_b8_s2048_h200" in ax.get_title()
    # rank 1's points coincide with rank 0's: drawn hollow, above them
    red = [c for c in ax.collections if c.get_edgecolor().size
           and np.allclose(c.get_edgecolor()[0][:3], (0.839, 0.153, 0.157), atol=0.01)]
    hollow = [c for c in red if (c.get_facecolor().size == 0 or c.get_facecolor()[0][3] == 0)
              and c.get_sizes()[0] != 320]  # not the (always hollow) whole-model star
    assert len(hollow) >= 5
    blue = [c for c in ax.collections if c.get_facecolor().size
            and np.allclose(c.get_facecolor()[0][:3], (0.122, 0.467, 0.706), atol=0.01)]
    assert min(c.get_zorder() for c in hollow) > max(c.get_zorder() for c in blue)
