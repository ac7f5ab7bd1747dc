"""Traces of HF Qwen2ForCausalLM as users take them: `model.generate()` under a bare profiler, and
prefill / decode steps with either attention implementation (issue 11's phase fixtures).

Model: Qwen2ForCausalLM from a ModelSpec-shaped Qwen2Config (default Qwen2.5-7B shapes, 2
layers, bf16), HF's random init on the device, no ranges of ours.

- `generate`: `with profile(): model.generate(ids, max_new_tokens=N)`, greedy, B x T prompt,
  HF's default DynamicCache, NO profiler schedule (no ProfilerStep ranges): one prefill forward
  then N - 1 decode forwards in one trace. A short generate runs outside the profiler first
  (cuBLAS / cuDNN initialisation). eos is unset, so exactly N tokens are generated.
- `prefill`: each profiled step is a forward over B x T fresh tokens (schedule: warm-up + active
  steps, ProfilerStep#N ranges).
- `decode`: a T-token prefill outside the profiler, then one greedy token per step with the
  DynamicCache (key length T + 1, T + 2, ...).
`--attn eager` runs HF's eager attention (repeat_kv, matmul, softmax in float32, matmul) instead
of SDPA.

    python3 -m workloads.capture_generate --out DIR generate [--attn eager] [--new-tokens 5]
    python3 -m workloads.capture_generate --out DIR prefill|decode [--attn eager]
    python3 -m workloads.capture_generate --out DIR all   # issue 11's four, one model build:
        generate (sdpa), then with eager attention: generate, prefill, decode
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from trace_roofline.model.models import get_model
from workloads.capture_common import (
    DTYPES,
    hf_stem,
    log,
    profile_generate,
    profile_steps,
    qwen2_config,
    random_lm,
    resolve_device,
)


def _model(args: argparse.Namespace, device: torch.device):
    spec = get_model(args.model)
    dtype = DTYPES[args.dtype]
    lm = random_lm(qwen2_config(spec, args.layers, dtype, args.attn), dtype, device, args.seed)
    gen = torch.Generator(device=device).manual_seed(args.seed + 3000)
    ids = torch.randint(0, spec.vocab_size, (args.batch, args.tokens), generator=gen,
                        device=device)  # [B, T] prompt
    return spec, lm, ids


def _workload(args: argparse.Namespace, kind: str, lm) -> dict:
    return {"kind": kind, "model": args.model, "layers": args.layers, "batch": args.batch,
            "tokens": args.tokens, "dtype": args.dtype,
            "attn_implementation": lm.config._attn_implementation, "seed": args.seed,
            "script": "workloads.capture_generate"}


def generate_trace(args: argparse.Namespace, dev: torch.device, spec, lm, ids) -> Path:
    """One bare-profiler trace of model.generate(ids, max_new_tokens=N): 1 prefill + N-1 decodes."""
    attn = lm.config._attn_implementation
    stem = hf_stem("qwen2", spec.name, args.layers, "generate", f"b{args.batch}",
                   f"t{args.tokens}", f"n{args.new_tokens}", "" if attn == "sdpa" else attn,
                   device=dev)
    work = {**_workload(args, "hf_generate", lm), "cache": "DynamicCache"}
    return profile_generate(lm, ids, args.new_tokens, Path(args.out) / f"{stem}.json.gz", dev,
                            work)


def steps_trace(args: argparse.Namespace, dev: torch.device, spec, lm, ids, phase: str) -> Path:
    """Prefill or decode steps (DynamicCache) under a profiler schedule."""
    attn = lm.config._attn_implementation
    shape = f"t{args.tokens}" if phase == "prefill" else f"s{args.tokens}"
    stem = hf_stem("qwen2", spec.name, args.layers, phase, f"b{args.batch}", shape,
                   "" if attn == "sdpa" else attn, device=dev)
    steps = args.steps or (3 if phase == "decode" else 2)
    return profile_steps(lm, ids, phase, Path(args.out) / f"{stem}.json.gz", dev,
                         _workload(args, f"hf_{phase}", lm), args.warmup, steps)


def run(args: argparse.Namespace) -> list[Path]:
    dev = resolve_device(args.device)
    spec, lm, ids = _model(args, dev)
    if args.command == "generate":
        return [generate_trace(args, dev, spec, lm, ids)]
    if args.command in ("prefill", "decode"):
        return [steps_trace(args, dev, spec, lm, ids, args.command)]
    paths = [generate_trace(args, dev, spec, lm, ids)]  # all: as built (--attn), then eager
    lm.set_attn_implementation("eager")
    paths.append(generate_trace(args, dev, spec, lm, ids))
    paths += [steps_trace(args, dev, spec, lm, ids, phase) for phase in ("prefill", "decode")]
    return paths


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m workloads.capture_generate",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", "-o", default="traces")
    p.add_argument("--model", default="qwen2.5-7b", help="preset or HF config.json (shapes)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", "-b", type=int, default=1)
    p.add_argument("--tokens", "-t", type=int, default=512, help="prompt tokens T")
    p.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--new-tokens", type=int, default=5, help="generate: max_new_tokens N")
    p.add_argument("--warmup", type=int, default=1, help="prefill/decode: profiler warm-up steps")
    p.add_argument("--steps", type=int, default=None,
                   help="prefill/decode: active steps (default 2 prefill, 3 decode)")
    p.add_argument("command", choices=("generate", "prefill", "decode", "all"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    t0 = time.perf_counter()
    paths = run(args)
    log(f"[capture_generate] {args.command}: {len(paths)} trace(s) in "
        f"{time.perf_counter() - t0:.1f} s")
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
