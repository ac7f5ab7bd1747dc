"""Hostile, odd and unlucky files: output paths that are no regular file, FIFOs, subnormal
durations, gzip bombs, markup and formulas in names, shared cache roots, unparsed strides;
each test fails on the code before its fix."""

from __future__ import annotations

import gzip
import json
import os
import stat
from pathlib import Path

import pytest

from tests.builders import gpu_trace, run_cli, write
from trace_roofline.model import hardware
from trace_roofline.pipeline import Run

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------- row 3: a subnormal duration
def _three_events(dur: float) -> dict:
    """A cpu op, its launch and its kernel (a 3-event trace), the kernel `dur` µs."""
    h200 = {"id": 0, "name": "NVIDIA H200", "totalGlobalMem": 150754820096, "computeMajor": 9,
            "computeMinor": 0, "numSms": 132}
    dims, types = [[64, 64], [64, 64]], ["c10::BFloat16"] * 2
    return {"deviceProperties": [h200], "traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 1, "dur": 10,
         "args": {"External id": 1, "Input Dims": dims, "Input type": types}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
         "ts": 2, "dur": 1, "args": {"External id": 1, "correlation": 5}},
        {"ph": "X", "cat": "kernel", "name": "gemm_kernel", "pid": 0, "tid": 7, "ts": 20,
         "dur": dur, "args": {"External id": 1, "correlation": 5, "device": 0, "stream": 7}},
    ]}


def test_subnormal_kernel_duration_is_analysed(tmp_path):
    """A kernel of 1e-320 µs: 1e-326 s is 0.0 in floating point, and whole_model divided the
    FLOPs by it (ZeroDivisionError, exit 1). Now analysed: no achieved rate, exit 0."""
    trace = write(_three_events(1e-320), tmp_path / "t.json")
    r = run_cli("analyze", str(trace), "--no-cache", "--json", str(tmp_path / "r.json"))
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    whole = json.loads((tmp_path / "r.json").read_text())
    assert "whole model" in r.stdout and whole


def test_whole_model_and_coverage_of_a_subnormal_time():
    import pandas as pd

    from trace_roofline.roofline import whole_model

    table = pd.DataFrame({"layer": [pd.NA], "flops": [1e6], "bytes": [1e4], "time_us": [1e-320],
                          "costed_time_us": [1e-320], "kernels": [1], "uncosted": [0],
                          "phase": ["decode"], "dtype": ["bf16"]})
    w = whole_model(table, hardware.PRESETS["h200-sxm"])
    assert w["achieved_flops_per_s"] != w["achieved_flops_per_s"]  # NaN: no rate in 0 s


# ----------------------------------------------------------------- row 13: devices without presets
@pytest.mark.parametrize(("name", "preset"), [
    ("NVIDIA H800", "h800-sxm"),
    ("NVIDIA GH200 480GB", "gh200"),
    ("Tesla V100-SXM2-32GB", "v100-sxm2"),
    ("Tesla V100-PCIE-16GB", "v100-pcie"),
    ("NVIDIA L4", "l4"),
    ("NVIDIA L40S", "l40s"),
    ("NVIDIA H20", "h20"),
    ("NVIDIA A100-SXM4-80GB", "a100-sxm"),
    ("NVIDIA A100-SXM4-40GB", "a100-sxm-40gb"),
    ("NVIDIA A100 80GB PCIe", "a100-pcie"),
    ("AMD Instinct MI250X", "mi250x"),
])
def test_common_devices_have_presets(name, preset):
    """Traces of an H800, a GH200 or a V100 had no preset: 'none given (no device in the
    trace)'. Each common device now has one, every figure cited."""
    hw = hardware.for_device_name(name)
    assert hw is not None and hw.name == preset
    assert hw.source and hw.mem_bandwidth > 0 and hw.peak_flops
    assert hw.link_bandwidth is None or hw.link_source


def test_datasheet_figures_of_the_new_presets():
    p = hardware.PRESETS
    assert p["h800-sxm"].peak("bf16") == p["h100-sxm"].peak("bf16") and p["h800-sxm"].link_bandwidth == 200e9
    assert p["gh200"].mem_bandwidth == 4.0e12 and p["gh200-144g"].mem_bandwidth == 4.9e12
    assert p["v100-sxm2"].peak("fp16") == 125e12 and "bf16" not in p["v100-sxm2"].peak_flops
    assert p["l4"].peak("bf16") == 121e12 and p["l4"].mem_bandwidth == 300e9
    assert p["mi250x"].peak("bf16") == 191.5e12 and p["mi250x"].mem_bandwidth == 1.6e12
    assert p["a100-sxm-40gb"].mem_bandwidth == 1555e9 and p["a100-pcie"].mem_bandwidth == 1935e9


