"""The one registry of kernel-name families: which library wrote a kernel and what it does.

Design notes: docs/design.md ("trace_roofline/model/kernels.py").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pandas as pd

from trace_roofline.model import operators
from trace_roofline.model.operators import Name

# (a role that is one operator's own work is named after it: attention, rope, sampling, ...)
ROLES: tuple[str, ...] = (
    "gemm", "moe_gemm", "conv", Name.ATTENTION, "attention_reduce", "norm", "fused_add_norm",
    Name.ROPE, "activation", "elementwise", "reduction", "copy", "kv_cache_write", "moe_routing",
    "moe_finalize", "quant", "collective", "memcpy", "softmax", "sort_scan", Name.SAMPLING,
    Name.LOSS, Name.OPTIMIZER, "unknown",
)
# which role an op instance of several kernels takes (attribute.py): the first of its kernels'
# roles in this order (an attention's memset is attention, a GEMM's split-K reduce a GEMM)
ROLE_PRIORITY: tuple[str, ...] = (
    Name.ATTENTION, "attention_reduce", "moe_gemm", "gemm", "conv", "collective", "fused_add_norm",
    "norm", Name.ROPE, "kv_cache_write", "activation", "quant", "moe_routing", "moe_finalize",
    Name.LOSS, Name.OPTIMIZER, Name.SAMPLING, "softmax", "sort_scan", "reduction", "copy",
    "elementwise", "memcpy", "unknown",
)
GEMM_ROLES = frozenset({"gemm", "moe_gemm"})  # weight GEMMs: named by shape, never by position
ATTENTION_ROLES = frozenset({Name.ATTENTION, "attention_reduce"})
UNKNOWN = "unknown"


@dataclass(frozen=True)
class KernelFamily:
    """One entry of the registry."""

    family: str
    vendor: str
    pattern: re.Pattern[str]
    role: str


def _f(family: str, vendor: str, rx: str, role: str) -> KernelFamily:
    assert role in ROLES, role
    return KernelFamily(family, vendor, re.compile(rx), role)


# collective kernels: the patterns operators.COLLECTIVES already holds (NCCL/RCCL, vLLM's
# custom all-reduce, symmetric-memory one/two-shot), plus the multimem all-reduce
_COLLECTIVE_RX = "|".join(o.kernels.pattern for o in operators.COLLECTIVES if o.kernels is not None)

FAMILIES: tuple[KernelFamily, ...] = (
    # CUDA / HIP runtime copies and fills: "Memcpy DtoD (Device -> Device)", "Memset (Device)"
    _f("runtime_memcpy", "CUDA/HIP runtime", r"^(?:Memcpy|Memset|memcpy|memset)\b", "memcpy"),
    # Inductor's generated kernels: what they fuse is in the name, what they are is not
    # (triton_poi_fused__scaled_dot_product_cudnn_attention__to_copy_..._5 is a copy)
    _f("inductor_pointwise", "PyTorch Inductor", r"^triton_poi_", "elementwise"),
    _f("inductor_reduction", "PyTorch Inductor", r"^triton_(?:red|per)_", "reduction"),
    # Inductor templates: flex attention (triton_tem_fused_flex_attention_0 and its backward),
    # matmuls (triton_tem_fused_mm_0, triton_tem_fused_addmm_1, triton_tem_fused_bmm_2,
    # triton_tem_fused__scaled_mm_0), convolutions
    _f("inductor_flex_attention", "PyTorch Inductor",
       r"^triton_tem_fused_.*flex_(?:attention|decoding)|^triton_tem_fused_flex", Name.ATTENTION),
    # (the experts' grouped GEMM, triton_tem_fused__grouped_mm_..._22: INDUCTOR_GROUPED_MM)
    _f("inductor_grouped_mm_template", "PyTorch Inductor", r"^triton_tem_fused__grouped_mm",
       "moe_gemm"),
    _f("inductor_mm_template", "PyTorch Inductor",
       r"^triton_tem_fused_(?:.*_)?(?:mm|addmm|bmm|baddbmm|_scaled_mm|scaled_mm)(?:_|$)", "gemm"),
    _f("inductor_conv_template", "PyTorch Inductor", r"^triton_tem_fused_(?:.*_)?convolution",
       "conv"),
    # FlashAttention 2/3 (Dao-AILab, and vLLM's / SGLang's vendored builds): flash_fwd_kernel,
    # flash_fwd_splitkv_kernel (+ flash_fwd_splitkv_combine_kernel), FlashAttnFwdSm90
    _f("pytorch_flash", "PyTorch SDPA (vendored FlashAttention)", r"pytorch_flash::", Name.ATTENTION),
    _f("flash_attention_combine", "FlashAttention",
       r"flash_fwd_splitkv_combine|FlashAttnFwdCombine|flash::.*[Cc]ombine", "attention_reduce"),
    _f("flash_attention", "FlashAttention",
       r"flash_fwd_|flash_bwd_|FlashAttnFwd|FlashAttnBwd|flash::", Name.ATTENTION),
    # TensorRT-LLM's FMHA as FlashInfer and vLLM run it on Blackwell/Hopper:
    # fmhaSm100fKernel_QkvBfloat16OBfloat16H64PagedKvCausalP64VarSeqQ128Kv128PersistentContext
    _f("trtllm_fmha", "TensorRT-LLM / FlashInfer", r"^fmhaSm\d+\w*Kernel|^fmha_v2_", Name.ATTENTION),
    # cuDNN's SDPA: cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_..., its
    # decode split reduction cudnn::fusion::lean_reduction_kernel<false, false, false>
    _f("cudnn_sdpa_reduce", "NVIDIA cuDNN", r"cudnn::fusion::lean_reduction", "attention_reduce"),
    _f("cudnn_sdpa", "NVIDIA cuDNN", r"cudnn.*(?:sdpa|fmha|flash_[fb]prop|mha)", Name.ATTENTION),
    # PyTorch's memory-efficient attention (xformers' CUTLASS kernels):
    # fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>)
    _f("mem_efficient_attention", "PyTorch SDPA (xformers CUTLASS)",
       r"fmha_cutlass|PyTorchMemEffAttention|mem_efficient|efficient_attention", Name.ATTENTION),
    # ck_tile / aiter attention (AMD): ck_tile::kentry<2, FmhaBatchPrefillWithPagedKVCacheKernel
    # <...>>, FmhaFwdSplitKVCombine, aiter::mha_batch_prefill, aiter's paged attention
    _f("ck_fmha_combine", "AMD ck_tile", r"Fmha\w*SplitKVCombine|fmha_fwd_splitkv_combine",
       "attention_reduce"),
    _f("ck_fmha", "AMD ck_tile / aiter",
       r"Fmha|fmha_|mha_batch_prefill|mha_varlen_fwd|mha_fwd|aiter::\w*paged_attention",
       Name.ATTENTION),
    # FlashInfer: BatchDecodeWithPagedKVCacheKernel, BatchPrefillWithPagedKVCacheKernel,
    # BatchPrefillWithRaggedKVCacheKernel, Single{Decode,Prefill}WithKVCacheKernel, MLA; their
    # split-KV merge (MergeStatesKernel, VariableLengthMergeStatesKernel)
    _f("flashinfer_merge", "FlashInfer", r"MergeStates", "attention_reduce"),
    _f("flashinfer_attention", "FlashInfer",
       r"Batch(?:Decode|Prefill)With(?:Paged|Ragged)KVCache|Single(?:Decode|Prefill)WithKVCache|"
       r"BatchMLAPaged", Name.ATTENTION),
    # ROCm / vLLM paged attention: paged_attention_ll4mi_QKV_mfma16_kernel<...> and
    # paged_attention_ll4mi_reduce_kernel<...>; vLLM's paged_attention_v2_reduce_kernel
    _f("paged_attention_reduce", "vLLM / ROCm", r"paged_attention\w*reduce", "attention_reduce"),
    _f("paged_attention", "vLLM / ROCm", r"paged_attention", Name.ATTENTION),
    # vLLM's Triton unified attention (kernel_unified_attention_2d / _3d) and the 3d variant's
    # reduce_segments; SGLang's Triton decode attention (_fwd_grouped_kernel_stage1, stage2)
    _f("vllm_unified_attention_reduce", "vLLM (Triton)", r"^reduce_segments", "attention_reduce"),
    _f("vllm_unified_attention", "vLLM (Triton)", r"kernel_unified_attention_(?:2d|3d)",
       Name.ATTENTION),
    _f("sglang_triton_attention_reduce", "SGLang (Triton)", r"^_fwd_kernel_stage2",
       "attention_reduce"),
    _f("sglang_triton_attention", "SGLang (Triton)",
       r"^_fwd_(?:grouped_)?kernel_stage1|^_?attn_fwd|^_fwd_kernel$|^_fwd_kernel_flash_decode",
       Name.ATTENTION),
    # KV-cache writes: vllm::reshape_and_cache_flash_kernel<...>, concat_and_cache_mla_kernel,
    # SGLang's store_kvcache<2048l, 4, false, long>
    _f("kv_cache_write", "vLLM / SGLang",
       r"reshape_and_cache|concat_and_cache_mla|store_kvcache|set_kv_buffer", "kv_cache_write"),
    # norms: aiter::add_rmsnorm_quant_kernel (fused residual add + RMSNorm, mangled
    # _ZN5aiter24add_rmsnorm_quant_kernel...), vllm::fused_add_rms_norm_kernel<...>, FlashInfer's
    # FusedAddRMSNormKernel; ck_tile::Rmsnorm2dFwd, vllm::rms_norm_kernel, ATen's layer norm
    _f("fused_add_rmsnorm", "aiter / vLLM / FlashInfer",
       r"add_rms_?norm|fused_add_rms_norm|FusedAddRMSNorm", "fused_add_norm"),
    _f("ck_rmsnorm", "AMD ck_tile", r"Rmsnorm2dFwd|Layernorm2dFwd", "norm"),
    _f("rmsnorm", "vLLM / SGLang / FlashInfer / ATen",
       r"rms_?norm|RMSNorm|RmsNorm|layer_?norm|LayerNorm|RowwiseMoments|GammaBetaBackward|"
       r"cuComputeGradInput|cuComputePartGradGammaBeta", "norm"),
    # RoPE: rotary_embedding_kernel<c10::BFloat16, true> (vLLM, SGLang's sgl_kernel), FlashInfer's
    # BatchQKApplyRotaryPosIdsCosSinCache
    _f("rotary_embedding", "vLLM / SGLang / FlashInfer",
       r"rotary_embedding|rotary_emb|apply_rotary|ApplyRotary", Name.ROPE),
    # quantisation: vllm scaled_fp8_quant / dynamic_per_token_scaled_fp8_quant kernels,
    # per_token_group_quant_fp8
    _f("fp8_quant", "vLLM / SGLang",
       r"scaled_fp8_quant|fp8_quant|per_token_group_quant|scaled_int8_quant|quantize_", "quant"),
    # mixture of experts: vLLM / SGLang's Triton fused_moe_kernel (w13, then w2); triton_kernels'
    # _topk_forward, _combined_routing_compute / _memset, _sum_bitmatrix_rows,
    # _matmul_ogs_NNT_bf16xbf16xmxfp4_16x128x256x1(_swiglu), _finalize_matmul_scatter_bf16;
    # vLLM's topkGatingSoftmax, moeTopK, moeSoftmax, moe_align_block_size_kernel,
    # count_and_sort_expert_tokens_kernel, moe_sum_kernel; TRT-LLM / FlashInfer's bmm_* expert
    # GEMMs (bmm_Bfloat16_MxE2m1MxE4m3_...), routing and finalize; torch's grouped GEMM
    # (CUTLASS GroupProblemShape) and its prepare_grouped_gemm_data
    _f("fused_moe_triton", "vLLM / SGLang (Triton)", r"^fused_moe_kernel", "moe_gemm"),
    _f("triton_kernels_matmul_ogs", "triton_kernels", r"^_matmul_ogs_|^_p_matmul_ogs_",
       "moe_gemm"),
    _f("triton_kernels_finalize", "triton_kernels", r"^_finalize_matmul_scatter", "moe_finalize"),
    _f("triton_kernels_routing", "triton_kernels",
       r"^_topk_forward|^_combined_routing|^_sum_bitmatrix|^_routing_|^_bitmatrix", "moe_routing"),
    _f("trtllm_moe_gemm", "TensorRT-LLM / FlashInfer",
       r"^bmm_(?:Bfloat16|Fp16|E4m3|E2m1|MxE|Fp8|BF16|FP8)", "moe_gemm"),
    _f("trtllm_moe_routing", "TensorRT-LLM / FlashInfer",
       r"routingMainKernel|routingIndicesCluster|routingRenormalize|routingDeepSeek|routingLlama4|"
       r"routingIndices", "moe_routing"),
    _f("trtllm_moe_finalize", "TensorRT-LLM / FlashInfer", r"finalizeKernel|finalize_moe",
       "moe_finalize"),
    _f("vllm_moe_routing", "vLLM / SGLang",
       r"topkGatingSoftmax|moeTopK|moeSoftmax|topk_softmax|moe_align_block_size|"
       r"count_and_sort_expert_tokens|sgl_moe_align|grouped_topk|biased_grouped_topk",
       "moe_routing"),
    _f("vllm_moe_sum", "vLLM / SGLang", r"moe_sum_kernel|moe_sum", "moe_finalize"),
    _f("torch_grouped_gemm", "PyTorch (CUTLASS grouped GEMM)",
       r"prepare_grouped_gemm_data|GroupProblemShape", "moe_gemm"),
    # collectives: ncclDevKernel_AllReduce_Sum_bf16_RING_LL(...), ncclKernel_* (NCCL, and RCCL,
    # which keeps the names), vLLM's cross_device_reduce_1stage<...>, symmetric memory's
    # multimem_all_reduce_kernel / one_shot_all_reduce
    _f("nccl_rccl", "NCCL / RCCL", r"^(?:void )?(?:nccl|rccl)(?:Dev)?Kernel", "collective"),
    _f("custom_all_reduce", "vLLM / SGLang / torch symmetric memory",
       _COLLECTIVE_RX + r"|multimem_all_reduce|multimem_all_gather|all_reduce_kernel",
       "collective"),
    # activations: vllm::act_and_mul_kernel<...silu_kernel...>, SGLang's
    # sgl_hip::activation::act_and_mul_kernel (mangled _ZN7sgl_hip10activation18act_and_mul...),
    # ATen's silu / gelu / sigmoid functors
    _f("act_and_mul", "vLLM / SGLang", r"act_and_mul|silu_and_mul|gelu_and_mul|gelu_tanh_and_mul|"
       r"swiglu", "activation"),
    # the expert bmm's of TRT-LLM were matched above: what is left here is weight GEMM libraries
    # _scaled_mm: cuBLASLt FP8 GEMMs (sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_...), CUTLASS
    # cutlass_scaled_mm, fbgemm f8f8bf16
    _f("scaled_mm", "cuBLASLt / CUTLASS (FP8)",
       r"scaled_mm|f8f8bf16|fp8_gemm|(?:gemm|xmma|nvjet).*(?:e4m3|e5m2)", "gemm"),
    # cuBLAS GEMV and its dot/reduce pair: internal::gemvx::kernel<...>, gemv2T_kernel,
    # dot_kernel<float, 128, 0, cublasDotParams<...>>, reduce_1Block_kernel<..cublasGemv..>
    _f("cublas_gemv", "NVIDIA cuBLAS",
       r"gemvx|gemv2?[NT]?_kernel|gemv|dot_kernel.*cublas|reduce_1Block_kernel.*cublas", "gemm"),
    _f("cublas_splitk_reduce", "NVIDIA cuBLASLt",
       r"splitKreduce|splitK_?[Rr]educe|ReduceSplitK|reduce_splitk", "gemm"),
    _f("cublaslt_nvjet", "NVIDIA cuBLASLt", r"nvjet_", "gemm"),
    _f("cublas_xmma", "NVIDIA cuBLAS", r"sm\d+_xmma_|xmma_gemm", "gemm"),
    _f("cublas_legacy", "NVIDIA cuBLAS",
       r"(?:ampere|volta|turing|hopper|sm\d+)_\w*gemm|\bgemmSN_|gemmk1_kernel", "gemm"),
    _f("cutlass_gemm", "NVIDIA CUTLASS",
       r"cutlass\w*gemm|cutlass.*Gemm|GemmUniversal|cutlass_80_simt_sgemm|wgmma", "gemm"),
    # hipBLASLt / Tensile: Cijk_Alik_Bljk_BBS_BH_Bias_HA_S_SAV_UserArgs_MT128x256x32_...;
    # CK / aiter GEMMs
    _f("hipblaslt_tensile", "AMD hipBLASLt / Tensile", r"^Cijk_", "gemm"),
    _f("ck_gemm", "AMD ck / aiter",
       r"gemm_a16w16|gemm_a8w8|ck_tile.*Gemm|kernel_gemm_xdl|DeviceGemm|bf16gemm", "gemm"),
    # Triton matmuls written by hand (not Inductor's): matmul_kernel, _matmul_kernel,
    # persistent matmuls
    _f("triton_matmul", "Triton",
       r"^_?(?:persistent_)?matmul_kernel|^_?matmul_|^_kernel_matmul|^mm_kernel|^_?bmm_kernel",
       "gemm"),
    _f("gemm_other", "other GEMM libraries", r"gemm|Gemm|GEMM|cublas", "gemm"),
    # training: cross-entropy's NLL kernels (its log-softmax is a softmax: beam search runs one
    # too), fused / foreach optimizer kernels
    _f("torch_loss", "PyTorch ATen", r"nll_loss|cross_entropy|cunn_ClassNLLCriterion", Name.LOSS),
    _f("torch_optimizer", "PyTorch ATen",
       r"FusedAdam|fused_adam|[Aa]damW?Functor|_fused_adamw?|FusedSgd|fused_sgd|LambFunctor",
       Name.OPTIMIZER),
    # sampling: multinomial / exponential draws, argmax, FlashInfer's and vLLM's samplers,
    # penalties
    _f(Name.SAMPLING, "PyTorch ATen / FlashInfer / vLLM",
       r"distribution_elementwise|distribution_nullary|multinomial|sampleMultinomial|renormRows|"
       r"TopKTopP|SamplingFromProb|TopPRenorm|TopKRenorm|TopKMaskLogits|apply_penalt|"
       r"repetition_penalt|ArgMaxOps|ArgMinOps|argmax|exponential_kernel", Name.SAMPLING),
    # softmax (attention's eager softmax, a router's, sampling's): softmax_warp_forward<...>,
    # cunn_SoftMaxForward
    _f("torch_softmax", "PyTorch ATen", r"softmax_warp|SoftMaxForward|SoftMaxBackward|softmax",
       "softmax"),
    # sorting, scans, top-k (a router's top-k and dispatch, sampling's top-p): ATen's
    # bitonicSortKVInPlace, radixSortKVInPlace, sbtopk::gatherTopK; CUB (DeviceScanKernel,
    # DeviceRadixSort, DeviceSelectSweepKernel); rocPRIM's trampoline_kernel<...scan...>
    _f("rocprim", "AMD rocPRIM", r"rocprim::", "sort_scan"),
    _f("cub", "NVIDIA CUB", r"\bcub::|DeviceRadixSort|DeviceScan|DeviceSegmentedSort|DeviceSelect|"
       r"DeviceCompact|DeviceReduce", "sort_scan"),
    _f("torch_sort_topk", "PyTorch ATen",
       r"bitonicSort|radixSort|RadixSort|segmented_sort|gatherTopK|sbtopk|mbtopk|"
       r"tensor_kernel_scan|kernelHistogram1D|sort_postprocess|write_indices", "sort_scan"),
    # ATen's activation functors: silu_kernel, gelu_kernel, sigmoid_kernel_cuda, ...
    _f("torch_activation", "PyTorch ATen",
       r"silu_kernel|silu_backward|gelu_kernel|gelu_backward|sigmoid_kernel|sigmoid_backward|"
       r"relu_kernel|threshold_kernel|tanh_kernel|tanh_backward", "activation"),
    # ATen copies, concatenation, gathers and scatters: CatArrayBatchedCopy, direct_copy_kernel_cuda,
    # bfloat16_copy_kernel_cuda, index_copy_kernel_impl, index_put_kernel_impl,
    # indexSelectSmallIndex, vectorized_gather_kernel, index_kernel_impl, indexFuncSmallIndex
    _f("torch_copy", "PyTorch ATen",
       r"CatArrayBatchedCopy|copy_kernel|index_copy_kernel|index_put_kernel|indexSelect|"
       r"vectorized_gather_kernel|index_kernel_impl|indexFunc|_scatter_gather|scatter_kernel|"
       r"gather_kernel|embedding_backward|EmbeddingBag|embedding", "copy"),
    _f("torch_reduce", "PyTorch ATen", r"reduce_kernel|ReduceOp|reduce_1Block|reduction_kernel",
       "reduction"),
    _f("torch_foreach", "PyTorch ATen", r"multi_tensor_apply_kernel", "elementwise"),
    _f("torch_elementwise", "PyTorch ATen",
       r"elementwise_kernel|unrolled_elementwise|vectorized_elementwise|FillFunctor|at::native::",
       "elementwise"),
)

_NAMES = np.asarray([f.family for f in FAMILIES] + [UNKNOWN], dtype=object)
_VENDORS = np.asarray([f.vendor for f in FAMILIES] + [""], dtype=object)
_ROLES = np.asarray([f.role for f in FAMILIES] + [UNKNOWN], dtype=object)
BY_FAMILY: dict[str, KernelFamily] = {f.family: f for f in FAMILIES}
# classify's columns: per family index, its category's code, and the categories
_CODES = {col: (pd.Index(cats).get_indexer(values), cats) for col, values, cats in (
    ("family", _NAMES, pd.unique(_NAMES)), ("vendor", _VENDORS, pd.unique(_VENDORS)),
    ("role", _ROLES, list(ROLES)))}


def _distinct(names: pd.Series) -> tuple[np.ndarray, pd.Series]:
    """(per row, an index into the distinct names; the distinct names as strings): a
    categorical's categories, else the factorized values (missing: the last, "")."""
    if isinstance(names.dtype, pd.CategoricalDtype):
        cats = pd.Series(np.asarray(names.cat.categories, dtype=object)).astype("string")
        codes = names.cat.codes.to_numpy()
    else:
        codes, uniq = pd.factorize(names.to_numpy(dtype=object), use_na_sentinel=True)
        cats = pd.Series(np.asarray(uniq, dtype=object)).astype("string")
    return np.where(codes < 0, len(cats), codes), pd.concat(
        [cats, pd.Series([""], dtype="string")], ignore_index=True)


