"""attribute.py on categorical codes: output pinned on every committed trace, and each columnar
piece (string decoding, nesting subsets, id lookup, thread keys, layer counting, per-name module
frames) against a plain reference computation.

tests/golden/attributed.parquet holds attribute() of every trace in sample_traces/ (column
`trace`), as computed by the object-column implementation before the categorical rewrite
(commit c9ae8a1). After an intended change of attribution, regenerate it with
`PYTHONPATH=. python3 tests/attribution/test_attribute_codes.py --update` (so the worktree's trace_roofline is
the one imported) and say why in the commit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.builders import ROOT, by_prefix, walk
from trace_roofline.attribution import nn_modules
from trace_roofline.attribution.attribute import ATTRIBUTED_COLUMNS, attribute
from trace_roofline.attribution.codes import lookup as _lookup
from trace_roofline.attribution.codes import strings as _strings
from trace_roofline.attribution.instance_names import module_frames as _module_frames
from trace_roofline.attribution.instance_names import segment_layers as _segment_layers
from trace_roofline.attribution.nest import KeySpace, Nest
from trace_roofline.model.models import get_model
from trace_roofline.model.operators import MODEL_LEVEL, STAGES
from trace_roofline.trace import load_trace

GOLDEN = ROOT / "tests" / "golden" / "attributed.parquet"
TRACES = sorted((ROOT / "sample_traces").glob("*.json.gz"))


def _attribute(path: Path) -> pd.DataFrame:
    return attribute(load_trace(path), get_model("qwen-tiny" if "tiny" in path.name
                                                 else "qwen2.5-7b"))


@pytest.fixture(scope="module")
def golden() -> pd.DataFrame:
    return pd.read_parquet(GOLDEN)


def test_golden_covers_every_committed_trace(golden):
    assert sorted(golden["trace"].unique()) == [p.name for p in TRACES]


@pytest.mark.parametrize("path", walk(TRACES, by_prefix, lambda p: p.name))
def test_attribute_matches_the_golden_frame(path, golden):
    a = _attribute(path)
    want = golden[golden["trace"] == path.name].drop(columns="trace").reset_index(drop=True)
    got = a[want.columns].astype({"name": "str"})  # (the golden frame holds the names as str)
    pd.testing.assert_frame_equal(got, want, check_exact=True)  # columns added since
    assert [str(a[c].dtype) for c in a] == list(ATTRIBUTED_COLUMNS.values())
    for col, dtype in ATTRIBUTED_COLUMNS.items():  # each column has its declared dtype
        assert a[col].dtype == dtype, col


def test_declared_dtypes_also_when_a_column_is_all_missing(tmp_path):
    # kernels that no cpu op launched: every op column is missing (the object-column version
    # returned dtype object for those)
    kernel = {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "dur": 1.0,
              "args": {"stream": 7, "device": 0}}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [{**kernel, "ts": 10.0}, {**kernel, "ts": 20.0}]}))
    a = attribute(load_trace(path))
    assert {c: str(a[c].dtype) for c in a} == ATTRIBUTED_COLUMNS
    assert a["op_name"].isna().all() and (a["operator"] == "unattributed").all()


# ----------------------------------------------------------------------------------------------
# String columns decoded once per category
# ----------------------------------------------------------------------------------------------
@given(st.lists(st.one_of(st.none(), st.sampled_from(["", "aten::mm", "x" * 500, "é[1, 2]"])),
                max_size=70))
def test_strings_decode_like_an_object_column(values):
    got = _strings(pd.Series(values, dtype=object).astype("category"))
    want = pd.array(np.array(values, dtype=object), dtype="str")
    pd.testing.assert_extension_array_equal(got, want)


def test_strings_decode_across_take_chunks():
    codes = np.random.default_rng(0).integers(-1, 3, 100_000)
    cats = ["a", "bb" * 100, "ccc"]
    got = _strings(pd.Categorical.from_codes(codes, cats))
    want = np.where(codes >= 0, np.array(cats, dtype=object)[np.maximum(codes, 0)], None)
    pd.testing.assert_extension_array_equal(got, pd.array(want, dtype="str"))


# ----------------------------------------------------------------------------------------------
# Nest.subset: the same answers as a Nest built on the subset alone
# ----------------------------------------------------------------------------------------------
def _random_intervals(rng, n=600):
    """Nested intervals by construction (children inside parents), several keys, same-start
    and zero-length ones, some on an unknown thread (-1)."""
    out = []
    for key in (-1, 0, 1, 4):
        t = int(rng.integers(0, 50))
        stack = []
        for _ in range(n // 4):
            while stack and (rng.random() < 0.4 or t >= stack[-1]):
                t = max(t, stack.pop())
            end_max = stack[-1] if stack else t + 1000
            e = int(rng.integers(t, end_max + 1))
            out.append((t, e, key))
            stack.append(e)
            t += int(rng.integers(0, 3))
    return np.array(out, dtype=np.int64)


@pytest.mark.parametrize("seed", range(5))
def test_nest_subset_matches_a_nest_of_the_subset(seed):
    rng = np.random.default_rng(seed)
    iv = _random_intervals(rng)
    s, e, k = iv[:, 0], iv[:, 1], iv[:, 2]
    q = rng.integers(-5, int(e.max()) + 5, 4000)
    qk = rng.choice([-1, 0, 1, 2, 4], 4000)
    full = Nest(s, e, k)
    for mask in (rng.random(len(s)) < 0.5, np.zeros(len(s), bool), np.ones(len(s), bool)):
        rows = np.flatnonzero(mask)
        alone, sub = Nest(s[rows], e[rows], k[rows]), full.subset(mask)
        back = np.append(rows, -1)  # alone's index -> constructor index (-1 stays -1)
        assert (sub.innermost(q, qk) == back[alone.innermost(q, qk)]).all()
        assert (sub.outermost(q, qk) == back[alone.outermost(q, qk)]).all()
        want_depth = np.full(len(s), -1)
        want_depth[rows] = alone.depth
        assert (sub.depth == want_depth).all()


# ----------------------------------------------------------------------------------------------
# Id lookup (correlation, flow id, External id) by sort + searchsorted
# ----------------------------------------------------------------------------------------------
@given(st.lists(st.one_of(st.none(), st.integers(-3, 12)), max_size=60),
       st.lists(st.integers(-4, 14), max_size=40))
def test_lookup_matches_pandas(values, queries):
    col = pd.Series(values, dtype="Int64")
    v = col.to_numpy(np.int64, na_value=0)
    q = np.array(queries, dtype=np.int64)

    def row_of(found: pd.Series) -> list[int]:  # the row holding each query in `found`, or -1
        pos = pd.Index(found.astype("int64")).get_indexer(q)
        return [int(found.index[p]) if p >= 0 else -1 for p in pos]

    # first row holding each value (the old dropna().drop_duplicates() + get_indexer)
    got = _lookup(v, col.notna().to_numpy(), q, unique=False)
    assert got.tolist() == row_of(col.dropna().drop_duplicates())
    # the one row holding a positive value, when exactly one does
    got = _lookup(v, (col.notna() & (col > 0)).to_numpy(), q, unique=True)
    assert got.tolist() == row_of(col[~col.duplicated(keep=False) & col.notna() & (col > 0)])


# ----------------------------------------------------------------------------------------------
# Thread keys looked up once per run of rows
# ----------------------------------------------------------------------------------------------
@given(st.lists(st.tuples(st.one_of(st.none(), st.integers(0, 3)),
                          st.one_of(st.none(), st.integers(0, 3))), min_size=1, max_size=80),
       st.integers(1, 79))
def test_keyspace_codes_are_equal_exactly_for_equal_pairs(pairs, cut):
    df = pd.DataFrame(pairs, columns=["pid", "tid"]).astype("Int64")
    a, b = df.iloc[:cut], df.iloc[cut:]
    keys = KeySpace(a, b)
    codes = np.concatenate([keys.codes(a["pid"], a["tid"]), keys.codes(b["pid"], b["tid"])])
    na = df.isna().any(axis=1).to_numpy()
    assert (codes[na] == -1).all() and (codes[~na] >= 0).all()
    real = [p for p, m in zip(pairs, na, strict=True) if not m]
    c = codes[~na]
    for i in range(len(real)):
        for j in range(len(real)):
            assert (c[i] == c[j]) == (real[i] == real[j])
    # a pair never seen is unknown
    assert keys.codes(pd.Series([99], dtype="Int64"), pd.Series([0], dtype="Int64"))[0] == -1


# ----------------------------------------------------------------------------------------------
# Layer counting: numpy runs vs the groupby formulation it replaced
# ----------------------------------------------------------------------------------------------
def _segment_layers_reference(name: pd.Series, grp: pd.Series) -> pd.Series:
    emb = name.eq("embedding").to_numpy()
    g_arr = grp.to_numpy()
    first_emb = emb & ~np.r_[False, emb[:-1] & (g_arr[1:] == g_arr[:-1])]
    head = name.eq("lm_head").to_numpy()
    after_head = np.r_[False, head[:-1] & ~head[1:]]  # the row after a run of lm_head rows
    fwd = pd.Series((first_emb | after_head).astype(int), index=name.index).groupby(grp).cumsum()
    seq = pd.Series(pd.factorize(pd.MultiIndex.from_arrays([g_arr, fwd.to_numpy()]))[0],
                    index=name.index)
    stage = name.map(STAGES).astype("float64")
    st_ = stage.dropna()
    g = seq.loc[st_.index]
    prev = st_.groupby(g).shift(1)
    new = prev.isna() | (st_ < prev)
    at_stage = new.astype(int).groupby(g).cumsum() - 1
    layer = pd.Series(np.nan, index=name.index)
    layer.loc[at_stage.index] = at_stage.to_numpy()
    layer = layer.groupby(seq).ffill()
    layer = layer.where(~name.isin(MODEL_LEVEL))
    return pd.Series(pd.array(layer, dtype="Float64").astype("Int64"), index=name.index)


NAMES = [None, "embedding", "other", "rope", "kv_cache", "lm_head", "final_norm", *STAGES]


@settings(max_examples=300, deadline=None)  # the first call pays one-time imports
@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from(NAMES)), min_size=1, max_size=60))
def test_segment_layers_matches_the_groupby_reference(rows):
    rows = sorted(rows, key=lambda r: r[0])  # instance tables are sorted by group
    grp = np.array([g for g, _ in rows])
    name = pd.Series([n for _, n in rows], dtype=object)
    codes, cats = pd.factorize(name)
    got = _segment_layers(codes, pd.Index(cats, dtype=object), grp)
    want = _segment_layers_reference(name, pd.Series(grp))
    pd.testing.assert_extension_array_equal(got, want.array)


# ----------------------------------------------------------------------------------------------
# nn.Module frames classified once per distinct frame name
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", [p for p in TRACES if "_stack_" in p.name], ids=lambda p: p.name)
def test_module_frames_per_name_match_per_row(path):
    frames = load_trace(path).python_frames
    got, want = _module_frames(frames), nn_modules.module_frames(frames)
    assert len(want) > 0 and list(got.columns) == list(want.columns)
    for col in want:
        assert got[col].astype(object).tolist() == want[col].astype(object).tolist(), col


if __name__ == "__main__" and sys.argv[1:] == ["--update"]:
    frames = [_attribute(p).assign(trace=p.name) for p in TRACES]
    pd.concat(frames, ignore_index=True).to_parquet(GOLDEN, compression="zstd", index=False)
    print(f"wrote {GOLDEN} ({len(TRACES)} traces)")


def test_kernel_names_are_categorical_sorted_and_used():
    """`name` holds a few dozen distinct long kernel names: categorical, its categories the
    names in use, sorted, so that it sorts and compares as the strings do."""
    a = _attribute(ROOT / "sample_traces" / "hf-qwen2-qwen2.5-7b-2l_decode_b1_s512_h200.json.gz")
    cats = list(a["name"].cat.categories)
    assert cats == sorted(set(a["name"].astype(str))) and len(cats) < len(a) / 10
    order = a.sort_values("name", kind="stable").index
    assert list(order) == list(a.assign(s=a["name"].astype(str)).sort_values("s", kind="stable").index)
