"""The engine: add requests, step, abort. Synchronous; the async engine and the pipeline drive it.

Order of side effects in one step (an exception in the model run leaves the scheduler's state
as it was before the step, apart from blocks allocated to scheduled requests, which stay owned):
    schedule -> run model + sample -> advance num_computed_tokens -> append tokens, detokenize,
    check stops -> free finished requests.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import KeysView
from dataclasses import dataclass

import torch

from llmserve.config import EngineConfig, GenerationConfig
from llmserve.engine.kv_cache import KVCacheManager
from llmserve.engine.output import IncrementalDetokenizer, RequestTimes, SequenceOutput
from llmserve.engine.request import Request, RequestStatus
from llmserve.engine.scheduler import Scheduler, SchedulerOutput
from llmserve.errors import InvalidRequestError, PromptTooLongError
from llmserve.models.loader import LoadedModel
from llmserve.sampling.params import SamplingParams
from llmserve.sampling.sampler import SamplerOutput
from llmserve.worker.model_runner import ModelRunner, num_blocks_for

logger = logging.getLogger(__name__)


@dataclass
class _Tracked:
    request: Request
    detok: IncrementalDetokenizer


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.loaded = loaded
        self.config = config
        self.tokenizer = loaded.tokenizer
        self.session_len = min(config.session_len or loaded.max_model_len, loaded.max_model_len)
        num_blocks = config.num_blocks or num_blocks_for(loaded, config.block_size, config.cache_max_bytes,
                                                         config.cache_max_entry_count)
        self.runner = ModelRunner(loaded, num_blocks, config.block_size, config.num_threads)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_prefill_token_num, config.max_batch_size)
        self._tracked: dict[str, _Tracked] = {}  # sequence id -> state
        self._children: dict[str, list[str]] = {}  # caller's request id -> its sequence ids
        self._seed_gen = torch.Generator(device="cpu").manual_seed(config.seed)
        logger.info("KV cache: %d blocks of %d tokens (%d tokens in all, up to %d tokens per sequence)",
                    num_blocks, config.block_size, num_blocks * config.block_size, self.session_len)

    # --- requests ------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], gen: GenerationConfig) -> None:
        """Queue a request (n sequences). Raises InvalidRequestError before queueing anything."""
        if request_id in self._children:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        self._validate_prompt(prompt_token_ids, gen)
        params = self._sampling_params(gen)
        seqs = []
        for i in range(gen.n):
            seq_params = params
            if params.seed is not None:
                seq_params = dataclasses.replace(params, seed=params.seed + i)
            seqs.append(Request(
                request_id=f"{request_id}#{i}", token_ids=list(prompt_token_ids),
                num_prompt_tokens=len(prompt_token_ids), sampling=seq_params,
                max_new_tokens=gen.max_new_tokens, max_total_tokens=self.session_len,
                parent_id=request_id, index=i, generator=self._generator(seq_params),
                prompt_source=seqs[0] if seqs else None))  # the prompt is computed once, then shared
        for r in seqs:
            self.scheduler.add_request(r)  # first one may refuse (too big for the pool): nothing queued yet
            self._tracked[r.request_id] = _Tracked(r, IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, gen.skip_special_tokens, gen.stop_words,
                gen.include_stop_str_in_output))
        self._children[request_id] = [r.request_id for r in seqs]

    def abort(self, request_id: str) -> list[SequenceOutput]:
        """Abort a request's sequences now; their blocks are free when this returns."""
        outputs = []
        for seq_id in self._children.pop(request_id, []):
            t = self._tracked.pop(seq_id, None)
            if t is None:
                continue
            self.scheduler.finish(t.request, RequestStatus.FINISHED_ABORTED)
            outputs.append(self._output(t, [], t.detok.flush(final=True), [], "abort"))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def live_request_ids(self) -> KeysView[str]:
        return self._children.keys()

    # --- the loop ------------------------------------------------------------------------

    def step(self) -> list[SequenceOutput]:
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return []
        sampled = self.runner.execute(plan.scheduled, [self.kv.block_table(s.request.request_id)
                                                       for s in plan.scheduled])
        self.scheduler.update_after_step(plan)
        return self._process(plan, sampled)

    def _process(self, plan: SchedulerOutput, sampled: SamplerOutput) -> list[SequenceOutput]:
        outputs = []
        now = time.monotonic()
        samplers = (s.request for s in plan.scheduled if s.samples)
        for request, token, logprobs in zip(samplers, sampled.token_ids, sampled.logprobs):
            t = self._tracked[request.request_id]
            request.first_token_time = request.first_token_time or now
            request.append_token(token)
            reason, stop = self._stop_reason(request, token)
            text = "" if reason == "stop" else t.detok.add(token)
            if t.detok.stop_hit is not None:
                reason, stop = "stop", t.detok.stop_hit
            new_ids = [] if stop == token and reason == "stop" else [token]
            new_lp = [logprobs] if logprobs is not None and new_ids else []
            if reason is not None:
                text += t.detok.flush(final=True)
                self._finish(t, reason)
            outputs.append(self._output(t, new_ids, text, new_lp, reason, stop))
        return outputs

    def _stop_reason(self, r: Request, token: int) -> tuple[str | None, str | int | None]:
        if token in r.sampling.stop_token_ids and r.num_output_tokens > r.sampling.min_tokens:
            return "stop", token
        if r.num_output_tokens >= r.max_new_tokens or r.num_tokens >= r.max_total_tokens:
            return "length", None
        return None, None

    def _finish(self, t: _Tracked, reason: str) -> None:
        r = t.request
        self.scheduler.finish(r, RequestStatus(reason))
        del self._tracked[r.request_id]
        siblings = self._children.get(r.parent_id, [])
        if not any(s in self._tracked for s in siblings):
            self._children.pop(r.parent_id, None)

    def _output(self, t: _Tracked, new_ids: list[int], text: str, logprobs: list, reason: str | None,
                stop: str | int | None = None) -> SequenceOutput:
        r = t.request
        num_out = r.num_output_tokens - (1 if reason == "stop" and isinstance(stop, int) else 0)
        times = None
        if reason is not None:
            times = RequestTimes(r.arrival_time, r.first_scheduled_time, r.first_token_time, time.monotonic())
        return SequenceOutput(r.parent_id, r.index, new_ids, text, r.num_prompt_tokens, num_out,
                              finished=reason is not None, finish_reason=reason, stop_reason=stop,
                              new_logprobs=logprobs, times=times)

    # --- validation and parameters -------------------------------------------------------

    def _validate_prompt(self, ids: list[int], gen: GenerationConfig) -> None:
        if not ids:
            raise InvalidRequestError("the prompt is empty: give at least one token", param="prompt")
        vocab = self.loaded.hf_config.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad!r} is not in the vocabulary [0, {vocab})", param="prompt")
        bad_bias = next((t for t in (gen.logit_bias or {}) if not 0 <= t < vocab), None)
        if bad_bias is not None:
            raise InvalidRequestError(f"logit_bias token id {bad_bias} is not in the vocabulary [0, {vocab})",
                                      param="logit_bias")
        if len(ids) + gen.max_new_tokens > self.session_len:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens and max_new_tokens is {gen.max_new_tokens}: together "
                f"{len(ids) + gen.max_new_tokens}, over the session length of {self.session_len} tokens; "
                "shorten the prompt or lower max_new_tokens", param="max_new_tokens")

    def _sampling_params(self, gen: GenerationConfig) -> SamplingParams:
        stop_ids = set(gen.stop_token_ids or [])
        if not gen.ignore_eos:
            stop_ids.update(self.loaded.eos_token_ids)
        return SamplingParams(
            temperature=float(gen.temperature), top_k=gen.top_k, top_p=float(gen.top_p), min_p=float(gen.min_p),
            repetition_penalty=float(gen.repetition_penalty), presence_penalty=float(gen.presence_penalty),
            frequency_penalty=float(gen.frequency_penalty), logit_bias=gen.logit_bias,
            bad_words_ids=self._bad_words_ids(gen.bad_words or []), min_tokens=gen.min_new_tokens,
            stop_token_ids=frozenset(stop_ids), seed=gen.random_seed, logprobs=gen.logprobs)

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        # A word is produced either at the start of a text or after a space, and the two tokenize
        # differently in most vocabularies: ban both spellings.
        out: list[list[int]] = []
        for word in words:
            for variant in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def _generator(self, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None:
            return None
        return torch.Generator(device=self.runner.device).manual_seed(params.seed)
