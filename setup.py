"""The compiled event scanner (trace_roofline/trace/_scan.c), optional: where it cannot be
built (no C compiler), the install still succeeds and traces are decoded by msgspec alone."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("trace_roofline.trace._scan", ["trace_roofline/trace/_scan.c"],
                             depends=["trace_roofline/trace/_fields.h"],  # (generated: fields.py)
                             optional=True, extra_compile_args=["-O3"])])
