"""Where the time of one `analyze` goes: each pipeline stage timed in one process, and with
--profile the top functions of each stage under cProfile.

    python benchmarks/bench_stages.py TRACE [--model qwen2.5-7b] [--profile] [--top 15]

Stages: load (load_trace; with --profile the one-process parse, since cProfile cannot see
into the forked parse worker), attribute, costs (costs.attach.attach_costs) and roofline (the rest
of roofline.analyze: placement, whole model, reconciliation). Wall seconds per stage, peak RSS
after it. Run it on a quiet machine; the times are a breakdown, not a benchmark of record
(bench_ingest.py is).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

t0 = time.perf_counter()
import trace_roofline.trace as trace_mod  # noqa: E402
from trace_roofline.attribution.attribute import attribute  # noqa: E402
from trace_roofline.costs.attach import attach_costs  # noqa: E402
from trace_roofline.model.models import get_model  # noqa: E402
from trace_roofline.pipeline import TraceFacts, analyze, trace_hardware  # noqa: E402

IMPORTS_S = time.perf_counter() - t0


def run(name: str, fn: Callable, profile: bool, top: int) -> object:
    """Call fn(), print its wall time and the peak RSS so far (and its top functions)."""
    prof = cProfile.Profile() if profile else None
    t = time.perf_counter()
    result = prof.runcall(fn) if prof else fn()
    wall = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{name:<10} {wall:7.2f} s   peak RSS {peak:6.0f} MB", flush=True)
    if prof:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
        print("\n".join(line for line in out.getvalue().splitlines()[6:] if line.strip()))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--model", help="model preset (names GEMMs of unannotated traces)")
    ap.add_argument("--profile", action="store_true", help="cProfile each stage (slower)")
    ap.add_argument("--top", type=int, default=15, help="functions listed per stage")
    args = ap.parse_args()
    model = get_model(args.model) if args.model else None
    workers = 1 if args.profile else None  # cProfile sees one process
    print(f"{'imports':<10} {IMPORTS_S:7.2f} s")
    trace = run("load", lambda: trace_mod.load_trace(args.trace, workers=workers), args.profile, args.top)
    print(f"           {len(trace.device)} device rows, {len(trace.cpu_ops)} cpu_ops, "
          f"{len(trace.runtime)} runtime, {len(trace.flows)} flows, "
          f"{len(trace.python_frames)} python frames, {len(trace.annotations)} annotations")
    attributed = run("attribute", lambda: attribute(trace, model), args.profile, args.top)
    run("costs", lambda: attach_costs(attributed, model), args.profile, args.top)
    hw = trace_hardware(trace)
    t = time.perf_counter()
    run("analyze", lambda: analyze(attributed, model, hw, facts=TraceFacts(trace=trace.path)), args.profile,
        args.top)
    print(f"(roofline = analyze - costs; analyze took {time.perf_counter() - t:.2f} s in all)")


if __name__ == "__main__":
    main()
