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
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from llmserve.errors import InvalidRequestError
from llmserve.layers.linear import Linear
from llmserve.lora.adapter import AdapterError, LoRAAdapter, read_adapter

logger = logging.getLogger(__name__)


# A step with several adapters and few tokens runs each layer's adapters as one stacked pair of matmuls: x @ [A1 .. An]
# masked to each token's own adapter's columns, then @ [B1; ..; Bn]. It computes the other adapters' columns too (n
# times the segmented work) but in 3 ops instead of 4 per adapter: below some number of rows the ops cost more than
# the arithmetic. That number is measured on the running machine at the first step with several adapters
# (measure_stacked_max_rows; LLMSERVE_LORA_STACKED_MAX_ROWS pins it). On a 2-core AMD EPYC Zen 5, 4 rank-48 adapters
# on a 576 -> 960 bf16 layer, microseconds, segmented vs stacked: 4 rows 141 vs 40, 64: 170 vs 83, 256: 229 vs 198.
STACKED_ROW_BUCKETS = (16, 64, 256, 1024)
# Stacked weights kept per layer, for the most recent sets of adapters (each a copy of their A and B): decode steps
# keep one set while the running requests stay; a new set costs one concatenation per layer.
_STACKS_KEPT = 2


@dataclass(frozen=True)
class LoRAGroup:
    adapter: LoRAAdapter
    rows: slice | torch.Tensor  # the batch rows of its tokens: one contiguous run, or their indices


@dataclass(eq=False)
class LoRAStep:
    groups: tuple[LoRAGroup, ...]
    stacked: bool  # run each layer's adapters as one stacked pair of matmuls (STACKED_MAX_ROWS)
    owner: torch.Tensor | None = None  # stacked: [T] each row's group index, -1 for the base model's rows
    masks: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)  # stacked: by column owners

    def mask(self, columns: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """[T, len(columns)]: 1 where the row's group owns the column (columns: each column's group index)."""
        m = self.masks.get(columns)
        if m is None:
            owner = torch.tensor(columns, device=self.owner.device)
            m = self.masks[columns] = (self.owner[:, None] == owner[None, :]).to(dtype)
        return m


class LoRALayer:
    """The hook on one linear layer: y += x[rows] @ A.T @ B.T for each adapter of the step that adapts it."""

    def __init__(self, manager: LoRAManager, name: str) -> None:
        self.manager = manager
        self.name = name
        # stacked weights by the step's adapters (their uids): (A's [in, sum R], B's [sum R, out], column owners)
        self._stacks: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor, tuple[int, ...]] | None] = {}

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        step = self.manager.step
        if step is None:
            return y
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.view(-1, y.shape[-1])
        if step.stacked:
            stack = self._stack(step)
            if stack is not None:
                at, bt, columns = stack
                y2.addmm_((x2 @ at).mul_(step.mask(columns, x2.dtype)), bt)
            return y
        for group in step.groups:
            w = group.adapter.weights.get(self.name)
            if w is None:
                continue
            if isinstance(group.rows, slice):
                y2[group.rows].addmm_(x2[group.rows] @ w.at, w.bt)
            else:
                y2.index_add_(0, group.rows, (x2.index_select(0, group.rows) @ w.at) @ w.bt)
        return y

    def _stack(self, step: LoRAStep) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]] | None:
        key = tuple(g.adapter.uid for g in step.groups)
        if key in self._stacks:
            return self._stacks[key]
        parts = [(k, g.adapter.weights[self.name]) for k, g in enumerate(step.groups) if self.name in g.adapter.weights]
        stack = None
        if parts:
            columns = tuple(k for k, w in parts for _ in range(w.at.shape[1]))
            stack = (torch.cat([w.at for _, w in parts], dim=1), torch.cat([w.bt for _, w in parts]), columns)
        if len(self._stacks) >= _STACKS_KEPT:
            self._stacks.pop(next(iter(self._stacks)))
        self._stacks[key] = stack
        return stack

    def forget(self, uid: int) -> None:
        """Drop the stacks holding an unloaded adapter's weights."""
        for key in [k for k in self._stacks if uid in k]:
            del self._stacks[key]


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
        self.stacked_max_rows: int | None = None  # measured at the first step with several adapters
        self.layers: list[LoRALayer] = []
        for name, module in model.named_modules():
            if isinstance(module, Linear):
                module.lora = LoRALayer(self, name)
                self.layers.append(module.lora)
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
        for layer in self.layers:
            layer.forget(adapter.uid)
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

    def _stacked_max_rows(self, runs: list[tuple[LoRAAdapter, list]]) -> int:
        """The most rows a step with several adapters runs stacked: pinned, or measured once (on the widest update
        of the step's adapters, for as many adapters as the step has)."""
        if self.stacked_max_rows is None:
            pinned = os.environ.get("LLMSERVE_LORA_STACKED_MAX_ROWS")
            if pinned is not None:
                self.stacked_max_rows = int(pinned)
            else:
                w = max((w for adapter, _ in runs for w in adapter.weights.values()),
                        key=lambda w: w.at.numel() + w.bt.numel())
                self.stacked_max_rows = measure_stacked_max_rows(w.at.shape[0], w.bt.shape[1], w.at.shape[1],
                                                                 len(runs), self.dtype, self.device)
                logger.info("LoRA: steps of several adapters up to %d rows run stacked (measured)",
                            self.stacked_max_rows)
        return self.stacked_max_rows

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
        stacked = len(runs) > 1 and offset <= self._stacked_max_rows(list(runs.values()))
        owner = torch.full((offset,), -1, dtype=torch.long) if stacked else None
        # by load id: the same adapters make the same stack whatever order their requests came in
        for adapter, spans in sorted(runs.values(), key=lambda run: run[0].uid):
            if owner is not None:
                for lo, hi in spans:
                    owner[lo:hi] = len(groups)
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
        self.step = LoRAStep(tuple(groups), stacked, None if owner is None else owner.to(self.device))
        try:
            yield
        finally:
            self.step = None


