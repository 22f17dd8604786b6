"""OpenAI-compatible routes: GET /v1/models, POST /v1/chat/completions, POST /v1/completions.
Both generation routes take `session_id` as an extra body field (see session_routes.py). Chat takes images
(image_url parts) for a vision-language model; /v1/models says which inputs the model takes (`input_modalities`).

Each generation route: check the model name, take a concurrency slot (429), build the prompt and
the GenerationConfig (400), open the engine request(s) (first output received, so a refusal is
still a 400), then stream SSE chunks or collect the whole answer. The slot is held until the last
chunk is sent. Completions with several prompts run them as separate engine requests, batched
together by the engine; choice i*n + j is sample j of prompt i (as vLLM numbers them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from llmserve.engine.output import SequenceOutput
from llmserve.sampling.logprobs import TokenLogprobs
from llmserve.serve.chat_tools import ChatOutput, ChoiceOutput, chat_output, chat_tool_request
from llmserve.serve.errors import ApiError, OpenAIError, error_body, error_responses
from llmserve.serve.generation import EngineRequest, Primed, new_request_id, open_request
from llmserve.serve.openai_format import (
    Choice,
    CompletionLogprobs,
    chat_logprobs,
    merge_completion_logprobs,
    usage,
    vllm_prompt_logprobs,
)
from llmserve.serve.openai_params import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    PARAM_NAMES,
    chat_generation_config,
    chat_prompt,
    check_model,
    check_prompt_length,
    completion_generation_config,
    completion_prompts,
    legacy_functions,
    session_id_of,
)
from llmserve.serve.protocol import ChatCompletionRequest, CompletionRequest, StreamOptions
from llmserve.serve.state import ServedModel, ServerState
from llmserve.serve.streaming import (
    MAY_STREAM,
    REQUEST_ID_HEADER,
    SSEResponse,
    merge,
    sse_event,
    until_disconnected,
)

router = APIRouter(responses=error_responses(OpenAIError))
DONE = "data: [DONE]\n\n"


def _state(request: Request) -> ServerState:
    return request.app.state.llm


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    _, model = _state(request).ready()
    card = {"id": model.name, "object": "model", "created": model.created, "owned_by": "llmserve",
            "root": model.name, "parent": None, "max_model_len": model.session_len,
            "input_modalities": model.input_modalities}
    # LoRA adapters as vLLM lists them: their own id, the adapter's path as root, the base model as parent
    cards = [card] + [{**card, "id": name, "root": adapter.path, "parent": model.name}
                      for name, adapter in list((model.adapters or {}).items())]
    return JSONResponse({"object": "list", "data": cards})


@router.post("/v1/chat/completions", responses=MAY_STREAM)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = _state(request)
    engine, model = state.ready()
    adapter = check_model(model, body.model)
    with state.admit() as permit:
        legacy = legacy_functions(body)
        tools = chat_tool_request(model, body)
        prompt = await until_disconnected(request, chat_prompt(model, body, tools, state.image_limits))
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = check_prompt_length(model, len(prompt.token_ids), requested, "messages")
        output = chat_output(model, tools, prompt.text)
        if legacy:
            output = dataclasses.replace(output, legacy=True)
        gen = chat_generation_config(model, body, max_tokens, output)
        req = EngineRequest(new_request_id("chatcmpl"), prompt.token_ids, gen,
                            {**PARAM_NAMES, "logprobs": "top_logprobs"}, session_id=session_id_of(body), mm=prompt.mm,
                            adapter=adapter)
        outputs = await until_disconnected(request, open_request(state, engine, req))
        reply = _ChatReply(model, req, body, output)
        if body.stream:
            return SSEResponse(reply.stream(outputs), on_close=permit.hand_over(), request_id=req.request_id,
                               source=outputs)
        return JSONResponse(await until_disconnected(request, reply.collect(outputs)),
                            headers={REQUEST_ID_HEADER: req.request_id})


class _ChatReply:
    """Each choice's text goes through its own ChoiceOutput (reasoning and tool calls split off, chat_tools.py)."""

    def __init__(self, model: ServedModel, req: EngineRequest, body: ChatCompletionRequest,
                 output: ChatOutput) -> None:
        self.model, self.req, self.body = model, req, body
        self.created = int(time.time())
        self.outputs = [ChoiceOutput(output) for _ in range(req.gen.n)]

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.req.request_id, "object": obj, "created": self.created,
                "model": self.req.adapter or self.model.name}

    def _logprobs(self, out: SequenceOutput) -> dict[str, Any] | None:
        return chat_logprobs(self.model.token_text, out.new_logprobs) if self.body.logprobs else None

    async def collect(self, outputs: AsyncIterator[SequenceOutput]) -> dict[str, Any]:
        choices = [Choice(i) for i in range(self.req.gen.n)]
        prompt_lps = None
        async with aclosing(outputs):
            async for out in outputs:
                choices[out.index].add(out)
                prompt_lps = prompt_lps or out.prompt_logprobs
        reply = {**self._envelope("chat.completion"), "choices": [
            {"index": c.index, "message": self.outputs[c.index].message(c.text),
             "logprobs": chat_logprobs(self.model.token_text, c.logprobs) if self.body.logprobs else None,
             "finish_reason": self.outputs[c.index].finish_reason(c.finish_reason), "stop_reason": c.stop_reason}
            for c in choices],
            "usage": usage(len(self.req.prompt_token_ids), sum(c.num_tokens for c in choices),
                           self._prediction([c.prediction for c in choices]), max(c.cached for c in choices))}
        if self.body.prompt_logprobs is not None:  # vLLM puts them beside the choices
            reply["prompt_logprobs"] = vllm_prompt_logprobs(self.model.token_text, prompt_lps or [])
        return reply

    def _prediction(self, counts: list[tuple[int, int] | None]) -> tuple[int, int] | None:
        """The choices' (accepted, rejected) prediction tokens summed, where the request sent a prediction."""
        if self.body.prediction is None:
            return None
        return sum(c[0] for c in counts if c), sum(c[1] for c in counts if c)

    async def stream(self, outputs: AsyncIterator[SequenceOutput]) -> AsyncIterator[str]:
        head = self._envelope("chat.completion.chunk")
        include_usage, continuous = usage_options(self.body.stream_options)
        tokens: dict[int, int] = {}
        predicted: dict[int, tuple[int, int] | None] = {}
        cached = [0]  # the prompt is computed once for all the choices: by the first sequence started
        if include_usage:
            head["usage"] = None

        def so_far() -> dict[str, Any]:  # vLLM's continuous_usage_stats: the usage so far in every chunk
            return {"usage": usage(len(self.req.prompt_token_ids), sum(tokens.values()),
                                   self._prediction(list(predicted.values())), cached[0])} if continuous else {}

        for i in range(self.req.gen.n):
            yield sse_event({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}], **so_far()})
        try:
            async with aclosing(outputs):
                async for out in outputs:
                    tokens[out.index] = out.num_output_tokens
                    predicted[out.index] = out.prediction_tokens
                    cached[0] = max(cached[0], out.num_cached_tokens)
                    choice_output = self.outputs[out.index]
                    delta = choice_output.delta(out.new_text, out.finished)
                    if not (delta or out.finished or (out.new_logprobs and self.body.logprobs)):
                        continue
                    choice = {"index": out.index, "delta": delta, "logprobs": self._logprobs(out),
                              "finish_reason": choice_output.finish_reason(out.finish_reason)}
                    if out.finished:
                        choice["stop_reason"] = out.stop_reason
                    yield sse_event({**head, "choices": [choice], **so_far()})
        except ApiError as e:
            yield sse_event(error_body("/v1/", e.status, e.message, e.param, e.code))
        if include_usage:
            yield sse_event({**head, "choices": [], "usage": usage(len(self.req.prompt_token_ids),
                                                                   sum(tokens.values()),
                                                                   self._prediction(list(predicted.values())),
                                                                   cached[0])})
        yield DONE


