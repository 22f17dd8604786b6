"""Continuous batching under a token budget, with chunked prefill and preemption by recompute.

There are no prefill and decode phases. Each request has num_tokens (prompt + generated) and
num_computed_tokens (already in the KV cache); each step hands out at most
`max_num_batched_tokens` new tokens over at most `max_batch_size` running requests:

1. running requests, oldest first, get what they still need (one token when decoding, the next
   chunk when partially prefilled). When the pool has no block for one of them, the newest
   running request is preempted (blocks freed, back to the head of the queue, recomputed later
   with its generated tokens kept, so its output does not change);
2. then waiting requests, first come first served, get chunks of the remaining budget. A prompt
   longer than the budget is prefilled over several steps. A prefix-cache hit starts a request
   with num_computed_tokens = hit blocks * block_size.

Admission guarantees progress: a request that could not run even alone in the pool is refused
when added, so the oldest running request always fits once everything newer is preempted.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from llmserve.engine.kv_cache import KVCacheManager
from llmserve.engine.request import Request, RequestStatus
from llmserve.errors import PromptTooLongError


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    # True when this step computes the request's last known token, so a new one is sampled.
    # Fixed at scheduling time: the request's counters move on after the step.
    samples: bool

    @classmethod
    def of(cls, request: Request, num_new_tokens: int) -> ScheduledRequest:
        return cls(request, num_new_tokens, request.num_computed_tokens + num_new_tokens == request.num_tokens)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # single-token (decode) requests first, then prefill chunks
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_batch_size: int) -> None:
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_batch_size = max_batch_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # oldest first: preemption takes from the end
        self.num_preemptions = 0  # since start, for metrics and tests

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
            if self._allocate_or_preempt(request, n, preempted):
                scheduled.append(ScheduledRequest.of(request, n))
                budget -= n
                i += 1
            else:
                break  # the request itself was preempted: it was the newest
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size and not preempted:
            request = self.waiting[0]
            prefix = self.kv.find_cached_prefix(request)
            num_cached = len(prefix) * self.kv.block_size
            n = min(request.num_tokens - num_cached, budget)
            if not self.kv.allocate(request, n, prefix):
                break  # first come, first served: nobody overtakes the head of the queue
            self.kv.prefix_stats.queried_tokens += request.num_tokens
            self.kv.prefix_stats.hit_tokens += num_cached
            self.waiting.popleft()
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            request.first_scheduled_time = request.first_scheduled_time or time.monotonic()
            self.running.append(request)
            scheduled.append(ScheduledRequest.of(request, n))
            budget -= n
        scheduled.sort(key=lambda s: s.num_new_tokens != 1)  # stable: decodes first, order kept
        return SchedulerOutput(scheduled, preempted)

    def _allocate_or_preempt(self, request: Request, n: int, preempted: list[Request]) -> bool:
        while not self.kv.allocate(request, n):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def update_after_step(self, output: SchedulerOutput) -> None:
        """The step's tokens are now in the cache; publish full blocks to the prefix cache."""
        for s in output.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
            self.kv.cache_full_blocks(s.request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Remove a request wherever it is and free its blocks at once (finish or abort)."""
        assert status.finished
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)
