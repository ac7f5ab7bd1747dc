"""A trace file's bytes: listing a directory's trace files, opening a document (inflating gzip),
reading it whole or through a sliding `Window`.

Design notes: docs/design.md ("trace_roofline/trace/read.py").
"""

from __future__ import annotations

import os
import re
import struct
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import BinaryIO

from trace_roofline.errors import InputError
from trace_roofline.files import open_regular
from trace_roofline.trace.schema import Progress

inflating: ModuleType  # zlib's interface: decompressobj, error
try:  # ISA-L's inflate (python-isal, the `gzip` extra): 1.8x zlib's on a 1 GB trace
    from isal import isal_zlib as inflating
except ImportError:  # not installed: the standard library's, which it mirrors
    import zlib as inflating

CHUNK_BYTES = 16 << 20  # a plain file is read this much at a time
# A gzip trace is inflated in memory: at most MAX_INFLATION bytes per compressed byte (the
# committed traces inflate 5-21x; gzip's own limit is ~1032x, reached by a "bomb" of one
# repeated byte), and never less than INFLATION_FLOOR bytes in all, whatever the ratio. More is
# refused as soon as it is reached, so inflating holds at most the limit plus one chunk.
MAX_INFLATION = 100
INFLATION_FLOOR = 256 << 20
# From this many inflated bytes on, a one-member gzip file whose trailer gives its size is
# inflated on a thread (zlib and ISA-L release the GIL) while the parse reads what is ready.
STREAM_MIN_BYTES = 16 << 20
_PIECE_BYTES = 4 << 20  # inflated at a time by the thread (what the parse may wait for)
Buffer = bytearray  # a document's bytes, writable (decoding patches them)
Stamp = tuple[int, int, int, int]  # a file's identity: (st_dev, st_ino, st_size, st_mtime_ns)


def trace_files(d: Path) -> list[Path]:
    """The trace files of directory `d`: tensorboard_trace_handler's, else any JSON, sorted."""
    files = sorted(d.glob("*.pt.trace.json")) + sorted(d.glob("*.pt.trace.json.gz"))
    if not files:  # not the tensorboard layout: any JSON trace in the directory
        files = sorted(d.glob("*.json")) + sorted(d.glob("*.json.gz"))
    files = [f for f in files if f.is_file()]
    if not files:
        raise InputError(f"{d}: directory holds no trace files (*.pt.trace.json[.gz], *.json)")
    return sorted(files)


@contextmanager
def reading(p: Path) -> Iterator[None]:
    """OSErrors while reading `p` become InputError naming the file and the problem."""
    try:
        yield
    except FileNotFoundError:
        raise InputError(f"{p}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{p}: is a directory, not a trace file") from None
    except PermissionError:
        raise InputError(f"{p}: permission denied") from None
    except OSError as e:
        raise InputError(f"{p}: cannot read ({e.strerror or e})") from None


def stamp(f: BinaryIO) -> Stamp:
    """The identity of open file `f` now (what a rewrite changes)."""
    st = os.fstat(f.fileno())
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class FileChanged(InputError):
    """The trace file was rewritten (in place) while it was being read."""


def check_unchanged(p: Path, f: BinaryIO, opened: Stamp) -> None:
    """Raise FileChanged if file `f` (trace `p`) no longer has the identity it was opened with."""
    with reading(p):
        now = stamp(f)
    if now != opened:
        raise FileChanged(f"{p}: changed while it was being read")


@dataclass(frozen=True, eq=False)
class Document:
    """A trace file's JSON text, `size` bytes: in memory (`data`, a gzip file inflated) or read
    from the plain file `path` when needed, always through `file` (opened once, by
    open_document) and checked against its `opened` identity. A context manager that closes it."""

    path: Path
    size: int
    data: bytearray | None = None
    file: BinaryIO | None = None
    opened: Stamp | None = None
    inflater: Inflater | None = None  # filling `data` on its thread (a gzip file, streamed)

    def __enter__(self) -> Document:
        return self

    def __exit__(self, *exc) -> None:
        if self.inflater is not None:
            self.inflater.stop()
        if self.file is not None:
            self.file.close()

    def check(self) -> None:
        """Raise FileChanged if the file is no longer the one opened (rewritten in place)."""
        if self.file is not None:
            assert self.opened is not None  # (open_document gives a file its identity)
            check_unchanged(self.path, self.file, self.opened)

    def read(self, offset: int, n: int) -> bytes:
        """Bytes [offset, offset + n) of the text (fewer at its end)."""
        if self.data is not None:
            if self.inflater is not None:
                self.inflater.wait(offset + n)
            return bytes(self.data[offset : offset + n])
        buf = bytearray(max(min(n, self.size - offset), 0))
        del buf[self.read_into(memoryview(buf), offset) :]
        return bytes(buf)

    def read_into(self, view: memoryview, offset: int) -> int:
        """Fill `view` from offset `offset` of the file (released after); the bytes read (fewer
        at its end), checked to be the opened file's."""
        done = 0
        try:
            assert self.file is not None  # (only a plain file's document is read from its file)
            with reading(self.path):
                while done < len(view) and (got := _pread(self.file.fileno(), view[done:], offset + done)):
                    done += got
        finally:
            view.release()
        self.check()
        return done

    @contextmanager
    def window(self, start: int) -> Iterator[Window]:
        """A Window on the text from offset `start` on."""
        if self.data is not None:
            yield Window(self.data, 0, self) if self.inflater is not None else Window(self.data)
            return
        yield Window(bytearray(min(CHUNK_BYTES, self.size - start + 1)), start, self)

    def whole(self, progress: Progress | None) -> bytearray:
        """All of the text in memory (read now for a plain file, fewer bytes if it shrank):
        ours to patch."""
        if self.data is not None:
            if self.inflater is not None:
                self.inflater.wait(self.size)
            return self.data
        buf, done = bytearray(self.size), 0
        view = memoryview(buf)
        try:
            while done < self.size and (got := self.read_into(view[done : done + CHUNK_BYTES], done)):
                done += got
                if progress:
                    progress("read", done, self.size)
        finally:
            view.release()
        del buf[done:]
        return buf


