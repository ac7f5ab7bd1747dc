"""The columnar trace cache: hits are identical to parses, bad entries are never trusted."""

import dataclasses
import os
import pickle
import shutil
import threading
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

import trace_roofline.cache as cache_mod
from tests.builders import SAMPLES, by_prefix, run_cli, walk
from trace_roofline import pipeline
from trace_roofline.attribution.attribute import attribute
from trace_roofline.cache import TraceCache, cache_dir
from trace_roofline.cli import main
from trace_roofline.model.hardware import get_hardware
from trace_roofline.model.models import get_model
from trace_roofline.options import AnalysisOptions
from trace_roofline.pipeline import Run, analyze_trace
from trace_roofline.trace import load_trace

DECODE = SAMPLES / "qwen2.5-7b_decode_b1_s2048_h200.json.gz"
HF = SAMPLES / "hf-qwen2-qwen2.5-7b-2l_decode_b1_s512_h200.json.gz"


def assert_same(a, b) -> None:
    """Every field of two dataclasses (a Trace, an Analysis) equal: DataFrames exactly, dtypes
    and categories included; anything else by == (a NaN equals a NaN)."""
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, pd.DataFrame):
            pd.testing.assert_frame_equal(x, y, check_exact=True, obj=f.name)
        else:
            assert x == y or (x != x and y != y), f.name


@pytest.fixture
def decode_copy(tmp_path) -> Path:
    """A private copy of DECODE, a real trace (tests change its mtime)."""
    dst = tmp_path / "in" / DECODE.name
    dst.parent.mkdir()
    shutil.copy(DECODE, dst)
    return dst


def _load(c: TraceCache, path, model=None):
    """(trace, attribution, status) as the pipeline gets them: `load`, then, when the cache
    has no attribution for the model, `attribute` and `store_attributed` (pipeline._attributed)."""
    trace, attributed = c.load(path, model)
    if attributed is None:
        attributed = attribute(trace, model)
        c.store_attributed(trace, model, attributed)
    return trace, attributed, c.log[-1]  # (with store_attributed's write error)


@pytest.fixture
def no_parse(monkeypatch):
    """Any JSON parse inside the cache or attribution in `_load` fails the test: the call
    must be a hit."""
    def boom(*a, **k):
        raise AssertionError("parsed or attributed despite a valid cache entry")

    def forbid():
        monkeypatch.setattr(cache_mod, "load_trace", boom)
        monkeypatch.setitem(globals(), "attribute", boom)
    return forbid


def _files(c: TraceCache, pattern: str) -> list[Path]:
    return sorted(c.root.glob(f"*/{pattern}"))


@pytest.mark.parametrize("path", walk(sorted(SAMPLES.glob("*.json.gz")), by_prefix))
def test_hit_is_identical_to_a_parse_on_every_sample(path, tmp_path):
    c = TraceCache(tmp_path / "c")
    fresh = load_trace(path)
    expected = attribute(fresh)
    t1, a1, s1 = _load(c, path)
    t2, a2, s2 = _load(c, path)
    assert (s1.trace_hit, s1.attribution_hit, s1.write_error) == (False, False, None)
    assert (s2.trace_hit, s2.attribution_hit, s2.write_error) == (True, True, None)
    for t, a in ((t1, a1), (t2, a2)):
        assert_same(t, fresh)  # every table, categories and dtypes included; meta too
        pd.testing.assert_frame_equal(a, expected, check_exact=True)


def test_hit_reads_no_json_and_keys_attribution_by_model(decode_copy, tmp_path, no_parse):
    c = TraceCache(tmp_path / "c")
    model = get_model("qwen2.5-7b")
    _load(c, decode_copy, None)
    _load(c, decode_copy, model)
    assert len(_files(c, "attributed-*")) == 2  # one part per model, beside one trace part
    no_parse()
    for m in (None, model):
        _, _, s = _load(c, decode_copy, m)
        assert s.trace_hit and s.attribution_hit
    with pytest.raises(AssertionError, match="despite"):  # another model: attribution misses
        _load(c, decode_copy, get_model("llama-3-8b"))


