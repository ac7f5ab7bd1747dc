"""Many traces at once: --jobs (local processes) and --dask (a real distributed.LocalCluster) give
the serial run's tables; workers parse, the client does not; at most `jobs` traces in flight;
worker errors reach the caller as the one-line InputError; results are small."""

import dataclasses
import json
import pickle
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import pandas as pd
import pytest

from benchmarks.tile import tile
from tests.builders import ROOT, SAMPLES, read, run_cli
from trace_roofline.errors import InputError
from trace_roofline.model.models import get_model
from trace_roofline.options import AnalysisOptions
from trace_roofline.outputs import report
from trace_roofline.parallel import Workers, analyze_many, bounded_map, compact
from trace_roofline.pipeline import analyze_trace
from trace_roofline.roofline import coverage, operators_frame

# Real traces of every kind: annotated H200, HF eager and compiled, fused, a TP=2 rank.
TRACES = [SAMPLES / n for n in (
    "qwen2.5-7b_decode_b1_s2048_h200.json.gz",
    "hf-qwen2-qwen2.5-7b-2l_decode_b1_s512_h200.json.gz",
    "hf-qwen2-qwen2.5-7b-2l_decode_b1_s2048_static_compiled_h200.json.gz",
    "qwen2.5-7b_decode_b32_s2048_fused_noannot_h200.json.gz",
    "tp2/tp2-qwen2.5-7b-2l_decode_b8_s2048_noannot_h200/vm_664.1796069023174623233.pt.trace.json.gz",
)]
OPTIONS = AnalysisOptions(causal="causal", attention_bytes="all", layers=28)
QWEN = get_model("qwen2.5-7b")


@pytest.fixture(scope="module")
def serial():
    """The plain library run, trace by trace: what every mode must reproduce."""
    return [analyze_trace(p, QWEN, options=OPTIONS) for p in TRACES]


def _assert_same(analyses, expected):
    pd.testing.assert_frame_equal(operators_frame(analyses), operators_frame(expected))
    for a, e in zip(analyses, expected, strict=True):
        pd.testing.assert_frame_equal(a.reconciliation, e.reconciliation)
        pd.testing.assert_frame_equal(a.extrapolated, e.extrapolated)
        assert (a.whole_by_phase, a.coverage, a.extrapolated_whole) == (
            e.whole_by_phase, e.coverage, e.extrapolated_whole)
    assert report.report_dict(analyses) == report.report_dict(expected)
    assert report.terminal_table(analyses, per_layer=True) == report.terminal_table(expected, True)
    assert report.markdown(analyses) == report.markdown(expected)


# Local processes and Dask change the process that uses them for good (multiprocessing's resource
# tracker stays as a child, a Dask client leaves its event-loop threads), which would change how
# trace.py parses in later tests (it forks only from a single-threaded process, and its tests
# check that no child is left). So those modes run in a fresh interpreter, whose client refuses
# to parse: each trace is parsed once, in a worker.
ISOLATED = """
import pickle, sys
from trace_roofline import cache, parallel, pipeline

def refuse(*args, **kwargs):
    raise AssertionError("the client parsed a trace")

if __name__ == "__main__":
    cache.load_trace = pipeline.load_trace = refuse
    args, kwargs, timeout_s = pickle.loads(bytes.fromhex(sys.argv[1]))
    parallel.DASK_CONNECT_TIMEOUT_S = timeout_s
    try:
        out = parallel.analyze_many(*args, **kwargs)
    except Exception as e:  # sent back and raised by the test
        out = e
    with open(sys.argv[2], "wb") as f:
        pickle.dump(out, f)
"""


def isolated(tmp_path, paths, model=None, timeout_s=10, **kwargs):
    """parallel.analyze_many(paths, model, **kwargs) in a fresh interpreter; its error re-raised."""
    out = tmp_path / "results.pkl"
    arg = pickle.dumps(((list(paths), model), kwargs, timeout_s)).hex()
    subprocess.run([sys.executable, "-c", ISOLATED, arg, str(out)], cwd=ROOT, check=True)
    result = pickle.loads(out.read_bytes())
    if isinstance(result, Exception):
        raise result
    return result


