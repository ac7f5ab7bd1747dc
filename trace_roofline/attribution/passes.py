"""Forward passes: find each forward pass of an attributed trace, number it, give it a phase.

Design notes: docs/design.md ("trace_roofline/attribution/passes.py").
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from trace_roofline.attribution.kind import DECODER, Verdict
from trace_roofline.frames import distinct_codes
from trace_roofline.model import layouts
from trace_roofline.model.operators import BEFORE_WINDOW, STAGES, Name
from trace_roofline.trace.decode import decode_args

PASS_COLUMNS = {
    "pass": "int64",  # 0, 1, ... in order of first device start
    "profiler_step": "Int64",  # N of the ProfilerStep#N range holding the pass, if any
    "phase": "str",  # prefill | decode | mixed | unknown
    "evidence": "str",  # the TOKEN_RULES rule that decided the phase, or "none"
    "T_min": "Int64",  # smallest query length per sequence the rule saw
    "T_max": "Int64",
    "B": "Int64",  # sequences (batch), when a rule saw it
    "S": "Int64",  # largest key length seen by attention, when known
    "layers": "int64",  # distinct decoder layers
    "kernels": "int64",
    "time_us": "float64",
    "ts_us": "float64",  # first unit's start
    "opened_by": "str",  # profiler_step | trace_start | embedding | layer_restart
}
PHASES = ("prefill", "decode", "mixed", "forward", "backward", "recompute", Name.OPTIMIZER,
          Name.BEFORE_WINDOW, "unknown")
# a training step's parts with a phase of their own (`recompute`: a checkpointed layer's forward
# run again inside backward, training.training_parts)
_TRAINING_PARTS = ("backward", Name.OPTIMIZER, "recompute")

_MODEL_KEY = {Name.EMBEDDING: -1.0, Name.EMBEDDING_NORM: -0.5, Name.FINAL_NORM: 1e12,
              Name.LM_HEAD: 1e12 + 1}
ATTENTION_LAYOUTS = {name: layout for name, (layout, _) in layouts.ATTENTION_LAYOUTS.items()}
_EAGER_ATTENTION_OPS = {*(g.removeprefix("aten::") for g in layouts.EAGER_ATTENTION_GEMMS),
                        "softmax", "_softmax", "_safe_softmax"}
_KV_OPS = {"index_copy_", "index_copy", "index_put_", "index_put", "_index_put_impl_", "cat"}
_VARLEN_OPS = re.compile(r"varlen|^aten::_flash_attention_forward$")
# argument indices of (cu_seqlens_q, max_seqlen_q): engines' flash-attention forwards
# (layouts.VARLEN_LAYOUTS), else aten's and flash_attn's (q, k, v, cu_seqlens_q, cu_seqlens_k,
# max_seqlen_q, ...)
_VARLEN_ARGS = {name: (v.cu_seqlens_q, v.max_seqlen_q) for name, v in layouts.VARLEN_LAYOUTS.items()}
_VARLEN_DEFAULT_ARGS = (3, 5)
_Q_PROJ = {Name.Q_PROJ, Name.QKV_PROJ}


@dataclass(frozen=True)
class Tokens:
    """What one op instance says about the pass: query lengths T (min, max), batch, keys."""

    t_min: int
    t_max: int
    batch: int | None = None
    keys: int | None = None


@dataclass(frozen=True)
class TokenRule:
    """A rule reading the query length from one kind of op (`applies` on operator and op name,
    `read` on the decoded Input Dims and Concrete Inputs; None when the shapes do not fit)."""

    name: str
    applies: Callable[[str, str], bool]
    read: Callable[[str, list, list], Tokens | None]


@dataclass(frozen=True)
class Passes:
    """`pass_id` and `phase` per attributed row (NA / "unknown" outside every pass) and the
    per-pass table (PASS_COLUMNS)."""

    pass_id: pd.arrays.IntegerArray
    phase: pd.api.extensions.ExtensionArray  # str
    table: pd.DataFrame
    kind: Verdict = DECODER  # a decoder's passes, or an encoder's (all `forward`)


def _base(op_name: str) -> str:
    return op_name.rsplit("::", 1)[-1]


def _is4d(d) -> bool:
    return isinstance(d, list) and len(d) == 4 and all(isinstance(v, int) for v in d)


def _read_attention(op_name: str, dims: list, _conc: list) -> Tokens | None:
    layout = ATTENTION_LAYOUTS.get(op_name)
    if layout is None or len(dims) < 2 or not (_is4d(dims[0]) and _is4d(dims[1])):
        return None
    (b, x1, x2, _), k = dims[0], dims[1]
    t, s = (x2, k[2]) if layout == "BHTD" else (x1, k[1])
    return Tokens(t, t, b, s)


def _read_varlen(op_name: str, dims: list, conc: list) -> Tokens | None:
    """q [total, n_q, d] with cu_seqlens_q [B + 1] and max_seqlen_q (at `_VARLEN_ARGS`), or a
    dense q [B, T, n_q, d]."""
    cu_at, max_at = _VARLEN_ARGS.get(op_name, _VARLEN_DEFAULT_ARGS)
    q = dims[0] if dims else None
    if _is4d(q):
        assert q is not None
        return Tokens(q[1], q[1], q[0])
    if len(dims) <= cu_at or not (isinstance(q, list) and len(q) == 3):
        return None
    cu = dims[cu_at]
    if not (isinstance(cu, list) and len(cu) == 1 and cu[0] >= 2):
        return None
    total, seqs = dims[0][0], cu[0] - 1
    try:
        max_q = int(conc[max_at]) if len(conc) > max_at else None
    except (TypeError, ValueError):
        max_q = None
    if total == seqs:
        return Tokens(1, 1, seqs)
    if max_q is None or max_q < 2:
        return None
    # every sequence of a pure prefill has >= 2 tokens: fewer in total proves a 1-token one
    low = 1 if total < max_q + 2 * (seqs - 1) else 2
    return Tokens(low, max_q, seqs)


def _read_eager(_op: str, dims: list, _conc: list) -> Tokens | None:
    a = dims[0] if dims else None
    if not (isinstance(a, list) and len(a) >= 3 and all(isinstance(v, int) for v in a)):
        return None
    return Tokens(a[-2], a[-2], a[0] if len(a) == 4 else None)


def _read_kv(op_name: str, dims: list, _conc: list) -> Tokens | None:
    """index_copy_(cache, dim, index, source) / index_put_(cache, indices, values): the source
    (last 4-D argument); cat([past, new], dim): the last tensor of the list."""
    if _base(op_name) == "cat":
        items = dims[0] if dims and isinstance(dims[0], list) else []
        four = [d for d in items if _is4d(d)]
        if not four:
            return None
        new = four[-1]
        past = sum(d[2] for d in four[:-1])
        return Tokens(new[2], new[2], new[0], past + new[2])
    four = [d for d in dims if _is4d(d)]
    if len(four) < 2:
        return None
    return Tokens(four[-1][2], four[-1][2], four[-1][0], None)


TOKEN_RULES: tuple[TokenRule, ...] = (
    TokenRule(Name.ATTENTION, lambda op, name: name in ATTENTION_LAYOUTS, _read_attention),
    TokenRule("varlen", lambda op, name: name in _VARLEN_ARGS or bool(_VARLEN_OPS.search(name)),
              _read_varlen),
    TokenRule("eager_attention",
              lambda op, name: op == Name.ATTENTION and _base(name) in _EAGER_ATTENTION_OPS,
              _read_eager),
    TokenRule(Name.KV_CACHE, lambda op, name: op == Name.KV_CACHE and _base(name) in _KV_OPS,
              _read_kv),
)
_GEMM_M = "gemm_m"  # rule 5, per pass (needs B from another row of the pass)
RULE_ORDER = (*(r.name for r in TOKEN_RULES), _GEMM_M)


def forward_passes(attributed: pd.DataFrame) -> Passes:
    """Number the forward passes of an attributed table and give each its phase.

    Needs the columns operator, layer, step, ts_us, dur_us, op_name, input_dims (and optionally
    concrete_inputs) of `attribute.ATTRIBUTED_COLUMNS`. Vectorised over rows; shapes are read
    once per distinct (operator, op_name, input_dims, concrete_inputs).
    """
    n = len(attributed)
    order = np.argsort(attributed["ts_us"].to_numpy(np.float64), kind="stable")
    op_codes, op_cats = _codes(attributed["operator"])
    layer = attributed["layer"].astype("Int64").to_numpy(np.float64, na_value=np.nan)[order]
    step = attributed["step"].astype("Int64").to_numpy(np.float64, na_value=np.nan)[order]
    pid_sorted, opened = _pass_ids(_order_key(op_codes[order], op_cats, layer), step)
    pass_id = np.full(n, -1, dtype=np.int64)
    pass_id[order] = pid_sorted
    early = np.append(op_cats == BEFORE_WINDOW.name, False)[op_codes]
    pass_id[early] = -1  # the step before the window: in no pass
    ev = _evidence(attributed, pass_id, (op_codes, op_cats))
    table = _table(attributed, pass_id, ev, opened)
    part = (attributed["training"].astype("string").fillna("").to_numpy(dtype=object)
            if "training" in attributed else np.full(n, "", dtype=object))
    training = np.isin(part, _TRAINING_PARTS)
    if training.any():  # a training step's pass: its forward rows are `forward`
        table.loc[table["pass"].isin(np.unique(pass_id[training & (pass_id >= 0)])),
                  "phase"] = "forward"
    phases = np.asarray([*table["phase"].tolist(), "unknown"], dtype=object)
    row = phases[np.where(pass_id >= 0, pass_id, len(table))]
    row = np.where(training, part, np.where(early, BEFORE_WINDOW.name, row))
    return Passes(pd.arrays.IntegerArray(np.maximum(pass_id, 0), pass_id < 0),
                  pd.array(row, dtype="str"), table)


def annotate(attributed: pd.DataFrame) -> tuple[pd.DataFrame, Passes]:
    """`attributed` with the forward pass as `step` (NA outside every pass), the ProfilerStep
    number it had as `profiler_step`, and the pass's `phase`; and the passes found."""
    p = forward_passes(attributed)
    out = attributed.assign(profiler_step=attributed["step"].astype("Int64"),
                            step=p.pass_id, phase=p.phase)
    return out, p


