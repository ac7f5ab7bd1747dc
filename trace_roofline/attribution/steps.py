"""Serving steps: the step annotations vLLM and SGLang write, each kernel's step, its phase, and
the attention work a step's batch statistics fix exactly.

Design notes: docs/design.md ("trace_roofline/attribution/steps.py").
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from trace_roofline.frames import factorized
from trace_roofline.trace import Trace

_SUMS = ("sq", "sk", "sqsq", "sqsk")
_VLLM = re.compile(
    r"^execute_(?P<tokens>\d+)_context_(?P<n>\d+)\("
    + "".join(rf"{s}(?P<p_{s}>\d+)" for s in _SUMS)
    + r"\)_generation_(?P<m>\d+)\("
    + "".join(rf"{s}(?P<d_{s}>\d+)" for s in _SUMS) + r"\)")
_SGLANG = re.compile(r"^step\[(?P<mode>[A-Z_]+) bs=(?P<bs>\d+)(?: toks=(?P<toks>\d+))?")
# SGLang's forward modes -> phase (ForwardMode in sglang/srt/model_executor/forward_batch_info.py)
SGLANG_PHASES = {"DECODE": "decode", "EXTEND": "prefill", "PREFILL": "prefill",
                 "MIXED": "mixed", "TARGET_VERIFY": "decode", "DRAFT_EXTEND": "prefill"}
PREFILL_SUMS = tuple(f"p_{s}" for s in _SUMS)
DECODE_SUMS = tuple(f"d_{s}" for s in _SUMS)
STEP_COLUMNS = {
    "step": "int64",  # 0, 1, ... in order of start
    "name": "str",  # the annotation(s), " | "-joined
    "phase": "str",  # prefill | decode | mixed | unknown
    "engine": "str",  # vllm (the detailed sums) | sglang (mode and batch only)
    "mode": "str",  # SGLang's forward mode, when annotated
    "tokens": "Int64",  # tokens in the step (Σq of chunks + decodes)
    "requests": "Int64",  # n chunks + m decodes (SGLang: bs)
    "chunks": "Int64",  # n prefill chunks
    "decodes": "Int64",  # m decode requests
    **{c: "Int64" for c in (*PREFILL_SUMS, *DECODE_SUMS)},
    "pid": "Int64",
    "ts_us": "float64",
    "end_us": "float64",
}


@dataclass(frozen=True)
class StepSums:
    """One step's batch statistics (NaN-free ints; zeros where a part is empty)."""

    chunks: int
    decodes: int
    p_sq: int
    p_sk: int
    p_sqsq: int
    p_sqsk: int
    d_sq: int
    d_sk: int

    @classmethod
    def from_row(cls, row: pd.Series) -> StepSums | None:
        """From a `steps` row; None without the detailed sums."""
        keys = ("chunks", "decodes", "p_sq", "p_sk", "p_sqsq", "p_sqsk", "d_sq", "d_sk")
        if any(pd.isna(row.get(k)) for k in keys):
            return None
        return cls(*(int(row[k]) for k in keys))

    def text(self) -> str:
        """The compact form carried per kernel (`serving_step` column) and read back by `parse_text`."""
        return " ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))


def parse_text(text: str) -> StepSums | None:
    """StepSums of `StepSums.text` (after a `step N:` prefix), None when it holds no sums."""
    fields = dict(kv.split("=", 1) for kv in re.findall(r"\b\w+=\d+", text))
    try:
        return StepSums(*(int(fields[f.name]) for f in dataclasses.fields(StepSums)))
    except KeyError:
        return None


