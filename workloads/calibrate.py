"""Measure the current device's ceilings and return them as a trace_roofline hardware JSON dict.

A ceiling that ordinary kernels beat is no ceiling, so each one is the max over several kernels,
not one benchmark's figure:
- Compute, per dtype: the best median FLOP/s over large square matmuls (n^3) AND the LLM-shaped
  GEMMs Y = X @ W of the model presets' projections (q/k/v/o, gate/up/down and the fused qkv and
  gate_up), M in `ms`, each in both weight layouts: `nn` (W [K, N], as the sweep) and `nt`
  (W [N, K] transposed, as nn.Linear runs). FLOPs = 2MKN. Random normal operands (never zeros:
  zeros run measurably faster), output poisoned with NaN and checked against float64 on its first
  rows. tf32 is a float32 matmul with TF32 allowed, fp32 one with TF32 forbidden; CPUs have no
  TF32, so there tf32 is the fp32 figure and `method` says so.
- Memory: the best median bytes/s over streaming kernels on buffers far past the last-level
  cache: copy (bytes = read + written), add a + b -> c (2 reads + 1 write) and sum (bytes read),
  each in float32 and bfloat16, each result checked.
- Link (machines with >= 2 GPUs): the all-reduce bus bandwidth of NCCL, one process per GPU, in
  nccl-tests' convention: for each message size (1 MiB .. 1 GiB, bf16), `iters` back-to-back
  in-place `dist.all_reduce` calls between two CUDA events after a warm-up; time per call t = the
  max over ranks of the mean; algbw = bytes / t; busbw = algbw * 2 (n - 1) / n for n ranks (the
  bytes each rank's link carries in a ring all-reduce). `link_bandwidth` = the best busbw, every
  size's figures in `link_measurements`. NVLink multicast (NVLS) stays off.
Each figure: warm-up, then `repeats` runs each timed on its own (CUDA events queued behind a
sleep, see sweep._time_calls; perf_counter on CPU), median. Every median is kept in
`measurements` and the kernel behind each ceiling in `ceilings_from`, so the figures can be
audited. Schema: {name, peak_flops{bf16,fp16,tf32,fp32}, mem_bandwidth, source, device_name,
device_names, date, method, ceilings_from, measurements[, link_bandwidth, link_method,
link_measurements]} -- trace_roofline.model.hardware.from_json
reads the first ones and keeps the rest in `extra`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trace_roofline.costs.calculator import si
from trace_roofline.model.models import PRESETS
from workloads.runner import device_tag, resolve_device, sync
from workloads.sweep import _time_calls

GEMM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32,
               "fp32": torch.float32}
# ‖C - C_ref‖/‖C‖ against float64 on the same (already rounded) operands: output rounding and
# accumulation only (tf32 also rounds the operands to a 10-bit mantissa).
GEMM_TOLERANCE = {"bf16": 1e-2, "fp16": 1e-2, "tf32": 5e-3, "fp32": 1e-4}
STREAM_DTYPES = (torch.float32, torch.bfloat16)
STREAM_MOVES = {"copy": 2, "add": 3, "sum": 1}  # buffers read + written per element
LLM_MODELS = tuple(n for n, s in PRESETS.items() if s.dtype == "bfloat16")  # real checkpoints
DEFAULTS = {  # stream buffer bytes (each); square sizes (increasing); LLM models and M values
    "cuda": {"copy_bytes": 2 << 30, "sizes": (4096, 8192, 16384), "models": LLM_MODELS,
             "ms": (2048, 4096, 8192), "warmup": 5, "repeats": 20},
    "cpu": {"copy_bytes": 256 << 20, "sizes": (512, 1024, 2048), "models": ("qwen-tiny",),
            "ms": (128,), "warmup": 1, "repeats": 5},
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


def gemm_shapes(sizes: tuple[int, ...], models: tuple[str, ...],
                ms: tuple[int, ...]) -> dict[tuple[int, int, int], str]:
    """(M, K, N) -> what it is: 'square', 'qwen2.5-7b gate_proj/up_proj', ... (joined by '; '
    when a shape is several things); squares first, in `sizes` order."""
    labels: dict[tuple[int, int, int], list[str]] = {(n, n, n): ["square"] for n in sizes}
    for model in models:
        spec = PRESETS[model]
        by_kn: dict[tuple[int, int], list[str]] = {}
        for name, (k, n, _) in {**spec.linears(), **spec.fused_linears()}.items():
            by_kn.setdefault((k, n), []).append(name)
        for m in ms:
            for (k, n), names in by_kn.items():
                labels.setdefault((m, k, n), []).append(f"{model} {'/'.join(names)}")
    return {shape: "; ".join(what) for shape, what in labels.items()}


def stream_rate(device: torch.device, kernel: str, dtype: torch.dtype, nbytes: int, warmup: int,
                repeats: int) -> dict:
    """Median bytes/s of one streaming kernel over buffers of nbytes each (bytes counted as
    STREAM_MOVES[kernel] x buffer: each input read once, the output written once)."""
    n = nbytes // dtype.itemsize
    gen = torch.Generator(device=device).manual_seed(n)
    x = torch.rand(n, generator=gen, device=device, dtype=dtype).add_(0.5)  # random, never zero
    if kernel == "copy":
        out = torch.full_like(x, float("nan"))
        secs, covered = _time_calls(lambda i: out.copy_(x), device, warmup, repeats)
        ok = torch.equal(out, x)
    elif kernel == "add":
        y = torch.rand(n, generator=gen, device=device, dtype=dtype).add_(0.5)
        out = torch.full_like(x, float("nan"))
        secs, covered = _time_calls(lambda i: torch.add(x, y, out=out), device, warmup, repeats)
        ok = torch.equal(out, x + y)
    elif kernel == "sum":
        out = torch.full((), float("nan"), device=device, dtype=dtype)
        secs, covered = _time_calls(lambda i: torch.sum(x, 0, out=out), device, warmup, repeats)
        ref = sum(c.double().sum().item() for c in x.split(1 << 24))  # float64, chunked
        ok = abs(out.item() - ref) <= (1e-2 if dtype.itemsize < 4 else 1e-3) * ref
    else:
        raise ValueError(f"unknown streaming kernel {kernel!r} (one of {', '.join(STREAM_MOVES)})")
    if not ok:
        raise AssertionError(f"{kernel} {dtype} check failed: wrong or unwritten output")
    med = statistics.median(secs)
    moved = STREAM_MOVES[kernel] * n * dtype.itemsize
    return {"kind": "stream", "kernel": kernel, "dtype": str(dtype).removeprefix("torch."),
            "buffer_bytes": n * dtype.itemsize, "bytes": moved, "median_s": med,
            "bytes_per_s": moved / med, "seconds": secs, "busy_fraction": covered}


def matmul_rate(device: torch.device, key: str, m: int, k: int, n: int, layout: str, warmup: int,
                repeats: int) -> dict:
    """Median FLOP/s of Y[M, N] = X[M, K] @ W, W stored [K, N] (`nn`) or [N, K] (`nt`, as
    nn.Linear); FLOPs = 2MKN (one multiply + one add per MAC)."""
    dtype = GEMM_DTYPES[key]
    gen = torch.Generator(device=device).manual_seed(m * 31 + k * 7 + n)
    a = torch.randn(m, k, generator=gen, device=device, dtype=torch.float32).to(dtype)
    w_shape = (k, n) if layout == "nn" else (n, k)
    w = torch.randn(w_shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    b = w if layout == "nn" else w.t()  # [K, N] either way
    c = torch.full((m, n), float("nan"), device=device, dtype=dtype)  # poisoned
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = key == "tf32"
    try:
        secs, covered = _time_calls(lambda i: torch.mm(a, b, out=c), device, warmup, repeats)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    rows = min(m, 8)
    ref = a[:rows].double() @ b.double()
    err = ((c[:rows].double() - ref).norm() / ref.norm()).item()
    if not (torch.isfinite(c).all() and err <= GEMM_TOLERANCE[key]):
        raise AssertionError(f"{key} {m}x{k}x{n} {layout} matmul check failed: rel. error {err:.2e}"
                             " or unwritten output")
    med = statistics.median(secs)
    return {"kind": "matmul", "dtype": key, "M": m, "K": k, "N": n, "layout": layout,
            "median_s": med, "flops_per_s": 2.0 * m * k * n / med, "seconds": secs,
            "busy_fraction": covered, "rel_error": err}


LINK_SIZES = tuple(1 << p for p in range(20, 31))  # all-reduce message bytes: 1 MiB .. 1 GiB


def bus_factor(ranks: int) -> float:
    """nccl-tests' all-reduce bus factor 2 (n - 1) / n: busbw = algbw * bus_factor(n)."""
    return 2.0 * (ranks - 1) / ranks


