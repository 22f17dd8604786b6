"""OpenAI requests -> prompt token ids and a GenerationConfig, with every refusal as a 400 naming
the field as the client spelled it.

Defaults, as vLLM: unset sampling knobs take the model's generation_config.json values; chat's
max_tokens defaults to what is left of the context (or of the KV pool, if that is smaller),
completions' to 16 (OpenAI's legacy default).
"""

from __future__ import annotations

import asyncio
from typing import Any, NamedTuple

from pydantic import ValidationError

from llmserve.chat_template import ChatTemplate
from llmserve.config import GenerationConfig
from llmserve.errors import InvalidRequestError
from llmserve.serve.chat_tools import ChatOutput
from llmserve.serve.errors import ApiError
from llmserve.serve.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingRequest,
    refuse_unknown_fields,
)
from llmserve.serve.state import ServedModel
from llmserve.serve.structured_params import openai_structured_output
from llmserve.tools import ToolRequest
from llmserve.vl.image import ImageLimits
from llmserve.vl.inputs import MultiModalInputs
from llmserve.vl.messages import text_only
from llmserve.vl.prompt import count_images, render_images

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_LOGPROBS = 20

# GenerationConfig field -> the request field, for error messages.
PARAM_NAMES = {"max_new_tokens": "max_tokens", "random_seed": "seed", "stop_words": "stop",
               "min_new_tokens": "min_tokens", "beam_width": "best_of"}


def check_model(model: ServedModel, requested: str | None) -> str | None:
    """The LoRA adapter the request's `model` names (None: the base model); 404 for a model not served here."""
    return model.adapter_of(requested)


def chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """A chat request built from another API's body (Responses, Anthropic, /tokenize), its values passed on as sent;
    a value of the wrong type among them is a 400 naming the field (the caller renames it to its API's)."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        loc = err.get("loc") or ("messages",)
        raise ApiError(400, f"{'.'.join(str(x) for x in loc)}: {err['msg']} (got {err.get('input')!r})",
                       param=str(loc[0])) from None


class ChatPrompt(NamedTuple):
    text: str  # as the template rendered it (whether it opened the reasoning is read from its end)
    token_ids: list[int]
    mm: MultiModalInputs | None = None  # a vision-language model's images


async def chat_prompt(model: ServedModel, req: ChatCompletionRequest, tools: ToolRequest | None,
                      limits: ImageLimits) -> ChatPrompt:
    """The messages through the chat template, with the tools the model may call and the template variables the
    request sets (chat_template_kwargs, reasoning_effort). A vision-language model's images take the pipeline's
    steps (vl/prompt.py): counted first (refused before anything is fetched), then loaded, rendered and processed on
    a worker thread, so a slow download or a large decode never holds up the event loop."""
    messages = [_template_message(m, i) for i, m in enumerate(req.messages)]
    template = model.chat_template
    try:
        variables = template_variables(template, req)
        template_tools = tools.template_tools if tools else None
        num_images = count_images(messages) if model.takes_images else 0
        if num_images:
            model.check_image_count(num_images)
            return ChatPrompt(*await asyncio.to_thread(render_images, messages, template, model.processor, limits,
                                                       template_tools, variables))
        text = template.messages_to_prompt(messages if model.takes_images else text_only(messages), template_tools,
                                           variables)
    except InvalidRequestError as e:
        raise ApiError.from_invalid(e) from None
    # The template writes the special tokens (BOS included) itself.
    return ChatPrompt(text, model.tokenizer.encode(text, add_special_tokens=False))


def template_variables(template: ChatTemplate, req: ChatCompletionRequest) -> dict[str, Any]:
    """vLLM's chat_template_kwargs and OpenAI's reasoning_effort, each refused where the template never reads it;
    vLLM's continue_final_message (the last assistant message left open)."""
    variables = dict(req.chat_template_kwargs or {})
    template.check_kwargs(variables, "chat_template_kwargs")
    if req.reasoning_effort is not None:
        template.check_kwargs({"reasoning_effort": req.reasoning_effort}, "reasoning_effort")
        variables["reasoning_effort"] = req.reasoning_effort
    if req.continue_final_message:  # transformers' own argument (so not a template variable a client may set)
        if req.messages[-1].role != "assistant" or not isinstance(req.messages[-1].content, str) \
                or not req.messages[-1].content:
            raise ApiError(400, "continue_final_message: the last message must be an assistant's, with text, for "
                                "the answer to continue it", param="continue_final_message")
        variables["continue_final_message"] = True
    return variables


