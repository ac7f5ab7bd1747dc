"""Ingest benchmark: a real committed trace tiled to ~100 MB and ~1 GB, timed end to end.

For each size it runs, each in a fresh process (wall and CPU time, peak RSS of the largest
process from wait4; with --memory, one more run samples the physical memory of the whole
process tree, since big files fork a parse worker):
  load     trace_roofline.trace.load_trace(path)            (ingest alone)
  analyze  `trace-roofline analyze path` through cli.main   (ingest + attribution + costs +
           roofline + terminal report: whatever stages exist, via the public CLI), a first
           run: the benchmark's private cache directory is emptied before each run, so it
           includes writing the cache entry
  analyze-nocache   the same with --no-cache (parse only, nothing written)
  analyze-cached    `python3 -m trace_roofline.cli analyze path` again, the entry in the cache
  analyze-cached-out  the same with --out DIR (CSV/Parquet/JSON/MD and the PNG/SVG chart)
  orjson   orjson.loads of the same bytes with the GC off (a generic decoder, the yardstick:
           absolute times differ between machines, the ratio analyze/orjson less so)
  load-serial, analyze-serial   the same with the parse worker disabled (one process)
  analyze-msgspec   `analyze` (a first run) with the compiled scanner switched off: every
           event decoded by msgspec, as before the scanner (trace/_scan.c)
  hta      HolisticTraceAnalysis 0.5.0 TraceAnalysis(trace_dir=...) on the same file, in a
           throwaway venv under benchmarks/data/ (skipped with a note if it cannot be set up)
The timed runs are interleaved, every tool once per round (`--repeat` rounds), so that a ratio
such as analyze/orjson compares runs minutes apart on a machine whose speed drifts.
MB/s is uncompressed JSON megabytes (1e6 bytes) per wall second, including interpreter start
and imports (reported separately as `startup`). Results go to stdout (markdown) and to
benchmarks/data/results.json; benchmarks/README.md records the figures.

    python benchmarks/bench_ingest.py                       # 100 MB and 1 GB, with HTA
    python benchmarks/bench_ingest.py --sizes 100 --no-hta  # quick
    python benchmarks/bench_ingest.py --tools load,load-serial,analyze,analyze-serial --repeat 3 \
        --memory --no-hta
    python benchmarks/bench_ingest.py --sizes 1000 --tools analyze,orjson,analyze-cached,\
analyze-cached-out --repeat 3 --memory --no-hta --data-dir /tmp/tiles   # issue 16's figures
"""

from __future__ import annotations

import argparse
import compileall
import gzip
import importlib.util
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DATA = HERE / "data"
DEFAULT_SOURCE = ROOT / "sample_traces" / "qwen2.5-7b_decode_b1_s2048_h200.json.gz"
HTA_VENV = DATA / "hta-venv"
# HTA 0.5.0 predates pandas 3; its import-time deps without jupyterlab/pytest (not used to load).
HTA_PACKAGES = ["HolisticTraceAnalysis==0.5.0", "pandas<3", "numpy", "plotly", "pyyaml",
                "psutil", "networkx", "pydot"]

sys.path.insert(0, str(HERE))
from tile import tile  # noqa: E402

LOAD = "import sys; from trace_roofline.trace import load_trace; load_trace(sys.argv[1])"
ANALYZE = "import sys; from trace_roofline.cli import run; run(['analyze', *sys.argv[1:]])"
ORJSON = ("import gc, sys; gc.disable(); import orjson\n"
          "with open(sys.argv[1], 'rb') as f: data = f.read()\n"
          "if data[:2] == b'\\x1f\\x8b': import gzip; data = gzip.decompress(data)\n"
          "orjson.loads(data)")
CLI = ["-m", "trace_roofline.cli", "analyze"]
FIRST_RUNS = ("analyze", "analyze-msgspec")  # the cache is emptied before each of their runs
LOAD_SERIAL = ("import sys; from trace_roofline.trace import load_trace; "
               "load_trace(sys.argv[1], workers=1)")
# The CLI has no workers= to pass: automatic mode's threshold out of reach keeps it on one core.
SERIAL = "import trace_roofline.trace.parallel as P; P.PARALLEL_MIN_BYTES = float('inf'); "
# Events decoded by msgspec alone (the compiled scanner switched off), as before it existed.
MSGSPEC = "import trace_roofline.trace.columns as C; C.SCANNER = None; "
STARTUP = "import trace_roofline.cli, trace_roofline.pipeline, pandas"
HTA = ("import sys; from hta.trace_analysis import TraceAnalysis; "
       "TraceAnalysis(trace_dir=sys.argv[1])")


