"""Shared pieces of the HF capture scripts (capture_generate, capture_graphs, capture_moe, capture_tp).

- `random_lm`: any HF causal LM from its config, random init created directly on the device.
- `qwen2_config`: a Qwen2Config of a ModelSpec's shapes with a chosen attention implementation.
- `Profiled`: torch.profiler around a block (no schedule, as `with profile(): model.generate()`) or
  with a schedule (ProfilerStep#N ranges), exported atomically to a gzipped Chrome trace, with
  the run's description in the trace's top-level `trace_roofline_workload` object.
- `profile_generate`, `profile_steps`: the two ways the scripts drive an HF causal LM: a bare
  profiler around `model.generate()`, or prefill / decode forwards under a profiler schedule.
- `init_group`, `free_port`: one process per GPU joining an NCCL (gloo on CPU) process group,
  with NVLink multicast kept off (NCCL_SAFE_ENV).
- `versions`: what produced a trace (torch, transformers, GPU), for provenance.
"""

from __future__ import annotations

import gzip
import json
import os
import socket
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trace_roofline.model.models import ModelSpec
from workloads import hf_capture
from workloads.runner import DTYPES, device_tag, resolve_device, sync

__all__ = ["DTYPES", "GENERATE_KW", "NCCL_SAFE_ENV", "Profiled", "device_tag", "free_port",
           "hf_stem", "init_group", "log", "profile_generate", "profile_steps", "qwen2_config",
           "random_lm", "resolve_device", "sync", "versions"]


NCCL_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}  # NVLink multicast stays off (device KINDS.md)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, world: int, port: int, use_cuda: bool) -> torch.device:
    """Join the process group (env:// on 127.0.0.1:port); returns this rank's device."""
    for k, v in NCCL_SAFE_ENV.items():
        os.environ[k] = v
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    if use_cuda:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    return device


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def versions(device: torch.device) -> dict[str, Any]:
    """torch / transformers / CUDA versions and the device name, as written into each trace."""
    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                            "python": sys.version.split()[0]}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    info["device"] = (torch.cuda.get_device_name(device) if device.type == "cuda"
                      else device.type)
    return info


def qwen2_config(spec: ModelSpec, layers: int, dtype: torch.dtype, attn: str = "sdpa"):
    """hf_capture.qwen2_config without bos/eos/pad token ids, so generate() runs exactly
    max_new_tokens steps."""
    config = hf_capture.qwen2_config(spec, layers, dtype, attn)
    config.bos_token_id = config.eos_token_id = config.pad_token_id = None
    return config


