"""Forced tool calls: the grammars compiled against the tiny tokenizer and followed by random walks (any token
the mask allows, until the grammar ends); whatever the walk writes must parse, with the family's own parser,
into calls of allowed tools whose arguments validate against their schemas."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from llmserve import InvalidRequestError
from llmserve.structured.compiler import GrammarCompiler
from llmserve.structured.matcher import GrammarState
from llmserve.structured.spec import StructuredOutput
from llmserve.tools import (
    OutputParser,
    ParsedOutput,
    parse_tool_request,
    reasoning_parser,
    tool_call_grammar,
    tool_parser,
)
from llmserve.tools.mistral import MistralParser
from llmserve.tools.parser import ToolParser
from tests.tiny_models import VOCAB_SIZE, tiny_tokenizer

EOS = 2
_BITS = torch.arange(32, dtype=torch.int32)

WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": -100, "maximum": 100}, "b": {"type": "boolean"},
                                     "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}},
    "required": ["a"]}}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: `{}`
LOOSE = {"type": "function", "function": {"name": "loose", "strict": False, "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
TOOLS = [WEATHER, ADD, NOW, LOOSE]

FAMILIES = {"hermes": lambda: tool_parser("hermes"), "llama3_json": lambda: tool_parser("llama3_json"),
            "mistral": lambda: MistralParser(), "mistral-v13": lambda: MistralParser(args_marker=True)}


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(tiny_tokenizer(), VOCAB_SIZE, [EOS])


def allowed(state: GrammarState) -> list[int]:
    bits = ((state.next_mask[0].unsqueeze(1) >> _BITS) & 1).flatten()[:VOCAB_SIZE]
    return bits.nonzero().flatten().tolist()


def walk(compiler: GrammarCompiler, grammar: StructuredOutput, seed: int, prefix: str = "", limit: int = 2000,
         prefer: set[int] | None = None) -> str:
    """`prefix` accepted token by token, then random allowed tokens until the grammar is finished (a token of
    `prefer` whenever one is allowed)."""
    tok = tiny_tokenizer()
    state = GrammarState(compiler.compile(grammar), [EOS], VOCAB_SIZE)
    tokens = tok.encode(prefix)
    for t in tokens:
        assert state.accept(t), f"the grammar refuses {prefix!r} at {tok.decode([t])!r}"
    rng = random.Random(seed)
    while not state.finished:
        assert len(tokens) < limit, tok.decode(tokens)
        options = allowed(state)
        preferred = [t for t in options if t in (prefer or ())]
        token = rng.choice(preferred or options)
        assert state.accept(token)
        if token != EOS:
            tokens.append(token)
    return tok.decode(tokens)


def check_calls(out: ParsedOutput, allowed_names: set[str], strict_only: bool = False) -> None:
    """Names allowed, arguments valid (with `strict_only`, tools that say `strict: false` are held to any object)."""
    for call in out.tool_calls:
        assert call.name in allowed_names
        function = next(t["function"] for t in TOOLS if t["function"]["name"] == call.name)
        schema = function.get("parameters") or {"type": "object", "maxProperties": 0}
        if strict_only and function.get("strict") is False:
            schema = {"type": "object"}
        jsonschema.validate(json.loads(call.arguments), schema)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("choice, parallel, names, counts", [
    ("required", True, {"get_weather", "add", "now", "loose"}, range(1, 100)),
    ("required", False, {"get_weather", "add", "now", "loose"}, [1]),
    ({"type": "function", "function": {"name": "add"}}, True, {"add"}, [1]),  # a named tool: one call, even so
    ({"type": "function", "function": {"name": "now"}}, False, {"now"}, [1]),
])
def test_forced_calls_always_parse_and_validate(compiler, family, choice, parallel, names, counts):
    parser: ToolParser = FAMILIES[family]()
    grammar = tool_call_grammar(parser, parse_tool_request(TOOLS, choice, parallel))
    seen_names: set[str] = set()
    for seed in range(8):
        text = walk(compiler, grammar, seed)
        out = parser.parse(text)
        assert out.content is None and len(out.tool_calls) in counts, text
        check_calls(out, names)
        seen_names |= {c.name for c in out.tool_calls}
    assert len(seen_names) > 1 or len(names) == 1  # the walks reach more than one tool


@pytest.mark.parametrize("family", FAMILIES)
def test_a_model_that_prefers_whitespace_still_finishes_the_call(compiler, family):
    # JSON takes any whitespace between tokens: a model that always writes it where allowed (small and random models
    # do) would never finish a forced call without the bound on consecutive whitespace
    tok = tiny_tokenizer()
    whitespace = {i for i in range(len(tok)) if tok.decode([i]) and not tok.decode([i]).strip()}
    parser: ToolParser = FAMILIES[family]()
    grammar = tool_call_grammar(parser, parse_tool_request([WEATHER], "required", False))
    text = walk(compiler, grammar, 0, limit=400, prefer=whitespace)
    out = parser.parse(text)
    assert len(out.tool_calls) == 1, text
    check_calls(out, {"get_weather"})
    # 16 between JSON tokens, and the space the call's opening ends with
    assert max(len(run) for run in re.findall(r"\s+", text)) <= 17, text


def test_parallel_walks_do_write_several_calls(compiler):
    parser = tool_parser("hermes")
    grammar = tool_call_grammar(parser, parse_tool_request([NOW], "required", True))
    assert max(len(parser.parse(walk(compiler, grammar, seed)).tool_calls) for seed in range(10)) > 1


@pytest.mark.parametrize("reasoner, thinking, prefix", [
    ("qwen3", None, "<think>\nI should call it.\n</think>\n\n"),
    ("deepseek_r1", None, "I should call it.\n</think>\n\n"),  # the prompt opened the reasoning
    ("qwen3", True, "I should call it.\n</think>\n\n"),
])
def test_forced_calls_after_reasoning(compiler, reasoner, thinking, prefix):
    parser = tool_parser("hermes")
    reasoning = reasoning_parser(reasoner)
    grammar = tool_call_grammar(parser, parse_tool_request(TOOLS, "required", False), reasoning, thinking)
    for seed in range(4):
        text = walk(compiler, grammar, seed, prefix)
        out = OutputParser(reasoning, parser, thinking).parse(text)
        assert out.reasoning == "I should call it." and out.content is None and len(out.tool_calls) == 1, text
        check_calls(out, {"get_weather", "add", "now", "loose"})


def test_thinking_disabled_forces_the_call_at_once(compiler):
    grammar = tool_call_grammar(tool_parser("hermes"), parse_tool_request([NOW], "required", False),
                                reasoning_parser("qwen3"), thinking=False)
    assert json.loads(grammar.source)["format"]["type"] == "tag"  # no reasoning block in front


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_with_a_strict_tool_constrains_only_opened_calls(compiler, family):
    parser: ToolParser = FAMILIES[family]()
    request = parse_tool_request(TOOLS[:3], "auto", False)  # (a `strict: false` tool's free object: endless walks)
    grammar = tool_call_grammar(parser, request)
    assert grammar is not None and grammar.kind == "structural_tag"
    # free text is free, until the model opens a call: then it must finish a call of one of the tools
    opening = {"hermes": "<tool_call>", "llama3_json": '{"name": ', "mistral": "[TOOL_CALLS]",
               "mistral-v13": "[TOOL_CALLS]"}[family]
    prefix = ("Sure. " if family != "llama3_json" else "") + opening
    for seed in range(6):
        text = walk(compiler, grammar, seed, prefix)
        out = parser.parse(text)
        assert len(out.tool_calls) == 1, text  # parallel_tool_calls=false: the grammar ends after one call
        check_calls(out, {"get_weather", "add", "now"}, strict_only=True)


def test_auto_without_strict_tools_is_unconstrained():
    parser = tool_parser("hermes")
    assert tool_call_grammar(parser, parse_tool_request([ADD, NOW], "auto")) is None
    assert tool_call_grammar(parser, parse_tool_request([ADD, NOW], "none")) is None
    # allowed_tools narrows the tools: only a grammar keeps that promise
    narrowed = parse_tool_request([ADD, NOW], {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "function", "function": {"name": "now"}}]}})
    grammar = tool_call_grammar(parser, narrowed)
    assert [t["begin"] for t in json.loads(grammar.source)["format"]["tags"]] == [
        '<tool_call>\n{"name": "now", "arguments": ']


def test_a_schema_xgrammar_refuses_names_the_tools_field(compiler):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "strange"}}}}}
    grammar = tool_call_grammar(tool_parser("hermes"), parse_tool_request([bad], "required"))
    with pytest.raises(InvalidRequestError, match="tools: the structural tag could not be compiled") as e:
        compiler.compile(grammar)
    assert e.value.param == "tools"
