"""Rank discovery (distributedInfo, file names), duplicate ranks, the cross-rank summary, and the
CLI's rank output, on real sample traces copied under rank-style names."""

import json
import math
import shutil
from pathlib import Path

import pandas as pd
import pytest

from tests.builders import SAMPLES, read
from trace_roofline.attribution.ranks import (
    CrossRank,
    RankInfo,
    rank_from_name,
    rank_info,
    rank_order,
    summarize,
    unranked_note,
)
from trace_roofline.cli import main
from trace_roofline.errors import InputError
from trace_roofline.parallel import analyze_many

B1 = SAMPLES / "qwen2.5-7b_decode_b1_s2048_h200.json.gz"
B64 = SAMPLES / "qwen2.5-7b_decode_b64_s2048_h200.json.gz"
TINY = SAMPLES / "qwen-tiny_decode_b2_s64_l2_cpu.json.gz"


@pytest.mark.parametrize(("name", "label", "rank"), [
    ("rank0.json.gz", "0", 0),
    ("trace_rank_3.pt.trace.json", "3", 3),
    ("run-rank-12.json", "12", 12),
    ("RANK7.json", "7", 7),
    ("rank3_tp1.json", "3", 3),  # a global rank beats coordinates
    ("dp0_pp0_tp1.pt.trace.json.gz", "dp0_pp0_tp1", None),
    ("tp1.json", "tp1", None),
    ("worker.ep2.pt.trace.json", "ep2", None),
    ("x_ep2_tp1_dp1.json", "dp1_tp1_ep2", None),  # canonical order dp, pp, tp, ep
])
def test_rank_from_name(name, label, rank):
    info = rank_from_name(Path("/d") / name)
    assert (info.label, info.rank, info.source) == (label, rank, "file name")


@pytest.mark.parametrize("name", [
    "myhost_12345.1732000000000000.pt.trace.json.gz",  # tensorboard_trace_handler default
    "node1_local_rank3.json",  # a GPU index on one host, not a rank
    "crank5.json", "http1.json", "stp1.json",  # rank / tp inside a word
    "qwen2.5-7b_decode_b1_s2048_h200.json.gz",
])
def test_names_without_rank(name):
    info = rank_from_name(name)
    assert not info.ranked and info.label == "?" and info.source == "none"


def test_distributed_info_wins_over_the_name():
    meta = {"distributedInfo": {"backend": "nccl", "rank": 2, "world_size": 4}}
    assert rank_info("rank0.json", meta) == RankInfo("rank0.json", rank=2, world_size=4,
                                                      source="distributedInfo")
    assert rank_info("x.json", {"distributedInfo": {"rank": "1"}}).rank == 1
    assert rank_info("rank5.json", {"distributedInfo": {"backend": "nccl"}}).rank == 5  # no rank key


@pytest.mark.parametrize("bad", [-1, True, 1.5, "one", [0]])
def test_bad_distributed_rank_is_an_input_error(bad):
    with pytest.raises(InputError, match=r"^t\.json: distributedInfo\.rank is .* not a non-negative"):
        rank_info("t.json", {"distributedInfo": {"rank": bad}})


def _with_distributed_info(src: Path, dst: Path, **info) -> Path:
    doc = read(src)
    doc["distributedInfo"] = {"backend": "nccl", "pg_count": 1, **info}
    dst.write_text(json.dumps(doc))
    return dst


def test_ranks_from_real_traces(tmp_path):
    """distributedInfo read through the real parser; names for the copies without it."""
    a = _with_distributed_info(TINY, tmp_path / "host_111.1.pt.trace.json", rank=1, world_size=3)
    b = shutil.copy(TINY, tmp_path / "rank0.json.gz")
    c = shutil.copy(TINY, tmp_path / "trace_rank_2.json.gz")
    infos = [r.rank for r in analyze_many([a, b, c])]
    assert [(i.rank, i.world_size, i.source) for i in infos] == [
        (1, 3, "distributedInfo"), (0, None, "file name"), (2, None, "file name")]
    assert rank_order(infos) == [1, 0, 2]


def test_two_files_claiming_one_rank(tmp_path):
    a = _with_distributed_info(TINY, tmp_path / "host_1.5.pt.trace.json", rank=1, world_size=2)
    b = shutil.copy(TINY, tmp_path / "rank1.json.gz")
    c = shutil.copy(TINY, tmp_path / "rank0.json.gz")
    infos = [r.rank for r in analyze_many([a, b, c])]
    with pytest.raises(InputError) as e:
        rank_order(infos)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"{a} and {b} both claim rank 1 (distributedInfo, file name)")
    # coordinates collide the same way
    with pytest.raises(InputError, match="both claim rank dp0_tp1"):
        rank_order([rank_from_name("a/dp0_tp1.json"), rank_from_name("b/tp1_dp0.json")])


def test_not_a_set_of_ranks():
    one, two, bare = rank_from_name("rank0.json"), rank_from_name("rank1.json"), rank_from_name("x.json")
    assert rank_order([one]) is None
    assert rank_order([bare, rank_from_name("y.json")]) is None
    assert unranked_note([bare, rank_from_name("y.json")]) is None
    assert rank_order([one, bare]) is None
    assert unranked_note([two, bare]) == ("no cross-rank summary: x.json has no rank (no "
                                          "distributedInfo, no rank in its name) while rank1.json "
                                          "is rank 1")
    assert unranked_note([one, two]) is None


