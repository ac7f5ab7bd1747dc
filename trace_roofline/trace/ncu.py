"""Nsight Compute import: per-kernel measured DRAM bytes, matched to the trace's kernels.

Design notes: docs/design.md ("trace_roofline/trace/ncu.py").
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

import numpy as np
import pandas as pd

from trace_roofline.errors import InputError
from trace_roofline.files import open_regular

# One row per profiled kernel launch, in ncu's launch order.
NCU_COLUMNS = {
    "ncu_id": "int64",  # ncu's "ID": launch order within the report
    "kernel_name": "str",  # as ncu printed it (demangled, function-only or mangled)
    "stream": "Int64",
    "grid": "str",  # "x,y,z" blocks per grid
    "block": "str",  # "x,y,z" threads per block
    "ncu_time_us": "float64",  # gpu__time_duration.sum
    "dram_read_bytes": "float64",  # dram__bytes_read.sum
    "dram_write_bytes": "float64",  # dram__bytes_write.sum
    "dram_bytes": "float64",  # read + write
    "nvtx_range": "str",  # NVTX push/pop stack "outer/inner" (ncu --nvtx), else missing
}

# Columns `match_kernels` adds to the attributed rows (missing where a kernel had no ncu match).
MATCH_COLUMNS = {
    "ncu_id": "Int64",
    "ncu_name": "str",
    "ncu_time_us": "float64",
    "dram_read_bytes": "float64",
    "dram_write_bytes": "float64",
    "dram_bytes": "float64",
    "nvtx_range": "str",
}

# One row per group of `by` keys (default layer, operator); merge it onto the roofline tables.
MEASURED_COLUMNS = {
    "measured_kernels": "int64",  # kernels of the group with an ncu measurement
    "unmeasured_kernels": "int64",  # kernels of the group without one (then measured_* are NaN)
    "unmeasured_copies": "int64",  # memcpy/memset rows: ncu profiles kernels only
    "measured_read_bytes": "float64",
    "measured_write_bytes": "float64",
    "measured_bytes": "float64",  # Σ DRAM bytes read + written over the group's kernels
    "ncu_time_us": "float64",
    "measured_intensity": "float64",  # analytical FLOPs / measured bytes (needs `costed`)
    "bytes_ratio": "float64",  # measured bytes / analytical bytes (needs `costed`)
}

METRICS = {
    "gpu__time_duration.sum": "ncu_time_us",
    "dram__bytes_read.sum": "dram_read_bytes",
    "dram__bytes_write.sum": "dram_write_bytes",
}
_TIME_TO_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "µs": 1.0,
               "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}
# ncu's byte prefixes are decimal (SI); the binary ones appear only if asked for.
_BYTES = {"byte": 1.0, "b": 1.0, "kbyte": 1e3, "kb": 1e3, "mbyte": 1e6, "mb": 1e6,
          "gbyte": 1e9, "gb": 1e9, "tbyte": 1e12, "tb": 1e12,
          "kibyte": 2.0**10, "mibyte": 2.0**20, "gibyte": 2.0**30, "tibyte": 2.0**40}
_UNITS = {"gpu__time_duration.sum": _TIME_TO_US,
          "dram__bytes_read.sum": _BYTES, "dram__bytes_write.sum": _BYTES}
_MISSING = {"", "n/a", "N/A"}
_HEADER = re.compile(r'^"?ID"?,')
_CAPTURE_HINT = ("capture with: ncu --csv --page raw --metrics "
                 "gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum")


# ---------------------------------------------------------------------------------------- read
def read_ncu_csv(path: str | os.PathLike) -> pd.DataFrame:
    """Parse an Nsight Compute CSV export into one row per kernel launch (`NCU_COLUMNS`).

    Accepts the raw page (`--page raw`: header row, units row, one row per launch) and the
    details page (`--metrics ...` without `--page raw`: one row per launch and metric). Lines
    before the header (`==PROF==`, `==WARNING==`, program output) and unquoted lines inside the
    table (program output interleaved with ncu's) are skipped. Values may carry thousands
    separators ("1,234.5"); units (nsecond/usecond/msecond/second, byte/Kbyte/Mbyte/...) are
    normalised to µs and bytes; a raw page without a units row is taken as base units (ns, byte).
    Raises InputError (one line, naming the file) for a missing file, a file that is not an
    ncu CSV, missing metrics, unknown units or unparseable values.
    """
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{p}: is a directory, expected an ncu CSV file")
    if not p.exists():
        raise InputError(f"{p}: no such file")
    if p.suffix == ".ncu-rep":
        raise InputError(f"{p}: an Nsight Compute report, not a CSV; export it with "
                         f"ncu --import {p.name} --csv --page raw > {p.stem}.ncu.csv")
    try:
        with open_regular(p) as f:  # (a FIFO: an InputError, not a read that never ends)
            data = f.read()
        if data[:2] == b"\x1f\x8b":
            raise InputError(f"{p}: gzip-compressed, not an Nsight Compute CSV")
        # (as read_text would: universal newlines)
        text = data.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")
    except OSError as e:
        raise InputError(f"{p}: cannot read ({e.strerror})") from None
    table = _table_text(p, text)
    try:
        df = pd.read_csv(io.StringIO(table), dtype=str, keep_default_na=False, na_filter=False)
    except (pd.errors.ParserError, ValueError) as e:
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise InputError(f"{p}: not a valid ncu CSV table ({msg})") from None
    if "Kernel Name" not in df.columns:
        raise InputError(f"{p}: not an Nsight Compute CSV (no 'Kernel Name' column); {_CAPTURE_HINT}")
    if "Metric Name" in df.columns and "Metric Value" in df.columns:
        wide, values = _from_details(p, df)
    else:
        wide, values = _from_raw(p, df)
    if wide.empty:
        raise InputError(f"{p}: no kernel rows in the ncu CSV")
    ids = pd.to_numeric(wide["ID"].str.replace(",", "", regex=False), errors="coerce")
    if ids.isna().any():
        bad = wide.loc[ids.isna(), "ID"].iloc[0]
        raise InputError(f"{p}: unparseable kernel ID {bad!r}")
    out = pd.DataFrame({"ncu_id": ids.astype("int64").to_numpy()})
    out["kernel_name"] = wide["Kernel Name"].to_numpy()
    out["stream"] = (_to_int(wide["Stream"]) if "Stream" in wide else
                     pd.Series(pd.NA, index=wide.index, dtype="Int64")).to_numpy()
    for src, dst in (("Grid Size", "grid"), ("Block Size", "block")):
        out[dst] = (launch_dims(wide[src]) if src in wide else
                    pd.Series(None, index=wide.index, dtype="str")).to_numpy()
    for metric, col in METRICS.items():
        out[col] = values[metric].to_numpy()
    out["dram_bytes"] = out["dram_read_bytes"] + out["dram_write_bytes"]
    nvtx = [c for c in wide.columns if "Push/Pop_Range" in c]
    out["nvtx_range"] = (nvtx_stack(wide[nvtx[0]]) if nvtx else
                         pd.Series(None, index=wide.index, dtype="str")).to_numpy()
    out = out.sort_values("ncu_id", kind="stable", ignore_index=True).astype(NCU_COLUMNS)
    out.attrs["path"] = str(p)  # lets match_kernels name the file in its errors
    return out


def _table_text(p: Path, text: str) -> str:
    """The CSV table: from the header row on, minus lines that are not ncu's."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines)
                  if _HEADER.match(ln) and "Kernel Name" in ln), None)
    if start is None:
        raise InputError(f"{p}: not an Nsight Compute CSV (no header row starting with \"ID\" "
                         f"and naming \"Kernel Name\"); {_CAPTURE_HINT}")
    header = lines[start]
    if header.startswith('"'):  # ncu quotes every field: anything else is program output
        body = [ln for ln in lines[start + 1:] if ln.startswith('"')]
    else:
        body = [ln for ln in lines[start + 1:] if ln.strip() and not ln.startswith("==")]
    return "\n".join([header, *body]) + "\n"


