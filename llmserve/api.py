"""The offline API, in LMDeploy's shape (`pipe(prompts, gen_config)`, `stream_infer`, `chat`) and
DeepSpeed-MII's (`pipe(prompts, max_new_tokens=...)`). Synchronous: it drives the engine itself."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from llmserve.chat_template import Messages, model_chat_template
from llmserve.config import ChatTemplateConfig, EngineConfig, GenerationConfig, max_new_tokens_within
from llmserve.engine import gc_heap
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.output import SequenceOutput
from llmserve.errors import InvalidRequestError
from llmserve.lmdeploy_compat import BackendConfig, VisionConfig, as_engine_config
from llmserve.models.loader import LoadedModel, load_model
from llmserve.vl.constants import IMAGE_TOKEN
from llmserve.vl.image import ImageLimits
from llmserve.vl.inputs import MultiModalInputs
from llmserve.vl.messages import has_images, text_only, tuple_to_messages
from llmserve.vl.prompt import ImagePrompt, count_images, raw_with_images, render_images

# A string, chat messages (content: a string or OpenAI / GPT-4V parts), {"input_ids": [...]}, or, for a
# vision-language model, LMDeploy's (text, image) or (text, [images]).
Prompt = str | Messages | dict[str, Any] | tuple

# Keyword names other engines use, mapped to GenerationConfig's. Not max_length (MII's and transformers'), which
# counts the prompt too: it becomes each prompt's max_new_tokens once the prompt is tokenized (Pipeline._max_length).
_ALIASES = {"max_tokens": "max_new_tokens", "seed": "random_seed", "stop": "stop_words",
            "min_tokens": "min_new_tokens"}
_GEN_FIELDS = {f.name for f in dataclasses.fields(GenerationConfig)}
_DEFAULT_MAX_NEW_TOKENS = next(f.default for f in dataclasses.fields(GenerationConfig) if f.name == "max_new_tokens")
_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


@dataclass
class Response:
    text: str
    generate_token_len: int
    input_token_len: int
    session_id: int
    finish_reason: str | None = None  # 'stop' | 'length' | 'abort'; None while streaming
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None  # per generated token: {token id: logprob}
    index: int = 0  # position of the prompt in the call's batch
    # GenerationConfig.prompt_logprobs: per prompt token {token id: logprob, top-N...}; None for the first one
    prompt_logprobs: list[dict[int, float] | None] | None = None

    def __str__(self) -> str:
        return self.text


@dataclass
class EmbeddingResponse:
    """Pipeline.embed's answer for one input: the pooled vector (engine/pooling.py)."""

    embedding: list[float]
    input_token_len: int
    index: int = 0  # position of the input in the call's batch


@dataclass
class Session:
    """A multi-turn conversation held by `Pipeline.chat`.

    `token_ids` is the conversation as the engine saw it (every prompt, then every answer's ids) and
    `text` the rendered chat those ids stand for. The next turn appends only the tokens of the text
    rendered after `text`, so its prompt starts with exactly these ids.

    Each turn runs under the engine session `chat-<session_id>` (engine/sessions.py): the engine keeps
    the conversation's KV between turns, so the next turn prefills only its new tokens, prefix caching
    on or off. The engine bounds its sessions (EngineConfig.max_sessions, session_ttl, and eviction
    under memory pressure); a turn whose session was evicted is recomputed from the same ids, with the
    same output. `Pipeline.end_session` (or closing the pipeline) frees the KV.
    """

    session_id: int
    history: Messages = field(default_factory=list)
    response: Response | None = None
    token_ids: list[int] = field(default_factory=list)  # empty: the next turn tokenizes the whole chat
    text: str = ""


