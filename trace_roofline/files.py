"""Small file helpers: JSON inputs read with one-line errors, trace files found in a directory,
a file's identity for cache keys, and the CLI's writes: all or nothing, never over an input,
a directory's set of outputs swapped in whole, no temporary left behind by a killed run."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import io
import json
import os
import re
import secrets
import shutil
import stat
import sys
import zlib
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import BinaryIO, TypeVar

from trace_roofline.errors import InputError


def read_json(path: str | Path) -> object:
    """Decode a JSON file (a regular file: `open_regular`); any failure is an InputError naming
    the file."""
    p = Path(path)
    try:
        with open_regular(p) as f:
            return json.loads(f.read())
    except FileNotFoundError:
        raise InputError(f"{p}: no such file") from None
    except OSError as e:
        raise InputError(f"{p}: cannot read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise InputError(f"{p}: not valid JSON ({e})") from None


def kind_of(mode: int) -> str:
    """What a file of `mode` is, in words ('a FIFO', 'a directory', ...)."""
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"))
    return next((word for test, word in kinds if test(mode)), "not a regular file")


def open_regular(path: str | Path) -> io.BufferedReader:
    """`path` opened for binary reading, or an InputError naming it when it is not a regular
    file: a FIFO would block `open` until some writer came (forever), a device or a socket is
    no file to analyse. Checked before the open (nothing but a regular file is opened) and
    again on the descriptor, opened without blocking, in case the path changed in between.
    OSError (a missing file, no permission) as `open` raises it."""
    p = Path(path)
    st = os.stat(p)
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{p}: is {kind_of(st.st_mode)}, not a regular file: give a file")
    nonblock = getattr(os, "O_NONBLOCK", 0)
    f = open(p, "rb", opener=lambda name, flags: os.open(name, flags | nonblock))  # noqa: SIM115
    try:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{p}: is {kind_of(st.st_mode)}, not a regular file: give a file")
        if nonblock:  # (no effect on a regular file's reads; cleared all the same)
            fd = f.fileno()
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~nonblock)
    except BaseException:
        f.close()
        raise
    return f


def check_replaceable(path: str | Path, label: str = "output") -> None:
    """Raise InputError when `path` exists (its final target, through symlinks) and is not a
    regular file: a device node, a FIFO, a socket or a directory is never replaced by an
    output (renaming a report over `/dev/full` replaced the device node)."""
    try:
        st = os.stat(path)
    except OSError:
        return  # a new path (or a dangling link): created
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{path}: {label} exists and is {kind_of(st.st_mode)}, not a regular "
                         "file: refusing to replace it (give a new path or a regular file)")


# How much of a file is read to tell a trace from another JSON file: Kineto writes
# schemaVersion, deviceProperties and a few small keys before "traceEvents".
SNIFF_BYTES = 1 << 20

# The content sample of `identity`: this many bytes at each end of the file, and BLOCKS blocks
# of BLOCK bytes evenly spaced between them (160 KiB in all: a file up to that is hashed whole).
SAMPLE_EDGE = 64 << 10
SAMPLE_BLOCK = 4 << 10
SAMPLE_BLOCKS = 8


def identity(path: Path) -> dict[str, object]:
    """What identifies a file's content for a cache key: its resolved path, device, inode, size,
    mtime, ctime (`st_ctime_ns`: the kernel sets it on every write, rename or chmod, and `touch
    -r` cannot set it back) and, for a regular file, a hash of a sample of its bytes
    (`content_sample`). OSError when it cannot be stat-ed (a missing file)."""
    p = path.resolve()
    st = os.stat(p)
    sample = None
    if stat.S_ISREG(st.st_mode):  # (never open a FIFO or a device: it may block)
        try:
            fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except OSError:
            fd = -1  # unreadable: the analysis will say so
        if fd >= 0:
            try:
                st = os.fstat(fd)  # the times and the sample of the one file opened
                sample = content_sample(fd, st.st_size)
            finally:
                os.close(fd)
    return {"path": str(p), "device": st.st_dev, "inode": st.st_ino, "size": st.st_size,
            "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "sample": sample}


def content_sample(fd: int, size: int) -> str:
    """BLAKE2b of the first and last SAMPLE_EDGE bytes of an open file and of SAMPLE_BLOCKS
    evenly spaced blocks of SAMPLE_BLOCK bytes between them (the whole file when it is no
    larger): ~20 reads, whatever the file's size."""
    h = hashlib.blake2b(digest_size=16)
    whole = 2 * SAMPLE_EDGE + SAMPLE_BLOCKS * SAMPLE_BLOCK
    if size <= whole:
        spans = [(0, size)]
    else:
        step = (size - 2 * SAMPLE_EDGE - SAMPLE_BLOCK) // (SAMPLE_BLOCKS - 1)
        spans = [(0, SAMPLE_EDGE),
                 *((SAMPLE_EDGE + i * step, SAMPLE_BLOCK) for i in range(SAMPLE_BLOCKS)),
                 (size - SAMPLE_EDGE, SAMPLE_EDGE)]
    for offset, length in spans:
        while length > 0:
            chunk = os.pread(fd, min(length, 1 << 20), offset)
            if not chunk:
                break  # shorter than its size said (truncated meanwhile): the key will differ
            h.update(chunk)
            offset, length = offset + len(chunk), length - len(chunk)
    return h.hexdigest()


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
    tensorboard = [f for f in tensorboard if f.is_file()]  # (a FIFO named *.json: never opened)
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
        with open_regular(path) as f:
            head = f.read(SNIFF_BYTES)
        if head[:2] == b"\x1f\x8b":
            head = zlib.decompressobj(wbits=31).decompress(head, SNIFF_BYTES)
    except (OSError, zlib.error, InputError):
        return True
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    return b'"traceEvents"' in head or text.startswith(b"[")


