"""Property tests of the DataFrame stages: frames with missing values (NaN, None,
pd.NA) in every optional column, and model configs, hardware files and options holding hostile
values (0, negative, True, inf, NaN, 1e30, strings, huge integers, null, lists). Whatever the
input, a stage returns or raises the project's InputError: no other exception escapes.

The frames are a committed trace's tables and attribution (loaded once), each example knocking
out a random share of the cells of its optional columns; few examples, no deadline (a stage run
takes a fraction of a second)."""

from __future__ import annotations

import copy
import json
import math
import os
from functools import cache

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.builders import SAMPLES
from trace_roofline.errors import InputError
from trace_roofline.model import families, hardware
from trace_roofline.model.models import ModelSpec, get_model
from trace_roofline.options import AnalysisOptions
from trace_roofline.pipeline import TraceFacts, analyze, attribute_trace
from trace_roofline.trace import Trace, load_trace

TRACE = SAMPLES / "hf-qwen2-qwen2.5-7b-2l_decode_b1_s512_h200.json.gz"
CONFIGS = sorted((SAMPLES / "families_h200" / "configs").glob("*.json"))
# PROPERTY_EXAMPLES=200 PROPERTY_RANDOM=1 explores further (fresh examples on each run).
SETTINGS = settings(max_examples=int(os.environ.get("PROPERTY_EXAMPLES", "12")), deadline=None,
                    derandomize=not os.environ.get("PROPERTY_RANDOM"),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# The columns of each trace table that may be missing (nullable: the rest, ids, names, times
# and kinds, are always set by the loader).
TRACE_OPTIONAL = {
    "device": ["pid", "correlation", "external_id", "grid", "block"],
    "cpu_ops": ["pid", "tid", "external_id", "input_dims", "input_types", "concrete_inputs",
                "input_strides"],
    "runtime": ["pid", "tid", "correlation", "external_id"],
    "annotations": ["pid", "tid", "external_id"],
    "python_frames": ["pid", "tid", "python_id", "parent_id"],
    "flows": ["id", "pid", "tid"],
}
# attribute()'s optional columns (NA where the schema allows it).
ATTRIBUTED_OPTIONAL = ["stream", "op_id", "op_name", "input_dims", "input_types", "concrete_inputs",
                       "input_strides", "layer", "step", "reason", "training", "model"]
MISSING = [None, np.nan, pd.NA]
HOSTILE = [0, -1, -3584, True, False, math.inf, -math.inf, math.nan, 1e30, -1e30, 0.5, "3584",
           "", "abc", 10**400, 2**63, None, [], [1], {}, {"a": 1}]


@cache
def _trace() -> Trace:
    return load_trace(TRACE)


@cache
def _attributed() -> pd.DataFrame:
    kernels, _, _ = attribute_trace(_trace())
    return kernels


def _knock_out(frame: pd.DataFrame, columns: list[str], seed: int, share: float,
               missing: object) -> pd.DataFrame:
    """`frame` with about `share` of each optional column's cells missing (`missing`: None,
    NaN or pd.NA, stored as the column's dtype stores it)."""
    rng = np.random.default_rng(seed)
    out = frame.copy()
    for col in (c for c in columns if c in out):
        mask = rng.random(len(out)) < share
        values = out[col]
        if isinstance(values.dtype, pd.CategoricalDtype):
            out[col] = values.where(~mask)  # (a category holds NaN only)
        elif pd.api.types.is_extension_array_dtype(values.dtype):
            out[col] = values.where(~mask, pd.NA)
        else:
            obj = values.astype(object)
            obj[mask] = missing
            out[col] = obj if values.dtype == object else obj.astype(values.dtype, errors="ignore")
    return out


def _only_input_errors(run) -> object:
    """run()'s result, or None when it raised InputError; any other exception fails."""
    try:
        return run()
    except InputError as e:
        assert str(e) and "\n" not in str(e).strip(), repr(e)
        return None


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), share=st.sampled_from([0.05, 0.5, 1.0]),
       missing=st.sampled_from(MISSING), tables=st.sets(st.sampled_from(sorted(TRACE_OPTIONAL)),
                                                       min_size=1))
def test_attribution_and_analysis_of_tables_with_missing_values(seed, share, missing, tables):
    """The trace's tables with missing cells in optional columns: attribute_trace, then
    costing and placing, give a result or an InputError."""
    t = _trace()
    changed = {name: _knock_out(getattr(t, name), TRACE_OPTIONAL[name], seed, share, missing)
               for name in tables}
    trace = Trace(**{**{f: getattr(t, f) for f in ("path", "meta", *TRACE_OPTIONAL)}, **changed})
    got = _only_input_errors(lambda: attribute_trace(trace))
    if got is not None:
        kernels = got[0]
        _only_input_errors(lambda: analyze(kernels, None, hardware.PRESETS["h200-sxm"],
                                           facts=TraceFacts(trace=str(TRACE))))


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), share=st.sampled_from([0.05, 0.5, 1.0]),
       missing=st.sampled_from(MISSING),
       columns=st.sets(st.sampled_from(ATTRIBUTED_OPTIONAL), min_size=1),
       model=st.sampled_from([None, "qwen2.5-7b"]))
