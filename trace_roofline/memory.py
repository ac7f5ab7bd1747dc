"""The CLI process's memory settings: fewer page faults for big, short-lived arrays.

Design notes: docs/design.md ("trace_roofline/memory.py").
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
