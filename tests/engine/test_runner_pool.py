"""The KV pool's memory: zero-filled (the torch decode path reads padded slots under a mask)."""

from __future__ import annotations

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


def _mapping(address: int) -> tuple[str, dict[str, str]]:
    """The permissions (e.g. "rw-s") and the fields (Rss, VmFlags, ...) of the mapping that holds `address` (Linux
    /proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        perms, fields, inside = "", {}, False
        for line in f:
            words = line.split()
            head = words[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                if inside:
                    break
                start, end = (int(v, 16) for v in head.split("-"))
                inside = start <= address < end
                perms = words[1]
            elif inside:
                fields[head.rstrip(":")] = " ".join(words[1:])
    return (perms, fields) if inside else ("", {})


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds `address`."""
    return _mapping(address)[1].get("VmFlags", "").split()


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux only")
def test_pool_is_mapped_on_demand_not_written_up_front() -> None:
    pool = zeroed((2, 2, 64, 64, 4, 64), torch.bfloat16, torch.device("cpu"))  # 16 MiB
    perms, fields = _mapping(pool.data_ptr() + pool.numel())
    assert perms.startswith("rw") and int(fields["Rss"].split()[0]) < 1024  # kB: nothing touched yet
    pool[0, 0].fill_(1)
    assert int(_mapping(pool.data_ptr() + pool.numel())[1]["Rss"].split()[0]) >= 1024


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


def test_cuda_graph_capture_sizes():
    """The batch sizes CUDA graphs are captured for (a step replays the smallest that holds it): every size up to
    max_batch_size is covered, the largest is max_batch_size itself, at most 256."""
    pytest.importorskip("triton")
    from llmserve.worker.cuda_graphs import capture_sizes

    assert capture_sizes(1) == [1]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert capture_sizes(100)[-2:] == [96, 100]
    assert capture_sizes(128)[-1] == 128 and capture_sizes(1000)[-1] == 256
