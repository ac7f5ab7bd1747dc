"""The last stage of naming: every named row checked against its name's contract.

A row whose name breaks its contract (model/contracts.py: a GEMM named `residual`, a linear of
another (K, N) than the layout's, expert names on a dense model, `loss` with no loss op) is
demoted to `other`, evidence `fallback`, its reason saying which name it had and why not.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from trace_roofline.attribution import gemm_names, gemm_operands, naming, op_families
from trace_roofline.model import contracts, kernels, operators
from trace_roofline.model.models import ModelSpec, expected_linears
from trace_roofline.model.operators import Name

OTHER = operators.OTHER.name
BROKEN = "breaks its name's contract: "  # the reasons of demoted rows contain it
_NORM_OPS = {"layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm", "rms_norm_",
             "rmsnorm", "fused_add_rms_norm", "fused_add_rmsnorm", "add_rmsnorm", "group_norm",
             "native_group_norm"}
_LOSS_OPS = op_families.LOSS_OPS - {"log_softmax", "_log_softmax"}  # beam search log-softmaxes too
_SOFTMAX_OPS = op_families.SOFTMAX_OPS | {"log_softmax", "_log_softmax", "topk_softmax"}
_CONV_OPS = {"convolution", "_convolution", "conv1d", "conv2d", "conv3d", "cudnn_convolution",
             "mkldnn_convolution", "slow_conv2d_forward", "thnn_conv2d"}
_GROUPED_OPS = {"_grouped_mm"}
_FUSED_LOSS = re.compile(r"^triton_\w*(?:nll_loss|cross_entropy)")  # Inductor's, by its aten ops


def work(rows: pd.DataFrame) -> np.ndarray:
    """Per row, the kind of work it does as a code into contracts.WORK, from its op (`op_name`,
    `input_dims`) or, where the op says nothing, its kernel's role (`name`); worked out once per
    distinct (op, kernel, Input Dims)."""
    return naming.per_value(rows[["op_name", "name", "input_dims"]],
                            lambda d: pd.Series(_codes(_work(d)), index=d.index)
                            ).to_numpy(dtype=np.int64)


def _work(d: pd.DataFrame) -> pd.Series:
    base = operators.base_names(d["op_name"]).fillna("")
    role = kernels.roles(d["name"].fillna("")).astype(str)
    dims = op_families.dims_flags(d["input_dims"])
    gemm_op = base.isin(op_families.GEMM_OPS)
    batched = (dims["batched"] & base.isin(op_families.BATCHED_GEMM_OPS | {"matmul"})) | (
        base.isin(op_families.BATCHED_GEMM_OPS) & dims["rank3"])
    rules: list[tuple[pd.Series, str]] = [  # first match wins
        (operators.recognise(operators.ATTENTION, base) | role.isin(kernels.ATTENTION_ROLES),
         Name.ATTENTION),
        (base.isin(_LOSS_OPS) | role.eq(Name.LOSS) | base.str.contains(_FUSED_LOSS), Name.LOSS),
        (operators.collective_of(base).notna() | role.eq("collective"), "collective"),
        # an engine's fused MoE op runs routing and finalize kernels too: those by their role
        (base.isin(_GROUPED_OPS) | role.eq("moe_gemm") | (
            operators.recognise(operators.FUSED_EXPERTS, base) & role.isin(["gemm", "unknown"])),
         "grouped_gemm"),
        (gemm_op & dims["last0"].eq(1), "generic"),  # an outer product (RoPE's table): no weight
        (batched, "batched_gemm"),
        (gemm_op, "weight_gemm"),
        (base.isin(_CONV_OPS) | role.eq("conv"), "conv"),
        (base.isin(_NORM_OPS) | role.isin(["norm", "fused_add_norm"]), "norm"),
        (base.isin(_SOFTMAX_OPS) | role.eq("softmax"), "softmax"),
        (role.isin(kernels.GEMM_ROLES), "gemm_kernel"),
    ]
    out = pd.Series("generic", index=d.index, dtype=object)
    for cond, name in reversed(rules):
        out[cond.to_numpy(dtype=bool)] = name
    return out


@dataclass(frozen=True)
class Facts:
    """What the preconditions read: the model (None: not given), the rows it names (a trace of
    several models: its own), the trace's vocabularies (embedding tables' rows), whether the
    trace runs a loss op, whether it is a decoder's and whether the model is not the trace's."""

    model: ModelSpec | None
    own: np.ndarray
    vocabularies: frozenset[int]
    loss_op: bool
    decoder: bool = True
    contradicted: bool = False  # most linear-named GEMMs miss the model's (K, N)


def verify(att: pd.DataFrame, model: ModelSpec | None, *, decoder: bool = True) -> pd.DataFrame:
    """`att` with each row whose name breaks its contract demoted to `other` (evidence
    `fallback`, the reason `BROKEN` + why). `model` is the shard the trace ran (None: unknown);
    `decoder` False says the trace is no decoder's (an encoder): decoder-only names break."""
    if att.empty:
        return att
    w = work(att)
    codes, names = pd.factorize(att["operator"].astype("string").fillna(""))
    op = np.asarray(names, dtype=object)[codes]
    facts = _facts(att, w, model, decoder)
    why = np.full(len(att), "", dtype=object)
    for i, name in enumerate(names):
        c = contracts.contract(str(name))
        if c is None:
            continue
        rows = codes == i
        bad = rows & ~np.isin(w, _codes(c.holds))
        said = np.array([f"{name} holds no {k.replace('_', ' ')} work" for k in contracts.WORK],
                        dtype=object)
        why[bad] = said[w[bad]]
        for need in sorted(c.needs):
            unmet, text = _PRECONDITIONS[need](att, rows & (why == ""), w, str(name), facts)
            why[unmet] = text
    if not decoder and model is None:  # an encoder's norms placed by a decoder's layout
        placed = (att["evidence"].astype("string").eq("position").fillna(False).to_numpy(bool)
                  & np.isin(op, _NORMS) & (why == ""))
        why[placed] = ("placed by a decoder's layout; the trace is an encoder's, whose norm "
                       "placement no config gave")
    broken = why != ""
    if not broken.any():
        return att
    out = att.copy()
    demoted = np.where(broken, OTHER, op)
    out["operator"] = pd.Series(demoted, index=att.index, dtype=att["operator"].dtype)
    out.loc[broken, "evidence"] = operators.FALLBACK
    out.loc[broken, "reason"] = op[broken] + " " + BROKEN + why[broken]  # (object arrays)
    return out


