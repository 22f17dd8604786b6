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


@dataclass
class PrefillSpan:
    """One request with more than one query token this step."""

    q_start: int  # first row of this request in the flat token batch
    q_end: int  # one past its last row
    num_cached: int  # tokens of context already in the cache before this step
    slots: torch.Tensor  # [num_cached + q_len] int64, cache slots of the whole context, in order
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def q_len(self) -> int:
        return self.q_end - self.q_start

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


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V is written
    num_decodes: int  # the first num_decodes tokens are single-token (decode) requests
    decode_slots: torch.Tensor | None  # [num_decodes, max_len] int64 context slots, padded with slot 0
    decode_lens: torch.Tensor | None  # [num_decodes] int64 context length (incl. the new token)
    prefills: list[PrefillSpan]
    _decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict, repr=False)

    def decode_mask(self, sliding_window: int | None) -> torch.Tensor:
        """[num_decodes, 1, 1, max_len] bool: True for real context keys (inside the window)."""
        assert self.decode_slots is not None and self.decode_lens is not None
        if sliding_window not in self._decode_masks:
            k_pos = torch.arange(self.decode_slots.shape[1], device=self.decode_slots.device)
            lens = self.decode_lens.unsqueeze(1)
            mask = k_pos < lens
            if sliding_window is not None:
                mask &= k_pos >= lens - sliding_window
            self._decode_masks[sliding_window] = mask[:, None, None, :]
        return self._decode_masks[sliding_window]


@dataclass
class SeqSpec:
    """What the runner knows about one scheduled request, in step order."""

    num_cached: int  # tokens already in the KV cache
    num_new: int  # tokens computed this step
    block_table: list[int]  # block ids holding the context, in order


def build_attention_metadata(seqs: list[SeqSpec], block_size: int, device: torch.device) -> AttentionMetadata:
    """Flatten a step's requests into slot mappings and gather indices. Decodes must come first."""
    slot_rows: list[list[int]] = []
    new_slots: list[int] = []
    for s in seqs:
        total = s.num_cached + s.num_new
        assert len(s.block_table) * block_size >= total, "block table too short for the context"
        slots = [s.block_table[i // block_size] * block_size + i % block_size for i in range(total)]
        slot_rows.append(slots)
        new_slots.extend(slots[s.num_cached:])
    num_decodes = 0
    while num_decodes < len(seqs) and seqs[num_decodes].num_new == 1:
        num_decodes += 1
    assert all(s.num_new > 1 for s in seqs[num_decodes:]), "decodes must come before prefill chunks"
    decode_slots = decode_lens = None
    if num_decodes:
        max_len = max(len(r) for r in slot_rows[:num_decodes])
        padded = [r + [0] * (max_len - len(r)) for r in slot_rows[:num_decodes]]
        decode_slots = torch.tensor(padded, dtype=torch.int64, device=device)
        decode_lens = torch.tensor([len(r) for r in slot_rows[:num_decodes]], dtype=torch.int64, device=device)
    prefills = []
    start = num_decodes
    for s, slots in zip(seqs[num_decodes:], slot_rows[num_decodes:]):
        slots_t = torch.tensor(slots, dtype=torch.int64, device=device)
        prefills.append(PrefillSpan(start, start + s.num_new, s.num_cached, slots_t))
        start += s.num_new
    return AttentionMetadata(
        slot_mapping=torch.tensor(new_slots, dtype=torch.int64, device=device),
        num_decodes=num_decodes,
        decode_slots=decode_slots,
        decode_lens=decode_lens,
        prefills=prefills,
    )
