"""Subcommands run, sweep, calibrate, hf-capture. Importable without torch: handlers import lazily.

trace_roofline/cli.py registers run/sweep/calibrate through add_<cmd>_parser(subparsers);
`python -m workloads <cmd>` gives the same commands (plus hf-capture) without the analyzer CLI.
Errors are the analyzer's: an InputError, printed by trace_roofline.cli.dispatch as one line
with exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from trace_roofline.cli import Parser, dispatch, int_list, model_arg  # noqa: F401 (int_list: shared type)
from trace_roofline.errors import InputError
from trace_roofline.files import check_targets, write_files

DEVICE_HELP = "cuda, cuda:N or cpu (default: cuda if torch sees one, else cpu)"
# traces/ of the current folder (ignored by the repository's .gitignore: a capture in the clone
# is never committed by accident).
OUT_HELP = "output directory (default: traces/ in the current folder)"


# The one line printed where torch is missing (README command 1 installs the analyzer only).
NEEDS_TORCH = ("`{command}` needs torch, which is not installed: "
               "pip install 'trace-roofline[workloads]' (without a GPU, first the CPU build: "
               "pip install torch --index-url https://download.pytorch.org/whl/cpu)")


def _needs_torch(command: str, module: str):
    """`module` (a workloads module that imports torch) for `command`; without torch an
    InputError naming the extra to install, printed as one line with exit code 2 (not a
    ModuleNotFoundError traceback)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] != "torch":
            raise
        raise InputError(NEEDS_TORCH.format(command=command)) from None


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def add_run_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "run", help="profile a synthetic decoder layer (decode or prefill) to a Chrome trace",
        description="Build a decoder layer of a model preset with random seeded weights, check it "
                    "against a float32 reference, and profile warm-up + N steps under "
                    "torch.profiler; writes OUT/<model>_<phase>_b<B>_<s|t><n>[...]_<device>"
                    ".json.gz, then analyses it.",
        epilog="examples:\n"
               "  trace-roofline run --phase decode --batch 8 --context 4096 --device cuda\n"
               "  trace-roofline run --phase prefill --tokens 2048 --layers 2 --out traces/")
    p.add_argument("--model", type=model_arg, default="qwen2.5-7b",
                   help="preset name, HF config.json or HF model directory")
    p.add_argument("--phase", choices=("decode", "prefill"), default="decode",
                   help="one new token per sequence against --context keys, or --tokens tokens")
    p.add_argument("--batch", "-b", type=int, default=1, help="sequences B")
    p.add_argument("--context", "-s", type=int, default=None,
                   help=f"decode only: keys the new token attends to, S (default: "
                        f"{RUN_DEFAULTS['context']})")
    p.add_argument("--tokens", "-t", type=int, default=None,
                   help=f"prefill only: tokens per sequence, T (default: {RUN_DEFAULTS['tokens']})")
    p.add_argument("--device", default=None, help=DEVICE_HELP)
    p.add_argument("--dtype", default=None, help="bfloat16|float16|float32 (default: the model's)")
    p.add_argument("--layers", type=int, default=1, help="decoder layers stacked")
    p.add_argument("--layout", choices=("separate", "fused"), default="separate",
                   help="HF q/k/v + gate/up modules, or fused qkv_proj / gate_up_proj")
    p.add_argument("--annotate", choices=("record_function", "nvtx", "none"),
                   default="record_function", help="operator ranges (none: unannotated fixture)")
    p.add_argument("--compile", action="store_true", help="run the stack under torch.compile")
    p.add_argument("--warmup", type=int, default=2, help="profiler warm-up steps")
    p.add_argument("--steps", type=int, default=3, help="profiled (active) steps")
    p.add_argument("--with-stack", action="store_true", help="record Python stacks")
    p.add_argument("--no-profile", dest="profile", action="store_false",
                   help="run without torch.profiler, active steps between cudaProfilerStart/Stop "
                        "(for ncu --profile-from-start off; see workloads/ncu_capture.sh)")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the float32 reference check")
    p.add_argument("--seed", type=int, default=0, help="weights and inputs seed")
    p.add_argument("--name", default=None, help="file stem (default: generated from the run)")
    p.add_argument("--out", "-o", default="traces", help=OUT_HELP)
    p.add_argument("--summary", default=None,
                   help="also write the run summary JSON here (default: none)")
    p.add_argument("--no-analyze", dest="analyze", action="store_false",
                   help="only capture; by default the trace is analysed right away")
    p.add_argument("--hardware", default=None,
                   help="ceilings for the analysis (default: the trace's GPU; CPU traces get "
                        "intensities only unless a hardware JSON is given)")
    p.set_defaults(func=run_command)
    return p


