"""The compiled event scanner (trace/_scan.c) against the msgspec decoder: a file read with the
scanner (columns.SCANNER) and without it gives the same tables, bit for bit, the same metadata,
or the same InputError. The scanner reads the common case itself and declines the rest with a
reason (then msgspec decodes that batch): the tests also say which inputs it must read itself,
and why it declines the others. Skipped where the optional C extension is not built.
"""

import gzip
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.builders import SAMPLES, check_batch, gpu_trace, walk
from trace_roofline.errors import InputError
from trace_roofline.trace import SCHEMAS, columns, decode, fields, load_trace, parallel
from trace_roofline.trace import read as trace_read

_scan = pytest.importorskip("trace_roofline.trace._scan",
                            reason="the optional C extension trace_roofline.trace._scan is not built")

# SCAN_EXAMPLES=2000 for a longer search (the default keeps the file fast)
SETTINGS = settings(max_examples=int(os.environ.get("SCAN_EXAMPLES", 25)), deadline=None,
                    derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
READ = "read"  # expectation: the scanner read every batch itself
ERROR = "error"  # expectation: both ways raise (the same) InputError


# ----------------------------------------------------------------------------- reading both ways
class Spy:
    """Records what every Accumulator.scan call gave, in this process and in a forked worker:
    ("read", n) or ("declined", reason), one line per call in a log file."""

    def __init__(self, monkeypatch, log: Path):
        self.log = log
        real = columns.Accumulator.scan

        def scan(acc, buf, lo, hi, start):
            before = dict(acc.declined)
            got = real(acc, buf, lo, hi, start)
            if acc.scanner is not None:
                why = next((k for k, v in acc.declined.items() if v != before.get(k, 0)), None)
                with open(log, "a") as f:
                    f.write(f"{os.getpid()}\t{'read' if got is not None else 'declined'}\t"
                            f"{got if got is not None else why}\n")
            return got

        monkeypatch.setattr(columns.Accumulator, "scan", scan)

    def calls(self) -> list[tuple[int, str, str]]:
        """(process id, outcome, n or reason) of every scan call so far."""
        if not self.log.exists():
            return []
        rows = [line.split("\t") for line in self.log.read_text().splitlines()]
        return [(int(pid), outcome, value) for pid, outcome, value in rows]

    def clear(self) -> None:
        self.log.unlink(missing_ok=True)


def _load(path: Path, workers: int):
    try:
        return load_trace(path, workers=workers)
    except InputError as e:
        return e


def both_ways(path: Path, workers: int = 1, log: Path | None = None):
    """(with the scanner, without it, the scanner's calls): load_trace(path) each way (a Trace or
    the InputError), the scanner's (process id, outcome, n or reason) per batch (logged to `log`,
    a temporary file by default)."""
    if log is None:
        with tempfile.TemporaryDirectory() as d:
            return both_ways(path, workers, Path(d) / "scan.log")
    with pytest.MonkeyPatch.context() as m:
        spy = Spy(m, log)
        spy.clear()
        scanned = _load(path, workers)
        calls = spy.calls()
        m.setattr(columns, "SCANNER", None)
        plain = _load(path, workers)
    spy.clear()
    return scanned, plain, calls


def assert_same(scanned, plain) -> None:
    """The same tables (exactly: categories in order, float columns to the bit, so that 0.0 and
    -0.0 differ), the same meta; or the same InputError."""
    if isinstance(plain, InputError) or isinstance(scanned, InputError):
        assert type(scanned) is type(plain), (scanned, plain)
        assert str(scanned) == str(plain)
        return
    assert scanned.meta == plain.meta
    for table in SCHEMAS:
        x, y = getattr(scanned, table), getattr(plain, table)
        pd.testing.assert_frame_equal(x, y, check_exact=True, obj=table)
        for col in x.select_dtypes("float").columns:
            assert x[col].to_numpy().tobytes() == y[col].to_numpy().tobytes(), (
                table, col, x[col].tolist(), y[col].tolist())


def check_file(path: Path, expect: str | None = None, workers: int = 1):
    """Load `path` both ways and compare; `expect`: READ (the scanner read every batch), ERROR
    (both raise), a decline reason (some batch was declined for it) or None (no claim)."""
    scanned, plain, calls = both_ways(path, workers)
    assert_same(scanned, plain)
    if expect == READ:
        assert calls and all(c[1] == "read" for c in calls), calls
    elif expect == ERROR:
        assert isinstance(plain, InputError)
    elif expect is not None:
        assert ("declined", expect) in [c[1:] for c in calls], calls
    return scanned, calls


# ----------------------------------------------------------------------------- trace documents
KERNEL = {"ph": '"X"', "cat": '"kernel"', "name": '"gemm"', "pid": "0", "tid": "7", "ts": "100.5",
          "dur": "2.25", "args": {"device": "0", "stream": "7", "correlation": "11", "External id": "5",
                                  "grid": "[1, 2, 3]", "block": "[128, 1, 1]"}}
CPU_OP = {"ph": '"X"', "cat": '"cpu_op"', "name": '"aten::mm"', "pid": "1", "tid": "1", "ts": "99.0",
          "dur": "5.0", "args": {"External id": "5", "Input Dims": "[[2, 3], [3, 4]]",
                                 "Input type": '["float", "float"]', "Concrete Inputs": '["", ""]',
                                 "Input Strides": "[[3, 1], [4, 1]]"}}
RUNTIME = {"ph": '"X"', "cat": '"cuda_runtime"', "name": '"cudaLaunchKernel"', "pid": "1", "tid": "1",
           "ts": "99.5", "dur": "1.0", "args": {"correlation": "11", "External id": "5"}}
ANNOT = {"ph": '"X"', "cat": '"user_annotation"', "name": '"q_proj"', "pid": "1", "tid": "1",
         "ts": "98.0", "dur": "9.0", "args": {"External id": "4"}}
FRAME = {"ph": '"X"', "cat": '"python_function"', "name": '"nn.Module: Linear_0"', "pid": "1",
         "tid": "1", "ts": "97.0", "dur": "11.0", "args": {"Python id": "3", "Python parent id": "2"}}
FLOW = {"ph": '"s"', "cat": '"ac2g"', "name": '"ac2g"', "id": "11", "pid": "1", "tid": "1", "ts": "99.5"}
BASE = [KERNEL, CPU_OP]


def text(ev: dict, colon: str = ": ", comma: str = ", ") -> str:
    """An event (key -> value text; args a dict of them) as JSON text."""
    return "{" + comma.join(f'"{k}"{colon}{text(v, colon, comma) if isinstance(v, dict) else v}'
                            for k, v in ev.items()) + "}"


def with_(base: dict, **changes) -> dict:
    """`base` with fields changed: keys are field names, `args_X` for args field X (spaces as
    `_`, e.g. args_External_id); a value None deletes the field."""
    ev = dict(base)
    ev["args"] = dict(ev.get("args", {}))
    for key, value in changes.items():
        target, key = (ev["args"], key[5:].replace("_", " ")) if key.startswith("args_") else (ev, key)
        if value is None:
            target.pop(key, None)
        else:
            target[key] = value
    return ev


def document(events: list[str], head: str = '{"schemaVersion": 1, "traceEvents": [\n',
             sep: str = ",\n", tail: str = '\n], "traceName": "t"}') -> tuple[bytes, bytes]:
    """(the document, its events array's content) of event texts."""
    content = sep.join(events)
    return (head + content + tail).encode(), content.encode()


def write_events(path: Path, events: list, **layout) -> tuple[Path, bytes]:
    """BASE (a kernel and a cpu op, so that the file loads) then `events` (dicts or texts)."""
    data, content = document([text(e) if isinstance(e, dict) else e for e in [*BASE, *events]], **layout)
    path.write_bytes(data)
    return path, content


def test_scanner_keeps_no_buffer_checks_bounds_and_hands_each_key_once():
    """scan() keeps no reference to its buffer (it can be resized after a read or a decline),
    refuses bounds outside it, reads an empty batch as no events; strings() and raws() hand
    each new key once (string keys as their text, escapes kept), in code order."""
    sc = _scan.Scanner()
    buf = bytearray(text(with_(KERNEL, name=r'"g\u0041"')).encode())
    assert sc.scan(buf, 0, len(buf))[0] == 1
    buf += b" "  # (BufferError while an export of buf is held)
    assert sc.strings() == [b"X", b"kernel", rb"g\u0041"] and sc.strings() == []
    assert sc.raws() == [b"[1, 2, 3]\x01[128, 1, 1]", b"\x01" * 4] and sc.raws() == []
    assert sc.scan(buf, 0, len(buf))[0] == 1
    assert sc.strings() == [] and sc.raws() == []
    bad = bytearray(text(with_(KERNEL, name='"é"')).encode())
    assert sc.scan(bad, 0, len(bad)) == "a non-ASCII byte"
    bad += b" "
    for lo, hi in [(-1, 3), (3, 2), (0, len(buf) + 1)]:
        with pytest.raises(ValueError):
            sc.scan(buf, lo, hi)
    assert sc.scan(bytearray(b" \n "), 0, 3)[0] == 0


# ----------------------------------------------------------------------------- committed traces
def _committed() -> list[Path]:
    return sorted(p for p in SAMPLES.rglob("*") if p.name.endswith((".json", ".json.gz")))


def test_the_committed_files_are_many():
    assert len(_committed()) > 50


@pytest.mark.parametrize("path", walk(_committed()))
def test_every_committed_trace_reads_the_same_both_ways(path, tmp_path):
    """Every sample file (traces, and the JSON files that are not traces: the same InputError)
    gives the same result; the scanner reads the traces itself (at most the odd batch declined)."""
    scanned, plain, calls = both_ways(path, log=tmp_path / "scan.log")
    assert_same(scanned, plain)
    if not isinstance(plain, InputError):
        assert calls  # (a proven layout: read batch by batch)
        declined = sum(c[1] == "declined" for c in calls)
        assert declined <= max(1, len(calls) // 100), (declined, len(calls))


# ----------------------------------------------------------------------------- hand-written cases
K = KERNEL
LONG = "1" * 400
DEEP = "[" * 70 + "]" * 70
SHALLOW = "[" * 55 + "1" + "]" * 55
CASES = [
    # strings: escapes are read (decoded once per distinct spelling), non-ASCII bytes declined
    ("name-escapes", [with_(K, name=r'"a\"b\\c\/d\ne\u0041\b\f\r\tz"')], READ),
    ("name-escaped-twice", [with_(K, name='"gemmA"'), with_(K, name=r'"gemm\u0041"'),
                            with_(K, name=r'"gemm\u0041"')], READ),
    ("name-u0000-and-del", [with_(K, name='"a\\u0000b\x7f"')], READ),
    ("name-bmp-escape", [with_(K, name=r'"gemm_\u00e9_\u5185\uFFFF"')], READ),
    ("name-utf8", [with_(K, name='"gemm_é_内核"')], "a non-ASCII byte"),
    ("unknown-utf8", [with_(K, label='"Ωmega"')], "a non-ASCII byte"),
    ("name-control-tab", [with_(K, name='"a\tb"')], "a control character in a string"),
    ("name-control-nul", [with_(K, name='"a\x00b"')], "a control character in a string"),
    ("name-surrogate-pair", [with_(K, name=r'"x\ud83d\ude00"')], "a surrogate escape"),
    ("name-lone-surrogate", [with_(K, name=r'"x\ud800"')], "a surrogate escape"),
    ("name-bad-escape", [with_(K, name=r'"a\x41"')], ERROR),
    ("name-bad-u-escape", [with_(K, name=r'"a\u00g1"')], ERROR),
    ("cat-escaped", [with_(K, cat=r'"k\u0065rnel"'), with_(K, cat='"KERNEL"')], READ),
    ("ph-escaped", [with_(K, ph=r'"\u0058"')], READ),
    # keys
    ("key-escaped", [text(K).replace('"ph"', r'"p\u0068"')], "an escape in a key"),
    ("unknown-key-escaped", [with_(K, **{r"x\u0041": "1"})], "an escape in a key"),
    ("nested-key-escaped", [with_(K, extra=r'{"\u0041": [1, {"b\n": 2}]}')], READ),
    ("key-repeated", [text(K)[:-1] + ', "name": "other"}'], "a repeated key"),
    ("args-repeated", [text(K)[:-1] + ', "args": {}}'], "a repeated key"),
    ("arg-key-repeated", [with_(K, args_correlation="11, \"correlation\": 12")], "a repeated key"),
    ("unknown-key-repeated", [with_(K, x="1, \"x\": [2]")], READ),
    ("key-long-and-near", [with_(K, **{"Python parent idx": "1", "PH": '"B"', "args_PH": "[]",
                                       "n" * 40: "{}", "args_External id ": '"x"'})], READ),
    ("keys-near-known", [with_(K, **{"tss": '"x"', "t": '"x"', "durr": "true", "args_External iX": '"x"',
                                     "args_External i": "null", "args_Python parent ic": '"x"',
                                     "args_Python parent i": '"x"', "args_correlatioN": "[]",
                                     "args_Input Dimz": "1", "args_gri": "{}", "args_devices": "null"})],
     READ),
    ("short-keys-at-the-end", ['{"ph":"X","cat":"kernel","name":"k","pid":0,"tid":7,"ts":5,"dur":2}',
                               '{"ph":"X","cat":"cpu_op","ts":5,"dur":2,"id":3}'], READ),
    ("known-keys-elsewhere", [with_(K, device="1", stream='"0x9"', args_ph='"B"', args_name="7")], READ),
    # pid / tid / id as strings: without a digit read (<NA>), with one declined
    ("pid-spans", [with_(K, pid='"Spans"', tid='""'), with_(CPU_OP, pid='"Trace"', tid='"main"')], READ),
    ("pid-digits", [with_(K, pid='"12"')], "an int field holds a string with a digit"),
    ("tid-hex", [with_(K, tid='"0x1f"')], "an int field holds a string with a digit"),
    ("tid-label", [with_(CPU_OP, tid='"stream 7"')], "an int field holds a string with a digit"),
    ("pid-spaced", [with_(CPU_OP, pid='" 12 "')], "an int field holds a string with a digit"),
    ("pid-escaped", [with_(CPU_OP, pid=r'"\u0031"')], "an int field holds a string with a digit"),
    ("pid-escaped-letters", [with_(CPU_OP, pid=r'"\u0041"')], "an int field holds a string with a digit"),
    ("stream-hex", [with_(RUNTIME, args_stream='"0x0"'), with_(K, args_stream='"0x0"')],
     "an int field holds a string with a digit"),
    ("stream-label", [with_(K, args_stream='"default"')], READ),
    ("stream-and-tid-missing", [with_(K, args_stream=None, args_device=None, tid='"x"')], READ),
    # null in every field
    *[(f"null-{f}", [with_(K, **{f: "null"}), with_(CPU_OP, **{f: "null"})], READ)
      for f in ("ph", "cat", "name", "pid", "tid", "id", "args_grid", "args_block", "args_Input_Dims",
                "args_Input_type", "args_Concrete_Inputs", "args_Input_Strides", "args_Python_id",
                "args_Python_parent_id")],
    ("null-Input-dims-legacy", [with_(CPU_OP, args_Input_Dims=None, args_Input_dims="null")], READ),
    *[(f"null-{f}", [with_(K, **{f: "null"})], "a float field of another type") for f in ("ts", "dur")],
    *[(f"null-{f}", [with_(K, **{f: "null"})], "an int field of another type")
      for f in ("args_External_id", "args_external_id", "args_correlation", "args_device", "args_stream")],
    ("null-args", [with_(K, args="null")], "args is not an object"),
    # other types
    ("name-number", [with_(K, name="5")], "a string field of another type"),
    ("cat-true", [with_(K, cat="true")], "a string field of another type"),
    ("ph-array", [with_(K, ph='["X"]')], "a string field of another type"),
    ("pid-true", [with_(K, pid="true")], "an int field of another type"),
    ("pid-object", [with_(K, pid="{}")], "an int field of another type"),
    ("ts-string", [with_(K, ts='"100"')], "a float field of another type"),
    ("dur-false", [with_(K, dur="false")], "a float field of another type"),
    ("correlation-string", [with_(K, args_correlation='"11"')], "an int field of another type"),
    ("python-id-string", [with_(FRAME, args_Python_id='"3"')], "an int field of another type"),
    # floats and exponents in int fields
    *[(f"pid-{v}", [with_(K, pid=v)], "an int field out of int64") for v in ("1.0", "1e3", "-2.5", "0E0")],
    *[(f"{f}-float", [with_(K, **{f: "11.0"})], "an int field out of int64")
      for f in ("args_External_id", "args_correlation", "args_device", "args_stream", "id")],
    ("python-ids-float", [with_(FRAME, args_Python_parent_id="2e0")], "an int field out of int64"),
    # ints at and beyond int64 (MISSING, -2**63, is not a value)
    *[(f"pid-{v}", [with_(K, pid=v), with_(CPU_OP, tid=v)], READ)
      for v in (str(2**63 - 1), str(-(2**63) + 1), "-0", "0", "-5")],
    *[(f"{f}-int64-edges", [with_(K, **{f: str(2**63 - 1)}), with_(K, **{f: str(-(2**63) + 1)})], READ)
      for f in ("id", "args_External_id", "args_correlation", "args_device", "args_stream")],
    *[(f"pid-{v}", [with_(K, pid=v)], "an int field out of int64") for v in (str(2**63), str(-(2**63)))],
    ("correlation-2**63", [with_(K, args_correlation=str(2**63))], "an int field out of int64"),
    ("external-id--2**63", [with_(CPU_OP, args_External_id=str(-(2**63)))], "an int field out of int64"),
    ("python-id-2**63", [with_(FRAME, args_Python_id=str(2**63))], "an int field out of int64"),
    *[(f"{f}-2**64+5", [with_(K, **{f: str(2**64 + 5)})], "an integer out of uint64")
      for f in ("pid", "tid", "id", "args_device")],
    ("ts-2**64+5", [with_(K, ts=str(2**64 + 5))], "an integer out of uint64"),
    ("dur--2**64", [with_(K, dur=str(-(2**64)))], "an integer out of uint64"),
    # ts / dur: ints, big ints (beyond int64 and 2**53: one rounding), exponents, many digits
    ("ts-int", [with_(K, ts="100", dur="3"), with_(CPU_OP, ts="99", dur="5")], READ),
    ("ts-int64-edges", [with_(K, ts=str(2**63 - 1)), with_(K, ts=str(2**63)), with_(K, ts=str(-(2**63))),
                        with_(K, ts=str(2**63 + 1025)), with_(K, ts=str(2**64 - 2**11))], READ),
    ("ts-2**64-1", [with_(K, ts=str(2**64 - 1))], "an integer out of uint64"),  # (a cautious bound)
    ("ts-2**53+1", [with_(K, ts=str(2**53 + 1), dur=str(2**53 + 3))], READ),
    ("ts-exponents", [with_(K, ts="1e-7", dur="1.5E+3"), with_(K, ts="5e-324", dur="1e308"),
                      with_(K, ts="1E2", dur="2.5e-1"), with_(K, ts="-1e-400", dur="1e-400")], READ),
    ("ts-1e400", [with_(K, ts="1e400")], "a number out of range"),
    ("dur--1e400", [with_(K, dur="-1e400")], "a number out of range"),
    ("ts-many-digits", [with_(K, ts="0.1000000000000000055511151231257827",
                              dur="123456789012345678901234567890.5"),
                        with_(K, ts="5107736369859.574", dur="2.2250738585072011e-308"),
                        with_(K, ts="9007199254740993.0", dur="0.30000000000000001665"),
                        with_(K, ts="1" + "0" * 25 + ".5e-20", dur="4.9406564584124654e-324")], READ),
    ("ts-long-number", [with_(K, ts="1." + LONG)], "a long number"),
    ("ts-negative", [with_(K, ts="-100.5"), with_(CPU_OP, ts="-99")], READ),
    ("dur-negative", [with_(K, dur="-1"), with_(CPU_OP, dur="-0.5")], READ),
    ("ts-minus-zero-float", [with_(K, ts="-0.0", dur="-0.0"), with_(K, ts="-0e5", dur="-0E-3")], READ),
    ("ts-minus-zero-int", [with_(K, ts="-0"), with_(CPU_OP, dur="-0")], READ),
    ("ts-huge-and-far", [with_(K, dur="86400000001"), with_(K, ts="9e15"),
                         with_(K, ts="9.000000000000001e15")], READ),
    ("ts-leading-zero", [with_(K, ts="0100")], ERROR),
    ("ts-bare-dot", [with_(K, ts="1.")], ERROR),
    ("ts-plus", [with_(K, ts="+1")], ERROR),
    ("ts-nan", [with_(K, ts="NaN")], ERROR),
    ("ts-infinity", [with_(K, dur="-Infinity")], ERROR),
    ("ts-exponent-empty", [with_(K, ts="1e+")], ERROR),
    # args of every shape
    ("args-missing", [with_(K, args=None), with_(CPU_OP, args=None)], READ),
    ("args-empty", [with_(K, args={}), with_(CPU_OP, args={})], READ),
    *[(f"args-{v}", [with_(K, args=v)], "args is not an object") for v in ("[]", "5", '"x"', "[{}]")],
    # raw fields: any JSON value, its text kept
    ("raw-nested", [with_(K, args_grid='[[1, [2]], {"a": [3, {"b": null}]}]', args_block='{"x":1}'),
                    with_(CPU_OP, args_Input_Dims="[[1,2],[]]", args_Input_type='"float"',
                          args_Concrete_Inputs='["", "[1, 2]", 1.5e3, true]',
                          args_Input_Strides="[[1 , 2] ,\t[]]")], READ),
    ("raw-scalars", [with_(K, args_grid="-0.0", args_block="false"),
                     with_(CPU_OP, args_Input_Dims="7", args_Input_type="true", args_Concrete_Inputs='""')],
     READ),
    ("raw-escapes", [with_(CPU_OP, args_Concrete_Inputs=r'["a\"b", "\u0041", "\/"]')], READ),
    ("raw-some-absent", [with_(K, args_grid=None), with_(K, args_block=None), with_(K, args={}),
                         with_(CPU_OP, args_Input_type=None, args_Concrete_Inputs=None),
                         with_(CPU_OP, args_Input_Dims=None, args_Input_Strides=None)], READ),
    ("raw-utf8", [with_(CPU_OP, args_Input_type='["é"]')], "a non-ASCII byte"),
    ("raw-spellings", [with_(K, args_grid="[1,2,3]"), with_(K, args_grid="[1, 2, 3]"),
                       with_(K, args_grid="[ 1, 2, 3 ]")], READ),
    ("raw-legacy", [with_(CPU_OP, args_Input_Dims=None, args_Input_dims="[[5, 6]]"),
                    with_(CPU_OP, args_Input_dims="[[7]]")], READ),
    ("external-id-legacy", [with_(K, args_External_id=None, args_external_id="9"),
                            with_(CPU_OP, args_external_id="8"), with_(RUNTIME, args_External_id=None)],
     READ),
    ("raw-shallow", [with_(K, args_grid=SHALLOW), with_(K, extra=SHALLOW)], READ),
    ("raw-deep", [with_(K, args_grid=DEEP)], "nested too deeply"),
    ("unknown-deep", [with_(K, extra=DEEP)], "nested too deeply"),
    ("args-unknown-deep", [with_(K, args_extra=DEEP)], "nested too deeply"),
    ("unknown-values", [with_(K, a="[]", b="{}", c='{"x": [1, {"y": "z"}], "w": -1.5e-3}', d="true",
                              e="null", f='"\\u1234"', g=str(2**70), h="1e400")], READ),
    ("unknown-number-bad", [with_(K, extra="01")], ERROR),
    ("unknown-literal-bad", [with_(K, extra="nul")], ERROR),
    ("unknown-literal-long", [with_(K, extra="truex")], ERROR),
    # whitespace and separators
    ("ws-tabs", [text(K, colon=":\t", comma="\t,\t"), text(CPU_OP, colon="\t:", comma=",\t")], READ),
    ("ws-crlf", [text(K, colon=":\r\n ", comma="\r\n,\r\n")], READ),
    ("ws-none", [text(K, colon=":", comma=","), text(CPU_OP, colon=":", comma=",")], READ),
    ("ws-inside-values", [with_(K, args_grid="[ 1 ,\n2\t, 3\r\n]", ts=" 100.5 ")], READ),
    ("event-empty", ["{}", "{ }", "{\n}"], READ),
    *[(f"event-{v}", [v, text(K)], "an event is not an object")  # (the last one an object: proven)
      for v in ("7", "null", '"x"', "[1]", "[]", "true", "-0.5")],
    ("event-last-not-object", [text(K), "7"], None),  # (no '}' before ']': the Raw way, no scanner)
    ("trailing-comma-event", [text(K)[:-1] + ", }"], ERROR),
    ("trailing-comma-args", [with_(K, args_grid="[1, 2,]")], ERROR),
    ("trailing-comma-array", [text(K) + ","], ERROR),
    ("missing-colon", [text(K).replace('"ph": ', '"ph" ')], ERROR),
    ("missing-comma", [text(K).replace(', "cat"', ' "cat"')], ERROR),
    ("key-not-string", [text(K).replace('"ph"', "ph")], ERROR),
    ("raw-control-char", [with_(CPU_OP, args_Concrete_Inputs='["a\x01"]')], ERROR),
    # the other tables
    ("python-frames", [FRAME, with_(FRAME, args_Python_parent_id="null"),
                       with_(FRAME, args_Python_id=None, args_Python_parent_id=None),
                       with_(FRAME, args_Python_id=str(2**63 - 1))], READ),
    ("flows", [FLOW, with_(FLOW, ph='"f"', id="12", args={"bp": '"e"'}), with_(FLOW, cat='"async_gpu"'),
               with_(FLOW, id='"abc"'), with_(FLOW, id="null"), with_(FLOW, id=None, ts=None),
               with_(FLOW, ph='"t"')], READ),
    ("flow-id-string-digits", [with_(FLOW, id='"11"')], "an int field holds a string with a digit"),
    ("other-tables", [RUNTIME, ANNOT, with_(ANNOT, cat='"gpu_user_annotation"'),
                      with_(K, cat='"gpu_memcpy"'), with_(K, cat='"Memset"'),
                      with_(RUNTIME, cat='"hip_runtime"'), with_(CPU_OP, name='"ProfilerStep#3"')], READ),
    ("skipped-events", [with_(K, ph='"B"'), with_(K, dur=None), with_(K, ts=None), with_(K, dur="-1.0"),
                        with_(K, cat='"unknown"'), with_(K, ph='"i"', cat='"cpu_instant_event"')], READ),
]


@pytest.mark.parametrize(("events", "expect"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_edge_cases_read_the_same_both_ways(tmp_path, events, expect):
    path, content = write_events(tmp_path / "t.json", events)
    check_file(path, expect)
    got = check_batch(content)
    if expect == READ:
        assert isinstance(got, list), got
    elif expect not in (None, ERROR):
        assert got == expect


def test_case_ids_are_unique():
    ids = [c[0] for c in CASES]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("cut", [0.3, 0.6, 0.95, 0.9999])
def test_truncated_files(tmp_path, cut):
    data, _ = document([text(e) for e in [*BASE, RUNTIME, FRAME, FLOW] * 5])
    path = tmp_path / "t.json"
    path.write_bytes(data[: int(len(data) * cut)])
    check_file(path, ERROR)


@pytest.mark.parametrize("layout", ["array", "bom", "compact", "crlf", "gzip"])
def test_document_layouts(tmp_path, layout):
    """A top-level array of events, a byte-order mark, no whitespace at all, CRLF lines, gzip."""
    events = [text(e) for e in [*BASE, RUNTIME, ANNOT, FRAME, FLOW]]
    head, sep, tail = {"array": ("[", ",", "]"), "bom": ('\ufeff{"traceEvents":[', ", ", "]}"),
                       "compact": ('{"traceEvents":[', ",", '],"x":{"y":[1]}}'),
                       "crlf": ('{\r\n"traceEvents" :\r\n[\r\n', "\r\n,\r\n", "\r\n]\r\n}\r\n"),
                       "gzip": ('{"traceEvents": [', ",\n", "]}")}[layout]
    if layout == "compact":
        events = [text(e, colon=":", comma=",") for e in [*BASE, RUNTIME, ANNOT, FRAME, FLOW]]
    data, _ = document(events, head=head, sep=sep, tail=tail)
    path = tmp_path / ("t.json.gz" if layout == "gzip" else "t.json")
    if layout == "gzip":
        data = gzip.compress(data)
    path.write_bytes(data)
    tr, _ = check_file(path, READ)
    assert len(tr.device) == 1 and len(tr.cpu_ops) == 1 and len(tr.flows) == 1


def test_meta_and_counters_of_a_mixed_file(tmp_path):
    """Skip counters, dropped fields and event counts come out the same when some batches are
    read by the scanner and others (declined) by msgspec, with small batches."""
    events = [text(e) for e in [*BASE, RUNTIME, ANNOT, FRAME, FLOW]]
    odd = [text(with_(K, pid="true")), text(with_(K, args="[1]")), "7", text(with_(K, ts="null")),
           text(with_(K, name='"gemm_é"')), text(with_(K, ph='"B"'))]
    mixed = [e for i in range(60) for e in (events if i % 10 else [*events, odd[i // 10 % len(odd)]])]
    path = tmp_path / "t.json"
    path.write_bytes(document(mixed)[0])
    with pytest.MonkeyPatch.context() as m:
        m.setattr(decode, "SCAN_BATCH_BYTES", 3000)
        m.setattr(decode, "BATCH_BYTES", 3000)
        tr, calls = check_file(path)
    outcomes = {c[1] for c in calls}
    assert outcomes == {"read", "declined"}, calls
    assert tr.meta["skipped_events"] and tr.meta["events_with_dropped_fields"]


@pytest.mark.parametrize("batch", [1, 50, 700, 5000])
def test_batches_of_any_size_and_cuts_inside_events(tmp_path, batch):
    """Small scanner batches: a '}, {' inside an event (in a string, or an array of objects in
    its args) ends a batch mid-event, which the scanner declines ('... runs past the batch')
    and a later cut ends instead; the tables are those of the default batches without it."""
    doc = gpu_trace(steps=3)
    for e in doc["traceEvents"]:
        if e.get("ph") == "X":
            e.setdefault("args", {})["odd"] = [{"a": 1}, {"b": {"c": [2]}}, {"d": "}, {"}]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc, indent=1))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(columns, "SCANNER", None)
        ref = load_trace(path, workers=1)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(decode, "SCAN_BATCH_BYTES", batch)
        m.setattr(decode, "BATCH_BYTES", batch)
        m.setattr(decode, "_RETRIES", 1000)
        m.setattr(trace_read, "CHUNK_BYTES", 700)
        tr, calls = check_file(path)
    assert_same(tr, ref)
    reasons = {c[2] for c in calls if c[1] == "declined"}
    assert reasons <= {"a string runs past the batch", "a value runs past the batch",
                       "an object runs past the batch"}, reasons
    assert sum(int(c[2]) for c in calls if c[1] == "read") == ref.meta["event_count"]
    if batch < 5000:
        assert reasons, calls


# ----------------------------------------------------------------------------- random events
WS = st.sampled_from(["", "", " ", " ", "\t", "\n", "\r\n", "\n  ", " \t"])
ESCAPES = [r"\"", r"\\", r"\/", r"\b", r"\f", r"\n", r"\r", r"\t", r"\u0041", r"\u00e9", r"\u00E9",
           r"\u4e2d", r"\u0000", r"\u001f", r"\u007F", r"\uffff", r"\u0030"]
PLAIN_CHARS = "".join(chr(c) for c in range(0x20, 0x80) if chr(c) not in '"\\')
NO_DIGITS = "".join(c for c in PLAIN_CHARS if not c.isdigit())
CATS = ["kernel", "Kernel", "gpu_memcpy", "Memcpy", "gpu_memset", "cpu_op", "Operator", "cuda_runtime",
        "cuda_driver", "hip_runtime", "user_annotation", "gpu_user_annotation", "python_function",
        "ac2g", "async", "Trace", "cpu_instant_event", ""]


def _quoted(parts: list[str]) -> str:
    return '"' + "".join(parts) + '"'


ascii_string = st.lists(st.text(PLAIN_CHARS, max_size=5) | st.sampled_from(ESCAPES), max_size=3).map(_quoted)
digitless = st.text(NO_DIGITS, max_size=6).map(lambda s: f'"{s}"')
int64 = st.integers(-(2**63) + 1, 2**63 - 1).map(str) | st.sampled_from(["0", "-0", "1", "-1"])
_DIGITS = "0123456789"
_WHOLE = st.just("0") | st.tuples(st.sampled_from("123456789"), st.text(_DIGITS, max_size=24)).map("".join)
_FRAC = st.just("") | st.text(_DIGITS, min_size=1, max_size=25).map(lambda d: "." + d)
_EXP = st.just("") | st.tuples(st.sampled_from(["e", "E", "e+", "E+", "e-", "E-"]),
                               st.text(_DIGITS, min_size=1, max_size=2)).map("".join)


def _spelled(parts: tuple[str, str, str, str]) -> str:
    sign, whole, frac, exp = parts
    if not (frac or exp) and len(whole) > 18:  # an integral float: within uint64, read
        whole = whole[:18]
    return sign + whole + frac + exp


# A JSON number in any spelling: sign, digits (many: beyond int64 and 2**53), fraction, exponent
# (up to 1e±99; big_number: beyond the float range too).
number = st.tuples(st.sampled_from(["", "-"]), _WHOLE, _FRAC, _EXP).map(_spelled)
big_number = st.tuples(st.sampled_from(["", "-"]), _WHOLE, _FRAC,
                       _EXP | st.sampled_from(["e400", "E-400", "e99999", "e-99999"])).map(_spelled)


def json_value(leaf):
    """Any JSON value text with random whitespace, its leaves from `leaf`."""
    def container(inner):
        items = st.lists(st.tuples(WS, inner, WS), max_size=3)
        arrays = items.map(lambda xs: "[" + ",".join(a + v + b for a, v, b in xs) + "]")
        members = st.lists(st.tuples(ascii_string, WS, inner), max_size=3)
        objects = members.map(lambda xs: "{" + ",".join(f"{k}:{w}{v}" for k, w, v in xs) + "}")
        return arrays | objects

    return st.recursive(leaf, container, max_leaves=6)


plain_leaf = number | ascii_string | st.sampled_from(["true", "false", "null"])
plain_value = json_value(plain_leaf)
# What each known field accepts in the scanner's common case (read, never declined).
PLAIN = {
    "ph": st.sampled_from(['"X"', '"X"', '"s"', '"f"', '"B"', '"i"', "null"]) | ascii_string,
    "cat": st.sampled_from([json.dumps(c) for c in CATS] + ["null"]) | ascii_string,
    "name": ascii_string | st.just("null"),
    "pid": int64 | digitless | st.just("null"),
    "tid": int64 | digitless | st.just("null"),
    "id": int64 | digitless | st.just("null"),
    "ts": number,
    "dur": number,
    "External id": int64,
    "external id": int64,
    "correlation": int64,
    "device": int64,
    "stream": int64 | digitless,
    "grid": plain_value,
    "block": plain_value,
    "Input Dims": plain_value,
    "Input dims": plain_value,
    "Input type": plain_value,
    "Concrete Inputs": plain_value,
    "Input Strides": plain_value,
    "Python id": int64 | st.just("null"),
    "Python parent id": int64 | st.just("null"),
}
EVENT_KEYS = ["ph", "cat", "name", "pid", "tid", "ts", "dur", "id"]
ARGS_KEYS = [k for k in PLAIN if k not in EVENT_KEYS]
UNKNOWN_KEYS = ["Sequence number", "Fwd thread id", "Record function id", "Ev Idx", "kind", "PH", "Args",
                "Python parent idx", "Python parent ic", "External iX", "Input Dim", "bp", "s", "args2", "",
                "x" * 17]
_UNIQUE = {tuple(keys): st.lists(st.sampled_from(keys), unique=True, max_size=len(keys))
           for keys in (EVENT_KEYS, ARGS_KEYS)}
_UNKNOWN = st.lists(st.sampled_from(UNKNOWN_KEYS).map(json.dumps), max_size=2)
_SHUFFLE = st.randoms(use_true_random=False)


def _object(draw, members: list[tuple[str, str]]) -> str:
    """An object of (key text, value text) members in a random order, with random whitespace."""
    draw(_SHUFFLE).shuffle(members)
    return "{" + draw(WS) + ",".join(f"{k}{draw(WS)}:{draw(WS)}{v}{draw(WS)}" for k, v in members) + "}"


@st.composite
def plain_event(draw) -> str:
    """An event in the scanner's common case: known keys at most once each, with values it
    reads, unknown keys with any ASCII JSON value; random order and whitespace."""
    def members(keys: list[str]) -> list[tuple[str, str]]:
        out = [(json.dumps(k), draw(PLAIN[k])) for k in draw(_UNIQUE[tuple(keys)])]
        return out + [(k, draw(plain_value)) for k in draw(_UNKNOWN)]

    fields = members(EVENT_KEYS)
    if draw(st.booleans()):
        fields.append(('"args"', _object(draw, members(ARGS_KEYS))))
    return _object(draw, fields)


# Beyond the common case: other types, digits in strings, out-of-range numbers, non-ASCII and
# surrogates, escaped and repeated keys, deep nesting, events that are not objects.
wild_leaf = (plain_leaf | big_number | st.text(max_size=4).map(json.dumps)
             | st.text(max_size=4).map(lambda s: json.dumps(s, ensure_ascii=False))
             | st.sampled_from([str(2**63), str(-(2**63)), str(2**64 + 5), str(-(2**64)), '"12"', '"0x1f"',
                                '" 7"', '"\\ud83d\\ude00"', '"\\udc00"', '"a\tb"', "1.0", "1e3", DEEP,
                                SHALLOW]))
wild_value = json_value(wild_leaf)
_ANY = st.one_of(wild_value, *PLAIN.values())
WILD = {k: v | _ANY for k, v in PLAIN.items()}  # a known key's value: its plain ones or any
WILD_KEY = (st.sampled_from(EVENT_KEYS + ARGS_KEYS + ["args"]).map(json.dumps)
            | st.sampled_from(['"p\\u0068"', '"n\\u0061me"', '"Python \\u0069d"', '"é"']))
_KEYS = {tuple(keys): st.lists(st.sampled_from(keys), max_size=len(keys) + 1)
         for keys in (EVENT_KEYS, ARGS_KEYS)}
_ODD_KEYS = st.lists(st.tuples(WILD_KEY, wild_value), max_size=2)


@st.composite
def wild_event(draw) -> str:
    """Any event: known keys (sometimes twice) with values of any type, odd keys, args of
    any type; one in ten events is not an object."""
    if draw(st.integers(0, 9)) == 0:
        return draw(wild_value)

    def members(keys: list[str]) -> list[tuple[str, str]]:
        return [(json.dumps(k), draw(WILD[k])) for k in draw(_KEYS[tuple(keys)])] + draw(_ODD_KEYS)

    fields = members(EVENT_KEYS)
    if draw(st.booleans()):
        args = _object(draw, members(ARGS_KEYS)) if draw(st.integers(0, 5)) else draw(wild_value)
        fields.append(('"args"', args))
    return _object(draw, fields)


def _check_events(events: list[str], seps: list[str], must_read: bool) -> None:
    """BASE then `events` (joined by `seps`) in a file, loaded both ways, and as one batch."""
    with tempfile.TemporaryDirectory() as d:
        base = [text(e) for e in BASE]
        content = base[0] + ",\n" + base[1]
        for sep, ev in zip(seps, events, strict=True):
            content += sep + ev
        path = Path(d) / "t.json"
        path.write_bytes(b'{"traceEvents": [' + content.encode() + b"]}")
        check_file(path, READ if must_read else None)
    got = check_batch(content.encode())
    if must_read:
        assert isinstance(got, list), got


separators = st.lists(st.tuples(WS, WS).map(lambda w: w[0] + "," + w[1]), min_size=6, max_size=6)


@SETTINGS
@given(st.lists(plain_event(), min_size=1, max_size=5), separators)
def test_random_plain_events_are_read_by_the_scanner_as_msgspec_reads_them(events, seps):
    """Events in the common case: the scanner reads every batch, giving msgspec's values."""
    _check_events(events, seps[: len(events)], must_read=True)


@SETTINGS
@given(st.lists(wild_event(), min_size=1, max_size=5), separators)
def test_random_events_of_any_type_read_the_same_both_ways(events, seps):
    """Events of any shape: read or declined, the same tables, meta or error as msgspec's."""
    _check_events(events, seps[: len(events)], must_read=False)


# ----------------------------------------------------------------------------- two processes
needs_fork = pytest.mark.skipif(not hasattr(os, "fork") or parallel.usable_cores() < 2,
                                reason="the parallel parse needs fork and two cores")


@needs_fork
def test_two_process_parse_uses_the_scanner_in_both_processes(tmp_path, monkeypatch):
    """workers=2 (forced on a small file, with small batches and segments, the worker made to
    claim before the parent's first batch): the parent and the worker each scan their part,
    declined batches mixed in; the result is the one-process msgspec result."""
    events = [text(e) for e in [*BASE, RUNTIME, ANNOT, FRAME, FLOW]]
    odd = [text(with_(K, pid='"12"')), text(with_(K, name='"gemm_é"')), "null", text(with_(K, args="5"))]
    mixed = []
    for i in range(3000):
        mixed += [e.replace('"gemm"', f'"gemm_{i % 97}"') for e in events]
        if i % 50 == 7:
            mixed.append(odd[(i // 50) % len(odd)])
    path = tmp_path / "t.json"
    path.write_bytes(document(mixed)[0])
    assert path.stat().st_size > 1 << 20  # (below PARALLEL_MIN_BYTES: workers=2 forces the fork)
    forks, real_fork, real_init, real_claim = [], os.fork, parallel.Claims.__init__, parallel.Claims.parent

    def fork():
        forks.append(1)
        return real_fork()

    def init(self, start, end):
        real_init(self, start, end)
        self.end = end

    def claim(self, stop, after):  # the worker claims first (up to 10 s), so that both scan
        deadline = time.monotonic() + 10
        while self.worker_stop() == self.end and time.monotonic() < deadline:
            time.sleep(0.005)
        return real_claim(self, stop, after)

    monkeypatch.setattr(os, "fork", fork)
    monkeypatch.setattr(parallel.Claims, "__init__", init)
    monkeypatch.setattr(parallel.Claims, "parent", claim)
    monkeypatch.setattr(decode, "SCAN_BATCH_BYTES", 20_000)
    monkeypatch.setattr(decode, "BATCH_BYTES", 20_000)
    monkeypatch.setattr(parallel, "SEGMENT_BYTES", 200_000)
    monkeypatch.setattr(parallel, "MIN_SEGMENT_BYTES", 20_000)
    # a fork is refused while other threads run: wait for an earlier test's to end
    for t in [t for t in threading.enumerate() if t is not threading.main_thread()]:
        t.join(timeout=10)
    assert threading.active_count() == 1, [t.name for t in threading.enumerate()]
    scanned, plain, calls = both_ways(path, workers=2, log=tmp_path / "scan.log")
    assert len(forks) == 2  # (one each way)
    with monkeypatch.context() as m:
        m.setattr(columns, "SCANNER", None)
        serial = load_trace(path, workers=1)
    assert_same(scanned, plain)
    assert_same(scanned, serial)
    assert scanned.meta["skipped_events"] and scanned.meta["events_with_dropped_fields"]
    parent = os.getpid()
    for mine in (True, False):  # the parent's batches, the worker's
        got = {c[1] for c in calls if (c[0] == parent) == mine}
        assert got == {"read", "declined"}, (mine, calls)


def test_known_keys_are_found_by_their_hash():
    """Both key lookups (event keys, args keys) hash every key to a slot of its own: a key added
    later that collides would silently fall back to the slower linear search."""
    assert _scan.HASHED_LOOKUPS == 1


def test_the_scanners_field_table_is_generated_from_fields_py():
    """`_fields.h` is `fields.c_header()` (after editing fields.py: `python -m
    trace_roofline.trace.fields`), and the build in use reads the columns fields.py declares."""
    assert fields.HEADER.read_text() == fields.c_header()
    assert (_scan.I32_COLUMNS, _scan.F64_COLUMNS, _scan.I64_COLUMNS) == (
        fields.I32_COLUMNS, fields.F64_COLUMNS, fields.I64_COLUMNS)
    assert columns.SCANNER is _scan.Scanner


def test_a_scan_releases_the_gil():
    """Another thread runs while a batch is scanned (the parse worker's receiver drains its
    pipe meanwhile): it ticks in the middle half of one long scan call."""
    import threading

    event = ('{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 1.5, '
             '"dur": 2.0, "args": {"External id": 1, "Input Dims": [[4, 4], [4, 4]]}}')
    text = bytearray(", ".join([event] * 300_000).encode())
    ticks, done = [], threading.Event()

    def count():
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.0005)

    scanner = _scan.Scanner()
    thread = threading.Thread(target=count)
    thread.start()
    time.sleep(0.01)
    t0 = time.perf_counter()
    got = scanner.scan(text, 0, len(text))
    t1 = time.perf_counter()
    done.set()
    thread.join()
    middle = [t for t in ticks if t0 + 0.25 * (t1 - t0) < t < t0 + 0.75 * (t1 - t0)]
    assert got[0] == 300_000 and middle, (t1 - t0, len(ticks))
