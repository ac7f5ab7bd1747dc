"""Step-time sweep of one full-depth model (issue 34): decode over batch, prefill over length.

HF transformers' `Qwen2ForCausalLM` built from a ModelSpec's Qwen2Config (default Qwen2.5-7B, all
28 layers, random bf16 weights on the device, SDPA attention), run eagerly. A step is one forward:

- decode at batch B: B new tokens, each attending to `context` cached keys plus itself. The cache
  is a DynamicCache holding `context` random keys and values per layer (stand-ins for a prompt);
  after each step the new token is cropped off again, so every step has the same shapes (HF's
  torch.cat of the cache is in every step, as in HF eager decoding).
- prefill at length T: one sequence of T tokens from position 0, causal, with a fresh cache.

Logits are computed for every token of the step (HF's plain forward), so lm_head's M is the
step's token count in both phases. Per point: `warmup` unmeasured steps, `iters` steps each timed
by CUDA events without the profiler (each step synchronised, so the time is the step's wall time
on the device side, host launch gaps included), then one profiled step under torch.profiler
(CPU + CUDA activities, record_shapes, a `ProfilerStep#1` range) written as
`<out>/<stem>.json.gz`. `<out>/step_sweep_results.json` gets every point as soon as it is done.

    python -m workloads.capture_step_sweep --out DIR [--decode-batches 1,4,16,64,256]
        [--context 1024] [--prefill-tokens 256,512,1024,2048,4096] [--layers 28]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trace_roofline.model.models import get_model
from workloads.capture_common import (
    DTYPES,
    Profiled,
    device_tag,
    log,
    random_lm,
    resolve_device,
    sync,
    versions,
)
from workloads.hf_capture import qwen2_config

Step = Callable[[], object]
HFModel = Any  # a transformers PreTrainedModel (config, device, forward kwargs)


def time_steps(step: Step, device: torch.device, warmup: int, iters: int) -> dict[str, Any]:
    """`warmup` steps, then `iters` steps each between two CUDA events (perf_counter on a CPU),
    synchronised after each; the device-side ms per step (median, min, max, mean, all) and the
    host wall ms per step (median)."""
    for _ in range(warmup):
        step()
    sync(device)
    dev_ms: list[float] = []
    wall_ms: list[float] = []
    for _ in range(iters):
        t0 = time.perf_counter()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            dev_ms.append(start.elapsed_time(end))
        else:
            step()
        wall_ms.append((time.perf_counter() - t0) * 1e3)
        if device.type != "cuda":
            dev_ms.append(wall_ms[-1])
    return {"step_ms": {"median": statistics.median(dev_ms), "min": min(dev_ms),
                        "max": max(dev_ms), "mean": statistics.fmean(dev_ms),
                        "all": [round(x, 4) for x in dev_ms]},
            "timer": "cuda_events" if device.type == "cuda" else "perf_counter",
            "host_wall_ms_median": statistics.median(wall_ms), "iters": iters,
            "warmup": warmup}


def profile_one_step(step: Step, path: Path, device: torch.device,
                     workload: dict[str, Any]) -> float:
    """One step recorded under torch.profiler (schedule: 1 warm-up step, then 1 active step in a
    `ProfilerStep#1` range), exported to `path`; returns the recorded step's wall ms (host
    perf_counter, synchronised)."""
    wall = 0.0
    with Profiled(path, device, workload, schedule=(1, 1)) as prof:
        for _ in range(2):
            sync(device)
            t0 = time.perf_counter()
            step()
            sync(device)
            wall = (time.perf_counter() - t0) * 1e3
            prof.step()
    return wall


def measure(step: Step, path: Path, device: torch.device, workload: dict[str, Any],
            warmup: int, iters: int) -> dict[str, Any]:
    """time_steps, then profile_one_step to `path`: the step times and the profiled step's
    wall ms (`profiled_step_wall_ms`)."""
    row = time_steps(step, device, warmup, iters)
    row["profiled_step_wall_ms"] = profile_one_step(step, path, device, workload)
    log(f"[measure] {path.name}: median {row['step_ms']['median']:.3f} ms "
        f"(min {row['step_ms']['min']:.3f}, max {row['step_ms']['max']:.3f}); "
        f"profiled step {row['profiled_step_wall_ms']:.2f} ms wall")
    return row


def release(device: torch.device, row: dict[str, Any]) -> None:
    """Record the peak GPU memory of the point in `row` (GiB), then free the cached blocks
    and reset the peak."""
    if device.type == "cuda":
        row["max_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def fixed_cache(lm: HFModel, batch: int, context: int, seed: int = 0) -> Any:
    """A DynamicCache holding `context` random keys and values per layer for `batch`
    sequences (the model's dtype and device)."""
    from transformers import DynamicCache

    cfg = lm.config
    p = next(lm.parameters())
    gen = torch.Generator(device=p.device).manual_seed(seed)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shape = (batch, cfg.num_key_value_heads, context, head_dim)
    cache = DynamicCache(config=cfg)
    for layer in range(cfg.num_hidden_layers):
        k, v = (torch.randn(shape, generator=gen, device=p.device, dtype=p.dtype)
                for _ in range(2))
        cache.update(k, v, layer)
    return cache


def decode_step(lm: HFModel, batch: int, context: int, seed: int = 0,
                prompt: bool = False) -> Step:
    """One new token for each of `batch` sequences over a `context`-key DynamicCache; the
    token is cropped off after the step, so the shapes repeat. The cache holds random keys and
    values, or with `prompt` the model's own of a random `context`-token prompt (a prefill
    forward, last token's logits only: for caches whose keys and values differ in width)."""
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, lm.config.vocab_size, (batch, context + 1), generator=gen)
    ids = ids.to(lm.device)
    if prompt:
        with torch.inference_mode():
            cache = lm(input_ids=ids[:, :context], use_cache=True,
                       logits_to_keep=1).past_key_values
    else:
        cache = fixed_cache(lm, batch, context, seed)
    last = ids[:, context:]  # [B, 1]

    @torch.inference_mode()
    def step() -> object:
        out = lm(input_ids=last, past_key_values=cache, use_cache=True)
        cache.crop(-1)
        return out.logits
    return step


