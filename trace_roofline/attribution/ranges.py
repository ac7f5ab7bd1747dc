"""The ranges around each unit: canonical record_function names, layers.N, ProfilerStep#N.

Design notes: docs/design.md ("trace_roofline/attribution/attribute.py").
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import pandas as pd

from trace_roofline.attribution.codes import by_category, categorical, take
from trace_roofline.attribution.nest import KeySpace, Nest, to_ns
from trace_roofline.model import operators

_LAYER_RE = re.compile(r"(?:^|[./:\s])layers?[._\s#]?(\d+)(?:$|[./:\s])")
_STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")
_SEPARATOR = re.compile(r"[./:\s]")
_MISSING: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "name": lambda v: v < 0, "layer": np.isnan, "step": np.isnan}


def is_gpu_range(cat: pd.Series) -> np.ndarray:
    """Per annotation row, whether it is a gpu_user_annotation range (on a stream)."""
    return by_category(cat, lambda c: c.str.lower().eq("gpu_user_annotation"))


def _canonical(name: str) -> str | None:
    """Canonical operator of a range name: 'q_proj', 'layers.3.q_proj', 'input_layernorm'."""
    last = _SEPARATOR.split(name.strip())[-1]
    last = operators.ALIASES.get(last, last)
    return last if last in _NAMES else None


_NAMES = frozenset(operators.NAMES)


def _number(rx: re.Pattern, name: str) -> float:
    m = rx.search(name)
    return float(m.group(1)) if m else np.nan


def _facts(names: pd.Categorical) -> tuple[dict[str, np.ndarray], pd.Index]:
    """Per range row, the facts of its name (its canonical name's code, layer, step), each
    read once per distinct name; and the canonical names' categories."""
    distinct = [str(v) for v in names.categories]
    canon = pd.Categorical([_canonical(v) for v in distinct])
    layer = np.array([_number(_LAYER_RE, v) for v in distinct], dtype=np.float64)
    step = np.array([_number(_STEP_RE, v) for v in distinct], dtype=np.float64)
    return {"name": np.append(canon.codes.astype(np.int64), -1)[names.codes],
            "layer": np.append(layer, np.nan)[names.codes],
            "step": np.append(step, np.nan)[names.codes]}, canon.categories


class _Fill:
    """Per unit, the facts of the innermost range around a point, filled where still missing."""

    def __init__(self, facts: dict[str, np.ndarray], n: int):
        self.facts = facts
        self.out = {"name": np.full(n, -1, dtype=np.int64), "layer": np.full(n, np.nan),
                    "step": np.full(n, np.nan)}

    def __call__(self, field: str, rows: np.ndarray, nest: Nest, q_t: np.ndarray,
                 q_key: np.ndarray) -> None:
        missing = _MISSING[field]
        m = ~missing(self.facts[field])
        if not m.any() or not rows.any():
            return
        hit = nest.subset(m).innermost(q_t, q_key)
        cur = self.out[field][rows]
        fact = take(self.facts[field], hit, -1 if field == "name" else np.nan)
        self.out[field][rows] = np.where(missing(cur) & (hit >= 0), fact, cur)


def unit_ranges(ann: pd.DataFrame, units: pd.DataFrame, keys: KeySpace
                ) -> tuple[pd.Categorical, pd.arrays.IntegerArray, pd.arrays.IntegerArray]:
    """Per unit: (canonical range name, layers.N, ProfilerStep N) of the innermost ranges
    around its launch point; unlinked device rows use gpu_user_annotation ranges around them
    on their stream, and for the step any CPU ProfilerStep range around their start."""
    n = len(units)
    facts, canon = _facts(categorical(ann["name"]))
    gpu = is_gpu_range(ann["cat"])
    s = to_ns(ann["ts_us"])
    e = s + to_ns(ann["dur_us"])
    t, key = units["t"].to_numpy(), units["key"].to_numpy()
    fill = _Fill(facts, n)
    everyone = np.ones(n, dtype=bool)
    cpu = Nest(s, e, np.where(gpu, -1, keys.codes(ann["pid"], ann["tid"])))
    for field in facts:
        fill(field, everyone, cpu, t, key)
    if "dev_pid" in units and (key < 0).any():
        lost = key < 0
        gkeys = KeySpace(pd.DataFrame({"pid": units["dev_pid"], "tid": units["dev_stream"]}))
        on_stream = Nest(s, e, np.where(gpu, gkeys.codes(ann["pid"], ann["tid"]), -1))
        q_t = units["ts_ns"].to_numpy()[lost]
        q_key = gkeys.codes(units["dev_pid"], units["dev_stream"])[lost]
        for field in facts:
            fill(field, lost, on_stream, q_t, q_key)
    # the step, as a last resort: a CPU ProfilerStep range on any thread around the launch
    # (or, for an unlinked device row, around the kernel's start)
    nostep = np.isnan(fill.out["step"])
    if nostep.any():
        q_t = np.where(key >= 0, t, units["ts_ns"].to_numpy() if "ts_ns" in units else t)[nostep]
        anywhere = Nest(s, e, np.where(gpu, -1, 0))
        fill("step", nostep, anywhere, q_t, np.zeros(len(q_t), np.int64))

    def as_int(v: np.ndarray) -> pd.arrays.IntegerArray:
        missing = np.isnan(v)
        return pd.arrays.IntegerArray(np.where(missing, 0, v).astype(np.int64), missing)

    return (pd.Categorical.from_codes(fill.out["name"], canon), as_int(fill.out["layer"]),
            as_int(fill.out["step"]))
