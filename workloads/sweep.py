"""The M-knob lab: one projection-shaped GEMM timed at several M, next to the roofline.

Fixed weight W [K, N] (q_proj of the model by default), X [M, K], Y = X @ W. Each timed call
has its own pair of CUDA events (perf_counter + synchronize on CPU); the figure is the median
after warm-up. The weight is rotated among enough copies to span 4x the L2 cache, so the M=1
point measures DRAM, not a 26 MB weight sitting in a 60 MB L2 (methodology: warm-up, device-side
timing, medians, rotate inputs past the cache). A second pass runs under torch.profiler (no
schedule, so no ProfilerStep ranges): each call in a `q_proj` range inside `m_sweep.M{M}`, so the
analyzer can place the same points from the trace.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from trace_roofline.costs.calculator import si
from trace_roofline.errors import InputError
from trace_roofline.files import read_json, write_files
from trace_roofline.model.models import get_model
from trace_roofline.outputs.report import duration
from workloads.runner import DTYPES, device_tag, resolve_device, sync

PEAK_KEY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def gemm_cost(m: int, k: int, n: int, b: int) -> tuple[float, float]:
    """FLOPs = 2MKN (one multiply + one add per MAC); minimum bytes = (MK + KN + MN)·b
    (each operand read once, the output written once) -- the lesson's / DOMAIN.md convention."""
    return 2.0 * m * k * n, float((m * k + k * n + m * n) * b)


def load_hardware(spec: str | None, device_name: str | None) -> dict | None:
    """Roofs as {name, peak_flops{dtype: FLOP/s}, mem_bandwidth B/s, source}: from a hardware
    JSON path, else a trace_roofline.model.hardware preset name, else the preset matching the device."""
    if spec and spec.endswith(".json"):
        return read_json(spec)
    try:
        from trace_roofline.model import hardware as hw
        if spec:
            h = hw.get_hardware(spec)
        elif device_name:
            h = hw.for_device_name(device_name)
        else:
            return None
    except (ImportError, AttributeError, TypeError, LookupError, ValueError):
        if spec:
            raise
        return None
    if h is None:
        return None
    return {"name": h.name, "peak_flops": dict(h.peak_flops), "mem_bandwidth": h.mem_bandwidth,
            "source": getattr(h, "source", "")}


def _time_calls(fn: Callable[[int], object], device: torch.device, warmup: int,
                iters: int) -> tuple[list[float], float | None]:
    """(seconds per call of fn(i), each call timed on its own; on CUDA the fraction of the
    first-start..last-end span the timed calls cover, near 1 when nothing waited on launches).

    On CUDA the calls and their events are queued behind a ~20 ms `torch.cuda._sleep`, so the
    GPU runs them back to back and each event pair times the kernels, not the CPU's launch gap
    (without it, a 10 us GEMV reads as ~28 us on an H200: the launch cost, not the kernel).
    """
    for i in range(warmup):
        fn(i)
    sync(device)
    out = []
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(iters)]
        torch.cuda._sleep(40_000_000)  # cycles: ~20 ms at 2 GHz, more at idle clocks
        for i, (a, b) in enumerate(events):
            a.record()
            fn(i)
            b.record()
        torch.cuda.synchronize(device)
        out = [a.elapsed_time(b) / 1e3 for a, b in events]
        span = events[0][0].elapsed_time(events[-1][1]) / 1e3
        return out, sum(out) / span
    for i in range(iters):
        t = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t)
    return out, None


