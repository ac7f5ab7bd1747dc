"""trace_roofline: put every kernel of a profiled LLM on the roofline.

The pipeline's public functions are importable from here (matplotlib loads on first plot).
"""

from trace_roofline.attribution.attribute import attribute, operator_table
from trace_roofline.costs.shapes import attach_costs
from trace_roofline.errors import InputError
from trace_roofline.model.hardware import Hardware, get_hardware
from trace_roofline.model.models import ModelSpec, get_model
from trace_roofline.options import AnalysisOptions, DecodeShapes
from trace_roofline.outputs.report import markdown, report_dict, terminal_table
from trace_roofline.pipeline import (
    analyze,
    analyze_trace,
    attribute_trace,
    trace_hardware,
)
from trace_roofline.roofline import Analysis, operators_frame
from trace_roofline.trace import Trace, load_trace, load_traces
from trace_roofline.trace.ncu import match_kernels, read_ncu_csv

__all__ = [
    "Analysis", "AnalysisOptions", "DecodeShapes", "Hardware", "InputError", "ModelSpec", "Trace",
    "analyze", "analyze_trace", "attach_costs", "attribute", "attribute_trace", "get_hardware",
    "get_model", "load_trace", "load_traces", "markdown", "match_kernels", "operator_table",
    "operators_frame", "read_ncu_csv", "report_dict", "roofline_figure", "terminal_table",
    "trace_hardware",
]


def __getattr__(name: str) -> object:
    """`roofline_figure` imports matplotlib only when asked for."""
    if name == "roofline_figure":
        from trace_roofline.outputs.plot import roofline_figure

        return roofline_figure
    raise AttributeError(f"module 'trace_roofline' has no attribute {name!r}")
