"""tools / tool_choice / parallel_tool_calls: what is accepted, normalized, and refused (naming the field)."""

from __future__ import annotations

import pytest

from llmserve import InvalidRequestError
from llmserve.tools import parse_tool_request
from llmserve.tools.definitions import MAX_TOOLS, NO_PARAMETERS, Tool


def fn(name: str, parameters: dict | None = None, **extra) -> dict:
    function = {"name": name, **extra}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


WEATHER = fn("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
             description="Current weather", strict=True)
TIME = fn("get_time")


def test_tools_and_default_choice():
    req = parse_tool_request([WEATHER, TIME])
    assert req.mode == "auto" and req.allowed == ("get_weather", "get_time") and req.parallel_tool_calls
    assert req.tools[0] == Tool("get_weather", "Current weather", WEATHER["function"]["parameters"], True)
    assert req.tools[1].schema == NO_PARAMETERS  # no parameters: the call takes none
    assert req.template_tools == [WEATHER, TIME]  # as sent


def test_no_tools():
    assert parse_tool_request(None) is None
    assert parse_tool_request([], "none") is None
    assert parse_tool_request(None, "auto", False) is None


@pytest.mark.parametrize("choice, mode, allowed", [
    ("none", "none", ("get_weather", "get_time")),
    ("required", "required", ("get_weather", "get_time")),
    ({"type": "function", "function": {"name": "get_time"}}, "function", ("get_time",)),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "get_time"}}]}}, "required", ("get_time",)),
])
def test_tool_choice(choice, mode, allowed):
    req = parse_tool_request([WEATHER, TIME], choice, False)
    assert (req.mode, req.allowed, req.parallel_tool_calls) == (mode, allowed, False)
    assert [t.name for t in req.allowed_tools] == list(allowed)
    assert (req.template_tools is None) == (mode == "none")  # a model may not call is not shown the tools


@pytest.mark.parametrize("tools, choice, message, param", [
    ("get_weather", None, "tools: expected a list of function tools, got str", "tools"),
    ([WEATHER, WEATHER], None, r"tools\[1\].function.name: 'get_weather' is defined twice", "tools"),
    ([{"type": "code_interpreter"}], None, r"tools\[0\].type: only 'function' tools are supported", "tools"),
    ([{"type": "function"}], None, r"tools\[0\].function: expected an object with `name`", "tools"),
    ([fn("get weather")], None, r"tools\[0\].function.name: expected 1 to 64 letters", "tools"),
    ([fn("x" * 65)], None, r"tools\[0\].function.name", "tools"),
    ([fn("f", description=3)], None, r"tools\[0\].function.description: expected a string", "tools"),
    ([fn("f", strict="yes")], None, r"tools\[0\].function.strict: expected true or false", "tools"),
    ([fn("f", [1])], None, r"tools\[0\].function.parameters: expected a JSON schema object, got list", "tools"),
    ([fn("f", {"type": "string"})], None, r"parameters.type: .*must be 'object', got 'string'", "tools"),
    ([fn("f", {"type": "object", "properties": []})], None, r"parameters.properties: expected an object", "tools"),
    ([fn("f", {"type": "object", "required": "a"})], None, r"parameters.required: expected a list", "tools"),
    ([fn(f"f{i}") for i in range(MAX_TOOLS + 1)], None, f"tools: at most {MAX_TOOLS} tools, got {MAX_TOOLS + 1}",
     "tools"),
    ([fn("f", {"type": "object", "description": "x" * 300_000})], None, "tools: .* characters of JSON, over the limit",
     "tools"),
    ([fn("f", {"type": "object", "default": {1, 2}})], None, "tools: not serializable as JSON", "tools"),
    (None, "required", 'tool_choice: "required" needs at least one tool', "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "get_time"}},
     "tool_choice.function.name: 'get_time' is not one of the request's tools \\(get_weather\\)", "tool_choice"),
    (None, {"type": "function", "function": {"name": "get_time"}}, "`tools` is empty", "tool_choice"),
    ([WEATHER], {"type": "function"}, 'tool_choice: a named choice is {"type": "function"', "tool_choice"),
    ([WEATHER], "always", 'tool_choice: expected "none", "auto", "required"', "tool_choice"),
    ([WEATHER], {"type": "allowed_tools", "allowed_tools": {"mode": "any", "tools": []}},
     "tool_choice.allowed_tools: expected", "tool_choice"),
    ([WEATHER], {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "nope"}}]}},
     r"tool_choice.allowed_tools.tools\[0\].function.name: 'nope' is not one", "tool_choice"),
])
def test_refusals_name_the_field(tools, choice, message, param):
    with pytest.raises(InvalidRequestError, match=message) as e:
        parse_tool_request(tools, choice)
    assert e.value.param == param


def test_parallel_tool_calls_must_be_a_bool():
    with pytest.raises(InvalidRequestError, match="parallel_tool_calls: expected true or false, got 'no'"):
        parse_tool_request([WEATHER], None, "no")
