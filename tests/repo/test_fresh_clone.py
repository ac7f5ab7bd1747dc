"""What a newcomer on a fresh clone trips on: report.html without Bokeh, a
config.json given as the trace, misspelt commands and flags, diff of folders, a script beside
the clone, informational lines, near-zero rows on the charts, the tables' -0.0 and 0.0%."""

from __future__ import annotations

import dataclasses
import html
import re

import pandas as pd
import pytest
import tomllib

from tests.builders import ROOT, attributed, qwen_layer, run_cli, sweep_lines
from tests.outputs.test_plot import DEC, H200, QWEN
from trace_roofline.pipeline import TraceFacts, analyze


def _declared() -> dict[str, list[str]]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    return {"": project["dependencies"], **project["optional-dependencies"]}


def test_bokeh_is_a_base_dependency_at_the_pinned_minimum():
    """README's first command (`pip install -e .`) promises report.html: Bokeh comes with it,
    at the minimum .ci/min_versions.sh installs."""
    base = [d for d in _declared()[""] if re.match(r"bokeh\b", d)]
    assert base == ["bokeh>=3.4"]
    assert not [d for extra in _declared().values() for d in extra if "bokeh" in d and d not in base]
    pins = (ROOT / ".ci" / "min_versions.sh").read_text()
    assert '"bokeh==3.4.0"' in pins


def _config(tmp_path):
    import json

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                                  "hidden_size": 3584, "num_hidden_layers": 28}))
    return config


def test_a_config_given_as_the_trace_says_pass_it_as_model(tmp_path):
    config = _config(tmp_path)
    for argv in (["analyze", str(config)], ["analyze", str(tmp_path)],
                 ["diff", str(config), str(config)]):
        r = run_cli(*argv)
        assert r.returncode == 2, argv
        assert r.stdout == ""
        err = r.stderr.strip().splitlines()
        assert len(err) == 1 and f"--model {config if argv[1] == str(config) else tmp_path}" in err[0]
        assert "model config" in err[0] and "not a trace" in err[0] or "holds no trace" in err[0]


def test_a_trace_or_a_fifo_is_never_taken_for_a_config(tmp_path):
    import os

    from trace_roofline.cli import is_model_config

    assert not is_model_config(ROOT / "sample_traces" / "qwen2.5-7b_decode_b1_s2048_h200.json.gz")
    (tmp_path / "t.json").write_text('{"traceEvents": [], "model_type": "x"}')
    assert not is_model_config(tmp_path / "t.json")
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    assert not is_model_config(fifo)  # not opened: it would block
    assert is_model_config(_config(tmp_path))


def test_misspelt_commands_flags_and_choices_get_a_did_you_mean():
    for argv, want in ((["analyse", "x.json"], "did you mean 'analyze'?"),
                       (["analyze", "x.json", "--modle", "qwen2.5-7b"], "--modle (did you mean --model?)"),
                       (["analyze", "x.json", "--modle=qwen2.5-7b"], "(did you mean --model?)"),
                       (["analyze", "x.json", "--causal", "ful"], "did you mean 'full'?"),
                       (["diff", "a", "b", "--hardwre", "h200"], "--hardwre (did you mean --hardware?)"),
                       (["cache", "inf"], "did you mean 'info'?")):
        r = run_cli(*argv)
        assert r.returncode == 2 and r.stdout == "", argv
        assert len(r.stderr.splitlines()) == 1 and want in r.stderr, (argv, r.stderr)
    r = run_cli("analyze", "x.json", "--xyzzy")  # nothing close: no guess
    assert r.returncode == 2 and "unrecognized arguments: --xyzzy\n" in r.stderr


def test_diff_of_folders_takes_their_report_json_or_says_what_it_takes(tmp_path):
    import shutil

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    r = run_cli("diff", str(a), str(b))
    assert r.returncode == 2 and "Is a directory" not in r.stderr
    assert r.stderr.strip() == (f"trace-roofline: error: {a}: a folder without report.json; diff "
                                "takes two traces (.json, .json.gz), two report.json files or two "
                                "`analyze --out` folders")
    out = run_cli("analyze", str(ROOT / "sample_traces" / "qwen2.5-7b_decode_b1_s2048_h200.json.gz"),
                  "--model", "qwen2.5-7b", "--out", str(a))  # an analyze --out folder
    assert out.returncode == 0, out.stderr
    shutil.copy(a / "report.json", b / "report.json")
    r = run_cli("diff", str(a), str(b))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("A ")


# --------------------------------------------------------------------------- report.html


@pytest.fixture(scope="module")
def decode():
    return analyze(attributed(qwen_layer(QWEN, 1, 2048, DEC)), QWEN, H200,
                   facts=TraceFacts(trace="decode.json.gz"))


def _figures(chart):
    return list(getattr(chart, "children", [chart]))