# The run's shape when --context / --tokens are not given (each applies to one phase only).
RUN_DEFAULTS = {"context": 2048, "tokens": 512}


def run_shape(phase: str, context: int | None, tokens: int | None) -> dict[str, int]:
    """{context, tokens} of a run: the phase's own option or its default; the other phase's
    option is an error, never silently ignored."""
    other = {"decode": ("--tokens", tokens, "--context"), "prefill": ("--context", context,
                                                                       "--tokens")}
    flag, given, own = other[phase]
    if given is not None:
        raise InputError(f"{flag} is not used by --phase {phase} (it takes {own}); drop {flag}")
    return {"context": context or RUN_DEFAULTS["context"], "tokens": tokens or RUN_DEFAULTS["tokens"]}


def run_command(args: argparse.Namespace) -> int:
    runner = _needs_torch("run", "workloads.runner")
    RunConfig, run = runner.RunConfig, runner.run
    fields = ("model", "phase", "batch", "device", "dtype", "layers", "layout", "annotate",
              "compile", "warmup", "steps", "with_stack", "profile", "check", "seed", "name",
              "out")
    cfg = RunConfig(**{f: getattr(args, f) for f in fields},
                    **run_shape(args.phase, args.context, args.tokens))
    check_targets([args.summary] if args.summary else [])
    summary = run(cfg, progress=_progress)
    if args.summary:
        _write_json(Path(args.summary), summary)
    if summary["trace"] and args.analyze:
        print(_analysis_table(summary["trace"], args.model, args.hardware))
    print(summary["trace"] or "(no trace: --no-profile)")
    return 0


def _analysis_table(trace: str, model: str, hardware: str | None) -> str:
    """The main job's last step: the captured trace, attributed and placed on the roofline."""
    from trace_roofline.model.hardware import get_hardware
    from trace_roofline.model.models import get_model
    from trace_roofline.outputs.report import terminal_table
    from trace_roofline.pipeline import analyze_trace

    hw = get_hardware(hardware) if hardware else None
    return terminal_table([analyze_trace(trace, get_model(model), hw)])


def add_sweep_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "sweep", help="the M-knob lab: time a projection GEMM at several M",
        description="Time Y = X @ W for a model projection's (K, N) at each M (CUDA events, "
                    "warm-up, median), report achieved vs attainable TFLOP/s, and profile the "
                    "same calls; writes <stem>.results.json and <stem>.json.gz.",
        epilog="example:\n  trace-roofline sweep --projection down_proj --m 1,16,64,256,1024 "
               "--device cuda")
    p.add_argument("--model", type=model_arg, default="qwen2.5-7b",
                   help="preset name, HF config.json or HF model directory")
    p.add_argument("--projection", default="q_proj", help="q_proj, k_proj, ..., gate_up_proj")
    p.add_argument("--m", type=int_list, default=[1, 16, 64, 256, 1024],
                   help="tokens in flight M, e.g. 1,16,64")
    p.add_argument("--dtype", default=None,
                   help="bfloat16|float16|float32 (default: bfloat16 on CUDA, the model's on CPU)")
    p.add_argument("--device", default=None, help=DEVICE_HELP)
    p.add_argument("--warmup", type=int, default=10, help="untimed calls per M")
    p.add_argument("--iters", type=int, default=50, help="timed calls per M (median reported)")
    p.add_argument("--hardware", default=None,
                   help="hardware JSON or preset for the attainable column "
                        "(default: the preset matching the GPU, if any)")
    p.add_argument("--no-trace", dest="trace", action="store_false",
                   help="time only, write no profiled trace")
    p.add_argument("--out", "-o", default="traces", help=OUT_HELP)
    p.set_defaults(func=sweep_command)
    return p


def sweep_command(args: argparse.Namespace) -> int:
    run_sweep = _needs_torch("sweep", "workloads.sweep").run_sweep
    _, path = run_sweep(args.model, args.projection, tuple(args.m), args.dtype, args.device,
                        args.warmup, args.iters, args.hardware, args.out, args.trace,
                        progress=_progress)
    print(path)
    return 0


