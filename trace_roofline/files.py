"""Small file helpers: JSON inputs read with one-line errors, trace files found in a directory,
all-or-nothing writes for the CLI."""

from __future__ import annotations

import json
import os
import secrets
import zlib
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from trace_roofline.errors import InputError


def read_json(path: str | Path) -> object:
    """Decode a JSON file; any failure is an InputError naming the file."""
    p = Path(path)
    try:
        return json.loads(p.read_bytes())
    except FileNotFoundError:
        raise InputError(f"{p}: no such file") from None
    except OSError as e:
        raise InputError(f"{p}: cannot read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise InputError(f"{p}: not valid JSON ({e})") from None


# How much of a file is read to tell a trace from another JSON file: Kineto writes
# schemaVersion, deviceProperties and a few small keys before "traceEvents".
SNIFF_BYTES = 1 << 20



def identity(path: Path) -> dict[str, object]:
    """What identifies a file's content for a cache key: its resolved path, size, mtime, inode."""
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "inode": st.st_ino}


def find_traces(directory: str | Path) -> tuple[list[Path], list[Path]]:
    """(trace files, skipped files) of a directory, each sorted by path.

    The tensorboard_trace_handler layouts count: `DIR/*.pt.trace.json[.gz]` and the plugin
    layout `DIR/plugins/profile/*/*.pt.trace.json[.gz]`; failing both, every `*.json[.gz]` in
    DIR. A JSON file whose first MiB holds no "traceEvents" key and which is not a bare event
    array (a sweep's .results.json, a report.json, a hardware JSON) is skipped, as is every other
    file directly in DIR. Raises InputError when no trace is left.
    """
    d = Path(directory)
    files = sorted(f for f in d.iterdir() if f.is_file())
    tensorboard = sorted({*d.glob("*.pt.trace.json"), *d.glob("*.pt.trace.json.gz"),
                          *d.glob("plugins/profile/*/*.pt.trace.json"),
                          *d.glob("plugins/profile/*/*.pt.trace.json.gz")})
    candidates = tensorboard or [f for f in files if f.name.endswith((".json", ".json.gz"))]
    traces = [f for f in candidates if _looks_like_trace(f)]
    skipped = sorted(set(files) - set(traces))
    if not traces:
        raise InputError(f"{d}: directory holds no trace files (*.pt.trace.json[.gz], "
                         "plugins/profile/*/*.pt.trace.json[.gz], *.json[.gz] with traceEvents)")
    return traces, skipped


def _looks_like_trace(path: Path) -> bool:
    """A Chrome trace: "traceEvents" in its first MiB, or a top-level event array. A file that
    cannot be read or decompressed counts as a trace, so that loading it names the problem."""
    try:
        with open(path, "rb") as f:
            head = f.read(SNIFF_BYTES)
        if head[:2] == b"\x1f\x8b":
            head = zlib.decompressobj(wbits=31).decompress(head, SNIFF_BYTES)
    except (OSError, zlib.error):
        return True
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    return b'"traceEvents"' in head or text.startswith(b"[")


def check_targets(paths: Iterable[str | Path]) -> None:
    """Raise InputError unless every path can become a file: not a directory, and its nearest
    existing ancestor a directory. Call it before long work whose results go there."""
    for path in map(Path, paths):
        if path.is_dir():
            raise InputError(f"{path}: is a directory, expected a file path")
        for parent in path.parents:
            if parent.exists():
                if not parent.is_dir():
                    raise InputError(f"{parent}: exists and is not a directory")
                break


def write_files(files: Mapping[str | Path, bytes]) -> list[Path]:
    """Write every file (path -> content) or none; return the final paths.

    All targets are checked first (`check_targets`). Each file is then written to a hidden
    temporary sibling (created with the user's umask); only when all of them are on disk are
    they renamed into place. Any failure removes what was staged and raises an InputError, so
    no partial or half-written output is left behind.
    """
    targets = {Path(path): data for path, data in files.items()}
    check_targets(targets)
    staged: list[tuple[Path, Path]] = []
    try:
        for path, data in targets.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
            staged.append((tmp, path))
            with open(tmp, "xb") as f:
                f.write(data)
        for tmp, path in staged:
            os.replace(tmp, path)
    except OSError as e:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        where = e.filename or next(iter(targets), "")
        raise InputError(f"{where}: cannot write output ({e.strerror})") from None
    return list(targets)


@contextmanager
def staged_file(path: str | Path) -> Iterator[BinaryIO]:
    """A file too big to render in memory, streamed into a hidden temporary sibling of `path`
    that is renamed into place when the block ends without an error and removed otherwise."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{path}: is a directory, expected a file path")
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "xb") as f:
            yield f
        os.replace(tmp, path)
    except OSError as e:
        raise InputError(f"{e.filename or path}: cannot write output ({e.strerror})") from None
    finally:
        tmp.unlink(missing_ok=True)
