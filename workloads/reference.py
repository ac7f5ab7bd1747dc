"""An independent float32 computation of one Qwen2 decoder layer, for correctness checks.

Written from the math, not from layer.py: explicit GQA head repetition, explicit softmax with a
position-based causal mask, RoPE recomputed from theta. Inputs are upcast copies of the layer's
own weights and cache, so any difference is the dtype's rounding, or a bug.
"""

from __future__ import annotations

import torch

from trace_roofline.model.models import ModelSpec

# Accepted ||out - ref|| / ||ref|| per dtype of the layer under test (float32 reference).
# float32 (TF32 off) lands orders of magnitude below 1e-4; bf16's 8-bit mantissa, rounded at
# every op of a full layer, lands near 1e-2; fp16 (11 bits) about 8x lower.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2.5e-2, torch.float16: 4e-3}


def reference_layer(spec: ModelSpec, w: dict[str, torch.Tensor], x: torch.Tensor,
                    past_k: torch.Tensor, past_v: torch.Tensor,
                    pos: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """out [B,T,H], k [B,n_kv,T,d], v [B,n_kv,T,d] for tokens at positions pos..pos+T-1.

    past_k, past_v: [B, n_kv, pos, d] cache contents of the earlier positions.
    """
    f = {k: t.float() for k, t in w.items()}
    x = x.float()
    B, T, H = x.shape
    nq, nkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim

    def rms(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * h / torch.sqrt((h * h).mean(-1, keepdim=True) + spec.rms_norm_eps)

    def linear(h: torch.Tensor, name: str) -> torch.Tensor:
        y = h @ f[f"{name}.weight"].T
        return y + f[f"{name}.bias"] if f"{name}.bias" in f else y

    h = rms(x, f["input_layernorm.weight"])
    q = linear(h, "self_attn.q_proj").reshape(B, T, nq, d).permute(0, 2, 1, 3)  # [B,nq,T,d]
    k = linear(h, "self_attn.k_proj").reshape(B, T, nkv, d).permute(0, 2, 1, 3)  # [B,nkv,T,d]
    v = linear(h, "self_attn.v_proj").reshape(B, T, nkv, d).permute(0, 2, 1, 3)

    # RoPE, rotate-half convention: pair dim j with j + d/2 at angle p * theta^(-2j/d).
    j = torch.arange(d // 2, dtype=torch.float64, device=x.device)
    p = torch.arange(pos, pos + T, dtype=torch.float64, device=x.device)
    ang = p[:, None] * spec.rope_theta ** (-2.0 * j / d)  # [T, d/2]
    cos, sin = ang.cos().float(), ang.sin().float()

    def rope(t: torch.Tensor) -> torch.Tensor:
        a, b = t[..., : d // 2], t[..., d // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    q, k = rope(q), rope(k)
    keys = torch.cat([past_k.float(), k], dim=2)  # [B, nkv, S, d], S = pos + T
    values = torch.cat([past_v.float(), v], dim=2)
    group = nq // nkv
    keys = keys.repeat_interleave(group, dim=1)  # [B, nq, S, d]: query head i uses kv head i//g
    values = values.repeat_interleave(group, dim=1)
    scores = q @ keys.transpose(-1, -2) / d ** 0.5  # [B, nq, T, S]
    S = keys.shape[2]
    q_pos = torch.arange(pos, pos + T, device=x.device)[:, None]
    k_pos = torch.arange(S, device=x.device)[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    o = torch.softmax(scores, dim=-1) @ values  # [B, nq, T, d]
    o = o.permute(0, 2, 1, 3).reshape(B, T, nq * d)
    x = x + linear(o, "self_attn.o_proj")
    h = rms(x, f["post_attention_layernorm.weight"])
    g, u = linear(h, "mlp.gate_proj"), linear(h, "mlp.up_proj")
    out = x + linear(g * torch.sigmoid(g) * u, "mlp.down_proj")
    return out, k, v


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float32 (NaN anywhere gives NaN, which never passes)."""
    out, ref = out.float(), ref.float()
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))