_INFERENCE_PHASES = ("prefill", "decode", "mixed")


def as_forward(attributed: pd.DataFrame, found: Passes, verdict: Verdict
               ) -> tuple[pd.DataFrame, Passes]:
    """An encoder's table and passes: prefill, decode and mixed phases read `forward`."""
    def forward(phase: pd.Series) -> pd.Series:
        return phase.mask(phase.isin(_INFERENCE_PHASES), "forward")

    out = attributed.assign(phase=forward(attributed["phase"].astype("str")))
    table = found.table.assign(phase=forward(found.table["phase"]))
    return out, Passes(found.pass_id, out["phase"].array, table, verdict)


def _order_key(op: np.ndarray, op_cats: np.ndarray, layer: np.ndarray) -> np.ndarray:
    """The model-order key per row (NaN: not structural) from its operator (codes `op` of
    `op_cats`, -1 missing) and layer: embedding < layer·10 + stage < final_norm < lm_head."""
    def per_code(table: Mapping[str, float]) -> np.ndarray:
        return np.array([table.get(o, np.nan) for o in op_cats] + [np.nan], dtype=np.float64)[op]

    stage = per_code(STAGES)
    key = np.where(~np.isnan(layer) & ~np.isnan(stage), layer * 10.0 + stage, np.nan)
    return np.where(np.isnan(key), per_code(_MODEL_KEY), key)