def test_attribution_is_keyed_by_the_architecture_too(decode_copy, tmp_path):
    """GPT-2's config and a ModelSpec of the same summary fields (heads, sizes, ...) but the
    Llama-style layout those fields describe are two models: the second load misses."""
    c = TraceCache(tmp_path / "c")
    gpt2 = get_model(str(SAMPLES / "families_h200" / "configs" / "gpt2.json"))
    same_fields = type(gpt2)(**{f.name: getattr(gpt2, f.name) for f in dataclasses.fields(gpt2)})
    assert same_fields == gpt2 and same_fields.architecture != gpt2.architecture
    _load(c, decode_copy, gpt2)
    assert c.load(decode_copy, same_fields)[1] is None
    assert c.load(decode_copy, gpt2)[1] is not None


def test_same_file_by_another_spelling_keeps_the_callers_path(decode_copy, tmp_path, monkeypatch):
    c = TraceCache(tmp_path / "c")
    _load(c, decode_copy)
    monkeypatch.chdir(decode_copy.parent)
    t, _, s = _load(c, decode_copy.name)
    assert s.trace_hit and t.path == decode_copy.name and t.meta["path"] == decode_copy.name
    assert_same(t, load_trace(decode_copy.name))


def _corrupt_truncate(c: TraceCache) -> None:
    f = _files(c, "trace/cpu_ops.arrow")[0]
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _corrupt_flip(c: TraceCache) -> None:
    f = _files(c, "attributed-*/attributed.arrow")[0]
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same length: only the checksum can tell
    f.write_bytes(bytes(data))


def _corrupt_flip_fields(c: TraceCache) -> None:
    f = _files(c, "trace/fields.json")[0]
    f.write_text(f.read_text().replace("H200", "H100"))


def _corrupt_manifest(c: TraceCache) -> None:
    _files(c, "trace/manifest.json")[0].write_text("{not json")


def _corrupt_missing(c: TraceCache) -> None:
    _files(c, "trace/device.arrow")[0].unlink()


@pytest.mark.parametrize("corrupt", [_corrupt_truncate, _corrupt_flip, _corrupt_flip_fields,
                                     _corrupt_manifest, _corrupt_missing])
def test_corrupt_entry_is_ignored_and_rewritten(corrupt, decode_copy, tmp_path, no_parse):
    c = TraceCache(tmp_path / "c")
    fresh, expected = load_trace(decode_copy), attribute(load_trace(decode_copy))
    _load(c, decode_copy)
    corrupt(c)
    t, a, s = _load(c, decode_copy)
    assert not (s.trace_hit and s.attribution_hit) and s.write_error is None
    assert_same(t, fresh)
    pd.testing.assert_frame_equal(a, expected, check_exact=True)
    no_parse()  # rewritten: the next load is a full hit again
    t, a, s = _load(c, decode_copy)
    assert s.trace_hit and s.attribution_hit
    assert_same(t, fresh)


