"""The CLI process's memory settings: fewer page faults for big, short-lived arrays.

An analysis allocates and frees arrays of 1-30 MB in quick succession, and the kernel zeroes
every page that such a new array touches. By default:
- numpy advises the kernel to back each array of 4 MiB or more with transparent huge pages.
  Where THP is "madvise" with defrag "madvise" (common), a huge-page fault can stall while the
  kernel compacts memory.
- glibc returns a freed block to the kernel (munmap, or a trim at the top of its heap), so the
  next array faults its pages in again.

`tune()` turns numpy's advice off and keeps freed blocks of up to 32 MiB in glibc's heap for
reuse. On the 1 GB HF tile (three interleaved runs each) `attribute` went from 1.02-1.70 to
0.72-1.44 CPU s (its system time from 0.42-0.75 to 0.15-0.42 s) and `roofline.analyze` from
0.54-0.72 to 0.53-0.58 s (benchmarks/README.md, session 5). Only the CLI calls it: a library
does not change its host process's allocator.
"""

from __future__ import annotations

import ctypes
import importlib
import sys

# glibc mallopt parameters (malloc.h) and the values set
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD = 32 << 20  # glibc's maximum: blocks up to this size come from the heap
_TRIM_THRESHOLD = 2**31 - 1  # (an int) keep the heap's free top: never trimmed in practice


def tune() -> None:
    """Apply both settings to this process (and the parse worker it will fork); a numpy
    without the switch or a C library other than glibc is left as it is."""
    for name in ("numpy._core.multiarray", "numpy.core.multiarray"):  # numpy 2, numpy 1
        try:
            multiarray = importlib.import_module(name)
        except ImportError:
            continue
        switch = getattr(multiarray, "_set_madvise_hugepage", None)
        if switch is not None:
            switch(False)
        break
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
        libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)


def _glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc (the only one whose mallopt we know)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None)  # the symbols already loaded: the C library's among them
    if not hasattr(libc, "gnu_get_libc_version"):  # musl
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return libc
