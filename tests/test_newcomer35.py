"""What a newcomer on a fresh clone still tripped on (issue 35): report.html without Bokeh, a
config.json given as the trace, misspelt commands and flags, diff of folders, a script beside
the clone, informational lines, near-zero rows on the charts, the tables' -0.0 and 0.0%."""

from __future__ import annotations

import re
import tomllib

from tests.builders import ROOT


def _declared() -> dict[str, list[str]]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    return {"": project["dependencies"], **project["optional-dependencies"]}


def test_bokeh_is_a_base_dependency_at_the_pinned_minimum():
    """README's first command (`pip install -e .`) promises report.html: Bokeh comes with it,
    at the minimum .ci/min_versions.sh installs."""
    base = [d for d in _declared()[""] if re.match(r"bokeh\b", d)]
    assert base == ["bokeh>=3.4"]
    assert not [d for extra in _declared().values() for d in extra if "bokeh" in d and d not in base]
    pins = (ROOT / ".ci" / "min_versions.sh").read_text()
    assert '"bokeh==3.4.0"' in pins