class Pipeline:
    def __init__(self, model_path: str | None = None, backend_config: BackendConfig | None = None,
                 chat_template_config: ChatTemplateConfig | None = None, log_level: str = "ERROR",
                 vision_config: VisionConfig | None = None, **engine_kwargs: Any) -> None:
        logging.getLogger("llmserve").setLevel(log_level.upper())
        unknown = set(engine_kwargs) - _ENGINE_FIELDS
        if unknown:
            raise InvalidRequestError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        # LMDeploy's TurbomindEngineConfig / PytorchEngineConfig become the EngineConfig they ask for.
        if vision_config is not None:
            if not isinstance(vision_config, VisionConfig):
                raise InvalidRequestError(f"vision_config must be a VisionConfig, got {type(vision_config).__name__}",
                                          param="vision_config")
            engine_kwargs.setdefault("vision_max_batch_size", vision_config.max_batch_size)
        config = dataclasses.replace(as_engine_config(backend_config), **engine_kwargs)
        loaded = load_model(model_path, config)
        self.model_name = loaded.served_name
        self.tokenizer = loaded.tokenizer
        self.chat_template = model_chat_template(loaded, chat_template_config)
        self.processor = loaded.processor  # vision-language models: llmserve.vl.processor.VLProcessor
        self.image_limits = ImageLimits(max_pixels=config.max_image_pixels)  # paths allowed: the user's own files
        self.default_gen_config = default_generation_config(loaded)
        if config.dp > 1:
            raise InvalidRequestError("dp: data-parallel replicas are a server option (llmserve serve --dp N); a "
                                      "pipeline runs one engine", param="dp")
        self.engine: LLMEngine | None = LLMEngine(loaded, config)
        self._ids = itertools.count()
        gc_heap.freeze()  # the startup heap, for the pipeline's life (close() thaws it)

    # --- calls ---------------------------------------------------------------------------

    def __call__(self, prompts: Prompt | list[Prompt], gen_config: GenerationConfig | list[GenerationConfig] | None = None,
                 do_preprocess: bool = True, adapter_name: str | list[str | None] | None = None,
                 **gen_kwargs: Any) -> Response | list[Response]:
        """`gen_config` (LMDeploy's): one for every prompt, or a list with one per prompt. `adapter_name` (LMDeploy's):
        a loaded LoRA adapter for every prompt, or a list with one per prompt (None: the base model). Prompts with
        different settings or adapters run in the same batch."""
        batch, single = _as_batch(prompts)
        max_length = self._max_length(gen_config, gen_kwargs)
        gens = self._gen_configs(gen_config, gen_kwargs, len(batch))
        responses = self._collect(batch, gens, do_preprocess, max_length=max_length, adapter_name=adapter_name)
        return responses[0] if single and gens[0].n == 1 else responses

    def _collect(self, batch: list[Prompt], gens: GenerationConfig | list[GenerationConfig], do_preprocess: bool,
                 session_id: str | None = None, max_length: int | None = None,
                 adapter_name: str | list[str | None] | None = None) -> list[Response]:
        gens = gens if isinstance(gens, list) else [gens] * len(batch)
        results: dict[tuple[int, int], Response] = {}
        for r, out in self._generate(batch, gens, do_preprocess, session_id, max_length, adapter_name):
            key = (r.index, out.index)
            logprobs = [] if gens[r.index].logprobs is not None else None
            acc = results.setdefault(key, dataclasses.replace(r, text="", token_ids=[], logprobs=logprobs))
            _accumulate(acc, r)
        return [results[k] for k in sorted(results)]

    def embed(self, inputs: str | dict[str, Any] | list[str | dict[str, Any]], dimensions: int | None = None,
              normalize: bool | None = None, adapter_name: str | list[str | None] | None = None
              ) -> EmbeddingResponse | list[EmbeddingResponse]:
        """Embeddings of texts (tokenized as they are, with the tokenizer's special tokens: no chat template) or
        {"input_ids": [...]}, batched together, as vLLM's `LLM.embed`. The vector is pooled from the final hidden
        states as EngineConfig.pooler_config, the checkpoint's sentence-transformers modules or the default (LAST,
        normalized) say; `dimensions` keeps its first values (models trained for it: Matryoshka), `normalize`
        overrides the model's L2 normalization."""
        from llmserve.engine.pooling import EmbedParams

        single = isinstance(inputs, (str, dict))
        batch = [inputs] if single else inputs
        if not isinstance(batch, list) or not batch:
            raise InvalidRequestError("inputs must be a non-empty string, {'input_ids': [...]}, or a list of them",
                                      param="inputs")
        engine = self._engine()
        adapters = _per_prompt(adapter_name, len(batch), "adapter_name")
        token_ids = [self._embedding_ids(x) for x in batch]
        ids = [str(next(self._ids)) for _ in batch]
        params = EmbedParams(dimensions, normalize)
        results: dict[str, EmbeddingResponse] = {}
        added: list[str] = []
        try:
            for rid, toks, adapter in zip(ids, token_ids, adapters, strict=True):
                engine.add_embedding_request(rid, toks, params, adapter)
                added.append(rid)
            position = {rid: i for i, rid in enumerate(ids)}
            while len(results) < len(ids):
                for out in engine.step():
                    if out.embedding is not None:
                        results[out.request_id] = EmbeddingResponse(out.embedding, out.num_prompt_tokens,
                                                                     position[out.request_id])
                    elif out.finished:
                        raise InvalidRequestError(f"input {position[out.request_id]} was not embedded "
                                                  f"({out.finish_reason})")
        finally:
            for rid in added:
                if rid not in results:
                    engine.abort(rid)
        out = [results[rid] for rid in ids]
        return out[0] if single else out

    def _embedding_ids(self, item: Any) -> list[int]:
        if isinstance(item, str):
            return self.tokenizer(item, add_special_tokens=True)["input_ids"]
        if isinstance(item, dict) and set(item) == {"input_ids"} and isinstance(item["input_ids"], list):
            return item["input_ids"]
        raise InvalidRequestError(f"an input to embed must be a string or {{'input_ids': [...]}}, got "
                                  f"{type(item).__name__}", param="inputs")

    def stream_infer(self, prompts: Prompt | list[Prompt],
                     gen_config: GenerationConfig | list[GenerationConfig] | None = None,
                     do_preprocess: bool = True, session_id: str | None = None,
                     adapter_name: str | list[str | None] | None = None, **gen_kwargs: Any) -> Iterator[Response]:
        """Yield a Response per step and sequence carrying the new text and token ids (deltas);
        `generate_token_len` is cumulative; the last one of each sequence has finish_reason set.

        `session_id` (one prompt, one sequence): the engine keeps this conversation's KV after the
        answer, and a later call with the same id prefills only what its prompt adds (engine/sessions.py;
        `end_session_id` frees it). `gen_config`, `adapter_name`: as for __call__."""
        batch, _ = _as_batch(prompts)
        max_length = self._max_length(gen_config, gen_kwargs)
        gens = self._gen_configs(gen_config, gen_kwargs, len(batch))
        if session_id is not None and len(batch) != 1:  # (n, best_of and beam search: the engine refuses them)
            raise InvalidRequestError(f"session_id: a session continues one sequence; give one prompt, not "
                                      f"{len(batch)}", param="session_id")
        for r, _ in self._generate(batch, gens, do_preprocess, session_id, max_length, adapter_name):
            yield r

    def chat(self, prompt: str | tuple, session: Session | None = None, gen_config: GenerationConfig | None = None,
             adapter_name: str | None = None, **gen_kwargs: Any) -> Session:
        """One turn of a conversation: the prompt sees every earlier turn of `session`. A vision-language model takes
        (text, image) or (text, [images]) turns too; later turns see the earlier turns' images."""
        session = session or self.new_session()
        turn = tuple_to_messages(prompt) if isinstance(prompt, tuple) else [{"role": "user", "content": prompt}]
        messages = [*session.history, *turn]
        mm = None
        if has_images(messages):
            # the whole conversation through the processor: its images are part of every later prompt
            text, prompt_ids, mm = self.prompt_with_images(messages)
        else:
            text = self.chat_template.messages_to_prompt(messages)
            prompt_ids = self.session_prompt_ids(session, text)
        max_length = self._max_length(gen_config, gen_kwargs)
        gen = self._gen_config(gen_config, gen_kwargs)
        if max_length is not None:  # the conversation so far counts, as it is the prompt the engine sees
            gen = _within(gen, max_length, len(prompt_ids), "the conversation",
                          " (every turn so far, the chat template's tokens included)")
        prepared = {"input_ids": prompt_ids, "_mm": mm}
        response = self._collect([prepared], gen, True, engine_session_id(session, gen), adapter_name=adapter_name)[0]
        self.record_turn(session, messages, text, prompt_ids, response.text, response.token_ids)
        session.response = response
        return session

    def new_session(self) -> Session:
        """A fresh conversation for `chat` (or for a caller that streams its own turns, see record_turn)."""
        return Session(session_id=next(self._ids))

    def record_turn(self, session: Session, messages: Messages, text: str, prompt_ids: list[int], answer: str,
                    answer_ids: list[int]) -> None:
        """After a turn: `messages` (ending with the user's) rendered as `text` and sent as `prompt_ids`
        (from session_prompt_ids) got `answer` with `answer_ids`. The answer's ids stand for its text only
        if they decode to exactly it: a stop string cut from the text (its ids stay) or skipped special
        tokens break that, and the next turn then tokenizes the whole chat again."""
        session.history = [*messages, {"role": "assistant", "content": answer}]
        in_sync = self.tokenizer.decode(answer_ids, skip_special_tokens=False) == answer
        session.token_ids = prompt_ids + answer_ids if in_sync else []
        session.text = text + answer if in_sync else ""

    def end_session(self, session: Session) -> bool:
        """Free the KV the engine keeps for this chat session; False if it kept none (never stored,
        already ended, or evicted). The Session object stays usable: its next turn recomputes."""
        return self.end_session_id(engine_session_id(session))

    def end_session_id(self, session_id: str) -> bool:
        """end_session for a `stream_infer(..., session_id=...)` conversation."""
        return self._engine().end_session(session_id)

    # --- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.engine = None
        gc_heap.thaw()
        gc.collect()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals -----------------------------------------------------------------------

    def _gen_config(self, gen_config: GenerationConfig | None, kwargs: dict[str, Any]) -> GenerationConfig:
        if gen_config is not None and not isinstance(gen_config, GenerationConfig):
            raise InvalidRequestError(f"gen_config must be a GenerationConfig, got {type(gen_config).__name__}")
        changes = {_ALIASES.get(k, k): v for k, v in kwargs.items()}
        if changes.pop("do_sample", True) is False:
            changes["temperature"] = 0.0
        return (gen_config or self.default_gen_config).replace(**changes)

    def _gen_configs(self, gen_config: GenerationConfig | list[GenerationConfig] | None, kwargs: dict[str, Any],
                     num_prompts: int) -> list[GenerationConfig]:
        """One config per prompt: LMDeploy's gen_config is one for all, or a list with one per prompt (the keywords
        change each)."""
        if not isinstance(gen_config, (list, tuple)):
            return [self._gen_config(gen_config, kwargs)] * num_prompts
        if len(gen_config) != num_prompts:
            raise InvalidRequestError(f"gen_config: a list of {len(gen_config)} configs for {num_prompts} prompts; "
                                      "give one per prompt, or one for all", param="gen_config")
        return [self._gen_config(g, kwargs) for g in gen_config]

    def _max_length(self, gen_config: GenerationConfig | None, kwargs: dict[str, Any]) -> int | None:
        """Take MII's `max_length` (prompt plus output tokens) out of the keywords; None when not given.

        Given with an output bound too (max_new_tokens or max_tokens, or a gen_config whose max_new_tokens is
        not the default), it is refused: MII's documentation does not say which of the two wins. A gen_config
        that sets max_new_tokens to the default value cannot be told from one that leaves it unset."""
        max_length = kwargs.pop("max_length", None)
        if max_length is None:
            return None
        bounds = [k for k in ("max_new_tokens", "max_tokens") if kwargs.get(k) is not None]
        defaults = (_DEFAULT_MAX_NEW_TOKENS, self.default_gen_config.max_new_tokens)
        for c in gen_config if isinstance(gen_config, (list, tuple)) else [gen_config]:
            if isinstance(c, GenerationConfig) and c.max_new_tokens not in defaults:
                bounds.append(f"gen_config's max_new_tokens={c.max_new_tokens}")
        if bounds:
            raise InvalidRequestError(
                f"max_length and {bounds[0]}: give one of the two. max_length bounds the prompt plus the output "
                f"(DeepSpeed-MII's meaning), {bounds[0]} the output alone, and MII's documentation does not say "
                "which wins when both are given", param="max_length")
        session_len = self._engine().session_len
        if isinstance(max_length, int) and max_length > session_len:
            raise InvalidRequestError(f"max_length: {max_length} is over the session length of {session_len} "
                                      "tokens, which holds the prompt and the output; lower max_length",
                                      param="max_length")
        return max_length

    def session_prompt_ids(self, session: Session, text: str) -> list[int]:
        """The session's ids followed by the tokens of what the template rendered after them.

        Only the new text is tokenized, so earlier answers keep the ids they were generated as (a
        whole re-tokenization may merge tokens differently at a join and miss the cache from there
        on). When the rendering does not start with the previous one (a template that rewrites
        earlier turns, or a session out of sync), fall back to tokenizing the whole chat: correct,
        but the turn recomputes from the first differing block.
        """
        if session.token_ids and text.startswith(session.text):
            return session.token_ids + self.tokenizer.encode(text[len(session.text):], add_special_tokens=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _prepare(self, prompt: Prompt, do_preprocess: bool, limits: ImageLimits | None = None
                 ) -> tuple[list[int], MultiModalInputs | None]:
        """A prompt's token ids and, for one with images, its images' inputs."""
        limits = limits or self.image_limits
        if isinstance(prompt, dict):
            ids = prompt.get("input_ids")
            if not isinstance(ids, list):
                raise InvalidRequestError("a dict prompt must be {'input_ids': [token ids]}", param="prompt")
            return ids, prompt.get("_mm")
        if isinstance(prompt, tuple):
            if not do_preprocess:
                return self._raw_with_images(prompt, limits)
            prompt = tuple_to_messages(prompt)
        if isinstance(prompt, list):
            if has_images(prompt):
                _, ids, mm = self.prompt_with_images(prompt, limits)
                return ids, mm
            messages = prompt if self.processor is not None else text_only(prompt)
            text = self.chat_template.messages_to_prompt(messages)
            return self.tokenizer.encode(text, add_special_tokens=False), None
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"a prompt must be a string, a list of messages, (text, images) or "
                                      f"{{'input_ids': [...]}}, got {type(prompt).__name__}", param="prompt")
        if do_preprocess:
            text = self.chat_template.messages_to_prompt([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(text, add_special_tokens=False), None
        return self.tokenizer.encode(prompt), None

    def prompt_with_images(self, messages: Messages, limits: ImageLimits | None = None) -> ImagePrompt:
        """(rendered text, token ids, images) of chat messages with image parts (the steps of vl/prompt.py); the
        images load within `limits` (default: the pipeline's)."""
        self._engine().validate_image_count(count_images(messages))  # before any image is fetched or decoded
        return render_images(messages, self.chat_template, self.processor, limits or self.image_limits)

    def _raw_with_images(self, prompt: tuple, limits: ImageLimits) -> tuple[list[int], MultiModalInputs | None]:
        """do_preprocess=False: the text as it is, the images where it holds IMAGE_TOKEN or the processor's image
        token (else before it)."""
        parts = [(f"messages[0].content[{j}]", p["image"]) for j, p in enumerate(tuple_to_messages(prompt)[0]["content"])
                 if p["type"] == "image"]
        self._engine().validate_image_count(len(parts))
        token = self.processor.image_token
        text = prompt[0].replace(IMAGE_TOKEN, token)
        if token not in text:
            text = token * len(parts) + text
        _, ids, mm = raw_with_images(text, [s for _, s in parts], self.processor, limits, [w for w, _ in parts])
        return ids, mm

    def _generate(self, batch: list[Prompt], gens: list[GenerationConfig], do_preprocess: bool,
                  session_id: str | None = None, max_length: int | None = None,
                  adapter_name: str | list[str | None] | None = None) -> Iterator[tuple[Response, SequenceOutput]]:
        engine = self._engine()
        adapters = _per_prompt(adapter_name, len(batch), "adapter_name")
        for name in adapters:  # every name is checked before any request is queued
            engine.adapter(name)
        prepared = [self._prepare(p, do_preprocess) for p in batch]
        token_ids = [ids for ids, _ in prepared]
        # Every prompt's budget is checked before any request is queued.
        gens = [gen if max_length is None else
                _within(gen, max_length, len(toks), _subject(i, len(batch)), _counted(p, do_preprocess))
                for i, (p, toks, gen) in enumerate(zip(batch, token_ids, gens, strict=True))]
        ids = [str(next(self._ids)) for _ in batch]
        added: list[str] = []
        try:
            for rid, (toks, mm), prompt_gen, adapter in zip(ids, prepared, gens, adapters):
                engine.add_request(rid, toks, prompt_gen, session_id, mm, adapter)
                added.append(rid)
            position = {rid: i for i, rid in enumerate(ids)}
            unfinished = sum(g.n for g in gens)
            while unfinished:
                for out in engine.step():
                    unfinished -= out.finished
                    yield _response(out, position[out.request_id], int(out.request_id)), out
        finally:  # an exception (or a consumer that stops iterating) must not leave requests behind
            for rid in added:
                engine.abort(rid)

    def _engine(self) -> LLMEngine:
        if self.engine is None:
            raise InvalidRequestError("this pipeline was closed; create a new one")
        return self.engine


def pipeline(model_path: str | None = None, backend_config: BackendConfig | None = None,
             chat_template_config: ChatTemplateConfig | None = None, log_level: str = "ERROR",
             vision_config: VisionConfig | None = None, **engine_kwargs: Any) -> Pipeline:
    """Load a model (a local directory, a hub id, a .gguf file, or None for the embedded default)."""
    return Pipeline(model_path, backend_config, chat_template_config, log_level, vision_config, **engine_kwargs)


def default_generation_config(loaded: LoadedModel) -> GenerationConfig:
    """GenerationConfig() with the model's generation_config.json defaults laid over it."""
    known = {k: v for k, v in loaded.generation_defaults.items() if k in _GEN_FIELDS}
    return GenerationConfig(**known)


def _as_batch(prompts: Any) -> tuple[list[Prompt], bool]:
    if isinstance(prompts, (str, dict, tuple)):
        return [prompts], True
    if isinstance(prompts, list) and prompts and all(isinstance(p, dict) and "role" in p for p in prompts):
        return [prompts], True  # one conversation in OpenAI message format
    if not isinstance(prompts, list) or not prompts:
        raise InvalidRequestError("prompts must be a non-empty string, list of prompts, list of messages or "
                                  "{'input_ids': [...]}", param="prompts")
    return list(prompts), False


def _per_prompt(value: Any, count: int, param: str) -> list[Any]:
    """One value for every prompt, or a list of one per prompt."""
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise InvalidRequestError(f"{param}: a list needs one entry per prompt ({count}), got {len(value)}",
                                      param=param)
        return list(value)
    return [value] * count


def _within(gen: GenerationConfig, max_length: int, prompt_tokens: int, subject: str, note: str) -> GenerationConfig:
    """`gen` with the output budget `max_length` leaves after this prompt."""
    max_new = max_new_tokens_within(max_length, prompt_tokens, subject, note)
    if gen.min_new_tokens > max_new:
        raise InvalidRequestError(f"min_new_tokens: {gen.min_new_tokens} is more than the {max_new} tokens max_length="
                                  f"{max_length} leaves after the {prompt_tokens} of {subject}", param="min_new_tokens")
    return gen.replace(max_new_tokens=max_new)


def _subject(index: int, count: int) -> str:
    return "the prompt" if count == 1 else f"prompt {index} (of {count})"


def _counted(prompt: Prompt, do_preprocess: bool) -> str:
    """What a prompt's token count includes, for max_length's error."""
    if isinstance(prompt, list) or (isinstance(prompt, str) and do_preprocess):
        raw = "; do_preprocess=False sends the raw text" if isinstance(prompt, str) else ""
        return f" (the chat template's tokens included{raw})"
    return ""


def engine_session_id(session: Session, gen: GenerationConfig | None = None) -> str | None:
    """The engine session a chat session's turns run under; None for a turn that samples several
    sequences (n > 1, best_of, beam search), which runs without one."""
    return f"chat-{session.session_id}" if gen is None or gen.single_sequence else None


def _response(out: SequenceOutput, index: int, session_id: int) -> Response:
    logprobs = [_logprob_dict(lp) for lp in out.new_logprobs]
    prompt = None if out.prompt_logprobs is None else [lp and _logprob_dict(lp) for lp in out.prompt_logprobs]
    return Response(text=out.new_text, generate_token_len=out.num_output_tokens, input_token_len=out.num_prompt_tokens,
                    session_id=session_id, finish_reason=out.finish_reason, token_ids=list(out.new_token_ids),
                    logprobs=logprobs or None, index=index, prompt_logprobs=prompt)


def _logprob_dict(lp: Any) -> dict[int, float]:
    return {lp.token_id: lp.logprob, **dict(lp.top)}


def _accumulate(acc: Response, delta: Response) -> None:
    acc.text += delta.text
    acc.token_ids.extend(delta.token_ids)
    if acc.logprobs is not None and delta.logprobs:
        acc.logprobs.extend(delta.logprobs)
    acc.generate_token_len = delta.generate_token_len
    acc.finish_reason = delta.finish_reason
    acc.prompt_logprobs = acc.prompt_logprobs or delta.prompt_logprobs
