"""The ecosystem sweep (issue 32, "the ecosystem is the test"): every causal-LM family of the
installed transformers, built tiny and profiled on the CPU, named by the analyzer and checked
against the truth of its HF module tree.

Per family: a tiny config (`tiny_config`: 2 layers, widths whose linears keep distinct (K, N)),
random init, float32, eval, eager attention (sdpa where eager does not build); one prefill
(batch 1, 24 tokens) and one decode step (1 token, the prefill's KV cache), each under
torch.profiler (CPU, record_shapes, with_stack, with_modules). The truth comes from forward
hooks that open a `record_function` range named by each module's qualified path and class: the
profiler's own module frames (`nn.Module: LlamaAttention_0`) name a class and its instance
counter, not the path that tells q_proj from k_proj. Those ranges and every python_function
event are removed before the analyzer (`attribute_trace`, with `get_model` of the tiny
config.json, or None where get_model refuses it) sees the trace. Each analyzed op gets the
innermost module range enclosing it, its truth (ecosystem_truth.TRUTH_TABLE) and, where its
name contradicts that truth, the contradiction's kind (ecosystem_truth.CONTRADICTIONS).
Encoders (masked-LM, image classification): one forward each; no decoder-only name may appear.

    python -m workloads.ecosystem --out DIR [--families a,b] [--jobs N] [--table docs/models.md]
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing as mp
import os
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from workloads import ecosystem_truth as et

TOKENS = 24
# profiled runs per family: each op's time is its least over them (one op stalled by a busy CPU
# must not decide a family's share); the names come from the first
REPEATS = 3
TIMEOUT_S = 150.0
CLEAN_MAX = 0.02  # a family is clean when <= 2% of its op time is contradicted
MHA_FAMILIES = ("llama", "qwen2", "qwen3", "olmo2", "granite")  # also built with 4 KV heads
TABLE_BEGIN, TABLE_END = "<!-- ecosystem:begin -->", "<!-- ecosystem:end -->"
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 16
INTERMEDIATE, MOE_INTERMEDIATE, SHARED_INTERMEDIATE = 176, 48, 80
# (8 experts: a router's N apart from the 4 heads of a per-head attention gate)
EXPERTS, TOP_K, VOCAB, LAYERS, POSITIONS = 8, 2, 1000, 2, 256

# config field -> its tiny value (every family's spelling of each size)
SIZES: dict[str, int] = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "n_embed", "embed_dim", "model_dim",
                     "word_embed_proj_dim", "embedding_size", "hidden_dim_model"), HIDDEN),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads",
                     "encoder_attention_heads", "decoder_attention_heads", "attention_heads"),
                    HEADS),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads",
                     "multi_query_group_num", "n_head_kv", "kv_n_heads"), KV_HEADS),
    **dict.fromkeys(("head_dim", "attention_head_dim", "kv_channels", "d_kv", "head_size",
                     "v_head_dim", "qk_nope_head_dim", "dim_head"), HEAD_DIM),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "d_ff",
                     "encoder_ffn_dim", "decoder_ffn_dim", "ffn_hidden_dim",
                     "inner_hidden_size", "intermediate_size_mlp", "dim_feedforward", "dim_ff"),
                    INTERMEDIATE),
    **dict.fromkeys(("moe_intermediate_size", "expert_intermediate_size",
                     "moe_ffn_hidden_size", "expert_hidden_size"), MOE_INTERMEDIATE),
    **dict.fromkeys(("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size",
                     "shared_intermediate_size"), SHARED_INTERMEDIATE),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts",
                     "num_routed_experts"), EXPERTS),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k",
                     "moe_top_k", "num_selected_experts", "top_k_experts"), TOP_K),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "n_layers", "num_layers",
                     "decoder_layers", "encoder_layers", "num_decoder_layers"), LAYERS),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len",
                     "seq_length", "max_sequence_length"), POSITIONS),
    "vocab_size": VOCAB, "kv_lora_rank": 32, "q_lora_rank": 56, "qk_rope_head_dim": 8,
    "qk_head_dim": 24, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "n_shared_experts": 1, "moe_layer_freq": 1, "decoder_sparse_step": 1,
    "image_size": 32, "patch_size": 8, "num_channels": 3,
}
PERIODS = re.compile(r".*_(period|interval|step)$")
OFFSETS = re.compile(r".*_offset$")
TOKEN_IDS = re.compile(r".*_(token_id|token_index|id)$")


def _shrink_list(key: str, value: list, layers: int) -> list | None:
    """A per-layer list cut to LAYERS (each distinct kind kept first), or layer indices < LAYERS."""
    if key in SIZES and value and all(type(v) is int for v in value):
        return [SIZES[key]] * min(len(value), LAYERS)
    if len(value) == layers and layers > LAYERS:  # each kind once, attention's first
        kinds = sorted(dict.fromkeys(map(json.dumps, value)),
                       key=lambda k: not re.search(r"attention|full|attn", k))
        firsts = [json.loads(k) for k in kinds][:LAYERS]
        return (firsts + value[:LAYERS])[:LAYERS]
    if value and all(type(v) is int for v in value) and max(value) < layers and \
            value == sorted(set(value)) and "layer" in key:
        return [v for v in value if v < LAYERS]
    if key in ("hidden_sizes", "embed_dims", "dims", "widths"):
        return [max(8, HIDDEN * (i + 1) // 2) for i in range(len(value))]
    if key in ("depths", "num_layers_per_stage", "block_repeats"):
        return [1] * len(value)
    return None


def shrink(fields: dict[str, Any], mha: bool = False) -> dict[str, Any]:
    """The fields of a config dict that change to make it tiny (nested sub-configs too)."""
    layers = next((fields[k] for k in SIZES if SIZES[k] == LAYERS and
                   type(fields.get(k)) is int), LAYERS)
    out: dict[str, Any] = {}
    for key, value in fields.items():
        if isinstance(value, dict) and ("model_type" in value or key.endswith("_config")):
            sub = shrink(value, mha)  # a sub-config: its changed fields (and its type)
            out[key] = {**sub, **({"model_type": value["model_type"]}
                                  if value.get("model_type") else {})}
        elif isinstance(value, list):
            if (cut := _shrink_list(key, value, layers)) is not None:
                out[key] = cut
        elif type(value) is not int:
            continue
        elif key in SIZES:
            out[key] = (HEADS if mha and SIZES[key] == KV_HEADS else SIZES[key]) \
                if key != "q_lora_rank" or value else value
        elif PERIODS.fullmatch(key) and value > LAYERS:
            out[key] = LAYERS
        elif OFFSETS.fullmatch(key) and value >= LAYERS:
            out[key] = 1
    if "kv_lora_rank" in fields:  # MLA: the rotary head is qk_rope_head_dim
        out["head_dim"] = SIZES["qk_rope_head_dim"]
    if type(fields.get("rotary_dim")) is int:  # GPT-J, CodeGen: a part of each head
        out["rotary_dim"] = HEAD_DIM // 2
    vocab = out.get("vocab_size", fields.get("vocab_size"))
    for key, value in fields.items():  # token ids past the shrunk vocabulary
        if vocab and TOKEN_IDS.fullmatch(key) and type(value) is int and value >= vocab:
            out[key] = vocab - 1 - len(out) % 8
    return out


def tiny_config(family: str, kind: str = "causal") -> Any:
    """The family's config made tiny (`name@mha`: every KV head kept, q/k/v/o all [H, H]); a
    causal LM's with `is_decoder` (BERT-style encoders then mask causally), an encoder's
    without."""
    from transformers import CONFIG_MAPPING

    model_type, _, variant = family.partition("@")
    cls = CONFIG_MAPPING[model_type]
    changed = shrink(cls().to_dict(), mha=variant == "mha")
    cfg = cls(**changed, is_decoder=kind == "causal")
    for key, value in changed.items():  # fields an __init__ derives or ignores
        if not isinstance(value, dict) and getattr(cfg, key, value) != value:
            setattr(cfg, key, value)
    return cfg


def families(kind: str) -> list[str]:
    """The model types of `kind`: causal (plus the MHA variants), masked or image."""
    from transformers.models.auto import modeling_auto as ma

    names = {"causal": ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
             "masked": ma.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
             "image": ma.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES}[kind]
    extra = [f"{f}@mha" for f in MHA_FAMILIES if f in names] if kind == "causal" else []
    return [*names, *extra]


def all_tasks() -> list[tuple[str, str]]:
    """(kind, family) for every family of the sweep, causal first."""
    return [(k, f) for k in ("causal", "masked", "image") for f in families(k)]


# --- one family ------------------------------------------------------------------------------

def _build(kind: str, family: str) -> tuple[Any, Any, str]:
    """The tiny model (float32, eval), its config and the attention implementation it built
    with (eager first, then sdpa, then the family's default)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageClassification, AutoModelForMaskedLM

    factory = {"causal": AutoModelForCausalLM, "masked": AutoModelForMaskedLM,
               "image": AutoModelForImageClassification}[kind]
    cfg = tiny_config(family, kind)
    errors = []
    for attn in ("eager", "sdpa", None):
        torch.manual_seed(0)
        try:
            kw = {"attn_implementation": attn} if attn else {}
            model = factory.from_config(cfg, dtype=torch.float32, **kw)
            return model.float().eval(), cfg, attn or "default"
        except Exception as e:  # the next implementation may build (all failures reported)
            errors.append(f"{attn}: {type(e).__name__}: {e}")
    raise RuntimeError(" | ".join(errors))


class ModuleRanges:
    """Forward hooks opening a `record_function` range `eco|<path>|<class>` around every module
    call (the truth's source)."""

    PREFIX = "eco|"

    def __init__(self, model: Any) -> None:
        import torch

        self.handles, self.stack = [], []
        for path, module in model.named_modules():
            name = f"{self.PREFIX}{path}|{type(module).__name__}"

            def pre(_m: Any, _a: Any, name: str = name) -> None:
                rf = torch.profiler.record_function(name)
                rf.__enter__()
                self.stack.append(rf)

            def post(_m: Any, _a: Any, _o: Any) -> None:
                if self.stack:
                    self.stack.pop().__exit__(None, None, None)

            self.handles += [module.register_forward_pre_hook(pre),
                             module.register_forward_hook(post, always_call=True)]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _inputs(kind: str, model: Any) -> dict[str, Any]:
    import torch

    cfg = model.config
    if kind == "image":
        size = getattr(cfg, "image_size", 32)
        size = size[0] if isinstance(size, (list, tuple)) else size
        return {"pixel_values": torch.randn(1, getattr(cfg, "num_channels", 3), size, size)}
    vocab = getattr(cfg, "vocab_size", None) or getattr(cfg.get_text_config(), "vocab_size", VOCAB)
    return {"input_ids": torch.randint(4, min(vocab, VOCAB), (1, TOKENS))}


def _profile(call: Any, path: Path, workload: dict[str, Any]) -> None:
    """Run `call()` once under the profiler; the raw Chrome trace goes to `path`."""
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=acts, record_shapes=True, with_stack=True,
                                with_modules=True) as prof:
        prof.add_metadata_json("trace_roofline_workload", json.dumps(workload))
        call()
    prof.export_chrome_trace(str(path))


