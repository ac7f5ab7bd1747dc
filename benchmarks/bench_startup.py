"""Start-up, cached answers, gzip and --jobs under a CPU share, side by side (issue 36).

Every command runs in a fresh process; the trees compared (`--before DIR`: a checkout of the
code before, e.g. `git archive <commit> | tar -x -C DIR`; and this tree) alternate run by run,
so that both see the same machine. Wall and CPU seconds (user + sys of the whole process tree,
from wait4) are medians; the ratio is after / before.

    python benchmarks/bench_startup.py --before /tmp/tr_base --repeat 5
    python benchmarks/bench_startup.py --gzip TILE.json --repeat 3 [--before DIR]   # TILE.json.gz beside it
    python benchmarks/bench_startup.py --ranks DIR --repeat 2 [--before DIR]   # --jobs 2 vs 1, taskset
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "sample_traces" / "qwen2.5-7b_decode_b1_s2048_h200.json.gz"
CLI = "import sys; from trace_roofline.cli import run; sys.argv[0] = 'trace-roofline'; run()"
LOAD = "import sys; from trace_roofline.trace import load_trace; load_trace(sys.argv[1])"


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall s, CPU s of the process and its children) of one run in its tree (`python -c`
    imports from the working directory first); its output discarded."""
    t = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, cwd=env["PYTHONPATH"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    err = proc.stderr.read().decode() if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{err}")
    return wall, usage.ru_utime + usage.ru_stime


def env_for(tree: Path, cache: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "TRACE_ROOFLINE_CACHE_DIR": str(cache)}


def compare(cases: dict[str, list[str]], trees: dict[str, Path], repeat: int,
            warm: bool, prefix: list[str] | None = None) -> None:
    """Run every case on every tree `repeat` times, alternating the trees; print medians."""
    caches = {name: Path(tempfile.mkdtemp(prefix=f"bench-{name}-")) for name in trees}
    try:
        rows: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for case, args in cases.items():
            argv = [*(prefix or []), sys.executable, *args]
            if warm:  # fill each tree's cache (the analysis and its answer)
                for name, tree in trees.items():
                    timed(argv, env_for(tree, caches[name]))
            for _ in range(repeat):
                for name, tree in trees.items():
                    rows.setdefault((case, name), []).append(timed(argv, env_for(tree, caches[name])))
        # the ratios: to the first tree's run of the case, or with one tree, to the first case
        print("| case | tree | runs | wall s (median, range) | CPU s (median) | wall ratio | CPU ratio |")
        print("|---|---|---|---|---|---|---|")
        base: tuple[float, float] | None = None
        for case in cases:
            if len(trees) > 1:
                base = None
            for name in trees:
                walls, cpus = zip(*rows[(case, name)], strict=True)
                wall, cpu = statistics.median(walls), statistics.median(cpus)
                base = base or (wall, cpu)
                print(f"| {case} | {name} | {len(walls)} | {wall:.2f} ({min(walls):.2f}-{max(walls):.2f}) "
                      f"| {cpu:.2f} | {wall / base[0]:.2f} | {cpu / base[1]:.2f} |")
    finally:
        for d in caches.values():
            shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", type=Path, help="a checkout of the code before (start-up cases)")
    ap.add_argument("--trace", type=Path, default=TRACE, help="the trace of the cached analyze")
    ap.add_argument("--gzip", type=Path, help="a plain tile whose .gz sits beside it: load both")
    ap.add_argument("--ranks", type=Path, help="a folder of rank files: --jobs 2 vs 1, one CPU and all")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    here = {"after": ROOT}
    trees = {"before": args.before, **here} if args.before else here
    if args.before and not (args.gzip or args.ranks):
        out = Path(tempfile.mkdtemp(prefix="bench-out-"))
        compare({"--help": ["-c", CLI, "--help"],
                 "cache info": ["-c", CLI, "cache", "info"],
                 "analyze (cached), table": ["-c", CLI, "analyze", str(args.trace)],
                 "analyze (cached), --out": ["-c", CLI, "analyze", str(args.trace), "--out", str(out)]},
                {"before": args.before, **here}, args.repeat, warm=True)
    if args.gzip:
        gz = args.gzip.with_name(args.gzip.name + ".gz")
        compare({"load .json": ["-c", LOAD, str(args.gzip)],
                 "load .json.gz": ["-c", LOAD, str(gz)]}, trees, args.repeat, warm=False)
    if args.ranks:
        for cpus in ("0", "0,1"):
            print(f"\ntaskset -c {cpus}:")
            compare({f"--jobs {j}": ["-c", CLI, "analyze", str(args.ranks), "--no-cache", "--jobs", j]
                     for j in ("1", "2")}, trees, args.repeat, warm=False, prefix=["taskset", "-c", cpus])


if __name__ == "__main__":
    main()
