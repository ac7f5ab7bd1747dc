"""trace_roofline.trace: tables, dtypes and schema variants on synthetic Kineto traces and on every committed
real trace."""

import dataclasses
import gzip
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from benchmarks.tile import tile
from tests.builders import (
    SAMPLES,
    cpu_trace,
    gpu_trace,
    legacy_trace,
    parent_waits_for_a_claim,
    read,
    write,
)
from tests.trace.test_robustness import FILE_CASES
from trace_roofline.errors import InputError
from trace_roofline.trace import (
    SCHEMAS,
    Trace,
    decode,
    load_trace,
    load_traces,
    parallel,
    parse_dims,
    progress_bar,
)
from trace_roofline.trace import read as trace_read

DEVICE_CATS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset",
               "Kernel": "kernel", "Memcpy": "memcpy", "Memset": "memset"}


def raw_device(doc):
    """The device events of a trace document, read with the stdlib json module."""
    return [e for e in doc["traceEvents"] if e.get("cat") in DEVICE_CATS and e.get("ph") == "X"]


def assert_schema(tr):
    for table, schema in SCHEMAS.items():
        df = getattr(tr, table)
        assert list(df.columns) == list(schema), table
        for col, dtype in schema.items():
            assert str(df[col].dtype) == dtype, (table, col, df[col].dtype)


@pytest.fixture
def gpu(tmp_path):
    doc = gpu_trace(steps=2)
    return doc, load_trace(write(doc, tmp_path / "t.json"))


def test_tables_of_a_gpu_trace(gpu):
    doc, tr = gpu
    assert_schema(tr)
    assert not tr.cpu_only
    assert len(tr.device) == 2 * (3 + 2)
    assert tr.device["kind"].value_counts().to_dict() == {"kernel": 6, "memcpy": 2, "memset": 2}
    assert len(tr.cpu_ops) == 6 and len(tr.runtime) == 6
    assert len(tr.flows) == 12 and set(tr.flows["ph"]) == {"s", "f"}
    assert (tr.flows["cat"] == "ac2g").all()
    assert len(tr.python_frames) == 2 + 6
    # annotations: 2 ProfilerStep + 6 user ranges on the CPU + 6 projected on the GPU
    assert tr.annotations["cat"].value_counts().to_dict() == {
        "user_annotation": 8, "gpu_user_annotation": 6}
    assert tr.meta["device_properties"][0]["name"] == "NVIDIA H200"
    assert tr.meta["base_time_ns"] == 1790000000000000000
    assert tr.meta["schemaVersion"] == 1 and tr.meta["record_shapes"] == 1
    assert tr.meta["skipped_events"] == {} and tr.meta["events_with_dropped_fields"] == 0


def test_device_rows_match_the_raw_events_exactly(gpu):
    doc, tr = gpu
    raw = raw_device(doc)
    dev = tr.device
    assert dev["name"].astype(str).tolist() == [e["name"] for e in raw]
    # float µs timestamps and durations are kept bit for bit (no rounding to ints or ns)
    assert dev["ts_us"].tolist() == [e["ts"] for e in raw]
    assert dev["dur_us"].tolist() == [e["dur"] for e in raw]
    assert math.fsum(dev["dur_us"]) == math.fsum(e["dur"] for e in raw)
    assert dev["correlation"].tolist() == [e["args"]["correlation"] for e in raw]
    assert dev["external_id"].tolist() == [e["args"].get("External id", pd.NA) for e in raw]
    assert dev["device"].eq(0).all() and dev["stream"].eq(7).all() and dev["pid"].eq(0).all()
    kernels = dev[dev["kind"] == "kernel"]
    assert kernels["grid"].iloc[0] == "[28, 1, 1]" and kernels["block"].iloc[0] == "[384, 1, 1]"
    assert dev.loc[dev["kind"] == "memset", "grid"].isna().all()
    # event_id is the position in traceEvents
    events = doc["traceEvents"]
    assert all(events[i]["name"] == n for i, n in zip(dev["event_id"], dev["name"], strict=True))


def test_cpu_ops_keep_raw_shapes_and_parse_lazily(gpu):
    _, tr = gpu
    ops = tr.cpu_ops
    assert ops["name"].astype(str).tolist()[:3] == [
        "aten::mm", "aten::mm", "aten::_scaled_dot_product_flash_attention"]
    assert ops["input_dims"].iloc[0] == "[[1, 3584], [3584, 3584]]"
    assert parse_dims(ops["input_dims"].iloc[:3]) == [
        [[1, 3584], [3584, 3584]], [[1, 3584], [3584, 512]],
        [[1, 28, 1, 128], [1, 4, 64, 128], [1, 4, 64, 128]]]
    assert parse_dims(ops["input_types"].iloc[:1]) == [["c10::BFloat16"] * 2]
    assert parse_dims(ops["concrete_inputs"].iloc[:1]) == [["", ""]]
    assert parse_dims(pd.Series([None, "[1, 2", "[[2]]"])) == [None, None, [[2]]]
    assert ops["op_id"].is_monotonic_increasing
    assert ops["tid"].eq(100).all() and ops["external_id"].notna().all()



