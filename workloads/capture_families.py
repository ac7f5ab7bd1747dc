"""Traces of the decoder families, compilers and steps the analyzer must name honestly.

Each capture builds a Hugging Face model from its family's config (`FAMILIES`: real hidden sizes,
`layers` decoder layers, random weights on the device), runs it under torch.profiler and writes
`<out>/<family>_<mode>_<device>.json.gz` with its description in `trace_roofline_workload`.
Modes: prefill and decode (eager), `compile` and `max-autotune` (torch.compile, decode; with
`-prefill`, prefill), `train` (forward,
loss, backward, AdamW), `assisted` (generate with a draft model), `generate` (sampling), `batch`
(continuous batching: `generate_batch` over prompts of different lengths, `paged|sdpa`) and
`schedule` (prefill steps under a profiler schedule, no sync between steps: the recorded window
begins while the previous step's kernels still run).

    python -m workloads.capture_families --families gpt2,gemma2 --modes prefill,decode --out DIR
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

# model_type -> (config fields at real size, with the layer count set by --layers)
FAMILIES: dict[str, dict[str, object]] = {
    "qwen2": dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                  num_key_value_heads=4, vocab_size=152064),
    "qwen3": dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "llama": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256),
    "gemma2": dict(hidden_size=2304, intermediate_size=9216, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=256, vocab_size=256000,
                   attn_implementation="eager"),
    "phi3": dict(hidden_size=3072, intermediate_size=8192, num_attention_heads=32,
                 num_key_value_heads=32, vocab_size=32064),
    "gpt2": dict(n_embd=1024, n_head=16, vocab_size=50257),
    "deepseek_v2": dict(hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                        num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64,
                        n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
                        kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128, vocab_size=102400),
    "gpt_oss": dict(hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                    num_key_value_heads=8, head_dim=64, num_local_experts=32,
                    num_experts_per_tok=4, vocab_size=201088),
    "mixtral": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                    num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                    vocab_size=32000),
    "bert": dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16,
                 vocab_size=30522),
}
LAYER_FIELD = {"gpt2": "n_layer"}
MODES = ("prefill", "decode", "compile", "compile-prefill", "max-autotune",
         "max-autotune-prefill", "train", "assisted", "generate", "batch", "schedule")
BATCH_PROMPTS = (37, 300, 64, 129)  # continuous batching: prompt lengths of the requests


def build(family: str, layers: int, device: torch.device, dtype: torch.dtype,
          scale: float = 1.0, seed: int = 0, draft: float = 1.0) -> torch.nn.Module:
    """The family's model, `layers` layers, sizes times `scale` (a CPU test uses a small one);
    a `draft` model shrinks its widths further but keeps the vocabulary (assisted decoding)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    fields = {k: _scaled(k, v, scale if k == "vocab_size" else scale * draft)
              for k, v in FAMILIES[family].items()}
    fields[LAYER_FIELD.get(family, "num_hidden_layers")] = layers
    if family == "gpt_oss":
        fields["layer_types"] = ["sliding_attention", "full_attention"] * (layers // 2) + \
            ["sliding_attention"] * (layers % 2)
    cfg = AutoConfig.for_model(family, **fields)
    if (getattr(cfg, "pad_token_id", None) or 0) >= cfg.vocab_size:  # Phi-3's 32000, shrunk vocab
        cfg.pad_token_id = None
    torch.manual_seed(seed)
    factory = AutoModel if family == "bert" else AutoModelForCausalLM
    with torch.device(device):
        model = factory.from_config(cfg, dtype=dtype)
    return model.to(device=device, dtype=dtype)


def _scaled(key: str, value: object, scale: float) -> object:
    """Sizes shrunk by `scale` (head counts kept divisible; vocab, dims and ranks shrunk)."""
    if scale == 1.0 or not isinstance(value, int) or key in (
            "num_experts_per_tok", "n_shared_experts", "first_k_dense_replace"):
        return value
    if "heads" in key or key == "n_head":
        return max(2, int(value * scale) // 2 * 2)
    if "experts" in key:
        return max(8, int(value * scale))
    return max(16, int(value * scale) // 16 * 16)


def _step(model: torch.nn.Module, mode: str, batch: int, tokens: int, device: torch.device
          ) -> Callable[[], object]:
    """One profiled step of `mode` (the prompt of a decode runs before the profiler)."""
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, tokens), device=device)
    if mode == "train":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def train() -> object:
            if model.config.model_type == "bert":  # an encoder: a loss on its hidden states
                loss = model(input_ids=ids).last_hidden_state.float().square().mean()
            else:
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
        return train
    if mode == "generate":
        return lambda: model.generate(ids, max_new_tokens=8, do_sample=True, top_k=50, top_p=0.9)
    if mode == "batch":
        from transformers import ContinuousBatchingConfig, GenerationConfig

        model.set_attn_implementation("paged|sdpa")
        prompts = [torch.randint(0, vocab, (n,)).tolist() for n in BATCH_PROMPTS]
        gen = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1,
                               pad_token_id=0)
        # On a GPU the paged cache takes what memory is free, as a server's would; on the CPU
        # that is most of the machine's RAM (6.5 GB in a test of a 2-layer toy model): there
        # the cache holds the requests' own blocks, 16 of 256 tokens (5 needed).
        cb = ContinuousBatchingConfig(use_cuda_graph=False, max_batch_tokens=256,
                                      num_blocks=16 if device.type == "cpu" else None)
        return lambda: model.generate_batch(prompts, generation_config=gen,
                                            continuous_batching_config=cb, warmup=False)
    if mode == "decode":
        with torch.no_grad():
            cache = model(input_ids=ids, use_cache=True).past_key_values
        one = ids[:, -1:]
        return lambda: model(input_ids=one, past_key_values=cache, use_cache=True)
    return lambda: model(input_ids=ids)