def check_targets(paths: Iterable[str | Path]) -> None:
    """Raise InputError unless every path can become a file: not a directory nor any other
    file but a regular one (`check_replaceable`), and its nearest existing ancestor a
    directory. Call it before long work whose results go there."""
    for path in map(Path, paths):
        if path.is_dir():
            raise InputError(f"{path}: is a directory, expected a file path")
        check_replaceable(path)
        for parent in path.parents:
            if parent.exists():
                if not parent.is_dir():
                    raise InputError(f"{parent}: exists and is not a directory")
                break


def check_outputs(outputs: Iterable[tuple[str, str | Path]],
                  inputs: Iterable[str | Path | None] = ()) -> None:
    """Raise InputError when an output (label, path) exists and is not a regular file
    (`check_replaceable`), is one of the input files, or two outputs are one file: paths
    compared resolved, and by device and inode where both exist (a hard link or a symlink to
    the same file). Call it before the work, with every output the command may write."""
    given = [Path(p) for p in inputs if p is not None and str(p)]
    known = [(p, _where(p)) for p in given]
    seen: list[tuple[str, Path, tuple]] = []
    for label, out in outputs:
        o = Path(out)
        check_replaceable(o, label)
        where = _where(o)
        for i, iw in known:
            if _same(where, iw):
                raise InputError(f"{o}: {label} would overwrite the input {i}; "
                                 "choose another output path")
        for other, op, ow in seen:
            if _same(where, ow):
                raise InputError(f"{o}: {label} is also {other} ({op}); give each its own path")
        seen.append((label, o, where))


def _where(path: Path) -> tuple[str, tuple[int, int] | None]:
    """(resolved path, (device, inode) when it exists) of a path."""
    try:
        st = os.stat(path)
        inode = (st.st_dev, st.st_ino)
    except OSError:
        inode = None
    return str(path.resolve()), inode


def _same(a: tuple[str, tuple[int, int] | None], b: tuple[str, tuple[int, int] | None]) -> bool:
    return a[0] == b[0] or (a[1] is not None and a[1] == b[1])


# A temporary of this module: `.<target name>.<12 hex digits>.tmp`, a file beside the file it
# becomes or a directory beside the directory it replaces. Its writer holds an exclusive flock
# on it while it lives, so one that nobody holds was left by a killed run (`_sweep`).
_TEMP = re.compile(r"^\.(?P<name>.+)\.[0-9a-f]{12}\.tmp$")


def _temp_name(name: str) -> str:
    return f".{name}.{secrets.token_hex(6)}.tmp"


# A path as write_files' callers give it (a mapping's keys are one type or both).
_PathLike = TypeVar("_PathLike", bound=str | Path)


