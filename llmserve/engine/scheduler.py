"""Continuous batching under a token budget, with chunked prefill and preemption by recompute.

There are no prefill and decode phases. Each request has num_tokens (prompt + generated) and
num_computed_tokens (already in the KV cache); each step hands out at most
`max_num_batched_tokens` new tokens over at most `max_batch_size` running requests:

1. running requests, oldest first, get what they still need (one token when decoding, the next
   chunk when partially prefilled). When the pool has no block for one of them, the newest
   running request is preempted (blocks freed, back to the head of the queue, recomputed later
   with its generated tokens kept, so its output does not change);
2. then waiting requests, first come first served, get chunks of the remaining budget (a request whose LoRA
   adapter would make more than `max_loras` distinct adapters running waits, and the ones behind it may start). A prompt
   longer than the budget is prefilled over several steps. A prefix-cache hit starts a request
   with num_computed_tokens = hit blocks * block_size. The siblings of an n > 1 request wait for
   the first one's prompt and share its blocks (see _start_of). A request with a session id starts
   with the session's KV where its tokens extend the session's (engine/sessions.py).

Under memory pressure, idle sessions are evicted (least recently used first) before any running
request is preempted or the head of the queue is refused: their KV is only a saving, a running
request's is work.

Admission guarantees progress: a request that could not run even alone in the pool is refused
when added, so the oldest running request always fits once everything newer is preempted.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from llmserve.engine.kv_cache import KVCacheManager
from llmserve.engine.request import Request, RequestStatus
from llmserve.engine.sessions import SessionStore
from llmserve.errors import PromptTooLongError


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    # True when this step computes the request's last known token, so a new one is sampled.
    # Fixed at scheduling time: the request's counters move on after the step.
    samples: bool
    # Speculative decoding: room reserved (budget and blocks) for this many draft tokens, and the
    # drafts the proposer filled in (at most lookahead; they are part of num_new_tokens).
    lookahead: int = 0
    draft_token_ids: tuple[int, ...] = ()

    @classmethod
    def of(cls, request: Request, num_new_tokens: int, lookahead: int = 0) -> ScheduledRequest:
        return cls(request, num_new_tokens, request.num_computed_tokens + num_new_tokens == request.num_tokens,
                   lookahead)

    @property
    def num_real_tokens(self) -> int:
        return self.num_new_tokens - len(self.draft_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # single-token (decode) requests first, then prefill chunks
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class _Start(NamedTuple):
    blocks: list[int]  # computed blocks the request takes by reference: a prefix-cache hit, a fork or a session
    num_tokens: int  # computed tokens in them: whole blocks, except a session's, which may end mid-block
    source: str  # "cache" (counted in the prefix-cache hit rate), "fork" or "session"


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_batch_size: int,
                 num_lookahead_tokens: int = 0, sessions: SessionStore | None = None,
                 max_loras: int | None = None, num_prediction_tokens: int = 0) -> None:
        self.kv = kv
        self.max_loras = max_loras  # distinct LoRA adapters among the running requests (None: no bound)
        self.sessions = sessions
        self.num_lookahead_tokens = num_lookahead_tokens  # speculative decoding: drafts per decode step
        self.num_prediction_tokens = num_prediction_tokens  # the same for a request with a prediction
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_batch_size = max_batch_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # oldest first: preemption takes from the end
        # Beams preempted while waiting for their group (their step is reported, so they need no
        # compute until the group extends them): not queued; the engine requeues them (`unpark`).
        self.parked: list[Request] = []
        self.num_preemptions = 0  # since start, for metrics and tests
        self.num_prefill_tokens = 0  # prompt tokens computed since start (recomputes included)

    def add_request(self, request: Request) -> None:
        worst = request.num_prompt_tokens + request.max_new_tokens
        if self.kv.blocks_needed(worst) > self.kv.num_blocks:
            raise PromptTooLongError(
                f"prompt ({request.num_prompt_tokens} tokens) + max_new_tokens ({request.max_new_tokens}) needs "
                f"{self.kv.blocks_needed(worst)} KV blocks but the pool has {self.kv.num_blocks} "
                f"({self.kv.num_blocks * self.kv.block_size} tokens): shorten the prompt, lower max_new_tokens, "
                "or give the KV cache more memory", param="max_new_tokens")
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if n == 0:  # a beam that reported its step and waits for the rest of its group
                i += 1
                continue
            # (drafts leave a token of the budget for each running request after this one)
            lookahead = self._lookahead(request, budget - (len(self.running) - i - 1))
            if lookahead and self.kv.allocate(request, n + lookahead):  # drafts never cause a preemption
                scheduled.append(ScheduledRequest.of(request, n, lookahead))
                budget -= n + lookahead
                i += 1
            elif self._allocate_or_preempt(request, n, preempted):
                scheduled.append(ScheduledRequest.of(request, n))
                budget -= n
                i += 1
            else:
                break  # the request itself was preempted: it was the newest
        if not preempted:
            scheduled += self.start_waiting(budget, may_park=not scheduled)
        scheduled.sort(key=lambda s: s.num_new_tokens != 1)  # stable: decodes first, order kept
        return SchedulerOutput(scheduled, preempted)

    def start_waiting(self, budget: int, may_park: bool = False,
                      whole_if: Callable[[Request], bool] | None = None) -> list[ScheduledRequest]:
        """Start waiting requests, first come first served, within `budget` tokens and the batch size: each gets a
        chunk of its prompt (the whole of it where it fits). `may_park`: nothing else runs this step (see _admit).
        `whole_if` (async scheduling's step launched before the one in flight is read, LLMEngine._launch_next):
        only requests it accepts whose whole prompt fits the budget start; the queue stops at the first other one."""
        scheduled: list[ScheduledRequest] = []
        loras = {id(r.lora) for r in self.running if r.lora is not None}
        j = 0  # the queue's first request that may start: those before it wait for a LoRA place
        while j < len(self.waiting) and budget > 0 and len(self.running) < self.max_batch_size:
            request = self.waiting[j]
            if (request.lora is not None and self.max_loras is not None and id(request.lora) not in loras
                    and len(loras) >= self.max_loras):
                j += 1  # its adapter waits until one of the running ones is done; the ones behind it may go
                continue
            if whole_if is not None and not whole_if(request):
                break
            start = self._start_of(request)
            if start is None:
                break  # waits for its sibling's prompt; first come, first served, so do the ones behind it
            num_cached = start.num_tokens
            n = min(request.num_tokens - num_cached, budget)
            if whole_if is not None and n < request.num_tokens - num_cached:
                break
            if not self._admit(request, n, start, may_park=may_park and not scheduled):
                break  # first come, first served: nobody overtakes the head of the queue
            if start.source == "cache":
                self.kv.prefix_stats.queried_tokens += request.num_tokens
                self.kv.prefix_stats.hit_tokens += num_cached
            if self.sessions is not None and request.session_id is not None:
                self.sessions.claim(request, num_cached if start.source == "session" else 0)
            # (an n > 1 sibling's prompt is the first one's, even where it finds those blocks in the prefix cache)
            if request.first_scheduled_time is None and request.prompt_source is None and start.source != "fork":
                request.num_cached_prompt_tokens = num_cached
            request.prompt_source = None
            del self.waiting[j]
            if request.lora is not None:
                loras.add(id(request.lora))
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            request.first_scheduled_time = request.first_scheduled_time or time.monotonic()
            self.running.append(request)
            scheduled.append(ScheduledRequest.of(request, n))
            budget -= n
        return scheduled

    def _lookahead(self, request: Request, budget: int) -> int:
        """Draft tokens a decoding request may verify this step: none past its max_new_tokens (the
        last draft is followed by one more sampled token) or its session length; from a prediction, no more than it
        has left after the output's position in it, and none where that position was lost."""
        p = request.prediction
        if p is None:
            wanted = self.num_lookahead_tokens
        else:  # as many as the proposer will draft from where the output stands in it (PredictionProposer)
            wanted = 0 if not p.aligned else min(self.num_prediction_tokens, p.length or self.num_prediction_tokens,
                                                 len(p.token_ids) - p.cursor)
        if not wanted or request.num_tokens - request.num_computed_tokens != 1:
            return 0
        if request.sampling.beam_width:
            return 0
        room = min(request.max_new_tokens - request.num_output_tokens, request.max_total_tokens - request.num_tokens)
        return max(0, min(wanted, budget - 1, room - 1))

    def _start_of(self, request: Request) -> _Start | None:
        """The computed blocks a waiting request starts with; None while it must wait for them.

        A sibling of an n > 1 request waits until the first sibling has computed the prompt, then
        shares its full prompt blocks (whether or not prefix caching is on) instead of prefilling the
        prompt n times. It recomputes the partial last block itself (under block_size tokens, or one
        block when the prompt fills its blocks exactly) where vLLM copies that block on write: that
        keeps the bookkeeping free of device copies (no copy hook in the runner) at the price of at
        most block_size prompt tokens per sibling. If the first sibling is no longer running
        (finished or aborted; a preempted one is back ahead of it in the queue), it prefills normally.
        """
        # Prompt logprobs (and MEAN or CLS pooling) come from computing each position: no reuse of a cached prefix or
        # a session's KV (a sibling's fork is fine: its source computes the same prompt into the list they share).
        own_prompt = request.computes_whole_prompt
        if self.sessions is not None and request.session_id is not None and not own_prompt:
            reuse = self.sessions.reuse_for(request)
            if reuse is not None:
                return _Start(reuse.block_ids, reuse.num_tokens, "session")
        source = request.prompt_source
        num_shared = self.kv.num_shareable_blocks(request)
        bs = self.kv.block_size
        if source is None or num_shared == 0 or source.status != RequestStatus.RUNNING:
            hits = [] if own_prompt else self.kv.find_cached_prefix(request)
            return _Start(hits, len(hits) * bs, "cache")
        if source.num_computed_tokens < num_shared * bs:
            return None  # the source is running, so it gets budget before any waiting request: the wait ends
        return _Start(self.kv.fork(source, num_shared), num_shared * bs, "fork")

    def _admit(self, request: Request, n: int, start: _Start, may_park: bool) -> bool:
        """Allocate for the head of the queue, evicting idle sessions (never its own) if need be. When
        nothing else runs this step, the running requests can only be beams waiting for their group,
        holding blocks without computing: park them (newest first) to make room, or nothing would
        ever move."""
        while not self.kv.allocate(request, n, start.blocks, start.num_tokens):
            if self._evict_session(keep=request.session_id):
                continue
            idle = [r for r in self.running if r.num_computed_tokens == r.num_tokens]
            if not may_park or not idle:
                return False
            self.running.remove(idle[-1])
            self._preempt(idle[-1])
        return True

    def _allocate_or_preempt(self, request: Request, n: int, preempted: list[Request]) -> bool:
        while not self.kv.allocate(request, n):
            # A running request never needs its own session's blocks (it holds them, or runs without it).
            if self._evict_session(keep=None):
                continue
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _evict_session(self, keep: str | None) -> bool:
        return self.sessions is not None and self.sessions.evict_lru(keep)

    def _preempt(self, request: Request) -> None:
        """Free a request the caller took out of `running`; requeue it first, or park an idle beam."""
        idle = request.num_computed_tokens == request.num_tokens  # a beam that reported its step
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.status = RequestStatus.WAITING
        if idle:
            self.parked.append(request)
        else:
            self.waiting.appendleft(request)

    def unpark(self, request: Request) -> None:
        """A parked beam was extended: queue it (first) for recomputation."""
        if request in self.parked:
            self.parked.remove(request)
            self.waiting.appendleft(request)

    def update_after_step(self, output: SchedulerOutput) -> None:
        """The step's tokens are now in the cache; publish full blocks to the prefix cache."""
        for s in output.scheduled:
            r = s.request
            self.num_prefill_tokens += max(min(r.num_prompt_tokens, r.num_computed_tokens + s.num_real_tokens)
                                           - r.num_computed_tokens, 0)
            s.request.num_computed_tokens += s.num_real_tokens  # accepted drafts are added by the engine
            self.kv.cache_full_blocks(s.request)

    def add_running(self, request: Request) -> None:
        """A beam forked from a running one: it holds blocks (see KVCacheManager.fork_beam) and runs."""
        request.status = RequestStatus.RUNNING
        request.first_scheduled_time = request.first_scheduled_time or time.monotonic()
        self.running.append(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Remove a request wherever it is and free its blocks at once (finish or abort), unless its
        session keeps them for the next turn."""
        assert status.finished
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif request in self.parked:
            self.parked.remove(request)
        request.status = status
        if self.sessions is None or request.session_id is None or not self.sessions.keep(request):
            self.kv.free(request)
