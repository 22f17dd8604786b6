"""A Responses API request as the chat request it amounts to (docs/serving.md, "Responses API").

The Responses API is the chat API with other shapes: `input` items (messages, function calls, their outputs,
reasoning) are chat messages, `instructions` a system message in front, flat function tools the chat's nested
ones, `text.format` the response_format, `max_output_tokens` max_completion_tokens. So a request becomes a
`ChatCompletionRequest` and runs the chat route's steps (template, tools, grammar, sampling): what the chat API
honours or refuses, this one does too. Fields only this API has are checked here, each refusal naming the field as
the client spelled it (`input[2].content[0]`, `tools[1]`, `text.format`).

`previous_response_id` continues a stored conversation: its messages (the earlier inputs and outputs, without the
earlier instructions, as OpenAI documents) come before this input.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from llmserve.serve.errors import ApiError
from llmserve.serve.openai_params import chat_request
from llmserve.serve.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ResponsesRequest,
    SamplingRequest,
    refuse_unknown_fields,
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# The fields the two APIs share, by the same name (the sampling knobs, vLLM's extras, structured output).
_SHARED = set(SamplingRequest.model_fields) - {"n", "max_tokens", "stream_options", "response_format"}
_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _refuse(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param.split("[")[0].split(".")[0])


@dataclass
class Conversation:
    """What one request runs, and what a stored response keeps to be continued (the whole of it, whatever this
    request's truncation left out of its prompt)."""

    chat: ChatCompletionRequest  # the request as the chat route takes it: instructions, then `turns[start:]`
    num_front: int  # the instructions' messages in front (0 or 1)
    history: list[dict[str, Any]]  # chat messages before this input (previous_response_id), without instructions
    messages: list[dict[str, Any]]  # this input's chat messages
    origins: list[int]  # the input item each of `messages` came from
    all_chat: list[ChatMessage] = field(default_factory=list)  # instructions + history + messages, validated
    start: int = 0  # truncation "auto": turns (history + messages) left out of the prompt from the front

    def turn_starts(self) -> list[int]:
        """Where the prompt may start (truncation "auto"): 0, and each later user message, so that what is kept
        opens with a user turn and no tool result loses its call."""
        turns = self.history + self.messages
        return [0] + [i for i in range(1, len(turns)) if turns[i]["role"] == "user"]

    def starting_at(self, start: int) -> Conversation:
        messages = self.all_chat[:self.num_front] + self.all_chat[self.num_front + start:]
        return dataclasses.replace(self, chat=self.chat.model_copy(update={"messages": messages}), start=start)

    def where(self, index: int) -> str:
        """What the client calls the prompt's chat message `index`."""
        if index < self.num_front:
            return "instructions"
        turn = index - self.num_front + self.start
        if turn < len(self.history):
            return "previous_response_id"
        return f"input[{self.origins[turn - len(self.history)]}]"


def conversation(body: ResponsesRequest, history: list[dict[str, Any]]) -> Conversation:
    """The chat request for `body` (its own fields checked: `check_fields`) after `history` (a stored response's
    conversation; [] when none)."""
    known_calls = {c["id"]: c["function"]["name"] for m in history for c in m.get("tool_calls") or []}
    messages, origins = input_messages(body.input, known_calls)
    front = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fields: dict[str, Any] = {name: getattr(body, name) for name in _SHARED if name in body.model_fields_set}
    fields.update(
        model=body.model, messages=front + history + messages, max_completion_tokens=body.max_output_tokens,
        tools=chat_tools(body.tools), tool_choice=chat_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls, response_format=response_format(body.text),
        reasoning_effort=(body.reasoning or {}).get("effort"), chat_template_kwargs=body.chat_template_kwargs,
        logprobs=logprobs_wanted(body), top_logprobs=body.top_logprobs if logprobs_wanted(body) else None)
    chat = chat_request(fields)
    return Conversation(chat, len(front), history, messages, origins, list(chat.messages))


def logprobs_wanted(body: ResponsesRequest) -> bool:
    return LOGPROBS_INCLUDE in (body.include or [])


# What this API documents and this server cannot do: refused when sent with a value.
_REFUSALS = {
    "background": "background responses are not supported; stream the response instead (stream=true)",
    "prompt": "stored prompt templates are not available on this server; send the input itself",
    "conversation": "the Conversations API is not served here; continue with previous_response_id",
}


def check_fields(body: ResponsesRequest) -> None:
    """This API's own fields, before the request becomes a chat one (whose refusals are renamed to this API's)."""
    refuse_unknown_fields(body)
    for name, reason in _REFUSALS.items():
        if getattr(body, name) not in (None, False, {}, ""):
            raise _refuse(name, reason)
    if body.n != 1:
        raise _refuse("n", "a response has one output; send several requests for several answers")
    if body.max_tokens is not None:
        raise _refuse("max_tokens", "this API calls it max_output_tokens")
    if body.response_format is not None:
        raise _refuse("response_format", "this API calls it text.format ({\"format\": {\"type\": ...}})")
    if body.prompt_logprobs is not None:
        raise _refuse("prompt_logprobs", "a Response has no place for them; the chat and completions APIs return them")
    if body.stream_options is not None and body.stream_options.continuous_usage_stats:
        raise _refuse("stream_options", "continuous_usage_stats: the usage comes with the response's last event")
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise _refuse("max_output_tokens", f"must be >= 1, got {body.max_output_tokens}")
    for i, name in enumerate(body.include or []):
        if name != LOGPROBS_INCLUDE:
            raise _refuse(f"include[{i}]", f"{name!r} is not available here (the only one is {LOGPROBS_INCLUDE!r}: "
                                            "no built-in tools run here, and reasoning is not encrypted)")
    if body.top_logprobs is not None and not logprobs_wanted(body):
        raise _refuse("top_logprobs", f"logprobs come back only when include has {LOGPROBS_INCLUDE!r}; add it")
    if body.max_tool_calls is not None and body.max_tool_calls < 1:
        raise _refuse("max_tool_calls", f"must be >= 1, got {body.max_tool_calls}")
    reasoning = body.reasoning or {}
    unknown = set(reasoning) - {"effort", "summary", "generate_summary"}
    if unknown:
        raise _refuse("reasoning", f"unknown field {sorted(unknown)[0]!r} (it takes effort and summary)")
    for name in ("summary", "generate_summary"):
        if reasoning.get(name) is not None:
            raise _refuse(f"reasoning.{name}", "this server writes no summaries of the reasoning; a reasoning "
                                               "model's reasoning comes whole as the reasoning item's content")


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format -> the chat's response_format: {"type": "json_schema", name, schema, strict, description} is
    {"type": "json_schema", "json_schema": {...}} there. The shape of the schema is checked by the chat's path."""
    if text is None:
        return None
    unknown = set(text) - {"format", "verbosity"}
    if unknown:
        raise _refuse("text", f"unknown field {sorted(unknown)[0]!r} (it takes format)")
    if text.get("verbosity") not in (None, "medium"):
        raise _refuse("text.verbosity", "this server's models take no verbosity setting")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise _refuse("text.format", "expected {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                                     "{\"type\": \"json_schema\", \"name\": ..., \"schema\": {...}}")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    if not isinstance(fmt.get("schema"), dict):
        raise _refuse("text.format.schema", "a json_schema format needs its schema, a JSON object")
    inner = {k: v for k, v in fmt.items() if k != "type"}
    inner.setdefault("name", "response")
    return {"type": "json_schema", "json_schema": inner}


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Flat function tools ({"type": "function", "name", "description", "parameters", "strict"}) as the chat's
    nested ones, strict unless they say `"strict": false` (OpenAI's default here); the built-in tools (web search, file search, computer use, MCP, ...) are refused: nothing runs
    them here."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise _refuse(f"tools[{i}]", f"only function tools can be called here; a {kind!r} tool needs a "
                                         "service this server does not run")
        if not isinstance(tool.get("name"), str):
            raise _refuse(f"tools[{i}].name", "a function tool needs its name, a string")
        unknown = set(tool) - {"type", "name", "description", "parameters", "strict"}
        if unknown:
            raise _refuse(f"tools[{i}]", f"unknown field {sorted(unknown)[0]!r}")
        function = {k: v for k, v in tool.items() if k != "type" and v is not None}
        function.setdefault("strict", True)  # this API's default (the chat's is false): the arguments follow
        out.append({"type": "function", "function": function})  # the schema, by grammar
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """"none" | "auto" | "required" | {"type": "function", "name"} | {"type": "allowed_tools", "mode", "tools":
    [{"type": "function", "name"}]} -> the chat's forms (whose checks name what is wrong in them)."""
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") == "function" and set(choice) == {"type", "name"}:
        return {"type": "function", "function": {"name": choice["name"]}}
    if choice.get("type") == "allowed_tools" and set(choice) <= {"type", "mode", "tools"}:
        refs = choice.get("tools")
        refs = [{"type": r.get("type"), "function": {"name": r.get("name")}} if isinstance(r, dict) else r
                for r in refs] if isinstance(refs, list) else refs
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.get("mode"), "tools": refs}}
    raise _refuse("tool_choice", "expected \"none\", \"auto\", \"required\", {\"type\": \"function\", \"name\": "
                                 "...} or {\"type\": \"allowed_tools\", \"mode\": ..., \"tools\": [...]}; got "
                                 f"{choice!r} (built-in tools are not available here)")


