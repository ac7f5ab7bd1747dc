"""report.html: one self-contained page (no network at view time) with the interactive roofline,
the operator table (sortable), the reconciliation and the warnings of one or more analyses.

Design notes: docs/design.md ("trace_roofline/outputs/html_report.py").
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, SupportsFloat, SupportsInt, cast

import pandas as pd

from trace_roofline.costs.calculator import si
from trace_roofline.outputs.plot import TRACE_COLOURS, axis_points, panel_groups, short_name
from trace_roofline.outputs.text import (
    duration,
    evidence_text,
    headroom_lines,
    roofline_step_line,
)
from trace_roofline.roofline import Analysis, hardware_summary

if TYPE_CHECKING:
    from bokeh.models.renderers import DataRenderer

_MARKERS = {"decode": "circle", "prefill": "square", "unknown": "triangle"}
_HOVER = [("operator", "@operator"), ("trace", "@trace"), ("phase", "@phase"),
          ("layer", "@layer"), ("shape", "@shape"), ("time", "@time_text"),
          ("intensity", "@intensity{0.00} FLOP/B"), ("achieved", "@achieved_text"),
          ("% of roof", "@pct{0.0} %"), ("bound", "@bound"), ("evidence", "@evidence"),
          ("derivation", "@derivation")]
# (header, column, format) of the operator table: a format string, or a function of the value
# (SI-scaled units, as the terminal's); the cell's data-v keeps the exact value for sorting.
_Format = str | Callable[[object], str]
_TABLE: list[tuple[str, str, _Format]] = [
    ("trace", "trace", "{}"), ("phase", "phase", "{}"), ("operator", "operator", "{}"),
    ("kernels", "kernels", "{:d}"), ("time", "time_us", duration),
    ("time %", "time_pct", lambda v: _one_decimal(v)), ("FLOPs", "flops", lambda v: si(v, "FLOP")),
    ("bytes", "bytes", lambda v: si(v, "B")), ("FLOP/B", "intensity", "{:.2f}"),
    ("FLOP/s", "achieved_flops_per_s", lambda v: si(v, "FLOP/s")),
    ("B/s", "achieved_bytes_per_s", lambda v: si(v, "B/s")), ("% roof", "pct", lambda v: _one_decimal(v)),
    ("bound", "bound", "{}"), ("shape", "shape", "{}"), ("evidence", "evidence", "{}"),
    ("derivation", "derivation", "{}")]


def _one_decimal(v: object) -> str:
    """A percentage to one decimal; one that is not zero but rounds to it is `<0.1`, never
    `0.0` or `-0.0`."""
    x = float(cast(SupportsFloat, v))
    text = f"{x:.1f}"
    return text if float(text) != 0 else "0.0" if x == 0 else "<0.1" if x > 0 else ">-0.1"


_SORT_JS = """
document.querySelectorAll("table.sortable th").forEach((th, col) => th.addEventListener("click", () => {
  const body = th.closest("table").tBodies[0], up = th.dataset.dir !== "asc";
  th.closest("tr").querySelectorAll("th").forEach(h => delete h.dataset.dir);
  th.dataset.dir = up ? "asc" : "desc";
  const key = td => { const v = td.dataset.v ?? td.textContent; const n = parseFloat(v);
                      return isNaN(n) ? v : n; };
  [...body.rows].sort((a, b) => { const x = key(a.cells[col]), y = key(b.cells[col]);
      return (x < y ? -1 : x > y ? 1 : 0) * (up ? 1 : -1); }).forEach(r => body.appendChild(r));
}));
"""
_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; font-size: 13px; margin-bottom: 1.5em; }
th, td { padding: 2px 8px; border-bottom: 1px solid #ddd; text-align: right; white-space: nowrap; }
th { cursor: pointer; background: #f4f4f4; position: sticky; top: 0; }
th[data-dir=asc]::after { content: " ▲"; } th[data-dir=desc]::after { content: " ▼"; }
td.t, th.t { text-align: left; } .warn { color: #a40000; } .muted { color: #666; }
"""


