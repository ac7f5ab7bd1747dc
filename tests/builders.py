"""The one builder of synthetic test traces, as torch.profiler writes them (Kineto's ChromeTraceLogger).

Three levels, one vocabulary:
- `Kineto`: an event writer. Ranges (`op`, `ann`, `module`) nest by time on one CPU thread;
  `kernel` launches from the innermost open cpu op (cudaLaunchKernel with a correlation id, an
  `ac2g` flow, the kernel carrying correlation and External id). `emit(ops)` writes an op list
  (below) as events; `document()`/`write()` give the Chrome trace.
- `gpu_trace`, `legacy_trace`, `cpu_trace`: fixed documents exercising the schema (metadata
  events, gpu_user_annotation, memset/memcpy, old 2020-2021 spellings, a CPU-only trace).
- `Op`, `qwen_layer`, `attributed`: a decoder layer as a list of ops (operator, aten op, `Input
  Dims`, `Input type`, `Concrete Inputs`, kernel durations) and attribute.attribute()'s table of
  it, for tests of the costing and roofline stages without a trace file.
- `ROOT`, `SAMPLES` (the committed real traces), `read` (a trace file's JSON document), `write`
  and `run_cli` (the CLI in a fresh interpreter): the file helpers every test module shares.

Field names and layout follow pytorch/kineto libkineto/src/output_json.cpp: cpu_op args carry
"External id", "Input Dims", "Input type", "Concrete Inputs"; kernels carry "device", "stream",
"correlation", "External id", "grid", "block"; launches are cuda_runtime events linked by
`ac2g` flows whose id is the correlation. Timestamps are µs with ns decimals. The op names and
shapes follow what torch.profiler records on CUDA for workloads/layer.py (innermost
kernel-launching ops: addmm/mm, the flash attention forward in [B, T, heads, d] layout, copy_ for
casts and cache writes, ...); kernel durations are chosen numbers, not measurements.
"""

from __future__ import annotations

import copy
import gzip
import json
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pandas as pd
import pytest

from trace_roofline.model.models import ModelSpec
from trace_roofline.trace import columns, decode, parallel
from trace_roofline.trace.schema import MISSING

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_traces"


def walk(items: Iterable, group: Callable[[Any], Hashable] = lambda p: p.parent,
         ids: Callable[[Any], str] | None = None) -> list:
    """`items` (paths, or tuples of arguments) as pytest params: the first of each `group`
    (default: a path's folder) runs in every suite, the others are marked `exhaustive` (CI's
    leg of its own: `pytest -m exhaustive`). Ids: `ids`, else a path relative to SAMPLES."""
    seen: set[Hashable] = set()
    out = []
    for item in items:
        key = group(item)
        args = item if isinstance(item, tuple) else (item,)
        name = ids(item) if ids else str(item.relative_to(SAMPLES)) if isinstance(item, Path) else None
        out.append(pytest.param(*args, marks=[pytest.mark.exhaustive] if key in seen else [],
                                id=name))
        seen.add(key)
    return out


def by_prefix(path: Path) -> str:
    """A capture's model, for `walk`: its file name up to the first underscore."""
    return path.name.split("_")[0]


BF, F32 = "c10::BFloat16", "float"
H200 = {"id": 0, "name": "NVIDIA H200", "totalGlobalMem": 150754820096, "computeMajor": 9,
        "computeMinor": 0, "numSms": 132, "warpSize": 32}


# ----------------------------------------------------------------------------- op lists
@dataclass
class Op:
    """One kernel-launching aten op of an operator: `durs` holds one duration per kernel.

    `wrap` lists the outer cpu ops (name, Input Dims) that enclose it, outermost first, as
    HF's nn.Linear records aten::linear > aten::matmul > aten::mm; a trace written by
    `Kineto.emit` nests them, the attributed table ignores them."""

    operator: str
    name: str | None
    dims: list | None
    types: list | None
    concrete: list | None = None
    durs: tuple[float, ...] = (1.0,)
    kind: str = "kernel"
    wrap: tuple[tuple[str, list], ...] = ()