def _from_raw(p: Path, df: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, pd.Series]]:
    """Raw page: one column per metric, a units row (empty ID) right under the header."""
    missing = [m for m in METRICS if m not in df.columns]
    if missing:
        raise InputError(f"{p}: missing Nsight Compute metric(s) {', '.join(missing)}; "
                         f"{_CAPTURE_HINT}")
    blank = df["ID"].str.strip() == ""  # the units row (repeated if ncu printed several tables)
    units = df[blank].iloc[0] if blank.any() else None
    rows = df[~blank & (df["ID"] != "ID")].reset_index(drop=True)
    values = {}
    for metric, table in _UNITS.items():
        unit = units[metric].strip() if units is not None else ("nsecond" if table is _TIME_TO_US
                                                                 else "byte")
        factor = table.get(unit.lower())
        if factor is None:
            raise InputError(f"{p}: unknown unit {unit!r} for {metric}")
        values[metric] = _numbers(p, rows[metric], rows["ID"], metric) * factor
    return rows, values


def _from_details(p: Path, df: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, pd.Series]]:
    """Details page: one row per (launch, metric) with its own unit; pivot to one row per launch."""
    present = set(df["Metric Name"].unique())
    missing = [m for m in METRICS if m not in present]
    if missing:
        raise InputError(f"{p}: missing Nsight Compute metric(s) {', '.join(missing)}; "
                         f"{_CAPTURE_HINT}")
    launches = df.drop_duplicates("ID").reset_index(drop=True)
    values = {}
    for metric, table in _UNITS.items():
        rows = df[df["Metric Name"] == metric].drop_duplicates("ID")
        unit = rows["Metric Unit"].str.strip() if "Metric Unit" in rows else pd.Series(
            "nsecond" if table is _TIME_TO_US else "byte", index=rows.index)
        factor = unit.str.lower().map(table)
        if factor.isna().any():
            bad = unit[factor.isna()].iloc[0]
            raise InputError(f"{p}: unknown unit {bad!r} for {metric}")
        vals = _numbers(p, rows["Metric Value"], rows["ID"], metric) * factor.to_numpy()
        values[metric] = pd.Series(vals.to_numpy(), index=rows["ID"].to_numpy()).reindex(
            launches["ID"].to_numpy())
    return launches, values


