"""The roofline chart: every operator of one or more traces on its device's roofline.

Design notes: docs/design.md ("trace_roofline/outputs/plot.py").
"""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import SupportsFloat, cast

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.layout_engine import ConstrainedLayoutEngine
from matplotlib.lines import Line2D
from matplotlib.transforms import Bbox
from numpy.typing import ArrayLike

from trace_roofline.attribution.ranks import rank_info, rank_order
from trace_roofline.costs.calculator import si
from trace_roofline.errors import InputError
from trace_roofline.model.hardware import Hardware
from trace_roofline.model.operators import Name
from trace_roofline.roofline import Analysis, hardware_summary, split_part

PHASE_MARKERS = {"decode": "o", "prefill": "s", "unknown": "^"}
TRACE_COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
TRACE_MARKERS = ["o", "s", "D", "v", "P", "X"]
MAX_TRACES_PER_PANEL = len(TRACE_COLOURS)  # more traces of one hardware: one panel per trace
SMALL_MULTIPLE_LABELS = 4  # operators labelled per small-multiple panel (the largest by time)
# A panel of more than two traces labels only each trace's largest operators (by device time),
# about this many labels in all; the rest are unlabelled points (report.html hovers them all).
PANEL_LABELS = 24
# Two traces' points closer than this on both log axes (decades) would hide one another: the
# later trace's is drawn hollow over the earlier's (the ranks of a TP run sit on top of each other).
_COINCIDENT_DECADES = 0.04
# A point holding less than this share of its trace's device time (a 0.0% fallback row) does
# not set the axes' extent: one far-off speck would squeeze every other point into a corner.
AXIS_MIN_SHARE = 0.001
# A title's height in axes coordinates: where matplotlib's automatic placement puts it on these
# axes (no tick labels on top), given rather than computed again on every draw and layout pass.
TITLE_Y = 1.0
# Label offsets tried around a point, nearest first (points; angle 0 = right of the point).
_RADII = (7, 16, 28, 42, 58, 76, 96, 120)
_ANGLES = (0, 180, 35, -35, 145, -145, 90, -90, 60, -60, 120, -120)
# (radius, cos, sin) of each offset, in the order tried
_DIRECTIONS = np.array([(r, math.cos(math.radians(a)), math.sin(math.radians(a)))
                        for r in _RADII for a in _ANGLES])


def roofline_figure(analyses: Sequence[Analysis], hardware: Hardware | None = None, *,
                    title: str | None = None) -> Figure:
    """The roofline chart of `analyses`, each under `hardware` if given, else its own device."""
    if not analyses:
        raise ValueError("roofline_figure needs at least one analysis")
    panels = _panels(analyses, hardware)
    small = not all(label_all for _, _, label_all in panels)  # small multiples
    cols = min(len(panels), 3 if small else 2)
    rows = math.ceil(len(panels) / cols)
    width, height = (5.5, 4.2) if small else (11.5 if cols == 1 else 9.0, 7.5)
    fig = Figure(figsize=(width * cols, height * rows), dpi=150 if len(panels) < 7 else 100)
    FigureCanvasAgg(fig)
    placed = []
    chart = _Chart(title, many=len(panels) > 1, small=small, skipped={}, off_axes={},
                   declutter=set())
    names = dict(zip(map(id, analyses), trace_labels(analyses), strict=True))
    for i, (hw, group, label_all) in enumerate(panels):
        ax = fig.add_subplot(rows, cols, i + 1)
        panel = _Panel(group, hw, label_all, [names[id(a)] for a in group])
        placed.append((ax, *_draw_panel(ax, panel, chart)))
    skipped, off_axes, declutter = chart.skipped, chart.off_axes, chart.declutter
    lay_out(fig)
    for ax, points, roof_texts in placed:
        place_slope_label(fig, ax, points, roof_texts)
        place_labels(fig, ax, points, Obstacles(roof_texts))
    notes = []
    if declutter:
        notes.append("labels: in a panel of more than two traces, each trace's "
                     + " / ".join(str(n) for n in sorted(declutter))
                     + " largest operators by device time and its whole model")
    many = len(analyses) > 1
    def tags(found: dict[str, list[str]]) -> str:
        return ", ".join(op if not many else f"{op} ({len(t)} traces)" if len(t) > 1
                         else f"{op} ({t[0]})" for op, t in found.items())

    if skipped:
        notes.append("not on the log axes (0 FLOPs or no time): " + tags(skipped))
    if off_axes:
        notes.append(f"outside the axes (under {100 * AXIS_MIN_SHARE:g}% of the time each): "
                     + tags(off_axes))
    c = analyses[0].conventions
    notes.append(f"conventions: --causal {c['causal']}, --attention-bytes {c['attention_bytes']};"
                 " marker area ∝ share of the trace's device time")
    text = "\n".join(textwrap.fill(n, 200) for n in notes)
    fig.text(0.01, 0.005, text, fontsize=7, color="0.3", ha="left", va="bottom")
    return fig


