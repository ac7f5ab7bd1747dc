"""A Qwen2 decoder layer with the exact HF architecture, random seeded weights and a static KV cache.

Architecture as HF transformers' `Qwen2DecoderLayer` (modeling_qwen2.py):
  x = x + o_proj(attention(rope(q_proj(rms(x))), rope(k_proj(.)), v_proj(.)))
  x = x + down_proj(silu(gate_proj(rms(x))) * up_proj(rms(x)))
RMSNorm computes in float32 and casts back before the weight multiply; RoPE uses rotate_half with
cos/sin cast to the model dtype; q/k/v projections carry a bias (spec.qkv_bias).

GQA goes through `F.scaled_dot_product_attention(..., enable_gqa=True)`: that is what HF's sdpa
path does whenever no attention mask is passed (transformers `use_gqa_in_sdpa`), which is our case
(decode attends to every cached key, prefill is plainly causal). It computes the same function as
`repeat_kv` without materialising 7x copies of K and V, so no repeat copies sit in the attention
range (on the H200 with torch 2.11 SDPA dispatches this to cuDNN's flash attention kernels).

Every operator runs inside an annotation range with its canonical name (see OPERATORS); the
annotation can be a `record_function` range, an NVTX range (for Nsight Compute) or nothing
(unannotated attribution fixtures).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from trace_roofline.model.models import ModelSpec

# Canonical operator names, in execution order, for each layout.
OPERATORS = {
    "separate": ["input_norm", "q_proj", "k_proj", "v_proj", "rope", "kv_cache", "attention",
                 "o_proj", "residual", "post_attention_norm", "gate_proj", "up_proj", "act",
                 "down_proj"],
    "fused": ["input_norm", "qkv_proj", "rope", "kv_cache", "attention", "o_proj", "residual",
              "post_attention_norm", "gate_up_proj", "act", "down_proj"],
}
LAYOUTS = tuple(OPERATORS)
ANNOTATIONS = ("record_function", "nvtx", "none")

Annotate = Callable[[str], contextlib.AbstractContextManager]


def annotator(mode: str) -> Annotate:
    """Context-manager factory for operator ranges: record_function, NVTX, or none."""
    if mode == "record_function":
        return torch.profiler.record_function
    if mode == "nvtx":
        return _nvtx_range
    if mode == "none":
        return lambda name: contextlib.nullcontext()
    raise ValueError(f"annotate must be one of {ANNOTATIONS}, got {mode!r}")


@contextlib.contextmanager
def _nvtx_range(name: str) -> Iterator[None]:
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


def init_weights(spec: ModelSpec, seed: int, device: torch.device | str,
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random HF-named weights of one layer (same names as Qwen2DecoderLayer's state_dict).

    Linear weights ~ N(0, 0.02) (HF initializer_range); biases ~ N(0, 0.02); norm weights
    1 + N(0, 0.1) so a skipped weight multiply cannot go unnoticed. Drawn in float32 on `device`
    from a seeded generator, then cast.
    """
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, std: float) -> torch.Tensor:
        t = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * std
        return t.to(dtype)

    w: dict[str, torch.Tensor] = {}
    for name, (k, n, bias) in spec.linears().items():
        prefix = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        w[f"{prefix}.{name}.weight"] = randn(n, k, std=0.02)  # nn.Linear layout [N, K]
        if bias:
            w[f"{prefix}.{name}.bias"] = randn(n, std=0.02)
    for norm in ("input_layernorm", "post_attention_layernorm"):
        w[f"{norm}.weight"] = 1.0 + randn(spec.hidden_size, std=0.1)
    return w


