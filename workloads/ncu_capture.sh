#!/usr/bin/env bash
# Per-kernel DRAM bytes for a workload run, with Nsight Compute, for `analyze --ncu`.
#
# Usage: bash workloads/ncu_capture.sh OUT.ncu.csv [trace-roofline run options...]
#   e.g. bash workloads/ncu_capture.sh traces/qwen2.5-7b_decode_b1_s2048_h200.ncu.csv \
#            --phase decode --batch 1 --context 2048 --warmup 2 --steps 3
#
# ncu and torch.profiler both use CUPTI, so the workload runs here WITHOUT torch.profiler
# (`run --no-profile`): the same build, warm-up and steps as the traced run, with the active
# steps between cudaProfilerStart/Stop so `--profile-from-start off` captures exactly the kernels
# the trace's active steps hold (same kernels, same order, assuming the same cuBLAS/SDPA choices).
# Operator ranges are NVTX ranges with the canonical names (`--annotate nvtx`, `ncu --nvtx`).
# --clock-control none leaves the GPU clocks as found; ncu's default --cache-control all flushes
# caches before each kernel, so DRAM bytes are cold-cache bytes. Kernel names are demangled in
# full, as in the Chrome trace; units are base units (bytes, ns: --print-units base).
# Writes OUT.ncu.csv (raw page, one row per kernel, after a units row) and OUT.ncu-rep beside it.
set -euo pipefail
out_csv=$1; shift
rep=${out_csv%.csv}
NCU=${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || true)}
[ -n "$NCU" ] || { echo "ncu not found (set NCU=/path/to/ncu)" >&2; exit 2; }
metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum
mkdir -p "$(dirname "$out_csv")"
"$NCU" --clock-control none --profile-from-start off --nvtx --metrics "$metrics" \
    --export "$rep" --force-overwrite \
    python3 -m workloads run --no-profile --annotate nvtx --no-check "$@" >&2
imp=("$NCU" --import "$rep.ncu-rep" --csv --page raw --print-units base
        --print-kernel-base demangled --metrics "$metrics")
# NVTX columns on import: try --nvtx, else the plain raw page.
"${imp[@]}" --nvtx > "$out_csv.partial" || "${imp[@]}" > "$out_csv.partial" ||
    "$NCU" --import "$rep.ncu-rep" --csv --page raw > "$out_csv.partial"
mv "$out_csv.partial" "$out_csv"
echo "$out_csv"