def lay_out(fig: Figure) -> None:
    """Constrained layout, run once, leaving room for the notes below the axes. The figure
    keeps no layout engine: the labels are placed in this layout, and no draw or savefig lays
    the figure out again (nor pre-draws it to do so)."""
    ConstrainedLayoutEngine(rect=(0, 0.045, 1, 0.955)).execute(fig)


def axis_points(share: Sequence[float] | ArrayLike, whole: Sequence[bool] | ArrayLike) -> np.ndarray:
    """Which points set a chart's axes: the whole-model ones and those holding at least
    AXIS_MIN_SHARE of their trace's time (every point when none does)."""
    keep = np.asarray(whole, dtype=bool) | (np.asarray(share, dtype=float) >= AXIS_MIN_SHARE)
    return keep if keep.any() else np.ones(len(keep), dtype=bool)


def panel_groups(analyses: Sequence[Analysis], hardware: Hardware | None = None
                 ) -> list[tuple[Hardware | None, str | None, list[Analysis]]]:
    """(hardware, dtype of its roof, analyses) per roof: the analyses grouped by the hardware
    they are placed under (`hardware` if given, else each one's own) and the peak their compute
    dtype selects (an fp16 trace never sits under the bf16 roof, a CPU trace never under a
    GPU's), in order of first appearance. report.html draws one chart per group too."""
    groups: dict[object, tuple[Hardware | None, str | None, list[Analysis]]] = {}
    for a in analyses:
        hw = hardware or a.hardware
        summary = hardware_summary(a, hw)
        dtype = cast(str, summary["dtype"]) if summary else None
        key = None if hw is None else (hw.name, hw.mem_bandwidth, tuple(sorted(hw.peak_flops.items())),
                                       dtype)
        groups.setdefault(key, (hw, dtype, []))[2].append(a)
    return list(groups.values())


def _panels(analyses: Sequence[Analysis], hardware: Hardware | None
            ) -> list[tuple[Hardware | None, list[Analysis], bool]]:
    """(hardware, analyses, label every operator) per panel: `panel_groups`; a group of more
    than MAX_TRACES_PER_PANEL traces split into one panel per trace, labelling its largest
    operators."""
    panels = []
    for hw, _, group in panel_groups(analyses, hardware):
        if len(group) > MAX_TRACES_PER_PANEL:
            panels += [(hw, [a], False) for a in group]
        else:
            panels.append((hw, group, True))
    return panels


@dataclass(frozen=True)
class _Panel:
    """One panel: its analyses under one device (`hw`), their names, and whether every point
    is labelled (`label_all`; else a small multiple)."""

    analyses: list[Analysis]
    hw: Hardware | None
    label_all: bool
    names: list[str]


@dataclass(frozen=True)
class _Chart:
    """What the panels of one chart share: its title, whether it has several panels (`many`) of
    small multiples (`small`), and what they found: the operators not plottable (`skipped`),
    those outside the axes (`off_axes`: operator -> trace names), the labels per trace kept in
    a crowded panel (`declutter`)."""

    title: str | None
    many: bool
    small: bool
    skipped: dict[str, list[str]]
    off_axes: dict[str, list[str]]
    declutter: set[int]


def _draw_panel(ax, panel: _Panel, chart: _Chart) -> tuple[list[dict], list]:
    """One panel: roof, points, axes and legend; returns the points to label and the roof texts."""
    analyses, hw, names = panel.analyses, panel.hw, panel.names
    ax.set_xscale("log")
    ax.set_yscale("log")
    points = _points(analyses, chart.skipped)
    summary = hardware_summary(analyses[0], hw)
    peak = cast(float, summary["peak_flops_per_s"]) if summary else None
    dtype = cast(str, summary["dtype"]) if summary else ""  # used only under a roof (peak)
    points = _on_axes(ax, points, peak / hw.mem_bandwidth if hw and peak else None, peak)
    off = [p for p in points if p.get("off")]
    for p in off:  # too little time to set the axes, and outside them: said in the notes
        chart.off_axes.setdefault(p["label"], []).append(names[p["trace"]])
    points = [p for p in points if not p.get("off")]
    roof_texts = draw_roof(ax, hw, peak, dtype) if hw is not None and peak else []
    _hollow_coincident(points)
    _scatter(ax, points)
    ax.set_xlabel("arithmetic intensity (FLOP / byte, analytical minimum bytes)")
    ax.set_ylabel("achieved FLOP/s (analytical FLOPs / measured time)")
    ax.yaxis.set_major_formatter(rate_formatter())
    ax.grid(True, which="major", alpha=0.3)
    ax.grid(True, which="minor", alpha=0.08)
    device = (f"{hw.name}: {si(peak, 'FLOP/s')} {dtype}, "
              f"{si(hw.mem_bandwidth, 'B/s')}" if hw is not None and peak
              else "no device given (no roofs: pass --hardware)")
    points = _titled(ax, panel, chart, device, points)
    points = _merge_labels(points, "ranks" if names[0].startswith("rank ") else "traces")
    # In a grid of small multiples every legend sits inside its panel: one outside would
    # widen its column and push the grid past the figure's right edge.
    _legend(ax, analyses, _Legend(names, any("mx" in p for p in points), bool(roof_texts),
                                  outside=panel.label_all and not chart.small,
                                  titled=not panel.label_all))
    return points, roof_texts


