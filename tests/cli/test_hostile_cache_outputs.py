"""The cache and the outputs: no stale result, no code run from the cache, no crash on a
malformed manifest, no input overwritten, no user file deleted by `cache clear`, no mixed set or
temporary left by a killed run (docs/security.md, "Cache and outputs").

Each test below failed on the code before these fixes (items 5-9 and 11 of the issue)."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from tests.builders import ROOT, SAMPLES, walk
from trace_roofline import files
from trace_roofline.cache import TraceCache
from trace_roofline.cli import main
from trace_roofline.errors import InputError
from trace_roofline.model.models import get_model
from trace_roofline.options import AnalysisOptions
from trace_roofline.outputs.report import operators_tables, report_dict
from trace_roofline.pipeline import Run, analyze_trace

DECODE = SAMPLES / "qwen2.5-7b_decode_b1_s2048_h200.json.gz"
HF = SAMPLES / "hf-qwen2-qwen2.5-7b-2l_decode_b1_s512_h200.json.gz"
NOBODY = 65534
# benchmarks/snapshot_outputs.py's presets by file-name prefix (the longest match wins)
PRESETS = {"qwen2.5-7b": "qwen2.5-7b", "hf-qwen2-qwen2.5-7b": "qwen2.5-7b",
           "qwen-tiny": "qwen-tiny", "hf-moe-mixtral-8x7b": "mixtral-8x7b",
           "hf-moe-qwen1.5-moe-a2.7b": "qwen1.5-moe-a2.7b", "hf-moe-qwen3-30b-a3b": "qwen3-30b-a3b"}


def assert_same(a, b, where: str = "") -> None:
    """Two values equal all the way down, types included: DataFrames exactly (dtypes,
    categories), dataclasses field by field, dicts key by key in order, a NaN equal to a NaN."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, pd.DataFrame):
        pd.testing.assert_frame_equal(a, b, check_exact=True, obj=where)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), where


@pytest.fixture
def plain_trace(tmp_path) -> Path:
    """DECODE as a plain .json file of our own (tests edit it in place)."""
    dst = tmp_path / "in" / "t.json"
    dst.parent.mkdir()
    dst.write_bytes(gzip.decompress(DECODE.read_bytes()))
    return dst


def _part(c: TraceCache, pattern: str) -> Path:
    [part] = sorted(c.root.glob(f"*/{pattern}"))
    return part


# ------------------------------------------------------------------------ 5. stale results
def _edit_a_kernel_duration(path: Path) -> None:
    """Rewrite the first kernel's duration in place: other digits, same size; then give the
    file its old times back (`touch -r`)."""
    st = path.stat()
    text = path.read_bytes()
    kernel = text.index(b'"cat": "kernel"')
    m = re.compile(rb'"dur": (\d)').search(text, kernel)
    digit = b"9" if m[1] != b"9" else b"1"
    with open(path, "r+b") as f:
        f.seek(m.start(1))
        f.write(digit)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_a_trace_edited_in_place_with_its_old_times_is_not_served_stale(plain_trace, tmp_path):
    c = TraceCache(tmp_path / "c")
    before = analyze_trace(plain_trace, run=Run(cache=c))
    _edit_a_kernel_duration(plain_trace)
    after = analyze_trace(plain_trace, run=Run(cache=c))
    assert not c.log[-1].analysis_hit and not c.log[-1].trace_hit
    assert after.whole["time_us"] != before.whole["time_us"]
    assert_same(after, analyze_trace(plain_trace))


def test_identity_samples_the_content(tmp_path):
    """The key holds ctime and a hash of the first and last 64 KiB and of 8 blocks between:
    a byte changed in any of them changes it (beyond them, ctime is what tells)."""
    f = tmp_path / "big.bin"
    size = 4 << 20
    f.write_bytes(bytes(size))
    key = files.identity(f)
    assert {"device", "inode", "size", "mtime_ns", "ctime_ns", "sample"} <= set(key)
    step = (size - 2 * files.SAMPLE_EDGE - files.SAMPLE_BLOCK) // (files.SAMPLE_BLOCKS - 1)
    sampled = [0, files.SAMPLE_EDGE - 1, size - 1, files.SAMPLE_EDGE + 3 * step + 7]
    for offset in sampled:
        with open(f, "r+b") as h:
            h.seek(offset)
            h.write(b"\1")
        fd = os.open(f, os.O_RDONLY)
        try:
            changed = files.content_sample(fd, size)
        finally:
            os.close(fd)
        assert changed != key["sample"], offset
        with open(f, "r+b") as h:
            h.seek(offset)
            h.write(b"\0")
    small = tmp_path / "small.bin"  # up to 160 KiB: hashed whole
    small.write_bytes(b"a" * 1000)
    before = files.identity(small)["sample"]
    small.write_bytes(b"a" * 999 + b"b")
    assert files.identity(small)["sample"] != before