def capture(family: str, mode: str, out: Path, *, layers: int = 2, batch: int = 1,
            tokens: int = 512, device: str = "cuda", dtype: str = "bfloat16", steps: int = 2,
            scale: float = 1.0, progress: Callable[[str], None] = print) -> Path:
    """Profile `steps` steps of `family` in `mode`; returns the written trace."""
    dev, tdt = torch.device(device), getattr(torch, dtype)
    model = build(family, layers, dev, tdt, scale)
    model.train(mode == "train")
    if mode == "assisted":
        draft = build(family, 1, dev, tdt, scale, seed=1, draft=0.25)
        ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=dev)
        step: Callable[[], object] = lambda: model.generate(  # noqa: E731
            ids, assistant_model=draft, max_new_tokens=8, do_sample=False)
    else:
        compiler = mode.removesuffix("-prefill")
        if compiler in ("compile", "max-autotune"):
            torch._dynamo.reset()  # an earlier capture's recompile limit must not make it eager
            model.forward = torch.compile(  # type: ignore[method-assign]
                model.forward,
                mode="max-autotune-no-cudagraphs" if compiler == "max-autotune" else None)
            step = _step(model, "prefill" if mode.endswith("-prefill") else "decode",
                         batch, tokens, dev)
        else:
            step = _step(model, "prefill" if mode == "schedule" else mode, batch, tokens, dev)
    grad = torch.enable_grad() if mode == "train" else torch.no_grad()
    with grad:
        for _ in range(3 if mode.startswith(("compile", "max-autotune")) else 1):
            step()  # warm-up: compiles, and a decode's dynamic-shape recompile and autotuning
        _sync(dev)
        acts = [torch.profiler.ProfilerActivity.CPU]
        if dev.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        workload = dict(family=family, mode=mode, layers=layers, batch=batch, tokens=tokens,
                        dtype=dtype, scale=scale, steps=steps)
        prof = (_on_the_scheduler_thread(step, acts, workload, dev) if mode == "batch"
                else _profiled(step, acts, workload, steps, dev, schedule=mode == "schedule"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{family}_{mode}_{dev.type}.json.gz"
    prof.export_chrome_trace(str(path))
    progress(f"wrote {path}")
    return path


def _profiled(step: Callable[[], object], acts: list, workload: dict, steps: int,
              dev: torch.device, schedule: bool) -> torch.profiler.profile:
    """`steps` steps, each in a `ProfilerStep#N` range; with `schedule`, 3 unsynchronised
    steps under schedule(wait=1, warmup=1, active=1), the last one recorded."""
    sched = torch.profiler.schedule(wait=1, warmup=1, active=1) if schedule else None
    with torch.profiler.profile(activities=acts, record_shapes=True, schedule=sched) as prof:
        for i in range(3 if schedule else steps):
            # (given outside a schedule's recorded cycle, the metadata is dropped)
            prof.add_metadata_json("trace_roofline_workload", json.dumps(workload))
            if schedule:
                step()
                prof.step()
                continue
            with torch.profiler.record_function(f"ProfilerStep#{i}"):
                step()
        _sync(dev)
    return prof


def _on_the_scheduler_thread(step: Callable[[], object], acts: list, workload: dict,
                             dev: torch.device) -> torch.profiler.profile:
    """One `generate_batch`: continuous batching runs its steps on a worker thread, whose ops
    a profiler started on this thread does not record, so the worker's generation loop runs
    inside a profiler of its own (one `ProfilerStep#0` range)."""
    from transformers.generation.continuous_batching import continuous_api

    manager = continuous_api.ContinuousBatchingManager
    loop, done = manager._run_generation_loop, []

    def profiled(self: object) -> None:
        with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
            prof.add_metadata_json("trace_roofline_workload", json.dumps(workload))
            with torch.profiler.record_function("ProfilerStep#0"):
                loop(self)
            _sync(dev)
        done.append(prof)

    manager._run_generation_loop = profiled  # type: ignore[method-assign]
    try:
        step()
    finally:
        manager._run_generation_loop = loop  # type: ignore[method-assign]
    return done[0]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--modes", default="prefill,decode")
    ap.add_argument("--captures", default="",
                    help="family:mode pairs, comma separated (instead of families x modes)")
    ap.add_argument("--out", type=Path, default=Path("traces"))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args(argv)
    pairs = [tuple(c.split(":")) for c in a.captures.split(",") if c] or [
        (f, m) for f in a.families.split(",") for m in a.modes.split(",")
        if f != "bert" or m in ("prefill", "train")]
    failed = 0
    for family, mode in pairs:
        try:
            capture(family, mode, a.out, layers=a.layers, tokens=a.tokens, device=a.device)
        except Exception as e:  # one failing capture must not cost the others (logged)
            failed += 1
            print(f"FAILED {family} {mode}: {type(e).__name__}: {e}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
