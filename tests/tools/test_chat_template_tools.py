"""Tools, assistant tool_calls and tool results through chat templates: Qwen2.5-, Llama-3.1- and Mistral-style
templates, and the Hermes-format fallback for a template without tool support; template variables (Qwen3's
enable_thinking) taken only where the template reads them."""

from __future__ import annotations

import json

import pytest

from llmserve import InvalidRequestError
from llmserve.chat_template import ChatTemplate
from llmserve.config import ChatTemplateConfig
from llmserve.tools import tool_parser
from tests.tiny_models import tiny_tokenizer
from tests.tools.templates import LLAMA31, MISTRAL_V03, QWEN25

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL_ID = "call_8f2c41d0a9b3e7f6c5d4b3a2"
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": CALL_ID, "content": "22 C, sunny"},
]


def template(source: str | None = None) -> ChatTemplate:
    return ChatTemplate(tiny_tokenizer(), ChatTemplateConfig(chat_template=source) if source else None)


QWEN_EXPECTED = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query."
    "\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(WEATHER) +
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\n</tool_call><|im_end|>\n"
    "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    "<|im_end|>\n"
    "<|im_start|>user\n<tool_response>\n22 C, sunny\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)


def test_qwen_template_renders_tools_calls_and_results():
    assert template(QWEN25).messages_to_prompt(CONVERSATION, [WEATHER]) == QWEN_EXPECTED


def test_a_template_without_tool_support_gets_the_same_conversation_in_hermes_format():
    # ChatML reads only role and content: the tools, the call and the result are written into them, which is
    # what Qwen's own template writes, and what the hermes parser reads back
    plain = template()
    assert not plain.supports_tools
    assert plain.messages_to_prompt(CONVERSATION, [WEATHER]) == QWEN_EXPECTED


def test_llama_template():
    prompt = template(LLAMA31).messages_to_prompt(CONVERSATION, [WEATHER])
    assert ('Weather in Paris?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'
            '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'
            '<|start_header_id|>ipython<|end_header_id|>\n\n"22 C, sunny"<|eot_id|>'
            '<|start_header_id|>assistant<|end_header_id|>\n\n') in prompt
    assert '"name": "get_weather",\n        "description": "Weather now"' in prompt  # the tools, indented
    # `'tool_calls' in message` is how Llama's template tells calls apart: a null or empty list is no call
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "tool_calls": None},
             {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Ciao", "tool_calls": []}]
    assert "<|start_header_id|>assistant<|end_header_id|>\n\nCiao<|eot_id|>" in template(LLAMA31).messages_to_prompt(plain)


def test_mistral_template_gets_nine_character_ids():
    prompt = template(MISTRAL_V03).messages_to_prompt(CONVERSATION, [WEATHER])
    assert ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "' + CALL_ID[-9:]
            + '"}]<|im_end|>') in prompt
    assert prompt.endswith('[TOOL_RESULTS] {"content": 22 C, sunny, "call_id": "' + CALL_ID[-9:] + '"}[/TOOL_RESULTS]')
    assert prompt.startswith('<|im_start|>[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "get_weather"')


@pytest.mark.parametrize("source, family, start, end", [
    (QWEN25, "hermes", "<|im_start|>assistant\n", "<|im_end|>"),
    (None, "hermes", "<|im_start|>assistant\n", "<|im_end|>"),
    (LLAMA31, "llama3_json", "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    (MISTRAL_V03, "mistral", "[/INST]", "<|im_end|>"),
])
def test_what_a_template_writes_its_parser_reads_back(source, family, start, end):
    args = {"city": "Paris", "note": "quote \" and é"}
    calls = [{"id": "abcdefghi", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(args)}}]
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    prompt = template(source).messages_to_prompt(messages, [WEATHER])
    turn = prompt[prompt.rindex(start) + len(start):prompt.rindex(end)]
    out = tool_parser(family).parse(turn)
    assert out.content is None and [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", args)]


@pytest.mark.parametrize("message, error", [
    ({"role": "assistant", "content": None}, r"messages\[1\].content must be a string \(it may be null only beside "
                                             "tool_calls\\), got None"),
    ({"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "{bad"}}]}, r"messages\[1\].tool_calls\[0\].function.arguments: not valid JSON"),
    ({"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "[1]"}}]}, r"messages\[1\].tool_calls\[0\].function.arguments: must encode a JSON "
                                             "object, got \\[1\\]"),
    ({"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]},
     r"messages\[1\].tool_calls\[0\] must be"),
    ({"role": "assistant", "content": "", "tool_calls": {"x": 1}}, r"messages\[1\].tool_calls must be a list"),
    ({"role": "tool", "content": "x", "tool_call_id": 5}, r"messages\[1\].tool_call_id must be a string"),
])
def test_malformed_tool_messages_name_the_field(message, error):
    with pytest.raises(InvalidRequestError, match=error) as e:
        template(QWEN25).messages_to_prompt([{"role": "user", "content": "Q"}, message])
    assert e.value.param == "messages"


def test_arguments_given_as_a_dict_or_empty_are_taken():
    calls = [{"id": "a", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
             {"id": "b", "type": "function", "function": {"name": "g", "arguments": ""}}]
    prompt = template(QWEN25).messages_to_prompt([{"role": "user", "content": "Q"},
                                                  {"role": "assistant", "content": "On it.", "tool_calls": calls}])
    assert prompt.endswith('<|im_start|>assistant\nOn it.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n'
                           '</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call><|im_end|>\n')


def test_the_callers_messages_are_not_changed():
    messages = json.loads(json.dumps(CONVERSATION))
    template(MISTRAL_V03).messages_to_prompt(messages, [WEATHER])
    assert messages == CONVERSATION


# Qwen3's switch: the template closes the reasoning in the prompt when told not to think.
QWEN3 = QWEN25 + ("{%- if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}"
                  "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}")


def test_the_variables_a_template_reads():
    assert template(QWEN25).variables == {"messages", "tools", "add_generation_prompt"}
    assert {"enable_thinking", "tools"} <= template(QWEN3).variables
    assert {"date_string", "tools_in_user_message", "custom_tools"} <= template(LLAMA31).variables
    assert template("{% generation %}{{ x }}{% endgeneration %}").variables == {"x"}  # transformers' own tag
    assert template("{% for %}").variables is None  # does not parse


def test_template_variables_reach_the_template_only_where_it_reads_them():
    qwen3 = template(QWEN3)
    question = [{"role": "user", "content": "Hi"}]
    qwen3.check_kwargs({"enable_thinking": False}, "chat_template_kwargs")
    assert qwen3.messages_to_prompt(question, None, {"enable_thinking": False}).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert qwen3.messages_to_prompt(question).endswith("<|im_start|>assistant\n")
    with pytest.raises(InvalidRequestError, match=r"chat_template_kwargs.thinking: this model's chat template never "
                                                  r"reads `thinking`, so it would change nothing \(variables it reads: "
                                                  r"enable_thinking\)") as e:
        qwen3.check_kwargs({"thinking": True}, "chat_template_kwargs")
    assert e.value.param == "chat_template_kwargs"
    with pytest.raises(InvalidRequestError, match="chat_template_kwargs.tools: set by the server"):
        qwen3.check_kwargs({"tools": []}, "chat_template_kwargs")
    with pytest.raises(InvalidRequestError, match="^reasoning_effort: this model's chat template never reads"):
        qwen3.check_kwargs({"reasoning_effort": "low"}, "reasoning_effort")
    with pytest.raises(InvalidRequestError, match="variables could not be read"):
        template("{% for %}").check_kwargs({"x": 1}, "chat_template_kwargs")
