"""Per-step attention metadata, built once per step by the model runner and shared by all layers.

Token layout of a step (flat, unpadded; decodes first, then prefill chunks):

    tokens:   [d0 d1 d2 | p0 p0 p0 p0 | p1 p1]     T = 3 + 4 + 2
    requests:  decode x3  prefill chunk  prefill chunk

A request's context is every token already in the cache plus this step's tokens; its K/V live in
`slots` of the flat cache (slot = block_id * block_size + offset within the block).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def table_width(blocks: int) -> int:
    """The width of a block table the CUDA kernels read: blocks rounded up to a multiple of 16. Triton compiles a
    variant per int argument that divides by 16 or not (the table's row stride here), so eager steps' tables and the
    captured graphs' (worker/cuda_graphs.py) share one width rule, and the variants the graphs and the runner's warm-up
    compile at start are the only ones a run needs."""
    return -(-blocks // 16) * 16


@dataclass
class PrefillSpan:
    """One request with more than one query token this step."""

    q_start: int  # first row of this request in the flat token batch
    q_end: int  # one past its last row
    num_cached: int  # tokens of context already in the cache before this step
    host_slots: torch.Tensor  # [num_cached + q_len] int64 on the CPU, cache slots of the whole context, in order
    device: torch.device = torch.device("cpu")
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict, repr=False)
    _slots: torch.Tensor | None = field(default=None, repr=False)

    @property
    def q_len(self) -> int:
        return self.q_end - self.q_start

    @property
    def slots(self) -> torch.Tensor:
        """host_slots on the step's device, copied on first use: CUDA's Triton prefill never reads them, so a step of
        64 chunks makes no 64 small copies to the GPU."""
        if self._slots is None:
            self._slots = self.host_slots.to(self.device)
        return self._slots

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """[q_len, context] bool, True where query i may attend key j (causal, optional window)."""
        if sliding_window not in self._masks:
            total = self.num_cached + self.q_len
            q_pos = torch.arange(self.num_cached, total, device=self.slots.device).unsqueeze(1)
            k_pos = torch.arange(total, device=self.slots.device).unsqueeze(0)
            mask = k_pos <= q_pos
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
            self._masks[sliding_window] = mask
        return self._masks[sliding_window]


class Workspace:
    """Scratch buffers reused across layers and steps.

    Why: the decode path gathers every request's K/V blocks each layer (tens of MB at batch 64).
    Fresh tensors that large come from mmap and page-fault on every touch (measured: 8 ms vs
    0.6 ms for the same 15 MB gather into a reused buffer), so the gathers write in here.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            grown = max(numel, 2 * buf.numel()) if buf is not None and buf.dtype == dtype else numel
            buf = self._buffers[name] = torch.empty(grown, dtype=dtype, device=device)
        return buf[:numel].view(shape)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V is written
    num_decodes: int  # the first num_decodes tokens are single-token (decode) requests
    decode_tables: torch.Tensor | None  # [num_decodes, max_blocks] int64 block ids, padded with block 0 (CUDA: int32)
    decode_lens: torch.Tensor | None  # [num_decodes] int64 context length (incl. the new token)
    prefills: list[PrefillSpan]
    workspace: Workspace = field(default_factory=Workspace)
    decode_splits: int | None = None  # CUDA decode kernel's context splits (fixed by a captured graph), else its own
    prefill_kernel: str = "fp32"  # native prefill attention's path (fp32, dot, amx): the runner's measured choice
    decode_dot: bool = False  # native decode attention's scores by AVX512-BF16 dot products: likewise
    _decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict, repr=False)
    prefill_tables: torch.Tensor | None = None  # [num prefills, max blocks] int64 on the CPU: their block tables
    _prefill_arrays: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _prefill_work: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict,
                                                                                      repr=False)

    def prefill_arrays(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefill spans as one int64 [S, 4] table (q_start, q_len, num_cached, offset into slots) and their
        context slots concatenated, for native prefill attention; made once per step, shared by the layers."""
        if self._prefill_arrays is None:
            offsets, at = [], 0
            for p in self.prefills:
                offsets.append(at)
                at += p.slots.numel()
            spans = torch.tensor([[p.q_start, p.q_len, p.num_cached, o] for p, o in zip(self.prefills, offsets)],
                                 dtype=torch.int64).reshape(-1, 4)
            slots = (torch.cat([p.host_slots for p in self.prefills]) if self.prefills
                     else torch.empty(0, dtype=torch.int64))
            self._prefill_arrays = (spans, slots)
        return self._prefill_arrays

    def prefill_work(self, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The Triton prefill kernel's inputs (attention/triton_prefill.py), on the step's device: the chunks' block
        tables [S, W] int32 (W a multiple of 16), their (first row, rows, tokens cached before) [S, 3] int32, and one
        (chunk, first row) per program of block_m rows [P, 2] int32. Made once per step, shared by the layers: one
        copy to the device."""
        if block_m not in self._prefill_work:
            assert self.prefill_tables is not None
            spans = torch.tensor([[p.q_start, p.q_len, p.num_cached] for p in self.prefills], dtype=torch.int32)
            work = torch.tensor([[i, m] for i, p in enumerate(self.prefills) for m in range(0, p.q_len, block_m)],
                                dtype=torch.int32)
            width = self.prefill_tables.shape[1]
            tables = F.pad(self.prefill_tables, (0, table_width(width) - width)).to(torch.int32)
            # Triton also compiles a variant per pointer alignment: each part padded to 16 bytes, so all start aligned
            parts = [x.reshape(-1) for x in (spans, work, tables)]
            flat = torch.cat([F.pad(x, (0, -x.numel() % 4)) for x in parts]).to(self.slot_mapping.device)
            views, at = [], 0
            for x, shape in zip(parts, ((-1, 3), (-1, 2), tables.shape)):
                views.append(flat[at:at + x.numel()].view(shape))
                at += x.numel() + (-x.numel() % 4)
            self._prefill_work[block_m] = (views[2], views[0], views[1])
        return self._prefill_work[block_m]

    def decode_mask(self, sliding_window: int | None, block_size: int, dtype: torch.dtype) -> torch.Tensor:
        """[num_decodes, 1, 1, max_blocks * block_size] additive mask: 0 for real context keys
        (inside the window), -inf for padding. Additive float measured faster than bool in SDPA."""
        assert self.decode_tables is not None and self.decode_lens is not None
        key = (sliding_window, dtype)
        if key not in self._decode_masks:
            k_pos = torch.arange(self.decode_tables.shape[1] * block_size, device=self.decode_tables.device)
            lens = self.decode_lens.unsqueeze(1)
            visible = k_pos < lens
            if sliding_window is not None:
                visible &= k_pos >= lens - sliding_window
            mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))
            self._decode_masks[key] = mask[:, None, None, :]
        return self._decode_masks[key]