def test_input_strides_carried_raw_like_input_dims(tmp_path):
    """`Input Strides` becomes the raw-JSON column input_strides (a 0 stride marks a broadcast
    dim); an op without it gets NA; attribute() passes it through to the op's kernels."""
    from trace_roofline.attribution.attribute import attribute

    doc = gpu_trace(1)
    ops = [e for e in doc["traceEvents"] if e.get("cat") == "cpu_op"]
    ops[0]["args"]["Input Strides"] = [[1, 0], [3584, 1]]
    del ops[1]["args"]["Input Strides"]
    tr = load_trace(write(doc, tmp_path / "t.json"))
    strides = tr.cpu_ops["input_strides"]
    assert strides.iloc[0] == "[[1, 0], [3584, 1]]" and pd.isna(strides.iloc[1])
    assert parse_dims(strides.iloc[:1]) == [[[1, 0], [3584, 1]]]
    att = attribute(tr)
    by_op = att.dropna(subset=["op_id"]).set_index("op_id")["input_strides"]
    first, second = tr.cpu_ops["op_id"].iloc[:2]
    assert by_op.loc[[first]].eq("[[1, 0], [3584, 1]]").all()
    assert by_op.loc[[second]].isna().all()

def test_runtime_flows_and_frames_link_up(gpu):
    _, tr = gpu
    kernels = tr.device[tr.device["kind"] == "kernel"]
    # every kernel's correlation has one launch, one flow start and one flow end
    assert set(kernels["correlation"]) == set(tr.runtime["correlation"])
    for ph in ("s", "f"):
        assert set(tr.flows.loc[tr.flows["ph"] == ph, "id"]) == set(kernels["correlation"])
    assert set(kernels["external_id"]) <= set(tr.cpu_ops["external_id"])
    frames = tr.python_frames
    roots = frames[frames["parent_id"].isna()]
    assert len(roots) == 2 and roots["name"].eq("nn.Module: Qwen2Attention_0").all()
    assert frames["parent_id"].dropna().isin(roots["python_id"]).all()


def test_legacy_spellings(tmp_path):
    """2020-21 Kineto: Kernel/Operator/Runtime/Memcpy/Memset, 'external id', 'Input dims',
    tid 'stream 7', async_cpu_to_gpu flows, no deviceProperties."""
    new = load_trace(write(gpu_trace(2), tmp_path / "new.json"))
    old = load_trace(write(legacy_trace(2), tmp_path / "old.json"))
    assert_schema(old)
    for table in ("device", "cpu_ops", "runtime", "python_frames"):
        a, b = getattr(new, table), getattr(old, table)
        pd.testing.assert_frame_equal(a, b, check_categorical=False)
    assert (old.flows["cat"] == "async_cpu_to_gpu").all()
    assert old.meta["device_properties"] == []


def test_old_async_launch_flows_and_case_insensitive_cats(tmp_path):
    doc = gpu_trace(1)
    for e in doc["traceEvents"]:
        if e.get("cat") == "ac2g":
            e.update(cat="async", name="launch")
        if e.get("cat") == "cuda_runtime":
            e["cat"] = "CUDA_Runtime"
    tr = load_trace(write(doc, tmp_path / "t.json"))
    assert len(tr.flows) == 6 and len(tr.runtime) == 3


def test_rocm_and_other_runtimes(tmp_path):
    doc = gpu_trace(1)
    for e in doc["traceEvents"]:
        if e.get("cat") == "cuda_runtime":
            e["cat"], e["name"] = "hip_runtime", "hipLaunchKernel"
            e["args"]["stream"] = "0x0"  # ROCm writes the stream as a hex string
    tr = load_trace(write(doc, tmp_path / "t.json"))
    assert tr.runtime["name"].eq("hipLaunchKernel").all() and len(tr.runtime) == 3


def test_missing_external_id_and_missing_args(tmp_path):
    doc = gpu_trace(1)
    kernels = [e for e in doc["traceEvents"] if e.get("cat") == "kernel"]
    del kernels[0]["args"]["External id"]
    del kernels[1]["args"]
    tr = load_trace(write(doc, tmp_path / "t.json"))
    k = tr.device[tr.device["kind"] == "kernel"]
    assert k["external_id"].isna().tolist() == [True, True, False]
    assert k["correlation"].isna().tolist() == [False, True, False]
    # without args, device and stream fall back to pid and tid
    assert k["device"].tolist() == [0, 0, 0] and k["stream"].tolist() == [7, 7, 7]
    assert k["grid"].isna().tolist() == [False, True, False]


def test_string_pid_and_tid(tmp_path):
    doc = gpu_trace(1)
    for e in doc["traceEvents"]:
        if e.get("cat") == "cpu_op":
            e["pid"], e["tid"] = "100", "worker"
    tr = load_trace(write(doc, tmp_path / "t.json"))
    assert tr.cpu_ops["pid"].eq(100).all() and tr.cpu_ops["tid"].isna().all()


