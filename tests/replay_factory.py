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
