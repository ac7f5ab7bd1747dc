"""The raw trace fields the parser reads, declared once: each event key and `args` key with its
attribute name, its JSON type and unit (FIELDS), and which table column each one fills (TABLES).
decode.py's msgspec Structs and columns.py's column plan are derived from them at import; the
compiled scanner's field table, `_fields.h`, is generated from them (`python -m
trace_roofline.trace.fields` rewrites it; tests/trace/test_scan.py checks that it matches).

Design notes: docs/design.md ("trace_roofline/trace/fields.py").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# How a field's value is read (the scanner's kinds: K_STR, ...). Absent ints are MISSING,
# absent floats NaN, absent strings None, absent raw values empty.
KINDS = {
    "str": "K_STR",  # a string (null: absent)
    "float": "K_F64",  # a number
    "int": "K_INT",  # an int64
    "int|null": "K_INT_NULL",  # an int64 (null: absent)
    "int|str": "K_INT_STR",  # an int64, or a string: read as columns.as_int reads it
    "int|str|null": "K_INT_STR_NULL",
    "raw": "K_RAW",  # any JSON value, kept as its text
    "args": "K_ARGS",  # the object of args fields
}
INT_KINDS = ("int", "int|null", "int|str", "int|str|null")


@dataclass(frozen=True)
class Field:
    """One raw key: `attr` names it in decode.py's Structs and in TABLES' paths."""

    key: str  # as Kineto writes it
    attr: str
    kind: str  # one of KINDS
    unit: str = ""


EVENT = (
    Field("ph", "ph", "str"),
    Field("cat", "cat", "str"),
    Field("name", "name", "str"),
    Field("pid", "pid", "int|str|null"),
    Field("tid", "tid", "int|str|null"),
    Field("ts", "ts", "float", "us"),
    Field("dur", "dur", "float", "us"),
    Field("id", "id", "int|str|null"),
    Field("args", "args", "args"),
)
ARGS = (
    Field("External id", "external_id", "int"),
    Field("external id", "external_id_legacy", "int"),
    Field("correlation", "correlation", "int"),
    Field("device", "device", "int"),
    Field("stream", "stream", "int|str"),  # ROCm runtime events write "0x0"
    Field("grid", "grid", "raw"),
    Field("block", "block", "raw"),
    Field("Input Dims", "input_dims", "raw"),
    Field("Input dims", "input_dims_legacy", "raw"),
    Field("Input type", "input_types", "raw"),
    Field("Concrete Inputs", "concrete_inputs", "raw"),
    Field("Input Strides", "input_strides", "raw"),
    Field("Python id", "python_id", "int|null"),
    Field("Python parent id", "python_parent_id", "int|null"),
)
# path ("ts", "args.device") -> its field
FIELDS = {**{f.attr: f for f in EVENT}, **{f"args.{f.attr}": f for f in ARGS}}

# Per table: output column -> (field paths, converter). A second path fills the rows where the
# first is absent (legacy spelling, or pid/tid standing in for device/stream). Converters: int
# (Int64), str (categorical), raw (JSON text, categorical; args fields only), ph (the codes
# read to classify the event). ts/dur are every table's.
_EXT = ("args.external_id", "args.external_id_legacy")
TABLES: dict[str, dict[str, tuple[tuple[str, ...], str]]] = {
    "device": {
        "name": (("name",), "str"),
        "pid": (("pid",), "int"),
        "device": (("args.device", "pid"), "int"),
        "stream": (("args.stream", "tid"), "int"),
        "correlation": (("args.correlation",), "int"),
        "external_id": (_EXT, "int"),
        "grid": (("args.grid",), "raw"),
        "block": (("args.block",), "raw"),
    },
    "cpu_ops": {
        "name": (("name",), "str"),
        "pid": (("pid",), "int"),
        "tid": (("tid",), "int"),
        "external_id": (_EXT, "int"),
        "input_dims": (("args.input_dims", "args.input_dims_legacy"), "raw"),
        "input_types": (("args.input_types",), "raw"),
        "concrete_inputs": (("args.concrete_inputs",), "raw"),
        "input_strides": (("args.input_strides",), "raw"),
    },
    "runtime": {
        "name": (("name",), "str"),
        "pid": (("pid",), "int"),
        "tid": (("tid",), "int"),
        "correlation": (("args.correlation",), "int"),
        "external_id": (_EXT, "int"),
    },
    "annotations": {
        "name": (("name",), "str"),
        "cat": (("cat",), "str"),
        "pid": (("pid",), "int"),
        "tid": (("tid",), "int"),
        "external_id": (_EXT, "int"),
    },
    "python_frames": {
        "name": (("name",), "str"),
        "pid": (("pid",), "int"),
        "tid": (("tid",), "int"),
        "python_id": (("args.python_id",), "int"),
        "parent_id": (("args.python_parent_id",), "int"),
    },
    "flows": {
        "id": (("id",), "int"),
        "ph": (("ph",), "ph"),
        "cat": (("cat",), "str"),
        "pid": (("pid",), "int"),
        "tid": (("tid",), "int"),
    },
}
_UNDECLARED = {p for cols in TABLES.values() for paths, _ in cols.values() for p in paths} - set(FIELDS)
assert not _UNDECLARED, f"TABLES reads undeclared fields: {sorted(_UNDECLARED)}"


def raw_paths(table: str) -> tuple[str, ...]:
    """The raw fields of `table`, in the order its raw key joins them (columns._RawGroup)."""
    return tuple(p for paths, conv in TABLES[table].values() if conv == "raw" for p in paths)


RAW_TABLES = tuple(t for t in TABLES if raw_paths(t))
# The scanner's three column blocks, by path: string codes then one raw key per table with raw
# fields; floats; ints.
I32_COLUMNS = (*(p for p, f in FIELDS.items() if f.kind == "str"), *(f"raw.{t}" for t in RAW_TABLES))
F64_COLUMNS = tuple(p for p, f in FIELDS.items() if f.kind == "float")
I64_COLUMNS = tuple(p for p, f in FIELDS.items() if f.kind in INT_KINDS)
_RAW_ARGS = tuple(p for p, f in FIELDS.items() if f.kind == "raw")


def _c_name(prefix: str, path: str) -> str:
    return prefix + path.replace(".", "_").upper()


def _c_field(f: Field, path: str) -> str:
    assert f.key.isascii() and len(f.key) <= 16 and '"' not in f.key and "\\" not in f.key
    column = {"str": "S_", "float": "F_", "raw": "A_"}.get(f.kind, "I_")
    index = "0" if f.kind == "args" else _c_name(column, path)
    return f'    {{"{f.key}", {len(f.key)}, {KINDS[f.kind]}, {index}}},'


def c_header() -> str:
    """The text of `_fields.h`: the scanner's column enums, field tables and raw keys."""
    names = {"S_": I32_COLUMNS[: -len(RAW_TABLES)], "R_": RAW_TABLES, "F_": F64_COLUMNS,
             "I_": I64_COLUMNS, "A_": _RAW_ARGS}

    def enum(prefixes: str, count: str) -> str:
        items = [_c_name(pre, p) for pre in prefixes.split() for p in names[pre]]
        return f"enum {{ {', '.join([*items, count])} }};"

    def strings(name: str, values: tuple[str, ...]) -> str:
        quoted = ", ".join(f'"{v}"' for v in values)
        return f"static const char *const {name}[] = {{{quoted}}};"

    raw_keys = []
    for t in RAW_TABLES:
        assert len(raw_paths(t)) <= 16  # (_scan.c's MAX_RAW_KEY)
        args = ", ".join(_c_name("A_", p) for p in raw_paths(t))
        raw_keys.append(f"    {{{_c_name('R_', t)}, {len(raw_paths(t))}, {{{args}}}}},")
    return "\n".join([
        "/* Generated from trace_roofline/trace/fields.py by `python -m trace_roofline.trace.fields`:",
        " * do not edit. Included by _scan.c (after its Field, Kind and RawKey types). */",
        enum("S_ R_", "I32_COLUMNS"), enum("F_", "F64_COLUMNS"), enum("I_", "I64_COLUMNS"),
        enum("A_", "RAW_ARGS"),
        strings("I32_NAMES", I32_COLUMNS), strings("F64_NAMES", F64_COLUMNS),
        strings("I64_NAMES", I64_COLUMNS),
        "static Field EVENT_FIELDS[] = {", *(_c_field(f, f.attr) for f in EVENT), "};",
        "static Field ARGS_FIELDS[] = {", *(_c_field(f, f"args.{f.attr}") for f in ARGS), "};",
        "static const RawKey RAW_KEYS[] = {", *raw_keys, "};",
        "",
    ])


HEADER = Path(__file__).with_name("_fields.h")

if __name__ == "__main__":
    HEADER.write_text(c_header())
