"""Nsight Compute import: CSV parsing (formats, units, errors), kernel matching, per-operator sums."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from tests.builders import SAMPLES
from trace_roofline.attribution.attribute import attribute
from trace_roofline.errors import InputError
from trace_roofline.trace import load_trace
from trace_roofline.trace.ncu import (
    MEASURED_COLUMNS,
    NCU_COLUMNS,
    kernel_key,
    match_kernels,
    measured_by_operator,
    read_ncu_csv,
)

ADD = ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>,"
       " std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, "
       "std::array<char*, 3ul>)")
GEMM = "nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT"
REDUCE = ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>"
          "(cublasLt::cublasSplitKParams<float>, __nv_bfloat16 const*, float*)")
HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
        '"Block Size","Grid Size","Device","CC"')
METRICS = '"dram__bytes_read.sum","dram__bytes_write.sum","gpu__time_duration.sum"'


def _row(i: int, name: str, rd: str, wr: str, t: str, grid="(80, 1, 1)", block="(128, 1, 1)",
         extra: str = "") -> str:
    name = name.replace('"', '""')
    return (f'"{i}","4242","python3","h200","{name}","1","7","{block}","{grid}","0","9.0",'
            f'{extra}"{rd}","{wr}","{t}"')


def _write(tmp_path: Path, text: str, name="run.ncu.csv") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# ------------------------------------------------------------------------------------ parsing
def test_raw_page_units_separators_and_prelude(tmp_path):
    text = "\n".join([
        "==PROF== Connected to process 4242 (/usr/bin/python3.12)",
        "decode step 0 done",  # program stdout before the table
        "==WARNING== Found outstanding GPU clock reset, trying to revert...Success.",
        f"{HEAD},{METRICS}",
        '"","","","","","","","","","","","Kbyte","byte","usecond"',
        _row(0, GEMM, "14,680.06", "1,024", "1,234.5"),
        "decode step 1 done",  # program stdout interleaved with the table
        _row(1, ADD, "0.5", "0", "2.25", grid="(1, 1, 1)", block="(64, 1, 1)"),
        "==PROF== Disconnected from process 4242",
    ])
    df = read_ncu_csv(_write(tmp_path, text))
    assert list(df.columns) == list(NCU_COLUMNS)
    assert df["ncu_id"].tolist() == [0, 1]
    assert df["kernel_name"].tolist() == [GEMM, ADD]
    assert df["dram_read_bytes"].tolist() == [14_680_060.0, 500.0]  # Kbyte is 1000 bytes
    assert df["dram_write_bytes"].tolist() == [1024.0, 0.0]
    assert df["dram_bytes"].tolist() == [14_681_084.0, 500.0]
    assert df["ncu_time_us"].tolist() == [1234.5, 2.25]
    assert df["grid"].tolist() == ["80,1,1", "1,1,1"]
    assert df["block"].tolist() == ["128,1,1", "64,1,1"]
    assert df["stream"].tolist() == [7, 7]
    assert df["nvtx_range"].isna().all()


@pytest.mark.parametrize(("units", "rd", "t", "bytes_", "us"), [
    (("byte", "nsecond"), "2,000,000", "1,500", 2e6, 1.5),
    (("Mbyte", "msecond"), "2", "0.0015", 2e6, 1.5),
    (("Gbyte", "second"), "0.002", "0.0000015", 2e6, 1.5),
    (("Kibyte", "usecond"), "2", "1.5", 2048.0, 1.5),
])
def test_units_are_normalised(tmp_path, units, rd, t, bytes_, us):
    text = "\n".join([f"{HEAD},{METRICS}",
                      f'"","","","","","","","","","","","{units[0]}","{units[0]}","{units[1]}"',
                      _row(0, GEMM, rd, rd, t)])
    df = read_ncu_csv(_write(tmp_path, text))
    assert df["dram_read_bytes"].iloc[0] == pytest.approx(bytes_)
    assert df["dram_bytes"].iloc[0] == pytest.approx(2 * bytes_)
    assert df["ncu_time_us"].iloc[0] == pytest.approx(us)


def test_raw_page_without_units_row_is_base_units(tmp_path):
    text = "\n".join([f"{HEAD},{METRICS}", _row(3, GEMM, "100", "50", "2,000")])
    df = read_ncu_csv(_write(tmp_path, text))
    assert (df["dram_bytes"].iloc[0], df["ncu_time_us"].iloc[0]) == (150.0, 2.0)


def test_repeated_header_and_units_rows_are_skipped(tmp_path):
    units = '"","","","","","","","","","","","byte","byte","nsecond"'
    text = "\n".join([f"{HEAD},{METRICS}", units, _row(0, GEMM, "1", "2", "3,000"),
                      f"{HEAD},{METRICS}", units, _row(1, ADD, "4", "5", "6,000")])
    df = read_ncu_csv(_write(tmp_path, text))
    assert df["ncu_id"].tolist() == [0, 1] and df["ncu_time_us"].tolist() == [3.0, 6.0]


def test_nvtx_push_pop_stack(tmp_path):
    nvtx = '"thread Domain:Push/Pop_Range:PL_Type:PL_Value:CLR_Type:Color:Msg_Type:Msg",'
    cell = ('4242  ""<default domain>:decode:none:none:none:none:none:none"" '
            '""<default domain>:layers.3:none:none:none:none:none:none"" '
            '""<default domain>:aten::linear, seq = 12:none:none:none:none:none:none""')
    head = HEAD.replace('"Kernel Name"', nvtx + '"Kernel Name"')
    rows = [
        f'"0","4242","python3","h200","{cell}","{GEMM}","1","7","(128, 1, 1)","(80, 1, 1)",'
        '"0","9.0","1","2","3"',
        f'"1","4242","python3","h200","","{GEMM}","1","7","(128, 1, 1)","(80, 1, 1)",'
        '"0","9.0","1","2","3"',
    ]
    units = '"","","","","","","","","","","","","byte","byte","nsecond"'
    df = read_ncu_csv(_write(tmp_path, "\n".join([f"{head},{METRICS}", units, *rows])))
    assert df["nvtx_range"].iloc[0] == "decode/layers.3/aten::linear, seq = 12"
    assert pd.isna(df["nvtx_range"].iloc[1])


def test_details_page_is_pivoted(tmp_path):
    head = HEAD + ',"Section Name","Metric Name","Metric Unit","Metric Value"'
    lines = ["==PROF== Connected to process 1", head]
    for i, name, rd, rdu, t, tu in ((5, GEMM, "1.5", "Mbyte", "12.5", "usecond"),
                                    (6, ADD, "4,096", "byte", "3,000", "nsecond")):
        base = _row(i, name, "", "", "").rsplit(',"","",""', 1)[0]
        for metric, unit, value in (("dram__bytes_read.sum", rdu, rd),
                                    ("dram__bytes_write.sum", "byte", "10"),
                                    ("gpu__time_duration.sum", tu, t),
                                    ("launch__registers_per_thread", "register/thread", "64")):
            lines.append(f'{base},"Command line profiler metrics","{metric}","{unit}","{value}"')
    df = read_ncu_csv(_write(tmp_path, "\n".join(lines)))
    assert df["ncu_id"].tolist() == [5, 6]
    assert df["dram_read_bytes"].tolist() == [1.5e6, 4096.0]
    assert df["dram_bytes"].tolist() == [1.5e6 + 10, 4106.0]
    assert df["ncu_time_us"].tolist() == [12.5, 3.0]


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match=r"nope\.csv: no such file"):
        read_ncu_csv(tmp_path / "nope.csv")


@pytest.mark.parametrize("text", ['{"traceEvents": []}', "", "a,b,c\n1,2,3\n"])
def test_not_an_ncu_csv(tmp_path, text):
    p = _write(tmp_path, text, "trace.json")
    with pytest.raises(InputError, match=r"trace\.json: not an Nsight Compute CSV") as e:
        read_ncu_csv(p)
    assert "\n" not in str(e.value)


def test_binary_inputs_are_named(tmp_path):
    gz = tmp_path / "decode.json.gz"
    gz.write_bytes(b"\x1f\x8b\x08\x00" + bytes(64))
    with pytest.raises(InputError, match=r"decode\.json\.gz: gzip-compressed, not an Nsight"):
        read_ncu_csv(gz)
    rep = tmp_path / "decode.ncu-rep"
    rep.write_bytes(bytes(64))
    with pytest.raises(InputError, match=r"decode\.ncu-rep: an Nsight Compute report, not a CSV; "
                                         r"export it with ncu --import decode\.ncu-rep"):
        read_ncu_csv(rep)


def test_missing_metric_is_named(tmp_path):
    text = "\n".join([f'{HEAD},"dram__bytes_read.sum","gpu__time_duration.sum"',
                      '"","","","","","","","","","","","byte","nsecond"',
                      _row(0, GEMM, "1", "2", "3").rsplit(',"2"', 1)[0] + ',"3"'])
    with pytest.raises(InputError, match=r"run\.ncu\.csv: missing Nsight Compute metric\(s\) "
                                         r"dram__bytes_write\.sum;"):
        read_ncu_csv(_write(tmp_path, text))


def test_details_page_missing_metric(tmp_path):
    head = HEAD + ',"Section Name","Metric Name","Metric Unit","Metric Value"'
    base = _row(0, GEMM, "", "", "").rsplit(',"","",""', 1)[0]
    row = f'{base},"Command line profiler metrics","gpu__time_duration.sum","nsecond","5"'
    with pytest.raises(InputError, match="dram__bytes_read.sum, dram__bytes_write.sum"):
        read_ncu_csv(_write(tmp_path, "\n".join([head, row])))


def test_unparseable_value_and_unit(tmp_path):
    units = '"","","","","","","","","","","","byte","byte","nsecond"'
    bad = "\n".join([f"{HEAD},{METRICS}", units, _row(0, GEMM, "1", "2", "3"),
                     _row(1, GEMM, "12abc", "2", "3")])
    with pytest.raises(InputError, match=r"unparseable value '12abc' for dram__bytes_read\.sum "
                                         r"\(kernel ID 1\)"):
        read_ncu_csv(_write(tmp_path, bad))
    odd = "\n".join([f"{HEAD},{METRICS}", units.replace("nsecond", "cycle"),
                     _row(0, GEMM, "1", "2", "3")])
    with pytest.raises(InputError, match="unknown unit 'cycle' for gpu__time_duration.sum"):
        read_ncu_csv(_write(tmp_path, odd))


def test_na_values_are_missing_not_errors(tmp_path):
    units = '"","","","","","","","","","","","byte","byte","nsecond"'
    text = "\n".join([f"{HEAD},{METRICS}", units, _row(0, GEMM, "n/a", "2", "3")])
    df = read_ncu_csv(_write(tmp_path, text))
    assert math.isnan(df["dram_read_bytes"].iloc[0]) and math.isnan(df["dram_bytes"].iloc[0])


def test_header_without_rows(tmp_path):
    units = '"","","","","","","","","","","","byte","byte","nsecond"'
    with pytest.raises(InputError, match="no kernel rows"):
        read_ncu_csv(_write(tmp_path, f"{HEAD},{METRICS}\n{units}\n"))


# ------------------------------------------------------------------------------------ names
@pytest.mark.parametrize(("name", "full", "base"), [
    (ADD, "at::native::vectorized_elementwise_kernel<4,at::native::CUDAFunctor_add<c10::BFloat16>,"
          "std::array<char*,3ul>>", "vectorized_elementwise_kernel"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>(float*, int)",
     "at::native::cunn_SoftMaxForward<4,float>", "cunn_SoftMaxForward"),
    ("void at::native::elementwise_kernel<(int)128, (int)4, void at::native::f<T>(const T1 &)"
     "::[lambda(int) (instance 1)]>(int, T3)",
     "at::native::elementwise_kernel<(int)128,(int)4,voidat::native::f<T>(constT1&)"
     "::[lambda(int)(instance1)]>", "elementwise_kernel"),
    (GEMM, GEMM, GEMM),
    ("triton_poi_fused_add_mul_0", "triton_poi_fused_add_mul_0", "triton_poi_fused_add_mul_0"),
    ("_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIfEEEEviT0_",
     "vectorized_elementwise_kernel", "vectorized_elementwise_kernel"),
    ("_Z15rms_norm_kernelPfPKfi", "rms_norm_kernel", "rms_norm_kernel"),
    ("void at::vectorized_elementwise_kernel<4, void at::<unnamed>::pow_impl<float, float>"
     "(at::TensorIteratorBase &, T2)::[lambda(float) (instance 1)], std::array<char *, 2>>(int, T2)",
     "at::vectorized_elementwise_kernel<4,voidat::pow_impl<float,float>(at::TensorIteratorBase&,T2)"
     "::[lambda(float)(instance1)],std::array<char*,2>>", "vectorized_elementwise_kernel"),
])
def test_kernel_key(name, full, base):
    assert kernel_key(name) == full
    assert kernel_key(name, base=True) == base


def test_demangler_spacing_differences_share_a_full_key():
    assert kernel_key("void k<std::array<char *, 3ul>>(int)") == kernel_key(ADD.replace(
        "at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, ",
        "k<"))


# ----------------------------------------------------------------------------------- matching
def _attributed(steps: int, names=(GEMM, REDUCE, ADD)) -> pd.DataFrame:
    """A synthetic decode trace: per step, per layer: gemm + split-K reduce (q_proj), add (residual);
    plus one memcpy per step (kv_cache)."""
    rows, ts = [], 0.0
    ops = {GEMM: ("q_proj", 10.0), REDUCE: ("q_proj", 2.0), ADD: ("residual", 1.5)}
    for step in range(steps):
        for layer in range(2):
            for name in names:
                op, dur = ops[name]
                rows.append((name, "kernel", dur, op, layer, step))
        rows.append(("Memcpy DtoD (Device -> Device)", "memcpy", 3.0, "kv_cache", 1, step))
    out = []
    for i, (name, kind, dur, op, layer, step) in enumerate(rows):
        out.append({"event_id": i, "name": name, "kind": kind, "stream": 7, "ts_us": ts,
                    "dur_us": dur, "op_id": 100 + 10 * step + 2 * layer + (op == "residual"),
                    "operator": op, "layer": layer, "step": step,
                    "grid": "[80, 1, 1]" if name == GEMM else "[1, 1, 1]",
                    "block": "[128, 1, 1]"})
        ts += dur + 0.5
    df = pd.DataFrame(out)
    return df.astype({"layer": "Int64", "step": "Int64", "op_id": "Int64"})


def _ncu(names: list[str], dram: list[float] | None = None, short: bool = False) -> pd.DataFrame:
    """An ncu frame as read_ncu_csv returns it (dram read = 1000*(id+1), write = id)."""
    n = len(names)
    dram = dram or [1000.0 * (i + 1) for i in range(n)]
    df = pd.DataFrame({
        "ncu_id": range(n),
        "kernel_name": [kernel_key(x, base=True) if short else x for x in names],
        "stream": 7,
        "grid": ["80,1,1" if x == GEMM else "1,1,1" for x in names],
        "block": "128,1,1",
        "ncu_time_us": [12.0 if x == GEMM else 2.0 for x in names],
        "dram_read_bytes": dram,
        "dram_write_bytes": [float(i) for i in range(n)],
        "nvtx_range": None,
    })
    df["dram_bytes"] = df["dram_read_bytes"] + df["dram_write_bytes"]
    return df[list(NCU_COLUMNS)].astype(NCU_COLUMNS)


def _kernel_names(att: pd.DataFrame) -> list[str]:
    return att.loc[att["kind"] == "kernel", "name"].tolist()


def test_match_equal_counts_full_names():
    att = _attributed(2)
    ncu = _ncu(_kernel_names(att))
    matched, s = match_kernels(att, ncu)
    assert len(matched) == len(att) and matched["event_id"].tolist() == att["event_id"].tolist()
    k = matched[matched["kind"] == "kernel"]
    assert k["ncu_id"].tolist() == list(range(12))  # k-th launch pairs with the k-th
    assert k["dram_bytes"].tolist() == [1000.0 * (i + 1) + i for i in range(12)]
    assert matched.loc[matched["kind"] == "memcpy", "ncu_id"].isna().all()
    assert s["name_key"] == "full" and s["align"] == "end"
    assert (s["trace_kernels"], s["ncu_kernels"], s["matched"]) == (12, 12, 12)
    assert (s["trace_unmatched"], s["ncu_unmatched"]) == (0, 0)
    assert s["launch_config"] is True
    assert s["matched_time_fraction"] == 1.0
    # ncu/trace time per pair: gemm 12/10, reduce 2/2, add 2/1.5 -> median 1.2
    assert s["time_ratio_median"] == pytest.approx(1.2)


def test_match_without_kind_column_takes_every_row_as_a_kernel():
    att = _attributed(1)
    att = att[att["kind"] == "kernel"].drop(columns="kind")
    matched, s = match_kernels(att, _ncu(att["name"].tolist()))
    assert s["matched"] == 6 and matched["ncu_id"].tolist() == list(range(6))
    assert measured_by_operator(matched)["measured_kernels"].sum() == 6


def test_match_short_ncu_names_use_base_key():
    att = _attributed(1)
    matched, s = match_kernels(att, _ncu(_kernel_names(att), short=True))
    assert s["name_key"] == "base" and s["matched"] == 6
    k = matched[matched["kind"] == "kernel"]
    assert k["ncu_name"].tolist() == [kernel_key(n, base=True) for n in _kernel_names(att)]


def test_match_ncu_with_warmup_aligns_trailing_steps():
    att = _attributed(2)
    # ncu ran from process start: an init kernel, then one warm-up step, then the traced steps
    warm = _kernel_names(_attributed(1))
    names = ["void at::native::normal_kernel<float>(at::TensorBase&)", *warm, *_kernel_names(att)]
    matched, s = match_kernels(att, _ncu(names))
    k = matched[matched["kind"] == "kernel"]
    assert k["ncu_id"].tolist() == list(range(7, 19))  # the last 12 launches
    assert (s["matched"], s["trace_unmatched"], s["ncu_unmatched"]) == (12, 0, 7)
    cfg = {GEMM: "|80,1,1|128,1,1", REDUCE: "|1,1,1|128,1,1", ADD: "|1,1,1|128,1,1"}
    assert s["ncu_unmatched_by_key"] == {
        kernel_key(GEMM) + cfg[GEMM]: 2, kernel_key(REDUCE) + cfg[REDUCE]: 2,
        kernel_key(ADD) + cfg[ADD]: 2, "at::native::normal_kernel<float>|1,1,1|128,1,1": 1}
    # align="start" pairs the front instead: the warm-up step is (wrongly) taken for step 0
    _, s2 = match_kernels(att, _ncu(names), align="start")
    assert (s2["matched"], s2["ncu_unmatched"]) == (12, 7)


def test_match_fewer_ncu_launches_than_trace():
    att = _attributed(3)
    one_step = _kernel_names(_attributed(1))
    matched, s = match_kernels(att, _ncu(one_step))
    k = matched[matched["kind"] == "kernel"]
    assert k.loc[k["ncu_id"].notna(), "step"].unique().tolist() == [2]  # the last step
    assert (s["matched"], s["trace_unmatched"], s["ncu_unmatched"]) == (6, 12, 0)
    assert sorted(s["trace_unmatched_by_key"].values()) == [4, 4, 4]
    assert s["matched_time_fraction"] == pytest.approx(1 / 3)


def test_match_leaves_launches_of_another_size_unmatched():
    att = _attributed(1)
    ncu = _ncu(_kernel_names(att))
    ncu.loc[0, "grid"] = "40,1,1"  # layer 0's GEMM ran with another grid (another workload)
    matched, s = match_kernels(att, ncu)
    assert s["launch_config"] is True
    assert (s["matched"], s["trace_unmatched"], s["ncu_unmatched"]) == (5, 1, 1)
    k = matched[matched["kind"] == "kernel"]
    assert k["ncu_id"].tolist()[:4] == [pd.NA, 1, 2, 3]  # layer 1's GEMM keeps id 3
    assert s["ncu_unmatched_by_key"] == {kernel_key(GEMM) + "|40,1,1|128,1,1": 1}


def test_match_takes_launch_config_from_trace_device():
    att = _attributed(1)
    device = att[["event_id", "grid", "block"]]
    ncu = _ncu(_kernel_names(att))
    ncu.loc[[0, 3], "block"] = "256,1,1"
    _, s = match_kernels(att.drop(columns=["grid", "block"]), ncu, device=device)
    assert s["launch_config"] is True and (s["matched"], s["ncu_unmatched"]) == (4, 2)
    _, s = match_kernels(att.drop(columns=["grid", "block"]), ncu)  # names and order only
    assert s["launch_config"] is False and s["matched"] == 6


def test_match_with_no_common_launch_is_an_input_error():
    att = _attributed(1)
    ncu = _ncu(_kernel_names(att))
    ncu["grid"] = "999,1,1"
    ncu.attrs["path"] = "other.ncu.csv"
    with pytest.raises(InputError, match=r"other\.ncu\.csv: none of its 6 kernel launches"):
        match_kernels(att, ncu)


def test_match_checks_nvtx_ranges_against_attribution():
    att = _attributed(1)
    k = att[att["kind"] == "kernel"]
    ncu = _ncu(k["name"].tolist())
    ncu["nvtx_range"] = "layers." + k["layer"].astype(str).to_numpy() + "/" + k["operator"].to_numpy()
    _, s = match_kernels(att, ncu)
    assert (s["nvtx_operator_agreement"], s["nvtx_layer_agreement"]) == (1.0, 1.0)
    # a pairing shifted by one layer keeps the operators but not the layers
    ncu["nvtx_range"] = "layers." + (1 - k["layer"]).astype(str).to_numpy() + "/" + k["operator"].to_numpy()
    ncu.loc[2, "nvtx_range"] = "layers.1/act"
    _, s = match_kernels(att, ncu)
    assert s["nvtx_operator_agreement"] == pytest.approx(5 / 6)
    assert s["nvtx_layer_agreement"] == 0.0
    _, s = match_kernels(att, _ncu(k["name"].tolist()))
    assert s["nvtx_operator_agreement"] is None and s["nvtx_layer_agreement"] is None


def test_match_rejects_bad_align():
    att = _attributed(1)
    with pytest.raises(InputError, match="align"):
        match_kernels(att, _ncu(_kernel_names(att)), align="middle")


# ---------------------------------------------------------------------------------- aggregate
def test_measured_by_operator_sums_and_ratios():
    att = _attributed(1)
    names = _kernel_names(att)  # gemm, reduce, add per layer, ids 0..5
    matched, _ = match_kernels(att, _ncu(names))
    # analytical costs per op instance (op_id 100/101 layer 0, 102/103 layer 1)
    costed = pd.DataFrame({"op_id": [100, 101, 102, 103], "flops": [4e6, 1e3, 4e6, 1e3],
                           "bytes": [2000.0, 500.0, 4000.0, 1000.0]})
    out = measured_by_operator(matched, costed)
    assert list(out.columns) == ["layer", "operator", *MEASURED_COLUMNS]
    r = out.set_index(["layer", "operator"])
    # layer 0 q_proj = ncu ids 0 (gemm) + 1 (reduce): reads 1000 + 2000, writes 0 + 1
    q0 = r.loc[(0, "q_proj")]
    assert (q0["measured_read_bytes"], q0["measured_write_bytes"]) == (3000.0, 1.0)
    assert q0["measured_bytes"] == 3001.0 and q0["measured_kernels"] == 2
    assert q0["ncu_time_us"] == 14.0
    assert q0["measured_intensity"] == pytest.approx(4e6 / 3001.0)
    assert q0["bytes_ratio"] == pytest.approx(3001.0 / 2000.0)
    # layer 1 residual = ncu id 5: 6000 + 5 bytes against 1000 analytical
    assert r.loc[(1, "residual"), "bytes_ratio"] == pytest.approx(6005.0 / 1000.0)
    # kv_cache is a memcpy: counted, never measured
    kv = r.loc[(1, "kv_cache")]
    assert kv["unmeasured_copies"] == 1 and kv["measured_kernels"] == 0
    assert math.isnan(kv["measured_bytes"]) and math.isnan(kv["bytes_ratio"])
    # every kernel's bytes land in exactly one group
    assert out["measured_bytes"].sum() == matched["dram_bytes"].sum()


def test_measured_by_operator_partial_group_is_nan():
    att = _attributed(1)
    names = _kernel_names(att)
    ncu = _ncu([n for i, n in enumerate(names) if i != 1])  # layer 0's split-K reduce missing
    matched, s = match_kernels(att, ncu)
    assert s["trace_unmatched"] == 1
    r = measured_by_operator(matched).set_index(["layer", "operator"])
    assert r.loc[(0, "q_proj"), "unmeasured_kernels"] == 1
    assert math.isnan(r.loc[(0, "q_proj"), "measured_bytes"])
    assert not math.isnan(r.loc[(1, "q_proj"), "measured_bytes"])
    assert math.isnan(r.loc[(1, "q_proj"), "measured_intensity"])  # no costs given


def test_measured_by_operator_other_groupings():
    att = _attributed(2)
    matched, _ = match_kernels(att, _ncu(_kernel_names(att)))
    costed = pd.DataFrame({"operator": ["q_proj", "residual"], "flops": [8e6, 4e3],
                           "bytes": [1e4, 1e3]})
    per_op = measured_by_operator(matched, costed, by=("operator",)).set_index("operator")
    gemm_reduce = [i for i, n in enumerate(_kernel_names(att)) if n != ADD]
    expected = sum(1000.0 * (i + 1) + i for i in gemm_reduce)
    assert per_op.loc["q_proj", "measured_bytes"] == expected
    assert per_op.loc["q_proj", "measured_intensity"] == pytest.approx(8e6 / expected)
    whole = measured_by_operator(matched, by=())  # one row: the whole trace
    assert len(whole) == 1 and whole["measured_bytes"].iloc[0] == matched["dram_bytes"].sum()
    assert whole["measured_kernels"].iloc[0] == 12 and whole["unmeasured_copies"].iloc[0] == 2


# ------------------------------------------------------------------------ the committed H200 file
DECODE_TRACE = SAMPLES / "qwen2.5-7b_decode_b1_s2048_h200.json.gz"
DECODE_CSV = SAMPLES / "qwen2.5-7b_decode_b1_s2048_h200.ncu.csv"
PAIRS = sorted(SAMPLES.glob("*.ncu.csv"))


def test_real_h200_csv_parses():
    """ncu 2025.3 on the H200: NVTX push/pop and start/stop columns, units row "byte"/"ns"."""
    df = read_ncu_csv(DECODE_CSV)
    assert len(df) == 138 and df["ncu_id"].tolist() == list(range(138))
    assert df["dram_read_bytes"].notna().all() and df["ncu_time_us"].notna().all()
    # ID 135: the down_proj split-K GEMM, "135,850,240","19,456","34,880" (ns)
    last_gemm = df.loc[df["ncu_id"] == 135].iloc[0]
    assert last_gemm["kernel_name"] == "nvjet_sm90_tst_256x8_64x6_4x1_v_bz_splitK_TNT"
    assert (last_gemm["grid"], last_gemm["block"]) == ("4,28,1", "384,1,1")
    assert last_gemm["dram_bytes"] == 135_850_240 + 19_456
    assert last_gemm["ncu_time_us"] == pytest.approx(34.88)
    assert last_gemm["nvtx_range"] == "layers.0/down_proj"
    assert df["nvtx_range"].str.startswith("layers.0/").all()


@pytest.mark.parametrize("csv", PAIRS, ids=[p.name for p in PAIRS])
def test_real_csv_matches_its_trace(csv):
    """Every committed ncu CSV pairs one-to-one with the trace of the same stem, and the pairing
    agrees with the launch configs and with the NVTX operator/layer ranges of the ncu run."""
    trace = load_trace(csv.with_name(csv.name.removesuffix(".ncu.csv") + ".json.gz"))
    ncu = read_ncu_csv(csv)
    matched, s = match_kernels(attribute(trace), ncu, device=trace.device)
    assert (s["trace_unmatched"], s["ncu_unmatched"]) == (0, 0)
    assert s["matched"] == len(ncu) == s["trace_kernels"]
    assert s["launch_config"] is True
    assert s["nvtx_operator_agreement"] == 1.0 and s["nvtx_layer_agreement"] == 1.0
    assert matched["dram_bytes"].sum() == ncu["dram_bytes"].sum()


def test_real_decode_gemms_stream_their_weights_once():
    """Decode at batch 1 reads each weight matrix once per step: with ncu's cache flush, measured
    DRAM bytes of every projection are its 3 steps x K*N*2 bf16 weight bytes, plus at most 2%
    (activations, bias, split-K workspace)."""
    trace = load_trace(DECODE_TRACE)
    attributed = attribute(trace)
    matched, _ = match_kernels(attributed, read_ncu_csv(DECODE_CSV),
                               device=trace.device)
    steps = attributed["step"].nunique()
    assert steps == 3
    per_op = measured_by_operator(matched, by=("operator",)).set_index("operator")
    h, kv, inter = 3584, 512, 18944
    for op, (k, n) in {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
                       "gate_proj": (h, inter), "up_proj": (h, inter),
                       "down_proj": (inter, h)}.items():
        ratio = per_op.loc[op, "measured_bytes"] / (steps * k * n * 2)
        assert 1.0 <= ratio <= 1.02, (op, ratio)
    assert (per_op["unmeasured_kernels"] == 0).all()
    assert per_op["measured_bytes"].sum() == matched["dram_bytes"].sum()