def _template_message(m: ChatMessage, i: int) -> dict[str, Any]:
    """role and content, and what tool calling adds (tool_calls, tool_call_id, name) and reasoning models read back
    (reasoning_content) where the client sent it."""
    message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": _content(m, i)}
    for key in ("tool_calls", "tool_call_id", "name", "reasoning_content"):
        value = getattr(m, key)
        if value is not None:
            message[key] = value
    return message


def _content(m: ChatMessage, i: int) -> str | list[dict[str, Any]]:
    """A string, or the parts: text, and image_url (a text-only model refuses those, vl.messages.text_only)."""
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(m.content):
        if part.type == "text" and part.text is not None:
            parts.append({"type": "text", "text": part.text})
        elif part.type == "image_url":
            parts.append({"type": "image_url", "image_url": part.image_url})
        else:
            what = "a text part needs a string `text`" if part.type == "text" else f"got a {part.type!r} part"
            raise ApiError(400, f"messages[{i}].content[{j}]: a content part is of type text or image_url; {what}",
                           param="messages")
    return parts


class CompletionPrompt(NamedTuple):
    text: str | None  # None for a prompt sent as token ids
    token_ids: list[int]

    def echo(self, tokenizer: Any) -> str:
        return self.text if self.text is not None else tokenizer.decode(self.token_ids)