@router.post("/v1/completions", responses=MAY_STREAM)
async def completions(body: CompletionRequest, request: Request) -> Response:
    state = _state(request)
    engine, model = state.ready()
    adapter = check_model(model, body.model)
    with state.admit() as permit:
        prompts = completion_prompts(model, body.prompt)
        max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        prompt_only = max_tokens == 0 and body.echo  # the prompt (and its logprobs) only, as vLLM answers it
        max_tokens = 1 if prompt_only else max_tokens
        for prompt in prompts:
            check_prompt_length(model, len(prompt.token_ids), max_tokens, "prompt")
        gen = completion_generation_config(model, body, max_tokens)
        session_id = session_id_of(body, len(prompts))
        rid = new_request_id("cmpl")
        reqs = [EngineRequest(f"{rid}-{i}" if len(prompts) > 1 else rid, p.token_ids, gen, PARAM_NAMES,
                              session_id=session_id, adapter=adapter)
                for i, p in enumerate(prompts)]
        streams = await until_disconnected(request, _open_all(state, reqs))
        echoes = [p.echo(model.tokenizer) if body.echo else "" for p in prompts]
        reply = _CompletionReply(model, rid, reqs, echoes, body, prompt_only)
        merged = _Merged(streams)
        if body.stream:
            return SSEResponse(reply.stream(merged), on_close=permit.hand_over(), request_id=rid, source=merged)
        return JSONResponse(await until_disconnected(request, reply.collect(merged)),
                            headers={REQUEST_ID_HEADER: rid})


