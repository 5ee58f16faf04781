#!/usr/bin/env bash
# Third two-GPU pass: eager head-chunk pipelining, ring with compiled blocks, and 2048x2048 (10 steps).
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
run chunks_eager 150 --modes single,ulysses+chunks2 --profile ulysses+chunks2
run compile_ring 240 --modes single,single+compile,ring+compile,ulysses+compile --profile single+compile
run size2048 170 --size 2048 --steps 10 --repeat 1 --modes single,ulysses,ring
