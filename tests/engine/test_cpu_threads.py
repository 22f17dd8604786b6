"""The engine's default CPU thread count when the OpenMP runtime is configured from the environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from llmserve.worker.cpu_tuning import _OPENMP_THREAD_VARS

_PROBE = """
import json, os, torch
torch.ones(1 << 20).sum()  # an OpenMP region: the runtime binds the main thread by now
from llmserve.worker.cpu_tuning import configure_cpu, default_num_threads
print(json.dumps({"mask": len(os.sched_getaffinity(0)), "default": default_num_threads(),
                  "configured": configure_cpu(None), "torch": torch.get_num_threads()}))
"""


def _probe(env: dict[str, str]) -> dict[str, int]:
    clean = {k: v for k, v in os.environ.items() if k not in _OPENMP_THREAD_VARS}
    out = subprocess.run([sys.executable, "-c", _PROBE], env={**clean, **env}, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_default_is_the_affinity_mask_without_openmp_settings() -> None:
    r = _probe({})
    assert r["default"] == r["mask"] == r["configured"] == r["torch"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to see the main thread pinned to one")
def test_bound_openmp_threads_keep_every_place() -> None:
    # libgomp pins the main thread to its first place, so the main thread's mask holds one CPU; the engine used to
    # take that as its thread count and ran on one core
    r = _probe({"OMP_PROC_BIND": "close", "OMP_PLACES": "threads"})
    assert r["mask"] == 1
    assert r["default"] == r["configured"] == r["torch"] == len(os.sched_getaffinity(0))


def test_omp_num_threads_is_respected() -> None:
    r = _probe({"OMP_NUM_THREADS": "1"})
    assert r["default"] == r["configured"] == r["torch"] == 1