@pytest.mark.parametrize("mode", [{"jobs": 1}, {"jobs": 2}, {"jobs": 2, "dask": "local"}],
                         ids=["serial", "jobs2", "dask-local"])
def test_same_tables_as_serial(serial, mode, tmp_path):
    if mode == {"jobs": 1}:
        results = analyze_many(TRACES, QWEN, options=OPTIONS)
    else:
        results = isolated(tmp_path, TRACES, QWEN, options=OPTIONS, workers=Workers(**mode))
    assert [r.analysis.trace for r in results] == [str(p) for p in TRACES]  # input order
    _assert_same([r.analysis for r in results], serial)


def test_the_isolated_client_cannot_parse(tmp_path):
    """The guard above can fail: the serial path parses in the (isolated) client."""
    with pytest.raises(AssertionError, match="client parsed"):
        isolated(tmp_path, TRACES[:1])


def test_cli_jobs_and_dask_print_and_write_the_serial_outputs(tmp_path):
    d = tmp_path / "ranks"
    d.mkdir()
    for rank, src in enumerate(TRACES[:3]):
        shutil.copy(src, d / f"rank{rank}.json.gz")
    texts, docs = {}, {}
    for name, flags in {"serial": [], "jobs": ["--jobs", "2"], "dask": ["--dask", "local"]}.items():
        out = tmp_path / f"{name}.json"
        r = run_cli("analyze", str(d), "--model", "qwen2.5-7b", "--json", str(out), *flags)
        assert r.returncode == 0, r.stderr
        texts[name] = r.stdout.replace(str(out), "OUT")
        docs[name] = out.read_bytes()
    assert "cross-rank summary: 3 ranks" in texts["serial"]
    assert texts["jobs"] == texts["serial"] == texts["dask"]
    assert docs["jobs"] == docs["serial"] == docs["dask"]
    assert len(json.loads(docs["serial"])["ranks"]["summary"]) > 10


def test_bounded_map_keeps_at_most_window_in_flight():
    lock, state = threading.Lock(), {"now": 0, "peak": 0, "submitted": 0}

    def work(x):
        with lock:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
        time.sleep(0.002 * (x % 3))
        with lock:
            state["now"] -= 1
        return x * x

    with ThreadPoolExecutor(max_workers=8) as pool:
        def submit(x):
            state["submitted"] += 1
            return pool.submit(work, x)

        assert bounded_map(submit, wait, range(40), 3) == [x * x for x in range(40)]
    assert state["peak"] == 3 and state["submitted"] == 40


def test_bounded_map_stops_submitting_after_an_error():
    submitted = []

    def work(x):
        if x == 1:
            raise InputError("item 1: bad")
        time.sleep(0.05)
        return x

    with ThreadPoolExecutor(max_workers=2) as pool:
        def submit(x):
            submitted.append(x)
            return pool.submit(work, x)

        with pytest.raises(InputError, match="item 1: bad"):
            bounded_map(submit, wait, range(10), 2)
    assert len(submitted) <= 3


@pytest.mark.parametrize("mode", [{"jobs": 2}, {"jobs": 2, "dask": "local"}], ids=["jobs2", "dask"])
def test_worker_input_error_names_the_file(tmp_path, mode):
    bad = tmp_path / "rank1.json"
    bad.write_text('{"traceEvents": [{"ph": "X", "name": "k"')
    with pytest.raises(InputError, match=f"^{bad}: "):
        isolated(tmp_path, [bad, TRACES[0]], workers=Workers(**mode))


def test_cli_jobs_errors_exit_2(tmp_path):
    r = run_cli("analyze", str(TRACES[0]), str(tmp_path / "missing.json"), "--jobs", "2")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "missing.json" in r.stderr
    r = run_cli("analyze", str(TRACES[0]), "--jobs", "0")
    assert r.returncode == 2 and "--jobs: expected a positive integer" in r.stderr
    with pytest.raises(InputError, match="`jobs` must be at least 1"):
        analyze_many(TRACES[:1], workers=Workers(jobs=0))


