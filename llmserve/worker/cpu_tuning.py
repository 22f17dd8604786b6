"""Process-wide CPU settings applied once when an engine starts on CPU."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

import torch

from llmserve.layers.linear import onednn_available

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


# Environment variables with which the OpenMP runtime sizes its team or pins its threads itself.
_OPENMP_THREAD_VARS = ("OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")


def default_num_threads() -> int:
    """The cores this process may run on; or, where the environment configures OpenMP's threads, OpenMP's own team
    size (torch's thread count at import: one per place when bound, OMP_NUM_THREADS when given).

    Why not the affinity mask alone: with OMP_PROC_BIND / OMP_PLACES / GOMP_CPU_AFFINITY (what vLLM-CPU's docs advise)
    the runtime pins the main thread to its first place when torch loads it, so the main thread's mask holds one CPU,
    and the engine ran single-threaded: 83-85 against 134-149 decode tokens/s (w8a8, 2-core Xeon)."""
    if any(os.environ.get(name, "").strip().lower() not in ("", "false") for name in _OPENMP_THREAD_VARS):
        return max(1, torch.get_num_threads())
    return len(os.sched_getaffinity(0))


def configure_cpu(num_threads: int | None) -> int:
    """Set torch's thread count (default: default_num_threads()) and keep glibc from returning large freed blocks to
    the OS. Returns the thread count.

    Why the malloc settings: activations of a prefill chunk are tens of MB; glibc serves blocks that
    large with mmap and unmaps them on free, so every step page-faults its activations afresh.
    Raising the mmap and trim thresholds keeps them in the heap for reuse (the effect vLLM gets
    from preloading tcmalloc). Set LLMSERVE_NO_MALLOC_TUNING=1 to leave glibc alone.
    """
    threads = num_threads or default_num_threads()
    torch.set_num_threads(threads)
    if os.environ.get("LLMSERVE_NO_MALLOC_TUNING") != "1":
        _tune_glibc_malloc()
    return threads


def _glibc_call(fn: str, *args: int) -> int | None:
    """libc's fn(*args), or None where it is not there (not glibc: musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        return None if name is None else getattr(ctypes.CDLL(name), fn)(*args)
    except (OSError, AttributeError):
        return None


def _tune_glibc_malloc() -> None:
    ok = _glibc_call("mallopt", _M_MMAP_THRESHOLD, 512 << 20) and _glibc_call("mallopt", _M_TRIM_THRESHOLD, 1 << 30)
    if ok == 0:
        logger.debug("mallopt refused the thresholds; leaving malloc as it is")


def trim_heap() -> None:
    """Give glibc's free heap memory back to the OS (malloc_trim): after a one-off burst of large temporaries, such as a
    kernel calibration's candidates, which configure_cpu's raised trim threshold would otherwise keep resident under
    everything the engine maps afterwards (a first start's peak RSS was ~650 MB higher)."""
    _glibc_call("malloc_trim", 0)


def use_onednn(loaded: object) -> bool:
    """oneDNN-blocked weights for CPU matmuls, unless LLMSERVE_NO_ONEDNN=1 (for A/B measurements)."""
    if os.environ.get("LLMSERVE_NO_ONEDNN") == "1" or not hasattr(loaded.model, "pack_for_cpu"):
        return False
    return onednn_available(loaded.device, loaded.dtype)
