#!/usr/bin/env bash
# Tensor and CFG parallelism on 2 (or 4) H200s, one command: FLUX.1-dev-sized pipeline, one GPU vs TP-N (eager, compiled,
# compiled + CUDA graphs, with the cache) vs diffusers' own TP; per-GPU model and peak memory; TP-2 x Ulysses-2
# when 4 GPUs are visible. Expects the diffusers wheel in .whl/ (docs/benchmarks.md); writes under $OUT.
set -uo pipefail
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl
export PYTHONPATH=$SITE:$PWD/src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/device.txt" | wc -l)
MODES=single,tp,tp+compile,tp+compile+graph,tp+cache,single+compile,diffusers_tp
torchrun --nproc-per-node 2 benchmarks/cp_flux.py --modes "$MODES" --out "$OUT/tp_flux_x2.json" 2>&1 \
  | grep -v Warning | tail -14 | tee "$OUT/tp_flux_x2.log"
torchrun --nproc-per-node 2 benchmarks/tp_gqa.py --out "$OUT/tp_gqa_x2.json" 2>&1 | grep -v Warning | tail -8 \
  | tee "$OUT/tp_gqa_x2.log"
# CFG parallelism: FLUX true CFG (two calls per step) and PixArt-Σ batched CFG, cfg=2 vs one GPU.
torchrun --nproc-per-node 2 benchmarks/cp_flux.py --true-cfg \
  --modes single,cfg,single+compile,cfg+compile,cfg+compile+graph --out "$OUT/cfg_flux_x2.json" 2>&1 \
  | grep -v Warning | tail -10 | tee "$OUT/cfg_flux_x2.log"
torchrun --nproc-per-node 2 benchmarks/cfg_batched.py --out "$OUT/cfg_batched_x2.json" 2>&1 | grep -v Warning \
  | tail -8 | tee "$OUT/cfg_batched_x2.log"
# VAE parallelism: decode time and per-GPU peak memory of the FLUX.1 VAE, 1 GPU vs 2 (vs 4), NCCL.
RANKS=2; [ "$GPUS" -ge 4 ] && RANKS="2 4"
for SIZE in 1024 2048; do
  python3 benchmarks/vae_parallel.py --size "$SIZE" --ranks $RANKS --out "$OUT/vae_parallel_$SIZE.json" 2>&1 \
    | grep -v Warning | tail -6 | tee "$OUT/vae_parallel_$SIZE.log"
done
python3 benchmarks/vae_parallel.py --vae wan --size 480 --frames 81 --ranks $RANKS --out "$OUT/vae_parallel_wan.json" \
  2>&1 | grep -v Warning | tail -6 | tee "$OUT/vae_parallel_wan.log"
if [ "$GPUS" -ge 4 ]; then
  torchrun --nproc-per-node 4 benchmarks/cp_flux.py --modes single,tp,tp_ulysses,tp_ulysses+compile,ulysses \
    --out "$OUT/tp_flux_x4.json" 2>&1 | grep -v Warning | tail -12 | tee "$OUT/tp_flux_x4.log"
fi
python3 -m pytest -q -m "gpu or multigpu" tests -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
