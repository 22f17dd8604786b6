"""Online serving benchmark against any OpenAI-compatible server, measured as vLLM's
benchmark_serving.py measures it: streaming clients, per request TTFT, ITL, TPOT and end-to-end
latency, and throughput over the whole run.

Definitions (all from the client's clock, seconds; reported in ms):
- TTFT: request sent -> first event carrying content (a role-only first chunk does not count).
- ITL: each gap between consecutive events carrying content (one event may carry several tokens).
- TPOT: (e2e - TTFT) / (output tokens - 1), for requests with at least two output tokens.
- e2e: request sent -> end of the stream.
Output tokens come from the final `usage` when the server sends it (we ask with
`stream_options.include_usage`), else from the count of content events; the result says which.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from llmserve.bench import structured
from llmserve.bench.datasets import BenchRequest
from llmserve.bench.sampling import SamplingKnobs
from llmserve.bench.stats import Summary, summarize
from llmserve.errors import InvalidRequestError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
_ERROR_CHARS = 300  # of a failed response's body kept in the error message


@dataclass(frozen=True)
class ServingRequest:
    prompt: str  # the user message (chat endpoint) or the whole prompt text (completions endpoint)
    prompt_tokens: int  # by the benchmark's tokenizer; the server's usage replaces it when given
    output_len: int


@dataclass(frozen=True)
class ServingPlan:
    base_url: str  # scheme://host:port, with or without a trailing /v1
    model: str
    endpoint: str = "chat"  # a key of ENDPOINTS
    concurrency: int | None = None  # most requests in flight; None: no limit
    request_rate: float | None = None  # requests/s with Poisson arrivals; None: all sent at once
    ignore_eos: bool = False
    api_key: str | None = None
    seed: int = 0  # of the arrival times
    timeout_s: float = 600.0  # per connect/read, not per request
    sampling: SamplingKnobs = SamplingKnobs()  # greedy
    structured: str | None = None  # bench/structured.py KINDS: every request carries that constraint

    @property
    def url(self) -> str:
        return api_root(self.base_url) + ENDPOINTS[self.endpoint]


@dataclass
class RequestRecord:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    tokens_from_usage: bool = False
    ttft_s: float | None = None  # None when no content came
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


class StreamTally:
    """Reads one response's server-sent events as they arrive and turns them into a RequestRecord."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.last_content: float | None = None
        self.ttft_s: float | None = None
        self.itl_s: list[float] = []
        self.content_events = 0
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None
        self.done = False

    def add_line(self, now: float, line: str) -> None:
        """One line of the SSE stream, received at `now`; blank, comment and non-data lines are skipped."""
        if not line.startswith("data:") or self.done:
            return
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            self.done = True
            return
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            self.error = self.error or f"malformed event: {data[:_ERROR_CHARS]}"
            return
        self.add_event(now, event)

    def add_event(self, now: float, event: dict[str, Any]) -> None:
        if event.get("error"):
            self.error = self.error or f"error event: {json.dumps(event['error'])[:_ERROR_CHARS]}"
            return
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        if _content(event):
            if self.last_content is None:
                self.ttft_s = now - self.start
            else:
                self.itl_s.append(now - self.last_content)
            self.last_content = now
            self.content_events += 1

    def record(self, end: float, prompt_tokens: int) -> RequestRecord:
        if self.error is not None:
            return RequestRecord(ok=False, e2e_s=end - self.start, error=self.error)
        usage = self.usage or {}
        completion = usage.get("completion_tokens")
        from_usage = isinstance(completion, int)
        return RequestRecord(
            ok=True, prompt_tokens=usage.get("prompt_tokens") or prompt_tokens,
            output_tokens=completion if from_usage else self.content_events, tokens_from_usage=from_usage,
            ttft_s=self.ttft_s, itl_s=self.itl_s, e2e_s=end - self.start)


def _content(event: dict[str, Any]) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return delta.get("content") or ""
    return choice.get("text") or ""


