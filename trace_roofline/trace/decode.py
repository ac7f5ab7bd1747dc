"""Bytes -> event columns. The events array is cut at proven boundaries into batches, each read
in place by the compiled scanner (`_scan.c`, through `Accumulator.scan`: batches of about
SCAN_BATCH_BYTES) or, where it declines or is not built, decoded as a JSON array of GC-free
msgspec Structs carrying only the fields columns.py reads (the C decoder skips everything else
in an event; batches of about BATCH_BYTES). Both give the same columns. Shape arrays (`Input
Dims`, `Input type`, `Input Strides`, `Concrete Inputs`) stay raw JSON text. A plain file is
read as it is decoded, through a `read.Window` (one reused buffer): the whole text is never in
memory at once.

Design notes: docs/design.md ("trace_roofline/trace/decode.py").
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import msgspec
import numpy as np

from trace_roofline.errors import InputError
from trace_roofline.trace.columns import Accumulator, as_int
from trace_roofline.trace.fields import ARGS, EVENT, INT_KINDS, Field
from trace_roofline.trace.read import Buffer, Document, Window
from trace_roofline.trace.schema import MISSING, Progress

BATCH_BYTES = 1 << 20  # bytes of events per batch: bounds live Python objects
SCAN_BATCH_BYTES = 4 << 20  # ... when the compiled scanner reads them (no Python objects per event)
BATCH_EVENTS = 4096  # events per batch when the document is read as Raw slices
_RETRIES = 8  # batch ends tried before giving a span up as not valid JSON
SEARCH_BYTES = 1 << 20  # how far from the document's ends the events' bounds are looked for
HEAD_BYTES = SEARCH_BYTES + 3  # (and a byte-order mark)
_WS = rb"[ \t\n\r]*"
CUT = re.compile(rb"\}(" + _WS + rb"," + _WS + rb")\{")  # a boundary between two events
_END = re.compile(rb"\}" + _WS + rb"\]")  # the last event and the array's closing bracket
_EVENTS_KEY = re.compile(rb'"traceEvents"' + _WS + rb":" + _WS + rb"\[")

# Typed structs holding only the fields we read (fields.py), derived from it. Missing ints
# decode to MISSING.
_I64 = Annotated[int, msgspec.Meta(ge=MISSING + 1, le=2**63 - 1)]
_NO_RAW = msgspec.Raw()
_TYPES: dict[str, tuple[Any, Any]] = {  # kind -> (type, default)
    "str": (str | None, None),
    "float": (float, math.nan),
    "int": (_I64, MISSING),
    "int|null": (_I64 | None, MISSING),
    "int|str": (_I64 | str, MISSING),
    "int|str|null": (_I64 | str | None, MISSING),
    "raw": (msgspec.Raw, _NO_RAW),
}


def _struct(name: str, declared: tuple[Field, ...], types: dict[str, tuple[Any, Any]],
            frozen: bool = False) -> Any:
    """A GC-free msgspec Struct type of the `declared` fields whose kind `types` maps."""
    spec = [(f.attr, types[f.kind][0], msgspec.field(default=types[f.kind][1], name=f.key))
            for f in declared if f.kind in types]
    return msgspec.defstruct(name, spec, gc=False, frozen=frozen)


_Args = _struct("_Args", ARGS, _TYPES, frozen=True)
_Event = _struct("_Event", EVENT, {**_TYPES, "args": (_Args, _Args())})
# Retry shape for an event with malformed args or ids: keep its timing, drop its links. Only
# what defines the event (ph, cat, name, ts, dur) must be well typed; ints that are not
# integers (or strings of one) end up <NA> (`as_int`, applied at once, so that the columns
# only ever see ints, strings and None).
_EventLenient = _struct("_EventLenient", EVENT, {**_TYPES, **{k: (Any, None) for k in INT_KINDS}})
_LENIENT_INTS = [f.attr for f in EVENT if f.kind in INT_KINDS]


class _Top(msgspec.Struct, gc=False):
    traceEvents: list[msgspec.Raw] | None = None  # the JSON key


_TOP_EVENTS = msgspec.json.Decoder(_Top)
TOP = msgspec.json.Decoder(dict[str, msgspec.Raw])
RAW_LIST = msgspec.json.Decoder(list[msgspec.Raw])
_BATCH = msgspec.json.Decoder(list[_Event])  # type: ignore[valid-type]  # (a type made at import)
_ONE = msgspec.json.Decoder(_Event)
_ONE_LENIENT = msgspec.json.Decoder(_EventLenient)

_JSON_KINDS = {ord("["): "an array", ord("{"): "an object", ord('"'): "a string",
               ord("t"): "a boolean", ord("f"): "a boolean", ord("n"): "null"}
_JSON_LITERALS = {ord("t"): b"true", ord("f"): b"false", ord("n"): b"null"}
_PLACEHOLDER = _Event()


def decode_spans(doc: Document, progress: Progress | None) -> tuple[dict, int, Accumulator] | None:
    """(metadata, event count, columns) of the whole document, read batch by batch through a
    Window (see the module docstring), in this process; None if its layout or a batch is not
    proven (then `decode_raw` reads it)."""
    bounds = document_bounds(doc)
    if not bounds:
        return None
    start, end, meta = bounds
    acc = Accumulator()
    with doc.window(start - 1) as w:
        n = parse_span(Reading(doc.path, w, acc, progress), start, end)
    return None if n is None else (meta, n, acc)


def document_bounds(doc: Document) -> tuple[int, int, dict] | None:
    """`events_bounds` of a document, from its first and last bytes."""
    tail_at = max(doc.size - SEARCH_BYTES, 0)
    return events_bounds(doc.read(0, HEAD_BYTES), doc.read(tail_at, SEARCH_BYTES), tail_at)


def decode_raw(p: Path, buf: Buffer, progress: Progress | None) -> tuple[dict, int, Accumulator]:
    """(metadata, event count, columns) of the whole document in `buf` (our private copy: it is
    patched in place while decoding), read the Raw way; its errors are the ones reported."""
    try:
        meta, raws = _split_top(p, buf)  # zero-copy slices of buf, one per event
    except msgspec.DecodeError as e:
        raise InputError(f"{p}: {_why(e)}") from None
    except RecursionError:
        raise InputError(f"{p}: JSON nested too deeply") from None
    acc = Accumulator()
    parse_events(p, buf, raws, acc, progress)
    return meta, len(raws), acc


def events_bounds(head, tail, tail_at: int) -> tuple[int, int, dict] | None:
    """(start, end, metadata) of a document from its first HEAD_BYTES (`head`) and its last
    SEARCH_BYTES (`tail`, from offset `tail_at`): its events array's content is bytes
    [start, end) (byte start - 1 is its '[', byte end its ']'), the keys around it decoded;
    None if not proven."""
    a = events_start(head, len(head))
    q = events_end(tail, max(a[0] + 1 - tail_at, 0)) if a else None
    if a is None or q is None or (a[1] is None) != q[1]:
        return None
    try:
        meta = meta_around(a[1], tail[q[0] + 1 :])
    except (msgspec.DecodeError, RecursionError):
        return None
    return a[0] + 1, tail_at + q[0], meta


def meta_around(head: bytes | None, tail) -> dict:
    """The metadata of a document from the bytes before its events' '[' (None: the document
    is a top-level array of events) and after their ']'; raises msgspec.DecodeError."""
    if head is None:
        return {"device_properties": []}
    return top_meta(TOP.decode(head + b"[]" + bytes(tail)))


def events_start(buf, stop: int) -> tuple[int, bytes | None] | None:
    """(offset of the '[' opening traceEvents, the document's bytes before it) for an object
    document, (offset of '[', None) for a top-level array of events; None if not proven before
    offset `stop`."""
    bom = 3 if buf[:3] == b"\xef\xbb\xbf" else 0
    kind = json_kind(memoryview(buf)[bom:])
    if kind == "an array":
        return buf.index(b"[", bom), None
    if kind != "an object":
        return None
    m = _EVENTS_KEY.search(buf, bom, min(stop, bom + SEARCH_BYTES))
    if m is None:
        return None
    a = m.end() - 1
    head = bytes(buf[bom:a])
    try:  # the bytes before the '[' are an object whose last key is traceEvents
        top = TOP.decode(head + b"[]}")
    except (msgspec.DecodeError, RecursionError):
        return None
    return (a, head) if list(top)[-1] == "traceEvents" else None


def events_end(buf, d: int) -> tuple[int, bool] | None:
    """(offset of the ']' closing traceEvents, whether the document is a top-level array): the
    first '}' ']' in the last SEARCH_BYTES (and after offset `d`) after which the rest of the
    file is whitespace (an array document) or the rest of an object without another
    traceEvents key."""
    lo = max(d, len(buf) - SEARCH_BYTES)
    for m in list(_END.finditer(buf, lo))[-16:]:  # lowest first
        q = m.end() - 1
        tail = bytes(buf[q + 1 :])
        if not tail.strip(b" \t\n\r"):
            return q, True
        try:
            rest = TOP.decode(b'{"_":0' + tail)
        except (msgspec.DecodeError, RecursionError):
            continue
        if "traceEvents" not in rest:
            return q, False
    return None


@dataclass(frozen=True)
class Reading:
    """How a span of events is read: the document's `path` (named in errors), the window `w`
    its bytes come through, the columns `acc` they go to, and the optional `progress` and
    `claim` (see parse_span)."""

    path: Path
    w: Window
    acc: Accumulator
    progress: Progress | None = None
    claim: Callable[[int, int], int] | None = None


def parse_span(r: Reading, start: int, end: int) -> int | None:
    """Decode the events in document bytes [start, end) (a JSON array's content: separators,
    or the array's own brackets, at bytes start - 1 and end), read through `r.w`, batch by
    batch into `r.acc`, numbering them from 0; the number of events, or None when some batch
    is not valid JSON, holds an event the decoder rejects or is cut short (the caller then
    reads the document the Raw way, for its one true error). A batch ends at the first CUT
    BATCH_BYTES or more past its start; when that range does not decode (a CUT inside an
    event: in a string, or an array of objects in its args), at the first CUT BATCH_BYTES or
    more further, up to _RETRIES times. `r.claim(stop, after)`, when given, is asked for each
    batch's bytes before they are decoded (up to the separator at `stop`, the next event at
    `after`) and answers where the span ends now: `stop`, or less where another process has
    the rest (parallel.Claims); the span, and this batch, then end there."""
    w, claim, progress = r.w, r.claim, r.progress
    pos, n, total = start, 0, end - start
    step = BATCH_BYTES if r.acc.scanner is None else SCAN_BATCH_BYTES
    while pos < end:
        stop = pos
        for _ in range(_RETRIES):
            cut = w.search(CUT, min(stop + step, end), end, pos - 1)
            stop, after = cut or (end, end)
            if claim is not None and (ends := claim(stop, after)) < stop:
                end = stop = after = ends
            if stop <= pos:  # (claimed by the other process, up to here)
                return n
            got = _read_range(r, pos, stop, n)
            if got is not None or stop >= end:
                break
        if got is None:
            return None
        n += got
        pos = after
        if progress:
            progress("parse", pos - start, total)
    return n


def _read_range(r: Reading, start: int, stop: int, first: int) -> int | None:
    """Add the events of document bytes [start, stop), a JSON array's content, to `r.acc`,
    numbered from `first`: by the compiled scanner, or where it declines by msgspec. Their
    number, or None if the bytes are not such a content (or hold an event the decoder
    rejects, or the text ends first)."""
    p, w, acc = r.path, r.w, r.acc
    if not w.fill(start - 1, stop + 1):
        return None
    got = acc.scan(w.buf, start - w.lo, stop - w.lo, first)
    if got is not None:
        return got
    evs = _decode_range(p, w, start, stop, acc)
    if evs is None:
        return None
    acc.add(evs, first)
    return len(evs)  # (the batch's structs, and their views of the window, go before it moves)


def _decode_range(p: Path, w: Window, start: int, stop: int, acc: Accumulator) -> list | None:
    """The events of document bytes [start, stop) (held in `w`) decoded as a JSON array, or
    None if it is not one (or holds an event the decoder rejects). Its two bracket bytes are
    patched in for the decode and restored after."""
    buf, i, j = w.buf, start - 1 - w.lo, stop - w.lo
    keep = buf[i], buf[j]
    buf[i], buf[j] = 0x5B, 0x5D  # '[', ']'
    try:
        text = memoryview(buf)[i : j + 1]
        try:
            return _BATCH.decode(text)
        except (msgspec.DecodeError, RecursionError):  # (ValidationError is a DecodeError)
            pass
        try:
            raws = RAW_LIST.decode(text)
        except (msgspec.DecodeError, RecursionError):
            return None
        try:
            return _decode_each(p, raws, 0, acc)
        except InputError:  # (its index is in this range, not the file: the Raw way reports it)
            return None
    finally:
        buf[i], buf[j] = keep


def parse_events(p: Path, buf, raws: list, acc: Accumulator, progress: Progress | None) -> None:
    """Decode `raws`, the document's events as Raw slices of `buf`, batch by batch into `acc`."""
    base, n = _address(buf), len(raws)
    for start in range(0, n, BATCH_EVENTS):
        batch = raws[start : start + BATCH_EVENTS]
        text = _batch_text(buf, base, batch)
        acc.add(_decode_batch(p, text, batch, start, acc), start)
        if progress:
            progress("parse", min(start + BATCH_EVENTS, n), n)


def _address(obj) -> int:
    return np.frombuffer(obj, np.uint8).ctypes.data if len(obj) else 0


def _batch_text(buf, base: int, batch: list):
    """The batch's events as one JSON array, without copying when the slices are zero-copy.

    The events of a batch are contiguous in `buf`; the separator bytes just before the first
    and just after the last one (whitespace, ',' or the array's own brackets) are overwritten
    with '[' and ']' so that the range decodes as an array (`buf` is our private copy).
    """
    first, last = batch[0], batch[-1]
    start = _address(first) - base
    end = _address(last) - base + len(last)
    if start > 0 and end < len(buf) and start < end:
        buf[start - 1] = 0x5B  # '['
        buf[end] = 0x5D  # ']'
        return memoryview(buf)[start - 1 : end + 1]
    return b"[" + b",".join(batch) + b"]"  # pragma: no cover - msgspec copied the slices


def json_kind(view) -> str:
    """What the JSON text in `view` is, by its first byte: "an object", "an array", ... "empty"."""
    head = bytes(memoryview(view)[:4096]).lstrip()
    if not head:
        return "empty"
    first = head[0]
    kind = _JSON_KINDS.get(first, "a number" if first in b"-0123456789" else "not JSON")
    literal = _JSON_LITERALS.get(first)
    return "not JSON" if literal and not head.startswith(literal) else kind


def _why(e: Exception) -> str:
    msg = str(e)
    if "truncated" in msg:
        return "truncated JSON (the file ends in the middle of the document)"
    if msg.startswith("JSON is malformed"):
        return "malformed JSON" + msg[len("JSON is malformed") :]
    if "UTF-8" in msg:
        return "text is not valid UTF-8"
    return msg.splitlines()[0] if msg else type(e).__name__


def _split_top(p: Path, buf: Buffer) -> tuple[dict, list]:
    """Top-level metadata (decoded) and one zero-copy raw slice per event, in one pass."""
    view = memoryview(buf)
    if buf[:3] == b"\xef\xbb\xbf":  # a UTF-8 byte-order mark
        view = view[3:]
    kind = json_kind(view)
    if kind == "empty":
        raise InputError(f"{p}: empty file")
    if kind == "an array":  # Chrome's "JSON Array Format": the events alone
        return {"device_properties": []}, RAW_LIST.decode(view)
    if kind == "not JSON":
        gz = ", nor gzip-compressed though named .gz" if p.name.endswith(".gz") else ""
        begins = bytes(view[:24]).decode("utf-8", "replace")
        raise InputError(f"{p}: not JSON{gz} (it begins {begins!r}); expected a torch.profiler "
                         "trace, an object with traceEvents")
    if kind != "an object":
        raise InputError(f"{p}: top level is {kind}, expected an object with traceEvents")
    try:
        raws = _TOP_EVENTS.decode(view).traceEvents
    except msgspec.ValidationError:  # traceEvents is there but not a list
        raws = None
    if raws is None:
        events = TOP.decode(view).get("traceEvents")
        if events is None:
            raise InputError(f"{p}: no traceEvents key at the top level")
        raise InputError(f"{p}: traceEvents is {json_kind(events)}, not a list")
    return top_meta(TOP.decode(_without_events(buf, view, raws))), raws


def top_meta(top: dict) -> dict:
    """The top-level keys other than traceEvents (raw JSON values), decoded and normalised."""
    top.pop("traceEvents", None)
    meta = {k: decode_json(v, keep_text=True) for k, v in top.items()}
    props = meta.get("deviceProperties")
    meta["device_properties"] = (
        [d for d in props if isinstance(d, dict)] if isinstance(props, list) else []
    )
    for src, dst in (("baseTimeNanoseconds", "base_time_ns"), ("torch_version", "torch_version"),
                     ("pytorch_version", "torch_version")):
        if src in meta:
            meta[dst] = meta[src]
    return meta


def _without_events(buf: Buffer, view: memoryview, raws: list):
    """The document with its traceEvents array emptied (small), to read the other keys."""
    if not raws:
        return view
    base = _address(buf)
    first = _address(raws[0]) - base
    last = _address(raws[-1]) - base + len(raws[-1])
    start = _address(view) - base
    if not start < first < last <= len(buf):  # pragma: no cover - msgspec copied the slices
        return view
    open_, close = buf.rfind(b"[", start, first), buf.find(b"]", last)
    return bytes(buf[start:open_]) + b"[]" + bytes(buf[close + 1 :])


def decode_json(text: Any, keep_text: bool = False) -> Any:
    """The value of a JSON text; if it is not valid JSON, None (or the text, with keep_text)."""
    try:
        return msgspec.json.decode(text)
    except (msgspec.DecodeError, RecursionError, TypeError):
        return bytes(text).decode("utf-8", "replace") if keep_text else None


def decode_args(raw: str | None) -> list | None:
    """A recorded argument list (`Input Dims`, `Concrete Inputs`, ...) as Python lists, None if
    it is missing or not one."""
    value = decode_json(raw) if raw else None
    return value if isinstance(value, list) else None


def _decode_batch(p: Path, text, batch: Sequence, start: int, acc: Accumulator) -> list:
    """Decode a batch of events; retry one by one only if some event is malformed."""
    try:
        return _BATCH.decode(text)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return _decode_each(p, batch, start, acc)


def _decode_each(p: Path, batch: Sequence, start: int, acc: Accumulator) -> list:
    """Decode a batch's Raw events one by one (events number `start`, `start` + 1, ...):
    malformed ones kept without their links or skipped, and counted."""
    out = []
    for i, raw in enumerate(batch):
        try:
            out.append(_ONE.decode(raw))
            continue
        except msgspec.ValidationError:  # (a subclass of DecodeError)
            pass
        except msgspec.DecodeError as e:
            raise InputError(f"{p}: traceEvents[{start + i}]: {_why(e)}") from None
        try:
            ev = _ONE_LENIENT.decode(raw)
        except msgspec.ValidationError:
            acc.skipped["type"] += 1
            out.append(_PLACEHOLDER)
            continue
        acc.partly_read += 1
        kept = msgspec.structs.asdict(ev)
        out.append(_Event(**{**kept, **{k: as_int(kept[k]) for k in _LENIENT_INTS}}))
    return out
