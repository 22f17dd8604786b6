"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters loaded and unloaded while the server runs
(vLLM's routes and bodies; their success answers are vLLM's plain-text lines).

The adapter is read and checked on a worker thread (reading its file never holds up a step), then registered on
the engine thread between steps. From then on clients name it as their `model`; /v1/models lists it. Unloading
takes it from the registry: requests already running with it finish with it. The server loads whatever
directory the request names on its own disk: protect these routes (--api-keys) where clients are not trusted.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from llmserve.errors import InvalidRequestError
from llmserve.serve.errors import ApiError, OpenAIError, error_responses
from llmserve.serve.state import ServerState

router = APIRouter(responses=error_responses(OpenAIError))
# vLLM answers success with a line of text; errors are OpenAI's JSON (so no response_class here: it would document
# the errors as text too)
_SUCCESS = {200: {"description": "Done", "content": {"text/plain": {"schema": {"type": "string"}}}}}


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False  # vLLM's: replace an adapter already loaded under this name


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's; the name alone says which adapter here


def _lora_engine(request: Request):  # noqa: ANN202 - (AsyncEngine, ServedModel)
    state: ServerState = request.app.state.llm
    engine, model = state.ready()
    if engine.engine.lora is None:
        raise ApiError(400, "LoRA adapters are not enabled on this server: start it with --enable-lora (or "
                            "--adapters NAME=PATH ...)", param="lora_name")
    return engine, model


@router.post("/v1/load_lora_adapter", responses=_SUCCESS)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    engine, model = _lora_engine(request)
    name = body.lora_name
    if name == model.name:
        raise ApiError(400, f"lora_name: {name!r} is the base model's name", param="lora_name")
    manager = engine.engine.lora
    if name in manager.adapters and not body.load_inplace:
        raise ApiError(400, f"The LoRA adapter {name!r} has already been loaded (unload it first, or send "
                            "load_inplace: true to replace it)", param="lora_name")
    try:
        adapter = await asyncio.to_thread(manager.read, name, body.lora_path)

        def register(e) -> None:  # noqa: ANN001 - on the engine thread
            if body.load_inplace and name in e.lora.adapters:
                e.lora.unload(name)
            e.lora.add(adapter)

        await engine.call(register)
    except InvalidRequestError as e:
        raise ApiError.from_invalid(e) from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter", responses=_SUCCESS)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    engine, _ = _lora_engine(request)
    try:
        await engine.call(lambda e: e.unload_adapter(body.lora_name))
    except InvalidRequestError as e:
        raise ApiError(404, str(e), param="lora_name", code="model_not_found") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
