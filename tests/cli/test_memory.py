"""The CLI's memory settings (trace_roofline.memory): freed big arrays are reused, not faulted in
again, and numpy no longer advises huge pages. Each check runs in a fresh interpreter, since
the settings are process-wide."""

import subprocess
import sys

import pytest

from trace_roofline import memory

REFAULTS = """
import resource, sys
import numpy as np
from trace_roofline import memory
memory.tune()
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = [np.ones(1 << 21) for _ in range(4)]  # 4 arrays of 16 MiB
del x
before = faults()
for _ in range(5):
    x = [np.ones(1 << 21) for _ in range(4)]
    del x
print(faults() - before)
"""

NUMPY_MULTIARRAY = """try:  # numpy 2; numpy 1.26 (the oldest supported) names it numpy.core
    import numpy._core.multiarray as m
except ImportError:
    import numpy.core.multiarray as m
"""
ADVICE = NUMPY_MULTIARRAY + """
from trace_roofline import memory
memory.tune()
print(m._set_madvise_hugepage(True))  # the setting before this call
"""


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.mark.skipif(memory._glibc() is None, reason="glibc's mallopt only")
def test_freed_arrays_are_reused_without_page_faults():
    # 5 rounds of 64 MiB: 81920 faults of 4 KiB pages if each array were mapped afresh
    assert int(_run(REFAULTS)) < 256


def test_numpy_huge_page_advice_is_off():
    assert _run(ADVICE) == "False"


def test_cli_main_tunes_its_process():
    code = (NUMPY_MULTIARRAY + "from trace_roofline.cli import main\n"
            "main(['intensity', '--model', 'qwen2.5-7b', '--hardware', 'h200-sxm'])\n"
            "print(m._set_madvise_hugepage(True))\n")
    assert _run(code).splitlines()[-1] == "False"