def _evidence(a: Analysis) -> pd.Series:
    """(phase, operator) -> how the operator was named: every evidence with its share of the
    operator's time (`evidence_mix` "annotation 0.97, position 0.03" as "annotation 97%,
    position 3%")."""
    rows = a.operators[a.operators["layer"].isna()]
    mix = rows["evidence_mix"].map(lambda m: evidence_text(m) if isinstance(m, str) else None)
    return pd.Series(mix.to_numpy(), index=pd.MultiIndex.from_frame(rows[["phase", "operator"]]),
                     dtype=object)


def _shapes(a: Analysis) -> pd.Series:
    """(phase, operator) -> the shape of the instances holding most of its time (+ n others)."""
    c = a.costed.dropna(subset=["shape"])
    t = c.groupby(["phase", "operator", "shape"])["time_us"].sum().reset_index()
    t = t.sort_values("time_us", ascending=False, kind="stable")
    n = t.groupby(["phase", "operator"])["shape"].transform("size")
    more = (" (+" + (n - 1).astype(str).astype(object) + " more)").where(n > 1, "")
    t["label"] = t["shape"].astype(str).astype(object) + more
    return t.drop_duplicates(["phase", "operator"]).set_index(["phase", "operator"])["label"]


def operator_rows(analyses: Sequence[Analysis]) -> pd.DataFrame:
    """The aggregated operator rows of every analysis with the columns the page shows, plus one
    `whole model` row per (trace, phase) (column `whole` True)."""
    parts = []
    for a in analyses:
        ops = a.operators[a.operators["layer"].isna()]
        key = pd.MultiIndex.from_frame(ops[["phase", "operator"]])
        ev, sh = _evidence(a), _shapes(a)
        rows = pd.DataFrame({
            "trace": short_name(a.trace), "phase": ops["phase"].to_numpy(),
            "operator": ops["operator"].to_numpy(), "kernels": ops["kernels"].to_numpy(),
            "time_us": ops["time_us"].to_numpy(), "time_pct": 100 * ops["time_share"].to_numpy(),
            "flops": ops["flops"].to_numpy(), "bytes": ops["bytes"].to_numpy(),
            "intensity": ops["intensity"].to_numpy(),
            "achieved_flops_per_s": ops["achieved_flops_per_s"].to_numpy(),
            "achieved_bytes_per_s": ops["achieved_bytes_per_s"].to_numpy(),
            "pct": ops["pct_of_roof"].to_numpy(), "bound": ops["bound"].to_numpy(),
            "shape": sh.reindex(key).to_numpy(),
            "evidence": ev.reindex(key).to_numpy(), "derivation": ops["derivation"].to_numpy(),
            "whole": False, "layer": "all"})
        whole = pd.DataFrame([{
            "trace": short_name(a.trace), "phase": p, "operator": "whole model",
            "kernels": w["kernels"], "time_us": w["time_us"], "time_pct": 100.0,
            "flops": w["flops"], "bytes": w["bytes"], "intensity": w["intensity"],
            "achieved_flops_per_s": w["achieved_flops_per_s"],
            "achieved_bytes_per_s": w["achieved_bytes_per_s"], "pct": w.get("pct_of_roof"),
            "bound": w.get("bound"), "shape": "ΣFLOPs / Σbytes", "evidence": "sum of the rows",
            "derivation": "sum of the rows" + (
                f" but {', '.join(cast('dict[str, float]', w['excluded']))} (above roof)"
                if w.get("excluded") else ""),
            "whole": True, "layer": "all"} for p, w in a.whole_by_phase.items()
            if not w.get("withheld")])  # most time uncosted: no whole-model figure
        parts += [rows, whole]
    out = pd.concat(parts, ignore_index=True)
    out["evidence"] = out["evidence"].fillna("not recorded")
    out["derivation"] = out["derivation"].fillna("unknown")
    out["shape"] = out["shape"].fillna("-")
    out["time_text"] = out["time_us"].map(duration)
    out["achieved_text"] = out["achieved_flops_per_s"].map(lambda v: si(v, "FLOP/s"))
    return out


