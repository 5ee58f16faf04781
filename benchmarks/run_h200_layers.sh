#!/usr/bin/env bash
# One H200: GPU-marked tests, then the one-GPU cache / compile / CUDA-graph modes of cp_flux.py at 512² and 1024²,
# to compare with the figures measured before the technique list and layer stacks (docs/benchmarks.md).
# Expects the diffusers wheel in .whl/ (pip download --no-deps --only-binary=:all: diffusers==0.42.1 -d .whl, for the
# GPU machine's Python); writes logs and JSON under $OUT.
set -uo pipefail
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl
export PYTHONPATH=$SITE:$PWD/src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/device.txt"
python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
python3 benchmarks/cp_flux.py --size 512 --modes single,single+graph,single+cache,single+cache+graph,single+compile+cache+graph \
  --out "$OUT/cp_flux_layers_512.json" 2>&1 | grep -v Warning | tail -12 | tee "$OUT/cp_flux_layers_512.log"
python3 benchmarks/cp_flux.py --modes single,single+compile,single+compile+graph \
  --out "$OUT/cp_flux_layers_1024.json" 2>&1 | grep -v Warning | tail -10 | tee "$OUT/cp_flux_layers_1024.log"
