"""Collectives as operators: recognition, bus-byte costs, link roof, exposed time, waiting.

Every figure is computed by hand in the test. Synthetic traces come from tests/builders.py and
reproduce what torch.profiler records around an NCCL collective (from the committed TP=2 H200
traces): `c10d::allreduce_` (Input Dims [[[8, 1, 3584]]], a TensorList) around
`record_param_comms` (Input Dims [[[8, 1, 3584]], [], ...], Concrete Inputs ending in the world
size) that launches `ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pandas as pd
import pytest

from tests.builders import BF, SAMPLES, Kineto, Op, attributed, concat, qwen_layer
from trace_roofline.attribution import comms
from trace_roofline.attribution.attribute import attribute
from trace_roofline.costs.attach import CostOptions, attach_costs
from trace_roofline.costs.collectives import kernel_dtype
from trace_roofline.errors import InputError
from trace_roofline.model import operators
from trace_roofline.model.hardware import PRESETS, from_json, get_hardware
from trace_roofline.model.models import get_model
from trace_roofline.options import AnalysisOptions
from trace_roofline.pipeline import analyze
from trace_roofline.trace import load_trace

QWEN = get_model("qwen2.5-7b")
NCCL_AR = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
# record_param_comms(inputTensors, seq, pg name, rank, coll name, in split, out split,
# global rank start, global rank stride, world size), as recorded
RPC_TYPES = ["TensorList", "", "", "Scalar", "", "ScalarList", "ScalarList", "Scalar", "Scalar",
             "Scalar"]


def rpc(dims: list, world: int, operator: str = "all_reduce") -> Op:
    return Op(operator, "record_param_comms", [[dims], [], [], [], [], [], [], [], [], []],
              RPC_TYPES, ["", "", "", "0", "", "[]", "[]", "0", "1", str(world)])


@contextmanager
def all_reduce_ops(k: Kineto) -> Iterator[None]:
    """dist.all_reduce of an [8, 1, 3584] bf16 tensor over 2 ranks, as torch records it."""
    with (k.op("c10d::allreduce_", [[[8, 1, 3584]], [], [], [], [], []],
               ["TensorList", "", "", "", "Scalar", "Scalar"]),
          k.op("record_param_comms", [[[8, 1, 3584]], [], [], [], [], [], [], [], [], []],
               RPC_TYPES, concrete=["", "", "", "0", "", "[]", "[]", "0", "1", "2"])):
        yield


def costed_one(op: Op, kernel: str, group_size: int | None = None, model=QWEN) -> pd.Series:
    att = attributed([op]).assign(name=kernel)
    return attach_costs(att, model, CostOptions(group_size=group_size)).iloc[0]


# ---------------------------------------------------------------------------- vocabulary
def test_bus_factors_follow_nccl_tests() -> None:
    f = {o.name: o.bus_factor for o in operators.COLLECTIVES}
    assert f["all_reduce"](2) == 1.0 and f["all_reduce"](8) == 2 * 7 / 8
    assert f["all_gather"](4) == 3 / 4 and f["reduce_scatter"](4) == 3 / 4
    assert f["all_to_all"](8) == 7 / 8
    assert f["send_recv"](8) == 1.0 and f["broadcast"](8) == 1.0
    assert all(o.kind == "communication" for o in operators.COLLECTIVES)


@pytest.mark.parametrize(("name", "kernel", "want"), [
    ("c10d::allreduce_", True, None),
    (NCCL_AR, True, "all_reduce"),
    ("ncclKernel_AllReduce_RING_LL_Sum_half(ncclWorkElem)", True, "all_reduce"),
    ("void vllm::cross_device_reduce_1stage<__nv_bfloat16, 2>(vllm::RankData*)", True, "all_reduce"),
    ("void vllm::cross_device_reduce_2stage<half, 8>(vllm::RankData*)", True, "all_reduce"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", True, "all_gather"),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(x)", True, "reduce_scatter"),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", True, "send_recv"),
    ("ncclDevKernel_Broadcast_RING_LL(x)", True, "broadcast"),
    ("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn", True, None),
    ("allreduce_", False, "all_reduce"),
    ("all_reduce", False, "all_reduce"),  # _c10d_functional::all_reduce, vllm::all_reduce
    ("_allgather_base_", False, "all_gather"),
    ("all_gather_into_tensor", False, "all_gather"),
    ("reduce_scatter_tensor", False, "reduce_scatter"),
    ("alltoall_base_", False, "all_to_all"),
    ("all_to_all_single", False, "all_to_all"),
    ("recv_", False, "send_recv"),
    ("record_param_comms", False, None),  # which collective: its kernel or the op around it
    ("addmm", False, None),
])
def test_collective_names(name: str, kernel: bool, want: str | None) -> None:
    got = operators.collective_of(pd.Series([name]), kernel=kernel).iloc[0]
    assert (None if pd.isna(got) else got) == want


@pytest.mark.parametrize(("kernel", "short"), [
    (NCCL_AR, "bf16"), ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", "fp32"),
    ("ncclDevKernel_AllGather_Sum_f16_RING_SIMPLE(x)", "fp16"),
    ("void vllm::cross_device_reduce_1stage<__nv_bfloat16, 2>(x)", "bf16"),
    ("void vllm::cross_device_reduce_1stage<float, 4>(x)", "fp32"),
    ("ncclDevKernel_SendRecv(x)", None)])
def test_kernel_dtype(kernel: str, short: str | None) -> None:
    d = kernel_dtype(kernel)
    assert (d.short if d else None) == short


# ----------------------------------------------------------------------------- costs
def test_all_reduce_costs_message_times_bus_factor() -> None:
    # 8 x 1 x 3584 bf16 = 57344 B; t = 2: x 2(2-1)/2 = 1; t = 4 (recorded): x 1.5
    c = costed_one(rpc([8, 1, 3584], 2), NCCL_AR)
    assert (c["flops"], c["bytes"], c["dtype"]) == (0.0, 57344.0, "bf16")
    assert c["cost_kind"] == "communication"
    assert costed_one(rpc([8, 1, 3584], 4), NCCL_AR)["bytes"] == 57344 * 1.5
    # the recorded world size wins over the caller's group size
    assert costed_one(rpc([8, 1, 3584], 4), NCCL_AR, group_size=2)["bytes"] == 57344 * 1.5


def test_all_gather_message_is_t_times_the_input() -> None:
    # all_gather_into_tensor(input [4, 3584] bf16, group size, group name) over 2 ranks:
    # S = 2 x 4 x 3584 x 2 B = 57344 B; bus (2-1)/2 -> 28672 B
    op = Op("all_gather", "_c10d_functional::all_gather_into_tensor", [[4, 3584], [], []],
            [BF, "Scalar", ""])
    kernel = "ncclDevKernel_AllGather_RING_LL(x)"
    assert costed_one(op, kernel, group_size=2)["bytes"] == 28672.0
    # c10d::_allgather_base_(output [8, 3584], input [4, 3584]): the input is argument 1
    base = Op("all_gather", "c10d::_allgather_base_", [[8, 3584], [4, 3584], []],
              [BF, BF, ""])
    assert costed_one(base, kernel, group_size=2)["bytes"] == 28672.0


def test_reduce_scatter_and_send_recv() -> None:
    # reduce_scatter_tensor(input [8, 3584] bf16) over 4 ranks: S = 57344 B, bus 3/4
    op = Op("reduce_scatter", "_c10d_functional::reduce_scatter_tensor",
            [[8, 3584], [], [], []], [BF, "", "Scalar", ""])
    assert costed_one(op, "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(x)", 4)["bytes"] == 43008
    send = Op("send_recv", "c10d::send", [[[1024]], [], []], ["TensorList", "", "Scalar"])
    assert costed_one(send, "ncclDevKernel_SendRecv(x)", 2)["bytes"] == 1024 * 2  # model bf16


def test_vllm_custom_all_reduce_reads_ranks_from_its_kernel() -> None:
    # vllm::all_reduce(x [8, 3584] bf16) with cross_device_reduce_1stage<__nv_bfloat16, 4>:
    # t = 4 from the template, S = 57344 B, bus 2·3/4
    op = Op("all_reduce", "vllm::all_reduce", [[8, 3584]], [BF])
    kernel = "void vllm::cross_device_reduce_1stage<__nv_bfloat16, 4>(vllm::RankData*, int)"
    assert costed_one(op, kernel)["bytes"] == 57344 * 1.5


def test_unknown_group_size_is_uncosted() -> None:
    op = Op("all_reduce", "c10d::allreduce_", [[[8, 3584]], [], [], [], [], []],
            ["TensorList", "", "", "", "Scalar", "Scalar"], ["", "", "", "", "False", "-1"])
    c = costed_one(op, NCCL_AR)
    assert np.isnan(c["bytes"]) and "group size unknown" in c["uncosted"]
    assert costed_one(op, NCCL_AR, group_size=2)["bytes"] == 57344.0


# ---------------------------------------------------------------------------- roofline
def test_collectives_sit_on_the_link_roof_outside_the_whole_model() -> None:
    """A layer (durations 1 µs) and two 57344-B all-reduces of 10 and 20 µs: bus bytes/s =
    114688 B / 30 µs; % of the H200 preset's 450 GB/s link; the whole model, the
    reconciliation and the extrapolation leave them out."""
    layer = attributed(qwen_layer(QWEN, 1, 2048))
    ar = attributed([rpc([1, 1, 3584], 2), rpc([1, 1, 3584], 2)], first_event=900,
                    first_op=5000, t0=500.0)
    ar["name"] = NCCL_AR
    ar["dur_us"] = [10.0, 20.0]
    att = concat(layer, ar)
    a = analyze(att, QWEN, PRESETS["h200-sxm"], AnalysisOptions(layers=28))
    row = a.operators[(a.operators["operator"] == "all_reduce") & a.operators["layer"].isna()]
    r = row.iloc[0]
    assert r["bytes"] == 2 * 7168.0 and r["time_us"] == 30.0
    assert r["achieved_bytes_per_s"] == pytest.approx(14336 / 30e-6, rel=1e-12)
    assert r["pct_of_roof"] == pytest.approx(100 * 14336 / 30e-6 / 450e9, rel=1e-12)
    assert r["bound"] == "link" and np.isnan(r["intensity"])
    # (the layer's 1-µs kernels put some rows above their roof by more than the L2 holds: an
    # overcount the whole model leaves out, `excluded`, as it leaves out the collectives)
    hbm = a.operators[a.operators["layer"].isna() & (a.operators["operator"] != "all_reduce")
                      & ~a.operators["operator"].isin(list(a.whole["excluded"]))]
    assert a.whole["flops"] == pytest.approx(hbm["flops"].sum())
    assert a.whole["bytes"] == pytest.approx(hbm["bytes"].sum())
    assert a.whole["time_us"] == pytest.approx(layer["dur_us"].sum())
    assert "all_reduce" not in set(a.reconciliation["operator"])
    assert "all_reduce" not in set(a.extrapolated["operator"])
    c = a.communication["decode"]
    assert c["time_us"] == 30.0 and c["bytes"] == 14336.0 and c["kernels"] == 2
    assert c["time_share"] == pytest.approx(30.0 / att["dur_us"].sum())
    assert c["link_fraction"] == pytest.approx(14336 / 30e-6 / 450e9)
    assert c["exposed_time_us"] == 30.0  # back to back on one stream: nothing overlaps


# ------------------------------------------------------------------------- exposed time
def test_exposed_time_by_interval_arithmetic() -> None:
    # collectives [0, 10), [20, 25), [2, 5); compute [2, 4), [3, 6), [8, 12) merge to
    # [2, 6) u [8, 12): covered 4 + 2 of the first -> 4 exposed; the second 5; the third 0
    ts = np.array([0.0, 20.0, 2.0, 2.0, 3.0, 8.0])
    dur = np.array([10.0, 5.0, 3.0, 2.0, 3.0, 4.0])
    coll = np.array([True, True, True, False, False, False])
    out = comms.exposed_us(ts, dur, coll, ~coll)
    np.testing.assert_allclose(out, [4.0, 5.0, 0.0, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(comms.exposed_us(ts, dur, coll, np.zeros(6, bool)),
                               [10.0, 5.0, 3.0, 0, 0, 0])


def test_exposed_time_on_a_trace_with_a_compute_stream(kineto, trace_file) -> None:
    """An all-reduce on stream 9 overlapping a 4 µs GEMM on stream 7: 10 - 4 = 6 µs exposed."""
    k = kineto
    with all_reduce_ops(k):
        k.kernel(NCCL_AR, 10.0, stream=9, gpu_ts=2_000_000.0)
    with k.op("aten::mm", [[8, 3584], [3584, 3584]], [BF, BF]):
        k.kernel("sm90_xmma_gemm_bf16", 4.0, stream=7, gpu_ts=2_000_003.0)
    a = analyze(attribute(load_trace(trace_file(k)), None), None, PRESETS["h200-sxm"])
    c = a.communication["unknown"]
    assert c["time_us"] == 10.0 and c["exposed_time_us"] == pytest.approx(6.0)
    assert c["bytes"] == 57344.0


# ------------------------------------------------------------------------------ naming
def test_collectives_named_over_ranges_and_unlinked(kineto, trace_file) -> None:
    """Inside an `o_proj` range the NCCL kernel is all_reduce (by its c10d op); a collective
    kernel no op launched (a graph replay) is named by its kernel name; time is exact."""
    k = kineto
    with k.ann("o_proj"):
        with k.op("aten::mm", [[8, 1792], [1792, 3584]], [BF, BF]):
            k.kernel("sm90_xmma_gemm_bf16", 3.0)
        with all_reduce_ops(k):
            k.kernel(NCCL_AR, 7.25)
    k.kernel("ncclDevKernel_AllGather_RING_LL(x)", 2.5, ext=False, runtime=False, flow=False)
    att = attribute(load_trace(trace_file(k)), None)
    by = att.set_index("name")
    assert by.loc[NCCL_AR, "operator"] == "all_reduce" and by.loc[NCCL_AR, "evidence"] == "kernel_name"
    assert by.loc["ncclDevKernel_AllGather_RING_LL(x)", "operator"] == "all_gather"
    assert by.loc["ncclDevKernel_AllGather_RING_LL(x)", "evidence"] == "kernel_name"
    assert by.loc["sm90_xmma_gemm_bf16", "operator"] == "o_proj"
    assert att.loc[att["operator"] == "all_reduce", "dur_us"].sum() == 7.25


# ------------------------------------------------------------------------------ waiting
def _calls(times: list[float], phase: str = "decode") -> pd.DataFrame:
    return pd.DataFrame({"operator": "all_reduce", "phase": phase,
                         "ts_us": np.arange(len(times), dtype=float), "time_us": times})


def test_waiting_names_the_straggler() -> None:
    # rank 0: 100, 200 µs; rank 1: 5, 6 µs -> rank 0 waits 95 + 194 = 289 of 300 for rank 1
    w = comms.waiting(["0", "1"], [_calls([100.0, 200.0]), _calls([5.0, 6.0])]).set_index("rank")
    assert w.loc["0", "wait_us"] == 289.0 and w.loc["0", "time_us"] == 300.0
    assert w.loc["0", "wait_share"] == pytest.approx(289 / 300)
    assert w.loc["0", "waits_for"] == "1" and w.loc["0", "mostly_waits"]
    assert w.loc["1", "wait_us"] == 0.0 and pd.isna(w.loc["1", "waits_for"])
    assert not w.loc["1", "mostly_waits"]
    lines = comms.waiting_lines(w.reset_index())
    assert len(lines) == 1 and "rank 0 mostly waits" in lines[0] and "for rank 1" in lines[0]


def test_waiting_pairs_the_fewest_calls_and_three_ranks() -> None:
    # ranks a, b, c; calls (10, 4, 7), (3, 9, 8), extra call on c ignored:
    # per call min 4 and 3; waits a: 6 + 0, b: 0 + 6, c: 3 + 5
    w = comms.waiting(["a", "b", "c"], [_calls([10, 3]), _calls([4, 9]), _calls([7, 8, 50])])
    w = w.set_index("rank")
    assert (w["collectives"] == 2).all()
    assert w["wait_us"].tolist() == [6.0, 6.0, 8.0]
    assert w.loc["a", "waits_for"] == "b" and w.loc["b", "waits_for"] == "a"
    assert w.loc["c", "waits_for"] == "a"  # 5 µs behind a's call beats 3 µs behind b's


# ----------------------------------------------------------------------------- hardware
def test_link_bandwidth_presets_and_files(tmp_path) -> None:
    assert PRESETS["h200-sxm"].link_bandwidth == 450e9
    assert PRESETS["h100-sxm"].link_bandwidth == 450e9
    assert PRESETS["a100-sxm"].link_bandwidth == 300e9
    assert PRESETS["rtx4090"].link_bandwidth == 31.5e9
    measured = json.loads((SAMPLES / "h200x2_allreduce_busbw.json").read_text())
    assert get_hardware("h200-measured").link_bandwidth == measured["link_bandwidth"]
    base = {"name": "x", "peak_flops": {"bf16": 1e15}, "mem_bandwidth": 4e12}
    p = tmp_path / "hw.json"
    p.write_text(json.dumps({**base, "link_bandwidth": 3e11}))
    hw = from_json(p)
    assert hw.link_bandwidth == 3e11 and hw.to_json()["link_bandwidth"] == 3e11
    p.write_text(json.dumps(base))
    assert from_json(p).link_bandwidth is None and "link_bandwidth" not in from_json(p).to_json()
    p.write_text(json.dumps({**base, "link_bandwidth": -1}))
    with pytest.raises(InputError, match="hw.json: non-positive .* link_bandwidth"):
        from_json(p)
    p.write_text(json.dumps({**base, "link_bandwidth": "fast"}))
    with pytest.raises(InputError, match="link_bandwidth must be a number"):
        from_json(p)