def _charts(analyses: Sequence[Analysis], rows: pd.DataFrame):
    """One chart per roof (`plot.panel_groups`), stacked: a Bokeh layout."""
    from bokeh.layouts import column

    # a trace keeps its colour across the charts
    styles = trace_styles(list(dict.fromkeys(rows["trace"])))
    charts = [_chart(hw_analyses, rows, styles) for _, _, hw_analyses in panel_groups(analyses)]
    return charts[0] if len(charts) == 1 else column(*charts)


def trace_styles(names: Sequence[str]) -> dict[str, tuple[str, bool]]:
    """name -> (colour, hollow) of each trace, no two alike (the marker says the phase): the
    PNG chart's six colours first, then the rest of Category10's, then Category20's light
    shades; past 20 traces Turbo's, and past 256 the same colours hollow."""
    from bokeh.palettes import Category10, Category20, turbo

    n = len(names)
    ten = [*TRACE_COLOURS, *(c for c in Category10[10] if c not in TRACE_COLOURS)]
    palette = ([*ten, *Category20[20][1::2]] if n <= 20 else list(turbo(min(n, 256))))
    return {name: (palette[i % len(palette)], i >= len(palette)) for i, name in enumerate(names)}


# Ticks of the FLOP/s axis with their unit, as the PNG chart's (plot.rate_formatter).
_RATE_TICKS = """
for (const [scale, unit] of [[1e15, "P"], [1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]])
  if (tick >= scale) return Number((tick / scale).toPrecision(3)) + " " + unit + "FLOP/s";
return Number(tick.toPrecision(3)) + " FLOP/s";
"""


def _chart(analyses: Sequence[Analysis], rows: pd.DataFrame,
           styles: dict[str, tuple[str, bool]]):
    """The chart of the analyses under one roof (the first one's hardware and dtype)."""
    from bokeh.models import ColumnDataSource, CustomJSTickFormatter, HoverTool
    from bokeh.models.annotations import Label, Legend, Span  # not re-exported by bokeh.models' stubs
    from bokeh.plotting import figure

    hw = hardware_summary(analyses[0])
    mine = {short_name(a.trace) for a in analyses}
    rows = rows[rows["trace"].isin(mine)]
    plotted = rows[(rows["intensity"] > 0) & (rows["achieved_flops_per_s"] > 0)]
    # The axes span the points that hold time (a 0.0% row far off does not stretch them: it
    # stays in the data, a pan or zoom away) and the ridge.
    span = plotted[axis_points(plotted["time_pct"].fillna(0) / 100, plotted["whole"])]
    xs = span["intensity"].tolist() + ([hw["ridge"]] if hw else [])
    ys = span["achieved_flops_per_s"].tolist() + ([hw["peak_flops_per_s"]] if hw else [])
    x_lo, x_hi = min(xs, default=0.1) / 4, max(xs, default=1e3) * 10
    y_lo = min(ys, default=1e9) / 6
    # figure() takes (start, end) tuples for its ranges (FigureOptions: RangeLike); the stub's
    # constructor is Plot's, which types them as Range.
    p = figure(x_axis_type="log", y_axis_type="log", width=1240, height=640,
               x_range=(x_lo, x_hi), y_range=(y_lo, max(ys, default=1e15) * 4),  # type: ignore[arg-type]
               tools="pan,wheel_zoom,box_zoom,reset,save", active_scroll="wheel_zoom",
               x_axis_label="arithmetic intensity (FLOP / byte, analytical minimum bytes)",
               y_axis_label="achieved FLOP/s (analytical FLOPs / measured time)",
               title=_device_line(hw, len(mine)))
    p.yaxis.formatter = CustomJSTickFormatter(code=_RATE_TICKS)
    p.xaxis.formatter = CustomJSTickFormatter(code="return String(Number(tick.toPrecision(3)));")
    # outside the plot area, right of it: it covers neither the memory slope nor a point
    p.add_layout(Legend(location="top_left", click_policy="hide", label_text_font_size="11px"),
                 "right")
    if hw:
        peak = cast(float, hw["peak_flops_per_s"])
        bw, ridge = cast(float, hw["bandwidth_bytes_per_s"]), cast(float, hw["ridge"])
        p.line([x_lo, ridge, x_hi], [x_lo * bw, peak, peak], color="black", line_width=2,
               legend_label="roof: min(P, I·B)")
        p.add_layout(Span(location=ridge, dimension="height", line_dash="dotted",
                          line_color="#666"))
        # Along the ridge line at the bottom (high intensity, low FLOP/s: where points are
        # rarest), drawn over the points on a white background so none can cover it.
        p.add_layout(Label(x=ridge, y=y_lo, text=f"ridge I* = {ridge:.0f} FLOP/B",
                           angle=math.pi / 2, x_offset=-4, y_offset=8, text_font_size="11px",
                           text_color="#444", text_baseline="bottom", level="overlay",
                           background_fill_color="white", background_fill_alpha=0.85))
    renderers: list[DataRenderer] = []
    for trace in dict.fromkeys(rows["trace"]):
        colour, hollow = styles[trace]
        for phase, g in plotted[plotted["trace"] == trace].groupby("phase", sort=False):
            label = f"{trace} · {phase}"
            ops, whole = g[~g["whole"]], g[g["whole"]]
            marker = _MARKERS.get(phase, "triangle")
            dots = p.scatter("intensity", "achieved_flops_per_s", source=ColumnDataSource(
                _source(ops)), marker=marker, size="size", fill_color=None if hollow else colour,
                line_color=colour if hollow else "white", line_width=2 if hollow else 1,
                alpha=0.85, legend_label=label)
            renderers.append(dots)
            if len(whole):  # the star follows its trace's legend entry, and has none of its own
                star = p.scatter("intensity", "achieved_flops_per_s",
                                 source=ColumnDataSource(_source(whole)), marker="star", size=22,
                                 color=colour, alpha=0.85, line_color="black")
                dots.js_link("visible", star, "visible")
                renderers.append(star)
    # the whole-model symbol, once, in grey (a point off the log axes: nothing to hide)
    p.scatter([math.nan], [math.nan], marker="star", size=14, color="#888", line_color="black",
              legend_label="whole model (ΣFLOPs/Σbytes)")
    p.add_tools(HoverTool(renderers=renderers, tooltips=_HOVER))
    return p