def test_non_integer_ids_are_missing_whatever_their_batch_holds(tmp_path):
    """A float or boolean pid/tid/id (an event kept without its links) is <NA>, also in a batch
    whose other values are all integers (numpy alone would truncate 1.5 to 1)."""
    doc = gpu_trace(1)
    kernel = next(e for e in doc["traceEvents"] if e.get("cat") == "kernel")
    flow = next(e for e in doc["traceEvents"] if e.get("cat") == "ac2g")
    kernel["pid"], kernel["tid"], flow["id"] = 1.5, True, 2.5
    tr = load_trace(write(doc, tmp_path / "t.json"))
    assert tr.meta["events_with_dropped_fields"] == 2
    k = tr.device[tr.device["ts_us"] == kernel["ts"]].iloc[0]
    assert k["pid"] is pd.NA and k["device"] == k["stream"] == -1  # (its args dropped too)
    assert tr.flows["id"].isna().sum() == 1 and tr.flows["pid"].notna().all()


def test_int_timestamps_and_absent_device_properties(tmp_path):
    doc = gpu_trace(1)
    del doc["deviceProperties"]
    for e in doc["traceEvents"]:
        for k in ("ts", "dur"):
            if k in e and isinstance(e[k], float):
                e[k] = int(e[k])
    tr = load_trace(write(doc, tmp_path / "t.json"))
    assert tr.device["ts_us"].dtype == np.float64
    assert tr.device["ts_us"].tolist() == [e["ts"] for e in raw_device(doc)]
    assert tr.meta["device_properties"] == [] and "deviceProperties" not in tr.meta


def test_ns_decimals_survive(tmp_path):
    """Sub-µs digits on an absolute epoch-µs clock are kept exactly as the file's floats."""
    text = ('{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7,'
            ' "ts": 1712195495505583.125, "dur": 0.001, "args": {"stream": 7}},'
            ' {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7,'
            ' "ts": 5107214697143.417, "dur": 1.999, "args": {}}]}')
    p = tmp_path / "t.json"
    p.write_text(text)
    tr = load_trace(p)
    expect = json.loads(text)["traceEvents"]
    assert tr.device["ts_us"].tolist() == [e["ts"] for e in expect]
    assert tr.device["dur_us"].tolist() == [0.001, 1.999]


def test_cpu_only_trace(tmp_path):
    tr = load_trace(write(cpu_trace(), tmp_path / "cpu.json"))
    assert tr.cpu_only and tr.device.empty
    assert_schema(tr)
    assert len(tr.cpu_ops) == 3 and tr.cpu_ops["input_dims"].notna().all()


def test_profiler_step_written_as_cpu_op_moves_to_annotations(tmp_path):
    doc = gpu_trace(2)
    for e in doc["traceEvents"]:
        if e["name"].startswith("ProfilerStep#"):
            e["cat"] = "cpu_op"
    tr = load_trace(write(doc, tmp_path / "t.json"))
    steps = tr.annotations[tr.annotations["name"].str.startswith("ProfilerStep#")]
    assert steps["cat"].tolist() == ["cpu_op", "cpu_op"]
    assert not tr.cpu_ops["name"].str.startswith("ProfilerStep#").any()
    assert tr.annotations["event_id"].is_monotonic_increasing
    assert_schema(tr)


def test_gzip_and_directory_layouts(tmp_path):
    doc = gpu_trace(1)
    plain = load_trace(write(doc, tmp_path / "a.json"))
    gz = load_trace(write(doc, tmp_path / "b.json.gz", gz=True))
    pd.testing.assert_frame_equal(plain.device, gz.device)
    d = tmp_path / "tb"
    d.mkdir()
    write(doc, d / "host_1.1.pt.trace.json.gz", gz=True)
    assert len(load_trace(d).device) == len(plain.device)
    write(doc, d / "host_1.2.pt.trace.json", gz=False)
    assert [len(t.device) for t in load_traces(d)] == [5, 5]
    with pytest.raises(InputError, match="2 traces"):
        load_trace(d)


def test_concatenated_gzip_members(tmp_path):
    data = json.dumps(gpu_trace(1)).encode()
    p = tmp_path / "t.json.gz"
    p.write_bytes(gzip.compress(data[:100]) + gzip.compress(data[100:]))
    assert len(load_trace(p).device) == 5


def test_top_level_array_format(tmp_path):
    doc = gpu_trace(1)
    p = tmp_path / "t.json"
    p.write_text(json.dumps(doc["traceEvents"]))
    tr = load_trace(p)
    assert len(tr.device) == 5 and tr.meta["device_properties"] == []


def test_byte_order_mark(tmp_path):
    p = tmp_path / "t.json"
    p.write_bytes(b"\xef\xbb\xbf" + json.dumps(gpu_trace(1)).encode())
    assert len(load_trace(p).device) == 5


