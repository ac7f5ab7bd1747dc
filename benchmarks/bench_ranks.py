"""Many-rank benchmark: N rank-like files (a real trace tiled to ~100 MB, one copy per rank with its
own `distributedInfo`), analysed by `trace-roofline analyze DIR --no-cache` with each `--jobs J`
(and `--dask local`), under each `taskset -c` CPU list, each run a fresh process, the runs
alternating.

Reported per (CPUs, mode): wall seconds (median of --repeat runs, range), the speed-up over
`--jobs 1` on the same CPUs (run by run), CPU seconds of the whole process tree (forkserver and
Dask workers included, `run`), the processes seen, the CPU other processes took meanwhile (the
machine may be shared: /proc/stat busy time minus ours), and, with --memory, from one more run
per mode, the peak physical memory of the process tree (root RSS + each descendant's private
pages, sampled every ~50 ms; that run's time is not used). Files go to --dir
(benchmarks/data/ranks/) and are deleted at the end unless --keep (a kept folder of as many
files is reused). Results: stdout (markdown) and benchmarks/data/ranks.json.

    python benchmarks/bench_ranks.py                          # 64 x 100 MB, 3 runs per mode
    python benchmarks/bench_ranks.py --files 64 --mb 30 --cpus 0 0,1 --jobs 1,2   # one CPU, two
    python benchmarks/bench_ranks.py --files 8 --mb 20 --repeat 1   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_ingest import DATA, DEFAULT_SOURCE, busy_cpu_s, machine, wait_idle  # noqa: E402
from tile import tile  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


def _private_bytes(pid: int) -> int:
    """Private pages (clean + dirty) of one process: its own memory, not what it shares."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return sum(int(line.split()[1]) * 1024 for line in f
                       if line.startswith(("Private_Clean:", "Private_Dirty:")))
    except (OSError, ValueError):
        return 0


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, ValueError):
        return 0


def run(cmd: list[str], timeout: float, memory: bool = False) -> dict:
    """Run cmd (stdout discarded) and follow its whole process tree with psutil every ~50 ms
    (children found by parent pid, whichever thread started them: forkserver, Dask nannies).

    CPU s: the sum over every process seen of its own user + sys time at its last sample
    (a process's time after its last sample, at most ~50 ms, is missed). With `memory`, the
    peak of root RSS + descendants' private pages is sampled too (reading smaps costs CPU, so
    such a run's times are not reported)."""
    import psutil

    busy0, t0 = busy_cpu_s(), time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=HERE.parent)
    root = psutil.Process(proc.pid)
    cpu: dict[int, float] = {}
    peak = 0
    while proc.poll() is None:
        if time.perf_counter() - t0 > timeout:
            proc.kill()
            proc.wait()
            return {"ok": False, "note": f"timed out after {timeout:.0f} s"}
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for p in tree:
            try:
                t = p.cpu_times()
                cpu[p.pid] = t.user + t.system
            except psutil.NoSuchProcess:
                continue
        if memory:
            peak = max(peak, _rss_bytes(proc.pid) + sum(_private_bytes(p.pid) for p in tree[1:]))
        time.sleep(0.05)
    proc.wait()
    wall = time.perf_counter() - t0
    busy = busy_cpu_s() - busy0
    err = proc.stderr.read().decode(errors="replace").strip().splitlines()[-1:]
    ours = sum(cpu.values())
    out = {"ok": proc.returncode == 0, "wall_s": round(wall, 2), "cpu_s": round(ours, 1),
           "other_cpu_s": round(max(busy - ours, 0.0), 1), "processes": len(cpu)}
    if memory:
        out = {"ok": out["ok"], "tree_mb": round(peak / 2**20), "processes": len(cpu)}
    if proc.returncode:
        out["note"] = f"exit {proc.returncode}: {err[0] if err else ''}"[:200]
    return out


def make_ranks(source: Path, out: Path, files: int, mb: float) -> dict:
    """`files` copies of `source` tiled to ~`mb` MB, named rank<i>.pt.trace.json, each starting
    with its own distributedInfo {rank: i, world_size: files} (tile.py writes `{` then one
    top-level key per line, so the key goes in after the first line)."""
    out.mkdir(parents=True, exist_ok=True)
    base = out / "tile.json"
    info = tile(source, base, int(mb * 1e6))
    body = base.read_bytes()
    assert body.startswith(b"{\n"), "tile.py layout changed"
    for rank in range(files):
        head = json.dumps({"backend": "nccl", "rank": rank, "world_size": files})
        (out / f"rank{rank:03d}.pt.trace.json").write_bytes(
            b'{\n  "distributedInfo": ' + head.encode() + b",\n" + body[2:])
    base.unlink()
    return info