@dataclass
class ServingResult:
    endpoint: str
    model: str
    num_requests: int
    completed: int
    failed: int
    first_error: str | None
    concurrency: int | None
    request_rate: float | None
    duration_s: float
    prompt_tokens: int  # of completed requests
    output_tokens: int
    output_tokens_source: str  # 'usage', 'content events', 'mixed' or 'none'
    sampling: str  # SamplingKnobs.describe()
    request_throughput: float  # completed requests/s
    output_throughput: float  # tokens/s
    total_token_throughput: float  # (prompt + output) tokens/s
    ttft_ms: Summary | None
    tpot_ms: Summary | None
    itl_ms: Summary | None
    e2e_ms: Summary | None
    structured: str | None = None  # the --structured constraint every request carried

    def as_dict(self) -> dict:
        return asdict(self)


def summarize_run(records: list[RequestRecord], duration_s: float, plan: ServingPlan) -> ServingResult:
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    sources = {r.tokens_from_usage for r in ok}
    source = {frozenset(): "none", frozenset({True}): "usage", frozenset({False}): "content events"}.get(
        frozenset(sources), "mixed")
    per_s = 1 / duration_s if duration_s > 0 else 0.0
    return ServingResult(
        endpoint=plan.endpoint, model=plan.model, num_requests=len(records), completed=len(ok),
        failed=len(failed), first_error=failed[0].error if failed else None, concurrency=plan.concurrency,
        request_rate=plan.request_rate, duration_s=duration_s, prompt_tokens=prompt_tokens,
        sampling=plan.sampling.describe(),
        output_tokens=output_tokens, output_tokens_source=source, request_throughput=len(ok) * per_s,
        output_throughput=output_tokens * per_s, total_token_throughput=(prompt_tokens + output_tokens) * per_s,
        ttft_ms=summarize([r.ttft_s for r in ok if r.ttft_s is not None], 1000.0),
        tpot_ms=summarize([r.tpot_s for r in ok if r.tpot_s is not None], 1000.0),
        itl_ms=summarize([gap for r in ok for gap in r.itl_s], 1000.0),
        e2e_ms=summarize([r.e2e_s for r in ok], 1000.0), structured=plan.structured)


# --- sending -------------------------------------------------------------------------------


def request_body(plan: ServingPlan, req: ServingRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"model": plan.model, "max_tokens": req.output_len, **plan.sampling.request_fields(),
                            "stream": True, "stream_options": {"include_usage": True}}
    if plan.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if plan.ignore_eos:
        body["ignore_eos"] = True  # not OpenAI's: an extra field that vLLM, SGLang and we accept
    if plan.structured is not None:
        body.update(structured.request_fields(plan.structured))
    return body


def arrival_offsets(num: int, request_rate: float | None, seed: int) -> list[float]:
    """Send times in seconds from the start: a Poisson process of `request_rate` (exponential gaps,
    the first request at 0), or all at 0 when the rate is None."""
    if request_rate is None:
        return [0.0] * num
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(num):
        offsets.append(t)
        t += rng.expovariate(request_rate)
    return offsets


async def run_serving(plan: ServingPlan, requests: list[ServingRequest]) -> ServingResult:
    import httpx

    offsets = arrival_offsets(len(requests), plan.request_rate, plan.seed)
    gate = asyncio.Semaphore(plan.concurrency) if plan.concurrency else None
    # As many connections as requests in flight: a request waiting for a pooled connection would
    # count the wait as TTFT.
    in_flight = plan.concurrency or len(requests)
    limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
    async with httpx.AsyncClient(timeout=httpx.Timeout(plan.timeout_s), limits=limits,
                                 headers=_headers(plan.api_key)) as client:
        start = time.perf_counter()
        tasks = []
        for req, offset in zip(requests, offsets):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_gated(gate, client, plan, req)))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize_run(list(records), duration, plan)


async def _gated(gate: asyncio.Semaphore | None, client: Any, plan: ServingPlan,
                 req: ServingRequest) -> RequestRecord:
    if gate is None:
        return await send_request(client, plan, req)
    async with gate:
        return await send_request(client, plan, req)