def completion_prompts(model: ServedModel, prompt: str | list[str] | list[int] | list[list[int]]) -> list[CompletionPrompt]:
    """One string, several strings, one token list or several token lists."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise ApiError(400, "prompt: must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [CompletionPrompt(None, list(prompt))]  # type: ignore[arg-type]
    # Raw text: the tokenizer adds what the model expects at the start (BOS), as vLLM does.
    return [CompletionPrompt(None, p) if isinstance(p, list) else CompletionPrompt(p, model.tokenizer.encode(p))
            for p in prompt]


def session_id_of(req: SamplingRequest, num_prompts: int = 1) -> str | None:
    """The body's session_id as the engine's key (its text: 5 and "5" are one session). The engine checks
    the key itself (non-empty, bounded length) and the sampling settings a session allows."""
    if req.session_id is None:
        return None
    key = str(req.session_id)
    if num_prompts > 1:
        raise ApiError(400, f"session_id: a session continues one conversation; send one prompt, not {num_prompts}",
                       param="session_id")
    return key


def check_prompt_length(model: ServedModel, num_tokens: int, max_tokens: int | None, what: str) -> int:
    """max_tokens, defaulted to what is left of the context; 400 when the prompt does not fit."""
    limit = model.session_len
    if num_tokens >= limit:
        raise ApiError(400, f"This model's maximum context length is {limit} tokens, and the {what} "
                            f"{'have' if what == 'messages' else 'has'} {num_tokens} tokens: shorten it.",
                       param=what, code="context_length_exceeded")
    if max_tokens is None:  # as much as fits: in the context, and in the KV pool for a lone sequence
        if num_tokens >= model.kv_tokens:
            raise ApiError(400, f"The {what} {'have' if what == 'messages' else 'has'} {num_tokens} tokens, and the "
                                f"KV cache holds at most {model.kv_tokens} tokens per sequence: shorten it.",
                           param=what, code="context_length_exceeded")
        return min(limit, model.kv_tokens) - num_tokens
    if num_tokens + max_tokens > limit:
        raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                            f"{num_tokens + max_tokens} tokens ({num_tokens} in the {what}, {max_tokens} for the "
                            "completion). Reduce the length of the prompt or max_tokens.",
                       param="max_tokens", code="context_length_exceeded")
    return max_tokens


def chat_generation_config(model: ServedModel, req: ChatCompletionRequest, max_tokens: int,
                           output: ChatOutput) -> GenerationConfig:
    check_chat_fields(req)
    _check_unsupported(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise ApiError(400, f"top_logprobs: must be in [0, {MAX_LOGPROBS}], got {logprobs}", param="top_logprobs")
    if req.prompt_logprobs is not None and req.stream:
        raise ApiError(400, "prompt_logprobs: not available when streaming a chat completion", param="prompt_logprobs")
    constraint = output.constraint(openai_structured_output(req))
    if constraint is not None and req.continue_final_message:
        raise ApiError(400, "continue_final_message: a grammar (structured output, or a tool call forced) would hold "
                            "only for what follows the prefill; send one or the other", param="continue_final_message")
    changes: dict[str, Any] = {"logprobs": logprobs, "prompt_logprobs": req.prompt_logprobs,
                               "response_format": constraint,
                               "prediction": _prediction_ids(model, predicted_text(req.prediction))}
    if output.uses_tools and "skip_special_tokens" not in req.model_fields_set:
        changes["skip_special_tokens"] = False  # Mistral's [TOOL_CALLS] is a special token: the parser must see it
    # a grammar the tools asked for is refused (beam search) under the name of the field that asked
    names = {"logprobs": "top_logprobs", **({"response_format": "tool_choice"} if output.grammar else {})}
    return _generation_config(model, req, max_tokens, names, changes)


def completion_generation_config(model: ServedModel, req: CompletionRequest, max_tokens: int) -> GenerationConfig:
    _check_unsupported(req)
    if req.suffix:
        raise ApiError(400, "suffix: not supported", param="suffix")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise ApiError(400, f"logprobs: must be in [0, {MAX_LOGPROBS}], got {req.logprobs}", param="logprobs")
    # echo with logprobs returns the prompt's too, as vLLM does (lm-eval's loglikelihood tasks read them)
    echoed = req.logprobs if req.echo and req.logprobs is not None else None
    wanted = [n for n in (echoed, req.prompt_logprobs) if n is not None]
    return _generation_config(model, req, max_tokens, {}, {
        "logprobs": req.logprobs, "prompt_logprobs": max(wanted) if wanted else None,
        "response_format": openai_structured_output(req)})


def _generation_config(model: ServedModel, req: SamplingRequest, max_tokens: int, names: dict[str, str],
                       route_changes: dict[str, Any]) -> GenerationConfig:
    """`route_changes`: what the route decides itself (logprobs, prompt_logprobs, response_format, ...), over the
    fields both routes share."""
    changes: dict[str, Any] = {
        "n": req.n, "max_new_tokens": max_tokens, "min_new_tokens": req.min_tokens, "stop_words": req.stop,
        "random_seed": req.seed, "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
        "logit_bias": _logit_bias(req.logit_bias), "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens, "stop_token_ids": req.stop_token_ids,
        "bad_words": req.bad_words, "include_stop_str_in_output": req.include_stop_str_in_output,
        "best_of": req.best_of, "use_beam_search": req.use_beam_search,
        "length_penalty": req.length_penalty, "early_stopping": req.early_stopping, **route_changes,
    }
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        if getattr(req, name) is not None:
            changes[name] = getattr(req, name)
    try:
        return model.defaults.replace(**changes)
    except InvalidRequestError as e:
        raise ApiError.from_invalid(e, {**PARAM_NAMES, **names}) from None


MAX_N = 128  # OpenAI's limit; each sample is a sequence in the engine


def _check_unsupported(req: SamplingRequest) -> None:
    refuse_unknown_fields(req)
    if req.n > MAX_N:
        raise ApiError(400, f"n: must be <= {MAX_N}, got {req.n}", param="n")
    if req.best_of is not None and req.best_of > MAX_N:
        raise ApiError(400, f"best_of: must be <= {MAX_N}, got {req.best_of}", param="best_of")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options: only allowed when stream is true", param="stream_options")


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        if not key.lstrip("-").isdigit():
            raise ApiError(400, f"logit_bias: keys must be token ids, got {key!r}", param="logit_bias")
        if not -100 <= value <= 100:
            raise ApiError(400, f"logit_bias: values must be in [-100, 100], got {value} for token {key}",
                           param="logit_bias")
        out[int(key)] = value
    return out


# Chat fields OpenAI documents that llmserve cannot honour: refused when they ask for something.
_CHAT_REFUSALS: dict[str, str] = {
    "audio": "audio output is not supported",
    "web_search_options": "web search is not available",
    "verbosity": "this server's models take no verbosity setting",
}


def predicted_text(prediction: dict[str, Any] | None) -> str | None:
    """OpenAI's Predicted Outputs: {"type": "content", "content": "..." or [{"type": "text", "text": "..."}, ...]}
    -> the predicted text (GenerationConfig.prediction: drafted and verified, so the output is unchanged)."""
    if prediction is None:
        return None
    shape = 'expected {"type": "content", "content": "..."} (or content as a list of {"type": "text", "text": ...})'
    if not isinstance(prediction, dict) or prediction.get("type") != "content" or set(prediction) != {"type", "content"}:
        raise ApiError(400, f"prediction: {shape}", param="prediction")
    content = prediction["content"]
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                         and set(p) == {"type", "text"} for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"prediction: {shape}", param="prediction")


def _prediction_ids(model: ServedModel, text: str | None) -> list[int] | None:
    """The prediction tokenized here, as prompts are, not on the engine's thread (a long one would hold up steps)."""
    return None if text is None else model.tokenizer.encode(text, add_special_tokens=False)


