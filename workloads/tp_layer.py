"""A vLLM/Megatron-style tensor-parallel shard of the Qwen2 decoder stack of `workloads.layer`.

Rank r of t holds, per layer (n_q, n_kv heads, intermediate I of the model):
- `qkv_proj` column-parallel: its n_q/t query heads and n_kv/t KV heads (fused [q | k | v] rows,
  with their bias), so attention runs on n_q/t heads against n_kv/t cached KV heads;
- `o_proj` row-parallel: the K columns of its heads, output [M, H] summed by an all-reduce;
- `gate_up_proj` column-parallel: rows [r·I/t, (r+1)·I/t) of gate and of up, fused;
- `down_proj` row-parallel: the matching K columns, followed by an all-reduce;
- both RMSNorms and the residual adds in full (every rank holds the whole hidden state).
Weights and the KV cache are slices of one full `DecoderStack` (same seed on every rank), so a
rank's output must equal the full stack's: `check_against_full` measures it.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from workloads.layer import Annotate, DecoderStack, annotator, fuse_weights


class RowParallel(nn.Module):
    """A row-parallel linear: this rank's partial product, then an all-reduce (sum) over the group,
    inside an `all_reduce` range when annotated."""

    def __init__(self, linear: nn.Linear, ann: Annotate, group: dist.ProcessGroup | None = None):
        super().__init__()
        self.linear, self.ann, self.group = linear, ann, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)  # [B, T, H] partial sum
        with self.ann("all_reduce"):
            dist.all_reduce(y, group=self.group)
        return y


def shard_weights(w: dict[str, torch.Tensor], spec, rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slice of one layer's HF-named weights (separate layout) under TP = world."""
    d = spec.head_dim
    q = slice(rank * spec.num_heads // world * d, (rank + 1) * spec.num_heads // world * d)
    kv = slice(rank * spec.num_kv_heads // world * d, (rank + 1) * spec.num_kv_heads // world * d)
    i = slice(rank * spec.intermediate_size // world,
              (rank + 1) * spec.intermediate_size // world)
    rows = {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv,
            "mlp.gate_proj": i, "mlp.up_proj": i}
    cols = {"self_attn.o_proj": q, "mlp.down_proj": i}
    out = {}
    for name, t in w.items():
        module = name.rsplit(".", 1)[0]
        if module in rows:
            out[name] = t[rows[module]].clone()  # weight [N, K] rows, or bias [N]
        elif module in cols:
            out[name] = t[:, cols[module]].clone()  # weight [N, K] columns
        else:
            out[name] = t.clone()  # norms
    return out


def tp_stack(full: DecoderStack, rank: int, world: int, annotate: str,
             group: dist.ProcessGroup | None = None) -> DecoderStack:
    """Rank `rank`'s shard of `full` (fused layout, row-parallel o_proj/down_proj + all-reduce);
    its KV cache (when `full` has one) is the slice of `full`'s cache for its KV heads."""
    spec = full.spec
    for what, n in (("num_heads", spec.num_heads), ("num_kv_heads", spec.num_kv_heads),
                    ("intermediate_size", spec.intermediate_size)):
        if n % world:
            raise ValueError(f"{what} {n} is not divisible by tp {world}")
    shard = dataclasses.replace(spec, num_heads=spec.num_heads // world,
                                num_kv_heads=spec.num_kv_heads // world,
                                intermediate_size=spec.intermediate_size // world)
    p = full.cos
    stack = DecoderStack(shard, len(full.layers), "fused", annotate, full.seed, p.device,
                         full.layers[0].self_attn.o_proj.weight.dtype, p.shape[0])
    ann = annotator(annotate)
    kv = slice(rank * shard.num_kv_heads, (rank + 1) * shard.num_kv_heads)
    for layer, full_layer, w in zip(stack.layers, full.layers, full.weights, strict=True):
        layer.load_state_dict(fuse_weights(shard_weights(w, spec, rank, world)))
        attn, full_attn = layer.self_attn, full_layer.self_attn
        if full_attn.k_cache is not None:
            attn.k_cache = full_attn.k_cache[:, kv].clone()  # [B, n_kv/t, S_max, d]
            attn.v_cache = full_attn.v_cache[:, kv].clone()
        attn.o_proj = RowParallel(attn.o_proj, ann, group)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, ann, group)
    stack.weights = []  # the shard's weights live in the modules; full.weights has the model's
    return stack


@torch.inference_mode()
def check_against_full(full: DecoderStack, tp: DecoderStack, x: torch.Tensor, pos: int) -> float:
    """||tp(x) - full(x)|| / ||full(x)||: the shard plus its all-reduces against the whole stack
    (each writes its own cache slot, so the two runs do not interfere)."""
    ref = full(x, pos).float()
    out = tp(x, pos).float()
    return ((out - ref).norm() / ref.norm()).item()
