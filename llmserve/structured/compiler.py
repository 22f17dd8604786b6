"""Grammars compiled against one model's tokenizer (xgrammar), once per distinct source.

One `GrammarCompiler` per engine. xgrammar's `TokenizerInfo` (the vocabulary decoded to bytes) is built
on first use, not at start, so a model that never sees a structured request never imports xgrammar.
`compile` is thread-safe and may be slow for a large schema: the async engine runs it on a worker
thread before the request reaches the engine loop (engine/async_engine.py), so other requests' steps
never wait for it; the engine then finds the result in the cache. Concurrent compiles of one source
share one compilation. Errors are the request's fault (a schema, regex or grammar xgrammar refuses)
and raise InvalidRequestError with xgrammar's reason.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmserve.errors import InvalidRequestError
from llmserve.structured.spec import StructuredOutput

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

# Compiled grammars kept (least recently used dropped first). A compiled JSON schema over a 49k vocabulary is
# tens of KB; the bound keeps a client that sends a new schema per request from growing memory without limit.
CACHE_ENTRIES = 512
# xgrammar's own cache of sub-results (JSON schema fragments, tokenizer-level masks), in bytes.
XGRAMMAR_CACHE_BYTES = 128 << 20


@dataclass
class CompileStats:
    compiled: int = 0  # grammars compiled (cache misses)
    cache_hits: int = 0
    seconds: float = 0.0  # total compile time
    last_seconds: float = 0.0


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], max_threads: int = 2) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._max_threads = max_threads
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self.stats = CompileStats()

    @property
    def bitmask_words(self) -> int:
        """int32 words of one row of the token bitmask (one bit per vocabulary entry)."""
        return (self.vocab_size + 31) // 32

    def compile(self, spec: StructuredOutput) -> xgrammar.CompiledGrammar:
        """The compiled grammar of `spec` (cached). Raises InvalidRequestError if xgrammar refuses it."""
        with self._lock:
            future = self._cache.get(spec.key)
            mine = future is None
            if mine:
                future = self._cache[spec.key] = Future()
                while len(self._cache) > CACHE_ENTRIES:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(spec.key)
                self.stats.cache_hits += 1
        if not mine:
            return future.result()  # raises the first compile's error too
        start = time.perf_counter()
        try:
            compiled = self._compile(spec)
        except BaseException as e:
            with self._lock:
                self._cache.pop(spec.key, None)  # a refused source is not kept (nor its error)
            future.set_exception(e)
            raise
        seconds = time.perf_counter() - start
        with self._lock:
            self.stats.compiled += 1
            self.stats.seconds += seconds
            self.stats.last_seconds = seconds
        logger.debug("compiled a %s in %.1f ms", spec.describe(), seconds * 1e3)
        future.set_result(compiled)
        return compiled

    def is_cached(self, spec: StructuredOutput) -> bool:
        with self._lock:
            future = self._cache.get(spec.key)
            return future is not None and future.done() and future.exception() is None

    def warm_up(self) -> None:
        """Import xgrammar and read the vocabulary now (the first structured request would otherwise pay it)."""
        self._xgr_compiler()

    def _xgr_compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                start = time.perf_counter()
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._max_threads,
                                                     cache_limit_bytes=XGRAMMAR_CACHE_BYTES)
                logger.info("structured output: xgrammar read the vocabulary (%d tokens) in %.2f s",
                            self.vocab_size, time.perf_counter() - start)
            return self._compiler

    def _compile(self, spec: StructuredOutput) -> xgrammar.CompiledGrammar:
        compiler = self._xgr_compiler()
        try:
            if spec.kind == "json":
                # json_object means an object (xgrammar's builtin JSON grammar also takes arrays: `[false]`)
                return _compile_json_schema(compiler, spec.source or '{"type": "object"}', spec.any_whitespace)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.source)
            if spec.kind == "choice":
                return compiler.compile_grammar(choice_ebnf(spec.choices))
            if spec.kind == "grammar":
                return compiler.compile_grammar(spec.source)
            if spec.kind == "structural_tag":
                return compiler.compile_structural_tag(spec.source)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse errors, and its Invalid*Error
            raise InvalidRequestError(f"{spec.param}: the {spec.describe()} could not be compiled: {xgrammar_reason(e)}",
                                      param=spec.param) from None
        raise AssertionError(f"unknown structured output kind {spec.kind!r}")


# xgrammar 0.2.8 writes a string with minLength/maxLength as `name ::= (([^\"\\\r\n]))` repeated: raw control
# characters allowed (invalid JSON: json.loads refused 27 of 40 random walks over {"type": "string", "maxLength": 8}).
# Such rules are rewritten to exclude control characters. Still without escapes, as xgrammar has them: an escape
# alternative inside the bounded repetition made masks up to 200x dearer to fill (23 ms at some positions, measured),
# while a plain character class keeps xgrammar's fast path.
_RAW_STRING_CHARS = re.compile(r'^(\S+) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
_JSON_STRING_CHAR = r' ::= (([^\0-\x1f\"\\]))'


def _compile_json_schema(compiler: Any, schema: str, any_whitespace: bool) -> Any:
    import xgrammar as xgr

    text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace))
    fixed = _RAW_STRING_CHARS.sub(lambda m: m.group(1) + _JSON_STRING_CHAR, text)
    if fixed != text:
        try:
            return compiler.compile_grammar(fixed)
        except RuntimeError:  # xgrammar's printed grammar did not parse back: its own compile, unpatched
            logger.warning("structured output: could not patch xgrammar's length-bounded strings in a schema")
    return compiler.compile_json_schema(schema, any_whitespace=any_whitespace)


def choice_ebnf(choices: list[str]) -> str:
    """root ::= "a" | "b" ...: JSON string literals are valid EBNF literals in xgrammar (same escapes)."""
    import json

    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: (Check failed: \(.*?\) is false: )?")


def xgrammar_reason(error: BaseException) -> str:
    """xgrammar's message without its C++ log prefix ("[12:00:00] /project/cpp/x.cc:83: ")."""
    return _XGR_PREFIX.sub("", str(error).strip()).strip() or type(error).__name__
