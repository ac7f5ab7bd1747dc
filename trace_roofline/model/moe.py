"""Mixture-of-experts cost model: routed-expert FLOPs and bytes, active experts, intensity.

Design notes: docs/design.md ("trace_roofline/model/moe.py").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from trace_roofline.errors import InputError
from trace_roofline.model import formulas

Assumption = Literal["expected", "low", "high"]
ASSUMPTIONS: tuple[str, ...] = ("expected", "low", "high")


@dataclass(frozen=True)
class Experts:
    """The experts of one sparse MLP layer (HF config names in brackets).

    num_experts: routed experts E (`num_local_experts`, `num_experts`; DeepSeek:
        `n_routed_experts`).
    top_k: experts per token k (`num_experts_per_tok`; gpt-oss: `experts_per_token`).
    intermediate_size: I of one routed expert (`moe_intermediate_size`; Mixtral, gpt-oss:
        `intermediate_size`).
    shared_intermediate_size: I of the shared expert every token passes
        (`shared_expert_intermediate_size`; DeepSeek: its `n_shared_experts` experts run as
        one MLP of n_shared_experts·moe_intermediate_size), 0 without one.
    shared_gate: the shared expert's output is scaled by sigmoid(x·w), w of H -> 1 (Qwen2-MoE).
    norm_topk_prob: the top-k routing weights are renormalised to sum to 1.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    shared_intermediate_size: int = 0
    shared_gate: bool = False
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        if self.num_experts < 1 or self.intermediate_size < 1:
            raise InputError(f"experts: num_experts ({self.num_experts}) and intermediate_size "
                             f"({self.intermediate_size}) must be >= 1")
        if not 1 <= self.top_k <= self.num_experts:
            raise InputError(f"experts: top_k must be in [1, num_experts={self.num_experts}], "
                             f"got {self.top_k}")
        if self.shared_intermediate_size < 0:
            raise InputError("experts: shared_intermediate_size must be >= 0, got "
                             f"{self.shared_intermediate_size}")


@dataclass(frozen=True)
class ActiveExperts:
    """Active experts of one layer for `tokens` tokens: the uniform-routing expectation and
    the range [low, high] the true count lies in (all three equal when `exact`)."""

    tokens: int
    expected: float
    low: int
    high: int
    exact: bool = False

    def value(self, assumption: Assumption = "expected") -> float:
        """The count an assumption stands for: expected, low or high."""
        if assumption not in ASSUMPTIONS:
            raise ValueError(f"assumption must be one of {ASSUMPTIONS}, got {assumption!r}")
        return {"expected": self.expected, "low": float(self.low),
                "high": float(self.high)}[assumption]

    def describe(self) -> str:
        """One line naming the assumption and the range it implies."""
        if self.exact:
            return f"{self.low} active experts, counted from the trace's per-expert GEMMs"
        return (f"{self.expected:.2f} active experts expected under uniform routing for "
                f"{self.tokens} tokens (range {self.low}-{self.high})")


def routed_rows(tokens: int, top_k: int) -> int:
    """ΣM_e = tokens·top_k: the rows the routed experts' GEMMs process together."""
    if tokens < 0 or top_k < 1:
        raise ValueError(f"tokens must be >= 0 and top_k >= 1, got {tokens}, {top_k}")
    return tokens * top_k


def expected_active_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """E·(1 - (1 - k/E)^tokens): experts hit at least once under uniform routing."""
    if not 1 <= top_k <= num_experts or tokens < 0:
        raise ValueError(f"need 1 <= top_k <= num_experts and tokens >= 0, got top_k={top_k}, "
                         f"num_experts={num_experts}, tokens={tokens}")
    # -expm1(t·log1p(-k/E)) keeps precision when k/E or the result is small
    if top_k == num_experts:
        return float(num_experts) if tokens > 0 else 0.0
    return -num_experts * math.expm1(tokens * math.log1p(-top_k / num_experts))


def active_experts_range(num_experts: int, top_k: int, tokens: int) -> tuple[int, int]:
    """[min(k, E), min(E, tokens·k)] for tokens >= 1; (0, 0) for no tokens."""
    if tokens <= 0:
        return 0, 0
    return min(top_k, num_experts), min(num_experts, routed_rows(tokens, top_k))


def active_experts(experts: Experts, tokens: int, counted: int | None = None) -> ActiveExperts:
    """Active experts for `tokens` tokens: `counted` (seen in the trace) makes it exact."""
    if counted is not None:
        return ActiveExperts(tokens, float(counted), counted, counted, exact=True)
    low, high = active_experts_range(experts.num_experts, experts.top_k, tokens)
    expected = expected_active_experts(experts.num_experts, experts.top_k, tokens)
    return ActiveExperts(tokens, expected, low, high)


