"""An Anthropic Messages API request as the chat request it amounts to (docs/serving.md, "Anthropic Messages API").

`system` is a system message in front; each message's content blocks are the chat's parts (`text`, `image` as an
image_url part), an assistant's `tool_use` blocks its tool_calls (input as JSON arguments) and its `thinking` its
reasoning_content, a user's `tool_result` blocks tool messages before the rest of its turn; `tools` (`name`,
`description`, `input_schema`) are function tools, `tool_choice` auto / any / tool / none the chat's auto /
required / named / none, `stop_sequences` the stop strings, `output_config.format` the response_format,
`thinking` the template's enable_thinking. A last assistant message is a prefill: the answer continues it
(`continue_final_message`). Then the chat route's steps run, and their refusals name this API's fields.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from llmserve.serve.errors import ApiError
from llmserve.serve.openai_params import chat_request
from llmserve.serve.protocol import (
    AnthropicCountTokensRequest,
    AnthropicMessagesRequest,
    ChatCompletionRequest,
    SamplingRequest,
    refuse_unknown_fields,
)

# The fields the OpenAI routes share, by the same name (sampling knobs, vLLM's extras, structured output).
_SHARED = set(SamplingRequest.model_fields) - {"n", "max_tokens", "stop", "stream_options", "response_format",
                                               "prompt_logprobs"}
_REFUSED = {  # field -> why, where sent with a value
    "n": "a message has one answer; send several requests for several",
    "stop": "this API calls it stop_sequences",
    "response_format": "this API calls it output_config.format",
    "stream_options": "an OpenAI field; this API's stream ends with message_delta's usage",
    "prompt_logprobs": "a message has no place for them; the OpenAI routes return them",
    "container": "no code execution container runs here",
    "mcp_servers": "no MCP servers are connected here",
    "context_management": "context editing is not done here",
}
_SERVER_TOOL_TYPES = ("custom", None)


def _refuse(where: str, message: str) -> ApiError:
    return ApiError(400, f"{where}: {message}", param=where.split("[")[0].split(".")[0])


@dataclass
class Conversation:
    chat: ChatCompletionRequest
    origins: list[int | None]  # the request message each chat message came from (None: the system prompt)

    def where(self, index: int) -> str:
        """What the client calls chat message `index`."""
        origin = self.origins[index] if index < len(self.origins) else None
        return "system" if origin is None else f"messages[{origin}]"


def check_fields(body: AnthropicMessagesRequest) -> None:
    refuse_unknown_fields(body)
    for name, reason in _REFUSED.items():
        value = getattr(body, name)
        if value not in (None, [], {}, "") and not (name == "n" and value == 1):
            raise _refuse(name, reason)
    if body.max_tokens < 1:
        raise _refuse("max_tokens", f"must be >= 1, got {body.max_tokens}")


def conversation(body: AnthropicMessagesRequest | AnthropicCountTokensRequest) -> Conversation:
    messages, origins = chat_messages(body.system, body.messages)
    variables = dict(body.chat_template_kwargs or {})
    thinking = _thinking(body.thinking)
    if thinking and variables.get("enable_thinking", thinking["enable_thinking"]) != thinking["enable_thinking"]:
        raise _refuse("thinking", "chat_template_kwargs.enable_thinking says otherwise; send one of them")
    variables.update(thinking)
    output = body.output_config or {}
    unknown = set(output) - {"effort", "format"}
    if unknown:
        raise _refuse("output_config", f"unknown field {sorted(unknown)[0]!r} (it takes effort and format)")
    tools, parallel = chat_tools(body.tools), _parallel(body.tool_choice)
    fields: dict[str, Any] = {}
    if isinstance(body, AnthropicMessagesRequest):
        fields = {name: getattr(body, name) for name in _SHARED if name in body.model_fields_set}
        fields.update(max_completion_tokens=body.max_tokens, stop=body.stop_sequences)
    fields.update(model=body.model, messages=messages, tools=tools, tool_choice=chat_tool_choice(body.tool_choice),
                  parallel_tool_calls=parallel, response_format=_format(output.get("format")),
                  reasoning_effort=output.get("effort"), chat_template_kwargs=variables or None,
                  continue_final_message=messages[-1]["role"] == "assistant")  # a prefill (empty ones dropped)
    chat = chat_request(fields)
    return Conversation(chat, origins)


def _thinking(thinking: dict[str, Any] | None) -> dict[str, Any]:
    """The template variable a thinking setting is (Qwen3's enable_thinking); the chat path refuses it for a template
    that does not read it. A thinking budget is refused: nothing here could hold the reasoning to it."""
    if thinking is None:
        return {}
    kind = thinking.get("type")
    if kind == "enabled":
        raise _refuse("thinking", "a thinking budget (budget_tokens) cannot be enforced here; send {\"type\": "
                                  "\"adaptive\"} to let the model think, or {\"type\": \"disabled\"}")
    if kind not in ("adaptive", "disabled") or set(thinking) - {"type", "display"}:
        raise _refuse("thinking", f"expected {{\"type\": \"adaptive\"}} or {{\"type\": \"disabled\"}}, got {thinking!r}")
    if thinking.get("display") not in (None, "summarized"):
        raise _refuse("thinking.display", "the reasoning comes whole in the thinking blocks; it is not left out here")
    return {"enable_thinking": kind == "adaptive"}


def _format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict) \
            or set(fmt) - {"type", "schema"}:
        raise _refuse("output_config.format", "expected {\"type\": \"json_schema\", \"schema\": {...}}")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Client tools (`name`, `description`, `input_schema`, `strict`) as the chat's function tools; Anthropic's
    server tools (web search, bash, text editor, computer use, code execution, ...) are refused: nothing runs them
    here."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else "?"
        if kind not in _SERVER_TOOL_TYPES:
            raise _refuse(f"tools[{i}]", f"a {kind!r} tool needs a service this server does not run; only client "
                                         "tools (name, description, input_schema) can be called here")
        unknown = set(tool) - {"type", "name", "description", "input_schema", "cache_control", "strict"}
        if unknown:
            raise _refuse(f"tools[{i}]", f"unknown field {sorted(unknown)[0]!r}")
        if not isinstance(tool.get("input_schema"), dict):
            raise _refuse(f"tools[{i}].input_schema", "a tool needs its input_schema, a JSON schema object")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        for key in ("description", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: dict[str, Any] | None) -> str | dict[str, Any] | None:
    """{"type": "auto" | "any" | "tool" (with "name") | "none"} -> "auto" | "required" | a named function | "none"."""
    if choice is None:
        return None
    kind = choice.get("type")
    unknown = set(choice) - {"type", "name", "disable_parallel_tool_use"}
    if unknown:
        raise _refuse("tool_choice", f"unknown field {sorted(unknown)[0]!r}")
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if kind in ("auto", "any", "none") and "name" not in choice:
        return {"auto": "auto", "any": "required", "none": "none"}[kind]
    raise _refuse("tool_choice", "expected {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"tool\", \"name\": "
                                 f"...}} or {{\"type\": \"none\"}}, got {choice!r}")


def _parallel(choice: dict[str, Any] | None) -> bool | None:
    """disable_parallel_tool_use: true -> at most one call (parallel_tool_calls false)."""
    if choice is None or choice.get("disable_parallel_tool_use") is None:
        return None
    if not isinstance(choice["disable_parallel_tool_use"], bool):
        raise _refuse("tool_choice.disable_parallel_tool_use", "must be a boolean")
    return not choice["disable_parallel_tool_use"]


def chat_messages(system: str | list[dict[str, Any]] | None,
                  messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[int | None]]:
    """The chat messages, and the request message each came from (None: the system prompt)."""
    if not messages:
        raise _refuse("messages", "must not be empty")
    out: list[dict[str, Any]] = []
    origins: list[int | None] = []
    if system:
        out.append({"role": "system", "content": system if isinstance(system, str) else _text(system, "system")})
        origins.append(None)
    calls: dict[str, str] = {}  # tool_use id -> name, for the results that answer them
    for i, role, blocks in _turns(messages):
        where = f"messages[{i}]"
        converted = _assistant(blocks, where, calls) if role == "assistant" else _user(blocks, where, calls)
        out += converted
        origins += [i] * len(converted)
    if len(out) > 1 and out[-1]["role"] == "assistant" and not out[-1]["content"] and not out[-1].get("tool_calls"):
        out, origins = out[:-1], origins[:-1]  # an empty last assistant message: no prefill
    return out, origins


def _turns(messages: list[dict[str, Any]]) -> list[tuple[int, str, list[Any]]]:
    """(index of its first message, role, blocks) per turn: consecutive messages of one role are one turn, as
    Anthropic combines them (templates that need the roles to alternate would refuse them apart)."""
    turns: list[tuple[int, str, list[Any]]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise _refuse(f"{where}.role", f"must be user or assistant, got {role!r} (the system prompt is `system`)")
        if set(m) - {"role", "content"}:
            raise _refuse(where, f"unknown field {sorted(set(m) - {'role', 'content'})[0]!r}")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise _refuse(f"{where}.content", "a message's content is a string or a list of content blocks")
        for j, b in enumerate(blocks):
            _check_block(b, f"{where}.content[{j}]")
        if turns and turns[-1][1] == role:
            turns[-1][2].extend(blocks)
        else:
            turns.append((i, role, list(blocks)))
    return turns


_BLOCK_KEYS = {"text": {"text", "citations"}, "image": {"source"}, "thinking": {"thinking", "signature"},
               "tool_use": {"id", "name", "input"}, "tool_result": {"tool_use_id", "content", "is_error"}}


def _check_block(block: Any, where: str) -> None:
    """A block's fields beyond its kind's (and cache_control, automatic here) are refused; citations only empty."""
    if not isinstance(block, dict):
        raise _refuse(where, "a content block is an object with a type")
    allowed = _BLOCK_KEYS.get(block.get("type"), set(block)) | {"type", "cache_control"}
    unknown = [k for k in block if k not in allowed and block[k] is not None]
    if unknown:
        raise _refuse(where, f"unknown field {unknown[0]!r} in a {block.get('type')} block")
    if block.get("citations"):
        raise _refuse(where, "citations are not written here")


def _text(blocks: list[Any], where: str) -> str:
    texts = []
    for j, b in enumerate(blocks):
        if not (isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)):
            raise _refuse(f"{where}[{j}]", "expected a text block {\"type\": \"text\", \"text\": ...}")
        texts.append(b["text"])
    return "".join(texts)


def _assistant(blocks: list[Any], where: str, calls: dict[str, str]) -> list[dict[str, Any]]:
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for j, b in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            message["content"] += b["text"]
        elif kind == "thinking" and isinstance(b.get("thinking"), str):
            message["reasoning_content"] = message.get("reasoning_content", "") + b["thinking"]
        elif kind == "tool_use":
            if not (isinstance(b.get("id"), str) and isinstance(b.get("name"), str) and isinstance(b.get("input"), dict)):
                raise _refuse(at, "a tool_use block needs id, name (strings) and input (an object)")
            calls[b["id"]] = b["name"]
            message.setdefault("tool_calls", []).append(
                {"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": json.dumps(b["input"])}})
        else:
            raise _refuse(at, f"an assistant's content blocks are text, thinking or tool_use; got {kind!r}"
                              + (" (redacted thinking cannot be read here)" if kind == "redacted_thinking" else ""))
    if message.get("tool_calls") and not message["content"]:
        message["content"] = None
    return [message]


def _user(blocks: list[Any], where: str, calls: dict[str, str]) -> list[dict[str, Any]]:
    """Tool results first (as tool messages, in order), then the turn's text and images as one user message."""
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, b in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "tool_result":
            results.append(_tool_result(b, at, calls))
        elif kind in ("text", "image"):
            parts.append(_part(b, at))
        else:
            raise _refuse(at, f"a user's content blocks are text, image or tool_result; got {kind!r}"
                              + (" (documents are not read here)" if kind == "document" else ""))
    out = results
    if parts:
        text_only = all(p["type"] == "text" for p in parts)
        out = out + [{"role": "user", "content": "".join(p["text"] for p in parts) if text_only else parts}]
    if not out:
        raise _refuse(f"{where}.content", "must not be empty")
    return out


def _part(b: dict[str, Any], at: str) -> dict[str, Any]:
    if b["type"] == "text":
        if not isinstance(b.get("text"), str):
            raise _refuse(at, "a text block needs its text, a string")
        return {"type": "text", "text": b["text"]}
    source = b.get("source")
    if isinstance(source, dict) and source.get("type") == "base64" and isinstance(source.get("data"), str) \
            and isinstance(source.get("media_type"), str):
        return {"type": "image_url", "image_url": {"url": f"data:{source['media_type']};base64,{source['data']}"}}
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise _refuse(f"{at}.source", "an image's source is {\"type\": \"base64\", \"media_type\", \"data\"} or "
                                  "{\"type\": \"url\", \"url\"}; uploaded files are not available here")


def _tool_result(b: dict[str, Any], at: str, calls: dict[str, str]) -> dict[str, Any]:
    """A tool message; an error result says so in its text (the chat has no field for it)."""
    call_id = b.get("tool_use_id")
    if call_id not in calls:
        raise _refuse(f"{at}.tool_use_id", f"no tool_use block with id {call_id!r} comes before this result")
    content = b.get("content", "")
    if isinstance(content, list):
        content = _text(content, f"{at}.content")
    if not isinstance(content, str):
        raise _refuse(f"{at}.content", "a tool result's content is a string or text blocks")
    if b.get("is_error"):
        content = "Error: " + content
    return {"role": "tool", "tool_call_id": call_id, "name": calls[call_id], "content": content}
