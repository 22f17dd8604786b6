"""Tool calling and reasoning through the real server with the official `openai` client.

A tiny random llama (4,096 positions, `[TOOL_CALLS]` and `<|python_tag|>` added as special tokens, as in Mistral's
and Llama 3's tokenizers) is served under the chat templates of each family (tests/tools/templates.py). Forced
calls (tool_choice "required" or a named function) come from the grammar, whatever the random model prefers, and
must always parse and validate; for `auto` the model's text is scripted with a `guided_choice` constraint (tools
under `auto` need no grammar, so the two may go together), so each parser reads exactly what a model of its family
writes. The embedded SmolLM2 (a ChatML template without tools: the Hermes fallback) answers one real round trip.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from llmserve.chat_template import ChatTemplate
from llmserve.config import ChatTemplateConfig
from llmserve.serve.config import ServerConfig
from llmserve.serve.state import model_tool_parser
from llmserve.tools import reasoning_parser
from tests.server.harness import EngineHandle, RunningServer, engine_for, running_server
from tests.tiny_models import CHAT_TEMPLATE, make_tiny_model, tiny_tokenizer
from tests.tools.templates import LLAMA31, MISTRAL_V03, QWEN25

pytestmark = pytest.mark.filterwarnings("ignore:The `dict` method is deprecated:DeprecationWarning")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 12},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": -100, "maximum": 100}, "b": {"type": "boolean"}}, "required": ["a", "b"]}}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: called with {}
# OpenAI's `strict`: the schema holds under `auto` too, so the calls follow a grammar once opened
STRICT_WEATHER = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
TOOLS = [WEATHER, ADD, NOW]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "maxProperties": 0})
           for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
MODEL = "tiny-tools"

# Qwen3's template is Qwen2.5's for tools, and closes the reasoning in the prompt when told not to think.
QWEN3 = QWEN25 + ("{%- if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}"
                  "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}")
DEEPSEEK_R1 = CHAT_TEMPLATE + "{% if add_generation_prompt %}{{ '<think>\\n' }}{% endif %}"  # opens the reasoning
# A template that takes tools but shows no call syntax llmserve knows: which parser reads its calls must be named.
UNKNOWN_FORMAT = "{% if tools %}{% for t in tools %}<function={{ t.function.name }}>{% endfor %}{% endif %}" + \
    CHAT_TEMPLATE
ID_PATTERNS = {"hermes": r"call_[0-9a-f]{24}", "llama3_json": r"call_[0-9a-f]{24}", "mistral": r"[A-Za-z0-9]{9}"}

# name -> (chat template, tool-call parser named, reasoning parser). None: the tokenizer's (ChatML, no tools).
SETUPS: dict[str, tuple[str | None, str | None, str | None]] = {
    "hermes": (QWEN25, None, None),
    "llama3_json": (LLAMA31, None, None),
    "mistral": (MISTRAL_V03, None, None),
    "chatml": (None, None, None),
    "qwen3": (QWEN3, None, "qwen3"),
    "deepseek_r1": (DEEPSEEK_R1, None, "deepseek_r1"),
    "unknown_format": (UNKNOWN_FORMAT, None, None),
    "unknown_format_named": (UNKNOWN_FORMAT, "hermes", None),
}
FAMILY_SETUPS = {"hermes": "hermes", "llama3_json": "llama3_json", "mistral": "mistral", "chatml": "hermes"}


@pytest.fixture(scope="module")
def tools_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineHandle]:
    directory = make_tiny_model("llama", tmp_path_factory.mktemp("tiny-tools"), max_position_embeddings=4096)
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "<|python_tag|>"]})
    tokenizer.save_pretrained(directory)
    with engine_for(directory, name=MODEL, num_blocks=768, block_size=16) as handle:
        yield handle


@pytest.fixture(scope="module")
def serve(tools_engine: EngineHandle) -> Iterator[Callable[[str], RunningServer]]:
    """serve(setup) -> a server of the shared engine under that setup's template and parsers (started once)."""
    with ExitStack() as stack:
        started: dict[str, RunningServer] = {}

        def get(setup: str) -> RunningServer:
            if setup not in started:
                template_source, parser, reasoning = SETUPS[setup]
                config = ChatTemplateConfig(chat_template=template_source) if template_source else None
                template = ChatTemplate(tools_engine.tokenizer, config)
                model = dataclasses.replace(tools_engine.model, chat_template=template,
                                            tool_parser=model_tool_parser(parser, template),
                                            reasoning=reasoning_parser(reasoning) if reasoning else None)
                started[setup] = stack.enter_context(running_server(EngineHandle(tools_engine.engine, model),
                                                                    enable_debug_routes=True))
            return started[setup]

        yield get


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def check_calls(calls: list[Any], names: set[str], id_pattern: str) -> None:
    """Each call: an id of the family's shape, an allowed name, arguments that are JSON valid for its schema."""
    assert calls
    for call in calls:
        assert re.fullmatch(id_pattern, call.id) and call.type == "function", call
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# --- forced calls ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("setup", list(FAMILY_SETUPS))
@pytest.mark.parametrize("choice, parallel, names", [
    ("required", False, {"get_weather", "add", "now"}),
    ("required", True, {"get_weather", "add", "now"}),
    ({"type": "function", "function": {"name": "add"}}, True, {"add"}),
    ({"type": "function", "function": {"name": "get_weather"}}, False, {"get_weather"}),
])
def test_forced_calls_always_parse_and_validate(serve, setup: str, choice: Any, parallel: bool,
                                                names: set[str]) -> None:
    c = client(serve(setup))
    for seed in range(4):
        r = c.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=choice,
                                      parallel_tool_calls=parallel, temperature=1.0, seed=seed, max_tokens=400)
        choice_ = r.choices[0]
        assert choice_.finish_reason == "tool_calls", choice_
        assert choice_.message.content is None
        calls = choice_.message.tool_calls
        check_calls(calls, names, ID_PATTERNS[FAMILY_SETUPS[setup]])
        if not parallel or choice != "required":
            assert len(calls) == 1


