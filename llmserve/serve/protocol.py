"""OpenAI request bodies (/v1/chat/completions, /v1/completions, /v1/responses, ...) as pydantic models.

Strict types (a string where a number belongs is a 400, as OpenAI answers; ints are accepted for
floats). Every field OpenAI documents is declared here, and so are the vLLM extras we take: each is
honoured, refused with a 400 naming it, or (where it cannot change the output, e.g. `user`) accepted
and ignored, as docs/serving.md's table says. A field we do not know is refused when it carries a
value (`unknown_fields`): a client asking for something we would silently not do gets told. Value
checks (ranges, consistency) happen when the request is turned into a GenerationConfig
(openai_params.py), which names the offending field. Responses are built as plain dicts
(openai_format.py): one per streamed chunk, on the hot path.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from llmserve.serve.errors import ApiError

# What an undeclared field may carry without being refused (`unknown_fields`), for the OpenAPI schema.
NOT_SENT_SCHEMA: dict[str, Any] = {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0},
                                             {"type": "object", "maxProperties": 0}, {"type": "string", "maxLength": 0}]}
BODY_SCHEMA_EXTRA: dict[str, Any] = {"additionalProperties": NOT_SENT_SCHEMA}
# "Must not be empty", said in the schema only: the check itself (and its message) stays where it is made.
NON_EMPTY = Field(json_schema_extra={"minItems": 1, "minLength": 1})
CHOICES_SCHEMA: dict[str, Any] = {"minItems": 1, "items": {"type": "string", "minLength": 1}}


class _Body(BaseModel):
    # Unknown fields are kept (not validated) so that `unknown_fields` can refuse the ones with a value.
    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True, json_schema_extra=BODY_SCHEMA_EXTRA)


def unknown_fields(body: BaseModel, prefix: str = "") -> list[str]:
    """Dotted names of the fields of `body` (and its nested bodies) that the model does not declare and that
    carry a value; null, [] and {} count as not sent (several clients send every field they know, unset ones
    empty)."""
    names = [prefix + k for k, v in (body.model_extra or {}).items() if not _empty(v)]
    for name in type(body).model_fields:
        value = getattr(body, name)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, BaseModel):
                where = f"{name}[{i}]" if isinstance(value, list) else name
                names.extend(unknown_fields(item, f"{prefix}{where}."))
    return names


def refuse_unknown_fields(body: BaseModel) -> None:
    """The first unknown field that carries a value, refused as a 400 naming it (`unknown_fields`)."""
    unknown = unknown_fields(body)
    if unknown:
        raise ApiError(400, f"{unknown[0]}: unknown field; llmserve does not know what it asks for, so it refuses it "
                            "rather than ignore it (the fields it takes are listed in docs/serving.md)",
                       param=unknown[0])


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, (list, dict, str)) and not value)


class StreamOptions(_Body):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far (guidellm asks for it on every request)
    continuous_usage_stats: bool = False
    include_obfuscation: bool | None = None  # OpenAI's side-channel padding of chunks: no effect on the text


class StructuredOutputsParams(_Body):
    """vLLM's `structured_outputs` extra field: exactly one of json, regex, choice, grammar, json_object,
    structural_tag."""

    json_schema: dict[str, Any] | str | bool | None = Field(None, alias="json")  # a JSON schema
    regex: str | None = None
    choice: list[str] | None = Field(None, json_schema_extra=CHOICES_SCHEMA)
    grammar: str | None = None  # EBNF
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_fallback: bool = False  # one backend, no fallback: nothing to disable
    disable_any_whitespace: bool = False  # JSON in its compact form only
    disable_additional_properties: bool = False  # the grammar never adds properties a schema does not list
    whitespace_pattern: str | None = None  # refused: xgrammar has no custom whitespace


class SamplingRequest(_Body):
    """Fields common to chat and text completions, OpenAI's and ours (the `extra_body` ones)."""

    model: str | None = None  # optional, as in vLLM: None means the served model
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None  # None: the model's generation_config default
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    best_of: int | None = None  # sampled: best of this many; beam search: the beam width
    use_beam_search: bool = False
    length_penalty: float = 1.0  # beam search (vLLM's legacy names)
    early_stopping: bool | Literal["never"] = False
    # ours (extra_body), vLLM's names
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    # ours: keep this conversation's KV for its next request (LMDeploy's session_id). The client still
    # sends the whole history; the session only saves the prefill of what was already computed.
    session_id: str | int | None = None
    # structured output: OpenAI's response_format, and vLLM's names for the same (structured_params.py)
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | bool | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, json_schema_extra=CHOICES_SCHEMA)
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: StructuredOutputsParams | None = None
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' logprobs (and top-N), in the response


