"""Requests whose answer is chosen among several sequences at the end: beam search and best_of.

Both hold their outputs back until the choice is made (as vLLM does for best_of > n), then hand out
exactly n finished sequences, indexed 0..n-1, each carrying its whole text and token ids.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

from llmserve.config import GenerationConfig
from llmserve.engine.beam_search import BeamGroup, Hypothesis
from llmserve.engine.output import RequestTimes, SequenceOutput
from llmserve.engine.request import Request, RequestStatus


@dataclass
class BestOf:
    """best_of > n sampled sequences; the n with the highest cumulative log-probability win."""

    n: int
    size: int
    keep_logprobs: bool  # the caller asked for logprobs (they are computed anyway, for the ranking)
    outputs: dict[int, list[SequenceOutput]] = field(default_factory=lambda: defaultdict(list))
    num_finished: int = 0

    def add(self, out: SequenceOutput) -> list[SequenceOutput]:
        """Hold one step's output; return the n winners once every sequence has finished."""
        self.outputs[out.index].append(out)
        self.num_finished += out.finished
        if self.num_finished < self.size:
            return []
        merged = [merge_outputs(parts) for _, parts in sorted(self.outputs.items())]
        # Stable sort: among equal scores the lower index wins.
        merged.sort(key=lambda o: sum(lp.logprob for lp in o.new_logprobs), reverse=True)
        winners = merged[:self.n]
        for i, o in enumerate(winners):
            o.index = i
            if not self.keep_logprobs:
                o.new_logprobs = []
        return winners


def merge_outputs(parts: list[SequenceOutput]) -> SequenceOutput:
    last = parts[-1]
    return SequenceOutput(
        last.request_id, last.index, [t for p in parts for t in p.new_token_ids], "".join(p.new_text for p in parts),
        last.num_prompt_tokens, last.num_output_tokens, last.finished, last.finish_reason, last.stop_reason,
        [lp for p in parts for lp in p.new_logprobs], last.times,
        next((p.prompt_logprobs for p in parts if p.prompt_logprobs is not None), None),
        prediction_tokens=last.prediction_tokens, num_cached_tokens=max(p.num_cached_tokens for p in parts))


@dataclass
class BeamSearch:
    """Engine-side state of one beam search: the group, the caller's settings, the timing."""

    group: BeamGroup
    gen: GenerationConfig
    arrival: float
    first_token: float | None = None
    next_beam: int = 1  # ids of forked beams: "<request id>#b<k>"
    root: Request | None = None  # the first beam, which computed the prompt (its prefix-cache hits are the search's)

    def fork(self, parent: Request, token: int) -> Request:
        child = Request(request_id=f"{self.group.request_id}#b{self.next_beam}", token_ids=parent.token_ids + [token],
                        num_prompt_tokens=parent.num_prompt_tokens, sampling=parent.sampling,
                        max_new_tokens=parent.max_new_tokens, max_total_tokens=parent.max_total_tokens,
                        parent_id=parent.parent_id, arrival_time=parent.arrival_time, mm=parent.mm,
                        lora=parent.lora)
        child.num_computed_tokens = parent.num_computed_tokens if parent.status == RequestStatus.RUNNING else 0
        self.next_beam += 1
        return child

    def outputs(self, tokenizer, hypotheses: list[Hypothesis], first_scheduled: float | None,
                reason: str | None = None) -> list[SequenceOutput]:
        g, gen = self.group, self.gen
        times = RequestTimes(self.arrival, first_scheduled, self.first_token, time.monotonic())
        cached = self.root.num_cached_prompt_tokens if self.root is not None else 0
        outs = []
        for i in range(g.n):
            if i >= len(hypotheses):  # only on abort before any beam grew
                outs.append(SequenceOutput(g.request_id, i, [], "", g.num_prompt_tokens, 0, True, reason or "abort",
                                           times=times, num_cached_tokens=cached))
                continue
            h = hypotheses[i]
            ids = h.token_ids[:-1] if h.ended_by_stop else list(h.token_ids)
            stop = h.token_ids[-1] if h.ended_by_stop else None
            finish = reason or ("stop" if h.ended_by_stop else "length")
            text = tokenizer.decode(ids, skip_special_tokens=gen.skip_special_tokens)
            # Stop strings cut the chosen beam's text (the search itself ends on stop ids only).
            hits = [(text.find(w), w) for w in gen.stop_words or [] if w in text]
            if hits and reason is None:
                cut, word = min(hits)
                text = text[:cut + len(word)] if gen.include_stop_str_in_output else text[:cut]
                finish, stop = "stop", word
            outs.append(SequenceOutput(g.request_id, i, ids, text, g.num_prompt_tokens, len(ids), True, finish, stop,
                                       times=times, num_cached_tokens=cached))
        return outs
