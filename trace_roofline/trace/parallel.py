"""The two-process parse: a forked worker decodes the later part of a big file.

msgspec holds the GIL, so the second core is a forked process, the worker; `Worker` is the
parent's handle on it. The two exchange one named message per step, pickled over two pipes:
 1. read: for a plain file the worker reads bytes [cut, end) while the parent reads [0, cut),
    each into its own buffer (a gzip file is inflated by the parent, then the worker is forked
    and shares that buffer copy-on-write);
 2. split: the worker finds the first event boundary '}' , '{' after `cut` and sends it
    (`Cut`); it finds the closing ']' of traceEvents near the end and splits the events between
    them (`Split`), or gives up (`NoSplit`). The parent finds the '[' that opens traceEvents and
    splits the events before the boundary. Each half is decoded as a JSON array of its own, and
    the keys before and after the array as one object ("[]" in place of the events): when all
    of them are valid JSON, so is the whole file, and JSON's grammar leaves only one parse, so
    the events are exactly a one-process read's. The parent then sends the index of the
    worker's first event (`Go`); anything else (no boundary, a malformed file, a worker that
    dies) falls back to the one-process path, which gives its usual result or error;
 3. decode: each process decodes its half into columns; the worker pickles its columns back
    (`Part`: each categorical as its values in first-seen order plus codes) or the error of its
    first malformed event (`BadEvent`), and the parent appends them after its own, re-coded
    (`Accumulator.absorb`): tables, category order, counters and the first-bad-event error are
    those of one process.
Whether a worker is forked at all is `use_worker` (documented at `load_trace`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

import msgspec

from trace_roofline.errors import InputError
from trace_roofline.trace.columns import Accumulator
from trace_roofline.trace.decode import RAW_LIST, TOP, json_kind, parse_events, top_meta
from trace_roofline.trace.read import gunzip, read_into
from trace_roofline.trace.schema import Progress

PARALLEL_MIN_BYTES = 64 << 20  # automatic mode forks a worker from this much JSON on
PARALLEL_SHARE = 0.5  # the parent's share of the events when it forks a worker
_SEARCH_BYTES = 1 << 20  # how far from the cut / the file's ends boundaries are looked for
_WS = rb"[ \t\n\r]*"
_CUT = re.compile(rb"\}(" + _WS + rb"," + _WS + rb")\{")  # a boundary between two events
_END = re.compile(rb"\}" + _WS + rb"\]")  # the last event and the array's closing bracket
_EVENTS_KEY = re.compile(rb'"traceEvents"' + _WS + rb":" + _WS + rb"\[")


def usable_cores() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def use_worker(size: int, workers: int | None) -> bool:
    """Whether to fork a parse worker for a document of `size` bytes (rules at load_trace)."""
    if workers == 1 or size < 1 or not hasattr(os, "fork") or threading.active_count() > 1:
        return False
    return workers == 2 or (size >= PARALLEL_MIN_BYTES and usable_cores() >= 2)


def read_document(p: Path, progress: Progress | None, workers: int | None
                  ) -> tuple[bytearray, Worker | None]:
    """Step 1 (read): the file's bytes, gunzipped when it starts with the gzip magic number,
    and the started worker, if any.

    The worker is None unless `use_worker(JSON size, workers)`: for a gzip file it is forked
    after inflating and shares the bytes; for a plain file it reads the bytes from its `cut`
    on while the parent reads (only) the bytes before it (then `worker.partial`)."""
    chunk = 16 << 20
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(2)
            f.seek(0)
            if progress:
                progress("read", 0, size)
            if head == b"\x1f\x8b":
                buf = gunzip(p, f, size, chunk, progress)
                cut = int(len(buf) * PARALLEL_SHARE)
                return buf, Worker.start(p, buf, cut) if use_worker(len(buf), workers) else None
            cut = int(size * PARALLEL_SHARE)
            worker = Worker.start(p, None, cut, size) if use_worker(size, workers) else None
            if worker:
                buf = bytearray(cut + _SEARCH_BYTES)  # room for the bytes up to the boundary
                try:
                    done = read_into(f, buf, cut, progress, size)
                except BaseException:
                    worker.__exit__()
                    raise
                if done == cut:
                    return buf, worker
                worker.__exit__()  # the file shrank: read it again in one process
                f.seek(0)
            buf = bytearray(size)
            del buf[read_into(f, buf, size, progress, size) :]
            return buf, None
    except FileNotFoundError:
        raise InputError(f"{p}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{p}: is a directory, not a trace file") from None
    except PermissionError:
        raise InputError(f"{p}: permission denied") from None
    except OSError as e:
        raise InputError(f"{p}: cannot read ({e.strerror or e})") from None


# ----------------------------------------------------------------------------------------------
# The messages, in protocol order. Offsets are file offsets of the document.
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cut:
    """Worker -> parent: where the parent's half ends and the worker's begins."""

    separator: int  # the ',' between the two halves' events (with its whitespace) starts here
    worker_start: int  # the worker's first event starts here
    gap: bytes  # bytes [cut, worker_start) when the parent read only [0, cut), else b""


@dataclass(frozen=True)
class Split:
    """Worker -> parent: the worker's events are a valid JSON array."""

    events: int  # how many events the worker's half holds
    tail: bytes  # the document after the ']' closing traceEvents
    array_document: bool  # the document is a top-level array of events (no keys)