def test_forced_calls_with_n_and_streaming(serve) -> None:
    c = client(serve("hermes"))
    body = dict(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required", temperature=1.0, seed=7, n=3,
                max_tokens=400)
    whole = c.chat.completions.create(**body)
    streamed = reassemble(list(c.chat.completions.create(**body, stream=True)))
    assert len(whole.choices) == 3
    for choice in whole.choices:
        check_calls(choice.message.tool_calls, {"get_weather", "add", "now"}, ID_PATTERNS["hermes"])
        assert streamed[choice.index] == message_of(choice)


def test_the_deprecated_functions_api(serve) -> None:
    """OpenAI's functions / function_call, as the tools API it became: a forced function's call comes back as
    message.function_call (one call, finish_reason "function_call"), streamed as function_call deltas that add up to
    it; a history with an assistant's function_call and the "function" message answering it is taken; "none"
    keeps the functions from being called."""
    c = client(serve("hermes"))
    body = dict(model=MODEL, messages=QUESTION, functions=[WEATHER["function"], ADD["function"]],
                function_call={"name": "get_weather"}, temperature=1.0, seed=3, max_tokens=400)
    whole = c.chat.completions.create(**body).choices[0]
    assert whole.finish_reason == "function_call" and whole.message.tool_calls is None
    call = whole.message.function_call
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_weather"])
    name, arguments, reasons = None, "", []
    for chunk in c.chat.completions.create(**body, stream=True):
        for ch in chunk.choices:
            assert ch.delta.tool_calls is None
            if ch.delta.function_call is not None:
                name = ch.delta.function_call.name or name
                arguments += ch.delta.function_call.arguments or ""
            reasons.append(ch.finish_reason)
    assert (name, arguments, reasons[-1]) == (call.name, call.arguments, "function_call")
    history = [*QUESTION, {"role": "assistant", "content": None, "function_call": {"name": "get_weather",
                                                                                  "arguments": call.arguments}},
               {"role": "function", "name": "get_weather", "content": "12 degrees"}]
    r = c.chat.completions.create(model=MODEL, messages=history, functions=[WEATHER["function"]], function_call="none",
                                  temperature=0, max_tokens=5).choices[0]
    assert r.message.function_call is None and r.finish_reason in ("stop", "length")


