"""Fixtures shared by every test module: the one trace builder (tests/builders.py).

Tests import the builder as `from tests.builders import ...` (tests/ is a package) or take these
fixtures: `kineto`, a fresh event writer, and `trace_file`, which writes a builder document
into the test's temporary directory.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.builders import Kineto, write

try:  # tqdm's monitor thread (HF's progress bars start it) never ends, and while another
    # thread runs the trace parser forks no worker: the two-process tests could not run
    import tqdm

    tqdm.tqdm.monitor_interval = 0
except ImportError:
    pass


@pytest.fixture
def kineto() -> Kineto:
    """A fresh `Kineto` event writer."""
    return Kineto()


@pytest.fixture
def trace_file(tmp_path: Path) -> Callable[..., Path]:
    """`trace_file(doc_or_writer, name="t.json", device="NVIDIA H200")` -> the written path."""

    def make(doc: dict | Kineto, name: str = "t.json", device: str | None = "NVIDIA H200") -> Path:
        path = tmp_path / name
        if isinstance(doc, Kineto):
            return doc.write(path, device=device)  # gzipped when the name ends in .gz
        return write(doc, path)

    return make


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir(tmp_path_factory):
    """The parsed-trace cache goes to a temporary directory, never the user's."""
    with pytest.MonkeyPatch.context() as mp:  # subprocesses inherit the variable too
        mp.setenv("TRACE_ROOFLINE_CACHE_DIR", str(tmp_path_factory.mktemp("trace-roofline-cache")))
        yield