def capture(kind: str, family: str, out: Path) -> tuple[dict[str, Any], Path, Any]:
    """Build the family tiny and profile it (a causal LM: prefill, then one decode step on its
    KV cache, in one trace; an encoder: one forward): the raw trace `out`/trace.json."""
    import torch

    torch.set_num_threads(1)
    model, cfg, attn = _build(kind, family)
    info: dict[str, Any] = {"attn": attn, "moe": _is_moe(model),
                            "encoder_decoder": bool(getattr(cfg, "is_encoder_decoder", False))}
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), default=str))
    args = _inputs(kind, model)
    workload = {"family": family, "kind": kind, "tokens": TOKENS, "dtype": "float32",
                "layers": LAYERS, "attn_implementation": attn, "device": "cpu",
                "forwards": {"prefill": 1, "decode": 1} if kind == "causal" else {"forward": 1}}
    one = args.get("input_ids", torch.zeros(1, 1, dtype=torch.long))[:, -1:]

    def steps() -> None:
        if kind != "causal":
            model(**args)
            return
        cache = model(**args, use_cache=True).past_key_values
        try:
            if cache is None:
                raise RuntimeError("the prefill returned no KV cache")
            model(input_ids=one, past_key_values=cache, use_cache=True)
        except Exception as e:  # a family without a decode step keeps its prefill
            info["decode_error"] = f"{type(e).__name__}: {e}"[:300]

    with torch.no_grad():
        steps()  # warm-up
        hooks = ModuleRanges(model)
        try:
            for r in range(REPEATS):
                _profile(steps, out / trace_name(r), workload)
        finally:
            hooks.remove()
    return info, out / trace_name(0), model