def _source(part: pd.DataFrame) -> dict[str, list]:
    size = 8 + 30 * (part["time_pct"].fillna(0) / 100).clip(0, 1) ** 0.5
    data = part[["operator", "trace", "phase", "layer", "shape", "time_us", "time_text",
                 "intensity", "achieved_flops_per_s", "achieved_text", "pct", "bound",
                 "evidence", "derivation"]]
    out = {c: data[c].astype(object).where(data[c].notna(), None).tolist() for c in data}
    out["size"] = size.tolist()
    return out


def _device_line(hw: dict | None, traces: int) -> str:
    if not hw:
        return f"{traces} trace(s) without a device: intensities only (pass --hardware for roofs)"
    return (f"Roofline on {hw['name']}: {si(hw['peak_flops_per_s'], 'FLOP/s')} {hw['dtype']}, "
            f"{si(hw['bandwidth_bytes_per_s'], 'B/s')}, ridge {hw['ridge']:.0f} FLOP/B "
            f"({traces} trace(s))")


def _cell(value: object, fmt: _Format) -> str:
    missing = value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value))
    if missing:
        return '<td data-v="">-</td>'
    if callable(fmt):
        text = fmt(value)
    else:
        text = fmt.format(int(cast(SupportsInt, value)) if fmt == "{:d}" else value)
    num = isinstance(value, (int, float)) and not isinstance(value, bool)
    return (f'<td data-v="{value}">{html.escape(text)}</td>' if num
            else f'<td class="t">{html.escape(text)}</td>')


def _table(rows: pd.DataFrame, columns: list[tuple[str, str, _Format]], cls: str = "sortable") -> str:
    head = "".join(f'<th class="{"t" if f == "{}" else ""}">{html.escape(h)}</th>'
                   for h, _, f in columns)
    body = "\n".join("<tr>" + "".join(_cell(r[c], f) for _, c, f in columns) + "</tr>"
                     for r in rows.to_dict(orient="records"))
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>\n{body}\n</tbody></table>'


