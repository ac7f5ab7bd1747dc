"""Start-up, cached answers and CPU shares: behaviour only, never a timing.

`--help`, `cache info` and a cached `analyze` load none of the analysis stack; a cached answer
prints and writes exactly what the analysis did; the worker counts follow the CPUs that the
affinity mask and the cgroup quota leave; a gzip trace reads into the plain file's tables.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from tests.builders import ROOT, SAMPLES, by_prefix, walk
from trace_roofline import parallel
from trace_roofline.parallel import Workers
from trace_roofline.trace import load_trace, read
from trace_roofline.trace import parallel as trace_parallel

HEAVY = ("pandas", "numpy", "pyarrow", "matplotlib", "bokeh", "msgspec")
TRACE = SAMPLES / "qwen-tiny_decode_b2_s64_l2_cpu.json.gz"
GPU_TRACE = SAMPLES / "qwen2.5-7b_decode_b1_s2048_h200.json.gz"

# Runs the CLI's main in a fresh interpreter; prints the heavy modules it imported, as JSON,
# on the last line of stderr (stdout is the command's own).
_PROBE = f"""
import json, sys
from trace_roofline import cli
try:
    code = cli.main(sys.argv[1:])
except SystemExit as e:
    code = e.code
sys.stdout.flush()
print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)), file=sys.stderr)
sys.exit(code)
"""


def _probe(*args: str, cache: Path) -> tuple[subprocess.CompletedProcess, list[str]]:
    env = {**os.environ, "TRACE_ROOFLINE_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=600)
    return done, json.loads(done.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("args", [["--help"], ["analyze", "--help"], ["cache", "info"]],
                         ids=" ".join)
def test_help_and_cache_info_import_no_analysis_stack(args, tmp_path):
    done, heavy = _probe(*args, cache=tmp_path / "c")
    assert done.returncode == 0, done.stderr
    assert heavy == []


def test_import_trace_roofline_is_lazy_and_complete():
    code = ("import sys, trace_roofline as t; assert 'pandas' not in sys.modules; "
            "assert all(getattr(t, n) is not None for n in t.__all__); print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)
    assert done.stdout.strip() == "ok", done.stderr


def test_python_dash_m_runs_the_cli():
    done = subprocess.run([sys.executable, "-m", "trace_roofline", "--help"], capture_output=True,
                          text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0 and "analyze" in done.stdout


@pytest.mark.parametrize("with_files", [False, True], ids=["table", "out+json"])
def test_a_cached_answer_is_the_analysis_output_without_the_stack(with_files, tmp_path):
    cache = tmp_path / "c"

    def run(name: str) -> tuple[str, dict[str, bytes], list[str]]:
        out = tmp_path / name
        extra = ["--out", str(out), "--json", str(out) + ".json"] if with_files else []
        done, heavy = _probe("analyze", str(GPU_TRACE), *extra, cache=cache)
        assert done.returncode == 0, done.stderr
        written = {p.name: p.read_bytes() for p in sorted(out.iterdir())} if with_files else {}
        if with_files:
            written["--json"] = Path(str(out) + ".json").read_bytes()
        return done.stdout.replace(str(out), "OUT"), written, heavy

    first, first_files, first_heavy = run("first")
    second, second_files, second_heavy = run("second")
    assert "pandas" in first_heavy and second_heavy == []
    assert second == first
    assert second_files == first_files
    if with_files:
        assert set(first_files) == {"--json", "operators.csv", "operators_by_layer.csv",
                                    "operators.parquet", "report.json", "report.md",
                                    "report.html", "roofline.png", "roofline.svg"}


def test_a_changed_trace_or_argument_is_not_answered_from_the_cache(tmp_path):
    trace = tmp_path / "t.json.gz"
    trace.write_bytes(TRACE.read_bytes())
    cache = tmp_path / "c"
    first, _ = _probe("analyze", str(trace), cache=cache)
    _, heavy = _probe("analyze", str(trace), cache=cache)
    assert heavy == []
    _, heavy = _probe("analyze", str(trace), "--causal", "full", cache=cache)
    assert "pandas" in heavy  # another argument: computed
    trace.write_bytes(gzip.compress(gzip.decompress(TRACE.read_bytes()) + b" "))
    again, heavy = _probe("analyze", str(trace), cache=cache)
    assert "pandas" in heavy and again.stdout == first.stdout  # the same trace, a new file
    _, heavy = _probe("analyze", str(trace), "--no-cache", cache=cache)
    assert "pandas" in heavy


# ---------------------------------------------------------------------------------------------
# The CPUs this process may use: affinity and the cgroup quota.
@pytest.fixture
def cgroup(tmp_path, monkeypatch):
    """Point the cgroup files at `tmp_path` (none exist until written) and give the process
    four CPUs of affinity."""
    paths = {name: tmp_path / name for name in ("cpu.max", "quota", "period")}
    monkeypatch.setattr(trace_parallel, "CGROUP_CPU_MAX", paths["cpu.max"])
    monkeypatch.setattr(trace_parallel, "CGROUP_V1_QUOTA", paths["quota"])
    monkeypatch.setattr(trace_parallel, "CGROUP_V1_PERIOD", paths["period"])
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    return paths


@pytest.mark.parametrize(("cpu_max", "cores"), [
    (None, 4), ("max 100000\n", 4), ("50000 100000\n", 1), ("150000 100000\n", 1),
    ("200000 100000\n", 2), ("800000 100000\n", 4), ("garbage\n", 4),
])
def test_usable_cores_reads_the_cgroup_v2_quota(cgroup, cpu_max, cores):
    if cpu_max is not None:
        cgroup["cpu.max"].write_text(cpu_max)
    assert trace_parallel.usable_cores() == cores


@pytest.mark.parametrize(("quota", "cores"), [("-1", 4), ("100000", 1), ("300000", 3)])
def test_usable_cores_reads_the_cgroup_v1_quota(cgroup, quota, cores):
    cgroup["quota"].write_text(quota + "\n")
    cgroup["period"].write_text("100000\n")
    assert trace_parallel.usable_cores() == cores


def test_a_one_cpu_quota_forks_no_parse_worker(cgroup):
    cgroup["cpu.max"].write_text("100000 100000\n")
    assert not trace_parallel.use_worker(1 << 30, None)
    assert trace_parallel.use_worker(1 << 30, 2)  # (asked for explicitly: as before)


def test_pool_workers_sharing_the_cpus_fork_no_parse_worker(cgroup, monkeypatch):
    monkeypatch.setattr(trace_parallel, "_sharing", 1)
    trace_parallel.share_cores(2)
    assert trace_parallel.usable_cores() == 4 and trace_parallel.use_worker(1 << 30, None)
    trace_parallel.share_cores(3)
    assert not trace_parallel.use_worker(1 << 30, None)


def test_jobs_never_start_more_processes_than_cpus(monkeypatch):
    def no_pool(*args, **kwargs):
        raise AssertionError("a process pool on one CPU")

    monkeypatch.setattr(parallel, "usable_cores", lambda: 1)
    monkeypatch.setattr(parallel, "_on_processes", no_pool)
    results = parallel.analyze_many([TRACE, TRACE], workers=Workers(jobs=2))
    assert [r.analysis.trace for r in results] == [str(TRACE)] * 2


# ---------------------------------------------------------------------------------------------
def _tables(trace) -> dict[str, pd.DataFrame]:
    return {name: getattr(trace, name) for name in
            ("device", "cpu_ops", "runtime", "annotations", "python_frames", "flows")}


@pytest.mark.parametrize("path", walk(sorted(SAMPLES.glob("*.json.gz"))[:8], by_prefix))
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("streamed", [False, True], ids=["inflated first", "streamed"])
def test_a_gzip_trace_reads_into_the_plain_files_tables(path, workers, streamed, tmp_path,
                                                        monkeypatch):
    """Inflated whole before the parse, or parsed while a thread inflates it (streamed: the
    thresholds lowered so that these small files stream too, the batches past 4 kB from the
    end waiting for the whole text, a worker forked once it is there)."""
    monkeypatch.setattr(read, "STREAM_MIN_BYTES", 0 if streamed else 1 << 62)
    monkeypatch.setattr(trace_parallel, "SEARCH_BYTES", 4096)
    plain = tmp_path / path.name.removesuffix(".gz")
    plain.write_bytes(gzip.decompress(path.read_bytes()))
    a, b = load_trace(path, workers=workers), load_trace(plain, workers=workers)
    for name, table in _tables(a).items():
        pd.testing.assert_frame_equal(table, _tables(b)[name], check_exact=True, obj=name)
    assert {k: v for k, v in a.meta.items() if k != "path"} == \
        {k: v for k, v in b.meta.items() if k != "path"}


@pytest.mark.parametrize("damage", ["two members", "a wrong trailer size", "truncated", "corrupt"])
def test_a_gzip_file_that_cannot_stream_reads_as_before(damage, tmp_path, monkeypatch):
    """Streaming gives up, and the file is read inflated first: its tables, or its own error."""
    monkeypatch.setattr(read, "STREAM_MIN_BYTES", 0)
    text = gzip.decompress(TRACE.read_bytes())
    packed = gzip.compress(text)
    data = {"two members": gzip.compress(text[:1000]) + gzip.compress(text[1000:]),
            "a wrong trailer size": packed[:-4] + (len(text) + 1).to_bytes(4, "little"),
            "truncated": packed[: len(packed) // 2] + packed[-4:],
            "corrupt": packed[:100] + bytes(200) + packed[300:]}[damage]
    path = tmp_path / "t.json.gz"
    path.write_bytes(data)
    monkeypatch.setattr(read, "STREAM_MIN_BYTES", 1 << 62)
    try:
        expected: object = _tables(load_trace(path))
    except Exception as e:  # noqa: BLE001 - the error the file gives when inflated first
        expected = (type(e), str(e))
    monkeypatch.setattr(read, "STREAM_MIN_BYTES", 0)
    try:
        got: object = _tables(load_trace(path))
    except Exception as e:  # noqa: BLE001
        got = (type(e), str(e))
    if isinstance(expected, dict):
        assert isinstance(got, dict)
        for name, table in expected.items():
            pd.testing.assert_frame_equal(got[name], table, check_exact=True, obj=name)
    else:
        assert got == expected
