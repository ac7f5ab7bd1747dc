"""`trace-roofline` command line: a thin layer that parses arguments, calls the library, prints/writes.

Every user error ends in one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from trace_roofline import calculator, costs
from trace_roofline._files import write_files
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


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


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
    from trace_roofline import ranks, report
    from trace_roofline.parallel import analyze_many
    from trace_roofline.pipeline import operators_frame
    from trace_roofline.trace import _trace_files, progress_bar

    out = Path(args.out) if args.out else None
    if out is not None and out.exists() and not out.is_dir():  # fail before the work, not after
        raise InputError(f"{out}: --out exists and is not a directory")
    model = get_model(args.model) if args.model else None
    hw = get_hardware(args.hardware) if args.hardware else None
    # A directory (tensorboard_trace_handler output) stands for every trace in it, by name.
    traces = [t for path in args.traces
              for t in (_trace_files(Path(path)) if Path(path).is_dir() else [path])]
    if len(args.ncu) > len(traces):
        raise InputError(f"{len(args.ncu)} --ncu files for {len(traces)} traces (one per trace)")
    ncu = args.ncu + [None] * (len(traces) - len(args.ncu))
    results = analyze_many(traces, model, hw, ncu=ncu, jobs=args.jobs, dask=args.dask,
                           progress=progress_bar(), causal=args.causal,
                           attention_bytes=args.attention_bytes, layers=args.layers,
                           by_shape=args.by_shape)
    analyses = [r.analysis for r in results]
    # Render every output in memory first: a failure leaves no partial files behind.
    text = report.terminal_table(analyses, per_layer=args.per_layer)
    doc = report.report_dict(analyses)
    cross = ranks.CrossRank.of([r.rank for r in results], [a.operators for a in analyses])
    if cross is not None:  # the traces are ranks of one run
        text += "\n\n" + cross.text()
        doc["ranks"] = cross.to_dict()
    elif note := ranks.unranked_note([r.rank for r in results]):
        text += f"\n\n{note}"
    payload = json.dumps(doc, indent=2).encode() + b"\n"
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
        outputs |= {
            out / "operators.csv": table.to_csv(index=False).encode(),
            out / "operators.parquet": parquet.getvalue(),
            out / "report.json": payload,
            out / "report.md": report.markdown(analyses).encode(),
            out / "roofline.png": png.getvalue(),
            out / "roofline.svg": svg.getvalue(),
        }
        if cross is not None:
            outputs[out / "ranks.csv"] = cross.summary.to_csv(index=False).encode()
    if outputs:
        written = write_files(outputs)
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
    p.add_argument("--out", help="directory for operators.csv/.parquet, report.json/.md, roofline.png/.svg")
    p.add_argument("--json", help="also write report.json to this path")
    p.add_argument("--jobs", type=_positive_int, default=1, metavar="N",
                   help="analyse N traces at a time in local processes (default 1: in this process)")
    p.add_argument("--dask", metavar="ADDRESS",
                   help="analyse the traces on a Dask cluster: a scheduler address, or 'local' to "
                        "start a LocalCluster of --jobs workers (needs trace-roofline[dask])")
    add_convention_args(p)
    p.set_defaults(func=_cmd_analyze)
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
