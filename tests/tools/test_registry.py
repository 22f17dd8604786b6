"""Choosing a tool-call parser by name or from the chat template."""

from __future__ import annotations

import pytest

from llmserve import InvalidRequestError
from llmserve.chat_template import BUILTIN_TEMPLATES
from llmserve.tools import detect_tool_parser, resolve_tool_parser, tool_parser
from llmserve.tools.hermes import HermesParser
from llmserve.tools.llama3_json import Llama3JsonParser
from llmserve.tools.mistral import MistralParser
from tests.tiny_models import CHAT_TEMPLATE
from tests.tools.templates import LLAMA31, MISTRAL_V03, QWEN25

# Llama 3.2's template has no <|python_tag|> (no built-in tools), only the JSON instruction.
LLAMA32 = LLAMA31.replace('"<|python_tag|>" + ', "")
MISTRAL_V13 = '{{ "[TOOL_CALLS]" + call.function.name + "[ARGS]" + call.function.arguments }}{{ tools }}'


@pytest.mark.parametrize("template, name", [
    (QWEN25, "hermes"), (LLAMA31, "llama3_json"), (LLAMA32, "llama3_json"), (MISTRAL_V03, "mistral"),
    (MISTRAL_V13, "mistral"), (CHAT_TEMPLATE, None), (BUILTIN_TEMPLATES["llama3"], None),
])
def test_detect_from_template(template, name):
    assert detect_tool_parser(template) == name


def test_by_name_and_aliases():
    assert isinstance(tool_parser("hermes"), HermesParser)
    assert isinstance(tool_parser("llama3_json"), Llama3JsonParser)
    assert isinstance(tool_parser("llama4_json"), Llama3JsonParser)
    assert isinstance(tool_parser("mistral"), MistralParser)
    with pytest.raises(InvalidRequestError, match="tool_call_parser: unknown parser 'qwen'; choose one of hermes, "
                                                  "llama3_json, llama4_json, mistral") as e:
        tool_parser("qwen")
    assert e.value.param == "tool_call_parser"


def test_resolve():
    assert isinstance(resolve_tool_parser(None, QWEN25), HermesParser)
    assert isinstance(resolve_tool_parser("llama3_json", QWEN25), Llama3JsonParser)  # the name wins
    # Mistral's forced calls follow the template's generation: [ARGS] (v13) or a JSON list (v3)
    assert resolve_tool_parser(None, MISTRAL_V13).args_marker
    assert not resolve_tool_parser(None, MISTRAL_V03).args_marker
    # a template without tools: chat_template.py writes the conversation in Hermes' format
    assert isinstance(resolve_tool_parser(None, CHAT_TEMPLATE), HermesParser)
    # a template that takes tools in a format we cannot tell
    with pytest.raises(InvalidRequestError, match="the chat template takes tools but writes calls in a format"):
        resolve_tool_parser(None, "{% for t in tools %}<function={{ t.function.name }}>{% endfor %}")
