"""Benchmark arithmetic on hand-made timings: percentiles, TPOT, ITL, TTFT, token counts, decode rate."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from llmserve.bench import structured
from llmserve.bench.latency import LatencySample, random_prompts, summarize_latency
from llmserve.bench.sampling import SamplingKnobs
from llmserve.bench.serving import (
    RequestRecord,
    ServingPlan,
    ServingRequest,
    StreamTally,
    arrival_offsets,
    request_body,
    summarize_run,
)
from llmserve.bench.stats import Summary, percentile, summarize
from tests.tiny_models import tiny_tokenizer


def test_percentile_interpolates_between_ranks_as_numpy() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5  # position 1.5 between 2 and 3
    assert percentile([4.0, 1.0, 3.0, 2.0], 0) == 1.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 100) == 4.0
    assert percentile([float(v) for v in range(101)], 99) == 99.0
    assert percentile([10.0, 20.0], 75) == 17.5
    assert percentile([7.0], 90) == 7.0
    values = [random.Random(1).random() for _ in range(37)]
    for q in (50, 90, 99):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)
    with pytest.raises(ValueError):
        percentile([], 50)


def test_summarize_scales_and_is_none_when_empty() -> None:
    assert summarize([0.25, 0.5, 0.75, 1.0, 1.5], 1000.0) == Summary(mean=800.0, p50=750.0, p90=1300.0, p99=1480.0)
    assert summarize([]) is None


def _tally(lines: list[tuple[float, str]]) -> StreamTally:
    tally = StreamTally(start=10.0)
    for now, line in lines:
        tally.add_line(now, line)
    return tally


ROLE = 'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}'


def _content(text: str) -> str:
    return "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": text}}]})


STREAM = [(10.25, ROLE), (10.25, ""), (10.5, _content("A")), (10.75, _content("B")), (10.75, ": keep-alive"),
          (11.5, _content("C")), (11.5, 'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}')]
USAGE = (11.75, 'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}}')


def test_stream_with_usage_times_content_events_and_counts_usage_tokens() -> None:
    rec = _tally([*STREAM, USAGE, (11.75, "data: [DONE]")]).record(end=12.0, prompt_tokens=3)
    # TTFT at the first content, not the role chunk; ITL between content events only.
    assert rec == RequestRecord(ok=True, prompt_tokens=7, output_tokens=4, tokens_from_usage=True, ttft_s=0.5,
                                itl_s=[0.25, 0.75], e2e_s=2.0)
    assert rec.tpot_s == 0.5  # (2.0 - 0.5) / (4 - 1)


def test_stream_without_usage_counts_content_events() -> None:
    rec = _tally([*STREAM, (11.75, "data: [DONE]")]).record(end=12.0, prompt_tokens=3)
    assert (rec.ok, rec.prompt_tokens, rec.output_tokens, rec.tokens_from_usage) == (True, 3, 3, False)
    assert rec.tpot_s == 0.75  # (2.0 - 0.5) / (3 - 1)


def test_completions_text_events_count_and_events_after_done_are_ignored() -> None:
    lines = [(10.5, 'data: {"choices": [{"index": 0, "text": "x"}]}'),
             (10.5, 'data: {"choices": [{"index": 0, "text": ""}]}'),
             (11.0, 'data: {"choices": [{"index": 0, "text": "y"}]}'),
             (11.0, "data: [DONE]"), (11.25, 'data: {"choices": [{"index": 0, "text": "z"}]}')]
    rec = _tally(lines).record(end=11.5, prompt_tokens=2)
    assert (rec.output_tokens, rec.ttft_s, rec.itl_s, rec.e2e_s) == (2, 0.5, [0.5], 1.5)


def test_error_event_or_malformed_event_fails_the_request() -> None:
    err = _tally([(10.5, _content("A")), (10.75, 'data: {"error": {"message": "oom"}}')]).record(11.0, 3)
    assert (err.ok, err.error, err.e2e_s) == (False, 'error event: {"message": "oom"}', 1.0)
    bad = _tally([(10.5, "data: {not json")]).record(11.0, 3)
    assert (bad.ok, bad.error) == (False, "malformed event: {not json")


def test_tpot_needs_two_tokens_and_a_first_token() -> None:
    assert RequestRecord(ok=True, output_tokens=1, ttft_s=0.5, e2e_s=0.5).tpot_s is None
    assert RequestRecord(ok=True, output_tokens=0, e2e_s=0.5).tpot_s is None


def test_run_summary_over_hand_made_records() -> None:
    records = [
        RequestRecord(ok=True, prompt_tokens=10, output_tokens=5, tokens_from_usage=True, ttft_s=0.5,
                      itl_s=[0.25, 0.25], e2e_s=1.5),
        RequestRecord(ok=False, e2e_s=0.125, error="HTTP 500: first"),
        RequestRecord(ok=True, prompt_tokens=20, output_tokens=3, tokens_from_usage=True, ttft_s=0.25,
                      itl_s=[0.5], e2e_s=1.25),
        RequestRecord(ok=False, e2e_s=0.125, error="HTTP 500: second"),
    ]
    plan = ServingPlan(base_url="http://h:1", model="m", concurrency=2)
    r = summarize_run(records, duration_s=2.0, plan=plan)
    assert (r.num_requests, r.completed, r.failed, r.first_error) == (4, 2, 2, "HTTP 500: first")
    assert (r.prompt_tokens, r.output_tokens, r.output_tokens_source) == (30, 8, "usage")
    assert (r.request_throughput, r.output_throughput, r.total_token_throughput) == (1.0, 4.0, 19.0)
    assert r.ttft_ms == Summary(mean=375.0, p50=375.0, p90=475.0, p99=497.5)
    assert r.tpot_ms == Summary(mean=375.0, p50=375.0, p90=475.0, p99=497.5)  # 0.25 and 0.5 s
    assert r.itl_ms == summarize([0.25, 0.25, 0.5], 1000.0)
    assert r.e2e_ms == Summary(mean=1375.0, p50=1375.0, p90=1475.0, p99=1497.5)
    mixed = summarize_run([records[0], RequestRecord(ok=True, output_tokens=2, ttft_s=0.5, e2e_s=1.0)], 1.0, plan)
    assert mixed.output_tokens_source == "mixed"
    none = summarize_run([records[1]], 1.0, plan)
    assert (none.output_tokens_source, none.ttft_ms, none.request_throughput) == ("none", None, 0.0)


def test_request_body_for_each_endpoint() -> None:
    req = ServingRequest(prompt="hi there", prompt_tokens=5, output_len=7)
    chat = request_body(ServingPlan(base_url="http://h:1/v1/", model="m", ignore_eos=True), req)
    assert chat == {"model": "m", "max_tokens": 7, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": "hi there"}],
                    "ignore_eos": True}
    plan = ServingPlan(base_url="http://h:1/v1/", model="m", endpoint="completions")
    assert request_body(plan, req) == {"model": "m", "max_tokens": 7, "temperature": 0.0, "stream": True,
                                       "stream_options": {"include_usage": True}, "prompt": "hi there"}
    assert plan.url == "http://h:1/v1/completions"
    knobs = SamplingKnobs(temperature=0.7, top_p=0.9, top_k=20, repetition_penalty=1.1)
    sampled = request_body(ServingPlan(base_url="http://h:1", model="m", sampling=knobs), req)
    assert {k: sampled[k] for k in ("temperature", "top_p", "top_k", "repetition_penalty")} == {
        "temperature": 0.7, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}
    assert "min_p" not in sampled  # knobs left at their neutral values are not sent
    constrained = request_body(ServingPlan(base_url="http://h:1", model="m", structured="regex"), req)
    assert constrained["guided_regex"] == structured.REGEX


def test_arrival_offsets_are_poisson_and_seeded() -> None:
    assert arrival_offsets(3, None, 0) == [0.0, 0.0, 0.0]
    rng = random.Random(5)
    gaps = [rng.expovariate(4.0) for _ in range(3)]
    assert arrival_offsets(4, 4.0, 5) == [0.0, gaps[0], gaps[0] + gaps[1], gaps[0] + gaps[1] + gaps[2]]
    assert arrival_offsets(4, 4.0, 6) != arrival_offsets(4, 4.0, 5)


def test_latency_decode_rate_and_summary() -> None:
    samples = [LatencySample(ttft_s=0.5, e2e_s=2.5, output_tokens=9), LatencySample(0.25, 1.25, 5),
               LatencySample(0.25, 0.25, 1)]
    assert [s.decode_tokens_per_s for s in samples] == [4.0, 4.0, None]  # 8 tokens in 2 s; 4 in 1 s
    ttft, decode, e2e = summarize_latency(samples)
    assert (ttft.mean, ttft.p50, decode.mean, e2e.p50) == (1000 / 3, 250.0, 4.0, 1250.0)


def test_random_prompts_have_exact_length_distinct_firsts_and_no_special_ids() -> None:
    tok = tiny_tokenizer()
    prompts = random_prompts(tok, 6, 12)
    assert [len(p) for p in prompts] == [12] * 6
    assert len({p[0] for p in prompts}) == 6
    assert not {t for p in prompts for t in p} & set(tok.all_special_ids)
    assert random_prompts(tok, 6, 12) == prompts
