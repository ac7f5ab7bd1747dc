"""docs/reference.md is generated from the code (docs/make_reference.py) and may not drift."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from trace_roofline.model import kernels, operators

DOCS = Path(__file__).resolve().parents[2] / "docs"


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


def test_every_module_the_docs_name_exists():
    """A path `trace_roofline/...` in a doc page names a module or package that is there (a split
    or a rename updates the prose too)."""
    root = DOCS.parent
    named = {(page.name, m) for page in DOCS.glob("*.md")
             for m in re.findall(r"trace_roofline/[\w/]+(?:\.py|\.c|/)", page.read_text())}
    missing = sorted(f"{page}: {m}" for page, m in named if not (root / m).exists())
    assert not missing, "\n".join(missing)


def test_every_design_note_a_module_points_to_is_there():
    """A docstring's `docs/design.md ("...")` names a section design.md has."""
    root = DOCS.parent
    sections = set(re.findall(r"^## `?([^`\n]+)`?$", (DOCS / "design.md").read_text(), re.M))
    pointers = {(str(p.relative_to(root)), s) for p in (root / "trace_roofline").rglob("*.py")
                for s in re.findall(r'docs/design\.md \("([^"]+)"\)', p.read_text())}
    missing = sorted(f"{p}: {s}" for p, s in pointers if s not in sections)
    assert not missing, "\n".join(missing)
