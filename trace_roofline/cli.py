"""`trace-roofline` command line: a thin layer that parses arguments, calls the library, prints/writes.

Every user error ends in one line on stderr and exit code 2; the parameters an InputError is
about are spelled as this CLI's flags (`FLAGS`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import gzip
import io
import json
import os
import re
import stat
import sys
import threading
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, cast

from trace_roofline import memory
from trace_roofline.cachedir import CacheDir
from trace_roofline.errors import InputError
from trace_roofline.files import check_outputs, check_targets, find_traces, staged_file, write_files
from trace_roofline.model import formulas
from trace_roofline.model.hardware import get_hardware
from trace_roofline.options import AnalysisOptions, DecodeShapes

if TYPE_CHECKING:
    from trace_roofline.model.models import ModelSpec

PROG = "trace-roofline"
DESCRIPTION = """\
Place every kernel of a profiled LLM on the roofline, and say why it sits there.

trace-roofline reads torch.profiler Chrome traces, attributes every kernel microsecond to a
named operator (q_proj, attention, down_proj, ...), costs each operator from the shapes in the
trace, and reports its intensity, achieved FLOP/s and bytes/s, the attainable roof and whether
it is memory- or compute-bound. `run`, `sweep` and `calibrate` produce traces and ceilings
(they need torch)."""
EXAMPLES = """\
examples:
  trace-roofline analyze trace.json.gz --model qwen2.5-7b --layers 28 --out report
  trace-roofline analyze traces/ --per-layer          # every trace in a directory
  trace-roofline intensity --model qwen2.5-7b --hardware rtx4090 --lesson
  trace-roofline run --phase prefill --tokens 2048 --device cuda
