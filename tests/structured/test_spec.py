"""What each API's spelling of a constraint becomes, and what is refused before anything compiles."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from llmserve import GenerationConfig, InvalidRequestError
from llmserve.structured import spec
from llmserve.structured.spec import StructuredOutput, parse_response_format

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["a"]}


def test_response_format_shapes():
    assert parse_response_format(None) is None
    assert parse_response_format({"type": "text"}) is None
    assert parse_response_format({"type": "json_object"}) == StructuredOutput("json", "")
    js = parse_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}})
    assert js.kind == "json" and json.loads(js.source) == SCHEMA
    # the schema's key order is kept (properties are generated in it), so the same text compiles once
    assert list(json.loads(js.source)["properties"]) == ["b", "a"]
    assert spec.json_schema(json.loads(json.dumps(SCHEMA)), "p").key == js.key
    reordered = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}
    assert spec.json_schema(reordered, "p").key != spec.json_schema({**reordered, "properties": {
        "b": {"type": "integer"}, "a": {"type": "string"}}}, "p").key
    assert parse_response_format({"type": "regex_schema", "regex_schema": "a+"}) == StructuredOutput("regex", "a+")
    assert parse_response_format({"type": "regex", "regex": "a+"}) == StructuredOutput("regex", "a+")
    assert parse_response_format({"type": "choice", "choice": ["x", "y"]}).choices == ["x", "y"]
    assert parse_response_format({"type": "grammar", "grammar": 'root ::= "a"'}).kind == "grammar"


def test_pydantic_model_and_json_string_schema():
    class Person(BaseModel):
        name: str
        age: int

    got = parse_response_format(Person)
    assert got.kind == "json" and json.loads(got.source)["required"] == ["name", "age"]
    assert spec.json_schema(json.dumps(SCHEMA), "guided_json").key == spec.json_schema(SCHEMA, "x").key


def test_legacy_structural_tag_becomes_the_format_shape():
    legacy = {"type": "structural_tag", "triggers": ["<f="],
              "structures": [{"begin": "<f=a>", "schema": SCHEMA, "end": "</f>"}]}
    got = json.loads(parse_response_format(legacy).source)
    assert got["format"]["type"] == "triggered_tags" and got["format"]["triggers"] == ["<f="]
    assert got["format"]["tags"][0]["content"] == {"type": "json_schema", "json_schema": SCHEMA}


@pytest.mark.parametrize("value, words", [
    ("json", "expected an object"),
    ({"type": "xml"}, "must be text, json_object"),
    ({"type": "json_schema"}, "json_schema: expected an object"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema: missing"),
    ({"type": "json_schema", "json_schema": {"schema": "{not json"}}, "not valid JSON"),
    ({"type": "json_schema", "json_schema": {"schema": [1]}}, "must be an object"),
    ({"type": "json_schema", "json_schema": {"schema": False}}, "matches no output"),
    ({"type": "regex_schema", "regex_schema": ""}, "non-empty regular expression"),
    ({"type": "choice", "choice": []}, "non-empty list"),
    ({"type": "choice", "choice": ["a", 1]}, "non-empty list"),
    ({"type": "grammar", "grammar": "  "}, "EBNF grammar"),
    ({"type": "structural_tag"}, "`format` object"),
])
def test_malformed_is_refused_naming_the_field(value, words):
    with pytest.raises(InvalidRequestError, match=words) as e:
        parse_response_format(value)
    assert e.value.param == "response_format"


def test_size_limits():
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}
    with pytest.raises(InvalidRequestError, match="over the limit of 65536"):
        spec.json_schema(big, "guided_json")
    with pytest.raises(InvalidRequestError, match="at most 1024 choices"):
        spec.choice([str(i) for i in range(1025)], "guided_choice")


def test_generation_config_normalizes_and_refuses_beam_search():
    gen = GenerationConfig(response_format={"type": "json_object"})
    assert gen.response_format == StructuredOutput("json", "")
    assert gen.replace(temperature=0).response_format == gen.response_format  # survives replace
    with pytest.raises(InvalidRequestError, match="not supported with beam search") as e:
        GenerationConfig(response_format={"type": "json_object"}, use_beam_search=True, beam_width=2)
    assert e.value.param == "response_format"