def trace_name(repeat: int) -> str:
    """The raw trace of the `repeat`-th profiled run (the first is the one analysed)."""
    return "trace.json" if repeat == 0 else f"trace.r{repeat}.json"


def _is_moe(model: Any) -> bool:
    return any(p.rsplit(".", 1)[-1] in ("experts", "block_sparse_moe") or "Experts" in
               type(m).__name__ for p, m in model.named_modules())


def module_ranges(events: list[dict[str, Any]]) -> pd.DataFrame:
    """The hooks' ranges: path, class, start and end (µs)."""
    rows = [(e["name"][len(ModuleRanges.PREFIX):], float(e["ts"]), float(e.get("dur", 0)))
            for e in events if e.get("ph") == "X" and
            str(e.get("name", "")).startswith(ModuleRanges.PREFIX)]
    df = pd.DataFrame(rows, columns=["name", "ts", "dur"])
    parts = df["name"].str.rsplit("|", n=1, expand=True) if len(df) else None
    return pd.DataFrame({"path": parts[0] if parts is not None else pd.Series(dtype=str),
                         "cls": parts[1] if parts is not None else pd.Series(dtype=str),
                         "start": df["ts"], "end": df["ts"] + df["dur"]})


def strip_frames(raw: Path, dest: Path) -> list[dict[str, Any]]:
    """Write `raw` gzipped to `dest` without python_function events and the hooks' ranges;
    returns the raw events."""
    trace = json.loads(raw.read_text())
    events = trace["traceEvents"]
    trace["traceEvents"] = [e for e in events if e.get("cat") != "python_function" and not
                            str(e.get("name", "")).startswith(ModuleRanges.PREFIX)]
    with gzip.open(dest, "wt") as f:
        json.dump(trace, f)
    return events


