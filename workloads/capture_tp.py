"""Tensor-parallel rank traces (issue 13): a vLLM-style TP = t shard of a 2-layer Qwen2.5-7B stack
on t GPUs, one process per GPU (torch.multiprocessing, NCCL; gloo on CPU), one trace per rank.

Each rank builds the full stack from the same seed, keeps its shard (`workloads.tp_layer`: fused
qkv_proj and gate_up_proj column-parallel, o_proj and down_proj row-parallel, each followed by
`dist.all_reduce`), checks its output against the full stack (relative error logged and written
into the trace), then profiles `--warmup` + `--steps` steps under a profiler schedule
(ProfilerStep#N). torch.profiler writes `distributedInfo` (backend, rank, world size, NCCL
version) into every trace because the process group is initialised, and each collective appears
as a `record_param_comms` cpu_op plus its NCCL kernel.

Each `--variant PHASE:ANNOTATE:NAMES` writes one directory OUT/tp<t>-<model>-<L>l_<phase>_b<B>_
<s S|t T>[_noannot]_<device>/ holding one trace per rank:
- PHASE decode (B new tokens at position S-1 of a random-filled cache) or prefill (B x T, causal);
- ANNOTATE none (no ranges of ours, as users' traces) or record_function (layers.i, operator and
  `all_reduce` ranges, the ground truth);
- NAMES rank (`rank0.json.gz`, ...) or tensorboard (torch.profiler.tensorboard_trace_handler's
  default `<hostname>_<pid>.<ms>.pt.trace.json.gz`: no rank in the name, only in distributedInfo).

    python3 -m workloads.capture_tp --out DIR --tp 2 --variant decode:none:tensorboard \\
        --variant prefill:none:rank --variant decode:record_function:rank
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trace_roofline.model.models import get_model
from workloads.capture_common import (
    DTYPES,
    NCCL_SAFE_ENV,
    Profiled,
    device_tag,
    free_port,
    init_group,
    log,
    sync,
)
from workloads.layer import DecoderStack, max_positions_for
from workloads.reference import TOLERANCE
from workloads.tp_layer import check_against_full, tp_stack

PHASES = ("decode", "prefill")
ANNOTATIONS = ("none", "record_function")
NAMES = ("rank", "tensorboard")
def parse_variant(text: str) -> tuple[str, str, str]:
    parts = text.split(":")
    if (len(parts) != 3 or parts[0] not in PHASES or parts[1] not in ANNOTATIONS
            or parts[2] not in NAMES):
        raise argparse.ArgumentTypeError(
            f"variant must be PHASE:ANNOTATE:NAMES with PHASE in {PHASES}, ANNOTATE in "
            f"{ANNOTATIONS}, NAMES in {NAMES}; got {text!r}")
    return parts[0], parts[1], parts[2]


def batch_of(args: argparse.Namespace, phase: str) -> int:
    return args.batch or (8 if phase == "decode" else 1)


def variant_dir(args: argparse.Namespace, phase: str, annotate: str, tag: str) -> str:
    shape = f"s{args.context}" if phase == "decode" else f"t{args.tokens}"
    return "_".join([f"tp{args.tp}-{args.model}-{args.layers}l", phase,
                     f"b{batch_of(args, phase)}", shape]
                    + (["noannot"] if annotate == "none" else []) + [tag])


def run_variant(args: argparse.Namespace, rank: int, device: torch.device, phase: str,
                annotate: str, names: str) -> str:
    spec = get_model(args.model)
    dtype = DTYPES[args.dtype or spec.dtype]
    length = args.context if phase == "decode" else args.tokens
    batch = batch_of(args, phase)
    full = DecoderStack(spec, args.layers, "separate", "none", args.seed, device, dtype,
                        max_positions_for(length))
    full.allocate_cache(batch, length, random_fill=phase == "decode")
    tp = tp_stack(full, rank, args.tp, annotate)
    T = 1 if phase == "decode" else args.tokens
    pos = args.context - 1 if phase == "decode" else 0
    gen = torch.Generator(device=device).manual_seed(args.seed + 2000)
    x = torch.randn(batch, T, spec.hidden_size, generator=gen, device=device,
                    dtype=torch.float32).to(dtype)  # [B, T, H], the same on every rank
    err = check_against_full(full, tp, x, pos)
    tol = TOLERANCE[dtype]
    if not err <= tol:
        raise AssertionError(f"rank {rank}: TP output differs from the full stack: {err:.2e} > {tol}")
    del full
    if device.type == "cuda":
        torch.cuda.empty_cache()

    @torch.inference_mode()
    def step() -> None:
        tp(x, pos)
        sync(device)

    for _ in range(2):
        step()
    tag = device_tag(device)
    out = Path(args.out) / variant_dir(args, phase, annotate, tag)
    out.mkdir(parents=True, exist_ok=True)
    shard = tp.spec
    work = {"kind": "tp_layer_stack", "model": args.model, "tp": args.tp, "rank": rank,
            "layers": args.layers, "phase": phase, "batch": batch,
            "context": args.context, "tokens": args.tokens, "dtype": str(dtype),
            "annotate": annotate, "layout": "fused (qkv_proj, gate_up_proj column-parallel; "
            "o_proj, down_proj row-parallel + all_reduce)",
            "per_rank": {"num_heads": shard.num_heads, "num_kv_heads": shard.num_kv_heads,
                         "intermediate_size": shard.intermediate_size},
            "check_rel_error_vs_full_stack": err, "warmup": args.warmup, "steps": args.steps,
            "seed": args.seed, "script": "workloads.capture_tp",
            "nccl_env": {k: os.environ.get(k) for k in NCCL_SAFE_ENV}}
    handler = (torch.profiler.tensorboard_trace_handler(str(out), use_gzip=True)
               if names == "tensorboard" else None)
    path = out / f"rank{rank}.json.gz"
    dist.barrier()
    with Profiled(path, device, work, schedule=(args.warmup, args.steps), worker=handler) as prof:
        for _ in range(args.warmup + args.steps):
            step()
            prof.step()
    dist.barrier()
    log(f"[capture_tp] rank {rank} {phase} {annotate} {names}: rel error vs full {err:.2e}, "
        f"{sorted(os.listdir(out))}")
    return str(out)


def worker(rank: int, args: argparse.Namespace, port: int, errors: mp.SimpleQueue) -> None:
    use_cuda = args.device == "cuda"
    device = init_group(rank, args.tp, port, use_cuda)
    try:
        for phase, annotate, names in args.variant:
            t0 = time.perf_counter()
            run_variant(args, rank, device, phase, annotate, names)
            if rank == 0:
                log(f"[capture_tp] {phase}:{annotate}:{names} in {time.perf_counter() - t0:.1f} s")
    except Exception:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m workloads.capture_tp",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", "-o", default="traces")
    p.add_argument("--tp", type=int, default=2, help="ranks (one GPU each)")
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", "-b", type=int, default=None,
                   help="default: 8 for decode, 1 for prefill")
    p.add_argument("--context", "-s", type=int, default=2048, help="decode: keys S")
    p.add_argument("--tokens", "-t", type=int, default=512, help="prefill: tokens T")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda when it has --tp GPUs")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variant", type=parse_variant, action="append", required=True,
                   help="PHASE:ANNOTATE:NAMES, e.g. decode:none:tensorboard (repeatable)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.device_count() >= args.tp else "cpu"
    if args.device == "cuda" and torch.cuda.device_count() < args.tp:
        log(f"capture_tp: error: --tp {args.tp} needs {args.tp} GPUs, "
            f"found {torch.cuda.device_count()}")
        return 2
    for k, v in NCCL_SAFE_ENV.items():
        os.environ[k] = v
    errors = mp.get_context("spawn").SimpleQueue()
    t0 = time.perf_counter()
    try:
        mp.spawn(worker, args=(args, free_port(), errors), nprocs=args.tp, join=True)
    except mp.ProcessRaisedException:
        while not errors.empty():
            log(errors.get())
        return 1
    log(f"[capture_tp] {len(args.variant)} variant(s) in {time.perf_counter() - t0:.1f} s")
    print(json.dumps({"out": args.out, "variants": [":".join(v) for v in args.variant]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
