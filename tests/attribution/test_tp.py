"""Tensor-parallel ranks: shards, tp inference, and the committed TP=2 H200 rank traces.

sample_traces/tp2/ (provenance in sample_traces/README.md): a vLLM-style 2-layer Qwen2.5-7B stack
on two H200s, fused qkv_proj and gate_up_proj column-parallel, o_proj and down_proj
row-parallel, each followed by an NCCL all-reduce of M x 3584 bf16; decode B=8 at S=2048 and
prefill T=512, one trace per rank, annotated and unannotated. Per-rank FLOPs are checked
against the formulas by hand (H 3584, n_q 28, n_kv 4, d 128, I 18944, t 2), the all-reduce time
against the NCCL kernels read straight from the JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.builders import SAMPLES, read, run_cli
from trace_roofline.attribution import comms
from trace_roofline.attribution.tp import infer_tp
from trace_roofline.errors import InputError
from trace_roofline.model.models import get_model
from trace_roofline.pipeline import analyze_trace

QWEN = get_model("qwen2.5-7b")
H, NQ, NKV, D, INTER, T = 3584, 28, 4, 128, 18944, 2
TP2 = SAMPLES / "tp2"
FOLDERS = {  # folder -> (phase, M tokens, rank files in rank order)
    "tp2-qwen2.5-7b-2l_decode_b8_s2048_h200": ("decode", 8, ["rank0.json.gz", "rank1.json.gz"]),
    "tp2-qwen2.5-7b-2l_decode_b8_s2048_noannot_h200": (
        "decode", 8, ["vm_664.1796069023174623233.pt.trace.json.gz",
                      "vm_665.1796069023178443443.pt.trace.json.gz"]),
    "tp2-qwen2.5-7b-2l_prefill_b1_t512_h200": ("prefill", 512, ["rank0.json.gz", "rank1.json.gz"]),
    "tp2-qwen2.5-7b-2l_prefill_b1_t512_noannot_h200": (
        "prefill", 512, ["rank0.json.gz", "rank1.json.gz"]),
}
LAYER_OPS = {"input_norm", "qkv_proj", "rope", "kv_cache", "attention", "o_proj", "all_reduce",
             "residual", "post_attention_norm", "gate_up_proj", "act", "down_proj"}


@pytest.fixture(scope="module")
def analyses() -> dict[tuple[str, int], object]:
    return {(folder, r): analyze_trace(TP2 / folder / f, QWEN)
            for folder, (_, _, files) in FOLDERS.items() for r, f in enumerate(files)}


def nccl_kernel_us(path: Path) -> float:
    """Σ duration of the ncclDevKernel_* kernels, read straight from the trace file."""
    events = read(path)["traceEvents"]
    return sum(e["dur"] for e in events
               if e.get("cat") == "kernel" and e["name"].startswith("ncclDevKernel_"))


# ---------------------------------------------------------------------------- shards
def test_shard_by_hand() -> None:
    s = QWEN.shard(2)
    assert (s.num_heads, s.num_kv_heads, s.intermediate_size, s.vocab_size) == (14, 2, 9472, 76032)
    assert (s.hidden_size, s.head_dim, s.num_layers) == (H, D, QWEN.num_layers)
    assert s.fused_linears()["qkv_proj"][:2] == (H, (NQ + 2 * NKV) // 2 * D)  # (3584, 2304)
    assert s.linears()["o_proj"][:2] == (NQ // 2 * D, H)  # row-parallel: K = 1792
    assert s.linears()["down_proj"][:2] == (INTER // 2, H)
    assert QWEN.shard(1) is QWEN
    assert QWEN.shard(4).num_kv_heads == 1  # 4 KV heads over 4 ranks
    assert get_model("llama-3-8b").shard(16).num_kv_heads == 1  # replicated when t > n_kv
    with pytest.raises(InputError, match="`tp` 3 does not divide"):
        QWEN.shard(3)


def test_infer_tp_from_the_set_of_gemm_shapes() -> None:
    tp2 = {(3584, 2304), (1792, 3584), (3584, 18944), (9472, 3584)}
    assert infer_tp(tp2, QWEN) == 2
    unsharded = {(3584, 3584), (3584, 512), (3584, 18944), (18944, 3584)}
    assert infer_tp(unsharded, QWEN) == 1
    # a TP=2 fused gate_up (3584, 18944) alone is also an unsharded gate_proj: the smaller wins
    assert infer_tp({(3584, 18944)}, QWEN) == 1
    assert infer_tp(set(), QWEN) == 1
    tp4 = {(3584, 1152), (896, 3584), (3584, 9472), (4736, 3584)}
    assert infer_tp(tp4, QWEN) == 4


# ------------------------------------------------------------------------ real ranks
@pytest.mark.parametrize("folder", FOLDERS)
def test_rank_traces_named_and_costed_per_rank(analyses, folder: str) -> None:
    phase, m, files = FOLDERS[folder]
    for r, f in enumerate(files):
        a = analyses[(folder, r)]
        assert a.tp == 2
        costed = a.costed
        assert set(costed["operator"]) == LAYER_OPS, folder
        assert a.coverage["fraction"] == pytest.approx(1.0)
        assert a.coverage["costed_fraction"] == pytest.approx(1.0)
        assert not costed["check"].notna().any()  # the shard explains every shape
        per_instance = costed[costed["flops"] > 0].groupby("operator")["flops"].agg(set)

        # qkv_proj = 2·M·H·(n_q + 2·n_kv)/t·d, plus the bias add M·(n_q + 2·n_kv)/t·d
        n_qkv = (NQ + 2 * NKV) // T * D
        assert per_instance["qkv_proj"] == {2 * m * H * n_qkv + m * n_qkv}
        assert per_instance["o_proj"] == {2 * m * (NQ // T * D) * H}
        assert per_instance["gate_up_proj"] == {2 * m * H * (2 * INTER // T)}
        assert per_instance["down_proj"] == {2 * m * (INTER // T) * H}
        # all_reduce holds exactly the NCCL kernels' time; bytes = M·H·2 B x 2(t-1)/t per call
        ar = a.operators[(a.operators["operator"] == "all_reduce") & a.operators["layer"].isna()]
        ar = ar.iloc[0]
        assert ar["time_us"] == pytest.approx(nccl_kernel_us(TP2 / folder / f), abs=1e-9)
        assert ar["kernels"] == 12 and ar["bytes"] == 12 * m * H * 2 * 1.0
        assert ar["achieved_bytes_per_s"] == pytest.approx(ar["bytes"] / (ar["time_us"] * 1e-6))
        link = 331662864726.8528  # h200-measured: the 2 x H200 all-reduce bus bandwidth
        assert ar["pct_of_roof"] == pytest.approx(100 * ar["achieved_bytes_per_s"] / link)
        assert ar["bound"] == "link"
        c = a.communication[phase]
        assert c["time_us"] == pytest.approx(ar["time_us"])
        # one stream: nothing overlaps the collectives, all their time is exposed
        assert c["exposed_time_us"] == pytest.approx(c["time_us"])
        calls = a.collectives
        assert len(calls) == 12 and set(calls["phase"]) == {phase}
        assert calls["time_us"].sum() == pytest.approx(c["time_us"])
        assert calls["layer"].tolist() == [0, 0, 1, 1] * 3  # after o_proj and down_proj
        assert a.whole["time_us"] + c["time_us"] == pytest.approx(a.coverage["kernel_time_us"])


def test_ranks_sum_to_the_model(analyses) -> None:
    """Per layer and step, the two ranks' qkv/o/gate_up/down FLOPs add up to the unsharded
    model's: 2·M·H·(n_q + 2·n_kv)·d (+ bias), 2·M·n_q·d·H, 2·M·H·2I, 2·M·I·H."""
    folder = "tp2-qwen2.5-7b-2l_decode_b8_s2048_h200"
    m = 8
    want = {"qkv_proj": 2 * m * H * (NQ + 2 * NKV) * D + m * (NQ + 2 * NKV) * D,
            "o_proj": 2 * m * NQ * D * H, "gate_up_proj": 2 * m * H * 2 * INTER,
            "down_proj": 2 * m * INTER * H}
    both = [analyses[(folder, r)].costed.groupby("operator")["flops"].sum() for r in (0, 1)]
    calls = 2 * 3  # 2 layers x 3 profiled steps
    for op, flops in want.items():
        assert both[0][op] + both[1][op] == calls * flops, op


