"""Measure torch.profiler's host cost per recorded event (run on a GPU machine; needs torch).

`trace-roofline project` estimates a step's host time without the profiler as the profiled step's
host wall minus (recorded CPU ops + CUDA runtime calls) x this cost (trace_roofline/project.py,
PROFILER_EVENT_US). This script measures that cost on its own, apart from any model: eager loops
of small ops (so the host is the bottleneck), timed without the profiler and under it with the
settings of the committed captures (CPU + CUDA activities, record_shapes, no stack). Each loop's
events are counted in its exported trace. Prints one JSON object; docs/project.md cites it.

    python3 docs/profiler_overhead.py --out sample_traces/provenance/profiler_overhead_h100.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ITERS = 2000


def loops(dev: torch.device) -> dict[str, Callable[[], None]]:
    """Host-bound loops: views only (CPU ops, no launch), one launch per op, and a RMSNorm-like
    mix of both (an HF eager layer's small ops at batch 1)."""
    x = torch.randn(1, 3584, device=dev, dtype=torch.bfloat16)
    w = torch.randn(3584, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)

    def views() -> None:
        for _ in range(ITERS):
            x.view(-1).unsqueeze(0).transpose(0, 1)

    def launches() -> None:
        for _ in range(ITERS):
            torch.add(x, 1.0, out=y)

    def rmsnorm() -> None:
        for _ in range(ITERS // 8):
            h = x.to(torch.float32)
            v = h.pow(2).mean(-1, keepdim=True)
            h = h * torch.rsqrt(v + 1e-6)
            _ = w * h.to(torch.bfloat16)

    return {"views": views, "launches": launches, "rmsnorm": rmsnorm}


def wall_ms(fn: Callable[[], None], dev: torch.device, repeats: int = 7) -> float:
    """Median wall ms of `fn` (synchronised before and after)."""
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(dev)
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def profiled(fn: Callable[[], None], dev: torch.device, path: Path) -> float:
    """Wall ms of `fn` under the profiler (the captures' settings), trace exported to `path`."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    fn()  # warm
    with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
        ms = wall_ms(fn, dev, repeats=1)
    prof.export_chrome_trace(str(path))
    return ms


def events(path: Path) -> dict[str, int]:
    """CPU ops and CUDA runtime calls recorded in an exported trace."""
    ev = json.loads(path.read_text())["traceEvents"]
    cats = [e.get("cat") for e in ev if e.get("ph") == "X"]
    return {"cpu_op": cats.count("cpu_op"), "cuda_runtime": cats.count("cuda_runtime")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the JSON here too")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in loops(dev).items():
            fn()
            plain = wall_ms(fn, dev)
            prof = statistics.median(profiled(fn, dev, Path(tmp, f"{name}.json"))
                                     for _ in range(3))
            n = events(Path(tmp, f"{name}.json"))
            total = n["cpu_op"] + n["cuda_runtime"]
            rows[name] = {"plain_ms": plain, "profiled_ms": prof, **n,
                          "us_per_event": (prof - plain) * 1e3 / total}
    out = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
           "loops": rows,
           "us_per_event_median": statistics.median(r["us_per_event"] for r in rows.values())}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
