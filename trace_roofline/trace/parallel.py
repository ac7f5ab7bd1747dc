"""The two-process parse: a forked worker decodes the later part of a big file.

msgspec holds the GIL, so the second core is a forked process, the worker; `Worker` is the
parent's handle on it. The worker sends one named message per step, pickled over a pipe:
 1. read: for a plain file the worker reads bytes [cut, end) while the parent reads [0, cut),
    each into its own buffer (a gzip file is inflated by the parent, then the worker is forked
    and shares that buffer copy-on-write);
 2. bounds: the worker finds the first event boundary '}' , '{' after `cut` and sends it
    (`Cut`); it finds the closing ']' of traceEvents near the end (`Split`, with the bytes
    after it), or gives up (`NoSplit`). The parent finds the '[' that opens traceEvents;
 3. decode: each process decodes its half batch by batch (decode.parse_span), proving it a
    JSON array of events; the worker pickles its columns back (`Part`: each categorical as its
    values in first-seen order plus codes, events numbered from 0) and the parent appends them
    after its own, re-coded and renumbered (`Accumulator.absorb`). With both halves and the
    keys around the array (one object with "[]" in place of the events) valid JSON, so is the
    whole file, and JSON's grammar leaves only one parse: tables, category order and counters
    are exactly a one-process read's. Anything else (no boundary, a malformed file or event,
    a worker that dies) falls back to the one-process path, which gives its usual result or
    error.
Whether a worker is forked at all is `use_worker` (documented at `load_trace`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

import msgspec

from trace_roofline.errors import InputError
from trace_roofline.trace.columns import Accumulator
from trace_roofline.trace.decode import CUT, SEARCH_BYTES, events_end, events_start, meta_around, parse_span
from trace_roofline.trace.read import gunzip, read_into
from trace_roofline.trace.schema import Progress

PARALLEL_MIN_BYTES = 64 << 20  # automatic mode forks a worker from this much JSON on
PARALLEL_SHARE = 0.5  # the parent's share of the events when it forks a worker


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
                buf = bytearray(cut + SEARCH_BYTES)  # room for the bytes up to the boundary
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
    """Worker -> parent: the worker's events end at the ']' closing traceEvents."""

    tail: bytes  # the document after that ']'
    array_document: bool  # the document is a top-level array of events (no keys)


@dataclass(frozen=True)
class NoSplit:
    """Worker -> parent: its half could not be proven (or read): fall back."""


@dataclass(frozen=True)
class Part:
    """Worker -> parent: the columns of the worker's half (`Accumulator.export()`)."""

    columns: dict
    events: int  # how many events the worker's half holds


class Worker:
    """The parent's handle on the forked worker (protocol above); a context manager that
    always kills and reaps the child on the way out."""

    def __init__(self, pid: int, up, cut: int, partial: bool):
        self.pid, self.up, self.cut, self.partial = pid, up, cut, partial

    @classmethod
    def start(cls, p: Path, buf, cut: int, size: int = 0) -> Worker | None:
        """Fork; the child works on `buf` (the whole document) or, when None, reads bytes
        [cut, size) of `p` itself."""
        r_up, w_up = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            for fd in (r_up, w_up):
                os.close(fd)
            return None
        if pid == 0:  # pragma: no cover - runs in the child (coverage does not follow forks)
            code = 1
            try:
                os.close(r_up)
                with open(w_up, "wb") as up:
                    _work(p, buf, cut, size, up)
                code = 0
            finally:
                os._exit(code)
        os.close(w_up)
        return cls(pid, open(r_up, "rb"), cut, buf is None)

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(OSError):  # the child may be gone
            self.up.close()
        # (ChildProcessError/ProcessLookupError: reaped already, e.g. under SIGCHLD = SIG_IGN)
        with contextlib.suppress(ChildProcessError, ProcessLookupError):
            if self.pid is not None and os.waitpid(self.pid, os.WNOHANG)[0] == 0:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
        self.pid = None

    def _recv(self) -> Cut | Split | NoSplit | Part | None:
        """The worker's next message; None if it died (sent nothing, or half a message)."""
        try:
            return pickle.load(self.up)
        except Exception:  # whatever half a pickle raises: the worker died
            return None

    def parse(self, p: Path, buf, progress: Progress | None
              ) -> tuple[dict, int, Accumulator] | None:
        """(meta, event count, columns) of the whole trace, or None to fall back. When the
        parent read only its part (`partial`), `buf` is emptied once that part is decoded."""
        cut = self._recv()
        if not isinstance(cut, Cut):
            return None
        if self.partial:  # buf holds bytes [0, cut) and spare room: add the bytes up to the start
            buf[self.cut : cut.worker_start] = cut.gap
            del buf[cut.worker_start :]
        head = events_start(buf, cut.separator)
        split = self._recv() if head else None
        if not isinstance(split, Split) or split.array_document != (head[1] is None):
            return None
        try:
            meta = meta_around(head[1], split.tail)
        except (msgspec.DecodeError, RecursionError):
            return None
        acc = Accumulator()
        start, end = head[0] + 1, cut.separator

        def halfway(stage: str, done: int, total: int) -> None:  # the worker's half is to come
            progress(stage, min(done, total - 1), total)

        n1 = parse_span(p, buf, start, end, acc, halfway if progress else None)
        if self.partial:  # decoded: free the bytes before the worker's columns come (a
            del buf[:]  # fallback reads the file again)
        part = self._recv() if n1 is not None else None
        if not isinstance(part, Part):  # not proven, or the worker died: one process decides
            return None
        acc.absorb(part.columns, n1)
        if progress:
            progress("parse", end - start, end - start)
        return meta, n1 + part.events, acc


def _work(p: Path, buf, cut: int, size: int, up) -> None:
    """The worker's side of the protocol: read, find its bounds and decode the events after
    `cut`."""

    def send(msg: Cut | Split | NoSplit | Part) -> None:
        pickle.dump(msg, up, protocol=pickle.HIGHEST_PROTOCOL)
        up.flush()

    base = 0  # file offset of buf[0]
    if buf is None:
        base, buf = cut, _read_tail(p, cut, size)
        if buf is None:
            return send(NoSplit())
    m = CUT.search(buf, cut - base, cut - base + SEARCH_BYTES)
    if m is None:
        return send(NoSplit())
    s1, d = m.span(1)
    send(Cut(base + s1, base + d, bytes(buf[cut - base : d]) if base else b""))
    end = events_end(buf, d)
    if not end:
        return send(NoSplit())
    q, array_doc = end
    send(Split(bytes(buf[q + 1 :]), array_doc))
    acc = Accumulator()
    n = parse_span(p, buf, d, q, acc, None)
    del buf  # (its own copy, if it read the file: freed before the columns are shipped)
    send(NoSplit() if n is None else Part(acc.export(), n))


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