@dataclass
class SeqSpec:
    """What the runner knows about one scheduled request, in step order."""

    num_cached: int  # tokens already in the KV cache
    num_new: int  # tokens computed this step
    block_table: list[int]  # block ids holding the context, in order


def build_attention_metadata(seqs: list[SeqSpec], block_size: int, device: torch.device,
                             workspace: Workspace | None = None) -> AttentionMetadata:
    """Flatten a step's requests into slot mappings and gather indices. Decodes must come first.

    Vectorised: the per-token work is torch ops over a padded block-table tensor, so the Python
    cost per step is O(requests + blocks), not O(context tokens).
    """
    num_decodes = 0
    while num_decodes < len(seqs) and seqs[num_decodes].num_new == 1:
        num_decodes += 1
    assert all(s.num_new > 1 for s in seqs[num_decodes:]), "decodes must come before prefill chunks"
    totals = [s.num_cached + s.num_new for s in seqs]
    width = max(len(s.block_table) for s in seqs)
    for s, total in zip(seqs, totals):
        assert len(s.block_table) * block_size >= total, "block table too short for the context"
    tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs], dtype=torch.int64)
    # Every slot of every request's blocks, in context order: [num_seqs, width * block_size].
    all_slots = (tables[:, :, None] * block_size + torch.arange(block_size)).reshape(len(seqs), -1)
    new_counts = torch.tensor([s.num_new for s in seqs])
    row = torch.repeat_interleave(torch.arange(len(seqs)), new_counts)
    starts = torch.tensor([s.num_cached for s in seqs])
    # Index of each new token within its own request: 0..num_new-1 per request.
    offset = torch.arange(int(new_counts.sum())) - torch.repeat_interleave(torch.cumsum(new_counts, 0) - new_counts,
                                                                          new_counts)
    slot_mapping = all_slots[row, starts[row] + offset]
    decode_tables = decode_lens = None
    if num_decodes:
        max_blocks = -(-max(totals[:num_decodes]) // block_size)
        decode_tables = tables[:num_decodes, :max_blocks]
        if device.type == "cuda":
            # as the captured graphs' tables: int32 (Triton specializes on a pointer's dtype too), table_width wide
            decode_tables = F.pad(decode_tables, (0, table_width(max_blocks) - max_blocks)).to(torch.int32)
        decode_tables = decode_tables.to(device)
        decode_lens = torch.tensor(totals[:num_decodes], dtype=torch.int64, device=device)
    prefills = []
    start = num_decodes
    for i in range(num_decodes, len(seqs)):
        s = seqs[i]
        prefills.append(PrefillSpan(start, start + s.num_new, s.num_cached, all_slots[i, :totals[i]], device))
        start += s.num_new
    return AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        num_decodes=num_decodes,
        decode_tables=decode_tables,
        decode_lens=decode_lens,
        prefills=prefills,
        workspace=workspace or Workspace(),
        prefill_tables=tables[num_decodes:] if prefills else None,
    )
