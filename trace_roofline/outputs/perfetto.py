"""The analysed trace as Perfetto (ui.perfetto.dev) and chrome://tracing read it, enriched.

Design notes: docs/design.md ("trace_roofline/outputs/perfetto.py").
"""

from __future__ import annotations

import gzip
import io
import operator
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import msgspec
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from trace_roofline.errors import InputError
from trace_roofline.files import open_regular
from trace_roofline.roofline import Analysis
from trace_roofline.roofline.placement import main_dtype, place_rows
from trace_roofline.trace import Trace

CATEGORY = "trace_roofline"
BATCH = 1 << 16  # added events encoded per chunk
CHUNK = 16 << 20  # bytes of the input read (and events decoded) at a time


class KernelArgs(msgspec.Struct):
    """args.roofline of a kernel event (written by `_rows_json` from `kernel_figures`' columns
    of the same names)."""

    operator: str
    layer: int | None
    step: int | None
    phase: str | None
    evidence: str | None
    instance: int = msgspec.field(name="op instance")
    op_id: int | None = msgspec.field(name="cpu op")
    shape: str | None
    flops: float | None = msgspec.field(name="flops (time share)")
    bytes: float | None = msgspec.field(name="bytes (time share)")
    intensity: float | None = msgspec.field(name="intensity FLOP/B")
    pct_of_roof: float | None = msgspec.field(name="% of roof")
    bound: str | None


class BandArgs(msgspec.Struct):
    """args of an operator-instance slice (written by `_rows_json` from the columns of the
    same names)."""

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
    uncosted: int = msgspec.field(name="uncosted kernels")


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
    """One row per analysed kernel, in (lane, start) order: its lane, its op instance's row
    of `analysis.costed` (names, phase, evidence, cpu op, shape), its cost shares and its
    instance's intensity, % of roof and bound, `part` (0: `analysis`, i: `analysis.models[i -
    1]`, the model whose analysis holds its instance, in a trace of several models) and `band`,
    the operator instance (slice) it belongs to. ValueError when `analysis` was not computed
    from `attributed`."""
    parts = [analysis, *analysis.models]
    owner = np.zeros(len(attributed), dtype=np.int64)
    if len(parts) > 1:  # each kernel on its own model's analysis (its instances are its own)
        instance = attributed["instance"].to_numpy()
        owner[:] = -1
        for i, part in enumerate(parts):
            owner[np.isin(instance, part.costed["instance"].to_numpy(np.int64))] = i
        if (owner < 0).any():
            raise ValueError("`analysis` was not computed from `attributed`: their op "
                             "instances differ")
    out = pd.concat([_part_figures(trace, attributed[owner == i], part).assign(part=i)
                     for i, part in enumerate(parts)], ignore_index=True)
    out = out.sort_values(["lane", "ts_us"], kind="stable").reset_index(drop=True)
    same = (out[["lane", "operator", "part"]].eq(out[["lane", "operator", "part"]].shift())
            ).all(axis=1)
    for col in ("layer", "step"):
        same &= out[col].eq(out[col].shift()).fillna(out[col].isna() & out[col].shift().isna())
    out["band"] = np.cumsum(~same.to_numpy()) - 1
    return out


def _part_figures(trace: Trace, attributed: pd.DataFrame, analysis: Analysis) -> pd.DataFrame:
    """kernel_figures' columns but `part` and `band`, of one model's kernels and analysis."""
    c = analysis.costed.reset_index(drop=True)
    row = _costed_rows(attributed, c)
    roofs = _placed(c.assign(costed_time_us=c["time_us"].where(c["flops"].notna(), 0.0)),
                    analysis)
    dur = attributed["dur_us"].to_numpy(np.float64)
    t, n = c["time_us"].to_numpy(np.float64)[row], c["kernels"].to_numpy(np.float64)[row]
    share = np.divide(dur, t, out=1.0 / n, where=t > 0)
    out = pd.DataFrame({
        "event_id": attributed["event_id"].to_numpy(),
        "lane": _lanes(trace, attributed["event_id"].to_numpy()),
        "ts_us": attributed["ts_us"].to_numpy(np.float64), "dur_us": dur,
        "instance": attributed["instance"].to_numpy(np.int64),
        **{col: c[col].array.take(row) for col in (
            "operator", "layer", "step", "phase", "evidence", "op_id", "shape", "dtype")},
        "flops": c["flops"].to_numpy(np.float64)[row] * share,
        "bytes": c["bytes"].to_numpy(np.float64)[row] * share,
        **{col: roofs[col].array.take(row) for col in ("intensity", "pct_of_roof", "bound")},
    })
    return out