@pytest.mark.parametrize(("batch", "chunk"), [(1, 1), (2, 64), (7, 5), (300, 1000), (5000, 64)])
def test_batches_and_reads_join_seamlessly(tmp_path, monkeypatch, batch, chunk):
    """Batch boundaries anywhere (including compact '},{' separators) and file reads of any
    size (a window smaller than a batch grows) change nothing."""
    doc = gpu_trace(2)
    ref = load_trace(write(doc, tmp_path / "a.json"))
    compact = tmp_path / "b.json"
    compact.write_text(json.dumps(doc, separators=(",", ":")))
    monkeypatch.setattr(decode, "BATCH_BYTES", batch)
    monkeypatch.setattr(decode, "SCAN_BATCH_BYTES", batch)
    monkeypatch.setattr(trace_read, "CHUNK_BYTES", chunk)
    for path in (tmp_path / "a.json", compact):
        for workers in (1, 2):
            tr = load_trace(path, workers=workers)
            for table in SCHEMAS:
                pd.testing.assert_frame_equal(getattr(tr, table), getattr(ref, table))


@pytest.mark.parametrize("batch", [1, 2, 3, 7])
def test_raw_batches_join_seamlessly(tmp_path, monkeypatch, batch):
    """The Raw way (a layout not proven): its batch boundaries change nothing either."""
    doc = gpu_trace(2)
    ref = load_trace(write(doc, tmp_path / "a.json"))
    compact = tmp_path / "b.json"
    compact.write_text(json.dumps(doc, separators=(",", ":")))
    monkeypatch.setattr(decode, "events_bounds", lambda *args: None)
    monkeypatch.setattr(decode, "BATCH_EVENTS", batch)
    for path in (tmp_path / "a.json", compact):
        tr = load_trace(path)
        for table in SCHEMAS:
            pd.testing.assert_frame_equal(getattr(tr, table), getattr(ref, table))


@pytest.mark.parametrize("batch", [1, 40, 300])
def test_cuts_inside_events_are_retried_further_on(tmp_path, monkeypatch, batch):
    """A '}, {' inside an event (an array of objects in its args, or in a string) can end a
    batch mid-event: that range does not decode and a later cut ends the batch instead. The
    events are still read in spans (no fallback), and are exactly the Raw way's."""
    doc = gpu_trace(steps=3)
    for e in doc["traceEvents"]:
        if e.get("ph") == "X":
            e.setdefault("args", {})["odd"] = [{"a": 1}, {"b": {"c": [2]}}, {"d": "}, {"}]
    path = write(doc, tmp_path / "t.json")
    with monkeypatch.context() as m:
        m.setattr(decode, "events_bounds", lambda *args: None)
        raw_way = load_trace(path, workers=1)
    spans, misses, real_span, real_range = [], [], decode.parse_span, decode._read_range

    def parse_span(*args):
        spans.append(real_span(*args))
        return spans[-1]

    def read_range(*args):
        got = real_range(*args)
        if got is None:
            misses.append(args[2:4])
        return got

    monkeypatch.setattr(decode, "parse_span", parse_span)
    monkeypatch.setattr(decode, "_read_range", read_range)
    monkeypatch.setattr(decode, "BATCH_BYTES", batch)
    monkeypatch.setattr(decode, "SCAN_BATCH_BYTES", batch)  # (the compiled scanner's batches)
    monkeypatch.setattr(decode, "_RETRIES", 1000)
    assert_identical(load_trace(path, workers=1), raw_way)
    assert spans == [raw_way.meta["event_count"]] and misses