"""
# Packages add subcommands through this entry-point group: a function taking the subparsers.
COMMANDS_GROUP = "trace_roofline.commands"
# Library parameter name -> the flag that sets it: how InputError.spelled writes a parameter.
FLAGS = {
    "attention_bytes": "--attention-bytes", "by_shape": "--by-shape", "causal": "--causal",
    "context": "--context", "device": "--device", "dtype": "--dtype", "force": "--force",
    "hardware": "--hardware",
    "layers": "--layers", "layout": "--layout", "model": "--model", "ncu": "--ncu",
    "out": "--out", "phase": "--phase", "projection": "--projection", "steps": "--steps",
    "tokens": "--tokens", "warmup": "--warmup", "batch": "--batch", "tp": "--tp",
    "graph_map": "--graph-map", "jobs": "--jobs", "dask": "--dask", "host_ms": "--host-ms",
}
class Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's and epilog's lines; appends each option's default to its help
    (an option whose default is None says in its help what happens without it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (default not in (None, argparse.SUPPRESS) and action.nargs != 0  # not a switch
                and "%(default)" not in text and "(default:" not in text and action.option_strings):
            shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else "%(default)s"
            text += f" (default: {shown})"
        return text


class Parser(argparse.ArgumentParser):
    """argparse that reports errors in one line (no usage dump) with exit code 2 and shows
    defaults in its help."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {_suggested(message)}\n")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        """argparse's, with the chosen command's parser reporting what it did not recognise,
        each misspelt flag with the one it most likely means."""
        ns, extras = super().parse_known_args(args, namespace)
        command = self._command_parser(ns)
        if extras and command is not None and self is not command:
            command.error("unrecognized arguments: " + " ".join(
                _with_suggestion(x, command._option_string_actions) for x in extras))
        return ns, extras

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error("unrecognized arguments: " + " ".join(
                _with_suggestion(x, self._option_string_actions) for x in extras))
        return ns

    def _command_parser(self, ns: argparse.Namespace) -> argparse.ArgumentParser | None:
        """The parser of the subcommand `ns` names (None without subcommands)."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action.choices.get(getattr(ns, action.dest or "", None) or "")
        return None


_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)$")


def did_you_mean(word: str, choices: Sequence[str]) -> str | None:
    """The choice `word` most likely misspells (difflib's closest, cutoff 0.6), else None."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return close[0] if close else None


def _with_suggestion(token: str, options: Sequence[str]) -> str:
    """An unrecognised argument, with the flag it likely misspells: "--modle (did you mean
    --model?)"."""
    flag = token.split("=", 1)[0]
    guess = did_you_mean(flag, [o for o in options if o.startswith("--")]) if flag.startswith("-") else None
    return f"{token} (did you mean {guess}?)" if guess else token


def _suggested(message: str) -> str:
    """argparse's message, an invalid choice followed by the choice it most likely misspells."""
    m = _INVALID_CHOICE.search(message)
    if m is None:
        return message
    guess = did_you_mean(m.group(1), re.findall(r"'([^']*)'", m.group(2)))
    return f"{message}; did you mean {guess!r}?" if guess else message


def _ints_at_least(text: str, least: int, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < least for v in values):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return values


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated positive integers, e.g. '1,16,64'."""
    return _ints_at_least(text, 1, "positive integers")


def _count_list(text: str) -> list[int]:
    """argparse type: comma-separated integers >= 0, e.g. '0,1024'."""
    return _ints_at_least(text, 0, "integers >= 0")


def _name_list(text: str) -> list[str]:
    """argparse type: comma-separated names, e.g. 'h100-sxm,h200'."""
    values = [x.strip() for x in text.split(",") if x.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return values


def positive_int(text: str) -> int:
    """argparse type: one positive integer, e.g. '2'."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def model_arg(text: str) -> str:
    """argparse type for --model: a preset name, a config.json, or a Hugging Face model
    directory (its config.json)."""
    path = Path(text)
    if not path.is_dir():
        return text
    config = path / "config.json"
    if not config.is_file():
        raise argparse.ArgumentTypeError(f"{path}: directory holds no config.json")
    return str(config)


def add_convention_args(p: argparse.ArgumentParser, lesson: bool = False) -> None:
    """--causal / --attention-bytes (and --lesson where the lesson's table is reproducible:
    then both default to None, resolved by `conventions`)."""
    p.add_argument("--causal", choices=formulas.CAUSAL_CONVENTIONS, default=None if lesson else "causal",
                   help="attention FLOPs: every query-key pair (full) or unmasked ones (causal)"
                        + (" (default: causal; full with --lesson)" if lesson else ""))
    p.add_argument("--attention-bytes", choices=formulas.ATTENTION_BYTES_CONVENTIONS,
                   default=None if lesson else "all",
                   help="attention bytes: K,V reads only (kv) or Q,K,V read + O written (all)"
                        + (" (default: all; kv with --lesson)" if lesson else ""))
    if lesson:
        p.add_argument("--lesson", action="store_true",
                       help="the lesson's conventions: --causal full --attention-bytes kv")


def add_force_arg(p: argparse.ArgumentParser, layers: bool = True) -> None:
    p.add_argument("--force", action="store_true",
                   help="analyse traces whose shapes contradict --model (an error otherwise): "
                        + ("warn, and never extrapolate with --layers" if layers else "warn"))


def conventions(args: argparse.Namespace) -> tuple[formulas.Causal, formulas.AttentionBytes]:
    """(causal, attention_bytes) of `intensity`: --lesson's unless a flag contradicts it."""
    if not args.lesson:
        return args.causal or "causal", args.attention_bytes or "all"
    for flag, given, lesson in (("--causal", args.causal, "full"),
                                ("--attention-bytes", args.attention_bytes, "kv")):
        if given not in (None, lesson):
            raise InputError(f"--lesson means {flag} {lesson}; drop --lesson or {flag} {given}")
    return "full", "kv"


def get_model(name: str) -> ModelSpec:
    """model.models.get_model, imported on first use (the model layouts load pandas)."""
    from trace_roofline.model.models import get_model as preset_or_config

    return preset_or_config(name)


def _cmd_intensity(args: argparse.Namespace) -> int:
    from trace_roofline.costs import calculator

    causal, attention_bytes = conventions(args)
    table = calculator.intensity_table(
        get_model(args.model), get_hardware(args.hardware), args.m, args.s,
        causal, attention_bytes, args.fused,
    )
    print(json.dumps(table, indent=2) if args.json else calculator.format_intensity(table))
    return 0


# A Hugging Face config.json is a few kB: a JSON file this small without traceEvents is read
# whole to tell a model config given as the trace (no trace is this small and config-like).
_CONFIG_MAX_BYTES = 1 << 20
# Keys every HF config has one of, and no Chrome trace has at its top level.
_CONFIG_KEYS = frozenset({"model_type", "architectures", "hidden_size", "num_hidden_layers",
                          "num_attention_heads", "text_config", "n_embd", "d_model"})


def is_model_config(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a model's config.json: a small JSON object with a config's keys and no
    traceEvents. Only a regular file is opened (never a FIFO or a device), and only a small one."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _CONFIG_MAX_BYTES:
            return False
        with open(path, "rb") as f:
            doc = json.loads(f.read())
    except (OSError, ValueError, RecursionError):  # unreadable, or not JSON (gzip, binary, ...)
        return False
    return isinstance(doc, dict) and "traceEvents" not in doc and bool(_CONFIG_KEYS & doc.keys())


def _not_a_model_config(path: str | os.PathLike[str]) -> None:
    """Raise the one-line hint when a trace argument is a model config, or a folder without
    traces whose config.json is one (a Hugging Face model directory)."""
    p = Path(path)
    if is_model_config(p):
        raise InputError(f"{p}: this is a model config, not a trace: pass it as --model {p}")
    if p.is_dir() and is_model_config(p / "config.json"):
        raise InputError(f"{p}: holds no trace but a model config (config.json): pass it as "
                         f"--model {p}")


def _trace_paths(given: Sequence[str]) -> list[str]:
    """Each given path, a directory standing for the traces in it (notes on stderr name the
    files skipped as not traces). A model config given as a trace is refused with a hint."""
    paths: list[str] = []
    for path in given:
        if not Path(path).is_dir():
            _not_a_model_config(path)
            paths.append(path)
            continue
        try:
            traces, skipped = find_traces(path)
        except InputError:
            _not_a_model_config(path)
            raise
        paths += map(str, traces)
        if skipped:
            print(f"{PROG}: note: {path}: skipped {len(skipped)} file(s) that are not traces: "
                  + ", ".join(p.name for p in skipped), file=sys.stderr)
    return paths


def _cmd_cache(args: argparse.Namespace) -> int:
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
# work, and the set the directory is swapped in as (files.write_files: complete old or new set).
ANALYZE_OUT = ("operators.csv", "operators_by_layer.csv", "operators.parquet", "report.json",
               "report.md", "report.html", "roofline.png", "roofline.svg", "ranks.csv")
DIFF_OUT = ("diff.csv", "diff.json", "diff.md", "diff.png")


def _option_files(*values: str | None) -> list[str]:
    """The --model/--hardware values that are files (an HF config.json, a hardware JSON)."""
    return [v for v in values if v and Path(v).is_file()]


def _outputs(args: argparse.Namespace, out: Path | None,
             names: Sequence[str]) -> list[tuple[str, Path]]:
    """(flag, path) of every output the command may write: --json, --perfetto, --out's files."""
    given = [(f"--{flag}", Path(getattr(args, flag))) for flag in ("json", "perfetto")
             if getattr(args, flag, None)]
    return given + ([("--out", out / name) for name in names] if out is not None else [])


def _cmd_analyze(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else None
    if out is not None and out.exists() and not out.is_dir():  # fail before the work, not after
        raise InputError(f"{out}: --out exists and is not a directory")
    check_targets([args.json] if args.json else [])
    hw = get_hardware(args.hardware) if args.hardware else None
    traces = _trace_paths(args.traces)
    if args.ncu and len(args.ncu) != len(traces):
        raise InputError(f"{len(args.ncu)} --ncu file(s) for {len(traces)} trace(s): give one "
                         "--ncu per trace, in the order of the traces")
    ncu = args.ncu or [None] * len(traces)
    if args.graph_map is not None and not Path(args.graph_map).exists():
        raise InputError(f"{args.graph_map}: no such file or folder (--graph-map: an eager trace, "
                         "a graph capture or a folder of captures)")
    inputs = [*traces, *args.ncu, args.graph_map, *_option_files(args.model, args.hardware)]
    check_outputs(_outputs(args, out, ANALYZE_OUT), inputs)  # before the work: no output over an input
    shapes = None
    if (args.batch is None) != (args.context is None):
        raise InputError("--batch and --context go together (the decode shapes of graph replays)")
    if args.batch is not None:
        if args.model is None:
            raise InputError("--batch/--context need --model (the shapes of its linears)")
        shapes = DecodeShapes(args.batch, args.context)
    options = AnalysisOptions(causal=args.causal, attention_bytes=args.attention_bytes,
                              layers=args.layers, by_shape=args.by_shape, force=args.force,
                              tp=args.tp, graph_map=args.graph_map, decode_shapes=shapes)
    answers = None if args.no_cache or args.perfetto else CacheDir()
    key = _answer_key(args, traces, ncu, hw, options) if answers is not None else None
    if answers is not None and key is not None and (found := answers.answer(key)) is not None:
        return _serve(found, args, out, inputs)  # nothing parsed, no DataFrame built
    memory.tune()  # the work starts: allocator settings for big, short-lived arrays
    from trace_roofline.attribution import ranks
    from trace_roofline.cache import TraceCache
    from trace_roofline.outputs import report
    from trace_roofline.parallel import analyze_many
    from trace_roofline.pipeline import analyze_trace_kernels
    from trace_roofline.trace import progress_bar

    model = get_model(args.model) if args.model else None
    cache = None if args.no_cache else TraceCache()
    if args.perfetto:  # the enriched file needs the trace and the kernels the analysis named
        if len(traces) != 1:
            raise InputError(f"--perfetto takes one trace, got {len(traces)}")
        analysis, kernels = analyze_trace_kernels(traces[0], model, hw,
                                                  options.replace(ncu=ncu[0]),
                                                  progress=progress_bar(), cache=cache)
        analyses, infos = [analysis], []
    else:
        results = analyze_many(traces, model, hw, options, ncu=ncu, jobs=args.jobs,
                               dask=args.dask, progress=progress_bar(), cache=cache)
        analyses, infos = [r.analysis for r in results], [r.rank for r in results]
    for status in cache.log if cache else []:  # in this process only (jobs 1, no dask)
        if status.write_error:
            print(f"{PROG}: note: {status.path}: not cached ({status.write_error})", file=sys.stderr)
    cross = (ranks.CrossRank.of(infos, [a.operators for a in analyses],
                                [a.collectives for a in analyses]) if infos else None)
    analyses = [m for a in analyses for m in (a, *a.models)]  # a trace's models, each apart
    # Render every output in memory first: a failure leaves no partial files behind.
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
    answer = {_TEXT: text.encode(), **_answer_files(outputs, args)}
    with contextlib.ExitStack() as stack:  # the Perfetto file lands with the others or not at all
        if args.perfetto:
            _write_perfetto(stack, Path(args.perfetto), kernels, analyses[0])
            text += f"\n\nwrote {args.perfetto} (open it in ui.perfetto.dev)"
        if outputs:
            written = write_files(outputs, inputs=inputs,
                                  sets={out: ANALYZE_OUT} if out is not None else None)
            text += "\n\nwrote " + ", ".join(str(p) for p in written)
    if answers is not None and key is not None and cache is not None and not any(
            status.write_error for status in cache.log):
        for error in answers.store_answer(key, answer):
            print(f"{PROG}: note: answer not cached ({error})", file=sys.stderr)
    print(text)
    return 0


# A cached answer (analyze's printed table and the files asked for, cachedir.CacheDir.answer):
# its parts by name, the files as "json" (--json's) and "out/<name>" (--out's).
_TEXT, _JSON, _OUT = "text", "json", "out/"
ANSWER_VERSION = 1  # bump when what an answer holds changes
# The libraries whose versions shape the answer's bytes (tables, Parquet, charts, report.html).
_RENDERERS = ("pandas", "pyarrow", "numpy", "matplotlib", "bokeh", "msgspec")


def _answer_key(args: argparse.Namespace, traces: Sequence[str], ncu: Sequence[str | None],
                hardware: object, options: AnalysisOptions) -> dict | None:
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
        if not all(Path(t).is_file() for t in traces):
            return None
        model = ({"arg": args.model, "file": identity(Path(args.model)) if Path(args.model).is_file()
                  else None} if args.model else None)
        keys = [options.replace(ncu=n).cache_key() for n in ncu]
        if any(k is None for k in keys):
            return None
        key = {"answer": ANSWER_VERSION, "code": code_fingerprint(),
               "versions": {name: installed(name) for name in _RENDERERS},
               "traces": [{**identity(Path(t)), "given": t} for t in traces],
               "model": model, "hardware": _dataclass_key(hardware), "options": keys,
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


def _serve(answer: dict[str, bytes], args: argparse.Namespace, out: Path | None,
           inputs: Sequence[str | None]) -> int:
    """Print a cached answer and write its files where this run asks for them."""
    text = answer.pop(_TEXT).decode()
    outputs = {Path(args.json) if name == _JSON else cast(Path, out) / name.removeprefix(_OUT): data
               for name, data in answer.items()}
    return _write_and_print(text, outputs, inputs, out, ANALYZE_OUT)


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


def _diff_side(path: str, args: argparse.Namespace, label: str):
    """A report.json (a JSON object whose first key is "schema_version", "trace" or "traces"),
    an `analyze --out` folder (its report.json) or a trace."""
    from trace_roofline.files import read_json
    from trace_roofline.outputs import diff
    from trace_roofline.pipeline import analyze_trace
    from trace_roofline.trace import progress_bar

    p = Path(path)
    _not_a_model_config(p)
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
    return diff.side(analyze_trace(p, model, hw, causal=args.causal,
                                   attention_bytes=args.attention_bytes, force=args.force,
                                   progress=progress_bar()))


_REPORT_HEAD = re.compile(rb'\A\s*\{\s*"(?:traces?|schema_version)"\s*:')


def _cmd_diff(args: argparse.Namespace) -> int:
    from trace_roofline.outputs import diff, report

    out = Path(args.out) if args.out else None
    if out is not None and out.exists() and not out.is_dir():
        raise InputError(f"{out}: --out exists and is not a directory")
    inputs = [args.a, args.b, *_option_files(args.model, args.hardware)]
    check_outputs(_outputs(args, out, DIFF_OUT), inputs)
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


PROJECT_OUT = ("projection.json", "projection.png")


def _cmd_project(args: argparse.Namespace) -> int:
    from trace_roofline import project
    from trace_roofline.outputs.plot import projection_figure
    from trace_roofline.pipeline import analyze_trace
    from trace_roofline.trace import load_trace, progress_bar

    out = Path(args.out) if args.out else None
    if out is not None and out.exists() and not out.is_dir():
        raise InputError(f"{out}: --out exists and is not a directory")
    _not_a_model_config(args.trace)
    if Path(args.trace).is_dir():
        raise InputError(f"{args.trace}: project takes one trace file, not a directory")
    inputs = [args.trace, *_option_files(args.model, *(args.hardware or []))]
    check_outputs(_outputs(args, out, PROJECT_OUT), inputs)
    model = get_model(args.model)
    hardware = [get_hardware(h) for h in args.hardware] if args.hardware else None
    trace = load_trace(args.trace, progress=progress_bar())
    analysis = analyze_trace(trace, model, causal=args.causal,
                             attention_bytes=args.attention_bytes, force=args.force)
    result = project.project(analysis, trace=trace, batch=args.batch, context=args.context,
                             tokens=args.tokens, layers=args.layers, hardware=hardware,
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
    return _write_and_print(text, outputs, inputs, out, PROJECT_OUT)


def _write_and_print(text: str, outputs: dict[Path, bytes], inputs: Sequence[str | None],
                     out: Path | None, names: Sequence[str]) -> int:
    """Write `outputs` (none over an input; `names` the set `out` may hold), then print `text`
    with the files written."""
    if outputs:
        written = write_files(outputs, inputs=inputs, sets={out: names} if out is not None
                              else None)
        text += "\n\nwrote " + ", ".join(str(p) for p in written)
    print(text)
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trace-roofline")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def _no_command(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    print(f"\n{PROG}: error: give a command (above); `{PROG} COMMAND --help` for its options",
          file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog=PROG, description=DESCRIPTION, epilog=EXAMPLES)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    # No command: the usage and the command list (the whole help), exit 2, not a bare
    # "arguments are required".
    parser.set_defaults(func=lambda args: _no_command(parser))
    sub = parser.add_subparsers(dest="command", title="commands", parser_class=Parser)

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
    p.set_defaults(func=_cmd_intensity)

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
                   help="analyse N traces at a time in local processes (default: 1, in this process)")
    p.add_argument("--dask", metavar="ADDRESS",
                   help="analyse the traces on a Dask cluster: a scheduler address, or 'local' to "
                        "start a LocalCluster of --jobs workers (needs trace-roofline[dask]) "
                        "(default: none)")
    add_convention_args(p)
    p.set_defaults(func=_cmd_analyze)

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
    p.set_defaults(func=_cmd_diff)

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
    p.add_argument("--context", type=_count_list,
                   help="cached keys per sequence before the step, e.g. 1024,4096 (default: the "
                        "trace's)")
    p.add_argument("--tokens", type=int_list,
                   help="new tokens per sequence: 1 in decode, the prompt length in prefill "
                        "(default: the trace's)")
    p.add_argument("--layers", type=positive_int,
                   help="decoder layers (default: the trace's)")
    p.add_argument("--hardware", type=_name_list,
                   help="preset names or JSON files, comma-separated (default: the trace's GPU)")
    p.add_argument("--host-ms", type=float, metavar="MS",
                   help="host time per step without the profiler (default: the trace's profiled "
                        "host time less the profiler's cost per recorded event)")
    p.add_argument("--json", help="write projection.json to this path (default: none)")
    p.add_argument("--out", help="directory for projection.json and projection.png "
                                 "(default: print only)")
    add_force_arg(p, layers=False)
    add_convention_args(p)
    p.set_defaults(func=_cmd_project)

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
    p.set_defaults(func=_cmd_cache)
    for plugin in entry_points(group=COMMANDS_GROUP):  # workloads' run, sweep, calibrate
        plugin.load()(sub)
    return parser


def dispatch(args: argparse.Namespace) -> int:
    """Run a parsed subcommand: an InputError becomes one line on stderr (parameters spelled
    as flags) and exit code 2."""
    try:
        return args.func(args)
    except InputError as e:
        print(f"{PROG}: error: {e.spelled(FLAGS)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `trace-roofline analyze ... | head`: stop quietly
        sys.stderr.close()
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "func", None) not in (_cmd_cache, _cmd_analyze):  # (analyze: once it works)
        memory.tune()  # this process is ours: allocator settings for big, short-lived arrays
    return dispatch(args)


def run(argv: Sequence[str] | None = None) -> NoReturn:
    """The console script: `main`, then exit. When nothing else runs (one thread, no child
    process) and the output is flushed, the process ends at once (os._exit), without tearing
    down the interpreter: freeing pandas' and pyarrow's modules takes ~0.1 s, and every file
    this CLI writes is complete (written, closed and renamed into place) before `main`
    returns."""
    code = main(argv)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed pipe or stream: the interpreter's exit reports it
        sys.exit(code)
    children = sys.modules.get("multiprocessing")
    if threading.active_count() == 1 and not (children and children.active_children()):
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
