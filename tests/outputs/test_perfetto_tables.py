"""`analyze --perfetto` says what the tables say: the kernels it enriches are the ones the
analysis attributed (a TP rank's shard, CUDA-graph replays named from a --graph-map trace
loaded once, a cached analysis), joined to their costs by op instance."""

import json
from pathlib import Path

import pandas as pd
import pytest

import trace_roofline as tr
from tests.builders import SAMPLES
from trace_roofline import pipeline
from trace_roofline.cache import TraceCache
from trace_roofline.cli import main
from trace_roofline.outputs import perfetto
from trace_roofline.pipeline import Run, analyze_trace_kernels
from trace_roofline.trace import load

TP_RANK = (SAMPLES / "tp2" / "tp2-qwen2.5-7b-2l_decode_b8_s2048_noannot_h200"
           / "vm_664.1796069023174623233.pt.trace.json.gz")
CG = str(SAMPLES / "cuda_graphs" / "hf-qwen2-qwen2.5-7b-2l_decode_b1_s512_static1024_{}_h200.json.gz")
QWEN = tr.get_model("qwen2.5-7b")


def _kernels(path: Path) -> pd.DataFrame:
    """The enriched kernel events of a Perfetto file: args.roofline and the event's dur."""
    events = json.loads(path.read_bytes())["traceEvents"]
    return pd.DataFrame([{**e["args"]["roofline"], "dur": e["dur"]} for e in events
                         if isinstance(e.get("args"), dict) and "roofline" in e["args"]])


def _assert_as_table(kernels: pd.DataFrame, table: pd.DataFrame, keys: list[str]) -> None:
    """Per `keys` group: the same groups, kernel counts, device time and FLOPs as the table."""
    got = kernels.groupby(keys, dropna=False).agg(
        kernels=("dur", "size"), time_us=("dur", "sum"),
        flops=("flops (time share)", lambda f: f.sum(min_count=1)))
    want = table.set_index(keys)[["kernels", "time_us", "flops"]]
    assert sorted(got.index.tolist()) == sorted(want.index.tolist())
    want = want.loc[got.index]
    assert got["kernels"].tolist() == want["kernels"].tolist()
    assert got["time_us"].to_numpy() == pytest.approx(want["time_us"].to_numpy(), rel=1e-9)
    assert got["flops"].to_numpy() == pytest.approx(want["flops"].to_numpy(), rel=1e-9,
                                                    nan_ok=True)


@pytest.mark.parametrize("tp", [[], ["--tp", "2"]])
def test_tp_rank_kernels_are_named_as_in_the_tables(tmp_path, tp):
    """A TP=2 rank (names from shapes and kernel names): every enriched kernel's operator,
    layer and phase, summed, give the operator tables' rows; collectives sit under the link
    roof there as in the tables."""
    out, report = tmp_path / "rank.json", tmp_path / "report"
    assert main(["analyze", str(TP_RANK), "--model", "qwen2.5-7b", *tp, "--no-cache",
                 "--perfetto", str(out), "--out", str(report)]) == 0
    k = _kernels(out)
    assert len(k) == 252 and {"all_reduce", "qkv_proj", "gate_up_proj"} <= set(k["operator"])
    ops = pd.read_csv(report / "operators.csv")
    _assert_as_table(k, ops, ["operator", "phase"])
    layered = k[k["layer"].notna()].astype({"layer": "int64"})
    _assert_as_table(layered, pd.read_csv(report / "operators_by_layer.csv"),
                     ["operator", "layer", "phase"])
    link = ops.loc[ops["operator"] == "all_reduce", "bound"].tolist()
    assert link == ["link"] and set(k.loc[k["operator"] == "all_reduce", "bound"]) == {"link"}


def test_replayed_kernels_carry_the_tables_flops_and_the_map_is_read_once(tmp_path,
                                                                          monkeypatch):
    """CUDA-graph replays named from --graph-map: each file is parsed once, and the replayed
    kernels (no cpu op of their own) carry their op instance's FLOPs, as the table has them."""
    parsed: list[str] = []
    real = load._load_file

    def counted(p, *args):
        parsed.append(Path(p).name)
        return real(p, *args)

    monkeypatch.setattr(load, "_load_file", counted)
    out, report = tmp_path / "replays.json", tmp_path / "report"
    assert main(["analyze", CG.format("graph"), "--model", "qwen2.5-7b", "--no-cache",
                 "--graph-map", CG.format("mapping"), "--perfetto", str(out),
                 "--out", str(report)]) == 0
    assert sorted(parsed) == sorted(Path(CG.format(x)).name for x in ("graph", "mapping"))
    k = _kernels(out)
    replayed = k[k["evidence"] == "graph_map"]
    assert len(replayed) == 516 and replayed["cpu op"].isna().all()
    assert replayed["flops (time share)"].notna().all()
    assert (replayed.loc[replayed["operator"] == "q_proj", "flops (time share)"] > 0).all()
    _assert_as_table(k, pd.read_csv(report / "operators.csv"), ["operator", "phase"])


def test_cached_analysis_gives_its_kernels_without_attributing(tmp_path, monkeypatch):
    """The second run is an Analysis cache hit: the kernels come from the cached trace and
    attribution parts (attribute() is not called) and equal the first run's."""
    cache = TraceCache(tmp_path / "cache")
    a1, k1 = analyze_trace_kernels(TP_RANK, QWEN, run=Run(cache=cache))

    def refuse(*_args, **_kw):
        raise AssertionError("attribute() ran again")

    monkeypatch.setattr(pipeline, "attribute", refuse)  # the one caller of attribute()
    a2, k2 = analyze_trace_kernels(TP_RANK, QWEN, run=Run(cache=cache))
    assert cache.log[-2].analysis_hit and cache.log[-1].attribution_hit
    pd.testing.assert_frame_equal(k1.kernels, k2.kernels)
    pd.testing.assert_frame_equal(a1.costed, a2.costed)
    assert (k2.model, k2.tp) == (k1.model, k1.tp) and k2.tp == 2
    f1 = perfetto.kernel_figures(k1.trace, k1.kernels, a1)
    pd.testing.assert_frame_equal(f1, perfetto.kernel_figures(k2.trace, k2.kernels, a2))