def enclosing(ops: pd.DataFrame, ranges: pd.DataFrame) -> pd.Series:
    """Per op, the index in `ranges` of the innermost range enclosing it (-1: none)."""
    start = ops["ts_us"].to_numpy(float)[:, None]
    end = start + ops["dur_us"].to_numpy(float)[:, None]
    inside = (ranges["start"].to_numpy()[None, :] <= start + 1e-3) & \
        (ranges["end"].to_numpy()[None, :] >= end - 1e-3)
    span = np.where(inside, (ranges["end"] - ranges["start"]).to_numpy()[None, :], np.inf)
    best = span.argmin(axis=1) if len(ranges) else np.zeros(len(ops), int)
    return pd.Series(np.where(np.isfinite(span.min(axis=1, initial=np.inf)), best, -1),
                     index=ops.index)


def truths(model: Any, paths: pd.Series, classes: pd.Series, moe: bool) -> pd.Series:
    """Each (path, class) pair's truth (TRUTH_TABLE), computed once per distinct module."""
    children: dict[str, set[str]] = {}
    for p, _ in model.named_modules():
        if p:
            parent, _, leaf = p.rpartition(".")
            children.setdefault(parent, set()).add(leaf)
    frozen = {k: frozenset(v) for k, v in children.items()}
    keys = pd.DataFrame({"path": paths, "cls": classes})
    distinct = keys.drop_duplicates()
    found = {(p, c): et.truth_of(et.site_of(p, c, frozen, moe))
             for p, c in zip(distinct["path"], distinct["cls"], strict=True)}
    return pd.Series([found[k] for k in zip(keys["path"], keys["cls"], strict=True)], index=paths.index,
                     dtype="string")


