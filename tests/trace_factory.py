"""Small synthetic Kineto traces shaped like torch.profiler's output (ChromeTraceLogger).

Field names and layout follow pytorch/kineto libkineto/src/output_json.cpp: cpu_op args carry
"External id", "Input Dims", "Input type", "Concrete Inputs"; kernels carry "device", "stream",
"correlation", "External id", "grid", "block"; launches are cuda_runtime events linked by
`ac2g` flows whose id is the correlation. Timestamps are µs with ns decimals.
"""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path

H200 = {"id": 0, "name": "NVIDIA H200", "totalGlobalMem": 150754820096, "computeMajor": 9,
        "computeMinor": 0, "numSms": 132, "warpSize": 32}

# (record_function name, aten op, Input Dims, kernel name, grid)
OPS = [
    ("q_proj", "aten::mm", [[1, 3584], [3584, 3584]], "nvjet_tst_64x8_64x16_4x1_v_bz_TNT", [28, 1, 1]),
    ("k_proj", "aten::mm", [[1, 3584], [3584, 512]], "nvjet_tst_64x8_64x16_4x1_v_bz_TNT", [4, 1, 1]),
    ("attention", "aten::_scaled_dot_product_flash_attention",
     [[1, 28, 1, 128], [1, 4, 64, 128], [1, 4, 64, 128]],
     "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 64>>(Params)", [1, 28, 1]),
]


def gpu_trace(steps: int = 2, t0: float = 1_000_000.125) -> dict:
    """A small new-style GPU trace: `steps` profiler steps over OPS, with flows and frames."""
    ev: list[dict] = [
        {"ph": "M", "name": "process_name", "ts": t0, "pid": 100, "tid": 0,
         "args": {"name": "python3"}},
        {"ph": "M", "name": "thread_name", "ts": t0, "pid": 0, "tid": 7,
         "args": {"name": "stream 7"}},
    ]
    ext = corr = pyid = 0
    ts = t0
    for step in range(steps):
        step_start = ts
        ext += 1
        step_ev = {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}",
                   "pid": 100, "tid": 100, "ts": ts, "dur": 0.0, "args": {"External id": ext}}
        ev.append(step_ev)
        pyid += 1
        root = pyid
        frame = {"ph": "X", "cat": "python_function", "name": "nn.Module: Qwen2Attention_0",
                 "pid": 100, "tid": 100, "ts": ts + 0.5, "dur": 0.0,
                 "args": {"Python parent id": None, "Python id": root}}
        ev.append(frame)
        ts += 1.0
        for rf, op, dims, kernel, grid in OPS:
            ext += 1
            ev.append({"ph": "X", "cat": "user_annotation", "name": rf, "pid": 100, "tid": 100,
                       "ts": ts, "dur": 20.0, "args": {"External id": ext}})
            ext += 1
            corr += 1
            ev.append({"ph": "X", "cat": "cpu_op", "name": op, "pid": 100, "tid": 100,
                       "ts": ts + 1.0, "dur": 15.5,
                       "args": {"External id": ext, "Record function id": 0,
                                "Input Dims": dims, "Input type": ["c10::BFloat16"] * len(dims),
                                "Input Strides": [[1] * len(d) for d in dims],
                                "Concrete Inputs": [""] * len(dims), "Ev Idx": ext}})
            pyid += 1
            ev.append({"ph": "X", "cat": "python_function", "name": "nn.Module: Linear_0",
                       "pid": 100, "tid": 100, "ts": ts + 0.75, "dur": 16.0,
                       "args": {"Python parent id": root, "Python id": pyid}})
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 100,
                       "tid": 100, "ts": ts + 2.0, "dur": 4.25,
                       "args": {"External id": ext, "cbid": 211, "correlation": corr}})
            ev.append({"ph": "s", "id": corr, "pid": 100, "tid": 100, "ts": ts + 2.0,
                       "cat": "ac2g", "name": "ac2g"})
            kts = ts + 30.0 + 0.001 * corr
            ev.append({"ph": "X", "cat": "kernel", "name": kernel, "pid": 0, "tid": 7,
                       "ts": kts, "dur": 3.456 + 0.001 * corr,
                       "args": {"External id": ext, "queued": 0, "device": 0, "context": 1,
                                "stream": 7, "correlation": corr, "registers per thread": 168,
                                "shared memory": 99328, "blocks per SM": 0.2,
                                "warps per SM": 0.8, "grid": grid, "block": [384, 1, 1],
                                "est. achieved occupancy %": 0}})
            ev.append({"ph": "f", "id": corr, "pid": 0, "tid": 7, "ts": kts, "cat": "ac2g",
                       "name": "ac2g", "bp": "e"})
            ev.append({"ph": "X", "cat": "gpu_user_annotation", "name": rf, "pid": 0, "tid": 7,
                       "ts": kts - 0.001, "dur": 3.458 + 0.001 * corr,
                       "args": {"External id": ext - 1}})
            ts += 25.0
        # device work without a launching op: no External id (Kineto omits it)
        corr += 1
        ev.append({"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "pid": 0,
                   "tid": 7, "ts": ts + 40.0, "dur": 1.184,
                   "args": {"device": 0, "context": 1, "stream": 7, "correlation": corr,
                            "bytes": 4096, "memory bandwidth (GB/s)": 3.46}})
        corr += 1
        ev.append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)",
                   "pid": 0, "tid": 7, "ts": ts + 42.0, "dur": 2.0,
                   "args": {"External id": ext, "device": 0, "context": 1, "stream": 7,
                            "correlation": corr, "bytes": 256}})
        ts += 50.0
        step_ev["dur"] = ts - step_start
        frame["dur"] = ts - step_start - 1.0
    ev.append({"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans",
               "tid": "PyTorch Profiler", "ts": t0 - 10, "dur": ts - t0 + 20,
               "args": {"Op count": 0}})
    ev.append({"ph": "i", "s": "g", "name": "Iteration Start: PyTorch Profiler",
               "pid": "Traces", "tid": "Trace PyTorch Profiler", "ts": t0 - 10})
    return {"schemaVersion": 1, "deviceProperties": [H200], "record_shapes": 1,
            "displayTimeUnit": "ms", "baseTimeNanoseconds": 1790000000000000000,
            "traceName": "synthetic", "traceEvents": ev}


