"""What a trace's own shapes say about the model, before anything is placed or extrapolated.

Design notes: docs/design.md ("trace_roofline/costs/crosscheck.py").
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from trace_roofline import frames
from trace_roofline.model import formulas, models, operators
from trace_roofline.model.models import PRESETS, ModelSpec
from trace_roofline.model.operators import Name

TP_DEGREES = tuple(t for t in models.TP_DEGREES if t > 1)


def _degree(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Per row: 1 where got == want, t where got · t == want for t in TP_DEGREES, else 0."""
    t = np.where(got == want, 1, 0)
    for d in TP_DEGREES:
        t = np.where((t == 0) & (got * d == want), d, t)
    return t


def _int(col: pd.Series) -> np.ndarray:
    return col.astype("Int64").to_numpy(np.int64, na_value=-1)


# The columns the checks read: a trace repeats a few dozen distinct combinations of them over
# hundreds of thousands of instances, so the checks run on the distinct rows only.
_CHECKED = ["operator", "cost_kind", "K", "N", "n_q", "n_kv", "head_dim"]


_ROW_PARALLEL = {o.name: o.row_parallel for o in operators.OPERATORS}


def _linear_degrees(costed: pd.DataFrame, model: ModelSpec) -> tuple[np.ndarray, np.ndarray]:
    """(checked, t) per row (of distinct rows: a few dozen) for GEMMs named as one of the
    model's linears."""
    expect = models.expected_linears(model)
    op = costed["operator"].astype(object).tolist()
    named = np.array([o in expect for o in op], dtype=bool)
    checked = costed["cost_kind"].eq("gemm").to_numpy(bool) & named
    k, n = _int(costed["K"]), _int(costed["N"])
    ke, ne = (np.array([expect.get(o, (-1, -1))[i] for o in op], dtype=np.int64) for i in (0, 1))
    row = np.array([_ROW_PARALLEL.get(o, False) for o in op], dtype=bool)
    t = np.where(row, np.where(n == ne, _degree(k, ke), 0), np.where(k == ke, _degree(n, ne), 0))
    return checked, t


