"""Small file helpers: JSON inputs read with one-line errors; all-or-nothing writes for the CLI."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator, Mapping
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


def write_files(files: Mapping[str | Path, bytes]) -> list[Path]:
    """Write every file (path -> content) or none; return the final paths.

    All targets are checked first (parent directory creatable, target not a directory). Each
    file is then written to a hidden temporary sibling (created with the user's umask); only when
    all of them are on disk are they renamed into place. Any failure removes what was staged and
    raises an InputError, so no partial or half-written output is left behind.
    """
    targets = {Path(path): data for path, data in files.items()}
    for path in targets:
        if path.is_dir():
            raise InputError(f"{path}: is a directory, expected a file path")
        for parent in path.parents:
            if parent.exists():
                if not parent.is_dir():
                    raise InputError(f"{parent}: exists and is not a directory")
                break
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