def random_lm(config: Any, dtype: torch.dtype, device: torch.device, seed: int = 0,
              **kwargs: Any) -> torch.nn.Module:
    """AutoModelForCausalLM.from_config(config, **kwargs), parameters created on `device` in
    `dtype` (HF's own random init, seeded), in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    finally:
        torch.set_default_dtype(prev)
    return model.to(device=device, dtype=dtype).eval()


class Profiled:
    """torch.profiler (record_shapes, CPU + CUDA activities) writing `path` (.json.gz) atomically.

    schedule=None: everything inside the `with` block is recorded, no ProfilerStep ranges; the
    trace is exported when the block ends. schedule=(warmup, active): call `.step()` after each
    step; ProfilerStep#N ranges; the trace is exported when the active steps are done.
    A block that raises writes nothing.
    """

    def __init__(self, path: Path, device: torch.device, workload: dict[str, Any],
                 schedule: tuple[int, int] | None = None, with_stack: bool = False,
                 worker: Callable[[torch.profiler.profile], None] | None = None) -> None:
        self.path, self.device, self.schedule = Path(path), device, schedule
        self.workload = {**workload, **versions(device)}
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        kw: dict[str, Any] = {}
        if schedule is not None:
            warmup, active = schedule
            kw["schedule"] = torch.profiler.schedule(wait=0, warmup=warmup, active=active,
                                                     repeat=1)
            kw["on_trace_ready"] = worker or self._export
        self.prof = torch.profiler.profile(activities=activities, record_shapes=True,
                                           with_stack=with_stack, **kw)

    def _export(self, prof: torch.profiler.profile) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.partial.json.gz")
        prof.export_chrome_trace(str(tmp))
        os.replace(tmp, self.path)

    def __enter__(self) -> Profiled:
        self.prof.__enter__()
        self.prof.add_metadata_json("trace_roofline_workload", json.dumps(self.workload))
        return self

    def step(self) -> None:
        self.prof.step()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        sync(self.device)
        self.prof.__exit__(exc_type, exc, tb)
        if exc_type is None and self.schedule is None:
            self._export(self.prof)
        if exc_type is None and self.path.is_file():
            log(f"[capture] wrote {self.path} ({self.path.stat().st_size / 1e3:.1f} kB): "
                f"{json.dumps(trace_summary(self.path))}")


def trace_summary(path: Path) -> dict[str, Any]:
    """What a written trace holds, for the capture log: device kernels (count, total µs),
    memcpy/memset, cpu_ops, cudaGraphLaunch calls, ProfilerStep ranges, distributedInfo."""
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    events = trace.get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") == "kernel"]
    count = Counter(e.get("cat") for e in events)
    names = Counter(e.get("name", "") for e in events if e.get("cat") == "cuda_runtime")
    return {"kernels": len(kernels), "kernel_us": round(sum(e.get("dur", 0) for e in kernels), 1),
            "memcpy": count["gpu_memcpy"], "memset": count["gpu_memset"],
            "cpu_ops": count["cpu_op"],
            "graph_launches": sum(v for k, v in names.items() if "GraphLaunch" in k),
            "profiler_steps": sum(1 for e in events if e.get("cat") == "user_annotation"
                                  and e.get("name", "").startswith("ProfilerStep#")),
            "distributedInfo": "distributedInfo" in trace}


def hf_stem(family: str, spec_name: str, layers: int, *parts: str, device: torch.device) -> str:
    """E.g. hf-qwen2-qwen2.5-7b-2l_generate_b1_t512_n5_h200 (empty parts skipped)."""
    return "_".join([f"hf-{family}-{spec_name}-{layers}l", *[p for p in parts if p],
                     device_tag(device)])


GENERATE_KW = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0}


@torch.inference_mode()
def profile_generate(lm: torch.nn.Module, ids: torch.Tensor, new_tokens: int, path: Path,
                     device: torch.device, workload: dict[str, Any], warmup_tokens: int = 2,
                     **kw: Any) -> Path:
    """`with profile(): lm.generate(ids, max_new_tokens=N)`, greedy, exactly N new tokens (no
    eos), no profiler schedule; a `warmup_tokens` generate runs unprofiled first (give N when
    the shapes must repeat, e.g. a StaticCache sized by N under torch.compile). The workload
    records the forwards: 1 prefill + N - 1 decode."""
    args = {**GENERATE_KW, **kw}
    lm.generate(ids, max_new_tokens=warmup_tokens, min_new_tokens=warmup_tokens, **args)
    sync(device)
    work = {**workload, "max_new_tokens": new_tokens, "profiler_schedule": None,
            "forwards": {"prefill": 1, "decode": new_tokens - 1}}
    with Profiled(path, device, work):
        out = lm.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **args)
    if out.shape[1] != ids.shape[1] + new_tokens:
        raise AssertionError(f"generate made {out.shape[1] - ids.shape[1]} tokens, not {new_tokens}")
    return path


@torch.inference_mode()
def profile_steps(lm: torch.nn.Module, ids: torch.Tensor, phase: str, path: Path,
                  device: torch.device, workload: dict[str, Any], warmup: int = 1,
                  steps: int = 2, before_steps: Callable[[], None] | None = None) -> Path:
    """Prefill: each step a forward over the B x T prompt `ids`. Decode: the prompt is prefilled
    unprofiled, then each step feeds one greedy token per sequence with HF's DynamicCache (keys
    T + 1, T + 2, ...). One unprofiled step, then `warmup` + `steps` under a profiler schedule
    (ProfilerStep#N ranges). `before_steps` runs after the prompt's prefill, before any step
    (e.g. to switch the experts implementation for decode only, as generate() does)."""
    if phase not in ("prefill", "decode"):
        raise ValueError(f"phase must be prefill or decode, got {phase!r}")
    state: dict[str, Any] = {}

    def prefill() -> None:
        state["out"] = lm(input_ids=ids, use_cache=True)
        sync(device)

    def decode() -> None:
        nxt = state["out"].logits[:, -1:].argmax(-1)  # [B, 1] greedy token
        state["out"] = lm(input_ids=nxt, past_key_values=state["out"].past_key_values,
                          use_cache=True)
        sync(device)

    prefill()  # warm-up, and the prompt's cache for decode
    if before_steps is not None:
        before_steps()
    step = prefill if phase == "prefill" else decode
    step()
    work = {**workload, "phase": phase, "cache": "DynamicCache",
            "profiler_schedule": {"warmup": warmup, "active": steps}}
    with Profiled(path, device, work, schedule=(warmup, steps)) as prof:
        for _ in range(warmup + steps):
            step()
            prof.step()
    return path
