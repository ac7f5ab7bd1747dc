"""trace_roofline: put every kernel of a profiled LLM on the roofline."""

from trace_roofline.errors import InputError
from trace_roofline.hardware import Hardware, get_hardware
from trace_roofline.models import ModelSpec, get_model

__all__ = ["Hardware", "InputError", "ModelSpec", "get_hardware", "get_model"]