def write_files(files: Mapping[_PathLike, bytes], *, inputs: Iterable[str | Path | None] = (),
                sets: Mapping[str | Path, Collection[str]] | None = None) -> list[Path]:
    """Write every file (path -> content) or none; return the final paths.

    All targets are checked first (`check_targets`; `check_outputs` against `inputs`: no
    output may replace an input). Temporaries that killed runs left for these targets are
    removed (`_sweep`). The files are then staged in full (created with the user's umask) and
    only then moved into place, so a failure leaves no partial or half-written output and
    raises an InputError. A directory of `sets` (directory -> every name its set may hold)
    is written as one set: staged in a temporary directory beside it and swapped in by one
    rename (`_swap`), so it holds the complete old set or the complete new one at every
    instant, even under kill -9. That needs a real directory on the parent's file system
    holding nothing but names of its set (no input) and Linux's renameat2 where it exists
    already; otherwise (and for other files) each file is replaced by its own rename: each
    file is complete, a kill between two renames leaves old and new files side by side.
    """
    targets = {Path(path): data for path, data in files.items()}
    check_targets(targets)
    input_paths = [Path(i) for i in inputs if i is not None and str(i)]
    check_outputs([("output", p) for p in targets], input_paths)
    groups: dict[Path, dict[str, bytes]] = {}
    for path, data in targets.items():
        groups.setdefault(path.parent, {})[path.name] = data
    whole = {Path(d): frozenset(names) for d, names in (sets or {}).items()}
    stages: list[_Stage] = []
    try:
        for directory, named in groups.items():
            names = whole.get(directory)
            swap = names is not None and _swappable(directory, names | named.keys(), input_paths)
            stages.append(_Stage.of(directory, named, swap))
        for stage in stages:
            stage.commit()
    except OSError as e:
        where = e.filename or next(iter(targets), "")
        raise InputError(f"{where}: cannot write output ({e.strerror})") from None
    finally:
        for stage in stages:
            stage.close()
    return list(targets)


@dataclass
class _Stage:
    """The staged new files of one directory: temporaries beside their targets (`swap`
    False), or one temporary directory beside the directory (`swap`), each flock-ed."""

    directory: Path
    names: list[str]
    swap: bool
    temps: list[Path] = field(default_factory=list)
    locks: list[int] = field(default_factory=list)  # open descriptors holding the flocks

    @classmethod
    def of(cls, directory: Path, named: Mapping[str, bytes], swap: bool) -> _Stage:
        """Sweep stale temporaries, then stage every file (an OSError on any failure, after
        which `close` removes what was staged)."""
        stage = cls(directory, list(named), swap)
        try:
            _sweep(directory, named.keys())
            _sweep(directory.parent, {directory.name})  # a set staged beside it, killed
            if swap:
                directory.parent.mkdir(parents=True, exist_ok=True)
                stage._stage_directory(named)
            else:
                directory.mkdir(parents=True, exist_ok=True)
                for name, data in named.items():
                    stage._stage_file(directory / _temp_name(name), data)
        except BaseException:
            stage.close()
            raise
        return stage

    def _stage_directory(self, named: Mapping[str, bytes]) -> None:
        tmp = self.directory.parent / _temp_name(self.directory.name)
        os.mkdir(tmp)  # (the mode a new directory gets; an existing one's is copied at the swap)
        self.temps.append(tmp)
        self.locks.append(_locked(tmp))
        for name, data in named.items():
            with open(tmp / name, "xb") as f:
                f.write(data)

    def _stage_file(self, tmp: Path, data: bytes) -> None:
        f = open(tmp, "xb")  # noqa: SIM115 (kept open: its descriptor holds the lock)
        self.temps.append(tmp)
        self.locks.append(os.dup(f.fileno()))
        with f:
            _try_lock(self.locks[-1])
            f.write(data)

    def commit(self) -> None:
        """Move the staged files into place."""
        if not self.swap:
            for tmp, name in zip(self.temps, self.names, strict=True):
                _move(tmp, self.directory / name)
        elif not _swap(self.temps[0], self.directory):  # no atomic swap here: file by file
            for name in self.names:
                _move(self.temps[0] / name, self.directory / name)

    def close(self) -> None:
        """Remove what is left of the stage (after a swap: the old set) and release the locks."""
        for tmp in self.temps:
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
        for fd in self.locks:
            os.close(fd)
        self.temps, self.locks = [], []


