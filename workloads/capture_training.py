"""Training steps and attention geometries whose figures issue 33 checks, one profiled step each.

Every capture builds its model with random weights on the device (bf16), runs `warmup` steps,
times `iters` steps by CUDA events (no profiler), then records one step under torch.profiler
(CPU + CUDA, record_shapes, a `ProfilerStep#1` range) as `<out>/<name>_<gpu>.json.gz`, with the
model's config as `<out>/<name>.config.json`; `<out>/training_results.json` gets each capture as
soon as it is done (a failing capture is recorded with its error and the others go on).

- `qwen2.5-0.5b-2l_train_{eager,checkpointing,compiled}_b4_t512`: forward, loss, backward and
  AdamW of HF Qwen2ForCausalLM at Qwen2.5-0.5B's widths (2 layers), eager, under activation
  checkpointing (`gradient_checkpointing_enable`, non-reentrant: the forward runs again inside
  backward), and under torch.compile (the model's forward; AdamW eager);
- `mixtral-2l_train_eager_b4_t512`: the same step of HF Mixtral at Mixtral-8x7B's widths
  (8 experts, top-2), 2 layers;
- `deepseek-v2-lite-2l_prefill_b1_t1024`, `deepseek-v2-lite-2l_decode_b8_s1024`: HF DeepSeek-V2
  (MLA: d_qk 192 = 128 nope + 64 rope, d_v 128; layer 0 dense, layer 1 MoE) at V2-Lite's widths;
  the decode step attends to a 1024-token prompt's cache (plus itself);
- `vit-l-4l_eager_b8_i224`: HF ViTModel at ViT-L/16 widths, 4 layers, 8 images of 224x224
  (197 tokens), eager attention (bmm, softmax, bmm; no mask);
- `flex-attention-2l_prefill_b1_t512`: two attention layers at Qwen2.5-7B's widths (q/k/v/o
  linears, 28 heads, 4 kv heads, d 128) around compiled `flex_attention` with a causal block mask.

    python -m workloads.capture_training --out DIR [--only NAME,...]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from trace_roofline.model.models import get_model
from workloads.capture_common import (
    DTYPES,
    device_tag,
    log,
    random_lm,
    resolve_device,
    versions,
)
from workloads.capture_families import _step as family_step
from workloads.capture_families import build as build_family
from workloads.capture_misleading import _hf as hf_model
from workloads.capture_step_sweep import (
    HFModel,
    Step,
    decode_step,
    measure,
    prefill_step,
    release,
)
from workloads.hf_capture import qwen2_config

BATCH, TOKENS = 4, 512  # training steps: sequences x tokens
# a capture: (device, dtype) -> (the step, the model's config as a dict, what ran)
Built = tuple[Step, dict[str, Any], str]


def _config(model: HFModel) -> dict[str, Any]:
    return json.loads(model.config.to_json_string(use_diff=False))


def dense_train(mode: str) -> Callable[[torch.device, torch.dtype], Built]:
    """Qwen2.5-0.5B widths, 2 layers: one training step in `mode` (eager, checkpointing,
    compiled)."""
    def make(dev: torch.device, dtype: torch.dtype) -> Built:
        lm: HFModel = random_lm(qwen2_config(get_model("qwen2.5-0.5b"), 2, dtype), dtype,
                                dev).train()
        if mode == "checkpointing":
            lm.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        if mode == "compiled":
            torch._dynamo.reset()
            lm.forward = torch.compile(lm.forward)  # type: ignore[method-assign]
        return (family_step(lm, "train", BATCH, TOKENS, dev), _config(lm),
                f"Qwen2.5-0.5B widths, 2 layers, train step ({mode}) B={BATCH} T={TOKENS}: "
                "forward, loss, backward, AdamW")
    return make


def mixtral_train(dev: torch.device, dtype: torch.dtype) -> Built:
    lm = build_family("mixtral", 2, dev, dtype).train()
    return (family_step(lm, "train", BATCH, TOKENS, dev), _config(lm),
            f"Mixtral-8x7B widths (8 experts, top-2), 2 layers, train step (eager) B={BATCH} "
            f"T={TOKENS}: forward, loss, backward, AdamW")


def mla(phase: str, batch: int, tokens: int) -> Callable[[torch.device, torch.dtype], Built]:
    """DeepSeek-V2-Lite widths, 2 layers: a prefill of batch x tokens, or a decode step over a
    `tokens`-token prompt's cache."""
    def make(dev: torch.device, dtype: torch.dtype) -> Built:
        lm = build_family("deepseek_v2", 2, dev, dtype).eval()
        step = (decode_step(lm, batch, tokens, prompt=True) if phase == "decode"
                else prefill_step(lm, batch, tokens))
        shape = f"S={tokens} (+1)" if phase == "decode" else f"T={tokens}"
        return (step, _config(lm), f"DeepSeek-V2-Lite widths (MLA d_qk 192, d_v 128), 2 layers, "
                f"{phase} B={batch} {shape}")
    return make


