"""Forward passes and their phases (attribution.passes) on real H200 traces and hand-built rows."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

import trace_roofline as tr
from tests.builders import SAMPLES
from trace_roofline.attribution.passes import PASS_COLUMNS, forward_passes

QWEN = tr.get_model("qwen2.5-7b")


def _attributed(name: str) -> pd.DataFrame:
    return tr.attribute(tr.load_trace(SAMPLES / name), QWEN)


@pytest.fixture(scope="module")
def hf_decode() -> pd.DataFrame:
    return _attributed("hf-qwen2-qwen2.5-7b-2l_decode_b1_s512_h200.json.gz")


@pytest.fixture(scope="module")
def hf_prefill() -> pd.DataFrame:
    return _attributed("hf-qwen2-qwen2.5-7b-2l_prefill_b1_t512_h200.json.gz")


def test_profiler_steps_are_passes(hf_decode):
    p = forward_passes(hf_decode)
    t = p.table
    assert list(t.columns) == list(PASS_COLUMNS)
    assert t["phase"].tolist() == ["decode"] * 3
    assert t["profiler_step"].tolist() == [2, 3, 4]
    assert t["S"].tolist() == [515, 516, 517]  # DynamicCache grows one key per step
    assert t["evidence"].eq("attention").all() and t["layers"].eq(2).all()
    # every row is in a pass, and time is conserved
    assert not p.pass_id.isna().any()
    assert t["time_us"].sum() == pytest.approx(hf_decode["dur_us"].sum(), rel=1e-12)


def test_generate_without_profiler_steps(hf_decode, hf_prefill):
    """An HF generate profile has no ProfilerStep ranges: one prefill pass then decode passes,
    opened by their embeddings (real kernels of the two traces, one after the other)."""
    pre = hf_prefill[hf_prefill["step"] == 2]
    dec = hf_decode.assign(ts_us=hf_decode["ts_us"] - hf_decode["ts_us"].min()
                           + pre["ts_us"].max() + 100.0)
    gen = pd.concat([pre, dec], ignore_index=True).assign(step=pd.NA)
    p = forward_passes(gen)
    t = p.table
    assert t["phase"].tolist() == ["prefill", "decode", "decode", "decode"]
    assert t["opened_by"].tolist() == ["trace_start", "embedding", "embedding", "embedding"]
    assert t["T_max"].tolist() == [512, 1, 1, 1]
    # the decode trace's steps open with the argmax over the previous logits: sampling after
    # lm_head belongs to the pass before
    assert t["kernels"].tolist() == [len(pre) + 2, 117, 117, 115]
    rows = gen.assign(p=np.asarray(p.pass_id, dtype=float)).sort_values("ts_us")
    assert rows.groupby("p")["name"].last().str.contains("ArgMax").tolist() == [True] * 3 + [False]
    assert (p.phase[(gen["operator"] == "lm_head").to_numpy()] != "unknown").all()


def test_layer_restart_opens_a_pass(hf_decode):
    """Without embeddings or steps (e.g. a replay of the layers alone) the layer order going
    back opens a pass."""
    layers = hf_decode[hf_decode["layer"].notna()].assign(step=pd.NA)
    t = forward_passes(layers).table
    assert len(t) == 3
    assert t["opened_by"].tolist() == ["trace_start", "layer_restart", "layer_restart"]
    assert t["phase"].eq("decode").all()


def _rows(specs: list[tuple[str, str, list, list | None]], pass_of: list[int] | None = None,
          ) -> pd.DataFrame:
    """Attributed-like rows: (operator, op_name, Input Dims, Concrete Inputs), one layer."""
    n = len(specs)
    stage = {"input_norm": 0, "q_proj": 1, "attention": 2, "kv_cache": 2, "o_proj": 3}
    return pd.DataFrame({
        "operator": [s[0] for s in specs],
        "op_name": [s[1] for s in specs],
        "input_dims": [json.dumps(s[2]) for s in specs],
        "concrete_inputs": [json.dumps(s[3]) if s[3] is not None else None for s in specs],
        "layer": pd.array([0 if s[0] in stage else None for s in specs], dtype="Int64"),
        "step": pd.array(pass_of if pass_of is not None else [1] * n, dtype="Int64"),
        "ts_us": np.arange(n, dtype=float),
        "dur_us": np.ones(n),
    })


QP = ("q_proj", "aten::addmm", [[3584], [1, 3584], [3584, 3584]], None)


@pytest.mark.parametrize("t, phase", [(1, "decode"), (512, "prefill")])
def test_eager_attention(t, phase):
    """matmul-softmax-matmul in eager attention (HF attn_implementation="eager")."""
    s = 512 if t > 1 else 515
    rows = _rows([
        ("attention", "aten::matmul", [[1, 28, t, 128], [1, 28, 128, s]], None),
        ("attention", "aten::bmm", [[28, t, 128], [28, 128, s]], None),
        ("attention", "aten::_softmax", [[1, 28, t, s], [], []], None),
        ("attention", "aten::bmm", [[28, t, s], [28, s, 128]], None),
    ])
    tab = forward_passes(rows).table
    assert tab["phase"].tolist() == [phase]
    assert tab["evidence"].tolist() == ["eager_attention"]


def test_bmm_outside_attention_is_no_evidence():
    """A bmm not named attention (the RoPE inverse-frequency product) says nothing."""
    rows = _rows([("rope", "aten::bmm", [[1, 64, 1], [1, 1, 7]], None), QP])
    assert forward_passes(rows).table["phase"].tolist() == ["unknown"]


@pytest.mark.parametrize("total, seqs, max_q, phase", [
    (200, 200, 1, "decode"),
    (300, 200, 100, "mixed"),  # 199 other sequences share 200 tokens: some have one
    (1000, 4, 250, "prefill"),
])
def test_varlen(total, seqs, max_q, phase):
    dims = [[total, 28, 128], [total, 4, 128], [total, 4, 128], [seqs + 1], [seqs + 1], [], []]
    conc = ["", "", "", "", "", str(max_q), str(max_q)]
    rows = _rows([("attention", "flash_attn::_flash_attn_varlen_forward", dims, conc)])
    tab = forward_passes(rows).table
    assert tab["phase"].tolist() == [phase] and tab["B"].tolist() == [seqs]


def test_mixed_batch_of_separate_attention_calls():
    rows = _rows([
        ("attention", "aten::_scaled_dot_product_flash_attention",
         [[8, 28, 1, 128], [8, 4, 900, 128], [8, 4, 900, 128]], None),
        ("attention", "aten::_scaled_dot_product_flash_attention",
         [[1, 28, 256, 128], [1, 4, 256, 128], [1, 4, 256, 128]], None),
    ])
    assert forward_passes(rows).table["phase"].tolist() == ["mixed"]


def test_kv_cache_writes_tell_the_phase():
    rows = _rows([
        ("kv_cache", "aten::index_copy_", [[1, 4, 4096, 128], [], [1], [1, 4, 1, 128]], None),
        ("kv_cache", "aten::cat", [[[0], [1, 4, 512, 128]], []], None),
    ], pass_of=[1, 2])
    tab = forward_passes(rows).table
    assert tab["phase"].tolist() == ["decode", "prefill"]
    assert tab["evidence"].tolist() == ["kv_cache", "kv_cache"]


def test_q_proj_m_over_cache_batch():
    """A compiled cache write carries the cache [B, n_kv, S, d] only: T = q_proj's M / B."""
    triton = "triton_poi_fused_add_arange_index_copy_transpose_view_4"
    rows = _rows([
        QP, ("kv_cache", triton, [[1, 4, 4096, 128], [1, 512]], None),
        ("q_proj", "aten::addmm", [[3584], [64, 3584], [3584, 3584]], None),
        ("kv_cache", triton, [[4, 4, 4096, 128], [4, 512]], None),
        ("q_proj", "aten::addmm", [[3584], [7, 3584], [3584, 3584]], None),
        ("kv_cache", triton, [[4, 4, 4096, 128], [4, 512]], None),
    ], pass_of=[1, 1, 2, 2, 3, 3])
    tab = forward_passes(rows).table
    assert tab["phase"].tolist() == ["decode", "prefill", "unknown"]  # 7 tokens over 4: no
    assert tab["evidence"].tolist() == ["gemm_m", "gemm_m", "none"]
    assert tab["T_max"].tolist()[:2] == [1, 16]