def _on_axes(ax, points: list[dict], ridge: float | None, peak: float | None) -> list[dict]:
    """Set the axes' limits from the points that hold enough time (`axis_points`), the ridge and
    the peak; mark the points outside them `off`, and set the intensity-only points (no y)
    just above the bottom edge."""
    core = [p for p, keep in zip(points, axis_points([p["rank"] for p in points],
                                                     [p["whole"] for p in points]), strict=True)
            if keep]
    xs = [p["x"] for p in core] + [p.get("mx", p["x"]) for p in core]
    ys = [p["y"] for p in core if p["y"] is not None]
    x_lo = min(xs + ([ridge] if ridge else [])) / 4 if xs else 0.01
    x_hi = max(xs + ([ridge] if ridge else [])) * 10 if xs else 1e4
    y_hi = max(ys + ([peak] if peak else [])) * 4 if ys else 1e15
    y_lo = min(ys) / 6 if ys else 1e9
    ax.set_xlim(x_lo, x_hi)
    ax.set_ylim(y_lo, y_hi)
    for p in points:
        if not (x_lo <= p["x"] <= x_hi and x_lo <= p.get("mx", p["x"]) <= x_hi
                and (p["y"] is None or y_lo <= p["y"] <= y_hi)):
            p["off"] = True
        elif p["y"] is None:
            p["y"] = y_lo * (y_hi / y_lo) ** 0.025
    return points


def _scatter(ax, points: list[dict]) -> None:
    """Each point's marker; a measured intensity hollow, linked to its analytical point."""
    for p in points:
        if "mx" in p:  # measured intensity: hollow marker, dashed link to the analytical point
            ax.plot([p["x"], p["mx"]], [p["y"], p["y"]], ls="--", lw=0.8, color=p["c"], zorder=2)
            ax.scatter([p["mx"]], [p["y"]], s=p["s"], marker=p["m"], facecolors="none",
                       edgecolors=p["c"], linewidths=1.2, zorder=3)
        hollow = p.get("hollow") or p["m"] == "*"  # a star outlines, never hides, the points
        ax.scatter([p["x"]], [p["y"]], s=p["s"], marker=p["m"],
                   facecolors="none" if hollow else p["c"],
                   edgecolors=p["c"] if hollow else "white",
                   linewidths=1.6 if p["m"] == "*" else 1.4 if hollow else 0.6,
                   zorder=3 if p["whole"] else 5 if p.get("hollow") else 4, alpha=0.9)


