"""`analyze`: its arguments, the checks before the work, the analyses (in this process, on
local processes or on Dask), the printed table and the files written, and the cached answer a
re-run prints and writes without the analysis stack."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

from trace_roofline import memory
from trace_roofline.cachedir import CacheDir
from trace_roofline.cli_args import (
    PROG,
    add_convention_args,
    add_force_arg,
    get_model,
    model_arg,
    not_a_model_config,
    option_files,
    out_dir,
    outputs_of,
    positive_int,
    write_and_print,
)
from trace_roofline.errors import InputError
from trace_roofline.files import check_outputs, check_targets, find_traces, staged_file, write_files
from trace_roofline.model.hardware import Hardware, get_hardware
from trace_roofline.options import AnalysisOptions, DecodeShapes

if TYPE_CHECKING:
    from trace_roofline.cache import TraceCache
    from trace_roofline.roofline import Analysis

# Every file `analyze --out` may write: checked against the inputs before the work, and the set
# the directory is swapped in as (files.write_files: the complete old or new set).
ANALYZE_OUT = ("operators.csv", "operators_by_layer.csv", "operators.parquet", "report.json",
               "report.md", "report.html", "roofline.png", "roofline.svg", "ranks.csv")


def add_analyze(sub: argparse._SubParsersAction) -> None:
    """`analyze`: attribute, cost and place every operator of traces on the roofline."""
    p = sub.add_parser(
        "analyze", help="attribute, cost and place every operator of traces on the roofline",
        description="Attribute every kernel of each trace to an operator, cost it from the "
                    "shapes in the trace and place it on its device's roofline; prints a table "
                    "per trace and, with --out, writes operators.csv, operators_by_layer.csv, "
                    "operators.parquet, report.json, report.md, report.html, roofline.png and "
                    "roofline.svg.",
        epilog="examples:\n"
               "  trace-roofline analyze decode.json.gz prefill.json.gz --model qwen2.5-7b "
               "--layers 28 --out report\n"
               "  trace-roofline analyze log_dir/ --per-layer   # tensorboard_trace_handler output\n"
               "  trace-roofline analyze decode.json.gz --ncu decode.ncu.csv")
    p.add_argument("traces", nargs="+",
                   help="torch.profiler trace(s): .json, .json.gz, or a directory of them "
                        "(tensorboard_trace_handler layouts included; other files skipped)")
    p.add_argument("--model", type=model_arg,
                   help="preset name, HF config.json or HF model directory: names GEMMs in "
                        "unannotated traces, needed by --layers (default: none)")
    p.add_argument("--hardware",
                   help="preset name or JSON file for every trace (default: each trace's own "
                        "GPU; none for a CPU trace: intensities only)")
    p.add_argument("--layers", type=int,
                   help="extrapolate a layer trace to this many layers (default: no extrapolation)")
    p.add_argument("--ncu", action="append", default=[], metavar="CSV",
                   help="Nsight Compute raw CSV of the same run: one per trace, in order "
                        "(default: none)")
    p.add_argument("--tp", type=positive_int, metavar="T",
                   help="each trace is one rank of --model sharded T ways by tensor parallelism "
                        "(and collectives span T ranks) (default: inferred from the GEMM shapes)")
    p.add_argument("--per-layer", action="store_true",
                   help="also a block per layer, its time%% of the layer's device time")
    p.add_argument("--by-shape", action="store_true",
                   help="one row and point per (operator, shape), e.g. per M of a sweep")
    p.add_argument("--graph-map", metavar="TRACE_OR_DIR",
                   help="names and shapes for CUDA/HIP-graph replays: an eager (graphs off) "
                        "trace of the same step, a profiled graph capture, or a folder of "
                        "captures (vLLM's capture_torch_profiler_dir, TraceLens's "
                        "capture_traces/ with execution_details.json), named with the same "
                        "--model (default: a capture_traces/ folder beside the trace, else the "
                        "trace's own eager passes or capture, else kernel names)")
    p.add_argument("--batch", type=int,
                   help="decode batch B of CUDA-graph replays named from kernel names, to cost "
                        "them, with --context (default: none: named, uncosted)")
    p.add_argument("--context", type=int,
                   help="keys S each decode query attends to, with --batch (default: none)")
    _add_run_args(p)
    add_convention_args(p)
    p.set_defaults(func=run_analyze, tune_memory=False)  # (tuned once the work starts)


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """`analyze`'s outputs, cache, --force and workers."""
    p.add_argument("--out", help="directory for operators.csv/.parquet, report.json/.md/.html, "
                                 "roofline.png/.svg (default: print only)")
    p.add_argument("--json", help="also write report.json to this path (default: none)")
    p.add_argument("--perfetto", metavar="FILE",
                   help="write the trace enriched for ui.perfetto.dev: kernel args, operator "
                        "slices, TFLOP/s and GB/s counters (one trace; .gz compresses) (default: none)")
    p.add_argument("--no-cache", action="store_true",
                   help="neither read nor write the cache of parsed trace tables, attributions "
                        "and finished analyses (see `cache info`; default: use it)")
    add_force_arg(p)
    p.add_argument("--jobs", type=positive_int, default=1, metavar="N",
                   help="analyse N traces at a time in local processes, never more than the CPUs "
                        "this process may use (its affinity and cgroup quota) (default: 1, in "
                        "this process)")
    p.add_argument("--dask", metavar="ADDRESS",
                   help="analyse the traces on a Dask cluster: a scheduler address, or 'local' to "
                        "start a LocalCluster of --jobs workers (needs trace-roofline[dask]) "
                        "(default: none)")