def test_a_file_that_shrinks_while_it_is_read_gets_the_raw_way_error(tmp_path, monkeypatch):
    """The text ending before the events' proven end is not proven: the file is read again,
    whole, and its error (or tables) are the Raw way's."""
    path = write(gpu_trace(steps=6), tmp_path / "t.json")
    data, real = path.read_bytes(), decode.events_bounds

    def then_shrink(*args):
        out = real(*args)
        path.write_bytes(data[: len(data) // 2])
        return out

    monkeypatch.setattr(decode, "events_bounds", then_shrink)
    monkeypatch.setattr(trace_read, "CHUNK_BYTES", 1000)
    with pytest.raises(InputError, match=r"t\.json: truncated JSON"):
        load_trace(path, workers=1)


def test_input_file_is_not_modified(tmp_path):
    p = write(gpu_trace(1), tmp_path / "t.json")
    before = p.read_bytes()
    load_trace(p)
    assert p.read_bytes() == before


def test_progress_callback(tmp_path):
    calls = []
    load_trace(write(gpu_trace(1), tmp_path / "t.json"), progress=lambda *a: calls.append(a))
    stages = [c[0] for c in calls]
    assert stages[0] == "read" and stages[-1] == "parse"
    assert calls[-1][1] == calls[-1][2]  # parse ends at done == total


def test_progress_bar_is_silent_off_a_tty(tmp_path):
    import io

    assert progress_bar(io.StringIO()) is None

    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    bar = progress_bar(out, min_bytes=0)
    load_trace(write(gpu_trace(1), tmp_path / "t.json"), progress=bar)
    assert "parse" in out.getvalue() and out.getvalue().endswith("\n")
    small = Tty()
    load_trace(tmp_path / "t.json", progress=progress_bar(small))
    assert small.getvalue() == ""  # below min_bytes nothing is drawn


COMMITTED = sorted(SAMPLES.glob("*.json.gz"))


@pytest.mark.parametrize("path", COMMITTED, ids=[p.name for p in COMMITTED])
def test_committed_traces_match_a_stdlib_reading(path):
    """Every committed real trace: each table holds exactly its events, timings bit for bit."""
    doc = read(path)
    events = doc["traceEvents"]
    tr = load_trace(path)
    assert_schema(tr)
    assert tr.meta["skipped_events"] == {} and tr.meta["events_with_dropped_fields"] == 0
    raw = raw_device(doc)
    assert tr.device["ts_us"].tolist() == [e["ts"] for e in raw]
    assert math.fsum(tr.device["dur_us"]) == math.fsum(e["dur"] for e in raw)
    ops = [e for e in events if e.get("cat") == "cpu_op" and e.get("ph") == "X"
           and not e["name"].startswith("ProfilerStep#")]
    assert tr.cpu_ops["name"].astype(str).tolist() == [e["name"] for e in ops]
    dims = [json.dumps(e["args"]["Input Dims"]) if "Input Dims" in e["args"] else None
            for e in ops]
    assert tr.cpu_ops["input_dims"].astype(object).where(tr.cpu_ops["input_dims"].notna(),
                                                          None).tolist() == dims
    strides = [json.dumps(e["args"]["Input Strides"]) if "Input Strides" in e["args"] else None
               for e in ops]
    got = tr.cpu_ops["input_strides"].astype(object)
    assert got.where(got.notna(), None).tolist() == strides
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    assert tr.runtime["correlation"].tolist() == [e["args"]["correlation"] for e in runtime]
    flows = [e for e in events if e.get("cat") == "ac2g"]
    assert tr.flows["id"].tolist() == [e["id"] for e in flows]
    frames = [e for e in events if e.get("cat") == "python_function"]
    assert len(tr.python_frames) == len(frames)
    assert tr.cpu_only == (not raw)
    if tr.cpu_only:
        assert tr.meta["device_properties"] == [] and len(tr.cpu_ops) > 0
    else:
        assert tr.meta["device_properties"][0]["name"] == "NVIDIA H200"


# ----------------------------------------------------------------------------------------------
# Two processes: big files fork a worker for the later events; the tables must not change
# ----------------------------------------------------------------------------------------------
def column_bits(s: pd.Series):
    """Everything that defines a column: categories in order and codes, mask and values, bytes."""
    if isinstance(s.dtype, pd.CategoricalDtype):
        return s.cat.categories.tolist(), s.cat.codes.to_numpy().tobytes()
    if str(s.dtype) == "Int64":
        return s.isna().to_numpy().tobytes(), s.fillna(0).to_numpy("int64").tobytes()
    return str(s.dtype), s.to_numpy().tobytes()


def assert_identical(a, b):
    assert a.meta == b.meta
    for table in SCHEMAS:
        x, y = getattr(a, table), getattr(b, table)
        pd.testing.assert_frame_equal(x, y, check_exact=True)
        for col in x.columns:
            assert column_bits(x[col]) == column_bits(y[col]), (table, col)


def children() -> list[str]:
    pid = os.getpid()
    return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()


@pytest.fixture
def both(monkeypatch):
    """load(path, mode) -> Trace or the InputError message, checking how it was parsed:
    "serial" one process; "two" a worker was forked and the parent decoded one span (as much
    of the events as it claimed); "alone" a worker was forked but the parent decoded all the
    events (the worker died before claiming any); "late" the parent decoded its part, then the
    worker died and the file was parsed again in one process; "unforked" the layout was not
    proven, so no worker was forked; "fallback" a worker was forked but its part or the
    parent's was not proven, so the one-process path decided; "any" no check (only: no worker
    left behind). The one-process path decodes the file as one span, or, when that is not proven, the Raw way
    (a span of None, or none). Batches, windows and the worker's segments are small, so that
    the two processes meet somewhere in the middle of a small file."""
    forks, spans = [], []
    parent, real_fork, real_parse = os.getpid(), os.fork, parallel.parse_span

    def fork():
        forks.append(1)
        return real_fork()

    def parse(*args, **kw):
        n = real_parse(*args, **kw)
        if os.getpid() == parent:
            spans.append(n)
        return n

    monkeypatch.setattr(os, "fork", fork)
    for module in (decode, parallel):  # the one-process parse; the parent's (and worker's) part
        monkeypatch.setattr(module, "parse_span", parse)
    monkeypatch.setattr(decode, "BATCH_BYTES", 2000)
    monkeypatch.setattr(decode, "SCAN_BATCH_BYTES", 2000)  # (the compiled scanner's batches)
    monkeypatch.setattr(trace_read, "CHUNK_BYTES", 1500)  # (windows slide, and grow to hold a batch)
    monkeypatch.setattr(parallel, "SEGMENT_BYTES", 20_000)
    monkeypatch.setattr(parallel, "MIN_SEGMENT_BYTES", 2000)

    def load(path, mode: str):
        forks.clear()
        spans.clear()
        before = set(children())  # (an earlier test's helper process may still be running)
        try:
            out = load_trace(path, workers=1 if mode == "serial" else 2)
        except InputError as e:
            out = str(e)
        assert set(children()) <= before  # the worker is always reaped, whatever happened
        if mode == "any":
            return out
        assert len(forks) == (mode not in ("serial", "unforked"))
        n = out.meta["event_count"] if isinstance(out, Trace) else None
        if mode == "two":
            assert len(spans) == 1 and (n is None or 0 <= spans[0] < n), (spans, n)
        elif mode == "alone":
            assert spans == [n], (spans, n)
        elif mode == "late":
            assert len(spans) == 2 and spans[0] < n and spans[1:] in ([n], [None]), (spans, n)
        elif n is not None and mode != "fallback":
            assert spans in ([n], [None], []), (spans, n)
        return out

    load.spans = spans  # (the parent's spans of the last load)
    return load


needs_fork = pytest.mark.skipif(not hasattr(os, "fork") or parallel.usable_cores() < 2,
                                reason="the parallel parse needs fork and two cores")


def _tiled(tmp_path, source: str, copies: int = 3) -> Path:
    path = tmp_path / f"tiled_{source}.json"
    src = SAMPLES / source
    tile(src, path, copies * len(gzip.decompress(src.read_bytes())))
    return path


@needs_fork
@pytest.mark.parametrize("source", ["qwen2.5-7b_decode_b1_s2048_h200.json.gz",
                                    "hf-qwen2-qwen2.5-7b-2l_decode_b1_s512_stack_h200.json.gz",
                                    "qwen-tiny_decode_b2_s64_l2_cpu.json.gz"])
def test_parallel_parse_is_bit_identical_on_tiled_real_traces(tmp_path, both, source):
    path = _tiled(tmp_path, source)
    serial = both(path, "serial")
    assert len(serial.device) + len(serial.cpu_ops) > 1000
    assert_identical(serial, both(path, "two"))


@needs_fork
@pytest.mark.parametrize("layout", ["compact", "spaced", "array", "gzip", "bom"])
@pytest.mark.parametrize("segment", [700, 20_000, 1 << 30])
def test_parallel_parse_of_other_layouts_and_cuts(tmp_path, both, monkeypatch, layout, segment):
    """One-byte separators, a top-level array, a gzip file (the worker forked after
    inflating), a byte-order mark; the worker's segments tiny, small or 1/8 of the events."""
    doc = json.loads(_tiled(tmp_path, "qwen2.5-7b_decode_b1_s2048_h200.json.gz", 2).read_text())
    data = {"compact": lambda: json.dumps(doc, separators=(",", ":")).encode(),
            "spaced": lambda: json.dumps(doc).encode(),
            "array": lambda: json.dumps(doc["traceEvents"], indent=1).encode(),
            "gzip": lambda: gzip.compress(json.dumps(doc, indent=2).encode(), 1),
            "bom": lambda: b"\xef\xbb\xbf" + json.dumps(doc, indent=1).encode()}[layout]()
    path = tmp_path / ("t.json.gz" if layout == "gzip" else "t.json")
    path.write_bytes(data)
    serial = both(path, "serial")
    monkeypatch.setattr(parallel, "SEGMENT_BYTES", segment)
    assert_identical(serial, both(path, "two"))


def _mixed_events() -> dict:
    """A GPU trace with bad, partly bad, legacy and late-first-seen events spread over it."""
    doc = gpu_trace(steps=6)
    events = doc["traceEvents"]
    k = {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 5.0, "dur": 1.0,
         "args": {"device": 0, "stream": 7, "correlation": 1, "External id": 2}}
    bad = [dict(k, ts="12"), dict(k, dur=-1.0), dict(k, dur=1e20), dict(k, ph="B"), 7, None,
           {kk: v for kk, v in k.items() if kk != "dur"},
           {"ph": "s", "cat": "ac2g", "id": 3, "pid": 1, "tid": 1}]
    partly = [dict(k, args={"External id": "abc"}), dict(k, pid=1.5), dict(k, args=[1])]
    late = [dict(k, name="only_in_the_second_half", args={"grid": [9, 9, 9]}),
            {"ph": "X", "cat": "cpu_op", "name": "ProfilerStep#99", "pid": 1, "tid": 1,
             "ts": 9.0, "dur": 1.0, "args": {}},
            {"ph": "X", "cat": "cpu_op", "name": "aten::late", "pid": 1, "tid": 1, "ts": 9.0,
             "dur": 1.0, "args": {"Input Dims": [[7, 7]], "Input type": ["float"]}}]
    n = len(events)
    for i, e in enumerate(bad + partly):
        events.insert((i * 37) % n, e)
    events[-5:-5] = late
    return doc


@needs_fork
def test_parallel_parse_is_bit_identical_with_skipped_and_bad_events(tmp_path, both, monkeypatch):
    doc = _mixed_events()
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc).replace("Infinity", "1e400"))
    serial = both(path, "serial")
    parent_waits_for_a_claim(monkeypatch)  # (a small file: the worker must get a part)
    assert serial.meta["skipped_events"] and serial.meta["events_with_dropped_fields"] == 3
    assert "only_in_the_second_half" in serial.device["name"].cat.categories
    assert_identical(serial, both(path, "two"))


