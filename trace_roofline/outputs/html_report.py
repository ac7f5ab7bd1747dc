"""report.html: one self-contained page (no network at view time) with the interactive roofline,
the operator table (sortable), the reconciliation and the warnings of one or more analyses.

The chart is Bokeh with its JavaScript inlined (`bokeh.resources.INLINE`): log-log axes, the
roof min(P, I·B_mem) and the ridge of the first analysis's device (as `plot.roofline_figure`),
one point per (trace, phase, operator) and a star per (trace, phase) whole model; hovering a
point shows operator, phase, layer, shape, time, intensity, achieved FLOP/s, % of roof, bound
and evidence; clicking a legend entry (one per trace and phase) hides or shows it; wheel-zoom,
pan and reset. Bokeh was chosen by measurement (README.md, "report.html"): the smallest inlined
library that does hover, legend toggles and log axes. The tables are plain HTML; a few lines of
inline JavaScript sort a table by the clicked column.

`evidence` (how each operator was named) is the operator table's `evidence_mix`: every evidence
with its fraction of the operator's time. A phase whose whole model is withheld (most of its
time uncosted, roofline.MIN_COSTED) has no star and no whole-model row.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

import pandas as pd

from trace_roofline.outputs.plot import TRACE_COLOURS, short_name
from trace_roofline.roofline import Analysis, hardware_summary

_MARKERS = {"decode": "circle", "prefill": "square", "unknown": "triangle"}
_HOVER = [("operator", "@operator"), ("trace", "@trace"), ("phase", "@phase"),
          ("layer", "@layer"), ("shape", "@shape"), ("time", "@time_us{0,0.0} µs"),
          ("intensity", "@intensity{0.000} FLOP/B"), ("achieved", "@tflops{0.000} TFLOP/s"),
          ("% of roof", "@pct{0.0} %"), ("bound", "@bound"), ("evidence", "@evidence")]
# (header, column, format) of the operator table.
_TABLE = [("trace", "trace", "{}"), ("phase", "phase", "{}"), ("operator", "operator", "{}"),
          ("kernels", "kernels", "{:d}"), ("time µs", "time_us", "{:,.1f}"),
          ("time %", "time_pct", "{:.1f}"), ("GFLOP", "gflop", "{:.3f}"), ("MB", "mb", "{:.2f}"),
          ("FLOP/B", "intensity", "{:.2f}"), ("TFLOP/s", "tflops", "{:.2f}"),
          ("GB/s", "gbs", "{:,.0f}"), ("% roof", "pct", "{:.1f}"), ("bound", "bound", "{}"),
          ("shape", "shape", "{}"), ("evidence", "evidence", "{}")]
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
th, td { padding: 2px 8px; border-bottom: 1px solid #ddd; text-align: right; }
th { cursor: pointer; background: #f4f4f4; position: sticky; top: 0; }
th[data-dir=asc]::after { content: " ▲"; } th[data-dir=desc]::after { content: " ▼"; }
td.t, th.t { text-align: left; } .warn { color: #a40000; } .muted { color: #666; }
"""


def _evidence(a: Analysis) -> pd.Series:
    """(phase, operator) -> how the operator was named: every evidence with its fraction of
    the operator's time (`evidence_mix`, e.g. "annotation 0.97, position 0.03")."""
    rows = a.operators[a.operators["layer"].isna()]
    return rows.set_index(["phase", "operator"])["evidence_mix"].astype(object)


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
            "evidence": ev.reindex(key).to_numpy(), "whole": False, "layer": "all"})
        whole = pd.DataFrame([{
            "trace": short_name(a.trace), "phase": p, "operator": "whole model",
            "kernels": w["kernels"], "time_us": w["time_us"], "time_pct": 100.0,
            "flops": w["flops"], "bytes": w["bytes"], "intensity": w["intensity"],
            "achieved_flops_per_s": w["achieved_flops_per_s"],
            "achieved_bytes_per_s": w["achieved_bytes_per_s"], "pct": w.get("pct_of_roof"),
            "bound": w.get("bound"), "shape": "ΣFLOPs / Σbytes", "evidence": "sum of the rows",
            "whole": True, "layer": "all"} for p, w in a.whole_by_phase.items()
            if not w.get("withheld")])  # most time uncosted: no whole-model figure
        parts += [rows, whole]
    out = pd.concat(parts, ignore_index=True)
    out["evidence"] = out["evidence"].fillna("not recorded")
    out["shape"] = out["shape"].fillna("-")
    out["gflop"], out["mb"] = out["flops"] / 1e9, out["bytes"] / 1e6
    out["tflops"] = out["achieved_flops_per_s"] / 1e12
    out["gbs"] = out["achieved_bytes_per_s"] / 1e9
    return out


