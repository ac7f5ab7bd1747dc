"""The commands besides `analyze` (cli_analyze.py): `intensity`, `diff`, `project` and `cache`,
each its arguments (`add_<command>`) and its run (`run_<command>`)."""

from __future__ import annotations

import argparse
import io
import json
import re
from pathlib import Path
from typing import cast

from trace_roofline.cli_args import (
    add_convention_args,
    add_force_arg,
    conventions,
    count_list,
    get_model,
    int_list,
    model_arg,
    name_list,
    not_a_model_config,
    option_files,
    out_dir,
    outputs_of,
    positive_int,
    write_and_print,
)
from trace_roofline.errors import InputError
from trace_roofline.files import check_outputs, write_files
from trace_roofline.model.hardware import get_hardware
from trace_roofline.options import AnalysisOptions

DIFF_OUT = ("diff.csv", "diff.json", "diff.md", "diff.png")
PROJECT_OUT = ("projection.json", "projection.png")


def add_intensity(sub: argparse._SubParsersAction) -> None:
    """`intensity`: shape-only intensities, regimes, M* and S*."""
    p = sub.add_parser(
        "intensity", help="shape-only GEMM/attention intensity, regimes, M* and S*",
        description="Arithmetic intensity of each projection GEMM and of attention from the "
                    "model's shapes alone (no trace), at each token count M and context S; the "
                    "regime of each (memory- or compute-bound on the hardware), and M* and S*, "
                    "where they cross the ridge. For a mixture-of-experts model, the routed "
                    "experts' GEMMs at each M (active experts under uniform routing, tokens per "
                    "active expert, the dense equivalent) and the tokens where they cross it.",
        epilog="examples:\n  trace-roofline intensity --model qwen2.5-7b --hardware rtx4090 "
               "--m 1,256 --s 128,512,2048 --lesson\n  trace-roofline intensity --model "
               "mixtral-8x7b --hardware h200-measured --m 1,8,64,256,1024")
    p.add_argument("--model", type=model_arg, default="qwen2.5-7b",
                   help="preset name, HF config.json or HF model directory")
    p.add_argument("--hardware", default="rtx4090",
                   help="preset name or hardware JSON file whose ridge every regime, M* and S* is "
                        "against (no trace here to take a device from, unlike analyze: the "
                        "output's first lines name the hardware used)")
    p.add_argument("--m", type=int_list, default=[1, 256], help="tokens in flight, e.g. 1,256")
    p.add_argument("--s", type=int_list, default=[128, 512, 2048], help="context lengths")
    p.add_argument("--fused", action="store_true", help="fused qkv_proj / gate_up_proj layout")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    add_convention_args(p, lesson=True)
    p.set_defaults(func=run_intensity)


def run_intensity(args: argparse.Namespace) -> int:
    from trace_roofline.costs import calculator

    causal, attention_bytes = conventions(args)
    table = calculator.intensity_table(
        get_model(args.model), get_hardware(args.hardware),
        calculator.Sweep(args.m, args.s, causal, attention_bytes, args.fused),
    )
    print(json.dumps(table, indent=2) if args.json else calculator.format_intensity(table))
    return 0



def add_diff(sub: argparse._SubParsersAction) -> None:
    """`diff`: two traces (or report.json files) of one model, A -> B."""
    p = sub.add_parser(
        "diff", help="compare two traces (or report.json files) of one model, A -> B",
        description="Compare two traces (or report.json files) of one model per (phase, operator): "
                    "device time per profiled step, speed-up, intensity and % of roof A -> B, FLOPs "
                    "equal or changed (a different workload is said first), operators on one side only.",
        epilog="examples:\n"
               "  trace-roofline diff eager.json.gz compiled.json.gz --model qwen2.5-7b --out diff\n"
               "  trace-roofline diff before/report.json after/report.json")
    p.add_argument("a", help="trace, report.json or an `analyze --out` folder: before")
    p.add_argument("b", help="trace, report.json or an `analyze --out` folder: after")
    p.add_argument("--model", type=model_arg,
                   help="preset name, HF config.json or model directory, for traces (default: none)")
    p.add_argument("--hardware", help="preset name or JSON file (default: each trace's GPU)")
    p.add_argument("--out", help="directory for diff.csv/.json/.md and diff.png (default: print only)")
    add_force_arg(p, layers=False)
    add_convention_args(p)
    p.set_defaults(func=run_diff)