def _styles(fig) -> dict[str, tuple]:
    """legend label -> (fill colour, line colour, marker) of its points."""
    out = {}
    for item in fig.legend[0].items:
        glyph = item.renderers[0].glyph
        if " · " in item.label.value:
            out[item.label.value] = (glyph.fill_color, glyph.line_color, glyph.marker)
    return out


@pytest.mark.parametrize("n", [7, 12, 25])
def test_html_traces_never_share_a_colour_and_marker(decode, n):
    from trace_roofline.outputs.html_report import _charts, operator_rows

    many = [dataclasses.replace(decode, trace=f"run{i}.json.gz") for i in range(n)]
    (fig,) = _figures(_charts(many, operator_rows(many)))
    styles = _styles(fig)
    assert len(styles) == n and len(set(styles.values())) == n, styles


def test_html_legend_outside_the_plot_area_and_units_on_the_axes(decode):
    from bokeh.models import CustomJSTickFormatter, Legend

    from trace_roofline.outputs.html_report import _charts, operator_rows

    cpu = dataclasses.replace(decode, trace="cpu.json.gz", hardware=None)
    for fig in _figures(_charts([decode, cpu], operator_rows([decode, cpu]))):
        assert not [x for x in fig.center if isinstance(x, Legend)]  # not over the slope
        assert [x for x in fig.right if isinstance(x, Legend)]
        (y,) = fig.yaxis
        assert isinstance(y.formatter, CustomJSTickFormatter) and "FLOP/s" in y.formatter.code


def test_html_flop_per_byte_as_the_terminal_prints_it(decode):
    from trace_roofline.outputs.html_report import _HOVER, report_html

    ops = decode.operators.copy()
    ops.loc[ops["operator"] == "attention", "intensity"] = 1219.3812
    page = report_html([dataclasses.replace(decode, operators=ops)])
    table = page.split("<h2>Operators</h2>")[1].split("</table>")[0]
    cells = re.findall(r'data-v="([^"]*)">([^<]*)</td>', table)
    flop_b = [text for v, text in cells if v in {str(x) for x in ops["intensity"]}]
    assert "1219.38" in flop_b and "1.00" in flop_b
    assert "1.22e+03" not in flop_b and "1" not in flop_b
    assert ("intensity", "@intensity{0.00} FLOP/B") in _HOVER


def _with_speck(a):
    """`a` with one more operator row: 0.0% of the time at intensity 1e-5 (a fallback row)."""
    ops = a.operators
    row = ops[ops["operator"] == "residual"].iloc[[0]].copy()
    row["operator"], row["evidence"], row["time_share"] = "other", "fallback", 1e-6
    row["time_us"] = row["time_us"] * 1e-6
    row["intensity"], row["achieved_flops_per_s"] = 1e-5, 1e3
    return dataclasses.replace(a, operators=pd.concat([ops, row], ignore_index=True))


def test_a_near_zero_row_does_not_stretch_the_axes(decode):
    from trace_roofline.outputs.html_report import _charts, operator_rows
    from trace_roofline.outputs.plot import roofline_figure

    a = _with_speck(decode)
    fig = roofline_figure([a])
    x_lo, _ = fig.axes[0].get_xlim()
    y_lo, _ = fig.axes[0].get_ylim()
    assert x_lo > 1e-3 and y_lo > 1e6, (x_lo, y_lo)
    assert any("outside the axes" in t.get_text() and "other" in t.get_text() for t in fig.texts)
    (chart,) = _figures(_charts([a], operator_rows([a])))
    assert chart.x_range.start > 1e-3 and chart.y_range.start > 1e6


# ------------------------------------------------------------------------ run and sweep
def test_sweep_prints_readable_times_and_progress():
    lines = sweep_lines(verbose=True)
    starts = [x for x in lines if re.match(r"\[sweep\] M=\s*\d+ \(\d of 2\)", x)]
    assert len(starts) == 2 and "1 warm-up + 2 timed calls" in starts[0]
    rows = [x for x in lines if re.match(r"\[sweep\] M=\s*\d+: ", x)]
    assert len(rows) == 2
    assert all(re.search(r": +\d+(\.\d+)? (µs|ms|s) ", x) for x in rows), rows
    assert not any(re.search(r"\d\.\d\d us", x) for x in rows), rows  # not 980633.67 us
    assert any(x.startswith("[sweep] profiling 5 calls per M") for x in lines)


def test_run_and_sweep_default_out_is_ignored_by_git():
    import subprocess

    from trace_roofline.cli import build_parser

    parser = build_parser()
    for command in ("run", "sweep"):
        args = parser.parse_args([command])
        assert args.out == "traces"
    help_text = run_cli("sweep", "--help").stdout
    assert "traces/ in the current folder" in " ".join(help_text.split())
    # a capture in the clone is not committed by accident (the rule; and git's reading of it
    # where the tree is a git work tree: CI's minimum-versions leg runs on a copy that is not)
    assert "/traces/" in (ROOT / ".gitignore").read_text().split()
    ignored = subprocess.run(["git", "check-ignore", "-q", "traces/x.json.gz"], cwd=ROOT)
    assert ignored.returncode in ((0,) if (ROOT / ".git").exists() else (0, 128))