async def _open_all(state: ServerState, reqs: list[EngineRequest]) -> list[Primed]:
    """Open every prompt's request (they run batched); if one is refused or the wait is cancelled
    (client gone), close the ones already open, which aborts them."""
    engine, _ = state.ready()
    tasks = [asyncio.ensure_future(open_request(state, engine, r)) for r in reqs]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for t in tasks:
            if not t.cancelled() and t.exception() is None:
                await t.result().aclose()  # type: ignore[attr-defined]
        raise


class _Merged:
    """merge() of the prompts' streams; `aclose()` also closes streams a never-started merge holds."""

    def __init__(self, streams: list[Primed]) -> None:
        self._streams = streams
        self._merged = merge(streams)  # type: ignore[arg-type]

    def __aiter__(self) -> _Merged:
        return self

    async def __anext__(self) -> tuple[int, SequenceOutput]:
        return await self._merged.__anext__()

    async def aclose(self) -> None:
        await self._merged.aclose()  # type: ignore[attr-defined]
        for s in self._streams:
            await s.aclose()


class _CompletionReply:
    """Choice i*n + j is sample j of prompt i. Echo puts the prompt before the text (and, with logprobs, the prompt
    tokens' logprobs, which come with each choice's first output); `prompt_only` (max_tokens 0 with echo) answers
    the prompt and its logprobs alone: the engine's one sampled token is dropped."""

    def __init__(self, model: ServedModel, rid: str, reqs: list[EngineRequest], echoes: list[str],
                 body: CompletionRequest, prompt_only: bool = False) -> None:
        self.model, self.rid, self.reqs, self.body = model, rid, reqs, body
        self.n = body.n
        self.prompt_only = prompt_only
        self.created = int(time.time())
        self.choices = [Choice(p * self.n + j, prefix=echoes[p]) for p in range(len(reqs)) for j in range(self.n)]
        self.offsets = [CompletionLogprobs(model.token_text, len(c.prefix)) for c in self.choices]
        self.started: set[int] = set()  # choices whose first output (with the prompt's logprobs) has come

    def _prompt_fields(self, i: int, out: SequenceOutput) -> dict[str, Any]:
        """What a choice says about its prompt, from its first output: the echoed prompt's logprobs, and vLLM's
        `prompt_logprobs` when asked."""
        fields: dict[str, Any] = {}
        lps = out.prompt_logprobs or [None] * out.num_prompt_tokens
        if self.body.echo and self.body.logprobs is not None:
            lps_top = [lp if lp is None else _top(lp, self.body.logprobs) for lp in lps]
            fields["logprobs"] = CompletionLogprobs(self.model.token_text).prompt(
                self.reqs[i // self.n].prompt_token_ids, lps_top)
        if self.body.prompt_logprobs is not None:
            fields["prompt_logprobs"] = vllm_prompt_logprobs(
                self.model.token_text, [lp if lp is None else _top(lp, self.body.prompt_logprobs) for lp in lps])
        return fields

    def _generated(self, out: SequenceOutput) -> SequenceOutput:
        """The output as the client sees it: without the sampled token when only the prompt was asked for."""
        if not self.prompt_only:
            return out
        return dataclasses.replace(out, new_token_ids=[], new_text="", num_output_tokens=0, new_logprobs=[],
                                   finish_reason="length" if out.finished else None, stop_reason=None)

    def _envelope(self) -> dict[str, Any]:
        return {"id": self.rid, "object": "text_completion", "created": self.created,
                "model": self.reqs[0].adapter or self.model.name}

    def _usage(self) -> dict[str, Any]:
        return usage(sum(len(r.prompt_token_ids) for r in self.reqs), sum(c.num_tokens for c in self.choices),
                     cached_tokens=sum(max(c.cached for c in self.choices[p:p + self.n])  # each prompt's, once
                                       for p in range(0, len(self.choices), self.n)))

    async def collect(self, merged: AsyncIterator[tuple[int, SequenceOutput]]) -> dict[str, Any]:
        lps: list[dict[str, Any] | None] = [None] * len(self.choices)
        prompt_info: list[dict[str, Any]] = [{} for _ in self.choices]
        async with aclosing(merged):
            async for p, raw in merged:
                i = p * self.n + raw.index
                if i not in self.started:
                    self.started.add(i)
                    prompt_info[i] = self._prompt_fields(i, raw)
                    lps[i] = prompt_info[i].pop("logprobs", None)
                out = self._generated(raw)
                self.choices[i].add(out)
                if self.body.logprobs is not None:
                    lps[i] = merge_completion_logprobs(lps[i], self.offsets[i].generated(out.new_logprobs))
        return {**self._envelope(), "choices": [
            {"index": c.index, "text": c.prefix + c.text, "logprobs": lp, "finish_reason": c.finish_reason,
             "stop_reason": c.stop_reason, **info} for c, lp, info in zip(self.choices, lps, prompt_info)],
            "usage": self._usage()}

    async def stream(self, merged: AsyncIterator[tuple[int, SequenceOutput]]) -> AsyncIterator[str]:
        head = self._envelope()
        include_usage, continuous = usage_options(self.body.stream_options)
        so_far = (lambda: {"usage": self._usage()}) if continuous else dict  # vLLM's continuous_usage_stats
        try:
            async with aclosing(merged):
                async for p, raw in merged:
                    i = p * self.n + raw.index
                    if i not in self.started:  # the echo (and the prompt's logprobs) first
                        self.started.add(i)
                        info = self._prompt_fields(i, raw)
                        if self.body.echo or info:
                            yield sse_event({**head, "choices": [{"index": i, "text": self.choices[i].prefix,
                                                                  "finish_reason": None, "logprobs": None, **info}],
                                             **so_far()})
                    out = self._generated(raw)
                    self.choices[i].num_tokens = out.num_output_tokens
                    self.choices[i].cached = out.num_cached_tokens
                    if not (out.new_text or out.finished or (out.new_logprobs and self.body.logprobs is not None)):
                        continue
                    lp = self.offsets[i].generated(out.new_logprobs) if self.body.logprobs is not None else None
                    choice = {"index": i, "text": out.new_text, "logprobs": lp, "finish_reason": out.finish_reason}
                    if out.finished:
                        choice["stop_reason"] = out.stop_reason
                    yield sse_event({**head, "choices": [choice], **so_far()})
        except ApiError as e:
            yield sse_event(error_body("/v1/", e.status, e.message, e.param, e.code))
        if include_usage:
            yield sse_event({**head, "choices": [], "usage": self._usage()})
        yield DONE


def usage_options(options: StreamOptions | None) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats): the second only with the first, as vLLM reads them."""
    include = options is not None and options.include_usage
    return include, include and options.continuous_usage_stats


def _top(lp: TokenLogprobs, n: int) -> TokenLogprobs:
    return lp if len(lp.top) <= n else dataclasses.replace(lp, top=lp.top[:n])