_KNOWN: dict[str, int] = {}  # name -> family index, of the names seen in this process
_KNOWN_MAX = 1 << 16  # (a trace of millions of distinct names is searched, not remembered)


def family_index(distinct: pd.Series) -> np.ndarray:
    """Per distinct name, the index in FAMILIES of its family (len(FAMILIES): unknown): one
    vectorised regex search per family over the names not seen before, the first match kept."""
    text = distinct.astype("string").fillna("")
    keys = text.to_numpy(dtype=object)
    out = np.fromiter((_KNOWN.get(k, -1) for k in keys), np.int64, len(keys))
    new = np.flatnonzero(out < 0)
    if len(new):
        found = _search(text.iloc[new])
        out[new] = found
        if len(_KNOWN) < _KNOWN_MAX:
            _KNOWN.update(zip(keys[new], found.tolist(), strict=True))
    return out


def _search(text: pd.Series) -> np.ndarray:
    out = np.full(len(text), len(FAMILIES), dtype=np.int64)
    for i, fam in enumerate(FAMILIES):
        todo = out == len(FAMILIES)
        if not todo.any():
            break
        hit = text[todo].str.contains(fam.pattern).fillna(False).to_numpy(dtype=bool)
        out[np.flatnonzero(todo)[hit]] = i
    out[(text == "").to_numpy()] = len(FAMILIES)
    return out


