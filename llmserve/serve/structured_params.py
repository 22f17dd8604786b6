"""The request fields that constrain output, as each API spells them, -> one StructuredOutput (or None).

OpenAI: `response_format` (text | json_object | json_schema). vLLM's extra fields: `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` (with `guided_decoding_backend`,
`guided_whitespace_pattern`) and the newer `structured_outputs` object. TGI: `parameters.grammar`
`{"type": "json" | "regex" | "json_schema", "value": ...}`. A request may use one of them; two that
both constrain the output are refused rather than one of them being silently dropped.
"""

from __future__ import annotations

from typing import Any

from llmserve.errors import InvalidRequestError
from llmserve.serve.errors import ApiError
from llmserve.serve.protocol import SamplingRequest, StructuredOutputsParams
from llmserve.structured import spec
from llmserve.structured.spec import StructuredOutput, parse_response_format

BACKENDS = (None, "", "auto", "xgrammar")


def openai_structured_output(req: SamplingRequest) -> StructuredOutput | None:
    try:
        found = [(name, value) for name, value in (
            ("response_format", parse_response_format(req.response_format)),
            ("guided_json", None if req.guided_json is None else spec.json_schema(req.guided_json, "guided_json")),
            ("guided_regex", None if req.guided_regex is None else spec.regex(req.guided_regex, "guided_regex")),
            ("guided_choice", None if req.guided_choice is None else spec.choice(req.guided_choice, "guided_choice")),
            ("guided_grammar", None if req.guided_grammar is None
             else spec.grammar(req.guided_grammar, "guided_grammar")),
            ("structured_outputs", None if req.structured_outputs is None
             else _structured_outputs(req.structured_outputs)),
        ) if value is not None]
    except InvalidRequestError as e:
        raise ApiError.from_invalid(e) from None
    if req.guided_decoding_backend not in BACKENDS:
        raise ApiError(400, f"guided_decoding_backend: only xgrammar is available, got {req.guided_decoding_backend!r}",
                       param="guided_decoding_backend")
    if req.guided_whitespace_pattern is not None:
        raise ApiError(400, "guided_whitespace_pattern: custom whitespace patterns are not supported (xgrammar); "
                            "use structured_outputs.disable_any_whitespace for compact JSON",
                       param="guided_whitespace_pattern")
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise ApiError(400, f"{names} both constrain the output: send one", param=found[1][0])
    return found[0][1] if found else None


def _structured_outputs(p: StructuredOutputsParams) -> StructuredOutput | None:
    param = "structured_outputs"
    if p.whitespace_pattern is not None:
        raise InvalidRequestError(f"{param}.whitespace_pattern: custom whitespace patterns are not supported "
                                  "(xgrammar); use disable_any_whitespace for compact JSON", param=param)
    kinds = [(name, value) for name, value in (
        ("json", p.json_schema), ("regex", p.regex), ("choice", p.choice), ("grammar", p.grammar),
        ("json_object", p.json_object or None), ("structural_tag", p.structural_tag)) if value is not None]
    if len(kinds) > 1:
        raise InvalidRequestError(f"{param}: give one of json, regex, choice, grammar, json_object, structural_tag; "
                                  f"got {', '.join(k for k, _ in kinds)}", param=param)
    if not kinds:
        return None
    kind, value = kinds[0]
    where = f"{param}.{kind}"
    if kind == "json":
        return spec.json_schema(value, where, not p.disable_any_whitespace)
    if kind == "json_object":
        return spec.any_json(where, not p.disable_any_whitespace)
    return {"regex": spec.regex, "choice": spec.choice, "grammar": spec.grammar,
            "structural_tag": spec.structural_tag}[kind](value, where)


def tgi_structured_output(grammar: dict[str, Any] | None) -> StructuredOutput | None:
    """TGI's `parameters.grammar`: {"type": "json", "value": schema} (TGI's own), {"type": "regex", "value":
    pattern}, or {"type": "json_schema", "value": {"name", "schema"}} (TGI 3)."""
    if grammar is None:
        return None
    kind, value = grammar.get("type"), grammar.get("value")
    try:
        if kind == "json":
            return spec.json_schema(value, "grammar")
        if kind == "regex":
            return spec.regex(value, "grammar")
        if kind == "json_schema":
            schema = value.get("schema") if isinstance(value, dict) else None
            if schema is None:
                raise InvalidRequestError("grammar.value: expected {\"name\": ..., \"schema\": {...}}", param="grammar")
            return spec.json_schema(schema, "grammar")
    except InvalidRequestError as e:
        raise ApiError(400, f"`grammar`: {str(e).removeprefix('grammar: ')}", param="grammar") from None
    raise ApiError(400, f"`grammar`: type must be json, regex or json_schema, got {kind!r}", param="grammar")
