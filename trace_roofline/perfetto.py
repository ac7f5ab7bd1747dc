"""The analysed trace as Perfetto (ui.perfetto.dev) and chrome://tracing read it, enriched.

`enriched_trace(trace, attributed, analysis)` yields the bytes of a Chrome trace JSON file: the
original file's events, in their order and byte for byte, except that every analysed kernel (the
rows of `attributed`, by `event_id` = index in traceEvents) gains `args.roofline`; the file's
other top-level keys are kept as they are. Appended to traceEvents:
- a process "trace_roofline" (its own pid, sorted first) with one thread per GPU stream (CPU
  thread for CPU-only traces), "operators · <lane>", holding one slice per operator instance: a
  maximal run of consecutive kernels of that lane with the same (operator, layer, step), from
  its first kernel's start to its last kernel's end (cut at the next instance's start, so
  slices never overlap), named after the operator, its args the instance's figures
  (`BandArgs`);
- two counter tracks per lane, "TFLOP/s" and "GB/s" (ph "C", arg key = the lane): over each
  slice, its FLOPs (bytes) spread evenly over its span, and 0 in gaps between slices, so the
  area under a counter is the lane's analytical FLOPs (bytes); uncosted kernels count 0.

A kernel's `args.roofline` (`KernelArgs`): operator, layer, step, phase, evidence (how the name
was found: annotation, module, shape, compile, position, unattributed), its op instance (the
launching cpu op's event index), the instance's shape, and `flops` / `bytes` = the kernel's
share of its op instance's analytical costs, by device time (a split-K GEMM's two kernels share
the GEMM's FLOPs in proportion to their durations; they sum to the instance's). Intensity,
% of roof and bound are therefore the op instance's, which every share has alike.

Memory: the file is streamed (gunzipped on the fly) in CHUNK-sized pieces, each cut at an event
boundary and split into zero-copy msgspec `Raw` events that are written out as they are; only
the analysed kernels are decoded and re-encoded. Peak memory beyond the analysis itself is a few
chunks plus the per-kernel and per-slice figures (figures in README.md).
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import msgspec
import numpy as np
import pandas as pd

from trace_roofline.errors import InputError
from trace_roofline.roofline import Analysis, place
from trace_roofline.trace import Trace

CATEGORY = "trace_roofline"
BATCH = 1 << 16  # added events encoded per chunk
CHUNK = 16 << 20  # bytes of the input read (and events decoded) at a time


class KernelArgs(msgspec.Struct):
    """args.roofline of a kernel event."""

    operator: str
    layer: int | None
    step: int | None
    phase: str | None
    evidence: str | None
    op_instance: int | None = msgspec.field(name="op instance")
    shape: str | None
    flops: float | None = msgspec.field(name="flops (time share)")
    bytes: float | None = msgspec.field(name="bytes (time share)")
    intensity: float | None = msgspec.field(name="intensity FLOP/B")
    pct_of_roof: float | None = msgspec.field(name="% of roof")
    bound: str | None


class BandArgs(msgspec.Struct):
    """args of an operator-instance slice."""

    operator: str
    layer: int | None
    step: int | None
    phase: str | None
    evidence: str | None
    kernels: int
    kernel_time_us: float = msgspec.field(name="kernel time µs")
    flops: float | None
    bytes: float | None
    intensity: float | None = msgspec.field(name="intensity FLOP/B")
    achieved_tflops: float | None = msgspec.field(name="achieved TFLOP/s")
    achieved_gbs: float | None = msgspec.field(name="achieved GB/s")
    pct_of_roof: float | None = msgspec.field(name="% of roof")
    bound: str | None
    uncosted_kernels: int = msgspec.field(name="uncosted kernels")


class _Slice(msgspec.Struct):
    ph: str
    cat: str
    name: str
    pid: int
    tid: int
    ts: float
    dur: float
    args: BandArgs


class _Counter(msgspec.Struct):
    ph: str
    cat: str
    name: str
    pid: int
    ts: float
    args: dict[str, float]


class _Meta(msgspec.Struct):
    ph: str
    name: str
    pid: int
    tid: int
    args: dict[str, object]


def kernel_figures(trace: Trace, attributed: pd.DataFrame, analysis: Analysis) -> pd.DataFrame:
    """One row per analysed kernel, in (lane, start) order: its lane, names, phase, evidence,
    op instance, cost shares and its instance's intensity, % of roof and bound, and `band`,
    the operator instance (slice) it belongs to."""
    k = attributed.reset_index(drop=True)
    lane = _lanes(trace, k["event_id"].to_numpy())
    c = analysis.costed.reset_index(drop=True)
    key = ["op_id", "operator", "layer", "step"]
    inst = c[c["op_id"].notna()].assign(_inst=lambda d: d.index)
    roofs = place(c.assign(operator=c.index.astype(str), layer=pd.NA), analysis.hardware)
    roofs.index = roofs["operator"].astype(int)
    out = pd.DataFrame({
        "event_id": k["event_id"].to_numpy(), "lane": lane, "ts_us": k["ts_us"].to_numpy(),
        "dur_us": k["dur_us"].to_numpy(), "operator": k["operator"].astype(object).to_numpy(),
        "layer": k["layer"].astype("Int64").to_numpy(), "step": k["step"].astype("Int64").to_numpy(),
        "op_id": k["op_id"].astype("Int64").to_numpy(), "evidence": k["evidence"].astype(object).to_numpy(),
    })
    out = out.merge(inst[[*key, "_inst"]], on=key, how="left")
    i = out["_inst"].to_numpy(dtype="float64")
    has = ~np.isnan(i)
    at = np.where(has, i, 0).astype(np.int64)

    def take(frame: pd.DataFrame, col: str) -> pd.Series:
        values = frame[col].reindex(at).to_numpy()
        return pd.Series(values, index=out.index).where(has)

    phase_of_step = c.dropna(subset=["step"]).groupby("step")["phase"].first()
    out["phase"] = take(c, "phase").fillna(out["step"].map(phase_of_step)).fillna(
        c["phase"].iloc[0] if len(c) else None)
    t, n = take(c, "time_us").astype("float64"), take(c, "kernels").astype("float64")
    share = (out["dur_us"] / t.where(t > 0)).fillna(1.0 / n)
    out["flops"] = take(c, "flops").astype("float64") * share
    out["bytes"] = take(c, "bytes").astype("float64") * share
    out["dtype"], out["shape"] = take(c, "dtype"), take(c, "shape")
    for col in ("intensity", "pct_of_roof", "bound"):
        out[col] = take(roofs, col)
    out = out.sort_values(["lane", "ts_us"], kind="stable").reset_index(drop=True)
    same = (out[["lane", "operator"]].eq(out[["lane", "operator"]].shift())).all(axis=1)
    for col in ("layer", "step"):
        same &= out[col].eq(out[col].shift()).fillna(out[col].isna() & out[col].shift().isna())
    out["band"] = np.cumsum(~same.to_numpy()) - 1
    return out.drop(columns="_inst")


def _lanes(trace: Trace, event_ids: np.ndarray) -> np.ndarray:
    """Each unit's lane label: 'GPU d stream s' for device rows, 'CPU thread t' otherwise."""
    dev = trace.device.set_index("event_id")
    cpu = trace.cpu_ops.set_index("op_id")
    on_dev = pd.Index(event_ids).isin(dev.index)
    labels = np.empty(len(event_ids), dtype=object)
    d = dev.reindex(event_ids[on_dev])
    labels[on_dev] = ("GPU " + d["device"].astype(str) + " stream " + d["stream"].astype(str)).to_numpy()
    t = cpu.reindex(event_ids[~on_dev])["tid"].astype("Int64").astype(str)
    labels[~on_dev] = ("CPU thread " + t).to_numpy()
    return labels


