"""What a request's output must match, in one normalized form, from every API's spelling of it.

`StructuredOutput` is the engine's view: a kind (json, regex, choice, grammar, structural_tag) and its
source text. The parsers below turn LMDeploy's / OpenAI's `response_format`, vLLM's `guided_*` and
`structured_outputs` fields and TGI's `grammar` into it, and refuse (InvalidRequestError naming the
field) anything malformed or too large. Whether a schema, regex or grammar *compiles* is decided by
xgrammar (structured/compiler.py); here only the shape of the request is checked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from llmserve.errors import InvalidRequestError

# Bound on a request's grammar source (schema JSON, regex, EBNF, choices joined): compiling is linear-ish
# in it, and the compiled grammar is cached, so an unbounded one is a memory and CPU lever for clients.
MAX_SOURCE_CHARS = 64 * 1024
MAX_CHOICES = 1024

KINDS = ("json", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutput:
    """kind "json": `source` is a JSON schema (JSON text), or "" for any JSON object
    (OpenAI's json_object). "regex": a regular expression the whole output matches. "choice": a JSON
    list of the allowed strings. "grammar": an EBNF grammar (xgrammar's / GBNF syntax, root rule
    `root`). "structural_tag": xgrammar's structural tag (JSON), e.g. tool calls inside free text.
    `any_whitespace`: JSON may hold any whitespace between tokens (False: the compact form only)."""

    kind: str
    source: str
    any_whitespace: bool = True
    param: str = field(default="response_format", compare=False)  # the request field it came from, for errors

    @property
    def key(self) -> tuple[str, str, bool]:
        """Identity of the compiled grammar: two requests with the same key share one compilation."""
        return (self.kind, self.source, self.any_whitespace)

    @property
    def choices(self) -> list[str]:
        assert self.kind == "choice"
        return json.loads(self.source)

    def describe(self) -> str:
        what = {"json": "JSON schema" if self.source else "JSON object", "regex": "regex", "choice": "choice",
                "grammar": "grammar", "structural_tag": "structural tag"}[self.kind]
        return what


def json_schema(schema: Any, param: str, any_whitespace: bool = True) -> StructuredOutput:
    """A JSON schema given as a dict, a JSON string, or a pydantic model class."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    if isinstance(schema, str):
        if len(schema) > MAX_SOURCE_CHARS:
            raise _too_large(param, len(schema))
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{param}: the JSON schema is not valid JSON: {e}", param=param) from None
    if isinstance(schema, bool):  # JSON Schema allows true (anything) and false (nothing)
        if not schema:
            raise InvalidRequestError(f"{param}: the schema `false` matches no output", param=param)
        return StructuredOutput("json", "", any_whitespace, param)
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{param}: a JSON schema must be an object, got {type(schema).__name__}",
                                  param=param)
    try:
        source = json.dumps(schema, ensure_ascii=False)  # key order kept: properties are generated in it
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"{param}: the JSON schema cannot be serialized: {e}", param=param) from None
    return StructuredOutput("json", _bounded(source, param), any_whitespace, param)


def any_json(param: str, any_whitespace: bool = True) -> StructuredOutput:
    return StructuredOutput("json", "", any_whitespace, param)


def regex(pattern: Any, param: str) -> StructuredOutput:
    if not isinstance(pattern, str) or not pattern:
        raise InvalidRequestError(f"{param}: expected a non-empty regular expression string, got {pattern!r}",
                                  param=param)
    return StructuredOutput("regex", _bounded(pattern, param), param=param)


def choice(choices: Any, param: str) -> StructuredOutput:
    if (not isinstance(choices, (list, tuple)) or not choices
            or not all(isinstance(c, str) and c for c in choices)):
        raise InvalidRequestError(f"{param}: expected a non-empty list of non-empty strings, got {choices!r}",
                                  param=param)
    if len(choices) > MAX_CHOICES:
        raise InvalidRequestError(f"{param}: at most {MAX_CHOICES} choices, got {len(choices)}", param=param)
    return StructuredOutput("choice", _bounded(json.dumps(list(choices), ensure_ascii=False), param), param=param)


