"""<think> splitting (qwen3, deepseek_r1), whole and streamed, alone and in front of a tool-call parser."""

from __future__ import annotations

import json

import pytest

from llmserve import InvalidRequestError
from llmserve.tools import OutputParser, ReasoningDelta, prompt_thinking, reasoning_parser, tool_parser
from llmserve.tools.calls import ContentDelta, ParsedOutput, ToolCall
from tests.tools.streams import assert_streams_reassemble, without_ids

# (parser, thinking, output, reasoning, content)
CASES = [
    ("qwen3", None, "<think>\nThe user greets me.\nI greet back.\n</think>\n\nHello!", "The user greets me.\nI greet back.",
     "Hello!"),
    ("qwen3", None, "Hello! No thinking here.", None, "Hello! No thinking here."),  # told not to think: no tags
    ("qwen3", None, "\n<think>\n\n</think>\n\nHi", None, "Hi"),  # an empty think block
    ("qwen3", None, "<think>\nstill thinking when max_tokens ran o", "still thinking when max_tokens ran o", None),
    ("qwen3", None, "<thinking> is not <think>", None, "<thinking> is not <think>"),
    ("qwen3", None, "Answer first <think>not reasoning</think>", None, "Answer first <think>not reasoning</think>"),
    ("qwen3", True, "Reasoning opened by the prompt.\n</think>\n\nDone.", "Reasoning opened by the prompt.", "Done."),
    ("qwen3", False, "<think>x</think>y", None, "<think>x</think>y"),  # thinking disabled: no split at all
    ("deepseek_r1", None, "Okay, 2 + 2 is 4.\n</think>\n\nThe answer is 4.", "Okay, 2 + 2 is 4.", "The answer is 4."),
    ("deepseek_r1", None, "<think>\nOlder template.\n</think>\nFour.", "Older template.", "Four."),
    ("deepseek_r1", None, "Cut off mid-thought </thi", "Cut off mid-thought </thi", None),
    ("deepseek_r1", None, "a < b and </ b>\n</think>4 </think>", "a < b and </ b>", "4 </think>"),
]


@pytest.mark.parametrize("name, thinking, text, reasoning, content", CASES)
def test_whole_and_every_split(name, thinking, text, reasoning, content):
    parser = reasoning_parser(name)
    expected = ParsedOutput(reasoning, content, [])
    assert parser.parse(text, thinking) == expected
    assert_streams_reassemble(lambda: parser.stream(thinking), text, expected)


def test_reasoning_streams_as_it_comes():
    stream = reasoning_parser("qwen3").stream()
    assert stream.feed("<thi") == []
    assert stream.feed("nk>\nStep one") == [ReasoningDelta("Step one")]
    assert stream.feed(".\n</th") == [ReasoningDelta(".")]  # the newline waits: it may be the tag's layout
    assert stream.feed("ink>\n\nAns") == [ContentDelta("Ans")]
    assert stream.feed("wer") == [ContentDelta("wer")]
    assert stream.finish() == []


@pytest.mark.parametrize("prompt, thinking", [
    ("<|im_start|>assistant\n<think>\n", True),  # DeepSeek-R1, Qwen3-Thinking-2507
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # Qwen3 with enable_thinking=False
    ("<|im_start|>assistant\n", None),
])
def test_prompt_thinking(prompt, thinking):
    assert prompt_thinking(prompt) is thinking


def test_unknown_reasoning_parser():
    with pytest.raises(InvalidRequestError, match="reasoning_parser: unknown parser 'r1'; choose one of qwen3, deepseek_r1"):
        reasoning_parser("r1")


QWEN3_CALL = ("<think>\nThe user wants the weather; I have a tool for it.\n</think>\n\n"
              '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


def test_reasoning_then_tool_calls():
    parser = OutputParser(reasoning_parser("qwen3"), tool_parser("hermes"))
    expected = ParsedOutput("The user wants the weather; I have a tool for it.", None,
                            [ToolCall("", "get_weather", json.dumps({"city": "Paris"}))])
    assert without_ids(parser.parse(QWEN3_CALL)) == without_ids(expected)
    assert_streams_reassemble(parser.stream, QWEN3_CALL, expected)
    stream = parser.stream()
    stream.feed(QWEN3_CALL)
    assert stream.num_tool_calls == 1


def test_a_call_written_inside_the_reasoning_is_reasoning():
    text = '<think>Maybe <tool_call>{"name": "f", "arguments": {}}</tool_call>?</think>No call.'
    out = OutputParser(reasoning_parser("qwen3"), tool_parser("hermes")).parse(text)
    assert out == ParsedOutput('Maybe <tool_call>{"name": "f", "arguments": {}}</tool_call>?', "No call.", [])


def test_output_parser_without_either_passes_content_through():
    assert OutputParser().parse("plain <tool_call> text") == ParsedOutput(None, "plain <tool_call> text", [])
    assert OutputParser().stream().feed("") == []
