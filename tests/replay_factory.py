"""CUDA-graph replay traces derived from real eager traces, shaped as Kineto writes a replay.

What a `torch.cuda.CUDAGraph.replay()` looks like in a torch.profiler trace (checked on the
H200 with torch 2.11.0+cu130): one `cudaGraphLaunch` cuda_runtime event (cbid 311) with a
correlation id and an ac2g flow start; every kernel of the replay carries that same correlation,
no External id, on the capture stream; no cpu op, no launch event per kernel.

`as_replays(doc)` turns each ProfilerStep of an eager trace into one such replay: its device
events keep their names, grids and times, lose their External ids and take the correlation of
a new cudaGraphLaunch placed at the step's start; cpu ops, per-kernel launches, their flows and
python frames go (the ProfilerStep ranges stay). Options edit the replayed sequence the way a
different capture would: drop memsets, reorder the kernels, change grids.
"""

from __future__ import annotations

import copy
import random
import re

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
_STEP = "ProfilerStep#"


def as_replays(doc: dict, *, drop_memsets: bool = False, shuffle_seed: int | None = None,
               grid_scale: int = 1) -> dict:
    """The eager trace's ProfilerSteps as CUDA-graph replays (module docstring).

    `shuffle_seed` permutes the kernels of each replay (same multiset, another order);
    `grid_scale` multiplies the first grid dim of every elementwise kernel (another batch)."""
    doc = copy.deepcopy(doc)
    ev = doc["traceEvents"]
    steps = sorted(((e["ts"], e["ts"] + e["dur"], e) for e in ev
                    if e.get("cat") == "user_annotation" and str(e.get("name")).startswith(_STEP)),
                   key=lambda s: s[0])
    launch_ts = {e["args"]["correlation"]: e["ts"] for e in ev
                 if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    top = max(int(e.get("args", {}).get("correlation", 0) or 0) for e in ev) + 1000
    keep, by_step = [], {i: [] for i in range(len(steps))}
    for e in ev:
        cat = e.get("cat")
        if cat in DEVICE_CATS:
            t = launch_ts.get(e["args"].get("correlation"), e["ts"])
            i = next((k for k, (s0, s1, _) in enumerate(steps) if s0 <= t < s1), None)
            if i is None or (drop_memsets and cat == "gpu_memset"):
                continue
            by_step[i].append(e)
        elif cat in ("cpu_op", "cuda_runtime", "cuda_driver", "ac2g", "python_function"):
            continue
        else:
            keep.append(e)
    rng = random.Random(shuffle_seed)
    for i, (s0, _, step) in enumerate(steps):
        corr = top + i
        tid = step["tid"]
        keep.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "pid": step["pid"],
                     "tid": tid, "ts": s0 + 1.0, "dur": 8.5,
                     "args": {"cbid": 311, "correlation": corr}})
        keep.append({"ph": "s", "id": corr, "pid": step["pid"], "tid": tid, "ts": s0 + 1.0,
                     "cat": "ac2g", "name": "ac2g"})
        kernels = sorted(by_step[i], key=lambda e: e["ts"])
        if shuffle_seed is not None:
            slots = [(e["ts"], e["dur"]) for e in kernels]
            rng.shuffle(kernels)
            for e, (ts, _) in zip(kernels, slots, strict=True):
                e["ts"] = ts
        for e in kernels:
            e["args"].pop("External id", None)
            e["args"]["correlation"] = corr
            grid = e["args"].get("grid")
            if grid_scale != 1 and grid and "elementwise" in e["name"]:
                e["args"]["grid"] = [grid[0] * grid_scale, *grid[1:]]
            keep.append(e)
    doc["traceEvents"] = keep
    return doc


def as_piecewise(doc: dict, eager: str, op: str = "vllm::unified_attention_with_output") -> dict:
    """A FULL-graph replay re-cut as vLLM's piecewise graphs replay it: every run of kernels
    whose names match `eager` (an attention layer's cache write and attention) runs eagerly,
    one cpu op `op` launching them (a runtime launch each, External id and flow); every run
    between them is its own graph launch. Host times divide the graph launch's time in order;
    the kernels keep their names, grids and device times."""
    doc = copy.deepcopy(doc)
    ev = doc["traceEvents"]
    graph = next(e for e in ev if e.get("cat") == "cuda_runtime"
                 and e["name"] in ("cudaGraphLaunch", "hipGraphLaunch"))
    corr = graph["args"]["correlation"]
    kernels = sorted((e for e in ev if e.get("cat") in DEVICE_CATS
                      and e["args"].get("correlation") == corr), key=lambda e: e["ts"])
    pattern = re.compile(eager)
    runs: list[tuple[bool, list[dict]]] = []
    for k in kernels:
        hit = bool(pattern.search(k["name"]))
        if runs and runs[-1][0] == hit:
            runs[-1][1].append(k)
        else:
            runs.append((hit, [k]))
    ids = [int(e.get("args", {}).get(key, 0) or 0) for e in ev
           for key in ("correlation", "External id")]
    top = max(ids) + 1000
    keep = [e for e in ev if e is not graph and not (e.get("cat") == "ac2g" and e.get("id") == corr)]
    slot = graph["dur"] / len(runs)
    pid, tid = graph["pid"], graph["tid"]
    for i, (hit, run) in enumerate(runs):
        t0 = graph["ts"] + i * slot
        if not hit:
            top += 1
            keep.append({**graph, "ts": t0, "dur": slot * 0.8,
                         "args": {**graph["args"], "correlation": top}})
            keep.append({"ph": "s", "id": top, "pid": pid, "tid": tid, "ts": t0,
                         "cat": "ac2g", "name": "ac2g"})
            for k in run:
                k["args"]["correlation"] = top
            continue
        top += 1
        ext = top
        keep.append({"ph": "X", "cat": "cpu_op", "name": op, "pid": pid, "tid": tid, "ts": t0,
                     "dur": slot * 0.9, "args": {"External id": ext, "Record function id": 0}})
        step = slot * 0.8 / len(run)
        for j, k in enumerate(run):
            top += 1
            ts = t0 + 0.05 * slot + j * step
            launch = "hipLaunchKernel" if graph["name"].startswith("hip") else "cudaLaunchKernel"
            keep.append({"ph": "X", "cat": "cuda_runtime", "name": launch, "pid": pid,
                         "tid": tid, "ts": ts, "dur": step * 0.5,
                         "args": {"External id": ext, "correlation": top, "kernel": k["name"]}})
            keep.append({"ph": "s", "id": top, "pid": pid, "tid": tid, "ts": ts,
                         "cat": "ac2g", "name": "ac2g"})
            k["args"]["correlation"] = top
            k["args"]["External id"] = ext
    doc["traceEvents"] = keep
    return doc


