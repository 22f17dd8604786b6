"""The KV pool's memory: zero-filled (the torch decode path reads padded slots under a mask)."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys

import pytest
import torch

from llmserve.worker.model_runner import zeroed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zeroed_pool_is_zero_contiguous_per_layer_and_writable(dtype: torch.dtype) -> None:
    pool = zeroed((3, 2, 5, 4, 2, 8), dtype, torch.device("cpu"))
    assert pool.shape == (3, 2, 5, 4, 2, 8) and pool.dtype == dtype
    assert all(layer.is_contiguous() for layer in pool)
    assert torch.count_nonzero(pool) == 0
    pool[1, 0, 2] = 1.5
    assert torch.count_nonzero(pool) == 4 * 2 * 8 and torch.count_nonzero(pool[0]) == 0


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds `address` (Linux /proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                start, end = (int(v, 16) for v in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    return []


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps") or not hasattr(mmap, "MADV_HUGEPAGE"),
                    reason="Linux with transparent huge pages only")
def test_pool_asks_for_transparent_huge_pages() -> None:
    pool = zeroed((2, 2, 64, 64, 4, 64), torch.bfloat16, torch.device("cpu"))  # 16 MiB
    assert "hg" in _vm_flags(pool.data_ptr() + pool.numel())  # hg: madvise(MADV_HUGEPAGE) was given


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux only")
@pytest.mark.parametrize("env,expect", [(None, True), ("0", False)])
def test_importing_llmserve_first_gives_torch_tensors_huge_pages(env: str | None, expect: bool) -> None:
    code = ("import llmserve, torch; from tests.engine.test_runner_pool import _vm_flags; "
            "t = torch.empty(8 << 20, dtype=torch.uint8); print('hg' in _vm_flags(t.data_ptr() + 4096))")
    environ = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env is not None:
        environ["THP_MEM_ALLOC_ENABLE"] = env
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, cwd=root,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(expect)