def _allreduce_worker(rank: int, world: int, port: int, sizes: tuple[int, ...], warmup: int,
                      iters: int, use_cuda: bool, results: mp.SimpleQueue) -> None:
    """One rank of link_bandwidth: times in-place all-reduces of each size; rank 0 reports."""
    from workloads.capture_common import init_group

    device = init_group(rank, world, port, use_cuda)
    dtype = torch.bfloat16
    try:
        for nbytes in sizes:
            n = nbytes // dtype.itemsize
            x = torch.zeros(n, dtype=dtype, device=device)  # zeros: sums stay finite
            for _ in range(warmup):
                dist.all_reduce(x)
            sync(device)
            dist.barrier()
            if use_cuda:
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                for _ in range(iters):
                    dist.all_reduce(x)
                end.record()
                end.synchronize()
                secs = start.elapsed_time(end) / 1e3 / iters
            else:
                t0 = time.perf_counter()
                for _ in range(iters):
                    dist.all_reduce(x)
                secs = (time.perf_counter() - t0) / iters
            slowest = torch.tensor([secs], dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            y = torch.full((n,), rank + 1.0, dtype=dtype, device=device)
            dist.all_reduce(y)  # check: every element is 1 + 2 + ... + world
            ok = bool((y == world * (world + 1) / 2).all().item())
            del x, y
            if rank == 0:
                t = slowest.item()
                results.put({"bytes": nbytes, "dtype": "bfloat16", "iters": iters,
                             "time_s": t, "algbw": nbytes / t,
                             "busbw": nbytes / t * bus_factor(world), "correct": ok})
    finally:
        dist.destroy_process_group()


def link_bandwidth(ranks: int | None = None, sizes: tuple[int, ...] = LINK_SIZES,
                   warmup: int = 5, iters: int = 20, device: str = "cuda",
                   progress: Callable[[str], None] = print) -> dict:
    """All-reduce bus bandwidth over `ranks` GPUs (default: all), one process each (NCCL; gloo
    with device="cpu", for dry runs). Returns {link_bandwidth (bytes/s, the best busbw), ranks,
    method, ceilings_from, measurements, nccl_version, device_names}."""
    from workloads.capture_common import NCCL_SAFE_ENV, free_port

    use_cuda = device == "cuda"
    if ranks is None:
        ranks = torch.cuda.device_count() if use_cuda else 2
    if ranks < 2 or (use_cuda and torch.cuda.device_count() < ranks):
        raise ValueError(f"link_bandwidth needs >= 2 ranks and as many GPUs; ranks={ranks}, "
                         f"GPUs={torch.cuda.device_count()}")
    os.environ.update(NCCL_SAFE_ENV)
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_allreduce_worker, args=(ranks, free_port(), tuple(sizes), warmup, iters, use_cuda,
                                      results), nprocs=ranks, join=True)
    rows = []
    while not results.empty():
        rows.append(results.get())
    if len(rows) != len(sizes) or not all(r["correct"] for r in rows):
        raise AssertionError(f"all-reduce check failed or sizes missing: {rows}")
    for r in rows:
        progress(f"[calibrate] all_reduce {r['bytes'] / 2**20:.0f} MiB x {ranks} ranks: "
                 f"{r['time_s'] * 1e6:.1f} us, algbw {si(r['algbw'], 'B/s')}, "
                 f"busbw {si(r['busbw'], 'B/s')}")
    best = max(rows, key=lambda r: r["busbw"])
    names = ([torch.cuda.get_device_name(i) for i in range(ranks)] if use_cuda
             else [cpu_name()] * ranks)
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if use_cuda else None
    backend = f"NCCL {nccl}, NCCL_NVLS_ENABLE=0" if use_cuda else "gloo on CPU, a dry run"
    timer = "two CUDA events" if use_cuda else "time.perf_counter"
    method = (f"all-reduce (sum, in place, bf16) over {ranks} ranks, one process per device "
              f"(torch.distributed, {backend}), sizes {sizes[0] / 2**20:.0f} MiB .. "
              f"{sizes[-1] / 2**20:.0f} MiB; per size {warmup} warm-up then {iters} back-to-back "
              f"calls timed by {timer}, time per call = max over ranks of the mean; algbw = "
              f"bytes / time, busbw = algbw * 2(n-1)/n (nccl-tests' convention); "
              f"link_bandwidth = the best busbw; each size's result checked (sum of rank+1)")
    return {"link_bandwidth": best["busbw"], "ranks": ranks, "method": method,
            "ceilings_from": f"all_reduce {best['bytes'] / 2**20:.0f} MiB bf16 x {ranks} ranks",
            "measurements": rows, "nccl_version": nccl, "device_names": names,
            "torch": torch.__version__, "date": dt.date.today().isoformat()}


