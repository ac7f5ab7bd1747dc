"""What a trace's own shapes say about the model, before anything is placed or extrapolated.

Design notes: docs/architecture.md ("trace_roofline/costs/crosscheck.py").
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from trace_roofline import frames
from trace_roofline.model import models, operators
from trace_roofline.model.models import PRESETS, ModelSpec

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
    checked = (costed["cost_kind"].eq("attention") & costed["n_q"].notna()).to_numpy(bool)
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
    distinct = frames.distinct_rows(costed, _CHECKED)[0]
    out = []
    for name, spec in PRESETS.items():
        degrees = _tp_degrees(distinct, spec)
        if len(degrees) == 1 and _checks(distinct, spec).isna().all():
            t = degrees.pop()
            out.append(name if t == 1 else f"{name} (TP={t})")
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
    lin = costed.loc[costed["cost_kind"].eq("gemm") & costed["operator"].isin(operators.LINEARS),
                     ["operator", "K", "N", "time_us"]]
    att = costed.loc[costed["cost_kind"].eq("attention") & costed["n_q"].notna(),
                     ["operator", "n_q", "n_kv", "head_dim", "time_us"]]
    if lin.empty and att.empty:
        return None
    kn = _modal(lin.astype({"K": "int64", "N": "int64"}), ["K", "N"])
    heads = (_modal(att.assign(operator="attention"), ["n_q", "n_kv", "head_dim"])
             .iloc[0].astype(int).tolist() if len(att) else [None] * 3)

    def first(*picks: tuple[str, str, float]) -> int | None:
        """The first (operator, K or N, scale) the trace shows, as K·scale or N·scale."""
        for op, col, scale in picks:
            if op in kn.index:
                return int(kn.loc[op, col] * scale)
        return None

    hidden = first(("q_proj", "K", 1), ("qkv_proj", "K", 1), ("gate_proj", "K", 1),
                   ("up_proj", "K", 1), ("gate_up_proj", "K", 1), ("o_proj", "N", 1),
                   ("down_proj", "N", 1), ("lm_head", "K", 1))
    q = first(("q_proj", "N", 1), ("o_proj", "K", 1))
    if q is None and heads[0] is not None:
        q = heads[0] * heads[2]
    kv = first(("k_proj", "N", 1), ("v_proj", "N", 1))
    if kv is None and q is not None and "qkv_proj" in kn.index:
        kv = (int(kn.loc["qkv_proj", "N"]) - q) // 2
    if kv is None and heads[1] is not None and heads[1] != heads[0]:  # (K, V expanded to every
        kv = heads[1] * heads[2]                                        # query head: unknown)
    d = heads[2]
    fits = fitting_presets(costed)
    return {
        "hidden_size": hidden, "q_size": q, "kv_size": kv,
        "intermediate_size": first(("gate_proj", "N", 1), ("up_proj", "N", 1),
                                   ("down_proj", "K", 1), ("gate_up_proj", "N", 0.5)),
        "vocab_size": first(("lm_head", "N", 1)),
        # heads from the projection widths (attention may read K/V expanded to every head)
        "num_heads": q // d if q and d else heads[0],
        "num_kv_heads": kv // d if kv and d else heads[1], "head_dim": d,
        "presets": fits, "match": fits[0] if fits else "custom", "layout": _layout(costed),
    }


# (operators whose presence says the form, the form) of a layer's attention, then of its MLP
_FORMS = ((("kv_b_proj", "kv_a_proj_with_mqa"), "MLA attention"),
          (("qkv_proj",), "fused qkv"), (("k_proj",), "q/k/v"),
          (("experts_gate_up", "experts_gate", "experts_down"), "routed experts"),
          (("gate_up_proj",), "fused gated MLP"), (("gate_proj",), "gated MLP"),
          (("up_proj",), "ungated MLP"))


def _layout(costed: pd.DataFrame) -> str:
    """The forms of a layer the named operators show: 'q/k/v, gated MLP', 'MLA attention,
    routed experts, gated MLP', 'fused qkv, ungated MLP'."""
    names = set(costed["operator"].astype(str))
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
    attn = costed.loc[costed["cost_kind"].eq("attention"), ["step"]].groupby(
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
