#!/usr/bin/env bash
# Follow-up to run_cp_h200x2.sh: Ulysses with head-chunk pipelining (eager and compiled) and with CUDA graphs.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-benchmarks/results}
run() {  # name, timeout, then cp_flux.py arguments
  local name=$1 limit=$2
  shift 2
  timeout "$limit" torchrun --nproc_per_node 2 benchmarks/cp_flux.py --out "$OUT/cp_flux_$name.json" "$@" \
    >"$OUT/cp_flux_$name.log" 2>&1
  echo "$name: exit $?"
  grep -E "^\||^profile" "$OUT/cp_flux_$name.log"
}
run chunks 120 --modes single,ulysses+chunks2,ulysses+chunks4 --profile ulysses+chunks2
run compile_chunks 230 --modes single,single+compile,ulysses+compile+chunks2 --profile ulysses+compile+chunks2
run cudagraphs 200 --modes single,ulysses+cudagraphs+chunks2
