"""The roofline chart: every operator of one or more traces on its device's roofline.

Log-log axes: the memory slope I·B_mem and the compute roof P meet at the ridge I* = P/B_mem.
Each trace is drawn under its own hardware: one panel per hardware (a CPU trace and an H200
trace are never drawn under one roof), titled with that hardware's ceilings; a hardware with
more than `MAX_TRACES_PER_PANEL` traces gets small multiples, one panel per trace.
One point per operator (aggregated over layers and steps) at (intensity, achieved FLOP/s); a
colour and a marker per trace (a trace holding several phases marks them decode o, prefill s),
marker area by share of device time; a hollow star per trace and phase for the whole model
(ΣFLOPs/Σbytes of the phase), drawn under the operator points so none is hidden; a hollow
triangle on the bottom edge for the intensity of the model extrapolated to its full depth (it
has no measured time). Measured DRAM bytes (ncu), when present, add a hollow marker at the
measured intensity joined to the analytical point. Labels are placed greedily so none overlap,
each joined to its point by a leader line; the legend sits outside the axes. Returns a Figure
(Agg canvas); never shows or saves it.
"""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.transforms import Bbox

from trace_roofline.model.hardware import Hardware
from trace_roofline.roofline import Analysis, hardware_summary

PHASE_MARKERS = {"decode": "o", "prefill": "s", "unknown": "^"}
TRACE_COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
TRACE_MARKERS = ["o", "s", "D", "v", "P", "X"]
MAX_TRACES_PER_PANEL = len(TRACE_COLOURS)  # more traces of one hardware: one panel per trace
SMALL_MULTIPLE_LABELS = 4  # operators labelled per small-multiple panel (the largest by time)
# Label offsets tried around a point, nearest first (points; angle 0 = right of the point).
_RADII = (7, 16, 28, 42, 58, 76, 96, 120)
_ANGLES = (0, 180, 35, -35, 145, -145, 90, -90, 60, -60, 120, -120)


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
    fig.set_layout_engine("constrained", rect=(0, 0.045, 1, 0.955))  # room for the notes
    FigureCanvasAgg(fig)
    placed, skipped = [], {}
    for i, (hw, group, label_all) in enumerate(panels):
        ax = fig.add_subplot(rows, cols, i + 1)
        points, roof_texts = _draw_panel(ax, group, hw, skipped, label_all, many=len(panels) > 1,
                                         title=title)
        placed.append((ax, points, roof_texts))
    fig.draw_without_rendering()
    fig.set_layout_engine("none")  # freeze the layout the labels are placed in
    for ax, points, roof_texts in placed:
        place_labels(fig, ax, points, roof_texts)
    notes = []
    many = len(analyses) > 1
    tags = [op if not many else f"{op} ({len(t)} traces)" if len(t) > 1 else f"{op} ({t[0]})"
            for op, t in skipped.items()]
    if tags:
        notes.append("not on the log axes (0 FLOPs or no time): " + ", ".join(tags))
    c = analyses[0].conventions
    notes.append(f"conventions: --causal {c['causal']}, --attention-bytes {c['attention_bytes']};"
                 " marker area ∝ share of the trace's device time")
    text = "\n".join(textwrap.fill(n, 200) for n in notes)
    fig.text(0.01, 0.005, text, fontsize=7, color="0.3", ha="left", va="bottom")
    return fig


def _panels(analyses: Sequence[Analysis], hardware: Hardware | None
            ) -> list[tuple[Hardware | None, list[Analysis], bool]]:
    """(hardware, analyses, label every operator) per panel: analyses grouped by the hardware
    they are placed under, in order of first appearance; a group of more than
    MAX_TRACES_PER_PANEL traces split into one panel per trace, labelling its largest operators."""
    groups: dict[object, tuple[Hardware | None, list[Analysis]]] = {}
    for a in analyses:
        hw = hardware or a.hardware
        groups.setdefault(None if hw is None else (hw.name, hw.mem_bandwidth,
                                                   tuple(sorted(hw.peak_flops.items()))),
                          (hw, []))[1].append(a)
    panels = []
    for hw, group in groups.values():
        if len(group) > MAX_TRACES_PER_PANEL:
            panels += [(hw, [a], False) for a in group]
        else:
            panels.append((hw, group, True))
    return panels


