"""Serving several LoRA adapters at once over one base model (multi-LoRA).

The manager keeps the loaded adapters by name and, while the model runs a step, which rows of the flat batch
belong to which adapter (`LoRAStep`). Every adaptable linear layer carries a `LoRALayer` hook (Linear.lora): after
the layer's own product it adds, for each adapter in the step, x[rows] @ A.T @ B.T to those rows. So one batch
mixes any adapters and the base model; each adapter's tokens go through one pair of matmuls per layer (segmented
by adapter: a contiguous run of rows is a view, scattered rows are gathered once), never one request at a time.

Requests hold their adapter object, not its name: unloading an adapter takes it out of the registry for new
requests while the ones running finish with it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from llmserve.errors import InvalidRequestError
from llmserve.layers.linear import Linear
from llmserve.lora.adapter import AdapterError, LoRAAdapter, read_adapter

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoRAGroup:
    adapter: LoRAAdapter
    rows: slice | torch.Tensor  # the batch rows of its tokens: one contiguous run, or their indices


@dataclass(frozen=True)
class LoRAStep:
    groups: tuple[LoRAGroup, ...]


class LoRALayer:
    """The hook on one linear layer: y += x[rows] @ A.T @ B.T for each adapter of the step that adapts it."""

    def __init__(self, manager: LoRAManager, name: str) -> None:
        self.manager = manager
        self.name = name

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        step = self.manager.step
        if step is None:
            return y
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.view(-1, y.shape[-1])
        for group in step.groups:
            w = group.adapter.weights.get(self.name)
            if w is None:
                continue
            if isinstance(group.rows, slice):
                y2[group.rows].addmm_(x2[group.rows] @ w.a.t(), w.b.t())
            else:
                y2.index_add_(0, group.rows, (x2.index_select(0, group.rows) @ w.a.t()) @ w.b.t())
        return y


class LoRAManager:
    def __init__(self, model: nn.Module, dtype: torch.dtype, device: torch.device, max_loras: int,
                 max_lora_rank: int, max_cpu_loras: int | None = None) -> None:
        self.model = model
        self.dtype = dtype
        self.device = device
        self.max_loras = max_loras  # distinct adapters in one step (the scheduler keeps to it)
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras  # adapters loaded at once (None: no bound)
        self.adapters: dict[str, LoRAAdapter] = {}
        self.step: LoRAStep | None = None
        for name, module in model.named_modules():
            if isinstance(module, Linear):
                module.lora = LoRALayer(self, name)
        # the native decoder stack runs every layer in one call, past these hooks: models skip it during LoRA steps
        for module in model.modules():
            if hasattr(module, "native_stack"):
                module.lora_manager = self

    # --- the registry ------------------------------------------------------------------

    def read(self, name: str, path: str) -> LoRAAdapter:
        """Read and check an adapter without registering it (any thread)."""
        self._check_name(name)
        return read_adapter(name, path, self.model, self.max_lora_rank, self.dtype, self.device)

    def add(self, adapter: LoRAAdapter) -> None:
        """Register an adapter read by `read` (the engine's thread)."""
        self._check_name(adapter.name)
        if adapter.name in self.adapters:
            raise AdapterError(adapter.name, "an adapter of this name is already loaded (unload it first)",
                               param="lora_name")
        if self.max_cpu_loras is not None and len(self.adapters) >= self.max_cpu_loras:
            raise AdapterError(adapter.name, f"max_cpu_loras={self.max_cpu_loras} adapters are loaded already "
                                             f"({', '.join(self.adapters)}): unload one first", param="lora_name")
        self.adapters[adapter.name] = adapter
        logger.info("LoRA adapter %r loaded from %s: rank %d on %s, %.1f MiB", adapter.name, adapter.path,
                    adapter.rank, "/".join(adapter.target_modules), adapter.nbytes / 2**20)

    def load(self, name: str, path: str) -> LoRAAdapter:
        adapter = self.read(name, path)
        self.add(adapter)
        return adapter

    def unload(self, name: str) -> LoRAAdapter:
        """Take an adapter out of the registry; requests already running with it finish with it."""
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise InvalidRequestError(f"no LoRA adapter named {name!r} is loaded (loaded: "
                                      f"{', '.join(self.adapters) or 'none'})", param="lora_name")
        logger.info("LoRA adapter %r unloaded", name)
        return adapter

    def get(self, name: str, param: str = "adapter_name") -> LoRAAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise InvalidRequestError(f"no LoRA adapter named {name!r} is loaded (loaded: "
                                      f"{', '.join(self.adapters) or 'none'})", param=param)
        return adapter

    @staticmethod
    def _check_name(name: str) -> None:
        if not isinstance(name, str) or not name.strip():
            raise InvalidRequestError(f"a LoRA adapter's name must be a non-empty string, got {name!r}",
                                      param="lora_name")

    # --- a step ------------------------------------------------------------------------

    @contextmanager
    def stepping(self, adapters: list[LoRAAdapter | None], lengths: list[int]) -> Iterator[None]:
        """While the model runs a step whose sequences (in batch order, `lengths` tokens each) use these adapters
        (None: the base model)."""
        runs: dict[int, tuple[LoRAAdapter, list[tuple[int, int]]]] = {}
        offset = 0
        for adapter, n in zip(adapters, lengths):
            if adapter is not None:
                runs.setdefault(id(adapter), (adapter, []))[1].append((offset, offset + n))
            offset += n
        if not runs:
            yield
            return
        groups = []
        for adapter, spans in runs.values():
            merged = [list(spans[0])]
            for lo, hi in spans[1:]:
                if lo == merged[-1][1]:
                    merged[-1][1] = hi
                else:
                    merged.append([lo, hi])
            if len(merged) == 1:
                rows: slice | torch.Tensor = slice(merged[0][0], merged[0][1])
            else:
                rows = torch.cat([torch.arange(lo, hi) for lo, hi in merged]).to(self.device)
            groups.append(LoRAGroup(adapter, rows))
        self.step = LoRAStep(tuple(groups))
        try:
            yield
        finally:
            self.step = None
