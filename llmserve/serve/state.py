"""What the routes share: the model being served, the async engine (absent while loading), the
concurrency limit and the requests in flight (so shutdown can abort them).

Everything here is touched on the event loop only, except `attach`, which the loading thread may
call once (a plain attribute store).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from llmserve.chat_template import ChatTemplate, model_chat_template
from llmserve.config import ChatTemplateConfig, GenerationConfig
from llmserve.engine.async_engine import AsyncEngine
from llmserve.engine.llm_engine import LLMEngine
from llmserve.errors import InvalidRequestError
from llmserve.serve.config import ServerConfig
from llmserve.serve.errors import ApiError
from llmserve.serve.metrics import ServerMetrics
from llmserve.serve.response_store import ResponseStore
from llmserve.serve.token_text import TokenText
from llmserve.serve.tracing import RequestTracer
from llmserve.tools import ReasoningParser, ToolParser, resolve_tool_parser, tool_parser
from llmserve.tools.reasoning import reasoning_parser as named_reasoning_parser
from llmserve.vl.image import MAX_IMAGE_PIXELS, ImageLimits


@dataclass
class ServedModel:
    name: str  # what clients put in `model`
    tokenizer: Any  # transformers PreTrainedTokenizerBase; encode/decode are safe off the engine thread
    chat_template: ChatTemplate
    defaults: GenerationConfig  # GenerationConfig() with the model's generation_config.json over it
    session_len: int  # max prompt + output tokens of one sequence
    eos_token_ids: frozenset[int]
    max_batch_size: int
    kv_tokens: int  # KV pool capacity in tokens
    dtype: str
    device: str
    created: int  # unix seconds, for /v1/models
    token_text: TokenText  # single-token text/bytes, cached (logprobs, TGI details)
    # How the model writes tool calls; None when its template takes tools in a format llmserve cannot tell and no
    # --tool-call-parser names one (requests with tools are then refused, saying so).
    tool_parser: ToolParser | None = None
    reasoning: ReasoningParser | None = None  # --reasoning-parser: <think> split off every chat answer
    # Vision-language models: the processor (vl.processor.VLProcessor; None for a text-only model), the engine's
    # check of a prompt's image count (InvalidRequestError; it reads only the config, so any thread may call it)
    # and EngineConfig.max_image_pixels.
    processor: Any = None
    check_image_count: Callable[[int], None] | None = None
    max_image_pixels: int = MAX_IMAGE_PIXELS
    # LoRA adapters clients may name as their model: the engine's live registry (name -> lora.LoRAAdapter; changed
    # only on the engine thread, read here for names), or None when the engine serves no adapters.
    adapters: dict[str, Any] | None = None

    def adapter_of(self, requested: str | None) -> str | None:
        """The adapter a request's `model` names (None: the base model; ApiError 404 for an unknown name)."""
        if requested is None or requested == self.name:
            return None
        if self.adapters is not None and requested in self.adapters:
            return requested
        served = ", ".join(f"`{n}`" for n in [self.name, *(self.adapters or ())])
        raise ApiError(404, f"The model `{requested}` does not exist. This server serves {served}.",
                       param="model", code="model_not_found")

    @property
    def takes_images(self) -> bool:
        return self.processor is not None

    @property
    def input_modalities(self) -> list[str]:
        """What /v1/models and /info report the model takes."""
        return ["text", "image"] if self.takes_images else ["text"]

    @classmethod
    def of(cls, engine: LLMEngine, defaults: GenerationConfig, name: str | None = None,
           chat_template: ChatTemplateConfig | None = None, tool_call_parser: str | None = None,
           reasoning_parser: str | None = None) -> ServedModel:
        loaded = engine.loaded
        template = model_chat_template(loaded, chat_template)
        return cls(name=name or loaded.served_name, tokenizer=loaded.tokenizer,
                   chat_template=template, defaults=defaults,
                   session_len=engine.session_len, eos_token_ids=frozenset(loaded.eos_token_ids),
                   max_batch_size=engine.config.max_batch_size, kv_tokens=engine.kv.num_blocks * engine.kv.block_size,
                   dtype=str(loaded.dtype).removeprefix("torch."), device=str(loaded.device), created=int(time.time()),
                   token_text=TokenText(loaded.tokenizer), tool_parser=model_tool_parser(tool_call_parser, template),
                   reasoning=named_reasoning_parser(reasoning_parser) if reasoning_parser else None,
                   processor=loaded.processor, check_image_count=engine.validate_image_count,
                   max_image_pixels=engine.config.max_image_pixels,
                   adapters=engine.lora.adapters if engine.lora is not None else None)