def _costed_rows(attributed: pd.DataFrame, costed: pd.DataFrame) -> np.ndarray:
    """Each attributed row's op instance (`instance`) as its row of `costed` (the row with
    that `instance`). Every instance must be there with costed's kernel count (else
    ValueError)."""
    row = pd.Index(costed["instance"].array).get_indexer(attributed["instance"].to_numpy())
    kernels = np.bincount(row + 1, minlength=len(costed) + 1)  # [0]: rows not in costed
    if kernels[0] or not np.array_equal(kernels[1:], costed["kernels"].to_numpy()):
        raise ValueError("`analysis` was not computed from `attributed`: their op instances "
                         "differ")
    return row


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
    """One row per operator instance (`kernel_figures`' band, a run of its rows in its order):
    lane, start, span (cut at the next band's start), names, kernel count and time, summed
    cost shares and the roofline figures."""
    k = kernels
    first = np.flatnonzero(k["band"].diff().ne(0).to_numpy())  # each band's first kernel
    out = k.iloc[first][["band", "lane", "ts_us", "operator", "layer", "step", "phase",
                         "evidence", "part"]].reset_index(drop=True)
    out["kernels"] = np.diff(np.append(first, len(k)))
    out["kernel_time_us"] = np.add.reduceat(k["dur_us"].to_numpy(), first)
    end = np.maximum.reduceat((k["ts_us"] + k["dur_us"]).to_numpy(), first)
    nxt = out["ts_us"].shift(-1).where(out["lane"].eq(out["lane"].shift(-1)))
    out["dur_us"] = np.minimum(end, nxt.fillna(np.inf)) - out["ts_us"]
    costed = k["flops"].notna().to_numpy()
    n = np.add.reduceat(costed.astype(np.int64), first)
    out["uncosted"] = out["kernels"] - n
    for col in ("flops", "bytes"):  # NaN without a costed kernel, as roofline.place sums
        total = np.add.reduceat(np.nan_to_num(k[col].to_numpy(np.float64)), first)
        out[col] = np.where(n > 0, total, np.nan)
    out["costed_time_us"] = np.add.reduceat(np.where(costed, k["dur_us"], 0.0), first)
    lead = k[costed].sort_values(["band", "flops", "bytes"], ascending=[True, False, False],
                                 kind="stable").drop_duplicates("band")  # most FLOPs: its dtype
    out["dtype"] = out["band"].map(lead.set_index("band")["dtype"])
    cols = ["intensity", "achieved_flops_per_s", "achieved_bytes_per_s", "pct_of_roof", "bound"]
    parts = [analysis, *analysis.models]
    placed = [_placed(out[out["part"] == i], part) for i, part in enumerate(parts)]
    roofs = placed[0][cols] if len(placed) == 1 else pd.concat([p[cols] for p in placed])
    roofs = roofs.sort_index()  # (each band under its own model's roof and main dtype)
    for col in cols:
        out[col] = roofs[col].to_numpy()
    return out