def _pass_ids(key: np.ndarray, step: np.ndarray) -> tuple[np.ndarray, dict[int, str]]:
    """Pass number per time-sorted row (-1: none) and what opened each pass, from the rows'
    model-order keys (`_order_key`) and ProfilerStep numbers."""
    n = len(key)
    structural = ~np.isnan(key)
    grp = np.where(np.isnan(step), -1.0, step)
    new_grp = np.r_[True, grp[1:] != grp[:-1]] if n else np.zeros(0, bool)
    run = np.cumsum(new_grp) - 1  # a run of rows in one ProfilerStep range (or outside all)
    s_rows = np.flatnonzero(structural)
    s_key, s_run = key[s_rows], run[s_rows]
    first = np.r_[True, s_run[1:] != s_run[:-1]] if len(s_rows) else np.zeros(0, bool)
    prev = np.r_[np.nan, s_key[:-1]]
    emb = s_key == _MODEL_KEY[Name.EMBEDDING]
    by_emb = ~first & emb & (prev != _MODEL_KEY[Name.EMBEDDING])
    by_layer = ~first & ~emb & (s_key < prev)
    start = first | by_emb | by_layer
    start_rows = s_rows[start]
    reason = list(np.where(first[start], np.where(grp[start_rows] >= 0, "profiler_step",
                                                  "trace_start"),
                           np.where(by_emb[start], Name.EMBEDDING, "layer_restart")))
    # every row: the pass of the last start at or before it, within its run; rows before the
    # run's first start take that start's pass
    num = np.full(n, -1, dtype=np.int64)
    num[start_rows] = np.arange(len(start_rows))
    last = np.maximum.accumulate(np.where(num >= 0, np.arange(n), -1)) if n else num
    at = np.maximum(last, 0)
    pid = np.where((last >= 0) & (run[at] == run), num[at], -1)
    run_first = pd.Series(num).where(num >= 0).groupby(run).transform("min").to_numpy()
    has = ~np.isnan(run_first)
    pid = np.where(has & (pid < 0), np.nan_to_num(run_first, nan=-1).astype(np.int64), pid)
    # a ProfilerStep range without structural rows is a pass of its own
    bare = ~has & (grp >= 0)
    if bare.any():
        extra = pd.factorize(run[bare])[0]
        pid[bare] = extra + len(reason)
        reason += ["profiler_step"] * int(extra.max() + 1)
    # renumber in order of first row
    seen = pid >= 0
    ids, first_at = np.unique(pid[seen], return_index=True)
    rank = np.full(len(reason), -1, dtype=np.int64)
    rank[ids[np.argsort(first_at, kind="stable")]] = np.arange(len(ids))
    out = np.where(seen, rank[np.maximum(pid, 0)] if len(rank) else -1, -1)
    opened = {int(rank[i]): reason[i] for i in ids}
    return out, opened