def measure_stacked_max_rows(in_features: int, out_features: int, rank: int, num_adapters: int, dtype: torch.dtype,
                             device: torch.device,
                             timer: Callable[[str, int, Callable[[], object]], float] | None = None) -> int:
    """The largest of STACKED_ROW_BUCKETS at which the stacked pair of matmuls ran faster than the segmented ones on
    this machine (0 where it never did): one layer of `num_adapters` random updates of `rank` columns, the rows
    spread over the adapters as decode steps spread them. `timer(path, rows, fn)` gives fn's seconds (default: the
    best of a few runs); path is "stacked" or "segmented"."""
    timer = timer or (lambda path, rows, fn: _best_seconds(fn))
    gen = torch.Generator(device="cpu").manual_seed(0)
    ats = [torch.randn(in_features, rank, generator=gen).to(device, dtype) for _ in range(num_adapters)]
    bts = [torch.randn(rank, out_features, generator=gen).to(device, dtype) for _ in range(num_adapters)]
    best = 0
    for rows in STACKED_ROW_BUCKETS:
        segmented, stacked = _lora_paths(ats, bts, torch.randn(rows, in_features, generator=gen).to(device, dtype))
        if timer("stacked", rows, stacked) < timer("segmented", rows, segmented):
            best = rows
        else:
            break
    return best


def _lora_paths(ats: list[torch.Tensor], bts: list[torch.Tensor], x: torch.Tensor
                ) -> tuple[Callable[[], object], Callable[[], object]]:
    """(segmented, stacked): the two ways LoRALayer adds these updates to x's rows, each row its own adapter's."""
    n, device = len(ats), x.device
    y = torch.zeros(x.shape[0], bts[0].shape[1], dtype=x.dtype, device=device)
    owner = torch.arange(x.shape[0], device=device) % n
    index = [torch.nonzero(owner == k).flatten() for k in range(n)]
    mask = (owner[:, None] == torch.arange(n * ats[0].shape[1], device=device)[None, :] // ats[0].shape[1]).to(x.dtype)
    at_all, bt_all = torch.cat(ats, dim=1), torch.cat(bts)

    def segmented() -> None:
        for k in range(n):
            y.index_add_(0, index[k], (x.index_select(0, index[k]) @ ats[k]) @ bts[k])

    def stacked() -> None:
        y.addmm_((x @ at_all).mul_(mask), bt_all)

    return segmented, stacked


def _best_seconds(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
