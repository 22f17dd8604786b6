"""Structured output: constrain a request's tokens to a JSON schema, regex, choice, EBNF grammar or structural
tag (xgrammar). spec.py normalizes what the APIs send, compiler.py compiles it against the model's tokenizer
(cached), matcher.py follows one sequence through its grammar; the sampler masks the logits of rows that carry
one (sampling/grammar.py)."""

from llmserve.structured.spec import StructuredOutput, parse_response_format

__all__ = ["StructuredOutput", "parse_response_format"]
