"""The two-process parse: a forked worker decodes the events from the end while the parent
decodes them from the start, and they meet wherever their speeds make them meet.

Design notes: docs/design.md ("trace_roofline/trace/parallel.py").
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import pickle
import signal
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np

from trace_roofline.trace.columns import Accumulator
from trace_roofline.trace.decode import (
    CUT,
    HEAD_BYTES,
    SEARCH_BYTES,
    Reading,
    document_bounds,
    events_start,
    parse_span,
)
from trace_roofline.trace.read import Document
from trace_roofline.trace.schema import Progress

PARALLEL_MIN_BYTES = 64 << 20  # automatic mode forks a worker from this much JSON on
SEGMENT_BYTES = 32 << 20  # the worker's claims (~0.1 s of decoding; at most 1/8 of the events):
# how close the two processes finish
MIN_SEGMENT_BYTES = 1 << 20  # (a batch) near the parent, where the segments shrink
PIPE_BYTES = 1 << 20  # the worker's pipe (64 KiB by default: the columns cross it in 0.18 s, 0.1 s)


# The CPU quota of this process's control group: cgroup v2's "<quota> <period>" (or "max"),
# else cgroup v1's two files, in microseconds (a quota of -1: none).
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
CGROUP_V1_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
CGROUP_V1_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
_sharing = 1  # processes of this analysis that share the CPUs (`share_cores`)


def cpu_quota() -> float | None:
    """The CPUs the control group's quota allows (quota / period), None when it sets none (or
    there is no readable cgroup file)."""
    try:
        fields = CGROUP_CPU_MAX.read_text().split()
    except OSError:
        try:
            fields = [CGROUP_V1_QUOTA.read_text().strip(), CGROUP_V1_PERIOD.read_text().strip()]
        except OSError:
            return None
    try:
        quota, period = (float(f) for f in fields[:2])
    except ValueError:  # "max": no quota
        return None
    return quota / period if quota > 0 and period > 0 else None


def usable_cores() -> int:
    """The CPUs this process may really use: those its affinity allows (os.sched_getaffinity:
    `taskset`), at most its control group's CPU quota rounded down, at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    quota = cpu_quota()
    return max(1, min(cores, int(quota)) if quota is not None else cores)


def share_cores(processes: int) -> None:
    """This process is one of `processes` analysing traces side by side (a --jobs pool's
    worker): it forks a parse worker only where each of them can have two CPUs."""
    global _sharing
    _sharing = processes


def use_worker(size: int, workers: int | None) -> bool:
    """Whether to fork a parse worker for a document of `size` bytes (rules at load_trace)."""
    if workers == 1 or size < 1 or not hasattr(os, "fork") or threading.active_count() > 1:
        return False
    return workers == 2 or (size >= PARALLEL_MIN_BYTES and usable_cores() >= 2 * _sharing)


def parse_two(doc: Document, progress: Progress | None) -> tuple[dict, int, Accumulator] | None:
    """(metadata, event count, columns) of the whole document, decoded by this process and a
    forked worker; None if its layout is not proven, no worker could be forked, or the parse
    was not proven (then one process reads it)."""
    bounds = document_bounds(doc)
    if not bounds:
        return None
    start, end, meta = bounds
    worker = Worker.start(doc, start, end)
    if worker is None:
        return None
    with worker:
        got = worker.parse(doc, start, end, progress)
    return None if got is None else (meta, *got)


def parse_streamed(doc: Document, progress: Progress | None, workers: int | None
                   ) -> tuple[dict, int, Accumulator] | None:
    """(metadata, event count, columns) of a document whose text its `Inflater` is still
    writing: this process decodes the events from the front as they are inflated; once all of
    the text is there (and `use_worker` agrees), a forked worker takes on the rest from the
    back, as in `parse_two`. The events' end, read from the document's tail, bounds the batch
    that reaches the tail. None if the layout or the parse is not proven (then one process
    reads it)."""
    inflater = doc.inflater
    assert inflater is not None
    head = doc.read(0, HEAD_BYTES)
    found = events_start(head, len(head))
    tail_at = max(doc.size - SEARCH_BYTES, 0)
    if found is None or found[0] + 1 >= tail_at:  # (the events start in the tail: nothing to stream)
        return None
    start = found[0] + 1
    acc = Accumulator()
    state: dict = {"bounds": None, "worker": None, "next": start}
    with contextlib.ExitStack() as stack:

        def claim(stop: int, after: int) -> int:
            worker = state["worker"]
            if worker is None and state["bounds"] is None and (stop >= tail_at or inflater.finished()):
                state["bounds"] = bounds = document_bounds(doc)  # (waits for the whole text)
                if bounds is None or bounds[0] != start:
                    return 0  # (not proven: the span ends here, and is not used)
                inflater.stop()  # (ended: no thread at the fork)
                inflater.wait(doc.size)  # (Unstreamed if it found more than its size)
                if use_worker(doc.size, workers):
                    state["worker"] = worker = Worker.start(doc, state["next"], bounds[1])
                    if worker is not None:
                        stack.enter_context(worker)
            state["next"] = after
            if worker is not None:
                return worker.claims.parent(stop, after)
            return stop if state["bounds"] is None else min(stop, state["bounds"][1])

        with doc.window(start - 1) as w:
            n = parse_span(Reading(doc.path, w, acc, progress, claim), start, doc.size)
        bounds = state["bounds"]
        if bounds is None or bounds[0] != start:
            return None
        if state["worker"] is not None:
            got = state["worker"].collect(n, acc, start, bounds[1], progress)
            return None if got is None else (bounds[2], *got)
    return None if n is None else (bounds[2], n, acc)


