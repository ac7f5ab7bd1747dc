"""Stage 1: read a torch.profiler (Kineto) Chrome trace into typed pandas tables.

Design notes: docs/design.md ("trace_roofline/trace/__init__.py").
"""

from trace_roofline.trace.load import PROGRESS_MIN_BYTES, load_trace, load_traces, parse_dims, progress_bar
from trace_roofline.trace.read import trace_files
from trace_roofline.trace.schema import (
    ANNOTATION_COLUMNS,
    CPU_OP_COLUMNS,
    DEVICE_COLUMNS,
    FLOW_COLUMNS,
    MAX_DUR_US,
    MAX_TS_US,
    PYTHON_FRAME_COLUMNS,
    RUNTIME_COLUMNS,
    SCHEMAS,
    Progress,
    Trace,
)

__all__ = [
    "ANNOTATION_COLUMNS", "CPU_OP_COLUMNS", "DEVICE_COLUMNS", "FLOW_COLUMNS", "MAX_DUR_US",
    "MAX_TS_US", "PROGRESS_MIN_BYTES", "PYTHON_FRAME_COLUMNS", "RUNTIME_COLUMNS", "SCHEMAS",
    "Progress", "Trace", "load_trace", "load_traces", "parse_dims", "progress_bar",
    "trace_files",
]