def _chart(analyses: Sequence[Analysis], rows: pd.DataFrame):
    from bokeh.models import ColumnDataSource, HoverTool, Label, Span
    from bokeh.plotting import figure

    hw = hardware_summary(analyses[0])
    plotted = rows[(rows["intensity"] > 0) & (rows["achieved_flops_per_s"] > 0)]
    xs = plotted["intensity"].tolist() + ([hw["ridge"]] if hw else [])
    ys = plotted["achieved_flops_per_s"].tolist() + ([hw["peak_flops_per_s"]] if hw else [])
    x_lo, x_hi = min(xs, default=0.1) / 4, max(xs, default=1e3) * 10
    p = figure(x_axis_type="log", y_axis_type="log", width=1100, height=640,
               x_range=(x_lo, x_hi), y_range=(min(ys, default=1e9) / 6, max(ys, default=1e15) * 4),
               tools="pan,wheel_zoom,box_zoom,reset,save", active_scroll="wheel_zoom",
               x_axis_label="arithmetic intensity (FLOP / byte, analytical minimum bytes)",
               y_axis_label="achieved FLOP/s (analytical FLOPs / measured time)",
               title=_device_line(hw))
    if hw:
        peak, bw, ridge = hw["peak_flops_per_s"], hw["bandwidth_bytes_per_s"], hw["ridge"]
        p.line([x_lo, ridge, x_hi], [x_lo * bw, peak, peak], color="black", line_width=2,
               legend_label="roof: min(P, I·B)")
        p.add_layout(Span(location=ridge, dimension="height", line_dash="dotted",
                          line_color="#666"))
        p.add_layout(Label(x=ridge, y=peak, text=f"ridge I* = {ridge:.0f} FLOP/B", x_offset=4,
                           y_offset=-18, text_font_size="11px", text_color="#444"))
    renderers = []
    for i, trace in enumerate(dict.fromkeys(rows["trace"])):
        colour = TRACE_COLOURS[i % len(TRACE_COLOURS)]
        for phase, g in plotted[plotted["trace"] == trace].groupby("phase", sort=False):
            label = f"{trace} · {phase}"
            for whole, part in g.groupby("whole"):
                src = ColumnDataSource(_source(part))
                renderers.append(p.scatter(
                    "intensity", "achieved_flops_per_s", source=src,
                    marker="star" if whole else _MARKERS.get(phase, "triangle"),
                    size=22 if whole else "size", color=colour, alpha=0.85,
                    line_color="black" if whole else "white", legend_label=label))
    p.add_tools(HoverTool(renderers=renderers, tooltips=_HOVER))
    p.legend.click_policy = "hide"
    p.legend.location = "top_left"
    p.legend.label_text_font_size = "11px"
    return p


def _source(part: pd.DataFrame) -> dict[str, list]:
    size = 8 + 30 * (part["time_pct"].fillna(0) / 100).clip(0, 1) ** 0.5
    data = part[["operator", "trace", "phase", "layer", "shape", "time_us", "intensity",
                 "achieved_flops_per_s", "tflops", "pct", "bound", "evidence"]]
    out = {c: data[c].astype(object).where(data[c].notna(), None).tolist() for c in data}
    out["size"] = size.tolist()
    return out


