"""Vectorised helpers over DataFrame columns shared by every stage."""

from __future__ import annotations

import numpy as np
import pandas as pd


def distinct_rows(frame: pd.DataFrame, cols: list[str]) -> tuple[pd.DataFrame, np.ndarray]:
    """The distinct rows of `frame[cols]` (missing values included), in order of first
    appearance, and per row of `frame` the index of its distinct row."""
    sub = frame[cols]
    codes, first = distinct_codes([factorized(sub[c])[0] for c in cols])
    return sub.iloc[first].reset_index(drop=True), codes


def factorized(values: pd.Series) -> tuple[np.ndarray, pd.Index | pd.api.extensions.ExtensionArray]:
    """pd.factorize(values) (codes, -1 where missing, and the values they number), but a
    categorical's own codes and categories as they are (numbered in category order, not in
    order of appearance; categories that no row holds kept)."""
    if isinstance(values.dtype, pd.CategoricalDtype):
        return values.cat.codes.to_numpy(), values.cat.categories
    return pd.factorize(values.array)


def distinct_codes(parts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the number of its distinct combination of `parts` (integer codes of equal
    length, -1 for missing), numbered in order of first appearance; and the first row of each
    combination."""
    n = len(parts[0]) if parts else 0
    ids, bound = np.zeros(n, dtype=np.int64), 1
    for p in parts:  # mixed radix, renumbered before it could overflow
        size = int(p.max(initial=-1)) + 2
        if bound * size >= 2**62:
            ids = pd.factorize(ids)[0]
            bound = int(ids.max(initial=-1)) + 1
        ids, bound = ids * size + (p + 1), bound * size
    ids = pd.factorize(ids)[0].astype(np.int64)
    # numbered by first appearance: a row is a first where its number exceeds all before it
    new = np.r_[True, ids[1:] > np.maximum.accumulate(ids)[:-1]] if n else np.zeros(0, bool)
    return ids, np.flatnonzero(new)