def classify(names: pd.Series) -> pd.DataFrame:
    """Per kernel name (a Series, categorical or not): its `family`, `vendor` and `role`, as
    categoricals, indexed like `names`. Worked out once per distinct name."""
    codes, distinct = _distinct(names)
    fam = family_index(distinct)[codes]
    return pd.DataFrame({col: pd.Categorical.from_codes(code[fam], cats)
                         for col, (code, cats) in _CODES.items()}, index=names.index)


def roles(names: pd.Series) -> pd.Series:
    """Per kernel name, its role (categorical over ROLES)."""
    return classify(names)["role"]


def role_of(name: str) -> str:
    """The role of one kernel name (tests, messages)."""
    return str(roles(pd.Series([name], dtype=object)).iloc[0])


def family_of(name: str) -> str:
    """The family of one kernel name (tests, messages)."""
    return str(classify(pd.Series([name], dtype=object))["family"].iloc[0])


# ----------------------------------------------------------------------------------------------
# What an Inductor kernel fuses: triton_{poi,red,per,tem}_fused_<aten ops>_<n> lists the aten
# ops of the graph nodes it fused, which tells a norm, RoPE, a cache store or an activation
# apart (the family above only says pointwise or reduction)
# ----------------------------------------------------------------------------------------------
INDUCTOR_KERNEL = operators.TRITON_KERNEL_OP
INDUCTOR_FUSES: dict[str, re.Pattern[str]] = {
    "norm": re.compile(r"(?:^|_)(?:rsqrt|mean|var_mean|rms_norm|layer_norm)(?:_|$)"),
    Name.ROPE: re.compile(r"(?:^|_)(?:neg|cos|sin|rotary)(?:_|$)"),
    "store": re.compile(r"(?:^|_)(?:index_put|index_copy|scatter|slice_scatter|copy)(?:_|$)"),
    "cat": re.compile(r"(?:^|_)cat(?:_|$)"),
    Name.ACT: re.compile(r"(?:^|_)(?:silu|gelu|sigmoid)(?:_|$)"),
    "softmax": re.compile(r"(?:^|_)(?:softmax|prepare_softmax_online)(?:_|$)"),
    # (a reduction kernel's: a pointwise one only carries the name of a bmm it was fused near)
    "bmm": re.compile(r"^triton_(?:red|per)_.*(?:^|_)(?:bmm|baddbmm)(?:_|$)"),
}


