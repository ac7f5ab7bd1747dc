"""Suite-wide: the parsed-trace cache goes to a temporary directory, never the user's."""

import pytest


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # subprocesses inherit the variable too
        mp.setenv("TRACE_ROOFLINE_CACHE_DIR", str(tmp_path_factory.mktemp("trace-roofline-cache")))
        yield