def allocate(fd: int, size: int) -> None:
    """Give file `fd` `size` bytes of real storage (not a sparse hole), so that writes through
    a shared mmap of it cannot fault (SIGBUS) on a full file system; OSError where they could."""
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, size)
    else:  # pragma: no cover - no posix_fallocate (macOS): written zeros hold storage too
        if os.pwrite(fd, bytes(size), 0) != size:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class Claims:
    """Who decodes which bytes of the events [start, end): the parent [start, parent_stop),
    the worker [worker_start, end), the rest not yet claimed. Both frontiers (and the first
    event after the parent's, `parent_next`) live in a small shared file, changed only under
    its POSIX record lock (per process: mutual exclusion across the fork, released if a
    process dies). A frontier sits at a separator ('}' ... ',' ... '{' between two events),
    so the two parts meet at an event boundary."""

    _PARENT_STOP, _PARENT_NEXT, _WORKER_STOP, _WORKER_START = range(4)

    def __init__(self, start: int, end: int):
        fd, name = tempfile.mkstemp(prefix="trace-roofline-")
        os.unlink(name)  # (the descriptor keeps it while both processes need it)
        try:
            allocate(fd, mmap.PAGESIZE)  # (a full file system: OSError here, not SIGBUS later)
            fcntl.lockf(fd, fcntl.LOCK_EX)  # (a file system without record locks: no worker)
            fcntl.lockf(fd, fcntl.LOCK_UN)
            self.map = mmap.mmap(fd, mmap.PAGESIZE)
        except OSError:
            os.close(fd)
            raise
        self.fd = fd
        self.at = np.frombuffer(self.map, np.int64, count=4)
        self.at[:] = (start, start, end, end)
        self.segment = max(min(SEGMENT_BYTES, (end - start) // 8), 1)  # the worker's claims

    def close(self) -> None:
        del self.at
        self.map.close()
        os.close(self.fd)

    @contextlib.contextmanager
    def _locked(self):
        fcntl.lockf(self.fd, fcntl.LOCK_EX)
        try:
            yield self.at
        finally:
            fcntl.lockf(self.fd, fcntl.LOCK_UN)

    def parent(self, stop: int, after: int) -> int:
        """The parent claims up to the separator at `stop` (the next event starts at `after`);
        where its part ends now: `stop`, or the worker's frontier when that comes first."""
        with self._locked() as at:
            got = min(stop, int(at[self._WORKER_STOP]))
            if got > at[self._PARENT_STOP]:
                at[self._PARENT_STOP], at[self._PARENT_NEXT] = got, (after if got == stop else
                                                                      at[self._WORKER_START])
            return got

    def worker_stop(self) -> int:
        """Where the worker's part starts now (only the worker moves it: no lock)."""
        return int(self.at[self._WORKER_STOP])

    def parent_stop(self) -> int:
        """Where the parent's part ends now (a glimpse, without the lock)."""
        return int(self.at[self._PARENT_STOP])

    def worker(self, boundary: tuple[int, int] | None) -> tuple[int, int] | None:
        """The worker claims the bytes from the event after `boundary` (a separator's
        (start, end)) to its frontier, or all that the parent has not claimed when `boundary`
        is None or the parent got past it; the (start, stop) of the new segment, or None
        when nothing is left."""
        with self._locked() as at:
            stop = int(at[self._WORKER_STOP])
            if at[self._PARENT_STOP] >= stop:
                return None
            if boundary is None or boundary[0] <= at[self._PARENT_STOP]:
                boundary = int(at[self._PARENT_STOP]), int(at[self._PARENT_NEXT])
            at[self._WORKER_STOP], at[self._WORKER_START] = boundary
            return boundary[1], stop


@dataclass(frozen=True)
class Segment:
    """Worker -> parent, as soon as it is decoded: one segment's columns (`Accumulator.export()`)
    and how many events it holds. Segments come from the back of the file to the front."""

    columns: dict
    events: int


@dataclass(frozen=True)
class Done:
    """Worker -> parent: every segment it claimed has been sent."""


@dataclass(frozen=True)
class Failed:
    """Worker -> parent: a segment could not be proven (or read): fall back."""


class Worker:
    """The parent's handle on the forked worker (protocol above); a context manager that
    always kills and reaps the child (and ends the thread that receives its messages) on the
    way out."""

    def __init__(self, pid: int, up, claims: Claims):
        self.pid: int | None = pid  # (None once reaped)
        self.up, self.claims = up, claims
        self.inbox: list[Segment | Done | Failed | None] = []
        self.receiver = threading.Thread(target=self._receive, daemon=True)
        self.receiver.start()  # (after the fork: the worker is a single-threaded copy)

    @classmethod
    def start(cls, doc: Document, start: int, end: int) -> Worker | None:
        """Fork a worker for the events in document bytes [start, end)."""
        try:
            claims = Claims(start, end)
        except OSError:  # no temporary file, or no record locks on it: one process
            return None
        r_up, w_up = os.pipe()
        with contextlib.suppress(AttributeError, OSError):  # (Linux; refused above pipe-max-size)
            fcntl.fcntl(w_up, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        try:
            pid = os.fork()
        except OSError:
            for fd in (r_up, w_up):
                os.close(fd)
            claims.close()
            return None
        if pid == 0:  # pragma: no cover - runs in the child (coverage does not follow forks)
            code = 1
            try:
                os.close(r_up)
                with open(w_up, "wb") as up:
                    _work(doc, claims, up)
                code = 0
            finally:
                os._exit(code)
        os.close(w_up)
        return cls(pid, open(r_up, "rb"), claims)

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc) -> None:
        # (ChildProcessError/ProcessLookupError: reaped already, e.g. under SIGCHLD = SIG_IGN)
        with contextlib.suppress(ChildProcessError, ProcessLookupError):
            if self.pid is not None and os.waitpid(self.pid, os.WNOHANG)[0] == 0:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
        self.pid = None
        self.receiver.join()  # (the pipe is at its end: the worker is gone)
        with contextlib.suppress(OSError):
            self.up.close()
        self.claims.close()

    def parse(self, doc: Document, start: int, end: int, progress: Progress | None
              ) -> tuple[int, Accumulator] | None:
        """(event count, columns) of the events in [start, end), the parent decoding from the
        front while the worker decodes from the back; None to fall back."""
        acc = Accumulator()

        def halfway(stage: str, done: int, total: int) -> None:  # the worker's part is to come
            assert progress is not None  # (passed on only with a progress)
            progress(stage, min(done, total - 1), total)

        with doc.window(start - 1) as w:
            n = parse_span(Reading(doc.path, w, acc, halfway if progress else None, self.claims.parent),
                           start, end)
        return self.collect(n, acc, start, end, progress)

    def collect(self, n: int | None, acc: Accumulator, start: int, end: int,
                progress: Progress | None) -> tuple[int, Accumulator] | None:
        """The parent's `n` events in `acc` (None: not proven) and the worker's segments after
        them, the events in [start, end); None to fall back."""
        if n is not None and self.claims.worker_stop() == end:  # the worker claimed nothing
            return n, acc  # (it may have died: its messages are not needed)
        if n is None:
            return None
        self.receiver.join()
        if not isinstance(self.inbox[-1], Done):  # not proven, or the worker died
            return None
        # (_receive stops at the first message that is not a Segment: the last one)
        for seg in reversed(cast(list[Segment], self.inbox[:-1])):  # (file order)
            acc.absorb(seg.columns, n)
            n += seg.events
        if progress:
            progress("parse", end - start, end - start)
        return n, acc

    def _receive(self) -> None:
        """Collect the worker's messages into `inbox` until its last (on a thread, while this
        process decodes its own part); None if it died (sent nothing, or half a message)."""
        while True:
            try:
                msg = pickle.load(self.up)
            except Exception:  # whatever half a pickle raises: the worker died
                msg = None
            self.inbox.append(msg)
            if not isinstance(msg, Segment):
                return


def _work(doc: Document, claims: Claims, up) -> None:
    """The worker's side: claim and decode segments from the end until the parent is reached,
    sending each segment's columns as soon as it is decoded. Segments shrink to a third of
    the gap left between the two frontiers, so that the worker's last one ends about when the
    parent arrives."""
    while True:
        stop = claims.worker_stop()
        size = max(min(claims.segment, (stop - claims.parent_stop()) // 3), MIN_SEGMENT_BYTES)
        seg = claims.worker(_boundary(doc, stop - size, stop))
        if seg is None:
            break
        acc = Accumulator()
        with doc.window(seg[0] - 1) as w:
            n = parse_span(Reading(doc.path, w, acc), seg[0], seg[1])
        if n is None:
            return _send(up, Failed())
        _send(up, Segment(acc.export(), n))
    _send(up, Done())


def _boundary(doc: Document, lo: int, stop: int) -> tuple[int, int] | None:
    """The first separator between two events in the SEARCH_BYTES from offset `lo` (document
    offsets of its start and end, before `stop`), or None."""
    if lo <= 0:
        return None
    m = CUT.search(doc.read(lo, min(SEARCH_BYTES, stop - lo)))
    return (lo + m.start(1), lo + m.end(1)) if m else None


def _send(up, msg: Segment | Done | Failed) -> None:
    pickle.dump(msg, up, protocol=pickle.HIGHEST_PROTOCOL)
    up.flush()
