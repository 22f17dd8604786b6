"""OpenAI's Responses API (/v1/responses) through the real server with the official `openai` client.

A Responses request is the chat request it amounts to, so each answer is checked against the chat route's answer
to the same conversation (the same tokens, greedy or seeded), streamed against not streamed (the SDK's
`responses.stream()` checks the events' order and identities as it accumulates them), and stored conversations
against the chat history they stand for. Tools and reasoning run on the tool-calling module's templates.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.server.harness import EngineHandle, RunningServer
from tests.server.test_tool_calling import (  # noqa: F401 (fixtures)
    MODEL,
    QUESTION,
    SCHEMAS,
    TOOLS,
    serve,
    tools_engine,
)

QUESTION_TEXT = "What is the capital of France?"
GREEDY: dict[str, Any] = {"temperature": 0, "max_output_tokens": 12}


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat_text(client: openai.OpenAI, messages: list[dict[str, Any]], **kw: Any) -> tuple[str, Any]:
    r = client.chat.completions.create(model="tiny-llama", messages=messages, **kw)
    return r.choices[0].message.content, r


def post(server: RunningServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + "/v1/responses", json={"model": "tiny-llama", **body}, timeout=60)


# --- the answer ----------------------------------------------------------------------------------------------

def test_a_response_is_the_chat_answer_to_the_same_conversation(client: openai.OpenAI, tiny: EngineHandle) -> None:
    r = client.responses.create(model="tiny-llama", input=QUESTION_TEXT, instructions="You are terse.",
                                extra_body={"ignore_eos": True}, **GREEDY)
    text, chat = chat_text(client, [{"role": "system", "content": "You are terse."},
                                    {"role": "user", "content": QUESTION_TEXT}],
                           temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny-llama"
    assert r.output_text == text
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "incomplete"
    assert item.content[0].type == "output_text" and item.content[0].annotations == []
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == 12 and r.usage.total_tokens == r.usage.input_tokens + 12
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert (r.instructions, r.max_output_tokens, r.temperature, r.store) == ("You are terse.", 12, 0, True)
    assert r.tools == [] and r.tool_choice == "auto" and r.parallel_tool_calls is True


def test_input_items_are_the_chat_messages(client: openai.OpenAI) -> None:
    """Message items with content parts, a developer message (system), an earlier assistant turn."""
    items = [{"role": "developer", "content": "Answer in French."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"},
                                                             {"type": "input_text", "text": " there"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Bonjour"}]},
             {"role": "user", "content": QUESTION_TEXT}]
    r = client.responses.create(model="tiny-llama", input=items, **GREEDY)
    text, _ = chat_text(client, [{"role": "system", "content": "Answer in French."},
                                 {"role": "user", "content": "Hello there"},
                                 {"role": "assistant", "content": "Bonjour"}, {"role": "user", "content": QUESTION_TEXT}],
                        temperature=0, max_tokens=12)
    assert r.output_text == text


def test_streamed_events_add_up_to_the_response(client: openai.OpenAI) -> None:
    """A completed answer (the text scripted by vLLM's guided_choice, so that it ends) through the SDK's stream
    helper, which checks the events' order and identities as it accumulates them."""
    body = dict(model="tiny-llama", input=QUESTION_TEXT, temperature=0, max_output_tokens=40,
                extra_body={"guided_choice": ["Paris is the capital of France."]})
    whole = client.responses.create(**body)
    assert whole.status == "completed" and whole.output_text == "Paris is the capital of France."
    with client.responses.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == whole.output_text
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens, whole.usage.output_tokens)
    assert final.usage.input_tokens_details.cached_tokens > 0  # the same prompt again: from the prefix cache
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text and all(deltas)
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    # every event names the one item by the id it was added with
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {events[2].item.id} == {final.output[0].id}


def test_a_cut_stream_ends_incomplete(client: openai.OpenAI) -> None:
    body = dict(model="tiny-llama", input=QUESTION_TEXT, max_output_tokens=9, temperature=0,
                extra_body={"ignore_eos": True})
    whole = client.responses.create(**body)
    events = list(client.responses.create(**body, stream=True))
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output_text == whole.output_text
    assert last.response.usage.output_tokens == whole.usage.output_tokens == 9
    assert last.response.output[0].status == "incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text


