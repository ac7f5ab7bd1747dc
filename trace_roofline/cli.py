"""`trace-roofline` command line: a thin layer that parses arguments, calls the library, prints/writes.

Every user error ends in one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from trace_roofline import calculator, costs
from trace_roofline._files import staged_file, write_files
from trace_roofline.errors import InputError
from trace_roofline.hardware import get_hardware
from trace_roofline.models import get_model

PROG = "trace-roofline"


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors in one line (no usage dump) with exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_convention_args(p: argparse.ArgumentParser, lesson: bool = False) -> None:
    """--causal / --attention-bytes (and --lesson where the lesson's table is reproducible)."""
    p.add_argument("--causal", choices=costs.CAUSAL_CONVENTIONS, default="causal",
                   help="attention FLOPs: every query-key pair (full) or unmasked ones (causal)")
    p.add_argument("--attention-bytes", choices=costs.ATTENTION_BYTES_CONVENTIONS, default="all",
                   help="attention bytes: K,V reads only (kv) or Q,K,V read + O written (all)")
    if lesson:
        p.add_argument("--lesson", action="store_true",
                       help="the lesson's conventions: --causal full --attention-bytes kv")


def _cmd_intensity(args: argparse.Namespace) -> int:
    if args.lesson:
        args.causal, args.attention_bytes = "full", "kv"
    table = calculator.intensity_table(
        get_model(args.model), get_hardware(args.hardware), args.m, args.s,
        args.causal, args.attention_bytes, args.fused,
    )
    print(json.dumps(table, indent=2) if args.json else calculator.format_intensity(table))
    return 0


def _cmd_analyze(args: argparse.Namespace) -> int:
    from trace_roofline import report
    from trace_roofline.pipeline import analyze_trace, operators_frame
    from trace_roofline.trace import load_trace, load_traces, progress_bar

    out = Path(args.out) if args.out else None
    if out is not None and out.exists() and not out.is_dir():  # fail before the work, not after
        raise InputError(f"{out}: --out exists and is not a directory")
    model = get_model(args.model) if args.model else None
    hw = get_hardware(args.hardware) if args.hardware else None
    # A directory (tensorboard_trace_handler output) stands for every trace in it, by name.
    traces = [t for path in args.traces
              for t in (load_traces(path, progress_bar()) if Path(path).is_dir() else [path])]
    if len(args.ncu) > len(traces):
        raise InputError(f"{len(args.ncu)} --ncu files for {len(traces)} traces (one per trace)")
    ncu = args.ncu + [None] * (len(traces) - len(args.ncu))
    if args.perfetto:  # the Trace is kept: the enriched file needs its tables and attribution
        if len(traces) != 1:
            raise InputError(f"--perfetto takes one trace, got {len(traces)}")
        traces = [load_trace(traces[0], progress_bar())]
    analyses = [
        analyze_trace(t, model, hw, causal=args.causal, attention_bytes=args.attention_bytes,
                      layers=args.layers, ncu=csv, by_shape=args.by_shape, progress=progress_bar())
        for t, csv in zip(traces, ncu, strict=True)
    ]
    # Render every output in memory first: a failure leaves no partial files behind.
    text = report.terminal_table(analyses, per_layer=args.per_layer)
    payload = json.dumps(report.report_dict(analyses), indent=2).encode() + b"\n"
    outputs: dict[Path, bytes] = {Path(args.json): payload} if args.json else {}
    if args.out:
        from trace_roofline import plot  # matplotlib: only when a chart is written

        table = operators_frame(analyses)
        parquet = io.BytesIO()
        table.to_parquet(parquet, index=False)
        fig = plot.roofline_figure(analyses)
        png, svg = io.BytesIO(), io.BytesIO()
        fig.savefig(png, format="png")
        fig.savefig(svg, format="svg")
        outputs |= _html_report(out, analyses)
        outputs |= {
            out / "operators.csv": table.to_csv(index=False).encode(),
            out / "operators.parquet": parquet.getvalue(),
            out / "report.json": payload,
            out / "report.md": report.markdown(analyses).encode(),
            out / "roofline.png": png.getvalue(),
            out / "roofline.svg": svg.getvalue(),
        }
    with contextlib.ExitStack() as stack:  # the Perfetto file lands with the others or not at all
        if args.perfetto:
            _write_perfetto(stack, Path(args.perfetto), traces[0], model, analyses[0])
            text += f"\n\nwrote {args.perfetto} (open it in ui.perfetto.dev)"
        if outputs:
            written = write_files(outputs)
            text += "\n\nwrote " + ", ".join(str(p) for p in written)
    print(text)
    return 0


def _html_report(out: Path, analyses) -> dict[Path, bytes]:
    """report.html when the optional `html` extra (Bokeh) is installed; a note otherwise."""
    try:
        from trace_roofline.html_report import report_html

        return {out / "report.html": report_html(analyses).encode()}
    except ModuleNotFoundError as e:
        if e.name is None or not e.name.startswith("bokeh"):
            raise
        print(f"{PROG}: report.html skipped: pip install 'trace-roofline[html]' (Bokeh) for it",
              file=sys.stderr)
        return {}


def _write_perfetto(stack: contextlib.ExitStack, path: Path, trace, model, analysis) -> None:
    """Stream the enriched trace into a staged file (gzip when the name ends in .gz)."""
    from trace_roofline.attribute import attribute
    from trace_roofline.perfetto import enriched_trace

    f = stack.enter_context(staged_file(path))
    out = gzip.GzipFile(fileobj=f, mode="wb", compresslevel=1) if path.suffix == ".gz" else f
    for chunk in enriched_trace(trace, attribute(trace, model), analysis):
        out.write(chunk)
    if out is not f:
        out.close()


def _diff_side(path: str, args: argparse.Namespace, label: str):
    """A report.json (a JSON object whose first key is "trace" or "traces") or a trace."""
    from trace_roofline import diff
    from trace_roofline._files import read_json
    from trace_roofline.pipeline import analyze_trace
    from trace_roofline.trace import progress_bar

    p = Path(path)
    try:
        with open(p, "rb") as f:
            head = f.read(256)
    except OSError as e:
        raise InputError(f"{p}: cannot read ({e.strerror})") from None
    if _REPORT_HEAD.match(head):
        return diff.side(read_json(p), label=str(p))
    model = get_model(args.model) if args.model else None
    hw = get_hardware(args.hardware) if args.hardware else None
    return diff.side(analyze_trace(p, model, hw, causal=args.causal,
                                   attention_bytes=args.attention_bytes, progress=progress_bar()))


_REPORT_HEAD = re.compile(rb'\A\s*\{\s*"traces?"\s*:')


def _cmd_diff(args: argparse.Namespace) -> int:
    from trace_roofline import diff

    out = Path(args.out) if args.out else None
    if out is not None and out.exists() and not out.is_dir():
        raise InputError(f"{out}: --out exists and is not a directory")
    a, b = _diff_side(args.a, args, "A"), _diff_side(args.b, args, "B")
    table = diff.diff(a, b)
    text = diff.format_table(table, a, b)
    if out is not None:
        from trace_roofline.plot_diff import diff_figure

        png = io.BytesIO()
        diff_figure(table, a, b).savefig(png, format="png")
        written = write_files({
            out / "diff.csv": table.to_csv(index=False).encode(),
            out / "diff.json": json.dumps(diff.to_json(table, a, b), indent=2).encode() + b"\n",
            out / "diff.md": diff.markdown(table, a, b).encode(),
            out / "diff.png": png.getvalue(),
        })
        text += "\n\nwrote " + ", ".join(str(p) for p in written)
    print(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("intensity", help="shape-only GEMM/attention intensity, regimes, M* and S*")
    p.add_argument("--model", default="qwen2.5-7b", help="preset name or HF config.json")
    p.add_argument("--hardware", default="rtx4090", help="preset name or hardware JSON file")
    p.add_argument("--m", type=_int_list, default=[1, 256], help="tokens in flight, e.g. 1,256")
    p.add_argument("--s", type=_int_list, default=[128, 512, 2048], help="context lengths")
    p.add_argument("--fused", action="store_true", help="fused qkv_proj / gate_up_proj layout")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    add_convention_args(p, lesson=True)
    p.set_defaults(func=_cmd_intensity)

    p = sub.add_parser("analyze", help="attribute, cost and place every operator of traces on the roofline")
    p.add_argument("traces", nargs="+", help="torch.profiler trace(s): .json, .json.gz or a directory")
    p.add_argument("--model", help="preset name or HF config.json (names GEMMs in unannotated traces)")
    p.add_argument("--hardware", help="preset name or JSON file (default: the trace's GPU)")
    p.add_argument("--layers", type=int, help="extrapolate a layer trace to this many layers")
    p.add_argument("--ncu", action="append", default=[], metavar="CSV",
                   help="Nsight Compute raw CSV of the same run, one per trace in order")
    p.add_argument("--per-layer", action="store_true", help="one terminal row per layer")
    p.add_argument("--by-shape", action="store_true",
                   help="one row and point per (operator, shape), e.g. per M of a sweep")
    p.add_argument("--out", help="directory for operators.csv/.parquet, report.json/.md/.html, "
                                 "roofline.png/.svg")
    p.add_argument("--json", help="also write report.json to this path")
    p.add_argument("--perfetto", metavar="FILE",
                   help="write the trace enriched for ui.perfetto.dev: kernel args, operator "
                        "slices, TFLOP/s and GB/s counters (one trace; .gz compresses)")
    add_convention_args(p)
    p.set_defaults(func=_cmd_analyze)

    p = sub.add_parser("diff", help="compare two traces (or report.json files) of one model, A -> B")
    p.add_argument("a", help="trace or report.json: before")
    p.add_argument("b", help="trace or report.json: after")
    p.add_argument("--model", help="preset name or HF config.json (for traces)")
    p.add_argument("--hardware", help="preset name or JSON file (default: each trace's GPU)")
    p.add_argument("--out", help="directory for diff.csv/.json/.md and diff.png")
    add_convention_args(p)
    p.set_defaults(func=_cmd_diff)
    from workloads.cli import add_calibrate_parser, add_run_parser, add_sweep_parser  # torch-free

    for add in (add_run_parser, add_sweep_parser, add_calibrate_parser):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except InputError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `trace-roofline analyze ... | head`: stop quietly
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