PAGE = os.sysconf("SC_PAGE_SIZE")


def tree_bytes(pid: int) -> int:
    """Physical memory of a process tree: the root's RSS plus each descendant's private pages
    (smaps_rollup Private_Clean + Private_Dirty). Pages a forked worker still shares with the
    root copy-on-write are counted once, in the root's RSS. Reading smaps walks the page
    tables (~25 ms for a GB-sized process), so only `--memory` runs sample it."""
    def children(p: int) -> list[int]:
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            return []
        return kids + [g for k in kids for g in children(k)]

    try:
        with open(f"/proc/{pid}/statm") as f:
            total = int(f.read().split()[1]) * PAGE
    except (OSError, ValueError):
        return 0
    for c in children(pid):
        try:
            with open(f"/proc/{c}/smaps_rollup") as f:
                total += sum(int(line.split()[1]) * 1024 for line in f
                             if line.startswith(("Private_Clean:", "Private_Dirty:")))
        except (OSError, ValueError):
            continue
    return total


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (all cores, /proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def wait_idle(limit_s: float) -> None:
    """On a shared machine: wait (at most limit_s) until other processes use < 0.1 core."""
    deadline = time.perf_counter() + limit_s
    while time.perf_counter() < deadline:
        b0 = busy_cpu_s()
        time.sleep(1.0)
        if busy_cpu_s() - b0 < 0.1:
            return


def measure(cmd: list[str], timeout: float, tree: bool = False, env: dict | None = None) -> dict:
    """Run cmd with stdout discarded: wall and CPU (user + sys, reaped children included)
    seconds and the peak RSS of its largest process (MB, from wait4). With `tree`, also the
    peak physical memory of the whole process tree (`tree_bytes`, sampled every ~20 ms); the
    sampling costs CPU, so such a run's times are not reported.

    CPU seconds are what the work costs; wall seconds also count waiting for a core when the
    machine is shared: `other_cpu_s` is the CPU time other processes took meanwhile (all cores
    busy minus ours; ~0 on a quiet machine), the load average is recorded too."""
    tree_peak = 0
    with tempfile.TemporaryFile() as err:
        busy0 = busy_cpu_s()
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT, env=env)
        deadline = t0 + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                return {"ok": False, "note": f"timed out after {timeout:.0f} s"}
            if tree:
                tree_peak = max(tree_peak, tree_bytes(proc.pid))
            time.sleep(0.02)
        wall = time.perf_counter() - t0
        busy = busy_cpu_s() - busy0
        err.seek(0)
        tail = err.read().decode(errors="replace").strip().splitlines()[-1:]
    rc = os.waitstatus_to_exitcode(status)
    cpu = usage.ru_utime + usage.ru_stime
    out = {"ok": rc == 0, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
           "other_cpu_s": round(max(busy - cpu, 0.0), 1),
           "peak_rss_mb": round(usage.ru_maxrss / 1024)}
    if tree:
        out = {"ok": rc == 0, "tree_mb": round(max(tree_peak, usage.ru_maxrss * 1024) / 2**20)}
    if rc != 0:
        out["note"] = f"exit {rc}: {tail[0] if tail else ''}"[:200]
    return out


