"""Small file helpers: JSON inputs read with one-line errors; all-or-nothing writes for the CLI."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

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


def write_files(out_dir: str | Path, files: Mapping[str, bytes]) -> list[Path]:
    """Write `files` (name -> content) into `out_dir` atomically; return the final paths.

    Every file is first written to a temporary sibling; only when all of them are on disk are they
    renamed into place, so a failure leaves no partial or half-written outputs behind.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"{out}: output path exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"{out}: cannot create output directory ({e.strerror})") from None
    staged: list[tuple[str, Path]] = []
    try:
        for name, data in files.items():
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=out)
            staged.append((tmp, out / name))
            with os.fdopen(fd, "wb") as f:
                f.write(data)
    except OSError as e:
        for tmp, _ in staged:
            Path(tmp).unlink(missing_ok=True)
        raise InputError(f"{out}: cannot write outputs ({e.strerror})") from None
    for tmp, final in staged:
        os.replace(tmp, final)
    return [final for _, final in staged]


def write_file(path: str | Path, data: bytes) -> Path:
    """Atomically write one file (temporary sibling, then rename)."""
    p = Path(path)
    return write_files(p.parent if str(p.parent) else ".", {p.name: data})[0]
