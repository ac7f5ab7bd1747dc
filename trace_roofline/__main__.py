"""`python -m trace_roofline`: the `trace-roofline` command."""

from trace_roofline.cli import run

run()
