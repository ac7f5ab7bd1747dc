"""Re-export of tests/builders.py's fixed documents, until every test imports `tests.builders`."""

from tests.builders import H200, OPS, cpu_trace, gpu_trace, legacy_trace, write

__all__ = ["H200", "OPS", "cpu_trace", "gpu_trace", "legacy_trace", "write"]
