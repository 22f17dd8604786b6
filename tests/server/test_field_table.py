"""docs/serving.md's field tables are true: every field they list is sent to the server with a value that asks for
something, and the server honours it (200), refuses it (400 naming the field) or accepts it with no effect, as its
row says. Every field has an example here and every example a row there, so neither can drift."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmserve.chat_template import ChatTemplate
from llmserve.config import ChatTemplateConfig
from llmserve.serve.state import model_tool_parser
from tests.server.harness import EngineHandle, RunningServer, running_server
from tests.tiny_models import CHAT_TEMPLATE

DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}

CHAT = {
    "messages": [{"role": "user", "content": "Hi"}], "model": "tiny-llama", "frequency_penalty": 0.5,
    "logit_bias": {"5": 3.0}, "logprobs": True, "top_logprobs": 2, "max_completion_tokens": 3, "max_tokens": 3,
    "n": 2, "presence_penalty": 0.5, "response_format": {"type": "json_object"}, "seed": 1, "stop": ["x"],
    "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.5, "top_p": 0.9,
    "parallel_tool_calls": False, "tool_choice": "required", "tools": [TOOL], "audio": {"voice": "alloy"},
    "function_call": "auto", "functions": [TOOL["function"]], "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "Hello"}, "reasoning_effort": "low", "verbosity": "low",
    "web_search_options": {"search_context_size": "low"}, "store": True, "metadata": {"k": "v"},
    "prompt_cache_key": "abc", "safety_identifier": "u1", "service_tier": "auto", "user": "u1",
}
COMPLETIONS = {
    "model": "tiny-llama", "prompt": "Hi", "best_of": 2, "echo": True, "frequency_penalty": 0.5,
    "logit_bias": {"5": 3.0}, "logprobs": 2, "max_tokens": 3, "n": 2, "presence_penalty": 0.5, "seed": 1,
    "stop": ["x"], "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.5, "top_p": 0.9,
    "suffix": "end", "user": "u1",
}
EMBEDDINGS = {
    "model": "tiny-llama", "input": ["Hi", "there"], "encoding_format": "base64", "dimensions": 8, "user": "u1",
    "truncate_prompt_tokens": 2, "add_special_tokens": False, "normalize": False,
}
EXTRAS = {
    "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 1, "ignore_eos": True,
    "skip_special_tokens": False, "stop_token_ids": [7], "bad_words": ["Paris"], "include_stop_str_in_output": True,
    "use_beam_search": True, "length_penalty": 0.5, "early_stopping": True, "session_id": "table-test",
    "response_format": {"type": "json_object"}, "guided_json": {"type": "object"}, "guided_regex": "[a-z]+",
    "guided_choice": ["yes", "no"], "guided_grammar": 'root ::= "yes"', "structured_outputs": {"regex": "[a-z]+"},
    "prompt_logprobs": 1, "guided_decoding_backend": "outlines", "guided_whitespace_pattern": " *",
    "chat_template_kwargs": {"enable_thinking": False}, "continue_final_message": True,
}
RESPONSES = {
    "input": "Hi", "model": "tiny-llama", "instructions": "Be brief.", "max_output_tokens": 3,
    "previous_response_id": None,  # a stored response's id, made for the test
    "store": False, "tools": [{"type": "function", **TOOL["function"]}], "tool_choice": "required",
    "parallel_tool_calls": False, "text": {"format": {"type": "json_object"}}, "reasoning": {"effort": "low"},
    "include": ["message.output_text.logprobs"], "top_logprobs": 2, "truncation": "auto", "metadata": {"k": "v"},
    "background": True, "max_tool_calls": 2, "prompt": {"id": "pmpt_1"}, "conversation": "conv_1",
    "prompt_cache_key": "abc", "prompt_cache_retention": "24h", "safety_identifier": "u1", "service_tier": "auto",
    "stream": True, "stream_options": {"include_obfuscation": False}, "temperature": 0.5, "top_p": 0.9, "user": "u1",
}
ANTHROPIC = {
    "model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "system": "Be brief.",
    "stop_sequences": ["x"], "stream": True, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
    "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}], "tool_choice": {"type": "any"},
    "thinking": {"type": "disabled"}, "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
    "metadata": {"user_id": "u1"}, "service_tier": "auto", "cache_control": {"type": "ephemeral"},
    "inference_geo": "us", "container": "c1", "mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}],
    "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
}
TGI = {
    "inputs": "The capital of France is", "stream": True, "do_sample": True, "max_new_tokens": 3, "temperature": 0.5,
    "top_k": 5, "top_p": 0.9, "repetition_penalty": 1.2, "frequency_penalty": 0.5, "stop": ["x"], "seed": 1,
    "truncate": 4, "return_full_text": True, "details": True, "decoder_input_details": True, "top_n_tokens": 2,
    "grammar": {"type": "regex", "value": "[a-z ]+"}, "typical_p": 0.5, "watermark": True, "best_of": 2,
    "adapter_id": "tiny-llama",  # the base model by name (adapters: tests/lora)
}

# Fields that only mean something beside another one: sent together.
NEEDS = {"top_logprobs": {"logprobs": True}, "stream_options": {"stream": True}, "tool_choice": {"tools": [TOOL]},
         "function_call": {"functions": [TOOL["function"]]},
         "parallel_tool_calls": {"tools": [TOOL]}}
ANTHROPIC_NEEDS = {"tool_choice": {"tools": ANTHROPIC["tools"]}}
RESPONSES_NEEDS = {"top_logprobs": {"include": RESPONSES["include"]}, "stream_options": {"stream": True},
                   "tool_choice": {"tools": RESPONSES["tools"]}, "parallel_tool_calls": {"tools": RESPONSES["tools"]}}
# Served with a ChatML template that reads tools (compactly) and two variables: template variables are taken only by a
# template that reads them (the tiny model's own reads none and refuses them: tests/server/test_tool_calling.py),
# and the Hermes tool preamble a template without tools gets does not fit the tiny model's 256 tokens.
TEMPLATE_FIELDS = {"reasoning_effort", "reasoning", "thinking", "chat_template_kwargs", "tools", "tool_choice", "parallel_tool_calls", "functions",
                   "function_call"}
VARIABLES_TEMPLATE = ("{% if tools %}{{ '<|im_start|>system\nCall with <tool_call>: ' }}{% for t in tools %}"
                      "{{ t.function.name + ' ' }}{% endfor %}{{ '<|im_end|>\n' }}{% endif %}"
                      "{% if reasoning_effort is defined %}{{ '<|im_start|>system\nReasoning: ' + reasoning_effort + "
                      "'<|im_end|>\n' }}{% endif %}" + CHAT_TEMPLATE +
                      "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}"
                      "{% endif %}")
CHAT_ONLY = {"chat_template_kwargs", "continue_final_message"}  # refused on /v1/completions: there is no template there


@pytest.fixture(scope="module")
def template_server(tiny: EngineHandle) -> Iterator[RunningServer]:
    template = ChatTemplate(tiny.tokenizer, ChatTemplateConfig(chat_template=VARIABLES_TEMPLATE))
    model = dataclasses.replace(tiny.model, chat_template=template, tool_parser=model_tool_parser(None, template))
    with running_server(EngineHandle(tiny.engine, model)) as s:
        yield s


def table(title: str) -> dict[str, str]:
    """field -> status of the table under the heading that starts with `title`."""
    text = DOC.read_text()
    section = text.split("\n### " + title, 1)[1].split("\n##", 1)[0]
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| (honoured|refused|no effect) \|", section,
                                                        re.MULTILINE)}


def test_every_field_has_an_example_and_a_row() -> None:
    assert table("OpenAI chat").keys() == CHAT.keys()
    assert table("OpenAI completions").keys() == COMPLETIONS.keys()
    assert table("Extra fields").keys() == EXTRAS.keys()
    assert table("TGI").keys() == TGI.keys()
    assert table("OpenAI embeddings").keys() == EMBEDDINGS.keys()
    assert table("OpenAI Responses").keys() == RESPONSES.keys()
    assert table("Anthropic messages").keys() == ANTHROPIC.keys()


def _post(server: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def _check(r: httpx.Response, field: str, status: str, param_of: Any) -> None:
    if status == "refused":
        assert r.status_code == 400, (field, r.text)
        assert param_of(r.json()) == field, (field, r.text)
    else:
        assert r.status_code == 200, (field, r.text)


def _openai_param(body: dict[str, Any]) -> str:
    return body["error"]["param"]


def _tgi_param(body: dict[str, Any]) -> str:
    match = re.match(r"`(\w+)`", body["error"])
    return match.group(1) if match else body["error"]


def _server_for(request: pytest.FixtureRequest, field: str) -> RunningServer:
    return request.getfixturevalue("template_server" if field in TEMPLATE_FIELDS else "server")


@pytest.mark.parametrize("field", list(CHAT))
def test_chat_field(request: pytest.FixtureRequest, field: str) -> None:
    body = {"messages": CHAT["messages"], "max_tokens": 2, "temperature": 0, **NEEDS.get(field, {}), field: CHAT[field]}
    _check(_post(_server_for(request, field), "/v1/chat/completions", body), field, table("OpenAI chat")[field],
           _openai_param)


@pytest.mark.parametrize("field", list(COMPLETIONS))
def test_completions_field(server: RunningServer, field: str) -> None:
    body = {"prompt": "Hi", "max_tokens": 2, "temperature": 0, **NEEDS.get(field, {}), field: COMPLETIONS[field]}
    _check(_post(server, "/v1/completions", body), field, table("OpenAI completions")[field], _openai_param)


@pytest.mark.parametrize("field", list(RESPONSES))
def test_responses_field(request: pytest.FixtureRequest, field: str) -> None:
    server = _server_for(request, field)
    value = RESPONSES[field]
    if field == "previous_response_id":
        value = _post(server, "/v1/responses", {"input": "Hello", "max_output_tokens": 2}).json()["id"]
    body = {"input": "Hi", "max_output_tokens": 2, "temperature": 0, **RESPONSES_NEEDS.get(field, {}), field: value}
    _check(_post(server, "/v1/responses", body), field, table("OpenAI Responses")[field], _openai_param)


# The extras the Responses API refuses: each is another field of its own, or has no place in a Response.
RESPONSES_REFUSED = {"response_format", "prompt_logprobs", "continue_final_message"}
# ... and the Messages API: what it names otherwise (stop_sequences, output_config.format) or has no place for;
# a last assistant message is continued there, with no field for it.
ANTHROPIC_REFUSED = {"response_format", "prompt_logprobs", "continue_final_message"}


@pytest.mark.parametrize("field", list(ANTHROPIC))
def test_anthropic_field(request: pytest.FixtureRequest, field: str) -> None:
    body = {"messages": ANTHROPIC["messages"], "max_tokens": 2, "temperature": 0, **ANTHROPIC_NEEDS.get(field, {}),
            field: ANTHROPIC[field]}
    r = _post(_server_for(request, field), "/v1/messages", body)
    status = table("Anthropic messages")[field]
    if status == "refused":  # Anthropic's errors name the field at the start of the message
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(field + ":"), (field, r.text)
    else:
        assert r.status_code == 200, (field, r.text)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"])
@pytest.mark.parametrize("field", list(EXTRAS))
def test_extra_field(request: pytest.FixtureRequest, path: str, field: str) -> None:
    server = _server_for(request, field)
    base = {"messages": CHAT["messages"]} if "chat" in path else {"prompt": "Hi"}
    body = {**base, "max_tokens": 2, "temperature": 0, field: EXTRAS[field]}
    if "responses" in path:
        body = {"input": "Hi", "max_output_tokens": 2, "temperature": 0, field: EXTRAS[field]}
    if path == "/v1/messages":
        body = {"messages": CHAT["messages"], "max_tokens": 2, "temperature": 0, field: EXTRAS[field]}
    if field == "continue_final_message":
        body["messages"] = [*CHAT["messages"], {"role": "assistant", "content": "Hel"}]
    if field == "use_beam_search":
        body["best_of"] = 2
    status = "refused" if field in CHAT_ONLY and "completions" in path and "chat" not in path \
        else table("Extra fields")[field]
    if ("responses" in path and field in RESPONSES_REFUSED) or (path == "/v1/messages" and field in ANTHROPIC_REFUSED):
        status = "refused"
    if path == "/v1/messages":
        r = _post(server, path, body)
        if field == "session_id":  # its KV is held for the next turn: let it go
            httpx.delete(server.url + "/v1/sessions/table-test")
        if status == "refused":
            assert r.status_code == 400 and r.json()["error"]["message"].startswith(field + ":"), (field, r.text)
        else:
            assert r.status_code == 200, (field, r.text)
        return
    _check(_post(server, path, body), field, status, _openai_param)
    if field == "session_id":
        httpx.delete(server.url + "/v1/sessions/table-test")


@pytest.mark.parametrize("field", list(EMBEDDINGS))
def test_embeddings_field(server: RunningServer, field: str) -> None:
    # the tiny model is not a Matryoshka one: its row's "honoured" is for models that are
    # (tests/engine/test_embeddings.py)
    status = "refused" if field == "dimensions" else table("OpenAI embeddings")[field]
    _check(_post(server, "/v1/embeddings", {"input": "Hi", field: EMBEDDINGS[field]}), field, status, _openai_param)


@pytest.mark.parametrize("field", list(TGI))
def test_tgi_field(server: RunningServer, field: str) -> None:
    parameters = {"max_new_tokens": 2}
    body: dict[str, Any] = {"inputs": TGI["inputs"], "parameters": parameters}
    if field in ("inputs", "stream"):
        body[field] = TGI[field]
        path = "/" if field == "stream" else "/generate"
    else:
        parameters[field] = TGI[field]
        path = "/generate"
    if field == "best_of":  # (TGI's rule: only with sampling)
        parameters["do_sample"] = True
    _check(_post(server, path, body), field, table("TGI")[field], _tgi_param)


def test_unknown_fields_with_a_value_are_refused(server: RunningServer) -> None:
    r = _post(server, "/v1/chat/completions", {"messages": CHAT["messages"], "max_tokens": 2, "temprature": 0.2,
                                               "made_up": None, "other": []})
    assert r.status_code == 400 and _openai_param(r.json()) == "temprature"
    assert "unknown field" in r.json()["error"]["message"]
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi", "mood": "happy"}],
                                               "max_tokens": 2})
    assert r.status_code == 400 and _openai_param(r.json()) == "messages[0].mood"
    r = _post(server, "/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 2, "typo_p": 0.4}})
    assert r.status_code == 400 and "parameters.typo_p" in r.json()["error"]
    ok = _post(server, "/v1/chat/completions", {"messages": CHAT["messages"], "max_tokens": 2, "made_up": None,
                                                "tools": [], "functions": None})
    assert ok.status_code == 200, ok.text
