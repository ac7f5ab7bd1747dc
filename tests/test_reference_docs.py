"""docs/reference.md is generated from the code (docs/make_reference.py) and may not drift."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from trace_roofline.model import kernels, operators

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _generator():
    spec = importlib.util.spec_from_file_location("make_reference", DOCS / "make_reference.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_reference_matches_the_code():
    """Regenerate with `python docs/make_reference.py` when this fails."""
    assert (DOCS / "reference.md").read_text() == _generator().render()


def test_reference_lists_every_operator_and_kernel_family():
    text = (DOCS / "reference.md").read_text()
    for name in operators.NAMES:
        assert name.endswith(operators.GRAD_SUFFIX) or f"| `{name}` |" in text, name
    for f in kernels.FAMILIES:
        assert f"| {f.family} |" in text, f.family
    assert "### analyze" in text and "### project" in text
