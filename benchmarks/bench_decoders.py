"""Which JSON decoder and gzip codec: measured on a tiled trace (see bench_ingest.py).

Each variant runs in a fresh process and times only its work (imports and, for the decoders,
reading the file are excluded); peak RSS is the whole process. The generic decoders only build
Python objects (no tables yet); `load_trace` is the whole ingest, reading and tables included.

    python benchmarks/bench_decoders.py [benchmarks/data/<tiled>.json]
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_ingest import DATA  # noqa: E402

READ = "import sys, gc; data = open(sys.argv[1], 'rb').read()\n"
VARIANTS = {
    "stdlib json, gc on": (READ + "import json", "json.loads(data)"),
    "stdlib json, gc off": (READ + "import json; gc.disable()", "json.loads(data)"),
    "orjson, gc on": (READ + "import orjson", "orjson.loads(data)"),
    "orjson, gc off": (READ + "import orjson; gc.disable()", "orjson.loads(data)"),
    "msgspec generic, gc off": (READ + "import msgspec; gc.disable()", "msgspec.json.decode(data)"),
    "msgspec typed structs, one decode": (
        READ + "import msgspec; from trace_roofline.trace.decode import _Event\n"
        "T = msgspec.defstruct('T', [('traceEvents', list[_Event])])",
        "msgspec.json.decode(data, type=T)"),
    # one process (the decoders are compared on one core; process_time counts no worker)
    "load_trace: batched msgspec + tables": (
        "import sys; from trace_roofline.trace import load_trace",
        "load_trace(sys.argv[1], workers=1)"),
}
# Each child times only the work (imports and, for the decoders, reading the file excluded).
TIMED = ("{setup}\nimport time, resource\nt, c = time.perf_counter(), time.process_time()\n"
         "{work}\nprint(time.perf_counter() - t, time.process_time() - c,"
         " resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")
GUNZIP = ("import sys; sys.path[:0] = {extra!r}; import {mod} as z\n"
          "data = open(sys.argv[1], 'rb').read()",
          "d = z.decompressobj(wbits=31); n = 0\n"
          "for i in range(0, len(data), 1 << 24): n += len(d.decompress(data[i:i + (1 << 24)]))")


def timed(setup: str, work: str, path: Path) -> tuple[float, float, float] | None:
    """(wall s, CPU s, peak RSS MB) of `work` in a fresh process, or None if it failed."""
    r = subprocess.run([sys.executable, "-c", TIMED.format(setup=setup, work=work), str(path)],
                       capture_output=True, text=True, timeout=900)
    return tuple(map(float, r.stdout.split())) if r.returncode == 0 else None


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else next(DATA.glob("*_100mb.json"))
    mb = path.stat().st_size / 1e6
    print(f"{path.name}: {mb:.0f} MB\n\n| decoder | wall s | CPU s | MB/s (CPU) | peak RSS MB |")
    print("|---|---|---|---|---|")
    for name, (setup, work) in VARIANTS.items():
        r = timed(setup, work, path)
        print(f"| {name} | {r[0]:.2f} | {r[1]:.2f} | {mb / r[1]:.0f} | {r[2]:.0f} |" if r
              else f"| {name} | failed |", flush=True)
    gz = path.with_name(path.name + ".gz")
    if not gz.exists():
        return
    isal = DATA / "isal"
    if not isal.exists():  # measured only; not a dependency of the package
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(isal),
                        "isal"], capture_output=True)
    print("\n| gunzip | CPU s | MB/s out (CPU) |\n|---|---|---|")
    for mod, extra in (("zlib", []), ("isal.isal_zlib", [str(isal)])):
        setup, work = GUNZIP
        r = timed(setup.format(extra=extra, mod=mod), work, gz)
        print(f"| {mod} | {r[1]:.2f} | {mb / r[1]:.0f} |" if r else f"| {mod} | unavailable |")


if __name__ == "__main__":
    main()
