"""CPU tests of workloads/: the layer vs a float32 reference (and HF), profiled traces, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.builders import ROOT, read

torch = pytest.importorskip("torch")

from trace_roofline.model.models import get_model  # noqa: E402
from workloads.layer import OPERATORS, DecoderStack  # noqa: E402
from workloads.runner import RunConfig, build, check_correctness, gpu_tag, run, trace_stem  # noqa: E402,E501

TINY = get_model("qwen-tiny")


def quiet(msg: str) -> None:
    pass


@pytest.mark.parametrize("phase", ["decode", "prefill"])
@pytest.mark.parametrize("layout", ["separate", "fused"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_layer_matches_float32_reference(phase: str, layout: str, dtype: str) -> None:
    cfg = RunConfig(model="qwen-tiny", phase=phase, batch=2, context=40, tokens=24,
                    device="cpu", dtype=dtype, layout=layout, layers=2)
    stack, x, pos = build(cfg, torch.device("cpu"))
    results = check_correctness(stack, x, pos)
    assert [r["layer"] for r in results] == [0, 1]
    if dtype == "float32":  # float32 vs float32: only summation order differs
        assert max(r["out"] for r in results) < 1e-5


def test_reference_check_catches_a_wrong_layer() -> None:
    cfg = RunConfig(model="qwen-tiny", phase="decode", batch=2, context=40, device="cpu")
    stack, x, pos = build(cfg, torch.device("cpu"))
    with torch.no_grad():  # break RoPE for the cached keys only: out and k_cache must notice
        stack.sin.neg_()
    with pytest.raises(AssertionError, match="differs from the float32 reference"):
        check_correctness(stack, x, pos)


def test_fused_layout_computes_the_same_function() -> None:
    outs = []
    for layout in ("separate", "fused"):
        cfg = RunConfig(model="qwen-tiny", phase="prefill", batch=2, tokens=16, device="cpu",
                        layout=layout)
        stack, x, pos = build(cfg, torch.device("cpu"))
        with torch.inference_mode():
            outs.append(stack(x, pos))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_decode_attends_to_exactly_s_keys() -> None:
    """Changing a cached key beyond position S-1 must not change the output; before it must."""
    cfg = RunConfig(model="qwen-tiny", phase="decode", batch=1, context=20, device="cpu")
    stack, x, pos = build(cfg, torch.device("cpu"))
    attn = stack.layers[0].self_attn
    big = torch.zeros(1, TINY.num_kv_heads, 40, TINY.head_dim)
    big[:, :, :20] = attn.k_cache
    vbig = torch.zeros_like(big)
    vbig[:, :, :20] = attn.v_cache
    with torch.inference_mode():
        base = stack(x, pos)
        attn.k_cache, attn.v_cache = big.clone(), vbig.clone()
        attn.k_cache[:, :, 25:] = 100.0  # beyond S: ignored
        same = stack(x, pos)
        attn.k_cache[:, :, 3] = 5.0  # inside S: seen
        changed = stack(x, pos)
    torch.testing.assert_close(same, base)
    assert not torch.allclose(changed, base)


def test_layer_matches_hf_qwen2_decoder_layer() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2 import modeling_qwen2 as hf

    from workloads.hf_capture import qwen2_config

    cfg = qwen2_config(TINY, layers=1, dtype=torch.float32)
    hf_layer = hf.Qwen2DecoderLayer(cfg, layer_idx=0).eval()
    rope = hf.Qwen2RotaryEmbedding(cfg)
    ours = DecoderStack(TINY, 1, annotate="none", seed=3, dtype=torch.float32, max_positions=256)
    ours.allocate_cache(2, 24, random_fill=False)
    hf_layer.load_state_dict(ours.weights[0])
    x = torch.randn(2, 24, TINY.hidden_size)
    pos_ids = torch.arange(24)[None].expand(2, -1)
    with torch.inference_mode():
        want = hf_layer(x, attention_mask=None, position_ids=pos_ids,
                        position_embeddings=rope(x, pos_ids))
        want = want[0] if isinstance(want, tuple) else want
        got = ours(x, 0)
    assert transformers.__version__
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_hf_capture_static_cache_decode(tmp_path: Path, capsys) -> None:
    """--cache static: StaticCache writes by index_copy_, SDPA reads every slot each step."""
    pytest.importorskip("transformers")
    from trace_roofline import load_trace
    from trace_roofline.attribution.attribute import attribute
    from workloads.cli import main

    args = ["hf-capture", "--phase", "decode", "--model", "qwen-tiny", "--tokens", "8",
            "--device", "cpu", "--dtype", "float32", "--warmup", "1", "--steps", "2",
            "--cache", "static", "--out", str(tmp_path)]
    assert main(args) == 0
    path = tmp_path / "hf-qwen2-qwen-tiny-2l_decode_b1_s8_static_cpu.json.gz"
    assert capsys.readouterr().out.strip() == str(path)
    trace = read(path)
    meta = trace["trace_roofline_workload"]
    assert (meta["cache"], meta["max_cache_len"], meta["compile"]) == ("StaticCache", 16, False)
    ops = [e for e in trace["traceEvents"] if e.get("cat") == "cpu_op"]
    # K and V of 2 layers x 2 steps, one token written into the [B, n_kv, 16, d] cache each time
    assert dims_in(ops, "aten::index_copy_") == [[[1, 2, 16, 32], [], [1], [1, 2, 1, 32]]] * 8
    # HF repeats K/V to n_q heads when SDPA gets a mask: [B, n_q, max_cache_len, d] every step
    assert {json.dumps(d[:3]) for d in dims_in(ops, "aten::scaled_dot_product_attention")} == {
        json.dumps([[1, 8, 1, 32], [1, 8, 16, 32], [1, 8, 16, 32]])}
    a = attribute(load_trace(path), TINY)
    kv = a[a["operator"] == "kv_cache"]
    assert set(kv["op_name"]) == {"aten::index_copy_"}
    assert sorted(map(int, kv["layer"].unique())) == [0, 1] and kv["step"].nunique() == 2
    assert main([*args[:-2], "--max-cache-len", "12", "--out", str(tmp_path)]) == 2
    assert "max_cache_len 12 cannot hold 8 prompt tokens and 5 decoded" in capsys.readouterr().err
    assert main(["hf-capture", "--phase", "prefill", "--cache", "static"]) == 2
    assert "cache static is for decode" in capsys.readouterr().err


def ranges(events: list[dict], name: str) -> list[dict]:
    return [e for e in events if e.get("cat") == "user_annotation" and e["name"] == name]


def ops_inside(events: list[dict], rng: dict) -> list[dict]:
    a, b = rng["ts"], rng["ts"] + rng["dur"]
    return [e for e in events if e.get("cat") == "cpu_op" and e["tid"] == rng["tid"]
            and a <= e["ts"] and e["ts"] + e["dur"] <= b]


def dims_in(ops: list[dict], opname: str) -> list[list]:
    return [e["args"]["Input Dims"] for e in ops if e["name"] == opname]


@pytest.fixture(scope="module")
def cpu_decode_trace(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("trace")
    return run(RunConfig(model="qwen-tiny", phase="decode", batch=2, context=48, device="cpu",
                         warmup=1, steps=2, out=str(out)), progress=quiet)


def test_profiled_cpu_run_has_every_range_with_shapes(cpu_decode_trace: dict) -> None:
    path = Path(cpu_decode_trace["trace"])
    assert path.name == "qwen-tiny_decode_b2_s48_cpu.json.gz"
    events = read(path)["traceEvents"]
    steps = [e for e in events if e.get("name", "").startswith("ProfilerStep#")]
    assert len(steps) == 2
    for op in OPERATORS["separate"]:
        assert len(ranges(events, op)) == 2 * (2 if op == "residual" else 1), op
    B, H, S = 2, TINY.hidden_size, 48
    nq, nkv, d = TINY.num_heads, TINY.num_kv_heads, TINY.head_dim
    for name, (k, n, bias) in TINY.linears().items():
        ops = ops_inside(events, ranges(events, name)[0])
        assert [[B, 1, k], [n, k]] + ([[n]] if bias else [[]]) in dims_in(ops, "aten::linear")
    attn = ops_inside(events, ranges(events, "attention")[0])
    sdpa = dims_in(attn, "aten::scaled_dot_product_attention")
    assert sdpa and sdpa[0][:3] == [[B, nq, 1, d], [B, nkv, S, d], [B, nkv, S, d]]
    cache = dims_in(ops_inside(events, ranges(events, "kv_cache")[0]), "aten::copy_")
    assert cache.count([[B, nkv, 1, d], [B, nkv, 1, d], []]) == 2  # K and V written
    norm = dims_in(ops_inside(events, ranges(events, "input_norm")[0]), "aten::mean")
    assert norm and norm[0][0] == [B, 1, H]


def test_trace_carries_workload_metadata(cpu_decode_trace: dict) -> None:
    meta = read(cpu_decode_trace["trace"])["trace_roofline_workload"]  # a JSON object at the top level
    assert meta["phase"] == "decode" and meta["batch"] == 2 and meta["context"] == 48


def test_unannotated_run_has_no_operator_ranges(tmp_path: Path) -> None:
    summary = run(RunConfig(model="qwen-tiny", phase="prefill", tokens=16, device="cpu",
                            annotate="none", warmup=1, steps=1, out=str(tmp_path)),
                  progress=quiet)
    events = read(summary["trace"])["traceEvents"]
    names = {e["name"] for e in events if e.get("cat") == "user_annotation"}
    assert names == {"ProfilerStep#1"}
    assert any(e["name"] == "aten::scaled_dot_product_attention" for e in events)


def test_trace_names_say_what_ran() -> None:
    cfg = RunConfig(model="qwen2.5-7b", phase="decode", batch=8, context=2048)
    assert trace_stem(cfg, "h200") == "qwen2.5-7b_decode_b8_s2048_h200"
    cfg = RunConfig(phase="prefill", tokens=512, layout="fused", annotate="none", compile=True)
    assert trace_stem(cfg, "cpu") == "qwen2.5-7b_prefill_b1_t512_fused_compiled_noannot_cpu"
    assert gpu_tag("NVIDIA H200") == "h200"
    assert gpu_tag("NVIDIA GeForce RTX 4090") == "rtx4090"
    assert gpu_tag("NVIDIA A100-SXM4-80GB") == "a100"


def test_bad_shapes_are_rejected() -> None:
    with pytest.raises(ValueError, match="batch"):
        build(RunConfig(model="qwen-tiny", batch=0, device="cpu"), torch.device("cpu"))
    with pytest.raises(ValueError, match="phase"):
        build(RunConfig(model="qwen-tiny", phase="train", device="cpu"), torch.device("cpu"))


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workloads", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_cli_run_writes_what_it_promises(tmp_path: Path) -> None:
    r = cli("run", "--model", "qwen-tiny", "--device", "cpu", "--phase", "prefill",
            "--batch", "2", "--tokens", "12", "--steps", "1", "--warmup", "1",
            "--out", str(tmp_path / "o"), "--summary", str(tmp_path / "s.json"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    want = tmp_path / "o" / "qwen-tiny_prefill_b2_t12_cpu.json.gz"
    # the main job ends by analysing what it captured; the last line says where the trace is
    assert r.stdout.strip().splitlines()[-1] == str(want)
    assert "whole model" in r.stdout and "q_proj" in r.stdout and "prefill" in r.stdout
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == [want.name]
    assert f"wrote {want}" in r.stderr  # progress ends saying where the file is
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["trace"] == str(want) and summary["check"][0]["out"] < 1e-5
    assert any(e["name"] == "q_proj" for e in read(want)["traceEvents"])


def test_cli_run_rejects_bad_arguments(tmp_path: Path) -> None:
    r = cli("run", "--model", "qwen-tiny", "--device", "cpu", "--batch", "0",
            "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert r.returncode == 2
    assert "batch" in r.stderr and not (tmp_path / "o").exists()


def test_cli_sweep_cpu(tmp_path: Path) -> None:
    hw = tmp_path / "hw.json"
    hw.write_text(json.dumps({"name": "x", "peak_flops": {"fp32": 1e11, "bf16": 2e11},
                              "mem_bandwidth": 1e10, "source": "test"}))
    r = cli("sweep", "--model", "qwen-tiny", "--device", "cpu", "--m", "1,64", "--iters", "5",
            "--warmup", "1", "--hardware", str(hw), "--out", str(tmp_path), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    res = json.loads(Path(r.stdout.strip()).read_text())
    rows = {row["M"]: row for row in res["rows"]}
    k = n = TINY.hidden_size
    # hand-computed: M=1, fp32: I = 2KN / ((K + KN + N) * 4)
    assert rows[1]["intensity"] == pytest.approx(2 * k * n / ((k + k * n + n) * 4))
    assert rows[1]["attainable_tflops"] == pytest.approx(rows[1]["intensity"] * 1e10 / 1e12)
    # M=64: I = 2*64*256*256 / ((64*256 + 256*256 + 64*256) * 4) = 21.33 > ridge 1e11/1e10 = 10
    assert rows[64]["intensity"] == pytest.approx(21.333, rel=1e-4)
    assert rows[1]["bound"] == "memory" and rows[64]["bound"] == "compute"
    events = read(res["trace"])["traceEvents"]
    assert {"m_sweep.M1", "m_sweep.M64"} <= {e["name"] for e in events}
    mm = [e["args"]["Input Dims"] for e in events if e.get("name") == "aten::mm"]
    assert [[64, k], [k, n]] in mm and [[1, k], [k, n]] in mm


def test_cli_calibrate_cpu_writes_hardware_json(tmp_path: Path) -> None:
    out = tmp_path / "cpu.json"
    r = cli("calibrate", "--device", "cpu", "--sizes", "128,256", "--copy-mib", "64",
            "--repeats", "3", "--out", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    hw = json.loads(out.read_text())
    assert set(hw) == {"name", "peak_flops", "mem_bandwidth", "source", "device_name",
                       "device_names", "date", "method", "ceilings_from", "measurements"}
    assert all(v > 0 for v in hw["peak_flops"].values())
    assert hw["peak_flops"]["tf32"] == hw["peak_flops"]["fp32"]  # no TF32 on CPUs, said so
    assert "no TF32" in hw["method"] and hw["date"] in hw["source"]
    assert 1e8 < hw["mem_bandwidth"] < 1e13
    assert [p.name for p in tmp_path.iterdir()] == ["cpu.json"]
    meas = hw["measurements"]
    # every ceiling is the best median of its kind: squares AND the preset's projection shapes
    mm = [m for m in meas if m["kind"] == "matmul"]
    for key in ("bf16", "fp16", "fp32"):
        rates = [m["flops_per_s"] for m in mm if m["dtype"] == key]
        assert hw["peak_flops"][key] == max(rates)
    assert {(m["M"], m["K"], m["N"]) for m in mm} == {
        (128, 128, 128), (256, 256, 256), *((128, k, n) for k, n in [
            (256, 256), (256, 64), (256, 768), (768, 256), (256, 384), (256, 1536)])}
    assert {m["layout"] for m in mm} == {"nn", "nt"}
    gate = next(m for m in mm if (m["M"], m["K"], m["N"]) == (128, 256, 768))
    assert gate["shape"] == "qwen-tiny gate_proj/up_proj"
    assert gate["flops_per_s"] == pytest.approx(2 * 128 * 256 * 768 / gate["median_s"])
    streams = [m for m in meas if m["kind"] == "stream"]
    assert {(m["kernel"], m["dtype"]) for m in streams} == {
        (k, d) for k in ("copy", "add", "sum") for d in ("float32", "bfloat16")}
    assert hw["mem_bandwidth"] == max(m["bytes_per_s"] for m in streams)
    moves = {"copy": 2, "add": 3, "sum": 1}  # buffers read + written per element
    assert all(m["buffer_bytes"] == 64 << 20 and m["bytes"] == moves[m["kernel"]] * (64 << 20)
               for m in streams)
    best = max(streams, key=lambda m: m["bytes_per_s"])
    assert hw["ceilings_from"]["mem_bandwidth"].startswith(f"{best['kernel']} {best['dtype']}")
    from trace_roofline.model.hardware import from_json  # the analyzer reads what calibrate writes

    loaded = from_json(out)
    assert loaded.name == "cpu-measured" and loaded.peak("bfloat16") == hw["peak_flops"]["bf16"]
    assert loaded.extra["measurements"] == meas


def test_calibration_shapes_cover_the_llm_projections() -> None:
    from workloads.calibrate import gemm_shapes

    shapes = gemm_shapes((4096, 8192), ("qwen2.5-7b",), (2048, 4096))
    assert list(shapes)[:2] == [(4096, 4096, 4096), (8192, 8192, 8192)]
    # the prefill T=2048 MLP GEMMs that beat the old square-only roof, separate and fused
    assert shapes[(2048, 3584, 18944)] == "qwen2.5-7b gate_proj/up_proj"
    assert shapes[(2048, 3584, 37888)] == "qwen2.5-7b gate_up_proj"
    assert shapes[(4096, 18944, 3584)] == "qwen2.5-7b down_proj"
    assert shapes[(2048, 3584, 4608)] == "qwen2.5-7b qkv_proj"  # 3584 + 2 * 512
    assert len(shapes) == 2 + 2 * 6  # q/o, k/v, gate/up, down, qkv, gate_up at each M
    both = gemm_shapes((4096,), ("llama-3-8b",), (4096,))
    assert both[(4096, 4096, 4096)] == "square; llama-3-8b q_proj/o_proj"


def test_calibration_catches_wrong_output(monkeypatch) -> None:
    from workloads import calibrate as cal

    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b, out: real_mm(a, b, out=out).mul_(1.1))
    with pytest.raises(AssertionError, match="matmul check failed"):
        cal.matmul_rate(torch.device("cpu"), "fp32", 16, 32, 24, "nt", 0, 1)


def test_committed_h200_calibration_is_auditable() -> None:
    hw = json.loads((ROOT / "trace_roofline" / "model" / "data" / "h200_measured.json").read_text())
    assert hw["name"] == "h200-measured" and hw["device_names"] == ["NVIDIA H200"]
    mm = [m for m in hw["measurements"] if m["kind"] == "matmul"]
    for key, peak in hw["peak_flops"].items():
        assert peak == max(m["flops_per_s"] for m in mm if m["dtype"] == key)
    streams = [m for m in hw["measurements"] if m["kind"] == "stream"]
    assert hw["mem_bandwidth"] == max(m["bytes_per_s"] for m in streams)
    assert {m["kernel"] for m in streams} == {"copy", "add", "sum"}
    assert min(m["buffer_bytes"] for m in streams) >= 1 << 30  # >> the 60 MB L2
    shapes = {(m["M"], m["K"], m["N"]) for m in mm}
    assert {(16384, 16384, 16384), (2048, 3584, 18944), (8192, 4096, 28672)} <= shapes


def test_trace_roofline_cli_has_workload_commands(tmp_path: Path, capsys) -> None:
    from trace_roofline.cli import main

    rc = main(["run", "--model", "qwen-tiny", "--device", "cpu", "--phase", "decode",
               "--context", "16", "--steps", "1", "--warmup", "1", "--annotate", "none",
               "--out", str(tmp_path)])
    want = tmp_path / "qwen-tiny_decode_b1_s16_noannot_cpu.json.gz"
    assert rc == 0 and want.exists()
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1] == str(want) and "down_proj" in out
    assert main(["run", "--model", "qwen-tiny", "--device", "cpu", "--steps", "0"]) == 2


# ------------------------------------------------------------------------ capture_all.sh
CAPTURE_ALL = ROOT / "workloads" / "capture_all.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_capture_all_refuses_without_a_gpu(tmp_path: Path) -> None:
    r = subprocess.run(["bash", str(CAPTURE_ALL), str(tmp_path / "out")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120,
                       env={"PATH": "/usr/bin:/bin", "CAPTURE_WORK": str(tmp_path / "w")})
    assert r.returncode == 2 and "torch sees no CUDA GPU" in r.stderr
    assert list(tmp_path.iterdir()) == []  # nothing captured, no calibration named for a GPU


def test_capture_all_stops_its_children_when_interrupted(tmp_path: Path) -> None:
    """A stand-in `python3` passes the GPU check and plays a capture that never ends; SIGTERM
    to the script must end that capture too, not leave it running."""
    import os
    import signal
    import time

    fake = tmp_path / "bin"
    fake.mkdir()
    pidfile = tmp_path / "capture.pid"
    (fake / "python3").write_text(
        "#!/bin/bash\n"
        'if [ "$1 $2" = "-m workloads.capture_all" ]; then echo $$ > "$PIDFILE"; exec sleep 120; fi\n'
        "exit 0\n")
    (fake / "python3").chmod(0o755)
    env = {"PATH": f"{fake}:/usr/bin:/bin", "CAPTURE_WORK": str(tmp_path / "w"),
           "PIDFILE": str(pidfile)}
    script = subprocess.Popen(["bash", str(CAPTURE_ALL), str(tmp_path / "out")], cwd=ROOT,
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not pidfile.exists() or not pidfile.read_text().strip():
            assert script.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        child = int(pidfile.read_text())
        script.send_signal(signal.SIGTERM)
        assert script.wait(timeout=30) == 130
        assert "interrupted" in script.stderr.read().decode()
        deadline = time.monotonic() + 10
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(child), "the capture outlived capture_all.sh"
    finally:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_cpu_dry_run_names_its_calibration_after_the_cpu(tmp_path: Path, monkeypatch) -> None:
    from workloads import capture_all

    monkeypatch.setattr(capture_all, "calibrate", lambda progress: ({"name": "cpu"}, {}))
    (name, do_calibrate), *_ = capture_all.captures(tmp_path)
    assert name == "calibrate"
    do_calibrate()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu_calibration_raw.json",
                                                          "cpu_measured.json"]