def bands(kernels: pd.DataFrame, analysis: Analysis) -> pd.DataFrame:
    """One row per operator instance (`kernel_figures`' band): lane, start, span (cut at the next
    band's start), names, kernel count and time, summed cost shares and the roofline figures."""
    k = kernels
    g = k.groupby("band", sort=True)
    out = g.agg(lane=("lane", "first"), ts_us=("ts_us", "min"), operator=("operator", "first"),
                layer=("layer", "first"), step=("step", "first"), phase=("phase", "first"),
                evidence=("evidence", "first"), kernels=("ts_us", "size"),
                kernel_time_us=("dur_us", "sum"))
    end = (k["ts_us"] + k["dur_us"]).groupby(k["band"]).max()
    nxt = out["ts_us"].shift(-1).where(out["lane"].eq(out["lane"].shift(-1)))
    out["dur_us"] = np.minimum(end, nxt.fillna(np.inf)) - out["ts_us"]
    costed = pd.DataFrame({"operator": k["band"].astype(str), "layer": pd.NA, "phase": k["phase"],
                           "kernels": 1, "time_us": k["dur_us"], "flops": k["flops"],
                           "bytes": k["bytes"], "dtype": k["dtype"]})
    roofs = place(costed, analysis.hardware)
    roofs.index = roofs["operator"].astype(int)
    roofs = roofs.reindex(out.index)
    for col in ("flops", "bytes", "intensity", "achieved_flops_per_s", "achieved_bytes_per_s",
                "pct_of_roof", "bound", "uncosted"):
        out[col] = roofs[col].to_numpy()
    return out.reset_index()


def _none(values: pd.Series) -> list:
    """A column as a list with missing values as None (msgspec writes null)."""
    return values.astype(object).where(values.notna(), None).tolist()