@dataclasses.dataclass(frozen=True)
class Job:
    """An `analyze` command, checked before the work: its traces (a folder's expanded), each
    trace's ncu CSV, the hardware and options for every trace, the --out folder, and every
    input file no output may overwrite."""

    traces: list[str]
    ncu: list[str | None]
    hardware: Hardware | None
    options: AnalysisOptions
    out: Path | None
    inputs: list[str | None]


def run_analyze(args: argparse.Namespace) -> int:
    """Print (and write) the analyses of the traces, or their cached answer."""
    job = checked(args)
    answers = None if args.no_cache or args.perfetto else CacheDir()
    key = _answer_key(args, job) if answers is not None else None
    if answers is not None and key is not None and (found := answers.answer(key)) is not None:
        return _serve(found, args, job)  # nothing parsed, no DataFrame built
    memory.tune()  # the work starts: allocator settings for big, short-lived arrays
    cache = None if args.no_cache else _trace_cache()
    analyses, infos, kernels = _analyses(args, job, cache)
    for status in cache.log if cache else []:  # in this process only (jobs 1, no dask)
        if status.write_error:
            print(f"{PROG}: note: {status.path}: not cached ({status.write_error})", file=sys.stderr)
    text, outputs = _rendered(args, job.out, analyses, infos)
    answer = {_TEXT: text.encode(), **_answer_files(outputs, args)}
    with contextlib.ExitStack() as stack:  # the Perfetto file lands with the others or not at all
        if args.perfetto:
            _write_perfetto(stack, Path(args.perfetto), kernels, analyses[0])
            text += f"\n\nwrote {args.perfetto} (open it in ui.perfetto.dev)"
        if outputs:
            written = write_files(outputs, inputs=job.inputs,
                                  sets={job.out: ANALYZE_OUT} if job.out is not None else None)
            text += "\n\nwrote " + ", ".join(str(p) for p in written)
    if answers is not None and key is not None and cache is not None and not any(
            status.write_error for status in cache.log):
        for error in answers.store_answer(key, answer):
            print(f"{PROG}: note: answer not cached ({error})", file=sys.stderr)
    print(text)
    return 0


def checked(args: argparse.Namespace) -> Job:
    """The command's `Job`, every argument checked before the work (and no output over an
    input)."""
    out = out_dir(args.out)
    check_targets([args.json] if args.json else [])
    hw = get_hardware(args.hardware) if args.hardware else None
    traces = _trace_paths(args.traces)
    if args.ncu and len(args.ncu) != len(traces):
        raise InputError(f"{len(args.ncu)} --ncu file(s) for {len(traces)} trace(s): give one "
                         "--ncu per trace, in the order of the traces")
    if args.graph_map is not None and not Path(args.graph_map).exists():
        raise InputError(f"{args.graph_map}: no such file or folder (--graph-map: an eager trace, "
                         "a graph capture or a folder of captures)")
    inputs = [*traces, *args.ncu, args.graph_map, *option_files(args.model, args.hardware)]
    check_outputs(outputs_of(args, out, ANALYZE_OUT), inputs)  # before the work
    return Job(traces, args.ncu or [None] * len(traces), hw, _options(args), out, inputs)