@needs_fork
@pytest.mark.parametrize("where", [[0.9], [0.2], [0.2, 0.9]])
def test_parallel_parse_reports_the_first_malformed_event(tmp_path, both, where):
    """An event the decoder rejects (invalid UTF-8 in its name) in either half, or both: the
    same one-line error, naming the first such event, and no worker left behind."""
    doc = gpu_trace(steps=6)
    n = len(doc["traceEvents"])
    for frac in where:
        doc["traceEvents"][int(frac * n)]["name"] = "BAD\u00ff"
    data = json.dumps(doc, ensure_ascii=False).encode().replace("BAD\u00ff".encode(), b"BAD\xff")
    path = tmp_path / "t.json"
    path.write_bytes(data)
    serial = both(path, "serial")
    assert isinstance(serial, str) and f"traceEvents[{int(where[0] * n)}]" in serial
    assert both(path, "any") == serial


def _in_child(monkeypatch, name: str, action):
    """Make parallel.<name> run `action` in the worker (the parent keeps the real function)."""
    parent, real = os.getpid(), getattr(parallel, name)

    def wrapper(*args, **kw):
        if os.getpid() != parent:
            action()
        return real(*args, **kw)

    monkeypatch.setattr(parallel, name, wrapper)


def _exit():
    os._exit(9)