def _placed(rows: pd.DataFrame, analysis: Analysis) -> pd.DataFrame:
    """Each row (one op instance or slice: operator, dtype, flops, bytes, costed_time_us) on
    the roofline as roofline.place places an operator: intensity, achieved FLOP/s and B/s,
    % of roof and bound (collectives under the link roof), the analysis's main dtype ruling
    the peak of the rest."""
    costed = rows["flops"].notna()
    secs = rows["costed_time_us"].where(rows["costed_time_us"] > 0) * 1e-6
    ops = pd.DataFrame({
        "operator": rows["operator"], "dtype": rows["dtype"].where(costed),
        "flops": rows["flops"], "bytes": rows["bytes"],
        "intensity": rows["flops"] / rows["bytes"].where(rows["bytes"] > 0),
        "achieved_flops_per_s": rows["flops"] / secs, "achieved_bytes_per_s": rows["bytes"] / secs,
    })
    return place_rows(ops, analysis.hardware, main_dtype(analysis.costed))


def _added_events(b: pd.DataFrame, pid: int) -> Iterator[bytes]:
    """The added process's events as JSON text (comma-separated, no brackets): metadata, then
    slices and counters in batches of bands."""
    lanes = pd.unique(b["lane"]).tolist()
    tid = {lane: i + 1 for i, lane in enumerate(lanes)}
    yield msgspec.json.encode([
        _Meta("M", "process_name", pid, 0, {"name": "trace_roofline"}),
        _Meta("M", "process_sort_index", pid, 0, {"sort_index": -1}),
        *(_Meta("M", "thread_name", pid, tid[lane], {"name": f"operators · {lane}"})
          for lane in lanes)])[1:-1]
    b = b.assign(
        tid=b["lane"].map(tid),
        achieved_tflops=(b["achieved_flops_per_s"] * 1e-12).where(b["flops"].notna()),
        achieved_gbs=(b["achieved_bytes_per_s"] * 1e-9).where(b["bytes"].notna()),
        uncosted=b["uncosted"].astype(np.int64),
        # Counters: the band's FLOPs (bytes) over its span from its start, 0 where a gap follows.
        rate_f=(b["flops"].fillna(0.0) / b["dur_us"].where(b["dur_us"] > 0) * 1e-6).fillna(0.0),
        rate_b=(b["bytes"].fillna(0.0) / b["dur_us"].where(b["dur_us"] > 0) * 1e-3).fillna(0.0),
        end=b["ts_us"] + b["dur_us"],
    )
    b["gap"] = ~(b["ts_us"].shift(-1).eq(b["end"]) & b["lane"].shift(-1).eq(b["lane"]))
    for at in range(0, len(b), BATCH):
        yield _band_events(b.iloc[at:at + BATCH], pid)


def _band_events(b: pd.DataFrame, pid: int) -> bytes:
    """The slices, then the TFLOP/s and GB/s counter values, of some bands (`_added_events`'
    columns), as JSON text built column by column."""
    slices = _rows_json(_Slice, {"ph": "X", "cat": CATEGORY, "name": b["operator"], "pid": pid,
                                 "tid": b["tid"], "ts": b["ts_us"], "dur": b["dur_us"],
                                 "args": _rows_json(BandArgs, b)})
    gap = b[b["gap"]]
    rows = pd.concat([
        pd.DataFrame({"ts": b["ts_us"], "lane": b["lane"], "f": b["rate_f"], "b": b["rate_b"]}),
        pd.DataFrame({"ts": gap["end"], "lane": gap["lane"], "f": 0.0, "b": 0.0}),
    ]).sort_values(["lane", "ts"], kind="stable")
    lane = _json_column(rows["lane"])
    counters = [_rows_json(_Counter, {
        "ph": "C", "cat": CATEGORY, "name": name, "pid": pid, "ts": rows["ts"],
        "args": pc.binary_join_element_wise(b"{", lane, b":", _json_column(rows[col]), b"}", b""),
    }) for name, col in (("TFLOP/s", "f"), ("GB/s", "b"))]
    return b",".join(_joined(part) for part in (slices, *counters))