# --- auto: each family's parser on scripted output -------------------------------------------------------------

HERMES_TEXT = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
               '\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
SCRIPTS = {  # setup -> (what the model writes, content, calls)
    "hermes": (HERMES_TEXT, "I will check.", [("get_weather", {"city": "Paris", "unit": "celsius"}), ("now", {})]),
    "chatml": (HERMES_TEXT, "I will check.", [("get_weather", {"city": "Paris", "unit": "celsius"}), ("now", {})]),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                    '{"name": "now", "parameters": {}}',
                    None, [("get_weather", {"city": "Paris", "unit": "celsius"}), ("now", {})]),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "now", "arguments": {}}]',
                None, [("get_weather", {"city": "Paris", "unit": "celsius"}), ("now", {})]),
}
TOOL_CALLS_TOKEN = 300  # the first token added to the tiny tokenizer


def scripted(text: str, **extra: Any) -> dict[str, Any]:
    """Request fields that make the model write `text` (tools under `auto` take a guided_choice beside them)."""
    return {"extra_body": {"guided_choice": [text], **extra}}


@pytest.mark.parametrize("setup", list(SCRIPTS))
def test_auto_parses_what_each_family_writes(serve, setup: str) -> None:
    text, content, calls = SCRIPTS[setup]
    c = client(serve(setup))
    # Mistral's marker as the special token it is in Mistral's tokenizer (the parser must see it in the text)
    bias = {"logit_bias": {str(TOOL_CALLS_TOKEN): 50}} if setup == "mistral" else {}
    body = dict(model=MODEL, messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=200, logprobs=True, **bias,
                **scripted(text))
    r = c.chat.completions.create(**body)
    choice = r.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", content)
    assert [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls] == calls
    check_calls(choice.message.tool_calls, {"get_weather", "now"}, ID_PATTERNS[FAMILY_SETUPS[setup]])
    if setup == "mistral":
        assert choice.logprobs.content[0].token == "[TOOL_CALLS]"
        # a request that asks for special tokens to be left out gets that, and the marker is gone with them
        skipped = c.chat.completions.create(**{**body, "extra_body": {**body["extra_body"],
                                                                      "skip_special_tokens": True}})
        assert skipped.choices[0].message.tool_calls is None
        assert skipped.choices[0].message.content == text.removeprefix("[TOOL_CALLS]")
    streamed = reassemble(list(c.chat.completions.create(**body, stream=True)))
    assert streamed[0] == message_of(choice)


def test_auto_without_a_call_is_content(serve) -> None:
    c = client(serve("hermes"))
    r = c.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=50,
                                  **scripted("It is sunny in Paris, x < y."))
    assert (r.choices[0].finish_reason, r.choices[0].message.content) == ("stop", "It is sunny in Paris, x < y.")
    assert r.choices[0].message.tool_calls is None


def test_parallel_tool_calls_false_keeps_the_first_call(serve) -> None:
    c = client(serve("hermes"))
    body = dict(model=MODEL, messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=200, parallel_tool_calls=False,
                **scripted(HERMES_TEXT))
    r = c.chat.completions.create(**body)
    assert [t.function.name for t in r.choices[0].message.tool_calls] == ["get_weather"]
    assert r.choices[0].finish_reason == "tool_calls"
    assert reassemble(list(c.chat.completions.create(**body, stream=True)))[0] == message_of(r.choices[0])


def test_tool_choice_none_shows_no_tools_and_parses_nothing(serve) -> None:
    c = client(serve("hermes"))
    base = dict(model=MODEL, messages=QUESTION, temperature=0, max_tokens=200, **scripted(HERMES_TEXT))
    r = c.chat.completions.create(tools=TOOLS, tool_choice="none", **base)
    plain = c.chat.completions.create(**base)
    assert r.choices[0].message.content == HERMES_TEXT and r.choices[0].message.tool_calls is None
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens  # the template was not shown the tools