def add_calibrate_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "calibrate", help="measure memory bandwidth and matmul peaks into a hardware JSON",
        description="Measure the memory ceiling (best median of copy, add and sum streams on "
                    "buffers far past the caches) and the bf16/fp16/tf32/fp32 matmul peaks "
                    "(best median over square and LLM-projection GEMMs, random data, warm-up), "
                    "and write a hardware JSON that --hardware accepts.",
        epilog="example:\n  trace-roofline calibrate --device cuda --out my_gpu.json\n"
               "  trace-roofline analyze trace.json.gz --hardware my_gpu.json")
    p.add_argument("--device", default=None, help=DEVICE_HELP)
    p.add_argument("--out", "-o", default=None, help="JSON path (default: print to stdout)")
    p.add_argument("--sizes", type=int_list, default=None,
                   help="square GEMM sizes, e.g. 4096,8192 (default: 4096,8192,16384 on CUDA, "
                        "512,1024,2048 on CPU)")
    p.add_argument("--copy-mib", type=int, default=None,
                   help="stream buffer size in MiB (default: 2048 on CUDA, 256 on CPU)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed runs per kernel (default: 20 on CUDA, 5 on CPU)")
    p.add_argument("--raw", default=None,
                   help="also write every measurement to this JSON (default: none)")
    p.set_defaults(func=calibrate_command)
    return p


def calibrate_command(args: argparse.Namespace) -> int:
    calibrate = _needs_torch("calibrate", "workloads.calibrate").calibrate
    check_targets([p for p in (args.out, args.raw) if p])  # before minutes of measuring
    hw, raw = calibrate(args.device, args.copy_mib and args.copy_mib << 20,
                        args.sizes and tuple(args.sizes), repeats=args.repeats,
                        progress=_progress)
    if args.raw:
        _write_json(Path(args.raw), raw)
    if args.out:
        _write_json(Path(args.out), hw)
        _progress(f"[calibrate] wrote {args.out}")
    else:
        print(json.dumps(hw, indent=2))
    return 0


def add_hf_capture_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "hf-capture", help="unannotated trace of HF Qwen2ForCausalLM (needs transformers)",
        description="Profile HF transformers' Qwen2ForCausalLM (random init, no ranges of ours) "
                    "at prefill or decode; writes OUT/hf-qwen2-<model>-<L>l_<phase>_b<B>_"
                    "<t|s><T>[_static][_compiled][_stack]_<device>.json.gz.")
    p.add_argument("--phase", choices=("prefill", "decode"), default="prefill",
                   help="the prompt's forward pass, or decode steps after it")
    p.add_argument("--model", type=model_arg, default="qwen2.5-7b",
                   help="preset name, HF config.json or HF model directory (shapes only)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers")
    p.add_argument("--batch", "-b", type=int, default=1, help="sequences B")
    p.add_argument("--tokens", "-t", type=int, default=512, help="prompt tokens")
    p.add_argument("--device", default=None, help=DEVICE_HELP)
    p.add_argument("--dtype", default="bfloat16", help="bfloat16|float16|float32")
    p.add_argument("--warmup", type=int, default=2, help="profiler warm-up steps")
    p.add_argument("--steps", type=int, default=3, help="profiled (active) steps")
    p.add_argument("--with-stack", action="store_true", help="record Python stacks")
    p.add_argument("--compile", action="store_true",
                   help="run the profiled steps through torch.compile(model)")
    p.add_argument("--cache", choices=("dynamic", "static"), default="dynamic",
                   help="KV cache: HF's default DynamicCache, or a StaticCache (decode only; "
                        "step i writes slot T + i by index_copy_)")
    p.add_argument("--max-cache-len", type=int, default=None,
                   help="StaticCache slots (default: 2 x --tokens)")
    p.add_argument("--out", "-o", default="traces", help=OUT_HELP)
    p.set_defaults(func=hf_capture_command)
    return p


def hf_capture_command(args: argparse.Namespace) -> int:
    capture = _needs_torch("hf-capture", "workloads.hf_capture").capture
    try:
        path = capture(args.phase, args.model, args.layers, args.batch, args.tokens, args.device,
                       args.dtype, args.warmup, args.steps, args.with_stack, args.out,
                       progress=_progress, compile=args.compile, cache=args.cache,
                       max_cache_len=args.max_cache_len)
    except ValueError as e:  # hf_capture checks its arguments with ValueError
        raise InputError(str(e)) from None
    print(path)
    return 0


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """The `trace_roofline.commands` entry point: register run, sweep and calibrate."""
    for add in (add_run_parser, add_sweep_parser, add_calibrate_parser):
        add(subparsers)


def _write_json(path: Path, obj: object) -> None:
    """Write atomically (the analyzer's all-or-nothing writer): no partial file is left."""
    write_files({path: (json.dumps(obj, indent=2) + "\n").encode()})


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m workloads")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for add in (add_run_parser, add_sweep_parser, add_calibrate_parser, add_hf_capture_parser):
        add(sub)
    return dispatch(parser.parse_args(argv))