def _titled(ax, panel: _Panel, chart: _Chart, device: str, points: list[dict]) -> list[dict]:
    """Title the panel; returns the points to label (in a small multiple or a crowded panel,
    each trace's largest)."""
    analyses, names = panel.analyses, panel.names
    if not panel.label_all:  # a small multiple: the trace names the panel
        ax.set_title(f"{names[0]}\non {device}", fontsize=8, y=TITLE_Y)
        return _largest(points, SMALL_MULTIPLE_LABELS)
    run = short_name(os.path.dirname(analyses[0].trace))
    what = (("rank(s) of " + run if run else "rank(s)")
            if names[0].startswith("rank ") and len(analyses) > 1 else "trace(s)")
    ax.set_title(chart.title or f"Roofline of {len(analyses)} {what} on {device}",
                 fontsize=11 if not chart.many else 9, y=TITLE_Y)
    if len(analyses) > 2:  # a pile of labels otherwise: each trace's largest operators
        per_trace = max(3, PANEL_LABELS // len(analyses) - 1)
        if sum(not p["whole"] for p in points) > per_trace * len(analyses):
            chart.declutter.add(per_trace)
            return [p for t in dict.fromkeys(p["trace"] for p in points)
                    for p in _largest([p for p in points if p["trace"] == t], per_trace)]
    return points


def _merge_labels(points: list[dict], what: str) -> list[dict]:
    """Points of several traces with one label at one spot (the same operator within
    2 x _COINCIDENT_DECADES on both axes) get one label, '<operator> (N traces)' in dark grey,
    instead of a pile of N labels in N colours. The markers are all drawn."""
    out: list[dict] = []
    for p in points:
        if p["y"] is None and not p["whole"]:
            out.append(p)
            continue
        twin = next((q for q in out if q["label"] == p["label"] and q["y"] is not None
                     and p["y"] is not None
                     and abs(math.log10(q["x"] / p["x"])) < 2 * _COINCIDENT_DECADES
                     and abs(math.log10(q["y"] / p["y"])) < 2 * _COINCIDENT_DECADES), None)
        if twin is None and p["y"] is None:
            twin = next((q for q in out if q["label"] == p["label"] and q["y"] is None
                         and abs(math.log10(q["x"] / p["x"])) < 2 * _COINCIDENT_DECADES), None)
        if twin is None:
            out.append(dict(p, n=1))
        else:
            twin["n"] = twin.get("n", 1) + 1
    for q in out:
        if q.get("n", 1) > 1:
            q["label"], q["c"] = f"{q['label']} ({q['n']} {what})", "0.25"
    return out


def _largest(points: list[dict], n: int) -> list[dict]:
    """The whole-model points and the `n` operator points with the most device time."""
    ranked = sorted((p for p in points if not p["whole"]), key=lambda p: -p["rank"])
    keep = {id(p) for p in ranked[:n]}
    return [p for p in points if p["whole"] or id(p) in keep]


def trace_labels(analyses: Sequence[Analysis]) -> list[str]:
    """How the chart names each trace: `rank 0`, `rank 1`, ... when the traces are the ranks of
    one run (ranks.rank_order: distributedInfo or the file name), else the file name's stem."""
    infos = [rank_info(a.trace, {"distributedInfo": a.distributed} if a.distributed else None)
             for a in analyses]
    try:
        ranked = rank_order(infos) is not None
    except InputError:  # two traces claim one rank: not a set of ranks
        ranked = False
    return ([f"rank {i.label}" for i in infos] if ranked
            else [short_name(a.trace) for a in analyses])


def _hollow_coincident(points: list[dict]) -> None:
    """A point of a later trace that would cover an earlier trace's point (within
    _COINCIDENT_DECADES on both axes) is drawn hollow, above it: both stay visible."""
    drawn: list[tuple[float, float, str]] = []
    for p in points:
        if p["whole"] or p["y"] is None:
            continue
        x, y = math.log10(p["x"]), math.log10(p["y"])
        if any(t != p["trace"] and abs(x - dx) < _COINCIDENT_DECADES
               and abs(y - dy) < _COINCIDENT_DECADES for dx, dy, t in drawn):
            p["hollow"] = True
        drawn.append((x, y, p["trace"]))


def _style(i: int, a: Analysis, phase: str) -> tuple[str, str]:
    """(colour, marker) of the i-th trace of a panel; a trace holding several phases marks
    each phase (decode o, prefill s) in its colour."""
    several = a.operators["phase"].nunique() > 1
    return (TRACE_COLOURS[i % len(TRACE_COLOURS)],
            PHASE_MARKERS.get(phase, "^") if several else TRACE_MARKERS[i % len(TRACE_MARKERS)])


def _points(analyses: Sequence[Analysis], skipped: dict[str, list[str]]) -> list[dict]:
    """Plottable operator and whole-model points; the operators that are not plottable are
    added to `skipped` (operator -> the traces they come from)."""
    points = []
    for i, a in enumerate(analyses):
        colour = TRACE_COLOURS[i % len(TRACE_COLOURS)]
        ops = a.operators[a.operators["layer"].isna()]
        for r in ops.itertuples():
            x, y = r.intensity, r.achieved_flops_per_s
            if not (pos(x) and pos(y)):
                if r.operator != Name.UNATTRIBUTED and r.flops == r.flops:
                    skipped.setdefault(r.operator, []).append(short_name(a.trace))
                continue
            share = r.time_share if pos(r.time_share) else 0.0
            p = {"x": float(x), "y": float(y), "c": colour, "m": _style(i, a, r.phase)[1],
                 "s": 25 + 600 * share, "label": r.operator, "whole": False, "rank": share,
                 "trace": i}
            mi = getattr(r, "measured_intensity", None)
            if pos(mi):
                p["mx"] = float(cast(SupportsFloat, mi))
            points.append(p)
        for phase, w in a.whole_by_phase.items():
            if (pos(w.get("intensity")) and pos(w.get("achieved_flops_per_s"))
                    and not w.get("withheld")):  # most time uncosted: no figure to draw
                label = "whole model" if len(a.whole_by_phase) == 1 else f"whole model ({phase})"
                points.append({"x": float(cast(SupportsFloat, w["intensity"])),
                               "y": float(cast(SupportsFloat, w["achieved_flops_per_s"])),
                               "c": colour, "m": "*", "s": 320, "whole": True, "rank": 2.0,
                               "label": label, "trace": i})
        for e in a.extrapolated_whole.values():  # no time: marked on the bottom edge
            if pos(e.get("intensity")):
                points.append({"x": float(e["intensity"]), "y": None, "c": colour, "m": "^",
                               "s": 110, "whole": True, "rank": 1.5, "hollow": True,
                               "label": f"{a.layers} layers: I = {e['intensity']:.3g}",
                               "trace": i})
    return points


def short_name(path: str) -> str:
    """A trace's file name without directories and trace suffixes (a model's part of a trace
    of several keeps its " [model i of n: ...]")."""
    path, part = split_part(path)
    name = os.path.basename(path.rstrip("/")) or path
    for suffix in (".gz", ".json", ".pt.trace"):
        name = name.removesuffix(suffix)
    return f"{name} [{part}]" if part else name


def pos(x: object) -> bool:
    try:
        v = float(x)  # type: ignore[arg-type]  # any object: what float() refuses raises
    except (TypeError, ValueError):
        return False
    return math.isfinite(v) and v > 0


def draw_roof(ax, hw: Hardware, peak: float, dtype: str) -> list:
    """Roof polyline, ridge line and their labels (returned: labels must not cover them)."""
    bw = hw.mem_bandwidth
    ridge = peak / bw
    (x_lo, x_hi), (y_lo, _) = ax.get_xlim(), ax.get_ylim()
    xs = np.array([x_lo, ridge, x_hi])
    ax.plot(xs, np.minimum(peak, xs * bw), color="black", lw=1.6, zorder=1)
    ax.axvline(ridge, color="0.4", ls=":", lw=1.0, zorder=1)
    texts = [
        ax.annotate(f"ridge I* = {ridge:.0f} FLOP/B", (ridge, y_lo), xytext=(-3, 6),
                    textcoords="offset points", rotation=90, ha="right", va="bottom",
                    fontsize=8, color="0.3"),
        ax.annotate(f"compute roof\n{si(peak, 'FLOP/s')} {dtype}", (x_hi, peak),
                    xytext=(-4, 4), textcoords="offset points", ha="right", va="bottom",
                    fontsize=8),
    ]
    # Memory-slope label a fifth of the way up the slope, just above it (nothing is attainable
    # there), rotated to match the slope on screen.
    x0 = math.exp(math.log(x_lo) + (math.log(ridge) - math.log(x_lo)) * 0.2)
    p0 = ax.transData.transform((x0, x0 * bw))
    p1 = ax.transData.transform((x0 * 2, x0 * 2 * bw))
    angle = math.degrees(math.atan2(p1[1] - p0[1], p1[0] - p0[0]))
    texts.append(ax.annotate(f"memory slope {si(bw, 'B/s')}", (x0, x0 * bw), xytext=(0, 6),
                             textcoords="offset points", rotation=angle,
                             rotation_mode="anchor", fontsize=8))
    return texts


# Where along the memory slope (fraction of its log length from the left edge to the ridge)
# its label may sit, tried in order: the first whose box covers no point wins.
_SLOPE_SPOTS = (0.2, 0.1, 0.3, 0.04, 0.4, 0.5, 0.6, 0.7, 0.8)


def place_slope_label(fig: Figure, ax, points: list[dict], roof_texts: list) -> None:
    """Move the memory-slope label (draw_roof's) along the slope to the first spot where it
    covers no marker (decode points near the roof sit right under its default spot), its
    angle recomputed for the frozen layout."""
    label = next((t for t in roof_texts if t.get_text().startswith("memory slope")), None)
    if label is None:
        return
    renderer = cast(FigureCanvasAgg, fig.canvas).get_renderer()  # the figures are drawn by Agg
    px_per_pt = fig.dpi / 72.0
    marks = []  # each marker's box, 2 pixels wider, and a margin of 6 (x0, y0, x1, y1 rows)
    for p in points:
        if p["y"] is None:
            continue
        cx, cy = ax.transData.transform((p["x"], p["y"]))
        r = math.sqrt(p["s"]) * px_per_pt / 2 + 2
        marks.append((cx - r, cy - r, cx + r, cy + r))
    margined = np.array(marks).reshape(-1, 4) + (-6, -6, 6, 6)
    (x_lo, _), bw = ax.get_xlim(), label.xy[1] / label.xy[0]
    ridge = next((ln.get_xdata()[0] for ln in ax.get_lines()[1:2]), None)
    if ridge is None or ridge <= x_lo:
        return
    frame = ax.get_window_extent(renderer)

    def put(frac: float) -> Bbox:
        x0 = math.exp(math.log(x_lo) + (math.log(ridge) - math.log(x_lo)) * frac)
        p0 = ax.transData.transform((x0, x0 * bw))
        p1 = ax.transData.transform((x0 * 2, x0 * 2 * bw))
        label.xy = (x0, x0 * bw)
        label.set_rotation(math.degrees(math.atan2(p1[1] - p0[1], p1[0] - p0[0])))
        return label.get_window_extent(renderer)

    for frac in _SLOPE_SPOTS:
        box = put(frac)
        # the rotated text is a band along its box's diagonal, not the whole box
        band = _densify(np.array([[box.x0, box.y0], [box.x1, box.y1]]))
        inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 <= frame.y1
        if inside and not _covering(margined, band).any():
            return
    put(_SLOPE_SPOTS[0])  # crowded everywhere: the default spot


def rate_formatter():
    from matplotlib.ticker import FuncFormatter

    def fmt(v: float, pos: int) -> str:
        for scale, unit in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M")):
            if v >= scale:
                return f"{v / scale:g} {unit}FLOP/s"
        return f"{v:g} FLOP/s"

    return FuncFormatter(fmt)


@dataclass(frozen=True)
class _Legend:
    """What a panel's legend shows besides its traces (`names`): measured links, a roof; and
    where: right of the axes (`outside`) or small in its upper left, without the trace's entry
    when the panel's title names it (`titled`)."""

    names: Sequence[str]
    measured: bool
    roof: bool
    outside: bool
    titled: bool


def _legend(ax, analyses: Sequence[Analysis], shown: _Legend) -> None:
    """Traces, phases of a mixed trace and symbols; to the right of the axes or, in a small
    multiple, small in its upper left, where nothing is attainable."""
    handles = []
    names, measured, roof, outside = shown.names, shown.measured, shown.roof, shown.outside
    for i, a in enumerate(analyses):
        phases = sorted(set(a.operators["phase"].dropna()))
        colour, marker = _style(i, a, phases[0] if phases else "unknown")
        handles.append(Line2D([], [], ls="", marker=marker, color=colour, markersize=8,
                              label=f"{names[i]} ({'/'.join(phases)})"))
    mixed = sorted({p for a in analyses if a.operators["phase"].nunique() > 1
                    for p in a.operators["phase"].dropna()})
    for phase in mixed:  # a trace holding several phases: its colour alone does not say which
        handles.append(Line2D([], [], ls="", marker=PHASE_MARKERS.get(phase, "^"), color="0.3",
                              markersize=7, label=phase))
    handles.append(Line2D([], [], ls="", marker="*", color="0.3", markersize=12,
                          markerfacecolor="none", label="whole model (ΣFLOPs/Σbytes)"))
    if any(a.extrapolated_whole for a in analyses):
        handles.append(Line2D([], [], ls="", marker="^", color="0.3", markerfacecolor="none",
                              markersize=8, label="extrapolated full model: intensity only"))
    if measured:
        handles.append(Line2D([], [], ls="--", marker="o", color="0.3", markerfacecolor="none",
                              label="measured DRAM bytes (ncu)"))
    if roof:
        handles.append(Line2D([], [], color="black", lw=1.6, label="roof: min(P, I·B)"))
    if outside:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8,
                  borderaxespad=0.0, framealpha=0.9)
    else:  # above the memory slope nothing is attainable: the upper left stays free of points
        # (a small multiple's title names its trace: no entry for it)
        ax.legend(handles=handles[1:] if shown.titled else handles, loc="upper left", fontsize=6,
                  framealpha=0.9)


