"""trace_roofline: put every kernel of a profiled LLM on the roofline.

The pipeline's public functions are importable from here; pandas/matplotlib load on first use.
"""

from importlib import import_module

from trace_roofline.errors import InputError
from trace_roofline.hardware import Hardware, get_hardware
from trace_roofline.models import ModelSpec, get_model

_LAZY = {
    "load_trace": "trace", "load_traces": "trace", "Trace": "trace",
    "attribute": "attribute", "operator_table": "attribute",
    "attach_costs": "shapes",
    "analyze": "roofline", "Analysis": "roofline",
    "analyze_trace": "pipeline", "operators_frame": "pipeline", "trace_hardware": "pipeline",
    "terminal_table": "report", "report_dict": "report", "markdown": "report",
    "roofline_figure": "plot",
    "read_ncu_csv": "ncu", "match_kernels": "ncu",
}

__all__ = ["Hardware", "InputError", "ModelSpec", "get_hardware", "get_model", *_LAZY]


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(import_module(f"trace_roofline.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'trace_roofline' has no attribute {name!r}")
