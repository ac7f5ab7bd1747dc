"""Malformed input: whole-file problems raise one-line InputErrors naming the file; single bad
events are skipped and counted in meta while every valid microsecond of device time is kept."""

import gzip
import importlib
import importlib.util
import json
import math

import pytest

from tests.builders import gpu_trace, write
from trace_roofline.errors import InputError
from trace_roofline.trace import load_trace, load_traces, read


def good_bytes() -> bytes:
    return json.dumps(gpu_trace(2), indent=1).encode()


def expect_error(path, match):
    with pytest.raises(InputError) as err:
        load_trace(path)
    msg = str(err.value)
    assert str(path) in msg and "\n" not in msg, msg
    assert match in msg, msg
    return msg


FILE_CASES = {
    "empty": (b"", "empty file"),
    "whitespace": (b"  \n ", "empty file"),
    "truncated": (good_bytes()[: len(good_bytes()) // 2], "truncated JSON"),
    "trailing_garbage": (good_bytes() + b"}{", "malformed JSON"),
    "not_json": (b"hello world", "not JSON"),
    # a first letter of true/false/null is no literal yet: not JSON, not "top level is null"
    "word_like_null": (b"nonsense", "not JSON (it begins 'nonsense'); expected a torch.profiler"),
    "word_like_true": (b"trace events", "not JSON (it begins 'trace events')"),
    "nan_token": (b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": NaN,'
                  b' "dur": 1}]}', "malformed JSON"),
    "top_number": (b"42", "top level is a number"),
    "top_string": (b'"trace"', "top level is a string"),
    "top_null": (b"null", "top level is null"),
    "top_bool": (b"true", "top level is a boolean"),
    "no_trace_events": (b'{"schemaVersion": 1}', "no traceEvents"),
    "trace_events_object": (b'{"traceEvents": {"ph": "X"}}', "traceEvents is an object"),
    "trace_events_string": (b'{"traceEvents": "x"}', "traceEvents is a string"),
    "trace_events_number": (b'{"traceEvents": 3}', "traceEvents is a number"),
    "trace_events_empty": (b'{"traceEvents": []}', "no timed events"),
    "only_metadata": (b'{"traceEvents": [{"ph": "M", "name": "process_name", "pid": 1,'
                      b' "tid": 0, "args": {"name": "python"}}]}', "no timed events"),
    "only_annotations": (b'{"traceEvents": [{"ph": "X", "cat": "user_annotation", "name": "a",'
                         b' "pid": 1, "tid": 1, "ts": 1.0, "dur": 2.0}]}', "no timed events"),
    "all_events_bad": (b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": "1",'
                       b' "dur": 1}, 7, null]}', "3 malformed events skipped"),
    "invalid_utf8_name": (b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k\xff\xfe",'
                          b' "pid": 0, "tid": 7, "ts": 1.0, "dur": 1.0}]}', "not valid UTF-8"),
    "deep_nesting_in_args": (b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1,'
                             b' "dur": 1, "args": {"junk": ' + b"[" * 100_000 + b"]" * 100_000
                             + b"}}]}", "nested too deeply"),
    "deep_nesting_top": (b"[" * 200_000, "nested too deeply"),
    "lone_surrogate": (b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "\\ud800",'
                       b' "ts": 1, "dur": 1}]}', "malformed JSON"),
}


@pytest.mark.parametrize("case", sorted(FILE_CASES))
def test_malformed_file_is_one_clear_line(tmp_path, case):
    data, match = FILE_CASES[case]
    p = tmp_path / f"{case}.json"
    p.write_bytes(data)
    expect_error(p, match)


def test_a_gz_name_without_gzip_data_says_both(tmp_path):
    p = tmp_path / "t.json.gz"
    p.write_bytes(b"not gzip at all")
    expect_error(p, "not JSON, nor gzip-compressed though named .gz (it begins 'not gzip at all')")


def test_missing_file_and_directories(tmp_path):
    expect_error(tmp_path / "nope.json", "no such file")
    expect_error(tmp_path / "nope", "no such file")
    (tmp_path / "empty").mkdir()
    expect_error(tmp_path / "empty", "no trace files")
    with pytest.raises(InputError, match="no trace files"):
        load_traces(tmp_path / "empty")
    (tmp_path / "empty" / "notes.txt").write_text("x")
    expect_error(tmp_path / "empty", "no trace files")


def test_a_bad_file_in_a_directory_names_that_file(tmp_path):
    write(gpu_trace(1), tmp_path / "a.pt.trace.json")
    bad = tmp_path / "b.pt.trace.json"
    bad.write_bytes(b'{"traceEvents": [')
    with pytest.raises(InputError, match="b.pt.trace.json: truncated JSON"):
        load_traces(tmp_path)


INFLATERS = [pytest.param(importlib.import_module(m), id=m) for m in ("zlib", "isal.isal_zlib")
             if importlib.util.find_spec(m.split(".")[0])]


@pytest.fixture(params=INFLATERS)
def inflater(request, monkeypatch):
    """Each gzip inflater trace/read.py may use: ISA-L's where installed, zlib's otherwise."""
    monkeypatch.setattr(read, "inflating", request.param)
    return request.param


def test_truncated_and_corrupt_gzip(tmp_path, inflater):
    packed = gzip.compress(good_bytes())
    p = tmp_path / "cut.json.gz"
    p.write_bytes(packed[: len(packed) // 2])
    expect_error(p, "truncated gzip")
    p = tmp_path / "corrupt.json.gz"
    p.write_bytes(packed[:20] + bytes(b ^ 0x5A for b in packed[20:60]) + packed[60:])
    expect_error(p, "corrupt gzip")
    p = tmp_path / "crc.json.gz"
    p.write_bytes(packed[:-8] + b"\0\0\0\0" + packed[-4:])
    expect_error(p, "corrupt gzip")
    p = tmp_path / "magic_only.json.gz"
    p.write_bytes(b"\x1f\x8b")
    expect_error(p, "gzip")
    p = tmp_path / "truncated_json_inside.json.gz"
    p.write_bytes(gzip.compress(good_bytes()[:-10]))
    expect_error(p, "truncated JSON")


def test_both_inflaters_give_the_same_document(tmp_path, inflater):
    """Concatenated gzip members (zero padding between them ignored), read in chunks smaller
    than a member: the same bytes as the standard library's gzip module gives."""
    text = good_bytes()
    first = gzip.compress(text[:100])
    members = first + b"\0" * 150 + gzip.compress(text[100:], compresslevel=1)
    p = tmp_path / "members.json.gz"
    p.write_bytes(members)
    for chunk in (64, len(first) + 10, 1 << 20):  # padding that spans chunks, or starts one
        with open(p, "rb") as f:
            assert bytes(read.gunzip(p, f, len(members), chunk, None)) == text
    plain = tmp_path / "plain.json"
    plain.write_bytes(text)
    assert load_trace(p).device.equals(load_trace(plain).device)


def kernel(ts=1.0, dur=1.0, **over):
    e = {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": ts, "dur": dur,
         "args": {"device": 0, "stream": 7, "correlation": 1, "External id": 2}}
    e.update(over)
    return e


def test_bad_events_are_skipped_counted_and_time_is_kept(tmp_path):
    good = [kernel(10.0, 1.5), kernel(20.0, 2.25), kernel(30.0, 0.0)]
    bad = {
        "complete event without ts or dur": [
            {k: v for k, v in kernel().items() if k != "ts"},
            {k: v for k, v in kernel().items() if k != "dur"},
        ],
        "fields of the wrong type": [
            kernel(ts="12"), kernel(dur=[1]), kernel(name=5), kernel(ts=True), kernel(cat=["k"]),
            7, None, "kernel", [], kernel(dur=1e400),
        ],
        "negative duration": [kernel(dur=-1.0)],
        "duration longer than a day": [kernel(dur=1e20)],
        "timestamp beyond int64 nanoseconds": [kernel(ts=1e18), kernel(ts=-1e308)],
        "device/cpu category with a phase other than X": [kernel(ph="B"), kernel(ph=None)],
    }
    events = good + [e for es in bad.values() for e in es]
    # kept, but their malformed args are dropped: timing is never thrown away for a bad link
    bad_args = [kernel(40.0, 4.0, args={"External id": "abc"}), kernel(50.0, 5.0, args=[1]),
                kernel(60.0, 6.0, args=None), kernel(70.0, 7.0, args={"External id": 2**70}),
                kernel(80.0, 8.0, pid=1.5), kernel(90.0, 9.0, tid={"a": 1}),
                kernel(100.0, 10.0, id=2**80)]
    events += bad_args
    p = tmp_path / "t.json"
    # 1e400 is not representable: write the text by hand so it reaches the parser as written
    p.write_text(json.dumps({"traceEvents": events}).replace("Infinity", "1e400"))
    tr = load_trace(p)
    assert tr.meta["skipped_events"] == {k: len(v) for k, v in bad.items()}
    assert tr.meta["events_with_dropped_fields"] == len(bad_args)
    kept = good + bad_args
    assert tr.device["ts_us"].tolist() == [e["ts"] for e in kept]
    assert math.fsum(tr.device["dur_us"]) == math.fsum(e["dur"] for e in kept)
    assert tr.device["external_id"].isna().tolist() == [False] * 3 + [True] * 7


def test_huge_ids_and_odd_values_do_not_crash(tmp_path):
    events = [kernel(1.0, 1.0, pid="9" * 30, tid=-1,
                     args={"correlation": -5, "stream": "0x1f", "grid": {"x": 1}}),
              {"ph": "s", "cat": "ac2g", "id": "12", "pid": 1, "tid": 1, "ts": 1.0},
              {"ph": "f", "cat": "ac2g", "id": 2**80, "pid": 1, "tid": 1, "ts": 1.0},
              {"ph": "s", "cat": "ac2g", "id": 3, "pid": 1, "tid": 1}]
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"traceEvents": events, "deviceProperties": "junk"}))
    tr = load_trace(p)
    assert tr.device["stream"].tolist() == [31]
    assert tr.device["pid"].isna().all() and tr.device["correlation"].tolist() == [-5]
    assert tr.device["grid"].tolist() == ['{"x": 1}']
    assert tr.flows["id"].tolist()[0] == 12 and tr.flows["id"].isna().tolist() == [False, True]
    assert tr.meta["skipped_events"] == {"flow event without ts": 1}
    assert tr.meta["device_properties"] == []


def test_non_utf8_outside_read_fields_is_tolerated(tmp_path):
    """Bytes we never read (an arg we skip) do not reject the file."""
    data = (b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7,'
            b' "ts": 1.0, "dur": 1.0, "args": {"note": "\xff"}}]}')
    p = tmp_path / "t.json"
    p.write_bytes(data)
    assert len(load_trace(p).device) == 1