def warnings(a: Analysis) -> list[str]:
    """What the reader must not miss: the analysis's warnings (contradictions with the model,
    no decoder layer, uncosted time, withheld whole model, malformed or implausible shapes),
    unattributed or fallback-named time, preset mismatches, operators above their roof."""
    out = list(a.warnings)
    cov = a.coverage
    kernel_us = cast(float, cov["kernel_time_us"])
    missing = kernel_us - cast(float, cov["attributed_time_us"])
    if missing > 1e-9 * kernel_us:  # more than float summation noise
        out.append(f"{missing:,.3f} µs ({100 * (1 - cast(float, cov['fraction'])):.3g}%) of device "
                   "time is unattributed")
    if cov["uncosted_instances"]:
        reasons = a.costed["uncosted"].value_counts()
        out.append(f"{cov['uncosted_instances']} op instance(s) without a cost "
                   f"({100 * (1 - cast(float, cov['costed_fraction'])):.1f}% of time): "
                   + ", ".join(f"{k} ×{v}" for k, v in reasons.items()))
    if cast(float, cov["fallback_time_us"]) > 1e-9 * kernel_us:
        out.append(f"{100 * cast(float, cov['fallback_fraction']):.3g}% of device time is named "
                   "without evidence (fallback): "
                   + ", ".join(cast("dict[str, float]", cov["fallback_by_operator"])))
    for check in sorted(a.costed["check"].dropna().unique()):
        out.append(f"model preset mismatch: {check}")
    ops = a.operators[a.operators["layer"].isna() & a.operators["exceeds_roof"].fillna(False)]
    for r in ops.itertuples():
        out.append(f"{r.operator} ({r.phase}) is above its roof ({r.pct_of_roof:.0f}% of roof): "
                   "bytes counted too high, reuse served from cache, or mis-timed kernels")
    return out


def _reconciliation(a: Analysis) -> str:
    parts = []
    for phase, rec in a.reconciliation.groupby("phase", sort=False):
        w = a.whole_by_phase.get(phase, {})
        rows = rec.assign(share=100 * rec["byte_share"])
        parts.append(f"<p>{html.escape(phase)}: Σ contribution = {rec['contribution'].sum():.4f} "
                     f"FLOP/B = whole-model ΣFLOPs/Σbytes {w.get('intensity', float('nan')):.4f}</p>"
                     + _table(rows, [("operator", "operator", "{}"), ("byte %", "share", "{:.2f}"),
                                     ("FLOP/B", "intensity", "{:.2f}"),
                                     ("bytes_i/Σbytes·I_i", "contribution", "{:.4f}")]))
    return "\n".join(parts)


_STEP_TABLE: list[tuple[str, str, _Format]] = [
    ("step", "step", "{}"), ("wall µs", "wall_us", "{:,.1f}"), ("busy µs", "busy_us", "{:,.1f}"),
    ("kernel µs", "kernel_us", "{:,.1f}"), ("memcpy µs", "memcpy_us", "{:,.1f}"),
    ("comm µs", "comm_us", "{:,.1f}"), ("idle µs", "idle_us", "{:,.1f}"),
    ("before µs", "idle_before_us", "{:,.1f}"), ("between µs", "idle_between_us", "{:,.1f}"),
    ("at syncs µs", "idle_sync_us", "{:,.1f}"), ("host µs", "host_us", "{:,.1f}"),
    ("launches", "launches", "{:d}"), ("verdict", "verdict", "{}"), ("evidence", "evidence", "{}")]


# (label, colour) of a step's timeline segments, in time order (_step_bars)
_SEGMENTS = (("idle before the first kernel", "#d9d9d9"), ("device busy", "#3b75af"),
             ("idle between kernels", "#f2b134"), ("idle at syncs", "#c0392b"),
             ("host only (no device work)", "#9e9e9e"))


