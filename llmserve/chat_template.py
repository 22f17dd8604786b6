"""Chat templates: the tokenizer's own jinja template, or a named built-in one, or a user's string.

Tool calling (OpenAI's shapes): `tools` reach the template as `apply_chat_template(tools=...)`; assistant
messages may carry `tool_calls` (content then null or empty) and `role: "tool"` messages the results
(`tool_call_id`, string content). Templates expect a call's `function.arguments` as a dict, while OpenAI sends a
JSON string: it is parsed here, as vLLM does (a string that is not a JSON object is the client's error here,
where vLLM quietly sends `{}`). Mistral's templates refuse ids that are not 9 characters: ids are cut to their
last 9, as vLLM does for Mistral.

A template that never reads `tools` (plain ChatML, the built-ins) would drop them without a word, as vLLM lets
happen. Here such a conversation is written in the Hermes/Qwen2.5 format instead, which the `hermes` parser
(chosen for such templates) reads back: the tools described in the system message, past calls as
`<tool_call>` blocks in the assistant's text, results as `<tool_response>` blocks in a user turn.

Template variables (vLLM's `chat_template_kwargs`, e.g. Qwen3's `enable_thinking`; OpenAI's `reasoning_effort`,
which gpt-oss's template reads) are taken only where the template reads them: a variable it never reads would
change nothing, so `check_kwargs` refuses it rather than let a request believe it was honoured.
"""

from __future__ import annotations

import json
import os
from typing import Any

from jinja2 import meta
from transformers import PreTrainedTokenizerBase

from llmserve.config import ChatTemplateConfig
from llmserve.errors import InvalidRequestError
from llmserve.tools.registry import detect_tool_parser, template_supports_tools

Messages = list[dict[str, Any]]

# apply_chat_template's own parameters (and what this class passes itself): a template variable of one of these
# names would change how the prompt is built rather than reach the template.
RESERVED_VARIABLES = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens",
})

BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml": (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n'"
        " + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    "llama2": (
        "{% if messages[0]['role'] == 'system' %}{% set sys = '<<SYS>>\n' + messages[0]['content'] + "
        "'\n<</SYS>>\n\n' %}{% set messages = messages[1:] %}{% else %}{% set sys = '' %}{% endif %}"
        "{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + (sys if loop.first else '')"
        " + m['content'] | trim + ' [/INST]' }}{% else %}{{ ' ' + m['content'] | trim + ' ' + eos_token }}"
        "{% endif %}{% endfor %}"
    ),
    "mistral": (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
        "{% elif m['role'] == 'assistant' %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"
    ),
    # No template: the messages' contents joined, for base models.
    "base": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
}


class ChatTemplate:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, config: ChatTemplateConfig | None = None,
                 processor_template: str | None = None) -> None:
        """processor_template: a vision-language model's processor's template (its default, before the
        tokenizer's); such a model's messages carry content lists of text and image parts (`multimodal`)."""
        config = config or ChatTemplateConfig()
        self.tokenizer = tokenizer
        self.meta_instruction = config.meta_instruction
        self.multimodal = processor_template is not None
        self.template = _pick_template(tokenizer, config, processor_template)
        self.supports_tools = template_supports_tools(self.template)
        self._short_ids = detect_tool_parser(self.template) == "mistral"
        self.variables = template_variables(self.template)

    def check_kwargs(self, kwargs: dict[str, Any], where: str) -> None:
        """Refuse (naming `where`.key) a variable the template never reads, or one apply_chat_template sets."""
        for key in kwargs:
            name = f"{where}.{key}" if where != key else key
            if key in RESERVED_VARIABLES:
                raise InvalidRequestError(f"{name}: set by the server from the request, not a template variable",
                                          param=where)
            if self.variables is None:
                raise InvalidRequestError(f"{name}: the chat template's variables could not be read, so whether it "
                                          "uses this one is unknown", param=where)
            if key not in self.variables:
                readable = ", ".join(sorted(self.variables - RESERVED_VARIABLES)) or "none"
                raise InvalidRequestError(f"{name}: this model's chat template never reads `{key}`, so it would "
                                          f"change nothing (variables it reads: {readable})", param=where)

    def messages_to_prompt(self, messages: Messages, tools: list[dict[str, Any]] | None = None,
                           variables: dict[str, Any] | None = None) -> str:
        """`tools`: OpenAI function tools ({"type": "function", "function": {...}}), already checked (see
        llmserve.tools.parse_tool_request); None or empty for none. `variables`: passed to the template, already
        checked with `check_kwargs`."""
        _check_messages(messages, self.multimodal)
        messages = [_template_message(m, i, self._short_ids) for i, m in enumerate(messages)]
        if self.meta_instruction and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": self.meta_instruction}, *messages]
        if not self.supports_tools:
            messages = _hermes_conversation(messages, tools)
            tools = None
        if self.multimodal:  # processors' templates iterate over content parts: a string becomes one text part
            messages = [{**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str)
                        else m for m in messages]
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools or None, chat_template=self.template,
                                                      tokenize=False,
                                                      add_generation_prompt=messages[-1]["role"] != "assistant",
                                                      **(variables or {}))
        except Exception as e:  # jinja raises for messages the template refuses (e.g. role order)
            raise InvalidRequestError(f"the chat template could not format these messages: {e}",
                                      param="messages") from e


