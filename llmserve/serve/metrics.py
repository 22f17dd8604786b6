"""Prometheus metrics of one server, named as vLLM names them (`llmserve:` instead of `vllm:`), so
existing dashboards need only the prefix changed.

Every app has its own CollectorRegistry (two apps in one process, as in tests, never share counts).
Counters and histograms are updated on the event loop as outputs reach the routes; the engine gauges
(running, waiting, KV usage) are read from the async engine's stats when /metrics is scraped.
Counts are per sequence: a request with n = 2 finishes twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from llmserve.engine.async_engine import EngineStats
from llmserve.engine.output import SequenceOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
FINISH_REASONS = ("stop", "length", "abort")

# No `*_created` series (creation timestamps of every counter and histogram): noise to scrapers, as
# vLLM decides too. prometheus-client only offers this switch process-wide.
disable_created_metrics()


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats | None] = lambda: None,
                 replicas: Callable[[], list[tuple[EngineStats, bool, int, int]] | None] = lambda: None) -> None:
        self.registry = CollectorRegistry()
        r: CollectorRegistry = self.registry
        self.request_success = Counter("llmserve:request_success", "Sequences finished, by finish reason "
                                       "(stop, length, abort).", ["finished_reason"], registry=r)
        self.requests_rejected = Counter("llmserve:requests_rejected", "Requests refused before generation, by "
                                         "HTTP status (400 invalid, 429 overloaded, 503 unavailable).",
                                         ["status"], registry=r)
        self.prompt_tokens = Counter("llmserve:prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("llmserve:generation_tokens", "Tokens generated.", registry=r)
        self.ttft = Histogram("llmserve:time_to_first_token_seconds", "Arrival at the engine to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("llmserve:time_per_output_token_seconds", "Mean time between output tokens of a "
                              "sequence, after the first.", buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("llmserve:e2e_request_latency_seconds", "Arrival at the engine to the last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("llmserve:request_queue_time_seconds", "Arrival to first scheduled.",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram("llmserve:request_prompt_tokens", "Prompt length of requests.",
                                               buckets=_TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram("llmserve:request_generation_tokens", "Output length of "
                                                   "finished sequences.", buckets=_TOKEN_BUCKETS, registry=r)
        r.register(_EngineGauges(stats))
        r.register(_ReplicaGauges(replicas))
        for reason in FINISH_REASONS:  # present (at 0) from the start, so rates work from the first scrape
            self.request_success.labels(reason)

    def on_started(self, num_prompt_tokens: int) -> None:
        """A request's first output arrived: its prompt has been processed."""
        self.prompt_tokens.inc(num_prompt_tokens)
        self.request_prompt_tokens.observe(num_prompt_tokens)

    def on_output(self, out: SequenceOutput) -> None:
        if out.new_token_ids:
            self.generation_tokens.inc(len(out.new_token_ids))
        if not out.finished:
            return
        self.request_success.labels(finished_reason=out.finish_reason).inc()
        self.request_generation_tokens.observe(out.num_output_tokens)
        t = out.times
        if t is None:
            return
        self.e2e.observe(t.finished - t.arrival)
        if t.first_scheduled is not None:
            self.queue_time.observe(t.first_scheduled - t.arrival)
        if t.first_token is not None:
            self.ttft.observe(t.first_token - t.arrival)
            if out.num_output_tokens > 1:
                self.tpot.observe((t.finished - t.first_token) / (out.num_output_tokens - 1))

    def on_embedded(self, num_prompt_tokens: int) -> None:
        """An embedding request's input done: its prompt counts, its sequence finished (no output tokens, no first
        token: kept out of the latency histograms, which are generation's)."""
        self.on_started(num_prompt_tokens)
        self.request_success.labels(finished_reason="stop").inc()

    def on_abandoned(self, num_sequences: int) -> None:
        """Sequences whose client left before they finished (the engine aborted them)."""
        self.request_success.labels(finished_reason="abort").inc(num_sequences)

    def on_rejected(self, status: int) -> None:
        self.requests_rejected.labels(status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ReplicaGauges(Collector):
    """--dp: each replica's figures, labelled by its index (the unlabelled gauges are their sums)."""

    def __init__(self, replicas: Callable[[], list[tuple[EngineStats, bool, int, int]] | None]) -> None:
        self._replicas = replicas

    def collect(self) -> Iterator[GaugeMetricFamily]:
        figures = self._replicas()
        if not figures:
            return
        families = {
            "running": GaugeMetricFamily("llmserve:replica_num_requests_running", "Sequences running, per "
                                         "data-parallel replica.", labels=["replica"]),
            "waiting": GaugeMetricFamily("llmserve:replica_num_requests_waiting", "Sequences waiting, per replica.",
                                         labels=["replica"]),
            "kv": GaugeMetricFamily("llmserve:replica_kv_cache_usage_perc", "Fraction of the replica's KV blocks in "
                                    "use.", labels=["replica"]),
            "outstanding": GaugeMetricFamily("llmserve:replica_outstanding_tokens", "Prompt and max_new_tokens of "
                                             "the requests the router sent the replica and it has not finished.",
                                             labels=["replica"]),
            "up": GaugeMetricFamily("llmserve:replica_up", "1 while the replica runs, 0 while it is started again.",
                                    labels=["replica"]),
            "restarts": GaugeMetricFamily("llmserve:replica_restarts", "Times the replica was started again after "
                                          "dying.", labels=["replica"]),
            "computed": GaugeMetricFamily("llmserve:replica_prompt_tokens_computed", "Prompt tokens the replica "
                                          "computed since it started.", labels=["replica"]),
        }
        for i, (s, up, outstanding, restarts) in enumerate(figures):
            label = [str(i)]
            families["running"].add_metric(label, float(s.num_running))
            families["waiting"].add_metric(label, float(s.num_waiting))
            families["kv"].add_metric(label, s.kv_blocks_in_use / max(1, s.kv_blocks_total))
            families["outstanding"].add_metric(label, float(outstanding))
            families["up"].add_metric(label, float(up))
            families["restarts"].add_metric(label, float(restarts))
            families["computed"].add_metric(label, float(s.prefill_tokens))
        yield from families.values()


class _EngineGauges(Collector):
    """Engine state at scrape time (read from the async engine's last stats snapshot)."""

    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self._stats()
        if s is None:  # still loading
            return
        values = {
            "llmserve:num_requests_running": ("Sequences in the running batch.", s.num_running),
            "llmserve:num_requests_waiting": ("Sequences waiting to be scheduled.", s.num_waiting),
            "llmserve:kv_cache_usage_perc": ("Fraction of KV-cache blocks in use (1 = full).",
                                             s.kv_blocks_in_use / max(1, s.kv_blocks_total)),
            "llmserve:kv_cache_blocks_total": ("KV-cache blocks in the pool.", s.kv_blocks_total),
            "llmserve:prefix_cache_hit_rate": ("Fraction of looked-up prompt tokens found in the prefix cache.",
                                               s.prefix_hit_rate),
            "llmserve:num_sessions": ("Sessions keeping their KV between turns.", s.num_sessions),
            "llmserve:session_kv_blocks": ("KV-cache blocks held by idle sessions (evicted before any request "
                                           "is preempted).", s.session_blocks),
        }
        for name, (doc, value) in values.items():
            yield GaugeMetricFamily(name, doc, value=float(value))
        # Cumulative, as vLLM's prefix_cache_queries / prefix_cache_hits: rate() over them gives the
        # hit rate of any window, which the since-start gauge above cannot.
        yield CounterMetricFamily("llmserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                  value=float(s.prefix_queried_tokens))
        yield CounterMetricFamily("llmserve:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                  value=float(s.prefix_hit_tokens))
        # Prompt tokens whose K/V the engine computed, engine-wide; set against the prompt tokens served
        # it shows what hits save, but it also counts recomputation after preemption.
        yield CounterMetricFamily("llmserve:prompt_tokens_computed", "Prompt tokens whose K/V was computed "
                                  "(hits excluded; recomputation after preemption included).",
                                  value=float(s.prefill_tokens))
        yield CounterMetricFamily("llmserve:session_hit_tokens", "Prompt tokens served from a session's kept KV.",
                                  value=float(s.session_hit_tokens))
        yield CounterMetricFamily("llmserve:sessions_evicted", "Sessions evicted before they were closed (count "
                                  "bound, TTL or memory pressure); their next turn recomputes.",
                                  value=float(s.sessions_evicted))
        # Speculative decoding (vLLM's spec_decode_* names): acceptance rate = accepted / draft tokens,
        # mean tokens per verify step = emitted / drafts.
        for name, doc, value in (
                ("spec_decode_num_draft_tokens", "Draft tokens verified.", s.spec_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_accepted_tokens),
                ("spec_decode_num_drafts", "Request-steps that verified draft tokens.", s.spec_verify_steps),
                ("spec_decode_num_emitted_tokens", "Tokens emitted by verify steps (accepted + 1 each).",
                 s.spec_emitted_tokens),
                ("structured_output_grammars_compiled", "Distinct grammars (schemas, regexes, ...) compiled.",
                 s.grammars_compiled),
                ("structured_output_grammar_cache_hits", "Structured requests whose grammar was already compiled.",
                 s.grammar_cache_hits),
                ("structured_output_compile_seconds", "Time spent compiling grammars.", s.grammar_compile_seconds)):
            yield CounterMetricFamily(f"llmserve:{name}", doc, value=float(value))
        if s.max_loras:
            # vLLM's lora_requests_info: the adapters with running and waiting requests, as labels
            info = GaugeMetricFamily("llmserve:lora_requests_info", "LoRA adapters with running and waiting requests.",
                                     labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
            info.add_metric([",".join(sorted(s.lora_running)), ",".join(sorted(s.lora_waiting)), str(s.max_loras)],
                            float(time.time()))
            yield info
            running = GaugeMetricFamily("llmserve:lora_num_requests_running", "Sequences running with each LoRA "
                                        "adapter.", labels=["lora_name"])
            for name, count in sorted(s.lora_running.items()):
                running.add_metric([name], float(count))
            yield running