def _numbers(p: Path, s: pd.Series, ids: pd.Series, metric: str) -> pd.Series:
    """Numbers printed by ncu: thousands separators removed, 'n/a' and empty -> NaN."""
    clean = s.str.strip().str.replace(",", "", regex=False)
    missing = clean.isin(_MISSING)
    num = pd.to_numeric(clean.where(~missing), errors="coerce").astype("float64")
    bad = num.isna() & ~missing
    if bad.any():
        i = bad.to_numpy().nonzero()[0][0]
        raise InputError(f"{p}: unparseable value {s.iloc[i]!r} for {metric} "
                         f"(kernel ID {ids.iloc[i]})")
    return num.reset_index(drop=True)


def _to_int(s: pd.Series) -> pd.Series:
    return pd.to_numeric(s.str.strip().replace("", None), errors="coerce").astype("Int64")


def launch_dims(s: pd.Series) -> pd.Series:
    """Canonical "x,y,z" launch dimensions from "(256, 1, 1)" (ncu) or "[256, 1, 1]" (Kineto)."""
    s = s.astype("str")
    dims = s.str.findall(r"\d+").str.join(",")
    return dims.where(s.notna() & (dims != ""), None).astype("str")


def nvtx_stack(s: pd.Series) -> pd.Series:
    """NVTX push/pop stack "outer/inner" from ncu's `thread Domain:Push/Pop_Range:...` column.

    A cell reads `<tid>  "<domain>:<range>:<PL_Type>:<PL_Value>:<CLR_Type>:<Color>:<Msg_Type>:<Msg>"`
    with one quoted item per open range, outermost first; the range name is what lies between
    the domain and the six trailing payload fields (so names may themselves contain ':').
    Parsed once per distinct cell (a stack repeats for every kernel inside it).
    """
    codes, uniq = pd.factorize(s.astype("str"))
    cells = pd.Series(uniq, dtype="str")
    stacks = (cells.str.replace(r'"[^":]*:(.*?)(?::[^:"]*){6}"\s*', r"\1/", regex=True)
              .str.replace(r"^\s*\d*\s*", "", regex=True).str.rstrip("/"))
    stacks = stacks.where(cells.str.contains('"', regex=False) & (stacks != ""), None)
    out = stacks.to_numpy(dtype=object)[codes] if len(uniq) else np.full(len(s), None, object)
    # numpy's stub: no where() overload takes x=None (valid at run time: an object value)
    return pd.Series(np.where(codes < 0, None, out),  # type: ignore[arg-type]
                     index=s.index, dtype="str")