def test_seeded_sampling_is_the_chat_one(client: openai.OpenAI) -> None:
    r = client.responses.create(model="tiny-llama", input=QUESTION_TEXT, temperature=1.0, top_p=0.9,
                                max_output_tokens=10, extra_body={"seed": 11, "top_k": 20})
    text, _ = chat_text(client, [{"role": "user", "content": QUESTION_TEXT}], temperature=1.0, top_p=0.9,
                        max_tokens=10, seed=11, extra_body={"top_k": 20})
    assert r.output_text == text and (r.temperature, r.top_p) == (1.0, 0.9)


def test_logprobs_are_the_chat_ones(client: openai.OpenAI) -> None:
    body = dict(model="tiny-llama", input=QUESTION_TEXT, temperature=0, max_output_tokens=6, top_logprobs=2,
                include=["message.output_text.logprobs"], extra_body={"ignore_eos": True})
    r = client.responses.create(**body)
    _, chat = chat_text(client, [{"role": "user", "content": QUESTION_TEXT}], temperature=0, max_tokens=6,
                        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    got = r.output[0].content[0].logprobs
    want = chat.choices[0].logprobs.content
    assert [(g.token, g.logprob, g.bytes) for g in got] == [(w.token, w.logprob, w.bytes) for w in want]
    assert [[(t.token, t.logprob) for t in g.top_logprobs] for g in got] == \
        [[(t.token, t.logprob) for t in w.top_logprobs] for w in want]
    events = list(client.responses.create(**body, stream=True))
    streamed = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert streamed == [g.token for g in got]
    assert [lp.token for lp in events[-1].response.output[0].content[0].logprobs] == streamed


# --- structured output ---------------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "size"], "additionalProperties": False}


@pytest.mark.parametrize("fmt, response_format", [
    ({"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True},
     {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}),
    ({"type": "json_object"}, {"type": "json_object"}),
    ({"type": "text"}, None),
])
def test_text_format_is_the_chat_response_format(client: openai.OpenAI, fmt: dict[str, Any],
                                                 response_format: dict[str, Any] | None) -> None:
    """The same grammar as the chat's response_format (the tiny model's JSON is noise that may not end within the
    budget; the SmolLM2 case in test_structured_output.py parses a whole one)."""
    r = client.responses.create(model="tiny-llama", input="JSON please", max_output_tokens=30, temperature=0,
                                text={"format": fmt})
    extra = {"response_format": response_format} if response_format else {}
    text, _ = chat_text(client, [{"role": "user", "content": "JSON please"}], temperature=0, max_tokens=30, **extra)
    assert r.output_text == text and r.text.format.type == fmt["type"]
    if response_format:
        assert r.output_text.lstrip().startswith("{")


# --- stored responses ----------------------------------------------------------------------------------------

def test_previous_response_id_continues_the_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(model="tiny-llama", input="Hi", instructions="Be brief.", **GREEDY)
    second = client.responses.create(model="tiny-llama", input=QUESTION_TEXT, previous_response_id=first.id,
                                     **GREEDY)
    # the earlier instructions are not carried over (OpenAI's rule); the earlier turns are
    text, _ = chat_text(client, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text},
                                 {"role": "user", "content": QUESTION_TEXT}], temperature=0, max_tokens=12)
    assert second.output_text == text and second.previous_response_id == first.id
    third = client.responses.create(model="tiny-llama", input="And Spain?", previous_response_id=second.id,
                                    instructions="Be brief.", **GREEDY)
    text, _ = chat_text(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                 {"role": "assistant", "content": first.output_text},
                                 {"role": "user", "content": QUESTION_TEXT},
                                 {"role": "assistant", "content": second.output_text},
                                 {"role": "user", "content": "And Spain?"}], temperature=0, max_tokens=12)
    assert third.output_text == text


