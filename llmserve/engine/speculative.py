"""Speculative decoding: proposers of draft tokens, and the acceptance counters.

Each step, the scheduler reserves room (token budget and KV blocks) for up to
`num_speculative_tokens` drafts per decoding request; a proposer fills in drafts; the target model
scores the request's last token plus its drafts in one forward pass, and `Sampler.verify` accepts a
prefix of the drafts and adds one token of its own. A step therefore emits 1 to k + 1 tokens per
request, and the output is the one the target alone would give (greedy: identical; sampled: the
same distribution).

Proposers:
- `NgramProposer` (prompt lookup): finds the latest earlier occurrence of the sequence's last n
  tokens (n from prompt_lookup_max down to prompt_lookup_min) and proposes the tokens that followed
  it. No model; pays off where the output copies the context (summaries, code edits, RAG).
- `PredictionProposer` (OpenAI's Predicted Outputs): a request's own predicted output, the text a code edit is
  expected to repeat. It drafts the prediction's next tokens from where the output stands in it, and after an edit
  finds the output's last tokens in the prediction again. Per request, beside the engine's proposer (if any).
- `DraftModelProposer`: a smaller model with the same vocabulary proposes its greedy continuation.
  It keeps its own KV cache tensors, laid out over the target's block tables (same block ids, same
  block size), and tracks per request how many positions of its cache are valid. It catches up on
  the tokens it has not seen (the prompt on the first step, accepted tokens afterwards) in the
  first of its k forward passes, so it never needs blocks the target does not already hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmserve.engine.request import Prediction, Request
from llmserve.engine.scheduler import ScheduledRequest
from llmserve.worker.model_runner import ModelRunner, Span


@dataclass
class SpecStats:
    """Cumulative counters (vLLM's names): drafts proposed and accepted, and verify steps."""

    num_drafts: int = 0  # request-steps that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # tokens emitted by those request-steps (accepted + 1 each)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_tokens_per_step(self) -> float:
        """Tokens a request gains per verify step (1.0 would be plain decoding)."""
        return self.num_emitted_tokens / self.num_drafts if self.num_drafts else 0.0

    def record(self, num_draft: int, num_accepted: int, num_emitted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_emitted


class Proposer:
    """Fills in draft tokens for the scheduled requests that have room for them (`lookahead`)."""

    def propose(self, scheduled: list[ScheduledRequest], tables: dict[Request, list[int]]) -> dict[Request, list[int]]:
        raise NotImplementedError

    def accepted(self, request: Request, num_verified_before: int, num_accepted: int, num_proposed: int) -> None:
        """After verification (stateful proposers track what their own cache holds)."""

    def forget(self, request: Request) -> None:
        """The request's blocks were freed: finished, aborted or preempted."""


class NgramProposer(Proposer):
    def __init__(self, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, scheduled: list[ScheduledRequest], tables: dict[Request, list[int]]) -> dict[Request, list[int]]:
        return {s.request: drafts for s in scheduled if (drafts := self.lookup(s.request.token_ids, s.lookahead))}

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            # Windows starting at 0 .. len - n - 1: every occurrence that ends before the suffix itself.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start:start + k].tolist()
        return []


class PredictionProposer(Proposer):
    """Drafts from each request's prediction (Request.prediction). An edited file's output copies the prediction in
    runs with edits between them. While the output goes on copying, the drafts are the prediction's tokens from its
    cursor. Where it does not (an edit, or a rejected draft), the cursor moves to the end of the longest run of the
    output's last tokens (up to max_n) found in the prediction: its first occurrence from the cursor on, else its last
    before; a run of two only within `reach` tokens after the cursor, a single token within reach / 4 (a short run
    found anywhere is mostly chance, and drafts from the wrong place). With no such run the step drafts nothing.

    The engine calls `advance` after every step of such a request (its cursor and draft length are then current when
    the scheduler reserves room for drafts) and `verified` after a step that verified drafts.

    How many: a step's drafts cost compute whether or not they are kept (SmolLM2's single-request step on a 2-core
    Xeon with AMX: 9.1 ms plain, 10.7 with one draft, 13.0 with 2-4, 14.6 with 15), so after a rejected draft the next
    step proposes one more than were accepted, and after all were accepted twice as many, up to the step's
    lookahead. With both rules a prediction the output does not follow cost ~1% (scripts/bench_prediction.py: 0.99x,
    where realigning on short runs anywhere and 15 drafts a step had cost 0.72x)."""

    def __init__(self, max_n: int = 4, reach: int = 64) -> None:
        self.max_n = max_n
        self.reach = reach

    def propose(self, scheduled: list[ScheduledRequest], tables: dict[Request, list[int]]) -> dict[Request, list[int]]:
        """The prediction's next tokens from its cursor, as many as the scheduler made room for (it sizes the
        lookahead by the cursor, the draft length and whether the output is aligned: Scheduler._lookahead)."""
        out = {}
        for s in scheduled:
            p = s.request.prediction
            if p is not None and (drafts := p.token_ids[p.cursor:p.cursor + s.lookahead]):
                out[s.request] = drafts
        return out

    def advance(self, request: Request) -> None:
        """After a step of a request with a prediction: where its output now stands in the prediction."""
        p = request.prediction
        assert p is not None
        p.aligned = self.align(p, request.output_token_ids)

    @staticmethod
    def verified(request: Request, num_drafts: int, num_accepted: int, num_appended: int) -> None:
        """After a step that verified num_drafts drafts of the prediction and appended num_appended tokens (fewer than
        num_accepted + 1 where a stop ended the sequence among them): the drafts kept in the output count as
        accepted, the others as rejected; align() reads num_drafts against the tokens that followed."""
        p = request.prediction
        assert p is not None
        kept = min(num_accepted, num_appended)
        p.accepted += kept
        p.rejected += num_drafts - kept
        p.proposed = num_drafts

    def align(self, p: Prediction, output: list[int]) -> bool:
        """Move p's cursor past the output's new tokens; whether the output's end was found in the prediction."""
        new = output[p.seen:]
        p.seen = len(output)
        ahead = p.token_ids[p.cursor:p.cursor + len(new)]
        same = next((i for i, (a, b) in enumerate(zip(new, ahead)) if a != b), min(len(new), len(ahead)))
        p.cursor += same
        if p.proposed:  # the tokens of a step that verified drafts: as many as were kept matched
            p.length = 2 * p.proposed if same >= p.proposed else same + 1
            p.proposed = 0
        if same == len(new):
            return True
        tokens = p.array
        tail = np.asarray(output[-self.max_n:], dtype=np.int64)
        for n in range(min(self.max_n, len(tail), len(tokens)), 0, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens, n)
            ends = np.flatnonzero((windows == tail[-n:]).all(axis=1)) + n  # where each occurrence ends
            after = ends[ends >= p.cursor]
            if n >= 3 and (after.size or ends.size):
                p.cursor = int(after[0] if after.size else ends[-1])
                return True
            near = after[after <= p.cursor + (self.reach if n == 2 else self.reach // 4)]
            if n < 3 and near.size:  # a short run only near the cursor: one found far off is mostly chance
                p.cursor = int(near[0])
                return True
        return False


class DraftModelProposer(Proposer):
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._computed: dict[Request, int] = {}  # positions of the request valid in the draft's cache

    def propose(self, scheduled: list[ScheduledRequest], tables: dict[Request, list[int]]) -> dict[Request, list[int]]:
        todo = [s for s in scheduled if s.lookahead > 0]
        if not todo:
            return {}
        drafts: dict[Request, list[int]] = {s.request: [] for s in todo}
        # Pass 1: catch up on unseen tokens (single-token spans first, as the runner requires).
        spans = []
        for s in todo:
            r = s.request
            done = self._computed.get(r, 0)
            if done >= r.num_tokens:  # cache ahead of a rolled-back sequence cannot happen; recompute
                done = 0
            spans.append((r, Span(r.token_ids[done:], done, tables[r], 1)))
        spans.sort(key=lambda x: len(x[1].token_ids) != 1)
        self._step(spans, drafts)
        for r, span in spans:
            self._computed[r] = span.start + len(span.token_ids)
        # Passes 2..k: one token each, for the requests that still want more.
        for i in range(1, max(s.lookahead for s in todo)):
            spans = [(s.request, Span([drafts[s.request][-1]], self._computed[s.request], tables[s.request], 1))
                     for s in todo if s.lookahead > i]
            self._step(spans, drafts)
            for r, _ in spans:
                self._computed[r] += 1
        return drafts

    def _step(self, spans: list[tuple[Request, Span]], drafts: dict[Request, list[int]]) -> None:
        logits = self.runner.forward([span for _, span in spans])
        assert logits is not None
        for (r, _), token in zip(spans, logits.argmax(dim=-1).tolist()):
            drafts[r].append(token)

    def accepted(self, request: Request, num_verified_before: int, num_accepted: int, num_proposed: int) -> None:
        """After verification: the draft's cache holds the request's tokens up to position
        num_verified_before - 1 (the last known token) plus the accepted drafts it computed itself
        (it never computed its own last draft)."""
        if request in self._computed:
            self._computed[request] = min(self._computed[request],
                                          num_verified_before + min(num_accepted, num_proposed - 1))

    def forget(self, request: Request) -> None:
        """The request's blocks were freed (finished, aborted or preempted): its draft cache is gone."""
        self._computed.pop(request, None)