# MI300X kernel names of the vLLM gpt-oss replay -> the names the same work takes on a B200
# (cuBLASLt nvjet GEMMs, TensorRT-LLM/FlashInfer MoE: bf16 x MXFP4 `bmm_*`, its routing and
# finalize, TRT-LLM FMHA, FlashInfer norm and RoPE): the first pattern that matches renames
B200_NAMES = (
    (r"^Cijk_", "nvjet_sm100_tst_128x256_64x4_2x1_v_bz_coopA_TNT"),
    (r"_matmul_ogs_\w*_swiglu$", "bmm_Bfloat16_MxE2m1Bfloat16_Fp32_t128x8x512u2_s4_et128x8_"
     "m128x8x64_cga1x1x1_16dp256b_TN_transOut_schedS_swiGlu_sm100f"),
    (r"^_matmul_ogs_", "bmm_Bfloat16_MxE2m1Bfloat16_Fp32_t128x8x512u2_s4_et128x8_m128x8x64_"
     "cga1x1x1_16dp256b_TN_transOut_schedS_sm100f"),
    (r"^_topk_forward|^_sum_bitmatrix|^_combined_routing",
     "void moe::dev::routing::routingRenormalize::routingIndicesClusterKernel<KernelParams>"),
    (r"^_finalize_matmul_scatter", "void moe::dev::finalize::finalizeKernelVecLoad<KernelParams>"),
    (r"kernel_unified_attention|^reduce_segments",
     "fmhaSm100fKernel_QkvBfloat16OBfloat16H64PagedKvCausalP64VarSeqQ128Kv128PersistentContext"),
    (r"Rmsnorm2dFwd", "void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>"),
    (r"rotary_embedding_kernel",
     "void flashinfer::BatchQKApplyRotaryPosIdsCosSinCache<true, 64u, 8u, 16u, __nv_bfloat16>"),
    (r"reshape_and_cache_flash", "void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, "
     "__nv_bfloat16, (vllm::Fp8KVCacheDataType)0>"),
)
B200_ALL_REDUCE = "void vllm::cross_device_reduce_1stage<__nv_bfloat16, 8>"


def as_b200_tp8_prefill(doc: dict, requests: int = 4, tokens: int = 2048,
                        all_reduce_us: float = 6.0) -> dict:
    """The vLLM gpt-oss FULL-graph replay as one TP=8 rank of a B200 runs a prefill: kernels
    renamed (B200_NAMES), a custom all-reduce after each o_proj and each MoE finalize (the
    kernels after it shifted), CUDA runtime names, a B200 in deviceProperties, and the step
    annotation of `requests` prompts of `tokens` each. Durations and grids stay the MI300X
    decode's: a trace of the kind, for names, phases and the annotation's costs."""
    doc = copy.deepcopy(doc)
    ev = doc["traceEvents"]
    rules = [(re.compile(rx), new) for rx, new in B200_NAMES]
    kernels = sorted((e for e in ev if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    added, shift, after_attention = [], 0.0, False
    for k in kernels:
        old = k["name"]
        k["ts"] += shift
        k["name"] = next((new for rx, new in rules if rx.search(old)), old)
        o_proj = after_attention and old.startswith("Cijk_")
        after_attention = (bool(re.search(r"unified_attention|reduce_segments", old))
                           or (after_attention and not old.startswith("Cijk_")))
        if o_proj or old.startswith("_finalize_matmul_scatter"):
            shift += all_reduce_us
            added.append({**k, "name": B200_ALL_REDUCE, "ts": k["ts"] + k["dur"],
                          "dur": all_reduce_us, "args": {**k["args"], "grid": [8, 1, 1]}})
    ev.extend(added)
    for e in ev:
        if e.get("cat") == "cuda_runtime":
            e["name"] = re.sub(r"^hip", "cuda", e["name"])
        if e.get("cat") == "user_annotation" and str(e["name"]).startswith("execute_"):
            t, q2 = requests * tokens, requests * tokens * tokens
            e["name"] = (f"execute_{t}_context_{requests}(sq{t}sk{t}sqsq{q2}sqsk{q2})"
                         "_generation_0(sq0sk0sqsq0sqsk0)")
    doc["deviceProperties"] = [{"id": 0, "name": "NVIDIA B200", "totalGlobalMem": 191_500_000_000,
                                "computeMajor": 10, "computeMinor": 0,
                                "numSms": 148, "maxThreadsPerBlock": 1024}]
    doc["distributedInfo"] = {"backend": "nccl", "rank": 0, "world_size": 8}
    return doc
