"""Fuzz: mutated traces either load or raise InputError, and loaded traces keep device time;
the two-process parse gives exactly the one-process result or error on every mutation.

The reference for device time is independent of trace_roofline.trace: the stdlib json module reads the
mutated document, and a device event counts when its ph/cat/name/ts/dur are well formed
(the documented policy: timing decides whether an event is kept, malformed links do not).
"""

import copy
import gzip
import json
import math
import os
import tempfile
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.builders import SAMPLES, gpu_trace, legacy_trace, read
from trace_roofline.errors import InputError
from trace_roofline.model.hardware import get_hardware
from trace_roofline.model.models import get_model
from trace_roofline.pipeline import analyze_trace
from trace_roofline.trace import MAX_DUR_US, MAX_TS_US, SCHEMAS, decode, load_trace
from trace_roofline.trace import read as trace_read

DEVICE = {"kernel", "gpu_memcpy", "memcpy", "gpu_memset", "memset"}
FIELDS = ["ph", "cat", "name", "pid", "tid", "ts", "dur", "id", "args"]
ARGS = ["External id", "external id", "correlation", "device", "stream", "grid", "block",
        "Input Dims", "Input type", "Concrete Inputs", "Python id", "Python parent id"]
# FUZZ_EXAMPLES=2000 for a longer search (the default keeps the suite fast)
SETTINGS = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 20)), deadline=None,
                    derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _committed() -> list[dict]:
    """The two smallest committed GPU traces and the smallest CPU one, read with stdlib json."""
    by_size = sorted(SAMPLES.glob("*.json.gz"), key=lambda p: p.stat().st_size)
    llm_cpu = [p for p in by_size if p.name.startswith("qwen") and p.name.endswith("_cpu.json.gz")]
    gpu = [p for p in by_size if not p.name.endswith("_cpu.json.gz")]
    docs = []
    for p in gpu[:2] + llm_cpu[:1]:
        doc = read(p)
        docs.append(doc if isinstance(doc, dict) else {"traceEvents": doc})
    return docs


BASES = [gpu_trace(2), legacy_trace(1)] + _committed()

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                 max_size=3),
    max_leaves=4,
)


def _number(v):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def reference_device_durations(doc) -> list[float] | None:
    """Durations of the device events a correct loader must keep, or None if not a trace."""
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        return None
    out = []
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        cat, name = e.get("cat"), e.get("name")
        if not isinstance(cat, str) or cat.lower() not in DEVICE:
            continue
        if name is not None and not isinstance(name, str):
            continue
        ts, dur = _number(e.get("ts")), _number(e.get("dur"))
        if ts is None or dur is None or not 0 <= dur <= MAX_DUR_US or abs(ts) > MAX_TS_US:
            continue
        out.append(dur)
    return out


# Batch and read sizes for the two-process parse: a few events per batch (decode.BATCH_BYTES,
# the batch-by-batch way, and SCAN_BATCH_BYTES, the compiled scanner's; decode.BATCH_EVENTS,
# the Raw way of documents not proven) and file reads smaller than a batch (read.CHUNK_BYTES:
# the window slides, and grows to hold a batch).
SMALL = [(decode, "BATCH_BYTES", 1000), (decode, "SCAN_BATCH_BYTES", 1000), (decode, "BATCH_EVENTS", 16),
         (trace_read, "CHUNK_BYTES", 700)]


def load_both(p: Path):
    """load_trace(p) in one process and, where fork exists, with the two-process parse forced
    and small batches and reads (SMALL: both halves hold several batches, the window slides and
    grows): the same trace or the same error."""
    try:
        one = load_trace(p, workers=1)
    except InputError as e:
        one = e
    if not hasattr(os, "fork"):
        return one
    with pytest.MonkeyPatch.context() as m:
        for module, name, value in SMALL:
            m.setattr(module, name, value)
        try:
            two = load_trace(p, workers=2)
        except InputError as e:
            two = e
    if isinstance(one, InputError):
        assert str(two) == str(one)
    else:
        assert two.meta == one.meta
        for table in SCHEMAS:
            pd.testing.assert_frame_equal(getattr(two, table), getattr(one, table),
                                          check_exact=True)
    return one