def _codes(col: pd.Series, rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(codes, categories) of a str column (or of its `rows`), missing = -1: arrow's dictionary
    encoding, no Python object per row."""
    arr = pa.array(col.array if hasattr(col, "array") else col, type=pa.large_string())
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if rows is not None:
        arr = pc.take(arr, pa.array(rows))
    enc = pc.dictionary_encode(arr)
    codes = enc.indices.to_numpy(zero_copy_only=False)
    codes = np.where(enc.indices.is_null().to_numpy(zero_copy_only=False), -1, codes)
    return codes.astype(np.int64), np.asarray(enc.dictionary.to_pylist(), dtype=object)


def _evidence(att: pd.DataFrame, pass_id: np.ndarray,
              operator: tuple[np.ndarray, np.ndarray]) -> pd.DataFrame:
    """One row per (pass, evidence row) with rule, T_min, T_max, B, S; `operator`: `_codes`
    of att["operator"]."""
    op, op_cats = operator
    name, name_cats = _codes(att["op_name"])
    keep_op = np.append(np.isin(op_cats, [Name.ATTENTION, Name.KV_CACHE, *_Q_PROJ]), False)
    keep_name = np.append(np.isin(name_cats, list(ATTENTION_LAYOUTS)), False)
    cand = (keep_op[op] | keep_name[name]) & (name >= 0) & (pass_id >= 0)
    cand &= att["input_dims"].notna().to_numpy()
    rows = np.flatnonzero(cand)
    cols = ["operator", "op_name", "input_dims", "concrete_inputs"]
    parts = [_codes(att[c], rows) if c in att else (np.full(len(rows), -1), np.zeros(0, object))
             for c in cols]
    codes, first = distinct_codes([c for c, _ in parts])
    found = [_read_combo(*(cats[c[i]] if c[i] >= 0 else "" for c, cats in parts))
             for i in first]
    table = pd.DataFrame(found, columns=["rule", "T_min", "T_max", "B", "S", "M", "B4"])
    ev = table.iloc[codes].reset_index(drop=True)
    ev["pass"] = pass_id[rows]
    # rule 5: q_proj's M over the batch of a 4-D cache / attention tensor in the same pass
    batch = ev.dropna(subset=["B4"]).groupby("pass")["B4"].first()
    m = ev[ev["M"].notna()].copy()
    m["B"] = m["pass"].map(batch)
    m = m[m["B"].notna() & (m["M"] % m["B"].where(m["B"] > 0, np.nan) == 0)]
    m["T_min"] = m["T_max"] = m["M"] // m["B"]
    m["rule"] = _GEMM_M
    return pd.concat([ev[ev["rule"].notna()], m], ignore_index=True)


def _read_combo(operator: str, op_name: str, dims_raw: str, conc_raw: str):
    """(rule, T_min, T_max, B, S, M, B4) of one distinct op: the first rule that reads it; the
    M of a q_proj / qkv_proj GEMM and the leading dim B4 of the first 4-D argument of a cache or
    attention op (rule 5 combines them per pass later)."""
    dims, conc = decode_args(dims_raw), decode_args(conc_raw)
    if dims is None:
        return (None,) * 7
    if operator in _Q_PROJ:
        return None, None, None, None, None, layouts.gemm_tokens(op_name, dims), None
    four = next((d for d in _flat(dims) if _is4d(d)), None)
    b4 = four[0] if four is not None and operator in (Name.KV_CACHE, Name.ATTENTION) else None
    for rule in TOKEN_RULES:
        if rule.applies(operator, op_name):
            tok = rule.read(op_name, dims, conc or [])
            if tok is not None:
                return rule.name, tok.t_min, tok.t_max, tok.batch, tok.keys, None, b4
    return None, None, None, None, None, None, b4


def _flat(dims: list) -> list:
    """Arguments with a tensor list's tensors in place of the list."""
    out: list = []
    for a in dims:
        if isinstance(a, list):
            out.extend(a if a and isinstance(a[0], list) else [a])
    return out


def _table(att: pd.DataFrame, pass_id: np.ndarray, ev: pd.DataFrame,
           opened: dict[int, str]) -> pd.DataFrame:
    """One row per pass (PASS_COLUMNS)."""
    seen = pass_id >= 0
    work = pd.DataFrame({
        "pass": pass_id[seen],
        "profiler_step": att["step"].astype("Int64").to_numpy()[seen],
        "layer": att["layer"].astype("Int64").to_numpy()[seen],
        "ts_us": att["ts_us"].to_numpy(np.float64)[seen],
        "dur_us": att["dur_us"].to_numpy(np.float64)[seen],
    })
    g = work.groupby("pass", sort=True)
    t = g.agg(profiler_step=("profiler_step", "first"), layers=("layer", "nunique"),
              kernels=("dur_us", "size"), time_us=("dur_us", "sum"), ts_us=("ts_us", "min"))
    t = t.reset_index()
    if len(ev):
        rules, names = pd.factorize(ev["rule"].array)
        rank = [RULE_ORDER.index(r) if r in RULE_ORDER else np.nan for r in names]
        ev = ev.assign(_rank=np.array([*rank, np.nan], dtype=np.float64)[rules])
        best = ev.groupby("pass")["_rank"].transform("min")
        ev = ev[ev["_rank"] == best]
        per = ev.groupby("pass").agg(evidence=("rule", "first"), T_min=("T_min", "min"),
                                     T_max=("T_max", "max"), B=("B", "max"), S=("S", "max"))
        t = t.merge(per.reset_index(), on="pass", how="left")
    else:
        t = t.assign(evidence=None, T_min=np.nan, T_max=np.nan, B=np.nan, S=np.nan)
    lo, hi = t["T_min"].to_numpy(np.float64), t["T_max"].to_numpy(np.float64)
    t["phase"] = np.select([hi == 1, lo > 1, (lo == 1) & (hi > 1)],
                           ["decode", "prefill", "mixed"], default="unknown")
    t["evidence"] = t["evidence"].fillna("none")
    t["opened_by"] = t["pass"].map(opened)
    for c in ("T_min", "T_max", "B", "S"):
        t[c] = pd.array(t[c].to_numpy(np.float64), dtype="Float64").astype("Int64")
    return t[list(PASS_COLUMNS)].astype(PASS_COLUMNS)