def _attention_degrees(costed: pd.DataFrame, model: ModelSpec) -> tuple[np.ndarray, np.ndarray]:
    """(checked, t) per attention instance with recorded heads."""
    checked = (costed["cost_kind"].eq(Name.ATTENTION) & costed["n_q"].notna()).to_numpy(bool)
    nq, nkv, d = (_int(costed[c]) for c in ("n_q", "n_kv", "head_dim"))
    t = np.where(d == model.head_dim, _degree(nq, np.full(len(nq), model.num_heads)), 0)
    kv = np.maximum(model.num_kv_heads // np.maximum(t, 1), 1)
    kv_ok = ((nkv == kv) & ((kv * np.maximum(t, 1) == model.num_kv_heads)
                            | (model.num_kv_heads < t))) | (nkv == nq)  # or expanded (repeat_kv)
    return checked, np.where(kv_ok, t, 0)


def instance_checks(costed: pd.DataFrame, model: ModelSpec | None) -> pd.Series:
    """Per instance, the contradiction with `model` (missing where consistent, up to a TP
    shard, or not checked): 'q_proj: K,N=3584,3584 but llama-3-8b has 4096,4096',
    'attention: n_q,n_kv,d=28,4,128 but llama-3-8b has 32,8,128'."""
    if model is None or costed.empty:
        return pd.Series(None, index=costed.index, dtype="str")
    distinct, codes = frames.distinct_rows(costed, _CHECKED)
    msg = _checks(distinct, model).to_numpy(object)
    return pd.Series(msg[codes], index=costed.index, dtype="str")


def _checks(costed: pd.DataFrame, model: ModelSpec) -> pd.Series:
    """instance_checks on rows of `costed[_CHECKED]`."""
    out = pd.Series(None, index=costed.index, dtype="object")
    lin, t_lin = _linear_degrees(costed, model)
    att, t_att = _attention_degrees(costed, model)
    expect = models.expected_linears(model)
    bad_lin = lin & (t_lin == 0)
    if bad_lin.any():
        rows = costed[bad_lin]
        want = rows["operator"].map({o: f"{k},{n}" for o, (k, n) in expect.items()})
        out[bad_lin] = (rows["operator"] + ": K,N=" + rows["K"].astype("str") + ","
                        + rows["N"].astype("str") + f" but {model.name} has " + want).to_numpy()
    bad_att = att & (t_att == 0)
    if bad_att.any():
        rows = costed[bad_att]
        want = f"{model.num_heads},{model.num_kv_heads},{model.head_dim}"
        out[bad_att] = ("attention: n_q,n_kv,d=" + rows["n_q"].astype("str") + ","
                        + rows["n_kv"].astype("str") + "," + rows["head_dim"].astype("str")
                        + f" but {model.name} has {want}").to_numpy()
    return out


def tp_degrees(costed: pd.DataFrame, model: ModelSpec) -> set[int]:
    """The TP degrees the consistent checked instances show ({1}: unsharded; empty: none
    checked). More than one degree means the shapes agree with no single layout."""
    return _tp_degrees(frames.distinct_rows(costed, _CHECKED)[0], model)


def _tp_degrees(costed: pd.DataFrame, model: ModelSpec) -> set[int]:
    """tp_degrees on rows of `costed[_CHECKED]`."""
    lin, t_lin = _linear_degrees(costed, model)
    att, t_att = _attention_degrees(costed, model)
    t = np.concatenate([t_lin[lin], t_att[att]])
    return {int(v) for v in np.unique(t[t > 0])}


def fitting_presets(costed: pd.DataFrame) -> list[str]:
    """Each preset no instance contradicts and one at least is checked against, with its TP
    degree when sharded: ['qwen2.5-7b'], ['llama-3-8b (TP=4)']."""
    return _fitting(frames.distinct_rows(costed, _CHECKED)[0])


def _fitting(distinct: pd.DataFrame) -> list[str]:
    """fitting_presets on rows of `costed[_CHECKED]`: a preset fits where every checked row
    shows one TP degree (0: a contradiction, `_checks`)."""
    out = []
    for name, spec in PRESETS.items():
        lin, t_lin = _linear_degrees(distinct, spec)
        att, t_att = _attention_degrees(distinct, spec)
        t = np.concatenate([t_lin[lin], t_att[att]])
        degrees = np.unique(t)
        if len(degrees) == 1 and degrees[0] > 0:
            out.append(name if degrees[0] == 1 else f"{name} (TP={int(degrees[0])})")
    return out


def _modal(rows: pd.DataFrame, cols: list[str]) -> pd.DataFrame:
    """Per operator, the values of `cols` holding most of its time."""
    t = rows.groupby(["operator", *cols], sort=False)["time_us"].sum().reset_index()
    t = t.sort_values("time_us", ascending=False, kind="stable")
    return t.drop_duplicates("operator").set_index("operator")[cols]


def inferred(costed: pd.DataFrame) -> dict[str, object] | None:
    """The decoder's dimensions the trace's named linears and attention show (None when it has
    neither): hidden_size, q_size, kv_size, intermediate_size, vocab_size, num_heads,
    num_kv_heads, head_dim (None where no operator shows it), the presets they fit
    (`fitting_presets`) and `match`: the first of them, else "custom"."""
    # the distinct rows of the checked columns (a few dozen), each with its instances' time
    distinct, codes = frames.distinct_rows(costed, _CHECKED)
    distinct["time_us"] = costed["time_us"].groupby(codes, sort=True).sum().to_numpy()
    lin = distinct.loc[distinct["cost_kind"].eq("gemm")
                       & distinct["operator"].isin(operators.LINEARS),
                       ["operator", "K", "N", "time_us"]]
    att = distinct.loc[distinct["cost_kind"].eq(Name.ATTENTION) & distinct["n_q"].notna(),
                       ["operator", "n_q", "n_kv", "head_dim", "time_us"]]
    if lin.empty and att.empty:
        return None
    kn = _modal(lin.astype({"K": "int64", "N": "int64"}), ["K", "N"])
    heads = (_modal(att.assign(operator=Name.ATTENTION), ["n_q", "n_kv", "head_dim"])
             .iloc[0].astype(int).tolist() if len(att) else [None] * 3)

    def first(*picks: tuple[str, str, float]) -> int | None:
        """The first (operator, K or N, scale) the trace shows, as K·scale or N·scale."""
        for op, col, scale in picks:
            if op in kn.index:
                return int(kn.loc[op, col] * scale)
        return None

    hidden = first((Name.Q_PROJ, "K", 1), (Name.QKV_PROJ, "K", 1), (Name.GATE_PROJ, "K", 1),
                   (Name.UP_PROJ, "K", 1), (Name.GATE_UP_PROJ, "K", 1), (Name.O_PROJ, "N", 1),
                   (Name.DOWN_PROJ, "N", 1), (Name.LM_HEAD, "K", 1))
    q = first((Name.Q_PROJ, "N", 1), (Name.O_PROJ, "K", 1))
    if q is None and heads[0] is not None:
        q = heads[0] * heads[2]
    kv = first((Name.K_PROJ, "N", 1), (Name.V_PROJ, "N", 1))
    if kv is None and q is not None and Name.QKV_PROJ in kn.index:
        kv = (int(kn.loc[Name.QKV_PROJ, "N"]) - q) // 2
    if kv is None and heads[1] is not None and heads[1] != heads[0]:  # (K, V expanded to every
        kv = heads[1] * heads[2]                                        # query head: unknown)
    d = heads[2]
    fits = _fitting(distinct[_CHECKED])
    return {
        "hidden_size": hidden, "q_size": q, "kv_size": kv,
        "intermediate_size": first((Name.GATE_PROJ, "N", 1), (Name.UP_PROJ, "N", 1),
                                   (Name.DOWN_PROJ, "K", 1), (Name.GATE_UP_PROJ, "N", 0.5)),
        "vocab_size": first((Name.LM_HEAD, "N", 1)),
        # heads from the projection widths (attention may read K/V expanded to every head)
        "num_heads": q // d if q and d else heads[0],
        "num_kv_heads": kv // d if kv and d else heads[1], "head_dim": d,
        "presets": fits, "match": fits[0] if fits else "custom", "layout": _layout(distinct),
    }


# (operators whose presence says the form, the form) of a layer's attention, then of its MLP
_FORMS = (((Name.KV_B_PROJ, Name.KV_A_PROJ_WITH_MQA), "MLA attention"),
          ((Name.QKV_PROJ,), "fused qkv"), ((Name.K_PROJ,), "q/k/v"),
          ((Name.EXPERTS_GATE_UP, "experts_gate", Name.EXPERTS_DOWN), "routed experts"),
          ((Name.GATE_UP_PROJ,), "fused gated MLP"), ((Name.GATE_PROJ,), "gated MLP"),
          ((Name.UP_PROJ,), "ungated MLP"))


def _layout(costed: pd.DataFrame) -> str:
    """The forms of a layer the named operators show: 'q/k/v, gated MLP', 'MLA attention,
    routed experts, gated MLP', 'fused qkv, ungated MLP'."""
    names = set(costed["operator"].unique().astype(str))
    forms = [form for ops, form in _FORMS if names & set(ops)]
    mlp = [f for f in forms if f.endswith("MLP")]
    return ", ".join([f for f in forms if not f.endswith("MLP")] + mlp[:1])


ORDER_EVIDENCE = ("shape", "kernel_name", "position")  # names and layers found from the order


def irregular_order(costed: pd.DataFrame) -> str | None:
    """A warning when a step counts more layers (from the order of its operators, no range or
    module saying so) than it has attention instances, else None."""
    counted = costed["evidence"].isin(ORDER_EVIDENCE) & costed["layer"].notna()
    if not counted.any():
        return None
    layers = costed.loc[counted, ["step", "layer"]].groupby("step", dropna=False)["layer"].nunique()
    attn = costed.loc[costed["cost_kind"].eq(Name.ATTENTION), ["step"]].groupby(
        "step", dropna=False).size()
    attn = attn.reindex(layers.index, fill_value=0)
    bad = layers[(attn > 0) & (layers > attn)]
    if bad.empty:
        return None
    step = bad.index[0]
    return (f"the operator order is irregular: step {step} counts {bad.iloc[0]} decoder layers "
            f"from the order of its operators but runs attention {attn[step]} time(s) "
            f"({len(bad)} step(s) so): layer numbers, and names resting on order (position; "
            "q/o, k/v, gate/up sharing a shape), may be wrong")


def describe(dims: dict[str, object]) -> str:
    """'hidden 3584, q 3584 (28 heads x 128), kv 512 (4 heads), intermediate 18944'."""
    parts = [f"hidden {dims['hidden_size']}" if dims["hidden_size"] else None]
    if dims["q_size"]:
        heads = (f" ({dims['num_heads']} heads x {dims['head_dim']})" if dims["num_heads"]
                 else "")
        parts.append(f"q {dims['q_size']}{heads}")
    if dims["kv_size"]:
        parts.append(f"kv {dims['kv_size']}"
                     + (f" ({dims['num_kv_heads']} heads)" if dims["num_kv_heads"] else ""))
    for key, label in (("intermediate_size", "intermediate"), ("vocab_size", "vocab")):
        if dims[key]:
            parts.append(f"{label} {dims[key]}")
    return ", ".join(p for p in parts if p)


# ------------------------------------------------------------------ figures against the layout
_NAMED = frozenset({*operators.LINEARS, operators.ATTENTION.name})
TOLERANCE = 0.01  # a disagreement above this fraction of the layout's figure is said


def generic_named(costed: pd.DataFrame) -> str | None:
    """A warning when a named linear or attention (one layer's, in one pass) is costed by
    generic per-kernel estimates alone (derivation `kernel`: the kernel's buffers), with no
    row of its name's cost signature (a GEMM, an attention costed from its geometry), so its
    FLOPs and bytes are not the operator's cost; its share of device time is given. Else None."""
    named = costed["operator"].isin(_NAMED).to_numpy(bool)
    if not named.any():
        return None
    rows = costed.loc[named, ["step", "layer", "operator", "derivation", "cost_kind", "time_us"]]
    generic = rows["derivation"].eq("kernel")
    signed = ~generic & rows["cost_kind"].isin(["gemm", Name.ATTENTION, "fused"])
    keys = [rows["step"].fillna(-1), rows["layer"].fillna(-1), rows["operator"]]
    unsigned = (generic.groupby(keys).transform("any")
                & ~signed.groupby(keys).transform("any")).to_numpy(bool)
    if not unsigned.any():
        return None
    time = rows[unsigned].groupby("operator", observed=True)["time_us"].sum()
    total = float(costed["time_us"].sum()) or 1.0
    parts = ", ".join(f"{op} {100 * t / total:.1f}%" for op, t in
                      time.sort_values(ascending=False, kind="stable").items())
    return ("named operators costed by a generic kernel estimate alone (derivation `kernel`: "
            "the kernel's buffers, not 2·M·K·N or the attention's geometry), so their FLOPs "
            f"and bytes are not the operators' cost: {parts} of device time")


def against_layout(costed: pd.DataFrame, model: ModelSpec | None, passes: pd.DataFrame | None,
                   causal: str = "causal", decoder: bool = True) -> list[str]:
    """The cross-check of each pass's figures against the model's layout and the pass's tokens
    (passes.PASS_COLUMNS: B sequences of T tokens, S keys), one warning per operator whose
    figure and the layout's differ by more than TOLERANCE, both figures given: a named linear's
    ΣFLOPs against layers x 2·M·K·N (+ M·N bias), M = B·T; attention's (outside sliding
    windows; not those costed from a serving step's annotation) against layers x
    2·B·n_q·pairs·(d + d_v), pairs causal in a decoder under `causal` causal. Passes whose
    B, T (one length) or S are not known are not checked; nothing without a model."""
    if model is None or passes is None or passes.empty or costed.empty:
        return []
    known = (passes["B"].notna() & passes["T_min"].notna()
             & passes["T_min"].eq(passes["T_max"])).to_numpy(bool, na_value=False)
    p = passes.loc[known].set_index("pass")
    if p.empty:
        return []
    rows = costed[costed["step"].isin(p.index) & costed["flops"].notna()]
    return [*_linears_against(rows, model, p), *_attention_against(rows, model, p, causal,
                                                                   decoder)]


def _per_pass(rows: pd.DataFrame) -> pd.DataFrame:
    """ΣFLOPs and layers (distinct; instances where no layer is known) per (step, operator)."""
    g = rows.groupby(["step", "operator"], observed=True).agg(
        flops=("flops", "sum"), layers=("layer", "nunique"), n=("flops", "size")).reset_index()
    g["layers"] = g["layers"].where(g["layers"] > 0, g["n"])
    return g


def _said(g: pd.DataFrame, what: pd.Series) -> list[str]:
    """One line per operator of `g` (step, operator, flops, expected) whose figures disagree:
    its first such pass, and how many more."""
    off = (g["flops"] - g["expected"]).abs() > TOLERANCE * g["expected"]
    bad = g[off.to_numpy(bool)]
    out = []
    for op, first in bad.groupby("operator", observed=True, sort=False):  # (operators: a few)
        r = first.iloc[0]
        more = f" (and {len(first) - 1} more pass(es))" if len(first) > 1 else ""
        out.append(f"cross-check: {op} in pass {int(r['step'])}: {r['flops']:.4g} FLOP costed, "
                   f"{r['expected']:.4g} FLOP from the layout ({what[r.name]}): "
                   f"{100 * (r['flops'] / r['expected'] - 1):+.1f}%{more}")
    return out


def _linears_against(rows: pd.DataFrame, model: ModelSpec, p: pd.DataFrame) -> list[str]:
    lin = {**model.linears(), **model.fused_linears()}
    g = _per_pass(rows[rows["operator"].isin(list(lin))])
    if g.empty:
        return []
    m = (p["B"] * p["T_min"]).astype("int64").reindex(g["step"]).to_numpy(np.int64)
    k, n, bias = (np.array([lin[o][i] for o in g["operator"]], dtype=np.int64)
                  for i in range(3))
    g["expected"] = g["layers"] * (2.0 * m * k * n + np.where(bias == 1, m * n, 0))
    what = pd.Series([f"{int(lay)} layer(s) x 2·{mm}·{kk}·{nn}" + (" + bias" if b else "")
                      for lay, mm, kk, nn, b in zip(g["layers"], m, k, n, bias, strict=True)],
                     index=g.index)  # (per pass and operator: a few dozen)
    return _said(g, what)


def _attention_against(rows: pd.DataFrame, model: ModelSpec, p: pd.DataFrame, causal: str,
                       decoder: bool) -> list[str]:
    at = model.architecture.attention
    layer = rows["layer"].astype("Int64").to_numpy(np.int64, na_value=-1)
    wins = np.array([at.window(i) is not None for i in range(len(at.windows))] + [False])
    windowed = wins[np.where((layer >= 0) & (layer < len(at.windows)), layer, -1)]
    attn = rows[rows["operator"].eq(operators.ATTENTION.name).to_numpy(bool)
                & rows["cost_kind"].isin([Name.ATTENTION, "gemm"]).to_numpy(bool)
                & ~rows["derivation"].eq("step").to_numpy(bool) & ~windowed]
    g = _per_pass(attn)
    s_known = p["S"].notna()
    g = g[g["step"].isin(p.index[s_known.to_numpy(bool)])].reset_index(drop=True)
    if g.empty:
        return []
    b, t, s = (p[c].astype("int64").reindex(g["step"]).to_numpy(np.int64)
               for c in ("B", "T_min", "S"))
    counted: formulas.Causal = "causal" if causal == "causal" and decoder else "full"
    nq, d, dv = model.num_heads, model.head_dim, at.v_head_dim
    g["expected"] = g["layers"] * np.array(
        [formulas.attention_flops(formulas.AttentionShape(
            nq, model.num_kv_heads, int(tt), int(ss), d, dv, int(bb),
            counted if tt > 1 else "full"))
         for bb, tt, ss in zip(b, t, s, strict=True)])  # (per pass: a few)
    what = pd.Series([f"{int(lay)} layer(s) x 2·{bb}·{nq}·pairs(T={tt}, S={ss}"
                      f"{', causal' if counted == 'causal' and tt > 1 else ''})·({d} + {dv})"
                      for lay, bb, tt, ss in zip(g["layers"], b, t, s, strict=True)],
                     index=g.index)
    return _said(g, what)