def test_stored_responses_read_back_list_inputs_and_delete(client: openai.OpenAI, server: RunningServer) -> None:
    r = client.responses.create(model="tiny-llama", input=[{"role": "user", "content": "one"},
                                                           {"role": "user", "content": "two"}], **GREEDY)
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    items = client.responses.input_items.list(r.id, order="asc")
    assert [(it.type, it.role, it.content[0].type, it.content[0].text) for it in items.data] == \
        [("message", "user", "input_text", "one"), ("message", "user", "input_text", "two")]
    assert all(it.id.startswith("msg_") for it in items.data)
    newest = client.responses.input_items.list(r.id, limit=1)
    assert newest.has_more and [it.id for it in newest.data] == [items.data[1].id]
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(r.id)
    assert e.value.body["param"] == "response_id"
    assert httpx.delete(f"{server.url}/v1/responses/{r.id}").status_code == 404


def test_store_false_keeps_nothing(client: openai.OpenAI) -> None:
    r = client.responses.create(model="tiny-llama", input="Hi", store=False, **GREEDY)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny-llama", input="Hi", previous_response_id=r.id, **GREEDY)
    assert (e.value.body["param"], e.value.body["code"]) == ("previous_response_id", "previous_response_not_found")


def test_a_streamed_response_is_stored_as_it_ended(client: openai.OpenAI) -> None:
    with client.responses.stream(model="tiny-llama", input="Hi", **GREEDY) as stream:
        final = stream.get_final_response()
    assert client.responses.retrieve(final.id).output_text == final.output_text


