"""Measure the current device's ceilings and return them as a trace_roofline hardware JSON dict.

- Memory: device-to-device copy `dst.copy_(src)` of buffers far larger than the last-level cache;
  bytes = 2 x size (each byte read once and written once).
- Compute: square matmuls of random normal data (never zeros: zeros run measurably faster) at
  several sizes per dtype; the peak is the best median over sizes. tf32 is a float32 matmul with
  TF32 allowed, fp32 one with TF32 forbidden. CPUs have no TF32: there the tf32 entry is the same
  float32 measurement, and `method` says so.
Each figure: warm-up, then `repeats` timed runs (CUDA events per run; perf_counter on CPU),
median. Schema: {name, peak_flops{bf16,fp16,tf32,fp32}, mem_bandwidth, source, device_name,
device_names, date, method} -- what trace_roofline.hardware.from_json reads.
"""

from __future__ import annotations

import datetime as dt
import platform
import statistics
from collections.abc import Callable

import torch

from workloads.runner import device_tag, resolve_device, sync
from workloads.sweep import _time_calls

GEMM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32,
               "fp32": torch.float32}
DEFAULTS = {  # buffer bytes for the copy; square GEMM sizes tried in increasing order
    "cuda": {"copy_bytes": 2 << 30, "sizes": (4096, 8192, 16384), "warmup": 3, "repeats": 20},
    "cpu": {"copy_bytes": 512 << 20, "sizes": (512, 1024, 2048), "warmup": 1, "repeats": 5},
}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def copy_bandwidth(device: torch.device, nbytes: int, warmup: int,
                   repeats: int) -> tuple[float, list[float]]:
    """Median bytes/s of dst.copy_(src), counting read + write."""
    n = nbytes // 4
    src = torch.rand(n, device=device, dtype=torch.float32) + 0.5  # random, never zero
    dst = torch.empty_like(src)
    secs, _ = _time_calls(lambda i: dst.copy_(src), device, warmup, repeats)
    if not torch.equal(dst, src):
        raise AssertionError("copy check failed: destination differs from source")
    med = statistics.median(secs)
    return 2 * n * 4 / med, secs


def matmul_rate(device: torch.device, key: str, size: int, warmup: int,
                repeats: int) -> tuple[float, float]:
    """(median FLOP/s, median seconds) of one size x size x size matmul, FLOPs = 2n^3."""
    dtype = GEMM_DTYPES[key]
    gen = torch.Generator(device=device).manual_seed(size)
    a = torch.randn(size, size, generator=gen, device=device, dtype=torch.float32).to(dtype)
    b = torch.randn(size, size, generator=gen, device=device, dtype=torch.float32).to(dtype)
    c = torch.empty(size, size, device=device, dtype=dtype)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = key == "tf32"
    try:
        secs, _ = _time_calls(lambda i: torch.mm(a, b, out=c), device, warmup, repeats)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    if not torch.isfinite(c).all():
        raise AssertionError(f"{key} {size}^3 matmul produced non-finite values")
    med = statistics.median(secs)
    return 2.0 * size**3 / med, med


@torch.inference_mode()
def calibrate(device: str | None = None, copy_bytes: int | None = None,
              sizes: tuple[int, ...] | None = None, warmup: int | None = None,
              repeats: int | None = None, max_seconds: float = 1.0,
              progress: Callable[[str], None] = print) -> tuple[dict, dict]:
    """(hardware JSON dict, raw measurements). Sizes stop growing once one run takes longer
    than max_seconds (keeps slow CPU dtypes cheap)."""
    dev = resolve_device(device)
    d = DEFAULTS["cuda" if dev.type == "cuda" else "cpu"]
    copy_bytes = copy_bytes or d["copy_bytes"]
    sizes = tuple(sizes or d["sizes"])
    warmup = d["warmup"] if warmup is None else warmup
    repeats = repeats or d["repeats"]
    if dev.type == "cuda":
        dev_name = torch.cuda.get_device_name(dev)
        l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0)
        progress(f"[calibrate] {dev_name}, L2 {l2 / 2**20:.0f} MiB, copy buffers "
                 f"{copy_bytes / 2**30:.2f} GiB")
    else:
        dev_name = cpu_name()
        progress(f"[calibrate] {dev_name} ({torch.get_num_threads()} threads)")
    bw, copy_secs = copy_bandwidth(dev, copy_bytes, warmup, repeats)
    progress(f"[calibrate] copy: {bw / 1e12:.3f} TB/s (read + write, median of {repeats})")
    raw: dict = {"copy": {"bytes_per_buffer": copy_bytes, "seconds": copy_secs,
                          "bandwidth": bw}, "matmul": {}}
    peaks: dict[str, float] = {}
    keys = ["bf16", "fp16", "tf32", "fp32"] if dev.type == "cuda" else ["bf16", "fp16", "fp32"]
    for key in keys:
        best = 0.0
        for size in sizes:
            rate, med = matmul_rate(dev, key, size, warmup, repeats)
            raw["matmul"][f"{key}_{size}"] = {"flops_per_s": rate, "median_s": med}
            progress(f"[calibrate] {key} {size}^3: {rate / 1e12:.2f} TFLOP/s")
            best = max(best, rate)
            if med > max_seconds:
                break
        peaks[key] = best
    if dev.type != "cuda":
        peaks["tf32"] = peaks["fp32"]
    sync(dev)
    date = dt.date.today().isoformat()
    timer = "CUDA events" if dev.type == "cuda" else "time.perf_counter"
    method = (f"copy: dst.copy_(src) of {copy_bytes / 2**20:.0f} MiB float32 buffers of random "
              f"data, bytes = read + written; matmul: torch.mm of random normal square matrices, "
              f"sizes {list(sizes)}, peak = best median over sizes, FLOPs = 2n^3; {warmup} warm-up "
              f"then {repeats} runs each timed with {timer}, median")
    if dev.type == "cuda":
        method += " (runs queued behind torch.cuda._sleep: kernel time, not launch gaps)"
    else:
        method += "; CPU has no TF32: tf32 = the fp32 measurement"
    hw = {
        "name": f"{device_tag(dev)}-measured",
        "peak_flops": {k: peaks[k] for k in ("bf16", "fp16", "tf32", "fp32")},
        "mem_bandwidth": bw,
        "source": (f"measured by trace-roofline calibrate on {date} (torch {torch.__version__}, "
                   f"{dev_name})"),
        "device_name": dev_name,
        "device_names": [dev_name],  # trace deviceProperties names this file applies to
        "date": date,
        "method": method,
    }
    return hw, raw