def inductor_fuses(names: pd.Series, what: str) -> pd.Series:
    """Per name (strings; non-Inductor names: False), whether the Inductor kernel fuses `what`
    (a key of INDUCTOR_FUSES). `_to_copy` counts as a cast, not a copy."""
    text = names.astype("string").fillna("")
    tri = text.where(text.str.match(INDUCTOR_KERNEL), "").str.replace("_to_copy", "_cast",
                                                                        regex=False)
    return tri.str.contains(INDUCTOR_FUSES[what]).fillna(False).astype(bool)


# An Inductor kernel that fused a matmul (a decode GEMV became a reduction, with the norm or the
# activation around it): its weight GEMM is read from its arguments' shapes (`inductor_gemm`)
INDUCTOR_MATMUL = re.compile(r"(?:^|(?<!grouped)_)(?:mm|addmm|bmm|baddbmm)(?:_|$)")
# Inductor's grouped-GEMM template (max-autotune's _grouped_mm of all experts) and its
# arguments: tokens [S, K], the experts' weights [E, N, K] or [E, K, N], offsets [E], out [S, N]
INDUCTOR_GROUPED_MM = BY_FAMILY["inductor_grouped_mm_template"].pattern


def grouped_gemm(shapes: list) -> tuple[int, int, int, int] | None:
    """(S, K, N, E) of an Inductor grouped-GEMM template from its arguments' shapes: the first
    2-D one is the input [S, K], the first 3-D one the weights, the last 2-D one of S rows the
    output [S, N]; None when they do not fit one another."""
    dims = [d for d in shapes if isinstance(d, list) and d and all(type(v) is int for v in d)]
    two = [d for d in dims if len(d) == 2]
    three = [d for d in dims if len(d) == 3]
    if len(two) < 2 or not three:
        return None
    (s, k), w = two[0], three[0]
    outs = [d for d in two[1:] if d[0] == s]
    if not outs:
        return None
    n = outs[-1][1]
    if sorted(w[1:]) != sorted((k, n)):
        return None
    return s, k, n, w[0]
