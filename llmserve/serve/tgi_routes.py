"""TGI-compatible routes: POST /generate, POST /generate_stream, POST / (either, by `stream`; the
non-streamed answer wrapped in a list, as TGI's compat route does), GET /info.

TGI's semantics, not ours, where they differ:
- raw text in `inputs`, tokenized with the tokenizer's special tokens (no chat template);
- `max_new_tokens` left out is 100, sent as null is "as many as fit";
- greedy unless `do_sample` or a sampling knob (temperature != 1, top_k, top_p < 1, typical_p < 1) is set, and
  unset knobs are neutral (the model's generation_config is not applied);
- a sampled request without `seed` gets a random one, reported in `details.seed`;
- stop sequences stay in the generated text; finish reasons are `length`, `eos_token`,
  `stop_sequence`; the EOS token is the last entry of `details.tokens` (special, logprob null:
  the engine does not keep the logprob of the token that stopped it) and counts in
  `generated_tokens`;
- `grammar` (`{"type": "json" | "regex" | "json_schema", "value": ...}`) constrains the output
  (structured_params.py);
- `decoder_input_details` lists the prompt tokens with their logprobs (the first one null), computed in
  the same prefill (the prompt is then computed in full: no prefix-cache reuse);
- `adapter_id` names a LoRA adapter the server loaded (--adapters NAME=PATH, or /v1/load_lora_adapter), or the
  base model;
- `typical_p` in (0, 1) is locally typical sampling, after temperature, top_k and top_p, as TGI's warpers run;
- `best_of` > 1 (up to MAX_BEST_OF; sampling, no `seed`, no streaming, as TGI checks) samples that many sequences of
  the prompt, computed once, and returns the one with the highest total log-probability of its generated tokens;
  with `details`, the others in `details.best_of_sequences`, each with its own seed;
- `watermark` biases each step's green list as TGI does (sampling/batch.py: WATERMARK_GAMMA, WATERMARK_DELTA from the
  environment, TGI's names), greedy requests too;
- any parameter TGI does not document is refused with 400;
- a vision-language model takes images as markdown in `inputs`, `![](https://...)` or `![](data:image/...)`,
  each where it stands (TGI's router reads them so); for a text-only model such markdown is plain text, as in TGI.
  The images are counted before any is fetched and loaded on a worker thread (vl/prompt.py).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

import llmserve
from llmserve.config import GenerationConfig
from llmserve.engine.output import SequenceOutput
from llmserve.errors import InvalidRequestError
from llmserve.serve.errors import ApiError, TgiError, error_responses
from llmserve.serve.generation import EngineRequest, new_request_id, open_request
from llmserve.serve.protocol import unknown_fields
from llmserve.serve.state import ServedModel, ServerState
from llmserve.serve.streaming import MAY_STREAM, REQUEST_ID_HEADER, SSEResponse, sse_event, until_disconnected
from llmserve.serve.structured_params import tgi_structured_output
from llmserve.serve.tgi_protocol import TGI_DEFAULT_MAX_NEW_TOKENS, TgiParameters, TgiRequest
from llmserve.vl.messages import markdown_images
from llmserve.vl.prompt import ImagePrompt, raw_with_images

router = APIRouter(responses=error_responses(TgiError))
# best_of's bound (TGI's --max-best-of, whose default is 2): each is a sequence in the engine, the prompt shared
MAX_BEST_OF = 16
PARAM_NAMES = {"max_new_tokens": "max_new_tokens", "random_seed": "seed", "stop_words": "stop",
               "logprobs": "top_n_tokens"}


@router.post("/generate")
async def generate(body: TgiRequest, request: Request) -> Response:
    return await _generate(body, request, stream=False, full_text_default=False, as_list=False)


@router.post("/generate_stream", responses=MAY_STREAM)
async def generate_stream(body: TgiRequest, request: Request) -> Response:
    return await _generate(body, request, stream=True, full_text_default=False, as_list=False)


@router.post("/", responses=MAY_STREAM)
async def compat_generate(body: TgiRequest, request: Request) -> Response:
    # TGI's compat route returns the prompt with the answer unless told otherwise (text-generation models).
    return await _generate(body, request, stream=body.stream, full_text_default=True, as_list=True)


@router.get("/info")
async def info(request: Request) -> JSONResponse:
    state: ServerState = request.app.state.llm
    _, model = state.ready()
    return JSONResponse({
        "model_id": model.name, "model_sha": None, "model_dtype": model.dtype, "model_device_type": model.device,
        "model_pipeline_tag": "image-text-to-text" if model.takes_images else "text-generation",
        "input_modalities": model.input_modalities, "max_concurrent_requests": state.config.max_concurrent_requests,
        "max_best_of": MAX_BEST_OF, "max_stop_sequences": None, "max_input_tokens": model.session_len - 1,
        "max_input_length": model.session_len - 1, "max_total_tokens": model.session_len,
        "max_batch_total_tokens": model.kv_tokens, "max_batch_size": model.max_batch_size,
        "max_client_batch_size": 1, "validation_workers": 0, "router": "llmserve",
        "version": llmserve.__version__, "sha": None, "docker_label": None,
    })


async def _generate(body: TgiRequest, request: Request, stream: bool, full_text_default: bool,
                    as_list: bool) -> Response:
    state: ServerState = request.app.state.llm
    engine, model = state.ready()
    with state.admit() as permit:
        _refuse_unsupported(body, stream)  # (before any image is fetched)
        prompt = await until_disconnected(request, _prompt(state, model, body.inputs))
        job = _job(model, body, prompt)
        outputs = await until_disconnected(request, open_request(state, engine, job.req))
        full_text = body.parameters.return_full_text
        reply = _TgiReply(model, job, body.inputs if (full_text_default if full_text is None else full_text) else "")
        if stream:
            return SSEResponse(reply.stream(outputs), on_close=permit.hand_over(), request_id=job.req.request_id,
                               source=outputs)
        answer = await until_disconnected(request, reply.collect(outputs))
        return JSONResponse([answer] if as_list else answer, headers=reply.headers())


@dataclass
class _Job:
    req: EngineRequest
    params: TgiParameters
    seed: int | None


async def _prompt(state: ServerState, model: ServedModel, inputs: str) -> ImagePrompt:
    """`inputs` tokenized with the tokenizer's special tokens; for a vision-language model, with its markdown images
    (counted first, then loaded and processed on a worker thread)."""
    pieces, urls = markdown_images(inputs) if model.takes_images else ([inputs], [])
    if not urls:
        return ImagePrompt(inputs, model.tokenizer.encode(inputs), None)
    try:
        model.check_image_count(len(urls))
        text = _with_special_tokens(model.tokenizer, model.processor.image_token.join(pieces))
        params = [f"inputs: image {k} (of {len(urls)})" for k in range(len(urls))]
        return await asyncio.to_thread(raw_with_images, text, urls, model.processor, state.image_limits, params)
    except InvalidRequestError as e:
        raise ApiError.from_invalid(e, {"messages": "inputs"}) from None


def _with_special_tokens(tokenizer: Any, text: str) -> str:
    """`text` with the special tokens the tokenizer adds around a text (BOS for Llama's), written as text: the
    processor tokenizes without adding them, and a prompt with images must start as the same text alone would."""
    bare = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a")
    start = next((k for k in range(len(full) - len(bare) + 1) if full[k:k + len(bare)] == bare), 0)
    prefix, suffix = full[:start], full[start + len(bare):]
    return "".join(tokenizer.convert_ids_to_tokens(prefix)) + text + "".join(tokenizer.convert_ids_to_tokens(suffix))


def _job(model: ServedModel, body: TgiRequest, prompt: ImagePrompt) -> _Job:
    p = body.parameters
    ids = prompt.token_ids
    if p.truncate is not None:
        if p.truncate < 1:
            raise ApiError(400, "`truncate` must be strictly positive", param="truncate")
        if prompt.mm is not None and p.truncate < len(ids):
            raise ApiError(400, f"`truncate`: the inputs have {len(ids)} tokens with their images' placeholders, "
                                f"and cutting them to {p.truncate} would cut the images off; raise `truncate` or "
                                "leave it out", param="truncate")
        ids = ids[-p.truncate:]
    if len(ids) >= model.session_len:
        raise ApiError(400, f"`inputs` must have less than {model.session_len} tokens. Given: {len(ids)}",
                       param="inputs")
    max_new = _max_new_tokens(model, p, len(ids))
    if max_new >= 1 and len(ids) + max_new > model.session_len:
        raise ApiError(400, f"`inputs` tokens + `max_new_tokens` must be <= {model.session_len}. Given: "
                            f"{len(ids)} `inputs` tokens and {max_new} `max_new_tokens`", param="max_new_tokens")
    sampling = _sampling(p)
    best_of = p.best_of or 1
    # a seed for each of best_of sequences: seed, seed + 1, ... (the engine's n), within 63 bits
    seed = p.seed if p.seed is not None else (secrets.randbits(62) if sampling else None)
    try:
        gen = GenerationConfig(
            max_new_tokens=max_new, temperature=(1.0 if p.temperature is None else p.temperature) if sampling else 0.0,
            top_k=p.top_k or 0, top_p=1.0 if p.top_p is None else p.top_p,
            typical_p=1.0 if p.typical_p is None else p.typical_p, watermark=p.watermark,
            repetition_penalty=1.0 if p.repetition_penalty is None else p.repetition_penalty,
            frequency_penalty=p.frequency_penalty or 0.0, stop_words=p.stop or None, include_stop_str_in_output=True,
            n=best_of, random_seed=seed, logprobs=p.top_n_tokens or 0, response_format=tgi_structured_output(p.grammar),
            prompt_logprobs=0 if p.decoder_input_details and p.details else None)
    except InvalidRequestError as e:
        raise ApiError.from_invalid(e, PARAM_NAMES) from None
    try:
        adapter = model.adapter_of(p.adapter_id)
    except ApiError as e:
        raise ApiError(400, f"`adapter_id`: {e.message}", param="adapter_id") from None
    return _Job(EngineRequest(new_request_id("generate"), ids, gen, PARAM_NAMES, mm=prompt.mm, adapter=adapter), p,
                seed)


def _max_new_tokens(model: ServedModel, p: TgiParameters, num_inputs: int) -> int:
    # As TGI 2: left out, 100; sent as null, whatever fits (in the context and in the KV pool).
    if "max_new_tokens" not in p.model_fields_set:
        return TGI_DEFAULT_MAX_NEW_TOKENS
    if p.max_new_tokens is None:
        return max(1, min(model.session_len, model.kv_tokens) - num_inputs)
    return p.max_new_tokens


def _sampling(p: TgiParameters) -> bool:
    """Whether TGI samples: do_sample, or any knob that changes the distribution."""
    return (p.do_sample or (p.temperature is not None and p.temperature != 1.0) or bool(p.top_k)
            or (p.top_p is not None and p.top_p < 1.0) or (p.typical_p is not None and p.typical_p < 1.0))


def _refuse_unsupported(body: TgiRequest, stream: bool) -> None:
    if not body.inputs:
        raise ApiError(400, "`inputs` cannot be empty", param="inputs")
    unknown = unknown_fields(body)
    if unknown:
        raise ApiError(400, f"`{unknown[0]}`: unknown parameter; refused rather than ignored", param=unknown[0])
    p = body.parameters
    best_of = 1 if p.best_of is None else p.best_of
    refusals = [
        (not 0 < best_of <= MAX_BEST_OF, "best_of", f"must be > 0 and <= {MAX_BEST_OF}. Given: {best_of}"),
        (best_of > 1 and p.seed is not None, "seed", "must not be set when `best_of` > 1"),
        (best_of > 1 and not _sampling(p), "best_of", "you must use sampling when `best_of` is > 1"),
        (best_of > 1 and stream, "best_of", "!= 1 is not supported when streaming tokens"),
        (stream and p.decoder_input_details, "decoder_input_details",
         "`decoder_input_details` == true is not supported when streaming tokens"),
    ]
    for refused, param, message in refusals:
        if refused:
            raise ApiError(400, f"`{param}`: {message}", param=param)


class _Sequence:
    """One generated sequence of a reply as TGI reports it: its tokens (with the made-up EOS one) and top tokens."""

    def __init__(self, tt: Any) -> None:
        self.tt = tt
        self.tokens: list[dict[str, Any]] = []
        self.top_tokens: list[list[dict[str, Any]]] = []
        self.text = ""
        self.last: SequenceOutput | None = None
        self.logprob = 0.0  # of its generated tokens, best_of's ranking

    def add(self, out: SequenceOutput) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
        """Record one output; its tokens as (token, top tokens) pairs (the EOS one made up)."""
        self.text += out.new_text
        self.last = out
        new = []
        for i, (tid, lp) in enumerate(zip(out.new_token_ids, out.new_logprobs or [None] * len(out.new_token_ids))):
            text = out.new_text if i == len(out.new_token_ids) - 1 else ""
            top = [self._token(t, v, self.tt.text(t)) for t, v in lp.top] if lp is not None else []
            new.append((self._token(tid, lp.logprob if lp else None, text), top))
            self.logprob += lp.logprob if lp is not None else 0.0
        if out.finished and out.finish_reason == "stop" and isinstance(out.stop_reason, int):
            new.append((self._token(out.stop_reason, None, self.tt.text(out.stop_reason)), []))
        for token, top in new:
            self.tokens.append(token)
            self.top_tokens.append(top)
        return new

    def _token(self, token_id: int, logprob: float | None, text: str) -> dict[str, Any]:
        return {"id": token_id, "text": text, "logprob": logprob, "special": self.tt.is_special(token_id)}

    def finish_reason(self) -> str:
        out = self.last
        if out is None or out.finish_reason == "abort":
            raise ApiError(503, "the request was aborted before it finished (the server is shutting down)")
        if out.finish_reason == "length":
            return "length"
        return "stop_sequence" if isinstance(out.stop_reason, str) else "eos_token"


class _TgiReply:
    def __init__(self, model: ServedModel, job: _Job, prefix: str) -> None:
        self.model, self.job, self.prefix = model, job, prefix
        self.tt = model.token_text
        self.seqs: dict[int, _Sequence] = {}  # by the engine's index: best_of's samples, else one
        self.best = 0  # the index collect() returns
        self.prompt_logprobs: list | None = None  # with the first output, when decoder_input_details asked

    def _seq(self, index: int) -> _Sequence:
        if index not in self.seqs:
            self.seqs[index] = _Sequence(self.tt)
        return self.seqs[index]

    @property
    def first(self) -> _Sequence:
        return self._seq(0)

    def _add(self, out: SequenceOutput) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
        self.prompt_logprobs = self.prompt_logprobs or out.prompt_logprobs
        return self._seq(out.index).add(out)

    def _seed(self, index: int) -> int | None:
        return None if self.job.seed is None else self.job.seed + index  # the engine's seed of sample `index`

    def _details(self, index: int = 0) -> dict[str, Any]:
        seq = self._seq(index)
        return {"finish_reason": seq.finish_reason(), "generated_tokens": len(seq.tokens), "seed": self._seed(index)}

    async def collect(self, outputs: AsyncIterator[SequenceOutput]) -> dict[str, Any]:
        async with aclosing(outputs):
            async for out in outputs:
                self._add(out)
        p = self.job.params
        # best_of: the sample with the highest total logprob of its generated tokens (the lower index on a tie; an EOS
        # that ended one is not counted, as OpenAI's best_of ranks: the engine keeps no logprob for it)
        best = self.best = min(range(max(1, len(self.seqs))), key=lambda i: (-self._seq(i).logprob, i))
        answer: dict[str, Any] = {"generated_text": self.prefix + self._seq(best).text}
        details = self._details(best)  # raises for an aborted request
        if p.details:
            lps = self.prompt_logprobs or [None] * len(self.job.req.prompt_token_ids)
            prefill = [{"id": t, "text": self.tt.text(t), "logprob": lp.logprob if lp is not None else None}
                       for t, lp in zip(self.job.req.prompt_token_ids, lps)]
            prefill = prefill if p.decoder_input_details else []

            def sequence(i: int) -> dict[str, Any]:
                seq = self._seq(i)
                return {**self._details(i), "prefill": prefill, "tokens": seq.tokens,
                        "top_tokens": seq.top_tokens if p.top_n_tokens else None}

            others = [{"generated_text": self.prefix + self._seq(i).text, **sequence(i)}
                      for i in sorted(self.seqs) if i != best]
            answer["details"] = {**details, **sequence(best), "best_of_sequences": others if others else None}
        return answer

    async def stream(self, outputs: AsyncIterator[SequenceOutput]) -> AsyncIterator[str]:
        """One event per token; the last one also carries generated_text and details (TGI's shape)."""
        try:
            async with aclosing(outputs):
                async for out in outputs:
                    new = self._add(out)
                    seq = self.first
                    if out.finish_reason == "abort":
                        raise ApiError(503, "the request was aborted before it finished (the server is shutting "
                                            "down)")
                    for k, (token, top) in enumerate(new):
                        last = out.finished and k == len(new) - 1
                        yield sse_event({
                            "index": len(seq.tokens) - len(new) + k + 1, "token": token,
                            "top_tokens": top if self.job.params.top_n_tokens else None,
                            "generated_text": self.prefix + seq.text if last else None,
                            "details": {**self._details(), "input_length": len(self.job.req.prompt_token_ids)}
                            if last else None}, sep="")
        except ApiError as e:
            yield sse_event({"error": e.message, "error_type": "incomplete_generation" if e.status == 503
                             else "generation"}, sep="")

    def headers(self) -> dict[str, str]:
        seq = self._seq(self.best)
        t = seq.last.times if seq.last is not None else None
        h = {REQUEST_ID_HEADER: self.job.req.request_id, "x-prompt-tokens": str(len(self.job.req.prompt_token_ids)),
             "x-generated-tokens": str(len(seq.tokens)), "x-compute-type": self.model.device}
        if t is not None:
            h["x-total-time"] = str(round((t.finished - t.arrival) * 1000))
            if t.first_scheduled is not None:
                h["x-queue-time"] = str(round((t.first_scheduled - t.arrival) * 1000))
                h["x-inference-time"] = str(round((t.finished - t.first_scheduled) * 1000))
        return h