UNNAMED = re.compile(r"^(other|unattributed|linear\[.*)$")


def judge(att: pd.DataFrame, events: list[dict[str, Any]], model: Any, moe: bool,
          kind: str = "causal") -> pd.DataFrame:
    """The analyzer's ops with their module, truth, contradiction kind and phase."""
    ranges = module_ranges(events)
    at = enclosing(att, ranges)
    known = at.to_numpy() >= 0
    path = pd.Series(np.where(known, ranges["path"].to_numpy()[at.clip(lower=0)], ""),
                     index=att.index)
    cls = pd.Series(np.where(known, ranges["cls"].to_numpy()[at.clip(lower=0)], ""),
                    index=att.index)
    out = att[["op_name", "operator", "evidence", "dur_us"]].copy()
    out["operator"] = out["operator"].astype(str)
    out["path"], out["truth"] = path, truths(model, path, cls, moe)
    out["contradiction"] = et.contradictions(out["truth"], out["operator"], out["op_name"], moe)
    out["named"] = ~out["operator"].str.match(UNNAMED.pattern) & (out["evidence"] != "fallback")
    out["phase"] = phase_of(att, ranges, kind)
    return out


def phase_of(ops: pd.DataFrame, ranges: pd.DataFrame, kind: str) -> pd.Series:
    """Per op, the call of the top module it ran in: prefill then decode (an encoder: forward)."""
    calls = ranges[ranges["path"] == ""].sort_values("start")["start"].to_numpy()
    names = np.array(["forward"] if kind != "causal" else ["prefill", "decode"][:len(calls)]
                     or ["prefill"])
    which = np.searchsorted(calls, ops["ts_us"].to_numpy(float) + 1e-3, side="right") - 1
    return pd.Series(names[np.clip(which, 0, len(names) - 1)], index=ops.index)


def score(judged: pd.DataFrame, top: int = 5) -> dict[str, Any]:
    """Contradicted and named share of op time, the top contradicted (truth, name, evidence)."""
    total = float(judged["dur_us"].sum()) or 1.0
    bad = judged[judged["contradiction"].notna()]
    pairs = (bad.groupby(["truth", "operator", "evidence", "contradiction"], observed=True)
             ["dur_us"].sum().sort_values(ascending=False).head(top) / total * 100)
    return {"contradicted_pct": round(float(bad["dur_us"].sum()) / total * 100, 2),
            "named_pct": round(float(judged.loc[judged["named"], "dur_us"].sum()) / total * 100,
                               2),
            "ops": len(judged),
            "top": [{"truth": t, "name": n, "evidence": e, "kind": k, "pct": round(float(p), 2)}
                    for (t, n, e, k), p in pairs.items()],
            "names": sorted(set(judged["operator"]))}


