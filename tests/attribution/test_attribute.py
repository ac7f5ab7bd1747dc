"""attribute.py: linking kernels to ops, naming operators, layers, steps, conservation.

Synthetic traces are built here event by event (`Kineto` below writes what torch.profiler
writes: cpu_op / user_annotation / python_function ranges nested by time on one thread,
cuda_runtime launches with a correlation id, ac2g flows, kernels carrying correlation and
External id), then read through trace.load_trace like any file. End-to-end tests run every
committed trace in sample_traces/.
"""

from __future__ import annotations

import contextlib
import gzip
import re
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.builders import SAMPLES, Kineto, by_prefix, walk
from trace_roofline.attribution.attribute import (
    ATTRIBUTED_COLUMNS,
    OPERATOR_TABLE_COLUMNS,
    attribute,
    coverage,
    operator_table,
)
from trace_roofline.attribution.nest import Nest
from trace_roofline.model.models import get_model
from trace_roofline.trace import load_trace

BF = "c10::BFloat16"
TINY = get_model("qwen-tiny")  # H 256, q 256, kv 64, I 768, vocab 1024
SEPARATE = {"q_proj", "k_proj", "v_proj", "o_proj", "attention", "gate_proj", "up_proj",
            "down_proj"}
FUSED = {"qkv_proj", "o_proj", "attention", "gate_up_proj", "down_proj"}


# ----------------------------------------------------------------------------------------------
# A tiny Kineto trace writer
# ----------------------------------------------------------------------------------------------
def linear(k: Kineto, m: int, kk: int, n: int, bias: bool, kernels=("nvjet_gemm",), **kw):
    """aten::linear > addmm (bias) or > matmul > mm, as HF's nn.Linear records on CUDA."""
    w = [n, kk]
    with k.op("aten::linear", [[1, m, kk], w, [n] if bias else []]):
        if bias:
            with k.op("aten::addmm", [[n], [m, kk], [kk, n], [], []]):
                for name in kernels:
                    k.kernel(name, **kw)
        else:
            with k.op("aten::matmul", [[1, m, kk], [kk, n]]), k.op("aten::mm", [[m, kk], [kk, n]]):
                for name in kernels:
                    k.kernel(name, **kw)


def elementwise(k: Kineto, name: str, dims: list, kernel: str = "elementwise_kernel", **kw):
    with k.op(name, dims):
        k.kernel(kernel, **kw)


def rms_norm(k: Kineto, m: int, h: int):
    x = [1, m, h]
    with k.op("aten::to", [x, [], [], [], []]), k.op("aten::_to_copy", [x, [], []]):
        elementwise(k, "aten::copy_", [x, x, []], "direct_copy_kernel")
    elementwise(k, "aten::pow", [x, []])
    elementwise(k, "aten::mean", [x, [], [], []], "reduce_kernel")
    elementwise(k, "aten::add", [[1, m, 1], [], []])
    elementwise(k, "aten::rsqrt", [[1, m, 1]])
    elementwise(k, "aten::mul", [x, [1, m, 1]])
    with k.op("aten::to", [x, [], [], [], []]), k.op("aten::_to_copy", [x, [], []]):
        elementwise(k, "aten::copy_", [x, x, []], "bfloat16_copy_kernel")
    elementwise(k, "aten::mul", [[h], x])


