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

# Offline throughput, 64 chat prompts of 36-390 tokens x 128 output tokens, greedy, ignore_eos, each
# next to transformers in the same run; then same-run A/Bs of engine settings (no baseline).
W="--num-prompts 64 --input-len 36:390 --output-len 128 --ignore-eos --json"
$ls bench throughput $W --dtype float32 --kv-cache-dtype bfloat16 --baseline transformers --baseline-batch-size 64 \
   > "$out/throughput_fp32_kvbf16_tf.json"
$ls bench throughput $W --dtype bfloat16 --baseline transformers --baseline-batch-size 32 > "$out/throughput_bf16_tf.json"
$ls bench throughput $W --dtype float32 > "$out/throughput_fp32.json"
$ls bench throughput $W --dtype float32 --no-enable-prefix-caching > "$out/throughput_fp32_no_prefix.json"
LLMSERVE_FUSED_OPS=0 $ls bench throughput $W --dtype float32 > "$out/throughput_fp32_unfused.json"
$ls bench throughput $W --dtype bfloat16 --quantization int8 > "$out/throughput_bf16_int8.json"
# Single request.
for args in "--dtype bfloat16 --quantization int8" "--dtype float32 --quantization int8" "--dtype bfloat16" \
            "--dtype float32"; do
  $ls bench latency --input-len 36 --output-len 128 --num-iters 5 $args --json > "$out/latency ${args}.json"
done
# KV reuse: a shared 1k-token system prompt (caching off/on) and an 8-turn chat (no reuse / sessions / caching).
.venv/bin/python scripts/bench_kv_reuse.py --dtype float32 > "$out/kv_reuse.txt" 2>&1
echo "done: $out"
