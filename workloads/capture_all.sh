#!/usr/bin/env bash
# All GPU captures for sample_traces/ in one device call:  bash workloads/capture_all.sh [OUT [ONLY]]
# CAPTURE_WORK: staging directory (default /tmp/captures).
# ONLY: comma-separated capture names of workloads/capture_all.py (plus `ncu`) to redo just those.
# Writes into OUT (default $OUT): capture.log and captures.tar.gz (traces, sweep results,
# calibration JSON, ncu CSV, nvidia-smi, pip versions, GPU pytest log), re-tarred after every
# step so a timeout keeps whatever was captured. Each step is independent (no set -e).
# Refuses (exit 2) where torch sees no CUDA GPU: the captures and the calibration are the GPU's.
# Interrupted (INT, TERM, HUP), it ends every process it started before exiting.
OUT=${1:-${OUT:?set OUT or pass a directory}}
ONLY=${2:-}
W=${CAPTURE_WORK:-/tmp/captures}  # staging directory (tar source)
if ! python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "capture_all.sh: error: torch sees no CUDA GPU here; these captures are GPU traces" >&2
  exit 2
fi
# Every descendant of a process, deepest first (by pid, never by name).
kill_tree() {
  local child
  for child in $(pgrep -P "$1"); do kill_tree "$child"; done
  kill -TERM "$1" 2>/dev/null
}
on_signal() {
  trap - INT TERM HUP
  echo "capture_all.sh: interrupted; stopping the captures" >&2
  for child in $(pgrep -P $$); do kill_tree "$child"; done
  wait
  exit 130
}
trap on_signal INT TERM HUP
set -x
mkdir -p "$W" "$OUT"
export PYTHONUNBUFFERED=1
# The analyzer package may be mid-edit by teammates: if `import trace_roofline` fails, load its
# submodules (models, errors: all the workloads need) without running its __init__.
if ! python3 -c 'import trace_roofline' 2>/dev/null; then
  mkdir -p /tmp/shim
  printf 'import sys, types\npkg = types.ModuleType("trace_roofline")\npkg.__path__ = ["%s/trace_roofline"]\nsys.modules["trace_roofline"] = pkg\n' "$PWD" > /tmp/shim/sitecustomize.py
  export PYTHONPATH=/tmp/shim${PYTHONPATH:+:$PYTHONPATH}
fi
retar() { tar czf "$OUT/captures.tar.gz.partial" -C "$W" . && mv "$OUT/captures.tar.gz.partial" "$OUT/captures.tar.gz"; }
captures() {
  date -u
  nvidia-smi > "$W/nvidia-smi.txt" 2>&1
  nvidia-smi -q -d CLOCK,POWER,PERFORMANCE > "$W/nvidia-smi-q.txt" 2>&1
  python3 -m pip list 2>/dev/null | grep -iE '^(torch|transformers|triton|numpy) ' > "$W/versions.txt"
  python3 -c 'import torch,sys;print("python",sys.version);print("torch",torch.__version__,"cuda",torch.version.cuda);print(torch.cuda.get_device_properties(0))' >> "$W/versions.txt" 2>&1
  (command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu) >> "$W/versions.txt" 2>&1
  retar
  # 1. calibration, annotated traces, sweep, unannotated fixtures (one process)
  timeout 330 python3 -m workloads.capture_all ${ONLY:+--only "$ONLY"} "$W" "tar czf $OUT/captures.tar.gz.partial -C $W . && mv $OUT/captures.tar.gz.partial $OUT/captures.tar.gz"
  echo "capture_all exit $?"
  retar
  # 2. ncu: same decode B=1 S=2048 workload as qwen2.5-7b_decode_b1_s2048_h200.json.gz
  if [ -z "$ONLY" ] || [[ ",$ONLY," == *,ncu,* ]]; then
    timeout 110 bash workloads/ncu_capture.sh "$W/qwen2.5-7b_decode_b1_s2048_h200.ncu.csv" \
        --phase decode --batch 1 --context 2048 --warmup 2 --steps 3 --out "$W"
    echo "ncu exit $?"
  fi
  retar
  # 3. GPU tests
  timeout 110 python3 -m pytest -m gpu -v -p no:cacheprovider tests/workloads/test_workloads_gpu.py > "$W/pytest_gpu.log" 2>&1
  echo "pytest exit $?"
  retar
  ls -la "$W"
  date -u
}
# In the background, so that a signal runs on_signal at once (bash defers traps until a
# foreground command ends).
captures 2>&1 | tee "$OUT/capture.log" &
wait $!
retar
