"""The diff chart: each operator's move on the roofline from trace A to trace B.

Design notes: docs/design.md ("trace_roofline/outputs/plot_diff.py").
"""

from __future__ import annotations

import textwrap
from typing import SupportsFloat, cast

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from trace_roofline.model.hardware import Hardware
from trace_roofline.outputs.diff import WHOLE, Side
from trace_roofline.outputs.plot import (
    PHASE_MARKERS,
    TITLE_Y,
    Obstacles,
    draw_roof,
    lay_out,
    place_labels,
    place_slope_label,
    pos,
    rate_formatter,
    short_name,
)

FASTER, SLOWER, NEUTRAL, ONE_SIDE = "#2ca02c", "#d62728", "#1f77b4", "0.45"
# A speed-up within this of 1 (1.00x, 0.99x, 1.02x) is drawn NEUTRAL: neither faster nor slower.
NEUTRAL_BAND = 0.02


def arrow_colour(speedup: float) -> str:
    """FASTER, SLOWER, or NEUTRAL within ±NEUTRAL_BAND of 1x (as the label prints it: 1.02x)."""
    if abs(round(speedup, 2) - 1.0) <= NEUTRAL_BAND + 1e-9:
        return NEUTRAL
    return FASTER if speedup > 1 else SLOWER


def _points(table: pd.DataFrame) -> tuple[list[dict], list[tuple], list[str]]:
    """Label points (at B, or at the only side), arrows (xa, ya, xb, yb, colour) and the
    operators that cannot sit on log axes."""
    points, arrows, skipped = [], [], []
    for r in table.itertuples():
        a = pos(r.intensity_a) and pos(r.achieved_flops_per_s_a)
        b = pos(r.intensity_b) and pos(r.achieved_flops_per_s_b)
        whole = r.operator == WHOLE
        marker = "*" if whole else PHASE_MARKERS.get(r.phase, "^")
        size = 260 if whole else 60
        if a and b:
            colour = arrow_colour(r.speedup)
            arrows.append((r.intensity_a, r.achieved_flops_per_s_a, r.intensity_b,
                           r.achieved_flops_per_s_b, colour, marker, size))
            same = r.flops_equal is pd.NA or bool(r.flops_equal)
            label = f"{r.operator} {r.speedup:.2f}x" + ("" if same else " (FLOPs changed)")
            points.append({"x": r.intensity_b, "y": r.achieved_flops_per_s_b, "c": colour,
                           "s": size, "label": label, "whole": whole, "rank": 2.0 if whole
                           else float(max(r.time_a_us, r.time_b_us))})
        elif a or b:
            sfx = "_a" if a else "_b"
            x, y = getattr(r, "intensity" + sfx), getattr(r, "achieved_flops_per_s" + sfx)
            other = "no FLOPs or time" if r.presence == "both" else "absent"
            points.append({"x": x, "y": y, "c": ONE_SIDE, "s": size, "hollow": a, "m": marker,
                           "label": f"{r.operator} ({'B' if a else 'A'}: {other})",
                           "whole": whole, "rank": 0.0})
        elif r.flops_a == r.flops_a or r.flops_b == r.flops_b:
            skipped.append(r.operator)
    return points, arrows, skipped


def diff_figure(table: pd.DataFrame, a: Side, b: Side, *, title: str | None = None) -> Figure:
    """A -> B arrows of `diff.diff`'s table on A's roofline (no roofs when A has no device)."""
    fig = Figure(figsize=(11.5, 7.5), dpi=150)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_xscale("log")
    ax.set_yscale("log")
    points, arrows, skipped = _points(table)
    hw = a.hardware
    peak = float(cast(SupportsFloat, hw["peak_flops_per_s"])) if hw else None
    ridge = float(cast(SupportsFloat, hw["ridge"])) if hw else None
    xs = [p["x"] for p in points] + [v[0] for v in arrows] + ([ridge] if ridge else [])
    ys = [p["y"] for p in points] + [v[1] for v in arrows]
    ax.set_xlim(min(xs, default=0.1) / 4, max(xs, default=1e3) * 10)
    ax.set_ylim(min(ys, default=1e9) / 6, max(ys + ([peak] if peak else []), default=1e15) * 4)
    roof_texts = []
    if hw and peak is not None:  # peak is None only without hw
        device = Hardware(str(hw["name"]), {str(hw["dtype"]): peak},
                          float(cast(SupportsFloat, hw["bandwidth_bytes_per_s"])),
                          str(hw.get("source", "")))
        roof_texts = draw_roof(ax, device, peak, str(hw["dtype"]))
    for xa, ya, xb, yb, colour, marker, size in arrows:
        ax.annotate("", (xb, yb), xytext=(xa, ya), zorder=3,
                    arrowprops={"arrowstyle": "-|>", "color": colour, "lw": 1.1,
                                "shrinkA": 3, "shrinkB": 5})
        ax.scatter([xa], [ya], s=size, marker=marker, facecolors="none", edgecolors=colour,
                   linewidths=1.2, zorder=4)
        ax.scatter([xb], [yb], s=size, marker=marker, color=colour, edgecolors="black",
                   linewidths=0.5, zorder=5)
    for p in points:
        if "m" in p:  # one side only
            ax.scatter([p["x"]], [p["y"]], s=p["s"], marker=p["m"],
                       facecolors="none" if p["hollow"] else p["c"], edgecolors=p["c"],
                       linewidths=1.2, zorder=4)
    ax.set_xlabel("arithmetic intensity (FLOP / byte, analytical minimum bytes)")
    ax.set_ylabel("achieved FLOP/s (analytical FLOPs / measured time)")
    ax.yaxis.set_major_formatter(rate_formatter())
    ax.grid(True, which="major", alpha=0.3)
    ax.grid(True, which="minor", alpha=0.08)
    ax.set_title(title or f"A {short_name(a.trace)} → B {short_name(b.trace)}", fontsize=11,
                 y=TITLE_Y)
    handles = [Line2D([], [], ls="", marker="o", color="0.3", markerfacecolor="none", label="A"),
               Line2D([], [], ls="", marker="o", color="0.3", label="B"),
               Line2D([], [], color=FASTER, label="B faster (label: speed-up A/B)"),
               Line2D([], [], color=SLOWER, label="B slower"),
               Line2D([], [], color=NEUTRAL, label=f"within ±{NEUTRAL_BAND:.0%} (unchanged)"),
               Line2D([], [], ls="", marker="*", color="0.3", markersize=12, label=WHOLE)]
    ax.legend(handles=handles, loc="upper left", fontsize=8, framealpha=0.9)
    lay_out(fig)
    place_slope_label(fig, ax, points + [{"x": v[0], "y": v[1], "s": v[6]} for v in arrows],
                      roof_texts)
    place_labels(fig, ax, points, Obstacles(
        roof_texts, markers=[{"x": v[0], "y": v[1], "s": v[6]} for v in arrows],
        lines=[[(v[0], v[1]), (v[2], v[3])] for v in arrows]))
    if skipped:
        note = "not on the log axes (0 FLOPs or no time): " + ", ".join(dict.fromkeys(skipped))
        fig.text(0.01, 0.005, textwrap.fill(note, 200), fontsize=7, color="0.3", ha="left",
                 va="bottom")
    return fig
