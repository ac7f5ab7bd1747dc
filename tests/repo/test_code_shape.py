"""The package's shape, read from its source: modules a reader can hold, functions cut at their
seams, options as one value, operator names as the vocabulary's constants (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.builders import ROOT
from trace_roofline.model.operators import BY_NAME

PACKAGE = ROOT / "trace_roofline"
SOURCES = sorted(PACKAGE.rglob("*.py"))
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 80
MAX_PARAMETERS = 5
MAX_WIDE_FUNCTIONS = 10  # functions allowed more than MAX_PARAMETERS
MAX_NAME_LITERALS = 50  # operator names spelt as strings outside the vocabulary
VOCABULARY = PACKAGE / "model" / "operators.py"


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def _functions(p: Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _parameters(f: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = f.args
    named = [*a.posonlyargs, *a.args]
    n = len(named) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
    return n - (1 if named and named[0].arg in ("self", "cls") else 0)


def _name_literals(p: Path) -> list[tuple[int, str]]:
    return [(n.lineno, n.value) for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in BY_NAME]


@pytest.mark.parametrize("path", SOURCES, ids=_rel)
def test_module_fits_a_reading(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{_rel(path)}: {lines} lines (split it by concern)"


@pytest.mark.parametrize("path", SOURCES, ids=_rel)
def test_functions_are_cut_at_their_seams(path):
    long = [f"{f.name} ({f.end_lineno - f.lineno + 1} lines)" for f in _functions(path)
            if (f.end_lineno or f.lineno) - f.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{_rel(path)}: {', '.join(long)}"


def test_options_travel_as_one_value():
    wide = [f"{_rel(p)}:{f.name} ({_parameters(f)})" for p in SOURCES for f in _functions(p)
            if _parameters(f) > MAX_PARAMETERS]
    assert len(wide) <= MAX_WIDE_FUNCTIONS, "\n".join(sorted(wide))


def test_operator_names_are_the_vocabulary_s_constants():
    found = [f"{_rel(p)}:{line} {v!r}" for p in SOURCES if p != VOCABULARY
             for line, v in _name_literals(p)]
    assert len(found) < MAX_NAME_LITERALS, f"{len(found)} literals:\n" + "\n".join(found)