# --------------------------------------------------------------------------------------- match
def kernel_key(name: str, base: bool = False) -> str:
    """Normalised kernel name for matching ncu to CUPTI names.

    Full key: the demangled name without its return type ("void ") and parameter list, with
    "(anonymous namespace)::" / "<unnamed>::" and all whitespace dropped (demanglers differ on
    "> >" and "char *"); template arguments are kept. ncu's demangler (2025.3) departs further
    from CUPTI's: it drops inline namespaces (`at::native::` -> `at::`), writes lambdas as
    "[lambda() (instance 3)]" not "{lambda()#3}", template integers as "2" not "2ul" and bools
    as 0/1, so on real PyTorch traces only the base key agrees.
    Base key (`base=True`): the last scope component without template arguments
    ("at::native::vectorized_elementwise_kernel<4, ...>(int, ...)" -> "vectorized_elementwise_kernel").
    Itanium-mangled names ("_ZN2at6native...") reduce to their base key only.
    """
    name = name.strip()
    if name.startswith("_Z"):
        return _mangled_base(name)
    name = re.sub(r"\(anonymous namespace\)::|\{anonymous\}::|<unnamed>::", "", name)
    name = re.sub(r"^(?:__global__\s+)?void\s+", "", name)
    depth, cut = 0, len(name)
    for i, ch in enumerate(name):  # parameter list = first '(' outside template brackets
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(depth - 1, 0)
        elif ch == "(" and depth == 0 and i > 0:
            cut = i
            break
    full = re.sub(r"\s+", "", name[:cut])
    if not base:
        return full
    depth, plain = 0, []
    for ch in full:  # drop template arguments
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(depth - 1, 0)
        elif depth == 0:
            plain.append(ch)
    return "".join(plain).split("::")[-1]


def _mangled_base(name: str) -> str:
    """Last source name of an Itanium nested name: _ZN2at6native6kernelIiEEvT_ -> 'kernel'."""
    i = 2 + (name[2:3] == "N")
    while i < len(name) and name[i] in "rVKL":  # cv-qualifiers of a nested name
        i += 1
    last = name
    while i < len(name) and name[i].isdigit():
        j = i
        while j < len(name) and name[j].isdigit():
            j += 1
        n = int(name[i:j])
        last = name[j:j + n]
        i = j + n
    return last