@torch.inference_mode()
def m_sweep(ms: list[int], k: int, n: int, dtype: torch.dtype, device: torch.device,
            warmup: int = 10, iters: int = 50, hardware: dict | None = None,
            trace_path: Path | None = None, profiled_calls: int = 5, seed: int = 0,
            progress: Callable[[str], None] = print) -> dict:
    """Time Y = X @ W at each M; return the results dict (rows per M) and optionally write the
    profiled trace to trace_path."""
    b = torch.tensor([], dtype=dtype).element_size()
    gen = torch.Generator(device=device).manual_seed(seed)
    props = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    l2 = getattr(props, "L2_cache_size", 0) or 64 << 20
    copies = max(1, math.ceil(4 * l2 / (k * n * b)))
    ws = [torch.randn(k, n, generator=gen, device=device, dtype=torch.float32).to(dtype)
          for _ in range(copies)]  # [K, N] each
    key = PEAK_KEY[dtype]
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 and device.type == "cuda":
        key = "tf32"
    rows = []
    for i_m, m in enumerate(ms):
        # said before the work: one M of a big CPU GEMM takes minutes
        progress(f"[sweep] M={m:>5} ({i_m + 1} of {len(ms)}): {warmup} warm-up + {iters} timed "
                 "calls ...")
        xs = [torch.randn(m, k, generator=gen, device=device, dtype=torch.float32).to(dtype)
              for _ in range(4)]  # [M, K]
        y = xs[0] @ ws[0]  # [M, N]
        ref = xs[0].float() @ ws[0].float()
        err = float(torch.linalg.vector_norm(y.float() - ref) / torch.linalg.vector_norm(ref))
        if not err < 2e-2:
            raise AssertionError(f"M={m}: X @ W differs from float32 reference by {err:.2e}")
        secs, covered = _time_calls(lambda i, xs=xs: xs[i % len(xs)] @ ws[i % copies], device,
                                    warmup, iters)
        med = statistics.median(secs)
        flops, nbytes = gemm_cost(m, k, n, b)
        row = {"M": m, "K": k, "N": n, "median_us": med * 1e6,
               "min_us": min(secs) * 1e6, "max_us": max(secs) * 1e6, "flops": flops,
               "bytes": nbytes, "intensity": flops / nbytes,
               "achieved_tflops": flops / med / 1e12, "achieved_gbps": nbytes / med / 1e9,
               "rel_error_vs_fp32": err, "timed_fraction_of_span": covered}
        if hardware:
            p, bw = hardware["peak_flops"][key], hardware["mem_bandwidth"]
            att = min(p, row["intensity"] * bw)  # attainable(I) = min(P, I·B)
            row.update(attainable_tflops=att / 1e12, roof_fraction=flops / med / att,
                       bound="memory" if row["intensity"] < p / bw else "compute")
        rows.append(row)
        progress(f"[sweep] M={m:>5}: {duration(med * 1e6):>9}  {si(flops / med, 'FLOP/s'):>13}"
                 + (f"  attainable {si(row['attainable_tflops'] * 1e12, 'FLOP/s'):>13} "
                    f"({100 * row['roof_fraction']:5.1f}% "
                    f"of roof, {row['bound']}-bound)" if hardware else ""))
    result = {
        "kind": "m_sweep", "device": str(device), "device_tag": device_tag(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__, "date": dt.date.today().isoformat(), "dtype": str(dtype),
        "peak_key": key, "hardware": hardware, "trace": str(trace_path) if trace_path else None,
        "method": (f"Y = X @ W, W [{k}, {n}] rotated among {copies} copies (>= 4x L2), X among 4; "
                   f"{warmup} warm-up calls then {iters} calls each timed with its own "
                   + ("CUDA events, queued behind a torch.cuda._sleep so the GPU runs them back "
                      "to back (kernel time, not launch gaps)" if device.type == "cuda"
                      else "perf_counter")
                   + "; median reported; FLOPs 2MKN, bytes (MK+KN+MN)b"),
        "rows": rows,
    }
    if trace_path is not None:
        progress(f"[sweep] profiling {profiled_calls} calls per M into {trace_path} ...")
        _profile_sweep(ms, k, ws, dtype, device, gen, profiled_calls, trace_path)
        progress(f"[sweep] wrote {trace_path}")
    return result


def _profile_sweep(ms: list[int], k: int, ws: list[torch.Tensor], dtype: torch.dtype,
                   device: torch.device, gen: torch.Generator, calls: int, path: Path) -> None:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    xs = {m: torch.randn(m, k, generator=gen, device=device, dtype=torch.float32).to(dtype)
          for m in ms}
    for m in ms:  # warm-up outside the trace (cuBLAS heuristics, handles)
        xs[m] @ ws[0]
    sync(device)
    tmp = path.with_name(f".{path.name}.partial.json.gz")
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        prof.add_metadata_json("trace_roofline_workload", json.dumps(
            {"kind": "m_sweep", "M": ms, "K": k, "N": ws[0].shape[1], "dtype": str(dtype),
             "calls_per_M": calls}))
        for m in ms:
            with torch.profiler.record_function(f"m_sweep.M{m}"):
                for i in range(calls):
                    with torch.profiler.record_function("q_proj"):
                        xs[m] @ ws[i % len(ws)]
            sync(device)
    prof.export_chrome_trace(str(tmp))
    os.replace(tmp, path)


def run_sweep(model: str = "qwen2.5-7b", projection: str = "q_proj",
              ms: tuple[int, ...] = (1, 16, 64, 256, 1024), dtype: str | None = None,
              device: str | None = None, warmup: int = 10, iters: int = 50,
              hardware: str | None = None, out: str = "traces", trace: bool = True,
              progress: Callable[[str], None] = print) -> tuple[dict, Path]:
    """The lab for one projection of a model preset; writes results JSON (+ trace) to `out`."""
    spec = get_model(model)
    linears = {**spec.linears(), **spec.fused_linears()}
    if projection not in linears:
        raise InputError(f"projection {projection!r} is not one of {', '.join(linears)}")
    k, n, _ = linears[projection]
    dev = resolve_device(device)
    key = (dtype or ("bfloat16" if dev.type == "cuda" else spec.dtype)).lower()
    if key not in DTYPES:
        raise InputError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    tdt = DTYPES[key]
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    hw = load_hardware(hardware, name)
    out_dir = Path(out)
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"{out_dir}: `out` is not a directory", "out")
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{spec.name}_msweep_{projection}_{PEAK_KEY[tdt]}_{device_tag(dev)}"
    progress(f"[sweep] {projection} K={k} N={n} {tdt} on {dev}; M in {list(ms)}")
    result = m_sweep(list(ms), k, n, tdt, dev, warmup, iters, hw,
                     out_dir / f"{stem}.json.gz" if trace else None, progress=progress)
    result.update(model=spec.name, projection=projection)
    path = out_dir / f"{stem}.results.json"
    write_files({path: (json.dumps(result, indent=2) + "\n").encode()})
    progress(f"[sweep] wrote {path}")
    return result, path