def model_chat_template(loaded: Any, config: ChatTemplateConfig | None = None) -> ChatTemplate:
    """The chat template of a loaded model (models.loader.LoadedModel): a vision-language model's is its
    processor's."""
    processor = getattr(loaded, "processor", None)
    if processor is None:
        return ChatTemplate(loaded.tokenizer, config)
    return ChatTemplate(loaded.tokenizer, config, processor.chat_template or loaded.tokenizer.chat_template or "")


def template_variables(source: str) -> frozenset[str] | None:
    """The variables a jinja template reads from its context; None if it cannot be parsed here. Parsed in the
    environment transformers renders with (its `generation` tag, loop controls), a private function of transformers,
    hence the broad fallback."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        environment = _compile_jinja_template(source).environment
        return frozenset(meta.find_undeclared_variables(environment.parse(source)))
    except Exception:  # noqa: BLE001  (a template that does not parse fails when rendered, with its reason)
        return None


def _pick_template(tokenizer: PreTrainedTokenizerBase, config: ChatTemplateConfig,
                   processor_template: str | None = None) -> str:
    if config.chat_template:
        if os.path.isfile(config.chat_template):
            with open(config.chat_template) as f:
                return f.read()
        return config.chat_template
    if config.model_name:
        if config.model_name not in BUILTIN_TEMPLATES:
            raise InvalidRequestError(f"unknown chat template {config.model_name!r}; built-in templates: "
                                      f"{', '.join(BUILTIN_TEMPLATES)}", param="chat_template")
        return BUILTIN_TEMPLATES[config.model_name]
    return processor_template or tokenizer.chat_template or BUILTIN_TEMPLATES["base"]


def _check_messages(messages: Any, multimodal: bool = False) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {'role', 'content'} objects",
                                  param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequestError(f"messages[{i}] must be an object with string 'role' and 'content', "
                                      f"got {m!r}", param="messages")
        if m["role"] not in ("system", "user", "assistant", "tool"):
            raise InvalidRequestError(f"messages[{i}].role must be system, user, assistant or tool, "
                                      f"got {m['role']!r}", param="messages")
        calls = m.get("tool_calls") if m["role"] == "assistant" else None
        if multimodal and isinstance(m.get("content"), list):
            for j, part in enumerate(m["content"]):
                ok = isinstance(part, dict) and (part.get("type") == "image" or (
                    part.get("type") == "text" and isinstance(part.get("text"), str)))
                if not ok:
                    raise InvalidRequestError(f"messages[{i}].content[{j}] must be a text or image part, got {part!r}",
                                              param="messages")
            continue
        if not isinstance(m.get("content"), str) and not (calls and m.get("content") is None):
            raise InvalidRequestError(f"messages[{i}].content must be a string (it may be null only beside "
                                      f"tool_calls), got {m.get('content')!r}", param="messages")
        if m["role"] == "tool" and not isinstance(m.get("tool_call_id", ""), str):
            raise InvalidRequestError(f"messages[{i}].tool_call_id must be a string", param="messages")


def _template_message(m: dict[str, Any], i: int, short_ids: bool) -> dict[str, Any]:
    """A copy in the shape templates expect: tool_calls with dict arguments (or no tool_calls key at all: Llama's
    template tests `'tool_calls' in message`), content "" for null."""
    m = dict(m)
    if m["role"] == "tool" and short_ids and "tool_call_id" in m:
        m["tool_call_id"] = m["tool_call_id"][-9:]
    if "tool_calls" not in m:
        return m
    calls = m.pop("tool_calls")
    if m["role"] != "assistant" and calls not in (None, []):  # _hermes_conversation would read them as calls
        raise InvalidRequestError(f"messages[{i}].tool_calls: only an assistant message makes tool calls; this one's "
                                  f"role is {m['role']}", param="messages")
    if calls is None or calls == []:
        return m
    if not isinstance(calls, list):
        raise InvalidRequestError(f"messages[{i}].tool_calls must be a list", param="messages")
    m["tool_calls"] = [_template_call(c, f"messages[{i}].tool_calls[{j}]", short_ids) for j, c in enumerate(calls)]
    if m.get("content") is None:
        m["content"] = ""
    return m


def _template_call(call: Any, where: str, short_ids: bool) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if (not isinstance(function, dict) or call.get("type", "function") != "function"
            or not isinstance(function.get("name"), str)):
        raise InvalidRequestError(f'{where} must be {{"id": ..., "type": "function", "function": {{"name": ..., '
                                  f'"arguments": "<JSON object>"}}}}, got {call!r}', param="messages")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{where}.function.arguments: not valid JSON: {e}", param="messages") from None
    elif arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise InvalidRequestError(f"{where}.function.arguments: must encode a JSON object, got {arguments!r}",
                                  param="messages")
    out = {**call, "type": "function", "function": {**function, "arguments": arguments}}
    if short_ids and isinstance(call.get("id"), str):
        out["id"] = call["id"][-9:]
    return out


HERMES_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)


def _hermes_conversation(messages: Messages, tools: list[dict[str, Any]] | None) -> Messages:
    """For a template without tool support: tools, calls and results written into plain role/content messages."""
    out: Messages = []
    if tools:
        preamble = HERMES_TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if messages[0]["role"] == "system":
            first, messages = messages[0], messages[1:]
            out.append({**first, "content": _plus_text(first["content"], "\n\n" + preamble)})
        else:
            out.append({"role": "system", "content": preamble})
    for m in messages:
        if m["role"] == "tool":
            response = f"<tool_response>\n{_text_of(m['content'])}\n</tool_response>"
            if out and out[-1].get("_tool_results"):  # consecutive results share one user turn, as in Qwen's
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "_tool_results": True})
        elif m.get("tool_calls"):
            blocks = [f'<tool_call>\n{{"name": {json.dumps(c["function"]["name"])}, "arguments": '
                      f'{json.dumps(c["function"]["arguments"], ensure_ascii=False)}}}\n</tool_call>'
                      for c in m["tool_calls"]]
            text = "\n".join(([_text_of(m["content"])] if m["content"] else []) + blocks)
            out.append({k: v for k, v in m.items() if k != "tool_calls"} | {"content": text})
        else:
            out.append(m)
    return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]


def _plus_text(content: str | list[dict[str, Any]], text: str) -> str | list[dict[str, Any]]:
    """A message's content (a string, or a vision-language model's parts) with `text` after it."""
    return [*content, {"type": "text", "text": text}] if isinstance(content, list) else content + text


def _text_of(content: str | list[dict[str, Any]]) -> str:
    """A message's text: a string as it is, the text parts of a list joined."""
    if isinstance(content, list):
        return "".join(p["text"] for p in content if p.get("type") == "text")
    return content