# ----------------------------------------------------------------------------- GEMM costs
def gate_up_flops(rows: int, hidden: int, intermediate: int) -> float:
    """Routed gate and up projections over ΣM_e rows: 2·ΣM_e·H·2I."""
    return 2.0 * rows * hidden * 2 * intermediate


def down_flops(rows: int, hidden: int, intermediate: int) -> float:
    """Routed down projections over ΣM_e rows: 2·ΣM_e·I·H."""
    return 2.0 * rows * intermediate * hidden


def gate_up_bytes(rows: int, hidden: int, intermediate: int, active: float, b: float) -> float:
    """Read ΣM_e·H activations and `active`·2I·H weights, write ΣM_e·2I: all at b bytes."""
    return (rows * hidden + active * 2 * intermediate * hidden + rows * 2 * intermediate) * float(b)


def down_bytes(rows: int, hidden: int, intermediate: int, active: float, b: float) -> float:
    """Read ΣM_e·I activations and `active`·I·H weights, write ΣM_e·H: all at b bytes."""
    return (rows * intermediate + active * intermediate * hidden + rows * hidden) * float(b)


def expert_weight_bytes(active: float, hidden: int, intermediate: int, b: float) -> float:
    """Weights the active routed experts read, each once: `active`·3·H·I·b."""
    return active * 3.0 * hidden * intermediate * b


# ----------------------------------------------------------------------------- intensity
def experts_flops(experts: Experts, hidden: int, tokens: int) -> float:
    """All routed expert GEMMs of one layer: 2·ΣM_e·H·2I + 2·ΣM_e·I·H = 6·ΣM_e·H·I."""
    rows = routed_rows(tokens, experts.top_k)
    i = experts.intermediate_size
    return gate_up_flops(rows, hidden, i) + down_flops(rows, hidden, i)


def experts_bytes(experts: Experts, hidden: int, tokens: int, b: float, active: float) -> float:
    """Minimum bytes of all routed expert GEMMs of one layer with `active` experts read."""
    rows = routed_rows(tokens, experts.top_k)
    i = experts.intermediate_size
    return gate_up_bytes(rows, hidden, i, active, b) + down_bytes(rows, hidden, i, active, b)


def experts_intensity(experts: Experts, hidden: int, tokens: int, b: float,
                      assumption: Assumption = "expected") -> float:
    """FLOP/byte of a layer's routed expert GEMMs, the active count by `assumption`."""
    active = active_experts(experts, tokens).value(assumption)
    return experts_flops(experts, hidden, tokens) / experts_bytes(experts, hidden, tokens, b, active)


def dense_equivalent_intensity(experts: Experts, hidden: int, tokens: int, b: float) -> float:
    """FLOP/byte of a dense SwiGLU MLP with intermediate k·I on the same tokens: the same
    FLOPs per token, its weights read once (gate, up: [T,H]x[H,kI]; down: [T,kI]x[kI,H])."""
    n = experts.top_k * experts.intermediate_size
    flops = 2 * formulas.gemm_flops(tokens, hidden, n) + formulas.gemm_flops(tokens, n, hidden)
    nbytes = 2 * formulas.gemm_bytes(tokens, hidden, n, b) + formulas.gemm_bytes(tokens, n, hidden, b)
    return flops / nbytes


def tokens_per_active_expert(experts: Experts, tokens: int,
                             assumption: Assumption = "expected") -> float:
    """ΣM_e / A: the M of an average active expert's GEMM (NaN without tokens)."""
    active = active_experts(experts, tokens).value(assumption)
    return routed_rows(tokens, experts.top_k) / active if active > 0 else math.nan


def crossing_tokens(experts: Experts, hidden: int, b: float, ridge_intensity: float,
                    assumption: Assumption = "expected") -> int | None:
    """Fewest tokens in flight at which the routed expert GEMMs reach the ridge (I >= I*);
    None when they never do (I -> 6·H·I / ((2H + 3I)·b) as tokens grow).

    Intensity grows with tokens under every assumption (A/tokens never grows), so a bisection
    finds the crossing."""
    def reaches(tokens: int) -> bool:
        return experts_intensity(experts, hidden, tokens, b, assumption) >= ridge_intensity

    return formulas.smallest_int(reaches, hi=1 << 40)