def _options(args: argparse.Namespace) -> AnalysisOptions:
    shapes = None
    if (args.batch is None) != (args.context is None):
        raise InputError("--batch and --context go together (the decode shapes of graph replays)")
    if args.batch is not None:
        if args.model is None:
            raise InputError("--batch/--context need --model (the shapes of its linears)")
        shapes = DecodeShapes(args.batch, args.context)
    return AnalysisOptions(causal=args.causal, attention_bytes=args.attention_bytes,
                           layers=args.layers, by_shape=args.by_shape, force=args.force,
                           tp=args.tp, graph_map=args.graph_map, decode_shapes=shapes)


def _trace_cache() -> TraceCache:
    from trace_roofline.cache import TraceCache

    return TraceCache()


def _analyses(args: argparse.Namespace, job: Job, cache: TraceCache | None
              ) -> tuple[list[Analysis], list, object]:
    """Every trace's Analysis, their ranks' information (none with --perfetto) and, with
    --perfetto, the kernels (pipeline.Attributed) its one Analysis was computed from."""
    from trace_roofline.parallel import Workers, analyze_many
    from trace_roofline.pipeline import Run, analyze_trace_kernels
    from trace_roofline.trace import progress_bar

    model = get_model(args.model) if args.model else None
    if args.perfetto:  # the enriched file needs the trace and the kernels the analysis named
        if len(job.traces) != 1:
            raise InputError(f"--perfetto takes one trace, got {len(job.traces)}")
        analysis, kernels = analyze_trace_kernels(
            job.traces[0], model, job.hardware, job.options.replace(ncu=job.ncu[0]),
            Run(cache=cache, progress=progress_bar()))
        return [analysis], [], kernels
    workers = Workers(cache=cache, progress=progress_bar(), jobs=args.jobs, dask=args.dask)
    results = analyze_many(job.traces, model, job.hardware,
                           [job.options.replace(ncu=n) for n in job.ncu], workers)
    return [r.analysis for r in results], [r.rank for r in results], None


def _rendered(args: argparse.Namespace, out: Path | None, analyses: list[Analysis],
              infos: list) -> tuple[str, dict[Path, bytes]]:
    """The printed text and every output file, rendered in memory first (a failure leaves no
    partial files behind)."""
    from trace_roofline.attribution import ranks
    from trace_roofline.outputs import report

    cross = (ranks.CrossRank.of(infos, [a.operators for a in analyses],
                                [a.collectives for a in analyses]) if infos else None)
    analyses = [m for a in analyses for m in (a, *a.models)]  # a trace's models, each apart
    text = report.terminal_table(analyses, per_layer=args.per_layer)
    if cross is not None:  # the traces are ranks of one run
        text += "\n\n" + cross.text()
    elif note := ranks.unranked_note(infos):
        text += f"\n\n{note}"
    across = cross.to_dict() if cross is not None else None
    outputs: dict[Path, bytes] = ({Path(args.json): report.report_json(analyses, ranks=across)}
                                  if args.json else {})
    if out is not None:
        files = report.output_files(analyses, ranks=across)
        if cross is not None:
            files["ranks.csv"] = report.csv_bytes(cross.summary)
        outputs |= {out / name: data for name, data in files.items()}
        outputs |= _html_report(out, analyses)
    return text, outputs


def _trace_paths(given: Sequence[str]) -> list[str]:
    """Each given path, a directory standing for the traces in it (notes on stderr name the
    files skipped as not traces). A model config given as a trace is refused with a hint."""
    paths: list[str] = []
    for path in given:
        if not Path(path).is_dir():
            not_a_model_config(path)
            paths.append(path)
            continue
        try:
            traces, skipped = find_traces(path)
        except InputError:
            not_a_model_config(path)
            raise
        paths += map(str, traces)
        if skipped:
            print(f"{PROG}: note: {path}: skipped {len(skipped)} file(s) that are not traces: "
                  + ", ".join(p.name for p in skipped), file=sys.stderr)
    return paths