# ------------------------------------------------------------------------ -0.0 and 0.0%
def test_diff_prints_no_signed_zero_and_no_zero_for_a_figure_that_is_not():
    from trace_roofline.outputs import diff

    sample = ROOT / "sample_traces"
    r = run_cli("diff", str(sample / "qwen2.5-7b_decode_b1_s2048_h200.json.gz"),
                str(sample / "qwen2.5-7b_decode_b1_s2048_compiled_noannot_h200.json.gz"),
                "--model", "qwen2.5-7b")
    assert r.returncode == 0, r.stderr
    assert not re.search(r"(?<![\w.])[+-]0\.0+(?![\d])", r.stdout), r.stdout
    assert diff._fmt(-0.01, "+.1f") == "0.0" and diff._fmt(-0.0, "+.2f") == "0.00"
    assert diff._fmt(0.001, ".1f") == "<0.1" and diff._fmt(0.0, ".1f") == "0.0"
    assert diff._fmt(1.26, "+.1f") == "+1.3"


def test_html_time_share_of_a_near_zero_row_is_not_zero(decode):
    from trace_roofline.outputs.html_report import report_html

    page = report_html([_with_speck(decode)])
    table = page.split("<h2>Operators</h2>")[1].split("</table>")[0]
    other = next(r for r in table.split("<tr>") if ">other<" in r)
    cells = re.findall(r">([^<]*)</td>", other)
    assert "<0.1" in [html.unescape(c) for c in cells] and "0.0" not in cells


def test_evidence_page_says_what_its_withheld_example_shows():
    page = (ROOT / "docs" / "evidence.md").read_text()
    assert re.search(r"^whole model +unknown withheld: ", page, re.M)  # the example's table line
    prose = " ".join(page.split())
    assert "no line in the table" not in prose
    assert "a `withheld` line instead of its figures in the table" in prose


# ------------------------------------------------------------------------------ diff.png
def _crossings(fig) -> list[tuple[str, str, str]]:
    """(what, label, other) for each label box over another label, over a marker, or crossed by
    another label's leader line."""
    import math

    import numpy as np
    from matplotlib.text import Text

    ax, renderer = fig.axes[0], fig.canvas.get_renderer()
    labels = [t for t in ax.texts if getattr(t, "arrow_patch", None) is not None and t.get_text()]
    boxes = [(t.get_text(), Text.get_window_extent(t, renderer)) for t in labels]
    out = [("box", n1, n2) for i, (n1, b1) in enumerate(boxes) for n2, b2 in boxes[i + 1:]
           if b1.overlaps(b2)]
    for t in labels:
        verts = t.arrow_patch.get_path().vertices
        line = np.linspace(verts[0], verts[-1], 40)
        out += [("leader", t.get_text(), n) for n, b in boxes if n != t.get_text() and np.any(
            (line[:, 0] >= b.x0) & (line[:, 0] <= b.x1) & (line[:, 1] >= b.y0) & (line[:, 1] <= b.y1))]
    for c in ax.collections:
        r = math.sqrt(c.get_sizes()[0]) * fig.dpi / 72 / 2
        for x, y in ax.transData.transform(c.get_offsets()):
            out += [("marker", n, f"{x:.0f},{y:.0f}") for n, b in boxes
                    if b.x0 - r < x < b.x1 + r and b.y0 - r < y < b.y1 + r]
    return out


def test_diff_chart_labels_overlap_nothing():
    import trace_roofline as tr
    from trace_roofline.outputs import diff
    from trace_roofline.outputs.plot_diff import diff_figure

    sample = ROOT / "sample_traces"
    a = diff.side(tr.analyze_trace(sample / "qwen2.5-7b_decode_b1_s2048_h200.json.gz", QWEN))
    b = diff.side(tr.analyze_trace(
        sample / "qwen2.5-7b_decode_b1_s2048_compiled_noannot_h200.json.gz", QWEN))
    fig = diff_figure(diff.diff(a, b), a, b)
    fig.draw_without_rendering()
    assert _crossings(fig) == []


# --------------------------------------------------------------------- the suite's memory
def test_a_cpu_continuous_batching_capture_stays_small(tmp_path):
    """The suite's 6.6 GB process: transformers' paged cache sized itself from the machine's
    free memory in tests/workloads/test_capture_families.py's llama-batch capture of a toy model."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import subprocess
    import sys

    code = ("import resource, sys\n"
            "from pathlib import Path\n"
            "from workloads.capture_families import capture\n"
            "capture('llama', 'batch', Path(sys.argv[1]), tokens=16, device='cpu', dtype='float32',"
            " steps=1, scale=0.03, progress=lambda _: None)\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    peak_kb = int(r.stdout.split()[-1])
    assert peak_kb < 1_500_000, f"{peak_kb / 1e6:.1f} GB"