# ---------------------------------------------------------------------------------- parsing
def parse(annotations: pd.DataFrame) -> pd.DataFrame:
    """The steps (STEP_COLUMNS) the `user_annotation` ranges of a trace name, in start order;
    overlapping ranges on one thread are one step. Each distinct name is read once."""
    cat_codes, cats = factorized(annotations["cat"])
    user = np.append(np.asarray(pd.Index(cats).astype("string") == "user_annotation"),
                     False)[np.where(cat_codes < 0, len(cats), cat_codes)]
    ann = annotations[user]
    codes, uniq = factorized(ann["name"])
    fields = _fields(pd.Series(np.asarray(uniq, dtype=object), dtype="string").fillna(""))
    keep = np.append((fields["engine"] != "").to_numpy(), False)[np.where(codes < 0, len(uniq),
                                                                            codes)]
    if not keep.any():
        return _empty()
    a = pd.concat([ann.reset_index(drop=True)[["name", "pid", "tid", "ts_us", "dur_us"]][keep]
                   .reset_index(drop=True),
                   fields.iloc[codes[keep]].reset_index(drop=True)], axis=1)
    a = a.sort_values(["pid", "tid", "ts_us"], kind="stable")
    a["end_us"] = a["ts_us"] + a["dur_us"]
    a["cluster"] = _clusters(a)
    return _merge(a)


def _fields(names: pd.Series) -> pd.DataFrame:
    """Per distinct annotation name (a string Series): the vLLM fields, SGLang's mode and
    batch, and `engine` ("" for neither)."""
    v, s = names.str.extract(_VLLM), names.str.extract(_SGLANG)
    out = pd.DataFrame(index=names.index)
    ints = ["tokens", "n", "m", *PREFILL_SUMS, *DECODE_SUMS]
    for c in ints:
        out[c] = pd.to_numeric(v[c]).astype("Int64")
    out["mode"] = s["mode"].astype("string")
    out["bs"] = pd.to_numeric(s["bs"]).astype("Int64")
    out["toks"] = pd.to_numeric(s["toks"]).astype("Int64")
    out["engine"] = np.where(v["tokens"].notna(), "vllm", np.where(s["mode"].notna(), "sglang", ""))
    return out


def _clusters(a: pd.DataFrame) -> np.ndarray:
    """A number per overlapping run of ranges on one (pid, tid) (rows sorted by thread, start)."""
    thread = pd.factorize(pd.MultiIndex.from_frame(a[["pid", "tid"]].fillna(-1)))[0]
    ts, end = a["ts_us"].to_numpy(), a["end_us"].to_numpy()
    new_thread = np.r_[True, thread[1:] != thread[:-1]]
    reach = pd.Series(end).groupby(thread).cummax().to_numpy()
    new = new_thread | (ts >= np.r_[-np.inf, reach[:-1]])
    return np.cumsum(new) - 1


def _merge(a: pd.DataFrame) -> pd.DataFrame:
    """One step per cluster: the detailed sums where any range has them, SGLang's mode and bs."""
    g = a.groupby("cluster", sort=False)
    first = g.first()  # first non-null per column
    t = pd.DataFrame({
        "name": g["name"].agg(lambda s: " | ".join(map(str, s))),
        "engine": np.where(first["tokens"].notna(), "vllm", "sglang"),
        "mode": first["mode"],
        "chunks": first["n"], "decodes": first["m"],
        **{c: first[c] for c in (*PREFILL_SUMS, *DECODE_SUMS)},
        "pid": first["pid"], "ts_us": g["ts_us"].min(), "end_us": g["end_us"].max(),
    })
    detailed = first["tokens"].notna()
    t["tokens"] = first["tokens"].where(detailed, first["toks"])
    decode_mode = first["mode"].isin(["DECODE", "TARGET_VERIFY"])
    t["tokens"] = t["tokens"].fillna(first["bs"].where(decode_mode))
    t["requests"] = (first["n"] + first["m"]).where(detailed, first["bs"])
    t["phase"] = _phase(first)
    t = t.sort_values("ts_us", kind="stable").reset_index(drop=True)
    t.insert(0, "step", np.arange(len(t)))
    return t[list(STEP_COLUMNS)].astype(STEP_COLUMNS)


