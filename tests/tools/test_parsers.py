"""Each family's tool-call parser on realistic outputs, whole and streamed over every split of the text."""

from __future__ import annotations

import json
import re

import pytest

from llmserve.tools import ContentDelta, ToolCallDelta, tool_parser
from llmserve.tools.calls import ParsedOutput, ToolCall
from llmserve.tools.parser import JsonEnd, json_value_end
from tests.tools.streams import assert_streams_reassemble, feed_pieces, without_ids


def expect(content: str | None, *calls: tuple[str, dict]) -> ParsedOutput:
    return ParsedOutput(None, content, [ToolCall("", name, json.dumps(args, ensure_ascii=False))
                                        for name, args in calls])


WEATHER = ("get_weather", {"city": "Paris", "unit": "celsius"})
TIME = ("get_time", {"timezone": "Europe/Paris"})

# (parser, model output, expected result)
CASES = [
    # Qwen2.5 / Hermes: one call, as Qwen writes it
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     expect(None, WEATHER)),
    # parallel calls, "\n" between them, content before, Hermes' arguments-first key order
    ("hermes", 'I will look both up.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
               '"celsius"}}\n</tool_call>\n<tool_call>\n{"arguments": {"timezone": "Europe/Paris"}, "name": '
               '"get_time"}\n</tool_call>',
     expect("I will look both up.", WEATHER, TIME)),
    # cut off after the JSON, before </tool_call>
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n', expect(None, TIME)),
    # malformed JSON inside the tags: all content, nothing lost
    ("hermes", 'Sure <tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}\n</tool_call>',
     expect('Sure <tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}\n</tool_call>')),
    # well-formed JSON that is not a call, then a good call: the first block stays content
    ("hermes", '<tool_call>{"tool": "x"}</tool_call> then <tool_call>{"name": "get_time", "arguments": '
               '{"timezone": "Europe/Paris"}}</tool_call>',
     expect('<tool_call>{"tool": "x"}</tool_call> then', TIME)),
    # the end tag inside a string argument does not end the call; unicode and escapes survive
    ("hermes", '<tool_call>\n{"name": "note", "arguments": {"text": "a </tool_call> b \\"q\\" é ✓"}}\n</tool_call>',
     expect(None, ("note", {"text": 'a </tool_call> b "q" é ✓'}))),
    # no calls: content exactly as written, trailing whitespace and a lone "<" included
    ("hermes", "The answer is x < y.\n", expect("The answer is x < y.\n")),
    ("hermes", "Unclosed <tool_call> at the end", expect("Unclosed <tool_call> at the end")),
    ("hermes", "Ends with a partial tag <tool_ca", expect("Ends with a partial tag <tool_ca")),
    # text after the calls is content
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}</tool_call>\nDone.',
     expect("\nDone.", TIME)),

    # Llama 3.1 / 3.2 JSON: the response is the call
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     expect(None, WEATHER)),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                    '{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}',
     expect(None, WEATHER, TIME)),
    ("llama3_json", '  {"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n', expect(None, TIME)),
    # prose that mentions JSON later is content, as is a JSON answer that is not a call
    ("llama3_json", 'Use {"name": "x"} as input.', expect('Use {"name": "x"} as input.')),
    ("llama3_json", '{"answer": 42, "name": 7}', expect('{"answer": 42, "name": 7}')),
    # malformed JSON: content
    ("llama3_json", '{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}',
     expect('{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}')),
    ("llama3_json", '{"name": "get_time", "parameters": {"timezone": Europe}}',
     expect('{"name": "get_time", "parameters": {"timezone": Europe}}')),
    # a good call, then a broken second one: the call, and the rest as content
    ("llama3_json", '{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}; {"name": oops}',
     expect('; {"name": oops}', TIME)),

    # Mistral v3 (7B v0.3, Nemo): a JSON list after [TOOL_CALLS]
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}]',
     expect(None, WEATHER, TIME)),
    # v11 and v13 shapes
    ("mistral", 'Checking.[TOOL_CALLS]get_weather{"city": "Paris", "unit": "celsius"}', expect("Checking.", WEATHER)),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time[ARGS]'
                '{"timezone": "Europe/Paris"}',
     expect(None, WEATHER, TIME)),
    # malformed: content, the marker included
    ("mistral", '[TOOL_CALLS] [{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}]',
     expect('[TOOL_CALLS] [{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}]')),
    ("mistral", "A plain [answer] with [TOOL_C", expect("A plain [answer] with [TOOL_C")),
]


