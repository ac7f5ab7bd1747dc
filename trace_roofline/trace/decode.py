"""Bytes -> event structs: the JSON document is cut into one zero-copy `Raw` slice per event, and
the events are decoded batch by batch into GC-free msgspec Structs carrying only the fields
columns.py reads (the C decoder skips everything else in an event). Shape arrays (`Input Dims`,
`Input type`, `Input Strides`, `Concrete Inputs`) stay raw JSON text.

Errors: a document that is not readable as a whole raises InputError naming the file (and, for
the first event the decoder rejects, its index); an event of the wrong shape is retried alone,
kept without its links (`_EventLenient`) or skipped and counted (`Accumulator.skipped`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import msgspec
import numpy as np

from trace_roofline.errors import InputError
from trace_roofline.trace.columns import Accumulator
from trace_roofline.trace.schema import MISSING, Progress

BATCH_EVENTS = 4096  # events per batch: bounds live Python objects, keeps them in cache

# Typed structs holding only the fields we use. Missing ints decode to MISSING.
_I64 = Annotated[int, msgspec.Meta(ge=MISSING + 1, le=2**63 - 1)]
_NO_RAW = msgspec.Raw()


def _f(name: str) -> Any:
    return msgspec.field(default=MISSING, name=name)


def _raw(name: str) -> Any:
    return msgspec.field(default=_NO_RAW, name=name)


class _Args(msgspec.Struct, frozen=True, gc=False):
    external_id: _I64 = _f("External id")
    external_id_legacy: _I64 = _f("external id")
    correlation: _I64 = MISSING
    device: _I64 = MISSING
    stream: _I64 | str = MISSING  # ROCm runtime events write "0x0"
    grid: msgspec.Raw = _NO_RAW
    block: msgspec.Raw = _NO_RAW
    input_dims: msgspec.Raw = _raw("Input Dims")
    input_dims_legacy: msgspec.Raw = _raw("Input dims")
    input_types: msgspec.Raw = _raw("Input type")
    concrete_inputs: msgspec.Raw = _raw("Concrete Inputs")
    input_strides: msgspec.Raw = _raw("Input Strides")
    python_id: _I64 | None = _f("Python id")
    python_parent_id: _I64 | None = _f("Python parent id")


_NO_ARGS = _Args()


class _Event(msgspec.Struct, gc=False):
    ph: str | None = None
    cat: str | None = None
    name: str | None = None
    pid: _I64 | str | None = None
    tid: _I64 | str | None = None
    ts: float = math.nan
    dur: float = math.nan
    id: _I64 | str | None = None
    args: _Args = _NO_ARGS


class _EventLenient(msgspec.Struct, gc=False):
    """Retry shape for an event with malformed args or ids: keep its timing, drop its links.

    Only what defines the event (ph, cat, name, ts, dur) must be well typed; pid/tid/id that
    are not integers end up <NA>.
    """

    ph: str | None = None
    cat: str | None = None
    name: str | None = None
    pid: Any = None
    tid: Any = None
    ts: float = math.nan
    dur: float = math.nan
    id: Any = None


class _Top(msgspec.Struct, gc=False):
    traceEvents: list[msgspec.Raw] | None = None  # the JSON key


_TOP_EVENTS = msgspec.json.Decoder(_Top)
TOP = msgspec.json.Decoder(dict[str, msgspec.Raw])
RAW_LIST = msgspec.json.Decoder(list[msgspec.Raw])
_BATCH = msgspec.json.Decoder(list[_Event])
_ONE = msgspec.json.Decoder(_Event)
_ONE_LENIENT = msgspec.json.Decoder(_EventLenient)

_JSON_KINDS = {ord("["): "an array", ord("{"): "an object", ord('"'): "a string",
               ord("t"): "a boolean", ord("f"): "a boolean", ord("n"): "null"}
_PLACEHOLDER = _Event()


def decode_document(p: Path, buf: bytearray, progress: Progress | None
                    ) -> tuple[dict, int, Accumulator]:
    """(metadata, event count, columns) of the whole document in `buf` (our private copy: it is
    patched in place while decoding), in this process."""
    try:
        meta, raws = _split_top(p, buf)  # zero-copy slices of buf, one per event
    except msgspec.DecodeError as e:
        raise InputError(f"{p}: {_why(e)}") from None
    except RecursionError:
        raise InputError(f"{p}: JSON nested too deeply") from None
    acc = Accumulator()
    parse_events(p, buf, raws, acc, progress)
    return meta, len(raws), acc


def parse_events(p: Path, buf, raws: list, acc: Accumulator, progress: Progress | None,
                  first: int = 0) -> None:
    """Decode `raws` (events number `first`, `first` + 1, ...) batch by batch into `acc`."""
    base, n = _address(buf), len(raws)
    for start in range(0, n, BATCH_EVENTS):
        batch = raws[start : start + BATCH_EVENTS]
        text = _batch_text(buf, base, batch)
        acc.add(_decode_batch(p, text, batch, first + start, acc), first + start)
        if progress:
            progress("parse", min(start + BATCH_EVENTS, n), n)


def _address(obj) -> int:
    return np.frombuffer(obj, np.uint8).ctypes.data if len(obj) else 0


def _batch_text(buf, base: int, batch: list, patch: bool = True):
    """The batch's events as one JSON array, without copying when the slices are zero-copy.

    The events of a batch are contiguous in `buf`; the separator bytes just before the first
    and just after the last one (whitespace, ',' or the array's own brackets) are overwritten
    with '[' and ']' so that the range decodes as an array. `buf` is our private copy (or its
    bytes around this batch are ours alone); with `patch=False` the range is copied instead.
    """
    first, last = batch[0], batch[-1]
    start = _address(first) - base
    end = _address(last) - base + len(last)
    if start > 0 and end < len(buf) and start < end:
        if not patch:
            return b"[" + memoryview(buf)[start:end] + b"]"
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
    return _JSON_KINDS.get(first, "a number" if first in b"-0123456789" else "not JSON")


def _why(e: Exception) -> str:
    msg = str(e)
    if "truncated" in msg:
        return "truncated JSON (the file ends in the middle of the document)"
    if msg.startswith("JSON is malformed"):
        return "malformed JSON" + msg[len("JSON is malformed") :]
    if "UTF-8" in msg:
        return "text is not valid UTF-8"
    return msg.splitlines()[0] if msg else type(e).__name__


def _split_top(p: Path, buf: bytearray) -> tuple[dict, list]:
    """Top-level metadata (decoded) and one zero-copy raw slice per event, in one pass."""
    view = memoryview(buf)
    if buf[:3] == b"\xef\xbb\xbf":  # a UTF-8 byte-order mark
        view = view[3:]
    kind = json_kind(view)
    if kind == "empty":
        raise InputError(f"{p}: empty file")
    if kind == "an array":  # Chrome's "JSON Array Format": the events alone
        return {"device_properties": []}, RAW_LIST.decode(view)
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


def _without_events(buf: bytearray, view: memoryview, raws: list):
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


def _decode_batch(p: Path, text, batch: Sequence, start: int, acc: Accumulator) -> list:
    """Decode a batch of events; retry one by one only if some event is malformed."""
    try:
        return _BATCH.decode(text)
    except (msgspec.ValidationError, msgspec.DecodeError):
        pass
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
        out.append(_Event(ev.ph, ev.cat, ev.name, ev.pid, ev.tid, ev.ts, ev.dur, ev.id))
    return out
