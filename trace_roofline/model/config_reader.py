"""A HF config.json's fields under their many spellings, each value checked, each default said.

`Config` reads a field by its canonical name (`SPELLINGS`: hidden_size is also n_embd, d_model,
dim; ...), refuses a bad value as a one-line InputError naming the field (a bool, a string, a
non-finite or out-of-range number: `BOUNDS`), and records every default it takes that is a
guess (`Config.assume`) for Architecture.assumed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trace_roofline.errors import InputError
from trace_roofline.model.architecture import Precision, dtype_bits
from trace_roofline.model.moe import Experts

MAX_LAYERS = 100_000  # deeper is a corrupt config, not a model (and would size per-layer tables)
_MAX_WIDTH = 1 << 24  # any width, head or expert count
_SCALE_BITS = 32  # fp8 checkpoints keep one float32 scale per weight block

# canonical field -> its spellings in transformers' configs, the first present wins
SPELLINGS: dict[str, tuple[str, ...]] = {
    "hidden_size": ("hidden_size", "n_embd", "d_model", "dim"),
    "num_attention_heads": ("num_attention_heads", "n_head", "num_heads", "n_heads",
                            "decoder_attention_heads"),
    "num_key_value_heads": ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query"),
    "intermediate_size": ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "d_ff",
                          "decoder_ffn_dim", "dim_ff"),
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers",
                          "decoder_layers"),
    "head_dim": ("head_dim", "kv_channels", "dim_head"),
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
    "num_experts_per_tok": ("num_experts_per_tok", "top_k", "moe_top_k", "experts_per_token",
                            "num_experts_per_token", "moe_topk", "moe_k"),
    "n_shared_experts": ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"),
    "moe_intermediate_size": ("moe_intermediate_size", "expert_intermediate_size"),
    "max_position_embeddings": ("max_position_embeddings", "n_positions"),
    "qk_norm": ("use_qk_norm", "qk_layernorm"),
    "attention_bias": ("attention_bias", "qkv_bias", "use_qkv_bias", "use_bias", "bias"),
    "hidden_act": ("hidden_activation", "hidden_act", "activation_function"),
    "rms_norm_eps": ("rms_norm_eps",),
    "layer_norm_eps": ("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"),
}
# Spellings whose value means something else: multi_query true is one KV head (false: none said)
_CONVERT: dict[str, Callable[[Any], Any]] = {"multi_query": lambda v: 1 if v is True else None}
# int field -> (least, most) value; any other int field: 0 .. _MAX_WIDTH
BOUNDS: dict[str, tuple[int, int]] = {
    **{k: (1, _MAX_WIDTH) for k in (
        "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
        "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
        "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "q_lora_rank", "decoder_sparse_step",
        "moe_layer_freq")},
    "num_hidden_layers": (1, MAX_LAYERS),
    "vocab_size": (0, 1 << 31),
    "max_position_embeddings": (0, 1 << 40),
}


class Config:
    """A config.json's fields with the reader's checks; errors start "<source>: ..."."""

    def __init__(self, cfg: dict, source: str, model_type: str):
        self.cfg, self.source, self.model_type = cfg, source, model_type
        self.assumed: list[str] = []

    def error(self, what: str) -> InputError:
        return InputError(f"{self.source}: bad value in config.json: {what}")

    def assume(self, line: str) -> None:
        """Record a default taken or a guess made (Architecture.assumed)."""
        if line not in self.assumed:
            self.assumed.append(line)

    def lookup(self, name: str) -> tuple[str, Any]:
        """(spelling, value) of the first spelling of `name` the config holds non-null, else
        (name, None)."""
        for key in SPELLINGS.get(name, (name,)):
            v = self.cfg.get(key)
            if v is not None and key in _CONVERT:
                v = _CONVERT[key](v)
            if v is not None:
                return key, v
        return name, None

    def has(self, name: str) -> bool:
        return self.lookup(name)[1] is not None

    def missing(self, *names: str) -> list[str]:
        """The fields absent under every spelling, each with its spellings."""
        return [_spelled(n) for n in names if not self.has(n)]

    def need(self, *names: str) -> None:
        """Every field present (under some spelling), else an InputError naming the missing."""
        missing = self.missing(*names)
        if missing:
            raise InputError(f"{self.source}: config.json lacks {', '.join(missing)}")

    def integer(self, name: str, default: int | None = None) -> int:
        """An int field in its bounds (BOUNDS); `default` where it is absent or null."""
        key, v = self.lookup(name)
        if v is None:
            if default is None:
                raise InputError(f"{self.source}: config.json lacks {_spelled(name)}")
            return default
        low, high = BOUNDS.get(name, (0, _MAX_WIDTH))
        return self.bounded(key, v, low, high)

    def bounded(self, key: str, v: Any, low: int, high: int) -> int:
        """`v` (field `key`) as an int from `low` to `high`, else an InputError naming it."""
        ok = (isinstance(v, int) and not isinstance(v, bool)) or (
            isinstance(v, float) and math.isfinite(v) and v.is_integer())
        if not ok or not low <= v <= high:
            raise self.error(f"{key} must be an integer from {low} to {high}, got {v!r}")
        return int(v)

    def ints(self, name: str) -> tuple[int, ...]:
        """A list of layer indices (mlp_only_layers), each from 0 to MAX_LAYERS."""
        v = self.cfg.get(name) or []
        if not isinstance(v, list):
            raise self.error(f"{name} must be a list of layer indices, got {v!r}")
        return tuple(self.bounded(name, x, 0, MAX_LAYERS) for x in v)

    def number(self, name: str, default: float) -> float:
        """A finite float field; `default` where absent or null."""
        v = self.maybe(name)
        return default if v is None else v

    def maybe(self, name: str) -> float | None:
        """A finite float field, None where absent or null."""
        key, v = self.lookup(name)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.error(f"{key} must be a finite number, got {v!r}")
        return float(v)

    def flag(self, name: str, default: bool) -> bool:
        """A bool field (0/1 accepted); `default` where absent or null."""
        key, v = self.lookup(name)
        if v is None:
            return default
        if not isinstance(v, (bool, int)) or v not in (0, 1):
            raise self.error(f"{key} must be true or false, got {v!r}")
        return bool(v)

    def text(self, name: str, default: str) -> str:
        key, v = self.lookup(name)
        if v is None:
            return default
        if not isinstance(v, str):
            raise self.error(f"{key} must be a string, got {v!r}")
        return v

    def name(self) -> str:
        return str(self.cfg.get("_name_or_path") or self.cfg.get("model_type") or Path(self.source).stem)

    def rope_theta(self) -> float:
        """`rope_theta`, or HF 5.x's `rope_parameters` (Gemma 3: the full-attention layers')."""
        rp = self.cfg.get("rope_parameters") or {}
        rp = rp.get("full_attention", rp) if isinstance(rp, dict) else {}
        base = self.number("rotary_emb_base", 10000.0)
        return self.number("rope_theta", _finite(rp.get("rope_theta"), base))

    def rotary_fraction(self) -> float:
        """The rotated fraction of a head: rotary_pct, partial_rotary_factor (top level or in
        rope_parameters), else 1; outside (0, 1] is an InputError."""
        rp = self.cfg.get("rope_parameters") or {}
        nested = _finite(rp.get("partial_rotary_factor"), 1.0) if isinstance(rp, dict) else 1.0
        f = self.number("rotary_pct", self.number("partial_rotary_factor", nested))
        if not 0 < f <= 1:
            raise self.error(f"the rotary fraction must be in (0, 1], got {f!r}")
        return f

    def windows(self, layers: int, default: Callable[[int], bool]) -> tuple[int | None, ...]:
        """Per-layer sliding windows: `layer_types` where the config lists them, else the
        family's rule `default(i)`; None for full attention or without `sliding_window`."""
        w = self.integer("sliding_window", 0)
        types = self.cfg.get("layer_types")
        sliding = ([t == "sliding_attention" for t in types[:layers]] if isinstance(types, list)
                   else [default(i) for i in range(layers)])
        return tuple(w if w and s else None for s in sliding)

    def precision(self) -> Precision:
        """Dtypes from `torch_dtype` (or `dtype`) and `quantization_config`: fp8 (`fmt` e4m3 or
        e5m2; a float32 scale per `weight_block_size` block) or mxfp4 (the routed experts)."""
        act = str(self.cfg.get("torch_dtype") or self.cfg.get("dtype") or "bfloat16")
        quant = self.cfg.get("quantization_config")
        method = str(quant.get("quant_method", "")).lower() if isinstance(quant, dict) else ""
        if method == "fp8":
            assert isinstance(quant, dict)
            w = "float8_e5m2" if str(quant.get("fmt", "")).lower() == "e5m2" else "float8_e4m3fn"
            block = quant.get("weight_block_size") or []
            if not isinstance(block, list):
                raise self.error(f"weight_block_size must be a list, got {block!r}")
            sizes = [self.bounded("weight_block_size", b, 1, _MAX_WIDTH) for b in block]
            bits = 8.0 + (_SCALE_BITS / math.prod(sizes) if sizes else 0.0)
            return Precision(act, w, bits, w, bits)
        if method == "mxfp4":
            return Precision(act, act, dtype_bits(act), "mxfp4", dtype_bits("mxfp4"))
        return Precision(act, act, dtype_bits(act), act, dtype_bits(act))

    def experts(self, inter: int, shared: int = 0, shared_gate: bool = False,
                norm_default: bool = True) -> Experts:
        """The routed experts (num_experts of `inter`) and a shared MLP of `shared`."""
        top_k = self.integer("num_experts_per_tok", 0)
        return Experts(num_experts=self.integer("num_experts"), top_k=top_k,
                       intermediate_size=inter, shared_intermediate_size=shared,
                       shared_gate=shared_gate,
                       norm_topk_prob=self.flag("norm_topk_prob", norm_default))


def _spelled(name: str) -> str:
    """A field and its other spellings: `num_attention_heads (or n_head, num_heads, n_heads)`."""
    others = SPELLINGS.get(name, (name,))[1:]
    return f"{name} (or {', '.join(others)})" if others else name


def _finite(v: Any, default: float) -> float:
    """A nested number (rope_parameters'), `default` where it is no finite number."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return float(v) if ok else default
