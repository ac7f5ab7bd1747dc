"""Do grouped expert GEMMs read the weights of only the experts that have rows? (issue 12)

HF transformers' default experts form runs `torch.nn.functional.grouped_mm` (or
`torch._grouped_mm`) over all E experts' weights with per-expert row offsets; trace_roofline
charges its weights once per *active* expert (moe.py). This script runs that call at
Mixtral-8x7B's shapes (E 8, H 4096, I 14336, bf16, HF's [E, 2I, H] / [E, H, I] weights seen
transposed, as transformers passes them) on S = 8 rows spread over A = 1, 2, 4, 8 experts (the
others get none), twice, for Nsight Compute to measure each kernel's DRAM bytes:

    ncu --clock-control none --csv --page raw --print-units base \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \\
        python3 -m workloads.moe_grouped_ncu > moe_grouped_mm_ncu_h200.csv

(ncu flushes the caches before each kernel by default: cold-cache DRAM bytes.) The result on
the project's H200 is sample_traces/provenance/moe_grouped_mm_ncu_h200.csv: the CUTLASS grouped
kernel reads A x one expert's weights, within 0.3% (tests/attribution/test_moe.py checks it).
"""

from __future__ import annotations

import sys

import torch

E, H, INTER, S = 8, 4096, 14336, 8
ACTIVE = (1, 2, 4, 8)


def main() -> int:
    torch.manual_seed(0)
    gate_up = torch.randn(E, 2 * INTER, H, device="cuda", dtype=torch.bfloat16)
    down = torch.randn(E, H, INTER, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(S, H, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(S, INTER, device="cuda", dtype=torch.bfloat16)
    gm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    for active in ACTIVE * 2:
        counts = [S // active] * active + [0] * (E - active)
        offs = torch.tensor(counts, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
        gm(x, gate_up.transpose(-2, -1), offs=offs)  # [S, H] x [E, H, 2I]
        gm(h, down.transpose(-2, -1), offs=offs)  # [S, I] x [E, I, H]
    torch.cuda.synchronize()
    print(torch.__version__, torch.cuda.get_device_name(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