def _move(src: Path, dst: Path) -> None:
    """One staged file into place (a rename: `dst` is old or new, never partial); never over
    anything but a regular file or a symlink (checked again here: the path may have become a
    device node or a FIFO since the checks before the work)."""
    with contextlib.suppress(FileNotFoundError):
        mode = os.lstat(dst).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
            raise InputError(f"{dst}: output exists and is {kind_of(mode)}, not a regular file: "
                             "refusing to replace it (give a new path or a regular file)")
    os.replace(src, dst)


def _swappable(directory: Path, names: Collection[str], inputs: Iterable[Path]) -> bool:
    """Whether `directory` may be replaced whole by a new set: absent, or a real directory
    (no symlink, no mount point, not the working directory or above it) whose every entry is
    a regular file named in `names` and no input, in a writable parent."""
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        here, parent = directory.resolve(), directory.parent
        if (not stat.S_ISDIR(st.st_mode) or os.stat(parent).st_dev != st.st_dev
                or not os.access(parent, os.W_OK | os.X_OK) or Path.cwd().is_relative_to(here)
                or any(p.resolve().parent == here for p in inputs)):
            return False
        entries = list(os.scandir(directory))
    except OSError:
        return False
    return all(e.name in names and e.is_file(follow_symlinks=False) for e in entries)


def _swap(staged: Path, directory: Path) -> bool:
    """Put the staged directory in place of `directory` in one rename: a plain rename when
    `directory` is absent or empty, else Linux's renameat2(RENAME_EXCHANGE) (the old set is
    then at `staged`). False, with nothing changed, where neither can be done."""
    try:
        os.rename(staged, directory)
        return True
    except OSError as e:
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
    os.chmod(staged, stat.S_IMODE(os.stat(directory).st_mode))  # the directory's own mode
    return _exchange(staged, directory)


@cache
def _renameat2() -> Callable[..., int] | None:
    """libc's renameat2 (glibc >= 2.28, Linux >= 3.15), None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically; False where the system or the file system cannot."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EXDEV, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _locked(path: Path) -> int:
    """An open descriptor of `path` holding an exclusive flock on it (where flock works)."""
    fd = os.open(path, os.O_RDONLY)
    _try_lock(fd)
    return fd


def _try_lock(fd: int) -> None:
    """Take an exclusive flock on fd (a file system without flock: the temporary is then never
    swept, `_held`)."""
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _held(path: Path) -> bool:
    """Whether a live process may still be writing the temporary `path`: someone holds its
    flock, or it cannot be told."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:  # (BlockingIOError: held)
        return True
    finally:
        os.close(fd)


def _sweep(directory: Path, names: Iterable[str]) -> None:
    """Remove this user's temporaries for `names` in `directory` that no live writer holds:
    the leftovers of a run killed while it wrote them."""
    wanted = set(names)
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for e in entries:
        m = _TEMP.match(e.name)
        if m is None or m["name"] not in wanted:
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid != os.getuid() or _held(Path(e.path)):
            continue
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(e.path, ignore_errors=True)
        elif stat.S_ISREG(st.st_mode):
            with contextlib.suppress(OSError):
                os.unlink(e.path)


@contextmanager
def staged_file(path: str | Path) -> Iterator[BinaryIO]:
    """A file too big to render in memory, streamed into a hidden temporary sibling of `path`
    (flock-ed; stale ones of `path` are swept first) that is renamed into place when the block
    ends without an error and removed otherwise."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{path}: is a directory, expected a file path")
    check_replaceable(path)
    stage = _Stage(path.parent, [path.name], swap=False)
    try:
        _sweep(path.parent, {path.name})
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / _temp_name(path.name)
        with open(tmp, "xb") as f:
            stage.temps.append(tmp)
            stage.locks.append(os.dup(f.fileno()))
            _try_lock(stage.locks[-1])
            yield f
        stage.commit()
    except OSError as e:
        raise InputError(f"{e.filename or path}: cannot write output ({e.strerror})") from None
    finally:
        stage.close()