def _norm(operator: str, m: int, h: int) -> list[Op]:
    """Qwen2RMSNorm as aten ops: cast to fp32, pow, mean, add eps, rsqrt, mul, cast, weight mul."""
    x = [1, m, h]
    return [
        Op(operator, "aten::copy_", [x, x, []], [F32, BF, "Scalar"], ["", "", "False"]),
        Op(operator, "aten::pow", [x, []], [F32, "Scalar"], ["", "2"]),
        Op(operator, "aten::mean", [x, [], [], []], [F32, "ScalarList", "Scalar", ""],
           ["", "[-1]", "True", ""]),
        Op(operator, "aten::add", [[1, m, 1], [], []], [F32, "Scalar", "Scalar"], ["", "1e-06", "1"]),
        Op(operator, "aten::rsqrt", [[1, m, 1]], [F32], [""]),
        Op(operator, "aten::mul", [x, [1, m, 1]], [F32, F32], ["", ""]),
        Op(operator, "aten::copy_", [x, x, []], [BF, F32, "Scalar"], ["", "", "False"]),
        Op(operator, "aten::mul", [[h], x], [BF, BF], ["", ""]),
    ]


def qwen_layer(spec: ModelSpec, t: int, s: int, durs: dict[str, tuple[float, ...]] | None = None,
               splitk_down: bool = True) -> list[Op]:
    """One HF-ordered Qwen2 decoder layer at T new tokens against S keys (decode: T=1;
    prefill: T=S), B=1; `durs` maps an operator to its kernels' durations (µs)."""
    h, nq, nkv, d, inter = (spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                            spec.intermediate_size)
    durs = durs or {}
    lin = spec.linears()

    def proj(name: str) -> Op:
        k, n, bias = lin[name]
        linear = ("aten::linear", [[1, t, k], [n, k], [n] if bias else []])
        if bias:
            return Op(name, "aten::addmm", [[n], [t, k], [k, n], [], []],
                      [BF, BF, BF, "Scalar", "Scalar"], ["", "", "", "1", "1"], wrap=(linear,))
        return Op(name, "aten::mm", [[t, k], [k, n]], [BF, BF], ["", ""],
                  wrap=(linear, ("aten::matmul", [[1, t, k], [k, n]])))

    q, kk = [1, nq, t, d], [1, nkv, t, d]
    ops = [*_norm("input_norm", t, h), proj("q_proj"), proj("k_proj"), proj("v_proj")]
    for x in (q, kk):  # rope: x*cos + rotate_half(x)*sin
        half = [*x[:-1], d // 2]
        ops += [
            Op("rope", "aten::mul", [x, [t, d]], [BF, BF]),
            Op("rope", "aten::neg", [half], [BF]),
            Op("rope", "aten::cat", [[half, half], []], ["TensorList", "Scalar"], ["", "-1"]),
            Op("rope", "aten::mul", [x, [t, d]], [BF, BF]),
            Op("rope", "aten::add", [x, x, []], [BF, BF, "Scalar"], ["", "", "1"]),
        ]
    ops += [Op("kv_cache", "aten::copy_", [kk, kk, []], [BF, BF, "Scalar"], ["", "", "False"])
            for _ in range(2)]
    causal = "True" if t > 1 else "False"
    ops.append(Op(
        "attention", "aten::_flash_attention_forward",
        [[1, t, nq, d], [1, s, nkv, d], [1, s, nkv, d], [], [], [], [], [], [], [], [], [], [], [], []],
        [BF, BF, BF, "", "", "Scalar", "Scalar", "Scalar", "Scalar", "Scalar", "Scalar", "", "",
         "", ""],
        ["", "", "", "", "", str(t), str(s), "0.", causal, "False", "0.0883", "", "", "", ""]))
    ops += [proj("o_proj"),
            Op("residual", "aten::add", [[1, t, h], [1, t, h], []], [BF, BF, "Scalar"]),
            *_norm("post_attention_norm", t, h), proj("gate_proj"), proj("up_proj"),
            Op("act", "aten::silu", [[1, t, inter]], [BF]),
            Op("act", "aten::mul", [[1, t, inter], [1, t, inter]], [BF, BF])]
    down = proj("down_proj")
    if splitk_down:  # split-K GEMM: two kernels, one op instance
        down.durs = (1.0, 1.0)
    ops += [down, Op("residual", "aten::add", [[1, t, h], [1, t, h], []], [BF, BF, "Scalar"])]
    for o in ops:
        if o.operator in durs:
            per = durs[o.operator]
            o.durs = per if len(per) == len(o.durs) else (per[0],) * len(o.durs)
    return ops


def attributed(ops: list[Op], layer: int | None = 0, step: int | None = None,
               first_event: int = 0, first_op: int = 1000, t0: float = 0.0) -> pd.DataFrame:
    """attribute.attribute()'s table for `ops`, kernels back to back from t0 (µs). Each op is one
    instance per (layer, step); a kernel without an op is an instance of its own (`concat`
    numbers the instances of joined frames afresh)."""
    rows, ts, eid = [], t0, first_event
    for i, o in enumerate(ops):
        for dur in o.durs:
            rows.append({
                "event_id": eid, "name": f"kernel_{o.name}", "kind": o.kind, "stream": 7,
                "ts_us": ts, "dur_us": float(dur), "op_id": first_op + i if o.name else None,
                "op_name": o.name,
                "input_dims": json.dumps(o.dims) if o.dims is not None else None,
                "input_types": json.dumps(o.types) if o.types is not None else None,
                "concrete_inputs": json.dumps(o.concrete) if o.concrete is not None else None,
                "operator": o.operator, "layer": layer if o.operator != "unattributed" else None,
                "step": step, "evidence": "annotation" if o.name else "fallback",
            })
            ts += dur + 0.5
            eid += 1
    df = _with_instances(pd.DataFrame(rows))
    return df.astype({"op_id": "Int64", "layer": "Int64", "step": "Int64", "event_id": "int64",
                      "stream": "int64", "op_name": "object", "input_dims": "object",
                      "input_types": "object", "concrete_inputs": "object"})


def concat(*frames: pd.DataFrame) -> pd.DataFrame:
    return _with_instances(pd.concat(frames, ignore_index=True))


def _with_instances(df: pd.DataFrame) -> pd.DataFrame:
    """Number the instances as attribute() would: one per op (op_id) per (operator, layer,
    step); a kernel without an op is one of its own."""
    op = df["op_id"].astype("Int64").fillna(-1 - df["event_id"].astype("int64"))
    keys = pd.MultiIndex.from_arrays([op, df["operator"], df["layer"].astype("Int64"),
                                      df["step"].astype("Int64")])
    return df.assign(instance=pd.factorize(keys)[0].astype("int64"))


# ----------------------------------------------------------------------------- event writer
class Kineto:
    """Builds a Chrome trace: ranges nest by time on one CPU thread, kernels run on a GPU."""

    def __init__(self, pid: int = 4242, tid: int = 4242):
        self.events: list[dict] = []
        self.pid, self.tid = pid, tid
        self.t = 1_000_000.0  # CPU cursor, µs
        self.gpu_t = {7: 1_000_000.0}  # per-stream GPU cursor
        self.ext = 0
        self.corr = 100
        self.ops: list[int] = []  # External ids of the open cpu ops
        self.pyid = 0
        self.frames: list[int] = []

    def _tick(self, dt: float = 1.0) -> float:
        self.t = round(self.t + dt, 3)
        return self.t

    @contextmanager
    def _range(self, ev: dict) -> Iterator[dict]:
        ev["ts"] = self._tick()
        self.events.append(ev)
        yield ev
        ev["dur"] = round(self._tick() - ev["ts"], 3)

    @contextmanager
    def op(self, name: str, dims: list | None = None, types: list | None = None, tid=None,
           concrete: list | None = None) -> Iterator[int]:
        """A cpu_op range (aten op) with its `Input Dims` / `Input type` / `Concrete Inputs`."""
        self.ext += 1
        args: dict = {"External id": self.ext}
        if dims is not None:
            args["Input Dims"] = dims
            args["Input type"] = types or [BF if d else "" for d in dims]
        if concrete is not None:
            args["Concrete Inputs"] = concrete
        ev = {"ph": "X", "cat": "cpu_op", "name": name, "pid": self.pid,
              "tid": tid or self.tid, "args": args}
        self.ops.append(self.ext)
        with self._range(ev):
            yield self.ext
        self.ops.pop()

    @contextmanager
    def ann(self, name: str) -> Iterator[None]:
        """A record_function range (user_annotation)."""
        self.ext += 1
        ev = {"ph": "X", "cat": "user_annotation", "name": name, "pid": self.pid,
              "tid": self.tid, "args": {"External id": self.ext}}
        with self._range(ev):
            yield

    @contextmanager
    def module(self, cls: str, idx: int) -> Iterator[None]:
        """An `nn.Module: cls_idx` python_function frame (with_stack traces)."""
        self.pyid += 1
        ev = {"ph": "X", "cat": "python_function", "name": f"nn.Module: {cls}_{idx}",
              "pid": self.pid, "tid": self.tid,
              "args": {"Python id": self.pyid,
                       "Python parent id": self.frames[-1] if self.frames else None}}
        self.frames.append(self.pyid)
        with self._range(ev):
            yield
        self.frames.pop()

    def kernel(self, name: str, dur: float = 2.0, *, ext: bool = True, runtime: bool = True,
               flow: bool = True, stream: int = 7, kind: str = "kernel", gpu_ts=None) -> int:
        """Launch a kernel from the innermost open cpu op (cudaLaunchKernel + flow)."""
        self.corr += 1
        launch = self._tick(0.5)
        if runtime:
            self.events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel",
                                "pid": self.pid, "tid": self.tid, "ts": launch, "dur": 0.4,
                                "args": {"correlation": self.corr,
                                         "External id": self.ops[-1] if self.ops else 0}})
        if flow:
            self.events.append({"ph": "s", "cat": "ac2g", "name": "ac2g", "id": self.corr,
                                "pid": self.pid, "tid": self.tid, "ts": launch})
        cursor = self.gpu_t.setdefault(stream, launch)
        ts = round(max(cursor, launch + 3.0), 3) if gpu_ts is None else gpu_ts
        self.gpu_t[stream] = round(ts + dur + 0.5, 3)
        cat = {"kernel": "kernel", "memset": "gpu_memset", "memcpy": "gpu_memcpy"}[kind]
        args = {"device": 0, "stream": stream, "correlation": self.corr}
        if ext and self.ops:
            args["External id"] = self.ops[-1]
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream,
                            "ts": ts, "dur": dur, "args": args})
        self._tick(0.5)
        return self.corr

    def emit(self, ops: Sequence[Op], *, annotate: bool = True) -> None:
        """Write an op list as events: each op inside its `wrap` ops, one kernel per duration
        (named `kernel_<aten op>`); with `annotate`, each run of ops of one operator inside a
        record_function range of that name (an `unattributed` op gets none, as in a real trace).
        """
        i = 0
        while i < len(ops):
            j = i + 1
            while j < len(ops) and ops[j].operator == ops[i].operator:
                j += 1
            if annotate and ops[i].operator != "unattributed":
                with self.ann(ops[i].operator):
                    self._emit_ops(ops[i:j])
            else:
                self._emit_ops(ops[i:j])
            i = j

    def _emit_ops(self, ops: Sequence[Op]) -> None:
        for o in ops:
            with _nested([(lambda n=n, d=d: self.op(n, d)) for n, d in o.wrap]):
                if o.name is None:  # device work no cpu op launched
                    for dur in o.durs:
                        self.kernel("kernel_unlaunched", dur, ext=False, runtime=False, flow=False)
                    continue
                with self.op(o.name, o.dims, o.types, concrete=o.concrete):
                    for dur in o.durs:
                        self.kernel(f"kernel_{o.name}", dur)

    def document(self, device: str | None = "NVIDIA H200") -> dict:
        """The Chrome trace; `device` names the GPU in deviceProperties (None: CPU-only)."""
        props = [{"id": 0, "name": device}] if device else []
        return {"schemaVersion": 1, "deviceProperties": props, "traceEvents": self.events}

    def write(self, path: Path, device: str | None = "NVIDIA H200", gz: bool | None = None) -> Path:
        """`document(device)` written to `path` (gzipped with `gz`; None: when the name ends in .gz)."""
        return write(self.document(device), path, gz=gz, indent=None)