def _diff_side(path: str, args: argparse.Namespace, label: str):
    """A report.json (a JSON object whose first key is "schema_version", "trace" or "traces"),
    an `analyze --out` folder (its report.json) or a trace."""
    from trace_roofline.files import read_json
    from trace_roofline.outputs import diff
    from trace_roofline.pipeline import Run, analyze_trace
    from trace_roofline.trace import progress_bar

    p = Path(path)
    not_a_model_config(p)
    if p.is_dir():  # an `analyze --out` folder stands for its report.json
        if not (p / "report.json").is_file():
            raise InputError(f"{p}: a folder without report.json; diff takes two traces (.json, "
                             ".json.gz), two report.json files or two `analyze --out` folders")
        p = p / "report.json"
    try:
        with open(p, "rb") as f:
            head = f.read(256)
    except OSError as e:
        raise InputError(f"{p}: cannot read ({e.strerror})") from None
    if _REPORT_HEAD.match(head):
        doc = cast("dict[str, object]", read_json(p))  # its head matched: a JSON object
        return diff.side(doc, label=str(p))
    model = get_model(args.model) if args.model else None
    hw = get_hardware(args.hardware) if args.hardware else None
    return diff.side(analyze_trace(p, model, hw, _options(args), Run(progress=progress_bar())))


def _options(args: argparse.Namespace) -> AnalysisOptions:
    """The analysis options `diff` and `project` take: the conventions and --force."""
    return AnalysisOptions(causal=args.causal, attention_bytes=args.attention_bytes,
                           force=args.force)


_REPORT_HEAD = re.compile(rb'\A\s*\{\s*"(?:traces?|schema_version)"\s*:')


def run_diff(args: argparse.Namespace) -> int:
    from trace_roofline.outputs import diff, report

    out = out_dir(args.out)
    inputs = [args.a, args.b, *option_files(args.model, args.hardware)]
    check_outputs(outputs_of(args, out, DIFF_OUT), inputs)
    a, b = _diff_side(args.a, args, "A"), _diff_side(args.b, args, "B")
    table = diff.diff(a, b)
    text = diff.format_table(table, a, b)
    if out is not None:
        from trace_roofline.outputs.plot_diff import diff_figure

        png = io.BytesIO()
        diff_figure(table, a, b).savefig(png, format="png")
        written = write_files({
            out / "diff.csv": report.csv_bytes(table),
            out / "diff.json": json.dumps(diff.to_json(table, a, b), indent=2).encode() + b"\n",
            out / "diff.md": diff.markdown(table, a, b).encode(),
            out / "diff.png": png.getvalue(),
        }, inputs=inputs, sets={out: DIFF_OUT})
        text += "\n\nwrote " + ", ".join(str(p) for p in written)
    print(text)
    return 0


def add_project(sub: argparse._SubParsersAction) -> None:
    """`project`: a traced step at other batch sizes, contexts, lengths, GPUs."""
    p = sub.add_parser(
        "project", help="what-if: a traced step at other batch sizes, contexts, lengths, GPUs",
        description="Project one trace's step (its phase with most device time, per forward "
                    "pass) to other shapes: each operator's FLOPs and bytes from the model's "
                    "formulas at the new batch, context and tokens, its time from what it "
                    "achieved in the trace (its fraction of its roof, past a per-kernel "
                    "latency), the host time the trace showed, and the step as the larger of "
                    "host and device time. Prints step ms, device ms, tokens/s, whole-model "
                    "intensity, the dominant operator and the operators that cross the ridge "
                    "per point, the M* and S* crossings, and the assumptions; --json and --out "
                    "write projection.json (and projection.png).",
        epilog="examples:\n"
               "  trace-roofline project decode.json.gz --model qwen2.5-7b --batch 1,8,64,256\n"
               "  trace-roofline project prefill.json.gz --model qwen2.5-7b --tokens "
               "512,1024,4096 --hardware h100-sxm,h200 --out proj")
    p.add_argument("trace", help="one torch.profiler trace (.json, .json.gz)")
    p.add_argument("--model", type=model_arg, required=True,
                   help="preset name, HF config.json or HF model directory (the layout FLOPs and "
                        "bytes are recomputed from) (default: none; required)")
    p.add_argument("--batch", type=int_list,
                   help="sequences per step, e.g. 1,8,64,256 (default: the trace's)")
    p.add_argument("--context", type=count_list,
                   help="cached keys per sequence before the step, e.g. 1024,4096 (default: the "
                        "trace's)")
    p.add_argument("--tokens", type=int_list,
                   help="new tokens per sequence: 1 in decode, the prompt length in prefill "
                        "(default: the trace's)")
    p.add_argument("--layers", type=positive_int,
                   help="decoder layers (default: the trace's)")
    p.add_argument("--hardware", type=name_list,
                   help="preset names or JSON files, comma-separated (default: the trace's GPU)")
    p.add_argument("--host-ms", type=float, metavar="MS",
                   help="host time per step without the profiler (default: the trace's profiled "
                        "host time less the profiler's cost per recorded event)")
    p.add_argument("--json", help="write projection.json to this path (default: none)")
    p.add_argument("--out", help="directory for projection.json and projection.png "
                                 "(default: print only)")
    add_force_arg(p, layers=False)
    add_convention_args(p)
    p.set_defaults(func=run_project)


