#!/usr/bin/env bash
# Context-parallel benchmark on two GPUs: fastdit eager modes, diffusers' and cache-dit's Ulysses (each in its own
# process, since neither can be undone), then fastdit with compiled blocks. Logs and JSON land in $OUT.
# Expects diffusers (and cache-dit for its row) importable, e.g. wheels installed into PYTHONPATH.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-benchmarks/results}
run() {  # name, then cp_flux.py arguments
  local name=$1
  shift
  timeout "${STAGE_TIMEOUT:-300}" torchrun --nproc_per_node 2 benchmarks/cp_flux.py --out "$OUT/cp_flux_$name.json" \
    "$@" >"$OUT/cp_flux_$name.log" 2>&1
  echo "$name: exit $?"
  grep -E "^\||^profile" "$OUT/cp_flux_$name.log"
}
run fastdit --modes single,ulysses,ring,ulysses+fp8 --profile single,ulysses
run diffusers --modes single,diffusers_ulysses --profile diffusers_ulysses
run cachedit --modes single,cachedit_ulysses
run compile --modes single,single+compile,ulysses+compile --profile ulysses+compile
