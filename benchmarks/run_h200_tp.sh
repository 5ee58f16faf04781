#!/usr/bin/env bash
# One H200: tensor parallelism through a one-rank mesh (bf16 numerics of the split layers, DTensor dispatch cost,
# eager and compiled) and the GPU-marked tests. Expects the diffusers wheel in .whl/ (see docs/benchmarks.md);
# writes logs and JSON under $OUT.
set -uo pipefail
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl
export PYTHONPATH=$SITE:$PWD/src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/device.txt"
torchrun --nproc-per-node 1 benchmarks/tp_one_gpu.py --out "$OUT/tp_one_gpu.json" 2>&1 | grep -v Warning | tail -8 \
  | tee "$OUT/tp_one_gpu.log"
python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
