"""The GEMM signature table: where each GEMM op's operands sit in its recorded arguments.

One table read by naming (K, N from the Input Dims text), costs (FLOPs and bytes) and graphs
(the calls a replayed kernel stands for). Design notes: docs/design.md ("trace_roofline/model/gemms.py").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Signature:
    """One GEMM op's argument layout.

    activation, weight, bias: argument indices (bias None: the op takes none). weight_nk: the
    weight is stored [N, K] (`linear`) rather than [K, N]. batched: operands carry a leading
    batch dim ([B, M, K] x [B, K, N]). experts: the weight is every expert's, [E, K, N].
    activation_any_rank: the activation may be [.., K] (its leading dims are the tokens M);
    otherwise it is exactly 2-D (3-D when batched). one_weight: each call multiplies one 2-D
    weight (a loop over experts runs one such call per expert).
    """

    activation: int
    weight: int
    bias: int | None = None
    weight_nk: bool = False
    batched: bool = False
    experts: bool = False
    activation_any_rank: bool = False
    one_weight: bool = False


SIGNATURES: dict[str, Signature] = {
    "mm": Signature(0, 1, one_weight=True),
    "addmm": Signature(1, 2, bias=0, one_weight=True),
    "_addmm_activation": Signature(1, 2, bias=0),
    "linear": Signature(0, 1, bias=2, weight_nk=True, activation_any_rank=True, one_weight=True),
    "matmul": Signature(0, 1, activation_any_rank=True, one_weight=True),
    "_scaled_mm": Signature(0, 1, bias=4),
    "bmm": Signature(0, 1, batched=True),
    "baddbmm": Signature(1, 2, bias=0, batched=True),
    "addbmm": Signature(1, 2, bias=0, batched=True),
    # aiter's bf16 GEMM, laid out as linear
    "gemm_a16w16": Signature(0, 1, weight_nk=True),
    # every expert's GEMM over its rows at once: [S, K] x [E, K, N] with per-expert offsets
    "_grouped_mm": Signature(0, 1, experts=True),
}

GEMM_OPS = frozenset(SIGNATURES)
# ops that multiply one 2-D weight per call: an expert loop's GEMMs
ONE_WEIGHT_OPS = frozenset(op for op, s in SIGNATURES.items() if s.one_weight)


def tokens(op: str, dims: list) -> int | None:
    """Tokens M of a 2-D-weight GEMM: the product of its activation's leading dims."""
    sig = SIGNATURES.get(op)
    if sig is None or sig.batched or sig.experts or len(dims) <= sig.activation:
        return None
    x = dims[sig.activation]
    if not (isinstance(x, list) and len(x) >= 2 and all(isinstance(v, int) for v in x)):
        return None
    m = 1
    for v in x[:-1]:
        m *= v
    return m