_OLD_CATS = {"kernel": "Kernel", "cpu_op": "Operator", "cuda_runtime": "Runtime",
             "gpu_memcpy": "Memcpy", "gpu_memset": "Memset", "ac2g": "async_cpu_to_gpu"}


def legacy_trace(steps: int = 2) -> dict:
    """The same trace in the 2020-2021 Kineto spellings (Kernel/Operator/Runtime, 'external
    id', 'Input dims', tid "stream 7", async_cpu_to_gpu flows), without deviceProperties."""
    doc = copy.deepcopy(gpu_trace(steps))
    del doc["deviceProperties"]
    for e in doc["traceEvents"]:
        if e.get("cat") in _OLD_CATS:
            e["cat"] = _OLD_CATS[e["cat"]]
        args = e.get("args", {})
        if "External id" in args and e.get("cat") in ("Kernel", "Runtime", "Memcpy"):
            args["external id"] = args.pop("External id")
        if "Input Dims" in args:
            args["Input dims"] = args.pop("Input Dims")
        if e.get("pid") == 0 and e.get("cat") in ("Kernel", "Memcpy", "Memset"):
            e["tid"] = "stream 7"
    return doc


def cpu_trace() -> dict:
    """A CPU-only trace: cpu ops with shapes, no device events, deviceProperties empty."""
    doc = gpu_trace(1)
    doc["deviceProperties"] = []
    doc["traceEvents"] = [e for e in doc["traceEvents"]
                          if e.get("cat") in ("cpu_op", "user_annotation", "python_function")]
    return doc


def write(doc, path: Path, gz: bool = False) -> Path:
    data = json.dumps(doc, indent=1).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path
