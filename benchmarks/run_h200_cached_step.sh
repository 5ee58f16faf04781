#!/usr/bin/env bash
# One H200: what a cached step costs on the host and on the device (benchmarks/step_costs.py with a host profile and
# a trace of one more call per mode), and where static FP8's producer kernels could still save time
# (benchmarks/profile_flux.py: fixed attention scales, coordinate-descent tuning, max-autotune). Expects the diffusers,
# torchao and cudnn-frontend wheels in .whl/; writes logs and JSON under $OUT:
#   bash benchmarks/run_h200_cached_step.sh [steps|fp8|autotune]...   (default: steps fp8)
set -uo pipefail
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl
export PYTHONPATH=$SITE:$PWD/src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/device.txt"
Q=compile+graph+fp8_static+cudnnfp8
C=single+compile+graph
for part in ${*:-steps fp8}; do
  case $part in
    steps) timeout 300 python3 benchmarks/step_costs.py --modes $C,$C+cache+ahead+outer,$C+cache4+ahead+outer,$C+magfast+outer \
        --host-profile "$OUT/profiles" --out "$OUT/step_costs.json" 2>&1 | grep -v -e Warning -e "Failed to load" \
        | tee "$OUT/step_costs.log" | tail -9 ;;
    fp8) timeout 300 python3 benchmarks/profile_flux.py --modes $Q,$Q+attnfixed,$Q+cdt --out "$OUT/profile_fp8.json" 2>&1 \
        | grep -v -e Warning -e "Failed to load" | tee "$OUT/profile_fp8.log" | tail -30 ;;
    autotune) timeout 560 python3 benchmarks/profile_flux.py --modes $Q+autotune --out "$OUT/profile_autotune.json" 2>&1 \
        | grep -v -e Warning -e "Failed to load" | tee "$OUT/profile_autotune.log" | tail -30 ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