def check(data: bytes, gz: bool = False):
    """Load the bytes; only InputError may escape; a loaded trace must keep device time."""
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / ("t.json.gz" if gz else "t.json")
        p.write_bytes(gzip.compress(data) if gz else data)
        tr = load_both(p)
        if isinstance(tr, InputError):
            assert "\n" not in str(tr) and str(p) in str(tr)
            return
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return  # the stdlib cannot read it either: nothing to compare against
    ref = reference_device_durations(doc)
    if ref is None:
        return
    got = tr.device["dur_us"].tolist()
    assert len(got) == len(ref)
    assert math.fsum(got) == math.fsum(ref)
    assert tr.device["ts_us"].notna().all()
    # the rest of the pipeline: no exception but InputError, every device µs in one operator row
    try:
        analysis = analyze_trace(tr, get_model("qwen2.5-7b"), get_hardware("h200-sxm"))
    except InputError as e:
        assert "\n" not in str(e)
        return
    if not tr.cpu_only:
        assert math.fsum(analysis.costed["time_us"]) == pytest.approx(math.fsum(ref), abs=1e-6)


@SETTINGS
@given(st.data())
def test_event_level_mutations(data):
    doc = copy.deepcopy(data.draw(st.sampled_from(BASES)))
    events = doc["traceEvents"]
    for _ in range(data.draw(st.integers(1, 6))):
        i = data.draw(st.integers(0, len(events) - 1))
        action = data.draw(st.sampled_from(
            ["set", "set_arg", "delete", "replace", "duplicate", "negate", "recase"]))
        e = events[i]
        if action == "replace" or not isinstance(e, dict):
            events[i] = data.draw(json_values)
        elif action == "set":
            e[data.draw(st.sampled_from(FIELDS))] = data.draw(json_values)
        elif action == "set_arg":
            if not isinstance(e.get("args"), dict):
                e["args"] = {}
            e["args"][data.draw(st.sampled_from(ARGS))] = data.draw(json_values)
        elif action == "delete":
            e.pop(data.draw(st.sampled_from(FIELDS)), None)
        elif action == "duplicate":
            events.insert(i, copy.deepcopy(e))
        elif action == "negate" and isinstance(e.get("dur"), (int, float)):
            e["dur"] = -e["dur"] - 1
        elif action == "recase" and isinstance(e.get("cat"), str):
            e["cat"] = e["cat"].upper()
    check(json.dumps(doc).encode())


@SETTINGS
@given(st.data())
def test_byte_level_mutations(data):
    base = json.dumps(data.draw(st.sampled_from(BASES)), indent=1).encode()
    buf = bytearray(base)
    for _ in range(data.draw(st.integers(1, 4))):
        k = data.draw(st.integers(0, len(buf)))
        action = data.draw(st.sampled_from(["truncate", "flip", "insert", "delete"]))
        if action == "truncate":
            del buf[k:]
        elif action == "flip" and k < len(buf):
            buf[k] ^= data.draw(st.integers(1, 255))
        elif action == "insert":
            buf[k:k] = data.draw(st.binary(min_size=1, max_size=8))
        elif action == "delete":
            del buf[k : k + data.draw(st.integers(1, 64))]
    check(bytes(buf), gz=data.draw(st.booleans()))


@pytest.mark.parametrize("cut", [0.1, 0.5, 0.9, 0.999])
def test_truncated_gzip_streams(cut):
    packed = gzip.compress(json.dumps(BASES[0]).encode())
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "t.json.gz"
        p.write_bytes(packed[: int(len(packed) * cut)])
        with pytest.raises(InputError):
            load_trace(p)
