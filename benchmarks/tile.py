"""Tile a real trace in time to a target size, keeping every join one-to-one.

Copy k of the source's events is shifted by k * span in time and by k * id_span in every id that
links events (External id, correlation, flow id, Python id / parent id), so copies never collide:
kernels still find exactly one launch, one cpu op and one flow pair. Metadata events (ph "M")
and the profiler's own span events (cat "Trace", ph "i") are written once.

The file is written in Kineto's layout (one key per line, args inline) so bytes per event stay
close to the source's; both figures are reported.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from pathlib import Path

_ID_ARGS = ("External id", "external id", "correlation", "Python id", "Python parent id")
_STEP = re.compile(r"ProfilerStep#(\d+)$")


def _load(path: Path) -> tuple[dict, int]:
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    doc = json.loads(data)
    return (doc if isinstance(doc, dict) else {"traceEvents": doc}), len(data)


def _int(v) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def _spans(events: list[dict]) -> tuple[float, int, int]:
    """Time span of the events (plus a gap), one more than the largest linking id, and the
    number of profiler steps (so copy k renumbers ProfilerStep#N to N + k * steps)."""
    t0, t1, top, steps = float("inf"), float("-inf"), 0, set()
    for e in events:
        m = _STEP.match(str(e.get("name", "")))
        if m:
            steps.add(int(m.group(1)))
        ts = e.get("ts")
        if isinstance(ts, (int, float)) and e.get("ph") != "M":
            t0 = min(t0, ts)
            t1 = max(t1, ts + (e.get("dur") or 0))
        top = max(top, _int(e.get("id")))
        args = e.get("args") or {}
        for k in _ID_ARGS:
            top = max(top, _int(args.get(k)))
    n_steps = max(steps) - min(steps) + 1 if steps else 0
    return (t1 - t0) + 1000.0, top + 1, n_steps


def _render(e: dict, dumps) -> str:
    lines = ",\n    ".join(f"{json.dumps(k)}: {dumps(v)}" for k, v in e.items())
    return "  {\n    " + lines + "\n  }"


def _shift(e: dict, k: int, span: float, id_span: int, n_steps: int) -> dict:
    out = dict(e)
    m = _STEP.match(str(e.get("name", "")))
    if m and n_steps:
        out["name"] = f"ProfilerStep#{int(m.group(1)) + k * n_steps}"
    if isinstance(e.get("ts"), (int, float)):
        out["ts"] = e["ts"] + k * span
    if _int(e.get("id")):
        out["id"] = e["id"] + k * id_span
    args = e.get("args")
    if isinstance(args, dict):
        a = dict(args)
        for key in _ID_ARGS:
            if _int(a.get(key)) > 0:
                a[key] = a[key] + k * id_span
        out["args"] = a
    return out


def tile(src: Path, dst: Path, target_bytes: int) -> dict:
    """Write `dst` (uncompressed JSON) of about `target_bytes`; return a summary dict."""
    try:
        import orjson

        def dumps(v):
            return orjson.dumps(v).decode()
    except ImportError:  # pragma: no cover - orjson only speeds the writer up
        dumps = json.dumps
    doc, src_bytes = _load(src)
    events = doc.pop("traceEvents")
    once = [e for e in events if e.get("ph") in ("M", "i") or e.get("cat") == "Trace"]
    body = [e for e in events if not (e.get("ph") in ("M", "i") or e.get("cat") == "Trace")]
    span, id_span, n_steps = _spans(body)
    body_bytes = sum(len(_render(e, dumps)) + 2 for e in body)
    copies = max(1, round(target_bytes / max(body_bytes, 1)))
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".tmp")
    n = 0
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("{\n")
        for key, val in doc.items():
            f.write(f"  {json.dumps(key)}: {json.dumps(val)},\n")
        f.write('  "traceEvents": [\n')
        first = True
        for e in once:
            f.write(("" if first else ",\n") + _render(e, dumps))
            first, n = False, n + 1
        for k in range(copies):
            for e in body:
                f.write(("" if first else ",\n") + _render(_shift(e, k, span, id_span, n_steps), dumps))
                first, n = False, n + 1
        f.write("\n  ]\n}\n")
    os.replace(tmp, dst)
    return {"copies": copies, "events": n, "bytes": dst.stat().st_size,
            "bytes_per_event": round(dst.stat().st_size / max(n, 1), 1),
            "source_bytes_per_event": round(src_bytes / max(len(events), 1), 1)}
