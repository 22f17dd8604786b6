"""A request's tools, tool_choice and parallel_tool_calls, checked and normalized into `ToolRequest`.

OpenAI's shapes:

    tools: [{"type": "function", "function": {"name", "description"?, "parameters"? (JSON schema), "strict"?}}]
    tool_choice: "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
                 | {"type": "allowed_tools", "allowed_tools": {"mode": "auto" | "required", "tools": [<named refs>]}}

Only the shape is checked here (InvalidRequestError naming the field); whether a parameters schema compiles is
xgrammar's call, made when a grammar is built from it (tools/grammar.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from llmserve.errors import InvalidRequestError

# OpenAI's limits: at most 128 functions, names of [a-zA-Z0-9_-]{1,64}. The dot is also taken (namespaced names
# such as MCP's "server.tool" reach vLLM unchanged); every name is JSON-escaped wherever it is written.
MAX_TOOLS = 128
NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# The tools' JSON is rendered into every prompt of the request and their schemas compiled: a bound on both costs.
MAX_TOOLS_CHARS = 256 * 1024

# A function that declares no parameters takes none (OpenAI: "omitting parameters defines a function with an empty
# parameter list"), so a forced call writes `{}`.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any] | None  # as the client sent it; None when left out
    strict: bool | None

    @property
    def schema(self) -> dict[str, Any]:
        """The JSON schema a call's arguments must match."""
        return self.parameters if self.parameters is not None else NO_PARAMETERS

    def to_openai(self) -> dict[str, Any]:
        """The tool as chat templates expect it (transformers passes `tools` through as given)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    """mode "none": no calls, and the template is not shown the tools (a model told of tools it may not call
    writes calls we would return as text); "auto": the model chooses; "required": at least one call; "function":
    exactly one call of `allowed[0]`. `allowed`: the names the model may call (all tools unless tool_choice narrows
    them with a named function or allowed_tools)."""

    tools: tuple[Tool, ...]
    mode: str
    allowed: tuple[str, ...]
    parallel_tool_calls: bool = True

    @property
    def allowed_tools(self) -> tuple[Tool, ...]:
        return tuple(t for t in self.tools if t.name in self.allowed)

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        if self.mode == "none" or not self.tools:
            return None
        return [t.to_openai() for t in self.tools]


def parse_tool_request(tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None) -> ToolRequest | None:
    """None when the request has no tools and asks for none (tool_choice unset, "none" or "auto")."""
    parsed = parse_tools(tools)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequestError(f"parallel_tool_calls: expected true or false, got {parallel_tool_calls!r}",
                                  param="parallel_tool_calls")
    mode, allowed = parse_tool_choice(tool_choice, parsed)
    if not parsed:
        return None
    return ToolRequest(parsed, mode, allowed, parallel_tool_calls is not False)


def parse_tools(tools: Any) -> tuple[Tool, ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise InvalidRequestError(f"tools: expected a list of function tools, got {type(tools).__name__}",
                                  param="tools")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}", param="tools")
    try:
        size = len(json.dumps(tools, ensure_ascii=False))
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"tools: not serializable as JSON: {e}", param="tools") from None
    if size > MAX_TOOLS_CHARS:
        raise InvalidRequestError(f"tools: {size} characters of JSON, over the limit of {MAX_TOOLS_CHARS}",
                                  param="tools")
    parsed = tuple(_parse_tool(t, f"tools[{i}]") for i, t in enumerate(tools))
    seen: set[str] = set()
    for i, tool in enumerate(parsed):
        if tool.name in seen:
            raise InvalidRequestError(f"tools[{i}].function.name: {tool.name!r} is defined twice; tool names must be "
                                      "unique", param="tools")
        seen.add(tool.name)
    return parsed


def parse_tool_choice(tool_choice: Any, tools: tuple[Tool, ...]) -> tuple[str, tuple[str, ...]]:
    """(mode, allowed names). Unset means "auto" with tools and "none" without, as OpenAI."""
    names = tuple(t.name for t in tools)
    if tool_choice is None:
        return ("auto" if tools else "none"), names
    if tool_choice in ("none", "auto"):
        return tool_choice, names
    if tool_choice == "required":
        if not tools:
            raise InvalidRequestError('tool_choice: "required" needs at least one tool in `tools`',
                                      param="tool_choice")
        return "required", names
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = _named(tool_choice, "tool_choice")
        _check_known(name, names, "tool_choice.function.name")
        return "function", (name,)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "allowed_tools":
        return _allowed_tools(tool_choice.get("allowed_tools"), names)
    raise InvalidRequestError('tool_choice: expected "none", "auto", "required", {"type": "function", "function": '
                              '{"name": ...}} or {"type": "allowed_tools", ...}, got ' + repr(tool_choice)[:200],
                              param="tool_choice")


def _parse_tool(tool: Any, where: str) -> Tool:
    if not isinstance(tool, dict):
        raise InvalidRequestError(f"{where}: expected an object, got {type(tool).__name__}", param="tools")
    if tool.get("type", "function") != "function":
        raise InvalidRequestError(f"{where}.type: only 'function' tools are supported, got {tool.get('type')!r}",
                                  param="tools")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidRequestError(f"{where}.function: expected an object with `name` (and `description`, "
                                  "`parameters`, `strict`)", param="tools")
    name = function.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise InvalidRequestError(f"{where}.function.name: expected 1 to 64 letters, digits, '_', '-' or '.', got "
                                  f"{name!r}", param="tools")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequestError(f"{where}.function.description: expected a string", param="tools")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequestError(f"{where}.function.strict: expected true or false, got {strict!r}", param="tools")
    parameters = function.get("parameters")
    if parameters is not None:
        _check_parameters(parameters, f"{where}.function.parameters")
    return Tool(name, description, parameters, strict)


def _check_parameters(schema: Any, where: str) -> None:
    """The shape of a function's JSON schema: an object schema (arguments are always a JSON object)."""
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{where}: expected a JSON schema object, got {type(schema).__name__}",
                                  param="tools")
    kind = schema.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and kind == ["object"]):
        raise InvalidRequestError(f"{where}.type: a function's arguments are a JSON object, so the schema's type "
                                  f"must be 'object', got {kind!r}", param="tools")
    properties = schema.get("properties")
    if properties is not None and (not isinstance(properties, dict)
                                   or not all(isinstance(v, (dict, bool)) for v in properties.values())):
        raise InvalidRequestError(f"{where}.properties: expected an object mapping each name to a schema",
                                  param="tools")
    required = schema.get("required")
    if required is not None and (not isinstance(required, list) or not all(isinstance(r, str) for r in required)):
        raise InvalidRequestError(f"{where}.required: expected a list of property names", param="tools")