def analyze_family(kind: str, family: str, work: Path, keep: bool = False
                   ) -> tuple[dict[str, Any], dict[str, pd.DataFrame]]:
    """Build, profile, analyze and judge one family in `work` (raw traces deleted unless
    `keep`): its result (see `main`) and each phase's judged ops (`judge`)."""
    import trace_roofline as tr
    from trace_roofline.errors import InputError
    from trace_roofline.pipeline import attribute_trace

    result: dict[str, Any] = {"family": family, "kind": kind}
    try:
        info, raw, lm = capture(kind, family, work)
    except Exception as e:  # not buildable tiny, or its forward fails: the why is the result
        return {**result, "buildable": False, "why": f"{type(e).__name__}: {e}"[:600]}, {}
    result.update(buildable=True, **info)
    model, judged = None, {}
    if kind == "causal":
        try:
            model = tr.get_model(str(work / "config.json"))
            result["model_read"] = True
        except InputError as e:
            result.update(model_read=False, model_error=str(e)[:300])
    events = strip_frames(raw, raw.with_suffix(".json.gz"))
    if not keep:
        raw.unlink()
    try:
        trace = tr.load_trace(raw.with_suffix(".json.gz"), workers=1)
        try:
            att, _, found = attribute_trace(trace, model)
        except InputError as e:  # the config's layout contradicted by the shapes
            result["model_refused"] = str(e)[:300]
            model = None
            att, _, found = attribute_trace(trace, None)
        result["verdict"] = found.kind.kind  # decoder, encoder, vision encoder
        ops = judge(att, events, lm, info["moe"], kind)
        ops["dur_us"], result["repeats"] = least_times(att, work, model, keep)
    except Exception as e:  # an analyzer crash is this family's result
        result["crash"] = f"{type(e).__name__}: {e}"[:600]
        result["where"] = traceback.format_exc(limit=-3)[-800:]
        return result, judged
    for phase, part in ops.groupby("phase", sort=False):
        judged[str(phase)] = part
        result[str(phase)] = score(part)
    return result, judged


def least_times(att: pd.DataFrame, work: Path, model: Any, keep: bool) -> tuple[np.ndarray, int]:
    """Each analysed op's least time over the repeated runs whose analysis has the same ops in
    the same order (the runs are the same forward passes), and how many runs that was."""
    import trace_roofline as tr
    from trace_roofline.pipeline import attribute_trace

    least, runs = att["dur_us"].to_numpy(float), 1
    for r in range(1, REPEATS):
        raw = work / trace_name(r)
        if not raw.exists():
            continue
        strip_frames(raw, raw.with_suffix(".json.gz"))
        if not keep:
            raw.unlink()
        again, _, _ = attribute_trace(tr.load_trace(raw.with_suffix(".json.gz"), workers=1), model)
        if len(again) == len(att) and (again["op_name"].to_numpy() == att["op_name"].to_numpy()).all():
            least, runs = np.minimum(least, again["dur_us"].to_numpy(float)), runs + 1
    return least, runs


def run_family(kind: str, family: str, out: Path | None = None) -> dict[str, Any]:
    """One family's result; its traces kept under `out` when given, else in a temp dir."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"eco_{family.replace('@', '_')}_") as tmp:
        work = Path(tmp) if out is None else out / family.replace("@", "_")
        work.mkdir(parents=True, exist_ok=True)
        result, _ = analyze_family(kind, family, work, keep=out is not None)
    return {**result, "seconds": round(time.perf_counter() - t0, 1)}


# --- the pool --------------------------------------------------------------------------------

def _worker(conn: Connection, out: str | None) -> None:
    """Run the families the parent sends, one at a time, until it sends None."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    while (task := conn.recv()) is not None:
        try:
            res = run_family(*task, Path(out) if out else None)
        except BaseException as e:  # never lose a task's answer
            res = {"family": task[1], "kind": task[0], "buildable": False,
                   "why": f"worker: {type(e).__name__}: {e}"[:600]}
        conn.send(res)


