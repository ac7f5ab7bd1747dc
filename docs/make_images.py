"""Regenerate every image that README.md and docs/*.md show, from the committed sample traces.

    python docs/make_images.py            # all of them
    python docs/make_images.py --list     # their names, one a line

Each image is made by the `trace-roofline` CLI (on PATH after `pip install -e .`) into a
temporary directory and copied into docs/. report_html.png is a screenshot of report.html in
headless Chromium (`apt-get install chromium`); without a browser that image is left as it is
and the script exits 1 after making the others. No GPU and no torch are needed.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
S = "sample_traces/"
DECODE = S + "qwen2.5-7b_decode_b1_s2048_h200.json.gz"
PREFILL = S + "qwen2.5-7b_prefill_b1_t2048_h200.json.gz"
COMPILED = S + "qwen2.5-7b_decode_b1_s2048_compiled_noannot_h200.json.gz"
SWEEP = S + "qwen2.5-7b_msweep_q_proj_bf16_h200.json.gz"


def cli(*args: str) -> None:
    exe = shutil.which("trace-roofline")
    if exe is None:
        sys.exit("trace-roofline is not on PATH: pip install -e . first")
    subprocess.run([exe, *args], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def first_command(tmp: Path) -> Path:
    """README's first command (decode + prefill, 28 layers), once for both images that use it."""
    out = tmp / "report"
    if not (out / "roofline.png").is_file():
        cli("analyze", DECODE, PREFILL, "--model", "qwen2.5-7b", "--layers", "28", "--out", str(out))
    return out


def readme_chart(tmp: Path) -> Path:
    return first_command(tmp) / "roofline.png"


def report_html(tmp: Path) -> Path | None:
    html = first_command(tmp) / "report.html"
    if not (html).is_file():
        sys.exit("analyze wrote no report.html: install the html extra (pip install -e '.[html]')")
    browser = next((p for n in ("chromium", "chromium-browser", "google-chrome")
                    if (p := shutil.which(n))), None)
    if browser is None:
        return None
    shot = tmp / "report_html.png"
    subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--window-size=1280,1500", "--virtual-time-budget=10000", f"--screenshot={shot}",
         html.as_uri()], check=True, capture_output=True, timeout=120)
    return shot


def diff_chart(tmp: Path) -> Path:
    cli("diff", DECODE, COMPILED, "--model", "qwen2.5-7b", "--out", str(tmp / "diff"))
    return tmp / "diff" / "diff.png"


def sweep_chart(tmp: Path) -> Path:
    cli("analyze", SWEEP, "--by-shape", "--out", str(tmp / "sweep"))
    return tmp / "sweep" / "roofline.png"


def projection_chart(tmp: Path) -> Path:
    cli("project", S + "step_sweep/hf-qwen2-qwen2.5-7b-28l_decode_b4_s1024_h100.json.gz",
        "--model", "qwen2.5-7b", "--batch", "1,4,16,64,256", "--out", str(tmp / "proj"))
    return tmp / "proj" / "projection.png"


# docs/<name>: how it is made. README.md and docs/*.md reference exactly these (tests/repo/test_docs.py).
IMAGES: dict[str, Callable[[Path], Path | None]] = {
    "roofline_decode_prefill_h200.png": readme_chart,
    "report_html.png": report_html,
    "diff_eager_vs_compile.png": diff_chart,
    "msweep_q_proj_h200.png": sweep_chart,
    "project_decode_h100.png": projection_chart,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print the images' names and stop")
    args = parser.parse_args()
    if args.list:
        print("\n".join(IMAGES))
        return 0
    missing = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, make in IMAGES.items():
            made = make(Path(tmp))
            if made is None:
                missing.append(name)
                print(f"not regenerated: docs/{name} (no Chromium found: apt-get install chromium)")
                continue
            shutil.copyfile(made, DOCS / name)
            print(f"wrote docs/{name}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
