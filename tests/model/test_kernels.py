"""The kernel-family registry (model/kernels.py): every family against real kernel names.

Names marked (trace) are copied from the committed traces (sample_traces/, and the MI300X
serving traces of ../shared/traces/ from TraceLens's test data); (doc) ones from the library's
source or documentation, where no committed trace holds one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from trace_roofline import load_trace
from trace_roofline.model import kernels

EXAMPLES: dict[str, list[str]] = {
    "runtime_memcpy": ["Memcpy DtoD (Device -> Device)", "Memset (Device)",  # (trace)
                       "Memcpy HtoD (Pageable -> Device)"],
    "inductor_pointwise": [  # (trace): the fused op list mentions attention, bmm, index_copy
        "triton_poi_fused__scaled_dot_product_cudnn_attention__to_copy__unsafe_view_add_arange_"
        "bmm_cat_clone_cos_expand_le_mul_neg_scalar_tensor_sin_slice_transpose_unsqueeze_view_"
        "where_5",
        "triton_poi_fused__to_copy_add_arange_bmm_cat_cos_index_copy_mul_neg_sin_slice_"
        "transpose_unsqueeze_view_3",
        "triton_poi_fused__unsafe_view_mul_silu_9"],
    "inductor_reduction": ["triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0",  # (trace)
                           "triton_per_fused__softmax_0"],  # (doc)
    "inductor_flex_attention": ["triton_tem_fused_flex_attention_0",  # (doc)
                                "triton_tem_fused_flex_attention_backward_1"],
    # (sample_traces/families_h200/mixtral_max-autotune_h200)
    "inductor_grouped_mm_template": [
        "triton_tem_fused__grouped_mm__to_copy__unsafe_view_add_embedding_mean_mul_pow_rsqrt_t_"
        "view_9"],
    "inductor_mm_template": ["triton_tem_fused_mm_0", "triton_tem_fused_addmm_1",  # (doc)
                             "triton_tem_fused_bmm_2", "triton_tem_fused__unsafe_view_mm_5",
                             "triton_tem_fused__scaled_mm_0"],
    "inductor_conv_template": ["triton_tem_fused_convolution_0"],  # (doc)
    "pytorch_flash": ["void pytorch_flash::flash_fwd_kernel<pytorch_flash::Flash_fwd_kernel_"
                      "traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>, false>"],  # (doc)
    "flash_attention_combine": ["void flash::flash_fwd_splitkv_combine_kernel<Flash_fwd_kernel_"
                                "traits<128, 64, 128, 4>, 16, 6, true>(Flash_fwd_params)"],  # (doc)
    "flash_attention": [
        "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::"
        "CollectiveMainloopFwdSm90<2, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >>>>",  # (trace)
        "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, false>",  # (doc)
        "void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4>, true>"],
    "cudnn_sdpa_reduce": ["void cudnn::fusion::lean_reduction_kernel<false, false, false>(void*, "
                          "float*, float*)"],  # (trace)
    "cudnn_sdpa": ["cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_"
                   "4x1x1_cga1x1x1_kernel0_0"],  # (trace)
    "mem_efficient_attention": ["fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::"
                                "AttentionKernel<cutlass::bfloat16_t, cutlass::arch::Sm80>)"],  # (doc)
    "ck_fmha_combine": ["ck_tile::kentry<FmhaFwdSplitKVCombineKernel<...>>"],  # (doc)
    "ck_fmha": ["_ZN7ck_tile6kentryILi2ENS_38FmhaBatchPrefillWithPagedKVCacheKernelINS_40Block"
                "FmhaBatchPrefillPipelineQRKSVSAsyncINS_36BlockFmhaBatchPrefillPipelineProblem",  # (trace)
                "aiter::mha_batch_prefill"],  # (trace: the op that launches it)
    "trtllm_fmha": [  # (doc: FlashInfer's trtllm-gen cubins)
        "fmhaSm100fKernel_QkvBfloat16OBfloat16H64PagedKvCausalP64VarSeqQ128Kv128PersistentContext"],
    "flashinfer_merge": ["void flashinfer::MergeStatesKernel<8, 16, 4, __nv_bfloat16>"],  # (doc)
    "flashinfer_attention": [  # (doc)
        "void flashinfer::BatchDecodeWithPagedKVCacheKernel<PosEncodingMode::kNone, 2, 4, 8>",
        "void flashinfer::BatchPrefillWithPagedKVCacheKernel<KernelTraits<MaskMode::kCausal>>"],
    "paged_attention_reduce": [  # (trace)
        "void paged_attention_ll4mi_reduce_kernel<__hip_bfloat16, __hip_bfloat16, 128, 128, 256, "
        "3, false>(__hip_bfloat16*, float const*)"],
    "paged_attention": [  # (trace)
        "void paged_attention_ll4mi_QKV_mfma16_kernel<0, __hip_bfloat16, __hip_bfloat16, "
        "(vllm::Fp8KVCacheDataType)0, 1, 128, 256, false, 4, 1>"],
    "vllm_unified_attention_reduce": ["reduce_segments"],  # (trace)
    "vllm_unified_attention": ["kernel_unified_attention_2d", "kernel_unified_attention_3d"],
    "sglang_triton_attention_reduce": ["_fwd_kernel_stage2"],  # (doc)
    "sglang_triton_attention": ["_fwd_grouped_kernel_stage1"],  # (doc)
    "kv_cache_write": [  # (trace)
        "void vllm::reshape_and_cache_flash_kernel<__hip_bfloat16, __hip_bfloat16, "
        "(vllm::Fp8KVCacheDataType)0>(__hip_bfloat16 const*)",
        "void (anonymous namespace)::store_kvcache<2048l, 4, false, long>((anonymous namespace)::"
        "StoreKVCacheParams)",
        "void vllm::reshape_and_cache_kernel<__nv_bfloat16>"],  # (doc)
    "fused_add_rmsnorm": [  # (trace)
        "_ZN5aiter24add_rmsnorm_quant_kernelIDF16bDF16bLi256ELi16ELb1ELb0ELb1ELi1EEEvPT0_PT_PfS4_"
        "S4_S4_diiiiiiib",
        "void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(c10::BFloat16*, c10::BFloat16*)"],
    "ck_rmsnorm": ["_ZN7ck_tile6kentryILi1ENS_12Rmsnorm2dFwdINS_27Rmsnorm2dFwdPipelineOnePassINS_"
                   "27Rmsnorm2dFwdPipelineProblemIDF16bDF16bfDF16b"],  # (trace)
    "rmsnorm": ["void vllm::rms_norm_kernel<c10::BFloat16>(c10::BFloat16*, c10::BFloat16 const*)",
                "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, "
                "float>(int, float, float const*)"],  # (doc)
    "rotary_embedding": ["void rotary_embedding_kernel<c10::BFloat16, true>(long const*, "
                         "c10::BFloat16*)",  # (trace)
                         "void vllm::rotary_embedding_kernel<c10::BFloat16, true>(long const*)"],
    "fp8_quant": ["void vllm::scaled_fp8_quant_kernel<c10::BFloat16, c10::Float8_e4m3fn>",  # (doc)
                  "void vllm::dynamic_per_token_scaled_fp8_quant_kernel<c10::BFloat16>"],
    "fused_moe_triton": ["fused_moe_kernel"],  # (trace)
    "triton_kernels_matmul_ogs": ["_matmul_ogs_NNT_bf16xbf16xmxfp4_16x128x256x1_swiglu",  # (trace)
                                  "_matmul_ogs_NNT_bf16xbf16xmxfp4_16x128x256x1"],
    "triton_kernels_finalize": ["_finalize_matmul_scatter_bf16"],  # (trace)
    "triton_kernels_routing": ["_topk_forward", "_combined_routing_compute",  # (trace)
                               "_combined_routing_memset", "_sum_bitmatrix_rows"],
    "trtllm_moe_gemm": ["bmm_Bfloat16_MxE2m1MxE4m3_Fp32_t128x8x512_s3_et128x8_m128x8x32_cga1x1x1_"
                        "16dp256b_TN_transOut_schedS_bN_sm100a"],  # (doc, a B200 trace)
    "trtllm_moe_routing": ["void moe::dev::routing::routingRenormalize::"
                           "routingIndicesClusterKernel<KernelParams>"],  # (doc)
    "trtllm_moe_finalize": ["void moe::dev::finalize::finalizeKernel<KernelParams>"],  # (doc)
    "vllm_moe_routing": [  # (trace)
        "void vllm::moe::topkGatingSoftmax<4, 8, 4, 16, 32, int>(float const*, bool const*)",
        "void vllm::moe::moe_align_block_size_kernel<int>(int const*, int*)",
        "void vllm::moe::count_and_sort_expert_tokens_kernel<int>(int const*, int*)"],
    "vllm_moe_sum": ["void vllm::moe::moe_sum_kernel<c10::BFloat16, 2>(c10::BFloat16*)"],  # (trace)
    "torch_grouped_gemm": [  # (trace)
        "void at::cuda::detail::prepare_grouped_gemm_data<cutlass::bfloat16_t, cutlass::bfloat16_t>",
        "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13"
        "GemmUniversalINS5_17GroupProblemShapeIN4cute5tupleIJiiiEEEEE"],
    "nccl_rccl": ["ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
                  "ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclWorkElem)"],  # (trace, doc)
    "custom_all_reduce": ["void vllm::cross_device_reduce_1stage<__nv_bfloat16, 2>(...)",  # (doc)
                          "void c10d::symmetric_memory::multimem_all_reduce_kernel<bf16, 16>",
                          "void c10d::symmetric_memory::one_shot_all_reduce_kernel<bf16, 8>"],
    "act_and_mul": [  # (trace)
        "_ZN7sgl_hip10activation18act_and_mul_kernelI14__hip_bfloat16TnPFT_RKS3_EXadL_Z4siluIS2_"
        "ES3_S5_EEEEvPS3_PS4_i",
        "void vllm::act_and_mul_kernel<c10::BFloat16, &(c10::BFloat16 vllm::silu_kernel"
        "<c10::BFloat16>(c10::BFloat16 const&)), true>(c10::BFloat16*)"],
    "scaled_mm": ["sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_warpgroupsize1x1x1_"
                  "execute_segment_k_off_kernel__5x_cublas",  # (doc: torch._scaled_mm)
                  "void cutlass_scaled_mm_sm90<...>"],
    "cublas_gemv": [  # (trace)
        "std::enable_if<true, void>::type internal::gemvx::kernel<int, int, __nv_bfloat16, "
        "__nv_bfloat16, __nv_bfloat16, float, true, true, true, false, 7, false>",
        "void dot_kernel<float, 128, 0, cublasDotParams<cublasGemvTensorStridedBatched<"
        "__nv_bfloat16 const>, cublasGemvTensorStridedBatched<float> > >"],
    "cublas_splitk_reduce": ["void cublasLt::splitKreduce_kernel<32, 16, int, float, "
                             "__nv_bfloat16, float>(cublasLt::cublasSplitKParams<float>)"],
    "cublaslt_nvjet": ["nvjet_sm90_tst_64x8_64x16_4x1_v_bz_splitK_TNT",  # (trace)
                       "nvjet_sm90_hsh_192x8_64x8_4x1_v_bz_TNT"],
    "cublas_xmma": ["sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize"
                    "1x1x1_execute_segment_k_off_kernel__5x_cublas",  # (doc)
                    "sm80_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize96x128x32_stage4_warpsize"
                    "2x2x1_tensor16x8x16_kernel"],
    "cublas_legacy": ["ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn"],  # (doc)
    "cutlass_gemm": ["void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_bf16_64x64_64x4_"
                     "tn_align2>(cutlass_80_tensorop_bf16_s16816gemm_bf16_64x64_64x4_tn_align2::"
                     "Params)",  # (trace)
                     "void cutlass::Kernel2<cutlass_80_simt_sgemm_128x32_8x5_nn_align1>"],
    "hipblaslt_tensile": ["Cijk_Alik_Bljk_BBS_BH_Bias_HA_S_SAV_UserArgs_MT128x256x32_MI16x16x1_SN_"
                          "LDSB1_AFC1_AFEM1"],  # (trace)
    "ck_gemm": ["aiter::gemm_a16w16"],  # (trace: the op)
    "triton_matmul": ["matmul_kernel", "_matmul_kernel_persistent"],  # (doc: Triton tutorials)
    "gemm_other": ["void gemm_kernel_bf16<128>"],  # (doc)
    "torch_loss": ["void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d"
                   "<float, float, long>(float*, float*)"],  # (doc)
    "torch_optimizer": ["void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::"
                        "native::(anonymous namespace)::FusedAdamMathFunctor<float, 4>>"],  # (doc)
    "sampling": [  # (trace)
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps"
        "<float>, unsigned int, long, 4, 4> >",
        "void at::native::(anonymous namespace)::distribution_elementwise_grid_stride_kernel<float,"
        " 4>",  # (doc: multinomial's exponential draw)
        "void flashinfer::sampling::TopKTopPSamplingFromProbKernel<1024>"],
    "torch_softmax": ["void (anonymous namespace)::softmax_warp_forward<float, float, float, 10, "
                      "false, false>(float*, float const*, int, int, int)",  # (trace)
                      # cross-entropy's and beam search's log-softmax (doc)
                      "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, "
                      "float, float, at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>"],
    "rocprim": ["void rocprim::ROCPRIM_400200_NS::detail::trampoline_kernel<rocprim::ROCPRIM_400200_"
                "NS::detail::wrapped_scan_config<rocprim::ROCPRIM_400200_NS::default_config, long>"],
    "cub": ["void at_cuda_detail::cub::detail::scan::DeviceScanKernel<at_cuda_detail::cub::detail::"
            "scan::policy_hub<int, int, int, unsigned int, std::plus<int> >::Policy1000>"],  # (trace)
    "torch_sort_topk": [  # (trace)
        "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(at::cuda::detail::"
        "TensorInfo<float const, unsigned int>)",
        "void at::native::bitonicSortKVInPlace<2, -1, 16, 16, float, long>"],
    "torch_activation": ["void at::native::vectorized_elementwise_kernel<8, at::native::(anonymous "
                         "namespace)::silu_kernel(at::TensorIteratorBase&)>"],  # (trace)
    "torch_copy": [  # (trace)
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous "
        "namespace)::OpaqueType<2u>, unsigned int, 4, 64, 64>",
        "void at::native::index_elementwise_kernel<128, 4, at::native::index_copy_kernel_impl<at::"
        "native::OpaqueType<2> >(at::TensorIterator&, long, long, long)>"],
    "torch_reduce": ["void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native"
                     "::MeanOps<float, float, float, float>, unsigned int, float, 4, 4> >"],
    "torch_foreach": ["void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native"
                      "::(anonymous namespace)::TensorListMetadata<2>, at::native::(anonymous "
                      "namespace)::UnaryOpFunctor<long, 2, 1, 1>>"],  # (trace)
    "torch_elementwise": ["void at::native::vectorized_elementwise_kernel<8, at::native::"
                          "CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul> >"],  # (trace)
}


def test_every_family_has_an_example():
    assert set(EXAMPLES) == set(kernels.BY_FAMILY), set(kernels.BY_FAMILY) ^ set(EXAMPLES)


@pytest.mark.parametrize("family", sorted(EXAMPLES))
def test_family_examples(family: str):
    got = kernels.classify(pd.Series(EXAMPLES[family]))
    assert got["family"].astype(str).tolist() == [family] * len(EXAMPLES[family])
    assert set(got["role"].astype(str)) == {kernels.BY_FAMILY[family].role}


def test_roles_that_matter():
    """The distinctions naming relies on."""
    role = kernels.role_of
    assert role("triton_poi_fused__scaled_dot_product_cudnn_attention_add_cat_mul_neg_3") == \
        "elementwise"  # a pointwise kernel whose fused name mentions attention
    assert role("triton_tem_fused_addmm_3") == "gemm"
    assert role("_ZN5aiter24add_rmsnorm_quant_kernelIDF16bDF16b") == "fused_add_norm"  # not residual
    assert role("FmhaBatchPrefillWithPagedKVCacheKernel") == "attention"  # ck, before FlashInfer
    assert role("bmm_Bfloat16_MxE2m1_Fp32") == "moe_gemm"  # TRT-LLM experts, not a generic GEMM
    assert role("Cijk_Alik_Bljk_HHS_BH_MT128x128x32") == "gemm"
    assert set(kernels.GEMM_ROLES) == {"gemm", "moe_gemm"}


@pytest.mark.parametrize("name", ["my_custom_kernel", "compute_position_kernel", "", "cijk_lower"])
def test_unknown(name: str):
    assert kernels.role_of(name) == kernels.UNKNOWN
    assert kernels.family_of(name) == kernels.UNKNOWN


def test_categorical_classifies_categories(monkeypatch):
    """A categorical Series is classified once per category, not per row; missing is unknown."""
    seen = []
    real = kernels.family_index
    monkeypatch.setattr(kernels, "family_index", lambda d: seen.append(len(d)) or real(d))
    names = pd.Series(pd.Categorical(["nvjet_sm90_tst_64x8", "reduce_segments", None] * 10_000))
    got = kernels.classify(names)
    assert seen == [3]  # two categories and the missing value
    assert got["role"].astype(str).iloc[:3].tolist() == ["gemm", "attention_reduce", "unknown"]
    assert got.index.equals(names.index) and isinstance(got["role"].dtype, pd.CategoricalDtype)


def test_registry_is_a_table():
    assert all(isinstance(f, kernels.KernelFamily) for f in kernels.FAMILIES)
    assert {f.role for f in kernels.FAMILIES} <= set(kernels.ROLES)
    assert len({f.family for f in kernels.FAMILIES}) == len(kernels.FAMILIES)


def test_inductor_fuses():
    names = pd.Series(["triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0",
                       "triton_poi_fused__to_copy_add_arange_index_copy_transpose_view_4",
                       "aten::mean"])
    assert kernels.inductor_fuses(names, "norm").tolist() == [True, False, False]
    assert kernels.inductor_fuses(names, "store").tolist() == [False, True, False]


# Input Dims of max-autotune decode kernels (sample_traces/families_h200/qwen2_max-autotune_h200,
# Qwen2.5-7B widths: H 3584, kv 512, I 18944, vocab 152064) and the GEMM each runs (M, K, N)
FUSED_GEMMS = [
    ("final norm + lm_head", [[3584], [1, 1, 3584], [1, 3584], [1, 1, 1], [152064, 3584],
                              [1, 152064], [], []], (1, 3584, 152064)),
    ("act + down_proj", [[1, 18944], [1, 18944], [3584, 18944], [1, 3584], [], []],
     (1, 18944, 3584)),
    ("norm + gate and up", [[3584], [1, 1, 3584], [1, 1, 1], [18944, 3584], [18944, 3584],
                            [1, 18944], [1, 18944], [], []], (1, 3584, 2 * 18944)),
    ("k_proj (bias)", [[512], [1, 1, 3584], [512, 3584], [1, 512], [], [], []], (1, 3584, 512)),
    ("o_proj from the heads", [[1, 28, 1, 128], [3584, 3584], [1, 3584], [], []],
     (1, 3584, 3584)),
    ("o_proj + residual, the embedding recomputed", [[1, 28, 1, 128], [3584, 3584], [1, 1],
                                                     [152064, 3584], [1, 3584], [1, 3584],
                                                     [1, 1, 3584], [], []], (1, 3584, 3584)),
    ("Phi-3's act + down_proj: the input is the fused gate_up's output",
     [[1, 16384], [3072, 8192], [1, 3072], [], []], (1, 8192, 3072)),
    ("a prefill k_proj template: the input has the weight's shape",
     [[512], [512, 3584], [512, 3584], [512, 512]], (512, 3584, 512)),
    ("an embedding and a norm, no GEMM", [[1, 1], [152064, 3584], [1, 3584], [1, 3584], [3584],
                                          [1, 1, 3584], [], []], None),
    ("RoPE's table (an outer product, no weight)", [[1, 3584], [64], [1, 28, 1, 128], [], []],
     None),
]


@pytest.mark.parametrize("what, dims, gemm", FUSED_GEMMS, ids=[c[0] for c in FUSED_GEMMS])
def test_the_gemm_inside_an_inductor_kernel(what, dims, gemm):
    got = kernels.inductor_gemm(dims)
    assert (got if got is None else got[:3]) == gemm


def test_an_inductor_kernel_counts_the_weights_it_multiplies():
    """Gemma-2's k and v (4 kv heads x 256 = 1024 each) in one max-autotune decode kernel: N
    is their sum, 2048, which is also its q_proj's N; two weights say it is not q_proj."""
    kv = [[1, 1, 2304], [1024, 2304], [1024, 2304], [1, 1024], [1, 4, 1, 256], [], [], []]
    assert kernels.inductor_gemm(kv) == kernels.FusedGemm(1, 2304, 2048, weights=2)
    q = [[1, 1, 2304], [2048, 2304], [1, 2048], [], []]
    assert kernels.inductor_gemm(q) == kernels.FusedGemm(1, 2304, 2048, weights=1)
    gate_up = FUSED_GEMMS[2][1]
    assert kernels.inductor_gemm(gate_up).weights == 2
    assert kernels.inductor_gemm(FUSED_GEMMS[7][1]).weights == 1  # the input has its shape


SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"


@pytest.mark.parametrize("rel", [
    "cuda_graphs/hf-moe-qwen1.5-moe-a2.7b-2l_decode_b4_s512_static1024_batchedmm_graph_h200.json.gz",
    "cuda_graphs/hf-qwen2-qwen2.5-7b-2l_generate_b1_t512_n5_static_compiled-ro_h200.json.gz",
    "moe/synthetic_vllm_fused_moe_mixtral-8x7b-2l_decode_b8_s512.json.gz",
    "tp2/tp2-qwen2.5-7b-2l_decode_b8_s2048_h200/rank0.json.gz",
])
def test_committed_traces_classify(rel: str):
    """Every kernel of these committed traces has a family; their GEMM time is GEMM-family."""
    dev = load_trace(SAMPLES / rel).device
    got = kernels.classify(dev["name"])
    unknown = dev["name"][got["role"].astype(str).eq("unknown").to_numpy()]
    assert unknown.empty, sorted(set(unknown.astype(str)))[:5]
    assert np.isin(got["role"].astype(str), list(kernels.ROLES)).all()


@pytest.mark.parametrize("dims, want", [
    # Mixtral's experts: gate_up [E, 2I, H] and down [E, H, I] buffers (as [E, N, K])
    ([[2, 4096], [8, 28672, 4096], [8], [2, 28672], [], [], []], (2, 4096, 28672, 8)),
    ([[2, 14336], [8, 4096, 14336], [8], [2, 4096], [], [], []], (2, 14336, 4096, 8)),
    # gpt-oss keeps its gate_up as [E, H, 2I] (as [E, K, N])
    ([[4, 2880], [32, 2880, 5760], [32], [4, 5760], [], [], []], (4, 2880, 5760, 32)),
    ([[4, 2880], [8, 100, 7], [8], [4, 5760]], None),  # weights that fit neither
])
def test_the_grouped_gemm_of_an_inductor_template(dims, want):
    assert kernels.grouped_gemm(dims) == want


def test_a_grouped_gemm_prologue_is_no_fused_matmul():
    """`_grouped_mm` in a pointwise kernel's name (the experts' input gather) is no `mm`."""
    assert kernels.fused_gemm("triton_poi_fused__grouped_mm__to_copy_add_10",
                              [[2], [2], [1, 1, 4096], [2, 4096], []]) is None


def test_a_weight_read_as_k_by_n_without_a_transpose():
    """A kernel without `t` among its fused ops reads its weight as [K, N]: the same buffer,
    the other way round."""
    dims = [[1, 256], [256, 64], [1, 64]]
    assert kernels.inductor_gemm(dims, transposed=False) == (1, 256, 64, 1)
    assert kernels.inductor_gemm(dims) == (1, 64, 256, 1)  # (as [N, K]: another GEMM)