@dataclass(frozen=True)
class NoSplit:
    """Worker -> parent: no split could be proven (or the file not read): fall back."""


@dataclass(frozen=True)
class Go:
    """Parent -> worker: the parent's half is valid too: decode yours."""

    first_event: int  # index in traceEvents of the worker's first event


@dataclass(frozen=True)
class BadEvent:
    """Worker -> parent: the InputError message of the first malformed event in its half."""

    message: str


@dataclass(frozen=True)
class Part:
    """Worker -> parent: the columns of the worker's half (`Accumulator.export()`)."""

    columns: dict


class Worker:
    """The parent's handle on the forked worker (protocol above); a context manager that
    always kills and reaps the child on the way out."""

    def __init__(self, pid: int, up, down, cut: int, partial: bool):
        self.pid, self.up, self.down, self.cut, self.partial = pid, up, down, cut, partial

    @classmethod
    def start(cls, p: Path, buf, cut: int, size: int = 0) -> Worker | None:
        """Fork; the child works on `buf` (the whole document) or, when None, reads bytes
        [cut, size) of `p` itself."""
        r_down, w_down = os.pipe()
        r_up, w_up = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            for fd in (r_down, w_down, r_up, w_up):
                os.close(fd)
            return None
        if pid == 0:  # pragma: no cover - runs in the child (coverage does not follow forks)
            code = 1
            try:
                os.close(w_down)
                os.close(r_up)
                with open(r_down, "rb") as down, open(w_up, "wb") as up:
                    _work(p, buf, cut, size, up, down)
                code = 0
            finally:
                os._exit(code)
        os.close(r_down)
        os.close(w_up)
        return cls(pid, open(r_up, "rb"), open(w_down, "wb"), cut, buf is None)

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc) -> None:
        for f in (self.down, self.up):
            with contextlib.suppress(OSError):  # the child may be gone
                f.close()
        # (ChildProcessError/ProcessLookupError: reaped already, e.g. under SIGCHLD = SIG_IGN)
        with contextlib.suppress(ChildProcessError, ProcessLookupError):
            if self.pid is not None and os.waitpid(self.pid, os.WNOHANG)[0] == 0:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
        self.pid = None

    def _recv(self) -> Cut | Split | NoSplit | BadEvent | Part | None:
        """The worker's next message; None if it died (sent nothing, or half a message)."""
        try:
            return pickle.load(self.up)
        except Exception:  # whatever half a pickle raises: the worker died
            return None

    def parse(self, p: Path, buf, progress: Progress | None
              ) -> tuple[dict, int, Accumulator] | None:
        """(meta, event count, columns) of the whole trace, or None to fall back."""
        cut = self._recv()
        if not isinstance(cut, Cut):
            return None
        if self.partial:  # buf holds bytes [0, cut) and spare room: add the bytes up to the start
            buf[self.cut : cut.worker_start] = cut.gap
            del buf[cut.worker_start :]
        head = _events_start(buf, cut.separator)
        raws = _split_at(buf, head[0], cut.separator) if head else None
        if not raws:
            return None
        split = self._recv()
        if not isinstance(split, Split) or split.array_document != (head[1] is None):
            return None
        try:
            meta = ({"device_properties": []} if head[1] is None
                    else top_meta(TOP.decode(head[1] + b"[]" + split.tail)))
        except (msgspec.DecodeError, RecursionError):
            return None
        n1 = len(raws)
        n = n1 + split.events
        try:
            pickle.dump(Go(n1), self.down)
            self.down.flush()
        except OSError:  # pragma: no cover - the child is gone
            return None
        self.partial = True  # buf gets patched from here on: a fallback must read the file again
        acc = Accumulator()

        def scaled(stage: str, done: int, total: int) -> None:
            progress(stage, min(done * n // total, n - 1), n)

        parse_events(p, buf, raws, acc, scaled if progress else None)
        del raws
        part = self._recv()
        if isinstance(part, BadEvent):  # the first malformed event: the parent's half had none
            raise InputError(part.message)
        if not isinstance(part, Part):  # the worker died: start again in one process
            return None
        acc.absorb(part.columns)
        if progress:
            progress("parse", n, n)
        return meta, n, acc


def _work(p: Path, buf, cut: int, size: int, up, down) -> None:
    """The worker's side of the protocol: read, split and decode the events after `cut`."""

    def send(msg: Cut | Split | NoSplit | BadEvent | Part) -> None:
        pickle.dump(msg, up, protocol=pickle.HIGHEST_PROTOCOL)
        up.flush()

    base = 0  # file offset of buf[0]
    if buf is None:
        base, buf = cut, _read_tail(p, cut, size)
        if buf is None:
            return send(NoSplit())
    m = _CUT.search(buf, cut - base, cut - base + _SEARCH_BYTES)
    if m is None:
        return send(NoSplit())
    s1, d = m.start(1), m.end(1)
    send(Cut(base + s1, base + d, bytes(buf[cut - base : d]) if base else b""))
    end = _events_end(buf, d)
    raws = None
    if end:
        q, array_doc = end
        buf[d - 1] = 0x5B  # '[' (buf is this process's own copy)
        try:
            raws = RAW_LIST.decode(memoryview(buf)[d - 1 : q + 1])
        except (msgspec.DecodeError, RecursionError):
            raws = None
    if not raws:
        return send(NoSplit())
    send(Split(len(raws), bytes(buf[q + 1 :]), array_doc))
    go = pickle.load(down)
    if not isinstance(go, Go):  # pragma: no cover - the parent closes the pipe instead
        return None
    acc = Accumulator()
    try:
        parse_events(p, buf, raws, acc, None, first=go.first_event)
    except InputError as e:
        return send(BadEvent(str(e)))
    del raws
    send(Part(acc.export()))


def _read_tail(p: Path, cut: int, size: int) -> bytearray | None:
    """Bytes [cut, size) of the file, or None if they cannot all be read."""
    buf = bytearray(size - cut)
    try:
        with open(p, "rb") as f:
            f.seek(cut)
            done = read_into(f, buf, len(buf), None, 0)
    except OSError:
        return None
    return buf if done == len(buf) else None


def _events_start(buf, s1: int) -> tuple[int, bytes | None] | None:
    """(offset of the '[' opening traceEvents, the document's bytes before it) for an object
    document, (offset of '[', None) for a top-level array of events; None if not proven."""
    bom = 3 if buf[:3] == b"\xef\xbb\xbf" else 0
    kind = json_kind(memoryview(buf)[bom:])
    if kind == "an array":
        return buf.index(b"[", bom), None
    if kind != "an object":
        return None
    m = _EVENTS_KEY.search(buf, bom, min(s1, bom + _SEARCH_BYTES))
    if m is None:
        return None
    a = m.end() - 1
    head = bytes(buf[bom:a])
    try:  # the bytes before the '[' are an object whose last key is traceEvents
        top = TOP.decode(head + b"[]}")
    except (msgspec.DecodeError, RecursionError):
        return None
    return (a, head) if list(top)[-1] == "traceEvents" else None


def _split_at(buf, a: int, s1: int) -> list | None:
    """The events between the '[' at `a` and the separator at `s1`, or None if not valid JSON."""
    if not a < s1:
        return None
    keep, buf[s1] = buf[s1], 0x5D  # ']'
    try:
        return RAW_LIST.decode(memoryview(buf)[a : s1 + 1])
    except (msgspec.DecodeError, RecursionError):
        return None
    finally:
        buf[s1] = keep


def _events_end(buf, d: int) -> tuple[int, bool] | None:
    """(offset of the ']' closing traceEvents, whether the document is a top-level array): the
    first '}' ']' in the last _SEARCH_BYTES after which the rest of the file is whitespace (an
    array document) or the rest of an object without another traceEvents key."""
    lo = max(d, len(buf) - _SEARCH_BYTES)
    for m in list(_END.finditer(buf, lo))[-16:]:  # lowest first
        q = m.end() - 1
        tail = bytes(buf[q + 1 :])
        if not tail.strip(b" \t\n\r"):
            return q, True
        try:
            rest = TOP.decode(b'{"_":0' + tail)
        except (msgspec.DecodeError, RecursionError):
            continue
        if "traceEvents" not in rest:
            return q, False
    return None