@contextmanager
def _nested(makers: list) -> Iterator[None]:
    if not makers:
        yield
        return
    with makers[0](), _nested(makers[1:]):
        yield


# ----------------------------------------------------------------------------- fixed documents

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


# ----------------------------------------------------------------------------- files, CLI
def write(doc: dict, path: Path, gz: bool | None = None, indent: int | None = 1) -> Path:
    """`doc` as JSON at `path`, gzipped with `gz` (None: when the name ends in .gz)."""
    data = json.dumps(doc, indent=indent).encode()
    path.write_bytes(gzip.compress(data) if (path.name.endswith(".gz") if gz is None else gz) else data)
    return path


def read(path: Path) -> dict:
    """The JSON document of a trace file, gzipped or not."""
    data = Path(path).read_bytes()
    return json.loads(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)


def run_cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    """`python -m trace_roofline.cli ARGS` in a fresh interpreter at the repository root (so this
    checkout's package), output captured as text; `kwargs` go to subprocess.run (env, ...)."""
    return subprocess.run([sys.executable, "-m", "trace_roofline.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, **kwargs)


def parent_waits_for_a_claim(monkeypatch) -> None:
    """The parent's first claim waits (up to 10 s) until the worker has claimed a segment: on a
    slow or busy machine the parent could otherwise claim every event before the worker runs."""
    real_init, real_parent = parallel.Claims.__init__, parallel.Claims.parent

    def init(self, start, end):
        real_init(self, start, end)
        self.end0 = end

    def parent(self, stop, after):
        deadline = time.monotonic() + 10
        while self.worker_stop() == self.end0 and time.monotonic() < deadline:
            time.sleep(0.001)
        return real_parent(self, stop, after)

    monkeypatch.setattr(parallel.Claims, "__init__", init)
    monkeypatch.setattr(parallel.Claims, "parent", parent)


def scan_batch(content: bytes) -> str | tuple:
    """The compiled scanner (trace.columns.SCANNER) over one batch, a JSON array's content: its
    reason for declining, or (n, i32, f64, i64 buffers, the string table with None first, the
    raw values)."""
    sc = columns.SCANNER()
    got = sc.scan(bytearray(b"[" + content + b"]"), 1, len(content) + 1)
    if isinstance(got, str):
        return got
    n, i32, f64, i64 = got
    strings = [None] + [msgspec.json.decode(b'"' + k + b'"') for k in sc.strings()]
    return n, i32, f64, i64, strings, sc.raws()


def msgspec_batch(content: bytes) -> list | None:
    """trace.decode's msgspec Structs of one batch (a JSON array's content), or None where
    msgspec does not decode it in one go (the scanner must then decline)."""
    try:
        return decode._BATCH.decode(b"[" + content + b"]")
    except (msgspec.DecodeError, RecursionError):
        return None


# the scanner's columns of one batch against msgspec's (test_scan, .ci/sanitize.sh's fuzz)
_INT_FIELDS = {"pid": "pid", "tid": "tid", "id": "id", "args.device": "device", "args.stream": "stream",
               "args.correlation": "correlation", "args.external_id": "external_id",
               "args.external_id_legacy": "external_id_legacy", "args.python_id": "python_id",
               "args.python_parent_id": "python_parent_id"}
_CPU_RAWS = ("input_dims", "input_dims_legacy", "input_types", "concrete_inputs", "input_strides")


def _f64(v: float) -> bytes:
    return struct.pack("<d", v)


def scanned_rows(content: bytes):
    """The scanner's columns of a batch (a JSON array's content) as one dict per event, or the
    reason it declines."""
    from trace_roofline.trace import _scan  # (the compiled scanner: callers skip without it)

    i32_cols, i64_cols = _scan.I32_COLUMNS, _scan.I64_COLUMNS
    got = scan_batch(content)
    if isinstance(got, str):
        return got
    n, i32, f64, i64, strings, raws = got
    i32 = np.frombuffer(i32, np.int32).reshape(-1, n) if n else np.empty((len(i32_cols), 0), np.int32)
    f64 = np.frombuffer(f64, np.float64).reshape(-1, n) if n else np.empty((2, 0))
    i64 = np.frombuffer(i64, np.int64).reshape(-1, n) if n else np.empty((len(i64_cols), 0), np.int64)
    rows = []
    for r in range(n):
        row = {c: strings[i32[k, r]] for k, c in enumerate(i32_cols[:3])}
        row["raw.device"], row["raw.cpu_ops"] = raws[i32[3, r]], raws[i32[4, r]]
        row["ts"], row["dur"] = _f64(f64[0, r]), _f64(f64[1, r])
        row.update({c: int(i64[k, r]) for k, c in enumerate(i64_cols)})
        rows.append(row)
    return rows


def _int_of(v) -> int:
    """A decoded int field as the columns hold it (a string of no digits, or None: MISSING)."""
    return MISSING if v is None else columns.as_int(v)


def struct_rows(content: bytes):
    """decode.py's msgspec Structs of the same batch as the same dicts, or None if msgspec
    does not decode the batch in one go (the scanner must then decline)."""
    evs = msgspec_batch(content)
    if evs is None:
        return None
    rows = []
    for e in evs:
        a = e.args
        row = {"ph": e.ph, "cat": e.cat, "name": e.name,
               "raw.device": bytes(a.grid) + b"\x01" + bytes(a.block),
               "raw.cpu_ops": b"\x01".join(bytes(getattr(a, c)) for c in _CPU_RAWS),
               "ts": _f64(e.ts), "dur": _f64(e.dur)}
        for col, attr in _INT_FIELDS.items():
            row[col] = _int_of(getattr(e, attr) if not col.startswith("args.") else getattr(a, attr))
        rows.append(row)
    return rows


def check_batch(content: bytes):
    """The scanner's columns of a batch are msgspec's, or it declines; what it gave."""
    got = scanned_rows(content)
    if isinstance(got, str):
        return got
    ref = struct_rows(content)
    assert ref is not None, "the scanner read a batch that msgspec does not decode"
    assert len(got) == len(ref)
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert g == r, (i, {k: (g[k], r[k]) for k in g if g[k] != r[k]})
    return got


# ---------------------------------------------------------------- names against a model's layout
_EXPERT_OPERATORS = {"router", "experts_gate_up", "experts_down", "experts_act", "moe_dispatch",
                     "moe_combine"}


def wrong_names(att: pd.DataFrame, model: ModelSpec) -> np.ndarray:
    """Per attributed row, whether its name is wrong for `model` (the shard the trace ran): a
    linear's name on a GEMM of another (K, N) (the lm_head's vocabulary padded by Inductor
    excepted) or one weight's name on a kernel of several (Inductor's k and v at once), an
    expert's on a dense model, q_norm / k_norm on a model without them."""
    from trace_roofline.attribution import gemm_operands, naming
    from trace_roofline.model import operators
    from trace_roofline.model.models import expected_linears

    op = att["operator"].astype(str).to_numpy()
    k, n, w = gemm_operands.gemm_kn(naming.base_name(att["op_name"].astype("string")).fillna(""),
                             att["input_dims"])
    want = expected_linears(model)
    for fused, parts in operators.FUSIONS:  # Inductor's kv_proj: the parts' weights at once
        if fused not in want and all(p in want for p in parts):
            want[fused] = (want[parts[0]][0], sum(want[p][1] for p in parts))
    kn = np.array([want.get(o, (-2, -2)) for o in op]).reshape(-1, 2)
    linear = np.isin(op, list(want)) & (k >= 0)
    wrong = linear & ((k != kn[:, 0]) | (n != kn[:, 1]))
    wrong |= linear & (w > 1) & ~np.isin(op, [f for f, _ in operators.FUSIONS])
    v = model.vocab_size  # (Inductor pads the lm_head's vocabulary: GPT-2's 50257 to 50264)
    padded = {-(-v // a) * a for a in (8, 16, 32, 64, 128)} if v else set()
    wrong &= ~((op == "lm_head") & (k == kn[:, 0]) & np.isin(n, list(padded)))
    if model.experts is None:
        wrong |= np.isin(op, list(_EXPERT_OPERATORS))
    if not model.architecture.attention.qk_norm:
        wrong |= np.isin(op, ["q_norm", "k_norm"])
    return wrong


def sweep_lines(verbose: bool) -> list[str]:
    """The progress lines of a tiny CPU sweep of qwen-tiny's q_proj at M = 1, 4 (one warm-up,
    two timed calls); skipped without torch."""
    import tempfile

    import pytest

    torch = pytest.importorskip("torch")
    from workloads.sweep import run_sweep

    lines: list[str] = []
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as out:
        run_sweep("qwen-tiny", "q_proj", (1, 4), None, "cpu", 1, 2, None, out, verbose,
                  progress=lines.append)
    return lines
