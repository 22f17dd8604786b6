"""Structured output through the real server on the embedded SmolLM2, with the official `openai` and TGI
`text-generation` clients: every constrained output parses and validates against its schema (greedy and sampled,
alone and 32 concurrent beside unconstrained requests, whose answers stay what they are alone), regex and choice
outputs match, and every malformed constraint is a 400 that leaves the engine serving."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.harness import EngineHandle, RunningServer, engine_for, running_server

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:The `dict` method is deprecated:DeprecationWarning")]
text_generation = pytest.importorskip("text_generation", reason="TGI's client is missing: run scripts/setup.sh")
MODEL = "SmolLM2-135M-Instruct.Q4_1"

SCHEMAS = {
    "person": ({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False},
        "Describe a person named Alice who is 30 as JSON."),
    "nested": ({"type": "object", "properties": {
        "city": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                                  "country": {"type": "string", "maxLength": 30}},
                 "required": ["name", "country"]},
        "population": {"type": "integer", "minimum": 0, "maximum": 100_000_000}}, "required": ["city", "population"]},
        "Give facts about Paris as JSON."),
    "enum": ({"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "sure": {"type": "boolean"}},
              "required": ["color", "sure"]}, "What color is the sky? Answer in JSON."),
    "array": ({"type": "object", "properties": {"fruits": {
        "type": "array", "items": {"type": "string", "maxLength": 15}, "minItems": 2, "maxItems": 4}},
        "required": ["fruits"]}, "List some fruits in JSON."),
    "numbers": ({"type": "array", "items": {"type": "integer", "minimum": -1000, "maximum": 1000},
                 "minItems": 1, "maxItems": 5}, "Give me some numbers as a JSON array."),
}


@pytest.fixture(scope="module")
def smol() -> Iterator[tuple[EngineHandle, RunningServer]]:
    with engine_for(None, num_blocks=256) as handle, running_server(handle, enable_debug_routes=True) as server:
        yield handle, server


@pytest.fixture(scope="module")
def client(smol: tuple[EngineHandle, RunningServer]) -> openai.OpenAI:
    return openai.OpenAI(base_url=smol[1].url + "/v1", api_key="unused", max_retries=0)


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def json_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name][0], "strict": True}}


@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.95, "seed": 5}],
                         ids=["greedy", "sampled"])
def test_json_schema_outputs_validate(client: openai.OpenAI, name: str, sampling: dict) -> None:
    schema, question = SCHEMAS[name]
    r = client.chat.completions.create(model=MODEL, messages=chat(question), max_tokens=300,
                                       response_format=json_format(name), **sampling)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), schema)


@pytest.mark.parametrize("where", ["chat", "beta.chat"])  # the client's current name and the (older) one
def test_parse_with_a_pydantic_model(client: openai.OpenAI, where: str) -> None:
    class City(BaseModel):
        name: str = Field(max_length=40)
        country: str = Field(max_length=40)
        population: int = Field(ge=0, le=100_000_000)  # unbounded, this model writes 1111... until max_tokens

    completions = (client.beta if where == "beta.chat" else client).chat.completions
    r = completions.parse(model=MODEL, messages=chat("Describe Paris."), temperature=0, max_tokens=200,
                          response_format=City)
    city = r.choices[0].message.parsed
    assert isinstance(city, City)
    assert list(json.loads(r.choices[0].message.content)) == ["name", "country", "population"]  # schema order


def test_the_responses_api_parses_into_a_pydantic_model(client: openai.OpenAI) -> None:
    """OpenAI's Responses API: text.format (here from `text_format`) is the chat's response_format."""
    class City(BaseModel):
        name: str = Field(max_length=40)
        country: str = Field(max_length=40)
        population: int = Field(ge=0, le=100_000_000)

    r = client.responses.parse(model=MODEL, input="Describe Paris.", temperature=0, max_output_tokens=200,
                               text_format=City)
    assert r.status == "completed" and isinstance(r.output_parsed, City)
    with client.responses.stream(model=MODEL, input="Describe Paris.", temperature=0, max_output_tokens=200,
                                 text_format=City) as stream:
        assert stream.get_final_response().output_parsed == r.output_parsed


def test_json_object_and_completions(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=chat("Give me a JSON object with a cat's name and age."),
                                       temperature=0, max_tokens=200, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    schema = SCHEMAS["enum"][0]
    c = client.completions.create(model=MODEL, prompt="The sky as JSON:", temperature=0, max_tokens=60,
                                  extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(c.choices[0].text), schema)


@pytest.mark.parametrize("extra", [
    {"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"},
    {"structured_outputs": {"regex": r"\(\d{3}\) \d{3}-\d{4}"}},
    {"response_format": {"type": "regex_schema", "regex_schema": r"\(\d{3}\) \d{3}-\d{4}"}},
])
def test_regex(client: openai.OpenAI, extra: dict) -> None:
    body = {"response_format": extra.pop("response_format")} if "response_format" in extra else {}
    r = client.chat.completions.create(model=MODEL, messages=chat("Write a US phone number."), temperature=0.7,
                                       seed=2, max_tokens=30, extra_body=extra, **body)
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", r.choices[0].message.content)
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("extra", [{"guided_choice": ["yes", "no", "maybe"]},
                                   {"structured_outputs": {"choice": ["yes", "no", "maybe"]}}])
def test_choice_with_n(client: openai.OpenAI, extra: dict) -> None:
    r = client.chat.completions.create(model=MODEL, messages=chat("Is Paris in France?"), temperature=1.0, n=4,
                                       seed=3, max_tokens=10, extra_body=extra)
    assert len(r.choices) == 4 and all(c.message.content in ("yes", "no", "maybe") for c in r.choices)


def test_ebnf_grammar_and_compact_json(client: openai.OpenAI) -> None:
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    r = client.chat.completions.create(model=MODEL, messages=chat("Is water wet?"), temperature=0, max_tokens=20,
                                       extra_body={"guided_grammar": grammar})
    assert r.choices[0].message.content in ("The answer is yes.", "The answer is no.")
    r = client.chat.completions.create(model=MODEL, messages=chat(SCHEMAS["person"][1]), temperature=0, max_tokens=60,
                                       extra_body={"structured_outputs": {"json": SCHEMAS["person"][0],
                                                                          "disable_any_whitespace": True}})
    text = r.choices[0].message.content
    assert not re.search(r"\s", text.replace(" ", "")) and json.loads(text)  # no newlines or indentation


def test_streamed_constrained_output_reassembles(client: openai.OpenAI) -> None:
    schema, question = SCHEMAS["array"]
    chunks = list(client.chat.completions.create(model=MODEL, messages=chat(question), temperature=0, max_tokens=200,
                                                 response_format=json_format("array"), stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)
    whole = client.chat.completions.create(model=MODEL, messages=chat(question), temperature=0, max_tokens=200,
                                           response_format=json_format("array"))
    assert whole.choices[0].message.content == text


def test_a_grammar_that_never_ends_stops_at_max_tokens(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=chat("Count."), temperature=0, max_tokens=15,
                                       extra_body={"guided_regex": "(ab)+"})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 15
    assert re.fullmatch("(ab)*a?", r.choices[0].message.content)


@pytest.mark.parametrize("extra", [{"guided_grammar": 'root ::= "a" root'},
                                   {"structured_outputs": {"grammar": 'root ::= "a" root'}}])
def test_a_grammar_that_can_never_finish_is_bounded_by_max_tokens(smol: tuple[EngineHandle, RunningServer],
                                                                  client: openai.OpenAI, extra: dict) -> None:
    # No string satisfies this grammar, so it never completes: only max_tokens ends the request.
    before = client.chat.completions.create(model=MODEL, messages=chat("Hi"), temperature=0, max_tokens=8)
    r = client.chat.completions.create(model=MODEL, messages=chat("Say something."), temperature=0, max_tokens=12,
                                       extra_body=extra)
    choice = r.choices[0]
    assert (choice.finish_reason, r.usage.completion_tokens) == ("length", 12)
    assert re.fullmatch("a+", choice.message.content), choice.message.content
    assert smol[1].kv()["in_use"] == 0
    after = client.chat.completions.create(model=MODEL, messages=chat("Hi"), temperature=0, max_tokens=8)
    assert after.choices[0].message.content == before.choices[0].message.content != ""


def test_32_concurrent_mixed_with_unconstrained(smol: tuple[EngineHandle, RunningServer]) -> None:
    """16 constrained (every schema, greedy and sampled) and 16 plain requests at once: each constrained output
    validates, each plain one equals its answer alone."""
    url = smol[1].url + "/v1"
    plain_questions = [f"Tell me one fact about the number {i}." for i in range(16)]

    async def run() -> tuple[list, list, list]:
        aclient = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)
        # one after another, so each runs alone in the engine
        alone = [await aclient.chat.completions.create(model=MODEL, messages=chat(q), temperature=0, max_tokens=24)
                 for q in plain_questions]
        names = list(SCHEMAS) * 4
        constrained = [aclient.chat.completions.create(
            model=MODEL, messages=chat(SCHEMAS[n][1]), max_tokens=300, response_format=json_format(n),
            temperature=0 if i % 2 else 0.8, seed=i) for i, n in enumerate(names[:16])]
        plain = [aclient.chat.completions.create(model=MODEL, messages=chat(q), temperature=0, max_tokens=24)
                 for q in plain_questions]
        results = await asyncio.gather(*constrained, *plain)
        await aclient.close()
        return alone, list(zip(names, results[:16])), results[16:]

    alone, constrained, plain = asyncio.run(run())
    for name, r in constrained:
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[name][0])
    assert len(plain) == len(alone) == 16
    assert [r.choices[0].message.content for r in plain] == [r.choices[0].message.content for r in alone]
    assert smol[1].kv()["in_use"] == 0
    # each schema compiled once (the module's earlier tests compiled them first), every later request a hit
    assert 0 < smol[1].metric("llmserve:structured_output_grammars_compiled_total") < 20
    assert smol[1].metric("llmserve:structured_output_grammar_cache_hits_total") >= 16
    assert smol[1].metric("llmserve:structured_output_compile_seconds_total") > 0


def test_tgi_grammar_with_its_client(smol: tuple[EngineHandle, RunningServer]) -> None:
    Client, Grammar = text_generation.Client, text_generation.types.Grammar
    tgi = Client(smol[1].url, timeout=120)
    schema = SCHEMAS["enum"][0]
    prompt = "<|im_start|>user\nWhat color is the sky? Answer in JSON.<|im_end|>\n<|im_start|>assistant\n"
    r = tgi.generate(prompt, max_new_tokens=60, grammar=Grammar(type="json", value=schema))
    jsonschema.validate(json.loads(r.generated_text), schema)
    r = tgi.generate(prompt, max_new_tokens=20, grammar=Grammar(type="regex", value="(blue|gray)!"))
    assert r.generated_text in ("blue!", "gray!")
    events = list(tgi.generate_stream(prompt, max_new_tokens=60, grammar=Grammar(type="json", value=json.dumps(schema))))
    jsonschema.validate(json.loads(events[-1].generated_text), schema)
    with pytest.raises(text_generation.errors.ValidationError, match="grammar"):
        tgi.generate(prompt, max_new_tokens=5, grammar=Grammar(type="regex", value="(a"))


BIG_SCHEMA = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(3000)}}


@pytest.mark.parametrize("extra, param, fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format", "JSON schema could not be compiled: Unsupported type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema: missing"),
    ({"response_format": {"type": "xml"}}, "response_format", "must be text, json_object"),
    ({"guided_regex": "(ab"}, "guided_regex", "regex could not be compiled"),
    ({"guided_grammar": "root ::= nothing"}, "guided_grammar", "grammar could not be compiled"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": BIG_SCHEMA}, "guided_json", "over the limit of 65536"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex", "both constrain"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "give one of"),
    ({"structured_outputs": {"regex": "a", "colour": "red"}}, "structured_outputs.colour", "unknown field"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend", "only xgrammar"),
    ({"guided_whitespace_pattern": " *", "guided_json": {}}, "guided_whitespace_pattern", "not supported"),
    ({"use_beam_search": True, "best_of": 2, "guided_regex": "a+"}, "response_format", "beam search"),
])
def test_bad_constraints_are_400_and_the_engine_keeps_serving(smol: tuple[EngineHandle, RunningServer],
                                                              extra: dict, param: str, fragment: str) -> None:
    url = smol[1].url
    body = {"model": MODEL, "messages": chat("Hi"), "max_tokens": 5, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and fragment in error["message"], error
    ok = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": chat("Hi"), "max_tokens": 3,
                                                         "temperature": 0}, timeout=60)
    assert ok.status_code == 200
    assert smol[1].kv()["in_use"] == 0
