#!/usr/bin/env bash
# Set everything up (idempotent) and run the whole test suite. GPU tests skip themselves without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
