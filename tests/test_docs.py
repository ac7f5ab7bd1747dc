"""The README's examples run as written, and the analyzer never needs torch."""

import re
import subprocess
import sys

from tests.builders import ROOT

README = (ROOT / "README.md").read_text()


def test_readme_starts_with_the_two_commands():
    commands = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    lines = [x for x in commands.splitlines() if x and not x.startswith("#")]
    assert len(lines) == 2
    assert "trace-roofline analyze sample_traces/" in lines[0]
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert lines[1].split("&& ", 1)[1] == ci[-1]  # CI runs exactly README's test command
    for path in re.findall(r"sample_traces/\S+\.json\.gz", lines[0]):
        assert (ROOT / path).is_file(), path


def test_readme_python_example_runs():
    code = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    check = ("\nimport sys\nimport trace_roofline.attribution.attribute\nassert callable(tr.attribute)\n"
             "assert 'torch' not in sys.modules\nprint(a.whole['intensity'])\n")
    r = subprocess.run([sys.executable, "-c", code + check], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    assert 1.0 < float(r.stdout.strip().splitlines()[-1]) < 1.1  # decode layer, weights dominate


def test_analyzer_modules_never_import_torch():
    mods = [p.stem for p in (ROOT / "trace_roofline").glob("*.py") if p.stem != "__init__"]
    code = ("import importlib, sys\n"
            f"for m in {mods!r}: importlib.import_module('trace_roofline.' + m)\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_readme_documents_the_report_schema_and_share_scale():
    from trace_roofline.outputs.report import OPERATOR_KEYS, SCHEMA_VERSION

    assert f'{{"schema_version": {SCHEMA_VERSION}, "traces": [...]}}' in README
    assert "`roof_fraction`" in README and "fractions from 0 to 1" in README
    assert "pct_of_roof" not in OPERATOR_KEYS and "roof_fraction" in OPERATOR_KEYS
