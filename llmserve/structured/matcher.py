"""One sequence's progress through its grammar: an xgrammar matcher and the mask of its next token.

Lifecycle (engine thread only): made when the sequence is added, with the mask of its first token
already filled; `accept` advances it by each token the engine appends (and fills the next mask, so
the engine knows at once whether the grammar is finished); the runner reads `next_mask` into the step's
bitmask. Speculative drafts: `valid_prefix` cuts a proposal at the first token the grammar refuses, and
`masks_with_drafts` fills the mask after each draft by advancing through them and rolling back, so the
matcher is left where it was. Preemption needs nothing: a preempted sequence keeps its generated tokens,
which are exactly what the matcher has accepted.

The grammar's end is the model's EOS (xgrammar's stop tokens): once only EOS can follow, the sequence is
finished (`finished`), without spending a step on sampling the EOS; where the grammar may end or go on
(`\\d+`), EOS is allowed in the mask and the model decides.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import xgrammar


class GrammarState:
    def __init__(self, compiled: xgrammar.CompiledGrammar, stop_token_ids: list[int], vocab_size: int) -> None:
        import xgrammar as xgr

        # Rollback (of drafts) is always available: xgrammar keeps the history of its (few) parser states.
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids))
        self._stop_token_ids = list(stop_token_ids)
        self.vocab_size = vocab_size
        self.next_mask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, words] int32: bit t = token t allowed
        self._stop_words = self._stop_bits(self.next_mask.shape[1])
        self._only_stop = False
        self._fill()

    @property
    def finished(self) -> bool:
        """The grammar is complete and nothing but EOS may follow, or EOS was accepted."""
        return self._only_stop or self._matcher.is_terminated()

    def accept(self, token_id: int) -> bool:
        """Advance by one generated token; False (state unchanged) if the grammar does not allow it."""
        if not self._matcher.accept_token(token_id):
            return False
        if not self._matcher.is_terminated():
            self._fill()
        return True

    def allows(self, token_id: int) -> bool:
        word, bit = divmod(token_id, 32)
        return 0 <= token_id < self.vocab_size and bool((int(self.next_mask[0, word]) >> bit) & 1)

    def valid_prefix(self, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the grammar accepts from here (the matcher is left unchanged)."""
        accepted = 0
        for token in drafts:
            if self._matcher.is_terminated() or not self._matcher.accept_token(token):
                break
            accepted += 1
        if accepted:
            self._matcher.rollback(accepted)
        return drafts[:accepted]

    def masks_with_drafts(self, drafts: tuple[int, ...] | list[int]) -> torch.Tensor:
        """[1 + len(drafts), words]: the next token's mask, then the mask after each draft (all of which the
        grammar accepts: see valid_prefix). The matcher ends where it started."""
        if not drafts:
            return self.next_mask
        masks = self.next_mask.new_empty((1 + len(drafts), self.next_mask.shape[1]))
        masks[0] = self.next_mask[0]
        for i, token in enumerate(drafts, start=1):
            accepted = self._matcher.accept_token(token)
            assert accepted, "drafts must be cut with valid_prefix first"
            if self._matcher.is_terminated():
                masks[i:] = self._stop_words  # after EOS nothing is sampled; any mask would do
                self._matcher.rollback(i)
                return masks
            self._matcher.fill_next_token_bitmask(masks, i)
        self._matcher.rollback(len(drafts))
        return masks

    def _fill(self) -> None:
        self._matcher.fill_next_token_bitmask(self.next_mask)
        # Only EOS left: nothing after the grammar's end but the stop token, which the engine need not sample.
        self._only_stop = self._matcher.is_completed() and not bool(
            torch.bitwise_and(self.next_mask, ~self._stop_words).any())

    def _stop_bits(self, words: int) -> torch.Tensor:
        bits = torch.zeros((1, words), dtype=torch.int32)
        for t in self._stop_token_ids:
            if 0 <= t < self.vocab_size:
                word, bit = divmod(t, 32)
                bits[0, word] |= _int32_bit(bit)
        return bits


def _int32_bit(bit: int) -> int:
    return (1 << bit) - (1 << 32 if bit == 31 else 0)  # bit 31 is the sign bit of an int32