def vit(dev: torch.device, dtype: torch.dtype) -> Built:
    fields = dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16,
                  num_hidden_layers=4, image_size=224, patch_size=16,
                  attn_implementation="eager")
    model, _ = hf_model("vit", fields, "ViTModel")
    model = model.to(device=dev, dtype=dtype)
    pixels = torch.randn(8, 3, 224, 224, device=dev, dtype=dtype)
    step = torch.inference_mode()(lambda: model(pixel_values=pixels).last_hidden_state)
    return (step, _config(model),
            "ViTModel at ViT-L/16 widths, 4 layers, eager attention, B=8 224x224 (197 tokens)")


class FlexAttentionStack(nn.Module):
    """`layers` residual attention layers: q/k/v (bias) and o linears around flex_attention
    (grouped-query: `heads` query heads over `kv_heads` key/value heads)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 layers: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.layers = nn.ModuleList(nn.ModuleDict({
            "q_proj": nn.Linear(hidden, heads * head_dim),
            "k_proj": nn.Linear(hidden, kv_heads * head_dim),
            "v_proj": nn.Linear(hidden, kv_heads * head_dim),
            "o_proj": nn.Linear(heads * head_dim, hidden, bias=False)}) for _ in range(layers))
        from torch.nn.attention.flex_attention import flex_attention

        self.attend = torch.compile(flex_attention)

    def forward(self, x: torch.Tensor, block_mask: Any) -> torch.Tensor:
        b, t, _ = x.shape
        for layer in cast(list[nn.ModuleDict], self.layers):
            q, k, v = (layer[n](x).view(b, t, -1, self.head_dim).transpose(1, 2)
                       for n in ("q_proj", "k_proj", "v_proj"))
            o = self.attend(q, k, v, block_mask=block_mask, enable_gqa=True)
            x = x + layer["o_proj"](o.transpose(1, 2).reshape(b, t, -1))
        return x


def flex(dev: torch.device, dtype: torch.dtype) -> Built:
    from torch.nn.attention.flex_attention import create_block_mask

    spec = get_model("qwen2.5-7b")
    cfg = dict(hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
               num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim, layers=2,
               batch=1, tokens=TOKENS, mask="causal", attention="flex_attention (compiled)")
    torch.manual_seed(0)
    with torch.device(dev):
        model = FlexAttentionStack(spec.hidden_size, spec.num_heads, spec.num_kv_heads,
                                   spec.head_dim, 2).to(dtype=dtype).eval()
        x = torch.randn(1, TOKENS, spec.hidden_size, dtype=dtype)
    mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, TOKENS, TOKENS,
                             device=str(dev))
    step = torch.inference_mode()(lambda: model(x, mask))
    return (step, cfg, f"2 attention layers at Qwen2.5-7B widths around compiled flex_attention, "
            f"causal block mask, B=1 T={TOKENS}")


# name -> (builder, warm-up steps, timed steps)
CAPTURES: dict[str, tuple[Callable[[torch.device, torch.dtype], Built], int, int]] = {
    f"qwen2.5-0.5b-2l_train_eager_b{BATCH}_t{TOKENS}": (dense_train("eager"), 2, 8),
    f"qwen2.5-0.5b-2l_train_checkpointing_b{BATCH}_t{TOKENS}": (dense_train("checkpointing"),
                                                                 2, 8),
    f"mixtral-2l_train_eager_b{BATCH}_t{TOKENS}": (mixtral_train, 2, 8),
    "deepseek-v2-lite-2l_prefill_b1_t1024": (mla("prefill", 1, 1024), 2, 10),
    "deepseek-v2-lite-2l_decode_b8_s1024": (mla("decode", 8, 1024), 2, 10),
    "vit-l-4l_eager_b8_i224": (vit, 2, 10),
    f"flex-attention-2l_prefill_b1_t{TOKENS}": (flex, 3, 10),
    f"qwen2.5-0.5b-2l_train_compiled_b{BATCH}_t{TOKENS}": (dense_train("compiled"), 3, 8),
}


def capture(name: str, out: Path, dev: torch.device, dtype: str) -> dict[str, Any]:
    """Build, time and profile capture `name`; its trace and config under `out`."""
    make, warmup, iters = CAPTURES[name]
    row: dict[str, Any] = {"name": name, "trace": f"{name}_{device_tag(dev)}.json.gz",
                           "config": f"{name}.config.json"}
    t0 = time.perf_counter()
    try:
        step, cfg, what = make(dev, DTYPES[dtype])
        row["what"] = what
        (out / row["config"]).write_text(json.dumps(cfg, indent=1, sort_keys=True) + "\n")
        row.update(measure(step, out / row["trace"], dev,
                           {"kind": "training_capture", "name": name, "what": what,
                            "dtype": dtype}, warmup, iters))
        del step
    except Exception as e:  # one failing capture must not cost the others (recorded)
        row["error"] = f"{type(e).__name__}: {e}"
        log(f"[training] FAILED {name}: {row['error']}")
    finally:
        gc.collect()
        release(dev, row)
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("traces/training"))
    ap.add_argument("--only", default=",".join(CAPTURES), help="captures, comma separated")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    a = ap.parse_args(argv)
    dev = resolve_device(a.device)
    a.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"dtype": a.dtype, **versions(dev), "captures": []}
    for name in a.only.split(","):
        results["captures"].append(capture(name, a.out, dev, a.dtype))
        (a.out / "training_results.json").write_text(json.dumps(results, indent=1) + "\n")
    return 1 if any("error" in c for c in results["captures"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
