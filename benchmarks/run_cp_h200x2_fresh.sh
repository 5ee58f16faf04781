#!/usr/bin/env bash
# Compiled Ulysses and ring, each in a fresh process (no earlier compiled mode in the same process).
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
run fresh_ulysses_compile 200 --modes single,ulysses+compile
run fresh_ring_compile 200 --modes single,ring+compile