# --- round trip --------------------------------------------------------------------------------------------------

def prompt_text(server: RunningServer, messages: list[dict[str, Any]], **fields: Any) -> str:
    """The prompt the server built, read back from vLLM's prompt_logprobs (all but its first token: with top 0,
    each entry holds the prompt token alone)."""
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "max_tokens": 1, "prompt_logprobs": 0, **fields}, timeout=60)
    assert r.status_code == 200, r.text
    return "".join(next(iter(entry.values()))["decoded_token"] for entry in r.json()["prompt_logprobs"][1:])


@pytest.mark.parametrize("setup, call_text, result_text", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     "<tool_response>\n22 C, sunny\n</tool_response>"),
    ("chatml", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     "<tool_response>\n22 C, sunny\n</tool_response>"),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     '<|start_header_id|>ipython<|end_header_id|>\n\n"22 C, sunny"<|eot_id|>'),  # Llama's template: tojson
    # Mistral's writes the function object as the client sent it (the openai client puts arguments first)
    ("mistral", '[TOOL_CALLS] [{"arguments": {"city": "Paris", "unit": "celsius"}, "name": "get_weather", "id": "{id}"}]',
     '[TOOL_RESULTS] {"content": 22 C, sunny, "call_id": "{id}"}[/TOOL_RESULTS]'),
])
def test_round_trip_with_a_tool_message(serve, setup: str, call_text: str, result_text: str) -> None:
    server = serve(setup)
    c = client(server)
    first = c.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER],
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                      temperature=0, max_tokens=200,
                                      **({"extra_body": {"logit_bias": {str(TOOL_CALLS_TOKEN): 50}}}
                                         if setup == "mistral" else {}))
    call = first.choices[0].message.tool_calls[0]
    # the client's own message object goes back as it came, and the tool's answer after it
    messages = [*QUESTION, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "22 C, sunny"}]
    messages[1]["tool_calls"][0]["function"]["arguments"] = '{"city": "Paris", "unit": "celsius"}'
    second = c.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0, max_tokens=8)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    prompt = prompt_text(server, messages, tools=[WEATHER])
    call_text, result_text = call_text.replace("{id}", call.id), result_text.replace("{id}", call.id)
    assert call_text in prompt and result_text in prompt, prompt
    assert prompt.index(call_text) < prompt.index(result_text)
    assert server.kv()["in_use"] == 0


# --- streaming ---------------------------------------------------------------------------------------------------

def reassemble(chunks: list[Any]) -> dict[int, dict[str, Any]]:
    """Each choice's message from its deltas, as a client adds them up (calls by index); also checks the shape
    of the stream: a call's first delta has its id, type and name, and only the last chunk a finish_reason."""
    out: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            m = out.setdefault(choice.index, {"content": None, "reasoning": None, "calls": [], "finish": None})
            assert m["finish"] is None, "a chunk after the choice finished"
            d = choice.delta
            if d.content:
                m["content"] = (m["content"] or "") + d.content
            reasoning = getattr(d, "reasoning_content", None)
            if reasoning:
                m["reasoning"] = (m["reasoning"] or "") + reasoning
            for t in d.tool_calls or []:
                if t.index == len(m["calls"]):
                    assert t.id and t.type == "function" and t.function.name, t
                    m["calls"].append([t.function.name, ""])
                m["calls"][t.index][1] += t.function.arguments or ""
            m["finish"] = choice.finish_reason
    return out


def message_of(choice: Any) -> dict[str, Any]:
    """A non-streamed choice in reassemble's shape (ids aside: each response draws its own)."""
    m = choice.message
    return {"content": m.content or None, "reasoning": getattr(m, "reasoning_content", None),
            "calls": [[t.function.name, t.function.arguments] for t in m.tool_calls or []],
            "finish": choice.finish_reason}


