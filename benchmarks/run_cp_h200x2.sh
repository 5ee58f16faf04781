#!/usr/bin/env bash
# Context-parallel benchmark passes on two GPUs. Each stage is one torchrun process pair (diffusers' and cache-dit's
# parallelism cannot be undone in-process, so each anchor gets its own); logs and JSON land in $OUT.
# Expects diffusers (and cache-dit for its row) importable, e.g. wheels installed into PYTHONPATH.
#
#   bash benchmarks/run_cp_h200x2.sh [main|overlap|scaling|fresh|graph|graph1|graph1_small|graph1_cache]
# (graph1, graph1_small and graph1_cache run on one GPU.)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-benchmarks/results}
NPROC=2
run() {  # name, timeout in seconds, then cp_flux.py arguments
  local name=$1 limit=$2
  shift 2
  timeout "$limit" torchrun --nproc_per_node "$NPROC" benchmarks/cp_flux.py --out "$OUT/cp_flux_$name.json" "$@" \
    >"$OUT/cp_flux_$name.log" 2>&1
  echo "$name: exit $?"
  grep -E "^\||^profile" "$OUT/cp_flux_$name.log"
}
case "${1:-main}" in
  main)  # fastdit eager, the two anchors, compiled blocks
    run fastdit 250 --modes single,ulysses,ring,ulysses+fp8 --profile single,ulysses
    run diffusers 250 --modes single,diffusers_ulysses --profile diffusers_ulysses
    run cachedit 250 --modes single,cachedit_ulysses
    run compile 250 --modes single,single+compile,ulysses+compile --profile ulysses+compile
    ;;
  overlap)  # head-chunk pipelining, eager and compiled
    run chunks_eager 150 --modes single,ulysses+chunks2 --profile ulysses+chunks2
    run compile_chunks 230 --modes single,single+compile,ulysses+compile+chunks2 --profile ulysses+compile+chunks2
    ;;
  scaling)  # ring with compiled blocks, and 2048x2048
    run compile_ring 240 --modes single,single+compile,ring+compile,ulysses+compile --profile single+compile
    run size2048 170 --size 2048 --steps 10 --repeat 1 --modes single,ulysses,ring
    ;;
  fresh)  # compiled modes, one per process
    run fresh_ulysses_compile 200 --modes single,ulysses+compile
    run fresh_ring_compile 200 --modes single,ring+compile
    ;;
  graph)  # whole calls replayed as CUDA graphs: eager kernels, then compiled ones (one compiled mode per process)
    run graph_eager 250 --modes single,single+graph,ulysses,ulysses+graph,ring+graph --profile ulysses+graph
    run graph_compile 250 --modes single,single+compile+graph,ulysses+compile+graph
    run graph_compile_ring 200 --modes single,ring+compile+graph
    ;;
  graph1)  # one GPU: eager, graphed eager, compiled, compiled and graphed (one compiled mode per process)
    NPROC=1
    run graph1_eager 200 --modes single,single+graph --profile single+graph
    run graph1_compile 200 --modes single,single+compile
    run graph1_compile_graph 200 --modes single,single+compile+graph
    ;;
  graph1_small)  # one GPU at 512x512, where a call's kernels are short and the CPU launching them sets the pace
    NPROC=1
    run graph1_512_eager 150 --size 512 --modes single,single+graph --profile single
    run graph1_512_compile 150 --size 512 --modes single,single+compile
    run graph1_512_compile_graph 150 --size 512 --modes single,single+compile+graph
    ;;
  graph1_cache)  # one GPU: a fixed-schedule cache, with and without CUDA graphs per block
    NPROC=1
    run graph1_cache_512 150 --size 512 --modes single,single+cache,single+cache+graph
    run graph1_cache_1024 150 --modes single,single+cache,single+cache+graph
    run graph1_cache_512_compile 150 --size 512 --modes single,single+compile+cache+graph
    run graph1_blocks_512 150 --size 512 --modes single,single+graph,single+blockgraph
    ;;
  *) echo "unknown pass $1 (main, overlap, scaling, fresh, graph, graph1, graph1_small, graph1_cache)" >&2; exit 2 ;;
esac