class ContentPart(_Body):
    type: str
    text: str | None = None
    # {"url": "https://... | data:image/...;base64,... | file:///..." , "detail": ...}; its shape is checked where the
    # images are read (vl/messages.py), which names the part; `detail` has no effect
    image_url: Any = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]  # function: the deprecated API's
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # What clients send back of an earlier assistant turn, and tool results.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    function_call: dict[str, Any] | None = None
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = NON_EMPTY
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins when both are set
    logprobs: bool = False
    top_logprobs: int | None = None
    # OpenAI's other documented fields: see openai_params.check_chat_fields for what each one gets
    audio: dict[str, Any] | None = None
    function_call: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    metadata: dict[str, Any] | None = None
    modalities: list[str] | None = None
    parallel_tool_calls: bool | None = None
    prediction: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    reasoning_effort: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    tool_choice: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    # vLLM's: variables for the chat template (Qwen3's enable_thinking), taken only where the template reads them
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the last (assistant) message is left open and the answer continues it (a "prefill")
    continue_final_message: bool = False


class ResponsesRequest(SamplingRequest):
    """OpenAI's Responses API body (POST /v1/responses; serve/responses_routes.py). The sampling fields both
    generation routes share are taken too (vLLM's extras in `extra_body`); `n` and `max_tokens` belong to the
    other routes and are refused. Items and tools are kept as sent and checked, naming the item, where they are
    turned into a chat (responses_input.py)."""

    input: str | list[dict[str, Any]] = NON_EMPTY
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    store: bool = True  # OpenAI's default: the response can be read back and continued (in memory here)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    reasoning: dict[str, Any] | None = None  # {"effort": ..., "summary": ...}
    include: list[str] | None = None
    top_logprobs: int | None = None
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, Any] | None = None
    background: bool | None = None
    max_tool_calls: int | None = None
    prompt: dict[str, Any] | None = None  # a stored prompt template (refused: none are stored here)
    conversation: str | dict[str, Any] | None = None  # the Conversations API (refused: not served here)
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    # vLLM's: variables for the chat template (Qwen3's enable_thinking), taken only where the template reads them
    chat_template_kwargs: dict[str, Any] | None = None


class AnthropicMessagesRequest(SamplingRequest):
    """Anthropic's Messages API body (POST /v1/messages; serve/anthropic_routes.py). As with the Responses API, the
    sampling fields the OpenAI routes share are taken too (vLLM's extras); the OpenAI names of what this API names
    otherwise (`stop`, `response_format`) and `n` are refused. Messages and tools are kept as sent and checked,
    naming the block, where they become a chat (anthropic_input.py)."""

    messages: list[dict[str, Any]] = NON_EMPTY
    max_tokens: int  # required, as in Anthropic's API
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None  # prompt caching: automatic here
    inference_geo: str | None = None
    container: str | dict[str, Any] | None = None  # refused: no code execution here
    mcp_servers: list[dict[str, Any]] | None = None  # refused: no MCP connector here
    context_management: dict[str, Any] | None = None  # refused: context editing is not done here
    # vLLM's: variables for the chat template, taken only where the template reads them
    chat_template_kwargs: dict[str, Any] | None = None


class AnthropicCountTokensRequest(_Body):
    """POST /v1/messages/count_tokens: what a Messages request would take as input."""

    model: str | None = None
    messages: list[dict[str, Any]] = NON_EMPTY
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]] = NON_EMPTY
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None


class EmbeddingRequest(_Body):
    """OpenAI's /v1/embeddings body with vLLM's extras (serve/embedding_routes.py)."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] = NON_EMPTY
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, json_schema_extra={"minimum": 1})
    user: str | None = None  # OpenAI's end-user id: for their abuse monitoring, nothing to do here
    # vLLM's extras
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    normalize: bool | None = None


class ScoreRequest(_Body):
    """vLLM's /score body (serve/score_routes.py)."""

    model: str | None = None
    text_1: str | list[str] = NON_EMPTY
    text_2: str | list[str] = NON_EMPTY
    truncate_prompt_tokens: int | None = None


class RerankRequest(_Body):
    """vLLM's /rerank body, which Cohere's and Jina's clients send (serve/score_routes.py)."""

    model: str | None = None
    query: str
    documents: list[str | dict[str, Any]] = NON_EMPTY
    top_n: int | None = None  # 0 or less, or null: every document (vLLM's)
    return_documents: bool | None = None  # Cohere's name; unset: returned, as vLLM always does
    truncate_prompt_tokens: int | None = None


class TeiEmbedRequest(_Body):
    """Text Embeddings Inference's /embed body (serve/embedding_routes.py)."""

    inputs: str | list[str] = NON_EMPTY
    normalize: bool = True
    truncate: bool = False
    truncation_direction: Literal["Right", "Left", "right", "left"] = "Right"
    prompt_name: str | None = None
    dimensions: int | None = None