def model_tool_parser(name: str | None, template: ChatTemplate) -> ToolParser | None:
    """The parser named, or the template's (see resolve_tool_parser); None where the template's format is unknown."""
    if name is not None:
        return tool_parser(name, template.template)
    try:
        return resolve_tool_parser(None, template.template)
    except InvalidRequestError:
        return None


class Permit:
    """One admitted generation request; `release` gives its slot back (idempotent)."""

    def __init__(self, state: ServerState) -> None:
        self._state = state
        self._held = True
        self.handed_over = False

    def release(self) -> None:
        if self._held:
            self._held = False
            self._state.num_active -= 1

    def hand_over(self) -> Callable[[], None]:
        """For a streamed response: the slot outlives the route; the response calls the returned
        function when it is done (see streaming.SSEResponse)."""
        self.handed_over = True
        return self.release


class ServerState:
    def __init__(self, config: ServerConfig, tracer: RequestTracer | None = None) -> None:
        self.config = config
        self.tracer = tracer  # --otlp-traces-endpoint: a span per engine request (tracing.py); None: off
        self.engine: AsyncEngine | None = None
        self.model: ServedModel | None = None
        self.metrics = ServerMetrics(lambda: self.engine.stats if self.engine is not None else None,
                                     lambda: getattr(self.engine, "replica_figures", lambda: None)())
        self.draining = False  # set on SIGINT/SIGTERM: new requests get 503
        self.num_active = 0  # admitted generation requests (HTTP), for max_concurrent_requests
        self.in_flight: set[str] = set()  # engine request ids, for aborting on shutdown
        self.responses = ResponseStore(config.responses_store_size)  # the Responses API's stored responses

    def attach(self, engine: AsyncEngine, model: ServedModel) -> None:
        self.model = model
        self.engine = engine

    @property
    def image_limits(self) -> ImageLimits:
        """What a request's images may be: no paths, file:// URLs only under --allowed-local-media-path."""
        c = self.config
        return ImageLimits(max_pixels=self.model.max_image_pixels if self.model else MAX_IMAGE_PIXELS,
                           max_bytes=c.max_image_bytes, timeout=c.image_fetch_timeout, allow_paths=False,
                           allowed_local_media_path=c.allowed_local_media_path)

    def ready(self) -> tuple[AsyncEngine, ServedModel]:
        """The engine and model, or a 503 while loading, after the engine stopped, or while shutting down."""
        if self.engine is None or self.model is None:
            raise ApiError(503, "the model is still loading; retry in a few seconds")
        if self.draining:
            raise ApiError(503, "the server is shutting down")
        if not self.engine.is_alive:
            raise ApiError(503, "the engine has stopped; restart the server")
        return self.engine, self.model

    @contextmanager
    def admit(self) -> Iterator[Permit]:
        """A slot among max_concurrent_requests (429 when none is free), released when the block exits
        unless the permit was handed over to a streamed response."""
        if self.num_active >= self.config.max_concurrent_requests:
            raise ApiError(429, f"the server is at its limit of {self.config.max_concurrent_requests} concurrent "
                                "requests; retry later", code="rate_limit_exceeded")
        self.num_active += 1
        permit = Permit(self)
        try:
            yield permit
        finally:
            if not permit.handed_over:
                permit.release()

    def abort_all(self) -> int:
        """Abort every engine request in flight (shutdown after the grace period); returns how many."""
        if self.engine is None:
            return 0
        for rid in list(self.in_flight):
            self.engine.abort(rid)
        return len(self.in_flight)
