"""Hostile and unlucky inputs to the ingest path (docs/security.md says what is
guaranteed): crafted hash collisions do not make the parse quadratic, a '{' inside a string
reserves no column memory, a full $TMPDIR falls back to one process instead of a SIGBUS, a trace
replaced or rewritten while it is read never mixes two files' events, and the compiled scanner
has no undefined behaviour on the committed edge cases and refuses a big-endian build.

Imports only trace_roofline.trace and trace_roofline.errors; the inputs are built here.
"""

from __future__ import annotations

import errno
import gzip
import importlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tests.builders import parent_waits_for_a_claim
from trace_roofline.errors import InputError
from trace_roofline.trace import SCHEMAS, Trace, columns, decode, load_trace, parallel
from trace_roofline.trace import read as trace_read

trace_load = importlib.import_module("trace_roofline.trace.load")
SCAN_C = Path(columns.__file__).with_name("_scan.c")
needs_scanner = pytest.mark.skipif(columns.SCANNER is None, reason="the optional C scanner is not built")
needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="the two-process parse needs fork")


# ----------------------------------------------------------------------------- traces
KERNEL = ('{"ph":"X","cat":"kernel","name":"%s","pid":0,"tid":7,"ts":%d,"dur":1,'
          '"args":{"device":0,"stream":7,"correlation":%d}}')


def write_kernels(path: Path, names: list[bytes]) -> Path:
    """A valid trace of one kernel event per name (make_collisions.py's layout)."""
    events = ",\n".join(KERNEL % (s.decode(), 10 * i, i) for i, s in enumerate(names))
    path.write_text('{"schemaVersion":1,"traceEvents":[\n' + events + "\n]}\n")
    return path


def mixed_trace(tag: str, n: int = 300) -> bytes:
    """A trace of n cpu ops, each launching a kernel, whose names and times carry `tag` (one
    letter): traces of two tags have the same size and layout, byte for byte but the tag."""
    events = []
    for i in range(n):
        ts = 1000 + 40 * i + ord(tag)
        events.append({"ph": "X", "cat": "cpu_op", "name": f"aten::op_{tag}_{i % 17}", "pid": 1,
                       "tid": 1, "ts": ts, "dur": 20,
                       "args": {"External id": i, "Input Dims": [[i % 5, 64]], "Input type": ["float"]}})
        events.append({"ph": "X", "cat": "kernel", "name": f"gemm_{tag}_{i % 13}", "pid": 0, "tid": 7,
                       "ts": ts + 5, "dur": 10,
                       "args": {"device": 0, "stream": 7, "correlation": i, "External id": i,
                                "grid": [i % 3 + 1, 1, 1], "block": [128, 1, 1]}})
    return json.dumps({"schemaVersion": 1, "traceEvents": events}, indent=1).encode()


def assert_same_tables(a: Trace, b: Trace) -> None:
    """The same metadata and tables, exactly (categories in order, floats to the bit)."""
    assert a.meta == b.meta
    for table in SCHEMAS:
        x, y = getattr(a, table), getattr(b, table)
        pd.testing.assert_frame_equal(x, y, check_exact=True, obj=table)
        for col in x.select_dtypes("float").columns:
            assert x[col].to_numpy().tobytes() == y[col].to_numpy().tobytes(), (table, col)


@pytest.fixture
def small_batches(monkeypatch):
    """Batches, windows and the worker's segments small enough that a 100 KB trace is read in
    many steps (and the two processes meet in its middle)."""
    monkeypatch.setattr(decode, "BATCH_BYTES", 2000)
    monkeypatch.setattr(decode, "SCAN_BATCH_BYTES", 2000)
    monkeypatch.setattr(trace_read, "CHUNK_BYTES", 1500)
    monkeypatch.setattr(parallel, "SEGMENT_BYTES", 20_000)
    monkeypatch.setattr(parallel, "MIN_SEGMENT_BYTES", 2000)


