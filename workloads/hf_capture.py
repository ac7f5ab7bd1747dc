"""Unannotated attribution fixtures from HF transformers' Qwen2ForCausalLM (needs transformers).

A Qwen2ForCausalLM built from a ModelSpec-shaped Qwen2Config (default: Qwen2.5-7B shapes with
2 layers), random init directly on the device, eager SDPA attention. No record_function of ours:
the trace holds only what torch.profiler sees of HF code (plus nn.Module frames with
with_stack=True). Prefill: each step is a forward over B x T fresh tokens. Decode: a T-token
prefill outside the profiler, then each step feeds one greedy token with HF's default
DynamicCache, so the key length grows by one every step (S = T + step).

Variants (transformers' other decode paths, each a different trace schema):
- compile=True: the steps run through torch.compile(model) (Triton kernels, fused cache writes);
  the prompt prefill stays eager. With the DynamicCache, each decode step crops the cache back
  by one token, so every step attends to T + 1 keys and the compiled graph keeps its shapes.
- cache="static" (decode): a transformers StaticCache of max_cache_len slots (default 2 x T). The
  prompt fills slots 0..T-1, step i writes its token into slot T + i by aten::index_copy_
  (`cache_position` says which), and SDPA reads all max_cache_len slots under a mask: the same
  shapes every step.
With either, two decode steps run outside the profiler first (torch.compile compiles there).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from trace_roofline.model.models import ModelSpec, get_model
from workloads.runner import DTYPES, device_tag, resolve_device, sync


def qwen2_config(spec: ModelSpec, layers: int, dtype: torch.dtype, attn: str = "sdpa"):
    """Qwen2Config with `spec`'s shapes, `layers` decoder layers and attention implementation
    `attn` (sdpa | eager); max_position_embeddings 32768 (Qwen2.5's)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, rms_norm_eps=spec.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        max_position_embeddings=32768, tie_word_embeddings=spec.tie_word_embeddings,
        use_cache=True, attn_implementation=attn, dtype=dtype,
    )


def build_model(spec: ModelSpec, layers: int, dtype: torch.dtype, device: torch.device,
                seed: int = 0):
    """Randomly initialised Qwen2ForCausalLM, parameters created on `device` in `dtype`."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(qwen2_config(spec, layers, dtype))
    finally:
        torch.set_default_dtype(prev)
    return model.to(device=device, dtype=dtype).eval()


def capture(phase: str = "prefill", model: str = "qwen2.5-7b", layers: int = 2, batch: int = 1,
            tokens: int = 512, device: str | None = None, dtype: str = "bfloat16",
            warmup: int = 2, steps: int = 3, with_stack: bool = False, out: str = "traces",
            seed: int = 0, progress: Callable[[str], None] = print, *, compile: bool = False,
            cache: str = "dynamic", max_cache_len: int | None = None) -> Path:
    """Profile HF prefill or decode steps; returns the written .json.gz path."""
    if phase not in ("prefill", "decode"):
        raise ValueError(f"phase must be prefill or decode, got {phase!r}")
    if cache not in ("dynamic", "static"):
        raise ValueError(f"cache must be dynamic or static, got {cache!r}")
    static = cache == "static"
    cache_len = max_cache_len or 2 * tokens
    if static and phase != "decode":
        raise ValueError("cache static is for decode (a prefill step makes its own cache)")
    decoded = 2 + warmup + steps  # tokens written after the prompt
    if static and cache_len < tokens + decoded:
        raise ValueError(f"max_cache_len {cache_len} cannot hold {tokens} prompt tokens and "
                         f"{decoded} decoded ones")
    spec = get_model(model)
    dev = resolve_device(device)
    tdt = DTYPES[dtype.lower()]
    t0 = time.perf_counter()
    progress(f"[hf] building Qwen2ForCausalLM ({model} shapes, {layers} layers, {tdt}) on {dev}")
    lm = build_model(spec, layers, tdt, dev, seed)
    fwd = torch.compile(lm) if compile else lm
    gen = torch.Generator(device=dev).manual_seed(seed + 3000)
    ids = torch.randint(0, spec.vocab_size, (batch, tokens), generator=gen, device=dev)
    shape = f"t{tokens}" if phase == "prefill" else f"s{tokens}"
    stem = "_".join([f"hf-qwen2-{spec.name}-{layers}l", phase, f"b{batch}", shape]
                    + (["static"] if static else []) + (["compiled"] if compile else [])
                    + (["stack"] if with_stack else []) + [device_tag(dev)])
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.json.gz"
    state: dict = {}
    kv = None
    if static:
        from transformers import StaticCache

        kv = StaticCache(config=lm.config, max_cache_len=cache_len)
    slots = torch.arange(cache_len, device=dev)  # [max_cache_len] StaticCache positions
    state["pos"] = tokens  # the next decoded token's position

    @torch.inference_mode()
    def prefill(fn: Callable = lm) -> None:
        at = {} if kv is None else {"past_key_values": kv, "cache_position": slots[:tokens]}
        state["out"] = fn(input_ids=ids, use_cache=True, **at)
        sync(dev)

    @torch.inference_mode()
    def decode() -> None:
        nxt = state["out"].logits[:, -1:].argmax(-1)  # [B, 1] greedy token
        past = state["out"].past_key_values
        pos = state["pos"]
        at = {} if kv is None else {"cache_position": slots[pos:pos + 1]}  # [1], a view
        state["out"] = fwd(input_ids=nxt, past_key_values=past, use_cache=True, **at)
        if kv is not None:
            state["pos"] = pos + 1
        elif compile:
            past.crop(-1)  # back to T cached keys: the next step has the same shapes
        sync(dev)

    prefill()  # warm-up (and, for decode, the prompt's KV cache), eager
    step = partial(prefill, fwd) if phase == "prefill" else decode
    for _ in range(2 if compile or static else int(phase == "prefill")):
        step()  # warm-up outside the profiler; torch.compile compiles here
    activities = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(wait=0, warmup=warmup, active=steps, repeat=1)
    tmp = path.with_name(f".{path.name}.partial.json.gz")

    def export(p: torch.profiler.profile) -> None:
        p.export_chrome_trace(str(tmp))
        os.replace(tmp, path)

    with torch.profiler.profile(activities=activities, record_shapes=True,
                                with_stack=with_stack, schedule=schedule,
                                on_trace_ready=export) as prof:
        prof.add_metadata_json("trace_roofline_workload", json.dumps(
            {"kind": "hf_qwen2", "model": spec.name, "layers": layers, "phase": phase,
             "batch": batch, "tokens": tokens, "dtype": dtype, "warmup": warmup,
             "steps": steps, "attn_implementation": "sdpa",
             "cache": "StaticCache" if static else "DynamicCache",
             "max_cache_len": cache_len if static else None, "compile": compile,
             "with_stack": with_stack}))
        for i in range(warmup + steps):
            step()
            prof.step()
            progress(f"[hf] step {i + 1}/{warmup + steps}")
    progress(f"[hf] wrote {path} ({path.stat().st_size / 1e3:.1f} kB) "
             f"in {time.perf_counter() - t0:.1f} s")
    return path