# A cached answer (analyze's printed table and the files asked for, cachedir.CacheDir.answer):
# its parts by name, the files as "json" (--json's) and "out/<name>" (--out's).
_TEXT, _JSON, _OUT = "text", "json", "out/"
ANSWER_VERSION = 1  # bump when what an answer holds changes
# The libraries whose versions shape the answer's bytes (tables, Parquet, charts, report.html).
_RENDERERS = ("pandas", "pyarrow", "numpy", "matplotlib", "bokeh", "msgspec")


def _answer_key(args: argparse.Namespace, job: Job) -> dict | None:
    """The key of `analyze`'s answer: every trace's file identity (files.identity) and given
    path, the code and library versions, every Analysis cache key's argument (the model by
    its argument, a file by its identity), and what is printed or written; None when a trace
    is not a regular file or an argument has no key (then nothing is cached)."""
    from importlib.metadata import PackageNotFoundError, version

    from trace_roofline.cachedir import code_fingerprint
    from trace_roofline.files import identity

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    try:
        if not all(Path(t).is_file() for t in job.traces):
            return None
        model = ({"arg": args.model, "file": identity(Path(args.model)) if Path(args.model).is_file()
                  else None} if args.model else None)
        keys = [job.options.replace(ncu=n).cache_key() for n in job.ncu]
        if any(k is None for k in keys):
            return None
        key = {"answer": ANSWER_VERSION, "code": code_fingerprint(),
               "versions": {name: installed(name) for name in _RENDERERS},
               "traces": [{**identity(Path(t)), "given": t} for t in job.traces],
               "model": model, "hardware": _dataclass_key(job.hardware), "options": keys,
               "per_layer": args.per_layer, "json": bool(args.json), "out": bool(args.out)}
        return json.loads(json.dumps(key))  # as the manifest will hold it (tuples: lists)
    except (OSError, TypeError, ValueError):
        return None


def _dataclass_key(value: object) -> object:
    """A dataclass (the hardware) as its type name and fields; None as None."""
    if value is None:
        return None
    return {"type": type(value).__name__, **dataclasses.asdict(value)}  # type: ignore[call-overload]


def _answer_files(outputs: dict[Path, bytes], args: argparse.Namespace) -> dict[str, bytes]:
    """The files of `outputs` by their answer names (`_JSON`, `_OUT` + name), in their order."""
    json_path = Path(args.json) if args.json else None
    return {_JSON if path == json_path else _OUT + path.name: data for path, data in outputs.items()}


def _serve(answer: dict[str, bytes], args: argparse.Namespace, job: Job) -> int:
    """Print a cached answer and write its files where this run asks for them."""
    text = answer.pop(_TEXT).decode()
    outputs = {Path(args.json) if name == _JSON else cast(Path, job.out) / name.removeprefix(_OUT):
               data for name, data in answer.items()}
    return write_and_print(text, outputs, job.inputs, job.out, ANALYZE_OUT)


def _html_report(out: Path, analyses) -> dict[Path, bytes]:
    """report.html (Bokeh, a base dependency); a note instead when Bokeh was removed."""
    try:
        from trace_roofline.outputs.html_report import report_html

        return {out / "report.html": report_html(analyses).encode()}
    except ModuleNotFoundError as e:
        if e.name is None or not e.name.startswith("bokeh"):
            raise
        print(f"{PROG}: report.html skipped: Bokeh is not installed (pip install 'bokeh>=3.4')",
              file=sys.stderr)
        return {}


def _write_perfetto(stack: contextlib.ExitStack, path: Path, kernels, analysis) -> None:
    """Stream the enriched trace into a staged file (gzip when the name ends in .gz), from
    the kernels (pipeline.Attributed) the analysis was computed from."""
    from trace_roofline.outputs.perfetto import enriched_trace

    f = stack.enter_context(staged_file(path))
    out = gzip.GzipFile(fileobj=f, mode="wb", compresslevel=1) if path.suffix == ".gz" else f
    for chunk in enriched_trace(kernels.trace, kernels.kernels, analysis):
        out.write(chunk)
    if out is not f:
        out.close()