def prefill_step(lm: HFModel, batch: int, tokens: int, seed: int = 0) -> Step:
    """A forward over `batch` x `tokens` fresh tokens (a new DynamicCache each step)."""
    ids = torch.randint(0, lm.config.vocab_size, (batch, tokens),
                        generator=torch.Generator().manual_seed(seed + 2)).to(lm.device)

    @torch.inference_mode()
    def step() -> object:
        return lm(input_ids=ids, use_cache=True).logits
    return step


def sweep_points(decode_batches: list[int], context: int, prefill_tokens: list[int]
                 ) -> list[dict[str, Any]]:
    """The sweep's points: decode (batch, context, tokens = batch), then prefill at B=1."""
    return ([{"phase": "decode", "batch": b, "context": context, "tokens": b}
             for b in decode_batches]
            + [{"phase": "prefill", "batch": 1, "context": 0, "tokens": t}
               for t in prefill_tokens])


def point_stem(model: str, layers: int, point: dict[str, Any], device: torch.device) -> str:
    """E.g. hf-qwen2-qwen2.5-7b-28l_decode_b16_s1024_h200, ..._prefill_b1_t2048_h200."""
    shape = (f"s{point['context']}" if point["phase"] == "decode"
             else f"t{point['tokens']}")
    return "_".join([f"hf-qwen2-{model}-{layers}l", point["phase"], f"b{point['batch']}",
                     shape, device_tag(device)])