def test_annotated_and_unannotated_ranks_agree(analyses) -> None:
    for phase in ("decode_b8_s2048", "prefill_b1_t512"):
        a = analyses[(f"tp2-qwen2.5-7b-2l_{phase}_h200", 0)].costed
        b = analyses[(f"tp2-qwen2.5-7b-2l_{phase}_noannot_h200", 0)].costed
        fa = a.groupby(["layer", "operator"])["flops"].sum()
        fb = b.groupby(["layer", "operator"])["flops"].sum()
        assert fa.to_dict() == fb.to_dict()


@pytest.mark.parametrize(("folder", "waiter", "straggler"), [
    ("tp2-qwen2.5-7b-2l_decode_b8_s2048_h200", "0", "1"),
    ("tp2-qwen2.5-7b-2l_decode_b8_s2048_noannot_h200", "0", "1"),
    ("tp2-qwen2.5-7b-2l_prefill_b1_t512_h200", "0", "1"),
    ("tp2-qwen2.5-7b-2l_prefill_b1_t512_noannot_h200", "1", "0"),
])
def test_waiting_rank_named(analyses, folder: str, waiter: str, straggler: str) -> None:
    """sample_traces/README.md: e.g. decode noannot rank 0 spends 5459 of its 6352 µs in the
    12 all-reduces, rank 1 79 µs (rank 1 arrives last); in the noannot prefill the reverse."""
    w = comms.waiting(["0", "1"], [analyses[(folder, r)].collectives for r in (0, 1)])
    w = w.set_index("rank")
    assert w.loc[waiter, "mostly_waits"] and w.loc[waiter, "waits_for"] == straggler
    assert not w.loc[straggler, "mostly_waits"]
    assert w.loc[straggler, "wait_us"] == 0.0  # its kernels are the short ones, every call


