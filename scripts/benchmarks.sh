#!/usr/bin/env bash
# The figures in BENCHMARKS.md, in order. Run on a quiet machine (nothing else on the cores).
# Usage: bash scripts/benchmarks.sh OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/llmserve-bench}
mkdir -p "$out"
ls=.venv/bin/llmserve
lscpu | grep -E "Model name|^CPU\(s\)|Flags" | sed 's/Flags:.*\(avx512[a-z_]*\).*/Flags: has \1/' > "$out/machine.txt"
date -u +%Y-%m-%d >> "$out/machine.txt"

# GGUF load: cold (empty conversion cache) then warm.
cold=$(mktemp -d)
LLMSERVE_CACHE_DIR=$cold .venv/bin/python -m llmserve.models.loader > "$out/load_cold.txt" 2>&1
LLMSERVE_CACHE_DIR=$cold .venv/bin/python -m llmserve.models.loader > "$out/load_warm.txt" 2>&1
rm -rf "$cold"

# Offline throughput, 64 chat prompts of 36-390 tokens x 128 output tokens, greedy, ignore_eos.
for bs in 64 32; do
  $ls bench throughput --num-prompts 64 --input-len 36:390 --output-len 128 --ignore-eos --dtype float32 \
     --baseline transformers --baseline-batch-size $bs --json > "$out/throughput_fp32_bs$bs.json"
done
# bf16 has no fast path on CPUs without AVX512-BF16/AMX: a smaller workload shows the ratio.
$ls bench throughput --num-prompts 16 --input-len 36:390 --output-len 32 --ignore-eos --dtype bfloat16 \
   --baseline transformers --baseline-batch-size 16 --json > "$out/throughput_bf16_small.json"
# Same-run A/B of engine settings (no baseline).
$ls bench throughput --num-prompts 64 --input-len 36:390 --output-len 128 --ignore-eos --dtype float32 \
   --enable-prefix-caching --json > "$out/throughput_fp32_prefix.json"
LLMSERVE_NO_MALLOC_TUNING=1 $ls bench throughput --num-prompts 64 --input-len 36:390 --output-len 128 \
   --ignore-eos --dtype float32 --json > "$out/throughput_fp32_no_malloc_tuning.json"
# Single request.
$ls bench latency --input-len 36 --output-len 128 --num-iters 5 --dtype float32 --json > "$out/latency_fp32.json"
echo "done: $out"