# ... whose weight it reads transposed (`t`: nn.Linear's [N, K] buffer), else as [K, N]
INDUCTOR_TRANSPOSED = re.compile(r"(?:^|_)t(?:_|$)")


class FusedGemm(NamedTuple):
    """The weight GEMM inside an Inductor kernel: [m, k] x [k, n], n summed over `weights`
    weight buffers of one shape (2: a fused gate and up, or k and v)."""

    m: int
    k: int
    n: int
    weights: int = 1


# no linear has fewer input features: a smaller "weight" is an activation (the top-k
# combine's [k, H] expert outputs weighted by [1, k] routing weights)
MIN_IN_FEATURES = 16


def fused_gemm(name: str, shapes: list) -> FusedGemm | None:
    """`inductor_gemm` of an Inductor kernel's arguments when its name says it fused a matmul
    (reading the weight as [N, K] when it fused a transpose too), else None."""
    if not INDUCTOR_MATMUL.search(name):
        return None
    return inductor_gemm(shapes, bool(INDUCTOR_TRANSPOSED.search(name)))


def inductor_gemm(shapes: list, transposed: bool = True) -> FusedGemm | None:
    """The weight GEMM inside an Inductor kernel that fused a matmul, from its arguments'
    shapes in order: a 2-D weight buffer [N, K] ([K, N] when not `transposed`; N > 1,
    K >= MIN_IN_FEATURES), with
    another argument that ends in N with M·N elements (the output) and a third that holds M·K
    (the input, as [M, K] or as heads) or 2·M·K (a fused gate_up's output, the activation run
    in the kernel). Several weights of that one shape run as one GEMM (N summed, `weights`
    counted: a fused gate and up; an input of the weight's shape is not one); None when no
    weight, or weights of two shapes, fit."""
    dims = [d for d in shapes if isinstance(d, list) and d and all(type(v) is int for v in d)]
    numel = [int(np.prod(d)) for d in dims]
    fits: dict[tuple[int, int], int] = {}  # (N, K) -> M
    for i, w in enumerate(dims):
        if len(w) != 2 or min(w) < 2:
            continue
        n, k = w if transposed else w[::-1]
        if k < MIN_IN_FEATURES:
            continue
        for j, out in enumerate(dims):
            m = numel[j] // n
            if (j != i and out[-1] == n and m >= 1 and m * n == numel[j]
                    and any(x not in (i, j) and numel[x] in (m * k, 2 * m * k)
                            for x in range(len(dims)))):
                fits[(n, k)] = m
                break
    if len(fits) != 1:
        return None
    (n, k), m = next(iter(fits.items()))
    shape = [n, k] if transposed else [k, n]
    weights = sum(d == shape for d in dims)
    if not any(numel[x] in (m * k, 2 * m * k) and d != shape for x, d in enumerate(dims)):
        weights -= 1  # (one of them is the input: an activation [M, K] of the weight's shape)
    return FusedGemm(m, k, n * weights, weights)


