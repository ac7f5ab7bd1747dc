"""The analysis options: one value that travels through every stage and owns its cache key."""

from __future__ import annotations

import dataclasses
import numbers
import os
from dataclasses import dataclass
from pathlib import Path

from trace_roofline import files
from trace_roofline.errors import InputError
from trace_roofline.model import formulas

MAX_LAYERS = 100_000  # as the config reader's: deeper is a mistake, not a model
MAX_TP = 1 << 16  # ranks of one tensor-parallel group


@dataclass(frozen=True)
class DecodeShapes:
    """Shapes the user gives for replayed decode steps: B sequences, S keys per query."""

    batch: int
    context: int

    def __post_init__(self) -> None:
        for name, value in (("batch", self.batch), ("context", self.context)):
            if value < 1:
                raise InputError(f"`{name}` must be >= 1, got {value}", name)


@dataclass(frozen=True)
class AnalysisOptions:
    """Everything an analysis depends on besides the trace, the model and the hardware.

    `causal`, `attention_bytes`: the attention conventions (formulas.py); `layers`: extrapolate
    to this many decoder layers; `ncu`: an Nsight Compute CSV of the same run; `by_shape`: one
    row per (operator, shape); `force`: analyse shapes that contradict the model; `tp`: the
    trace is one rank of the model sharded `tp` ways; `graph_map`: an eager trace of the same
    step naming CUDA-graph replays; `decode_shapes`: (B, S) costing replays named from kernels.
    """

    causal: str = "causal"
    attention_bytes: str = "all"
    layers: int | None = None
    ncu: str | os.PathLike | None = None
    by_shape: bool = False
    force: bool = False
    tp: int | None = None
    graph_map: object = None  # a path, or an already loaded trace.Trace
    decode_shapes: DecodeShapes | None = None

    def __post_init__(self) -> None:
        if self.causal not in formulas.CAUSAL_CONVENTIONS:
            raise InputError(f"`causal` must be one of {', '.join(formulas.CAUSAL_CONVENTIONS)}, "
                             f"got {self.causal!r}", "causal")
        if self.attention_bytes not in formulas.ATTENTION_BYTES_CONVENTIONS:
            raise InputError("`attention_bytes` must be one of "
                             f"{', '.join(formulas.ATTENTION_BYTES_CONVENTIONS)}, "
                             f"got {self.attention_bytes!r}", "attention_bytes")
        for name, most in (("layers", MAX_LAYERS), ("tp", MAX_TP)):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, numbers.Integral)
                                          and not isinstance(value, bool) and 1 <= int(value) <= most):
                raise InputError(f"`{name}` must be an integer from 1 to {most}, got {value!r}",
                                 name)

    def replace(self, **changes: object) -> AnalysisOptions:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def cache_key(self) -> dict[str, object] | None:
        """A JSON-able key of every option (a file by its identity, `files.identity`); None
        when one has no key (a graph map given as a loaded trace): then nothing is cached."""
        key: dict[str, object] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("ncu", "graph_map") and value is not None:
                if not isinstance(value, (str, os.PathLike)):
                    return None
                value = {"file": files.identity(Path(value))}
            elif isinstance(value, DecodeShapes):
                value = dataclasses.asdict(value)
            key[f.name] = value
        return key