def modes(jobs: list[int], dask: bool) -> dict[str, list[str]]:
    """Each mode's flags: `--jobs J` for each J, and `--dask local` with the largest J."""
    out = {f"--jobs {j}": ["--jobs", str(j)] for j in jobs}
    if dask:
        out["--dask local"] = ["--dask", "local", "--jobs", str(max(jobs))]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, default=DEFAULT_SOURCE)
    ap.add_argument("--files", type=int, default=64)
    ap.add_argument("--mb", type=float, default=100.0, help="size of each file, MB of JSON")
    ap.add_argument("--jobs", default="1,2", help="comma-separated --jobs values, one mode each")
    ap.add_argument("--dask", action="store_true", help="also a --dask local mode")
    ap.add_argument("--cpus", nargs="+", default=["all"], metavar="LIST",
                    help="run every mode under `taskset -c LIST` for each LIST (e.g. 0 0,1); "
                         "'all': no taskset")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--memory", action="store_true",
                    help="one more run per mode for the process tree's peak memory")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                    help="before each run wait up to S seconds for a quiet machine")
    ap.add_argument("--dir", type=Path, default=DATA / "ranks", help="where the rank files go")
    ap.add_argument("--keep", action="store_true", help="keep the rank files")
    args = ap.parse_args()

    d = args.dir
    reuse = args.keep and d.is_dir() and len(list(d.glob("rank*.pt.trace.json"))) == args.files
    try:
        if reuse:
            tiled = json.loads((d / "tile.info").read_text())
        else:
            shutil.rmtree(d, ignore_errors=True)
            tiled = make_ranks(args.source, d, args.files, args.mb)
            (d / "tile.info").write_text(json.dumps(tiled))
        total = sum(p.stat().st_size for p in d.glob("rank*.pt.trace.json"))
        print(f"{machine()}\n{args.files} files x {tiled['bytes'] / 1e6:.0f} MB "
              f"({tiled['events']} events, {tiled['copies']} copies of {args.source.name}): "
              f"{total / 1e9:.2f} GB\n")
        results = _measure(args, d)
        _table(results, total)
        (DATA / "ranks.json").write_text(json.dumps(
            {"machine": machine(), "files": args.files, "bytes": total, "tile": tiled,
             "results": results}, indent=2))
    finally:
        if not args.keep:
            shutil.rmtree(d, ignore_errors=True)
        (DATA / "ranks-report.json").unlink(missing_ok=True)


def _measure(args: argparse.Namespace, d: Path) -> dict:
    """Every (CPUs, mode) run `--repeat` times, the pairs alternating run by run (a shared
    machine's load falls on all of them alike); then, with --memory, one run each for the
    tree's peak memory. Each command analyses the folder afresh (--no-cache)."""
    cmds = {}
    for cpus in args.cpus:
        prefix = [] if cpus == "all" else ["taskset", "-c", cpus]
        for name, flags in modes([int(j) for j in args.jobs.split(",")], args.dask).items():
            cmds[f"{cpus} | {name}"] = [*prefix, sys.executable, "-m", "trace_roofline.cli",
                                        "analyze", str(d), "--no-cache",
                                        "--json", str(DATA / "ranks-report.json"), *flags]
    results: dict = {key: {"runs": []} for key in cmds}
    for _ in range(args.repeat):
        for key, cmd in cmds.items():
            if args.wait_idle:
                wait_idle(args.wait_idle)
            results[key]["runs"].append(run(cmd, args.timeout))
            print(key, json.dumps(results[key]["runs"][-1]), flush=True)
    for key, cmd in cmds.items() if args.memory else ():
        results[key]["tree"] = run(cmd, args.timeout, memory=True)
        print(key, json.dumps(results[key]["tree"]), flush=True)
    return results


def _table(results: dict, total: int) -> None:
    """One row per (CPUs, mode); `x --jobs 1`: the serial run's wall over this one's, run by
    run (median and range), on the same CPUs."""
    print("\n| CPUs | mode | runs | wall s median (range) | x --jobs 1 (range) | MB/s | CPU s "
          "| processes | others' CPU s | tree peak MB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key, r in results.items():
        cpus, name = key.split(" | ")
        ok = [x for x in r["runs"] if x["ok"]]
        if not ok:
            print(f"| {cpus} | {name} | 0 | {r['runs'][0].get('note', '')} | | | | | | |")
            continue
        walls = [x["wall_s"] for x in ok]
        med = statistics.median(walls)
        base = results.get(f"{cpus} | --jobs 1", {}).get("runs", [])
        ratios = [b["wall_s"] / x["wall_s"] for b, x in zip(base, r["runs"], strict=False)
                  if b["ok"] and x["ok"]]
        speed = (f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
                 if ratios else "-")
        print(f"| {cpus} | {name} | {len(ok)} | {med:.1f} ({min(walls):.1f}-{max(walls):.1f}) | "
              f"{speed} | {total / 1e6 / med:.1f} | {statistics.median(x['cpu_s'] for x in ok):.1f} "
              f"| {max(x['processes'] for x in ok)} | {', '.join(str(x['other_cpu_s']) for x in ok)} "
              f"| {r.get('tree', {}).get('tree_mb', '-')} |")


if __name__ == "__main__":
    main()
