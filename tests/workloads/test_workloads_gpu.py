"""GPU tests of the workloads (run on the H200 by workloads/capture_all.sh; skipped without CUDA)."""

from __future__ import annotations

import pytest

from tests.builders import read

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from workloads.calibrate import calibrate  # noqa: E402
from workloads.layer import OPERATORS  # noqa: E402
from workloads.runner import RunConfig, build, check_correctness, run  # noqa: E402
from workloads.sweep import m_sweep  # noqa: E402


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("phase", ["decode", "prefill"])
@pytest.mark.parametrize("layout", ["separate", "fused"])
def test_layer_matches_float32_reference_on_cuda(dtype: str, phase: str, layout: str) -> None:
    cfg = RunConfig(model="qwen2.5-7b", phase=phase, batch=2, context=300, tokens=130,
                    device="cuda", dtype=dtype, layout=layout, layers=2)
    stack, x, pos = build(cfg, torch.device("cuda"))
    results = check_correctness(stack, x, pos)  # raises past the dtype's tolerance
    assert len(results) == 2
    assert all(r["out"] <= r["tolerance"] for r in results)


def test_compiled_layer_matches_eager() -> None:
    cfg = RunConfig(model="qwen2.5-7b", phase="decode", batch=4, context=512, device="cuda",
                    annotate="none")
    stack, x, pos = build(cfg, torch.device("cuda"))
    with torch.inference_mode():
        eager = stack(x, pos)
        compiled = torch.compile(stack)(x, pos)
    err = float((compiled.float() - eager.float()).norm() / eager.float().norm())
    assert err < 1e-2


def test_profiled_cuda_run_has_kernels_in_every_range(tmp_path) -> None:
    summary = run(RunConfig(model="qwen2.5-7b", phase="decode", batch=2, context=256,
                            device="cuda", steps=2, out=str(tmp_path)), progress=lambda m: None)
    events = read(summary["trace"])["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    gpu_ranges = [e for e in events if e.get("cat") == "gpu_user_annotation"]
    assert kernels
    for op in OPERATORS["separate"]:
        spans = [(e["ts"], e["ts"] + e["dur"]) for e in gpu_ranges if e["name"] == op]
        assert spans, f"no gpu_user_annotation for {op}"
        inside = [k for k in kernels if any(a <= k["ts"] < b for a, b in spans)]
        assert inside, f"no kernel inside {op}"


def test_calibrate_cuda_schema_and_sanity() -> None:
    hw, raw = calibrate("cuda", copy_bytes=512 << 20, sizes=(2048,), repeats=5,
                        progress=lambda m: None)
    assert set(hw) == {"name", "peak_flops", "mem_bandwidth", "source", "device_name",
                       "device_names", "date", "method", "ceilings_from", "measurements"}
    assert set(hw["peak_flops"]) == {"bf16", "fp16", "tf32", "fp32"}
    # Half precision through the tensor cores beats plain fp32 on every CUDA GPU of interest.
    assert hw["peak_flops"]["bf16"] > hw["peak_flops"]["fp32"] > 0
    assert 1e10 < hw["mem_bandwidth"] < 1e14


def test_m_sweep_cuda_rises_with_m() -> None:
    res = m_sweep([1, 256], 3584, 3584, torch.bfloat16, torch.device("cuda"), warmup=5,
                  iters=20, progress=lambda m: None)
    r1, r256 = res["rows"]
    assert r256["achieved_tflops"] > 20 * r1["achieved_tflops"]