def run_project(args: argparse.Namespace) -> int:
    from trace_roofline import project
    from trace_roofline.outputs.plot import projection_figure
    from trace_roofline.pipeline import analyze_trace
    from trace_roofline.trace import load_trace, progress_bar

    out = out_dir(args.out)
    not_a_model_config(args.trace)
    if Path(args.trace).is_dir():
        raise InputError(f"{args.trace}: project takes one trace file, not a directory")
    inputs = [args.trace, *option_files(args.model, *(args.hardware or []))]
    check_outputs(outputs_of(args, out, PROJECT_OUT), inputs)
    model = get_model(args.model)
    hardware = [get_hardware(h) for h in args.hardware] if args.hardware else None
    trace = load_trace(args.trace, progress=progress_bar())
    analysis = analyze_trace(trace, model, options=_options(args))
    result = project.project(analysis, trace=trace, sweep=project.Sweep(
        args.batch, args.context, args.tokens, args.layers, hardware),
                             host_us=args.host_ms * 1e3 if args.host_ms is not None else None)
    text = project.format_projection(result)
    data = json.dumps(project.to_json(result), indent=2).encode() + b"\n"
    outputs: dict[Path, bytes] = {Path(args.json): data} if args.json else {}
    if out is not None:
        png = io.BytesIO()
        projection_figure(result.points, result.operators, project.swept(result.points),
                          title=f"{Path(args.trace).name}: projected {result.phase} step"
                          ).savefig(png, format="png")
        outputs |= {out / "projection.json": data, out / "projection.png": png.getvalue()}
    return write_and_print(text, outputs, inputs, out, PROJECT_OUT)


def add_cache(sub: argparse._SubParsersAction) -> None:
    """`cache info` / `cache clear`."""
    p = sub.add_parser("cache", help="the cache of parsed trace tables, attributions and finished "
                                     "analyses: where it is, what it holds, or clear it",
                       description="analyze caches three kinds of entries per trace file in "
                                   "$TRACE_ROOFLINE_CACHE_DIR, else $XDG_CACHE_HOME/trace-roofline, "
                                   "else ~/.cache/trace-roofline: the parsed trace tables (Arrow), "
                                   "the attribution of kernels to operators, one per model (Arrow), "
                                   "and the finished analysis, one per argument set (model, hardware, "
                                   "conventions, ...). A re-run with the same arguments reads the "
                                   "analysis back whole; other arguments reuse the tables and the "
                                   "attribution. Nothing is written next to your trace.",
                       epilog="examples:\n  trace-roofline cache info\n  trace-roofline cache clear")
    p.add_argument("action", choices=["info", "clear"],
                   help="info: location, size and the count of each kind of entry; clear: delete "
                        "every entry")
    p.set_defaults(func=run_cache, tune_memory=False)


def run_cache(args: argparse.Namespace) -> int:
    from trace_roofline.cachedir import CacheDir

    cache = CacheDir()
    if args.action == "clear":
        print(f"cleared {cache.directory}: {cache.clear() / 1e6:.1f} MB freed")
        return 0
    info = cache.info()
    print(f"cache {info.directory}: {info.entries} trace file(s), {info.total_bytes / 1e6:.1f} MB\n"
          f"  parsed trace tables {info.traces:>5}  (one per trace file)\n"
          f"  attributions        {info.attributions:>5}  (one per trace file and model)\n"
          f"  finished analyses   {info.analyses:>5}  (one per trace file and argument set)")
    return 0


# Every file `analyze --out` and `diff --out` may write: checked against the inputs before the