def _kernel_args(k: pd.DataFrame) -> list[KernelArgs]:
    cols = ["operator", "layer", "step", "phase", "evidence", "op_id", "shape", "flops", "bytes",
            "intensity", "pct_of_roof", "bound"]
    return list(map(KernelArgs, *(_none(k[c]) for c in cols)))


def _added_events(b: pd.DataFrame, pid: int) -> Iterator[list]:
    """Metadata, then slices and counters of the added process, in batches of bands."""
    lanes = list(dict.fromkeys(b["lane"]))
    tid = {lane: i + 1 for i, lane in enumerate(lanes)}
    yield [_Meta("M", "process_name", pid, 0, {"name": "trace_roofline"}),
           _Meta("M", "process_sort_index", pid, 0, {"sort_index": -1}),
           *(_Meta("M", "thread_name", pid, tid[lane], {"name": f"operators · {lane}"})
             for lane in lanes)]
    b = b.assign(
        tid=b["lane"].map(tid),
        tflops=(b["achieved_flops_per_s"] * 1e-12).where(b["flops"].notna()),
        gbs=(b["achieved_bytes_per_s"] * 1e-9).where(b["bytes"].notna()),
        # Counters: the band's FLOPs (bytes) over its span from its start, 0 where a gap follows.
        rate_f=(b["flops"].fillna(0.0) / b["dur_us"].where(b["dur_us"] > 0) * 1e-6).fillna(0.0),
        rate_b=(b["bytes"].fillna(0.0) / b["dur_us"].where(b["dur_us"] > 0) * 1e-3).fillna(0.0),
        end=b["ts_us"] + b["dur_us"],
    )
    b["gap"] = ~(b["ts_us"].shift(-1).eq(b["end"]) & b["lane"].shift(-1).eq(b["lane"]))
    for at in range(0, len(b), BATCH):
        yield _band_events(b.iloc[at:at + BATCH], pid)


def _band_events(b: pd.DataFrame, pid: int) -> list:
    """The slices and counter values of some bands (`_added_events`' columns)."""
    n = len(b)
    args = map(BandArgs, *(_none(b[c]) for c in (
        "operator", "layer", "step", "phase", "evidence", "kernels", "kernel_time_us", "flops",
        "bytes", "intensity", "tflops", "gbs", "pct_of_roof", "bound")),
        b["uncosted"].astype(int).tolist())
    events: list = list(map(_Slice, ["X"] * n, [CATEGORY] * n, b["operator"].tolist(), [pid] * n,
                            b["tid"].tolist(), b["ts_us"].tolist(), b["dur_us"].tolist(), args))
    gap = b[b["gap"]]
    rows = pd.concat([
        pd.DataFrame({"ts": b["ts_us"], "lane": b["lane"], "f": b["rate_f"], "b": b["rate_b"]}),
        pd.DataFrame({"ts": gap["end"], "lane": gap["lane"], "f": 0.0, "b": 0.0}),
    ]).sort_values(["lane", "ts"], kind="stable")
    for name, col in (("TFLOP/s", "f"), ("GB/s", "b")):
        m = len(rows)
        events += map(_Counter, ["C"] * m, [CATEGORY] * m, [name] * m, [pid] * m,
                      rows["ts"].tolist(),
                      [{lane: v} for lane, v in zip(rows["lane"], rows[col], strict=True)])
    return events