@pytest.mark.parametrize("family, text, expected", CASES)
def test_whole_text(family, text, expected):
    assert without_ids(tool_parser(family).parse(text)) == without_ids(expected)


@pytest.mark.parametrize("family, text, expected", CASES)
def test_every_split_streams_to_the_whole_text_result(family, text, expected):
    parser = tool_parser(family)
    assert_streams_reassemble(parser.stream, text, expected)


def test_streamed_deltas_have_openai_shape_and_ids():
    parser = tool_parser("hermes")
    text = CASES[1][1]
    deltas = feed_pieces(parser.stream(), [text[:25], text[25:60], text[60:]])
    calls = [d for d in deltas if isinstance(d, ToolCallDelta)]
    first = calls[0].to_openai()
    assert first == {"index": 0, "id": first["id"], "type": "function",
                     "function": {"name": "get_weather", "arguments": ""}}
    assert calls[1].to_openai() == {"index": 0, "function": {"arguments": json.dumps(WEATHER[1])}}
    assert [c.index for c in calls] == [0, 0, 1, 1]
    ids = [c.id for c in calls if c.id]
    assert len(set(ids)) == 2 and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)
    mistral_ids = [c.id for c in tool_parser("mistral").parse(CASES[18][1]).tool_calls]
    assert len(mistral_ids) == 2 and all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in mistral_ids)


def test_content_is_released_as_soon_as_it_cannot_be_a_marker():
    stream = tool_parser("hermes").stream()
    assert stream.feed("Hello <to") == [ContentDelta("Hello")]  # " <to" may start <tool_call>
    assert stream.feed("p") == [ContentDelta(" <top")]
    assert stream.feed(" <tool_call>\n{\"name\": ") == []  # a call in progress is held whole
    assert stream.feed('"f", "arguments": {}}') == []  # complete JSON, but </tool_call> may still come
    deltas = stream.feed("\n</tool_call>")
    assert [(d.index, d.name, d.arguments) for d in deltas] == [(0, "f", ""), (0, None, "{}")]
    assert stream.finish() == []


def test_llama_holds_a_json_start_until_it_knows_it_is_not_a_call():
    stream = tool_parser("llama3_json").stream()
    assert stream.feed('{"answer": ') == []
    assert stream.feed("1}") == [ContentDelta('{"answer": 1}')]
    assert stream.feed(" more") == [ContentDelta(" more")]


def test_arguments_are_reencoded_json_objects():
    # raw control characters in strings (literal newlines in code) are taken and escaped; an encoded string of
    # arguments is decoded; no arguments is {}
    out = tool_parser("hermes").parse('<tool_call>{"name": "run", "arguments": {"code": "a\n\tb"}}</tool_call>'
                                      '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
                                      '<tool_call>{"name": "g"}</tool_call>')
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("run", {"code": "a\n\tb"}), ("f", {"x": 1}), ("g", {})]
    assert out.tool_calls[0].arguments == '{"code": "a\\n\\tb"}'


@pytest.mark.parametrize("text, value", [
    ('{"a": [1, {"b": "}]"}]} tail', '{"a": [1, {"b": "}]"}]}'), ('[{"x": "\\""}]', '[{"x": "\\""}]'),
    ('{"a": "unterminated', None), ('{"a": "\\', None), ('{"a": [1, 2}', "bad"), ("{" * 3 + "}" * 3, "{{{}}}"),
])
def test_json_value_end(text, value):
    if value == "bad":
        with pytest.raises(ValueError):
            json_value_end(text, 0)
    else:
        assert json_value_end(text, 0) == (None if value is None else len(value))


@pytest.mark.parametrize("value", ['{"a": "x\\"}]\\\\", "b": [1, {"c": "{["}]}', '[{"k": "\\u00e9\\n"}, [], {}]',
                                   '{"code": "if (a) { b[\\"}\\"] }"}'])
def test_json_end_resumes_on_a_growing_text(value):
    # as a stream grows the buffer one character at a time: unfinished until the last bracket, then its end
    text = value + " tail"
    finder = JsonEnd()
    ends = [finder.find(text[:i], 0) for i in range(1, len(text) + 1)]
    assert ends == [None] * (len(value) - 1) + [len(value)] * 6


def test_deep_nesting_is_content_not_a_crash():
    text = "<tool_call>" + '{"name": "f", "arguments": ' + "[" * 5000 + "]" * 5000 + "}</tool_call>"
    assert tool_parser("hermes").parse(text).content == text
