"""Argument layouts of the attention ops whose shapes the trace records (one place for naming and costing)."""

from __future__ import annotations

from dataclasses import dataclass

from trace_roofline.model import gemms

# Attention ops with a known argument layout: name -> (Q/K/V layout, index of is_causal in
# Concrete Inputs). BHTD: [B, heads, T, d] (SDPA front ends); BTHD: [B, T, heads, d]
# (flash/efficient kernels). flash-attention's packed / paged forwards are `VARLEN_LAYOUTS`.
# Every other op the vocabulary recognises as attention (flex_attention, paged and unified
# attention) is uncosted: its mask or sequence lengths are not among its recorded arguments.
ATTENTION_LAYOUTS: dict[str, tuple[str, int]] = {
    "aten::scaled_dot_product_attention": ("BHTD", 5),
    "aten::_scaled_dot_product_attention_math": ("BHTD", 5),
    "aten::_scaled_dot_product_flash_attention": ("BHTD", 4),
    "aten::_scaled_dot_product_flash_attention_for_cpu": ("BHTD", 4),
    "aten::_scaled_dot_product_efficient_attention": ("BHTD", 6),
    "aten::_scaled_dot_product_cudnn_attention": ("BHTD", 6),
    "aten::_cudnn_attention_forward": ("BHTD", 10),
    "aten::_flash_attention_forward": ("BTHD", 8),
    "aten::_efficient_attention_forward": ("BTHD", 9),  # custom_mask_type: 0 none, 1/2 causal
    "flash_attn::_flash_attn_forward": ("BTHD", 5),
}
# SDPA's backward ops (grad_out, query, key, value, ... all BHTD): is_causal's index.
ATTENTION_BACKWARD_CAUSAL_AT: dict[str, int] = {
    "aten::_scaled_dot_product_flash_attention_backward": 11,
    "aten::_scaled_dot_product_efficient_attention_backward": 11,
    "aten::_scaled_dot_product_cudnn_attention_backward": 14,
    "aten::_cudnn_attention_backward": 14,
}
# The matmuls of an eager attention (QKᵀ, then P·V), as their ops are named
EAGER_ATTENTION_GEMMS = frozenset({"aten::bmm", "aten::baddbmm", "aten::matmul"})


@dataclass(frozen=True)
class Varlen:
    """Argument indices of a flash-attention forward over packed ([total, heads, d] with
    cu_seqlens) or paged ([pages, page_size, heads, d] with a page table) sequences."""

    cu_seqlens_q: int
    seqused_k: int
    max_seqlen_q: int
    max_seqlen_k: int
    page_table: int
    causal_from: int  # is_causal: the first True/False in Concrete Inputs from this index


# FA3's `fwd(q, k, v, k_new, v_new, q_v, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new,
# seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, page_table, ..., softmax_scale, is_causal,
# ...)` (vllm-project/flash-attention hopper/flash_api_torch_lib.cpp, sgl-kernel
# flash_extension.cc; later revisions insert o_scale before softmax_scale) and FA2's
# `varlen_fwd(q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k, block_table,
# alibi_slopes, max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal,
# ...)` (csrc/flash_attn/flash_api_torch_lib.cpp).
FA3 = Varlen(cu_seqlens_q=7, seqused_k=11, max_seqlen_q=12, max_seqlen_k=13, page_table=14,
               causal_from=23)
VARLEN_LAYOUTS: dict[str, Varlen] = {
    "_vllm_fa3_C::fwd": FA3, "sgl_kernel::fwd": FA3, "flash_attn_3::fwd": FA3,
    "_vllm_fa2_C::varlen_fwd": Varlen(cu_seqlens_q=4, seqused_k=6, max_seqlen_q=10,
                                       max_seqlen_k=11, page_table=8, causal_from=15),
}


def gemm_tokens(op_name: str, dims: list) -> int | None:
    """Tokens M of a 2-D-weight GEMM op (gemms.tokens: its activation's leading dims)."""
    return gemms.tokens(op_name.rsplit("::", 1)[-1], dims)