# ----------------------------------------------------------------------------- 1. hash collisions
# The scanner's first string-table hash (_scan.c fast_hash), inverted as make_collisions.py
# (../shared/repro) does: names of one length whose last 8-byte word is solved for, so that the
# hash state after it, and so the hash, is one value for all of them.
M64 = (1 << 64) - 1
MUL = 0xC4CEB9FE1A85EC53


def _step(h: int, w: int) -> int:
    h = ((h ^ w) * MUL) & M64
    return h ^ (h >> 29)


def _mix(x: np.ndarray) -> np.ndarray:
    """_step after the xor, on uint64 arrays (in place)."""
    x *= np.uint64(MUL)
    x ^= x >> np.uint64(29)
    return x


def _unmix(x: np.ndarray) -> np.ndarray:
    """The inverse of _mix."""
    m = x ^ (x >> np.uint64(29)) ^ (x >> np.uint64(58))
    return m * np.uint64(pow(MUL, -1, 1 << 64))


def fast_hash(s: bytes) -> int:
    """_scan.c's fast_hash, in Python (checks the crafted names)."""
    n, tail = len(s), len(s) % 8
    h = 0x9E3779B97F4A7C15 ^ ((n * 0xFF51AFD7ED558CCD) & M64)
    for i in range(0, n - tail, 8):
        h = _step(h, int.from_bytes(s[i : i + 8], "little"))
    h = ((h ^ int.from_bytes(s[n - tail :], "little") ^ (tail << 56)) * MUL) & M64
    return (h ^ (h >> 32)) | 1


def _state(prefix: bytes, size: int) -> int:
    """fast_hash's state after `prefix` (whole words) of a key of `size` bytes."""
    h = 0x9E3779B97F4A7C15 ^ ((size * 0xFF51AFD7ED558CCD) & M64)
    for i in range(0, len(prefix), 8):
        h = _step(h, int.from_bytes(prefix[i : i + 8], "little"))
    return h