@contextmanager
def _open(path: str) -> Iterator[BinaryIO]:
    """The file for reading, gunzipped on the fly when it starts with the gzip magic number."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            gz = f.read(2) == b"\x1f\x8b"
            f.seek(0)
            yield gzip.GzipFile(fileobj=f, mode="rb") if gz else f
    except OSError as e:  # includes gzip.BadGzipFile and zlib errors surface as OSError/EOFError
        raise InputError(f"{p}: cannot read ({e.strerror or e})") from None
    except EOFError:
        raise InputError(f"{p}: truncated gzip stream") from None


_ARRAY_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
_SEP = re.compile(rb"\}\s*,")


class _Events:
    """traceEvents read from a file in chunks: `batches()` yields lists of `Raw` events (each
    batch one decoded chunk: memory stays near CHUNK, not the file size); `head` and `tail`
    are the top-level members before and after the array (raw JSON), `array` whether the file
    is a bare JSON array of events.

    A chunk is cut after the last `}` + `,` whose prefix decodes as a JSON array of complete
    values (a `},` inside a string or a nested object cannot: the prefix would be unbalanced),
    so events are split exactly as a full JSON parse would split them.
    """

    def __init__(self, f: BinaryIO, path: str):
        self.f, self.path = f, path
        text = b""
        while (m := _ARRAY_KEY.search(text)) is None and not text.lstrip().startswith(b"["):
            more = f.read(CHUNK)
            if not more or len(text) > 4 * CHUNK:
                raise InputError(f"{path}: no traceEvents array found")
            text += more
        self.array = m is None
        if self.array:
            self.head: dict[str, msgspec.Raw] = {}
            self.rest = text.lstrip()[1:]
        else:
            self.head = self._decode(text[:m.end()] + b"]}", dict[str, msgspec.Raw], "its head")
            self.head.pop("traceEvents")
            self.rest = text[m.end():]
        self.tail: dict[str, msgspec.Raw] = {}

    def _decode(self, text: bytes, kind, what: str):
        try:
            return msgspec.json.decode(text, type=kind)
        except msgspec.DecodeError as e:
            raise InputError(f"{self.path}: not valid trace JSON in {what} ({e})") from None

    def batches(self) -> Iterator[list[msgspec.Raw]]:
        rest = self.rest
        while more := self.f.read(CHUNK):
            rest += more
            cut = _cut(rest)
            if cut is not None:
                yield cut[1]
                rest = rest[cut[0]:].lstrip()[1:]  # past the comma
        yield self._last(rest)

    def _last(self, rest: bytes) -> list[msgspec.Raw]:
        """The events before the array's closing `]`, and the members after it."""
        end = len(rest)
        while (end := rest.rfind(b"]", 0, end)) >= 0:
            try:
                events = msgspec.json.decode(b"[" + rest[:end + 1], type=list[msgspec.Raw])
            except msgspec.DecodeError:
                continue
            after = rest[end + 1:].strip()
            if self.array:
                if after:
                    break
                return events
            self.tail = self._decode(b'{"_":0' + after, dict[str, msgspec.Raw], "its tail")
            self.tail.pop("_")
            return events
        raise InputError(f"{self.path}: traceEvents array is not closed (truncated file?)")


def _cut(text: bytes) -> tuple[int, list[msgspec.Raw]] | None:
    """The end of the last complete event in `text` that a comma follows, and the events up to
    it (see _Events); None when no such event is among the last few `},`."""
    seps = list(_SEP.finditer(text, max(len(text) - CHUNK, 0)))
    for m in reversed(seps[-8:]):
        try:
            events = msgspec.json.decode(b"[" + text[:m.start() + 1] + b"]", type=list[msgspec.Raw])
        except msgspec.DecodeError:
            continue
        return m.start() + 1, events
    return None


def _next_pid(trace: Trace) -> int:
    pids = pd.concat([trace.device["pid"], trace.cpu_ops["pid"]]).dropna()
    return int(pids.max()) + 1 if len(pids) else 1


def enriched_trace(trace: Trace, attributed: pd.DataFrame, analysis: Analysis,
                   kernels: pd.DataFrame | None = None) -> Iterator[bytes]:
    """The enriched trace file's bytes, in chunks (see the module docstring). `trace.path` is
    read again; it must be the file `attributed` (attribute.attribute(trace)) came from."""
    kernels = kernel_figures(trace, attributed, analysis) if kernels is None else kernels
    ids = kernels["event_id"].to_numpy()
    order = np.argsort(ids, kind="stable")
    made = _kernel_args(kernels)
    ids, args = ids[order], [made[i] for i in order]
    with _open(trace.path) as f:
        events = _Events(f, trace.path)
        yield b"[" if events.array else b"{" + b"".join(
            msgspec.json.encode(k) + b":" + bytes(v) + b"," for k, v in events.head.items()
        ) + b'"traceEvents":['
        start = at = 0
        for batch in events.batches():
            stop = np.searchsorted(ids, start + len(batch))
            for j in range(at, stop):  # the analysed kernels here, decoded and re-encoded
                batch[ids[j] - start] = _with_args(batch[ids[j] - start], args[j])
            if batch:
                yield (b"," if start else b"") + b",".join(batch)
            at, start = stop, start + len(batch)
        if at < len(ids):
            raise InputError(f"{trace.path}: has {start} events, the analysis refers to event "
                             f"{ids[-1]}: the file changed since it was analysed")
        for part in _added_events(bands(kernels, analysis), _next_pid(trace)):
            yield (b"," if start else b"") + msgspec.json.encode(part)[1:-1]
            start += len(part)
        yield b"]" if events.array else b"]" + b"".join(
            b"," + msgspec.json.encode(k) + b":" + bytes(v) for k, v in events.tail.items()
        ) + b"}"


def _with_args(raw: msgspec.Raw, extra: KernelArgs) -> bytes:
    """The event with args.roofline added (args created when absent, left alone when not an
    object: such an event is not enriched)."""
    event = msgspec.json.decode(raw)
    args = event.get("args")
    if args is None:
        event["args"] = {"roofline": extra}
    elif isinstance(args, dict):
        args["roofline"] = extra
    else:
        return bytes(raw)
    return msgspec.json.encode(event)
