"""Re-export of tests/builders.py's op lists, until every test imports `tests.builders`."""

from tests.builders import BF, F32, Op, attributed, concat, qwen_layer

__all__ = ["BF", "F32", "Op", "attributed", "concat", "qwen_layer"]