def _named(choice: dict[str, Any], where: str) -> str:
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f'{where}: a named choice is {{"type": "function", "function": {{"name": ...}}}}',
                                  param="tool_choice")
    return name


def _check_known(name: str, names: tuple[str, ...], where: str) -> None:
    if name not in names:
        known = ", ".join(names) if names else "none: `tools` is empty"
        raise InvalidRequestError(f"{where}: {name!r} is not one of the request's tools ({known})",
                                  param="tool_choice")


def _allowed_tools(spec: Any, names: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    where = "tool_choice.allowed_tools"
    if not isinstance(spec, dict) or spec.get("mode") not in ("auto", "required") or not isinstance(
            spec.get("tools"), list) or not spec["tools"]:
        raise InvalidRequestError(f'{where}: expected {{"mode": "auto" | "required", "tools": [{{"type": "function", '
                                  '"function": {"name": ...}}, ...]}', param="tool_choice")
    allowed: list[str] = []
    for i, ref in enumerate(spec["tools"]):
        if not isinstance(ref, dict) or ref.get("type") != "function":
            raise InvalidRequestError(f"{where}.tools[{i}]: only function tools can be allowed", param="tool_choice")
        name = _named(ref, f"{where}.tools[{i}]")
        _check_known(name, names, f"{where}.tools[{i}].function.name")
        allowed.append(name)
    return spec["mode"], tuple(n for n in names if n in allowed)
