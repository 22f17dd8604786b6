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
from llmserve.engine.beam_search import BeamGroup
from llmserve.engine.groups import BeamSearch, BestOf
from llmserve.engine.kv_cache import KVCacheManager
from llmserve.engine.output import IncrementalDetokenizer, RequestTimes, SequenceOutput
from llmserve.engine.pooling import EmbedParams, Pooling, resolve_pooler
from llmserve.engine.request import Prediction, Request, RequestStatus
from llmserve.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from llmserve.engine.sessions import SessionStore
from llmserve.engine.speculative import (
    DraftModelProposer,
    NgramProposer,
    PredictionProposer,
    Proposer,
    SpecStats,
)
from llmserve.errors import InvalidRequestError, PromptTooLongError
from llmserve.kernels import calibrate
from llmserve.lora import LoRAAdapter, LoRAManager
from llmserve.models.loader import LoadedModel, load_model
from llmserve.sampling.params import SamplingParams
from llmserve.sampling.sampler import SamplerOutput
from llmserve.structured.compiler import GrammarCompiler
from llmserve.structured.matcher import GrammarState
from llmserve.vl.inputs import MultiModalInputs
from llmserve.worker.model_runner import CpuOptions, GraphOptions, InFlight, ModelRunner, num_blocks_for

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _InFlightStep:
    """Async scheduling: a launched decode step (its plan, and the runner's handle on its tokens)."""

    plan: SchedulerOutput
    handle: InFlight


@dataclass
class _Tracked:
    request: Request
    detok: IncrementalDetokenizer
    prompt_logprobs_sent: bool = False  # they go out with the sequence's first output


