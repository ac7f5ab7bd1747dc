"""A SYNTHETIC torch.profiler trace of vLLM's Triton fused-MoE form (issue 12), written from vLLM's
public source because vLLM does not run on this project's GPU image.

What it reproduces, and from where (vllm-project/vllm, files at the revisions in `SOURCES`):
- the op nesting of one MoE layer in an eager (enforce_eager) forward: the router GEMM
  (`aten::linear` > `aten::matmul` > `aten::mm`, a ReplicatedLinear H -> E), then
  `vllm::moe_forward(hidden [M, H], router_logits [M, E], str layer_name)` (layer.py) holding
  fused_topk's cast `aten::to` of the logits to fp32, `_moe_C::topk_softmax(topk_weights
  [M, k] fp32, topk_ids [M, k] int32, token_expert_indices [M, k] int32, gating [M, E] fp32)`,
  the renormalisation `aten::sum` + `aten::div` when the model renormalises (fused_moe.py
  vllm_topk_softmax), and `vllm::inplace_fused_experts(hidden [M, H], w1 [E, 2I, H],
  w2 [E, H, I], topk_weights, topk_ids, activation, bools, global_num_experts, None...)`
  (fused_moe.py) launching, in fused_experts_impl's order: `_moe_C::moe_align_block_size`
  (moe_align_block_size_small_batch_expert_kernel when topk_ids.numel() < 1024 and E <= 64,
  else moe_align_block_size_kernel + count_and_sort_expert_tokens_kernel; moe_align_sum_kernels.cu),
  the Triton `fused_moe_kernel` on w1 (a cuLaunchKernelEx driver launch with no cpu op of
  its own: its External id is the enclosing op's), `_C::silu_and_mul(out [M*k, I], in
  [M*k, 2I])`, `fused_moe_kernel` on w2, `_moe_C::moe_sum([M, k, H], [M, H])` (moe_sum_kernel
  <T, k> for k in 2..4, else at::sum_out: `aten::sum`). The `moe_forward` form (`--form
  moe_forward`, newer vLLM: the modular kernel launches the two Triton kernels directly under
  `vllm::moe_forward`, no `inplace_fused_experts` op) is the same without that wrapper.
- the top-k kernel's template arguments (topk_softmax_kernels.cu: topkGatingSoftmax<VPT, E,
  4, 16, 32, int> for a power-of-2 E <= 512, moeSoftmax<256> + moeTopK<256, int> otherwise), the
  fused kernel's grid (cdiv(EM, BLOCK_SIZE_M) x cdiv(N, BLOCK_SIZE_N), get_default_config:
  BLOCK_SIZE_M 16 / N 32 when M <= E, else 64 / 64; EM = M·k + E·(BLOCK_SIZE_M - 1)).
- how the profiler records a torch.library custom op's arguments (a `str` as type "" and
  dims [], None as "", bools and ints as "Scalar" with their value), checked by registering
  ops of these schemas with torch.library on CPU and profiling them (torch 2.13).
- the rest of an eager vLLM decoder layer: `_C::rms_norm` / `_C::fused_add_rms_norm`, the
  qkv / o linears, `_C::rotary_embedding`, `vllm::unified_attention_with_output` holding
  `_C_cache_ops::reshape_and_cache_flash` and `_vllm_fa3_C::fwd`; Qwen2-MoE's shared expert
  (gate_up, silu_and_mul, down), its sigmoid gate and the add of both outputs
  (qwen2_moe.py); embedding and the LM head on the sampled rows.
cuBLAS GEMM and aten kernel names are the ones the real H200 captures in sample_traces/moe
show for these shapes; vLLM kernel names are demangled from the csrc templates above.

What is NOT real: every duration. A kernel lasts 2 µs plus max(FLOPs / 600 TFLOP/s,
bytes / 3.3 TB/s) (about 70-75% of the H200's measured ceilings), its bytes from the
analytical minimum with the uniform-routing expectation of active experts (moe.py). Nothing
here was measured; the trace exercises recognition and costing, not timing.

    python3 -m workloads.synth_fused_moe --out sample_traces/moe
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from trace_roofline.files import write_files
from trace_roofline.model import moe

SOURCES = {  # vllm-project/vllm file -> the stored revision read for this script
    "vllm/model_executor/layers/fused_moe/fused_moe.py": "000d1458098ebf47491dad470d164d443ab18a9c",
    "vllm/model_executor/layers/fused_moe/layer.py": "0014ec6c58e1b74e660a1e6d059b5689716183ff",
    "csrc/moe/moe_align_sum_kernels.cu": "00e6fb6d7193804fd96d84c850fd6505574e8e0d",
    "csrc/moe/topk_softmax_kernels.cu": "0112cf233e0c60674c2844a09695ddeb2b901dc0",
}
BF, F32, I32, I64 = "c10::BFloat16", "float", "int", "long int"
PEAK, BANDWIDTH = 600e12, 3.3e12  # modelled rates (module docstring)
H200 = {"id": 0, "name": "NVIDIA H200", "totalGlobalMem": 150754820096, "computeMajor": 9,
        "computeMinor": 0, "numSms": 132, "warpSize": 32}

# kernel names (module docstring: real captures for cuBLAS/aten, vLLM's csrc for its own)
GEMM_DECODE = "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT"
GEMM_PREFILL = "nvjet_sm90_tst_128x128_64x6_2x1_v_bz_TNT"
CAST = ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda("
        "at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#7}::operator()() "
        "const::{lambda(float)#1}, std::array<char*, 2ul>, 4, TrivialOffsetCalculator<1, "
        "unsigned int>, TrivialOffsetCalculator<1, unsigned int>, at::native::memory::"
        "LoadWithCast<1>, at::native::memory::StoreWithCast<1> >")
SUM = ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::"
       "func_wrapper_t<float, at::native::sum_functor<float, float, float>::operator()("
       "at::TensorIterator&)::{lambda(float, float)#1}>, unsigned int, float, 4, 4> >")
DIV = ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<"
       "at::native::BinaryFunctor<float, float, float, at::native::binary_internal::"
       "DivFunctor<float> > > >")
ELEMENTWISE = "void at::native::vectorized_elementwise_kernel<8, {}, std::array<char*, 3ul> >"
EMBEDDING = ("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, "
             "long, unsigned int, 2, 2, -2, true>")
INDEX_SELECT = ("void at::native::(anonymous namespace)::indexSelectSmallIndex<c10::BFloat16, "
                "long, unsigned int, 2, 2, -2>")
RMS_NORM = ("void vllm::rms_norm_kernel<c10::BFloat16>(c10::BFloat16*, c10::BFloat16 const*, "
            "c10::BFloat16 const*, float, int, int)")
ADD_RMS_NORM = ("void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(c10::BFloat16*, "
                "c10::BFloat16*, c10::BFloat16 const*, float, int, int)")
ROTARY = ("void vllm::rotary_embedding_kernel<c10::BFloat16, true>(long const*, c10::BFloat16*, "
          "c10::BFloat16*, c10::BFloat16 const*, int, long, long, long, int, int, int)")
CACHE = ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, __nv_bfloat16, "
         "(vllm::Fp8KVCacheDataType)0>(__nv_bfloat16 const*, __nv_bfloat16 const*, "
         "__nv_bfloat16*, __nv_bfloat16*, long const*, long, long, long, long, long, int, int, "
         "int, float const*, float const*)")
FLASH = ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<"
         "flash::CollectiveMainloopFwdSm90<2, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >,"
         " cute::tuple<cute::C<128>, cute::C<128>, cute::C<128> >, 128, cutlass::bfloat16_t, "
         "float, cutlass::arch::Sm90, true, false, false, true, true, false, false, true, true, "
         "true, true, false, cutlass::bfloat16_t, 1> > > >")
SILU_AND_MUL = ("void vllm::act_and_mul_kernel<c10::BFloat16, &(c10::BFloat16 vllm::silu_kernel"
                "<c10::BFloat16>(c10::BFloat16 const&)), true>(c10::BFloat16*, "
                "c10::BFloat16 const*, int)")
ALIGN_SMALL = ("void vllm::moe::moe_align_block_size_small_batch_expert_kernel<int>(int const*,"
               " int*, int*, int*, int, int, unsigned long, int)")
ALIGN = ("void vllm::moe::moe_align_block_size_kernel<int>(int const*, int*, int*, int*, int, "
         "int, int, int, unsigned long, int*, int)")
COUNT_SORT = ("void vllm::moe::count_and_sort_expert_tokens_kernel<int>(int const*, int*, int*,"
              " unsigned long, int)")
MOE_SUM = "void vllm::moe::moe_sum_kernel<c10::BFloat16, {k}>(c10::BFloat16*, c10::BFloat16 const*, int)"
SOFTMAX_TOPK = ("void vllm::moe::topkGatingSoftmax<{vpt}, {e}, 4, 16, 32, int>(float const*, "
                "bool const*, float*, int, int*, int*, int, int, int)")
MOE_SOFTMAX = "void vllm::moe::moeSoftmax<256>(float const*, bool const*, float*, int)"
MOE_TOPK = ("void vllm::moe::moeTopK<256, int>(float const*, bool const*, float*, int*, int*, "
            "int, int, int, int)")
SIGMOID = ("void at::native::vectorized_elementwise_kernel<4, at::native::sigmoid_kernel_cuda("
           "at::TensorIteratorBase&)::{lambda()#2}::operator()() const::{lambda()#3}::operator()"
           "() const::{lambda(c10::BFloat16)#1}, std::array<char*, 2ul> >")


@dataclass(frozen=True)
class Shape:
    """The model (checkpoint config.json values) and the forward (tokens M, context S)."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: moe.Experts
    qkv_bias: bool
    renormalize: bool


