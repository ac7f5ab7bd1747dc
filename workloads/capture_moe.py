"""Mixture-of-experts traces of HF transformers models (issue 12): Mixtral-8x7B, Qwen1.5-MoE-A2.7B
and Qwen3-30B-A3B shapes, 2 layers, HF random init on the device, bf16, SDPA, no ranges of ours.

transformers 5.x runs the routed experts through one of its registered experts implementations
(`config._experts_implementation`, chosen with `experts_implementation=` at load time):
- `grouped_mm` (the default where it can dispatch: CUDA sm80+, recent torch): tokens sorted by
  expert (sort, histc, cumsum offsets), one `torch.nn.functional.grouped_mm` for all experts'
  gate+up and one for down, weighted, un-permuted, summed over top-k.
- `eager`: the Python loop over hit experts (one_hot mask, nonzero, then per expert: gather,
  linear gate_up, act * up, linear down, weight, index_add_).
- `batched_mm`: every (token, expert) pair gathers its expert's weights (`gate_up_proj[ids]`) and
  runs one torch.bmm; `generate()` switches grouped_mm to batched_mm for its decode loop on
  non-CPU devices (GenerationMixin._optimize_model_for_decode).
The router is a linear H -> E, softmax (float32), top-k (renormalised for Mixtral / Qwen3, not for
Qwen1.5-MoE); Qwen1.5-MoE adds a shared expert (gate/up/down 5632) with a sigmoid gate.

    python3 -m workloads.capture_moe --out DIR --model mixtral-8x7b prefill --experts grouped_mm
    python3 -m workloads.capture_moe --out DIR --model qwen1.5-moe-a2.7b decode --experts eager
    python3 -m workloads.capture_moe --out DIR --model qwen3-30b-a3b generate
    python3 -m workloads.capture_moe --out DIR --model mixtral-8x7b all   # one model build:
        prefill x {grouped_mm, eager}, decode x {grouped_mm, eager, batched_mm}, generate
    python3 -m workloads.capture_moe --out DIR --model mixtral-8x7b graph --experts grouped_mm
Defaults: prefill B=1, T=512, warm-up 1 + 1 active step; decode B=4 after a 512-token prompt,
warm-up 1 + 3 active steps; generate B=1, T=512, 4 new tokens (transformers' default experts).

`graph`: the decode step in a `torch.cuda.CUDAGraph`, as capture_graphs' `cudagraph` does for
Qwen2 (same code: capture_graphs.StaticDecode over this model, capture_graphs.cudagraph_traces):
a transformers StaticCache of `--cache-len` slots filled by an eager B x T prompt prefill (under
the default experts form; the named `--experts` form from the decode steps on), then `--traces`
`mapping` (the step eager, graphs off, ProfilerStep#1..N after 1 warm-up) and `graph` (`--replays`
replays under a bare profiler, the eager argmax + copy_ of the next token between them). The
grouped_mm form has no host sync (histc offsets, sorted on the device), so it captures; the
CPU runs the mapping only (`--tiny --device cpu graph --traces mapping`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from workloads.capture_common import (
    DTYPES,
    hf_stem,
    log,
    profile_generate,
    profile_steps,
    random_lm,
    resolve_device,
)
from workloads.capture_graphs import StaticDecode, _traces, cudagraph_traces

# Real checkpoints' config.json values (Hub), num_hidden_layers overridden by --layers.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral-8x7b": ("MixtralConfig", {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 32768,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_window": None, "tie_word_embeddings": False}),
    "qwen1.5-moe-a2.7b": ("Qwen2MoeConfig", {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
        "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 60,
        "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1,
        "norm_topk_prob": False, "qkv_bias": True, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 8192,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "tie_word_embeddings": False}),
    "qwen3-30b-a3b": ("Qwen3MoeConfig", {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "decoder_sparse_step": 1, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "tie_word_embeddings": False}),
}
# --tiny: the same architectures and expert counts with small matrices (CPU dry runs).
TINY = {"vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256,
        "moe_intermediate_size": 64, "shared_expert_intermediate_size": 256, "head_dim": 32,
        "num_attention_heads": 4, "num_key_value_heads": 2}
EXPERTS = ("grouped_mm", "eager", "batched_mm")


def moe_config(model: str, layers: int, dtype: torch.dtype, tiny: bool = False):
    """The HF config of `model` (a MODELS key) with `layers` decoder layers, SDPA, no eos."""
    import transformers

    cls_name, values = MODELS[model]
    values = dict(values)
    if tiny:
        values.update({k: v for k, v in TINY.items() if k in values or k == "head_dim"})
        if model == "mixtral-8x7b":
            values["head_dim"] = TINY["head_dim"]
    cls = getattr(transformers, cls_name)
    return cls(num_hidden_layers=layers, attn_implementation="sdpa", dtype=dtype, use_cache=True,
               bos_token_id=None, eos_token_id=None, pad_token_id=None, **values)


ALL = (("prefill", "grouped_mm"), ("prefill", "eager"), ("decode", "grouped_mm"),
       ("decode", "eager"), ("decode", "batched_mm"), ("generate", None))
BATCH = {"prefill": 1, "decode": 4, "generate": 1}


def _build(args: argparse.Namespace):
    dev = resolve_device(args.device)
    dtype = DTYPES[args.dtype]
    cfg = moe_config(args.model, args.layers, dtype, args.tiny)
    lm = random_lm(cfg, dtype, dev, args.seed)
    log(f"[capture_moe] {type(lm).__name__} ({args.model}{' tiny' if args.tiny else ''}, "
        f"{args.layers} layers), transformers' experts_implementation "
        f"{lm.config._experts_implementation}, "
        f"{sum(p.numel() for p in lm.parameters()) / 1e9:.2f} B parameters")
    return dev, cfg, lm


def _capture(args: argparse.Namespace, dev: torch.device, cfg, lm, command: str,
             experts: str | None) -> Path:
    default = lm.config._experts_implementation
    # batched_mm gathers every (token, expert) pair's weights: a decode form (generate() uses it
    # for decode only); a decode capture's prompt prefill runs under the default form
    prompt_default = command == "decode" and experts == "batched_mm"

    def switch() -> None:
        lm.set_experts_implementation(experts)
        if lm.config._experts_implementation != experts:
            raise ValueError(f"asked for experts_implementation {experts!r}, model has "
                             f"{lm.config._experts_implementation!r}")

    if experts and not prompt_default:
        switch()
    impl = experts or default
    batch = args.batch or BATCH[command]
    gen = torch.Generator(device=dev).manual_seed(args.seed + 3000)
    ids = torch.randint(0, cfg.vocab_size, (batch, args.tokens), generator=gen,
                        device=dev)  # [B, T]
    work = {"kind": f"hf_moe_{command}", "model": args.model, "hf_class": type(lm).__name__,
            "tiny": args.tiny, "layers": args.layers, "batch": batch, "tokens": args.tokens,
            "dtype": args.dtype, "attn_implementation": "sdpa", "experts_implementation": impl,
            "num_experts": getattr(cfg, "num_local_experts", getattr(cfg, "num_experts", None)),
            "top_k": cfg.num_experts_per_tok, "hidden_size": cfg.hidden_size,
            "moe_intermediate_size": getattr(cfg, "moe_intermediate_size",
                                             cfg.intermediate_size),
            "shared_expert_intermediate_size": getattr(cfg, "shared_expert_intermediate_size",
                                                       None),
            "norm_topk_prob": getattr(cfg, "norm_topk_prob", True),
            "seed": args.seed, "script": "workloads.capture_moe"}
    name = args.model + ("-tiny" if args.tiny else "")
    shape = f"s{args.tokens}" if command == "decode" else f"t{args.tokens}"
    parts = [command, f"b{batch}", shape] + (
        [f"n{args.new_tokens}"] if command == "generate" else []) + [impl.replace("_", "")]
    path = Path(args.out) / f"{hf_stem('moe', name, args.layers, *parts, device=dev)}.json.gz"
    try:
        if command == "generate":
            work["decode_experts_implementation"] = (
                "batched_mm" if impl == "grouped_mm" and dev.type != "cpu" else impl)
            return profile_generate(lm, ids, args.new_tokens, path, dev,
                                    {**work, "cache": "DynamicCache"})
        steps = args.steps or (1 if command == "prefill" else 3)
        if prompt_default:
            work["prompt_experts_implementation"] = default
        return profile_steps(lm, ids, command, path, dev, work, args.warmup, steps,
                             before_steps=switch if prompt_default else None)
    finally:
        if lm.config._experts_implementation != default:
            lm.set_experts_implementation(default)


class MoeStaticDecode(StaticDecode):
    """capture_graphs.StaticDecode over a MoE model: its files are named and described as
    capture_moe's (hf-moe-<model>-<L>l_decode_b<B>_s<T>_static<N>_<form>_<trace>_<device>)."""

    def __init__(self, args: argparse.Namespace, lm: torch.nn.Module, prompt_form: str) -> None:
        super().__init__(args, lm)
        self.prompt_form = prompt_form

    def stem(self, *parts: str) -> str:
        a = self.args
        form = self.lm.config._experts_implementation.replace("_", "")
        return hf_stem("moe", a.model + ("-tiny" if a.tiny else ""), a.layers, "decode",
                       f"b{a.batch}", f"s{a.tokens}", f"static{a.cache_len}", form, *parts,
                       device=self.dev)

    def workload(self, kind: str, **extra: object) -> dict:
        cfg = self.lm.config
        return super().workload(
            kind, hf_class=type(self.lm).__name__, tiny=self.args.tiny,
            experts_implementation=cfg._experts_implementation,
            prompt_experts_implementation=self.prompt_form,
            num_experts=getattr(cfg, "num_local_experts", getattr(cfg, "num_experts", None)),
            top_k=cfg.num_experts_per_tok, script="workloads.capture_moe graph", **extra)


