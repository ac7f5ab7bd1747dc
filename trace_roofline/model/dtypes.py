"""The one dtype table: every spelling of a dtype -> its short name, bytes and peak key.

Design notes: docs/design.md ("trace_roofline/model/dtypes.py").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    """One dtype: its torch name, the short name the tables show, size and compute-peak key."""

    name: str  # torch name: bfloat16, float8_e4m3fn, int64; mxfp4 / nvfp4 for weight formats
    short: str  # bf16, fp16, fp32, fp8, int64 (float8 variants all show as fp8)
    bytes: float  # bytes per element, block scales included (MXFP4: 4.25 / 8)
    peak: str | None  # Hardware.peak_flops key, None when no hardware lists one
    spellings: tuple[str, ...] = ()  # trace `Input type`, c10 and other names
    scalar_type: int | None = None  # c10::ScalarType number

    @property
    def bits(self) -> float:
        """Bits per element, scales included."""
        return self.bytes * 8.0


MXFP4_BITS = 4.0 + 8.0 / 32  # e2m1 elements, one e8m0 scale per 32 (OCP Microscaling spec v1.0)
NVFP4_BITS = 4.0 + 8.0 / 16  # e2m1 elements, one e4m3 scale per 16 (NVIDIA Blackwell NVFP4)


DTYPES: tuple[DType, ...] = (
    DType("bfloat16", "bf16", 2, "bf16", ("c10::BFloat16",), 15),
    DType("float16", "fp16", 2, "fp16", ("half", "c10::Half"), 5),
    DType("float32", "fp32", 4, "fp32", ("float",), 6),
    DType("tf32", "tf32", 4, "tf32"),  # a compute mode on fp32 data: hardware files list it
    DType("float64", "fp64", 8, None, ("double",), 7),
    DType("float8_e4m3fn", "fp8", 1, "fp8", ("c10::Float8_e4m3fn",), 24),
    DType("float8_e5m2", "fp8", 1, "fp8", ("c10::Float8_e5m2",), 23),
    DType("float8_e4m3fnuz", "fp8", 1, "fp8", ("c10::Float8_e4m3fnuz",), 26),
    DType("float8_e5m2fnuz", "fp8", 1, "fp8", ("c10::Float8_e5m2fnuz",), 25),
    DType("float8_e8m0fnu", "fp8", 1, "fp8", ("c10::Float8_e8m0fnu",), 44),
    DType("mxfp4", "mxfp4", MXFP4_BITS / 8, "fp4", ("fp4", "float4_e2m1fn_mx", "mx_fp4")),
    DType("nvfp4", "nvfp4", NVFP4_BITS / 8, "fp4", ("nv_fp4",)),
    DType("int64", "int64", 8, None, ("long int", "long", "c10::Long"), 4),
    DType("int32", "int32", 4, None, ("int", "c10::Int"), 3),
    DType("int16", "int16", 2, None, ("short int", "short", "c10::Short"), 2),
    DType("int8", "int8", 1, None, ("signed char", "c10::Char"), 1),
    DType("uint8", "uint8", 1, None, ("unsigned char", "c10::Byte"), 0),
    DType("bool", "bool", 1, None, ("c10::Bool",), 11),
    DType("complex64", "complex64", 8, None, ("c10::complex<float>",), 9),
    DType("complex128", "complex128", 16, None, ("c10::complex<double>",), 10),
)


def _key(spelling: str) -> str:
    return spelling.strip().lower().removeprefix("torch.")


def _index() -> dict[str, DType]:
    """Every spelling -> its dtype; a short name shared by several (fp8) means the first."""
    out: dict[str, DType] = {}
    for d in DTYPES:
        for s in (d.name, d.short, *d.spellings):
            out.setdefault(_key(s), d)
    return out


_BY_SPELLING = _index()
_BY_SCALAR_TYPE = {str(d.scalar_type): d for d in DTYPES if d.scalar_type is not None}


def lookup(spelling: str) -> DType | None:
    """The dtype a spelling names ('c10::BFloat16', 'torch.float16', 'bf16', 'long int'), or
    None when it names none (a trace's 'Scalar', 'TensorList', '')."""
    return _BY_SPELLING.get(_key(spelling))


def by_scalar_type(number: str) -> DType | None:
    """The dtype of a c10::ScalarType number as `Concrete Inputs` print it ('15' -> bfloat16)."""
    return _BY_SCALAR_TYPE.get(number)


def known() -> list[str]:
    """Every accepted spelling, sorted (for error messages)."""
    return sorted(_BY_SPELLING)
