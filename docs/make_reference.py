"""Write docs/reference.md from the code: the operator vocabulary with its contracts, the kernel
families, the model families, the CLI's commands and flags, and every module of the package.

    python docs/make_reference.py            # rewrite docs/reference.md
    python docs/make_reference.py --check    # exit 1 when the committed file is stale

tests/repo/test_reference_docs.py runs the check, so the reference cannot drift from the code.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

from trace_roofline import cli
from trace_roofline.model import contracts, families, kernels, operators

OUT = Path(__file__).with_name("reference.md")
PACKAGE = Path(__file__).resolve().parents[1] / "trace_roofline"


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: tuple[str, ...], rows: list[tuple[object, ...]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return [*out, ""]


def _operators() -> list[str]:
    rows = []
    for name in operators.NAMES:
        if name.endswith(operators.GRAD_SUFFIX):
            continue
        op = operators.BY_NAME[name]
        c = contracts.contract(name)
        rows.append((f"`{name}`", op.kind, "yes" if op.per_layer else "model",
                     "row" if op.row_parallel else "",
                     ", ".join(sorted(c.holds)) if c else "(none)",
                     ", ".join(sorted(c.needs)) if c else ""))
    return ["## Operators", "",
            "The vocabulary (`trace_roofline/model/operators.py`) and each name's contract "
            "(`model/contracts.py`): the work its rows may do and what the name needs. Each has a "
            "backward name, `q_proj.grad`, for its rows in a training step's backward pass (no "
            "contract of its own).", "",
            *_table(("operator", "kind", "per layer", "TP", "may hold", "needs"), rows)]


def _kernel_families() -> list[str]:
    rows = [(f.family, f.vendor, f.role, f"`{f.pattern.pattern}`") for f in kernels.FAMILIES]
    return ["## Kernel families", "",
            "The registry (`trace_roofline/model/kernels.py`), first match wins: a kernel's "
            "family, who ships it and the role the attribution gives it.", "",
            *_table(("family", "vendor", "role", "name pattern"), rows)]


def _model_families() -> list[str]:
    rows = []
    for model_type, f in sorted(families.FAMILIES.items()):
        switch = f" ({f.parallel_switch[0]}: {f.parallel_switch[2].name})" if (
            f.parallel_switch) else ""
        rows.append((f"`{model_type}`", f.placement.name + switch, f.norm or "(by eps field)",
                     "gated" if f.gated else "plain", f.activation, f.position,
                     f.layout.qk_norm or ""))
    return ["## Model families", "",
            "Each `model_type` whose layout `trace_roofline/model/families.py` declares (a config "
            "of another type is read from its fields). Placement: where the norms sit.", "",
            *_table(("model_type", "placement", "norm", "MLP", "activation", "position",
                     "q/k norm"), rows)]


def _commands() -> list[str]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = ["## Commands and flags", "", "`trace-roofline COMMAND --help` says the same.", ""]
    for name, p in sub.choices.items():
        rows = []
        for a in p._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            flags = ", ".join(f"`{s}`" for s in a.option_strings) or f"`{a.dest}`"
            rows.append((flags, (a.help or "").replace("%(default)s", str(a.default))))
        out += [f"### {name}", "", *_table(("argument", "what it does"), rows)]
    return out


def _modules() -> list[str]:
    rows = []
    for path in sorted(PACKAGE.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        first = " ".join(doc.split("\n\n", 1)[0].split())
        rows.append((f"`{path.relative_to(PACKAGE.parent)}`", first))
    return ["## Modules", "",
            "Every module of the package with the first paragraph of its docstring "
            "(docs/architecture.md says how the stages fit).", "",
            *_table(("module", "what it holds"), rows)]


def render() -> str:
    lines = ["# Reference", "",
             "Generated from the code by `python docs/make_reference.py`; do not edit by hand.", "",
             *_operators(), *_kernel_families(), *_model_families(), *_commands(), *_modules()]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/reference.md is stale")
    a = ap.parse_args(argv)
    text = render()
    if a.check:
        stale = not OUT.exists() or OUT.read_text() != text
        if stale:
            print(f"{OUT} is stale: run python docs/make_reference.py", file=sys.stderr)
        return int(stale)
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