def _ops(rows: list[tuple[str, str, float]], per_layer: bool = True) -> pd.DataFrame:
    """An operator table: aggregate rows (layer NA) and, to be ignored, a per-layer copy."""
    agg = pd.DataFrame(rows, columns=["phase", "operator", "time_us"]).assign(layer=pd.NA)
    layer = agg.assign(layer=0, time_us=1e9)  # per-layer rows must not count
    return pd.concat([agg, layer] if per_layer else [agg], ignore_index=True).astype({"layer": "Int64"})


def test_summary_by_hand():
    ranks = [RankInfo("a", rank=0), RankInfo("b", rank=1), RankInfo("c", rank=2)]
    tables = [
        _ops([("decode", "all_reduce", 10.0), ("decode", "o_proj", 4.0), ("prefill", "o_proj", 1.0)]),
        _ops([("decode", "all_reduce", 30.0), ("decode", "o_proj", 4.0), ("prefill", "o_proj", 2.0)]),
        _ops([("decode", "all_reduce", 20.0), ("decode", "o_proj", 8.0), ("decode", "rope", 3.0)]),
    ]
    s = summarize(ranks, tables).set_index(["phase", "operator"])
    assert s.index.tolist() == [("decode", "device time"), ("decode", "all_reduce"),
                                ("decode", "o_proj"), ("decode", "rope"),
                                ("prefill", "device time"), ("prefill", "o_proj")]
    ar = s.loc[("decode", "all_reduce")]
    assert (ar["ranks"], ar["min_time_us"], ar["median_time_us"], ar["max_time_us"]) == (3, 10, 20, 30)
    assert ar["skew"] == 1.5 and (ar["slowest_rank"], ar["fastest_rank"]) == ("1", "0")
    o = s.loc[("decode", "o_proj")]  # a tie for fastest: the first rank in rank order
    assert (o["median_time_us"], o["skew"], o["slowest_rank"], o["fastest_rank"]) == (4, 2, "2", "0")
    rope = s.loc[("decode", "rope")]  # ran on one rank: the others count 0 µs
    assert (rope["ranks"], rope["min_time_us"], rope["median_time_us"], rope["max_time_us"]) == (1, 0, 0, 3)
    assert math.isnan(rope["skew"])  # median 0: no ratio
    whole = s.loc[("decode", "device time")]  # each rank's device time in the phase: 14, 34, 31
    assert (whole["min_time_us"], whole["median_time_us"], whole["max_time_us"]) == (14, 31, 34)
    assert whole["slowest_rank"] == "1" and whole["skew"] == pytest.approx(34 / 31)
    pre = s.loc[("prefill", "o_proj")]  # rank 2 has no prefill at all
    assert (pre["ranks"], pre["median_time_us"], pre["fastest_rank"]) == (2, 1, "2")


def test_cross_rank_orders_ranks_and_tables_together():
    infos = [RankInfo("b", rank=1), RankInfo("a", rank=0)]
    cross = CrossRank.of(infos, [_ops([("decode", "mm", 9.0)]), _ops([("decode", "mm", 1.0)])])
    assert [r.path for r in cross.ranks] == ["a", "b"]
    row = cross.summary.iloc[1]
    assert (row["operator"], row["slowest_rank"], row["fastest_rank"]) == ("mm", "1", "0")
    d = cross.to_dict()
    assert d["ranks"][0] == {"path": "a", "rank": 0, "coords": {}, "world_size": None,
                             "source": "none", "label": "0"}
    assert d["summary"][1]["max_time_us"] == 9.0
    assert "skew = max / median" in cross.text() and "rank 1: b" in cross.text()
    assert CrossRank.of(infos[:1], [_ops([])]) is None


def test_cli_rank_directory(tmp_path, capsys):
    d = tmp_path / "ranks"
    d.mkdir()
    shutil.copy(B1, d / "rank0.json.gz")
    shutil.copy(B64, d / "rank1.json.gz")
    out = tmp_path / "r"
    assert main(["analyze", str(d), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "cross-rank summary: 2 ranks (rank from file name)" in text
    summary = pd.read_csv(out / "ranks.csv")
    whole = summary[summary["operator"] == "device time"].iloc[0]
    # B=64 decode (rank 1) is the slower rank; its whole time is the max
    report = json.loads((out / "report.json").read_text())
    times = [t["whole_model"]["time_us"] for t in report["traces"]]
    assert whole["slowest_rank"] == 1 and whole["max_time_us"] == pytest.approx(max(times))
    assert whole["min_time_us"] == pytest.approx(min(times))
    assert [r["path"] for r in report["ranks"]["ranks"]] == [str(d / "rank0.json.gz"),
                                                            str(d / "rank1.json.gz")]


def test_cli_duplicate_rank_is_one_line_and_no_output(tmp_path, capsys):
    d = tmp_path / "ranks"
    d.mkdir()
    shutil.copy(TINY, d / "rank0.json.gz")
    shutil.copy(TINY, d / "trace_rank_0.json.gz")
    assert main(["analyze", str(d), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "both claim rank 0" in err
    assert str(d / "rank0.json.gz") in err and str(d / "trace_rank_0.json.gz") in err
    assert not (tmp_path / "r").exists()


def test_cli_mixed_ranks_note(capsys, tmp_path):
    shutil.copy(TINY, tmp_path / "rank0.json.gz")
    assert main(["analyze", str(tmp_path / "rank0.json.gz"), str(TINY)]) == 0
    assert capsys.readouterr().out.rstrip().endswith(f"while {tmp_path / 'rank0.json.gz'} is rank 0")