def _draw_panel(ax, analyses: list[Analysis], hw: Hardware | None, skipped: dict,
                label_all: bool, many: bool, title: str | None) -> tuple[list[dict], list]:
    """One panel: roof, points, axes and legend; returns the points to label and the roof texts."""
    ax.set_xscale("log")
    ax.set_yscale("log")
    points = _points(analyses, skipped)
    summary = hardware_summary(analyses[0], hw)
    peak = summary["peak_flops_per_s"] if summary else None
    xs = [p["x"] for p in points] + [p.get("mx", p["x"]) for p in points]
    ys = [p["y"] for p in points if p["y"] is not None]
    ridge = peak / hw.mem_bandwidth if hw and peak else None
    x_lo = min(xs + ([ridge] if ridge else [])) / 4 if xs else 0.01
    x_hi = max(xs + ([ridge] if ridge else [])) * 10 if xs else 1e4
    y_hi = max(ys + ([peak] if peak else [])) * 4 if ys else 1e15
    y_lo = min(ys) / 6 if ys else 1e9
    ax.set_xlim(x_lo, x_hi)
    ax.set_ylim(y_lo, y_hi)
    for p in points:  # intensity-only points sit just above the bottom edge
        if p["y"] is None:
            p["y"] = y_lo * (y_hi / y_lo) ** 0.025
    roof_texts = draw_roof(ax, hw, peak, summary["dtype"]) if hw is not None and peak else []
    for p in points:
        if "mx" in p:  # measured intensity: hollow marker, dashed link to the analytical point
            ax.plot([p["x"], p["mx"]], [p["y"], p["y"]], ls="--", lw=0.8, color=p["c"], zorder=2)
            ax.scatter([p["mx"]], [p["y"]], s=p["s"], marker=p["m"], facecolors="none",
                       edgecolors=p["c"], linewidths=1.2, zorder=3)
        hollow = p.get("hollow") or p["m"] == "*"  # a star outlines, never hides, the points
        ax.scatter([p["x"]], [p["y"]], s=p["s"], marker=p["m"],
                   facecolors="none" if hollow else p["c"],
                   edgecolors=p["c"] if hollow else "white",
                   linewidths=1.6 if p["m"] == "*" else 1.2 if hollow else 0.6,
                   zorder=3 if p["whole"] else 4, alpha=0.9)
    ax.set_xlabel("arithmetic intensity (FLOP / byte, analytical minimum bytes)")
    ax.set_ylabel("achieved FLOP/s (analytical FLOPs / measured time)")
    ax.yaxis.set_major_formatter(rate_formatter())
    ax.grid(True, which="major", alpha=0.3)
    ax.grid(True, which="minor", alpha=0.08)
    device = (f"{hw.name}: {peak / 1e12:.0f} TFLOP/s {summary['dtype']}, "
              f"{hw.mem_bandwidth / 1e12:.2f} TB/s" if hw is not None and peak
              else "no device given (no roofs: pass --hardware)")
    if not label_all:  # a small multiple: the trace names the panel
        a = analyses[0]
        ax.set_title(f"{short_name(a.trace)}\non {device}", fontsize=8)
        ranked = sorted((p for p in points if not p["whole"]), key=lambda p: -p["rank"])
        keep = {id(p) for p in ranked[:SMALL_MULTIPLE_LABELS]}
        points = [p for p in points if p["whole"] or id(p) in keep]
    else:
        ax.set_title(title or f"Roofline of {len(analyses)} trace(s) on {device}",
                     fontsize=11 if not many else 9)
    _legend(ax, analyses, any("mx" in p for p in points), bool(roof_texts), outside=label_all)
    return points, roof_texts


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
                if r.operator != "unattributed" and r.flops == r.flops:
                    skipped.setdefault(r.operator, []).append(short_name(a.trace))
                continue
            share = r.time_share if pos(r.time_share) else 0.0
            p = {"x": float(x), "y": float(y), "c": colour, "m": _style(i, a, r.phase)[1],
                 "s": 25 + 600 * share, "label": r.operator, "whole": False, "rank": share}
            mi = getattr(r, "measured_intensity", None)
            if pos(mi):
                p["mx"] = float(mi)
            points.append(p)
        for phase, w in a.whole_by_phase.items():
            if (pos(w.get("intensity")) and pos(w.get("achieved_flops_per_s"))
                    and not w.get("withheld")):  # most time uncosted: no figure to draw
                label = "whole model" if len(a.whole_by_phase) == 1 else f"whole model ({phase})"
                points.append({"x": float(w["intensity"]), "y": float(w["achieved_flops_per_s"]),
                               "c": colour, "m": "*", "s": 320, "whole": True, "rank": 2.0,
                               "label": label})
        for e in a.extrapolated_whole.values():  # no time: marked on the bottom edge
            if pos(e.get("intensity")):
                points.append({"x": float(e["intensity"]), "y": None, "c": colour, "m": "^",
                               "s": 110, "whole": True, "rank": 1.5, "hollow": True,
                               "label": f"{a.layers} layers: I = {e['intensity']:.3g}"})
    return points