def sweep(tasks: Iterable[tuple[str, str]], jobs: int, timeout: float = TIMEOUT_S,
          out: Path | None = None, progress: bool = True) -> list[dict[str, Any]]:
    """Every task on a pool of `jobs` worker processes; a task past `timeout` seconds has its
    worker killed (and replaced) and is reported as a timeout."""
    ctx = mp.get_context("forkserver" if sys.platform != "win32" else "spawn")
    pending, results = list(tasks)[::-1], []
    busy: dict[Connection, tuple[Any, tuple[str, str], float]] = {}
    idle: list[tuple[Any, Connection]] = []

    def start() -> tuple[Any, Connection]:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(child, str(out) if out else None), daemon=True)
        proc.start()
        return proc, parent

    while pending or busy:
        while pending and len(busy) < jobs:
            proc, conn = idle.pop() if idle else start()
            task = pending.pop()
            conn.send(task)
            busy[conn] = (proc, task, time.monotonic())
        for conn in wait(list(busy), timeout=1.0):
            proc, task, began = busy.pop(conn)
            try:
                res = conn.recv()
                idle.append((proc, conn))
            except EOFError:  # the worker died (a crash in C): its task is the answer
                res = {"family": task[1], "kind": task[0], "buildable": False,
                       "why": f"worker died (exit {proc.exitcode})"}
            results.append(res)
            if progress:
                print(_line(res), file=sys.stderr, flush=True)
        for conn, (proc, task, began) in list(busy.items()):
            if time.monotonic() - began > timeout:
                proc.kill()
                busy.pop(conn)
                results.append({"family": task[1], "kind": task[0], "buildable": False,
                                "why": f"timeout after {timeout:.0f} s"})
    for proc, conn in idle:
        conn.send(None)
        proc.join(5)
    return results


def _line(res: dict[str, Any]) -> str:
    if not res.get("buildable"):
        return f"[eco] {res['kind']:6} {res['family']:28} not built: {res.get('why', '')[:100]}"
    phases = " ".join(f"{p} {res[p].get('contradicted_pct', 'crash')}%"
                      for p in ("prefill", "decode", "forward") if p in res)
    return f"[eco] {res['kind']:6} {res['family']:28} {phases} ({res.get('seconds')} s)"


# --- summary and table -----------------------------------------------------------------------

