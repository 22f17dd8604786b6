"""Beam search inside the continuous-batching engine.

A beam search request starts as one sequence (its prompt). Every beam is an ordinary `Request` in
the scheduler, batched with everything else; instead of sampling, its step hands the engine the
log-probabilities of the next token (after logit bias, bans and penalties). When every live beam of
a group has reported, `BeamGroup.select` extends them, as transformers' beam search does:

- candidates: the top K = max(2, 1 + #stop ids) * width continuations over all beams, by
  cumulative log-probability;
- a candidate that ends (a stop id, or the length limit) and ranks among the first `width` becomes a
  finished hypothesis scored logprob / generated_length ** length_penalty (the stop token counts);
  the best `width` hypotheses are kept;
- the best `width` candidates that do not end are the next live beams;
- the search ends when early_stopping=True and `width` hypotheses are finished, when no live beam
  can beat the worst kept hypothesis (early_stopping=False: judged at the current length;
  "never": at the longest possible length when length_penalty > 0), or when every candidate ended.

The engine turns the selection into block-table operations: a beam continued by one child keeps
its Request; each further child is forked (full blocks shared by reference, the partial last block
copied on write) and a beam without children is dropped and its blocks freed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmserve.engine.request import Request


@dataclass
class Hypothesis:
    token_ids: list[int]  # generated tokens, the stop token included when one ended it
    score: float  # length-penalised
    ended_by_stop: bool


@dataclass
class Candidate:
    parent: Request
    token_id: int
    logprob: float  # cumulative


@dataclass
class BeamGroup:
    request_id: str
    width: int
    n: int  # hypotheses returned
    num_prompt_tokens: int
    max_new_tokens: int
    max_total_tokens: int
    stop_token_ids: frozenset[int]
    length_penalty: float
    early_stopping: bool | str
    live: dict[Request, float] = field(default_factory=dict)  # beam -> cumulative logprob
    pending: dict[Request, torch.Tensor] = field(default_factory=dict)  # beam -> [V] logprobs of its next token
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most width
    can_improve: bool = True  # transformers' "early stop heuristic unsatisfied"
    done: bool = False

    def ready(self) -> bool:
        return bool(self.live) and all(b in self.pending for b in self.live)

    def select(self) -> list[Candidate]:
        """One step of the search over the reported beams; returns the next live beams (parent, token)."""
        beams = list(self.live)
        num_generated = beams[0].num_output_tokens
        scores = torch.stack([self.pending[b] for b in beams]) + torch.tensor([self.live[b] for b in beams])[:, None]
        self.pending.clear()
        vocab = scores.shape[1]
        k = min(max(2, 1 + len(self.stop_token_ids)) * self.width, scores.numel())
        top_scores, top_idx = scores.view(-1).topk(k)
        length = num_generated + 1  # of every candidate
        at_limit = (length >= self.max_new_tokens
                    or self.num_prompt_tokens + length >= self.max_total_tokens)
        running: list[Candidate] = []
        accepts = self._accepts_hypotheses()  # judged on the state before this step, as transformers does
        all_end = True
        for rank, (score, idx) in enumerate(zip(top_scores.tolist(), top_idx.tolist())):
            if score == float("-inf"):
                break
            parent, token = beams[idx // vocab], idx % vocab
            ends = at_limit or token in self.stop_token_ids
            all_end &= ends
            if not ends:
                if len(running) < self.width:
                    running.append(Candidate(parent, token, score))
                continue
            if rank < self.width and accepts:
                self._add(Hypothesis(parent.output_token_ids + [token], score / length ** self.length_penalty,
                                     token in self.stop_token_ids))
        self._update_can_improve(running, length)
        full = len(self.finished) >= self.width
        self.done = not running or all_end or not self.can_improve or (self.early_stopping is True and full)
        return [] if self.done else running

    def _accepts_hypotheses(self) -> bool:
        full = len(self.finished) >= self.width
        return self.can_improve and not (full and self.early_stopping is True)

    def _add(self, h: Hypothesis) -> None:
        self.finished.append(h)
        self.finished.sort(key=lambda x: x.score, reverse=True)  # stable: earlier hypotheses win ties
        del self.finished[self.width:]

    def _update_can_improve(self, running: list[Candidate], length: int) -> None:
        if not running or len(self.finished) < self.width:
            return
        if self.early_stopping == "never" and self.length_penalty > 0:
            best_length = self.max_new_tokens
        else:
            best_length = length
        best_possible = max(c.logprob for c in running) / best_length ** self.length_penalty
        self.can_improve = self.can_improve and best_possible > self.finished[-1].score

    def results(self) -> list[Hypothesis]:
        """The n best hypotheses. Live beams stand in when fewer than n ended (an abort, or a search
        left without candidates), scored the same way at their current length."""
        pool = list(self.finished)
        if len(pool) < self.n:
            pool += sorted((Hypothesis(b.output_token_ids, s / max(1, b.num_output_tokens) ** self.length_penalty,
                                       False) for b, s in self.live.items()), key=lambda h: h.score, reverse=True)
        return pool[:self.n]