def short_name(path: str) -> str:
    """A trace's file name without directories and trace suffixes."""
    name = os.path.basename(path.rstrip("/")) or path
    for suffix in (".gz", ".json", ".pt.trace"):
        name = name.removesuffix(suffix)
    return name


def pos(x: object) -> bool:
    try:
        v = float(x)  # type: ignore[arg-type]
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
        ax.annotate(f"compute roof\n{peak / 1e12:.0f} TFLOP/s {dtype}", (x_hi, peak),
                    xytext=(-4, 4), textcoords="offset points", ha="right", va="bottom",
                    fontsize=8),
    ]
    # Memory-slope label a fifth of the way up the slope, just above it (nothing is attainable
    # there), rotated to match the slope on screen.
    x0 = math.exp(math.log(x_lo) + (math.log(ridge) - math.log(x_lo)) * 0.2)
    p0 = ax.transData.transform((x0, x0 * bw))
    p1 = ax.transData.transform((x0 * 2, x0 * 2 * bw))
    angle = math.degrees(math.atan2(p1[1] - p0[1], p1[0] - p0[0]))
    texts.append(ax.annotate(f"memory slope {bw / 1e12:.2f} TB/s", (x0, x0 * bw), xytext=(0, 6),
                             textcoords="offset points", rotation=angle,
                             rotation_mode="anchor", fontsize=8))
    return texts


def rate_formatter():
    from matplotlib.ticker import FuncFormatter

    def fmt(v: float, pos: int) -> str:
        for scale, unit in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M")):
            if v >= scale:
                return f"{v / scale:g} {unit}FLOP/s"
        return f"{v:g} FLOP/s"

    return FuncFormatter(fmt)


def _legend(ax, analyses: Sequence[Analysis], measured: bool, roof: bool,
            outside: bool = True) -> None:
    """Traces, phases of a mixed trace and symbols; to the right of the axes (`outside`) or,
    in a small multiple, small in its upper left, where nothing is attainable."""
    handles = []
    for i, a in enumerate(analyses):
        phases = sorted(set(a.operators["phase"].dropna()))
        colour, marker = _style(i, a, phases[0] if phases else "unknown")
        handles.append(Line2D([], [], ls="", marker=marker, color=colour, markersize=8,
                              label=f"{short_name(a.trace)} ({'/'.join(phases)})"))
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
        ax.legend(handles=handles[1:], loc="upper left", fontsize=6, framealpha=0.9)