def grammar(ebnf: Any, param: str) -> StructuredOutput:
    if not isinstance(ebnf, str) or not ebnf.strip():
        raise InvalidRequestError(f"{param}: expected an EBNF grammar string, got {ebnf!r}", param=param)
    return StructuredOutput("grammar", _bounded(ebnf, param), param=param)


def structural_tag(tag: Any, param: str) -> StructuredOutput:
    """xgrammar's structural tag, {"type": "structural_tag", "format": {...}}, or the older shape vLLM documents,
    {"structures": [{"begin", "schema", "end"}], "triggers": [...]}, turned into the first."""
    if isinstance(tag, str):
        try:
            tag = json.loads(tag)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{param}: the structural tag is not valid JSON: {e}", param=param) from None
    if isinstance(tag, dict) and "structures" in tag:
        structures, triggers = tag.get("structures"), tag.get("triggers")
        if (not isinstance(structures, list) or not isinstance(triggers, list)
                or not all(isinstance(s, dict) and {"begin", "schema", "end"} <= s.keys() for s in structures)):
            raise InvalidRequestError(f"{param}: `structures` must be a list of {{begin, schema, end}} objects and "
                                      "`triggers` a list of strings", param=param)
        tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": [
            {"type": "tag", "begin": s["begin"], "content": {"type": "json_schema", "json_schema": s["schema"]},
             "end": s["end"]} for s in structures]}}
    if not isinstance(tag, dict) or not isinstance(tag.get("format"), dict):
        raise InvalidRequestError(f"{param}: a structural tag is an object with a `format` object (or `structures` "
                                  "and `triggers`)", param=param)
    tag = {"type": "structural_tag", "format": tag["format"]}
    return StructuredOutput("structural_tag", _bounded(json.dumps(tag, ensure_ascii=False), param),
                            param=param)


def parse_response_format(value: Any, param: str = "response_format") -> StructuredOutput | None:
    """LMDeploy's and OpenAI's `response_format`, plus the kinds vLLM takes elsewhere:

        {"type": "text"}                                           -> None (unconstrained)
        {"type": "json_object"}                                    -> any JSON object
        {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
        {"type": "regex_schema", "regex_schema": "..."}            (LMDeploy) or {"type": "regex", "regex": "..."}
        {"type": "choice", "choice": [...]}, {"type": "grammar", "grammar": "EBNF"}
        {"type": "structural_tag", ...}                           (vLLM / xgrammar)

    Also a pydantic model class (its JSON schema) or an already parsed StructuredOutput."""
    if value is None or isinstance(value, StructuredOutput):
        return value
    if isinstance(value, type) and hasattr(value, "model_json_schema"):
        return json_schema(value, param)
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{param}: expected an object such as {{'type': 'json_schema', 'json_schema': "
                                  f"{{'name': ..., 'schema': {{...}}}}}}, got {type(value).__name__}", param=param)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return any_json(param)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequestError(f"{param}.json_schema: expected an object with `name` and `schema`",
                                      param=param)
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            # OpenAI requires `schema`; without one the model is only held to JSON.
            raise InvalidRequestError(f"{param}.json_schema.schema: missing", param=param)
        return json_schema(schema, param)
    if kind in ("regex_schema", "regex"):
        return regex(value.get(kind), param)
    if kind == "choice":
        return choice(value.get("choice"), param)
    if kind in ("grammar", "ebnf"):
        return grammar(value.get(kind), param)
    if kind == "structural_tag":
        return structural_tag(value, param)
    raise InvalidRequestError(f"{param}.type: must be text, json_object, json_schema, regex_schema, choice, grammar "
                              f"or structural_tag, got {kind!r}", param=param)


def _bounded(source: str, param: str) -> str:
    if len(source) > MAX_SOURCE_CHARS:
        raise _too_large(param, len(source))
    return source


def _too_large(param: str, size: int) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {size} characters, over the limit of {MAX_SOURCE_CHARS} for a schema, "
                               "regex or grammar", param=param)
