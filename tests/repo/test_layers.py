"""The package's layering, read from its imports: no cycles, no upward imports, no private names
across modules, no torch, no workloads (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.builders import ROOT

PACKAGE = ROOT / "trace_roofline"
# Bottom to top: a module may import from its own layer and the layers below it, never above.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "files", "frames", "memory", "cachedir"),
    ("model",),
    ("options",),
    ("trace",),
    ("attribution",),
    ("costs",),
    ("roofline", "steptime", "project"),
    ("outputs",),
    ("pipeline", "cache", "parallel"),
    ("cli", "cli_args", "cli_analyze", "cli_commands", "__main__"),
)
RANK = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _unit(module: str) -> str | None:
    """The layer unit of a trace_roofline module: its subpackage or top-level module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "trace_roofline" else None


def _imports(path: Path) -> list[tuple[str, tuple[str, ...], int]]:
    """(imported module, names imported from it, line) for every import in the file."""
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, (), node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, tuple(a.name for a in node.names), node.lineno))
    return out


MODULES = {_module(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _compiled(module: str, name: str) -> bool:
    """`name` is a compiled extension module of package `module` (trace/_scan.c)."""
    folder = ROOT.joinpath(*module.split("."))
    return folder.is_dir() and (folder / f"{name}.c").exists()


def _targets(module: str, names: tuple[str, ...]) -> list[str]:
    """The trace_roofline modules an import statement reaches (a submodule imported by name;
    none for a compiled extension module)."""
    subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
    if names and all(_compiled(module, n) for n in names):
        return []
    return subs or [module]


def test_every_module_sits_in_a_layer():
    units = {_unit(m) for m in MODULES} - {None}
    assert units <= set(RANK), sorted(units - set(RANK))


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_upward_import_no_private_name_no_torch(module):
    path, mine = MODULES[module], RANK.get(_unit(module) or "", -1)
    for target, names, line in _imports(path):
        where = f"{path.relative_to(ROOT)}:{line}"
        top = target.split(".")[0]
        assert top not in ("torch", "workloads", "tests"), f"{where} imports {target}"
        if top != "trace_roofline" or module == "trace_roofline":
            continue
        for t in _targets(target, names):
            unit = _unit(t)
            if unit is not None:
                assert RANK[unit] <= mine, f"{where}: {module} ({mine}) imports {t} ({RANK[unit]})"
        private = [n for n in names if n.startswith("_") and not n.startswith("__")
                   and not (target == module.rsplit(".", 1)[0] and _compiled(target, n))]
        assert not private, f"{where} imports {private}"


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for m, p in MODULES.items():
        for target, names, _ in _imports(p):
            graph[m] |= {t for t in _targets(target, names) if t in MODULES and t != m}
    return graph


def test_no_import_cycles():
    graph, state, cycle = _graph(), {}, []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if n == "trace_roofline" or cycle:
                continue
            if state.get(n) == 1:
                cycle.extend(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, [*stack, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state and m != "trace_roofline":
            visit(m, [m])
    assert not cycle, " -> ".join(cycle)


def test_the_layering_test_can_fail(tmp_path):
    """An upward import is caught (the check reads real files, so give it one)."""
    bad = tmp_path / "bad.py"
    bad.write_text("from trace_roofline.outputs import report\n")
    ((target, names, _),) = _imports(bad)
    assert RANK[_unit(_targets(target, names)[0])] > RANK["model"]