def match_kernels(attributed: pd.DataFrame, ncu: pd.DataFrame, align: str = "end",
                  device: pd.DataFrame | None = None) -> tuple[pd.DataFrame, dict]:
    """Pair ncu launches with the trace's kernels and join the measured columns (`MATCH_COLUMNS`).

    Key: the kernel name reduced by `kernel_key`, plus the launch's grid and block sizes when
    both sides have them for every kernel (`device` = trace.device, or `grid`/`block` columns on
    `attributed`), so that a launch of another shape (another workload, batch or sequence length)
    stays unmatched instead of lending its bytes. The full name key (templates kept) is used
    when it pairs as many trace kernels as the base key; otherwise (function-only or mangled
    ncu names, or ncu's demangler spelling templates differently, as on real PyTorch traces)
    the base key. `summary["name_key"]` and `summary["launch_config"]` say which key was used.
    Order: within each key, the k-th trace launch (by ts_us) pairs with the k-th ncu launch
    (by ID). When the counts differ, the two sequences are aligned at their ends (`align="end"`,
    default): an ncu run profiles from process start (weight init, warm-up steps) while the
    torch.profiler trace holds the last steps, so the surplus at the front of the longer side
    is left unmatched; `align="start"` aligns the fronts instead (ncu run with --launch-skip).
    Only `kind == "kernel"` rows take part (ncu does not profile memcpy/memset).
    Returns (attributed rows in their order + `MATCH_COLUMNS`, summary dict: counts both ways,
    the most frequent unmatched keys, matched share of kernel time, median ncu/trace time
    ratio, and NVTX-range vs attributed operator/layer agreement when ncu recorded ranges).
    Raises InputError when no launch pairs at all (the CSV is of another workload).
    """
    if align not in ("end", "start"):
        raise InputError(f"align must be 'end' or 'start', not {align!r}")
    trace = attributed[attributed["kind"] == "kernel"] if "kind" in attributed else attributed
    trace = trace.sort_values(["ts_us", "event_id"], kind="stable")
    if device is not None and not {"grid", "block"} & set(trace.columns):
        cfg = device.loc[device["event_id"].isin(trace["event_id"]), ["event_id", "grid", "block"]]
        trace = trace.merge(cfg, on="event_id", how="left", sort=False)
    n = ncu.sort_values("ncu_id", kind="stable")
    launch: dict = {"trace": "", "ncu": ""}  # suffixes "|grid|block" when both sides have them
    if {"grid", "block"} <= set(trace.columns):
        dims = {"trace": launch_dims(trace["grid"]) + "|" + launch_dims(trace["block"]),
                "ncu": n["grid"].astype("str") + "|" + n["block"].astype("str")}
        if all(d.notna().all() for d in dims.values()):
            launch = {side: "|" + d.to_numpy() for side, d in dims.items()}
    names = {"trace": trace["name"].astype("str"), "ncu": n["kernel_name"].astype("str")}
    keys: dict[str, dict[str, np.ndarray]] = {}  # level -> side -> each row's key
    for level in ("full", "base"):
        keys[level] = {}
        for side, col in names.items():
            uniq = pd.unique(col)  # normalise per distinct name, not per launch
            table = {x: kernel_key(x, base=level == "base") for x in uniq}
            keys[level][side] = col.map(table).to_numpy() + launch[side]
    found = {level: np.isin(k["trace"], k["ncu"]).sum() for level, k in keys.items()}
    name_key = "full" if found["full"] >= found["base"] else "base"
    t = pd.DataFrame({"event_id": trace["event_id"].to_numpy(), "_key": keys[name_key]["trace"]})
    c = pd.DataFrame({"_key": keys[name_key]["ncu"], "_pos": np.arange(len(n))})
    for f in (t, c):
        f["_rank"] = f.groupby("_key", sort=False).cumcount(ascending=(align == "start"))
    pairs = t.merge(c, on=["_key", "_rank"], how="inner")
    if pairs.empty and len(t) and len(c):
        where = ncu.attrs.get("path", "the ncu CSV")
        raise InputError(f"{where}: none of its {len(c)} kernel launches matches the trace's "
                         f"{len(t)} kernels by name and launch size (another workload?)")
    got = n.iloc[pairs["_pos"].to_numpy()]
    measured = pd.DataFrame({
        "event_id": pairs["event_id"].to_numpy(),
        "ncu_id": got["ncu_id"].to_numpy(),
        "ncu_name": got["kernel_name"].to_numpy(),
        **{col: got[col].to_numpy() for col in list(MATCH_COLUMNS)[2:]},
    })
    matched = attributed.merge(measured, on="event_id", how="left", validate="one_to_one")
    matched = matched.astype(MATCH_COLUMNS)
    summary = {"name_key": name_key, "launch_config": not isinstance(launch["trace"], str),
               "align": align, **_counts(trace, t, c, pairs, measured)}
    return matched, summary


def _counts(trace: pd.DataFrame, t: pd.DataFrame, c: pd.DataFrame, pairs: pd.DataFrame,
            measured: pd.DataFrame) -> dict:
    """Counts both ways, the (up to 10) most frequent unmatched keys, and the pairing checks."""
    t_left = t.loc[~t["event_id"].isin(pairs["event_id"]), "_key"].value_counts()
    c_left = c.loc[~c["_pos"].isin(pairs["_pos"]), "_key"].value_counts()
    on = trace.set_index("event_id").loc[measured["event_id"]]
    ratio = measured["ncu_time_us"].to_numpy() / on["dur_us"].to_numpy()
    total_us = float(trace["dur_us"].sum())
    return {
        "trace_kernels": len(t),
        "ncu_kernels": len(c),
        "matched": len(pairs),
        "trace_unmatched": int(t_left.sum()),
        "ncu_unmatched": int(c_left.sum()),
        "trace_unmatched_by_key": {str(k): int(v) for k, v in t_left.head(10).items()},
        "ncu_unmatched_by_key": {str(k): int(v) for k, v in c_left.head(10).items()},
        "matched_time_fraction": float(on["dur_us"].sum()) / total_us if total_us else None,
        "time_ratio_median": float(np.nanmedian(ratio)) if len(ratio) else None,
        **_nvtx_agreement(on, measured["nvtx_range"]),
    }