# ---------------------------------------------------------------- 6. no code from the cache
def test_a_planted_pickle_is_never_unpickled(plain_trace, tmp_path):
    """Someone who can write the cache plants `analysis.pickle` (in the format the cache used
    to unpickle, with a manifest whose key and CRC-32 they recomputed): nothing of it runs."""
    c = TraceCache(tmp_path / "c")
    expected = analyze_trace(plain_trace, run=Run(cache=c))
    part = _part(c, "analysis-*")
    key = json.loads((part / "manifest.json").read_text())["key"]
    marker = tmp_path / "planted-code-ran"
    payload = pickle.dumps(_Planted(str(marker)), protocol=5)
    header = np.array([0, len(payload)], dtype="<u8").tobytes()
    for f in part.iterdir():
        f.unlink()
    with pa.CompressedOutputStream(str(part / "analysis.pickle"), "zstd") as out:
        out.write(header + payload)
    data = (part / "analysis.pickle").read_bytes()
    (part / "manifest.json").write_text(json.dumps({"key": key, "files": {
        "analysis.pickle": {"bytes": len(data), "crc32": zlib.crc32(data)}}}))
    got = analyze_trace(plain_trace, run=Run(cache=TraceCache(tmp_path / "c")))
    assert not marker.exists()
    assert_same(got, expected)


