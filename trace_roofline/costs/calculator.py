"""Shape-only intensity calculator: per-projection GEMM and attention intensity, regimes, M* and S*;
for a mixture-of-experts model, the routed experts' GEMMs against tokens in flight (moe.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from trace_roofline.model import formulas, moe
from trace_roofline.model.hardware import Hardware
from trace_roofline.model.models import ModelSpec
from trace_roofline.model.operators import Name

_PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def si(x: object, unit: str, digits: int = 4) -> str:
    """`x` in `unit` with an SI prefix that keeps 1 <= mantissa < 1000, `digits` significant
    digits: 407510000 B -> '407.5 MB', 1.508e12 FLOP/s -> '1.508 TFLOP/s', 8.5e9 B/s ->
    '8.5 GB/s'; '-' when missing. Every text output (terminal, report.md, report.html, charts,
    `intensity`, `sweep`, `calibrate`) prints rates and sizes with it, so a CPU's 8.5 GB/s is
    never '0.01 TB/s'."""
    try:
        v = float(x)  # type: ignore[arg-type]  # any object: what float() refuses is "-"
    except (TypeError, ValueError):
        return "-"
    if math.isnan(v):
        return "-"
    if math.isinf(v):
        return f"{v} {unit}"
    limit = 1 - 0.5 * 10.0 ** -digits  # 999.96 rounds to 1000: call it 1 k
    scale, prefix = next(((s, p) for s, p in _PREFIXES if abs(v) >= s * limit), (1.0, ""))
    return f"{v / scale:.{digits}g} {prefix}{unit}"


@dataclass(frozen=True)
class Sweep:
    """What `intensity_table` tabulates: the GEMMs at each of `ms` tokens in flight (the fused
    projections' with `fused`), attention at each of `ss` key lengths, under the conventions
    `causal` and `attention_bytes`."""

    ms: Sequence[int] = (1, 256)
    ss: Sequence[int] = (128, 512, 2048)
    causal: formulas.Causal = "causal"
    attention_bytes: formulas.AttentionBytes = "all"
    fused: bool = False


def intensity_table(model: ModelSpec, hardware: Hardware, sweep: Sweep | None = None) -> dict:
    """Everything `trace-roofline intensity` shows, as a JSON-ready dict."""
    sweep = sweep or Sweep()
    ms, ss, fused = sweep.ms, sweep.ss, sweep.fused
    causal, attention_bytes = sweep.causal, sweep.attention_bytes
    b = model.bytes_per_element
    peak = hardware.peak(model.dtype)
    ridge = formulas.ridge(peak, hardware.mem_bandwidth)
    linears = model.fused_linears() if fused else model.linears()
    if model.experts is not None and len(model.sparse_layers) == model.num_layers:
        # no dense MLP anywhere: its projections are the experts' (the MoE section)
        linears = {k: v for k, v in linears.items()
                   if k not in (Name.GATE_PROJ, Name.UP_PROJ, Name.DOWN_PROJ, Name.GATE_UP_PROJ)}
    gemms = [
        {
            "m": m,
            "operator": name,
            "k": k,
            "n": n,
            "bias": bias,
            "intensity": (i := formulas.gemm_intensity(m, k, n, b, bias)),
            "bound": formulas.bound(i, ridge),
        }
        for m in ms
        for name, (k, n, bias) in linears.items()
    ]
    attention = []
    for s in ss:
        row: dict[str, object] = {"s": s}
        for phase, t in (("decode", 1), ("prefill", s)):
            i = formulas.attention_intensity(formulas.AttentionShape(
                model.num_heads, model.num_kv_heads, t, s, model.head_dim, causal=causal
            ), b, attention_bytes)
            row[phase] = {"intensity": i, "bound": formulas.bound(i, ridge)}
        attention.append(row)
    return {
        "model": model.name,
        "dtype": model.dtype,
        "hardware": {
            "name": hardware.name,
            "peak_flops_per_s": peak,
            "bandwidth_bytes_per_s": hardware.mem_bandwidth,
            "ridge": ridge,
            "source": hardware.source,
        },
        "conventions": {"causal": causal, "attention_bytes": attention_bytes, "gemm_bias": "counted"},
        "gemm": gemms,
        Name.ATTENTION: attention,
        "m_star": {
            name: formulas.m_star(k, n, b, ridge, bias) for name, (k, n, bias) in linears.items()
        },
        "s_star": formulas.s_star(formulas.AttentionShape(
            model.num_heads, model.num_kv_heads, 0, 0, model.head_dim, causal=causal
        ), b, ridge, attention_bytes),
        "moe": _moe_table(model, ms, b, ridge),
    }


def _moe_table(model: ModelSpec, tokens: Sequence[int], b: float, ridge: float) -> dict | None:
    """The routed experts' GEMMs (gate_up + down of one sparse layer) at each number of tokens
    in flight: active experts (uniform-routing expectation and range), tokens per active expert,
    intensity under each count, the dense equivalent's (moe.py); and the fewest tokens at which
    the experts reach the ridge under each count. None for a dense model."""
    e = model.experts
    if e is None:
        return None
    h = model.hidden_size
    assumptions = cast("tuple[moe.Assumption, ...]", moe.ASSUMPTIONS)  # the Literal's values
    rows = []
    for t in tokens:
        active = moe.active_experts(e, t)
        by = {a: moe.experts_intensity(e, h, t, b, a) for a in assumptions}
        rows.append({
            "tokens": t, "experts_active": active.expected, "experts_active_low": active.low,
            "experts_active_high": active.high,
            "tokens_per_active_expert": moe.tokens_per_active_expert(e, t),
            "intensity": by, "bound": formulas.bound(by["expected"], ridge),
            "dense_equivalent_intensity": moe.dense_equivalent_intensity(e, h, t, b),
        })
    return {"experts": e.num_experts, "top_k": e.top_k, "intermediate": e.intermediate_size,
            "shared_intermediate": e.shared_intermediate_size, "rows": rows,
            "crossing_tokens": {a: moe.crossing_tokens(e, h, b, ridge, a)
                                for a in assumptions}}


def _regime(bound: str) -> str:
    return f"{bound}-bound"


def format_intensity(table: dict) -> str:
    """Terminal rendering of `intensity_table`, laid out like the lesson's expected output."""
    hw = table["hardware"]
    conv = table["conventions"]
    lines = [
        f"{table['model']} ({table['dtype']}) on {hw['name']}: ridge I* = {hw['ridge']:.1f} FLOP/byte"
        f"  ({si(hw['peak_flops_per_s'], 'FLOP/s')} / {si(hw['bandwidth_bytes_per_s'], 'B/s')})",
        f"hardware {hw['name']} (--hardware: no trace here to take a device from)"
        + (f": {hw['source']}" if hw.get("source") else ""),
        f"conventions: attention FLOPs {conv['causal']}, attention bytes {conv['attention_bytes']},"
        f" GEMM bias {conv['gemm_bias']}",
    ]
    for m in dict.fromkeys(g["m"] for g in table["gemm"]):
        lines += ["", f"-- GEMMs at M={m} tokens in flight --"]
        for g in (g for g in table["gemm"] if g["m"] == m):
            lines.append(
                f"  {g['operator']:<13} [{g['k']}x{g['n']}]".ljust(32)
                + f"I = {g['intensity']:8.1f} FLOP/byte  ({_regime(g['bound'])})"
            )
    lines += ["", "-- M* (smallest M that makes the GEMM compute-bound) --"]
    for name, m in table["m_star"].items():
        lines.append(f"  {name:<13} M* = {m if m is not None else 'never'}")
    lines += ["", "-- attention (GQA) --"]
    for a in table[Name.ATTENTION]:
        d, p = a["decode"], a["prefill"]
        lines.append(
            f"  S={a['s']:>5}: decode I={d['intensity']:5.1f} ({_regime(d['bound'])})  |  "
            f"prefill I={p['intensity']:8.1f} ({_regime(p['bound'])})"
        )
    s_star = table["s_star"]
    lines.append(f"  prefill S* = {s_star if s_star is not None else 'never'} (T = S)")
    if table.get("moe"):
        lines += _format_moe(table["moe"])
    return "\n".join(lines)


def _format_moe(m: dict) -> list[str]:
    lines = ["", f"-- routed experts: {m['experts']} experts, top-{m['top_k']}, expert I = "
             f"{m['intermediate']} (gate_up + down of one sparse layer; active experts expected "
             "under uniform routing, E·(1-(1-k/E)^T), range [k, min(E, T·k)]) --"]
    for r in m["rows"]:
        i = r["intensity"]
        lines.append(
            f"  tokens={r['tokens']:>6}: active {r['experts_active']:6.2f} "
            f"({r['experts_active_low']}-{r['experts_active_high']}), "
            f"{r['tokens_per_active_expert']:7.2f} tokens/expert: I = {i['expected']:7.1f} "
            f"FLOP/byte ({_regime(r['bound'])}; {i['high']:.1f}-{i['low']:.1f} over the range)"
            f"  | dense equivalent I = {r['dense_equivalent_intensity']:.1f}")
    c = m["crossing_tokens"]

    def at(v: int | None) -> str:
        return str(v) if v is not None else "never"

    lines.append(f"  experts compute-bound from {at(c['expected'])} tokens in flight (uniform "
                 f"routing; {at(c['low'])} if only top-k experts were hit, {at(c['high'])} if "
                 "every hit expert were distinct)")
    return lines