def _step_bars(steps: pd.DataFrame) -> str:
    """Each step's wall time as one bar (a chart without script): idle before the
    first kernel, device busy, idle between kernels, idle at syncs and the rest of the wall,
    as shares of the longest step's wall; a segment's title gives its µs."""
    wall = steps["wall_us"].to_numpy(float)
    between = (steps["idle_between_us"] - steps["idle_sync_us"]).clip(lower=0).to_numpy(float)
    parts = [steps["idle_before_us"].to_numpy(float), steps["busy_us"].to_numpy(float), between,
             steps["idle_sync_us"].to_numpy(float)]
    parts.append((wall - sum(parts)).clip(min=0))
    longest = max(float(wall.max()), 1e-9)
    rows = []
    for i, step in enumerate(steps["step"].astype(str)):  # (one row per step: a few)
        spans = "".join(
            f'<span title="{html.escape(label)}: {part[i]:,.1f} µs" style="display:inline-block;'
            f'height:14px;width:{100 * part[i] / longest:.3f}%;background:{colour}"></span>'
            for (label, colour), part in zip(_SEGMENTS, parts, strict=True) if part[i] > 0)
        rows.append(f'<div class="stepbar"><span class="muted">{html.escape(step)}</span>'
                    f'<div style="white-space:nowrap;width:100%">{spans}</div></div>')
    legend = " ".join(f'<span style="color:{c}">&#9632;</span> {html.escape(lab)}'
                      for lab, c in _SEGMENTS)
    return "".join(rows) + f'<p class="muted">{legend}</p>'


def _steps(a: Analysis) -> str:
    """The step table (steptime.step_table), its timeline bars, the roofline read against the
    step and the operators losing most to their roof; "" without a step table."""
    if a.steps is None:
        return ""
    lines = [x for x in (roofline_step_line(a), *headroom_lines(a)) if x]
    return ("<h4>Steps</h4>" + _step_bars(a.steps) + _table(a.steps, _STEP_TABLE)
            + "".join(f"<p>{html.escape(x)}</p>" for x in lines))


def report_html(analyses: Sequence[Analysis], title: str = "trace_roofline report") -> str:
    """The whole page as one string (Bokeh's JS inlined: no network needed to view it)."""
    if not analyses:
        raise ValueError("report_html needs at least one analysis")
    from bokeh.embed import components
    from bokeh.embed.bundle import bundle_for_objs_and_resources
    from bokeh.resources import INLINE

    rows = operator_rows(analyses)
    chart = _charts(analyses, rows)
    script, div = components(chart)
    bundle = bundle_for_objs_and_resources([chart], INLINE)  # only the bundles the chart uses
    resources = bundle.scripts() + "".join(f"<style>{c}</style>" for c in bundle.css_raw)
    table = rows.sort_values(["trace", "phase", "whole", "time_us"],
                             ascending=[True, True, True, False], kind="stable")
    sections = []
    for a in analyses:
        c, cov = a.conventions, a.coverage
        warn = "".join(f'<li class="warn">{html.escape(w)}</li>' for w in warnings(a)) or \
            '<li class="muted">none</li>'
        # Every string from a trace, a config or the analysis is escaped: a config's
        # `_name_or_path` or a trace's file name may hold markup (issue 35).
        model = html.escape(a.model.name) if a.model else "-"
        causal, attention = html.escape(str(c["causal"])), html.escape(str(c["attention_bytes"]))
        sections.append(
            f"<h3>{html.escape(short_name(a.trace))}</h3>"
            f'<p class="muted">{html.escape(a.trace)} · model {model}'
            f" · --causal {causal} · --attention-bytes {attention} · coverage "
            f"{100 * cast(float, cov['fraction']):.1f}% attributed, "
            f"{100 * cast(float, cov['evidence_fraction']):.1f}% named with evidence, "
            f"{100 * cast(float, cov['costed_fraction']):.1f}% costed</p>"
            f"<h4>Warnings</h4><ul>{warn}</ul>{_steps(a)}"
            f"<h4>Reconciliation</h4>{_reconciliation(a)}")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
{resources}
<style>{_CSS}</style>
{script}
</head><body>
<h1>{html.escape(title)}</h1>
<p class="muted">One chart per device and compute dtype (each trace under its own roof). Hover a
point for its figures; click a legend entry to hide or show a trace and phase; wheel to zoom.
Click a column header to sort.</p>
{div}
<h2>Operators</h2>
{_table(table, _TABLE)}
<h2>Per trace</h2>
{"".join(sections)}
<script>{_SORT_JS}</script>
</body></html>
"""