class _Planted:
    """Unpickling it writes a file: the code an attacker's pickle would run."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def _foreign(path: Path, monkeypatch) -> None:
    """Make `path` another user's: chown to nobody when running as root, else pretend to be
    another user (then every file of the cache is foreign)."""
    if os.getuid() == 0:
        os.chown(path, NOBODY, NOBODY, follow_symlinks=False)
    else:
        uid = os.getuid() + 1
        monkeypatch.setattr(os, "getuid", lambda: uid)


@pytest.mark.parametrize("where", ["version dir owned by nobody", "entry dir group-writable",
                                   "part dir world-writable", "file owned by nobody",
                                   "part is a symlink"])
def test_a_cache_others_can_write_is_ignored(where, plain_trace, tmp_path, monkeypatch):
    c = TraceCache(tmp_path / "c")
    expected = analyze_trace(plain_trace, run=Run(cache=c))
    part = _part(c, "analysis-*")
    if where == "version dir owned by nobody":
        _foreign(c.root, monkeypatch)
    elif where == "entry dir group-writable":
        part.parent.chmod(0o770)
    elif where == "part dir world-writable":
        part.chmod(0o777)
    elif where == "file owned by nobody":
        if os.getuid() != 0:
            pytest.skip("needs root to give a file to another user")
        _foreign(max(part.iterdir(), key=lambda f: f.name != "manifest.json"), monkeypatch)
    else:
        moved = tmp_path / "elsewhere"
        part.rename(moved)
        part.symlink_to(moved)
    c2 = TraceCache(tmp_path / "c")
    got = analyze_trace(plain_trace, run=Run(cache=c2))
    assert not c2.log[-1].analysis_hit, where
    assert_same(got, expected)
    if where == "version dir owned by nobody":  # nothing is written into it either
        assert "not a private directory" in c2.log[-1].write_error
        assert not c2.log[-1].trace_hit


def test_the_cache_is_private_and_tagged(plain_trace, tmp_path):
    c = TraceCache(tmp_path / "c")
    analyze_trace(plain_trace, run=Run(cache=c))
    dirs = [c.root, *c.root.iterdir(), *c.root.glob("*/*")]
    for d in (d for d in dirs if d.is_dir()):
        assert d.stat().st_mode & 0o777 == 0o700, d
    assert (c.root / "CACHEDIR.TAG").read_text().startswith(
        "Signature: 8a477f597d28d172789f06886806bc55")


def _committed_traces() -> list[Path]:
    """Every sample trace (benchmarks/snapshot_outputs.py's list) but the family captures."""
    return sorted(p for p in SAMPLES.rglob("*.json*") if ".json" in p.name
                  and not p.name.endswith(".results.json") and "busbw" not in p.name
                  and "families_h200" not in p.parts)  # (tests/attribution/test_families_h200.py's)


def _preset(p: Path) -> str | None:
    best = [m for pre, m in PRESETS.items() if p.name.startswith(pre)]
    return best[-1] if best else None


@pytest.mark.parametrize("path", walk(_committed_traces()))
def test_a_cache_hit_equals_the_fresh_analysis_on_every_sample(path, tmp_path):
    """The Analysis read back (JSON tree + Arrow frames, no pickle) is the one computed: every
    field and frame (dtypes, categories), report.json's dict and the operator tables."""
    model = get_model(m) if (m := _preset(path)) else None
    c = TraceCache(tmp_path / "c")
    try:
        fresh = analyze_trace(path, model, options=AnalysisOptions(force=True), run=Run(cache=c))
    except InputError as e:
        pytest.skip(f"not a trace: {e}")
    assert not c.log or c.log[-1].write_error is None
    hit = analyze_trace(path, model, options=AnalysisOptions(force=True), run=Run(cache=c))
    assert c.log[-1].analysis_hit
    assert_same(hit, fresh)
    assert json.dumps(report_dict([hit])) == json.dumps(report_dict([fresh]))
    for name, table in operators_tables([fresh]).items():
        pd.testing.assert_frame_equal(operators_tables([hit])[name], table, check_exact=True,
                                      obj=name)
    if fresh.model is not None:  # the layout the model was built from, not a default one
        assert hit.model.architecture == fresh.model.architecture


# -------------------------------------------------------------- 7. malformed manifests
@pytest.mark.parametrize("part,damage", [
    *((part, "drop a file entry") for part in ("trace", "attributed-*", "analysis-*")),
    *(("analysis-*", damage) for damage in ("files not an object",
                                            "a length that is not a number", "a path outside"))])
def test_a_malformed_manifest_is_a_miss(part, damage, plain_trace, tmp_path, capsys,
                                        monkeypatch):
    monkeypatch.setenv("TRACE_ROOFLINE_CACHE_DIR", str(tmp_path / "c"))
    run = ["analyze", str(plain_trace), "--model", "qwen2.5-7b"]
    assert main(run) == 0
    expected = capsys.readouterr().out
    c = TraceCache(tmp_path / "c")
    manifest = _part(c, part) / "manifest.json"
    m = json.loads(manifest.read_text())
    name = sorted(m["files"])[0]
    if damage == "drop a file entry":
        del m["files"][name]
    elif damage == "files not an object":
        m["files"] = list(m["files"])
    elif damage == "a length that is not a number":
        m["files"][name]["bytes"] = str(m["files"][name]["bytes"])
    else:
        m["files"]["../../../../in/t.json"] = {"bytes": plain_trace.stat().st_size,
                                                "crc32": zlib.crc32(plain_trace.read_bytes())}
    manifest.write_text(json.dumps(m))
    if part != "analysis-*":  # no finished analysis: the trace and attribution parts are read
        shutil.rmtree(_part(c, "analysis-*"))
    assert main(run) == 0
    assert capsys.readouterr().out == expected
    assert main(run) == 0  # rewritten: a hit again
    assert capsys.readouterr().out == expected
    assert TraceCache(tmp_path / "c").info().analyses == 1


# ------------------------------------------------------------ 8. an output over an input
def _contents(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case", ["--json is the trace", "--perfetto is the trace",
                                  "--json is a hard link of the trace",
                                  "--out holds the trace as report.json",
                                  "--json is the --ncu file", "--json and --perfetto are one file",
                                  "diff --out holds side A as diff.json"])