_NORMS = [n for n, c in contracts.CONTRACTS.items()  # the norm names (not residual, not any)
          if "norm" in c.holds and n != Name.RESIDUAL and c.holds != frozenset(contracts.WORK)]


def _codes(kinds) -> np.ndarray:
    """The codes of kinds of work (contracts.WORK's order)."""
    return pd.Index(contracts.WORK).get_indexer(list(kinds))


def demotions(att: pd.DataFrame) -> dict[str, object]:
    """The rows `verify` demoted: `demoted_time_us`, `demoted_kernels` and µs per name they had
    (`demoted_by_name`, largest first)."""
    reason = att["reason"] if "reason" in att else pd.Series("", index=att.index)
    hit = reason.astype("string").str.contains(BROKEN, regex=False).fillna(False).to_numpy(bool)
    had = reason[hit].astype("string").str.split(" ", n=1).str[0]
    by = att.loc[hit, "dur_us"].groupby(had.to_numpy()).sum().sort_values(ascending=False)
    return {"demoted_time_us": float(att.loc[hit, "dur_us"].sum()),
            "demoted_kernels": int(hit.sum()),
            "demoted_by_name": {str(k): float(v) for k, v in by.items()}}


def _facts(att: pd.DataFrame, w: np.ndarray, model: ModelSpec | None, decoder: bool) -> Facts:
    base = naming.base_name(att["op_name"]).fillna("")
    own = np.ones(len(att), dtype=bool)
    if model is not None and "model" in att and att["model"].notna().any():
        own = (att["model"].isna() | att["model"].eq(model.name)).to_numpy(dtype=bool)
    emb = att.loc[base.eq(Name.EMBEDDING).to_numpy(dtype=bool), "input_dims"].dropna().unique()
    vocab = pd.Series(emb, dtype="string").str.extract(r"^\[\s*\[\s*(\d+)\s*,\s*\d+\s*\]")[0]
    facts = Facts(model, own, frozenset(int(v) for v in vocab.dropna()),
                  bool((w == _codes([Name.LOSS])[0]).any()), decoder)
    if model is None:
        return facts
    shapes = _shapes(model)
    named = att["operator"].isin(list(shapes)).to_numpy(dtype=bool) & _checked(att, w, facts)
    fits = np.concatenate([_fits(g, shapes[str(name)])[0]
                           for name, g in att[named].groupby("operator", sort=False)]
                           or [np.zeros(0, np.int64)])
    known = fits >= 0
    return dataclasses.replace(facts, contradicted=bool(known.any())
                               and (fits[known] == 1).mean() < 0.5)