def test_changed_file_is_stale(decode_copy, tmp_path):
    c = TraceCache(tmp_path / "c")
    _load(c, decode_copy, None)
    _load(c, decode_copy, get_model("qwen2.5-7b"))
    st = decode_copy.stat()
    os.utime(decode_copy, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    _, _, s = _load(c, decode_copy)
    assert not s.trace_hit and not s.attribution_hit
    assert len(_files(c, "attributed-*")) == 1  # the stale entry went with all its parts
    # Same mtime, other content (and size): a new file under the old name.
    shutil.copy(HF, decode_copy)
    os.utime(decode_copy, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    t, _, s = _load(c, decode_copy)
    assert not s.trace_hit
    assert_same(t, load_trace(decode_copy))


def test_schema_version_or_code_change_misses(decode_copy, tmp_path, monkeypatch):
    c = TraceCache(tmp_path / "c")
    _load(c, decode_copy)
    with monkeypatch.context() as mp:  # a new version: a new v<N> tree, the old one unused
        mp.setattr(cache_mod, "SCHEMA_VERSION", cache_mod.SCHEMA_VERSION + 1)
        assert not _load(TraceCache(tmp_path / "c"), decode_copy)[2].trace_hit
    key = c._key(decode_copy)
    for field, value in (("schema", key["schema"] + 1), ("code", "0" * 64),
                         ("pandas", "0.0"), ("size", key["size"] + 1)):
        with monkeypatch.context() as mp:  # an entry in this tree built under another key
            mp.setattr(c, "_key", lambda p, k={**key, field: value}: k)
            _load(c, decode_copy)
        _, _, s = _load(c, decode_copy)
        assert not s.trace_hit and not s.attribution_hit, field


def test_write_failure_never_fails_the_analysis(decode_copy, tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    c = TraceCache(blocker / "cache")  # its parent is a file: mkdir fails with ENOTDIR
    t, a, s = _load(c, decode_copy)
    assert not s.trace_hit and "cannot write trace" in s.write_error and c.log == [s]
    assert_same(t, load_trace(decode_copy))
    monkeypatch.setenv("TRACE_ROOFLINE_CACHE_DIR", str(blocker / "cache"))
    assert main(["analyze", str(decode_copy), "--json", str(tmp_path / "r.json")]) == 0
    out, err = capsys.readouterr()
    assert "whole model" in out and (tmp_path / "r.json").is_file()
    assert err.startswith("trace-roofline: note: ") and "not cached (cannot write" in err
    assert err.count("\n") == 1


def test_cli_cache_use_no_cache_info_and_clear(decode_copy, tmp_path, capsys, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("TRACE_ROOFLINE_CACHE_DIR", str(d))
    before = sorted(decode_copy.parent.iterdir())
    assert main(["analyze", str(decode_copy), "--no-cache"]) == 0
    assert not d.exists()  # --no-cache neither reads nor writes
    uncached = capsys.readouterr().out
    for _ in range(2):  # a miss that writes, then a hit: the same report
        assert main(["analyze", str(decode_copy)]) == 0
        assert capsys.readouterr().out == uncached
    assert sorted(decode_copy.parent.iterdir()) == before  # nothing next to the user's file
    assert main(["analyze", str(decode_copy), "--causal", "full"]) == 0  # another argument set
    capsys.readouterr()
    assert main(["cache", "info"]) == 0
    size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
    # the one trace's tables and attribution (same model), and one analysis per argument set
    assert capsys.readouterr().out == (
        f"cache {d}: 1 trace file(s), {size / 1e6:.1f} MB\n"
        "  parsed trace tables     1  (one per trace file)\n"
        "  attributions            1  (one per trace file and model)\n"
        "  finished analyses       2  (one per trace file and argument set)\n")
    (d / "mine.txt").write_text("not the cache's")  # clear removes only what the cache made
    assert main(["cache", "clear"]) == 0
    assert capsys.readouterr().out == f"cleared {d}: {size / 1e6:.1f} MB freed\n"
    assert sorted(p.name for p in d.iterdir()) == ["mine.txt"]
    assert TraceCache(d).info().entries == 0


def test_cli_cache_help_names_the_three_kinds_of_entries(capsys):
    with pytest.raises(SystemExit):
        main(["cache", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for kind in ("parsed trace tables", "attribution", "finished analysis", "one per model",
                 "one per argument set"):
        assert kind in text, kind


def test_analyze_trace_with_cache_equals_without(tmp_path):
    c = TraceCache(tmp_path / "c")
    model = get_model("qwen2.5-7b")
    plain = analyze_trace(HF, model)
    for _ in range(2):
        cached = analyze_trace(HF, model, run=Run(cache=c))
        pd.testing.assert_frame_equal(cached.operators, plain.operators, check_exact=True)
        assert cached.whole == plain.whole and cached.coverage == plain.coverage
    assert [(s.trace_hit, s.attribution_hit, s.analysis_hit) for s in c.log] == [
        (False, False, False), (True, True, True)]


@pytest.fixture
def no_analysis(monkeypatch):
    """pipeline's computation fails the test: the Analysis must come from the cache."""
    def forbid():
        def boom(*a, **k):
            raise AssertionError("analysed despite a valid cache entry")
        monkeypatch.setattr(pipeline, "_analyze", boom)
    return forbid


def test_analysis_leaves_no_writer_thread_and_the_cache_pickles(decode_copy, tmp_path):
    c = TraceCache(tmp_path / "c")
    threads = threading.active_count()
    analyze_trace(decode_copy, run=Run(cache=c))  # a miss: the parts were written by a thread
    assert threading.active_count() == threads  # (a later parse may fork its worker)
    assert pickle.loads(pickle.dumps(c)).directory == c.directory  # parallel.analyze_many


def test_analysis_hit_per_argument_set(decode_copy, tmp_path, no_analysis):
    c = TraceCache(tmp_path / "c")
    model = get_model("qwen2.5-7b")
    runs = [dict(model=model), dict(model=model, options=AnalysisOptions(causal="full")),
            dict(model=model, options=AnalysisOptions(layers=28)),
            dict(model=None, hardware=get_hardware("rtx4090"))]
    fresh = [analyze_trace(decode_copy, **kw) for kw in runs]
    for kw in runs:
        analyze_trace(decode_copy, run=Run(cache=c), **kw)
    assert not any(s.analysis_hit for s in c.log)
    assert len(_files(c, "analysis-*/manifest.json")) == len(runs)
    no_analysis()
    for kw, expected in zip(runs, fresh, strict=True):
        assert_same(analyze_trace(decode_copy, run=Run(cache=c), **kw), expected)
        assert c.log[-1].analysis_hit
    with pytest.raises(AssertionError, match="despite"):  # another argument: a miss
        analyze_trace(decode_copy, model, options=AnalysisOptions(attention_bytes="kv"), run=Run(cache=c))


def test_corrupt_or_stale_analysis_is_recomputed(decode_copy, tmp_path, no_analysis):
    c = TraceCache(tmp_path / "c")
    ncu = tmp_path / "in" / "k.ncu.csv"
    shutil.copy(DECODE.with_name(DECODE.name.replace(".json.gz", ".ncu.csv")), ncu)
    analyze_trace(decode_copy, run=Run(cache=c))
    f = _files(c, "analysis-*/frame-0.arrow")[0]
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same length: only the checksum can tell
    f.write_bytes(bytes(data))
    analyze_trace(decode_copy, options=AnalysisOptions(ncu=ncu), run=Run(cache=c))
    st = ncu.stat()
    os.utime(ncu, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # a changed ncu CSV: another key
    for options in (AnalysisOptions(), AnalysisOptions(ncu=ncu)):
        assert_same(analyze_trace(decode_copy, options=options, run=Run(cache=c)),
                    analyze_trace(decode_copy, options=options))
        assert not c.log[-1].analysis_hit
    no_analysis()  # both rewritten
    analyze_trace(decode_copy, run=Run(cache=c))
    analyze_trace(decode_copy, options=AnalysisOptions(ncu=ncu), run=Run(cache=c))
    assert c.log[-1].analysis_hit and c.log[-2].analysis_hit


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("TRACE_ROOFLINE_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.setenv("TRACE_ROOFLINE_CACHE_DIR", "")
    assert cache_dir() == tmp_path / "xdg" / "trace-roofline"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == tmp_path / "home" / ".cache" / "trace-roofline"


def test_cached_cli_run_in_a_fresh_process(decode_copy, tmp_path):
    """End to end as a user runs it: the second process reads the first one's entry."""
    env = {**os.environ, "TRACE_ROOFLINE_CACHE_DIR": str(tmp_path / "c")}
    runs = [run_cli("analyze", str(decode_copy), env=env) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0] and runs[0].stdout == runs[1].stdout
    info = TraceCache(tmp_path / "c").info()
    assert (info.entries, info.traces, info.attributions, info.analyses) == (1, 1, 1, 1)


def test_parts_are_compressed(decode_copy, tmp_path):
    """Every part is compressed: the attribution's Arrow file is a third of the same table
    written uncompressed (its kernel names repeat), and the Analysis's costed frame (string
    columns dictionary-encoded, LZ4) half of it."""
    c = TraceCache(tmp_path / "c")
    analysis = analyze_trace(decode_copy, run=Run(cache=c))
    (arrow,) = _files(c, "attributed-*/attributed.arrow")
    with pa.memory_map(str(arrow)) as source:
        attributed = ipc.open_file(source).read_all()
    (costed,) = _files(c, "analysis-*/frame-0.arrow")  # (its first DataFrame field)
    for stored, table, ratio in ((arrow, attributed, 3),
                                 (costed, pa.Table.from_pandas(analysis.costed), 2)):
        plain = tmp_path / "plain.arrow"
        with ipc.new_file(str(plain), table.schema) as w:
            w.write_table(table)
        assert stored.stat().st_size < plain.stat().st_size / ratio, stored.name


def test_analysis_of_an_unknown_type_is_not_cached(decode_copy, tmp_path):
    """An Analysis holding a value of a type the codec does not know (here a set) is returned,
    not cached, and the write error says why; nothing of it is left in the cache."""
    c = TraceCache(tmp_path / "c")
    plain = analyze_trace(decode_copy)
    odd = dataclasses.replace(plain, coverage={**plain.coverage, "odd": {1, 2}})
    assert c.analysis(decode_copy, {"odd": True}, lambda: (c.load(decode_copy), odd)[1]) is odd
    assert "a builtins.set is not cached" in c.log[-1].write_error
    assert not _files(c, "analysis-*")
    assert c.analysis(decode_copy, {"odd": False}, lambda: plain) is plain
    [tree] = _files(c, "analysis-*/analysis.json")
    assert b"pickle" not in tree.read_bytes()
