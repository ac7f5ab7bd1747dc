"""Names per row as codes into a small vocabulary, and work done once per distinct value.

Design notes: docs/design.md ("trace_roofline/attribution/naming.py").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from trace_roofline.frames import distinct_codes, factorized
from trace_roofline.model import operators


def factorized_names(values: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """(codes, distinct values) of a column (frames.factorized): codes index the distinct
    values (an object array); missing is one more distinct value, the last."""
    codes, uniques = factorized(values)
    return (np.where(codes < 0, len(uniques), codes),
            np.append(np.asarray(uniques, dtype=object), [None]))


def distinct_values(values: pd.Series | pd.DataFrame) -> tuple[np.ndarray, pd.Series | pd.DataFrame]:
    """The distinct values of a column (a string Series), or the distinct rows of several (a
    DataFrame of string columns), and per row the index of its own."""
    if isinstance(values, pd.Series):
        codes, uniques = factorized_names(values)
        return codes, pd.Series(uniques, dtype=object).astype("string")
    parts = [factorized_names(values[c]) for c in values.columns]
    codes, first = distinct_codes([col_codes for col_codes, _ in parts])
    return codes, pd.DataFrame({
        c: pd.Series(col_uniques[col_codes[first]], dtype=object).astype("string")
        for c, (col_codes, col_uniques) in zip(values.columns, parts, strict=True)})


def per_value(values: pd.Series | pd.DataFrame, fn) -> pd.DataFrame | pd.Series:
    """fn evaluated once per distinct value (a string Series of them) or, for a DataFrame, once
    per distinct row (a DataFrame of string columns), broadcast back to the rows."""
    codes, distinct = distinct_values(values)
    out = fn(distinct).iloc[codes]
    out.index = values.index
    return out


@dataclass(frozen=True)
class Names:
    """A name per row, as codes into a small vocabulary: a test on the names costs one look-up
    per row, not a string comparison. The empty name "" is no name."""

    codes: np.ndarray  # per row, an index into vocab
    vocab: np.ndarray  # the names (an object array of str)

    @classmethod
    def of(cls, values: pd.Series) -> Names:
        """The names of a column (missing: "")."""
        codes, uniques = factorized_names(values)
        return cls(codes, np.where(pd.isna(uniques), "", uniques).astype(object))

    def isin(self, names: Iterable[str]) -> np.ndarray:
        """Per row, whether its name is one of `names`."""
        return np.isin(self.vocab, list(names))[self.codes]

    def mapped(self, fn: Callable[[pd.Series], pd.Series]) -> Names:
        """The names fn gives, evaluated once per name: fn takes a string Series of names
        (missing: no name) and returns one (missing: no name)."""
        names = pd.Series(np.where(self.vocab == "", None, self.vocab),  # type: ignore[call-overload]  # (stubs refuse None)
                          dtype="string")
        return Names(self.codes, fn(names).fillna("").to_numpy(dtype=object))

    def renamed(self, mapping: dict[str, str]) -> Names:
        """The names with those in `mapping` replaced."""
        return Names(self.codes, np.asarray([mapping.get(v, v) for v in self.vocab], dtype=object))

    def categorical(self) -> pd.Categorical:
        """The names as a Categorical of the names that occur, sorted ("": missing), as
        pd.Categorical would make of the names as strings."""
        codes, vocab = pd.factorize(self.vocab)  # one code per name
        codes = codes[self.codes]
        used = np.zeros(len(vocab), dtype=bool)
        used[codes] = True
        used &= vocab != ""
        cats = vocab[used]
        order = np.argsort(cats, kind="stable")
        new = np.full(len(vocab), -1)
        new[np.flatnonzero(used)[order]] = np.arange(len(cats))
        return pd.Categorical.from_codes(new[codes], cats[order])


Rule = tuple[np.ndarray, Names | str]  # (condition per row, name: one or per row)


def first_match(rules: list[Rule], default: str) -> Names:
    """Per row, the name of the first rule whose condition holds, else `default`: rules are
    ordered lists of (condition, name) pairs, read top to bottom like a table in the docs."""
    n = len(rules[0][0])
    which = np.full(n, len(rules))  # the index of the first rule that holds
    for i in reversed(range(len(rules))):
        np.copyto(which, i, where=rules[i][0])
    # a rule of one name is its own code; a rule of a name per row appends its vocabulary
    vocab = [name if isinstance(name, str) else "" for _, name in rules] + [default]
    codes = which.copy()
    for i, (_, name) in enumerate(rules):
        if isinstance(name, Names):
            rows = np.flatnonzero(which == i)
            codes[rows] = len(vocab) + name.codes[rows]
            vocab.extend(name.vocab)
    return Names(codes, np.asarray(vocab, dtype=object))


def base_name(names: pd.Series) -> pd.Series:
    """'aten::addmm' -> 'addmm' (Triton kernel names are kept whole)."""
    return per_value(names, operators.base_names)