MIXTRAL = Shape("mixtral-8x7b", 4096, 32, 8, 128, 32000, moe.Experts(8, 2, 14336), False, True)
QWEN_MOE = Shape("qwen1.5-moe-a2.7b", 2048, 16, 16, 128, 151936,
                 moe.Experts(60, 4, 1408, shared_intermediate_size=5632, shared_gate=True,
                             norm_topk_prob=False), True, False)


def _dur(flops: float, nbytes: float) -> float:
    return round(2.0 + max(flops / PEAK, nbytes / BANDWIDTH) * 1e6, 3)


class Writer:
    """A Kineto (torch.profiler Chrome trace) event writer: cpu ops nest by time on one thread;
    a kernel is launched by the innermost open op (cudaLaunchKernel, or cuLaunchKernelEx for
    Triton) with an ac2g flow; the GPU runs one stream in launch order."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.cpu = 1_000_000.0
        self.gpu = 1_000_000.0
        self.ext = 0
        self.corr = 1000
        self.open: list[int] = []

    def _tick(self, dt: float) -> float:
        self.cpu = round(self.cpu + dt, 3)
        return self.cpu

    @contextmanager
    def op(self, name: str, dims: list, types: list, concrete: list | None = None,
           cat: str = "cpu_op") -> Iterator[None]:
        """A cpu op (aten or custom) with Input Dims / Input type / Concrete Inputs."""
        self.ext += 1
        args = {"External id": self.ext, "Record function id": 0, "Input Dims": dims,
                "Input type": types, "Concrete Inputs": concrete or [""] * len(dims),
                "Input Strides": [_strides(d) if t in (BF, F32, I32, I64) else []
                                  for d, t in zip(dims, types, strict=True)]}
        ev = {"ph": "X", "cat": cat, "name": name, "pid": 4242, "tid": 4242,
              "ts": self._tick(1.0), "args": args}
        self.events.append(ev)
        self.open.append(self.ext)
        yield
        self.open.pop()
        ev["dur"] = round(self._tick(1.0) - ev["ts"], 3)

    @contextmanager
    def step(self, n: int) -> Iterator[None]:
        self.ext += 1
        ev = {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "pid": 4242,
              "tid": 4242, "ts": self._tick(1.0), "args": {"External id": self.ext}}
        self.events.append(ev)
        yield
        ev["dur"] = round(max(self._tick(1.0), self.gpu) - ev["ts"], 3)

    def kernel(self, name: str, flops: float, nbytes: float, grid: tuple = (1, 1, 1),
               block: tuple = (128, 1, 1), triton: bool = False) -> None:
        self.corr += 1
        launch = self._tick(3.0)
        ext = self.open[-1]
        self.events.append({
            "ph": "X", "cat": "cuda_driver" if triton else "cuda_runtime",
            "name": "cuLaunchKernelEx" if triton else "cudaLaunchKernel", "pid": 4242,
            "tid": 4242, "ts": launch, "dur": 2.5,
            "args": {"External id": ext, "correlation": self.corr}})
        self.events.append({"ph": "s", "cat": "ac2g", "name": "ac2g", "id": self.corr,
                            "pid": 4242, "tid": 4242, "ts": launch})
        start = round(max(self.gpu, launch + 4.0), 3)
        dur = _dur(flops, nbytes)
        self.gpu = round(start + dur + 1.0, 3)
        self.events.append({
            "ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": start, "dur": dur,
            "args": {"External id": ext, "device": 0, "context": 1, "stream": 7,
                     "correlation": self.corr, "grid": list(grid), "block": list(block)}})
        self.events.append({"ph": "f", "cat": "ac2g", "name": "ac2g", "id": self.corr,
                            "pid": 0, "tid": 7, "ts": start, "bp": "e"})
        self._tick(1.0)


def _strides(dims: list) -> list:
    out, acc = [], 1
    for d in reversed(dims):
        out.insert(0, acc)
        acc *= d
    return out


def linear(w: Writer, m: int, k: int, n: int, bias: bool, prefill: bool) -> None:
    """F.linear as recorded: linear > matmul > mm (addmm with a bias), one cuBLAS kernel."""
    kern = GEMM_PREFILL if prefill else GEMM_DECODE
    flops, nbytes = 2.0 * m * k * n, (m * k + k * n + m * n + (n if bias else 0)) * 2.0
    with w.op("aten::linear", [[m, k], [n, k], [n] if bias else []], [BF, BF, BF if bias else ""]):
        if bias:
            with w.op("aten::addmm", [[n], [m, k], [k, n], [], []], [BF, BF, BF, "Scalar", "Scalar"],
                      ["", "", "", "1", "1"]):
                w.kernel(kern.replace("_bz_", "_bz_bias_"), flops, nbytes)
            return
        with w.op("aten::matmul", [[m, k], [k, n]], [BF, BF]), \
                w.op("aten::mm", [[m, k], [k, n]], [BF, BF]):
            w.kernel(kern, flops, nbytes)


def norm(w: Writer, m: int, h: int, first: bool) -> None:
    if first:
        with w.op("_C::rms_norm", [[m, h], [m, h], [h], []], [BF, BF, BF, "Scalar"],
                  ["", "", "", "1e-05"]):
            w.kernel(RMS_NORM, 4.0 * m * h, 3.0 * m * h * 2)
        return
    with w.op("_C::fused_add_rms_norm", [[m, h], [m, h], [h], []], [BF, BF, BF, "Scalar"],
              ["", "", "", "1e-05"]):
        w.kernel(ADD_RMS_NORM, 5.0 * m * h, 4.0 * m * h * 2)


def fa3_args(tokens: int, seqs: int, max_k: int, heads: tuple[int, int, int],
             causal: str = "True") -> tuple[list, list, list]:
    """(Input Dims, Input type, Concrete Inputs) of `_vllm_fa3_C::fwd`'s 35 arguments as vLLM's
    FlashAttentionImpl passes them (vllm-project/flash-attention hopper/flash_api_torch_lib.cpp):
    q [tokens, n_q, d], the paged caches [pages, 16, n_kv, d], out, cu_seqlens_q [seqs + 1],
    seqused_k [seqs], max_seqlen_q, max_seqlen_k, page_table [seqs, pages], softmax_scale,
    is_causal, ...; `heads` is (n_q, n_kv, d)."""
    n_q, n_kv, d = heads
    cache = [seqs * max_k // 16 + 8, 16, n_kv, d]
    dims = [[tokens, n_q, d], cache, cache, [], [], [], [tokens, n_q, d], [seqs + 1], [], [],
            [], [seqs], [], [], [seqs, max_k // 16], *[[]] * 20]
    types = [BF, BF, BF, "", "", "", BF, I32, "", "", "", I32, "Scalar", "Scalar", I32,
             *[""] * 9, "Scalar", "Scalar", "Scalar", "Scalar", "Scalar", "Scalar", "",
             "Scalar", "", "Scalar", ""]
    concrete = [""] * 12 + [str(tokens // seqs), str(max_k), ""] + [""] * 9 + [
        str(d ** -0.5), causal, "-1", "-1", "0.0", "False", "", "0", "", "0", ""]
    return dims, types, concrete


def attention(w: Writer, s: Shape, m: int, seqs: int, context: int, prefill: bool) -> None:
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    blocks = seqs * math.ceil(context / 16)
    with w.op("_C::rotary_embedding", [[m], [m, q], [m, kv], [], [32768, s.head_dim], []],
              [I64, BF, BF, "Scalar", BF, "Scalar"], ["", "", "", str(s.head_dim), "", "True"]):
        w.kernel(ROTARY, 3.0 * m * (q + kv), 2.0 * m * (q + kv) * 2)
    cache = [blocks, 16, s.kv_heads, s.head_dim]
    with w.op("vllm::unified_attention_with_output",
              [[m, s.heads, s.head_dim], [m, s.kv_heads, s.head_dim],
               [m, s.kv_heads, s.head_dim], [m, s.heads, s.head_dim], [], []],
              [BF, BF, BF, BF, "", ""]):
        with w.op("_C_cache_ops::reshape_and_cache_flash",
                  [[m, s.kv_heads, s.head_dim], [m, s.kv_heads, s.head_dim], cache, cache, [m],
                   [], [], []], [BF, BF, BF, BF, I64, "", F32, F32], ["", "", "", "", "", "auto",
                                                                      "", ""]):
            w.kernel(CACHE, 0.0, 4.0 * m * kv * 2)
        with w.op("_vllm_fa3_C::fwd",
                  *fa3_args(m, seqs, context, (s.heads, s.kv_heads, s.head_dim))):
            pairs = m * context / (2 if prefill else 1)
            w.kernel(FLASH, 4.0 * s.heads * s.head_dim * pairs,
                     2.0 * (2 * m * q + 2 * seqs * context * kv),
                     grid=(math.ceil(m / 128), s.heads, 1), block=(384, 1, 1))


def shared_expert(w: Writer, s: Shape, m: int, prefill: bool) -> None:
    """Qwen2-MoE's shared expert (vLLM: MergedColumnParallelLinear gate_up, SiluAndMul,
    RowParallelLinear down) and its gate's linear H -> 1 (applied after, as sigmoid · out)."""
    h, i = s.hidden, s.experts.shared_intermediate_size
    linear(w, m, h, 2 * i, False, prefill)
    with w.op("_C::silu_and_mul", [[m, i], [m, 2 * i]], [BF, BF]):
        w.kernel(SILU_AND_MUL, 5.0 * m * i, 3.0 * m * i * 2)
    linear(w, m, i, h, False, prefill)
    linear(w, m, h, 1, False, prefill)
    with w.op("aten::sigmoid", [[m, 1]], [BF]):
        w.kernel(SIGMOID, 3.0 * m, 2.0 * m * 2)
    with w.op("aten::mul", [[m, 1], [m, h]], [BF, BF]):
        w.kernel(ELEMENTWISE.format("at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, "
                                    "c10::BFloat16, at::native::binary_internal::MulFunctor<float> >"),
                 m * h, 2.0 * (2 * m * h + m))


