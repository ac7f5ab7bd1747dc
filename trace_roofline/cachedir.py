"""The cache's directories, manifests and checksums, and finished answers: standard library only,
so that `cache info`, `cache clear` and a cached answer load no pandas, pyarrow or numpy.

Design notes: docs/cache.md; the Arrow parts live in trace_roofline/cache.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import mmap
import os
import re
import secrets
import shutil
import stat
import zlib
from collections.abc import Mapping
from functools import cache
from pathlib import Path

SCHEMA_VERSION = 4  # bump when the layout or the meaning of a cached file changes
# (2: zstd; 3: pickles with their buffers out of band; 4: no pickle, private dirs, CACHEDIR.TAG)
ENV_DIR = "TRACE_ROOFLINE_CACHE_DIR"
_VERSION_DIR = re.compile(r"^v(\d+)$")
# The Cache Directory Tagging Specification's tag (backup tools skip a directory holding it):
# `clear` deletes a version directory only when it holds this file as the cache wrote it.
_TAG = "CACHEDIR.TAG"
_TAG_TEXT = ("Signature: 8a477f597d28d172789f06886806bc55\n"
             "# This file is a cache directory tag created by trace-roofline.\n"
             "# For information about cache directory tags see https://bford.info/cachedir/\n")
_ENTRY_DIR = re.compile(r"^[0-9a-f]{32}$")
_TMP_DIR = re.compile(r"^\.tmp-[0-9a-f]{16}$")
_PART_FILE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*\.(?:arrow|json)$")
MANIFEST = "manifest.json"
# Part kinds, the start of a part's directory name: <kind>[-<digest>]
TRACE_PART, ATTRIBUTED, ANALYSIS, ANSWER = "trace", "attributed", "analysis", "answer"
READ_ERRORS: tuple[type[Exception], ...] = (OSError, ValueError, KeyError, TypeError,
                                            AttributeError, RecursionError)


@dataclasses.dataclass(frozen=True)
class CacheInfo:
    """The cache directory and what it holds: entries (cached source files) and the complete
    parts of each kind, parsed trace tables (one per file), attributions (one per file and
    model) and finished analyses (one per file and argument set)."""

    directory: Path
    entries: int
    traces: int
    attributions: int
    analyses: int
    total_bytes: int


def cache_dir() -> Path:
    """`$TRACE_ROOFLINE_CACHE_DIR`, else `$XDG_CACHE_HOME/trace-roofline`, else
    `~/.cache/trace-roofline` (empty variables count as unset, as XDG says)."""
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "trace-roofline"


@cache
def code_fingerprint() -> str:
    """SHA-256 of every .py and .json file of the analyzer package (its code and its model
    presets): any change (a new release, a new column, a fixed rule) invalidates every
    cached part."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for f in sorted([*root.rglob("*.py"), *root.rglob("*.json")]):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


class NotPrivate(OSError):
    """A cache directory another user owns or may write: never read, never written."""


def private_dir(path: Path) -> bool:
    """A real directory (no symlink) of the current user that group and others cannot write."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def owned_file(path: Path) -> os.stat_result | None:
    """The stat of a regular file (no symlink) of the current user, else None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() else None