async def send_request(client: Any, plan: ServingPlan, req: ServingRequest) -> RequestRecord:
    """One streaming request on `client` (an httpx.AsyncClient); every failure becomes a failed record."""
    import httpx

    start = time.perf_counter()
    tally = StreamTally(start)
    try:
        async with client.stream("POST", plan.url, json=request_body(plan, req)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                return RequestRecord(ok=False, e2e_s=time.perf_counter() - start,
                                     error=f"HTTP {resp.status_code}: {body[:_ERROR_CHARS]}")
            async for line in resp.aiter_lines():
                tally.add_line(time.perf_counter(), line)
    except httpx.HTTPError as e:
        return RequestRecord(ok=False, e2e_s=time.perf_counter() - start,
                             error=f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
    return tally.record(time.perf_counter(), req.prompt_tokens)


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def api_root(base_url: str) -> str:
    """'http://h:p', 'http://h:p/' and 'http://h:p/v1' all name the same server."""
    return base_url.rstrip("/").removesuffix("/v1")


# --- setting up ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ServedModel:
    name: str
    max_model_len: int | None  # when the server says (vLLM and we do)


def first_served_model(base_url: str, api_key: str | None, timeout_s: float = 30.0) -> ServedModel:
    """The first model of GET /v1/models."""
    import httpx

    url = api_root(base_url) + "/v1/models"
    try:
        resp = httpx.get(url, headers=_headers(api_key), timeout=timeout_s)
        resp.raise_for_status()
        first = resp.json()["data"][0]
        return ServedModel(str(first["id"]), first.get("max_model_len"))
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise InvalidRequestError(f"cannot read the served model from {url} ({type(e).__name__}: {e}); "
                                  "check --base-url or name the model with --model") from None


def load_bench_tokenizer(spec: str | None) -> PreTrainedTokenizerBase:
    """Only the tokenizer of `spec` (as `llmserve` names models; None: the embedded model), never
    the weights: the model runs in the server."""
    from llmserve.config import EngineConfig
    from llmserve.models.loader import load_tokenizer, locate_model

    if spec is None or os.path.exists(os.path.expanduser(spec)):
        return load_tokenizer(locate_model(spec, EngineConfig()).model_dir)
    return load_tokenizer(spec)  # a hub id: AutoTokenizer fetches the tokenizer files only


def serving_requests(bench: list[BenchRequest], tokenizer: PreTrainedTokenizerBase,
                     endpoint: str) -> list[ServingRequest]:
    """The chat endpoint gets the user message (the server applies its template); the completions
    endpoint gets our templated prompt as text, so both send about the same prompt tokens."""
    if endpoint == "chat":
        return [ServingRequest(r.prompt_text, len(r.prompt_token_ids), r.output_len) for r in bench]
    return [ServingRequest(tokenizer.decode(r.prompt_token_ids), len(r.prompt_token_ids), r.output_len)
            for r in bench]


def format_serving(r: ServingResult) -> str:
    load = (f"concurrency {r.concurrency}" if r.concurrency else "no concurrency limit") + ", " + (
        f"Poisson arrivals at {r.request_rate:g} req/s" if r.request_rate else "all requests ready at the start")
    lines = [
        f"serving: {r.num_requests} requests to {r.model} ({ENDPOINTS[r.endpoint]}), {load}; {r.sampling}"
        + (f"; every output constrained ({r.structured})" if r.structured else ""),
        f"completed {r.completed}, failed {r.failed} in {r.duration_s:.2f} s",
    ]
    if r.first_error:
        lines.append(f"first error: {r.first_error}")
    lines += [
        f"prompt tokens {r.prompt_tokens}, output tokens {r.output_tokens} (counted from: {r.output_tokens_source})",
        f"request throughput {r.request_throughput:.2f} req/s, output {r.output_throughput:.1f} tokens/s, "
        f"total {r.total_token_throughput:.1f} tokens/s",
        f"{'(ms)':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for name, s in (("TTFT", r.ttft_ms), ("TPOT", r.tpot_ms), ("ITL", r.itl_ms), ("E2E", r.e2e_ms)):
        cells = [f"{v:>10.2f}" for v in (s.mean, s.p50, s.p90, s.p99)] if s else [f"{'-':>10}"] * 4
        lines.append(f"{name:<12}{''.join(cells)}")
    return "\n".join(lines)