def input_messages(items: str | list[dict[str, Any]],
                   known_calls: dict[str, str]) -> tuple[list[dict[str, Any]], list[int]]:
    """The input as chat messages, and the item each came from. A function_call item joins the assistant message
    before it (or starts one); a function_call_output answers a call made earlier in the conversation (OpenAI
    refuses one that does not); a reasoning item's text goes with the assistant message right after it (and is
    dropped if another turn comes first). `known_calls` (call id -> function name) gains the calls found."""
    if not items:
        raise _refuse("input", "must not be empty")
    if isinstance(items, str):
        return [{"role": "user", "content": items}], [0]
    messages: list[dict[str, Any]] = []
    origins: list[int] = []
    reasoning: str | None = None
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind not in _ITEM_TYPES:
            raise _refuse(where, f"items are of type {', '.join(_ITEM_TYPES)}; got {kind!r}"
                                 + (" (send the item itself: stored items are not referenced here)"
                                    if kind == "item_reference" else ""))
        _check_keys(item, _ITEM_KEYS[kind], where)
        if kind == "reasoning":
            reasoning = (reasoning or "") + _reasoning_text(item, where)
            continue
        if kind == "function_call":
            call = _function_call(item, where)
            known_calls[call["id"]] = call["function"]["name"]
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                message = last
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                messages.append(message)
                origins.append(i)
        else:
            message = _message(item, where) if kind == "message" else _call_output(item, where, known_calls)
            messages.append(message)
            origins.append(i)
        if message["role"] == "assistant" and reasoning is not None:
            message["reasoning_content"] = message.get("reasoning_content", "") + reasoning
        reasoning = None  # reasoning belongs to the assistant turn right after it
    return messages, origins