def qwen_layer(k: Kineto, spec=TINY, m: int = 1, s: int = 16, *, fused: bool = False,
               annotate: bool = False, modules: int | None = None, no_ext: bool = False,
               splitk: bool = True):
    """One HF-ordered Qwen2 decoder layer (decode at m tokens against s cached keys)."""
    h, q, kv, inter = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size
    nq, nkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    kw = {"ext": not no_ext}

    @contextmanager
    def a(name):
        if annotate:
            with k.ann(name):
                yield
        else:
            yield

    @contextmanager
    def mod(cls):
        if modules is not None:
            with k.module(cls, modules if "Linear" not in cls else 0):
                yield
        else:
            yield

    with mod("Qwen2DecoderLayer"):
        with a("input_norm"), mod("Qwen2RMSNorm"):
            rms_norm(k, m, h)
        with mod("Qwen2Attention"):
            if fused:
                with a("qkv_proj"), mod("Linear"):
                    linear(k, m, h, q + 2 * kv, True, **kw)
            else:
                for name, n in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                    with a(name), mod("Linear"):
                        linear(k, m, h, n, True, **kw)
            with a("rope"):
                for heads in (nq, nkv):
                    x = [1, heads, m, d]
                    elementwise(k, "aten::mul", [x, [1, 1, m, d]], **kw)
                    elementwise(k, "aten::neg", [[1, heads, m, d // 2]], **kw)
                    elementwise(k, "aten::cat", [[[1, heads, m, d // 2]] * 2, []], "CatArray",
                                **kw)
                    elementwise(k, "aten::mul", [x, [1, 1, m, d]], **kw)
                    elementwise(k, "aten::add", [x, x, []], **kw)
            with a("kv_cache"):
                for _ in range(2):
                    elementwise(k, "aten::cat", [[[1, nkv, s - m, d], [1, nkv, m, d]], []],
                                "CatArray", **kw)
            qkv = [[1, nq, m, d], [1, nkv, s, d], [1, nkv, s, d]]
            with (a("attention"), k.op("aten::scaled_dot_product_attention", qkv),
                  k.op("aten::_scaled_dot_product_flash_attention", qkv),
                  k.op("aten::_flash_attention_forward",
                       [[1, m, nq, d], [1, s, nkv, d], [1, s, nkv, d]])):
                k.kernel("Memset (Device)", 0.5, kind="memset", **kw)
                k.kernel("flash_fwd_kernel", 4.0, **kw)
            with a("o_proj"), mod("Linear"):
                linear(k, m, q, h, False, **kw)
        with a("residual"):
            elementwise(k, "aten::add", [[1, m, h], [1, m, h], []], **kw)
        with a("post_attention_norm"), mod("Qwen2RMSNorm"):
            rms_norm(k, m, h)
        with mod("Qwen2MLP"):
            if fused:
                with a("gate_up_proj"), mod("Linear"):
                    linear(k, m, h, 2 * inter, False, **kw)
                with a("act"), mod("SiLUActivation"):
                    elementwise(k, "aten::silu", [[1, m, inter]], **kw)
                elementwise(k, "aten::mul", [[1, m, inter], [1, m, inter]], **kw)
            else:
                with a("gate_proj"), mod("Linear"):
                    linear(k, m, h, inter, False, **kw)
                with a("act"), mod("SiLUActivation"):
                    elementwise(k, "aten::silu", [[1, m, inter]], **kw)
                with a("up_proj"), mod("Linear"):
                    linear(k, m, h, inter, False, **kw)
                with a("act"):
                    elementwise(k, "aten::mul", [[1, m, inter], [1, m, inter]], **kw)
            with a("down_proj"), mod("Linear"):
                gemm = ("nvjet_splitK", "splitKreduce_kernel") if splitk else ("nvjet_gemm",)
                linear(k, m, inter, h, False, kernels=gemm, **kw)
        with a("residual"):
            elementwise(k, "aten::add", [[1, m, h], [1, m, h], []], **kw)


def qwen_model(k: Kineto, layers: int = 2, steps: int = 2, *, lm_head: bool = True, **kw):
    """Embedding, `layers` decoder layers, final norm and lm_head, one ProfilerStep each."""
    h = TINY.hidden_size
    with_modules = kw.pop("modules", False)
    mod = (lambda cls, i: k.module(cls, i)) if with_modules else (lambda cls, i: _null())
    for step in range(1, steps + 1):
        with k.ann(f"ProfilerStep#{step}"), mod("Qwen2ForCausalLM", 0):
            with (mod("Embedding", 0),
                  k.op("aten::embedding", [[TINY.vocab_size, h], [1, 1], [], [], []])):
                elementwise(k, "aten::index_select", [[TINY.vocab_size, h], [], [1]])
            for i in range(layers):
                qwen_layer(k, modules=i if with_modules else None, **kw)
            with mod("Qwen2RMSNorm", 99):
                rms_norm(k, 1, h)
            if lm_head:
                with mod("Linear", 99):
                    linear(k, 1, h, TINY.vocab_size, False)


@contextmanager
def _null():
    yield


@pytest.fixture
def build(tmp_path):
    def load(k: Kineto, name: str = "t.json"):
        return load_trace(k.write(tmp_path / name))
    return load


def nums(s: pd.Series) -> list:
    """Int64 column -> list with None for NA (NA does not compare)."""
    return [None if pd.isna(v) else int(v) for v in s]


def layer_ops(a: pd.DataFrame) -> dict:
    """{(step, layer): set of operators} over layer rows."""
    rows = a[a["layer"].notna()]
    return {key: set(g["operator"]) for key, g in rows.groupby(["step", "layer"])}


def assert_conserved(a: pd.DataFrame, tr) -> None:
    """Every device row appears once, in order, with its exact duration."""
    assert list(a.columns) == list(ATTRIBUTED_COLUMNS)
    if tr.cpu_only:
        return
    assert a["event_id"].tolist() == tr.device["event_id"].tolist()
    assert a["dur_us"].tolist() == tr.device["dur_us"].tolist()
    assert a["dur_us"].sum() == tr.device["dur_us"].sum()  # same values, same order
    t = operator_table(a)
    cov = coverage(a)
    assert t["dur_ps"].sum() == cov["kernel_time_ps"]
    assert cov["kernel_time_ps"] == int(np.rint(tr.device["dur_us"].to_numpy() * 1e6).sum())
    assert t["kernels"].sum() == len(tr.device)


# ----------------------------------------------------------------------------------------------
# Interval nesting
# ----------------------------------------------------------------------------------------------
def _random_nested(rng, n_roots=30):
    """Properly nested intervals (ns) on 3 threads, with same-start children and 0-length ones."""
    out = []

    def grow(s, e, key, depth):
        out.append((s, e, key))
        t = s
        while depth < 6 and t < e - 2 and rng.random() < 0.8:
            a = t + int(rng.integers(0, 3))  # children may start at the parent's start
            b = min(e, a + int(rng.integers(0, max(1, (e - a) // 2 + 1))))
            if b < a:
                break
            grow(a, b, key, depth + 1)
            t = b + int(rng.integers(1, 3))

    for key in range(3):
        t = 0
        for _ in range(n_roots):
            d = int(rng.integers(1, 400))
            grow(t, t + d, key, 0)
            t += d + int(rng.integers(0, 5))
    return np.array(out, dtype=np.int64)


def test_nest_matches_brute_force():
    rng = np.random.default_rng(0)
    iv = _random_nested(rng)
    s, e, key = iv[:, 0], iv[:, 1], iv[:, 2]
    nest = Nest(s, e, key)
    q = rng.integers(-5, int(e.max()) + 5, 3000)
    qk = rng.integers(-1, 3, 3000)
    inner, outer = nest.innermost(q, qk), nest.outermost(q, qk)
    ee = np.maximum(e, s + 1)
    for i in range(len(q)):
        hit = np.flatnonzero((key == qk[i]) & (s <= q[i]) & (ee > q[i]))
        if not len(hit):
            assert inner[i] == -1 and outer[i] == -1
            continue
        # innermost: latest start, shortest; ties of identical intervals go to the later one
        order = sorted(hit, key=lambda j: (s[j], -ee[j], j))
        assert inner[i] == order[-1] and outer[i] == order[0]
    # depth = number of strict ancestors (identical intervals: file order decides)
    anc = [sum(1 for j in np.flatnonzero(key == key[i]) if (s[j], -ee[j], j) < (s[i], -ee[i], i)
               and ee[j] > s[i]) for i in range(len(s))]
    assert nest.depth.tolist() == anc


def test_nest_ignores_unknown_threads():
    nest = Nest(np.array([0, 0]), np.array([10, 10]), np.array([-1, 0]))
    assert nest.innermost(np.array([5, 5]), np.array([-1, 0])).tolist() == [-1, 1]


# ----------------------------------------------------------------------------------------------
# Linking
# ----------------------------------------------------------------------------------------------
def test_external_id_links_to_innermost_shape_carrying_op(build):
    k = Kineto()
    with k.ann("ProfilerStep#5"):
        linear(k, 4, 256, 256, True)
        with k.op("aten::to", [[4], [], [], [], []]), k.op("aten::_to_copy", [[4], []]):
            with k.op("aten::empty_strided", [[], []]):
                pass
            with k.op("aten::copy_", [[4], [4], []]):
                k.kernel("copy_kernel")
        with k.op("aten::item", [[]]), k.op("aten::_local_scalar_dense", [[]]):
            k.kernel("Memcpy DtoH", kind="memcpy")
    tr = build(k)
    a = attribute(tr)
    ops = tr.cpu_ops.set_index("op_id")["name"].astype(str)
    assert [ops[i] for i in a["op_id"]] == ["aten::addmm", "aten::copy_",
                                           "aten::_local_scalar_dense"]
    assert a["op_name"].tolist() == ["aten::addmm", "aten::copy_", "aten::_local_scalar_dense"]
    assert a["input_dims"].iloc[0] == "[[256], [4, 256], [256, 256], [], []]"
    assert a["step"].tolist() == [5, 5, 5]
    assert a["kind"].tolist() == ["kernel", "kernel", "memcpy"]
    assert_conserved(a, tr)


@pytest.mark.parametrize("how", ["correlation", "flow"])
def test_kernels_without_external_id(build, how):
    """No External id: the runtime launch (or only its flow) places the kernel in its op."""
    k = Kineto()
    with k.ann("ProfilerStep#1"):
        with (k.ann("q_proj"), k.op("aten::linear", [[1, 1, 256], [256, 256], [256]]),
              k.op("aten::addmm", [[256], [1, 256], [256, 256], [], []])):
            k.kernel("gemm", ext=False, runtime=how == "correlation")
        with k.ann("act"), k.op("aten::silu", [[1, 1, 768]]):
            k.kernel("silu_kernel", ext=False, runtime=how == "correlation")
    tr = build(k)
    a = attribute(tr)
    assert a["op_name"].tolist() == ["aten::addmm", "aten::silu"]
    assert a["operator"].tolist() == ["q_proj", "act"]
    assert a["evidence"].tolist() == ["annotation", "annotation"]
    assert a["step"].tolist() == [1, 1]


def test_unlinked_kernel_is_unattributed_unless_a_gpu_range_names_it(build):
    k = Kineto()
    with k.ann("ProfilerStep#1"), k.ann("attention"), k.op("aten::silu", [[1, 8]]):
        k.kernel("linked")
    k.kernel("orphan", ext=False, runtime=False, flow=False, dur=3.0)
    k.kernel("orphan_in_gpu_range", ext=False, runtime=False, flow=False, dur=1.0,
             gpu_ts=2_000_010.0)
    k.events.append({"ph": "X", "cat": "gpu_user_annotation", "name": "down_proj", "pid": 0,
                     "tid": 7, "ts": 2_000_000.0, "dur": 50.0, "args": {}})
    tr = build(k)
    a = attribute(tr)
    assert a["operator"].tolist() == ["attention", "unattributed", "down_proj"]
    assert a["evidence"].tolist() == ["annotation", "fallback", "annotation"]
    assert a["op_id"].isna().tolist() == [False, True, True]
    cov = coverage(a)
    assert cov["kernels"] == 3 and cov["unattributed_kernels"] == 1
    assert cov["unattributed_time_us"] == 3.0
    assert cov["fraction"] == pytest.approx((cov["kernel_time_us"] - 3.0) / cov["kernel_time_us"])
    t = operator_table(a)
    assert list(t.columns) == list(OPERATOR_TABLE_COLUMNS)
    assert t.set_index("operator").loc["unattributed", "dur_us"] == 3.0
    assert_conserved(a, tr)


def test_split_k_and_memset_count_under_one_instance(build):
    k = Kineto()
    qwen_model(k, layers=1, steps=1)
    tr = build(k)
    a = attribute(tr, TINY)
    down = a[a["operator"] == "down_proj"]
    assert down["name"].tolist() == ["nvjet_splitK", "splitKreduce_kernel"]
    assert down["op_id"].nunique() == 1 and down["op_name"].iloc[0] == "aten::mm"
    attn = a[a["operator"] == "attention"]
    assert attn["kind"].tolist() == ["memset", "kernel"]
    assert attn["op_name"].unique().tolist() == ["aten::scaled_dot_product_attention"]
    t = operator_table(a)
    row = t[(t["operator"] == "down_proj")].iloc[0]
    assert (row["kernels"], row["ops"]) == (2, 1)


def test_attention_call_is_one_instance(build):
    """Mask preparation inside SDPA, cuDNN's kernels and memset: one instance, the SDPA op."""
    k = Kineto()
    qkv = [[1, 8, 1, 32], [1, 2, 16, 32], [1, 2, 16, 32]]
    with k.ann("ProfilerStep#1"), k.op("aten::scaled_dot_product_attention", qkv):
        elementwise(k, "aten::masked_fill", [[1, 1, 1, 16], [1, 1, 1, 16], []])
        with k.op("aten::_scaled_dot_product_cudnn_attention", qkv), \
                k.op("aten::_cudnn_attention_forward", qkv):
            k.kernel("Memset (Device)", kind="memset")
            k.kernel("cudnn_sdpa")
            k.kernel("lean_reduction_kernel")
    a = attribute(build(k))
    assert a["op_id"].nunique() == 1 and len(a) == 4
    assert a["op_name"].unique().tolist() == ["aten::scaled_dot_product_attention"]
    assert a["operator"].unique().tolist() == ["attention"]


def test_overlapping_streams_conserve_time(build):
    """Kernels of two streams overlap in time; each keeps its own op and its full duration."""
    k = Kineto()
    with k.ann("ProfilerStep#1"):
        with k.ann("q_proj"), k.op("aten::mm", [[1, 256], [256, 256]]):
            k.kernel("gemm_a", 10.0, stream=7, gpu_ts=5_000_000.0)
        with k.ann("k_proj"), k.op("aten::mm", [[1, 256], [256, 64]]):
            k.kernel("gemm_b", 10.0, stream=8, gpu_ts=5_000_005.0)
        with k.ann("v_proj"), k.op("aten::mm", [[1, 256], [256, 64]]):
            k.kernel("gemm_c", 0.001, stream=8, gpu_ts=5_000_006.0)
    tr = build(k)
    a = attribute(tr)
    assert a["operator"].tolist() == ["q_proj", "k_proj", "v_proj"]
    assert a["stream"].tolist() == [7, 8, 8]
    t = operator_table(a)
    assert t["dur_ps"].tolist() == [10_000_000, 10_000_000, 1_000]
    assert_conserved(a, tr)


def test_launch_thread_is_respected(build):
    """A launch on another thread is placed by that thread's ops, not the main thread's."""
    k = Kineto()
    with k.ann("ProfilerStep#1"), k.op("aten::mul", [[4], [4]]):
        corr = k.kernel("mul_kernel", ext=False)
    rt = next(e for e in k.events if e.get("cat") == "cuda_runtime" and
              e["args"]["correlation"] == corr)
    rt["tid"] = 777  # launched by a worker thread with no cpu op around it
    del rt["args"]["External id"]
    for e in k.events:
        if e.get("cat") == "ac2g":
            e["tid"] = 777
    tr = build(k)
    a = attribute(tr)
    assert a["op_id"].isna().all() and a["operator"].tolist() == ["unattributed"]
    assert a["step"].tolist() == [1]  # the step is still known from the CPU step range


def test_device_only_trace_is_all_unattributed(build):
    """Kernels and launches but no cpu ops (CUDA activity only): nothing to name them by."""
    k = Kineto()
    k.kernel("lonely", flow=False)
    k.kernel("lonely_flow_only", runtime=False)
    tr = build(k)
    assert tr.cpu_ops.empty
    a = attribute(tr)
    assert a["operator"].tolist() == ["unattributed"] * 2
    assert coverage(a)["fraction"] == 0.0
    assert_conserved(a, tr)


def test_no_profiler_steps(build):
    k = Kineto()
    qwen_model(k, layers=1, steps=1)
    k.events = [e for e in k.events if e.get("cat") != "user_annotation"]
    a = attribute(build(k))
    assert a["step"].isna().all()
    assert set(a.loc[a["layer"] == 0, "operator"]) >= SEPARATE
    assert set(a["layer"].dropna()) == {0}


# ----------------------------------------------------------------------------------------------
# Naming: annotations
# ----------------------------------------------------------------------------------------------
def test_annotated_layers_and_steps(build):
    k = Kineto()
    for step in (3, 4):
        with k.ann(f"ProfilerStep#{step}"):
            for i in range(2):
                with k.ann(f"layers.{i}"):
                    qwen_layer(k, annotate=True)
    tr = build(k)
    a = attribute(tr)
    assert (a["evidence"] == "annotation").all()
    per = layer_ops(a)
    assert set(per) == {(s, i) for s in (3, 4) for i in (0, 1)}
    canon = {"input_norm", "rope", "kv_cache", "residual", "post_attention_norm", "act"}
    assert all(ops == SEPARATE | canon for ops in per.values())
    assert_conserved(a, tr)


def test_innermost_canonical_range_wins(build):
    k = Kineto()
    with k.ann("ProfilerStep#1"), k.ann("layers.5"), k.ann("attention"):
        with k.ann("my_helper"), k.ann("rope"), k.op("aten::mul", [[2], [2]]):
            k.kernel("mul")
        with k.op("aten::neg", [[2]]):
            k.kernel("neg")
    with k.ann("model.layers.7.mlp.down_proj"), k.op("aten::mm", [[1, 8], [8, 4]]):
        k.kernel("gemm")
    tr = build(k)
    a = attribute(tr)
    assert a["operator"].tolist() == ["rope", "attention", "down_proj"]
    assert nums(a["layer"]) == [5, 5, 7]
    assert nums(a["step"]) == [1, 1, None]


def test_counted_layers_without_layer_ranges(build):
    """Canonical ranges but no layers.N: layers counted from the stage order."""
    k = Kineto()
    with k.ann("ProfilerStep#1"):
        for _ in range(3):
            qwen_layer(k, annotate=True)
    a = attribute(build(k))
    assert sorted(layer_ops(a)) == [(1, 0), (1, 1), (1, 2)]
    assert all(ops >= SEPARATE for ops in layer_ops(a).values())


# ----------------------------------------------------------------------------------------------
# Naming: unannotated traces (shapes and position)
# ----------------------------------------------------------------------------------------------
EXPECTED_ORDER = ["embedding", "input_norm", "q_proj", "k_proj", "v_proj", "rope", "kv_cache",
                  "attention", "o_proj", "residual", "post_attention_norm", "gate_proj", "act",
                  "up_proj", "act", "down_proj", "residual"]


def _runs(names: list[str]) -> list[str]:
    return [n for i, n in enumerate(names) if i == 0 or names[i - 1] != n]


@pytest.mark.parametrize("model", [TINY, None], ids=["model", "inferred"])
def test_unannotated_model_by_shape_and_position(build, model):
    k = Kineto()
    qwen_model(k, layers=2, steps=2)
    tr = build(k)
    a = attribute(tr, model)
    step1 = a[a["step"] == 1]
    layer_seq = EXPECTED_ORDER[1:]
    assert _runs(step1["operator"].tolist()) == (
        ["embedding"] + layer_seq + layer_seq[:-1] + ["residual", "final_norm", "lm_head"])
    per = layer_ops(a)
    assert sorted(per) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(ops >= SEPARATE for ops in per.values())
    for non_layer in ("embedding", "final_norm", "lm_head"):
        assert a.loc[a["operator"] == non_layer, "layer"].isna().all()
    src = a.groupby("operator")["evidence"].agg(set)
    assert src["q_proj"] == {"shape"} and src["attention"] == {"kernel_name"}
    assert src["rope"] == {"position"} and src["embedding"] == {"kernel_name"}
    assert coverage(a)["fraction"] == 1.0
    assert_conserved(a, tr)


def test_layers_restart_with_each_forward_in_a_step(build):
    """Two forward passes inside one ProfilerStep (a generate loop): layers 0, 1 twice."""
    k = Kineto()
    qwen_model(k, layers=2, steps=1)
    step = next(e for e in k.events if e["name"] == "ProfilerStep#1")
    qwen_model(k, layers=2, steps=1)
    k.events.remove(next(e for e in k.events[1:] if e["name"] == "ProfilerStep#1"))
    step["dur"] = round(k.t - step["ts"] + 1, 3)
    a = attribute(build(k), TINY)
    assert nums(a["step"].drop_duplicates()) == [1]
    q = a[a["operator"] == "q_proj"]
    assert nums(q["layer"]) == [0, 1, 0, 1]


def test_unannotated_fused_layout(build):
    k = Kineto()
    qwen_model(k, layers=2, steps=1, fused=True, lm_head=False)
    tr = build(k)
    for model in (TINY, None):
        a = attribute(tr, model)
        per = layer_ops(a)
        assert sorted(per) == [(1, 0), (1, 1)]
        assert all(ops >= FUSED and not ops & {"q_proj", "gate_proj"} for ops in per.values())
        act = a[a["operator"] == "act"]
        assert set(act["op_name"]) == {"aten::silu", "aten::mul"}


def test_unknown_shapes_are_generic_linears(build):
    k = Kineto()
    with k.ann("ProfilerStep#1"):
        for n in (96, 96, 40):
            with k.op("aten::mm", [[3, 80], [80, n]]):
                k.kernel("gemm")
    a = attribute(build(k))
    assert a["operator"].tolist() == ["linear[80×96]", "linear[80×96]", "linear[80×40]"]
    assert (a["evidence"] == "fallback").all()  # a shape matched to no linear is no evidence
    assert a["layer"].isna().all()


def test_model_that_does_not_match_falls_back_to_inference(build):
    k = Kineto()
    qwen_model(k, layers=1, steps=1)
    a = attribute(build(k), get_model("qwen2.5-7b"))
    assert layer_ops(a)[(1, 0)] >= SEPARATE


def test_kv_cache_writes_after_rope_and_static_cache(build):
    """cat after the last RoPE add is the cache; index_copy_ always is."""
    k = Kineto()
    with k.ann("ProfilerStep#1"):
        linear(k, 1, 256, 256, True)
        linear(k, 1, 256, 64, True)
        linear(k, 1, 256, 64, True)
        elementwise(k, "aten::neg", [[1, 8, 1, 16]])
        elementwise(k, "aten::cat", [[[1, 8, 1, 16]] * 2, []])
        elementwise(k, "aten::add", [[1, 8, 1, 32]] * 2)
        elementwise(k, "aten::index_copy_", [[1, 2, 16, 32], [], [1], [1, 2, 1, 32]])
        elementwise(k, "aten::cat", [[[1, 2, 15, 32], [1, 2, 1, 32]], []])
        with k.op("aten::reshape", [[1, 2, 16, 32]]), k.op("aten::clone", [[1, 2, 16, 32]]):
            elementwise(k, "aten::copy_", [[1, 8, 16, 32], [1, 8, 16, 32], []])
        with k.op("aten::scaled_dot_product_attention", [[1, 8, 1, 32]] * 3):
            k.kernel("attn")
        linear(k, 1, 256, 256, False)
        linear(k, 1, 256, 768, False)
        linear(k, 1, 256, 768, False)
        linear(k, 1, 768, 256, False)
    a = attribute(build(k), TINY)
    assert a["operator"].tolist() == [
        "q_proj", "k_proj", "v_proj", "rope", "rope", "rope", "kv_cache", "kv_cache",
        "attention", "attention", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_eager_attention_math_counts_as_attention(build):
    """bmm / softmax / bmm between the cache writes and o_proj is attention, not RoPE."""
    k = Kineto()
    with k.ann("ProfilerStep#1"):
        linear(k, 1, 256, 256, True)
        linear(k, 1, 256, 64, True)
        linear(k, 1, 256, 64, True)
        elementwise(k, "aten::add", [[1, 8, 1, 32]] * 2)
        elementwise(k, "aten::cat", [[[1, 2, 15, 32], [1, 2, 1, 32]], []])
        with k.op("aten::matmul", [[1, 8, 1, 32], [1, 8, 32, 16]]):
            elementwise(k, "aten::bmm", [[8, 1, 32], [8, 32, 16]])
        elementwise(k, "aten::mul", [[1, 8, 1, 16], []])
        elementwise(k, "aten::_softmax", [[1, 8, 1, 16], [], []])
        with k.op("aten::matmul", [[1, 8, 1, 16], [1, 8, 16, 32]]):
            elementwise(k, "aten::bmm", [[8, 1, 16], [8, 16, 32]])
        linear(k, 1, 256, 256, False)
        linear(k, 1, 256, 768, False)
        linear(k, 1, 256, 768, False)
        linear(k, 1, 768, 256, False)
    a = attribute(build(k), TINY)
    assert a["operator"].tolist() == [
        "q_proj", "k_proj", "v_proj", "rope", "kv_cache", "attention", "attention", "attention",
        "attention", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_torch_compile_triton_kernels(build):
    """Inductor launches carry the Triton kernel's name as a cpu op; GEMMs stay aten::mm."""
    k = Kineto()
    with k.ann("ProfilerStep#1"), k.op("Torch-Compiled Region: 0/0"):
        for _i in range(2):
            tri = [
                "triton_red_fused__to_copy_add_embedding_mean_mul_pow_rsqrt_0",
                "triton_poi_fused_add_cat_mul_neg_1", "triton_poi_fused_index_put_2",
                "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_3",
                "triton_poi_fused_mul_silu_4",
            ]
            elementwise(k, tri[0], [[1, 1], [1024, 256], [1, 1, 256]], tri[0])
            with k.op("aten::mm", [[1, 256], [256, 256], [1, 256]]):
                k.kernel("gemm")
            linear(k, 1, 256, 64, True)
            with k.op("aten::mm", [[64, 1], [1, 16], [64, 16]]):  # RoPE inverse frequencies
                k.kernel("sgemm")
            linear(k, 1, 256, 64, True)
            elementwise(k, tri[1], [[1, 256], [1, 64]], tri[1])
            elementwise(k, tri[2], [[1, 2, 16, 32], [1, 64]], tri[2])
            with k.op("aten::_scaled_dot_product_flash_attention", [[1, 8, 1, 32]] * 3):
                k.kernel("flash")
            with k.op("aten::mm", [[1, 256], [256, 256], [1, 256]]):
                k.kernel("gemm")
            elementwise(k, tri[3], [[1, 256], [256]], tri[3])
            for _ in range(2):
                with k.op("aten::mm", [[1, 256], [256, 768], [1, 768]]):
                    k.kernel("gemm")
            elementwise(k, tri[4], [[1, 768]] * 2, tri[4])
            with k.op("aten::mm", [[1, 768], [768, 256], [1, 256]]):
                k.kernel("gemm")
    a = attribute(build(k))
    first = a[a["layer"] == 0]
    assert first["operator"].tolist() == [
        "input_norm", "q_proj", "k_proj", "rope", "v_proj", "rope", "kv_cache", "attention",
        "o_proj", "post_attention_norm", "gate_proj", "up_proj", "act", "down_proj"]
    assert set(a.loc[a["name"].str.startswith("triton"), "evidence"]) == {"position"}
    assert sorted(layer_ops(a)) == [(1, 0), (1, 1)]



def test_triton_cache_store_and_kv_expansion_named_by_what_they_do(build):
    """Inductor's decode order: K's kernel (rotates and stores into the cache), v_proj, V's
    cache store, Q's RoPE kernel, then kernels on 4-D buffers only (K/V expanded to every
    query head, the mask). Stores into a 4-D buffer and cats that append to a cache are
    kv_cache wherever they sit, also when they rotate K on the way; the 4-D-only kernels are
    attention (eager HF's repeat_kv copies are); a store without a cache-shaped buffer and a
    RoPE kernel writing a fresh [1, 2, 1, 32] K are named by position (RoPE)."""
    k = Kineto()
    rope_tables = [[64, 32], [64, 32]]
    tri = {
        "krope_store": ("triton_poi_fused_add_cat_copy_mul_neg_slice_split_transpose_view_1",
                        [[1, 64], *rope_tables, [1, 2, 64, 32], []], "kv_cache"),
        "krope": ("triton_poi_fused_add_cat_mul_neg_2", [[1, 64], *rope_tables, [1, 2, 1, 32], []],
                  "rope"),
        "kcat": ("triton_poi_fused_add_cat_cos_mul_neg_sin_3",
                 [[1, 2, 64, 32], [1, 64], [64, 1], [1, 2, 65, 32], []], "kv_cache"),
        "flat": ("triton_poi_fused_copy_4", [[1, 64], [1, 64], []], "rope"),
        "vstore": ("triton_poi_fused_copy_slice_transpose_view_5", [[1, 64], [1, 2, 64, 32], []],
                   "kv_cache"),
        "vcat": ("triton_poi_fused_cat_transpose_view_6", [[1, 2, 64, 32], [1, 64], [1, 2, 65, 32],
                                                            []], "kv_cache"),
        "qrope": ("triton_poi_fused__scaled_dot_product_flash_attention_add_cat_mul_neg_7",
                  [[1, 256], *rope_tables, [1, 8, 1, 32], []], "rope"),
        "expand": ("triton_poi_fused__scaled_dot_product_flash_attention_cat_clone_cos_expand_"
                   "neg_sin_8", [[1, 2, 65, 32], [1, 8, 65, 32], []], "attention"),
        "mask": ("triton_poi_fused_le_where_9", [[], [1, 1, 1, 65], []], "attention"),
    }
    with k.ann("ProfilerStep#1"), k.op("Torch-Compiled Region: 0/0"):
        elementwise(k, "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0",
                    [[1, 1, 256], [256], [1, 1, 256], [], []], "norm")
        linear(k, 1, 256, 256, True)
        linear(k, 1, 256, 64, True)
        for key in ("krope_store", "krope", "kcat"):
            elementwise(k, tri[key][0], tri[key][1], tri[key][0])
        linear(k, 1, 256, 64, True)
        for key in ("flat", "vstore", "vcat", "qrope", "expand", "mask"):
            elementwise(k, tri[key][0], tri[key][1], tri[key][0])
        with k.op("aten::_scaled_dot_product_flash_attention", [[1, 8, 1, 32]] * 3):
            k.kernel("flash")
        with k.op("aten::mm", [[1, 256], [256, 256], [1, 256]]):
            k.kernel("gemm")
    a = attribute(build(k), TINY)
    by_kernel = dict(zip(a["name"], a["operator"], strict=True))
    assert {key: by_kernel[name] for key, (name, _, _) in tri.items()} == {
        key: want for key, (_, _, want) in tri.items()}


@pytest.mark.parametrize("path", sorted(SAMPLES.glob("*compiled*.json.gz")),
                         ids=lambda p: p.name.removesuffix(".json.gz"))
def test_compiled_traces_have_k_and_v_cache_writes_per_layer(path):
    """Every committed torch.compile trace: in each (step, layer) two Triton kernels write the
    K and V caches (each passed a [1, 4, S, 128] cache: n_kv x d = 512), Q's RoPE is a kernel
    of its own, and no 4-D-only kernel is named RoPE."""
    a = attribute(load_trace(path), get_model("qwen2.5-7b"))
    layers = a[a["layer"].notna()]
    pairs = set(zip(layers["step"], layers["layer"], strict=True))
    kv = layers[layers["operator"] == "kv_cache"]
    assert kv["name"].str.startswith("triton_poi_fused").all()
    assert kv["input_dims"].str.contains(r"\[1, 4, \d+, 128\]").all()
    assert kv.groupby(["step", "layer"])["op_id"].nunique().to_dict() == dict.fromkeys(pairs, 2)
    rope = layers[layers["operator"] == "rope"]
    assert set(zip(rope["step"], rope["layer"], strict=True)) == pairs
    assert rope["input_dims"].str.contains(r"\[\d+(?:, \d+){0,2}\]").all()  # a 1-3-D buffer


def test_module_frames_name_operators_and_layers(build):
    k = Kineto()
    qwen_model(k, layers=2, steps=1, modules=True)
    tr = build(k)
    a = attribute(tr)  # no model: module frames alone
    mod = a[a["evidence"] == "module"]
    assert not mod.empty
    per = layer_ops(a)
    assert sorted(per) == [(1, 0), (1, 1)]
    assert all(ops >= SEPARATE for ops in per.values())
    lin = a[a["op_name"].isin(["aten::addmm", "aten::mm"])]
    assert set(lin["evidence"]) == {"module"}
    assert a.loc[a["operator"] == "lm_head", "evidence"].unique().tolist() == ["module"]
    assert a.loc[a["operator"] == "final_norm", "layer"].isna().all()
    assert _runs(a["operator"].tolist())[:10] == EXPECTED_ORDER[:10]


# ----------------------------------------------------------------------------------------------
# CPU-only traces
# ----------------------------------------------------------------------------------------------
def test_cpu_only_top_level_ops_are_the_units(build):
    k = Kineto()
    with k.ann("ProfilerStep#1"):
        with (k.ann("q_proj"), k.op("aten::linear", [[1, 4, 256], [256, 256], [256]]),
              k.op("aten::addmm", [[256], [4, 256], [256, 256], [], []])):
            pass
        with k.ann("act"), k.op("aten::silu", [[1, 4, 768]]):
            pass
        with k.op("Torch-Compiled Region: 0/0"), k.op("aten::mul", [[4], [4]]):
            pass
    tr = build(k)
    assert tr.cpu_only
    a = attribute(tr)
    assert a["name"].tolist() == ["aten::linear", "aten::silu", "aten::mul"]
    assert a["kind"].unique().tolist() == ["cpu_op"]
    assert a["operator"].tolist()[:2] == ["q_proj", "act"]
    ops = tr.cpu_ops.set_index("op_id")
    assert a["dur_us"].tolist() == ops.loc[a["op_id"].astype(int), "dur_us"].tolist()
    assert a["event_id"].tolist() == a["op_id"].tolist()


# ----------------------------------------------------------------------------------------------
# Real traces (sample_traces/, captured on an H200 and on the CPU)
# ----------------------------------------------------------------------------------------------
def _layer_traces() -> list[Path]:
    return sorted(p for p in SAMPLES.glob("*.json.gz")  # LLM layers (not the CNN, matmul loop)
                  if "msweep" not in p.name and p.name.startswith(("qwen", "hf-")))


def _expected_layers(path: Path) -> int:
    m = re.search(r"-(\d+)l_|_l(\d+)_", path.name)  # hf-...-2l_ (HF captures) or _l2_ (ours)
    return int(m.group(1) or m.group(2)) if m else 1


@pytest.mark.parametrize("path", walk(_layer_traces(), by_prefix,
                                      lambda p: p.name.removesuffix(".json.gz")))
def test_real_traces_core_operators_per_layer(path):
    tr = load_trace(path)
    model = get_model("qwen-tiny" if "tiny" in path.name else "qwen2.5-7b")
    for m in (model, None):
        a = attribute(tr, m)
        assert_conserved(a, tr)
        cov = coverage(a)
        assert cov["fraction"] > 0.99, cov
        per = layer_ops(a)
        steps = a["step"].dropna().unique()
        layers = _expected_layers(path)
        assert set(per) == {(s, i) for s in steps for i in range(layers)}, sorted(per)
        for key, ops in per.items():
            assert ops >= SEPARATE or ops >= FUSED, (key, sorted(ops))
        # what no canonical operator explains stays small
        other = a.loc[a["operator"] == "other", "dur_us"].sum()
        assert other <= 0.05 * cov["kernel_time_us"]


@pytest.mark.parametrize("path", [p for p in _layer_traces() if "noannot" not in p.name
                                  and not p.name.startswith("hf-")],
                         ids=lambda p: p.name.removesuffix(".json.gz"))
def test_position_naming_agrees_with_our_annotations(path):
    """Strip our ranges (keep ProfilerStep#N): shapes and position must name what they named."""
    tr = load_trace(path)
    a = attribute(tr)
    w = a["dur_us"].to_numpy()
    assert w[(a["evidence"] == "annotation").to_numpy()].sum() > 0.9 * w.sum()
    steps = tr.annotations["name"].astype(str).str.startswith("ProfilerStep#").to_numpy()
    b = attribute(replace(tr, annotations=tr.annotations[steps].reset_index(drop=True)))
    assert not (b["evidence"] == "annotation").any()
    same = (a["operator"] == b["operator"]).to_numpy()
    same_layer = (a["layer"].fillna(-1) == b["layer"].fillna(-1)).to_numpy()
    assert w[same].sum() >= 0.999 * w.sum()
    assert same_layer.all()
    core = a["operator"].isin(SEPARATE | FUSED).to_numpy()
    assert same[core].all()


def test_real_traces_exist():
    """The end-to-end tests above only mean something with traces to run on."""
    names = [p.name for p in _layer_traces()]
    assert any("compiled" in n for n in names) and any("fused" in n for n in names)
    assert any(n.startswith("hf-") for n in names)


@pytest.mark.parametrize("variant", ["compiled", "static", "static_compiled"])
def test_hf_decode_compile_and_static_cache(variant):
    """HF decode under torch.compile (DynamicCache) and/or with StaticCache (index_copy_ writes,
    fused into Triton kernels when compiled): 2 steps x 2 whole layers, in order, nothing lost."""
    path = SAMPLES / f"hf-qwen2-qwen2.5-7b-2l_decode_b1_s2048_{variant}_h200.json.gz"
    tr = load_trace(path)
    a = attribute(tr, get_model("qwen2.5-7b"))
    assert_conserved(a, tr)
    assert coverage(a)["fraction"] > 0.99
    per = layer_ops(a)
    assert set(per) == {(s, i) for s in (1, 2) for i in (0, 1)}, sorted(per)
    assert all(ops >= SEPARATE for ops in per.values()), per
    core = a[a["operator"].isin(SEPARATE)]
    for (step, layer), g in core.groupby(["step", "layer"]):
        # one instance of each of the 7 projections (split-K GEMMs bring a reduce kernel)
        gemms = g[g["operator"] != "attention"]
        assert gemms.groupby("operator")["op_id"].nunique().eq(1).all(), (step, layer)
        if layer == 1:  # layer 0's core kernels all run before layer 1's
            first = core[(core["step"] == step) & (core["layer"] == 0)]
            assert (first["ts_us"] + first["dur_us"]).max() <= g["ts_us"].min()
    if variant == "static":  # eager StaticCache: K and V written by index_copy_ in every layer
        kv = a[a["operator"] == "kv_cache"]
        assert set(kv["op_name"]) == {"aten::index_copy_"}
        assert kv.groupby(["step", "layer"])["op_id"].nunique().to_dict() == {k: 2 for k in per}
    else:  # compiled: norms, rope + cache write and silu·mul are Triton kernels, all named
        tri = a[a["name"].str.startswith("triton_")]
        assert {"input_norm", "post_attention_norm", "rope", "act"} <= set(tri["operator"])
        assert tri.loc[tri["operator"] == "other", "dur_us"].sum() < 0.01 * a["dur_us"].sum()


def test_gzip_and_plain_give_the_same_attribution(tmp_path):
    path = next(p for p in _layer_traces() if "decode" in p.name)
    plain = tmp_path / "t.json"
    plain.write_bytes(gzip.decompress(path.read_bytes()))
    a, b = attribute(load_trace(path)), attribute(load_trace(plain))
    pd.testing.assert_frame_equal(a, b)


# ----------------------------------------------------------------------------------------------
# Properties on random traces
# ----------------------------------------------------------------------------------------------
OPS = [("aten::mm", [[1, 256], [256, 256]]), ("aten::mm", [[1, 256], [256, 64]]),
       ("aten::mm", [[1, 768], [768, 256]]), ("aten::add", [[1, 256], [1, 256], []]),
       ("aten::pow", [[1, 256], []]), ("aten::cat", [[[1, 2, 3, 4]] * 2, []]),
       ("aten::_flash_attention_forward", [[1, 1, 8, 32]] * 3), ("aten::empty", [[]])]
RANGES = ["q_proj", "attention", "layers.1", "my_range", "ProfilerStep#7"]


@st.composite
def random_trace(draw):
    k = Kineto()
    for _ in range(draw(st.integers(1, 12))):
        ranges = draw(st.lists(st.sampled_from(RANGES), max_size=2, unique=True))
        name, dims = draw(st.sampled_from(OPS))
        kernels = draw(st.lists(st.tuples(
            st.booleans(), st.booleans(), st.booleans(), st.sampled_from([7, 8]),
            st.floats(0.001, 50.0, allow_nan=False).map(lambda x: round(x, 3))),
            min_size=1, max_size=3))
        with contextlib.ExitStack() as stack:
            for r in ranges:
                stack.enter_context(k.ann(r))
            if draw(st.booleans()):
                stack.enter_context(k.op("aten::linear", [[1, 1, 256], [256, 256], []]))
            stack.enter_context(k.op(name, dims))
            for ext, runtime, flow, stream, dur in kernels:
                k.kernel("kern", dur, ext=ext, runtime=runtime, flow=flow, stream=stream)
    return k


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(random_trace())
def test_random_traces_conserve_and_link(tmp_path, k):
    tr = load_trace(k.write(tmp_path / "r.json"))
    a = attribute(tr)
    assert_conserved(a, tr)
    assert a["operator"].notna().all() and a["evidence"].notna().all()
    ops = set(tr.cpu_ops["op_id"])
    assert set(a["op_id"].dropna()) <= ops
    # a kernel with no External id, no runtime launch and no flow cannot be linked
    raw = [e for e in k.events if e.get("cat") == "kernel"]
    corr_known = {e["args"]["correlation"] for e in k.events if e.get("cat") == "cuda_runtime"}
    corr_known |= {e["id"] for e in k.events if e.get("ph") == "s"}
    for row, e in zip(a.itertuples(), raw, strict=True):
        if "External id" not in e["args"] and e["args"]["correlation"] not in corr_known:
            # (or, launched before the window -- correlation id below the first launch, done
            # before the first linked kernel -- the before_window bucket)
            assert pd.isna(row.op_id) and row.operator in ("unattributed", "before_window")
        else:
            assert not pd.isna(row.op_id)
    non_layer = a["operator"].isin(["embedding", "final_norm", "lm_head", "unattributed",
                                    "before_window"])
    assert a.loc[non_layer, "layer"].isna().all()
    cov = coverage(a)
    assert cov["attributed_time_ps"] + round(cov["unattributed_time_us"] * 1e6) == \
        cov["kernel_time_ps"]