def test_no_output_overwrites_an_input(case, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copy(DECODE, tmp_path / "t.json.gz")
    shutil.copy(DECODE.with_name(DECODE.name.replace(".json.gz", ".ncu.csv")), "k.csv")
    (tmp_path / "d").mkdir()
    args = {
        "--json is the trace": ["analyze", "t.json.gz", "--json", "t.json.gz"],
        "--perfetto is the trace": ["analyze", "t.json.gz", "--perfetto", "./t.json.gz"],
        "--json is a hard link of the trace": ["analyze", "t.json.gz", "--json", "link.json"],
        "--out holds the trace as report.json": ["analyze", "d/report.json", "--out", "d"],
        "--json is the --ncu file": ["analyze", "t.json.gz", "--ncu", "k.csv", "--json", "k.csv"],
        "--json and --perfetto are one file": ["analyze", "t.json.gz", "--json", "o.json",
                                               "--perfetto", "o.json"],
        "diff --out holds side A as diff.json": ["diff", "d/diff.json", "t.json.gz", "--out", "d"],
    }[case]
    os.link("t.json.gz", "link.json")
    shutil.copy(DECODE, "d/report.json")
    shutil.copy(DECODE, "d/diff.json")
    before = _contents(tmp_path)
    monkeypatch.setenv("TRACE_ROOFLINE_CACHE_DIR", str(tmp_path.parent / f"{tmp_path.name}-c"))
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("would overwrite the input" in err or "is also" in err), err
    assert _contents(tmp_path) == before  # nothing written, nothing replaced


def test_check_outputs_names_the_files():
    with pytest.raises(InputError, match=r"^a/b.json: --json would overwrite the input a/b.json"):
        files.check_outputs([("--json", "a/./b.json")], ["a/b.json"])
    files.check_outputs([("--json", "a/b.json"), ("--out", "a/c.json")], ["a/d.json"])


# ----------------------------------------------------------- 9. clear deletes only its own
def test_cache_clear_deletes_only_what_the_cache_wrote(plain_trace, tmp_path, capsys,
                                                       monkeypatch):
    d = tmp_path / "c"
    monkeypatch.setenv("TRACE_ROOFLINE_CACHE_DIR", str(d))
    assert main(["analyze", str(plain_trace)]) == 0
    mine = {d / "v7" / "thesis.tex": b"years of work", d / "v1" / "notes" / "a.txt": b"mine",
            d / "v3" / "keep.txt": b"not an entry"}
    for f, data in mine.items():
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(data)
    legacy = d / "v2" / ("0" * 32) / "trace"  # an older version's entry: the cache's own
    legacy.mkdir(parents=True)
    (legacy / "manifest.json").write_text("{}")
    capsys.readouterr()
    assert main(["cache", "clear"]) == 0
    assert all(f.read_bytes() == data for f, data in mine.items())
    assert not (d / "v4").exists() and not (d / "v2").exists()
    assert TraceCache(d).info().total_bytes == 0


# ---------------------------------------------------------------- 11. kill -9 during --out
# The CLI in a fresh process, blocked at a chosen point of writing --out (the test kills it
# there): "stage" before the n-th output file is created, "move" before the n-th rename into
# the directory (or swap of it), "cleanup" before removing a temporary directory after the
# swap. The hooks wrap the system calls, so they are the same for any writer.
HOOK = r"""
import builtins, os, shutil, sys, time
from pathlib import Path
point, n, ready, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
out = out.resolve()
seen = {"stage": 0, "move": 0, "cleanup": 0}

def reached(kind):
    seen[kind] += 1
    if kind == point and seen[kind] == n:
        ready.write_text("blocked")
        time.sleep(600)

def inside(p):
    return out.parent in Path(os.fsdecode(p)).resolve().parents

def wrap(kind, fn, test):
    def wrapped(*a, **k):
        if test(*a, **k):
            reached(kind)
        return fn(*a, **k)
    return wrapped

def staging(f, mode="r", *a, **k):
    return isinstance(f, (str, os.PathLike)) and "x" in mode and inside(f)

builtins.open = wrap("stage", builtins.open, staging)
os.replace = wrap("move", os.replace, lambda a, b, *x, **k: inside(b))
os.rename = wrap("move", os.rename, lambda a, b, *x, **k: inside(b))
shutil.rmtree = wrap("cleanup", shutil.rmtree, lambda p, *a, **k: inside(p) and Path(p).name.endswith(".tmp"))
import trace_roofline.files as files
if hasattr(files, "_exchange"):
    files._exchange = wrap("move", files._exchange, lambda a, b: True)
from trace_roofline.cli import main
sys.argv = ["trace-roofline", *sys.argv[5:]]
sys.exit(main(sys.argv[1:]))
"""
COMPARED = ("operators.csv", "operators_by_layer.csv", "report.json", "report.md")


def _killed_while_writing(point: str, n: int, args: list[str], work: Path, tmp: Path) -> bool:
    """Run the CLI in `work` with the hook (blocking in `work`/out); kill -9 it once it blocks.
    True if it was killed there, False if it finished first (the point is not on this
    writer's path)."""
    ready, log = tmp / f"ready-{point}-{n}", tmp / f"stderr-{point}-{n}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRACE_ROOFLINE_CACHE_DIR": str(tmp / "c")}
    with open(log, "wb") as err:
        p = subprocess.Popen([sys.executable, "-c", HOOK, point, str(n), str(ready),
                              str(work / "out"), *args], env=env, cwd=work,
                             stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + 300
        while not ready.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if p.poll() is not None:
            assert p.returncode == 0, log.read_text()
            return False
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    return True


def _outputs(d: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in d.iterdir() if f.name in COMPARED}


def _leftovers(*dirs: Path) -> list[str]:
    return [e.name for d in dirs for e in d.iterdir() if e.name.endswith(".tmp")]


class OutputSet(NamedTuple):
    """A complete `--out` directory: its file names, the compared files' bytes, where it is."""

    names: set[str]
    files: dict[str, bytes]
    where: Path


@pytest.fixture(scope="module")
def two_sets(tmp_path_factory) -> dict[str, OutputSet]:
    """The complete sets `--out out` gets from trace a (DECODE) and trace b (HF), each run in
    a directory holding both as a.json.gz and b.json.gz (the reports name them so)."""
    sets = {}
    for side in ("a", "b"):
        work = _work(tmp_path_factory.mktemp(f"ref-{side}"))
        assert subprocess.run([sys.executable, "-m", "trace_roofline.cli", *_run(side)],
                              cwd=work, env={**os.environ, "PYTHONPATH": str(ROOT)},
                              capture_output=True).returncode == 0
        sets[side] = OutputSet({f.name for f in (work / "out").iterdir()},
                               _outputs(work / "out"), work / "out")
    return sets


def _work(d: Path) -> Path:
    shutil.copy(DECODE, d / "a.json.gz")
    shutil.copy(HF, d / "b.json.gz")
    return d


def _mkdir(d: Path) -> Path:
    d.mkdir()
    return d


def _run(side: str) -> list[str]:
    return ["analyze", f"{side}.json.gz", "--no-cache", "--out", "out"]


@pytest.mark.parametrize("point,n", [("stage", 3), ("move", 2), ("cleanup", 1)])  # each stage
def test_kill_during_out_leaves_the_old_or_the_new_set_and_no_temporary(
        point, n, two_sets, tmp_path, capsys, monkeypatch):
    work = _work(_mkdir(tmp_path / "work"))
    out = work / "out"
    monkeypatch.chdir(work)
    shutil.copytree(two_sets["a"].where, out)  # the old set, as `main(_run("a"))` writes it
    _killed_while_writing(point, n, _run("b"), work, tmp_path)
    names, outputs = {f.name for f in out.iterdir()}, _outputs(out)
    assert (names, outputs) in [(s.names, s.files) for s in two_sets.values()], \
        f"a mixed set: {sorted(names)}"
    assert main(_run("b")) == 0  # the next run: the new set, and nothing left behind
    assert ({f.name for f in out.iterdir()}, _outputs(out)) == (two_sets["b"].names,
                                                                 two_sets["b"].files)
    assert _leftovers(out, work) == []
    capsys.readouterr()


def test_kill_during_out_into_a_shared_directory_keeps_user_files(two_sets, tmp_path, capsys,
                                                                  monkeypatch):
    """A directory holding other files is written file by file (each complete): a kill loses
    no user file, and the next run leaves no temporary."""
    work = _work(_mkdir(tmp_path / "work"))
    out = _mkdir(work / "out")
    (out / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    assert _killed_while_writing("stage", 3, _run("b"), work, tmp_path)
    assert (out / "notes.txt").read_text() == "mine"
    assert main(_run("b")) == 0
    assert (out / "notes.txt").read_text() == "mine" and _outputs(out) == two_sets["b"].files
    assert _leftovers(out, work) == []
    capsys.readouterr()


def test_write_files_swaps_a_set_in_whole(tmp_path):
    out = tmp_path / "out"
    sets = {out: ("a.csv", "b.csv", "old.csv")}
    files.write_files({out / "a.csv": b"1", out / "old.csv": b"stale"}, sets=sets)
    out.chmod(0o750)
    files.write_files({out / "a.csv": b"2", out / "b.csv": b"3"}, sets=sets)
    assert sorted(p.name for p in out.iterdir()) == ["a.csv", "b.csv"]  # the new set, exactly
    assert out.stat().st_mode & 0o777 == 0o750  # the directory's mode kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