def _boom():
    raise RuntimeError("boom")


def _unreadable():
    raise InputError("t.json: cannot read (gone)")


@needs_fork
@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize(("where", "action", "mode"), [
    ("parse_span", _exit, "late"), ("parse_span", _boom, "late"),
    ("_boundary", _exit, "alone"), ("_boundary", _boom, "alone"),
    ("_boundary", _unreadable, "alone")])
def test_a_dying_worker_gives_the_one_process_result(tmp_path, both, monkeypatch, where,
                                                     action, mode, gz):
    """A worker killed, crashing or unable to read the file at any step is not a failure: the
    file is parsed in one process, with its usual result (or error), and nothing is printed."""
    doc = _mixed_events()
    path = write(doc, tmp_path / "t.json", gz=gz)
    serial = both(path, "serial")
    _in_child(monkeypatch, where, action)
    if mode == "late":  # the worker dies after claiming: let it claim, however slow its start
        parent_waits_for_a_claim(monkeypatch)
    assert_identical(serial, both(path, mode))
    bad = tmp_path / "bad.json"
    bad.write_bytes(path.read_bytes()[:-40] if not gz else gzip.decompress(path.read_bytes())[:-40])
    assert both(bad, "unforked") == both(bad, "serial")


@needs_fork
@pytest.mark.parametrize("case", ["no_boundary", "duplicate_key", "duplicate_key_first",
                                  "tail_array", "truncated", "last_not_object", "garbage_after",
                                  "array_then_brace", "key_in_a_key"])
def test_unproven_splits_fall_back_to_one_process(tmp_path, both, monkeypatch, case):
    """Files whose halves cannot be proven to be the trace's events (no event boundary after
    the cut, a second traceEvents key, ...) are parsed by the one-process path, identically."""
    doc = gpu_trace(steps=6)
    events = doc["traceEvents"]
    text = {
        "no_boundary": lambda: json.dumps(dict(doc, traceEvents=events[:40] + [None] * 400)),
        "duplicate_key": lambda: json.dumps(doc)[:-1] + ', "traceEvents": ' + json.dumps(
            events[:9]) + "}",
        "tail_array": lambda: json.dumps(dict(doc, traceEvents=events, zz=[{"a": 1}])),
        "truncated": lambda: json.dumps(doc)[:-3],
        "last_not_object": lambda: json.dumps(dict(doc, traceEvents=events + [7])),
        "duplicate_key_first": lambda: '{"traceEvents": ' + json.dumps(events[:9]) + ", "
                                       + json.dumps(doc)[1:],
        "garbage_after": lambda: json.dumps(doc) + "}{",
        "array_then_brace": lambda: json.dumps(events) + "}",
        # '"traceEvents": [' inside a key name: no traceEvents key at all
        "key_in_a_key": lambda: '{"x \\"traceEvents": ' + json.dumps(events) + "}",
    }[case]()
    path = tmp_path / "t.json"
    path.write_text(text)
    serial = both(path, "serial")
    mode = {"tail_array": "two", "duplicate_key": "fallback",
            "duplicate_key_first": "fallback"}.get(case, "unforked")
    if mode == "two":  # (a small file: the parent could decode it all before the worker runs)
        parent_waits_for_a_claim(monkeypatch)
    out = both(path, mode)
    if isinstance(serial, str):
        assert out == serial
    else:
        assert_identical(serial, out)