# Session ids are keys the engine keeps while the session lives: bounded, like any client-chosen key.
MAX_SESSION_ID_CHARS = 256


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.loaded = loaded
        self.config = config
        self.tokenizer = loaded.tokenizer
        self.session_len = min(config.session_len or loaded.max_model_len, loaded.max_model_len)
        draft = self._load_draft(loaded, config)
        num_blocks = config.num_blocks or num_blocks_for(loaded, config.block_size, config.cache_max_bytes,
                                                         config.cache_max_entry_count, draft, config.kv_cache_dtype)
        # graphs are CUDA's; int8 weights there run kernels/triton/int8.py (or torch's dequantizing path), both
        # capturable (w8a8 runs on CPUs only)
        graphs = GraphOptions(not config.enforce_eager and config.tp == 1,
                              config.max_batch_size, self.session_len + config.num_speculative_tokens)
        threads = config.num_threads
        if config.tp > 1:  # the ranks split the cores
            from llmserve.distributed.workers import threads_per_rank

            threads = threads_per_rank(config)
        cpu = CpuOptions(threads, config.kernel_choice, calibrate.row_limits(config))
        self.runner = ModelRunner(loaded, num_blocks, config.block_size, cpu, config.kv_cache_dtype, graphs)
        if loaded.tp_workers is not None:  # the other ranks load their shards and caches now (after rank 0's timings)
            loaded.tp_workers.build(num_blocks, config.block_size, config.kv_cache_dtype)
            self.runner.tp_workers = loaded.tp_workers
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.lora: LoRAManager | None = None
        if config.enable_lora:
            self.lora = LoRAManager(loaded.model, loaded.dtype, loaded.device, config.max_loras,
                                    config.max_lora_rank, config.max_cpu_loras)
            for name, path in (config.adapters or {}).items():
                self.lora.load(name, path)
            self.runner.lora = self.lora
        self.proposer: Proposer | None = None
        if config.speculative_method == "ngram":
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        elif draft is not None:
            self.proposer = DraftModelProposer(ModelRunner(draft, num_blocks, config.block_size, cpu,
                                                           config.kv_cache_dtype, graphs))
        self.predictions = PredictionProposer()  # requests with a prediction draft from it, whatever the proposer
        self.spec_stats = SpecStats()
        lookahead = config.num_speculative_tokens if self.proposer else 0
        self.sessions = SessionStore(self.kv, config.max_sessions, config.session_ttl)
        self.scheduler = Scheduler(self.kv, config.max_prefill_token_num, config.max_batch_size, lookahead,
                                   self.sessions, config.max_loras if self.lora is not None else None,
                                   config.num_prediction_tokens)
        self._tracked: dict[str, _Tracked] = {}  # sequence id -> state
        self._children: dict[str, list[str]] = {}  # caller's request id -> its sequence ids
        self._beams: dict[str, BeamSearch] = {}  # caller's request id -> its beam search
        self._best_of: dict[str, BestOf] = {}  # caller's request id -> its held-back samples
        self._seed_gen = torch.Generator(device="cpu").manual_seed(config.seed)
        # Async scheduling: the decode step on the device whose tokens are not read yet (see _step_async)
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else loaded.device.type == "cuda" and self.runner.graphs is not None)
        self.async_scheduling &= self.proposer is None and loaded.tp_workers is None
        self._in_flight: _InFlightStep | None = None
        # Structured output: xgrammar is imported and the vocabulary read at the first structured request.
        self.grammars = GrammarCompiler(self.tokenizer, loaded.hf_config.vocab_size, loaded.eos_token_ids)
        self.pooler = resolve_pooler(loaded.model_dir, loaded.hf_config, config.pooler_config)  # embeddings
        logger.info("KV cache: %d blocks of %d tokens (%d tokens in all, up to %d tokens per sequence); async "
                    "scheduling %s", num_blocks, config.block_size, num_blocks * config.block_size, self.session_len,
                    "on" if self.async_scheduling else "off")

    # --- requests ------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], gen: GenerationConfig,
                    session_id: str | None = None, mm: MultiModalInputs | None = None,
                    adapter_name: str | None = None) -> None:
        """Queue a request (n sequences). Raises InvalidRequestError before queueing anything.

        With a session id, the request starts from the KV the session kept of its last turn (as far
        as the prompt extends that turn's tokens), and its own KV is kept for the next one (see
        engine/sessions.py). The prompt is always the whole conversation: a missing or evicted
        session only costs a longer prefill.

        `adapter_name`: a loaded LoRA adapter to run the request with (None: the base model)."""
        if request_id in self._children:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        if self.loaded.headless:
            raise InvalidRequestError(f"the model {self.loaded.served_name!r} has no LM head (its checkpoint holds the "
                                      "decoder alone, as embedding models ship): it makes embeddings only",
                                      param="model")
        self._validate_prompt(prompt_token_ids, gen)
        self._validate_images(prompt_token_ids, mm)
        self._validate_session(session_id, gen)
        lora = self.adapter(adapter_name)
        params = self._sampling_params(gen)
        if gen.use_beam_search:
            return self._add_beam_search(request_id, prompt_token_ids, gen, params, mm, lora)
        # Compiled on this thread unless already cached (the async engine compiles on a worker thread first).
        compiled = self.grammars.compile(gen.response_format) if gen.response_format is not None else None
        prompt_logprobs = [None] * len(prompt_token_ids) if gen.prompt_logprobs is not None else None
        predicted = self._prediction_ids(gen)
        num_seqs = gen.n
        if gen.best_of is not None and gen.best_of > gen.n:
            num_seqs = gen.best_of
            # The ranking needs each sampled token's logprob.
            params = dataclasses.replace(params, logprobs=params.logprobs or 0)
        seqs = []
        for i in range(num_seqs):
            seq_params = params
            if params.seed is not None:
                seq_params = dataclasses.replace(params, seed=params.seed + i)
            seqs.append(Request(
                request_id=f"{request_id}#{i}", token_ids=list(prompt_token_ids),
                num_prompt_tokens=len(prompt_token_ids), sampling=seq_params,
                max_new_tokens=gen.max_new_tokens, max_total_tokens=self.session_len,
                parent_id=request_id, index=i, generator=self._generator(seq_params),
                prompt_source=seqs[0] if seqs else None,  # the prompt is computed once, then shared
                session_id=session_id, grammar=self._grammar_state(compiled), prompt_logprobs=prompt_logprobs, mm=mm,
                lora=lora, prediction=None if predicted is None else Prediction(list(predicted))))
        for r in seqs:
            self.scheduler.add_request(r)  # first one may refuse (too big for the pool): nothing queued yet
            self._tracked[r.request_id] = _Tracked(r, IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, gen.skip_special_tokens, gen.stop_words,
                gen.include_stop_str_in_output))
        self._children[request_id] = [r.request_id for r in seqs]
        if num_seqs > gen.n:
            self._best_of[request_id] = BestOf(gen.n, num_seqs, keep_logprobs=gen.logprobs is not None)

    def add_embedding_request(self, request_id: str, prompt_token_ids: list[int], params: EmbedParams | None = None,
                              adapter_name: str | None = None) -> None:
        """Queue an embedding request (engine/pooling.py): the prompt's final hidden states pooled into one vector,
        which its one output carries (SequenceOutput.embedding). Raises InvalidRequestError before queueing
        anything."""
        if request_id in self._children:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        params = params or EmbedParams()
        normalize = self._check_embedding(params)
        self._validate_ids(prompt_token_ids)
        n = len(prompt_token_ids)
        if n > self.session_len:
            raise PromptTooLongError(f"the input has {n} tokens, over the session length of "
                                     f"{self.session_len} tokens; shorten it", param="input")
        if self.kv.blocks_needed(n) > self.kv.num_blocks:
            raise PromptTooLongError(f"the input has {n} tokens and the KV cache holds at most "
                                     f"{self.kv.num_blocks * self.kv.block_size}: shorten it, or give the KV cache "
                                     "more memory", param="input")
        lora = self.adapter(adapter_name)
        r = Request(request_id=f"{request_id}#0", token_ids=list(prompt_token_ids), num_prompt_tokens=n,
                    sampling=SamplingParams(), max_new_tokens=0, max_total_tokens=self.session_len,
                    parent_id=request_id, lora=lora,
                    pooling=Pooling(self.pooler.pooling_type, n, normalize, params.dimensions))
        self.scheduler.add_request(r)
        self._tracked[r.request_id] = _Tracked(r, IncrementalDetokenizer(self.tokenizer, prompt_token_ids, True,
                                                                         None, False))
        self._children[request_id] = [r.request_id]

    def _check_embedding(self, params: EmbedParams) -> bool:
        """Refuse what this model cannot embed as asked; the request's normalization."""
        pooler, name = self.pooler, self.loaded.served_name
        if pooler.refused is not None:
            raise InvalidRequestError(f"the model {name!r} cannot make embeddings as its checkpoint defines them: "
                                      f"{pooler.refused}; pooler_config may set another pooling", param="model")
        dims = params.dimensions
        if dims is not None:
            hidden = self.loaded.hf_config.hidden_size
            if not isinstance(dims, int) or isinstance(dims, bool) or not 1 <= dims <= hidden:
                raise InvalidRequestError(f"dimensions must be an integer from 1 to the model's {hidden}, got "
                                          f"{dims!r}", param="dimensions")
            if pooler.matryoshka is None:
                raise InvalidRequestError(f"the model {name!r} does not support Matryoshka representation (its config "
                                          "declares neither is_matryoshka nor matryoshka_dimensions): its embeddings "
                                          "cut to fewer dimensions would be poor; leave dimensions out",
                                          param="dimensions")
            if pooler.matryoshka and dims not in pooler.matryoshka:
                raise InvalidRequestError(f"dimensions {dims} is not one the model {name!r} was trained for: "
                                          f"{', '.join(map(str, pooler.matryoshka))}", param="dimensions")
        if params.normalize is not None and not isinstance(params.normalize, bool):
            raise InvalidRequestError(f"normalize must be true or false, got {params.normalize!r}",
                                      param="normalize")
        return pooler.normalize if params.normalize is None else params.normalize

    def _add_beam_search(self, request_id: str, prompt: list[int], gen: GenerationConfig,
                         params: SamplingParams, mm: MultiModalInputs | None = None,
                         lora: LoRAAdapter | None = None) -> None:
        # Beams are greedy rows to the sampler (no temperature, truncation or seed): it hands back
        # their log-probabilities and the engine chooses.
        params = dataclasses.replace(params, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, seed=None,
                                     logprobs=None, beam_width=gen.num_beams)
        root = Request(request_id=f"{request_id}#b0", token_ids=list(prompt), num_prompt_tokens=len(prompt),
                       sampling=params, max_new_tokens=gen.max_new_tokens, max_total_tokens=self.session_len,
                       parent_id=request_id, mm=mm, lora=lora)
        self.scheduler.add_request(root)
        group = BeamGroup(request_id, gen.num_beams, gen.n, len(prompt), gen.max_new_tokens, self.session_len,
                          params.stop_token_ids, float(gen.length_penalty), gen.early_stopping, live={root: 0.0})
        self._beams[request_id] = BeamSearch(group, gen, root.arrival_time, root=root)
        self._children[request_id] = []

    def abort(self, request_id: str) -> list[SequenceOutput]:
        """Abort a request's sequences now; their blocks are free when this returns."""
        outputs = []
        self._best_of.pop(request_id, None)
        if (beams := self._beams.pop(request_id, None)) is not None:
            results = beams.group.results()
            first = min((b.first_scheduled_time for b in beams.group.live if b.first_scheduled_time), default=None)
            for beam in beams.group.live:
                self.scheduler.finish(beam, RequestStatus.FINISHED_ABORTED)
            outputs.extend(beams.outputs(self.tokenizer, results, first, reason="abort"))
        for seq_id in self._children.pop(request_id, []):
            t = self._tracked.pop(seq_id, None)
            if t is None:
                continue
            self.scheduler.finish(t.request, RequestStatus.FINISHED_ABORTED)
            if self.proposer is not None:
                self.proposer.forget(t.request)
            outputs.append(self._output(t, [], t.detok.flush(final=True), [], "abort"))
        return outputs

    # --- LoRA adapters -------------------------------------------------------------------

    def adapter(self, name: str | None, param: str = "adapter_name") -> LoRAAdapter | None:
        """The loaded adapter of this name (None for None: the base model); a clear error otherwise."""
        if name is None:
            return None
        if not isinstance(name, str):
            raise InvalidRequestError(f"{param}: must be a string (a loaded LoRA adapter's name) or None, got "
                                      f"{type(name).__name__}", param=param)
        if self.lora is None:
            raise InvalidRequestError(f"{param}: {name!r} names a LoRA adapter, but this engine serves none (start it "
                                      "with adapters=... or enable_lora)", param=param)
        return self.lora.get(name, param)

    def load_adapter(self, name: str, path: str) -> LoRAAdapter:
        """Load a PEFT adapter at run time (between steps); requests may name it from then on."""
        return self._lora_manager().load(name, path)

    def unload_adapter(self, name: str) -> None:
        """Unload an adapter: new requests may no longer name it; running ones finish with it."""
        self._lora_manager().unload(name)

    def _lora_manager(self) -> LoRAManager:
        if self.lora is None:
            raise InvalidRequestError("LoRA adapters are not enabled in this engine (start it with enable_lora or "
                                      "adapters=...)", param="lora_name")
        return self.lora

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do with tp = 1). The engine cannot step after this."""
        if self.loaded.tp_workers is not None:
            self.loaded.tp_workers.close()

    def end_session(self, session_id: str) -> bool:
        """Free a session's KV now; False if no such session is kept (never stored, ended, or evicted)."""
        return self.sessions.close(session_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def live_request_ids(self) -> KeysView[str]:
        return self._children.keys()

    # --- the loop ------------------------------------------------------------------------

    def step(self) -> list[SequenceOutput]:
        self.sessions.expire()
        if self._in_flight is not None:
            if any(s.request.status == RequestStatus.RUNNING for s in self._in_flight.plan.scheduled):
                return self._step_async()
            self._in_flight = None  # every request of it was aborted: nothing to read
        plan = self.scheduler.schedule()
        if self.proposer is not None:
            for r in plan.preempted:
                self.proposer.forget(r)
        if not plan.scheduled:
            return []
        self._add_drafts(plan)
        if self.async_scheduling and self._may_overlap(plan.scheduled):
            singles = [s.request for s in plan.scheduled if s.num_new_tokens == 1]  # first, as the scheduler sorts
            prompts = [(s.request, s.num_new_tokens) for s in plan.scheduled if s.num_new_tokens > 1]
            self._in_flight = _InFlightStep(plan, self._launch(singles, [r.num_computed_tokens for r in singles],
                                                               prompts=prompts))
            return self._step_async()
        sampled = self.runner.execute(plan.scheduled, [self.kv.block_table(s.request.request_id)
                                                       for s in plan.scheduled])
        self.scheduler.update_after_step(plan)
        outputs = self._process(plan, sampled)
        if self._best_of:
            outputs = self._hold_best_of(outputs)
        return outputs

    # --- async scheduling ----------------------------------------------------------------
    #
    # Step N's tokens stay on the device while the host launches step N + 1 with them as its inputs; only then does
    # it read N's tokens and process them (append, detokenize, stops, outputs), while the device runs N + 1. The
    # host's work per step thus overlaps the device's, where a synchronous step leaves the device idle through it.
    #
    # Step N + 1 is launched before N's stops are known: a request that stops at N (an EOS, a stop string) computes
    # one token more, which is dropped. Its blocks are freed at once, as usual; the device writes that token's K/V
    # into them in stream order, before any later step can reuse them, and only into a block that is not yet full
    # (so not in the prefix cache). Requests whose N-th token is known to be their last (max_new_tokens, the session
    # length) are left out of N + 1. A request's counters lag by that one step while it is in flight:
    # num_computed_tokens and token_ids catch up when N is read, before anything else looks at them.
    #
    # Steps of decodes overlap, and so do steps that start requests (_may_overlap, _launch_next): a waiting request
    # whose whole prompt fits the step's budget starts in step N + 1 beside the decodes (its prompt computed and its
    # first token sampled on the device; such a step runs eagerly, not from a graph), so a server's stream of arrivals
    # does not make every step that starts one synchronous. Its counters lag by its prompt while N + 1 is in flight,
    # as a decode's lag by one token: the step after it takes its first token from N + 1 at position num_tokens.
    # A prompt chunked over several steps, images, prompt logprobs, n > 1 siblings after the first (which wait for
    # its prompt's blocks) and beams start, and run, in synchronous steps, after the one in flight is read, as does
    # a step that must preempt. Requests whose sampling reads their output (penalties, bad words, min_tokens, a
    # grammar) overlap in part: the next step waits for the one in flight before it launches (_reads_output). A
    # session's request that stops at N keeps only the blocks of its computed tokens (KVCacheManager.hold), which
    # N + 1's write lies beyond. A request with a prediction runs in synchronous steps until its output has passed
    # the prediction's end: its drafts follow the tokens read back.

    @staticmethod
    def _overlappable(r: Request) -> bool:
        p = r.prediction
        return (r.status == RequestStatus.RUNNING and not r.sampling.beam_width and r.pooling is None
                and (p is None or p.cursor >= len(p.token_ids)))

    @staticmethod
    def _reads_output(r: Request) -> bool:
        """Whether the request's sampling reads its output tokens (penalties, bad words, min_tokens, a grammar): the
        next step needs the one in flight on the host, so it waits for that step before launching (and still
        processes it while the next one runs)."""
        p = r.sampling
        return (p.needs_penalties or bool(p.bad_words_ids) or r.num_output_tokens < p.min_tokens
                or r.grammar is not None or p.watermark)

    def _may_overlap(self, scheduled: list[ScheduledRequest]) -> bool:
        """A step of every running request, none a beam's, each sampling: decodes, and prompts computed whole (the
        rest of them, past a cached prefix) that may start ahead (_starts_ahead)."""
        return (0 < len(scheduled) == len(self.scheduler.running)
                and all(s.samples and not s.draft_token_ids and self._overlappable(s.request)
                        and (s.request.num_output_tokens > 0 and s.num_new_tokens == 1
                             or s.num_new_tokens == s.request.num_tokens - s.request.num_computed_tokens
                             and self._starts_ahead(s.request))
                        for s in scheduled))

    def _launch(self, requests: list[Request], positions: list[int], prev: tuple[InFlight, list[int]] | None = None,
                known: list[int] | None = None, prompts: list[tuple[Request, int]] = ()) -> InFlight:
        return self.runner.launch(requests, positions, [self.kv.block_table(r.request_id) for r in requests], prev,
                                  known, [(r, n, self.kv.block_table(r.request_id)) for r, n in prompts])

    def _launch_next(self, step: _InFlightStep) -> _InFlightStep | None:
        """The step after the one in flight, launched with its tokens as inputs; None where it cannot overlap."""
        running = [(i, s.request) for i, s in enumerate(step.plan.scheduled)
                   if s.request.status == RequestStatus.RUNNING]
        if len(running) != len(self.scheduler.running):
            return None
        # a request whose token in flight is its last (by length) is not computed further
        rows = [(i, r) for i, r in running
                if r.num_output_tokens + 1 < r.max_new_tokens and r.num_tokens + 1 < r.max_total_tokens]
        sch = self.scheduler
        if (len(rows) > sch.max_num_batched_tokens or not all(self._overlappable(r) for _, r in rows)
                or not (rows or sch.waiting)):
            return None
        # room for the token in flight (computed by the step after this one: position num_tokens, since the token is
        # not appended yet) and the one that step samples; never a preemption. (A request whose prompt the step in
        # flight computes has not counted it yet: its num_computed_tokens lags by the prompt, not by one.)
        if not all(self.kv.allocate(r, r.num_tokens + 1 - r.num_computed_tokens) for _, r in rows):
            return None
        # waiting requests whose whole prompt fits start in this step too (a plain text prompt: see _starts_ahead)
        started: list[ScheduledRequest] = []
        if sch.waiting and len(rows) < sch.max_batch_size:
            started = sch.start_waiting(sch.max_num_batched_tokens - len(rows), whole_if=self._starts_ahead)
            if not started:
                return None  # (a waiting request that could start: a synchronous step starts it)
        requests = [r for _, r in rows]
        known = None
        if any(self._reads_output(r) for r in requests):
            tokens = step.handle.result()[0]
            known = [tokens[i] for i, _ in rows]
        started.sort(key=lambda s: s.num_new_tokens != 1)  # the runner's order: single tokens first
        plan = SchedulerOutput([ScheduledRequest(r, 1, True) for r in requests] + started)
        return _InFlightStep(plan, self._launch(requests, [r.num_tokens for r in requests],
                                                (step.handle, [i for i, _ in rows]), known,
                                                [(s.request, s.num_new_tokens) for s in started]))

    @staticmethod
    def _starts_ahead(r: Request) -> bool:
        """Whether a waiting request may start in a step launched before the one in flight is read: a prompt of
        text (no images: their encoder runs in the step), computed once (not n > 1 siblings sharing the first one's
        blocks, which lag while in flight), with no prompt logprobs (read back in the step), no beams, and
        not an embedding (pooled in the step)."""
        return (r.mm is None and r.prompt_source is None and r.prompt_logprobs is None
                and not r.sampling.beam_width and r.pooling is None)

    def _step_async(self) -> list[SequenceOutput]:
        step, self._in_flight = self._in_flight, None
        assert step is not None
        after = self._launch_next(step)  # before reading `step`'s tokens: the device goes on to it meanwhile
        tokens, logprobs = step.handle.result()
        live = [(s, t, lp) for s, t, lp in zip(step.plan.scheduled, tokens, logprobs, strict=True)
                if s.request.status == RequestStatus.RUNNING]
        plan = SchedulerOutput([s for s, _, _ in live])
        self.scheduler.update_after_step(plan)
        outputs = self._process(plan, SamplerOutput([t for _, t, _ in live], [lp for _, _, lp in live]))
        if after is not None and any(s.request.status == RequestStatus.RUNNING for s in after.plan.scheduled):
            self._in_flight = after
        if self._best_of:
            outputs = self._hold_best_of(outputs)
        return outputs

    def _hold_best_of(self, outputs: list[SequenceOutput]) -> list[SequenceOutput]:
        released = []
        for out in outputs:
            group = self._best_of.get(out.request_id)
            if group is None:
                released.append(out)
                continue
            winners = group.add(out)
            if winners:
                del self._best_of[out.request_id]
                released.extend(winners)
        return released

    def _add_drafts(self, plan: SchedulerOutput) -> None:
        wanting = [s for s in plan.scheduled if s.lookahead]
        if not wanting:
            return
        drafts = self.predictions.propose([s for s in wanting if s.request.prediction is not None], {})
        others = [s for s in wanting if s.request.prediction is None]
        if others and self.proposer is not None:
            drafts.update(self.proposer.propose(others, {s.request: self.kv.block_table(s.request.request_id)
                                                         for s in others}))
        for r, d in drafts.items():  # a draft the grammar refuses could never be accepted: not verified
            if r.grammar is not None and d:
                drafts[r] = r.grammar.valid_prefix(list(d))
        plan.scheduled = [
            dataclasses.replace(s, num_new_tokens=s.num_new_tokens + len(d), draft_token_ids=tuple(d))
            if (d := drafts.get(s.request)) else s
            for s in plan.scheduled]
        plan.scheduled.sort(key=lambda s: s.num_new_tokens != 1)  # decodes first, as the runner requires

    def _process(self, plan: SchedulerOutput, sampled: SamplerOutput) -> list[SequenceOutput]:
        outputs = []
        now = time.monotonic()
        row = 0
        reported: dict[str, BeamSearch] = {}
        for s in plan.scheduled:
            if not s.samples:
                continue
            if s.request.pooling is not None:  # its prompt is computed: the vector is ready
                outputs.append(self._embedded(s.request, now))
                continue
            if s.request.sampling.beam_width:
                beams = self._beams[s.request.parent_id]
                beams.group.pending[s.request] = sampled.beam_logprobs[row]
                reported[s.request.parent_id] = beams
                row += 1
                continue
            num_rows = 1 + len(s.draft_token_ids)
            tokens = sampled.token_ids[row:row + num_rows]
            logprobs = sampled.logprobs[row:row + num_rows]
            num_accepted = 0
            if s.draft_token_ids:  # emit up to the first rejected draft, inclusive
                accepted = sampled.accepted[row:row + num_rows - 1]
                num_accepted = next((i for i, a in enumerate(accepted) if not a), len(accepted))
                tokens, logprobs = tokens[:num_accepted + 1], logprobs[:num_accepted + 1]
                self._after_verify(s, num_accepted)
            row += num_rows
            before = s.request.num_tokens
            out = self._emit(s.request, tokens, logprobs, now)
            if (p := s.request.prediction) is not None:
                if s.draft_token_ids:
                    self.predictions.verified(s.request, len(s.draft_token_ids), num_accepted,
                                              s.request.num_tokens - before)
                    out.prediction_tokens = (p.accepted, p.rejected)
                self.predictions.advance(s.request)
            outputs.append(out)
        for beams in reported.values():
            if beams.group.ready():
                outputs.extend(self._beam_step(beams, now))
        return outputs

    def _embedded(self, r: Request, now: float) -> SequenceOutput:
        t = self._tracked[r.request_id]
        r.first_token_time = now
        self._finish(t, "stop")
        out = self._output(t, [], "", [], "stop")
        assert r.pooling is not None
        out.embedding = r.pooling.embedding()
        return out

    def _beam_step(self, beams: BeamSearch, now: float) -> list[SequenceOutput]:
        """Every live beam of the group reported: select, then fork, extend and drop beams."""
        group = beams.group
        beams.first_token = beams.first_token or now
        chosen = group.select()
        results = group.results() if group.done else []  # before the live beams are dropped
        old = group.live
        first_scheduled = min((b.first_scheduled_time for b in old if b.first_scheduled_time), default=None)
        children: dict[Request, list] = {}
        for c in chosen:
            children.setdefault(c.parent, []).append(c)
        for beam in old:  # drop first: their blocks may serve the copies below
            if beam not in children:
                self.scheduler.finish(beam, RequestStatus.FINISHED_STOPPED)
        group.live = {}
        copies = []
        for parent, kids in children.items():
            for c in kids[1:]:  # forks first: they copy the parent before it grows
                child = beams.fork(parent, c.token_id)
                if parent.status == RequestStatus.RUNNING:
                    pair = self.kv.fork_beam(parent, child)
                    if pair:
                        copies.append(pair)
                    self.scheduler.add_running(child)
                else:  # parked (preempted after reporting): the child recomputes too
                    self.scheduler.waiting.appendleft(child)
                group.live[child] = c.logprob
            parent.append_token(kids[0].token_id)
            self.scheduler.unpark(parent)  # if it was parked without blocks, it recomputes now
            group.live[parent] = kids[0].logprob
        self.runner.copy_blocks(copies)
        if not group.done:
            return []
        for beam in group.live:
            self.scheduler.finish(beam, RequestStatus.FINISHED_STOPPED)
        del self._beams[group.request_id]
        self._children.pop(group.request_id, None)
        return beams.outputs(self.tokenizer, results, first_scheduled)

    def _after_verify(self, s: ScheduledRequest, num_accepted: int) -> None:
        """Before the accepted tokens are appended: their K/V were computed by the verify pass, so
        they count as computed (a request that stops among them is freed anyway)."""
        r = s.request
        self.spec_stats.record(len(s.draft_token_ids), num_accepted, num_accepted + 1)
        if r.prediction is None:  # (a prediction's counts follow _emit: PredictionProposer.verified)
            self.proposer.accepted(r, r.num_tokens, num_accepted, len(s.draft_token_ids))
        r.num_computed_tokens += num_accepted

    def _emit(self, request: Request, tokens: list[int], logprobs: list, now: float) -> SequenceOutput:
        """Append the step's tokens one by one, stopping at the first that ends the sequence."""
        t = self._tracked[request.request_id]
        request.first_token_time = request.first_token_time or now
        text = ""
        new_ids: list[int] = []
        new_lp = []
        reason = stop = None
        for token, lp in zip(tokens, logprobs):
            request.append_token(token)
            reason, stop = self._grammar_end(request, token) or self._stop_reason(request, token)
            text += "" if reason == "stop" and stop == token else t.detok.add(token)
            if t.detok.stop_hit is not None:
                reason, stop = "stop", t.detok.stop_hit
            if not (stop == token and reason == "stop"):
                new_ids.append(token)
                if lp is not None:
                    new_lp.append(lp)
            if reason is not None:
                break
        if reason is not None:
            text += t.detok.flush(final=True)
            self._finish(t, reason)
        else:
            self.kv.cache_full_blocks(request)  # accepted drafts may have filled blocks
        out = self._output(t, new_ids, text, new_lp, reason, stop)
        if request.prompt_logprobs is not None and not t.prompt_logprobs_sent:
            out.prompt_logprobs, t.prompt_logprobs_sent = request.prompt_logprobs, True
        return out

    def _grammar_end(self, r: Request, token: int) -> tuple[str, int | None] | None:
        """Advance the sequence's grammar by `token`: ("stop", token) when the token is the EOS that ends it,
        ("stop", None) when the grammar is complete and only EOS could follow, None to go on."""
        g = r.grammar
        if g is None:
            return None
        if not g.accept(token):
            # The sampler masks every row with its grammar, so this means a NaN logit or a bug: end the
            # sequence rather than emit output that does not match.
            logger.error("%s: token %d does not match the request's grammar; sequence aborted", r.request_id, token)
            return "abort", None
        if g.finished:
            return "stop", (token if token in self.loaded.eos_token_ids else None)
        return None

    def _stop_reason(self, r: Request, token: int) -> tuple[str | None, str | int | None]:
        if token in r.sampling.stop_token_ids and r.num_output_tokens > r.sampling.min_tokens:
            return "stop", token
        if r.num_output_tokens >= r.max_new_tokens or r.num_tokens >= r.max_total_tokens:
            return "length", None
        return None, None

    def _finish(self, t: _Tracked, reason: str) -> None:
        r = t.request
        self.scheduler.finish(r, RequestStatus(reason))
        if self.proposer is not None:
            self.proposer.forget(r)
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
        p = r.prediction
        return SequenceOutput(r.parent_id, r.index, new_ids, text, r.num_prompt_tokens, num_out,
                              finished=reason is not None, finish_reason=reason, stop_reason=stop,
                              new_logprobs=logprobs, times=times,
                              prediction_tokens=None if p is None else (p.accepted, p.rejected),
                              num_cached_tokens=r.num_cached_prompt_tokens)

    # --- validation and parameters -------------------------------------------------------

    @staticmethod
    def _load_draft(loaded: LoadedModel, config: EngineConfig) -> LoadedModel | None:
        if config.speculative_method != "draft_model":
            return None
        draft = load_model(config.speculative_model, dataclasses.replace(config, hf_overrides=None))  # (the target's)
        if draft.hf_config.vocab_size != loaded.hf_config.vocab_size:
            raise InvalidRequestError(
                f"the draft model {config.speculative_model!r} has a vocabulary of {draft.hf_config.vocab_size} "
                f"tokens and the target {loaded.hf_config.vocab_size}: speculative decoding needs the same "
                "tokenizer", param="speculative_model")
        return draft

    def _prediction_ids(self, gen: GenerationConfig) -> list[int] | None:
        """GenerationConfig.prediction as token ids: text is tokenized as the output would be (no special tokens)."""
        if gen.prediction is None:
            return None
        if isinstance(gen.prediction, str):
            return self.tokenizer.encode(gen.prediction, add_special_tokens=False)
        vocab = self.loaded.hf_config.vocab_size
        bad = next((t for t in gen.prediction if t >= vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"prediction: token id {bad} is out of range: this model's ids are 0 to "
                                      f"{vocab - 1}", param="prediction")
        return gen.prediction

    def _validate_ids(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidRequestError("the prompt is empty: give at least one token", param="prompt")
        vocab = self.loaded.hf_config.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad!r} is not in the vocabulary [0, {vocab})", param="prompt")

    def _validate_prompt(self, ids: list[int], gen: GenerationConfig) -> None:
        self._validate_ids(ids)
        vocab = self.loaded.hf_config.vocab_size
        bad_bias = next((t for t in (gen.logit_bias or {}) if not 0 <= t < vocab), None)
        if bad_bias is not None:
            raise InvalidRequestError(f"logit_bias token id {bad_bias} is not in the vocabulary [0, {vocab})",
                                      param="logit_bias")
        if len(ids) + gen.max_new_tokens > self.session_len:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens and max_new_tokens is {gen.max_new_tokens}: together "
                f"{len(ids) + gen.max_new_tokens}, over the session length of {self.session_len} tokens; "
                "shorten the prompt or lower max_new_tokens", param="max_new_tokens")

    def validate_image_count(self, count: int) -> None:
        """Whether a prompt may carry `count` images here (checked before they are fetched, and again when added)."""
        if count and not self.loaded.takes_images:
            raise InvalidRequestError(f"the model {self.loaded.served_name!r} takes text only, and the prompt has "
                                      f"{count} image(s)", param="messages")
        if count > self.config.limit_mm_per_prompt:
            raise InvalidRequestError(f"the prompt has {count} images, over the limit of "
                                      f"{self.config.limit_mm_per_prompt} per prompt (limit_mm_per_prompt)",
                                      param="messages")

    def _validate_images(self, prompt: list[int], mm: MultiModalInputs | None) -> None:
        if mm is None:
            return
        self.validate_image_count(mm.num_images)
        for item in mm.images:
            if item.positions and (item.positions[0] < 0 or item.positions[-1] >= len(prompt)):
                raise InvalidRequestError("an image's placeholder positions fall outside the prompt",
                                          param="messages")

    @staticmethod
    def _validate_session(session_id: str | None, gen: GenerationConfig) -> None:
        if session_id is None:
            return
        if not isinstance(session_id, str) or not 0 < len(session_id) <= MAX_SESSION_ID_CHARS:
            got = (f"a {len(session_id)}-character string" if isinstance(session_id, str) and session_id
                   else repr(session_id))
            raise InvalidRequestError(f"session_id: expected a non-empty string of at most {MAX_SESSION_ID_CHARS} "
                                      f"characters, got {got}", param="session_id")
        if not gen.single_sequence:
            raise InvalidRequestError("session_id: a session continues one sequence; it cannot be combined with "
                                      "n > 1, best_of or beam search", param="session_id")

    def _sampling_params(self, gen: GenerationConfig) -> SamplingParams:
        stop_ids = set(gen.stop_token_ids or [])
        if not gen.ignore_eos:
            stop_ids.update(self.loaded.eos_token_ids)
        return SamplingParams(
            temperature=float(gen.temperature), top_k=gen.top_k, top_p=float(gen.top_p), min_p=float(gen.min_p),
            typical_p=float(gen.typical_p), watermark=gen.watermark,
            repetition_penalty=float(gen.repetition_penalty), presence_penalty=float(gen.presence_penalty),
            frequency_penalty=float(gen.frequency_penalty), logit_bias=gen.logit_bias,
            bad_words_ids=self._bad_words_ids(gen.bad_words or []), min_tokens=gen.min_new_tokens,
            stop_token_ids=frozenset(stop_ids), seed=gen.random_seed, logprobs=gen.logprobs,
            prompt_logprobs=gen.prompt_logprobs)

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

    def _grammar_state(self, compiled: object | None) -> GrammarState | None:
        if compiled is None:
            return None
        return GrammarState(compiled, self.loaded.eos_token_ids, self.loaded.hf_config.vocab_size)

    def _generator(self, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None:
            return None
        return torch.Generator(device=self.runner.device).manual_seed(params.seed)
