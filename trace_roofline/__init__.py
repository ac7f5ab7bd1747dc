"""trace_roofline: put every kernel of a profiled LLM on the roofline.

The pipeline's public functions are importable from here. Each loads its module on first use
(PEP 562), so that `import trace_roofline` (and the command line's parser) costs no pandas,
pyarrow, numpy or matplotlib import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Exported name -> the module that defines it.
_EXPORTS = {
    "attribute": "trace_roofline.attribution.attribute",
    "operator_table": "trace_roofline.attribution.attribute",
    "attach_costs": "trace_roofline.costs.attach",
    "InputError": "trace_roofline.errors",
    "Hardware": "trace_roofline.model.hardware",
    "get_hardware": "trace_roofline.model.hardware",
    "ModelSpec": "trace_roofline.model.models",
    "get_model": "trace_roofline.model.models",
    "AnalysisOptions": "trace_roofline.options",
    "DecodeShapes": "trace_roofline.options",
    "markdown": "trace_roofline.outputs.report",
    "report_dict": "trace_roofline.outputs.report",
    "terminal_table": "trace_roofline.outputs.report",
    "analyze": "trace_roofline.pipeline",
    "analyze_trace": "trace_roofline.pipeline",
    "Run": "trace_roofline.pipeline",
    "TraceFacts": "trace_roofline.pipeline",
    "attribute_trace": "trace_roofline.pipeline",
    "trace_hardware": "trace_roofline.pipeline",
    "Analysis": "trace_roofline.roofline",
    "operators_frame": "trace_roofline.roofline",
    "Trace": "trace_roofline.trace",
    "load_trace": "trace_roofline.trace",
    "load_traces": "trace_roofline.trace",
    "match_kernels": "trace_roofline.trace.ncu",
    "read_ncu_csv": "trace_roofline.trace.ncu",
    "roofline_figure": "trace_roofline.outputs.plot",
}

__all__ = [
    "Analysis", "AnalysisOptions", "DecodeShapes", "Hardware", "InputError", "ModelSpec", "Run",
    "Trace", "TraceFacts", "analyze", "analyze_trace", "attach_costs", "attribute",
    "attribute_trace", "get_hardware", "get_model", "load_trace", "load_traces", "markdown",
    "match_kernels", "operator_table", "operators_frame", "read_ncu_csv", "report_dict",
    "roofline_figure", "terminal_table", "trace_hardware",
]

if TYPE_CHECKING:
    from trace_roofline.attribution.attribute import attribute, operator_table
    from trace_roofline.costs.attach import attach_costs
    from trace_roofline.errors import InputError
    from trace_roofline.model.hardware import Hardware, get_hardware
    from trace_roofline.model.models import ModelSpec, get_model
    from trace_roofline.options import AnalysisOptions, DecodeShapes
    from trace_roofline.outputs.plot import roofline_figure
    from trace_roofline.outputs.report import markdown, report_dict, terminal_table
    from trace_roofline.pipeline import (
        Run,
        TraceFacts,
        analyze,
        analyze_trace,
        attribute_trace,
        trace_hardware,
    )
    from trace_roofline.roofline import Analysis, operators_frame
    from trace_roofline.trace import Trace, load_trace, load_traces
    from trace_roofline.trace.ncu import match_kernels, read_ncu_csv


def __getattr__(name: str) -> object:
    """An exported name, imported from its module on first use (then kept as an attribute)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'trace_roofline' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