@dataclass(frozen=True)
class Obstacles:
    """What labels must not cover besides the labelled points: texts already placed (`texts`,
    the roof's), unlabelled markers ({x, y, s}: the diff chart's A side) and polylines in data
    coordinates (its arrows)."""

    texts: list
    markers: Sequence[dict] = ()
    lines: Sequence[ArrayLike] = ()


@dataclass(frozen=True)
class _Room:
    """Where a label may go: inside `frame`, over none of the boxes `taken` or `marks` (rows of
    x0, y0, x1, y1, x0 <= x1 and y0 <= y1), crossing none of the sampled `lines` or `leaders`
    (display coordinates)."""

    frame: Bbox
    taken: np.ndarray
    marks: np.ndarray
    lines: np.ndarray
    leaders: np.ndarray


def place_labels(fig: Figure, ax, points: list[dict], obstacles: Obstacles) -> None:
    """Greedy placement: biggest points first, each label at the nearest candidate offset whose
    box overlaps no placed label, marker, roof line or roof text (`obstacles`), the legend or
    the axes edge; a leader line joins a label set away from its point. Where no spot is free,
    the candidate inside the axes with the fewest overlaps."""
    renderer = cast(FigureCanvasAgg, fig.canvas).get_renderer()  # the figures are drawn by Agg
    px_per_pt = fig.dpi / 72.0
    frame = ax.get_window_extent(renderer)
    taken, lines = _obstacle_boxes(ax, renderer, obstacles)
    centres = [ax.transData.transform((p["x"], p["y"])) for p in points]
    marks = _marker_boxes(ax, points, px_per_pt)
    others = _marker_boxes(ax, [p for p in obstacles.markers if p.get("y") is not None],
                           px_per_pt)
    order = sorted(range(len(points)), key=lambda i: -points[i]["rank"])
    leaders = np.empty((0, 2))  # the placed labels' leader lines: no later label covers one
    for i in order:
        p, (cx, cy) = points[i], centres[i]
        size = 8.5 if p["whole"] else 7.5
        text = ax.text(0, 0, p["label"], fontsize=size, weight="bold" if p["whole"] else None)
        ext = text.get_window_extent(renderer)
        text.remove()
        own = math.sqrt(p["s"]) / 2
        room = _Room(frame, taken, np.concatenate([np.delete(marks, i, axis=0), others]), lines,
                     leaders)
        dx, dy, ha, box = _spot((cx, cy), (ext.width, ext.height), own, px_per_pt, room)
        leaders = np.concatenate([leaders, _leader((cx, cy), box)[2:-2]])
        # Every label has a leader line to its point: a label between two points is never read
        # as the nearer one's.
        ax.annotate(p["label"], (p["x"], p["y"]), xytext=(dx, dy), textcoords="offset points",
                    ha=ha, va="center", fontsize=size, color=p["c"],
                    weight="bold" if p["whole"] else None, zorder=6,
                    arrowprops={"arrowstyle": "-", "color": p["c"], "lw": 0.6, "alpha": 0.7,
                                "shrinkA": 1, "shrinkB": own * 0.9})
        taken = np.concatenate([taken, box[None]])