def _phase(first: pd.DataFrame) -> np.ndarray:
    """From the chunk and decode counts, else SGLang's mode (SGLANG_PHASES)."""
    n, m = first["n"].fillna(-1).to_numpy(), first["m"].fillna(-1).to_numpy()
    by_counts = np.select([(n > 0) & (m > 0), n > 0, m > 0], ["mixed", "prefill", "decode"],
                          default="")
    by_mode = first["mode"].map(SGLANG_PHASES).fillna("unknown").to_numpy(dtype=object)
    return np.where(by_counts != "", by_counts, by_mode)


def _empty() -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype=t) for c, t in STEP_COLUMNS.items()})


# ----------------------------------------------------------------------- kernels and phases
def kernel_steps(trace: Trace, steps: pd.DataFrame) -> np.ndarray:
    """Per device row of `trace`, the step (index into `steps`) whose range holds the launch
    of the kernel (its runtime event, by correlation); -1 for none."""
    n = len(trace.device)
    out = np.full(n, -1, dtype=np.int64)
    if steps.empty or not n:
        return out
    rt = trace.runtime.dropna(subset=["correlation"])
    launch = pd.Series(rt["ts_us"].to_numpy(), index=rt["correlation"].astype("int64").to_numpy())
    launch = launch[~launch.index.duplicated()]
    corr = trace.device["correlation"].astype("Int64").to_numpy(np.int64, na_value=-1)
    at = launch.reindex(corr).to_numpy(np.float64)
    start, end = steps["ts_us"].to_numpy(), steps["end_us"].to_numpy()
    order = np.argsort(start, kind="stable")
    i = np.searchsorted(start[order], at, side="right") - 1
    j = order[np.maximum(i, 0)]
    inside = (i >= 0) & ~np.isnan(at) & (at <= end[j])
    out[inside] = steps["step"].to_numpy()[j[inside]]
    return out


def step_texts(steps: pd.DataFrame) -> np.ndarray:
    """Per step, the text carried by its kernels (`serving_step`): 'step N (phase): sums'."""
    out = []
    for _, row in steps.iterrows():  # one per step, not per kernel
        sums = StepSums.from_row(row)
        out.append(f"step {int(row['step'])} ({row['phase']})"
                   + (f": {sums.text()}" if sums is not None else ""))
    return np.asarray(out, dtype=object)


def apply(attributed: pd.DataFrame, passes_table: pd.DataFrame, steps: pd.DataFrame,
          of_row: np.ndarray) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The step's phase on each row inside an annotated step (its `phase`, and `serving_step`,
    `step_text`), and on each forward pass whose rows all lie in one step (`phase`,
    `evidence` = step_annotation); rows outside every step keep theirs."""
    inside = of_row >= 0
    phase = steps["phase"].to_numpy(dtype=object)
    text = step_texts(steps)
    old = attributed["phase"].astype(object).to_numpy() if "phase" in attributed else \
        np.full(len(attributed), "unknown", dtype=object)
    new_phase = np.where(inside, phase[np.maximum(of_row, 0)], old)
    labels = np.where(inside, text[np.maximum(of_row, 0)], None)
    out = attributed.assign(phase=pd.array(new_phase, dtype="str"),
                            serving_step=pd.Categorical(labels))
    return out, _pass_phases(attributed, passes_table, steps, of_row)


def _pass_phases(attributed: pd.DataFrame, table: pd.DataFrame, steps: pd.DataFrame,
                 of_row: np.ndarray) -> pd.DataFrame:
    """The passes table with each pass held by one step given that step's phase."""
    if table.empty or "step" not in attributed:
        return table
    pid = attributed["step"].astype("Int64").to_numpy(np.float64, na_value=np.nan)
    seen = ~np.isnan(pid)
    per = pd.DataFrame({"pass": pid[seen].astype(np.int64), "s": of_row[seen]})
    g = per.groupby("pass")["s"].agg(["min", "max"])
    one = g[(g["min"] == g["max"]) & (g["min"] >= 0)]["min"]
    t = table.copy()
    hit = t["pass"].isin(one.index).to_numpy()
    if hit.any():
        step_of = t.loc[hit, "pass"].map(one).to_numpy()
        t.loc[hit, "phase"] = steps["phase"].to_numpy(dtype=object)[step_of]
        t.loc[hit, "evidence"] = "step_annotation"
    return t


