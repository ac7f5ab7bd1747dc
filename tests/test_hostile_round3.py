"""Hostile, odd and unlucky input, round three (issue 35): each test reproduces one numbered row
of the issue's table and fails on the code before its fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.builders import gpu_trace, run_cli, write
from trace_roofline.model import hardware

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------- row 3: a subnormal duration
def _three_events(dur: float) -> dict:
    """A cpu op, its launch and its kernel (the issue's 3-event trace), the kernel `dur` µs."""
    h200 = {"id": 0, "name": "NVIDIA H200", "totalGlobalMem": 150754820096, "computeMajor": 9,
            "computeMinor": 0, "numSms": 132}
    dims, types = [[64, 64], [64, 64]], ["c10::BFloat16"] * 2
    return {"deviceProperties": [h200], "traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 1, "dur": 10,
         "args": {"External id": 1, "Input Dims": dims, "Input type": types}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
         "ts": 2, "dur": 1, "args": {"External id": 1, "correlation": 5}},
        {"ph": "X", "cat": "kernel", "name": "gemm_kernel", "pid": 0, "tid": 7, "ts": 20,
         "dur": dur, "args": {"External id": 1, "correlation": 5, "device": 0, "stream": 7}},
    ]}


def test_subnormal_kernel_duration_is_analysed(tmp_path):
    """A kernel of 1e-320 µs: 1e-326 s is 0.0 in floating point, and whole_model divided the
    FLOPs by it (ZeroDivisionError, exit 1). Now analysed: no achieved rate, exit 0."""
    trace = write(_three_events(1e-320), tmp_path / "t.json")
    r = run_cli("analyze", str(trace), "--no-cache", "--json", str(tmp_path / "r.json"))
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    whole = json.loads((tmp_path / "r.json").read_text())
    assert "whole model" in r.stdout and whole


def test_whole_model_and_coverage_of_a_subnormal_time():
    import pandas as pd

    from trace_roofline.roofline import whole_model

    table = pd.DataFrame({"layer": [pd.NA], "flops": [1e6], "bytes": [1e4], "time_us": [1e-320],
                          "costed_time_us": [1e-320], "kernels": [1], "uncosted": [0],
                          "phase": ["decode"], "dtype": ["bf16"]})
    w = whole_model(table, hardware.PRESETS["h200-sxm"])
    assert w["achieved_flops_per_s"] != w["achieved_flops_per_s"]  # NaN: no rate in 0 s


# ----------------------------------------------------------------- row 13: devices without presets
@pytest.mark.parametrize(("name", "preset"), [
    ("NVIDIA H800", "h800-sxm"),
    ("NVIDIA GH200 480GB", "gh200"),
    ("Tesla V100-SXM2-32GB", "v100-sxm2"),
    ("Tesla V100-PCIE-16GB", "v100-pcie"),
    ("NVIDIA L4", "l4"),
    ("NVIDIA L40S", "l40s"),
    ("NVIDIA H20", "h20"),
    ("NVIDIA A100-SXM4-80GB", "a100-sxm"),
    ("NVIDIA A100-SXM4-40GB", "a100-sxm-40gb"),
    ("NVIDIA A100 80GB PCIe", "a100-pcie"),
    ("AMD Instinct MI250X", "mi250x"),
])
def test_common_devices_have_presets(name, preset):
    """Traces of an H800, a GH200 or a V100 had no preset: 'none given (no device in the
    trace)'. Each common device now has one, every figure cited."""
    hw = hardware.for_device_name(name)
    assert hw is not None and hw.name == preset
    assert hw.source and hw.mem_bandwidth > 0 and hw.peak_flops
    assert hw.link_bandwidth is None or hw.link_source


def test_datasheet_figures_of_the_new_presets():
    p = hardware.PRESETS
    assert p["h800-sxm"].peak("bf16") == p["h100-sxm"].peak("bf16") and p["h800-sxm"].link_bandwidth == 200e9
    assert p["gh200"].mem_bandwidth == 4.0e12 and p["gh200-144g"].mem_bandwidth == 4.9e12
    assert p["v100-sxm2"].peak("fp16") == 125e12 and "bf16" not in p["v100-sxm2"].peak_flops
    assert p["l4"].peak("bf16") == 121e12 and p["l4"].mem_bandwidth == 300e9
    assert p["mi250x"].peak("bf16") == 191.5e12 and p["mi250x"].mem_bandwidth == 1.6e12
    assert p["a100-sxm-40gb"].mem_bandwidth == 1555e9 and p["a100-pcie"].mem_bandwidth == 1935e9


def test_a_device_without_a_preset_is_named(tmp_path):
    """A device no preset knows: the output says which device and to pass --hardware (it said
    'none given (no device in the trace)')."""
    doc = gpu_trace(1)
    doc["deviceProperties"] = [{**doc["deviceProperties"][0], "name": "NVIDIA RTX A6000"}]
    r = run_cli("analyze", str(write(doc, tmp_path / "t.json")), "--no-cache")
    assert r.returncode == 0, r.stderr
    assert "device 'NVIDIA RTX A6000' in the trace has no preset: pass --hardware" in r.stdout
    assert "no device in the trace" not in r.stdout