def legacy_functions(req: ChatCompletionRequest) -> bool:
    """OpenAI's deprecated functions API, as the tools API it became: `functions` -> `tools`, `function_call` ->
    `tool_choice` ("none", "auto", {"name": ...}), one call at most (the old API returns one); in the history an
    assistant's `function_call` -> a tool call, a "function" message -> a "tool" message answering it. Rewrites req in
    place; True where it used the old API (the answer then carries `function_call`, ChoiceOutput.legacy)."""
    history = any(m.function_call is not None or m.role == "function" for m in req.messages)
    if req.functions is None and req.function_call is None and not history:
        return False
    if req.tools is not None or req.tool_choice is not None:
        raise ApiError(400, "functions: send either the deprecated functions / function_call or tools / "
                            "tool_choice, not both", param="functions")
    functions = req.functions or []
    if not isinstance(functions, list) or not all(isinstance(f, dict) and isinstance(f.get("name"), str)
                                                  for f in functions):
        raise ApiError(400, "functions: expected a list of {\"name\": ..., \"description\": ..., \"parameters\": "
                            "{...}}", param="functions")
    choice = req.function_call
    if choice is not None and not (choice in ("none", "auto") or (isinstance(choice, dict) and set(choice) == {"name"}
                                                                    and isinstance(choice["name"], str))):
        raise ApiError(400, f"function_call: expected \"none\", \"auto\" or {{\"name\": ...}}, got {choice!r}",
                       param="function_call")
    if functions:
        req.tools = [{"type": "function", "function": f} for f in functions]
        req.tool_choice = (choice if isinstance(choice, str) or choice is None
                           else {"type": "function", "function": {"name": choice["name"]}})
        req.parallel_tool_calls = False
    elif choice is not None and choice != "none":
        raise ApiError(400, f"function_call: {choice!r} needs functions to call, and there are none",
                       param="function_call")
    messages, last_call = [], None
    for i, m in enumerate(req.messages):
        if m.function_call is not None:
            call = m.function_call
            if not (isinstance(call.get("name"), str) and isinstance(call.get("arguments", ""), str)):
                raise ApiError(400, f"messages[{i}].function_call: expected {{\"name\": ..., \"arguments\": "
                                    "\"...\"}", param="messages")
            last_call = f"call_{i}"
            m = m.model_copy(update={"function_call": None, "tool_calls": [
                {"id": last_call, "type": "function",
                 "function": {"name": call["name"], "arguments": call.get("arguments", "")}}]})
        elif m.role == "function":
            if last_call is None:
                raise ApiError(400, f"messages[{i}]: a \"function\" message answers an assistant's function_call, "
                                    "and none comes before it", param="messages")
            m = m.model_copy(update={"role": "tool", "tool_call_id": last_call})
        messages.append(m)
    req.messages = messages
    req.functions = req.function_call = None
    return True


def check_chat_fields(req: ChatCompletionRequest) -> None:
    """Refuse what we cannot do (docs/serving.md lists every field). Accepted with no effect on the output:
    user, metadata, safety_identifier, prompt_cache_key (prefix caching is automatic), service_tier,
    store=false, stream_options.include_obfuscation."""
    for name, reason in _CHAT_REFUSALS.items():
        value = getattr(req, name)
        if value not in (None, [], {}):
            raise ApiError(400, f"{name}: {reason}", param=name)
    if req.modalities not in (None, [], ["text"]):
        raise ApiError(400, f"modalities: only [\"text\"] is supported, got {req.modalities}", param="modalities")
    if req.store:
        raise ApiError(400, "store: this server does not store completions", param="store")
    for i, m in enumerate(req.messages):
        if m.audio:
            raise ApiError(400, f"messages[{i}]: audio in messages is not supported", param="messages")
