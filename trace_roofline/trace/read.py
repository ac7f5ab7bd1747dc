"""A trace file's bytes: listing a directory's trace files, opening a document (inflating gzip),
reading it whole or through a sliding `Window`.

Inputs are only ever opened for reading.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from trace_roofline.errors import InputError
from trace_roofline.trace.schema import Progress

try:  # ISA-L's inflate (python-isal, the `gzip` extra): 1.8x zlib's on a 1 GB trace
    from isal import isal_zlib as inflating
except ImportError:  # not installed: the standard library's, which it mirrors
    import zlib as inflating

CHUNK_BYTES = 16 << 20  # a plain file is read this much at a time
Buffer = bytearray | memoryview  # a document's bytes, writable (decoding patches them)


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


@dataclass(frozen=True, eq=False)
class Document:
    """A trace file's JSON text, `size` bytes: in memory (`data`, a gzip file inflated) or read
    from the plain file `path` when needed."""

    path: Path
    size: int
    data: bytearray | None = None

    def read(self, offset: int, n: int) -> bytes:
        """Bytes [offset, offset + n) of the text (fewer at its end)."""
        if self.data is not None:
            return bytes(self.data[offset : offset + n])
        with reading(self.path), open(self.path, "rb") as f:
            f.seek(offset)
            return f.read(n)

    @contextmanager
    def window(self, start: int) -> Iterator[Window]:
        """A Window on the text from offset `start` on (the file stays open while it is used)."""
        if self.data is not None:
            yield Window(self.data)
            return
        with reading(self.path), open(self.path, "rb") as f:
            f.seek(start)
            yield Window(bytearray(min(CHUNK_BYTES, self.size - start + 1)), start, f)

    def whole(self, progress: Progress | None) -> bytearray:
        """All of the text in memory (read now for a plain file, fewer bytes if it shrank):
        ours to patch."""
        if self.data is not None:
            return self.data
        buf = bytearray(self.size)
        with reading(self.path), open(self.path, "rb") as f:
            del buf[read_into(f, buf, self.size, progress, self.size) :]
        return buf


def open_document(p: Path, progress: Progress | None) -> Document:
    """The document of trace file `p`: a gzip file (by its magic number) is inflated now."""
    with reading(p), open(p, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if progress:
            progress("read", 0, size)
        if f.read(2) != b"\x1f\x8b":
            return Document(p, size)
        f.seek(0)
        data = gunzip(p, f, size, CHUNK_BYTES, progress)
        return Document(p, len(data), data)


class Window:
    """Document bytes [lo, hi) in `buf` (buf[i] is byte lo + i): a whole document in memory,
    or a file read CHUNK_BYTES at a time into one buffer, keeping only what is still needed."""

    def __init__(self, buf: Buffer, lo: int = 0, f=None):
        self.buf, self.lo, self.f = buf, lo, f
        self.hi = lo if f else lo + len(buf)

    def fill(self, keep: int, upto: int) -> bool:
        """Hold at least the bytes [keep, upto), reading on from the file into the rest of the
        buffer (where they do not fit, dropping the bytes before `keep` first, and growing the
        buffer if they still do not fit); False if the text ends first.
        No memoryview of `buf` may be alive (it may be resized)."""
        if self.hi >= upto:
            return True
        if self.f is None:
            return False
        if upto - self.lo > len(self.buf):  # (only then: a memmove of what is kept)
            n = self.hi - keep
            self.buf[:n] = self.buf[keep - self.lo : self.hi - self.lo]
            self.lo = keep
            if upto - keep > len(self.buf):
                self.buf.extend(bytes(upto - keep + CHUNK_BYTES - len(self.buf)))
        view = memoryview(self.buf)
        try:
            while self.hi < upto:
                got = self.f.readinto(view[self.hi - self.lo :])
                if not got:
                    return False
                self.hi += got
        finally:
            view.release()
        return True

    def search(self, pattern: re.Pattern, a: int, end: int, keep: int) -> tuple[int, int] | None:
        """Document offsets of group 1 of the first match of `pattern` in bytes [a, end),
        reading on as needed (keeping the bytes from `keep` on); None if there is none."""
        while True:
            m = pattern.search(self.buf, a - self.lo, min(self.hi, end) - self.lo)
            if m:
                return m.start(1) + self.lo, m.end(1) + self.lo
            if self.hi >= end or not self.fill(keep, self.hi + 1):
                return None


def read_into(f, buf, n: int, progress: Progress | None, total: int) -> int:
    """Read n bytes into buf[:n] from f's position; the number read (fewer at EOF)."""
    chunk = CHUNK_BYTES
    view, done = memoryview(buf), 0
    try:
        while done < n:
            got = f.readinto(view[done : min(done + chunk, n)])
            if not got:
                break
            done += got
            if progress:  # (the parent may read only its share while the worker reads the rest)
                progress("read", done * total // n, total)
    finally:
        view.release()
    return done


def gunzip(p: Path, f, size: int, chunk: int, progress: Progress | None) -> bytearray:
    """Inflate gzip file `f` (`size` bytes, read `chunk` at a time), concatenated members too
    (zero padding between them ignored, across chunks too), with `inflating` (ISA-L where
    installed, else zlib: the same bytes; a corrupt or truncated file is an InputError with
    either, though ISA-L accepts a header whose reserved flag bits are set)."""
    out = bytearray()
    d, fed, done, between = inflating.decompressobj(wbits=31), False, 0, False
    try:
        while data := f.read(chunk):
            done += len(data)
            while data := (data.lstrip(b"\x00") if between else data):
                out += d.decompress(data)
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