def test_a_device_without_a_preset_is_named(tmp_path):
    """A device no preset knows: the output says which device and to pass --hardware (it said
    'none given (no device in the trace)')."""
    doc = gpu_trace(1)
    doc["deviceProperties"] = [{**doc["deviceProperties"][0], "name": "NVIDIA RTX A6000"}]
    r = run_cli("analyze", str(write(doc, tmp_path / "t.json")), "--no-cache")
    assert r.returncode == 0, r.stderr
    assert "device 'NVIDIA RTX A6000' in the trace has no preset: pass --hardware" in r.stdout
    assert "no device in the trace" not in r.stdout


# ----------------------------------------------------------------- row 1: outputs over odd files
def _special(kind: str, path: Path) -> Path:
    """A FIFO, a character device node (/dev/full's numbers, made here: never a system node)
    or a socket at `path`; skip where this system cannot make one."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        try:
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 7))
        except (PermissionError, OSError) as e:
            pytest.skip(f"cannot make a device node here ({e})")
    else:
        import socket

        if len(str(path)) > 100:
            pytest.skip("temporary path too long for a unix socket")
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()
    return path


def _same_kind(path: Path, kind: str) -> bool:
    mode = os.lstat(path).st_mode
    return {"fifo": stat.S_ISFIFO, "device": stat.S_ISCHR, "socket": stat.S_ISSOCK}[kind](mode)


@pytest.mark.parametrize("kind", ["fifo", "device", "socket"])
@pytest.mark.parametrize("flag", ["--json", "--perfetto"])
def test_an_output_that_is_not_a_regular_file_is_never_replaced(tmp_path, kind, flag):
    """`--json /dev/full` (as root) renamed the report over the device node. A node, FIFO or
    socket given as an output is now refused before the work: one line, exit 2, untouched."""
    trace = write(gpu_trace(1), tmp_path / "t.json")
    target = _special(kind, tmp_path / "out.json")
    r = run_cli("analyze", str(trace), "--no-cache", flag, str(target), timeout=120)
    assert r.returncode == 2, r.stderr
    assert str(target) in r.stderr and "not a regular file" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert _same_kind(target, kind)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary


def test_a_fifo_inside_out_is_never_replaced(tmp_path):
    trace = write(gpu_trace(1), tmp_path / "t.json")
    out = tmp_path / "out"
    out.mkdir()
    fifo = _special("fifo", out / "report.json")
    r = run_cli("analyze", str(trace), "--no-cache", "--out", str(out), timeout=120)
    assert r.returncode == 2 and str(fifo) in r.stderr and "not a regular file" in r.stderr
    assert _same_kind(fifo, "fifo") and sorted(p.name for p in out.iterdir()) == ["report.json"]


def test_write_files_and_its_last_rename_refuse_a_node(tmp_path):
    """Checked before the work and again at the rename (the path may have changed between)."""
    from trace_roofline import files
    from trace_roofline.errors import InputError

    fifo = _special("fifo", tmp_path / "r.json")
    with pytest.raises(InputError, match="not a regular file"):
        files.write_files({fifo: b"{}"})
    staged = tmp_path / "staged"
    staged.write_bytes(b"{}")
    with pytest.raises(InputError, match="not a regular file"):
        files._move(staged, fifo)
    assert _same_kind(fifo, "fifo") and staged.exists()
    with pytest.raises(InputError, match="not a regular file"), files.staged_file(fifo):
        pass


# ----------------------------------------------------------------- row 2: a FIFO as an input
@pytest.mark.parametrize("cache", [True, False])
def test_a_fifo_given_as_the_trace_is_refused_without_blocking(tmp_path, cache):
    """A FIFO as the trace blocked forever in open() (nobody writes it): now 'not a regular
    file', exit 2, at once (the timeout turns a hang into a failure)."""
    fifo = _special("fifo", tmp_path / "t.json")
    r = run_cli("analyze", str(fifo), *(() if cache else ("--no-cache",)), timeout=60)
    assert r.returncode == 2, r.stderr
    assert f"{fifo}: is a FIFO (named pipe), not a regular file" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(("flag", "name"), [("--hardware", "hw.json"), ("--ncu", "k.ncu.csv")])
def test_a_fifo_given_as_another_input_is_refused(tmp_path, flag, name):
    trace = write(gpu_trace(1), tmp_path / "t.json")
    fifo = _special("fifo", tmp_path / name)
    r = run_cli("analyze", str(trace), "--no-cache", flag, str(fifo), timeout=60)
    assert r.returncode == 2, r.stderr
    assert str(fifo) in r.stderr and "not a regular file" in r.stderr