def worst(res: dict[str, Any]) -> float | None:
    """A causal family's contradicted % (the worse phase); None when nothing was scored."""
    pcts = [res[p]["contradicted_pct"] for p in ("prefill", "decode")
            if "contradicted_pct" in res.get(p, {})]
    return max(pcts) if pcts else None


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Built / clean counts, and the encoders carrying a decoder-only name."""
    causal = [r for r in results if r["kind"] == "causal"]
    built = [r for r in causal if r.get("buildable")]
    scored = [r for r in built if worst(r) is not None]
    clean = [r for r in scored if worst(r) <= CLEAN_MAX * 100]
    # encoders: masked-LM and image models, not the encoder-decoders the masked-LM mapping
    # also holds (BART, mBART: their decoder is a decoder, its names are right)
    enc = [r for r in results if r["kind"] != "causal" and r.get("buildable")
           and not r.get("encoder_decoder")]
    leaky = {r["family"]: sorted(set(r["forward"]["names"]) & et.ENCODER_FORBIDDEN)
             for r in enc if "names" in r.get("forward", {})}
    return {"causal": len(causal), "built": len(built), "scored": len(scored),
            "clean": len(clean), "clean_share": round(len(clean) / max(1, len(built)), 3),
            "encoders": len([r for r in results if r["kind"] != "causal"]),
            "encoders_built": len(enc),
            "encoders_with_decoder_names": {k: v for k, v in leaky.items() if v},
            # the verdict (attribution/kind.py) against what was built
            "causal_judged_not_decoder": sorted(r["family"] for r in built
                                                if r.get("verdict", "decoder") != "decoder"),
            "encoders_judged_decoder": sorted(r["family"] for r in enc
                                              if r.get("verdict") == "decoder")}


def table(results: list[dict[str, Any]]) -> str:
    """The generated section of docs/models.md."""
    s = summary(results)
    lines = [TABLE_BEGIN, "",
             "Generated by `python -m workloads.ecosystem --out DIR --table docs/models.md` "
             "(tests/workloads/test_ecosystem.py): every causal-LM family of the installed transformers, "
             "built tiny, profiled on the CPU (prefill of 24 tokens, one decode step; each op's "
             f"time its least over {REPEATS} runs), named without the module frames, and checked "
             "against its module tree. "
             f"{s['built']} of {s['causal']} causal-LM families built; {s['clean']} hold "
             f"<= {CLEAN_MAX:.0%} of op time under a contradicted name "
             f"({s['clean_share']:.0%}). Encoders: {s['encoders_built']} of {s['encoders']} "
             f"built, {len(s['encoders_with_decoder_names'])} carrying a decoder-only name, "
             f"{len(s['encoders_judged_decoder'])} not said to be no decoder; causal-LM "
             f"families said to be no decoder: {len(s['causal_judged_not_decoder'])} "
             f"({', '.join(s['causal_judged_not_decoder']) or 'none'}).",
             "", "| family | attn | --model | contradicted % prefill / decode | named % "
             "prefill / decode | top contradiction (truth -> name, evidence) |",
             "|---|---|---|---|---|---|"]
    for r in sorted((r for r in results if r["kind"] == "causal"), key=lambda r: r["family"]):
        if not r.get("buildable"):
            lines.append(f"| {r['family']} | - | - | not built: {_cell(r.get('why', ''))} | | |")
            continue
        pc = [_pct(r.get(p), "contradicted_pct") for p in ("prefill", "decode")]
        pn = [_pct(r.get(p), "named_pct") for p in ("prefill", "decode")]
        tops = [t for p in ("prefill", "decode") for t in r.get(p, {}).get("top", [])]
        top = max(tops, key=lambda t: t["pct"]) if tops else None
        what = f"{top['truth']} -> {top['name']} ({top['evidence']})" if top else ""
        lines.append(f"| {r['family']} | {r['attn']} | {'yes' if r.get('model_read') else 'no'}"
                     f" | {' / '.join(pc)} | {' / '.join(pn)} | {what} |")
    lines += ["", TABLE_END]
    return "\n".join(lines)


def _pct(phase: dict[str, Any] | None, key: str) -> str:
    if not phase:
        return "-"
    return "crash" if "crash" in phase else f"{phase[key]:.1f}"


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")[:90]


def write_table(path: Path, section: str) -> None:
    """Replace the marked section of `path` (appended where absent; the file made if need be)."""
    text = path.read_text() if path.exists() else "# Model families\n"
    if TABLE_BEGIN in text and TABLE_END in text:
        head, rest = text.split(TABLE_BEGIN, 1)
        text = head + section + rest.split(TABLE_END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n## The ecosystem sweep\n\n" + section + "\n"
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder of result.json")
    ap.add_argument("--families", default="", help="comma separated (default: all)")
    ap.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per family")
    ap.add_argument("--table", type=Path, help="docs/models.md: rewrite its generated section")
    ap.add_argument("--keep", action="store_true", help="keep the traces under OUT/traces")
    a = ap.parse_args(argv)
    tasks = all_tasks()
    if a.families:
        wanted = set(a.families.split(","))
        tasks = [t for t in tasks if t[1] in wanted]
    t0 = time.monotonic()
    results = sweep(tasks, a.jobs, a.timeout, a.out / "traces" if a.keep else None)
    doc = {"summary": {**summary(results), "seconds": round(time.monotonic() - t0, 1),
                       "jobs": a.jobs}, "families": results}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "result.json").write_text(json.dumps(doc, indent=1, default=str))
    print(json.dumps(doc["summary"], indent=1))
    if a.table:
        write_table(a.table, table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