def topk(w: Writer, s: Shape, m: int) -> None:
    """fused_topk: the fp32 cast of the logits, topk_softmax, the renormalisation."""
    e, k = s.experts.num_experts, s.experts.top_k
    with w.op("aten::to", [[m, e], [], [], [], []], [BF, "Scalar", "Scalar", "Scalar", ""],
              ["", "6", "False", "False", ""]), \
            w.op("aten::_to_copy", [[m, e], [], [], [], [], [], []],
                 [BF, "Scalar", "", "", "", "Scalar", ""], ["", "6", "", "", "", "False", ""]), \
            w.op("aten::copy_", [[m, e], [m, e], []], [F32, BF, "Scalar"], ["", "", "False"]):
        w.kernel(CAST, 0.0, 6.0 * m * e)
    with w.op("_moe_C::topk_softmax", [[m, k], [m, k], [m, k], [m, e]], [F32, I32, I32, F32]):
        if e & (e - 1) == 0 and e <= 512:  # topkGatingSoftmaxLauncherHelper's constants
            vpt = max(1, e // (4 * 32)) * 4
            w.kernel(SOFTMAX_TOPK.format(vpt=vpt, e=e), 5.0 * m * e, 4.0 * (m * e + 3 * m * k))
        else:
            w.kernel(MOE_SOFTMAX, 5.0 * m * e, 8.0 * m * e, grid=(m, 1, 1), block=(256, 1, 1))
            w.kernel(MOE_TOPK, m * e * k, 4.0 * (m * e + 3 * m * k), grid=(m, 1, 1),
                     block=(256, 1, 1))
    if s.renormalize:
        with w.op("aten::sum", [[m, k], [], [], []], [F32, "ScalarList", "Scalar", ""],
                  ["", "[-1]", "True", ""]):
            w.kernel(SUM, m * k, 4.0 * (m * k + m))
        with w.op("aten::div", [[m, k], [m, 1]], [F32, F32]):
            w.kernel(DIV, m * k, 4.0 * (2 * m * k + m))


def fused_experts(w: Writer, s: Shape, m: int, wrapped: bool) -> None:
    """fused_experts_impl: moe_align_block_size, fused_moe_kernel(w1), silu_and_mul,
    fused_moe_kernel(w2), moe_sum; inside `vllm::inplace_fused_experts` when `wrapped`."""
    h, ex = s.hidden, s.experts
    e, k, i = ex.num_experts, ex.top_k, ex.intermediate_size
    rows = m * k
    active = moe.expected_active_experts(e, k, m)
    block_m, block_n = (16, 32) if m <= e else (64, 64)
    em = rows + e * (block_m - 1)
    args = ([[m, h], [e, 2 * i, h], [e, h, i], [m, k], [m, k], [], *[[]] * 7, *[[]] * 8],
            [BF, BF, BF, F32, I32, "", *["Scalar"] * 7, *[""] * 8],
            ["", "", "", "", "", "", *["False"] * 6, "-1", *[""] * 8])
    with (w.op("vllm::inplace_fused_experts", *args) if wrapped else _nothing()):
        with w.op("_moe_C::moe_align_block_size",
                  [[m, k], [], [], [em], [math.ceil(em / block_m)], [1]],
                  [I32, "Scalar", "Scalar", I32, I32, I32], ["", str(e), str(block_m), "", "", ""]):
            if rows < 1024 and e <= 64:
                w.kernel(ALIGN_SMALL, 0.0, 4.0 * (rows + em + em / block_m + 1),
                         block=(max(e, 32), 1, 1))
            else:
                w.kernel(ALIGN, 0.0, 4.0 * (rows + em + em / block_m + 1), block=(1024, 1, 1))
                w.kernel(COUNT_SORT, 0.0, 8.0 * rows, grid=(math.ceil(rows / 256), 1, 1),
                         block=(256, 1, 1))
        grid = (math.ceil(em / block_m) * math.ceil(2 * i / block_n), 1, 1)
        w.kernel("fused_moe_kernel", moe.gate_up_flops(rows, h, i),
                 moe.gate_up_bytes(rows, h, i, active, 2), grid, triton=True)
        with w.op("_C::silu_and_mul", [[rows, i], [rows, 2 * i]], [BF, BF]):
            w.kernel(SILU_AND_MUL, 5.0 * rows * i, 3.0 * rows * i * 2)
        grid = (math.ceil(em / block_m) * math.ceil(h / block_n), 1, 1)
        w.kernel("fused_moe_kernel", moe.down_flops(rows, h, i),
                 moe.down_bytes(rows, h, i, active, 2), grid, triton=True)
        if 2 <= k <= 4:
            with w.op("_moe_C::moe_sum", [[m, k, h], [m, h]], [BF, BF]):
                w.kernel(MOE_SUM.format(k=k), rows * h, 2.0 * (rows * h + m * h))
        else:  # at::sum_out over top-k
            with w.op("aten::sum", [[m, k, h], [], [], [], [m, h]],
                      [BF, "ScalarList", "Scalar", "", BF], ["", "[1]", "False", "", ""]):
                w.kernel(SUM, rows * h, 2.0 * (rows * h + m * h))


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def moe_layer(w: Writer, s: Shape, m: int, prefill: bool, form: str) -> None:
    h, e = s.hidden, s.experts.num_experts
    if s.experts.shared_intermediate_size:
        shared_expert(w, s, m, prefill)
    linear(w, m, h, e, False, prefill)  # the router (gate)
    with w.op("vllm::moe_forward", [[m, h], [m, e], []], [BF, BF, ""]):
        topk(w, s, m)
        fused_experts(w, s, m, wrapped=form == "fused_experts")
    if s.experts.shared_intermediate_size:
        with w.op("aten::add", [[m, h], [m, h], []], [BF, BF, "Scalar"], ["", "", "1"]):
            w.kernel(ELEMENTWISE.format("at::native::CUDAFunctor_add<c10::BFloat16>"), m * h,
                     3.0 * m * h * 2)


def forward(w: Writer, s: Shape, seqs: int, tokens: int, context: int, layers: int,
            form: str) -> None:
    """One eager vLLM forward of `seqs` sequences, `tokens` new tokens in all."""
    h, prefill = s.hidden, tokens > seqs
    with w.op("aten::embedding", [[s.vocab, h], [tokens], [], [], []],
              [BF, I64, "Scalar", "Scalar", "Scalar"]), \
            w.op("aten::index_select", [[s.vocab, h], [], [tokens]], [BF, "Scalar", I64]):
        w.kernel(EMBEDDING, 0.0, 2.0 * tokens * h * 2 + 8 * tokens)
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    for layer in range(layers):
        norm(w, tokens, h, first=layer == 0)
        linear(w, tokens, h, q + 2 * kv, s.qkv_bias, prefill)
        attention(w, s, tokens, seqs, context, prefill)
        linear(w, tokens, q, h, False, prefill)
        norm(w, tokens, h, first=False)
        moe_layer(w, s, tokens, prefill, form)
    norm(w, tokens, h, first=False)
    with w.op("aten::index_select", [[tokens, h], [], [seqs]], [BF, "Scalar", I64]):
        w.kernel(INDEX_SELECT, 0.0, 2.0 * seqs * h * 2 + 8 * seqs)
    linear(w, seqs, h, s.vocab, False, prefill=False)


@dataclass(frozen=True)
class Case:
    shape: Shape
    phase: str  # prefill: one sequence of `tokens`; decode: `seqs` sequences, one token each
    seqs: int
    context: int
    form: str = "fused_experts"

    @property
    def tokens(self) -> int:
        return self.context if self.phase == "prefill" else self.seqs

    @property
    def stem(self) -> str:
        what = (f"prefill_b{self.seqs}_t{self.context}" if self.phase == "prefill"
                else f"decode_b{self.seqs}_s{self.context}")
        form = "" if self.form == "fused_experts" else "_moeforward"
        return f"synthetic_vllm_fused_moe_{self.shape.name}-2l_{what}{form}"


CASES = (
    Case(MIXTRAL, "prefill", 1, 512),
    Case(MIXTRAL, "decode", 8, 512),
    Case(MIXTRAL, "decode", 8, 512, form="moe_forward"),
    Case(QWEN_MOE, "decode", 8, 512),
)


def document(case: Case, layers: int = 2, steps: int = 2) -> dict:
    """The Chrome trace of `steps` forwards (ProfilerStep#N each) of `case`."""
    w = Writer()
    for n in range(steps):
        with w.step(n):
            forward(w, case.shape, case.seqs, case.tokens, case.context, layers, case.form)
    return {
        "schemaVersion": 1, "deviceProperties": [H200], "record_shapes": 1,
        "traceName": case.stem, "displayTimeUnit": "ms",
        "trace_roofline_workload": {
            "synthetic": True, "generator": "workloads/synth_fused_moe.py",
            "what": "vLLM eager forward, Triton fused MoE form; durations modelled, not measured",
            "model": case.shape.name, "layers": layers, "phase": case.phase, "sequences": case.seqs,
            "tokens": case.tokens, "context": case.context, "form": case.form,
            "vllm_sources": SOURCES, "modelled_rates": {"flops_per_s": PEAK,
                                                        "bytes_per_s": BANDWIDTH},
        },
        "traceEvents": w.events,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for the .json.gz files")
    args = ap.parse_args(argv)
    out = Path(args.out)
    files = {out / f"{c.stem}.json.gz": gzip.compress(
        json.dumps(document(c), separators=(",", ":")).encode(), mtime=0) for c in CASES}
    write_files(files)
    for path in files:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