def test_a_fifo_named_like_a_trace_in_a_directory_is_never_opened(tmp_path):
    """tensorboard_trace_handler's glob matched a FIFO named *.pt.trace.json, and sniffing it
    blocked; it is left out (not a file)."""
    write(gpu_trace(1), tmp_path / "a.pt.trace.json")
    _special("fifo", tmp_path / "b.pt.trace.json")
    r = run_cli("analyze", str(tmp_path), "--no-cache", timeout=120)
    assert r.returncode == 0, r.stderr
    assert "whole model" in r.stdout


def test_open_regular_refuses_a_fifo_in_process(tmp_path):
    from trace_roofline.errors import InputError
    from trace_roofline.files import open_regular, read_json

    fifo = _special("fifo", tmp_path / "c.json")
    with pytest.raises(InputError, match="not a regular file"):
        open_regular(fifo)
    with pytest.raises(InputError, match="not a regular file"):
        read_json(fifo)
    with pytest.raises(InputError, match="not a regular file"):
        read_json(tmp_path)


# ----------------------------------------------------------------- row 7: a gzip bomb
def _bomb(path: Path, mb: int) -> Path:
    """A .json.gz whose traceEvents array holds `mb` MB of spaces (~1 KB compressed per MB)."""
    import zlib

    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    spaces = b" " * (1 << 20)
    with open(path, "wb") as f:
        f.write(c.compress(b'{"traceEvents": ['))
        for _ in range(mb):
            f.write(c.compress(spaces))
        f.write(c.compress(b"]}") + c.flush())
    return path