def hta_python() -> tuple[str | None, str]:
    """The throwaway venv's python with HTA 0.5.0, creating it on first use."""
    py = HTA_VENV / "bin" / "python"
    if not py.exists():
        try:
            subprocess.run([sys.executable, "-m", "venv", str(HTA_VENV)], check=True,
                           capture_output=True, timeout=300)
            pip = [str(py), "-m", "pip", "install", "-q"]
            subprocess.run(pip + ["--no-deps", HTA_PACKAGES[0]], check=True, capture_output=True,
                           timeout=900)
            subprocess.run(pip + HTA_PACKAGES[1:], check=True, capture_output=True, timeout=900)
        except (subprocess.SubprocessError, OSError) as e:
            shutil.rmtree(HTA_VENV, ignore_errors=True)
            return None, f"HTA 0.5.0 unavailable ({type(e).__name__}: could not set up the venv)"
    probe = subprocess.run([str(py), "-c", "import hta, pandas; print(pandas.__version__)"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return None, "HTA 0.5.0 unavailable (import failed)"
    return str(py), f"HTA 0.5.0 with pandas {probe.stdout.strip()}"


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
               platform.processor())
    return (f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, "
            f"load average at start {os.getloadavg()[0]:.1f}")


def tools_for(file: Path, out: Path) -> dict[str, list[str]]:
    """Each tool's command line for one file (`out`: the cached --out run's report directory)."""
    py = sys.executable
    return {
        "load": [py, "-c", LOAD, str(file)],
        "analyze": [py, "-c", ANALYZE, str(file)],
        "analyze-nocache": [py, "-c", ANALYZE, str(file), "--no-cache"],
        "analyze-cached": [py, *CLI, str(file)],
        "analyze-cached-out": [py, *CLI, str(file), "--out", str(out)],
        "orjson": [py, "-c", ORJSON, str(file)],
        "load-serial": [py, "-c", LOAD_SERIAL, str(file)],
        "analyze-serial": [py, "-c", SERIAL + ANALYZE, str(file), "--no-cache"],
        "analyze-msgspec": [py, "-c", MSGSPEC + ANALYZE, str(file)],
    }


def summary(rows: list[dict]) -> list[str]:
    """Medians per (file, tool), then per file analyze / orjson (wall and CPU) and the memory
    ratios; markdown lines."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if r.get("wall_s"):
            groups.setdefault((r["file"], r["tool"]), []).append(r)
    lines = ["| file | tool | runs | median wall s | median CPU s | MB/s | peak RSS MB | tree MB "
             "| tree / file |", "|---|---|---|---|---|---|---|---|---|"]
    med = {}
    for (file, tool), rs in groups.items():
        wall = statistics.median(r["wall_s"] for r in rs)
        cpu = statistics.median(r["cpu_s"] for r in rs)
        med[file, tool] = (wall, cpu, rs[0])
        lines.append(f"| {file} | {tool} | {len(rs)} | {wall:.2f} | {cpu:.2f} | "
                     f"{rs[0]['mb'] / wall:.0f} | {max(r['peak_rss_mb'] for r in rs)} | "
                     f"{rs[0].get('tree_mb', '-')} | {rs[0].get('tree_x_file', '-')} |")
    for file in dict.fromkeys(f for f, _ in groups):
        if (file, "orjson") not in med:
            continue
        ow, oc, orow = med[file, "orjson"]
        for tool in ("analyze", "analyze-nocache", "analyze-msgspec", "analyze-cached", "analyze-cached-out"):
            if (file, tool) in med:
                w, c, r = med[file, tool]
                lines.append(f"- {file}: {tool} / orjson = {w / ow:.2f} wall, {c / oc:.2f} CPU; "
                             f"memory {r.get('tree_x_file', '-')}x the file "
                             f"(orjson {orow['peak_rss_mb'] * 2**20 / (orow['mb'] * 1e6):.2f}x)")
    return lines


def compile_package() -> None:
    """Byte-compile the package the tools import, as `pip install` does for an installed
    one: an editable install under PYTHONDONTWRITEBYTECODE (some CI images set it) would
    otherwise compile ~30 modules from source in every timed run (0.14 s on the Xeon)."""
    for where in importlib.util.find_spec("trace_roofline").submodule_search_locations:
        compileall.compile_dir(where, quiet=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=lambda s: Path(s).resolve(), default=DEFAULT_SOURCE)
    ap.add_argument("--sizes", default="100,1000", help="target sizes in MB, comma separated")
    ap.add_argument("--data-dir", type=Path, default=DATA,
                    help="where tiles, the cache and results go (default benchmarks/data)")
    ap.add_argument("--no-hta", action="store_true")
    ap.add_argument("--gzip", action="store_true", help="also time the .json.gz of each size")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--tools", default="load,analyze,hta",
                    help="any of load, analyze, analyze-nocache, analyze-cached, "
                         "analyze-cached-out, analyze-msgspec, orjson, hta, load-serial, analyze-serial (the "
                         "last two force the one-process parse, for comparison)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each tool (all recorded)")
    ap.add_argument("--wait-idle", type=float, default=0, metavar="S",
                    help="before each run wait up to S seconds for the machine to be idle")
    ap.add_argument("--memory", action="store_true",
                    help="one extra run of each of our tools that samples the whole process "
                         "tree's physical memory (parent + parse worker)")
    args = ap.parse_args()
    wanted = args.tools.split(",")
    data = args.data_dir.resolve()
    data.mkdir(parents=True, exist_ok=True)
    # A private cache: `analyze` empties it before each run (a first run), the cached tools
    # fill it once first; the user's own cache is never touched.
    cache = data / "cache"
    env = {**os.environ, "TRACE_ROOFLINE_CACHE_DIR": str(cache)}

    skip_hta = args.no_hta or "hta" not in wanted
    py, hta_note = (None, "HTA skipped") if skip_hta else hta_python()
    compile_package()
    startup = measure([sys.executable, "-c", STARTUP], 120)
    rows, results = [], {"machine": machine(), "source": str(args.source.relative_to(ROOT)),
                         "hta": hta_note, "startup": startup, "runs": []}
    for mb in (int(s) for s in args.sizes.split(",")):
        path = data / f"{args.source.name.split('.json')[0]}_{mb}mb.json"
        if not path.exists():
            info = tile(args.source, path, mb * 1_000_000)
            path.with_suffix(".tile.json").write_text(json.dumps(info))
        info = json.loads(path.with_suffix(".tile.json").read_text())
        size = path.stat().st_size
        files = [(path, size)]
        if args.gzip:
            gz = path.with_name(path.name + ".gz")
            if not gz.exists():
                with open(path, "rb") as f, gzip.open(gz, "wb", compresslevel=6) as g:
                    shutil.copyfileobj(f, g, 16 << 20)
            files.append((gz, size))
        for file, raw_size in files:
            commands = tools_for(file, data / "report")
            tools = [(t, commands[t]) for t in wanted if t in commands]
            if py and "hta" in wanted:
                hta_dir = data / f"hta_{file.name}"
                hta_dir.mkdir(exist_ok=True)
                link = hta_dir / file.name
                if not link.exists():
                    link.symlink_to(file)
                tools.append(("hta", [py, "-c", HTA, str(hta_dir)]))
            trees: dict[str, dict] = {}
            for tool, cmd in tools:  # the memory-sampled runs first (their times are not used)
                if args.memory and tool != "hta":
                    if tool in FIRST_RUNS:
                        shutil.rmtree(cache, ignore_errors=True)
                    elif tool.startswith("analyze-cached"):  # fill the cache (not recorded)
                        measure(commands["analyze-cached"], args.timeout, env=env)
                    trees[tool] = measure(cmd, args.timeout, tree=True, env=env)
            # the timed runs interleaved, every tool once per round, so that a ratio compares
            # runs minutes apart at most on a machine whose speed drifts
            cached = False  # whether the cache holds this file's entry (an analyze run writes it)
            for _, (tool, cmd) in itertools.product(range(args.repeat), tools):
                cold, tree = tool in FIRST_RUNS, trees.get(tool, {})
                if cold:
                    shutil.rmtree(cache, ignore_errors=True)
                elif tool.startswith("analyze-cached") and not cached:
                    measure(commands["analyze-cached"], args.timeout, env=env)  # fill it
                cached = cached or tool in FIRST_RUNS or tool.startswith("analyze-cached")
                wait_idle(args.wait_idle)
                load = os.getloadavg()[0]
                r = measure(cmd, args.timeout, env=env)
                r.update(tool=tool, file=file.name, mb=round(raw_size / 1e6),
                         events=info["events"], load_avg=round(load, 2))
                if r.get("wall_s"):
                    r["mb_per_s"] = round(raw_size / 1e6 / r["wall_s"], 1)
                    r["mb_per_cpu_s"] = round(raw_size / 1e6 / max(r["cpu_s"], 1e-3), 1)
                    r["tree_mb"] = tree.get("tree_mb", r["peak_rss_mb"] if "serial" in tool
                                            else "-")
                    if r["tree_mb"] != "-":
                        r["tree_x_file"] = round(r["tree_mb"] * 2**20 / raw_size, 2)
                results["runs"].append(r)
                rows.append(r)
                print(json.dumps(r), flush=True)
    shutil.rmtree(cache, ignore_errors=True)
    (data / "results.json").write_text(json.dumps(results, indent=2))
    print(f"\n{results['machine']}; load average at end {os.getloadavg()[0]:.1f}; {hta_note}; "
          f"startup+imports {startup.get('wall_s')} s ({startup.get('cpu_s')} s CPU), "
          f"{startup.get('peak_rss_mb')} MB\n")
    print("| file | MB | events | tool | load avg | others' CPU s | wall s | CPU s | MB/s (wall) "
          "| MB/s (CPU) | peak RSS MB | tree MB | tree / file |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [r["file"], r["mb"], r["events"], r["tool"], r["load_avg"]] + [
            r.get(k, "-") for k in ("other_cpu_s", "wall_s", "cpu_s", "mb_per_s", "mb_per_cpu_s",
                                    "peak_rss_mb", "tree_mb", "tree_x_file")]
        print("| " + " | ".join(map(str, cells)) + " |" + (f" {r['note']}" if "note" in r else ""))
    print("\n" + "\n".join(summary(rows)))


if __name__ == "__main__":
    main()