def _nvtx_agreement(on: pd.DataFrame, nvtx: pd.Series) -> dict:
    """Where ncu recorded NVTX ranges named like our workloads' ("layers.3/q_proj"), the share of
    paired kernels whose innermost range is the attributed operator, and whose "layers.N" range is
    the attributed layer: an independent check of both the pairing and the attribution."""
    nvtx = pd.Series(nvtx.to_numpy(), dtype="str")
    has = nvtx.notna().to_numpy()
    out: dict = {"nvtx_operator_agreement": None, "nvtx_layer_agreement": None}
    if not has.any():
        return out
    if "operator" in on:
        inner = nvtx.str.rsplit("/", n=1).str[-1].to_numpy()
        out["nvtx_operator_agreement"] = float((inner == on["operator"].to_numpy())[has].mean())
    layer = pd.to_numeric(nvtx.str.extract(r"(?:^|/)layers?[._](\d+)(?:/|$)")[0], errors="coerce")
    with_layer = layer.notna().to_numpy()
    if "layer" in on and with_layer.any():
        same = layer.to_numpy()[with_layer] == on["layer"].astype("float64").to_numpy()[with_layer]
        out["nvtx_layer_agreement"] = float(same.mean())
    return out


# ----------------------------------------------------------------------------------- aggregate
def measured_by_operator(matched: pd.DataFrame, costed: pd.DataFrame | None = None,
                         by: tuple[str, ...] = ("layer", "operator")) -> pd.DataFrame:
    """Measured DRAM bytes per group of `by` (`MEASURED_COLUMNS`), one row per group.

    A group's measured bytes are the sum over its kernels, and are NaN unless every kernel of
    the group has an ncu measurement (a partial sum would understate the traffic). memcpy/memset
    rows are counted in `unmeasured_copies`, not in the bytes. With `costed` (rows carrying
    flops and bytes, plus the `by` columns or an op_id that `matched` maps to them):
    measured_intensity = Σflops / measured_bytes (FLOP per DRAM byte; NaN for 0 bytes) and
    bytes_ratio = measured_bytes / Σbytes (1.0 = the analytical minimum was moved).
    The result merges onto the roofline's per-operator table on the `by` columns.
    """
    cols = [b for b in by if b in matched.columns]  # (the `by` columns it has)
    kernel = matched["kind"].eq("kernel") if "kind" in matched else pd.Series(True, matched.index)
    has = kernel & matched["dram_bytes"].notna()
    work = pd.DataFrame({
        "_one": 0,
        "measured_kernels": has.astype("int64"),
        "unmeasured_kernels": (kernel & ~has).astype("int64"),
        "unmeasured_copies": (~kernel).astype("int64"),
        "measured_read_bytes": matched["dram_read_bytes"].where(has, 0.0),
        "measured_write_bytes": matched["dram_write_bytes"].where(has, 0.0),
        "measured_bytes": matched["dram_bytes"].where(has, 0.0),
        "ncu_time_us": matched["ncu_time_us"].where(has, 0.0),
    })
    for b in cols:
        work[b] = matched[b]
    keys = cols or ["_one"]
    out = work.groupby(keys, dropna=False, sort=True).sum().reset_index()
    partial = (out["unmeasured_kernels"] > 0) | (out["measured_kernels"] == 0)
    sums = ["measured_read_bytes", "measured_write_bytes", "measured_bytes", "ncu_time_us"]
    out[sums] = out[sums].astype("float64").where(~partial, np.nan, axis=0)
    out["measured_intensity"] = np.nan
    out["bytes_ratio"] = np.nan
    if costed is not None:
        costs = costed
        if not set(cols) <= set(costed.columns):
            ops = matched.loc[matched["op_id"].notna(), ["op_id", *cols]].drop_duplicates("op_id")
            costs = costed.drop(columns=[b for b in cols if b in costed], errors="ignore").merge(
                ops, on="op_id", how="inner")
        costs = costs.assign(_one=0).groupby(keys, dropna=False)[["flops", "bytes"]].sum()
        costs = costs.reset_index()
        both = out[keys].merge(costs, on=keys, how="left")
        measured = out["measured_bytes"].where(out["measured_bytes"] > 0).to_numpy()
        out["measured_intensity"] = both["flops"].to_numpy() / measured
        out["bytes_ratio"] = out["measured_bytes"].to_numpy() / both["bytes"].to_numpy()
    out = out[[*cols, *MEASURED_COLUMNS]]
    return out.astype(MEASURED_COLUMNS)