# ----------------------------------------------------------------------------------------------
# What a bare kernel (a CUDA/HIP-graph replay, no op around it) runs
# ----------------------------------------------------------------------------------------------
# a GEMM's second kernel, which joins the one before it: split-K reductions, and the reduction
# of cuBLAS's dot-product GEMV (an N = 1 GEMM such as a shared expert's gate: dot_kernel, then
# reduce_1Block_kernel<..., cublasGemvTensorStridedBatched<...>>)
GEMM_SECOND_KERNEL = re.compile(r"splitKreduce|splitK_?[Rr]educe|ReduceSplitK|reduce_splitk|"
                               r"reduce_1Block_kernel.*cublas")

# Kernel name -> the ATen or engine op it runs (first match wins), for what the families and
# roles above do not say: ATen's functors (the op a norm, RoPE or dispatch is built of), the
# MoE engine ops naming.py names by their op, the fp32 SIMT GEMM of RoPE's table (no weight)
# and torch's grouped-GEMM set-up (which joins the GEMM after it, like a memset). Weight GEMMs
# and attention come from the roles (attribution/graphs.py's `kernel_ops`).
GROUPED_GEMM_PREPARE = "grouped_gemm_prepare"
FP32_GEMM = "fp32_gemm"
KERNEL_OPS: tuple[tuple[re.Pattern, str], ...] = tuple((re.compile(rx), op) for rx, op in (
    (r"simt_sgemm|_sgemm_", FP32_GEMM),  # fp32 SIMT GEMM: RoPE's inv_freq x positions
    (r"prepare_grouped_gemm", GROUPED_GEMM_PREPARE),
    (r"topkGatingSoftmax|moeTopK|moeSoftmax", "_moe_C::topk_softmax"),
    (r"moe_align_block_size|count_and_sort_expert_tokens", "_moe_C::moe_align_block_size"),
    (r"moe_sum_kernel", "_moe_C::moe_sum"),
    (r"gatherTopK|sbtopk|mbtopk", "aten::topk"),
    (r"bitonicSort|radixSort|RadixSort|segmented_sort", "aten::sort"),
    (r"kernelHistogram1D", "aten::histc"),
    (r"DeviceScan|tensor_kernel_scan", "aten::cumsum"),
    (r"arange_cuda_out", "aten::arange"),
    (r"indexSelect|(?<!rotary_)embedding", "aten::embedding"),
    (r"index_copy_kernel", "aten::index_copy_"),
    (r"index_put_kernel", "aten::index_put_"),
    (r"index_kernel_impl|vectorized_gather_kernel", "aten::index"),
    (r"CatArrayBatchedCopy", "aten::cat"),
    (r"MeanOps", "aten::mean"),
    (r"pow_tensor_scalar|pow_kernel", "aten::pow"),
    (r"rsqrt_kernel", "aten::rsqrt"),
    (r"silu_kernel", "aten::silu"),
    (r"sigmoid_kernel", "aten::sigmoid"),
    (r"gelu_kernel", "aten::gelu"),
    (r"neg_kernel", "aten::neg"),
    (r"cos_kernel", "aten::cos"),
    (r"sin_kernel", "aten::sin"),
    (r"CUDAFunctor_add|CUDAFunctorOnSelf_add|AddFunctor", "aten::add"),
    (r"MulFunctor", "aten::mul"),
    (r"copy_kernel", "aten::_to_copy"),
    (r"ArgMaxOps", "aten::argmax"),
    (r"softmax", "aten::_softmax"),
    (r"sum_functor", "aten::sum"),
))
