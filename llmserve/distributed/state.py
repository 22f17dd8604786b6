"""This process's rank in its tensor-parallel group, and the collectives of Megatron-style sharding.

A process belongs to at most one group (one engine per process when tp > 1); the models read the group while they
are built (how many heads, which rows of a checkpoint tensor are this rank's) and the sharded layers call the
collectives in their forward. With tp = 1 every helper here is the identity and costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TPState:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup (None with size 1)


_state = TPState()


def tp_state() -> TPState:
    return _state


def set_tp_state(state: TPState) -> None:
    global _state
    _state = state


def shard(n: int, what: str) -> tuple[int, int]:
    """(start, length) of this rank's even share of n rows or heads."""
    s = _state
    if n % s.size:
        from llmserve.errors import ModelLoadError

        raise ModelLoadError(f"tp={s.size}: the model's {what} ({n}) do not split evenly over {s.size} ranks; "
                             f"choose a tp that divides {n}")
    length = n // s.size
    return s.rank * length, length


def all_reduce_(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the group, in place (a row-parallel layer's partial products). bf16/fp16 partials are summed in
    fp32: gloo's reductions are not defined for every 16-bit type, and the sum rounds once instead of size times."""
    s = _state
    if s.size == 1:
        return x
    import torch.distributed as dist

    if x.dtype in (torch.bfloat16, torch.float16):
        wide = x.float()
        dist.all_reduce(wide, group=s.group)
        x.copy_(wide)
    else:
        dist.all_reduce(x, group=s.group)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's x along the last dimension, in rank order (vocabulary-parallel logits)."""
    s = _state
    if s.size == 1:
        return x
    import torch.distributed as dist

    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(s.size)]
    dist.all_gather(parts, x, group=s.group)
    return torch.cat(parts, dim=-1)
