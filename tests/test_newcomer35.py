"""What a newcomer on a fresh clone still tripped on (issue 35): report.html without Bokeh, a
config.json given as the trace, misspelt commands and flags, diff of folders, a script beside
the clone, informational lines, near-zero rows on the charts, the tables' -0.0 and 0.0%."""

from __future__ import annotations

import re

import tomllib

from tests.builders import ROOT, run_cli


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


def _config(tmp_path):
    import json

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                                  "hidden_size": 3584, "num_hidden_layers": 28}))
    return config


def test_a_config_given_as_the_trace_says_pass_it_as_model(tmp_path):
    config = _config(tmp_path)
    for argv in (["analyze", str(config)], ["analyze", str(tmp_path)],
                 ["diff", str(config), str(config)]):
        r = run_cli(*argv)
        assert r.returncode == 2, argv
        assert r.stdout == ""
        err = r.stderr.strip().splitlines()
        assert len(err) == 1 and f"--model {config if argv[1] == str(config) else tmp_path}" in err[0]
        assert "model config" in err[0] and "not a trace" in err[0] or "holds no trace" in err[0]


def test_a_trace_or_a_fifo_is_never_taken_for_a_config(tmp_path):
    import os

    from trace_roofline.cli import is_model_config

    assert not is_model_config(ROOT / "sample_traces" / "qwen2.5-7b_decode_b1_s2048_h200.json.gz")
    (tmp_path / "t.json").write_text('{"traceEvents": [], "model_type": "x"}')
    assert not is_model_config(tmp_path / "t.json")
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    assert not is_model_config(fifo)  # not opened: it would block
    assert is_model_config(_config(tmp_path))


def test_misspelt_commands_flags_and_choices_get_a_did_you_mean():
    for argv, want in ((["analyse", "x.json"], "did you mean 'analyze'?"),
                       (["analyze", "x.json", "--modle", "qwen2.5-7b"], "--modle (did you mean --model?)"),
                       (["analyze", "x.json", "--modle=qwen2.5-7b"], "(did you mean --model?)"),
                       (["analyze", "x.json", "--causal", "ful"], "did you mean 'full'?"),
                       (["diff", "a", "b", "--hardwre", "h200"], "--hardwre (did you mean --hardware?)"),
                       (["cache", "inf"], "did you mean 'info'?")):
        r = run_cli(*argv)
        assert r.returncode == 2 and r.stdout == "", argv
        assert len(r.stderr.splitlines()) == 1 and want in r.stderr, (argv, r.stderr)
    r = run_cli("analyze", "x.json", "--xyzzy")  # nothing close: no guess
    assert r.returncode == 2 and "unrecognized arguments: --xyzzy\n" in r.stderr


def test_diff_of_folders_takes_their_report_json_or_says_what_it_takes(tmp_path):
    import shutil

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    r = run_cli("diff", str(a), str(b))
    assert r.returncode == 2 and "Is a directory" not in r.stderr
    assert r.stderr.strip() == (f"trace-roofline: error: {a}: a folder without report.json; diff "
                                "takes two traces (.json, .json.gz), two report.json files or two "
                                "`analyze --out` folders")
    out = run_cli("analyze", str(ROOT / "sample_traces" / "qwen2.5-7b_decode_b1_s2048_h200.json.gz"),
                  "--model", "qwen2.5-7b", "--out", str(a))  # an analyze --out folder
    assert out.returncode == 0, out.stderr
    shutil.copy(a / "report.json", b / "report.json")
    r = run_cli("diff", str(a), str(b))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("A ")
