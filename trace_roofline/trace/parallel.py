"""The two-process parse: a forked worker decodes the later part of a big file.

msgspec holds the GIL, so the second core is a forked process, the worker; `Worker` is the
parent's handle on it. The worker sends one named message per step, pickled over a pipe:
 1. bounds: the worker finds the first event boundary '}' , '{' after `cut` (the middle of the
    document) and sends it (`Cut`); it finds the closing ']' of traceEvents near the end
    (`Split`, with the bytes after it), or gives up (`NoSplit`). The parent finds the '[' that
    opens traceEvents;
 2. decode: each process reads and decodes its part batch by batch (decode.parse_span; a plain
    file is read by each through its own Window, a gzip file is inflated by the parent before
    the fork and shared copy-on-write), proving it a JSON array of events; the worker pickles
    its columns back (`Part`: each categorical as its values in first-seen order plus codes,
    events numbered from 0) and the parent appends them after its own, re-coded and
    renumbered (`Accumulator.absorb`). With both parts and the keys around the array (one
    object with "[]" in place of the events) valid JSON, so is the whole file, and JSON's
    grammar leaves only one parse: tables, category order and counters are exactly a
    one-process read's. Anything else (no boundary, a malformed file or event, a worker that
    dies) falls back to the one-process path, which gives its usual result or error.
Whether a worker is forked at all is `use_worker` (documented at `load_trace`)."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import threading
from dataclasses import dataclass

import msgspec

from trace_roofline.errors import InputError
from trace_roofline.trace.columns import Accumulator
from trace_roofline.trace.decode import (
    CUT,
    HEAD_BYTES,
    SEARCH_BYTES,
    events_end,
    events_start,
    meta_around,
    parse_span,
)
from trace_roofline.trace.read import Document
from trace_roofline.trace.schema import Progress

PARALLEL_MIN_BYTES = 64 << 20  # automatic mode forks a worker from this much JSON on
PARALLEL_SHARE = 0.5  # the parent's share of the document's bytes when it forks a worker
PIPE_BYTES = 1 << 20  # the worker's pipe (64 KiB by default: the columns cross it in 0.18 s, 0.1 s)


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


# ----------------------------------------------------------------------------------------------
# The messages, in protocol order. Offsets are file offsets of the document.
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cut:
    """Worker -> parent: where the parent's part ends and the worker's begins."""

    separator: int  # the ',' between the two parts' events (with its whitespace) starts here
    worker_start: int  # the worker's first event starts here


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

    def __init__(self, pid: int, up):
        self.pid, self.up = pid, up

    @classmethod
    def start(cls, doc: Document) -> Worker | None:
        """Fork a worker for the part of `doc` after PARALLEL_SHARE of its bytes."""
        import fcntl  # (POSIX, as fork is)

        r_up, w_up = os.pipe()
        with contextlib.suppress(AttributeError, OSError):  # (Linux; refused above pipe-max-size)
            fcntl.fcntl(w_up, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
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
                    _work(doc, int(doc.size * PARALLEL_SHARE), up)
                code = 0
            finally:
                os._exit(code)
        os.close(w_up)
        return cls(pid, open(r_up, "rb"))

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

    def parse(self, doc: Document, progress: Progress | None
              ) -> tuple[dict, int, Accumulator] | None:
        """(meta, event count, columns) of the whole trace, or None to fall back."""
        cut = self._recv()
        if not isinstance(cut, Cut):
            return None
        head = events_start(doc.read(0, HEAD_BYTES), cut.separator)
        split = self._recv() if head else None
        if not isinstance(split, Split) or split.array_document != (head[1] is None):
            return None
        try:
            meta = meta_around(head[1], split.tail)
        except (msgspec.DecodeError, RecursionError):
            return None
        acc = Accumulator()
        start, end = head[0] + 1, cut.separator

        def halfway(stage: str, done: int, total: int) -> None:  # the worker's part is to come
            progress(stage, min(done, total - 1), total)

        with doc.window(start - 1) as w:
            n1 = parse_span(doc.path, w, start, end, acc, halfway if progress else None)
        part = self._recv() if n1 is not None else None
        if not isinstance(part, Part):  # not proven, or the worker died: one process decides
            return None
        acc.absorb(part.columns, n1)
        if progress:
            progress("parse", end - start, end - start)
        return meta, n1 + part.events, acc


def _work(doc: Document, cut: int, up) -> None:
    """The worker's side of the protocol: find its bounds and decode the events after `cut`."""

    def send(msg: Cut | Split | NoSplit | Part) -> None:
        pickle.dump(msg, up, protocol=pickle.HIGHEST_PROTOCOL)
        up.flush()

    acc = Accumulator()
    try:
        with doc.window(cut) as w:
            m = w.search(CUT, cut, min(cut + SEARCH_BYTES, doc.size), cut)
            if m is None:
                return send(NoSplit())
            send(Cut(*m))
            tail_at = max(doc.size - SEARCH_BYTES, 0)
            tail = doc.read(tail_at, SEARCH_BYTES)
            end = events_end(tail, max(m[1] - tail_at, 0))
            if not end:
                return send(NoSplit())
            send(Split(tail[end[0] + 1 :], end[1]))
            n = parse_span(doc.path, w, m[1], tail_at + end[0], acc, None)
    except InputError:  # the file could not be read: the parent finds out for itself
        return send(NoSplit())
    send(NoSplit() if n is None else Part(acc.export(), n))
