"""Every GPU capture of sample_traces/ in one process: `python -m workloads.capture_all OUTDIR`.

Each capture is independent: a failure is logged and the rest still run. After each one,
`on_done` (e.g. re-tarring the output) is called so a later timeout loses nothing captured.
Run through workloads/capture_all.sh, which adds nvidia-smi, ncu and the GPU tests. The
calibration is named after the device it measured (h200_measured.json on an H200,
cpu_measured.json in a CPU dry run), never after a GPU it did not run on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from workloads.calibrate import calibrate
from workloads.runner import RunConfig, device_tag, resolve_device, run
from workloads.sweep import run_sweep

MAX_TRACE_BYTES = 2_000_000
# A CPU dry run of the whole driver: TR_CAPTURE_MODEL=qwen-tiny python -m workloads.capture_all DIR
MODEL = os.environ.get("TR_CAPTURE_MODEL", "qwen2.5-7b")


def log(msg: str) -> None:
    print(msg, flush=True)


def captures(out: Path) -> list[tuple[str, Callable[[], object]]]:
    tag = device_tag(resolve_device(None))
    hw_path = out / f"{tag}_measured.json"
    sweep_hw = str(hw_path)

    def runner(**kw: object) -> Callable[[], object]:
        def go() -> object:
            summary = run(RunConfig(model=MODEL, out=str(out), **kw), progress=log)
            size = summary.get("trace_bytes") or 0
            if size > MAX_TRACE_BYTES:
                log(f"[capture] WARNING {summary['trace']} is {size} bytes (> 2 MB)")
            return {k: summary.get(k) for k in ("trace", "trace_bytes", "check")}
        return go

    def do_calibrate() -> object:
        hw, raw = calibrate(progress=log)
        hw_path.write_text(json.dumps(hw, indent=2) + "\n")
        (out / f"{tag}_calibration_raw.json").write_text(json.dumps(raw, indent=2) + "\n")
        return hw

    def do_sweep() -> object:
        result, _ = run_sweep(model=MODEL, hardware=sweep_hw if hw_path.exists() else None, out=str(out),
                              progress=log)
        return result["rows"]

    def hf(phase: str, with_stack: bool = False, steps: int = 3) -> Callable[[], object]:
        def go() -> object:
            from workloads.hf_capture import capture

            path = capture(phase, model=MODEL, tokens=512, steps=steps, with_stack=with_stack, out=str(out),
                           progress=log)
            size = path.stat().st_size
            if size > MAX_TRACE_BYTES and steps > 1:
                log(f"[capture] {path} is {size} bytes; recapturing with 1 active step")
                path = capture(phase, model=MODEL, tokens=512, steps=1, with_stack=with_stack,
                               out=str(out), progress=log)
            return {"trace": str(path), "bytes": path.stat().st_size}
        return go

    return [
        ("calibrate", do_calibrate),
        ("decode_b1_s2048", runner(phase="decode", batch=1, context=2048)),
        ("decode_b64_s2048", runner(phase="decode", batch=64, context=2048)),
        ("prefill_b1_t512", runner(phase="prefill", batch=1, tokens=512)),
        ("prefill_b1_t2048", runner(phase="prefill", batch=1, tokens=2048)),
        ("fused_decode_b32_s2048", runner(phase="decode", batch=32, context=2048,
                                          layout="fused")),
        ("m_sweep", do_sweep),
        ("fused_noannot_decode_b32_s2048", runner(phase="decode", batch=32, context=2048,
                                                  layout="fused", annotate="none")),
        ("hf_prefill_b1_t512", hf("prefill")),
        ("hf_decode_b1_s512", hf("decode")),
        ("compiled_noannot_decode_b1_s2048", runner(phase="decode", batch=1, context=2048,
                                                    annotate="none", compile=True)),
        ("compiled_noannot_prefill_b1_t512", runner(phase="prefill", batch=1, tokens=512,
                                                    annotate="none", compile=True)),
        ("hf_decode_b1_s512_stack", hf("decode", with_stack=True)),
        ("decode_b8_s2048_l2", runner(phase="decode", batch=8, context=2048, layers=2)),
        # the bf16 decode_b1_s2048 workload in fp16 (trace ..._decode_b1_s2048_fp16_<dev>)
        ("decode_b1_s2048_fp16", runner(phase="decode", batch=1, context=2048, dtype="float16")),
    ]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m workloads.capture_all")
    ap.add_argument("out", type=Path)
    ap.add_argument("on_done", nargs="?", help="shell command run after each capture")
    ap.add_argument("--only", default=None, help="comma-separated capture names")
    args = ap.parse_args(argv)
    out, on_done = args.out, args.on_done
    only = set(args.only.split(",")) if args.only else None
    out.mkdir(parents=True, exist_ok=True)
    log(f"[capture] torch {torch.__version__}, cuda {torch.version.cuda}, "
        f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}")
    results = {}
    for name, fn in captures(out):
        if only is not None and name not in only:
            continue
        t0 = time.perf_counter()
        log(f"[capture] === {name}")
        try:
            results[name] = {"ok": True, "result": fn()}
        except Exception as e:  # keep going: each capture is independent
            traceback.print_exc()
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        results[name]["seconds"] = round(time.perf_counter() - t0, 2)
        log(f"[capture] {name}: {'ok' if results[name]['ok'] else 'FAILED'} "
            f"({results[name]['seconds']} s)")
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        (out / "capture_results.json").write_text(json.dumps(results, indent=2, default=str))
        if on_done:
            subprocess.run(on_done, shell=True, check=False)
    failed = [n for n, r in results.items() if not r["ok"]]
    log(f"[capture] done; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