# ----------------------------------------------------------------------------- preconditions
# each: (attributed, candidate rows, work, the name, facts) -> (rows that fail, why)
Check = Callable[[pd.DataFrame, np.ndarray, np.ndarray, str, Facts], tuple[np.ndarray, str]]


def _padded(v: int) -> set[int]:
    """A vocabulary and the paddings Inductor and engines give it (GPT-2's 50257 -> 50264)."""
    return {v} | {-(-v // a) * a for a in (8, 16, 32, 64, 128)}


def _layout(att: pd.DataFrame, rows: np.ndarray, w: np.ndarray, name: str,
            f: Facts) -> tuple[np.ndarray, str]:
    """A linear's GEMM has the layout's (K, N) for that name (its fused and TP-sharded forms).
    Not checked where the model is not the trace's (`Facts.contradicted`: crosscheck's error
    names every disagreeing linear) nor on a name the trace itself gives (a record_function
    range, a module frame: the user's claim, which crosscheck checks)."""
    none = np.zeros(len(att), dtype=bool)
    if f.model is None or f.contradicted:
        return none, ""
    want = _shapes(f.model).get(name)
    rows = rows & _checked(att, w, f)
    if want is None or not rows.any():
        return none, ""
    fits, weights = _fits(att[rows], want)
    several = (weights > 1) & (name not in {fused for fused, _ in operators.FUSIONS})
    out = none.copy()
    out[np.flatnonzero(rows)[(fits == 0) | ((fits == 1) & several)]] = True
    shapes = " or ".join(f"[{a}×{b}]" for a, b in sorted(want))
    return out, f"its GEMM's (K, N) is not {f.model.name}'s {name} {shapes}"


def _checked(att: pd.DataFrame, w: np.ndarray, f: Facts) -> np.ndarray:
    """The rows whose (K, N) the layout checks: the model's own weight GEMMs, named by the
    analyzer (not by the trace's ranges or module frames)."""
    return f.own & np.isin(w, _codes(["weight_gemm", "gemm_kernel", "grouped_gemm"])) & ~att[
        "evidence"].isin(["annotation", "module"]).to_numpy(dtype=bool)


def _fits(rows: pd.DataFrame, want: set[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Per GEMM row, 1 if its (K, N) is one of `want`, 0 if not, -1 if it has none; and the
    weights an Inductor kernel multiplies at once."""
    k, n, weights = gemm_operands.gemm_kn(naming.base_name(rows["op_name"]).fillna(""),
                                   rows["input_dims"])
    wide = max([*n, *(b for _, b in want)], default=0) + 1
    hit = np.isin(k * wide + n, [a * wide + b for a, b in want]).astype(np.int64)
    return np.where(k >= 0, hit, -1), weights


def _shapes(model: ModelSpec) -> dict[str, set[tuple[int, int]]]:
    """Operator -> the (K, N) its GEMMs may have: the linears, fused forms, lm_head (padded),
    the MoE linears under the names naming gives them (experts_gate and _up are
    experts_gate_up; the shared expert's gate is router)."""
    out: dict[str, set[tuple[int, int]]] = {k: {v} for k, v in expected_linears(model).items()}
    for fused, parts in operators.FUSIONS:  # Inductor's kv_proj: the parts' weights at once
        if fused not in out and all(p in out for p in parts):
            (k, _), = out[parts[0]]
            out[fused] = {(k, sum(next(iter(out[p]))[1] for p in parts))}
    if Name.LM_HEAD in out:
        (k, v), = out[Name.LM_HEAD]
        out[Name.LM_HEAD] = {(k, p) for p in _padded(v)}
    for name, (k, n, _) in model.moe_linears().items():
        out.setdefault(gemm_names.SUB_LINEARS.get(name, name), set()).add((k, n))
    return out


def _experts(att: pd.DataFrame, rows: np.ndarray, w: np.ndarray, name: str,
             f: Facts) -> tuple[np.ndarray, str]:
    if f.model is None or f.model.experts is not None:
        return np.zeros(len(att), dtype=bool), ""
    return rows & f.own, f"{f.model.name} has no experts (a dense model)"


def _qk_norm(att: pd.DataFrame, rows: np.ndarray, w: np.ndarray, name: str,
             f: Facts) -> tuple[np.ndarray, str]:
    if f.model is None or f.model.qk_norm:
        return np.zeros(len(att), dtype=bool), ""
    return rows & f.own, f"{f.model.name} has no q/k norms"


def _vocabulary(att: pd.DataFrame, rows: np.ndarray, w: np.ndarray, name: str,
                f: Facts) -> tuple[np.ndarray, str]:
    """Without a model, the LM head's N is a vocabulary of an embedding table in the trace."""
    none = np.zeros(len(att), dtype=bool)
    if f.model is not None or not f.vocabularies or not rows.any():
        return none, ""
    sub = att[rows]
    _, n, _ = gemm_operands.gemm_kn(naming.base_name(sub["op_name"]).fillna(""), sub["input_dims"])
    known = set().union(*(_padded(v) for v in f.vocabularies))
    bad = (n >= 0) & ~np.isin(n, list(known))
    out = none.copy()
    out[np.flatnonzero(rows)[bad]] = True
    return out, ("its N is no vocabulary of the trace's embedding tables "
                 f"({', '.join(str(v) for v in sorted(f.vocabularies))})")


def _loss_op(att: pd.DataFrame, rows: np.ndarray, w: np.ndarray, name: str,
             f: Facts) -> tuple[np.ndarray, str]:
    if f.loss_op:
        return np.zeros(len(att), dtype=bool), ""
    return rows, ("the trace runs no loss op (nll_loss, cross_entropy, ...): a log-softmax "
                  "alone is beam search or sampling")


def _not_shared(att: pd.DataFrame, rows: np.ndarray, w: np.ndarray, name: str,
                f: Facts) -> tuple[np.ndarray, str]:
    return rows & np.isin(w, _codes(["grouped_gemm", "batched_gemm"])), (
        "a GEMM batched over experts is the routed experts', not the shared expert's")


def _decoder(att: pd.DataFrame, rows: np.ndarray, w: np.ndarray, name: str,
             f: Facts) -> tuple[np.ndarray, str]:
    if f.decoder:
        return np.zeros(len(att), dtype=bool), ""
    return rows, f"the trace is no decoder's (an encoder has no {name})"


_PRECONDITIONS: dict[str, Check] = {
    "layout": _layout, "experts": _experts, "qk_norm": _qk_norm, "vocabulary": _vocabulary,
    "loss_op": _loss_op, "not_shared": _not_shared, "decoder": _decoder,
}
assert set(_PRECONDITIONS) == set(contracts.NEEDS)