def test_dask_unreachable_and_missing(tmp_path, monkeypatch):
    with pytest.raises(InputError, match=r"^`dask` tcp://127\.0\.0\.1:9: cannot reach a Dask scheduler"):
        isolated(tmp_path, TRACES[:1], workers=Workers(dask="tcp://127.0.0.1:9"), timeout_s=1)
    monkeypatch.setitem(sys.modules, "distributed", None)  # as if the extra were not installed
    with pytest.raises(InputError, match=r"trace-roofline\[dask\]"):
        analyze_many(TRACES[:1], workers=Workers(dask="local"))


def _uncosted_trace(tmp_path) -> Path:
    """A real CPU trace whose aten::mul ops get a name with no cost rule (uncosted instances)."""
    doc = read(SAMPLES / "qwen-tiny_decode_b2_s64_l2_cpu.json.gz")
    for e in doc["traceEvents"]:
        if e.get("name") == "aten::mul":
            e["name"] = "aten::frobnicate"
    path = tmp_path / "frob.json"
    path.write_text(json.dumps(doc))
    return path


def test_compact_keeps_every_sum_and_remark(tmp_path):
    """Uncosted instances and preset mismatches (llama-3-8b on Qwen traces) stay one row each;
    device time, FLOPs, bytes and coverage are unchanged; the table shrinks."""
    for path, model in [(_uncosted_trace(tmp_path), None), (TRACES[1], get_model("llama-3-8b")),
                        (TRACES[0], None)]:
        a = analyze_trace(path, model,
                          options=AnalysisOptions(force=True))  # llama-3-8b contradicts: analysed anyway
        c = compact(a).costed
        assert list(c.dtypes.items()) == list(a.costed.dtypes.items())
        assert len(c) < len(a.costed) / 2
        cov = coverage(c)
        assert cov.keys() == a.coverage.keys()
        for key, value in a.coverage.items():  # by_evidence, fallback_by_operator: flat dicts
            assert cov[key] == pytest.approx(value, rel=1e-12), key
        for col in ("kernels", "time_us", "flops", "bytes"):
            assert c[col].sum() == pytest.approx(a.costed[col].sum(), rel=1e-12)
        pd.testing.assert_series_equal(c["uncosted"].value_counts(), a.costed["uncosted"].value_counts())
        assert sorted(c["check"].dropna()) == sorted(a.costed["check"].dropna())
        by = ["phase", "operator", "layer"]
        pd.testing.assert_frame_equal(
            c.groupby(by, dropna=False)[["time_us", "flops", "bytes"]].sum(),
            a.costed.groupby(by, dropna=False)[["time_us", "flops", "bytes"]].sum(), rtol=1e-12)
    assert (a.costed["uncosted"].isna() & a.costed["check"].isna()).all()  # TRACES[0]: all merge


def test_results_do_not_grow_with_the_trace(tmp_path):
    """A worker's answer is the operator tables and summaries: a trace tiled 10x in time (10x
    the steps and kernels) gives an answer of the same size, while the full Analysis grows."""
    tiled = tmp_path / "tiled.json"
    tile(TRACES[0], tiled, 10 * 400_000)
    small, big = analyze_many([TRACES[0], tiled], QWEN, options=OPTIONS)
    assert len(analyze_trace(tiled, QWEN).costed) >= 9 * len(analyze_trace(TRACES[0], QWEN).costed)
    assert len(big.analysis.costed) == len(small.analysis.costed)
    # (most of it: the H200's measured calibration, 47 kB, which the hardware carries); the
    # step table has a row a step, the one part that grows (10 rows here)
    assert len(big.analysis.steps) == 10 * len(small.analysis.steps)

    def stepless(r):
        return dataclasses.replace(r, analysis=dataclasses.replace(r.analysis, steps=None))
    assert len(pickle.dumps(stepless(big))) < 1.1 * len(pickle.dumps(stepless(small))) < 120_000
