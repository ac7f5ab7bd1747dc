"""`trace-roofline intensity` reproduces the lesson's table and reports errors in one line."""

import json

from tests.builders import run_cli
from trace_roofline.cli import main

LESSON_GEMM = {
    1: {"q_proj": "1.0", "k_proj": "1.0", "v_proj": "1.0", "o_proj": "1.0",
        "gate_proj": "1.0", "up_proj": "1.0", "down_proj": "1.0"},
    256: {"q_proj": "224.0", "k_proj": "162.9", "v_proj": "162.9", "o_proj": "224.0",
          "gate_proj": "236.0", "up_proj": "236.0", "down_proj": "236.0"},
}
LESSON_ARGS = ["intensity", "--model", "qwen2.5-7b", "--hardware", "rtx4090",
               "--m", "1,256", "--s", "128,512,2048", "--lesson"]


def test_lesson_table_digit_for_digit(capsys):
    assert main(LESSON_ARGS) == 0
    out = capsys.readouterr().out
    for m, ops in LESSON_GEMM.items():
        block = out.split(f"-- GEMMs at M={m} tokens")[1].split("--")[1]
        for op, value in ops.items():
            line = next(x for x in block.splitlines() if x.strip().startswith(op))
            assert f"I = {value:>8} FLOP/byte" in line
            assert ("memory-bound" in line) == (m == 1 or op in ("k_proj", "v_proj"))
    assert "S=  128: decode I=  7.0 (memory-bound)  |  prefill I=   896.0 (compute-bound)" in out
    assert "S=  512: decode I=  7.0 (memory-bound)  |  prefill I=  3584.0 (compute-bound)" in out
    assert "S= 2048: decode I=  7.0 (memory-bound)  |  prefill I= 14336.0 (compute-bound)" in out
    assert "attention FLOPs full, attention bytes kv" in out


def test_h200_prints_m_star_per_projection(capsys):
    assert main(["intensity", "--model", "qwen2.5-7b", "--hardware", "h200-sxm"]) == 0
    out = capsys.readouterr().out
    for op in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert any(line.strip().startswith(op) and "M* = " in line for line in out.splitlines())


def test_json_output(capsys):
    assert main([*LESSON_ARGS, "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert table["conventions"]["causal"] == "full"
    decode = [a["decode"]["intensity"] for a in table["attention"]]
    assert decode == [7.0, 7.0, 7.0]
    assert table["m_star"]["q_proj"] == 181


def test_fused_layout(capsys):
    assert main(["intensity", "--fused", "--m", "1"]) == 0
    out = capsys.readouterr().out
    assert "qkv_proj      [3584x4608]" in out and "gate_up_proj  [3584x37888]" in out


def test_errors_are_one_line_exit_2(tmp_path):
    bad = tmp_path / "hw.json"
    bad.write_text("{")
    for args in (["intensity", "--model", "nope"], ["intensity", "--hardware", str(bad)],
                 ["intensity", "--m", "0"], ["intensity", "--causal", "maybe"]):
        r = run_cli(*args)
        assert r.returncode == 2, args
        assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
