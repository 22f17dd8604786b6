"""The constraints `--structured` puts on every benchmark request (bench serving, bench throughput).

Open-ended on purpose: a bounded repetition ({0,2000}, maxLength 2000) makes xgrammar compile each position as a
state (measured: ~1 s to compile, and masks 15x dearer to fill), which is the cost of that bound, not of
structured output; `*` and `+` compile in milliseconds.

The JSON schema's free-text field and the open regex let a request run to max_tokens like an unconstrained one,
so output tokens/s compare with an unconstrained run; a choice ends after a few tokens and measures the
per-request cost (compile lookup, matcher, first mask) instead. One constraint for all requests: the engine
compiles it once, as a server answering one application's schema would.
"""

from __future__ import annotations

from typing import Any

from llmserve.structured import spec
from llmserve.structured.spec import StructuredOutput

SCHEMA: dict[str, Any] = {
    "type": "object", "properties": {
        "title": {"type": "string", "maxLength": 60},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
        "rating": {"enum": ["good", "average", "bad"]},
        "summary": {"type": "string"}},
    "required": ["title", "year", "tags", "rating", "summary"], "additionalProperties": False}
REGEX = "[A-Z][A-Za-z0-9 ,.;'-]+"
CHOICES = ["positive", "negative", "neutral"]
KINDS = ("json-schema", "regex", "choice")


def request_fields(kind: str) -> dict[str, Any]:
    """An OpenAI-compatible request's fields for the constraint (response_format, or vLLM's guided_* names)."""
    return {"json-schema": {"response_format": {"type": "json_schema",
                                                "json_schema": {"name": "record", "schema": SCHEMA}}},
            "regex": {"guided_regex": REGEX}, "choice": {"guided_choice": CHOICES}}[kind]


def response_format(kind: str) -> StructuredOutput:
    return {"json-schema": lambda: spec.json_schema(SCHEMA, "--structured"),
            "regex": lambda: spec.regex(REGEX, "--structured"),
            "choice": lambda: spec.choice(CHOICES, "--structured")}[kind]()