# ------------------------------------------------------------------------------ attention
@dataclass(frozen=True)
class StepAttention:
    """One layer's attention in a step: query-key pairs counted, query tokens, keys read per
    KV head, and what the count rests on."""

    pairs: float
    queries: int
    keys: float
    exact: bool
    note: str


def attention(s: StepSums, causal: str = "causal", window: int | None = None) -> StepAttention:
    """Pairs, queries and keys read of one layer of a step (module docstring); `causal`
    "causal" counts the unmasked pairs of the prefill chunks, "full" every pair."""
    q = s.p_sq + s.d_sq
    chunk_pairs = s.p_sqsk - (s.p_sqsq - s.p_sq) / 2 if causal == "causal" else float(s.p_sqsk)
    if window is None:
        note = (f"step sums: {s.chunks} chunk(s) Σq·k - (Σq² - Σq)/2 = {chunk_pairs:.0f} "
                f"{'causal ' if causal == 'causal' else ''}pairs, {s.decodes} decode(s) "
                f"Σk = {s.d_sk}")
        return StepAttention(chunk_pairs + s.d_sk, q, float(s.p_sk + s.d_sk), True, note)
    w_chunks = min(chunk_pairs, window * s.p_sq)
    w_decodes = min(s.d_sk, window * s.decodes)
    # exact when the sums prove every chunk and every context no longer than the window
    # (Σk <= W); otherwise min(.., W·Σq) is an upper bound, exact when all see >= W keys
    exact = (s.chunks == 0 or s.p_sk <= window) and (s.decodes == 0 or s.d_sk <= window)
    keys = min(float(s.p_sk), s.p_sq + s.chunks * (window - 1.0)) + w_decodes
    mean = (s.p_sk + s.d_sk) / max(s.chunks + s.decodes, 1)
    note = (f"sliding window {window}: min(pairs, {window}·Σq) = {w_chunks + w_decodes:.0f} "
            + ("pairs (exact)" if exact else
               f"pairs, an upper bound (only sums are recorded): exact when every request "
               f"holds >= {window} keys (mean {mean:.0f})"))
    return StepAttention(w_chunks + w_decodes, q, keys, exact, note)


def attention_table(texts: pd.Series, windows: np.ndarray, causal: str = "causal") -> pd.DataFrame:
    """`attention` for many (step text, layer window) rows at once (window NaN: none): pairs,
    queries, keys, exact, note per row; each distinct (text, window) worked out once."""
    key = pd.DataFrame({"t": texts.astype(object).to_numpy(),
                        "w": np.asarray(windows, dtype=np.float64)})
    codes, uniq = pd.factorize(pd.MultiIndex.from_frame(key.fillna({"w": -1.0})))
    rows = []
    for text, w in uniq:
        sums = parse_text(text) if isinstance(text, str) else None
        a = attention(sums, causal, None if w < 0 else int(w)) if sums is not None else None
        rows.append((a.pairs, a.queries, a.keys, a.exact, a.note, sums.chunks + sums.decodes,
                     sums.chunks) if a is not None and sums is not None else
                    (np.nan, np.nan, np.nan, False, None, np.nan, np.nan))
    table = pd.DataFrame(rows, columns=["pairs", "queries", "keys", "exact", "note",
                                        "requests", "chunks"])
    return table.iloc[codes].reset_index(drop=True)
