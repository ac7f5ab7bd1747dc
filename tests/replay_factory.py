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
