"""Chat templates: the tokenizer's own jinja template, or a named built-in one, or a user's string."""

from __future__ import annotations

import os
from typing import Any

from transformers import PreTrainedTokenizerBase

from llmserve.config import ChatTemplateConfig
from llmserve.errors import InvalidRequestError

Messages = list[dict[str, Any]]

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
    def __init__(self, tokenizer: PreTrainedTokenizerBase, config: ChatTemplateConfig | None = None) -> None:
        config = config or ChatTemplateConfig()
        self.tokenizer = tokenizer
        self.meta_instruction = config.meta_instruction
        self.template = _pick_template(tokenizer, config)

    def messages_to_prompt(self, messages: Messages) -> str:
        _check_messages(messages)
        if self.meta_instruction and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": self.meta_instruction}, *messages]
        try:
            return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                      add_generation_prompt=messages[-1]["role"] != "assistant")
        except Exception as e:  # jinja raises for messages the template refuses (e.g. role order)
            raise InvalidRequestError(f"the chat template could not format these messages: {e}",
                                      param="messages") from e


def _pick_template(tokenizer: PreTrainedTokenizerBase, config: ChatTemplateConfig) -> str:
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
    return tokenizer.chat_template or BUILTIN_TEMPLATES["base"]


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {'role', 'content'} objects",
                                  param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InvalidRequestError(f"messages[{i}] must be an object with string 'role' and 'content', "
                                      f"got {m!r}", param="messages")
        if m["role"] not in ("system", "user", "assistant", "tool"):
            raise InvalidRequestError(f"messages[{i}].role must be system, user, assistant or tool, "
                                      f"got {m['role']!r}", param="messages")
