"""A trace file's bytes: listing a directory's trace files, reading into a buffer, inflating gzip.

Inputs are only ever opened for reading.
"""

from __future__ import annotations

import zlib
from pathlib import Path

from trace_roofline.errors import InputError
from trace_roofline.trace.schema import Progress


def trace_files(d: Path) -> list[Path]:
    """The trace files of directory `d`: tensorboard_trace_handler's, else any JSON, sorted."""
    files = sorted(d.glob("*.pt.trace.json")) + sorted(d.glob("*.pt.trace.json.gz"))
    if not files:  # not the tensorboard layout: any JSON trace in the directory
        files = sorted(d.glob("*.json")) + sorted(d.glob("*.json.gz"))
    files = [f for f in files if f.is_file()]
    if not files:
        raise InputError(f"{d}: directory holds no trace files (*.pt.trace.json[.gz], *.json)")
    return sorted(files)


def read_into(f, buf, n: int, progress: Progress | None, total: int) -> int:
    """Read n bytes into buf[:n] from f's position; the number read (fewer at EOF)."""
    chunk = 16 << 20
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
    """Inflate gzip file `f` (`size` bytes, read `chunk` at a time), concatenated members too."""
    out = bytearray()
    d, fed, done = zlib.decompressobj(wbits=31), False, 0
    try:
        while data := f.read(chunk):
            done += len(data)
            while data:
                out += d.decompress(data)
                data, fed = b"", True
                if d.eof:  # next member of a concatenated gzip; zero padding is ignored
                    data = d.unused_data.lstrip(b"\x00")
                    d, fed = zlib.decompressobj(wbits=31), False
            if progress:
                progress("read", done, size)
    except zlib.error as e:
        raise InputError(f"{p}: corrupt gzip data ({e})") from None
    if fed and not d.eof:
        raise InputError(f"{p}: truncated gzip file (the compressed stream ends early)")
    return out