_ITEM_KEYS = {"message": {"type", "role", "content", "id", "status", "phase"},
              "function_call": {"type", "call_id", "name", "arguments", "id", "status", "namespace"},
              "function_call_output": {"type", "call_id", "output", "id", "status"},
              "reasoning": {"type", "summary", "content", "encrypted_content", "id", "status"}}


def _check_keys(item: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = [k for k, v in item.items() if k not in allowed and v not in (None, [], {}, "")]
    if unknown:
        raise _refuse(where, f"unknown field {sorted(unknown)[0]!r} in a {item.get('type', 'message')} item")


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise _refuse(f"{where}.role", f"must be user, assistant, system or developer, got {role!r}")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": "system" if role == "developer" else role, "content": content}
    if not isinstance(content, list):
        raise _refuse(f"{where}.content", "a message's content is a string or a list of content parts")
    parts = [_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)]
    if role == "assistant" or all(p["type"] == "text" for p in parts):
        if any(p["type"] != "text" for p in parts):
            raise _refuse(f"{where}.content", "an assistant message holds text (output_text or refusal parts)")
        return {"role": "system" if role == "developer" else role, "content": "".join(p["text"] for p in parts)}
    return {"role": "system" if role == "developer" else role, "content": parts}


def _part(part: Any, where: str) -> dict[str, Any]:
    """A content part as the chat's: input_text / output_text / refusal -> text, input_image -> image_url."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text"):
        if not isinstance(part.get("text"), str):
            raise _refuse(where, f"an {kind} part needs its text, a string")
        return {"type": "text", "text": part["text"]}
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return {"type": "text", "text": part["refusal"]}
    if kind == "input_image":
        if part.get("file_id") is not None or not isinstance(part.get("image_url"), str):
            raise _refuse(where, "an input_image part needs its image_url (an http(s) or data: URL); uploaded "
                                 "files (file_id) are not available here")
        return {"type": "image_url", "image_url": {"url": part["image_url"]}}
    raise _refuse(where, f"content parts are input_text, input_image, output_text or refusal; got {kind!r}"
                         + (" (files and audio are not read here)" if kind in ("input_file", "input_audio") else ""))


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    if item.get("encrypted_content") is not None:
        raise _refuse(f"{where}.encrypted_content", "this server cannot read encrypted reasoning (it writes none)")
    texts = []
    for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        for j, part in enumerate(item.get(key) or []):
            if not (isinstance(part, dict) and part.get("type") == part_type and isinstance(part.get("text"), str)):
                raise _refuse(f"{where}.{key}[{j}]", f"expected {{\"type\": \"{part_type}\", \"text\": ...}}")
            texts.append(part["text"])
        if texts:
            break  # the reasoning itself where it is given, else its summary
    return "".join(texts)


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise _refuse(f"{where}.{key}", "a function_call item needs call_id, name and arguments, strings")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def _call_output(item: dict[str, Any], where: str, known_calls: dict[str, str]) -> dict[str, Any]:
    call_id = item.get("call_id")
    if call_id not in known_calls:
        raise _refuse(f"{where}.call_id", f"no function call with call_id {call_id!r} comes before this output "
                                          "(send the function_call item, or continue with previous_response_id)")
    output = item.get("output")
    if isinstance(output, list):
        parts = [_part(p, f"{where}.output[{j}]") for j, p in enumerate(output)]
        if any(p["type"] != "text" for p in parts):
            raise _refuse(f"{where}.output", "a function's output is read as text here")
        output = "".join(p["text"] for p in parts)
    if not isinstance(output, str):
        raise _refuse(f"{where}.output", "a function_call_output needs its output, a string")
    return {"role": "tool", "tool_call_id": call_id, "name": known_calls[call_id], "content": output}
