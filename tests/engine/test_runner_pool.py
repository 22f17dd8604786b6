"""The KV pool's memory: zero-filled (the torch decode path reads padded slots under a mask)."""

from __future__ import annotations

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


def test_large_zeroed_pool_is_zero_where_sampled() -> None:
    pool = zeroed((2, 2, 1024, 64, 4, 64), torch.float32, torch.device("cpu"))  # 256 MiB, lazily mapped
    assert float(pool[1, 1, -1].abs().sum()) == 0.0 and float(pool[0, 0, 0].abs().sum()) == 0.0