def run_sweep(out: Path, model: str = "qwen2.5-7b", layers: int | None = None,
              decode_batches: list[int] | None = None, context: int = 1024,
              prefill_tokens: list[int] | None = None, device: str | None = None,
              dtype: str = "bfloat16", warmup: int = 3, iters: int = 20,
              seed: int = 0) -> dict[str, Any]:
    """Measure and profile every point; writes traces, the model's config and the results
    JSON (rewritten after each point). A failing point is recorded with its error."""
    spec = get_model(model)
    layers = layers or spec.num_layers
    dev, tdt = resolve_device(device), DTYPES[dtype]
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    config = qwen2_config(spec, layers, tdt)
    lm = random_lm(config, tdt, dev, seed)
    (out / f"hf-qwen2-{spec.name}-{layers}l.config.json").write_text(
        config.to_json_string(use_diff=False))
    log(f"[sweep] built {spec.name} ({layers} layers, {tdt}) on {dev} in "
        f"{time.perf_counter() - t0:.1f} s")
    results: dict[str, Any] = {
        "model": spec.name, "layers": layers, "dtype": dtype, "attn_implementation": "sdpa",
        "cache": "DynamicCache (random keys/values; the step's token cropped off after each "
                 "step)", "logits": "every token of the step", **versions(dev),
        "points": []}
    path = out / "step_sweep_results.json"
    for point in sweep_points(decode_batches or [1, 4, 16, 64, 256], context,
                              prefill_tokens or [256, 512, 1024, 2048, 4096]):
        stem = point_stem(spec.name, layers, point, dev)
        row: dict[str, Any] = {**point, "trace": f"{stem}.json.gz"}
        step: Step | None = None
        try:
            step = (decode_step(lm, point["batch"], context, seed) if point["phase"] == "decode"
                    else prefill_step(lm, point["batch"], point["tokens"], seed))
            row.update(measure(step, out / row["trace"], dev,
                               {"kind": "step_sweep", "model": spec.name, "layers": layers,
                                "dtype": dtype, **point, "attn_implementation": "sdpa",
                                "cache": "DynamicCache"}, warmup, iters))
        except Exception as e:  # one failing point must not cost the others (recorded)
            row["error"] = f"{type(e).__name__}: {e}"
            log(f"[sweep] FAILED {stem}: {row['error']}")
        finally:
            del step
            release(dev, row)
        results["points"].append(row)
        path.write_text(json.dumps(results, indent=1) + "\n")
    return results


def time_rounds(out: Path, model: str = "qwen2.5-7b", decode_batches: list[int] | None = None,
                context: int = 1024, rounds: int = 3, device: str | None = None,
                dtype: str = "bfloat16", warmup: int = 10, iters: int = 20,
                seed: int = 0) -> dict[str, Any]:
    """The decode points timed again without the profiler, `rounds` times in turn (1, 4, ...,
    1, 4, ...), to tell a point's own step time from the order it was measured in; writes
    `<out>/step_timing_rounds.json`."""
    spec = get_model(model)
    dev, tdt = resolve_device(device), DTYPES[dtype]
    out.mkdir(parents=True, exist_ok=True)
    lm = random_lm(qwen2_config(spec, spec.num_layers, tdt), tdt, dev, seed)
    batches = decode_batches or [1, 4, 16, 64, 256]
    steps = {b: decode_step(lm, b, context, seed) for b in batches}
    res: dict[str, Any] = {"model": spec.name, "context": context, "warmup": warmup,
                           "iters": iters, **versions(dev), "rounds": []}
    for r in range(rounds):
        for b in batches:
            row = time_steps(steps[b], dev, warmup, iters)
            res["rounds"].append({"round": r, "batch": b, **row})
            log(f"[rounds] round {r} B={b}: median {row['step_ms']['median']:.3f} ms, host "
                f"{row['host_wall_ms_median']:.3f} ms")
            (out / "step_timing_rounds.json").write_text(json.dumps(res, indent=1) + "\n")
    return res


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("traces/step_sweep"))
    ap.add_argument("--model", default="qwen2.5-7b", help="a Qwen2 preset")
    ap.add_argument("--layers", type=int, default=None, help="default: the model's depth")
    ap.add_argument("--decode-batches", type=_ints, default=[1, 4, 16, 64, 256])
    ap.add_argument("--context", type=int, default=1024, help="cached keys of a decode step")
    ap.add_argument("--prefill-tokens", type=_ints, default=[256, 512, 1024, 2048, 4096])
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=0,
                    help="time the decode points this many rounds in turn, no profiler")
    a = ap.parse_args(argv)
    if a.rounds:
        time_rounds(a.out, a.model, a.decode_batches, a.context, a.rounds, a.device, a.dtype,
                    max(a.warmup, 10), a.iters)
        return 0
    res = run_sweep(a.out, a.model, a.layers, a.decode_batches, a.context, a.prefill_tokens,
                    a.device, a.dtype, a.warmup, a.iters)
    return 1 if any("error" in p for p in res["points"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
