"""Write every machine-readable output of `analyze` on every committed sample trace into one folder.

Used to show a refactor changes no output: run it on two checkouts and `diff -r` the folders.
    python benchmarks/snapshot_outputs.py OUT [--root CHECKOUT] [--jobs 2] [--only REGEX]
    diff -r BEFORE AFTER
Images and report.html are left out (their bytes carry render ids); paths are made relative.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
PRESET_PREFIXES = {"qwen2.5-7b": "qwen2.5-7b", "hf-qwen2-qwen2.5-7b": "qwen2.5-7b", "qwen-tiny": "qwen-tiny",
                   "hf-moe-mixtral-8x7b": "mixtral-8x7b", "hf-moe-qwen1.5-moe-a2.7b": "qwen1.5-moe-a2.7b",
                   "hf-moe-qwen3-30b-a3b": "qwen3-30b-a3b"}
KEPT = ("operators.csv", "operators_by_layer.csv", "report.json", "report.md", "ranks.csv")


def traces(root: Path) -> list[Path]:
    return sorted(p for p in (root / "sample_traces").rglob("*.json*") if ".json" in p.name
                  and not p.name.endswith(".results.json") and "busbw" not in p.name)


def model_for(p: Path) -> str | None:
    best = [m for pre, m in PRESET_PREFIXES.items() if p.name.startswith(pre)]
    return best[-1] if best else None


def run(root: Path, trace: Path, out: Path, extra: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rel = trace.relative_to(root)
    cmd = [sys.executable, "-m", "trace_roofline.cli", "analyze", str(rel), "--no-cache", "--out",
           str(out / "files"), "--per-layer", *extra]
    env = dict(os.environ, PYTHONPATH=str(root))
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    text = f"exit {r.returncode}\n{r.stdout}\n--- stderr\n{r.stderr}"
    (out / "stdout.txt").write_text(re.sub(re.escape(str(out)), "OUT", text))
    for f in (out / "files").glob("*"):
        if f.name not in KEPT:
            f.unlink()
        else:
            f.write_text(f.read_text().replace(str(out), "OUT"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--root", type=Path, default=HERE)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", type=re.compile, default=None,
                    help="only the traces whose path under sample_traces/ matches this regex")
    a = ap.parse_args()
    root = a.root.resolve()
    jobs = []
    for t in traces(root):
        rel = str(t.relative_to(root / "sample_traces"))
        if a.only is not None and not a.only.search(rel):
            continue
        name = rel.replace("/", "__")
        jobs.append((t, a.out / name / "bare", []))
        if model := model_for(t):
            jobs.append((t, a.out / name / "model", ["--model", model]))
    with ThreadPoolExecutor(a.jobs) as ex:
        list(ex.map(lambda j: run(root, *j), jobs))
    print(f"{len(jobs)} runs into {a.out}")


if __name__ == "__main__":
    main()