def owned_dir(path: Path) -> bool:
    """A real directory (no symlink) of the current user, whatever its mode."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()


def ensure_private(path: Path) -> None:
    """Create the directory `path` (mode 0700) unless it exists, close one of this user's to
    group and others (what they may have put in it is another user's, never read: `CacheDir.verified`);
    NotPrivate unless it is then `private_dir` (another user's, or a symlink)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if owned_dir(path) and not private_dir(path):
        os.chmod(path, 0o700)
    if not private_dir(path):
        raise NotPrivate(0, f"{path} is not a private directory of this user (owned by another "
                            "user, or a symlink): not used")


def cache_base(directory: Path) -> Path:
    """Where the cache's version directories go: `directory` itself when it is this user's own
    directory that others cannot write (or does not exist yet: it is then created, 0700), else
    this user's own subdirectory `trace-roofline-<uid>` of it. So a shared directory (`/tmp`:
    world-writable), one of another user, or a file system's root (`/`) is never filled with
    `v<N>` directories, and another user's `v<N>` there cannot turn this user's cache off; the
    subdirectory must be private in turn (`ensure_private`: one that another user made first
    is refused with a note, never used). (A group-writable directory of the user's own, as
    user-private groups make them, is used: its version directory is private all the same.)"""
    try:
        st = os.stat(directory)
    except OSError:
        return directory  # (missing: created by this user; unreadable: the write says so)
    own = (stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()
           and not st.st_mode & stat.S_IWOTH)
    resolved = directory.resolve()
    return directory if own and resolved.parent != resolved else directory / f"trace-roofline-{os.getuid()}"


def tagged(version: Path) -> bool:
    """The directory holds this cache's CACHEDIR.TAG (a regular file of this user, as written)."""
    f = version / _TAG
    if owned_file(f) is None:
        return False
    try:
        return f.read_text() == _TAG_TEXT
    except (OSError, UnicodeDecodeError):
        return False


def legacy_layout(version: Path) -> bool:
    """A version directory of a cache from before the tag: nothing in it but entries (32 hex
    digits) and write temporaries (.tmp-<16 hex digits>), all directories."""
    try:
        return all(d.is_dir() and not d.is_symlink()
                   and (_ENTRY_DIR.match(d.name) or _TMP_DIR.match(d.name))
                   for d in version.iterdir())
    except OSError:
        return False


def manifest_files(manifest: object, key: dict) -> dict[str, tuple[int, int]] | None:
    """name -> (bytes, crc32) of a manifest built for `key`; None unless it is well formed:
    an object with that key and a `files` object of safe names (`_PART_FILE`), each with an
    integer length and checksum."""
    if not isinstance(manifest, dict) or manifest.get("key") != key:
        return None
    listed = manifest.get("files")
    if not isinstance(listed, dict):
        return None
    out: dict[str, tuple[int, int]] = {}
    for name, rec in listed.items():
        if not (isinstance(name, str) and _PART_FILE.match(name) and isinstance(rec, dict)):
            return None
        size, crc = rec.get("bytes"), rec.get("crc32")
        if type(size) is not int or type(crc) is not int:
            return None
        out[name] = (size, crc)
    return out


def crc32(path: Path) -> int:
    """CRC-32 of the file at `path` (read through a private map; an empty file is 0)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return 0
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return zlib.crc32(data)


class CacheDir:
    """The cache at `directory` (default `cache_dir()`; its version directories in
    `cache_base(directory)`): its entries' parts, verified on read and written whole."""

    WRITE_ERRORS: tuple[type[Exception], ...] = (OSError, ValueError)

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        self.directory = Path(directory) if directory is not None else cache_dir()
        self.base = cache_base(self.directory)
        self.root = self.base / f"v{SCHEMA_VERSION}"

    def entry(self, path: str) -> Path:
        """The entry directory of the source file at absolute path `path`."""
        return self.root / hashlib.sha256(path.encode()).hexdigest()[:32]

    def info(self) -> CacheInfo:
        """Entries, complete parts of each kind and bytes on disk (temporary leftovers
        included), of this cache's version directories (`version_dirs`)."""
        entries = size = 0
        kinds: list[str] = []  # one per complete part: "trace", "attributed", "analysis", ...
        for version in self.version_dirs():
            for entry in version.iterdir():
                found = list(entry.glob(f"*/{MANIFEST}")) if private_dir(entry) else []
                entries += bool(found)
                kinds += (m.parent.name.partition("-")[0] for m in found)
            size += sum(f.stat().st_size for f in version.rglob("*") if f.is_file())
        return CacheInfo(self.base, entries, kinds.count(TRACE_PART),
                         kinds.count(ATTRIBUTED), kinds.count(ANALYSIS), size)

    def clear(self) -> int:
        """Remove this cache's version directories (`version_dirs`: those it tagged, nothing
        else in the directory); return the bytes freed."""
        freed = self.info().total_bytes
        for version in self.version_dirs():
            shutil.rmtree(version, ignore_errors=True)
        return freed

    def version_dirs(self) -> list[Path]:
        """The `v<N>` directories of this user that this cache wrote: holding its CACHEDIR.TAG
        (a file of this user), or (before version 4, which wrote none) nothing but its layout of
        entries and temporaries."""
        try:
            found = sorted(self.base.iterdir())
        except OSError:
            return []
        out = []
        for d in found:
            m = _VERSION_DIR.match(d.name)
            if m is None or not owned_dir(d):
                continue
            if tagged(d) or (int(m[1]) < 4 and legacy_layout(d)):
                out.append(d)
        return out

    def verified(self, part: Path, key: dict) -> dict[str, Path] | None:
        """name -> file of the part, when the version directory, the entry and the part are
        `private_dir`s, the manifest is well formed and was built for `key`, and every file it
        lists is a regular file of this user with its recorded length and CRC-32; else None."""
        if not all(private_dir(d) for d in (*self._subdir(), self.root, part.parent, part)):
            return None
        try:
            manifest = json.loads((part / MANIFEST).read_bytes())
            listed = manifest_files(manifest, key)
            if listed is None:
                return None
            found: dict[str, Path] = {}
            for name, (size, crc) in listed.items():
                f = part / name
                st = owned_file(f)
                if st is None or st.st_size != size or crc32(f) != crc:
                    return None
                found[name] = f
            return found
        except READ_ERRORS:
            return None

    def write(self, entry: Path, name: str, key: dict, rendered: Mapping[str, object],
              errors: list[str]) -> None:
        """Write rendered files (`write_file`'s) and their manifest to a temporary directory
        of the (private, tagged) version directory, then rename it to entry/name; failures
        are appended to `errors`. No pandas here (it runs on the cache's writer thread)."""
        tmp = self.root / f".tmp-{secrets.token_hex(8)}"
        try:
            self._ensure_root()
            tmp.mkdir(mode=0o700)
            manifest: dict[str, dict] = {}
            for fname, data in rendered.items():
                self.write_file(data, tmp / fname)
                manifest[fname] = {}
            for fname, rec in manifest.items():
                rec.update(bytes=(tmp / fname).stat().st_size, crc32=crc32(tmp / fname))
            (tmp / MANIFEST).write_text(json.dumps({"key": key, "files": manifest}))
            ensure_private(entry)
            if (entry / name).is_symlink():
                (entry / name).unlink()
            shutil.rmtree(entry / name, ignore_errors=True)  # a stale or corrupt part
            os.rename(tmp, entry / name)
        except self.WRITE_ERRORS as e:
            errors.append(f"cannot write {name} to {self.base}: "
                          f"{getattr(e, 'strerror', None) or e}")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def write_file(self, data: object, path: Path) -> None:
        """Write one rendered file: bytes as they are."""
        if not isinstance(data, bytes):
            raise TypeError(f"cannot write a {type(data).__name__}")
        path.write_bytes(data)

    # ------------------------------------------------------------------------------------------
    # Finished answers: what a command printed and the files it wrote, by name, for one key.
    def answer(self, key: dict) -> dict[str, bytes] | None:
        """The files stored by `store_answer` under `key` (verified), else None; only while
        every trace of the key still has a finished analysis (an answer renders them: one
        removed, as stale or malformed, takes its answers along)."""
        if not all(any(self.entry(t["path"]).glob(f"{ANALYSIS}-*/{MANIFEST}")) for t in key["traces"]):
            return None
        part = self._answer_part(key)
        found = self.verified(part, key)
        if found is None:
            return None
        try:
            names = json.loads(found.pop(_ANSWER_NAMES).read_bytes())
            if (not isinstance(names, list) or len(names) != len(found)
                    or not all(isinstance(n, str) for n in names)):
                return None
            return {n: found[f"{i}.json"].read_bytes() for i, n in enumerate(names)}
        except READ_ERRORS:
            return None

    def store_answer(self, key: dict, answer: Mapping[str, bytes]) -> list[str]:
        """Keep `answer` (name -> bytes) for `answer(key)`; the write's errors."""
        names = list(answer)
        rendered = {_ANSWER_NAMES: json.dumps(names).encode(),
                    **{f"{i}.json": answer[n] for i, n in enumerate(names)}}
        errors: list[str] = []
        part = self._answer_part(key)
        self.write(part.parent, part.name, key, rendered, errors)
        return errors

    def _answer_part(self, key: dict) -> Path:
        first = key["traces"][0]["path"]  # (the entry of the first trace holds it)
        return self.entry(first) / f"{ANSWER}-{digest(key)[:16]}"

    def _subdir(self) -> tuple[Path, ...]:
        """The per-user subdirectory holding the version directories (`cache_base`), if any."""
        return (self.base,) if self.base != self.directory else ()

    def _ensure_root(self) -> None:
        """The version directory (and the per-user subdirectory above it), private (mode
        0700), tagged as this cache's."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)  # (a new one: private)
        for d in self._subdir():
            ensure_private(d)
        ensure_private(self.root)
        if not tagged(self.root):
            tmp = self.root / f".tag-{secrets.token_hex(8)}"
            tmp.write_text(_TAG_TEXT)
            os.replace(tmp, self.root / _TAG)


_ANSWER_NAMES = "names.json"  # an answer part's file names, in order (its files: 0.json, ...)