def test_a_gzip_bomb_is_refused_in_bounded_memory(tmp_path, monkeypatch):
    """200 MB of whitespace in ~200 KB of gzip was inflated whole (a 2 MB bomb: 3.3 GB RSS). Now
    inflating stops at the limit (here a floor of 8 MB instead of 256, to be quick), a clear
    one-line InputError, having held little more than the limit."""
    import tracemalloc

    from trace_roofline.errors import InputError
    from trace_roofline.trace import load_trace, read

    monkeypatch.setattr(read, "INFLATION_FLOOR", 8 << 20)
    bomb = _bomb(tmp_path / "bomb.json.gz", 200)
    assert bomb.stat().st_size < 1 << 20
    tracemalloc.start()
    try:
        with pytest.raises(InputError, match="refused as a gzip bomb") as e:
            load_trace(bomb, workers=1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(bomb) in str(e.value) and "\n" not in str(e.value)
    assert peak < 64 << 20, peak  # the limit and a chunk, not 200 MB


def test_gzip_under_the_limit_inflates_as_before(tmp_path, monkeypatch):
    """A trace within the ratio (and concatenated members) loads unchanged; the limit is the
    larger of MAX_INFLATION x the file and INFLATION_FLOOR."""
    from trace_roofline.trace import load_trace, read

    doc = json.dumps(gpu_trace(1)).encode()
    one = tmp_path / "one.json.gz"
    one.write_bytes(gzip.compress(doc[:100]) + gzip.compress(doc[100:]))
    monkeypatch.setattr(read, "INFLATION_FLOOR", 0)
    assert len(doc) < read.MAX_INFLATION * one.stat().st_size
    plain = write(gpu_trace(1), tmp_path / "p.json")
    assert len(load_trace(one, workers=1).device) == len(load_trace(plain).device)
    assert read.inflation_limit(10) == 1000
    monkeypatch.setattr(read, "INFLATION_FLOOR", 1 << 28)
    assert read.inflation_limit(10) == 1 << 28


# ----------------------------------------------------------------- row 12: --perfetto, several models
@pytest.mark.parametrize("name", ["misleading/t5_dit_cpu.json.gz",
                                  "families_h200/llama_assisted_h200.json.gz"])
def test_perfetto_of_a_trace_of_several_models_is_written(tmp_path, name):
    """A trace holding several models (T5 text encoder + DiT; an assisted generate's target and
    draft): --perfetto raised ValueError ('analysis was not computed from attributed'), since
    only the first model's instances were looked for. Each kernel is now placed with its own
    model's analysis, every analysed kernel enriched."""
    trace = ROOT / "sample_traces" / name
    out = tmp_path / "p.json"
    r = run_cli("analyze", str(trace), "--no-cache", "--perfetto", str(out), timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    doc = json.loads(out.read_bytes())
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    enriched = [e for e in events if isinstance(e.get("args"), dict) and "roofline" in e["args"]]
    slices = [e for e in events if e.get("cat") == "trace_roofline" and e.get("ph") == "X"]
    assert enriched and slices
    assert sum(s["args"]["kernels"] for s in slices) == len(enriched)


def test_kernel_figures_place_each_model_on_its_own_analysis():
    from trace_roofline.outputs.perfetto import bands, kernel_figures
    from trace_roofline.pipeline import analyze_trace_kernels

    analysis, att = analyze_trace_kernels(ROOT / "sample_traces/misleading/t5_dit_cpu.json.gz")
    assert analysis.models  # (two models in the trace)
    k = kernel_figures(att.trace, att.kernels, analysis)
    assert len(k) == len(att.kernels) and set(k["part"]) == {0, 1}
    for i, part in enumerate([analysis, *analysis.models]):
        assert (k["part"] == i).sum() == part.costed["kernels"].sum()
    b = bands(k, analysis)
    assert b["kernels"].sum() == len(k) and b.groupby("band")["part"].nunique().max() == 1


# ----------------------------------------------------------------- row 9: CSV injection
def test_formula_like_cells_are_neutralised_and_numbers_kept():
    """A text cell starting with = + - @, a tab or a CR is what a spreadsheet runs as a formula:
    it gets a leading `'`; numbers (-0.5), missing values and other text are unchanged."""
    import pandas as pd

    from trace_roofline.outputs.report import csv_bytes, neutralised

    frame = pd.DataFrame({
        "name": ["=cmd|' /C calc'!A0", "+1", "-x", "@SUM(A1)", "\tz", "\rz", "ok", None],
        "value": [-0.5, 1.0, -2.0, 3.0, 4.0, 5.0, 6.0, float("nan")],
        "cat": pd.Categorical(["=1", "a", "a", "a", "a", "a", "a", "a"]),
        "s": pd.array(["-1", None, "a", "b", "c", "d", "e", "f"], dtype="string"),
    })
    out = neutralised(frame)
    assert out["name"].tolist()[:7] == ["'=cmd|' /C calc'!A0", "'+1", "'-x", "'@SUM(A1)", "'\tz",
                                        "'\rz", "ok"]
    assert pd.isna(out["name"].iloc[7]) and out["cat"].iloc[0] == "'=1" and out["s"].iloc[0] == "'-1"
    assert out["value"].equals(frame["value"])  # numbers stay numbers
    import io

    back = pd.read_csv(io.StringIO(csv_bytes(frame).decode()))
    assert back["value"].iloc[0] == -0.5 and back["name"].iloc[0] == "'=cmd|' /C calc'!A0"
    assert frame["name"].iloc[0] == "=cmd|' /C calc'!A0"  # the caller's frame untouched


def test_operators_csv_of_a_trace_named_like_a_formula(tmp_path):
    """The trace column holds the path as given: a trace saved as `=cmd|' -C calc'!A0.json`
    put a formula at the start of an operators.csv cell."""
    import subprocess
    import sys

    name = "=cmd|' -C calc'!A0.json"
    write(gpu_trace(1), tmp_path / name)
    r = subprocess.run([sys.executable, "-m", "trace_roofline.cli", "analyze", name, "--no-cache",
                        "--out", "out"], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert r.returncode == 0, r.stderr
    for csv in ("operators.csv", "operators_by_layer.csv"):
        import pandas as pd

        table = pd.read_csv(tmp_path / "out" / csv)
        assert (table["trace"] == "'" + name).all()
        assert not table.map(lambda v: isinstance(v, str) and v[:1] in "=+-@\t\r").any().any()


# ----------------------------------------------------------------- row 10: the cache's root
NOBODY = 65534
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a directory to another user")


def test_a_shared_or_root_cache_dir_gets_a_per_user_subdirectory(tmp_path):
    """TRACE_ROOFLINE_CACHE_DIR=/ created /v4; a world-writable directory (/tmp) took the
    version directories too. Only the user's own directory that others cannot write is used as
    it is; anything else holds the user's private `trace-roofline-<uid>`."""
    from trace_roofline.cache import TraceCache, cache_base

    uid = os.getuid()
    assert cache_base(Path("/")) == Path(f"/trace-roofline-{uid}")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    assert cache_base(shared) == shared / f"trace-roofline-{uid}"
    own = tmp_path / "own"
    assert cache_base(own) == own  # (new: created 0700 at the first write)
    own.mkdir(mode=0o700)
    assert cache_base(own) == own and TraceCache(own).root == own / "v4"


@needs_root
def test_another_users_v4_in_a_shared_cache_dir_does_not_turn_caching_off(tmp_path):
    """With the cache in a shared directory, another user's pre-created `v4` turned this user's
    caching off. Now this user's entries go to its own subdirectory: the second run is a hit."""
    from trace_roofline.cache import TraceCache
    from trace_roofline.pipeline import analyze_trace

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    (shared / "v4").mkdir()
    os.chown(shared / "v4", NOBODY, NOBODY)
    trace = write(gpu_trace(1), tmp_path / "t.json")
    first = TraceCache(shared)
    analyze_trace(trace, run=Run(cache=first))
    assert not first.log[-1].write_error, first.log[-1].write_error
    second = TraceCache(shared)
    analyze_trace(trace, run=Run(cache=second))
    assert second.log[-1].analysis_hit
    private = shared / f"trace-roofline-{os.getuid()}"
    assert private.stat().st_mode & 0o777 == 0o700 and (private / "v4" / "CACHEDIR.TAG").exists()
    assert list((shared / "v4").iterdir()) == []  # nothing of this user's in the other's


@needs_root
def test_a_per_user_subdirectory_made_by_another_user_is_refused_with_a_note(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    planted = shared / f"trace-roofline-{os.getuid()}"
    planted.mkdir(mode=0o700)
    os.chown(planted, NOBODY, NOBODY)
    trace = write(gpu_trace(1), tmp_path / "t.json")
    r = run_cli("analyze", str(trace), env={**os.environ, "TRACE_ROOFLINE_CACHE_DIR": str(shared)},
                timeout=300)
    assert r.returncode == 0, r.stderr
    assert "not cached" in r.stderr and f"{planted} is not a private directory" in r.stderr
    assert list(planted.iterdir()) == []


# ------------------------------------------------------ found by tests/roofline/test_property_stages.py
def test_a_hardware_ceiling_beyond_any_float_is_an_input_error(tmp_path):
    """`"bf16": 1e400` written as an integer (10**400) raised OverflowError in math.isfinite."""
    from trace_roofline.errors import InputError

    path = tmp_path / "hw.json"
    path.write_text('{"name": "x", "mem_bandwidth": 1e12, "peak_flops": {"bf16": 1' + "0" * 400 + "}}")
    with pytest.raises(InputError, match="peak_flops.*an integer of 401 digits"):
        hardware.from_json(path)


@pytest.mark.parametrize("value", ["3", 2.5, float("inf"), True, 10**400, 0, -1])
@pytest.mark.parametrize("field", ["layers", "tp"])
def test_options_layers_and_tp_must_be_integers_in_range(field, value):
    """`layers="3"` raised TypeError ('<' between str and int), `layers=inf` a TypeError deep in
    the extrapolation, `layers=10**400` an OverflowError: each is now refused up front."""
    from trace_roofline.errors import InputError
    from trace_roofline.options import AnalysisOptions

    with pytest.raises(InputError, match=f"`{field}` must be an integer from 1 to"):
        AnalysisOptions(**{field: value})
    assert AnalysisOptions(**{field: 2}).layers in (2, None)


# ------------------------------------- row 11: a training step whose strides do not parse
def test_backward_gemms_whose_strides_are_missing_or_unparsed_are_analysed(tmp_path):
    """HolisticTraceAnalysis's MTIA training trace records its mm operands' strides in a form
    the GEMM reader does not parse: `_mm_operands` compared pd.NA (TypeError: boolean value of
    NA is ambiguous). The training step keeps its backward names, read as untransposed."""
    import pandas as pd

    import trace_roofline as tr
    from trace_roofline.attribution.grad_gemms import _mm_operands

    ops = pd.DataFrame({"op_name": ["aten::mm", "aten::mm", "aten::addmm"],
                        "input_dims": ["[[4, 8], [8, 16]]"] * 2 + ["[[16], [4, 8], [8, 16]]"],
                        "input_strides": pd.array(["", None, "[[1], [8, 1]]"], dtype="string")})
    got = _mm_operands(ops)
    assert got[["a0", "a1", "b1"]].to_numpy().tolist() == [[4, 8, 16]] * 3
    assert not got["a_t"].any()
    doc = json.loads(gzip.decompress(
        (ROOT / "sample_traces/training/qwen-tiny_train_b2_t32_l2_adamw_cpu.json.gz").read_bytes()))
    for i, e in enumerate(doc["traceEvents"]):
        if "Input Strides" in e.get("args", {}):
            e["args"]["Input Strides"] = "<unknown>" if i % 2 else [[]]
    path = tmp_path / "odd_strides.json"
    path.write_text(json.dumps(doc))
    a = tr.analyze_trace(path, tr.get_model("qwen-tiny"))
    assert any(str(o).endswith(".grad") for o in a.operators["operator"])
