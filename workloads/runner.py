"""Run decoder-layer decode/prefill steps under torch.profiler and export a gzipped Chrome trace.

A step is one forward pass of the stack. Decode: B sequences, one new token at position S-1 that
attends to S keys (the static cache holds random stand-ins for the S-1 earlier tokens; every step
rewrites the same slot, so all steps have identical shapes). Prefill: B x T tokens from position 0,
causal. Profiler schedule: `warmup` steps recorded but discarded, then `steps` active steps.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from trace_roofline.errors import InputError
from trace_roofline.model.models import get_model
from workloads.layer import DecoderStack, max_positions_for
from workloads.reference import TOLERANCE, reference_layer, rel_error

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
          "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}
DTYPE_TAG = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}  # file names


@dataclass
class RunConfig:
    """What one profiled run does; also written into the trace as metadata."""

    model: str = "qwen2.5-7b"
    phase: str = "decode"  # decode | prefill
    batch: int = 1
    context: int = 2048  # decode: keys each new token attends to (S)
    tokens: int = 512  # prefill: tokens per sequence (T)
    device: str | None = None  # None: cuda when available, else cpu
    dtype: str | None = None  # None: the model spec's dtype
    layers: int = 1
    layout: str = "separate"  # separate | fused
    annotate: str = "record_function"  # record_function | nvtx | none
    compile: bool = False
    warmup: int = 2
    steps: int = 3
    with_stack: bool = False
    profile: bool = True  # False: plain run for ncu (cudaProfilerStart/Stop around active steps)
    check: bool = True
    seed: int = 0
    out: str = "traces"
    name: str | None = None
    extra: dict = field(default_factory=dict)


def resolve_device(device: str | None) -> torch.device:
    """`device` ('cuda', 'cuda:N' or 'cpu'; None: cuda when torch sees one, else cpu) as a
    torch.device; InputError for another kind or a GPU torch does not see."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise InputError(f"`device` {device!r} is not one of cuda, cuda:N, cpu", "device")
    if device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise InputError(f"`device` {device!r}: torch sees {torch.cuda.device_count()} CUDA "
                             "device(s)", "device")
    return torch.device(device)


def device_tag(device: torch.device) -> str:
    """Short file-name tag: 'cpu', or the GPU model (see gpu_tag)."""
    if device.type != "cuda":
        return device.type
    return gpu_tag(torch.cuda.get_device_name(device))


def gpu_tag(name: str) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA GeForce RTX 4090' -> 'rtx4090',
    'NVIDIA A100-SXM4-80GB' -> 'a100': words up to the first one holding a digit."""
    words = [w for w in re.split(r"[\s_]+", name.lower())
             if w and w not in ("nvidia", "geforce", "tesla")]
    parts: list[str] = []
    for w in words:
        parts.append(re.sub(r"[^a-z0-9]", "", w.split("-")[0]))
        if any(ch.isdigit() for ch in w):
            break
    return "".join(parts) or "cuda"


def trace_stem(cfg: RunConfig, tag: str) -> str:
    """E.g. qwen2.5-7b_decode_b8_s2048_h200, qwen2.5-7b_decode_b1_s2048_fp16_h200 (a dtype
    other than the model's) or qwen2.5-7b_prefill_b1_t512_fused_noannot_cpu."""
    if cfg.name:
        return cfg.name
    shape = f"s{cfg.context}" if cfg.phase == "decode" else f"t{cfg.tokens}"
    spec = get_model(cfg.model)
    parts = [spec.name.lower(), cfg.phase, f"b{cfg.batch}", shape]
    dtype = DTYPES.get((cfg.dtype or spec.dtype).lower())
    if dtype is not None and dtype != DTYPES.get(spec.dtype.lower()):  # not the model's own
        parts.append(DTYPE_TAG[dtype])
    if cfg.layers != 1:
        parts.append(f"l{cfg.layers}")
    if cfg.layout == "fused":
        parts.append("fused")
    if cfg.compile:
        parts.append("compiled")
    if cfg.annotate == "none":
        parts.append("noannot")
    if cfg.with_stack:
        parts.append("stack")
    parts.append(tag)
    return "_".join(parts)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def validate(cfg: RunConfig) -> None:
    """Raise InputError, naming the parameter, before anything is measured or written."""
    if cfg.phase not in ("decode", "prefill"):
        raise InputError(f"`phase` must be decode or prefill, got {cfg.phase!r}", "phase")
    for name in ("batch", "context", "tokens", "layers", "steps"):
        if getattr(cfg, name) < 1:
            raise InputError(f"`{name}` must be >= 1, got {getattr(cfg, name)}", name)
    if cfg.warmup < 0:
        raise InputError(f"`warmup` must be >= 0, got {cfg.warmup}", "warmup")
    if (cfg.dtype or "bfloat16").lower() not in DTYPES:
        raise InputError(f"`dtype` {cfg.dtype!r} is not one of {', '.join(DTYPES)}", "dtype")
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise InputError(f"{out}: `out` is not a directory", "out")
    get_model(cfg.model)


def build(cfg: RunConfig, device: torch.device) -> tuple[DecoderStack, torch.Tensor, int]:
    """The stack with its cache allocated, the step input x [B, T, H] and the start position."""
    validate(cfg)
    spec = get_model(cfg.model)
    dtype = DTYPES[(cfg.dtype or spec.dtype).lower()]
    length = cfg.context if cfg.phase == "decode" else cfg.tokens
    stack = DecoderStack(spec, cfg.layers, cfg.layout, cfg.annotate, cfg.seed, device, dtype,
                         max_positions_for(length))
    stack.allocate_cache(cfg.batch, length, random_fill=cfg.phase == "decode")
    T = 1 if cfg.phase == "decode" else cfg.tokens
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 2000)
    x = torch.randn(cfg.batch, T, spec.hidden_size, generator=gen, device=device,
                    dtype=torch.float32).to(dtype)  # [B, T, H]
    return stack, x, (cfg.context - 1 if cfg.phase == "decode" else 0)


