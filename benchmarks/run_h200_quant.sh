#!/usr/bin/env bash
# One H200: quantization on the FLUX.1-dev-sized model (benchmarks/quant_flux.py) and the GPU-marked quantization
# tests. Expects the diffusers and torchao wheels in .whl/ (see docs/benchmarks.md, "Quantization"); writes logs and
# JSON under $OUT. Each part is one process of a few minutes (compile included), so a part can be re-run on its own:
#   bash benchmarks/run_h200_quant.sh [speed|memory|anchor|fp8attn|fp8attn-reference|reference|tests]... (default: all)
# (fp8attn needs the nvidia-cudnn-frontend wheel in .whl/ too.)
set -uo pipefail
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl
export PYTHONPATH=$SITE:$PWD/src
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/device.txt"
PARTS=${*:-speed memory anchor fp8attn fp8attn-reference reference tests}
run() {  # name, modes: each part repeats the bf16 baseline, the reference of its quality figures
  timeout 590 python3 benchmarks/quant_flux.py --mode-timeout 240 --modes "$2" --out "$OUT/quant_flux_$1.json" 2>&1 \
    | grep -v -e Warning -e "Failed to load" | tee "$OUT/quant_flux_$1.log" | grep -v "^\[" | tail -16
}
for part in $PARTS; do
  case $part in
    speed) run speed bf16+compile,fp8+compile,fp8_tensor+compile,fp8+compile+graph,fp8_tensor+compile+graph ;;
    memory) run memory bf16+compile,fp8+compile+noada,fp8+compile+all,fp8_weight+compile,int8_weight+compile,int8_weight ;;
    anchor) run anchor bf16+compile,fp8+compile,fp8+compile+fp8attn,anchor ;;
    fp8attn) run fp8attn bf16+compile+graph,bf16+compile+graph+cudnnfp8,fp8+compile+graph,fp8+compile+graph+cudnnfp8 ;;
    fp8attn-reference)
      timeout 300 python3 benchmarks/quant_flux.py --reference --modes bf16,bf16+cudnnfp8,fp8,fp8+cudnnfp8 \
        --out "$OUT/quant_reference_fp8attn.json" 2>&1 | grep -v -e Warning -e "Failed to load" \
        | tee "$OUT/quant_reference_fp8attn.log" | grep -v "^\[" | tail -8 ;;
    reference)
      timeout 590 python3 benchmarks/quant_flux.py --reference --out "$OUT/quant_reference.json" 2>&1 \
        | grep -v -e Warning -e "Failed to load" | tee "$OUT/quant_reference.log" | grep -v "^\[" | tail -14 ;;
    tests) python3 -m pytest -q -m gpu tests/test_quantize.py -p no:cacheprovider 2>&1 | tail -15 \
        | tee "$OUT/gpu_tests.log" ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