# --- reasoning ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("setup, text, reasoning, content", [
    ("qwen3", "<think>\nThe user greets me.\n</think>\n\nHello!", "The user greets me.", "Hello!"),
    ("qwen3", "Hello without thinking.", None, "Hello without thinking."),
    ("deepseek_r1", "The user greets me.\n</think>\n\nHello!", "The user greets me.", "Hello!"),
])
def test_reasoning_split_whole_and_streamed(serve, setup: str, text: str, reasoning: str | None,
                                            content: str) -> None:
    c = client(serve(setup))
    body = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=100,
                **scripted(text))
    r = c.chat.completions.create(**body)
    m = r.choices[0].message
    assert (m.reasoning_content, m.content, r.choices[0].finish_reason) == (reasoning, content, "stop")
    assert reassemble(list(c.chat.completions.create(**body, stream=True)))[0] == message_of(r.choices[0])


def test_reasoning_cut_by_max_tokens_is_all_reasoning(serve) -> None:
    c = client(serve("deepseek_r1"))
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                  max_tokens=6, **scripted("Still thinking about it, a long thought"))
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.reasoning_content and r.choices[0].message.content == ""


def test_reasoning_then_a_call(serve) -> None:
    c = client(serve("qwen3"))
    text = ('<think>\nI need the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "unit": "celsius"}}\n</tool_call>')
    body = dict(model=MODEL, messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=200, **scripted(text))
    r = c.chat.completions.create(**body)
    m = r.choices[0].message
    assert (m.reasoning_content, m.content, r.choices[0].finish_reason) == ("I need the weather.", None, "tool_calls")
    assert [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert reassemble(list(c.chat.completions.create(**body, stream=True)))[0] == message_of(r.choices[0])


def test_enable_thinking_false_reaches_the_template_and_forces_the_call_at_once(serve) -> None:
    server = serve("qwen3")
    c = client(server)
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert prompt_text(server, QUESTION, **off).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # the prompt closed the reasoning: a forced call is written at once, with no reasoning block before it
    r = c.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                  parallel_tool_calls=False, temperature=0, max_tokens=200, extra_body=off)
    m = r.choices[0].message
    assert (m.reasoning_content, m.content, r.choices[0].finish_reason) == (None, None, "tool_calls")
    check_calls(m.tool_calls, {"get_weather", "add", "now"}, ID_PATTERNS["hermes"])


def test_without_a_reasoning_parser_think_tags_are_content(serve) -> None:
    c = client(serve("hermes"))
    r = c.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=100,
                                  **scripted("<think>\nhm\n</think>\n\nHello!"))
    assert r.choices[0].message.content == "<think>\nhm\n</think>\n\nHello!"
    assert "reasoning_content" not in r.choices[0].message.model_extra


# --- refusals: a 400 naming the field, and the server goes on -------------------------------------------------------

BAD_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "strange"}}}}}