def _first_words(at: int, n: int) -> np.ndarray:
    """n distinct-looking words of bytes 0x60-0x7f ('`', a-z, '{', '|', '}', '~', DEL)."""
    w = np.arange(at, at + n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return (w & np.uint64(0x1F1F1F1F1F1F1F1F)) | np.uint64(0x6060606060606060)


def _plain(w: np.ndarray) -> np.ndarray:
    """Whether each word's bytes are plain JSON string content (0x20-0x7f but '"' and '\\')."""
    b = w.view(np.uint8).reshape(-1, 8)
    return ((b >= 0x20) & (b < 0x80) & (b != 0x22) & (b != 0x5C)).all(axis=1)


def _names(prefix: bytes, pairs: list[np.ndarray], n: int) -> list[bytes]:
    words = np.unique(np.concatenate(pairs), axis=0)[:n].astype("<u8")
    assert len(words) == n
    return [prefix + w.tobytes() for w in words]


def colliders(n: int, prefix: bytes) -> list[bytes]:
    """n distinct names `prefix` + 16 bytes with one and the same fast_hash."""
    h, target, pairs, at = _state(prefix, len(prefix) + 16), None, [], 1 << 40
    with np.errstate(over="ignore"):
        while sum(map(len, pairs)) < n:
            w1 = _first_words(at, 1 << 21)
            at += 1 << 21
            w2 = _mix(w1 ^ np.uint64(h))
            if target is None:
                target = w2[0] ^ np.frombuffer(b"collide_", "<u8")[0]
            w2 ^= target  # (the state after w2 is target's, for every w1)
            cheap = (w2 & np.uint64(0x8080808080808080)) == 0
            w1, w2 = w1[cheap], w2[cheap]
            ok = _plain(w2)
            pairs.append(np.stack([w1[ok], w2[ok]], axis=1))
    return _names(prefix, pairs, n)


def clustered(n: int) -> list[bytes]:
    """n distinct 16-byte names whose fast_hash values differ but agree in their low 12 bits:
    the one slot of a table of up to 4096 slots (the pre-final state varies in bits 44-63 only)."""
    h, pairs, at = _state(b"", 16), [], 1 << 30
    with np.errstate(over="ignore"):
        states = _unmix(np.uint64(0x1234_5678_9ABC) ^ (np.arange(1 << 20, dtype=np.uint64) << np.uint64(44)))
        while sum(map(len, pairs)) < n:
            w1 = _first_words(at, 1)
            w2 = states ^ _mix(w1 ^ np.uint64(h))[0]  # (the state after w2: one of `states`)
            w2 = w2[(w2 & np.uint64(0x8080808080808080)) == 0]
            w2 = w2[_plain(w2)]
            pairs.append(np.stack([np.full(len(w2), w1[0]), w2], axis=1))
            at += 1
    return _names(b"", pairs, n)


def random_names(n: int, prefix: bytes) -> list[bytes]:
    """n names `prefix` + 16 random bytes of 0x60-0x7f (as the crafted ones)."""
    rng = np.random.default_rng(2)
    return [prefix + bytes(r) for r in (rng.integers(0, 32, (n, 16)) + 0x60).astype(np.uint8)]


def parse_seconds(path: Path, runs: int = 3) -> float:
    """The fastest of `runs` one-process parses of `path`."""
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        load_trace(path, workers=1)
        best = min(best, time.perf_counter() - t)
    return best


# long kernel names with a common prefix, as C++ templates give: each probe past a colliding
# name compares the whole prefix, so 4000 of them show the quadratic cost in a small file
PREFIX = (b"void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl<" * 30)[:2048]


def test_crafted_hash_collisions_parse_about_as_fast_as_random_names(tmp_path):
    """4000 kernel names crafted to share the scanner's first hash parse at most 3x slower
    than 4000 random names of the same length (before the keyed fallback: 7x, quadratic)."""
    bad = colliders(4000, PREFIX)
    assert len({fast_hash(s) for s in bad[:200]}) == 1
    crafted = write_kernels(tmp_path / "crafted.json", bad)
    plain = write_kernels(tmp_path / "random.json", random_names(4000, PREFIX))
    assert crafted.stat().st_size == plain.stat().st_size
    assert len(load_trace(crafted, workers=1).device) == 4000
    slow, fast = parse_seconds(crafted), parse_seconds(plain)
    assert slow < 3 * fast, (slow, fast)


@needs_scanner
@pytest.mark.parametrize("craft", ["collisions", "cluster"])
def test_colliding_names_switch_the_string_table_to_the_keyed_hash(craft):
    """Names of one hash, or of one slot, make the scanner's string table hash with keyed
    SipHash from then on (random names never do), and every name keeps its own code."""
    names = colliders(300, b"") if craft == "collisions" else clustered(1500)
    if craft == "cluster":
        assert len({fast_hash(s) for s in names}) == len(names)
        assert len({fast_hash(s) & 4095 for s in names}) == 1
    sc, code = columns.SCANNER(), {s: i for i, s in enumerate(names)}
    for part in (names[: len(names) // 2], names[len(names) // 2 :] + names):  # (new, then seen)
        text = bytearray(b"[" + b",".join(b'{"name":"%s"}' % s for s in part) + b"]")
        n, i32, _, _ = sc.scan(text, 1, len(text) - 1)
        codes = np.frombuffer(i32, np.int32).reshape(-1, n)[2] - 1
        assert [code[s] for s in part] == codes.tolist()
    assert sc.strings() == names
    assert sc.keyed() == (True, False)
    sc = columns.SCANNER()
    text = bytearray(b"[" + b",".join(b'{"name":"%s"}' % s for s in random_names(3000, b"")) + b"]")
    assert sc.scan(text, 1, len(text) - 1)[0] == 3000
    assert sc.keyed() == (False, False)


# ----------------------------------------------------------------------------- 2. braces in strings
def braces_trace(n: int) -> bytes:
    """make_braces.py's trace: one kernel and one cpu op whose unknown arg is n '{' bytes."""
    k = ('{"ph":"X","cat":"kernel","name":"gemm","pid":0,"tid":7,"ts":100,"dur":2,'
         '"args":{"device":0,"stream":7,"correlation":1}}')
    c = ('{"ph":"X","cat":"cpu_op","name":"aten::mm","pid":1,"tid":1,"ts":99,"dur":5,'
         '"args":{"note":"' + "{" * n + '"}}')
    return ('{"schemaVersion":1,"traceEvents":[' + k + "," + c + "]}").encode()


def traced_peak(fn) -> int:
    """The peak of memory allocated (tracemalloc: Python, PyMem_Raw and numpy) while fn() runs."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@needs_scanner
def test_braces_inside_a_string_reserve_no_column_rows():
    """A batch of two events, one holding a string of 1M '{', takes the scanner a few KB of
    column memory (it reserved 232 bytes per '{': 243 MB)."""
    text = braces_trace(1 << 20)
    start = text.index(b"[") + 1
    buf = bytearray(text)
    sc = columns.SCANNER()
    got = []
    peak = traced_peak(lambda: got.append(sc.scan(buf, start, len(buf) - 2)))
    assert got[0][0] == 2
    assert peak < 1 << 20, peak


def test_a_gzip_trace_of_one_long_string_of_braces_loads_in_little_memory(tmp_path):
    """make_braces.py's .json.gz, 16 MB of '{' (16 KB compressed), loads in a few times its
    inflated size (it needed 232 bytes per '{', 3.7 GB; at 200 MB: "not enough memory")."""
    n = 16 << 20
    path = tmp_path / "braces.json.gz"
    path.write_bytes(gzip.compress(braces_trace(n), 9))
    got = []
    peak = traced_peak(lambda: got.append(load_trace(path, workers=1)))
    assert len(got[0].device) == 1 and len(got[0].cpu_ops) == 1
    assert peak < 4 * n, peak


# ----------------------------------------------------------------------------- 3. a full $TMPDIR
def _can_mount_in_a_namespace() -> bool:
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-Urm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True)
    return probe.returncode == 0


FULL_TMPDIR = textwrap.dedent("""
    import os, sys, tempfile
    tmp, trace = sys.argv[1], sys.argv[2]
    os.environ["TMPDIR"] = tmp
    tempfile.tempdir = None
    assert tempfile.gettempdir() == tmp  # (cached now, as in a process whose disk fills later)
    try:
        with open(os.path.join(tmp, "fill"), "wb") as f:
            while True:
                f.write(bytes(1 << 16))
                f.flush()
    except OSError:
        pass
    from trace_roofline.trace import load_trace
    two, one = load_trace(trace, workers=2), load_trace(trace, workers=1)
    assert all(getattr(two, t).equals(getattr(one, t)) for t in ("device", "cpu_ops", "runtime"))
    print("tables", len(two.device), len(two.cpu_ops))
""")


@needs_fork
@pytest.mark.skipif(not _can_mount_in_a_namespace(), reason="cannot mount a tmpfs in a user namespace here")
def test_a_full_tmpdir_means_one_process_not_a_bus_error(tmp_path):
    """With $TMPDIR on a full file system, a two-process parse falls back to one process (the
    claims file could not be allocated) with the same tables; it died of SIGBUS."""
    trace = tmp_path / "t.json"
    trace.write_bytes(mixed_trace("a"))
    mnt = tmp_path / "full"
    mnt.mkdir()
    mount = 'mount -t tmpfs -o size=256k tmpfs "$1" && exec "$2" -c "$3" "$1" "$4"'
    cmd = ["unshare", "-Urm", "sh", "-c", mount, "sh", str(mnt), sys.executable, FULL_TMPDIR, str(trace)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert "tables 300 300" in run.stdout


@needs_fork
def test_a_claims_file_that_cannot_be_allocated_means_one_process(tmp_path, monkeypatch):
    """Where the claims file cannot be given storage (ENOSPC from posix_fallocate), no worker
    is forked and the one process gives the same tables."""
    path = tmp_path / "t.json"
    path.write_bytes(mixed_trace("a"))
    serial = load_trace(path, workers=1)
    forks = []

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    def fork():
        forks.append(1)
        raise AssertionError("forked although the claims file has no storage")

    monkeypatch.setattr(os, "posix_fallocate", full, raising=False)
    monkeypatch.setattr(os, "fork", fork)
    assert_same_tables(serial, load_trace(path, workers=2))
    assert forks == []


# ----------------------------------------------------------------------------- 4. one file identity
def _in_place(path: Path, data: bytes, mtime_s: int) -> None:
    """Rewrite `path` in place (same inode) with `data`, modified at `mtime_s` (a distinct time
    for each rewrite: file systems keep coarse timestamps)."""
    with open(path, "r+b") as f:
        f.write(data)
        f.truncate()
    os.utime(path, ns=(mtime_s * 10**9, mtime_s * 10**9))


@needs_fork
def test_a_trace_replaced_by_mv_during_a_two_process_parse_is_read_from_the_first_file(
        tmp_path, monkeypatch, small_batches):
    """`mv b.json t.json` while the worker decodes the back of t.json: both processes read the
    file that was opened (the worker reopened the path: the back of the other file)."""
    path, other = tmp_path / "t.json", tmp_path / "b.json"
    path.write_bytes(mixed_trace("a"))
    other.write_bytes(mixed_trace("b"))
    first = load_trace(path, workers=1)
    parent, real_work = os.getpid(), parallel._work

    def work(*args):
        if os.getpid() != parent:
            os.replace(other, path)
        return real_work(*args)

    monkeypatch.setattr(parallel, "_work", work)
    parent_waits_for_a_claim(monkeypatch)
    got = load_trace(path, workers=2)
    assert not other.exists()  # (the worker did replace it)
    assert_same_tables(first, got)


def _rewrite_while_reading(monkeypatch, path: Path, versions: list[bytes], every: bool) -> None:
    """After the parent's first batch (and, with `every`, after each later batch and before a
    whole-file decode too), rewrite `path` in place with the next of `versions`."""
    parent, real_range, real_raw = os.getpid(), decode._read_range, trace_load.decode_raw
    done = []

    def rewrite() -> None:
        if os.getpid() == parent and (every or not done):
            done.append(1)
            _in_place(path, versions[len(done) % len(versions)], 1_600_000_000 + len(done))

    def read_range(*args):
        got = real_range(*args)
        rewrite()
        return got

    def raw(*args):
        rewrite()
        return real_raw(*args)

    monkeypatch.setattr(decode, "_read_range", read_range)
    monkeypatch.setattr(trace_load, "decode_raw", raw)


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=needs_fork)])
def test_a_trace_rewritten_in_place_once_is_read_again_whole(tmp_path, monkeypatch, small_batches,
                                                             workers):
    """A trace rewritten in place after its first batch gives the tables of the new version
    (read again, whole), not the first batch of one version and the rest of the other."""
    path = tmp_path / "t.json"
    a, b = mixed_trace("a"), mixed_trace("b")
    path.write_bytes(a)
    os.utime(path, ns=(10**18, 10**18))  # (written long before it is read)
    with monkeypatch.context() as m:
        _rewrite_while_reading(m, path, [a, b], every=False)
        got = load_trace(path, workers=workers)
    assert path.read_bytes() == b
    assert_same_tables(load_trace(path, workers=1), got)


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=needs_fork)])
def test_a_trace_rewritten_again_and_again_is_an_input_error(tmp_path, monkeypatch, small_batches,
                                                             workers):
    """A trace rewritten in place while it is read, and again while it is read again, is a
    one-line InputError naming it."""
    path = tmp_path / "t.json"
    a, b = mixed_trace("a"), mixed_trace("b")
    path.write_bytes(a)
    _rewrite_while_reading(monkeypatch, path, [a, b], every=True)
    with pytest.raises(InputError) as e:
        load_trace(path, workers=workers)
    assert str(e.value) == f"{path}: changed while it was being read"


def test_an_unchanged_trace_is_read_through_one_descriptor(tmp_path, monkeypatch, small_batches):
    """Every read of a plain trace is of the descriptor opened first: the path is opened once."""
    path = tmp_path / "t.json"
    path.write_bytes(mixed_trace("a"))
    opened, real_open = [], open

    def counting_open(file, *args, **kw):
        if str(file) == str(path):
            opened.append(1)
        return real_open(file, *args, **kw)

    monkeypatch.setattr("builtins.open", counting_open)
    assert len(load_trace(path, workers=1).device) == 300
    assert opened == [1]


# ----------------------------------------------------------------------------- 10. undefined behaviour
def _compiler() -> str | None:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc) or shutil.which("gcc")


needs_cc = pytest.mark.skipif(_compiler() is None, reason="no C compiler")
INCLUDE = sysconfig.get_paths()["include"]

UB_CASES = textwrap.dedent("""
    import importlib.machinery, importlib.util, sys
    name = "trace_roofline.trace._scan"
    loader = importlib.machinery.ExtensionFileLoader(name, sys.argv[1])
    spec = importlib.util.spec_from_file_location(name, sys.argv[1], loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    for text in [b"", b" ", b'{"name": ""}', b'{"ph": "X", "cat": ""}', b"{}", b'{"args": {}}',
                 b'{"args": {"grid": [1], "block": []}}', b'{"args": {"Input Dims": [[]]}}']:
        sc = mod.Scanner()
        buf = bytearray(b"[" + text + b"]")
        got = sc.scan(buf, 1, len(buf) - 1)
        assert not isinstance(got, str), (text, got)
        sc.strings(), sc.raws()
    print("scanned")
""")


@needs_cc
def test_the_scanner_has_no_undefined_behaviour_on_empty_keys_and_batches(tmp_path):
    """Built with UBSan, the scanner reports nothing on empty batches, empty keys and absent
    raw arguments (it passed NULL to memcpy with a length of 0 there)."""
    so = tmp_path / "_scan_ubsan.so"
    build = subprocess.run([_compiler(), "-shared", "-fPIC", "-O1", "-g", "-fsanitize=undefined",
                            f"-I{INCLUDE}", str(SCAN_C), "-o", str(so)], capture_output=True, text=True)
    if build.returncode != 0:
        pytest.skip(f"no UBSan build here: {build.stderr[-300:]}")
    run = subprocess.run([sys.executable, "-c", UB_CASES, str(so)], capture_output=True, text=True,
                         env={**os.environ, "UBSAN_OPTIONS": "print_stacktrace=1"}, timeout=120)
    assert run.returncode == 0 and "scanned" in run.stdout, run.stderr[-2000:]
    assert "runtime error" not in run.stderr, run.stderr[-2000:]


@needs_cc
def test_a_big_endian_build_of_the_scanner_is_refused():
    """The scanner reads words as little-endian: for a big-endian target it does not compile
    (the optional extension is then left out, and msgspec reads traces)."""
    cmd = [_compiler(), "-fsyntax-only", "-Wno-builtin-macro-redefined", f"-I{INCLUDE}",
           "-U__BYTE_ORDER__", "-D__BYTE_ORDER__=__ORDER_BIG_ENDIAN__", str(SCAN_C)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    assert run.returncode != 0 and "big-endian" in run.stderr, run.stderr[-2000:]
    little = subprocess.run(cmd[:4] + [str(SCAN_C)], capture_output=True, text=True)
    assert little.returncode == 0, little.stderr[-2000:]
