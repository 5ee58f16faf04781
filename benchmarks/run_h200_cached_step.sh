#!/usr/bin/env bash
# One H200: what a cached step costs on the host and on the device (benchmarks/step_costs.py with a host profile and
# a trace of one more call per mode), and where static FP8's producer kernels could still save time
# (benchmarks/profile_flux.py: fixed attention scales, coordinate-descent tuning, max-autotune). Expects the diffusers,
# torchao and cudnn-frontend wheels in .whl/; writes logs and JSON under $OUT:
#   bash benchmarks/run_h200_cached_step.sh [steps|steps_before|host|fp8|autotune|static|static_e2e|rows|rows_e2e|split|ndtile|fuse|fuse_e2e|producers|tests]...
# (default: steps fp8). steps_before: the same as steps with another checkout's src in .before/src (a change's
# baseline, same lease); host: the host time of a cached step on this machine's CPU (host_cached_step.py, against
# .before/src when present; cache-dit's anchor when its wheels are in .whl2/).
# static: calibrated (static) FP8 attention scales beside the dynamic ones, per call (profile_flux.py); static_e2e: the
# same end to end (cp_flux.py, bf16 first as the quality baseline); rows / rows_e2e: static FP8 with one weight scale
# per output channel beside one per tensor, per call and end to end; split: the single blocks' proj_out as two FP8
# matmuls (splitout) or one over FP8 parts (catfp8), fused Q/K/V projections (fuseqkv), per call, with inductor's generated code of the first mode
# (output_code.log.gz); ndtile: inductor's 2-D tiling of pointwise kernels (prefer_nd_tiling), alone and with
# fused Q/K/V; autotune: max-autotune (AUTOTUNE_MODES); fuse: fastdit's fused projections (Fuse) per call, bf16 and
# static FP8, beside diffusers' fused Q/K/V; fuse_e2e: the same end to end (cp_flux.py, bf16 first as the quality
# baseline); producers: every FP8 matmul of a call timed at its shape, fused and not, and the single blocks' GELU +
# concatenation + cast kernel against a tiled Triton kernel (probe_fp8_producers.py);
# tests: the GPU tests of FP8 attention, static FP8 and fused projections.
set -uo pipefail
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl
if compgen -G ".whl2/*.whl" > /dev/null; then python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl2/*.whl; fi
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
    steps_before) PYTHONPATH=$SITE:$PWD/.before/src timeout 300 python3 benchmarks/step_costs.py \
        --modes $C,$C+cache+ahead+outer,$C+cache4+ahead+outer,$C+magfast+outer --out "$OUT/step_costs_before.json" 2>&1 \
        | grep -v -e Warning -e "Failed to load" | tee "$OUT/step_costs_before.log" | tail -9 ;;
    host) B=(); [ -d .before/src ] && B=(--baseline-src .before/src --baseline-label "${BEFORE_LABEL:-before}")
      [ -n "${LABEL:-}" ] && B+=(--label "$LABEL")
      timeout 200 python3 benchmarks/host_cached_step.py "${B[@]}" --rounds "${ROUNDS:-15}" --out "$OUT/host_cached_step.json" \
        2>&1 | grep -v -e Warning -e "Failed to load" | tee "$OUT/host_cached_step.log" | grep -v "^W1" | tail -60 ;;
    fp8) timeout 300 python3 benchmarks/profile_flux.py --modes $Q,$Q+attnfixed,$Q+cdt --out "$OUT/profile_fp8.json" 2>&1 \
        | grep -v -e Warning -e "Failed to load" | tee "$OUT/profile_fp8.log" | tail -30 ;;
    autotune) timeout 580 python3 benchmarks/profile_flux.py --modes ${AUTOTUNE_MODES:-$Q,$Q+autotune,$Q+autotune+tma} --out "$OUT/profile_autotune.json" 2>&1 \
        | grep -v -e Warning -e "Failed to load" | tee "$OUT/profile_autotune.log" | tail -30 ;;
    static) timeout 300 python3 benchmarks/profile_flux.py --modes $Q,$Q+attnstatic,$Q+attnfixed \
        --out "$OUT/profile_static_attention.json" 2>&1 | grep -v -e Warning -e "Failed to load" \
        | tee "$OUT/profile_static_attention.log" | tail -30 ;;
    static_e2e) E=single+compile+graph+vae+outer
      timeout 420 python3 benchmarks/cp_flux.py --modes $E,$E+q8s+cudnnfp8,$E+q8s+cudnnfp8s,$E+q8s+cudnnfp8s+magultra \
        --repeat 3 --out "$OUT/single_static_attention.json" 2>&1 | grep -v -e Warning -e "Failed to load" \
        | tee "$OUT/single_static_attention.log" | grep "^|" | tail -8 ;;
    rows) timeout 300 python3 benchmarks/profile_flux.py --modes $Q,$Q+rows --out "$OUT/profile_rows.json" 2>&1 \
        | grep -v -e Warning -e "Failed to load" | tee "$OUT/profile_rows.log" | tail -30 ;;
    rows_e2e) E=single+compile+graph+vae+outer
      timeout 300 python3 benchmarks/cp_flux.py --modes $E,$E+q8s+cudnnfp8s,$E+q8r+cudnnfp8s \
        --repeat 3 --out "$OUT/single_rows.json" 2>&1 | grep -v -e Warning -e "Failed to load" \
        | tee "$OUT/single_rows.log" | grep "^|" | tail -8 ;;
    split) S=$Q+attnstatic
      TORCH_LOGS=output_code TORCH_LOGS_OUT="$OUT/output_code.log" timeout 200 python3 benchmarks/profile_flux.py --modes $S \
        --out "$OUT/profile_split_base.json" 2>&1 | grep -v -e Warning -e "Failed to load" | tail -3; gzip -f "$OUT/output_code.log"
      timeout 400 python3 benchmarks/profile_flux.py --modes $S,$S+splitout,$S+catfp8,$S+fuseqkv \
        --out "$OUT/profile_split.json" 2>&1 | grep -v -e Warning -e "Failed to load" | tee "$OUT/profile_split.log" | tail -60 ;;
    ndtile) S=$Q+attnstatic
      timeout 400 python3 benchmarks/profile_flux.py --modes $S,$S+ndtile,$S+fuseqkv+ndtile \
        --out "$OUT/profile_ndtile.json" 2>&1 | grep -v -e Warning -e "Failed to load" | tee "$OUT/profile_ndtile.log" | tail -40 ;;
    fuse) S=$Q+attnstatic B=compile+graph
      timeout 500 python3 benchmarks/profile_flux.py --modes $B,$B+fuse,$S,$S+fuse,$S+fuseqkv \
        --out "$OUT/profile_fuse.json" 2>&1 | grep -v -e Warning -e "Failed to load" | tee "$OUT/profile_fuse.log" | tail -60 ;;
    fuse_e2e) E=single+compile+graph+vae+outer
      timeout 500 python3 benchmarks/cp_flux.py --modes $E,$E+fuse,$E+q8s+cudnnfp8s,$E+q8s+cudnnfp8s+fuse \
        --repeat 3 --out "$OUT/single_fuse.json" 2>&1 | grep -v -e Warning -e "Failed to load" \
        | tee "$OUT/single_fuse.log" | grep "^|" | tail -8 ;;
    producers) (cd benchmarks && timeout 400 python3 probe_fp8_producers.py --out "$OUT/fp8_producers.json") 2>&1 \
        | grep -v -e Warning -e "Failed to load" | tee "$OUT/fp8_producers.log" | tail -60 ;;
    tests) timeout 300 python3 -m pytest -q -m gpu tests/parallel/attention tests/test_quantize_static.py tests/test_quantize_rows.py tests/test_fuse.py 2>&1 \
        | tail -15 | tee "$OUT/gpu_tests.log" ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