def place_labels(fig: Figure, ax, points: list[dict], fixed: list) -> None:
    """Greedy placement: biggest points first, each label at the nearest candidate offset whose
    box overlaps no placed label, marker, roof line or roof text, the legend or the axes edge;
    a leader line joins a label set away from its point."""
    renderer = fig.canvas.get_renderer()
    px_per_pt = fig.dpi / 72.0
    frame = ax.get_window_extent(renderer)
    legend = ax.get_legend()
    taken: list[Bbox] = [t.get_window_extent(renderer).padded(4) for t in fixed
                         if not t.get_rotation()]
    if legend:
        taken.append(legend.get_window_extent(renderer))
    n_fixed = len(taken)  # leader lines must not cross these (roof texts, legend)
    # Every line (roof, ridge, measured links), sampled densely in display space; a rotated
    # text (the slope label) is a band along its box's diagonal, not its whole bounding box.
    segs = [_densify(ln.get_transform().transform(ln.get_xydata())) for ln in ax.get_lines()]
    for t in fixed:
        if t.get_rotation() and 0 < t.get_rotation() < 90:
            b = t.get_window_extent(renderer)
            segs += [_densify(np.array([[b.x0, b.y0 + dy], [b.x1, b.y1 + dy]]))
                     for dy in (-9, -4.5, 0, 4.5, 9)]
    lines = np.concatenate(segs) if segs else np.empty((0, 2))
    centres = [ax.transData.transform((p["x"], p["y"])) for p in points]
    marks = [Bbox.from_extents(cx - r, cy - r, cx + r, cy + r)
             for (cx, cy), p in zip(centres, points, strict=True)
             for r in [math.sqrt(p["s"]) * px_per_pt / 2 + 1]]
    order = sorted(range(len(points)), key=lambda i: -points[i]["rank"])
    for i in order:
        p, (cx, cy) = points[i], centres[i]
        size = 8.5 if p["whole"] else 7.5
        text = ax.text(0, 0, p["label"], fontsize=size, weight="bold" if p["whole"] else None)
        ext = text.get_window_extent(renderer)
        text.remove()
        w, h = ext.width, ext.height
        own = math.sqrt(p["s"]) / 2
        best = None
        for radius in _RADII:
            for angle in _ANGLES:
                dx = (radius + own) * math.cos(math.radians(angle))
                dy = (radius + own) * math.sin(math.radians(angle))
                ha = "left" if dx > 1 else "right" if dx < -1 else "center"
                x0 = cx + dx * px_per_pt - {"left": 0, "right": w, "center": w / 2}[ha]
                y0 = cy + dy * px_per_pt - h / 2
                box = Bbox.from_extents(x0 - 1, y0 - 1, x0 + w + 1, y0 + h + 1)
                inside = (frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0
                          and box.y1 <= frame.y1)
                leader = np.linspace((cx, cy), ((box.x0 + box.x1) / 2, (box.y0 + box.y1) / 2), 24)
                if (inside and not any(box.overlaps(b) for b in taken)
                        and not any(box.overlaps(m) for j, m in enumerate(marks) if j != i)
                        and not _crosses(box, lines)
                        and not any(_crosses(b, leader) for b in taken[:n_fixed])):
                    best = (dx, dy, ha, box)
                    break
            if best:
                break
        if best is None:  # crowded everywhere: the farthest spot to the right
            dx = (_RADII[-1] + own)
            x0 = cx + dx * px_per_pt
            best = (dx, 0.0, "left", Bbox.from_extents(x0, cy - h / 2, x0 + w, cy + h / 2))
        dx, dy, ha, box = best
        # Every label has a leader line to its point: a label between two points is never read
        # as the nearer one's.
        ax.annotate(p["label"], (p["x"], p["y"]), xytext=(dx, dy), textcoords="offset points",
                    ha=ha, va="center", fontsize=size, color=p["c"],
                    weight="bold" if p["whole"] else None, zorder=6,
                    arrowprops={"arrowstyle": "-", "color": p["c"], "lw": 0.6, "alpha": 0.7,
                                "shrinkA": 1, "shrinkB": own * 0.9})
        taken.append(box)


def _densify(pts: np.ndarray, step: float = 3.0) -> np.ndarray:
    """Points every `step` pixels along a display-space polyline."""
    out = [pts[:1]]
    for a, b in zip(pts[:-1], pts[1:], strict=True):
        n = max(int(np.hypot(*(b - a)) / step), 1)
        out.append(a + (b - a) * np.linspace(0, 1, n + 1)[1:, None])
    return np.concatenate(out)


def _crosses(box: Bbox, pts: np.ndarray) -> bool:
    return bool(np.any((pts[:, 0] >= box.x0) & (pts[:, 0] <= box.x1)
                       & (pts[:, 1] >= box.y0) & (pts[:, 1] <= box.y1)))
