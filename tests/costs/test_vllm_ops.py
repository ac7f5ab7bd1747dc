"""Serving engines' dense custom ops (vLLM `_C::` / `_C_cache_ops::` / `vllm::`, SGLang
`sgl_kernel::`): each cost rule against a hand-computed value, malformed shapes, and the names
they get in a vLLM forward.

The traces here are SYNTHETIC, written with tests/builders.py's Kineto builder: vLLM does not
run on this project's GPU image, so no real vLLM or SGLang capture exists. The op names and
argument lists follow the engines' own schemas (vLLM csrc/torch_bindings.cpp,
vllm-project/flash-attention hopper/flash_api_torch_lib.cpp, sgl-kernel
csrc/common_extension.cc and flash_extension.cc) and the nesting of vLLM's eager forward
(`vllm::unified_kv_cache_update` then `vllm::unified_attention_with_output`,
vllm/model_executor/layers/attention/attention.py); kernel durations are chosen numbers.
Shapes are Qwen2.5-7B's: H 3584, 28 query heads, 4 KV heads, d 128, I 18944.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import trace_roofline as tr
from tests.builders import BF, F32, Kineto, Op, attributed
from trace_roofline.attribution.attribute import operator_table
from trace_roofline.costs.attach import CostOptions, attach_costs
from workloads.synth_fused_moe import fa3_args

QWEN = tr.get_model("qwen2.5-7b")
H, NQ, NKV, D, I_FF = 3584, 28, 4, 128, 18944
I64, I32, U8 = "long int", "int", "unsigned char"
NORM_TYPES = [BF, BF, BF, "Scalar"]


def cost(op: Op, **kw) -> pd.Series:
    """The one costed instance of `op` (attach_costs over its attributed row)."""
    out = attach_costs(attributed([op]), QWEN, CostOptions(**kw))
    assert len(out) == 1
    return out.iloc[0]


def costed(name: str, dims: list, types: list, concrete: list | None = None, **kw) -> pd.Series:
    return cost(Op("x", name, dims, types, concrete or [""] * len(dims)), **kw)


# ------------------------------------------------------------------------------- norms
def test_rms_norm_hand_computed():
    """_C::rms_norm(out [4, 3584], input [4, 3584], weight [3584], eps): 4 FLOPs per element
    (the aten rule's), 4·4·3584 = 57344; reads input and weight, writes out:
    (14336 + 3584 + 14336)·2 = 64512 bytes. SGLang's rmsnorm (eps, enable_pdl) is the same."""
    for name, extra in (("_C::rms_norm", []), ("sgl_kernel::rmsnorm", ["Scalar"])):
        c = costed(name, [[4, H], [4, H], [H], [], *[[]] * len(extra)], NORM_TYPES + extra)
        assert (c["flops"], c["bytes"], c["cost_kind"], c["dtype"]) == (57344, 64512, "norm",
                                                                        "bf16")


def test_rms_norm_matches_the_aten_rule():
    """The same RMSNorm as aten::rms_norm(input, normalized_shape, weight, eps) costs the same."""
    engine = costed("_C::rms_norm", [[4, H], [4, H], [H], []], NORM_TYPES)
    aten = costed("aten::rms_norm", [[4, H], [], [H], []], [BF, "ScalarList", BF, "Scalar"])
    assert (engine["flops"], engine["bytes"]) == (aten["flops"], aten["bytes"])


def test_fused_add_rms_norm_hand_computed():
    """_C::fused_add_rms_norm(input [4, 3584], residual [4, 3584], weight [3584], eps) in place:
    residual += input (1 FLOP), input = norm(residual)·weight (4): 5·14336 = 71680 FLOPs;
    input and residual each read and written, weight read: (4·14336 + 3584)·2 = 121856 bytes.
    SGLang's fused_add_rmsnorm is the same."""
    for name, extra in (("_C::fused_add_rms_norm", []), ("sgl_kernel::fused_add_rmsnorm",
                                                          ["Scalar"])):
        c = costed(name, [[4, H], [4, H], [H], [], *[[]] * len(extra)], NORM_TYPES + extra)
        assert (c["flops"], c["bytes"], c["cost_kind"]) == (71680, 121856, "norm")


# -------------------------------------------------------------------------------- RoPE
ROTARY_TYPES = [I64, BF, BF, "Scalar", BF, "Scalar"]


def test_rotary_embedding_hand_computed():
    """_C::rotary_embedding(positions [4], query [4, 28·128], key [4, 4·128], 128,
    cos_sin_cache [32768, 128] bf16, is_neox): 4·(28 + 4)·128 = 16384 rotated elements, 3
    FLOPs each = 49152; bytes: rotated read + written 16384·2·2 = 65536, 4 cos|sin rows
    4·128·2 = 1024, 4 int64 positions 32: 66592."""
    c = costed("_C::rotary_embedding", [[4], [4, NQ * D], [4, NKV * D], [], [32768, D], []],
               ROTARY_TYPES, ["", "", "", "128", "", "True"])
    assert (c["flops"], c["bytes"], c["cost_kind"]) == (49152, 66592, "elementwise")


def test_rotary_embedding_partial_rotary_fp32_table_no_key():
    """rot_dim 64 of head_size 128 (cos_sin_cache [4096, 64] fp32), query [4, 28, 128] only
    (key None): 4·28·64 = 7168 rotated elements, 21504 FLOPs; bytes 7168·2·2 = 28672 + 4 rows
    4·64·4 = 1024 + positions 32 = 29728."""
    c = costed("_C::rotary_embedding", [[4], [4, NQ, D], [], [], [4096, 64], []],
               [I64, BF, "", "Scalar", F32, "Scalar"], ["", "", "", "128", "", "False"])
    assert (c["flops"], c["bytes"]) == (21504, 29728)


def test_rotary_embedding_reads_at_most_the_tables_rows():
    """8 tokens over a 2-row table: 2 rows read (2·128·2 = 512 B), not 8; rotated
    8·32·128 = 32768 elements, 131072 B; positions 64 B: 131648."""
    c = costed("_C::rotary_embedding", [[8], [8, NQ * D], [8, NKV * D], [], [2, D], []],
               ROTARY_TYPES, ["", "", "", "128", "", "True"])
    assert c["bytes"] == 131072 + 512 + 64


def test_rotary_embedding_without_head_size_is_uncosted():
    c = costed("_C::rotary_embedding", [[4], [4, NQ * D], [4, NKV * D], [], [32768, D], []],
               ROTARY_TYPES)
    assert pd.isna(c["flops"]) and "head_size not recorded" in c["uncosted"]


SGL_ROPE = [[4, NQ, D], [4, NKV, D], [4, NQ, D], [4, NKV, D], [32768, D], [4], [], [], []]
SGL_ROPE_TYPES = [BF, BF, BF, BF, F32, I64, "Scalar", "Scalar", "Scalar"]


def test_sglang_rope_hand_computed():
    """sgl_kernel::apply_rope_pos_ids_cos_sin_cache(q [4, 28, 128], k [4, 4, 128], q_rope,
    k_rope, cos_sin_cache [32768, 128] fp32, pos_ids [4], interleave, enable_pdl, stream):
    16384 rotated elements, 49152 FLOPs; 65536 + 4 rows·128·4 = 2048 + 32 = 67616 bytes."""
    c = costed("sgl_kernel::apply_rope_pos_ids_cos_sin_cache", SGL_ROPE, SGL_ROPE_TYPES)
    assert (c["flops"], c["bytes"]) == (49152, 67616)


def test_sglang_rope_with_fused_kv_store():
    """The same with v [4, 4, 128], k_buffer / v_buffer [4096, 4, 128] bf16, kv_cache_loc [4]:
    the store writes k and v (2048 elements each, 2·2048·2 = 8192 B), reads v (4096 B) and
    the 4 int64 slots (32 B); k is already read by the RoPE: 67616 + 12320 = 79936."""
    pool = [4096, NKV, D]
    c = costed("sgl_kernel::apply_rope_pos_ids_cos_sin_cache",
               [*SGL_ROPE, [4, NKV, D], pool, pool, [4]], [*SGL_ROPE_TYPES, BF, BF, BF, I64])
    assert (c["flops"], c["bytes"]) == (49152, 79936)


# -------------------------------------------------------------------------- activation
def test_silu_and_mul_hand_computed():
    """_C::silu_and_mul(out [4, 18944], input [4, 37888]): silu 4 + mul 1 = 5 FLOPs per output
    element, 5·75776 = 378880; reads input, writes out: (151552 + 75776)·2 = 454656 bytes.
    gelu_tanh_and_mul: gelu 8 + 1 = 9 per element, 681984 FLOPs, same bytes."""
    for name, flops in (("_C::silu_and_mul", 378880), ("sgl_kernel::silu_and_mul", 378880),
                        ("_C::gelu_tanh_and_mul", 681984)):
        c = costed(name, [[4, I_FF], [4, 2 * I_FF]], [BF, BF])
        assert (c["flops"], c["bytes"], c["cost_kind"]) == (flops, 454656, "elementwise"), name


# ---------------------------------------------------------------------------- KV cache
def _cache_args(tokens: int, slots: int, cache: list, cache_type: str = BF) -> tuple:
    kv = [tokens, NKV, D]
    return ([kv, kv, cache, cache, [slots], [], [], []],
            [BF, BF, cache_type, cache_type, I64, "", F32, F32],
            ["", "", "", "", "", "auto", "", ""])


def test_reshape_and_cache_flash_hand_computed():
    """reshape_and_cache_flash(key [4, 4, 128], value, key_cache [blocks, 16, 4, 128],
    value_cache, slot_mapping [4], "auto", k_scale, v_scale): each of key and value 2048
    elements read and written, (2048·2 + 2048·2)·2 = 16384 B, slots 4·8 = 32 B, the two 0-d
    fp32 scales 8 B: 16424 bytes, 0 FLOPs; the same whatever the cache's size."""
    for blocks in (136, 100_000):
        c = costed("_C_cache_ops::reshape_and_cache_flash",
                   *_cache_args(4, 4, [blocks, 16, NKV, D]))
        assert (c["flops"], c["bytes"], c["cost_kind"]) == (0, 16424, "copy")


def test_reshape_and_cache_writes_slot_mappings_tokens_at_the_cache_dtype():
    """key padded to 8 tokens (vLLM V1 pads for CUDA graphs), slot_mapping [4]: 4 tokens
    move. An fp8 cache (uint8): written at 1 byte: 32 + 2·(2048·2 + 2048) + 8 = 12328. The
    older reshape_and_cache layout (key_cache [blocks, 4, 16, 16, 8], value_cache
    [blocks, 4, 128, 16]) moves the same 16424 bytes."""
    padded = costed("_C_cache_ops::reshape_and_cache_flash",
                    *_cache_args(8, 4, [136, 16, NKV, D]))
    fp8 = costed("_C_cache_ops::reshape_and_cache_flash",
                 *_cache_args(4, 4, [136, 16, NKV, D], U8))
    dims, types, conc = _cache_args(4, 4, [])
    dims[2:4] = [[136, NKV, D // 8, 16, 8], [136, NKV, D, 16]]
    paged = costed("_C_cache_ops::reshape_and_cache", dims, types, conc)
    assert (padded["bytes"], fp8["bytes"], paged["bytes"]) == (16424, 12328, 16424)


def test_concat_and_cache_mla_and_sglang_store_kv_cache():
    """concat_and_cache_mla(kv_c [4, 512], k_pe [4, 64], kv_cache [136, 16, 576],
    slot_mapping [4], "auto", scale): (2048 + 256)·2·2 = 9216 + 32 + 4 = 9252 bytes.
    store_kv_cache(k_cache, v_cache [4096, 4, 128], out_loc [4], k, v [4, 4, 128]):
    2·2048·2·2 = 16384 + 32 = 16416 bytes."""
    mla = costed("_C_cache_ops::concat_and_cache_mla",
                 [[4, 512], [4, 64], [136, 16, 576], [4], [], []],
                 [BF, BF, BF, I64, "", F32], ["", "", "", "", "auto", ""])
    pool, kv = [4096, NKV, D], [4, NKV, D]
    sgl = costed("sgl_kernel::store_kv_cache", [pool, pool, [4], kv, kv], [BF, BF, I64, BF, BF])
    assert (mla["flops"], mla["bytes"], sgl["flops"], sgl["bytes"]) == (0, 9252, 0, 16416)


# --------------------------------------------------------------------------- attention
def _fa3(t: int, b: int, max_k: int, causal: str = "True") -> tuple[list, list, list]:
    """_vllm_fa3_C::fwd's 35 arguments for Qwen2.5-7B's heads (workloads.synth_fused_moe)."""
    return fa3_args(t, b, max_k, (NQ, NKV, D), causal)


def test_flash_attention_fwd_one_sequence_hand_computed():
    """_vllm_fa3_C::fwd (or sgl_kernel::fwd), one prefill sequence T = S = 512 (cu_seqlens_q
    [2], max_seqlen_k 512), causal: 512·513/2 = 131328 pairs, FLOPs 4·28·128·131328 =
    1882718208; bytes (all) K, V 2·4·512·128·2 = 1048576 + Q, O 2·28·512·128·2 = 7340032:
    8388608."""
    for name in ("_vllm_fa3_C::fwd", "sgl_kernel::fwd"):
        c = costed(name, *_fa3(512, 1, 512))
        assert (c["flops"], c["bytes"], c["cost_kind"]) == (1882718208, 8388608, "attention")
        assert (c["B"], c["T"], c["S"], c["n_q"], c["n_kv"], c["head_dim"], c["causal"]) == (
            1, 512, 512, NQ, NKV, D, True)


def test_flash_attention_fwd_chunk_against_a_prefix():
    """One sequence, a 16-token chunk against 1040 keys, causal (bottom-right aligned):
    16·(1040 - 16) + 16·17/2 = 16520 pairs, 4·28·128·16520 = 236830720 FLOPs; `kv` bytes
    2·4·1040·128·2 = 2129920. With is_causal False: 16·1040 = 16640 pairs, 238551040."""
    c = costed("_vllm_fa3_C::fwd", *_fa3(16, 1, 1040), attention_bytes="kv")
    assert (c["flops"], c["bytes"]) == (236830720, 2129920)
    full = costed("_vllm_fa3_C::fwd", *_fa3(16, 1, 1040, causal="False"))
    assert full["flops"] == 238551040 and not full["causal"]


def test_flash_attention_fa2_varlen_fwd_hand_computed():
    """_vllm_fa2_C::varlen_fwd(q [16, 28, 128], k, v packed [1040, 4, 128], out,
    cu_seqlens_q [2], cu_seqlens_k [2], None, None, None, None, 16, 1040, 0.0, scale,
    zero_tensors False, is_causal True, ...): the same 236830720 FLOPs as above."""
    k = [1040, NKV, D]
    dims = [[16, NQ, D], k, k, [16, NQ, D], [2], [2], [], [], [], [], *[[]] * 11]
    types = [BF, BF, BF, BF, I32, I32, "", "", "", "", *["Scalar"] * 11]
    conc = [""] * 10 + ["16", "1040", "0.0", "0.0883", "False", "True", "-1", "-1", "0.0",
                        "False", "0"]
    c = costed("_vllm_fa2_C::varlen_fwd", dims, types, conc, attention_bytes="kv")
    assert (c["flops"], c["bytes"], c["T"], c["S"]) == (236830720, 2129920, 16, 1040)


def test_flash_attention_fwd_several_paged_sequences_is_uncosted():
    """Decode of 4 sequences over a paged cache: their key lengths (seqused_k) are tensor
    values; max_seqlen_k only bounds them."""
    c = costed("_vllm_fa3_C::fwd", *_fa3(4, 4, 512))
    assert pd.isna(c["flops"]) and c["cost_kind"] == "none"
    assert "4 packed or paged sequence(s)" in c["uncosted"]
    assert "max_seqlen_k 512 bounds them" in c["uncosted"]


def test_unified_attention_is_uncosted_with_its_reason():
    kv = [4, NKV, D]
    c = costed("vllm::unified_attention_with_output", [[4, NQ, D], kv, kv, [4, NQ, D], []],
               [BF, BF, BF, BF, ""])
    assert pd.isna(c["bytes"]) and "vLLM's attention metadata" in c["uncosted"]


# --------------------------------------------------------------------------- malformed
def _fa3_without_sequences() -> tuple[list, list, list]:
    """_fa3 with cu_seqlens_q of one element: 0 sequences."""
    dims, types, conc = _fa3(4, 4, 512)
    dims[7] = [1]
    return dims, types, conc


@pytest.mark.parametrize(("name", "dims", "types", "concrete"), [
    # weight [4096] is not the hidden dim 3584
    ("_C::rms_norm", [[4, H], [4, H], [4096], []], NORM_TYPES, None),
    ("_C::rms_norm", [[4, H], [4, H]], [BF, BF], None),  # weight missing
    ("sgl_kernel::rmsnorm", [[4, H], [4, H], [H, 2], [], []], NORM_TYPES + ["Scalar"], None),
    ("_C::fused_add_rms_norm", [[4, H], [8, H], [H], []], NORM_TYPES, None),
    # 3500 is not a whole number of 128-wide heads
    ("_C::rotary_embedding", [[4], [4, 3500], [4, 512], [], [32768, D], []], ROTARY_TYPES,
     ["", "", "", "128", "", "True"]),
    # rot_dim 256 > head_size 128
    ("_C::rotary_embedding", [[4], [4, 3584], [4, 512], [], [32768, 256], []], ROTARY_TYPES,
     ["", "", "", "128", "", "True"]),
    ("_C::rotary_embedding", [[4], [4, 3584], [4, 512], [], [32768, D], []], ROTARY_TYPES,
     ["", "", "", "x", "", "True"]),
    ("sgl_kernel::apply_rope_pos_ids_cos_sin_cache", [[4, 3584], *SGL_ROPE[1:]],
     SGL_ROPE_TYPES, None),
    ("_C::silu_and_mul", [[4, I_FF], [4, I_FF]], [BF, BF], None),  # input not [.., 2I]
    ("_C::silu_and_mul", [[4, I_FF]], [BF], None),
    # 8 slots but only 4 tokens of key
    ("_C_cache_ops::reshape_and_cache_flash", *_cache_args(4, 8, [136, 16, NKV, D])),
    ("sgl_kernel::store_kv_cache", [[4096, NKV, D], [4096, NKV, D], [4]], [BF, BF, I64], None),
    # a packed query without cu_seqlens_q; cu_seqlens_q of 1 element (0 sequences)
    ("_vllm_fa3_C::fwd", [[4, NQ, D], [136, 16, NKV, D], [136, 16, NKV, D]], [BF, BF, BF],
     None),
    ("_vllm_fa3_C::fwd", *_fa3_without_sequences()),
    ("_vllm_fa3_C::fwd", [[4, NQ], [136, 16, NKV, D], [136, 16, NKV, D]], [BF, BF, BF], None),
])
def test_malformed_shapes_raise_malformed(name, dims, types, concrete):
    """Shapes a rule cannot read: cost_kind `malformed`, no FLOPs or bytes, a reason."""
    c = costed(name, dims, types, concrete)
    assert c["cost_kind"] == "malformed", c["uncosted"]
    assert pd.isna(c["flops"]) and "malformed shape data" in c["uncosted"]


# ------------------------------------------------------------ names in a vLLM forward
T, SEQS, CONTEXT = 4, 4, 512  # decode: 4 sequences, one new token each, 512 cached keys
LM_ROWS, VOCAB = SEQS, 152064


def _op(k: Kineto, name: str, dims: list, types: list, concrete: list | None = None,
        dur: float = 2.0, kernel: str | None = None) -> None:
    with k.op(name, dims, types, concrete=concrete or [""] * len(dims)):
        k.kernel(kernel or f"kernel_{name}", dur)


def _linear(k: Kineto, m: int, kk: int, n: int, bias: bool, dur: float) -> None:
    """F.linear as recorded: linear > addmm (bias) or linear > matmul > mm."""
    with k.op("aten::linear", [[m, kk], [n, kk], [n] if bias else []],
              [BF, BF, BF if bias else ""]):
        if bias:
            _op(k, "aten::addmm", [[n], [m, kk], [kk, n], [], []],
                [BF, BF, BF, "Scalar", "Scalar"], ["", "", "", "1", "1"], dur, "nvjet_bias")
            return
        with k.op("aten::matmul", [[m, kk], [kk, n]], [BF, BF]):
            _op(k, "aten::mm", [[m, kk], [kk, n]], [BF, BF], dur=dur, kernel="nvjet")


def _norm(k: Kineto, first: bool) -> None:
    name = "_C::rms_norm" if first else "_C::fused_add_rms_norm"
    _op(k, name, [[T, H], [T, H], [H], []], NORM_TYPES, ["", "", "", "1e-06"])


def _vllm_layer(k: Kineto, first: bool, nested_cache: bool) -> None:
    """One eager Qwen2 decoder layer as vLLM V1 runs it (qwen2.py, attention.py)."""
    _norm(k, first)
    _linear(k, T, H, NQ * D + 2 * NKV * D, True, 10.0)  # qkv_proj
    _op(k, "_C::rotary_embedding", [[T], [T, NQ * D], [T, NKV * D], [], [32768, D], []],
        ROTARY_TYPES, ["", "", "", "128", "", "True"])
    kv, cache = [T, NKV, D], _cache_args(T, T, [SEQS * CONTEXT // 16 + 8, 16, NKV, D])
    if not nested_cache:  # newer vLLM: the cache write is its own custom op
        with k.op("vllm::unified_kv_cache_update", [kv, kv, []], [BF, BF, ""]):
            _op(k, "_C_cache_ops::reshape_and_cache_flash", *cache)
    with k.op("vllm::unified_attention_with_output", [[T, NQ, D], kv, kv, [T, NQ, D], []],
              [BF, BF, BF, BF, ""]):
        if nested_cache:  # older vLLM: written inside the attention op
            _op(k, "_C_cache_ops::reshape_and_cache_flash", *cache)
        _op(k, "_vllm_fa3_C::fwd", *_fa3(T, SEQS, CONTEXT), dur=8.0, kernel="flash_fwd_sm90")
    _linear(k, T, NQ * D, H, False, 8.0)  # o_proj
    _norm(k, False)
    _linear(k, T, H, 2 * I_FF, False, 80.0)  # gate_up_proj
    _op(k, "_C::silu_and_mul", [[T, I_FF], [T, 2 * I_FF]], [BF, BF])
    _linear(k, T, I_FF, H, False, 40.0)  # down_proj


def vllm_trace(path, nested_cache: bool = False):
    """A SYNTHETIC vLLM decode step of a 2-layer Qwen2.5-7B: embedding, 2 layers, the final
    fused add + norm, the LM head on each sequence's last row."""
    k = Kineto()
    with k.ann("ProfilerStep#0"):
        _op(k, "aten::embedding", [[VOCAB, H], [T], [], [], []],
            [BF, I64, "Scalar", "Scalar", "Scalar"])
        for layer in range(2):
            _vllm_layer(k, layer == 0, nested_cache)
        _norm(k, False)
        _linear(k, LM_ROWS, H, VOCAB, False, 300.0)
    return k.write(path)


LAYER_NAMES = [  # (op, operator) in a layer's order
    ("aten::addmm", "qkv_proj"), ("_C::rotary_embedding", "rope"),
    ("_C_cache_ops::reshape_and_cache_flash", "kv_cache"),
    ("_vllm_fa3_C::fwd", "attention"), ("aten::mm", "o_proj"),
    ("_C::fused_add_rms_norm", "post_attention_norm"), ("aten::mm", "gate_up_proj"),
    ("_C::silu_and_mul", "act"), ("aten::mm", "down_proj")]


@pytest.fixture(scope="module")
def vllm_analysis(tmp_path_factory):
    path = vllm_trace(tmp_path_factory.mktemp("vllm") / "synthetic_vllm_qwen2.5-7b.json")
    return tr.load_trace(path), tr.analyze_trace(path, QWEN)


def test_vllm_forward_ops_are_named_by_position(vllm_analysis):
    """rms_norm opens layer 0 (input_norm), fused_add_rms_norm is the post-attention norm
    and layer 1's input norm, then the final norm; rotary -> rope, reshape_and_cache_flash
    (in unified_kv_cache_update) -> kv_cache, silu_and_mul -> act; evidence `position`."""
    trace, _ = vllm_analysis
    k = tr.attribute(trace, QWEN)
    got = list(zip(k["op_name"], k["operator"], k["layer"].astype("float"), strict=True))
    want = [("aten::embedding", "embedding", np.nan)]
    for layer, opener in ((0, "_C::rms_norm"), (1, "_C::fused_add_rms_norm")):
        want += [(opener, "input_norm", layer)] + [(o, n, layer) for o, n in LAYER_NAMES]
    want += [("_C::fused_add_rms_norm", "final_norm", np.nan), ("aten::mm", "lm_head", np.nan)]
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g[:2] == w[:2] and (g[2] == w[2] or (np.isnan(g[2]) and np.isnan(w[2]))), (g, w)
    engine = k[k["op_name"].str.startswith(("_C::", "_C_cache_ops::"))]
    assert set(engine["evidence"]) == {"position"}
    assert len(k) == len(trace.device)  # every kernel is one row: time is conserved
    total = np.rint(trace.device["dur_us"].to_numpy() * 1e6).astype(np.int64).sum()
    assert operator_table(k)["dur_ps"].sum() == total


def test_vllm_forward_is_costed_but_attention(vllm_analysis):
    """Every instance but the two attention calls is costed; the engine ops by the rules
    above (per layer: rope 49152 FLOPs / 66592 B, kv_cache 0 / 16424 B, act 378880 /
    454656 B; input_norm 57344 / 64512 B in layer 0, 71680 / 121856 B in layer 1). The
    attention instance is the flash-attention forward inside unified_attention_with_output,
    uncosted for its 4 paged sequences (their lengths are tensor values)."""
    _, a = vllm_analysis
    c = a.costed
    uncosted = c[c["flops"].isna()]
    assert list(uncosted["op_name"]) == ["_vllm_fa3_C::fwd"] * 2
    assert list(uncosted["operator"]) == ["attention"] * 2
    assert uncosted["uncosted"].str.contains("4 packed or paged sequence").all()
    per = c.groupby(["operator", "layer"])[["flops", "bytes"]].sum()
    for op, flops, nbytes in (("rope", 49152, 66592), ("kv_cache", 0, 16424),
                              ("act", 378880, 454656), ("post_attention_norm", 71680, 121856)):
        for layer in (0, 1):
            assert tuple(per.loc[(op, layer)]) == (flops, nbytes), (op, layer)
    assert tuple(per.loc[("input_norm", 0)]) == (57344, 64512)
    assert tuple(per.loc[("input_norm", 1)]) == (71680, 121856)


def test_older_vllm_writes_the_cache_inside_attention(tmp_path):
    """Where reshape_and_cache_flash runs inside unified_attention_with_output (older vLLM),
    the dispatching op gathers nothing: the cache write is a kv_cache instance (costed as
    in the newer layout) and the flash kernel the instance of its flash-attention forward."""
    trace = tr.load_trace(vllm_trace(tmp_path / "synthetic_vllm_nested.json", True))
    k = tr.attribute(trace, QWEN)
    cache = k[k["name"] == "kernel__C_cache_ops::reshape_and_cache_flash"]
    assert len(cache) == 2 and set(cache["operator"]) == {"kv_cache"}
    assert set(cache["op_name"]) == {"_C_cache_ops::reshape_and_cache_flash"}
    flash = k[k["name"] == "flash_fwd_sm90"]
    assert len(flash) == 2 and set(flash["op_name"]) == {"_vllm_fa3_C::fwd"}
    assert set(flash["operator"]) == {"attention"}
    c = tr.analyze_trace(trace, QWEN).costed
    assert tuple(c[c["operator"] == "kv_cache"].groupby("layer")["bytes"].sum()) == (16424, 16424)


def test_vllm_decode_step_is_a_decode_pass(vllm_analysis):
    """The step's phase comes from the flash-attention forward's varlen arguments
    (_vllm_fa3_C::fwd: cu_seqlens_q [5] at argument 7, 4 query tokens: 4 sequences of 1)."""
    _, a = vllm_analysis
    assert list(a.passes["phase"]) == ["decode"]
    assert set(a.costed["phase"]) == {"decode"}


def test_single_sequence_vllm_prefill_is_costed(tmp_path):
    """One sequence of 16 tokens through unified_attention_with_output -> _vllm_fa3_C::fwd
    (cu_seqlens_q [2], max_seqlen_k 16, causal): the flash forward is the attention instance,
    costed as T = S = 16: 136 pairs, 4·28·128·136 = 1949696 FLOPs per layer; phase prefill."""
    t = 16
    k = Kineto()
    with k.ann("ProfilerStep#0"):
        _op(k, "aten::embedding", [[VOCAB, H], [t], [], [], []],
            [BF, I64, "Scalar", "Scalar", "Scalar"])
        _op(k, "_C::rms_norm", [[t, H], [t, H], [H], []], NORM_TYPES, ["", "", "", "1e-06"])
        _linear(k, t, H, NQ * D + 2 * NKV * D, True, 10.0)
        with k.op("vllm::unified_attention_with_output",
                  [[t, NQ, D], [t, NKV, D], [t, NKV, D], [t, NQ, D], []], [BF, BF, BF, BF, ""]):
            _op(k, "_vllm_fa3_C::fwd", *_fa3(t, 1, t), dur=8.0, kernel="flash_fwd_sm90")
        _linear(k, t, NQ * D, H, False, 8.0)
    a = tr.analyze_trace(k.write(tmp_path / "synthetic_vllm_prefill.json"), QWEN)
    attn = a.costed[a.costed["operator"] == "attention"]
    assert list(attn["op_name"]) == ["_vllm_fa3_C::fwd"]
    assert list(attn["flops"]) == [1949696]
    assert list(a.passes["phase"]) == ["prefill"]


def _sglang_trace(path):
    """A SYNTHETIC SGLang decoder layer (sgl_kernel ops, a paged FA3 prefill of one
    sequence of 16 tokens against 16 keys)."""
    t, q, kv, pool = 16, [16, NQ, D], [16, NKV, D], [4096, NKV, D]
    k = Kineto()
    with k.ann("ProfilerStep#0"):
        _op(k, "aten::embedding", [[VOCAB, H], [t], [], [], []],
            [BF, I64, "Scalar", "Scalar", "Scalar"])
        _op(k, "sgl_kernel::rmsnorm", [[t, H], [t, H], [H], [], []], NORM_TYPES + ["Scalar"])
        _linear(k, t, H, NQ * D + 2 * NKV * D, True, 10.0)
        _op(k, "sgl_kernel::apply_rope_pos_ids_cos_sin_cache",
            [q, kv, q, kv, [32768, D], [t], [], [], []], SGL_ROPE_TYPES)
        _op(k, "sgl_kernel::store_kv_cache", [pool, pool, [t], kv, kv], [BF, BF, I64, BF, BF])
        _op(k, "sgl_kernel::fwd", *_fa3(t, 1, t), dur=8.0)
        _linear(k, t, NQ * D, H, False, 8.0)
        _op(k, "sgl_kernel::fused_add_rmsnorm", [[t, H], [t, H], [H], [], []],
            NORM_TYPES + ["Scalar"])
        _linear(k, t, H, 2 * I_FF, False, 80.0)
        _op(k, "sgl_kernel::silu_and_mul", [[t, I_FF], [t, 2 * I_FF]], [BF, BF])
        _linear(k, t, I_FF, H, False, 40.0)
    return k.write(path)


def test_sglang_layer_is_costed(tmp_path):
    """Every instance of the SGLang layer is costed; its attention (one sequence, T = S = 16,
    causal: 136 pairs) 4·28·128·136 = 1949696 FLOPs."""
    c = tr.analyze_trace(_sglang_trace(tmp_path / "synthetic_sglang.json"), QWEN).costed
    assert c["flops"].notna().all(), c.loc[c["flops"].isna(), "uncosted"].tolist()
    attn = c[c["op_name"] == "sgl_kernel::fwd"].iloc[0]
    assert (attn["operator"], attn["flops"]) == ("attention", 1949696)


def test_sglang_layer_ops_are_named(tmp_path):
    """SGLang's own spellings of the norm, fused add-norm, RoPE and cache-write ops fall in
    the same op families as vLLM's, so position names them like vLLM's layer."""
    k = tr.attribute(tr.load_trace(_sglang_trace(tmp_path / "synthetic_sglang.json")), QWEN)
    by_op = dict(zip(k["op_name"], k["operator"], strict=False))
    assert by_op["sgl_kernel::rmsnorm"] == "input_norm"
    assert by_op["sgl_kernel::fused_add_rmsnorm"] == "post_attention_norm"
    assert by_op["sgl_kernel::apply_rope_pos_ids_cos_sin_cache"] == "rope"
    assert by_op["sgl_kernel::store_kv_cache"] == "kv_cache"
