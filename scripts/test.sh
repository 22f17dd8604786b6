#!/usr/bin/env bash
# Set everything up (idempotent) and run the whole test suite. GPU tests skip themselves without CUDA.
# The tests run in parallel, one pytest-xdist worker per core (at most 4), each with one OpenMP thread: most tests
# keep a core only half busy (tiny models, servers, subprocesses), and two workers of two threads each on two cores
# ran slower than one. Kernels' thread-count tests set their own counts. LLMSERVE_TEST_WORKERS=0 runs it serially.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
workers=${LLMSERVE_TEST_WORKERS:-auto}
if [ "$workers" = 0 ]; then
    exec .venv/bin/python -m pytest -q "$@"
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -q -n "$workers" --maxprocesses 4 --dist worksteal "$@"