def _public(meas: dict) -> dict:
    """A measurement as the hardware JSON keeps it (per-run seconds stay in the raw output)."""
    return {k: v for k, v in meas.items() if k not in ("seconds", "busy_fraction", "rel_error")}


@torch.inference_mode()
def calibrate(device: str | None = None, copy_bytes: int | None = None,
              sizes: tuple[int, ...] | None = None, warmup: int | None = None,
              repeats: int | None = None, max_seconds: float = 1.0,
              progress: Callable[[str], None] = print, models: tuple[str, ...] | None = None,
              ms: tuple[int, ...] | None = None, link: bool | None = None) -> tuple[dict, dict]:
    """(hardware JSON dict, raw measurements with per-run seconds). Square sizes stop growing
    once one run takes longer than max_seconds (keeps slow CPU dtypes cheap); `models` and `ms`
    pick the LLM-shaped GEMMs (model preset names, token counts M). `link` (default: when the
    machine has >= 2 GPUs) adds the all-reduce bus bandwidth over all GPUs (link_bandwidth)."""
    dev = resolve_device(device)
    d = DEFAULTS["cuda" if dev.type == "cuda" else "cpu"]
    copy_bytes = copy_bytes or d["copy_bytes"]
    sizes = tuple(sizes or d["sizes"])
    models = tuple(d["models"] if models is None else models)
    ms = tuple(ms or d["ms"])
    warmup = d["warmup"] if warmup is None else warmup
    repeats = repeats or d["repeats"]
    if dev.type == "cuda":
        dev_name = torch.cuda.get_device_name(dev)
        l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0)
        progress(f"[calibrate] {dev_name}, L2 {l2 / 2**20:.0f} MiB, stream buffers "
                 f"{copy_bytes / 2**30:.2f} GiB each")
    else:
        dev_name = cpu_name()
        progress(f"[calibrate] {dev_name} ({torch.get_num_threads()} threads)")
    raw: list[dict] = []
    for kernel in STREAM_MOVES:
        for dtype in STREAM_DTYPES:
            r = stream_rate(dev, kernel, dtype, copy_bytes, warmup, repeats)
            raw.append(r)
            progress(f"[calibrate] {kernel} {r['dtype']}: {si(r['bytes_per_s'], 'B/s')}")
    shapes = gemm_shapes(sizes, models, ms)
    keys = ["bf16", "fp16", "tf32", "fp32"] if dev.type == "cuda" else ["bf16", "fp16", "fp32"]
    for key in keys:
        for (m, k, n), what in shapes.items():
            if what.startswith("square") and any(r["kind"] == "matmul" and r["dtype"] == key and
                                        r["shape"].startswith("square") and r["median_s"] > max_seconds
                                        for r in raw):
                continue  # a smaller square already took too long
            for layout in ("nn", "nt"):
                r = {**matmul_rate(dev, key, m, k, n, layout, warmup, repeats), "shape": what}
                raw.append(r)
                progress(f"[calibrate] {key} {m}x{k}x{n} {layout} ({what}): "
                         f"{si(r['flops_per_s'], 'FLOP/s')}")
    sync(dev)
    streams = [r for r in raw if r["kind"] == "stream"]
    best_bw = max(streams, key=lambda r: r["bytes_per_s"])
    best = {key: max((r for r in raw if r["kind"] == "matmul" and r["dtype"] == (
        key if key in keys else "fp32")), key=lambda r: r["flops_per_s"])
        for key in ("bf16", "fp16", "tf32", "fp32")}  # no tf32 on CPUs: the fp32 figure
    ceilings_from = {key: f"matmul {r['M']}x{r['K']}x{r['N']} {r['layout']} ({r['shape']})"
                     for key, r in best.items()}
    ceilings_from["mem_bandwidth"] = (f"{best_bw['kernel']} {best_bw['dtype']}, "
                                      f"{best_bw['buffer_bytes'] / 2**20:.0f} MiB buffers")
    for key, r in best.items():
        progress(f"[calibrate] ceiling {key}: {si(r['flops_per_s'], 'FLOP/s')}, "
                 f"{ceilings_from[key]}")
    progress(f"[calibrate] ceiling mem_bandwidth: {si(best_bw['bytes_per_s'], 'B/s')}, "
             f"{ceilings_from['mem_bandwidth']}")
    date = dt.date.today().isoformat()
    timer = "CUDA events" if dev.type == "cuda" else "time.perf_counter"
    method = (
        f"memory: max over streaming kernels of their median bytes/s -- copy (bytes = read + "
        f"written), add a+b->c (2 reads + 1 write), sum (bytes read) -- in float32 and bfloat16, "
        f"{copy_bytes / 2**20:.0f} MiB random buffers each; compute: per dtype, max over GEMMs of "
        f"their median FLOP/s (FLOPs = 2MKN) -- squares {list(sizes)} and the projections (q/k/v/o, "
        f"gate/up/down, fused qkv and gate_up) of {', '.join(models) or 'no model'} at M "
        f"{list(ms)} -- each with W stored [K, N] (nn) and [N, K] (nt, as nn.Linear), torch.mm "
        f"of random normal data, checked against float64; {warmup} warm-up then {repeats} runs "
        f"each timed with {timer}, median; every median in `measurements`, the kernel behind "
        f"each ceiling in `ceilings_from`")
    if dev.type == "cuda":
        method += " (runs queued behind torch.cuda._sleep: kernel time, not launch gaps)"
    else:
        method += "; CPU has no TF32: tf32 = the fp32 measurement"
    hw = {
        "name": f"{device_tag(dev)}-measured",
        "peak_flops": {k: best[k]["flops_per_s"] for k in ("bf16", "fp16", "tf32", "fp32")},
        "mem_bandwidth": best_bw["bytes_per_s"],
        "source": (f"measured by trace-roofline calibrate on {date} (torch {torch.__version__}, "
                   f"{dev_name})"),
        "device_name": dev_name,
        "device_names": [dev_name],  # trace deviceProperties names this file applies to
        "date": date,
        "method": method,
        "ceilings_from": ceilings_from,
        "measurements": [_public(r) for r in raw],
    }
    raw_out = {"device_name": dev_name, "torch": torch.__version__, "date": date,
               "measurements": raw}
    if link is None:
        link = dev.type == "cuda" and torch.cuda.device_count() >= 2
    if link:
        bw = link_bandwidth(device="cuda" if dev.type == "cuda" else "cpu", progress=progress)
        hw.update({"link_bandwidth": bw["link_bandwidth"], "link_method": bw["method"],
                   "link_measurements": bw["measurements"]})
        hw["ceilings_from"]["link_bandwidth"] = bw["ceilings_from"]
        raw_out["link"] = bw
    return hw, raw_out


def main(argv: list[str] | None = None) -> int:
    """`python3 -m workloads.calibrate --link-only --out FILE.json`: the all-reduce bus bandwidth
    alone (the full calibration is `trace-roofline calibrate`)."""
    p = argparse.ArgumentParser(prog="python3 -m workloads.calibrate", description=main.__doc__)
    p.add_argument("--link-only", action="store_true", required=True)
    p.add_argument("--ranks", type=int, default=None, help="default: every GPU")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: gloo dry run (no meaningful figure)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--max-mib", type=int, default=1024)
    p.add_argument("--out", "-o", default=None, help="JSON path (default: stdout)")
    args = p.parse_args(argv)
    sizes = tuple(s for s in LINK_SIZES if s <= args.max_mib << 20)
    try:
        res = link_bandwidth(args.ranks, sizes, iters=args.iters, device=args.device,
                             progress=lambda m: print(m, file=sys.stderr, flush=True))
    except ValueError as e:
        print(f"calibrate: error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(res, indent=2) + "\n"
    if args.out:
        from trace_roofline.files import write_files

        write_files({Path(args.out): text.encode()})
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
