"""`trace-roofline` command line: a thin layer that parses arguments, calls the library, prints/writes.

Every user error ends in one line on stderr and exit code 2; the parameters an InputError is
about are spelled as this CLI's flags (`FLAGS`). The commands: `analyze` (cli_analyze.py), the
others (cli_commands.py), and those packages add (`COMMANDS_GROUP`); the parser's parts and
what every command shares: cli_args.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import NoReturn

from trace_roofline import cli_analyze, cli_commands, memory
from trace_roofline.cli_args import PROG, Parser, int_list, is_model_config, model_arg
from trace_roofline.errors import InputError

__all__ = ["FLAGS", "Parser", "build_parser", "dispatch", "int_list", "is_model_config", "main",
           "model_arg", "run"]

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


# Each command's `add_<command>(subparsers)`, in the order of the help's command list.
COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    cli_commands.add_intensity, cli_analyze.add_analyze, cli_commands.add_diff,
    cli_commands.add_project, cli_commands.add_cache)


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
    for add in COMMANDS:
        add(sub)
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
    if getattr(args, "tune_memory", True):  # (cache, analyze: tuned once the work starts)
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