def _obstacle_boxes(ax, renderer, obstacles: Obstacles) -> tuple[np.ndarray, np.ndarray]:
    """The boxes of the fixed texts and the legend (x0, y0, x1, y1 rows), and every line (roof,
    ridge, measured links, `obstacles.lines`) sampled densely in display space; a rotated text
    (the slope label) is a band along its box's diagonal, not its whole bounding box."""
    taken = [t.get_window_extent(renderer).padded(4) for t in obstacles.texts
             if not t.get_rotation()]
    legend = ax.get_legend()
    if legend:
        taken.append(legend.get_window_extent(renderer))
    segs = [_densify(ln.get_transform().transform(ln.get_xydata())) for ln in ax.get_lines()]
    segs += [_densify(ax.transData.transform(np.asarray(line, dtype=float)))
             for line in obstacles.lines]
    for t in obstacles.texts:
        if t.get_rotation() and 0 < t.get_rotation() < 90:
            b = t.get_window_extent(renderer)
            segs += [_densify(np.array([[b.x0, b.y0 + dy], [b.x1, b.y1 + dy]]))
                     for dy in (-9, -4.5, 0, 4.5, 9)]
    return (np.array([b.extents for b in taken]).reshape(-1, 4),
            np.concatenate(segs) if segs else np.empty((0, 2)))