@needs_fork
@pytest.mark.parametrize("slow", ["parent", "worker"])
def test_the_faster_process_decodes_more(tmp_path, both, monkeypatch, slow):
    """The split follows the two processes' speeds (a busy core claims less): with one of them
    slowed down, the other decodes most of the events, and the result is the same."""
    path = _tiled(tmp_path, "qwen2.5-7b_decode_b1_s2048_h200.json.gz")
    serial = both(path, "serial")
    n = serial.meta["event_count"]
    parent, real_parse = os.getpid(), parallel.parse_span  # (the fixture's counting wrapper)

    def parse(r, start, end):
        if (os.getpid() == parent) == (slow == "parent"):
            r = dataclasses.replace(r, progress=lambda *a: time.sleep(0.01))  # (after each batch)
        return real_parse(r, start, end)

    monkeypatch.setattr(parallel, "parse_span", parse)
    two = both(path, "two")
    assert_identical(serial, two)
    share = both.spans[0] / n
    assert (share < 1 / 3) if slow == "parent" else (share > 2 / 3), share  # (loaded CI: a margin)


@needs_fork
def test_every_malformed_file_case_gives_the_same_error_in_parallel(tmp_path, both):
    for case, (data, _) in FILE_CASES.items():
        path = tmp_path / f"{case}.json"
        path.write_bytes(data)
        assert both(path, "any") == both(path, "serial"), case


@needs_fork
def test_parallel_parse_when_children_are_reaped_automatically(tmp_path, both, monkeypatch):
    """A host program ignoring SIGCHLD (the kernel reaps children at once) still gets a result."""
    import signal

    path = write(_mixed_events(), tmp_path / "t.json")
    serial = both(path, "serial")
    parent_waits_for_a_claim(monkeypatch)  # (a small file: the worker must get a part)
    old = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    try:
        assert_identical(serial, both(path, "two"))
    finally:
        signal.signal(signal.SIGCHLD, old)


@pytest.fixture
def forks(monkeypatch):
    """The number of os.fork calls made so far (each one really forks)."""
    calls, real_fork = [], os.fork

    def fork():
        calls.append(1)
        return real_fork()

    monkeypatch.setattr(os, "fork", fork)
    return calls


def test_small_files_stay_in_one_process(tmp_path, forks):
    load_trace(write(gpu_trace(steps=6), tmp_path / "t.json"))
    assert forks == [] and parallel.PARALLEL_MIN_BYTES >= 1 << 20


@pytest.mark.parametrize("workers", [0, 3, -1, True, 2.0, "2"])
def test_workers_must_be_none_1_or_2(tmp_path, workers):
    path = write(gpu_trace(steps=1), tmp_path / "t.json")
    for load in (load_trace, load_traces):
        with pytest.raises(InputError, match=r"^workers must be None \(automatic\), 1 or 2, not "):
            load(path, workers=workers)


def test_when_a_worker_is_used():
    """The rules in load_trace's docstring: size, cores and `workers`; never with threads."""
    big = parallel.PARALLEL_MIN_BYTES
    can_fork = hasattr(os, "fork")
    assert parallel.use_worker(big, None) == (can_fork and parallel.usable_cores() >= 2)
    assert not parallel.use_worker(big - 1, None)
    assert parallel.use_worker(1, 2) == can_fork  # 2: whatever the size and the cores
    assert not parallel.use_worker(0, 2)  # (an empty document has nothing to split)
    assert not parallel.use_worker(1 << 40, 1)


@needs_fork
def test_two_workers_fork_only_without_other_threads(tmp_path, forks):
    """workers=2 forks for a small file; with another thread running (a notebook kernel) neither
    it nor automatic mode forks, and the result is the same."""
    import threading

    path = write(_mixed_events(), tmp_path / "t.json")
    before = set(children())
    two = load_trace(path, workers=2)
    assert len(forks) == 1
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert not parallel.use_worker(1 << 40, None)
        one = load_trace(path, workers=2)
    finally:
        stop.set()
        thread.join()
    assert len(forks) == 1 and set(children()) <= before
    assert_identical(two, one)


@needs_fork
def test_no_record_locks_means_one_process(tmp_path, both, monkeypatch):
    """Where the claims file cannot be locked (a file system without POSIX record locks), no
    worker is forked and the one process gives the same tables."""
    path = _tiled(tmp_path, "qwen2.5-7b_decode_b1_s2048_h200.json.gz", 2)
    serial = both(path, "serial")

    def no_locks(*args):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(parallel.fcntl, "lockf", no_locks)
    assert_identical(serial, both(path, "unforked"))