# --- refusals ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, param", [
    ({"n": 2}, "n"),
    ({"max_tokens": 5}, "max_tokens"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True, "include_usage": True}}, "stream_options"),
    ({"tool_choice": {"type": "allowed_tools", "mode": "sometimes", "tools": []}}, "tool_choice"),
    ({"background": True}, "background"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
    ({"reasoning": {"summary": "auto"}}, "reasoning"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"text": {"format": {"type": "xml"}}}, "text"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"text": {"verbosity": "low"}}, "text"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 100000}, "max_output_tokens"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"stream": True, "stream_options": {"frobnicate": 1}}, "stream_options.frobnicate"),
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "1"}]}, "input"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "abc"}]}, "input"),
    ({"input": "Hi", "previous_response_id": "resp_missing"}, "previous_response_id"),
])
def test_refusals_name_the_field(server: RunningServer, body: dict[str, Any], param: str) -> None:
    r = post(server, {"input": "Hi", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert error["message"]


def test_an_input_over_the_context_is_refused_or_truncated(server: RunningServer, tiny: EngineHandle,
                                                          client: openai.OpenAI) -> None:
    """truncation "auto" leaves out the fewest oldest turns that make the input fit (the prompt is then the chat's
    prompt of the turns kept), and the stored conversation is still the whole one."""
    limit = tiny.model.session_len
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * (limit // 20)} for i in range(7)]
    r = post(server, {"input": turns, "max_output_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    ok = client.responses.create(model="tiny-llama", input=turns, truncation="auto", max_output_tokens=4,
                                 temperature=0, instructions="Be brief.", extra_body={"ignore_eos": True})
    fits = [k for k in (2, 4, 6) if len(tiny.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *turns[k:]], add_generation_prompt=True, tokenize=True,
        return_dict=False)) + 4 <= limit]
    text, chat = chat_text(client, [{"role": "system", "content": "Be brief."}, *turns[fits[0]:]], temperature=0,
                           max_tokens=4, extra_body={"ignore_eos": True})
    assert fits[0] < 6  # more than the last turn fits: only what does not is left out
    assert (ok.usage.input_tokens, ok.output_text) == (chat.usage.prompt_tokens, text)
    # the whole conversation is stored: continued without truncation, it is over the context again
    again = post(server, {"input": "more", "previous_response_id": ok.id, "max_output_tokens": 4})
    assert again.status_code == 400 and again.json()["error"]["code"] == "context_length_exceeded"
    assert client.responses.create(model="tiny-llama", input="more", previous_response_id=ok.id, temperature=0,
                                   truncation="auto", max_output_tokens=4).status == "incomplete"


def test_truncation_keeps_whole_turns(server: RunningServer, tiny: EngineHandle, client: openai.OpenAI) -> None:
    """A tool result is never kept without its call: the prompt starts at a user message."""
    big = "word " * (tiny.model.session_len // 3)
    items = [{"role": "user", "content": big},
             {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "call_1", "output": big},
             {"role": "user", "content": "last"}]
    ok = client.responses.create(model="tiny-llama", input=items, truncation="auto", max_output_tokens=4,
                                 temperature=0, instructions="Be brief.")
    _, chat = chat_text(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "last"}],
                        max_tokens=1)
    assert ok.usage.input_tokens == chat.usage.prompt_tokens


def test_errors_from_the_chat_path_name_the_input_item(server: RunningServer) -> None:
    """An image on a text-only model, at input[1].content[1], behind instructions (the chat's messages[2])."""
    r = post(server, {"instructions": "Be brief.", "input": [
        {"role": "user", "content": "Hi"},
        {"role": "user", "content": [{"type": "input_text", "text": "Look"},
                                     {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    assert "input[1].content[1]" in r.json()["error"]["message"], r.text
    r = post(server, {"input": "Hi", "reasoning": {"effort": 5}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning.effort", r.text


# --- tools and reasoning (the tool-calling module's templates and scripted outputs) -----------------------------

# The Responses API's shape; strict false as the chat's are (this API's default is strict: tested on its own)
FLAT_TOOLS = [{"type": "function", **t["function"], "strict": False} for t in TOOLS]
CHAT_TOOLS = [{"type": "function", "function": {**t["function"], "strict": False}} for t in TOOLS]  # the same


def tools_client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def items_of(response: Any) -> list[tuple[Any, ...]]:
    """Output items in a comparable shape (ids aside: each response draws its own)."""
    out = []
    for it in response.output:
        if it.type == "message":
            out.append(("message", it.content[0].text))
        elif it.type == "reasoning":
            out.append(("reasoning", it.content[0].text))
        else:
            out.append(("function_call", it.name, it.arguments))
    return out


def scripted(text: str, **extra: Any) -> dict[str, Any]:
    return {"extra_body": {"guided_choice": [text], **extra}}


@pytest.mark.parametrize("choice, chat_choice, names", [
    ("required", "required", {"get_weather", "add", "now"}),
    ({"type": "function", "name": "add"}, {"type": "function", "function": {"name": "add"}}, {"add"}),
    ({"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "now"}]},
     {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [{"type": "function",
                                                                               "function": {"name": "now"}}]}},
     {"now"}),
])
def test_forced_calls_are_function_call_items(serve, choice: Any, chat_choice: Any,  # noqa: F811
                                              names: set[str]) -> None:
    c = tools_client(serve("hermes"))
    for seed in range(3):
        body = dict(model=MODEL, input=QUESTION, tools=FLAT_TOOLS, tool_choice=choice, temperature=1.0,
                    max_output_tokens=400, extra_body={"seed": seed})
        r = c.responses.create(**body)
        assert r.status == "completed" and r.output_text == ""
        calls = [it for it in r.output if it.type == "function_call"]
        assert calls and len(calls) == len(r.output)
        for call in calls:
            assert call.name in names and call.call_id.startswith("call_") and call.id.startswith("fc_")
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        chat = c.chat.completions.create(model=MODEL, messages=QUESTION, tools=CHAT_TOOLS, temperature=1.0,
                                         tool_choice=chat_choice, max_tokens=400, seed=seed)
        assert [(t.function.name, t.function.arguments) for t in chat.choices[0].message.tool_calls] == \
            [(it.name, it.arguments) for it in calls]
        with c.responses.stream(**body) as stream:
            events = list(stream)
            final = stream.get_final_response()
        assert items_of(final) == items_of(r)
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert [(e.name, e.arguments) for e in done] == [(it.name, it.arguments) for it in calls]


def test_auto_content_and_calls_in_order(serve) -> None:  # noqa: F811
    from tests.server.test_tool_calling import HERMES_TEXT

    c = tools_client(serve("hermes"))
    body = dict(model=MODEL, input=QUESTION, tools=FLAT_TOOLS, temperature=0, max_output_tokens=200,
                **scripted(HERMES_TEXT))
    r = c.responses.create(**body)
    assert items_of(r) == [("message", "I will check."),
                           ("function_call", "get_weather", '{"city": "Paris", "unit": "celsius"}'),
                           ("function_call", "now", "{}")]
    with c.responses.stream(**body) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert items_of(final) == items_of(r)
    added = [i for i, k in enumerate(kinds) if k == "response.output_item.added"]
    done = [i for i, k in enumerate(kinds) if k == "response.output_item.done"]
    assert len(added) == len(done) == 3 and all(a < d for a, d in zip(added, done))
    assert all(d < a for d, a in zip(done, added[1:]))  # one item open at a time
    one = c.responses.create(**body, parallel_tool_calls=False)
    assert [it.name for it in one.output if it.type == "function_call"] == ["get_weather"]


def test_function_call_outputs_continue_the_conversation(serve) -> None:  # noqa: F811
    """The call and its output, sent back as items or after previous_response_id, are the chat's assistant
    tool_calls message and tool message."""
    server = serve("hermes")
    c = tools_client(server)
    first = c.responses.create(model=MODEL, input=QUESTION, tools=FLAT_TOOLS[:1], temperature=0,
                               tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200)
    [call] = first.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "22 C, sunny"}
    continued = c.responses.create(model=MODEL, previous_response_id=first.id, input=[result], tools=FLAT_TOOLS[:1],
                                   temperature=0, max_output_tokens=8, extra_body={"ignore_eos": True})
    items = [*QUESTION, {"type": "function_call", "call_id": call.call_id, "name": call.name,
                         "arguments": call.arguments}, result]
    manual = c.responses.create(model=MODEL, input=items, tools=FLAT_TOOLS[:1], temperature=0, max_output_tokens=8,
                                extra_body={"ignore_eos": True})
    chat = c.chat.completions.create(model=MODEL, tools=CHAT_TOOLS[:1], temperature=0, max_tokens=8,
                                     extra_body={"ignore_eos": True}, messages=[
                                         *QUESTION, {"role": "assistant", "content": None, "tool_calls": [
                                             {"id": call.call_id, "type": "function",
                                              "function": {"name": call.name, "arguments": call.arguments}}]},
                                         {"role": "tool", "tool_call_id": call.call_id, "content": "22 C, sunny"}])
    assert items_of(continued) == items_of(manual)
    assert continued.usage.input_tokens == manual.usage.input_tokens == chat.usage.prompt_tokens
    assert manual.output_text == (chat.choices[0].message.content or "")


def test_reasoning_items(serve) -> None:  # noqa: F811
    c = tools_client(serve("qwen3"))
    body = dict(model=MODEL, input="Hi", temperature=0, max_output_tokens=100,
                **scripted("<think>\nThe user greets me.\n</think>\n\nHello!"))
    r = c.responses.create(**body)
    assert items_of(r) == [("reasoning", "The user greets me."), ("message", "Hello!")]
    assert r.output_text == "Hello!" and r.usage.output_tokens_details.reasoning_tokens > 0
    with c.responses.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert items_of(final) == items_of(r)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "The user greets me."
    # the reasoning goes back with the assistant turn it came with
    again = c.responses.create(model=MODEL, input="And?", previous_response_id=r.id, temperature=0,
                               max_output_tokens=4, extra_body={"ignore_eos": True})
    chat = c.chat.completions.create(model=MODEL, temperature=0, max_tokens=4, extra_body={"ignore_eos": True},
                                     messages=[{"role": "user", "content": "Hi"},
                                               {"role": "assistant", "content": "Hello!",
                                                "reasoning_content": "The user greets me."},
                                               {"role": "user", "content": "And?"}])
    assert again.usage.input_tokens == chat.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model=MODEL, input="Hi", include=["message.output_text.logprobs"], max_output_tokens=4)
    assert e.value.body["param"] == "include"


def test_tool_refusals_name_the_flat_fields(serve) -> None:  # noqa: F811
    server = serve("hermes")
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, "input": "Hi", "tools": FLAT_TOOLS,
                                                       "tool_choice": {"type": "function", "name": "get_time"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "tool_choice.name: 'get_time' is not one of the request's tools" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, "input": "Hi", "tools": FLAT_TOOLS,
                                                       "tool_choice": "required",
                                                       "text": {"format": {"type": "json_object"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format", r.text
    assert r.json()["error"]["message"].startswith("text.format and tool_choice both constrain")


# --- a step that fails mid-stream ---------------------------------------------------------------------------------

def test_a_failed_step_ends_the_stream_with_response_failed(tiny: EngineHandle) -> None:
    """The engine's error after two outputs (as open_request's stream raises it: an ApiError): the open message
    closes as incomplete, `response.failed` carries the error, and nothing is stored."""
    import asyncio
    from types import SimpleNamespace

    from llmserve.config import GenerationConfig
    from llmserve.engine.output import SequenceOutput
    from llmserve.serve.chat_tools import PLAIN
    from llmserve.serve.errors import ApiError
    from llmserve.serve.generation import EngineRequest
    from llmserve.serve.protocol import ResponsesRequest
    from llmserve.serve.response_store import ResponseStore
    from llmserve.serve.responses_input import conversation
    from llmserve.serve.responses_routes import _Reply

    async def outputs() -> Any:
        for i, text in enumerate(["Hel", "lo"]):
            yield SequenceOutput("resp_x", 0, [5 + i], text, 3, i + 1)
        raise ApiError(500, "the engine step failed")

    async def events() -> list[dict[str, Any]]:
        body = ResponsesRequest(input="Hi", stream=True)
        req = EngineRequest("resp_x", [1, 2, 3], GenerationConfig(max_new_tokens=5))
        reply = _Reply(state, tiny.model, req, body, conversation(body, []), PLAIN)
        return [json.loads(chunk.split("data: ", 1)[1]) async for chunk in reply.stream(outputs())]

    state = SimpleNamespace(responses=ResponseStore(10))
    got = asyncio.run(events())
    assert [e["type"] for e in got][-4:] == ["response.output_text.done", "response.content_part.done",
                                             "response.output_item.done", "response.failed"]
    failed = got[-1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {"code": "server_error",
                                                                "message": "the engine step failed"}
    assert failed["output"][0]["status"] == "incomplete" and failed["output"][0]["content"][0]["text"] == "Hello"
    assert failed["usage"]["output_tokens"] == 2
    with pytest.raises(ApiError):
        state.responses.get("resp_x")


def test_the_store_keeps_the_newest_within_its_count_and_bytes() -> None:
    from llmserve.serve.errors import ApiError
    from llmserve.serve.response_store import ResponseStore, StoredResponse

    def stored(n: int) -> StoredResponse:
        return StoredResponse({"id": "x" * n}, [], [])

    store = ResponseStore(3, max_bytes=400)
    for i in range(4):
        store.put(f"r{i}", stored(50))
    with pytest.raises(ApiError) as e:
        store.get("r0")  # the oldest, past the count
    assert e.value.status == 404
    assert [store.get(f"r{i}").size for i in (1, 2, 3)] == [stored(50).measure()] * 3
    store.put("big", stored(300))  # the bytes: r1 and r2 go
    assert store.num_bytes == store.get("r3").size + store.get("big").size <= 400
    for rid in ("r1", "r2"):
        with pytest.raises(ApiError):
            store.get(rid)
    store.put("huge", stored(1000))  # over the whole budget: not kept, nothing evicted for it
    with pytest.raises(ApiError):
        store.get("huge")
    store.delete("big")
    assert store.num_bytes == store.get("r3").size
    with pytest.raises(ApiError) as e:
        store.get("gone", previous=True)
    assert (e.value.status, e.value.param, e.value.code) == (400, "previous_response_id", "previous_response_not_found")
    none = ResponseStore(0)
    assert none.put("r", stored(1)) is False
    with pytest.raises(ApiError):
        none.get("r")


def test_a_server_that_stores_nothing_says_so(tiny: EngineHandle) -> None:
    from tests.server.harness import running_server

    with running_server(tiny, responses_store_size=0) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        r = c.responses.create(model="tiny-llama", input="Hi", **GREEDY)
        assert r.store is False  # asked (the default), not kept: the response says what happened
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(r.id)


def test_function_tools_are_strict_by_default(serve) -> None:  # noqa: F811
    """This API's default (the chat's is not strict): under `auto` the arguments follow the schema by grammar, so
    the answer is the chat's with `"strict": true`, and a text.format beside it is refused (two grammars)."""
    c = tools_client(serve("hermes"))
    tool = {"type": "function", **TOOLS[0]["function"]}  # no `strict`
    chat_tool = {"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}
    for seed in range(2):
        r = c.responses.create(model=MODEL, input=QUESTION, tools=[tool], temperature=1.0, max_output_tokens=60,
                               extra_body={"seed": seed})
        chat = c.chat.completions.create(model=MODEL, messages=QUESTION, tools=[chat_tool], temperature=1.0,
                                         max_tokens=60, seed=seed).choices[0].message
        assert items_of(r) == ([("message", chat.content)] if chat.content else []) + \
            [("function_call", t.function.name, t.function.arguments) for t in chat.tool_calls or []]
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model=MODEL, input=QUESTION, tools=[tool], text={"format": {"type": "json_object"}})
    assert e.value.body["param"] == "text.format"
    r = c.responses.create(model=MODEL, input=QUESTION, tools=[{**tool, "strict": False}], max_output_tokens=4,
                           text={"format": {"type": "json_object"}})
    assert r.tools[0].strict is False


def streamed_and_whole(c: openai.OpenAI, body: dict[str, Any]) -> tuple[Any, Any]:
    """The whole response and the one the stream's last event carries (any status)."""
    return c.responses.create(**body), list(c.responses.create(**body, stream=True))[-1].response


@pytest.mark.parametrize("setup, text, max_tokens, items, status", [
    # cut while reasoning: the reasoning, and an empty message (the one cut)
    ("deepseek_r1", "Still thinking about it, a long thought", 6,
     [("reasoning", "Still thinking about it,"), ("message", "")], "incomplete"),
    # reasoning, then the end without any text
    ("qwen3", "<think>\nOnly thoughts.\n</think>\n\n", 100, [("reasoning", "Only thoughts."), ("message", "")],
     "completed"),
    # text after a call comes after it
    ("hermes", '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\nDone.', 100,
     [("function_call", "now", "{}"), ("message", "\nDone.")], "completed"),
])
def test_whole_and_streamed_answers_have_the_same_items(serve, setup: str, text: str, max_tokens: int,  # noqa: F811
                                                        items: list[tuple[Any, ...]], status: str) -> None:
    c = tools_client(serve(setup))
    body = dict(model=MODEL, input="Hi", temperature=0, max_output_tokens=max_tokens, **scripted(text))
    if setup == "hermes":
        body["tools"] = FLAT_TOOLS
    whole, streamed = streamed_and_whole(c, body)
    assert items_of(whole) == items_of(streamed)
    assert [it.status for it in whole.output] == [it.status for it in streamed.output]
    assert (whole.status, streamed.status) == (status, status)
    assert [i[0] for i in items_of(whole)] == [i[0] for i in items]
    if status == "incomplete":
        assert whole.output[-1].status == "incomplete"


def test_an_aborted_generation_fails_and_is_not_stored(tiny: EngineHandle) -> None:
    import asyncio
    from types import SimpleNamespace

    from llmserve.config import GenerationConfig
    from llmserve.engine.output import SequenceOutput
    from llmserve.serve.chat_tools import PLAIN
    from llmserve.serve.generation import EngineRequest
    from llmserve.serve.protocol import ResponsesRequest
    from llmserve.serve.response_store import ResponseStore
    from llmserve.serve.responses_input import conversation
    from llmserve.serve.responses_routes import _Reply

    async def outputs() -> Any:
        yield SequenceOutput("resp_y", 0, [5], "Hel", 3, 1)
        yield SequenceOutput("resp_y", 0, [], "", 3, 1, finished=True, finish_reason="abort")

    state = SimpleNamespace(responses=ResponseStore(10))
    body = ResponsesRequest(input="Hi")
    req = EngineRequest("resp_y", [1, 2, 3], GenerationConfig(max_new_tokens=5))
    response = asyncio.run(_Reply(state, tiny.model, req, body, conversation(body, []), PLAIN).collect(outputs()))
    assert response["status"] == "failed" and response["error"]["code"] == "server_error"
    assert response["store"] is False and state.responses.num_bytes == 0