def _marker_boxes(ax, points: Sequence[dict], px_per_pt: float) -> np.ndarray:
    """The display box of each point's marker ({x, y, s}), a pixel wider: x0, y0, x1, y1 rows."""
    return np.array([(cx - r, cy - r, cx + r, cy + r)
                     for p in points for cx, cy in [ax.transData.transform((p["x"], p["y"]))]
                     for r in [math.sqrt(p["s"]) * px_per_pt / 2 + 1]]).reshape(-1, 4)


def _spot(centre: tuple[float, float], extent: tuple[float, float], own: float,
          px_per_pt: float, room: _Room) -> tuple[float, float, str, np.ndarray]:
    """(dx, dy in points, alignment, box: x0, y0, x1, y1) of a label `extent` wide and high for
    a marker of radius `own` at `centre`: the nearest free candidate, else the fewest clashes
    inside the axes, else to the right. Every candidate's clashes but its leader's are counted
    at once; the leader's (a placed label it crosses), only where the rest leave it free."""
    (cx, cy), (w, h), frame = centre, extent, room.frame
    offsets, boxes = _candidates(centre, extent, own, px_per_pt)
    inside = np.flatnonzero((frame.x0 <= boxes[:, 0]) & (boxes[:, 2] <= frame.x1)
                            & (frame.y0 <= boxes[:, 1]) & (boxes[:, 3] <= frame.y1))
    clashes = (_overlapping(boxes, room.taken) + _overlapping(boxes, room.marks)
               + _covering(boxes, room.lines) + _covering(boxes, room.leaders))
    for k in inside[clashes[inside] == 0]:
        if not _covering(room.taken, _leader(centre, boxes[k])).any():
            return (*offsets[k], boxes[k])
    if len(inside):  # crowded everywhere: the fewest overlaps (the nearest of those)
        total = [clashes[k] + _covering(room.taken, _leader(centre, boxes[k])).sum()
                 for k in inside]
        k = inside[int(np.argmin(total))]
        return (*offsets[k], boxes[k])
    dx = _RADII[0] + own  # no spot inside the axes at all: to the right
    x0 = cx + dx * px_per_pt
    return dx, 0.0, "left", np.array([x0, cy - h / 2, x0 + w, cy + h / 2])


def _candidates(centre: tuple[float, float], extent: tuple[float, float], own: float,
                px_per_pt: float) -> tuple[list[tuple[float, float, str]], np.ndarray]:
    """Each candidate spot of a label, nearest first: its offset (dx, dy in points, alignment)
    and its box (x0, y0, x1, y1 rows, a pixel wider than the label)."""
    (cx, cy), (w, h) = centre, extent
    dx = (_DIRECTIONS[:, 0] + own) * _DIRECTIONS[:, 1]
    dy = (_DIRECTIONS[:, 0] + own) * _DIRECTIONS[:, 2]
    ha = np.where(dx > 1, "left", np.where(dx < -1, "right", "center"))
    x0 = cx + dx * px_per_pt - np.where(dx > 1, 0, np.where(dx < -1, w, w / 2))
    y0 = cy + dy * px_per_pt - h / 2
    return ([(float(a), float(b), str(c)) for a, b, c in zip(dx, dy, ha, strict=True)],
            np.stack([x0 - 1, y0 - 1, x0 + w + 1, y0 + h + 1], axis=1))


def _leader(centre: tuple[float, float], box: np.ndarray) -> np.ndarray:
    """A label's leader line, sampled: from its point (`centre`) to its box's centre."""
    return np.linspace(centre, ((box[0] + box[2]) / 2, (box[1] + box[3]) / 2), 24)