def _device_line(hw: dict | None) -> str:
    if not hw:
        return "Roofline (no device: pass --hardware for roofs)"
    return (f"Roofline on {hw['name']}: {hw['peak_flops_per_s'] / 1e12:.0f} TFLOP/s "
            f"{hw['dtype']}, {hw['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s, "
            f"ridge {hw['ridge']:.0f} FLOP/B")


def _cell(value: object, fmt: str) -> str:
    missing = value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value))
    if missing:
        return '<td data-v="">-</td>'
    text = fmt.format(int(value) if fmt == "{:d}" else value)
    num = isinstance(value, (int, float)) and not isinstance(value, bool)
    return (f'<td data-v="{value}">{html.escape(text)}</td>' if num
            else f'<td class="t">{html.escape(text)}</td>')


def _table(rows: pd.DataFrame, columns: list[tuple[str, str, str]], cls: str = "sortable") -> str:
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
    missing = cov["kernel_time_us"] - cov["attributed_time_us"]
    if missing > 1e-9 * cov["kernel_time_us"]:  # more than float summation noise
        out.append(f"{missing:,.3f} µs ({100 * (1 - cov['fraction']):.3g}%) of device time is "
                   "unattributed")
    if cov["uncosted_instances"]:
        reasons = a.costed["uncosted"].value_counts()
        out.append(f"{cov['uncosted_instances']} op instance(s) without a cost "
                   f"({100 * (1 - cov['costed_fraction']):.1f}% of time): "
                   + ", ".join(f"{k} ×{v}" for k, v in reasons.items()))
    if cov["fallback_time_us"] > 1e-9 * cov["kernel_time_us"]:
        out.append(f"{100 * cov['fallback_fraction']:.3g}% of device time is named without "
                   "evidence (fallback): " + ", ".join(cov["fallback_by_operator"]))
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
                                     ("FLOP/B", "intensity", "{:.3f}"),
                                     ("bytes_i/Σbytes·I_i", "contribution", "{:.4f}")]))
    return "\n".join(parts)


def report_html(analyses: Sequence[Analysis], title: str = "trace_roofline report") -> str:
    """The whole page as one string (Bokeh's JS inlined: no network needed to view it)."""
    if not analyses:
        raise ValueError("report_html needs at least one analysis")
    from bokeh.embed import components
    from bokeh.embed.bundle import bundle_for_objs_and_resources
    from bokeh.resources import INLINE

    rows = operator_rows(analyses)
    chart = _chart(analyses, rows)
    script, div = components(chart)
    bundle = bundle_for_objs_and_resources([chart], INLINE)  # only the bundles the chart uses
    resources = bundle.scripts() + "".join(f"<style>{c}</style>" for c in bundle.css_raw)
    table = rows.sort_values(["trace", "phase", "whole", "time_us"],
                             ascending=[True, True, True, False], kind="stable")
    sections = []
    for a in analyses:
        c = a.conventions
        warn = "".join(f'<li class="warn">{html.escape(w)}</li>' for w in warnings(a)) or \
            '<li class="muted">none</li>'
        sections.append(
            f"<h3>{html.escape(short_name(a.trace))}</h3>"
            f'<p class="muted">{html.escape(a.trace)} · model {a.model.name if a.model else "-"}'
            f" · --causal {c['causal']} · --attention-bytes {c['attention_bytes']} · coverage "
            f"{100 * a.coverage['fraction']:.1f}% attributed, "
            f"{100 * a.coverage['evidence_fraction']:.1f}% named with evidence, "
            f"{100 * a.coverage['costed_fraction']:.1f}% costed</p>"
            f"<h4>Warnings</h4><ul>{warn}</ul><h4>Reconciliation</h4>{_reconciliation(a)}")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
{resources}
<style>{_CSS}</style>
{script}
</head><body>
<h1>{html.escape(title)}</h1>
<p class="muted">Hover a point for its figures; click a legend entry to hide or show a trace and
phase; wheel to zoom. Click a column header to sort.</p>
{div}
<h2>Operators</h2>
{_table(table, _TABLE)}
<h2>Per trace</h2>
{"".join(sections)}
<script>{_SORT_JS}</script>
</body></html>
"""