@contextmanager
def _open(path: str) -> Iterator[io.BufferedIOBase]:
    """The file for reading, gunzipped on the fly when it starts with the gzip magic number."""
    p = Path(path)
    try:
        with open_regular(p) as f:
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

    def __init__(self, f: io.BufferedIOBase, path: str):
        self.f, self.path = f, path
        text = b""
        while (m := _ARRAY_KEY.search(text)) is None and not text.lstrip().startswith(b"["):
            more = f.read(CHUNK)
            if not more or len(text) > 4 * CHUNK:
                raise InputError(f"{path}: no traceEvents array found")
            text += more
        self.array = m is None
        if m is None:
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
    it (see _Events); None when no such event is among the last few `},`. (Searched from the
    end in growing windows: a chunk holds millions of `},`, only the last few matter.)"""
    low, window = max(len(text) - CHUNK, 0), 1 << 16
    while len(seps := list(_SEP.finditer(text, max(len(text) - window, low)))) < 8:
        if len(text) - window <= low:
            break
        window <<= 4
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


def enriched_trace(trace: Trace, attributed: pd.DataFrame, analysis: Analysis) -> Iterator[bytes]:
    """The enriched trace file's bytes, in chunks (see the module docstring). `trace.path` is
    read again; it must be the file `attributed` (pipeline.attribute_trace's table, from which
    `analysis` was computed) came from."""
    kernels = kernel_figures(trace, attributed, analysis)
    by_event = kernels.sort_values("event_id", kind="stable")
    ids = by_event["event_id"].to_numpy()
    with _open(trace.path) as f:
        events = _Events(f, trace.path)
        yield b"[" if events.array else b"{" + b"".join(
            msgspec.json.encode(k) + b":" + bytes(v) + b"," for k, v in events.head.items()
        ) + b'"traceEvents":['
        start = at = 0
        for batch in events.batches():
            stop = int(np.searchsorted(ids, start + len(batch)))
            if batch:
                yield (b"," if start else b"") + _enriched(
                    batch, ids[at:stop] - start, by_event.iloc[at:stop])
            at, start = stop, start + len(batch)
        if at < len(ids):
            raise InputError(f"{trace.path}: has {start} events, the analysis refers to event "
                             f"{ids[-1]}: the file changed since it was analysed")
        for part in _added_events(bands(kernels, analysis), _next_pid(trace)):
            yield (b"," if start else b"") + part
            start += 1
        yield b"]" if events.array else b"]" + b"".join(
            b"," + msgspec.json.encode(k) + b":" + bytes(v) for k, v in events.tail.items()
        ) + b"}"


class _ArgsOf(msgspec.Struct):
    """An event's `args` as it is written (empty when the event has none)."""

    args: msgspec.Raw = msgspec.Raw(b"")


_WS = np.zeros(256, dtype=bool)
_WS[list(b" \t\n\r")] = True
MAX_WS = 64  # whitespace run skipped between an event's last tokens; longer: decoded instead
_ARGS = operator.attrgetter("args")
_ARGS_KEY = np.frombuffer(b'"args"', np.uint8)
_ROOFLINE_KEY = b'"roofline"'
_OPEN, _CLOSE, _COLON, _BACKSLASH = b"{}:\\"
# What goes around a kernel's args.roofline object, by where it is spliced in (_places).
_AROUND = [(b',"roofline":', b""), (b'"roofline":', b""), (b',"args":{"roofline":', b"}"),
           (b'"args":{"roofline":', b"}")]


