"""Traces of models that are not LLM decoders, for the analyzer's honesty checks.

trace_roofline must say that these hold no decoder layer and which time it cannot cost, instead
of presenting ReLU and pooling as the model's intensity. Two workloads, profiled as the LLM
traces are (torch.profiler, record_shapes=True, 1 warm-up + 2 active steps `ProfilerStep#1..2`):

- `cnn`: Conv2d(3→16, 3x3) → ReLU → MaxPool2d(2) → Conv2d(16→32, 3x3) → ReLU → MaxPool2d(2) →
  Flatten → Linear(2048→10) on a [8, 3, 32, 32] batch, built from torch.nn alone;
- `matmul`: a plain loop of 8 `x = x @ w` products, x [256, 512], w [512, 512].

    python -m workloads.non_llm --device cpu --out sample_traces
writes sample_traces/cnn_b8_cpu.json.gz and matmul_loop_cpu.json.gz.
"""

from __future__ import annotations

import argparse
import gzip
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, schedule


def cnn(device: str) -> Callable[[], torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 10),
    ).to(device).eval()
    x = torch.randn(8, 3, 32, 32, device=device)

    def step() -> torch.Tensor:
        with torch.no_grad():
            return model(x)

    return step


def matmul(device: str) -> Callable[[], torch.Tensor]:
    torch.manual_seed(0)
    x0 = torch.randn(256, 512, device=device)
    w = torch.randn(512, 512, device=device) / 512 ** 0.5

    def step() -> torch.Tensor:
        x = x0
        for _ in range(8):
            x = x @ w
        return x

    return step


WORKLOADS = {"cnn_b8": cnn, "matmul_loop": matmul}


def capture(step: Callable[[], torch.Tensor], path: Path, device: str, warmup: int = 1,
            active: int = 2) -> Path:
    """Profile `step` (warmup + active steps) and write the Chrome trace gzipped to `path`."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        with profile(activities=activities, record_shapes=True,
                     schedule=schedule(wait=0, warmup=warmup, active=active, repeat=1),
                     on_trace_ready=lambda p: p.export_chrome_trace(str(raw))) as prof:
            for _ in range(warmup + active):
                step()
                if device == "cuda":
                    torch.cuda.synchronize()
                prof.step()
        path.write_bytes(gzip.compress(raw.read_bytes(), mtime=0))
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out", default="sample_traces", help="directory for the traces")
    args = p.parse_args(argv)
    tag = "cpu" if args.device == "cpu" else "h200"
    for name, make in WORKLOADS.items():
        path = capture(make(args.device), Path(args.out) / f"{name}_{tag}.json.gz", args.device)
        print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
