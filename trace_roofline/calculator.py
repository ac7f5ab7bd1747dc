"""Shape-only intensity calculator: per-projection GEMM and attention intensity, regimes, M* and S*."""

from __future__ import annotations

from collections.abc import Sequence

from trace_roofline import costs
from trace_roofline.hardware import Hardware
from trace_roofline.models import ModelSpec


def intensity_table(
    model: ModelSpec,
    hardware: Hardware,
    ms: Sequence[int] = (1, 256),
    ss: Sequence[int] = (128, 512, 2048),
    causal: costs.Causal = "causal",
    attention_bytes: costs.AttentionBytes = "all",
    fused: bool = False,
) -> dict:
    """Everything `trace-roofline intensity` shows, as a JSON-ready dict."""
    b = model.bytes_per_element
    peak = hardware.peak(model.dtype)
    ridge = costs.ridge(peak, hardware.mem_bandwidth)
    linears = model.fused_linears() if fused else model.linears()
    gemms = [
        {
            "m": m,
            "operator": name,
            "k": k,
            "n": n,
            "bias": bias,
            "intensity": (i := costs.gemm_intensity(m, k, n, b, bias)),
            "bound": costs.bound(i, ridge),
        }
        for m in ms
        for name, (k, n, bias) in linears.items()
    ]
    attention = []
    for s in ss:
        row: dict[str, object] = {"s": s}
        for phase, t in (("decode", 1), ("prefill", s)):
            i = costs.attention_intensity(
                model.num_heads, model.num_kv_heads, t, s, model.head_dim, b, causal, attention_bytes
            )
            row[phase] = {"intensity": i, "bound": costs.bound(i, ridge)}
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
        "attention": attention,
        "m_star": {
            name: costs.m_star(k, n, b, ridge, bias) for name, (k, n, bias) in linears.items()
        },
        "s_star": costs.s_star(
            model.num_heads, model.num_kv_heads, model.head_dim, b, ridge, causal, attention_bytes
        ),
    }


def _regime(bound: str) -> str:
    return f"{bound}-bound"


def format_intensity(table: dict) -> str:
    """Terminal rendering of `intensity_table`, laid out like the lesson's expected output."""
    hw = table["hardware"]
    conv = table["conventions"]
    lines = [
        f"{table['model']} ({table['dtype']}) on {hw['name']}: ridge I* = {hw['ridge']:.1f} FLOP/byte"
        f"  ({hw['peak_flops_per_s'] / 1e12:.1f} TFLOP/s / {hw['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s)",
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
    for a in table["attention"]:
        d, p = a["decode"], a["prefill"]
        lines.append(
            f"  S={a['s']:>5}: decode I={d['intensity']:5.1f} ({_regime(d['bound'])})  |  "
            f"prefill I={p['intensity']:8.1f} ({_regime(p['bound'])})"
        )
    s_star = table["s_star"]
    lines.append(f"  prefill S* = {s_star if s_star is not None else 'never'} (T = S)")
    return "\n".join(lines)