def _enriched(batch: Sequence[msgspec.Raw | bytes], local: np.ndarray, kernels: pd.DataFrame) -> bytes:
    """The events of `batch` joined by commas, those at `local` (ascending) with the
    args.roofline of `kernels`' rows (one per event, in that order)."""
    text = b",".join(batch)
    if not len(local):
        return text
    lens = np.fromiter(map(len, batch), np.int64, len(batch))
    starts = np.cumsum(lens + 1) - lens - 1  # of each event in text
    mine = np.fromiter(batch, object, len(batch))[local]
    heads = msgspec.json.decode(b"[" + b",".join(mine) + b"]", type=list[_ArgsOf])
    args = list(map(_ARGS, heads))
    buf = np.frombuffer(text, np.uint8)
    offset, around = _places(buf, starts[local], lens[local], args)
    if _ROOFLINE_KEY in text:  # enriched before? Those events are decoded and re-encoded
        found = [m.start() for m in re.finditer(re.escape(_ROOFLINE_KEY), text)]
        ev = np.searchsorted(starts[local], found, side="right") - 1
        inside = (ev >= 0) & (found < (starts + lens)[local][np.maximum(ev, 0)])
        around[ev[inside]] = -1
    texts = _rows_json(KernelArgs, kernels)
    odd = np.flatnonzero(around < 0)
    if len(odd):  # a layout the splice does not handle: decode and re-encode those alone
        batch = list(batch)
        for j in odd.tolist():
            batch[local[j]] = _with_args(mine[j], texts[j].as_py())
        return _enriched(batch, local[around >= 0], kernels.iloc[np.flatnonzero(around >= 0)])
    pieces = np.array(_AROUND, dtype=object)[around]
    inserts = pc.binary_join_element_wise(pa.array(pieces[:, 0], pa.binary()), texts,
                                          pa.array(pieces[:, 1], pa.binary()), b"")
    return _splice(buf, starts[local] + offset, inserts)


def _places(buf: np.ndarray, start: np.ndarray, length: np.ndarray, args: list[msgspec.Raw]
            ) -> tuple[np.ndarray, np.ndarray]:
    """Where each event (`buf[start:start + length]`, its raw `args` given) takes its
    args.roofline, as (offset in the event, index into _AROUND), index -1 where the splice
    cannot place it. Spliced: right before the closing brace of `args` when `args` is an
    object and the event's last member (its very text ends the event, after the key "args"),
    else, without `args`, before the event's closing brace."""
    end = start + length - 1  # the event's closing brace
    size = np.fromiter(map(len, args), np.int64, len(args))
    has = size > 0
    last = _back(buf, end - 1, start)  # the last member's last byte
    close = np.where(has, last, end)  # where it goes
    first = close - size + 1  # where args starts, if it is the last member
    at = np.clip(first, start, end)
    colon = _back(buf, np.maximum(at - 1, start), start)
    key = _back(buf, np.maximum(colon - 1, start), start)  # the key's closing quote
    word = buf[np.clip(key - 5, start, end)[:, None] + np.arange(len(_ARGS_KEY))]
    fits = (has & (buf[last] == _CLOSE) & (first > start) & (buf[at] == _OPEN)
            & (buf[colon] == _COLON) & (key - 6 >= start) & (word == _ARGS_KEY).all(axis=1)
            & (buf[np.maximum(key - 6, start)] != _BACKSLASH) & _same(buf, first, args))
    before = _back(buf, close - 1, start)  # the byte before it: `{` when nothing is there
    empty = (buf[before] == _OPEN).astype(np.int64)
    around = np.where(has, np.where(fits, empty, -1), 2 + empty)
    around[_WS[buf[last]] | _WS[buf[before]]] = -1  # whitespace runs longer than MAX_WS
    return close - start, around


def _back(buf: np.ndarray, at: np.ndarray, floor: np.ndarray) -> np.ndarray:
    """The last non-whitespace position <= `at` (not below `floor`), skipping at most MAX_WS
    bytes (a longer run: a position on whitespace)."""
    at = at.copy()
    for _ in range(MAX_WS):
        ws = _WS[buf[at]] & (at > floor)
        if not ws.any():
            break
        at[ws] -= 1
    return at