@torch.inference_mode()
def check_correctness(stack: DecoderStack, x: torch.Tensor, pos: int) -> list[dict]:
    """Each layer's output and cache write vs the float32 reference; raises on a miss."""
    results = []
    matmul_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # a float32 reference means float32 math
    try:
        for i, layer in enumerate(stack.layers):
            attn = layer.self_attn
            past_k = attn.k_cache[:, :, :pos].clone()
            past_v = attn.v_cache[:, :, :pos].clone()
            out = layer(x, pos, stack.cos, stack.sin)
            T = x.shape[1]
            ref, k, v = reference_layer(stack.spec, stack.weights[i], x, past_k, past_v, pos)
            errs = {"out": rel_error(out, ref),
                    "k_cache": rel_error(attn.k_cache[:, :, pos:pos + T], k),
                    "v_cache": rel_error(attn.v_cache[:, :, pos:pos + T], v)}
            tol = TOLERANCE[out.dtype]
            results.append({"layer": i, "dtype": str(out.dtype), "tolerance": tol, **errs})
            bad = {k: e for k, e in errs.items() if not e <= tol}
            if bad:
                raise AssertionError(f"layer {i} ({out.dtype}) differs from the float32 "
                                     f"reference: {bad} > {tol}")
            x = out
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul_tf32
    return results


def _atomic_export(prof: torch.profiler.profile, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.partial.json.gz")
    prof.export_chrome_trace(str(tmp))
    os.replace(tmp, path)


def run(cfg: RunConfig, progress: Callable[[str], None] = print) -> dict:
    """Build, check, warm up, then profile (or plainly run) the steps. Returns a summary dict
    with the trace path (None for a plain run)."""
    validate(cfg)
    device = resolve_device(cfg.device)
    tag = device_tag(device)
    out_dir = Path(cfg.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = trace_stem(cfg, tag)
    progress(f"[run] {stem}: building {cfg.layers} x {cfg.model} layer ({cfg.layout}) on {device}")
    t0 = time.perf_counter()
    stack, x, pos = build(cfg, device)
    summary: dict = {"config": asdict(cfg), "device": str(device), "device_tag": tag,
                     "torch": torch.__version__, "trace": None}
    if device.type == "cuda":
        summary["gpu"] = torch.cuda.get_device_name(device)
    if cfg.check:
        summary["check"] = check_correctness(stack, x, pos)
        worst = max(r["out"] for r in summary["check"])
        progress(f"[run] correctness vs float32 reference: max rel error {worst:.2e} (ok)")
    step_fn = torch.compile(stack) if cfg.compile else stack

    @torch.inference_mode()
    def step() -> None:
        step_fn(x, pos)
        sync(device)

    progress("[run] warming up" + (" (torch.compile)" if cfg.compile else ""))
    for _ in range(2):
        step()
    total = cfg.warmup + cfg.steps
    if not cfg.profile:
        for _ in range(cfg.warmup):
            step()
        if device.type == "cuda":
            torch.cuda.profiler.start()  # ncu --profile-from-start off captures from here
        for _ in range(cfg.steps):
            step()
        if device.type == "cuda":
            torch.cuda.profiler.stop()
        progress(f"[run] ran {total} steps without torch.profiler ({time.perf_counter() - t0:.1f} s)")
        return summary
    path = out_dir / f"{stem}.json.gz"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(wait=0, warmup=cfg.warmup, active=cfg.steps, repeat=1)
    with torch.profiler.profile(activities=activities, record_shapes=True,
                                with_stack=cfg.with_stack, schedule=schedule,
                                on_trace_ready=lambda p: _atomic_export(p, path)) as prof:
        prof.add_metadata_json("trace_roofline_workload", json.dumps(asdict(cfg)))
        for i in range(total):
            step()
            prof.step()
            progress(f"[run] step {i + 1}/{total} " + ("(warm-up)" if i < cfg.warmup else ""))
    summary["trace"] = str(path)
    summary["trace_bytes"] = path.stat().st_size
    progress(f"[run] wrote {path} ({path.stat().st_size / 1e3:.1f} kB) "
             f"in {time.perf_counter() - t0:.1f} s")
    return summary
