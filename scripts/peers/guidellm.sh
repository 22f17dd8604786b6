#!/usr/bin/env bash
# guidellm (vLLM's serving benchmark) as a peer client: the load of ../shared/PEERS.md against any
# OpenAI-compatible server (llmserve serve, vLLM's api_server, llama-server), summarized from its benchmarks.json.
# guidellm goes in its own virtual environment (never the project's .venv), installed once (a stamp file marks it).
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: scripts/peers/guidellm.sh [OPTIONS] URL MODEL_DIR
       scripts/peers/guidellm.sh --install-only

Installs guidellm (once) in ${PEERS_DIR:-~/.cache/llmserve-peers}/guidellm and runs, from a scratch directory:
  guidellm run --backend kind=openai_http,target=URL --profile kind=concurrent,streams=32
    --constraint kind=max_requests,count=64 --tokenizer kind=hf_auto,model=MODEL_DIR
    --data kind=synthetic_text,prompt_tokens=256,output_tokens=128 --disable-progress
then prints output tok/s, TTFT mean/median and ITL median from its benchmarks.json.

  URL                  the server, e.g. http://127.0.0.1:8000 (no /v1)
  MODEL_DIR            tokenizer directory (the model directory the server reads, e.g. llmserve's converted
                       ~/.cache/llmserve/gguf/SmolLM2-135M-Instruct.Q4_1-<key>)
  --max-requests N     requests in all (64)
  --streams N          concurrent streams (32)
  --prompt-tokens N    synthetic prompt tokens (256)
  --output-tokens N    output tokens per request (128)
  --seed N             guidellm's random seed (its default, 42), which makes the synthetic prompts: a server with
                       a prefix cache answers a second run of the same prompts from it (vLLM's hit rate went to 45%
                       and its TTFT from 2.3 to 0.8 s), so give each run against one server a new seed (or restart it)
  --out DIR            keep guidellm's files (benchmarks.json, .csv, log) in DIR (default: a temporary
                       directory, removed afterwards)
  --json               print the summary as one JSON object
  --install-only       install (or check) the venv, run nothing
  -h, --help           this message

Environment: PEERS_DIR, GUIDELLM_VERSION (0.8.1), PYTHON (the interpreter that creates the venv, default python3).
EOF
}

here=$(cd "$(dirname "$0")" && pwd)
peers=${PEERS_DIR:-$HOME/.cache/llmserve-peers}
venv=$peers/guidellm
version=${GUIDELLM_VERSION:-0.8.1}
stamp=$venv/.installed-guidellm-$version

install_only=0 max_requests=64 streams=32 prompt_tokens=256 output_tokens=128 seed=42 out="" as_json=0
positional=()
while [ $# -gt 0 ]; do
    case $1 in
        -h|--help) usage; exit 0 ;;
        --install-only) install_only=1 ;;
        --max-requests|--streams|--prompt-tokens|--output-tokens|--seed|--out)
            [ $# -ge 2 ] || { echo "guidellm: $1 needs a value" >&2; usage >&2; exit 2; }
            case $1 in
                --max-requests) max_requests=$2 ;;
                --streams) streams=$2 ;;
                --prompt-tokens) prompt_tokens=$2 ;;
                --output-tokens) output_tokens=$2 ;;
                --seed) seed=$2 ;;
                --out) out=$2 ;;
            esac
            shift ;;
        --json) as_json=1 ;;
        -*) echo "guidellm: unknown option $1" >&2; usage >&2; exit 2 ;;
        *) positional+=("$1") ;;
    esac
    shift
done

if [ ! -f "$stamp" ]; then
    echo "guidellm: installing guidellm==$version into $venv" >&2
    start=$SECONDS
    [ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "guidellm==$version"
    "$venv/bin/guidellm" --help >/dev/null
    touch "$stamp"
    echo "guidellm: installed in $((SECONDS - start)) s" >&2
fi
if [ "$install_only" = 1 ]; then
    echo "guidellm: ready: $venv/bin/guidellm" >&2
    exit 0
fi
if [ ${#positional[@]} -ne 2 ]; then
    usage >&2
    exit 2
fi
url=${positional[0]%/}
model_dir=${positional[1]}
[ -d "$model_dir" ] || { echo "guidellm: $model_dir is not a directory" >&2; exit 2; }
model_dir=$(cd "$model_dir" && pwd)

if [ -n "$out" ]; then
    mkdir -p "$out"
    scratch=$(cd "$out" && pwd)
else
    scratch=$(mktemp -d "${TMPDIR:-/tmp}/llmserve-guidellm.XXXXXX")
    trap 'rm -rf "$scratch"' EXIT
fi
# guidellm asks for vLLM's stream_options.continuous_usage_stats on every streaming request. A server that refuses
# the field (400) would fail every request: probe once, and if it is refused run guidellm without it (only that
# field is dropped; guidellm reads the usage of the final chunk, which include_usage still brings). See
# guidellm_run.py.
drop=()
probe=$("$venv/bin/python" - "$url" <<'PY'
import json, sys, urllib.error, urllib.request
url = sys.argv[1]
with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
    model = json.load(r)["data"][0]["id"]
body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()
    print("ok")
except urllib.error.HTTPError as e:
    print("refused" if e.code == 400 and b"continuous_usage_stats" in e.read() else f"http {e.code}")
PY
) || { echo "guidellm: cannot reach $url/v1 (GET /v1/models failed)" >&2; exit 1; }
if [ "$probe" = refused ]; then
    echo "guidellm: $url refuses stream_options.continuous_usage_stats (a vLLM extension); running guidellm" \
         "without that field" >&2
    drop=(--drop-continuous-usage-stats)
fi
# No hub here: the tokenizer is a local directory, and nothing else may be fetched.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
(
    cd "$scratch"
    "$venv/bin/python" "$here/guidellm_run.py" ${drop[@]+"${drop[@]}"} run --backend "kind=openai_http,target=$url" \
        --profile "kind=concurrent,streams=$streams" \
        --constraint "kind=max_requests,count=$max_requests" \
        --tokenizer "kind=hf_auto,model=$model_dir" \
        --data "kind=synthetic_text,prompt_tokens=$prompt_tokens,output_tokens=$output_tokens" \
        --seed "kind=static,value=$seed" \
        --disable-progress
) >"$scratch/guidellm.log" 2>&1 || {
    echo "guidellm: run failed (exit $?); its output:" >&2
    tail -n 40 "$scratch/guidellm.log" >&2
    exit 1
}
summary_args=("$scratch/benchmarks.json")
[ "$as_json" = 1 ] && summary_args+=(--json)
"$venv/bin/python" "$here/guidellm_summary.py" "${summary_args[@]}"