def _same(buf: np.ndarray, first: np.ndarray, texts: list[msgspec.Raw]) -> np.ndarray:
    """Whether `buf` holds each of `texts` at its `first` (out of range: False)."""
    size = np.fromiter(map(len, texts), np.int64, len(texts))
    want = np.frombuffer(b"".join(texts), np.uint8)
    ok = (first >= 0) & (first + size <= len(buf))
    at = np.repeat(np.where(ok, first, 0) - (np.cumsum(size) - size), size) + np.arange(len(want))
    wrong = np.flatnonzero(buf[np.minimum(at, len(buf) - 1)] != want)
    ok[np.searchsorted(np.cumsum(size), wrong, side="right")] = False
    return ok


def _rows_json(struct: type[msgspec.Struct], columns: Mapping[str, object]) -> pa.BinaryArray:
    """Each row as `struct`'s JSON text, built column by column from `columns` (by field
    name; a DataFrame will do): a Series is encoded per row (`_json_column`), a pyarrow binary
    array is JSON text already, any other value is every row's. The same bytes as
    `msgspec.json.encode(struct(...))` of the row."""
    pieces: list = []
    text = b"{"
    for i, f in enumerate(msgspec.structs.fields(struct)):
        text += (b"," if i else b"") + msgspec.json.encode(f.encode_name) + b":"
        value = columns[f.name]
        if isinstance(value, pd.Series):
            value = _json_column(value)
        if isinstance(value, pa.Array):
            pieces += [text, value]
            text = b""
        else:
            text += msgspec.json.encode(value)
    return pc.binary_join_element_wise(*pieces, text + b"}", b"")


def _joined(texts: pa.BinaryArray) -> bytes:
    """The texts joined by commas."""
    _, data = _buffers(pc.binary_join_element_wise(texts, b",", b""))
    return data[:-1].tobytes()


def _buffers(texts: pa.BinaryArray) -> tuple[np.ndarray, np.ndarray]:
    """A binary array's offsets and its bytes (numpy views of its buffers)."""
    offsets = np.frombuffer(texts.buffers()[1], np.int32)[texts.offset:
                                                         texts.offset + len(texts) + 1]
    return offsets, np.frombuffer(texts.buffers()[2], np.uint8)[offsets[0]:offsets[-1]]


def _json_column(values: pd.Series) -> pa.BinaryArray:
    """The JSON text of each value (null where missing)."""
    if pd.api.types.is_float_dtype(values):  # (msgspec writes NaN as null)
        listed = values.to_numpy(np.float64, na_value=np.nan).tolist()
    elif pd.api.types.is_integer_dtype(values):
        listed = values.to_numpy(object, na_value=None).tolist()
    else:  # strings: each distinct one encoded once
        code, uniques = pd.factorize(values)
        texts = pa.array([*map(msgspec.json.encode, uniques.tolist()), b"null"], pa.binary())
        return texts.take(np.where(code < 0, len(uniques), code))
    numbers = msgspec.json.encode(listed)[1:-1]  # no commas inside a number
    return pc.split_pattern(pa.array([numbers] if listed else [], pa.large_binary()),
                            b",").flatten().cast(pa.binary())


def _splice(buf: np.ndarray, at: np.ndarray, inserts: pa.BinaryArray) -> bytes:
    """`buf` with inserts[i] placed before byte at[i] (`at` ascending)."""
    offsets, data = _buffers(inserts)
    out = np.empty(len(buf) + len(data), np.uint8)
    placed = np.repeat(at, np.diff(offsets)) + np.arange(len(data))
    keep = np.ones(len(out), dtype=bool)
    keep[placed] = False
    out[placed] = data
    out[keep] = buf
    return out.tobytes()


def _with_args(raw: msgspec.Raw, extra: bytes) -> bytes:
    """The event with args.roofline (JSON text `extra`) added or replaced (args created when
    absent or null, left alone when not an object: such an event is not enriched)."""
    event = msgspec.json.decode(raw)
    args = event.get("args")
    if args is None:
        event["args"] = {"roofline": msgspec.Raw(extra)}
    elif isinstance(args, dict):
        args["roofline"] = msgspec.Raw(extra)
    else:
        return bytes(raw)
    return msgspec.json.encode(event)
