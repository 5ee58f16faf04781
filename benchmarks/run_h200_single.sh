#!/usr/bin/env bash
# One H200: the one-GPU speed table (benchmarks/cp_flux.py, FLUX.1-dev-sized, 1024², 28 steps) for every
# configuration — eager, compiled + CUDA graphs, FP8 rowwise — each without a cache, with fixed F1B0 schedules
# (computing every 2nd / 4th step) and with MagCache presets on the reference calibration; plus the FP8 attention
# probe. One process per precision (the first mode of each is its quality baseline). Expects the diffusers and torchao
# wheels in .whl/; writes logs and JSON under $OUT:
#   bash benchmarks/run_h200_single.sh [probe|eager|bf16|fp8|vae|anchor]...   (default: all, in this order)
# vae: FP8 with the VAE decoder compiled too; anchor: bf16 compiled blocks beside diffusers' compile_repeated_blocks.
set -uo pipefail
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl
export PYTHONPATH=$SITE:$PWD/src
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/device.txt"
PARTS=${*:-probe eager bf16 fp8 vae anchor}
run() {  # name, seconds, modes, extra arguments
  timeout "$2" python3 benchmarks/cp_flux.py --modes "$3" "${@:4}" --out "$OUT/single_$1.json" 2>&1 \
    | grep -v -e Warning -e "Failed to load" | tee "$OUT/single_$1.log" | grep "^|" | tail -12
}
C=single+compile+graph
Q=single+q8+compile+graph
for part in $PARTS; do
  case $part in
    probe) timeout 120 python3 benchmarks/probe_fp8_attention.py --out "$OUT/fp8_attention.json" 2>&1 \
        | grep -v -e Warning -e "Failed to load" | tail -8 ;;
    eager) run eager 150 single,single+cache,single+cache4,single+magfast ;;
    bf16) run bf16 200 single,$C,$C+cache,$C+cache4,$C+magfast --warmup 1 --repeat 2 ;;
    fp8) run fp8 260 single,$Q,$Q+cache,$Q+cache4,$Q+magbalanced,$Q+magfast,$Q+magultra --profile $Q+magfast ;;
    vae) run vae 300 single,$Q+vae,$Q+magfast,$Q+vae+magfast,$Q+vae+magultra ;;
    anchor) run anchor 200 single,single+compile,single+compile+vae,diffusers_compile ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
