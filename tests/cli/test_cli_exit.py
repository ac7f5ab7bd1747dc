"""The console script's exit (cli.run): with nothing else running it ends the process at once
after flushing its output (no interpreter teardown); otherwise it exits normally."""

import subprocess
import sys

from tests.builders import ROOT, SAMPLES, run_cli

SAMPLE = SAMPLES / "qwen2.5-7b_decode_b1_s2048_h200.json.gz"
# atexit handlers run on a normal exit only: they tell which way the process ended
PROBE = """
import atexit, sys, threading, time
atexit.register(lambda: print("interpreter exit", flush=True))
if sys.argv[1] == "thread":
    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
from trace_roofline.cli import run
run(["intensity", "--model", "qwen2.5-7b", "--hardware", "h200-sxm"])
"""


def _probe(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True,
                          text=True)


def test_quick_exit_when_alone_keeps_the_output():
    r = _probe("alone")
    assert r.returncode == 0 and "interpreter exit" not in r.stdout
    assert r.stdout.rstrip().splitlines()[-1]  # the report, flushed before the exit


def test_normal_exit_while_another_thread_runs():
    r = _probe("thread")
    assert r.returncode == 0 and r.stdout.rstrip().endswith("interpreter exit")


def test_exit_codes_and_files_through_the_console_module(tmp_path):
    ok = run_cli("analyze", str(SAMPLE), "--no-cache", "--out", str(tmp_path / "r"))
    assert ok.returncode == 0, ok.stderr
    assert "q_proj" in ok.stdout and (tmp_path / "r" / "operators.csv").stat().st_size > 0
    bad = run_cli("analyze", str(tmp_path / "missing.json"), "--no-cache")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