def _overlapping(boxes: np.ndarray, others: np.ndarray) -> np.ndarray:
    """How many of `others` each of `boxes` overlaps, edges touching included (x0, y0, x1, y1
    rows, as Bbox.overlaps)."""
    b, o = boxes[:, None, :], others[None, :, :]
    return ((b[..., 0] <= o[..., 2]) & (o[..., 0] <= b[..., 2])
            & (b[..., 1] <= o[..., 3]) & (o[..., 1] <= b[..., 3])).sum(axis=1)


def _covering(boxes: np.ndarray, pts: np.ndarray) -> np.ndarray:
    """Whether each of `boxes` (x0, y0, x1, y1 rows) holds any of the points `pts`."""
    if len(boxes) and len(pts):  # only the points near the boxes are compared with each one
        pts = pts[(pts[:, 0] >= boxes[:, 0].min()) & (pts[:, 0] <= boxes[:, 2].max())
                  & (pts[:, 1] >= boxes[:, 1].min()) & (pts[:, 1] <= boxes[:, 3].max())]
    b, p = boxes[:, None, :], pts[None, :, :]
    return np.any((p[..., 0] >= b[..., 0]) & (p[..., 0] <= b[..., 2])
                  & (p[..., 1] >= b[..., 1]) & (p[..., 1] <= b[..., 3]), axis=1)


def _densify(pts: np.ndarray, step: float = 3.0) -> np.ndarray:
    """Points every `step` pixels along a display-space polyline."""
    out = [pts[:1]]
    for a, b in zip(pts[:-1], pts[1:], strict=True):
        n = max(int(np.hypot(*(b - a)) / step), 1)
        out.append(a + (b - a) * np.linspace(0, 1, n + 1)[1:, None])
    return np.concatenate(out)


# Operators drawn in their own colour in the projection's stacked bars; the rest are "other".
PROJECTION_OPERATORS = 8


def projection_figure(points: pd.DataFrame, operators: pd.DataFrame, swept: str, *,
                      title: str | None = None) -> Figure:
    """`trace-roofline project`'s chart from its tables (project.POINT_COLUMNS, OPERATOR_COLUMNS):
    step, device and host ms and tokens/s against the `swept` column, the measured point ringed;
    beside it each point's device time stacked by operator (the largest PROJECTION_OPERATORS)."""
    order = points.sort_values(swept, kind="stable").index.to_numpy()
    pts = points.loc[order]
    numeric = swept != "hardware"
    x = pts[swept].to_numpy(float) if numeric else np.arange(len(pts), dtype=float)
    fig = Figure(figsize=(13.0, 5.0), dpi=150)
    fig.set_layout_engine("constrained")
    FigureCanvasAgg(fig)
    ax, bars = fig.subplots(1, 2)
    ax.plot(x, pts["step_ms"], "-o", color="#1f77b4", label="step (max of host, device)")
    ax.plot(x, pts["device_ms"], "--", color="#2ca02c", label="device (kernels)")
    ax.plot(x, pts["host_ms"], ":", color="#7f7f7f", label="host (issue)")
    own = pts["measured"].to_numpy(bool)
    ax.scatter(x[own], pts.loc[own, "step_ms"], s=160, facecolors="none", edgecolors="#d62728",
               linewidths=2, zorder=5, label="measured point")
    rate = ax.twinx()
    rate.plot(x, pts["tokens_per_s"], "-s", color="#ff7f0e", label="tokens/s")
    rate.set_ylabel("tokens/s")
    ax.set_ylabel("ms per step")
    if numeric and pts[swept].min() > 0 and len(pts) > 1:
        ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(v) for v in pts[swept]])
    ax.set_xlabel(swept)
    handles = ax.get_legend_handles_labels()[0] + rate.get_legend_handles_labels()[0]
    ax.legend(handles=handles, fontsize=8, loc="upper left")
    ax.set_title("step time and throughput", fontsize=10)
    ops = operators.assign(ms=operators["time_us"] / 1e3)
    top = ops.groupby("operator")["ms"].sum().sort_values(ascending=False, kind="stable")
    named = list(top.index[:PROJECTION_OPERATORS])
    ops["name"] = ops["operator"].where(ops["operator"].isin(named), Name.OTHER)
    table = ops.pivot_table(index="point", columns="name", values="ms", aggfunc="sum",
                            fill_value=0.0).reindex(order)
    pos = np.arange(len(order))
    bottom = np.zeros(len(order))
    colours = [*TRACE_COLOURS, "#17becf", "#bcbd22", "#e377c2", "#7f7f7f"]
    for i, name in enumerate([*named, *([Name.OTHER] if Name.OTHER in table else [])]):
        share = table[name].to_numpy(float) / np.maximum(table.sum(axis=1).to_numpy(float), 1e-12)
        bars.bar(pos, share * 100.0, bottom=bottom, color=colours[i % len(colours)], label=name)
        bottom += share * 100.0
    bars.set_xticks(pos, [f"{v}{' *' if m else ''}" for v, m in
                          zip(pts[swept], pts["measured"], strict=True)])
    bars.set_xlabel(f"{swept} (* measured)")
    bars.set_ylabel("% of device time")
    bars.set_title("device time by operator", fontsize=10)
    bars.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    if title:
        fig.suptitle(title, fontsize=11)
    return fig
