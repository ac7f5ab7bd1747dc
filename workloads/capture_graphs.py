"""CUDA-graph decode traces of HF Qwen2ForCausalLM with a StaticCache, and their mapping traces
(issue 11): what serving engines and `torch.compile(mode="reduce-overhead")` leave in a trace.

Model: Qwen2ForCausalLM, ModelSpec-shaped Qwen2Config (default Qwen2.5-7B shapes, 2 layers, bf16,
SDPA), HF random init on the GPU. A transformers StaticCache of `--cache-len` slots is filled by
an eager B x T prompt prefill outside the profiler; every decode step then feeds one greedy token
per sequence. transformers 5.17's StaticCache keeps its write position on the device
(`cumulative_length`, index_copy_ into the slots) and HF builds the decode mask on the device, so
the step has no host sync and can be captured. SDPA reads all cache slots under that mask.

Subcommands (each writes its traces into --out):
- `cudagraph`: `torch.cuda.CUDAGraph` of one decode step (static input ids [B, 1], static
  logits), captured after two eager warm-up runs on a side stream (PyTorch's documented recipe).
  Between replays the next token is taken eagerly (argmax of the static logits, copy_ into the
  static ids), as a serving loop does. `--traces` picks (in this order):
  - `mapping` -> `..._mapping_<dev>`: the same step, same batch, same cache, graphs OFF: eager
    forward + argmax + copy_, profiler schedule (warm-up 1, ProfilerStep#1..N), SGLang's
    "mapping" trace.
  - `graph` -> `..._graph_<dev>`: only `--replays` replays (+ the eager argmax/copy_ between
    them) under a bare profiler; kernels inside replays have no cpu_op, shapes or External id,
    only a cudaGraphLaunch.
  - `capture` -> `..._graphcapture_<dev>`: a second graph of the same step, with the profiler on
    during its eager warm-up, its capture and 2 replays: the capture's cpu_ops (with shapes) and
    launches, then the replays' kernels, in one trace.
- `compiled`: `torch.compile(model, mode=..., dynamic=False)` decode steps
  (cudagraph_mark_step_begin before each); three unprofiled calls (compile, CUDA-graph warm-up
  and recording), then `--steps` profiled steps under a bare profiler. mode reduce-overhead:
  Inductor's Triton kernels and cuBLAS GEMMs replayed from CUDA graphs (trace `_compiled-ro_`);
  mode default: the same Inductor graph launched kernel by kernel (trace `_compiled_`, the
  mapping for the former).
- `generate-static`: `model.generate(ids, max_new_tokens=N, cache_implementation="static")`, which
  in transformers 5.17 compiles the decode forward with CompileConfig (default mode
  reduce-overhead) on CUDA; a first call (same N) compiles, the second is profiled (bare profiler):
  an eager prefill and N-1 decode forwards replayed from CUDA graphs.

    python3 -m workloads.capture_graphs --out DIR cudagraph --batch 1,4 --traces mapping,graph
    python3 -m workloads.capture_graphs --out DIR cudagraph --batch 1 --traces capture
    python3 -m workloads.capture_graphs --out DIR compiled --batch 1 --mode reduce-overhead,default
    python3 -m workloads.capture_graphs --out DIR compiled --batch 4 --mode reduce-overhead
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from trace_roofline.cli import int_list
from trace_roofline.model.models import get_model
from workloads.capture_common import (
    DTYPES,
    Profiled,
    hf_stem,
    log,
    profile_generate,
    qwen2_config,
    random_lm,
    resolve_device,
    sync,
)

MODE_TAG = {"reduce-overhead": "compiled-ro", "default": "compiled",
            "max-autotune-no-cudagraphs": "compiled-ma"}


class StaticDecode:
    """The model, its StaticCache and the prompt, prefilled; `step` runs one eager decode step.
    `lm`: a model built elsewhere on the device (capture_moe's), else a Qwen2ForCausalLM of
    `args.model`'s shapes."""

    def __init__(self, args: argparse.Namespace, lm: torch.nn.Module | None = None) -> None:
        from transformers import StaticCache

        self.dev = resolve_device(args.device)
        self.spec = get_model(args.model)
        dtype = DTYPES[args.dtype]
        self.args = args
        self.lm = lm if lm is not None else random_lm(
            qwen2_config(self.spec, args.layers, dtype, "sdpa"), dtype, self.dev, args.seed)
        self.kv = StaticCache(config=self.lm.config, max_cache_len=args.cache_len)
        gen = torch.Generator(device=self.dev).manual_seed(args.seed + 3000)
        prompt = torch.randint(0, self.lm.config.vocab_size, (args.batch, args.tokens),
                               generator=gen, device=self.dev)  # [B, T]
        with torch.inference_mode():
            logits = self.lm(input_ids=prompt, past_key_values=self.kv, use_cache=True).logits
            self.ids = logits[:, -1:].argmax(-1)  # [B, 1] the step's static input
        self.written = args.tokens  # cache slots written so far (host-side count, for the check)
        sync(self.dev)

    def forward(self) -> torch.Tensor:
        """One decode forward on the static ids; logits [B, 1, vocab]."""
        return self.lm(input_ids=self.ids, past_key_values=self.kv, use_cache=True).logits

    def advance(self, logits: torch.Tensor) -> None:
        """The serving loop's eager part: next greedy token into the static ids."""
        self.ids.copy_(logits[:, -1:].argmax(-1))

    def room(self, steps: int) -> None:
        """Count `steps` more cache writes; refuse before the StaticCache would overflow (an
        out-of-range index_copy_ is a device-side assert, not an exception)."""
        self.written += steps
        if self.written > self.args.cache_len:
            raise ValueError(f"cache_len {self.args.cache_len} cannot hold {self.written} tokens")

    def stem(self, *parts: str) -> str:
        a = self.args
        return hf_stem("qwen2", self.spec.name, a.layers, "decode", f"b{a.batch}",
                       f"s{a.tokens}", f"static{a.cache_len}", *parts, device=self.dev)

    def workload(self, kind: str, **extra: object) -> dict:
        a = self.args
        return {"kind": kind, "model": a.model, "layers": a.layers, "batch": a.batch,
                "cudnn_sdpa": not a.no_cudnn_sdpa, "prompt_tokens": a.tokens,
                "cache": "StaticCache", "max_cache_len": a.cache_len,
                "dtype": a.dtype, "attn_implementation": "sdpa", "seed": a.seed,
                "script": "workloads.capture_graphs", **extra}


def _graph(sd: StaticDecode, warmups: int = 2) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Capture one decode step; returns the graph and its static logits."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    sd.room(warmups)
    with torch.cuda.stream(side):
        for _ in range(warmups):  # eager warm-up runs write the cache too
            sd.forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = sd.forward()
    return graph, logits


def _replays(sd: StaticDecode, graph: torch.cuda.CUDAGraph, logits: torch.Tensor, n: int) -> None:
    sd.room(n)
    for _ in range(n):
        graph.replay()
        sd.advance(logits)
    sync(sd.dev)


def _per_batch(args: argparse.Namespace) -> list[argparse.Namespace]:
    return [argparse.Namespace(**{**vars(args), "batch": b}) for b in args.batch]


def capture_cudagraph(args: argparse.Namespace) -> list[Path]:
    return [p for a in _per_batch(args) for p in cudagraph_traces(a)]


@torch.inference_mode()
def cudagraph_traces(args: argparse.Namespace, sd: StaticDecode | None = None) -> list[Path]:
    """The `--traces` of one batch size (module docstring), of `sd` (default: a fresh
    StaticDecode of `args`)."""
    sd = sd or StaticDecode(args)
    if sd.dev.type != "cuda" and set(args.traces) - {"mapping"}:
        raise ValueError("CUDA graphs need a CUDA device (only --traces mapping runs on CPU)")
    out = Path(args.out)
    paths = []
    if "mapping" in args.traces:
        path = out / f"{sd.stem('mapping')}.json.gz"
        sd.room(1 + 1 + args.replays)
        sd.advance(sd.forward())  # warm-up, unprofiled
        work = sd.workload("hf_static_decode_mapping", cuda_graphs=False,
                           step="forward + argmax + copy_ into the static ids",
                           profiler_schedule={"warmup": 1, "active": args.replays})
        with Profiled(path, sd.dev, work, schedule=(1, args.replays)) as prof:
            for _ in range(1 + args.replays):
                sd.advance(sd.forward())
                prof.step()
        paths.append(path)
    if "graph" in args.traces:
        graph, logits = _graph(sd)
        _replays(sd, graph, logits, 2)  # unprofiled
        path = out / f"{sd.stem('graph')}.json.gz"
        work = sd.workload("hf_static_decode_cudagraph", cuda_graphs=True, replays=args.replays,
                           step="graph.replay() + eager argmax + copy_ into the static ids",
                           profiler_schedule=None, capture_in_trace=False)
        with Profiled(path, sd.dev, work):
            _replays(sd, graph, logits, args.replays)
        paths.append(path)
    if "capture" in args.traces:
        path = out / f"{sd.stem('graphcapture')}.json.gz"
        work = sd.workload("hf_static_decode_cudagraph", cuda_graphs=True, replays=2,
                           step="2 eager warm-up forwards on a side stream, torch.cuda.graph "
                                "capture of one forward, then graph.replay() + eager argmax + "
                                "copy_, twice", profiler_schedule=None, capture_in_trace=True)
        with Profiled(path, sd.dev, work):
            graph2, logits2 = _graph(sd)
            _replays(sd, graph2, logits2, 2)
        paths.append(path)
    return paths


def capture_compiled(args: argparse.Namespace) -> list[Path]:
    paths = []
    for a in _per_batch(args):
        for mode in args.mode:
            torch._dynamo.reset()  # a fresh compile per (batch, mode)
            paths += _compiled(argparse.Namespace(**{**vars(a), "mode": mode}))
    return paths


@torch.inference_mode()
def _compiled(args: argparse.Namespace) -> list[Path]:
    sd = StaticDecode(args)
    compiled = torch.compile(sd.lm, mode=args.mode, dynamic=False)
    state = {"ids": sd.ids.clone()}

    def step() -> None:
        torch.compiler.cudagraph_mark_step_begin()
        out = compiled(input_ids=state["ids"], past_key_values=sd.kv, use_cache=True)
        state["ids"] = out.logits[:, -1:].argmax(-1)  # [B, 1], a fresh tensor each step

    t0 = time.perf_counter()
    sd.room(3 + args.steps)
    for _ in range(3):  # compile; CUDA-graph warm-up; recording
        step()
    sync(sd.dev)
    log(f"[capture_graphs] compile ({args.mode}) + 3 steps: {time.perf_counter() - t0:.1f} s")
    path = Path(args.out) / f"{sd.stem(MODE_TAG[args.mode])}.json.gz"
    work = sd.workload("hf_static_decode_compiled", compile_mode=args.mode, dynamic=False,
                       cuda_graphs=args.mode == "reduce-overhead", steps=args.steps,
                       step="cudagraph_mark_step_begin + compiled forward + eager argmax",
                       profiler_schedule=None)
    with Profiled(path, sd.dev, work):
        for _ in range(args.steps):
            step()
    return [path]


def capture_generate_static(args: argparse.Namespace) -> list[Path]:
    return [p for a in _per_batch(args) for mode in args.mode
            for p in _generate_static(argparse.Namespace(**{**vars(a), "mode": mode}))]


def _generate_static(args: argparse.Namespace) -> list[Path]:
    from transformers import CompileConfig

    dev = resolve_device(args.device)
    spec = get_model(args.model)
    dtype = DTYPES[args.dtype]
    lm = random_lm(qwen2_config(spec, args.layers, dtype, "sdpa"), dtype, dev, args.seed)
    gen = torch.Generator(device=dev).manual_seed(args.seed + 3000)
    ids = torch.randint(0, spec.vocab_size, (args.batch, args.tokens), generator=gen, device=dev)
    n = args.new_tokens
    kw = {"cache_implementation": "static", "compile_config": CompileConfig(mode=args.mode)}
    stem = hf_stem("qwen2", spec.name, args.layers, "generate", f"b{args.batch}",
                   f"t{args.tokens}", f"n{n}", "static", MODE_TAG[args.mode], device=dev)
    work = {"kind": "hf_generate", "model": args.model, "layers": args.layers,
            "batch": args.batch, "tokens": args.tokens, "dtype": args.dtype,
            "attn_implementation": "sdpa", "cache": "StaticCache",
            "cache_implementation": "static", "compile_mode": args.mode,
            "cudnn_sdpa": not args.no_cudnn_sdpa, "seed": args.seed,
            "script": "workloads.capture_graphs"}
    # the unprofiled first generate (same N, so the same cache shapes) compiles the decode forward
    return [profile_generate(lm, ids, n, Path(args.out) / f"{stem}.json.gz", dev, work,
                             warmup_tokens=n, **kw)]


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(text.split(","))
    bad = [m for m in modes if m not in MODE_TAG]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {bad}; known: {', '.join(MODE_TAG)}")
    return modes


def _traces(text: str) -> tuple[str, ...]:
    names = tuple(text.split(","))
    bad = [n for n in names if n not in ("mapping", "graph", "capture")]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown trace(s) {bad}; known: mapping, graph, capture")
    return names


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m workloads.capture_graphs",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", "-o", default="traces")
    p.add_argument("--model", default="qwen2.5-7b", help="preset or HF config.json (shapes)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", "-b", type=int_list, default=[1],
                   help="comma-separated batch sizes, one model build and trace set each")
    p.add_argument("--tokens", "-t", type=int, default=512, help="prompt tokens T")
    p.add_argument("--cache-len", type=int, default=1024, help="StaticCache slots")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-cudnn-sdpa", action="store_true",
                   help="disable cuDNN SDPA (torch.backends.cuda.enable_cudnn_sdp(False)) for the "
                        "whole run, e.g. if graph capture of cuDNN attention fails")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("cudagraph", help="torch.cuda.CUDAGraph replays (+ mapping, capture)")
    c.add_argument("--replays", type=int, default=4)
    c.add_argument("--traces", type=_traces, default=("graph",),
                   help="comma-separated, in this order: mapping (eager, graphs off), graph "
                        "(replays only), capture (warm-up + capture + 2 replays in one trace)")
    c.set_defaults(func=capture_cudagraph)
    m = sub.add_parser("compiled", help="torch.compile(model, mode=...) decode steps")
    m.add_argument("--mode", type=_modes, default=("reduce-overhead",),
                   help=f"comma-separated torch.compile modes ({', '.join(MODE_TAG)})")
    m.add_argument("--steps", type=int, default=4)
    m.set_defaults(func=capture_compiled)
    g = sub.add_parser("generate-static", help="generate(cache_implementation='static')")
    g.add_argument("--mode", type=_modes, default=("reduce-overhead",))
    g.add_argument("--new-tokens", type=int, default=5)
    g.set_defaults(func=capture_generate_static)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    t0 = time.perf_counter()
    paths = args.func(args)
    log(f"[capture_graphs] {args.command}: {len(paths)} trace(s) in "
        f"{time.perf_counter() - t0:.1f} s")
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
