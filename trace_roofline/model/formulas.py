"""Analytical cost model: FLOPs and minimum DRAM bytes from shapes, and roofline helpers.

Design notes: docs/design.md ("trace_roofline/model/formulas.py").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Causal = Literal["full", "causal"]
AttentionBytes = Literal["kv", "all"]
CAUSAL_CONVENTIONS: tuple[str, ...] = ("full", "causal")
ATTENTION_BYTES_CONVENTIONS: tuple[str, ...] = ("kv", "all")


def gemm_flops(m: int, k: int, n: int, bias: bool = False) -> float:
    """Y[M,N] = X[M,K] @ W[K,N] (+ b[N]): 2·M·K·N, plus M·N adds when a bias is fused."""
    return 2.0 * m * k * n + (m * n if bias else 0)


def gemm_bytes(m: int, k: int, n: int, b: float, bias: bool = False) -> float:
    """Read X (M·K) and W (K·N), write Y (M·N); a bias adds N reads. All at b bytes/element."""
    return (m * k + k * n + m * n + (n if bias else 0)) * float(b)


def gemm_intensity(m: int, k: int, n: int, b: float, bias: bool = False) -> float:
    """FLOP/byte of a GEMM: ≈ 2/b at M = 1, ≈ 2M/b while M ≪ N."""
    return gemm_flops(m, k, n, bias) / gemm_bytes(m, k, n, b, bias)


def attention_pairs(t: int, s: int, causal: Causal = "causal") -> float:
    """Query-key pairs one head scores: T queries against S keys.

    `full`: every query sees every key (T·S), as the lesson counts.
    `causal`: query i (0-based, last query aligned with the last key) sees S - T + i + 1 keys,
    so pairs = T·(S - T) + T·(T + 1)/2; decode (T = 1) gives S either way.
    """
    if causal == "full":
        return float(t) * s
    if causal == "causal":
        return float(t) * (s - t) + t * (t + 1) / 2.0
    raise ValueError(f"causal must be one of {CAUSAL_CONVENTIONS}, got {causal!r}")


@dataclass(frozen=True)
class AttentionShape:
    """One attention call: `batch` sequences of T queries (n_q heads) against S keys (n_kv
    heads), q/k heads of d and v heads of d_v (None: d), its pairs counted `causal`."""

    n_q: int
    n_kv: int
    t: int
    s: int
    d: int
    d_v: int | None = None
    batch: int = 1
    causal: Causal = "causal"

    @property
    def dv(self) -> int:
        return self.d if self.d_v is None else self.d_v


def attention_flops(a: AttentionShape) -> float:
    """QKᵀ (2·d per pair) plus P·V (2·d_v per pair) for every query head:
    2·B·n_q·pairs·(d + d_v), 4·B·n_q·d·pairs when d_v = d (None). MLA (DeepSeek-V2/V3) has
    d = 192 (nope + rope) and d_v = 128.

    GQA does not change FLOPs: each query head still scores its own keys. Softmax is ignored.
    """
    return 2.0 * a.batch * a.n_q * (a.d + a.dv) * attention_pairs(a.t, a.s, a.causal)


def attention_bytes(a: AttentionShape, b: float, convention: AttentionBytes = "all") -> float:
    """Minimum DRAM bytes of a fused (flash-style) attention with GQA; K of d and V of d_v
    (None: d) per head.

    `kv`: only K and V are read, B·n_kv·S·(d + d_v)·b (the lesson's count);
    `all`: Q read and O written as well, + B·n_q·T·(d + d_v)·b. Scores stay on chip in both.
    """
    kv = 1.0 * a.batch * a.n_kv * a.s * (a.d + a.dv) * b
    if convention == "kv":
        return kv
    if convention == "all":
        return kv + 1.0 * a.batch * a.n_q * a.t * (a.d + a.dv) * b
    raise ValueError(f"convention must be one of {ATTENTION_BYTES_CONVENTIONS}, got {convention!r}")


# FlashAttention-2 (Dao 2023, sec. 3.1): the backward pass recomputes QKᵀ and runs dV = PᵀdO,
# dP = dO·Vᵀ, dQ = dS·K, dK = dSᵀ·Q: five matmuls of the forward's size to its two.
ATTENTION_BACKWARD_FLOPS_RATIO = 2.5


def attention_backward_flops(a: AttentionShape) -> float:
    """The backward of `attention_flops`: 2.5x the forward (ATTENTION_BACKWARD_FLOPS_RATIO)."""
    return ATTENTION_BACKWARD_FLOPS_RATIO * attention_flops(a)


def attention_backward_bytes(a: AttentionShape, b: float) -> float:
    """Minimum DRAM bytes of a fused attention backward: Q, O, dO read and dQ written
    (2·B·n_q·T·(d + d_v)), K and V read and dK, dV written (2·B·n_kv·S·(d + d_v)), b bytes
    each; d_v None: d."""
    return b * (2.0 * a.batch * a.n_q * a.t * (a.d + a.dv)
                + 2.0 * a.batch * a.n_kv * a.s * (a.d + a.dv))


def attention_intensity(a: AttentionShape, b: float, convention: AttentionBytes = "all") -> float:
    """Decode (T = 1, kv bytes): (2/b)·(n_q/n_kv), S cancels. Prefill T = S, full, kv: (2/b)·(n_q/n_kv)·S."""
    return attention_flops(a) / attention_bytes(a, b, convention)


def elementwise_bytes(elements_in: float, elements_out: float, b: float) -> float:
    """Elementwise ops, norms, RoPE, residual adds, copies: inputs read once + outputs written once."""
    return (elements_in + elements_out) * float(b)


def ridge(peak_flops: float, bandwidth: float) -> float:
    """I* = P / B_mem: below it a kernel is memory-bound."""
    return peak_flops / bandwidth


def attainable(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """Roofline: min(P, I·B_mem)."""
    return min(peak_flops, intensity * bandwidth)


def bound(intensity: float, ridge_intensity: float) -> str:
    """'memory' when I < I*, else 'compute'."""
    return "memory" if intensity < ridge_intensity else "compute"


def smallest_int(pred: Callable[[int], bool], hi: int = 1 << 40) -> int | None:
    """Smallest n ≥ 1 with pred(n), for a pred that is monotone in n; None if none up to hi."""
    if not pred(hi):
        return None
    lo = 1
    while lo < hi:
        mid = (lo + hi) // 2
        if pred(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def m_star(k: int, n: int, b: float, ridge_intensity: float, bias: bool = False) -> int | None:
    """Smallest M at which a [M,K]x[K,N] GEMM is compute-bound (I ≥ I*); ≈ I*·b/2 while M ≪ N.

    None when the GEMM can never reach the ridge (I → 2KN/((K+N)·b) as M → ∞).
    """
    return smallest_int(lambda m: gemm_intensity(m, k, n, b, bias) >= ridge_intensity)


def s_star(heads: AttentionShape, b: float, ridge_intensity: float,
           convention: AttentionBytes = "all") -> int | None:
    """Smallest prefill length S (T = S) at which attention of `heads` (its n_q, n_kv, d, d_v,
    batch and causal; its own T and S unused) is compute-bound."""
    def compute_bound(s: int) -> bool:
        prefill = dataclasses.replace(heads, t=s, s=s)
        return attention_intensity(prefill, b, convention) >= ridge_intensity

    return smallest_int(compute_bound, hi=1 << 30)