def _pread(fd: int, view: memoryview, offset: int) -> int:
    """One read of the file at `offset` into `view`, zero-copy where the system has preadv."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)
    data = os.pread(fd, len(view), offset)  # pragma: no cover - no preadv (e.g. older macOS)
    view[: len(data)] = data  # pragma: no cover
    return len(data)  # pragma: no cover


def open_document(p: Path, progress: Progress | None, stream: bool = True) -> Document:
    """The document of trace file `p` (use it as a context manager: it holds the file open);
    a gzip file (by its magic number) is inflated now, or with `stream` (where `_trailer_size`
    tells its size) on the document's `Inflater` thread while it is read."""
    with ExitStack() as closing:
        with reading(p):
            f = closing.enter_context(open_regular(p))  # (a FIFO: refused, never waited on)
            opened = stamp(f)
            size = opened[2]
            if progress:
                progress("read", 0, size)
            if f.read(2) != b"\x1f\x8b":
                closing.pop_all()  # (the document closes it)
                return Document(p, size, file=f, opened=opened)
            inflated = _trailer_size(f, size) if stream else None
            f.seek(0)
            if inflated is not None:
                closing.pop_all()  # (the document's inflater closes it)
                data = bytearray(inflated)
                return Document(p, inflated, data, inflater=Inflater(p, f, opened, data))
            data = gunzip(p, f, size, CHUNK_BYTES, progress)
        check_unchanged(p, f, opened)  # (the compressed bytes were one file's)
    return Document(p, len(data), data)


class Window:
    """Document bytes [lo, hi) in `buf` (buf[i] is byte lo + i): a whole document in memory,
    or a plain file's document `doc` read CHUNK_BYTES at a time into one buffer, keeping only
    what is still needed."""

    def __init__(self, buf: Buffer, lo: int = 0, doc: Document | None = None):
        self.buf, self.lo, self.doc = buf, lo, doc
        self.hi = lo if doc else lo + len(buf)

    def fill(self, keep: int, upto: int) -> bool:
        """Hold at least the bytes [keep, upto), reading on from the file into the rest of the
        buffer (where they do not fit, dropping the bytes before `keep` first, and growing the
        buffer if they still do not fit); False if the text ends first.
        No memoryview of `buf` may be alive (it may be resized)."""
        if self.hi >= upto:
            return True
        if self.doc is None:
            return False
        if self.doc.inflater is not None:  # (the whole document's buffer, filling)
            self.hi = self.doc.inflater.wait(upto)
            return self.hi >= upto
        if upto - self.lo > len(self.buf):  # (only then: a memmove of what is kept)
            n = self.hi - keep
            self.buf[:n] = self.buf[keep - self.lo : self.hi - self.lo]
            self.lo = keep
            if upto - keep > len(self.buf):
                self.buf.extend(bytes(upto - keep + CHUNK_BYTES - len(self.buf)))
        got = self.doc.read_into(memoryview(self.buf)[self.hi - self.lo :], self.hi)
        self.hi += got
        return self.hi >= upto

    def search(self, pattern: re.Pattern, a: int, end: int, keep: int) -> tuple[int, int] | None:
        """Document offsets of group 1 of the first match of `pattern` in bytes [a, end),
        reading on as needed (keeping the bytes from `keep` on); None if there is none."""
        while True:
            m = pattern.search(self.buf, a - self.lo, min(self.hi, end) - self.lo)
            if m:
                return m.start(1) + self.lo, m.end(1) + self.lo
            if self.hi >= end or not self.fill(keep, self.hi + 1):
                return None


class Unstreamed(InputError):
    """A streamed gzip file did not inflate to the size its trailer gave (several members, a
    corrupt or truncated stream, a file rewritten): it is read again without streaming, which
    reports the file's own error, if any."""


