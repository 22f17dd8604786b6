"""Anthropic's Messages API (/v1/messages) through the real server with Anthropic's official client.

A Messages request is the chat request it amounts to, so each answer is checked against the chat route's answer to
the same conversation (greedy or seeded: the same tokens), streamed against whole (the SDK's `messages.stream()`
accumulates the events into the message, checking their order), and errors in Anthropic's shape. Tools and
thinking run on the tool-calling module's templates and scripted outputs.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.server.harness import EngineHandle, RunningServer, running_server
from tests.server.test_tool_calling import (  # noqa: F401 (fixtures)
    MODEL,
    SCHEMAS,
    TOOLS,
    serve,
    tools_engine,
)

QUESTION = "What is the capital of France?"
USER = [{"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def client(server: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def oai(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat(oai: openai.OpenAI, messages: list[dict[str, Any]], model: str = "tiny-llama", **kw: Any) -> Any:
    return oai.chat.completions.create(model=model, messages=messages, **kw)


def post(server: RunningServer, body: dict[str, Any], path: str = "/v1/messages") -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "tiny-llama", "max_tokens": 8, **body}, timeout=60)


def blocks_of(message: Any) -> list[tuple[Any, ...]]:
    out = []
    for b in message.content:
        if b.type == "text":
            out.append(("text", b.text))
        elif b.type == "thinking":
            out.append(("thinking", b.thinking))
        else:
            out.append(("tool_use", b.name, b.input))
    return out


# --- the answer ----------------------------------------------------------------------------------------------

def test_a_message_is_the_chat_answer(client: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    m = client.messages.create(model="tiny-llama", max_tokens=12, system="You are terse.", messages=USER,
                               extra_body={"temperature": 0, "ignore_eos": True})
    c = chat(oai, [{"role": "system", "content": "You are terse."}, *USER], temperature=0, max_tokens=12,
             extra_body={"ignore_eos": True})
    assert m.type == "message" and m.role == "assistant" and m.model == "tiny-llama" and m.id.startswith("msg_")
    assert blocks_of(m) == [("text", c.choices[0].message.content)]
    assert (m.stop_reason, m.stop_sequence) == ("max_tokens", None)
    assert m.usage.output_tokens == 12
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == c.usage.prompt_tokens


def test_content_blocks_and_system_blocks_are_the_chat_messages(client: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "Bonjour"}]},
                {"role": "user", "content": QUESTION}]
    m = client.messages.create(model="tiny-llama", max_tokens=10, messages=messages,
                               system=[{"type": "text", "text": "Answer "}, {"type": "text", "text": "in French."}],
                               extra_body={"temperature": 0})
    c = chat(oai, [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello there"},
                   {"role": "assistant", "content": "Bonjour"}, *USER], temperature=0, max_tokens=10)
    assert m.content[0].text == c.choices[0].message.content


def test_seeded_sampling_and_stop_sequences(client: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    body = dict(model="tiny-llama", max_tokens=16, messages=USER,
                extra_body={"temperature": 1.0, "top_p": 0.9, "top_k": 20, "seed": 4})
    whole = client.messages.create(**body).content[0].text
    c = chat(oai, USER, temperature=1.0, top_p=0.9, max_tokens=16, seed=4, extra_body={"top_k": 20})
    assert whole == c.choices[0].message.content
    stop = whole[len(whole) // 2:][:2]
    m = client.messages.create(**body, stop_sequences=[stop])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert m.content[0].text == whole[:whole.index(stop)]


def test_a_stream_adds_up_to_the_message(client: anthropic.Anthropic) -> None:
    body = dict(model="tiny-llama", max_tokens=40, messages=USER,
                extra_body={"temperature": 0, "guided_choice": ["Paris is the capital of France."]})
    whole = client.messages.create(**body)
    assert (blocks_of(whole), whole.stop_reason) == ([("text", "Paris is the capital of France.")], "end_turn")
    with client.messages.stream(**body) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert blocks_of(final) == blocks_of(whole) and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == whole.usage.output_tokens
    raw = [e.type for e in client.messages.create(**body, stream=True)]
    assert raw[0] == "message_start" and raw[1] == "content_block_start"
    assert raw[-4:] == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert "text" in events


def test_a_prefill_is_continued(client: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    """A last assistant message is continued (Anthropic's prefill): the prompt leaves it open, as vLLM's
    continue_final_message does, and the answer is only what follows."""
    prefill = [*USER, {"role": "assistant", "content": "The capital is"}]
    m = client.messages.create(model="tiny-llama", max_tokens=6, messages=prefill,
                               extra_body={"temperature": 0, "ignore_eos": True})
    c = chat(oai, prefill, temperature=0, max_tokens=6, extra_body={"continue_final_message": True,
                                                                    "ignore_eos": True})
    closed = chat(oai, prefill, temperature=0, max_tokens=6, extra_body={"ignore_eos": True})
    assert m.content[0].text == c.choices[0].message.content
    assert c.usage.prompt_tokens < closed.usage.prompt_tokens  # the turn is left open: no end-of-turn tokens


def test_consecutive_turns_of_one_role_are_one_and_an_empty_prefill_is_none(client: anthropic.Anthropic,
                                                                            oai: openai.OpenAI) -> None:
    split = [{"role": "user", "content": "Hello"}, {"role": "user", "content": [{"type": "text", "text": " there"}]},
             {"role": "assistant", "content": ""}]
    m = client.messages.create(model="tiny-llama", max_tokens=6, messages=split,
                               extra_body={"temperature": 0, "ignore_eos": True})
    c = chat(oai, [{"role": "user", "content": "Hello there"}], temperature=0, max_tokens=6,
             extra_body={"ignore_eos": True})
    assert m.content[0].text == c.choices[0].message.content
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == c.usage.prompt_tokens


def test_output_config_format_is_the_chat_response_format(client: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    m = client.messages.create(model="tiny-llama", max_tokens=30, messages=USER, extra_body={"temperature": 0},
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    c = chat(oai, USER, temperature=0, max_tokens=30, response_format={
        "type": "json_schema", "json_schema": {"name": "output", "schema": schema, "strict": True}})
    assert m.content[0].text == c.choices[0].message.content and m.content[0].text.lstrip().startswith("{")


def test_count_tokens(client: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    n = client.messages.count_tokens(model="tiny-llama", messages=USER, system="You are terse.")
    c = chat(oai, [{"role": "system", "content": "You are terse."}, *USER], max_tokens=1)
    assert n.input_tokens == c.usage.prompt_tokens


# --- errors and keys -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, fragment", [
    ({"max_tokens": 0}, "max_tokens: must be >= 1"),
    ({"max_tokens": 100000}, "max_tokens"),
    ({"n": 2}, "n: "),
    ({"stop": ["x"]}, "stop: this API calls it stop_sequences"),
    ({"response_format": {"type": "json_object"}}, "response_format: this API calls it output_config.format"),
    ({"container": "c1"}, "container:"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers:"),
    ({"frobnicate": 1}, "frobnicate: unknown field"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]},
     "messages[0].content[0].source"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                  "content": "1"}]}]}, "messages[0].content[0].tool_use_id"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking: a thinking budget"),
    ({"thinking": {"type": "adaptive"}}, "thinking: this model's chat template never reads `enable_thinking`"),
    ({"output_config": {"effort": "high"}}, "output_config.effort"),
    ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format"),
    ({"thinking": {"type": "adaptive", "display": "omitted"}}, "thinking.display"),
    ({"thinking": {"type": "disabled"}, "chat_template_kwargs": {"enable_thinking": True}}, "thinking: "),
    ({"tool_choice": {"type": "auto", "bogus": True}}, "tool_choice: unknown field 'bogus'"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "bogus": 1}]}]},
     "messages[0].content[0]: unknown field 'bogus'"),
    ({"messages": [*USER, {"role": "assistant", "content": "{"}],
      "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "messages: a grammar"),
    ({"system": "Be brief.", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Look"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
     "messages[0]: this model takes text only, got an image block"),  # the request's index, not the chat's
])
def test_refusals_in_anthropics_shape(server: RunningServer, body: dict[str, Any], fragment: str) -> None:
    r = post(server, {"messages": USER, **body})
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
    assert fragment in error["error"]["message"], error


def test_the_client_raises_anthropics_errors(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny-llama", max_tokens=0, messages=USER)
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-opus-4", max_tokens=4, messages=USER)
    assert e.value.body["error"]["type"] == "not_found_error"


def test_the_key_as_x_api_key(tiny: EngineHandle) -> None:
    with running_server(tiny, api_keys=["sk-a"]) as s:
        ok = anthropic.Anthropic(base_url=s.url, api_key="sk-a", max_retries=0)
        assert ok.messages.create(model="tiny-llama", max_tokens=2, messages=USER).usage.output_tokens >= 1
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=s.url, api_key="sk-b", max_retries=0).messages.create(
                model="tiny-llama", max_tokens=2, messages=USER)
        assert e.value.body["error"]["type"] == "authentication_error"
        assert httpx.post(s.url + "/v1/chat/completions", headers={"x-api-key": "sk-a"}, json={
            "messages": USER, "max_tokens": 1}).status_code == 200
        assert httpx.post(s.url + "/v1/chat/completions", headers={"x-api-key": ""}, json={
            "messages": USER, "max_tokens": 1}).status_code == 401


# --- tools and thinking ---------------------------------------------------------------------------------------

ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                    "input_schema": t["function"].get("parameters", {"type": "object", "properties": {}})}
                   for t in TOOLS]
CHAT_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                "parameters": t["input_schema"]}} for t in ANTHROPIC_TOOLS]


def tools_client(server: RunningServer) -> tuple[anthropic.Anthropic, openai.OpenAI]:
    return (anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0),
            openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0))


@pytest.mark.parametrize("choice, chat_choice", [
    ({"type": "any"}, "required"),
    ({"type": "tool", "name": "add"}, {"type": "function", "function": {"name": "add"}}),
    ({"type": "any", "disable_parallel_tool_use": True}, "required"),
])
def test_forced_tool_use(serve, choice: dict[str, Any], chat_choice: Any) -> None:  # noqa: F811
    c, o = tools_client(serve("hermes"))
    for seed in range(3):
        body = dict(model=MODEL, max_tokens=400, messages=USER, tools=ANTHROPIC_TOOLS, tool_choice=choice,
                    extra_body={"temperature": 1.0, "seed": seed})
        m = c.messages.create(**body)
        assert m.stop_reason == "tool_use" and all(b.type == "tool_use" for b in m.content)
        for b in m.content:
            jsonschema.validate(b.input, SCHEMAS[b.name])
        ref = o.chat.completions.create(model=MODEL, messages=USER, tools=CHAT_TOOLS, tool_choice=chat_choice,
                                        parallel_tool_calls=not choice.get("disable_parallel_tool_use"),
                                        temperature=1.0, seed=seed, max_tokens=400).choices[0].message
        assert m.content and [(b.name, b.input) for b in m.content] == [
            (t.function.name, json.loads(t.function.arguments)) for t in ref.tool_calls]
        if choice.get("disable_parallel_tool_use") or choice["type"] == "tool":
            assert len(m.content) == 1
        with c.messages.stream(**body) as stream:
            final = stream.get_final_message()
        assert blocks_of(final) == blocks_of(m) and final.stop_reason == "tool_use"


def test_tool_results_continue_the_conversation(serve) -> None:  # noqa: F811
    c, o = tools_client(serve("hermes"))
    first = c.messages.create(model=MODEL, max_tokens=400, messages=USER, tools=ANTHROPIC_TOOLS[:1],
                              tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0})
    [use] = first.content
    messages = [*USER, {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "22 C"},
                                             {"type": "text", "text": "Thanks"}]}]
    m = c.messages.create(model=MODEL, max_tokens=6, messages=messages, tools=ANTHROPIC_TOOLS[:1],
                          extra_body={"temperature": 0, "ignore_eos": True})
    ref = o.chat.completions.create(
        model=MODEL, tools=CHAT_TOOLS[:1], temperature=0, max_tokens=6, extra_body={"ignore_eos": True},
        messages=[*USER, {"role": "assistant", "content": None, "tool_calls": [
            {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
            {"role": "tool", "tool_call_id": use.id, "content": "22 C"}, {"role": "user", "content": "Thanks"}])
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == ref.usage.prompt_tokens
    message = ref.choices[0].message
    assert blocks_of(m) == ([("text", message.content)] if message.content else []) + [
        ("tool_use", t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls or []]


def scripted(text: str) -> dict[str, Any]:
    return {"extra_body": {"temperature": 0, "guided_choice": [text]}}


@pytest.mark.parametrize("setup, text, blocks, stop_reason", [
    ("qwen3", "<think>\nThe user greets me.\n</think>\n\nHello!",
     [("thinking", "The user greets me."), ("text", "Hello!")], "end_turn"),
    ("hermes", 'I will check.\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
     [("text", "I will check."), ("tool_use", "now", {})], "tool_use"),
])
def test_thinking_and_auto_tool_use_whole_and_streamed(serve, setup: str, text: str,  # noqa: F811
                                                       blocks: list[tuple[Any, ...]], stop_reason: str) -> None:
    c, o = tools_client(serve(setup))
    body = dict(model=MODEL, max_tokens=100, messages=[{"role": "user", "content": "Hi"}], **scripted(text))
    if setup == "hermes":
        body["tools"] = ANTHROPIC_TOOLS
    m = c.messages.create(**body)
    assert (blocks_of(m), m.stop_reason) == (blocks, stop_reason)
    with c.messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert (blocks_of(final), final.stop_reason) == (blocks, stop_reason)
    if setup == "qwen3":
        assert m.content[0].signature == ""
        # the thinking goes back with its turn, and `thinking` sets the template's enable_thinking
        again = c.messages.create(model=MODEL, max_tokens=2, thinking={"type": "disabled"}, messages=[
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "The user greets me.", "signature": ""},
                {"type": "text", "text": "Hello!"}]}, {"role": "user", "content": "And?"}])
        ref = o.chat.completions.create(model=MODEL, max_tokens=2, extra_body={
            "chat_template_kwargs": {"enable_thinking": False}}, messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!", "reasoning_content": "The user greets me."},
            {"role": "user", "content": "And?"}])
        assert again.usage.input_tokens + again.usage.cache_read_input_tokens == ref.usage.prompt_tokens
