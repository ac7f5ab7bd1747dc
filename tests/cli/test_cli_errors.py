"""The CLI's rough edges: one-line errors instead of tracebacks, conflicts rejected rather than
ignored, library parameters spelled as flags, and help that states every default."""

import argparse
import json

import pytest

from tests.builders import SAMPLES
from trace_roofline.cli import FLAGS, build_parser, main
from trace_roofline.errors import InputError

DECODE = SAMPLES / "qwen2.5-7b_decode_b1_s2048_h200.json.gz"
PREFILL = SAMPLES / "qwen2.5-7b_prefill_b1_t2048_h200.json.gz"
NCU = SAMPLES / "qwen2.5-7b_decode_b1_s2048_h200.ncu.csv"


def one_line_error(capsys, argv: list[str], *needles: str) -> str:
    """Run the CLI in process; it must exit 2 with one stderr line holding every needle."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


# ------------------------------------------------------------------ tracebacks -> one line
@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def test_run_out_an_existing_file(tmp_path, capsys, torch):
    taken = tmp_path / "taken"
    taken.write_text("user file")
    one_line_error(capsys, ["run", "--model", "qwen-tiny", "--device", "cpu", "--out", str(taken)],
                   f"{taken}: --out is not a directory")
    assert taken.read_text() == "user file"


@pytest.mark.parametrize("command", ["run", "sweep", "calibrate"])
def test_an_unknown_device_is_one_line(tmp_path, capsys, torch, command):
    one_line_error(capsys, [command, "--device", "tpu", "--out", str(tmp_path / "o")],
                   "--device 'tpu' is not one of cuda, cuda:N, cpu")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(__import__("importlib.util").util.find_spec("torch") is None, reason="torch")
def test_a_gpu_torch_does_not_see_is_one_line(capsys):
    import torch

    missing = f"cuda:{torch.cuda.device_count()}"
    one_line_error(capsys, ["run", "--device", missing], f"--device '{missing}': torch sees")


def test_calibrate_checks_its_outputs_before_measuring(tmp_path, capsys, torch, monkeypatch):
    from workloads import calibrate

    def measure(*a, **k):
        raise AssertionError("measured before checking --out")

    monkeypatch.setattr(calibrate, "calibrate", measure)
    one_line_error(capsys, ["calibrate", "--device", "cpu", "--out", str(tmp_path)],
                   f"{tmp_path}: is a directory")
    (tmp_path / "f").write_text("")
    one_line_error(capsys, ["calibrate", "--out", str(tmp_path / "x.json"), "--raw",
                            str(tmp_path / "f" / "raw.json")], "exists and is not a directory")


# ---------------------------------------------------------------- conflicts are rejected
@pytest.mark.parametrize("argv,needle", [
    (["--phase", "decode", "--tokens", "64"], "--tokens is not used by --phase decode"),
    (["--phase", "prefill", "--context", "64"], "--context is not used by --phase prefill"),
])
def test_run_rejects_the_other_phases_option(tmp_path, capsys, torch, argv, needle):
    one_line_error(capsys, ["run", "--model", "qwen-tiny", "--device", "cpu", *argv,
                            "--out", str(tmp_path / "o")], needle)
    assert not (tmp_path / "o").exists()


def test_run_defaults_per_phase():
    from workloads.cli import run_shape

    assert run_shape("decode", None, None) == {"context": 2048, "tokens": 512}
    assert run_shape("decode", 64, None)["context"] == 64
    assert run_shape("prefill", None, 64)["tokens"] == 64


def test_lesson_with_a_contradicting_convention(capsys):
    one_line_error(capsys, ["intensity", "--lesson", "--causal", "causal"],
                   "--lesson means --causal full; drop --lesson or --causal causal")
    one_line_error(capsys, ["intensity", "--lesson", "--attention-bytes", "all"],
                   "--lesson means --attention-bytes kv")
    # agreeing with the lesson is fine, and the table says which conventions it used
    assert main(["intensity", "--lesson", "--causal", "full", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert table["conventions"]["causal"] == "full"
    assert table["conventions"]["attention_bytes"] == "kv"


def test_ncu_files_must_match_the_traces(capsys):
    one_line_error(capsys, ["analyze", str(DECODE), str(PREFILL), "--ncu", str(NCU)],
                   "1 --ncu file(s) for 2 trace(s)")


# ---------------------------------------------------------------- parameters -> flags
@pytest.mark.parametrize("error,cli", [
    (InputError("`layers` needs `model` (embedding and lm_head come from the model)", "layers", "model"),
     "--layers needs --model (embedding and lm_head come from the model)"),
    (InputError("`layers` must be >= 1, got 0", "layers"), "--layers must be >= 1, got 0"),
    (InputError("`attention_bytes` must be one of all, kv", "attention_bytes"),
     "--attention-bytes must be one of all, kv"),
    (InputError("t.json: `hardware` has no bf16 peak", "hardware"), "t.json: --hardware has no bf16 peak"),
    # prose that merely contains a parameter's name is left alone; so is an unlisted backquote
    (InputError("extrapolated to 28 layers of the model"), "extrapolated to 28 layers of the model"),
    (InputError("`force` is not a parameter here"), "`force` is not a parameter here"),
])
def test_library_parameters_become_flags(error, cli):
    assert error.spelled(FLAGS) == cli


def test_parameters_survive_pickling_and_rewrapping():
    import pickle

    e = pickle.loads(pickle.dumps(InputError("`tp` 3 does not divide 28 heads", "tp")))
    assert e.parameters == ("tp",) and e.spelled(FLAGS) == "--tp 3 does not divide 28 heads"


def test_every_library_parameter_has_a_flag(capsys):
    """Each parameter a library error names is one of the CLI's flags (no raw name leaks)."""
    assert main(["analyze", str(DECODE), "--layers", "28"]) == 2
    assert "--layers needs --model" in capsys.readouterr().err


def test_int_lists_are_checked_once_for_both_clis(capsys):
    from trace_roofline.cli import int_list
    from workloads import cli as workloads_cli

    assert workloads_cli.int_list is int_list and int_list("1, 16,64") == [1, 16, 64]
    for bad in ("1,x", "0,4", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            int_list(bad)


# -------------------------------------------------------------------------------- help
def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_option_is_described_with_its_default():
    for name, p in subparsers(build_parser()).items():
        assert p.description, name
        text = p.format_help()
        assert "example" in text, name
        for a in p._actions:
            if not a.option_strings or a.dest == "help":
                continue
            assert a.help, (name, a.option_strings)
            switch = a.nargs == 0
            if not switch:
                assert "(default:" in p._get_formatter()._get_help_string(a), (name, a.dest)


def test_help_states_the_defaults_users_asked_about():
    subs = subparsers(build_parser())
    run, intensity = subs["run"].format_help(), subs["intensity"].format_help()
    assert "output directory (default: traces/ in the current folder)" in " ".join(run.split())
    assert "(default: 2048)" in run and "(default: 512)" in run
    assert "(default: qwen2.5-7b)" in intensity and "(default: rtx4090)" in intensity


def test_top_help_is_for_users(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "Place every kernel of a profiled LLM on the roofline" in out
    assert "examples:" in out and "trace-roofline analyze trace.json.gz" in out
