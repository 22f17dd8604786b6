"""Decode steps on CUDA replayed from captured CUDA graphs (vLLM's and LMDeploy's default; `enforce_eager` turns it
off).

Why: an eager decode step of an 8B model launches ~750 kernels; at batch 64 on an H100 the host took 23 ms to launch
what the GPU ran in 11 (torch.profiler, scripts/cuda_profile.py). A replay launches them all at once.

A graph is captured per batch size in `capture_sizes` (a step of n requests replays the smallest size >= n, its
spare rows padded), over static input buffers: token ids, positions, KV slots, context lengths and block tables.
Every kernel's shape depends only on the batch size: the Triton decode kernel (attention/triton_decode.py) reads the
lengths and tables on the device, and its context splits are fixed per size. Padding rows write their K/V into a
scratch block that the KV allocator never hands out and read only that block, so they touch no request's cache.
The graph covers the model and the LM head; the sampler runs eagerly on the graph's logits.

M-RoPE models (Qwen2-VL) decode from the same 1-D positions: a decode token follows every image of its prompt, so its
three rotary rows are equal, its sequence index + the request's delta. `run` takes the deltas and puts index + delta
in the positions buffer, while the KV slots and context lengths stay by sequence index.
"""

from __future__ import annotations

import logging
import time

import torch

from llmserve.attention.metadata import AttentionMetadata, table_width
from llmserve.attention.triton_decode import num_splits

logger = logging.getLogger(__name__)

SIZES = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def capture_sizes(max_batch_size: int) -> list[int]:
    sizes = [s for s in SIZES if s < max_batch_size]
    return sizes + [max_batch_size] if max_batch_size <= SIZES[-1] else sizes + [SIZES[-1]]


class CudaGraphDecoder:
    """Captured decode steps of one model over its bound KV cache; `run` replays the graph for a batch."""

    def __init__(self, model: torch.nn.Module, device: torch.device, block_size: int, max_blocks_per_seq: int,
                 scratch_block: int, max_batch_size: int, num_kv_heads: int) -> None:
        self.model = model
        self.block_size = block_size
        self.width = table_width(max_blocks_per_seq)  # as eager steps' tables
        self.scratch_block = scratch_block
        self.sizes = capture_sizes(max_batch_size)
        self.max_size = self.sizes[-1]
        n = self.max_size
        # ids, positions, slots, lens, and the rows of the previous step's tokens that are this step's ids (async
        # scheduling: see `run`): one int64 buffer, one host-to-device copy per step
        self._inputs = torch.zeros((5, n), dtype=torch.int64, device=device)
        self._tables = torch.full((n, self.width), scratch_block, dtype=torch.int32, device=device)
        # Pinned host buffers of those copies, two of each in turn: with async scheduling the host fills the next
        # step's while the device may not yet have copied the last one's (`_copied`: an event after each copy)
        self._staging = torch.zeros((2, 5, n), dtype=torch.int64, pin_memory=True)
        self._table_staging = torch.zeros((2, n * self.width), dtype=torch.int32, pin_memory=True)
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        # a padding row's (id, position, slot, length, previous row): token 0 at position 0, one token of context in
        # the scratch block
        self._pad = torch.tensor([0, 0, scratch_block * block_size, 1, 0])[:, None]
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first: the smaller ones fit in its memory pool
            self._graphs[size] = self._capture(size, num_splits(size, num_kv_heads, device), pool)
        torch.cuda.synchronize(device)
        logger.info("captured CUDA graphs of decode steps for %d batch sizes (up to %d) in %.1f s",
                    len(self.sizes), self.max_size, time.perf_counter() - start)

    def _meta(self, size: int, splits: int) -> AttentionMetadata:
        ids, pos, slots, lens = self._inputs[:4, :size]
        return AttentionMetadata(slot_mapping=slots, num_decodes=size, decode_tables=self._tables[:size],
                                 decode_lens=lens, prefills=[], decode_splits=splits)

    def _forward(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        ids, pos = self._inputs[0, :size], self._inputs[1, :size]
        return self.model.compute_logits(self.model(ids, pos, meta))

    @torch.inference_mode()
    def _capture(self, size: int, splits: int, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self._inputs[:, :size] = self._pad.to(self._inputs.device)  # every row a padding row
        self._tables[:size, 0] = self.scratch_block
        meta = self._meta(size, splits)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the capture: Triton compiles, cuBLAS picks its kernels
            for _ in range(2):
                self._forward(size, meta)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self._forward(size, meta)
        return graph, logits

    def fits(self, num_seqs: int, max_blocks: int) -> bool:
        return num_seqs <= self.max_size and max_blocks <= self.width

    @torch.inference_mode()
    def run(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]],
            rope_deltas: list[int] | None = None, prev: tuple[torch.Tensor, list[int]] | None = None) -> torch.Tensor:
        """One decode step of n requests (token_ids[i] at positions[i], over block_tables[i]) -> logits [n, V],
        a view of the graph's output: read it before the next run. rope_deltas: an M-RoPE model's rotary position
        minus sequence index per request (positions index the cache either way). prev: (tokens, rows) where the ids
        are still on the device (async scheduling): request i's id is tokens[rows[i]], and token_ids is not read."""
        n = len(token_ids)
        size = next(s for s in self.sizes if s >= n)
        bs = self.block_size
        turn, self._turn = self._turn, self._turn ^ 1
        if self._copied[turn] is not None:  # the device has read this buffer (two steps ago): at once in practice
            self._copied[turn].synchronize()
        staging = self._staging[turn]
        if prev is None:
            staging[0, :n] = torch.tensor(token_ids)
        else:
            staging[4, :n] = torch.tensor(prev[1])
        index = torch.tensor(positions)
        staging[1, :n] = index if rope_deltas is None else index + torch.tensor(rope_deltas)
        staging[2, :n] = torch.tensor([t[p // bs] * bs + p % bs for t, p in zip(block_tables, positions)])
        staging[3, :n] = index + 1
        staging[:, n:size] = self._pad
        self._inputs[:, :size].copy_(staging[:, :size], non_blocking=True)
        if prev is not None:  # on the device, in stream order after the step that sampled them
            torch.index_select(prev[0], 0, self._inputs[4, :n], out=self._inputs[0, :n])
        # only the columns in use: a row's later columns are never read (its length bounds the kernel's reads)
        width = max(len(t) for t in block_tables)
        flat: list[int] = []
        for t in block_tables:
            flat += t
            flat += [self.scratch_block] * (width - len(t))
        flat += [self.scratch_block] * ((size - n) * width)
        tables = self._table_staging[turn, :size * width].view(size, width)
        tables.copy_(torch.tensor(flat, dtype=torch.int32).view(size, width))
        self._tables[:size, :width].copy_(tables, non_blocking=True)
        event = self._copied[turn] = self._copied[turn] or torch.cuda.Event()
        event.record()
        graph, logits = self._graphs[size]
        graph.replay()
        return logits[:n]
