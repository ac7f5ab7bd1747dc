"""Capture a CPU training step of a tiny Qwen2-shaped model (qwen-tiny's shapes) under torch.profiler.

    python sample_traces/training/make_training_trace.py sample_traces/training

HF transformers' Qwen2ForCausalLM with the `qwen-tiny` preset's config (hidden 256, 8 query heads,
2 KV heads, intermediate 768, 2 layers, vocab 1024, fp32, SDPA attention), random weights (no
download), batch 2 x 32 tokens. One warm-up step, then 2 profiled steps, each in a `ProfilerStep#N` record_function range:
forward, cross-entropy loss, backward (on CPU autograd runs on the calling thread, (the autograd thread's
under `autograd::engine::evaluate_function: XBackward0` frames), AdamW step (`Optimizer.step#AdamW.step`,
foreach implementation), zero_grad. record_shapes=True, no stack.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import Qwen2Config, Qwen2ForCausalLM


def main(out: Path) -> Path:
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                      intermediate_size=768, num_hidden_layers=2, vocab_size=1024,
                      max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1e6,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    model = Qwen2ForCausalLM(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 32))

    def step() -> None:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: AdamW's state is created here
    path = out / "qwen-tiny_train_b2_t32_l2_adamw_cpu.json.gz"
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for i in range(2):
            with record_function(f"ProfilerStep#{i + 1}"):
                step()
    prof.export_chrome_trace(str(path))
    return path


if __name__ == "__main__":
    print(main(Path(sys.argv[1] if len(sys.argv) > 1 else ".")))