def _trailer_size(f: BinaryIO, size: int) -> int | None:
    """The inflated size a gzip file's trailer gives (ISIZE: modulo 4 GiB), when streaming it
    applies: at least STREAM_MIN_BYTES, within `inflation_limit(size)`; else None."""
    if size < 18:
        return None
    f.seek(size - 4)
    (inflated,) = struct.unpack("<I", f.read(4))
    return inflated if STREAM_MIN_BYTES <= inflated <= inflation_limit(size) else None


class Inflater:
    """Inflates one gzip member from file `f` into `data` (exactly its size) on a thread;
    `wait` gives how much is ready. Whatever does not fit that size (another member, a longer
    stream), a corrupt or truncated stream, or a file changed since `opened` stops it: `wait`
    then raises Unstreamed."""

    def __init__(self, p: Path, f: BinaryIO, opened: Stamp, data: bytearray):
        self.path, self.file, self.opened, self.data = p, f, opened, data
        self.done = 0  # bytes of `data` ready
        self.failed = False
        self.stopping = False
        self.ready = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="trace-roofline-inflate", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self._inflate()
        except (OSError, ValueError, inflating.error, InputError):
            self.failed = True
        finally:
            self.file.close()
            with self.ready:
                self.ready.notify_all()

    def _inflate(self) -> None:
        view, n = memoryview(self.data), len(self.data)
        d = inflating.decompressobj(wbits=31)
        try:
            while not self.stopping and (chunk := self.file.read(_PIECE_BYTES >> 2)):
                while True:  # (output buffered inside the stream comes with an empty tail too)
                    piece = d.decompress(chunk, _PIECE_BYTES)
                    chunk = d.unconsumed_tail
                    if self.done + len(piece) > n:
                        raise ValueError("longer than its trailer says")
                    view[self.done : self.done + len(piece)] = piece
                    with self.ready:
                        self.done += len(piece)
                        self.ready.notify_all()
                    if d.eof or (not chunk and len(piece) < _PIECE_BYTES):
                        break
                if d.eof and (chunk or d.unused_data or self.file.read(1)):
                    raise ValueError("more than one member")
            check_unchanged(self.path, self.file, self.opened)
            if not self.stopping and (not d.eof or self.done != n):
                raise ValueError("not the size its trailer says")
        finally:
            view.release()

    def wait(self, upto: int) -> int:
        """Bytes ready once at least min(upto, size) are (or the stream ended); Unstreamed if
        it failed."""
        upto = min(upto, len(self.data))
        with self.ready:
            self.ready.wait_for(lambda: self.done >= upto or not self.thread.is_alive() or self.failed)
        if self.failed or self.done < upto:
            raise Unstreamed(f"{self.path}: could not be streamed")
        return self.done

    def finished(self) -> bool:
        """Whether all of the text is ready (the thread then has ended, or is ending)."""
        return self.done == len(self.data) and not self.failed

    def stop(self) -> None:
        """End the thread (at its next chunk) and wait for it."""
        self.stopping = True
        self.thread.join()


def inflation_limit(size: int) -> int:
    """The most bytes a gzip file of `size` bytes may inflate to (MAX_INFLATION, INFLATION_FLOOR)."""
    return max(INFLATION_FLOOR, MAX_INFLATION * size)


def gunzip(p: Path, f, size: int, chunk: int, progress: Progress | None) -> bytearray:
    """Inflate gzip file `f` (`size` bytes, read `chunk` at a time), concatenated members too
    (zero padding between them ignored, across chunks too), with `inflating` (ISA-L where
    installed, else zlib: the same bytes; a corrupt or truncated file is an InputError with
    either, though ISA-L accepts a header whose reserved flag bits are set). At most `chunk`
    bytes are inflated per call, and a file inflating past `inflation_limit(size)` is an
    InputError (a gzip bomb: memory stays bounded by the limit, not by the inflated size)."""
    out = bytearray()
    limit = inflation_limit(size)
    d, fed, done, between = inflating.decompressobj(wbits=31), False, 0, False
    try:
        while data := f.read(chunk):
            done += len(data)
            while data := (data.lstrip(b"\x00") if between else data):
                while True:  # (output buffered inside the stream comes with an empty tail too)
                    piece = d.decompress(data, chunk)
                    out += piece
                    if len(out) > limit:
                        raise InputError(_bomb(p, size, limit))
                    data = d.unconsumed_tail
                    if d.eof or (not data and len(piece) < chunk):
                        break
                data, fed, between = b"", True, False
                if d.eof:  # next member of a concatenated gzip
                    data, d, fed = d.unused_data, inflating.decompressobj(wbits=31), False
                    between = True
            if progress:
                progress("read", done, size)
    except inflating.error as e:
        raise InputError(f"{p}: corrupt gzip data ({e})") from None
    if fed and not d.eof:
        raise InputError(f"{p}: truncated gzip file (the compressed stream ends early)")
    return out


def _bomb(p: Path, size: int, limit: int) -> str:
    return (f"{p}: inflates to more than {limit / 1e6:.0f} MB, {limit / max(size, 1):.0f}x its "
            f"{size / 1e6:.3g} MB (real traces compress 5-30x): refused as a gzip bomb; if it is "
            "a real trace, gunzip it and pass the .json (a plain file is read in chunks)")