@pytest.mark.parametrize("setup, fields, param, fragment", [
    ("hermes", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "tool_choice.function.name: 'get_time' is not one of the request's tools (get_weather, add, now)"),
    ("hermes", {"tool_choice": "required"}, "tool_choice", '"required" needs at least one tool'),
    ("hermes", {"tools": TOOLS, "tool_choice": "always"}, "tool_choice", 'expected "none", "auto", "required"'),
    ("hermes", {"tools": [WEATHER, WEATHER]}, "tools", "tools[1].function.name: 'get_weather' is defined twice"),
    ("hermes", {"tools": [{"type": "code_interpreter"}]}, "tools", "only 'function' tools are supported"),
    ("hermes", {"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools",
     "tools[0].function.name: expected 1 to 64 letters"),
    ("hermes", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools",
     "the schema's type must be 'object'"),
    ("hermes", {"tools": "get_weather"}, "tools", "tools: Input should be a valid list"),
    ("hermes", {"tools": [BAD_TOOL], "tool_choice": "required"}, "tools", "could not be compiled"),
    ("hermes", {"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls", "valid boolean"),
    ("hermes", {"tools": TOOLS, "tool_choice": "required", "use_beam_search": True, "best_of": 2}, "tool_choice",
     "tool_choice: structured output is not supported with beam search"),
    ("hermes", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "response_format and tool_choice both constrain the output"),
    ("hermes", {"tools": [STRICT_WEATHER], "guided_regex": "a+"}, "guided_regex",  # a grammar under auto too
     "guided_regex and tool_choice both constrain the output"),
    ("hermes", {"messages": [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{bad"}}]}]},
     "messages", "messages[1].tool_calls[0].function.arguments: not valid JSON"),
    ("hermes", {"messages": [*QUESTION, {"role": "function", "name": "f", "content": "1"}]},
     "messages", "a \"function\" message answers an assistant's function_call, and none comes before it"),
    ("hermes", {"tools": TOOLS, "functions": [WEATHER["function"]]}, "functions",
     "send either the deprecated functions / function_call or tools / tool_choice, not both"),
    ("hermes", {"functions": [WEATHER["function"]], "function_call": "required"}, "function_call",
     "function_call: expected \"none\", \"auto\" or {\"name\": ...}"),
    ("hermes", {"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs",
     "chat_template_kwargs.enable_thinking: this model's chat template never reads `enable_thinking`"),
    ("qwen3", {"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs",
     "chat_template_kwargs.add_generation_prompt: set by the server"),
    ("hermes", {"reasoning_effort": "high"}, "reasoning_effort",
     "reasoning_effort: this model's chat template never reads `reasoning_effort`"),
    ("unknown_format", {"tools": TOOLS}, "tools", "start the server with --tool-call-parser"),
])
def test_bad_tool_requests_are_400_and_the_server_goes_on(serve, setup: str, fields: dict[str, Any], param: str,
                                                          fragment: str) -> None:
    server = serve(setup)
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 5, **fields}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param) and fragment in error["message"], error
    tools = {"tools": TOOLS} if setup != "unknown_format" else {}
    ok = client(server).chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=3, **tools)
    assert ok.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert server.kv()["in_use"] == 0


def test_the_official_client_sees_the_400(serve) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client(serve("hermes")).chat.completions.create(
            model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}})
    assert e.value.param == "tool_choice" and "'x' is not one of the request's tools" in e.value.message


def test_a_named_parser_serves_a_template_in_an_unknown_format(serve) -> None:
    r = client(serve("unknown_format_named")).chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=200, **scripted(HERMES_TEXT))
    assert [t.function.name for t in r.choices[0].message.tool_calls] == ["get_weather", "now"]


def test_parser_flags() -> None:
    from llmserve.cli import build_parser, dataclass_from_args

    args = build_parser().parse_args(["serve", "--tool-call-parser", "mistral", "--reasoning-parser", "qwen3"])
    config = dataclass_from_args(ServerConfig, args)
    assert (config.tool_call_parser, config.reasoning_parser) == ("mistral", "qwen3")
    with pytest.raises(ValueError, match="tool_call_parser: unknown parser 'qwen'; choose one of hermes"):
        ServerConfig(tool_call_parser="qwen")
    with pytest.raises(ValueError, match="reasoning_parser: unknown parser 'o1'; choose one of qwen3, deepseek_r1"):
        ServerConfig(reasoning_parser="o1")


# --- a real model ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol() -> Iterator[RunningServer]:
    with engine_for(None, num_blocks=256) as handle, running_server(handle, enable_debug_routes=True) as server:
        yield server


@pytest.mark.slow
def test_smollm2_calls_a_tool_and_answers_from_its_result(smol: RunningServer) -> None:
    """SmolLM2's ChatML template shows no tools: they reach it in Hermes' format, and its forced call is read back."""
    c = client(smol)
    name = "SmolLM2-135M-Instruct.Q4_1"
    first = c.chat.completions.create(model=name, messages=QUESTION, tools=[WEATHER], tool_choice="required",
                                      temperature=0, max_tokens=100)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    check_calls(message.tool_calls, {"get_weather"}, ID_PATTERNS["hermes"])
    # the client's message object itself goes back, as OpenAI's examples (and docs/tools.md's) do
    messages = [*QUESTION, message,
                {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "22 degrees celsius, sunny"}]
    second = c.chat.completions.create(model=name, messages=messages, tools=[WEATHER], temperature=0, max_tokens=60)
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.content
    assert second.choices[0].message.tool_calls is None
    assert smol.kv()["in_use"] == 0
