"""`python -m workloads run|sweep|calibrate|hf-capture ...` (no analyzer needed)."""

import sys

from workloads.cli import main

sys.exit(main())