def fuse_weights(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same weights in the fused serving layout (qkv_proj, gate_up_proj), vLLM-style."""
    out = {k: v for k, v in w.items()
           if not any(p in k for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))}
    qkv = [f"self_attn.{p}_proj" for p in "qkv"]
    out["self_attn.qkv_proj.weight"] = torch.cat([w[f"{p}.weight"] for p in qkv])  # [q+2kv, H]
    if f"{qkv[0]}.bias" in w:
        out["self_attn.qkv_proj.bias"] = torch.cat([w[f"{p}.bias"] for p in qkv])
    out["mlp.gate_up_proj.weight"] = torch.cat(
        [w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]])  # [2I, H]
    return out


def rope_tables(spec: ModelSpec, positions: int, device: torch.device | str,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [positions, d] as HF Qwen2RotaryEmbedding (float32 math, cast to dtype)."""
    d = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32,
                                                       device=device) / d))  # [d/2]
    t = torch.arange(positions, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)  # [P, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, d]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RMSNorm(nn.Module):
    """Qwen2RMSNorm: normalise in float32, cast back, then multiply by the weight."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        var = h.pow(2).mean(-1, keepdim=True)  # [B, T, 1]
        h = h * torch.rsqrt(var + self.eps)
        return self.weight * h.to(dtype)


class Attention(nn.Module):
    """Qwen2Attention with a preallocated KV cache [B, n_kv, S_max, d]."""

    def __init__(self, spec: ModelSpec, layout: str, annotate: Annotate) -> None:
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.spec, self.layout, self.ann = spec, layout, annotate
        self.scaling = d ** -0.5
        if layout == "fused":
            self.qkv_proj = nn.Linear(h, spec.q_size + 2 * spec.kv_size, bias=spec.qkv_bias)
        else:
            self.q_proj = nn.Linear(h, spec.q_size, bias=spec.qkv_bias)
            self.k_proj = nn.Linear(h, spec.kv_size, bias=spec.qkv_bias)
            self.v_proj = nn.Linear(h, spec.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(spec.q_size, h, bias=False)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def allocate_cache(self, batch: int, max_len: int, fill: torch.Generator | None) -> None:
        """Static cache; with `fill`, random contents stand in for earlier tokens."""
        p = self.o_proj.weight
        shape = (batch, self.spec.num_kv_heads, max_len, self.spec.head_dim)
        self.k_cache, self.v_cache = (
            torch.randn(shape, generator=fill, device=p.device, dtype=torch.float32).to(p.dtype)
            if fill is not None else torch.zeros(shape, device=p.device, dtype=p.dtype)
            for _ in range(2))

    def forward(self, x: torch.Tensor, pos: int, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        """x: [B, T, H] for tokens at positions pos..pos+T-1. Decode: T=1 attends to pos+1 keys.
        Prefill: pos=0, causal over the T new tokens."""
        ann, s = self.ann, self.spec
        B, T, _ = x.shape
        d, nq, nkv = s.head_dim, s.num_heads, s.num_kv_heads
        if self.layout == "fused":
            with ann("qkv_proj"):
                qkv = self.qkv_proj(x)  # [B, T, q + 2kv]
            q, k, v = qkv.split([s.q_size, s.kv_size, s.kv_size], dim=-1)
        else:
            with ann("q_proj"):
                q = self.q_proj(x)  # [B, T, nq*d]
            with ann("k_proj"):
                k = self.k_proj(x)  # [B, T, nkv*d]
            with ann("v_proj"):
                v = self.v_proj(x)  # [B, T, nkv*d]
        q = q.view(B, T, nq, d).transpose(1, 2)  # [B, nq, T, d]
        k = k.view(B, T, nkv, d).transpose(1, 2)  # [B, nkv, T, d]
        v = v.view(B, T, nkv, d).transpose(1, 2)  # [B, nkv, T, d]
        with ann("rope"):
            c, sn = cos[pos:pos + T], sin[pos:pos + T]  # [T, d], broadcast over B, heads
            q = q * c + rotate_half(q) * sn
            k = k * c + rotate_half(k) * sn
        with ann("kv_cache"):
            self.k_cache[:, :, pos:pos + T].copy_(k)  # cache [B, nkv, S_max, d]
            self.v_cache[:, :, pos:pos + T].copy_(v)
        if T == 1:
            keys = self.k_cache[:, :, :pos + 1]  # [B, nkv, S, d], S = pos+1
            values = self.v_cache[:, :, :pos + 1]
            causal = False
        elif pos == 0:
            keys, values, causal = k, v, True
        else:
            raise ValueError("chunked prefill (T > 1 at pos > 0) is not supported")
        with ann("attention"):
            o = F.scaled_dot_product_attention(q, keys, values, is_causal=causal,
                                               scale=self.scaling, enable_gqa=True)  # [B,nq,T,d]
        o = o.transpose(1, 2).reshape(B, T, nq * d)  # [B, T, nq*d]
        with ann("o_proj"):
            return self.o_proj(o)  # [B, T, H]


class MLP(nn.Module):
    """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x))."""

    def __init__(self, spec: ModelSpec, layout: str, annotate: Annotate) -> None:
        super().__init__()
        h, i = spec.hidden_size, spec.intermediate_size
        self.layout, self.ann, self.i = layout, annotate, i
        if layout == "fused":
            self.gate_up_proj = nn.Linear(h, 2 * i, bias=False)
        else:
            self.gate_proj = nn.Linear(h, i, bias=False)
            self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ann = self.ann
        if self.layout == "fused":
            with ann("gate_up_proj"):
                gate_up = self.gate_up_proj(x)  # [B, T, 2I]
            gate, up = gate_up.split(self.i, dim=-1)  # [B, T, I] each
        else:
            with ann("gate_proj"):
                gate = self.gate_proj(x)  # [B, T, I]
            with ann("up_proj"):
                up = self.up_proj(x)  # [B, T, I]
        with ann("act"):
            h = F.silu(gate) * up
        with ann("down_proj"):
            return self.down_proj(h)  # [B, T, H]


class DecoderLayer(nn.Module):
    """Qwen2DecoderLayer: pre-norm attention and MLP blocks, each with a residual add."""

    def __init__(self, spec: ModelSpec, layout: str = "separate",
                 annotate: str = "record_function") -> None:
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        ann = annotator(annotate)
        self.spec, self.layout, self.ann = spec, layout, ann
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layout, ann)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec, layout, ann)

    def forward(self, x: torch.Tensor, pos: int, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        ann = self.ann
        with ann("input_norm"):
            h = self.input_layernorm(x)
        h = self.self_attn(h, pos, cos, sin)
        with ann("residual"):
            x = x + h
        with ann("post_attention_norm"):
            h = self.post_attention_layernorm(x)
        h = self.mlp(h)
        with ann("residual"):
            return x + h


class DecoderStack(nn.Module):
    """`num_layers` decoder layers sharing RoPE tables; layer i runs in a `layers.{i}` range."""

    def __init__(self, spec: ModelSpec, num_layers: int = 1, layout: str = "separate",
                 annotate: str = "record_function", seed: int = 0,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
                 max_positions: int = 4096) -> None:
        super().__init__()
        self.spec, self.layout, self.seed = spec, layout, seed
        self.ann = annotator(annotate)
        self.layers = nn.ModuleList()
        self.weights: list[dict[str, torch.Tensor]] = []  # HF-named, separate layout
        for i in range(num_layers):
            layer = DecoderLayer(spec, layout, annotate).to(device=device, dtype=dtype)
            w = init_weights(spec, seed + i, device, dtype)
            layer.load_state_dict(fuse_weights(w) if layout == "fused" else w)
            self.layers.append(layer)
            self.weights.append(w)
        cos, sin = rope_tables(spec, max_positions, device, dtype)
        self.register_buffer("cos", cos, persistent=False)  # [P, d]
        self.register_buffer("sin", sin, persistent=False)

    def allocate_cache(self, batch: int, max_len: int, random_fill: bool = True) -> None:
        if max_len > self.cos.shape[0]:
            raise ValueError(f"cache of {max_len} exceeds max_positions {self.cos.shape[0]}")
        dev = self.cos.device
        gen = torch.Generator(device=dev).manual_seed(self.seed + 1000) if random_fill else None
        for layer in self.layers:
            layer.self_attn.allocate_cache(batch, max_len, gen)

    def forward(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            with self.ann(f"layers.{i}"):
                x = layer(x, pos, self.cos, self.sin)
        return x


def max_positions_for(context: int) -> int:
    """RoPE table length: the context rounded up to a multiple of 256."""
    return max(256, math.ceil(context / 256) * 256)