def capture_graph(args: argparse.Namespace, lm: torch.nn.Module) -> list[Path]:
    """`graph`: the decode step's mapping and CUDA-graph replay traces (module docstring)."""
    args = argparse.Namespace(**{**vars(args), "batch": args.batch or BATCH["decode"]})
    default = lm.config._experts_implementation
    sd = MoeStaticDecode(args, lm, default)  # prefills the prompt under the default form
    if args.experts and args.experts != default:
        lm.set_experts_implementation(args.experts)
    return cudagraph_traces(args, sd)


def run(args: argparse.Namespace) -> list[Path]:
    dev, cfg, lm = _build(args)
    if args.command == "graph":
        return capture_graph(args, lm)
    if args.command != "all":
        return [_capture(args, dev, cfg, lm, args.command, args.experts)]
    paths = []
    for command, experts in ALL:
        t0 = time.perf_counter()
        try:
            paths.append(_capture(args, dev, cfg, lm, command, experts))
        except Exception as e:  # one form failing (e.g. out of memory) must not lose the rest
            log(f"[capture_moe] FAILED {command} {experts}: {type(e).__name__}: {e}")
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        log(f"[capture_moe] {command} {experts}: {time.perf_counter() - t0:.1f} s")
    return paths


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m workloads.capture_moe",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", "-o", default="traces")
    p.add_argument("--model", choices=sorted(MODELS), default="mixtral-8x7b")
    p.add_argument("--tiny", action="store_true", help="small matrices, same experts (CPU)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--experts", choices=EXPERTS, default=None,
                   help="experts_implementation (default: transformers' choice; not with all)")
    p.add_argument("--batch", "-b", type=int, default=None,
                   help="default: prefill 1, decode 4, generate 1")
    p.add_argument("--tokens", "-t", type=int, default=512,
                   help="prefill / generate: prompt tokens T; decode: prompt before the steps")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=None,
                   help="active steps (default: prefill 1, decode 3)")
    p.add_argument("--new-tokens", type=int, default=4, help="generate: max_new_tokens")
    p.add_argument("--cache-len", type=int, default=1024, help="graph: StaticCache slots")
    p.add_argument("--replays", type=int, default=4,
                   help="graph: replays profiled, and steps of the mapping trace")
    p.add_argument("--traces", type=_traces, default=("mapping", "graph"),
                   help="graph: comma-separated, of mapping (eager, graphs off), graph (replays "
                        "only), capture (warm-up + capture + 2 replays in one trace)")
    p.add_argument("--no-cudnn-sdpa", action="store_true",
                   help="graph: disable cuDNN SDPA for the run (if its capture fails)")
    p.add_argument("command", choices=("prefill", "decode", "generate", "graph", "all"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    t0 = time.perf_counter()
    paths = run(args)
    log(f"[capture_moe] {args.command}: {len(paths)} trace(s) in "
        f"{time.perf_counter() - t0:.1f} s")
    for path in paths:
        print(path)
    return 0 if args.command != "all" or len(paths) == len(ALL) else 1


if __name__ == "__main__":
    sys.exit(main())
