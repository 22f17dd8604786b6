"""TGI request bodies (POST /generate, /generate_stream and /), as TGI's router names the fields.

Strict types as in protocol.py; every parameter TGI documents is declared (tgi_routes.py honours or refuses
each), and an unknown one that carries a value is refused (protocol.unknown_fields). TGI's `text_generation`
client sends every parameter, None where unset, so None must always mean "not set".
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from llmserve.serve.protocol import BODY_SCHEMA_EXTRA, NON_EMPTY

TGI_DEFAULT_MAX_NEW_TOKENS = 100  # TGI 2.x's default


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", json_schema_extra=BODY_SCHEMA_EXTRA)


class TgiParameters(_Body):
    do_sample: bool = False
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: list[str] = Field(default_factory=list)
    seed: int | None = None
    truncate: int | None = None
    return_full_text: bool | None = None
    details: bool = False
    decoder_input_details: bool = False
    top_n_tokens: int | None = None
    best_of: int | None = None
    watermark: bool = False
    grammar: dict[str, Any] | None = None
    adapter_id: str | None = None


class TgiRequest(_Body):
    inputs: str = NON_EMPTY
    parameters: TgiParameters = Field(default_factory=TgiParameters)
    stream: bool = False  # POST / only
