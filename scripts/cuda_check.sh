#!/usr/bin/env bash
# On a machine with CUDA and torch: what needs a GPU. Run from the repository root; logs go to $OUT (default
# /tmp/cuda_check). Parts, in the order given (default: bench tests suite):
#   bench   `bench throughput` on a random-weight Llama-3-8B-shape model against transformers on the same GPU
#           (the model directory: scripts/make_shape_model.py llama-3-8b .gpu/llama3-8b, made where a tokenizer is)
#   tests   tests/gpu (the engine on CUDA against transformers on CUDA, CUDA graphs against eager steps) and the
#           Triton decode kernel against the torch reference
#   suite   the engine, sampling and model tests with CUDA visible (EngineConfig's device auto picks it)
#   again   `bench throughput` once more, no baseline (a second process: Triton's disk cache warm)
#   unfused the same with LLMSERVE_FUSED_OPS=0 (torch's elementwise ops: the A/B of kernels/triton/fused.py)
#   sync    the same with --no-async-scheduling (synchronous steps: the A/B of async scheduling, engine/llm_engine.py)
#   base    the same from another checkout, BASE=DIR (e.g. `git archive COMMIT llmserve | tar -x -C DIR`): a same-run
#           comparison with earlier code on the same GPU
#   latency `bench latency`, one request, 36-token prompt, 128 tokens
#   int8    `bench throughput` and `bench latency` with --quantization int8 (kernels/triton/int8.py), then the same
#           with LLMSERVE_INT8_TRITON=0 (torch's path, the weight dequantized at every call): its A/B
# Extra `bench throughput` flags: BENCH_FLAGS="...".
set -u
OUT=${OUT:-/tmp/cuda_check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PY:-python3}
MODEL=${MODEL:-.gpu/llama3-8b}
MODEL_PATH=$(realpath "$MODEL")
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm,clocks.max.sm --format=csv
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).multi_processor_count, 'SMs')"
nproc
W=(--num-prompts 64 --input-len 36:390 --output-len 128 --ignore-eos)
status=0
for part in "${@:-bench tests suite}"; do
  for p in $part; do
    echo "=== $p $(date -u +%H:%M:%S)"
    case $p in
      bench)
        timeout "${BENCH_TIMEOUT:-300}" $PY -m llmserve.cli bench throughput "$MODEL" --load-format dummy \
          --dtype bfloat16 "${W[@]}" --baseline transformers --baseline-batch-size 32 ${BENCH_FLAGS:-} \
          2>&1 | tee "$OUT/bench.log" || status=1 ;;
      again|unfused|base|sync)
        dir=$PWD; env=(); extra=()
        [ "$p" = unfused ] && env=(LLMSERVE_FUSED_OPS=0)
        [ "$p" = sync ] && extra=(--no-async-scheduling)
        [ "$p" = base ] && dir=${BASE:?BASE=DIR of the other checkout}
        (cd "$dir" && env "${env[@]}" PYTHONPATH="$dir" timeout "${BENCH_TIMEOUT:-300}" $PY -m llmserve.cli bench \
          throughput "$MODEL_PATH" --load-format dummy --dtype bfloat16 "${W[@]}" "${extra[@]}" ${BENCH_FLAGS:-}) \
          2>&1 | tee "$OUT/$p.log" | grep -v "^\s*$" | tail -25 || status=1 ;;
      latency)
        timeout "${BENCH_TIMEOUT:-300}" $PY -m llmserve.cli bench latency "$MODEL" --load-format dummy \
          --dtype bfloat16 --input-len 36 --output-len 128 2>&1 | tee "$OUT/latency.log" | tail -25 || status=1 ;;
      int8)
        for env in LLMSERVE_INT8_TRITON=1 LLMSERVE_INT8_TRITON=0; do
          echo "--- $env"
          env $env timeout "${BENCH_TIMEOUT:-300}" $PY -m llmserve.cli bench throughput "$MODEL" --load-format dummy \
            --dtype bfloat16 "${W[@]}" --quantization int8 ${BENCH_FLAGS:-} 2>&1 | tee -a "$OUT/int8.log" \
            | grep -v "^\s*$" | tail -6 || status=1
          env $env timeout "${BENCH_TIMEOUT:-300}" $PY -m llmserve.cli bench latency "$MODEL" --load-format dummy \
            --dtype bfloat16 --quantization int8 --input-len 36 --output-len 128 2>&1 | tee -a "$OUT/int8.log" \
            | tail -8 || status=1
        done ;;
      profile)
        timeout "${BENCH_TIMEOUT:-300}" $PY -m llmserve.cli bench throughput "$MODEL" --load-format dummy \
          --dtype bfloat16 "${W[@]}" --profile-steps ${BENCH_FLAGS:-} 2>&1 | tee "$OUT/profile.log" || status=1 ;;
      tests)
        # the CPU extension builds meanwhile (the int8-KV test compares with the CPU engine; a fresh machine compiles
        # it, minutes): it failed at the 60 s limit on an H200 when the build started inside it
        (timeout 400 $PY -c "from llmserve.kernels import native; native.load()" >"$OUT/native_build.log" 2>&1 &)
        # a per-test limit, so one stuck test (the qblock file ran ~15 s a test on an H100, and one call of two of its
        # tests passed 90 s) fails alone and the summary still prints; the durations say where the time went
        timeout "${TESTS_TIMEOUT:-420}" $PY -m pytest -q -p no:cacheprovider --timeout "${TEST_TIMEOUT:-60}" -rfE \
          --durations=10 tests/gpu tests/attention/test_triton_decode.py tests/attention/test_triton_prefill.py \
          tests/kernels/test_triton_fused.py tests/kernels/test_triton_qblock.py tests/kernels/test_triton_int8.py 2>&1 \
          | tee "$OUT/gpu_tests.log" | tail -40 || status=1 ;;
      suite)
        # the CPU extension first (tests compare with the CPU engine): its compile outlasted a test's timeout once
        timeout 300 $PY -c "from llmserve.kernels import native; print('native extension:', native.load() is not None)"
        timeout "${SUITE_TIMEOUT:-240}" $PY -m pytest -v -p no:cacheprovider --timeout 60 \
          --continue-on-collection-errors tests/engine tests/sampling tests/models tests/test_chat_sessions.py 2>&1 \
          | tee "$OUT/suite.log" | grep -v PASSED | tail -40 || status=1 ;;
      *) echo "unknown part $p"; status=2 ;;
    esac
  done
done
exit $status
