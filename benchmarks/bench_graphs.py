"""CUDA-graph replay naming benchmark: is it linear in kernels?

Tiles a replay trace (tile.py: copy k shifts times and every linking id, so each copy's
cudaGraphLaunch correlations stay distinct: every copy adds replays) to several sizes and times,
each size in a fresh process: load_trace, attribute, graphs.name_replays (with the mapping trace,
and without: kernel names + model), passes.forward_passes and attach.attach_costs, then the
whole `analyze --graph-map --no-cache` command in a fresh process. Also times
graphs.align alone on growing sequences (one long replay against a perturbed template), where
the banded LCS must grow linearly, not quadratically.

    python benchmarks/bench_graphs.py --replay REPLAY.json.gz --mapping EAGER.json.gz \
        --model qwen2.5-7b --sizes 100,300,1000
Results: stdout (markdown) and benchmarks/data/graphs_results.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]  # this checkout's trace_roofline, not an installed one
from tile import tile  # noqa: E402

CHILD = r"""
import json, sys, time, resource
import trace_roofline as tr
from trace_roofline.attribution import graphs
from trace_roofline.attribution import passes
from trace_roofline.costs.attach import attach_costs
replay, mapping, model = sys.argv[1], sys.argv[2], tr.get_model(sys.argv[3])
out = {}
t = time.perf_counter(); m_trace = tr.load_trace(mapping)
m = graphs.mapping_from(m_trace, tr.attribute(m_trace, model)); out["mapping_s"] = time.perf_counter() - t
t = time.perf_counter(); trace = tr.load_trace(replay); out["load_s"] = time.perf_counter() - t
t = time.perf_counter(); att = tr.attribute(trace, model); out["attribute_s"] = time.perf_counter() - t
t = time.perf_counter(); rr = graphs.replay_rows(trace); out["replay_rows_s"] = time.perf_counter() - t
t = time.perf_counter(); named, rep = graphs.name_replays(trace, att, model, mapping=m)
out["name_replays_map_s"] = time.perf_counter() - t
t = time.perf_counter()
bare, rep2 = graphs.name_replays(trace, att, model, shapes=graphs.DecodeShapes(1, 4096))
out["name_replays_bare_s"] = time.perf_counter() - t
t = time.perf_counter(); p = passes.forward_passes(named); out["passes_s"] = time.perf_counter() - t
t = time.perf_counter(); c = attach_costs(named, model); out["costs_s"] = time.perf_counter() - t
out.update(kernels=len(att), replay_kernels=rep.kernels, replays=rep.replays, graphs=len(rep.graphs),
           named_fraction=rep.named_fraction, bare_named_fraction=rep2.named_fraction,
           passes=len(p.table), peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
print(json.dumps(out))
"""


def align_scaling(lengths: list[int]) -> list[dict]:
    """graphs.align on a sequence of n kernels (a 60-kernel layer pattern repeated) against
    itself with 1% of kernels dropped and 1% inserted: seconds per kernel should stay flat."""
    from trace_roofline.attribution import graph_align

    rng = np.random.default_rng(0)
    layer = rng.integers(0, 40, size=60)
    rows = []
    for n in lengths:
        a = np.resize(layer, n)
        keep = rng.random(n) > 0.01
        b = a[keep]
        ins = np.sort(rng.choice(len(b), size=n // 100, replace=False))
        b = np.insert(b, ins, 99)
        t = time.perf_counter()
        m = graph_align.align(a, b)
        s = time.perf_counter() - t
        rows.append({"kernels": n, "seconds": s, "us_per_kernel": s / n * 1e6,
                     "matched": float((m >= 0).mean())})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replay", required=True, type=Path)
    ap.add_argument("--mapping", required=True, type=Path)
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--sizes", default="100,300,1000", help="tile sizes in MB")
    ap.add_argument("--align", default="1000,10000,100000", help="align() sequence lengths")
    args = ap.parse_args(argv)
    results = {"align": align_scaling([int(v) for v in args.align.split(",")]), "tiles": []}
    print("| kernels | align s | µs/kernel | matched |\n|---|---|---|---|")
    for r in results["align"]:
        print(f"| {r['kernels']} | {r['seconds']:.3f} | {r['us_per_kernel']:.1f} | "
              f"{r['matched']:.3f} |")
    print()
    for mb in (int(v) for v in args.sizes.split(",")):
        dst = DATA / f"graphs_{args.replay.name.split('.')[0]}_{mb}MB.json"
        if not dst.exists():
            tile(args.replay, dst, mb * 1_000_000)
        proc = subprocess.run([sys.executable, "-c", CHILD, str(dst), str(args.mapping),
                               args.model], capture_output=True, text=True, check=True,
                              cwd=ROOT)
        row = {"mb": dst.stat().st_size / 1e6, **json.loads(proc.stdout.strip().splitlines()[-1])}
        t = time.perf_counter()  # the whole command, a fresh process, no cache
        subprocess.run([sys.executable, "-m", "trace_roofline.cli", "analyze", str(dst),
                        "--model", args.model, "--graph-map", str(args.mapping), "--no-cache"],
                       capture_output=True, check=True, cwd=ROOT)
        row["analyze_graph_map_s"] = time.perf_counter() - t
        results["tiles"].append(row)
        print(json.dumps(row))
    DATA.mkdir(parents=True, exist_ok=True)
    (DATA / "graphs_results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