def test_report_flags_slow_communication(analyses) -> None:
    from trace_roofline.outputs.report import terminal_table

    folder = "tp2-qwen2.5-7b-2l_decode_b8_s2048_noannot_h200"
    waiter, straggler = (terminal_table([analyses[(folder, r)]]) for r in (0, 1))
    assert "! communication (decode) takes 85.9% of device time" in waiter
    assert "model qwen2.5-7b (tp2 rank)   tp 2" in waiter
    assert "! communication" not in straggler  # 8.1% of its device time


def test_cli_tp_flag_and_report(tmp_path: Path) -> None:
    trace = TP2 / "tp2-qwen2.5-7b-2l_decode_b8_s2048_h200" / "rank1.json.gz"
    run = run_cli("analyze", str(trace), "--model", "qwen2.5-7b", "--tp", "2", "--json",
                  str(tmp_path / "r.json"), check=True)
    assert "tp 2" in run.stdout and "communication (decode): 12 collective kernel(s)" in run.stdout
    assert "link 331.7 GB/s per direction" in run.stdout
    entry = json.loads((tmp_path / "r.json").read_text())["traces"][0]
    assert entry["tp"] == 2 and entry["communication"]["decode"]["kernels"] == 12
    assert entry["hardware"]["link_bandwidth_bytes_per_s"] == 331662864726.8528
    bad = run_cli("analyze", str(trace), "--model", "qwen2.5-7b", "--tp", "3")
    assert bad.returncode == 2 and "--tp 3 does not divide" in bad.stderr
    assert bad.stdout == ""