def test_strongest_rule_decides():
    """Attention shapes win over a cache write in the same pass."""
    rows = _rows([
        ("kv_cache", "aten::index_copy_", [[1, 4, 4096, 128], [], [3], [1, 4, 3, 128]], None),
        ("attention", "aten::scaled_dot_product_attention",
         [[1, 28, 1, 128], [1, 4, 4096, 128], [1, 4, 4096, 128]], None),
    ])
    tab = forward_passes(rows).table
    assert tab["evidence"].tolist() == ["attention"] and tab["phase"].tolist() == ["decode"]


def test_no_structure_no_pass():
    rows = _rows([("other", "aten::add", [[4], [4]], None)], pass_of=[None])
    p = forward_passes(rows)
    assert p.table.empty and p.pass_id.isna().all() and p.phase.tolist() == ["unknown"]


def test_annotate_sets_step_to_the_pass(hf_decode, hf_prefill):
    from trace_roofline.attribution.passes import annotate

    pre = hf_prefill[hf_prefill["step"] == 3]
    gen = pd.concat([pre, hf_decode.assign(ts_us=hf_decode["ts_us"] + 1e6)], ignore_index=True)
    out, p = annotate(gen)
    assert out["profiler_step"].tolist() == gen["step"].astype("Int64").tolist()
    assert sorted(out["step"].unique().tolist()) == [0, 1, 2, 3]
    assert out.groupby("step")["phase"].first().tolist() == ["prefill"] + ["decode"] * 3
    assert len(p.table) == 4
