#!/usr/bin/env bash
# The GPU captures of issues 11-13 for sample_traces/, one device call per machine kind:
#   bash workloads/capture_issues.sh single OUT   # one GPU: generate/eager, CUDA graphs, compile, MoE
#   bash workloads/capture_issues.sh tp2 OUT      # two GPUs: TP=2 rank traces + all-reduce busbw
#   bash workloads/capture_issues.sh moe-graphs OUT  # one GPU: MoE decode steps in CUDA graphs,
#                                                    # batched_mm (and Qwen1.5-MoE's grouped_mm)
# Writes OUT/capture_<kind>.log, OUT/env_<kind>.txt and OUT/traces_<kind>.tar (the .json.gz traces
# and JSON results, re-tarred after every step so a timeout keeps whatever was captured). Each
# step runs in its own process under `timeout`; a failing step is logged and the rest still run.
# Steps start only while DEADLINE seconds (default 540) are not used up.
set -u
KIND=${1:?single or tp2}
OUT=${2:-${OUT:?set OUT or pass a directory}}
DEADLINE=${DEADLINE:-540}
W=/tmp/captures_$KIND
mkdir -p "$W" "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The GPU image lacks the analyzer's dependencies (msgspec): if `import trace_roofline` fails, load
# its submodules (models, errors, _files: all the workloads need) without running its __init__
# (as capture_all.sh does); PYTHONPATH carries this into the spawned rank processes too.
if ! python3 -c 'import trace_roofline' 2>/dev/null; then
  mkdir -p /tmp/shim
  printf 'import sys, types\npkg = types.ModuleType("trace_roofline")\npkg.__path__ = ["%s/trace_roofline"]\nsys.modules["trace_roofline"] = pkg\n' "$PWD" > /tmp/shim/sitecustomize.py
  export PYTHONPATH=/tmp/shim:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
LOG="$OUT/capture_$KIND.log"
retar() { tar cf "$OUT/traces_$KIND.tar.partial" -C "$W" . && mv "$OUT/traces_$KIND.tar.partial" "$OUT/traces_$KIND.tar"; }
step() {  # step SECONDS NAME command...
  local limit=$1 name=$2; shift 2
  if (( SECONDS + limit > DEADLINE )); then
    echo "=== SKIP $name: ${SECONDS}s used, ${limit}s more would pass ${DEADLINE}s"; return 1
  fi
  echo "=== $name (t=${SECONDS}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@"
  local rc=$?
  echo "=== $name exit $rc in $((SECONDS - t0))s"
  retar
  return $rc
}
{
  date -u
  {
    date -u; nvidia-smi; nvidia-smi topo -m
    python3 -m pip list 2>/dev/null | grep -iE '^(torch|transformers|triton|numpy) '
    python3 -c 'import torch,sys;print("python",sys.version);print("torch",torch.__version__,"cuda",torch.version.cuda,"nccl",torch.cuda.nccl.version());[print(torch.cuda.get_device_properties(i)) for i in range(torch.cuda.device_count())]'
  } > "$OUT/env_$KIND.txt" 2>&1
  case $KIND in
    single)
      step 90 generate python3 -m workloads.capture_generate --out "$W" all
      step 90 cudagraph python3 -m workloads.capture_graphs --out "$W" --batch 1,4 cudagraph --traces mapping,graph \
        || step 90 cudagraph-nocudnn python3 -m workloads.capture_graphs --out "$W" --batch 1,4 --no-cudnn-sdpa cudagraph --traces mapping,graph
      for m in mixtral-8x7b qwen1.5-moe-a2.7b qwen3-30b-a3b; do
        step 100 "moe-$m" python3 -m workloads.capture_moe --out "$W" --model "$m" all
      done
      step 200 compiled-b1 python3 -m workloads.capture_graphs --out "$W" --batch 1 compiled --mode reduce-overhead,default
      step 120 compiled-b4 python3 -m workloads.capture_graphs --out "$W" --batch 4 compiled --mode reduce-overhead
      step 60 graphcapture python3 -m workloads.capture_graphs --out "$W" --batch 1 cudagraph --traces capture
      step 100 generate-static python3 -m workloads.capture_graphs --out "$W" --batch 1 generate-static --mode reduce-overhead
      ;;
    tp2)
      step 150 tp python3 -m workloads.capture_tp --out "$W" --tp 2 --variant decode:none:tensorboard \
        --variant prefill:none:rank --variant decode:record_function:rank --variant prefill:record_function:rank
      NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,GRAPH,TUNING step 120 allreduce-busbw \
        python3 -m workloads.calibrate --link-only --out "$W/h200x2_allreduce_busbw.json"
      ;;
    moe-graphs)
      for m in mixtral-8x7b qwen3-30b-a3b qwen1.5-moe-a2.7b; do
        step 150 "graph-batchedmm-$m" python3 -m workloads.capture_moe --out "$W" --model "$m" graph \
          --experts batched_mm
      done
      step 150 graph-groupedmm-qwen1.5-moe python3 -m workloads.capture_moe --out "$W" \
        --model qwen1.5-moe-a2.7b graph --experts grouped_mm
      ;;
    *) echo "unknown kind $KIND"; exit 2 ;;
  esac
  ls -laR "$W"
  date -u
} 2>&1 | tee "$LOG"
retar