def test_costing_and_placing_of_attributed_rows_with_missing_values(seed, share, missing,
                                                                   columns, model):
    """attribute()'s table with missing cells in optional columns: costed and placed
    (pipeline.analyze, with and without a model), or an InputError."""
    frame = _knock_out(_attributed(), sorted(columns), seed, share, missing)
    spec = get_model(model) if model else None
    _only_input_errors(lambda: analyze(frame, spec, hardware.PRESETS["h200-sxm"], AnalysisOptions(force=True),
                                       facts=TraceFacts(trace=str(TRACE))))


def _extra_keys(cfg: dict) -> list[str]:
    """A config's own keys and the optional ones a reader may look up."""
    return sorted({*cfg, "head_dim", "num_key_value_heads", "num_experts", "num_local_experts",
                   "num_experts_per_tok", "moe_intermediate_size", "n_routed_experts",
                   "n_shared_experts", "first_k_dense_replace", "sliding_window", "layer_types",
                   "tie_word_embeddings", "torch_dtype", "rope_theta", "intermediate_size",
                   "n_inner", "model_type", "architectures", "text_config", "q_lora_rank",
                   "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"})


@SETTINGS
@given(data=st.data(), config=st.sampled_from(CONFIGS), value=st.sampled_from(HOSTILE))
def test_model_config_fields_with_hostile_values(data, config, value):
    """Each family's config with one field set to a hostile value: a model, or an InputError
    (naming the field); a model that is built is then used to cost a trace."""
    cfg = json.loads(config.read_text())
    key = data.draw(st.sampled_from(_extra_keys(cfg)))
    cfg = copy.deepcopy(cfg)
    cfg[key] = value
    spec = _only_input_errors(
        lambda: ModelSpec.from_architecture(families.from_hf_config(cfg, config.name)))
    if spec is not None:
        _only_input_errors(lambda: analyze(_attributed(), spec, hardware.PRESETS["h200-sxm"],
                                           AnalysisOptions(force=True), facts=TraceFacts(trace=str(TRACE))))


@SETTINGS
@given(key=st.sampled_from(["name", "peak_flops", "mem_bandwidth", "source", "device_names",
                            "link_bandwidth", "link_source", "extra"]),
       value=st.sampled_from([*HOSTILE, {"bf16": 0}, {"bf16": "1e15"}, {"int8": 1e15},
                              {"bf16": True}, {"bf16": 10**400}, ["bf16"]]))
def test_hardware_fields_with_hostile_values(key, value):
    raw = {"name": "x", "peak_flops": {"bf16": 1e15, "fp32": 1e14}, "mem_bandwidth": 3e12,
           "source": "test", "device_names": ["X"], "link_bandwidth": 4e11}
    raw[key] = value
    hw = _only_input_errors(lambda: hardware._from_dict(raw, "hw.json"))
    if hw is not None:
        _only_input_errors(lambda: analyze(_attributed(), None, hw, facts=TraceFacts(trace=str(TRACE))))


@SETTINGS
@given(field=st.sampled_from(["causal", "attention_bytes", "layers", "tp", "by_shape", "force"]),
       value=st.sampled_from(HOSTILE))
def test_analysis_options_with_hostile_values(field, value):
    """AnalysisOptions' fields with hostile values: refused (InputError) or analysed."""
    options = _only_input_errors(lambda: AnalysisOptions(**{field: value}))
    if options is not None:
        spec = get_model("qwen2.5-7b")
        _only_input_errors(lambda: analyze(_attributed(), spec, hardware.PRESETS["h200-sxm"], options,
                                           facts=TraceFacts(trace=str(TRACE))))


def test_the_frames_are_what_the_loader_gives():
    """(The knocked-out columns exist and are nullable in the loader's schema.)"""
    from trace_roofline.attribution.attribute import ATTRIBUTED_COLUMNS
    from trace_roofline.trace import SCHEMAS

    for table, cols in TRACE_OPTIONAL.items():
        assert set(cols) <= set(SCHEMAS[table]), table
    assert set(ATTRIBUTED_OPTIONAL) <= set(ATTRIBUTED_COLUMNS)
    assert len(_attributed()) > 100 and CONFIGS


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
