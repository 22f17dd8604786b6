"""config.json read into the attributes our model code uses, with transformers' defaults per model type.

Why not `AutoConfig`: in transformers 5, importing any model's configuration module imports
`transformers.activations`, which pulls in `torch.distributed.tensor` and `torch._dynamo`: about 1.4 s of
a 5 s start on a 2-core CPU, for a JSON file. `AutoTokenizer` loads `AutoConfig` too unless it is handed
a config, so `load_tokenizer` gives it this one where that is safe (`tokenizer_class`).

What this reproduces (transformers 5.23, `models/*/configuration_*.py` and `modeling_rope_utils.py`):
- each model type's defaults for absent keys (`_DEFAULTS`): Llama and Mistral default bos 1 / eos 2,
  Qwen3 a head_dim of 128, Mistral a 4096 sliding window;
- num_key_value_heads = heads when null, and Qwen's sliding window only with `use_sliding_window`
  (head_dim and Qwen's per-layer windows, when absent, are derived by the model code as for older
  transformers configs: llama.head_dim_of, llama.layer_sliding_windows);
- the RoPE normalisation into `rope_parameters` (legacy `rope_scaling` + `rope_theta`, `type` ->
  `rope_type`, `original_max_position_embeddings` for llama3 / yarn / longrope);
- every other key kept as an attribute, as `PreTrainedConfig` keeps unknown keys.

Model types we do not know here, and remote-code configs, still go through `AutoConfig`
(`loader.read_hf_config`). tests/models/test_model_config.py checks every field our models read
against `AutoConfig` on a table of configs.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

from llmserve.errors import ModelLoadError

_COMMON: dict[str, Any] = {
    "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
    "head_dim": None, "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_parameters": None, "pad_token_id": None,
}
_QWEN: dict[str, Any] = {
    "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32, "max_position_embeddings": 32768,
    "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28, "layer_types": None,
    "bos_token_id": None, "eos_token_id": None,
}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"vocab_size": 32000, "intermediate_size": 11008, "max_position_embeddings": 2048,
              "bos_token_id": 1, "eos_token_id": 2, "attention_bias": False, "mlp_bias": False},
    "mistral": {"vocab_size": 32000, "intermediate_size": 14336, "num_key_value_heads": 8,
                "max_position_embeddings": 4096 * 32, "bos_token_id": 1, "eos_token_id": 2, "sliding_window": 4096},
    "qwen2": {**_QWEN, "head_dim": None},
    "qwen3": {**_QWEN, "head_dim": 128, "attention_bias": False},
}
_POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings")
_SCALED_ROPE_TYPES = ("llama3", "yarn", "longrope")
# Model types whose declared tokenizer class AutoTokenizer replaces by the one it registers for the type
# (transformers 5.23's MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS, among our types: qwen2 -> Qwen2Tokenizer).
HUB_TOKENIZER_CLASS_OVERRIDDEN = frozenset({"qwen2"})


class ModelConfig:
    """The model's config.json as attributes (a stand-in for a transformers `PreTrainedConfig`)."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)

    def __repr__(self) -> str:
        return f"ModelConfig({self.__dict__.get('model_type')!r}, {self.__dict__.get('architectures')!r})"


def handles(raw: dict[str, Any], trust_remote_code: bool) -> bool:
    """Whether `from_dict` reads this config the way transformers would (else use AutoConfig)."""
    remote = trust_remote_code and "AutoConfig" in (raw.get("auto_map") or {})
    return raw.get("model_type") in _DEFAULTS and not remote


def from_dict(raw: dict[str, Any], model_dir: str) -> ModelConfig:
    """`raw` (a parsed config.json of a model type in _DEFAULTS) with defaults and normalisation applied."""
    path = os.path.join(model_dir, "config.json")
    model_type = raw["model_type"]
    values = {**_COMMON, **_DEFAULTS[model_type], **copy.deepcopy(raw)}
    torch_dtype = values.pop("torch_dtype", None)  # the older name: used where dtype is absent or null
    if values.get("dtype") is None:
        values["dtype"] = torch_dtype
    values["_name_or_path"] = model_dir
    _check_fields(values, path)
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    if model_type in ("qwen2", "qwen3") and not values["use_sliding_window"]:
        values["sliding_window"] = None
    values["rope_parameters"] = _rope_parameters(values, path)
    values.pop("rope_scaling", None)
    values.pop("rope_theta", None)
    return ModelConfig(values)


def tokenizer_class(model_dir: str, hf_config: Any) -> str | None:
    """The tokenizer class tokenizer_config.json declares, when `load_tokenizer` may hand `AutoTokenizer` our
    ModelConfig instead of letting it load AutoConfig; else None.

    With a declared `tokenizer_class`, transformers 5 picks the tokenizer from that name and the config's
    `model_type` string alone. Without one it looks the config's class up in its own tables, which our
    ModelConfig is not in; remote tokenizer code (`auto_map`) is left to AutoTokenizer too."""
    if not isinstance(hf_config, ModelConfig):
        return None
    try:
        with open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8") as f:
            declared = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(declared, dict) or "auto_map" in declared:
        return None
    name = declared.get("tokenizer_class")
    return name if isinstance(name, str) and name else None


def _check_fields(values: dict[str, Any], path: str) -> None:
    for key in _POSITIVE_INTS:
        value = values[key]
        if value is None and key in ("num_key_value_heads", "head_dim"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelLoadError(f"{path}: {key!r} must be a positive integer, got {value!r}")
    eps = values["rms_norm_eps"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise ModelLoadError(f"{path}: 'rms_norm_eps' must be a positive number, got {eps!r}")
    if not isinstance(values["hidden_act"], str):
        raise ModelLoadError(f"{path}: 'hidden_act' must be a string, got {values['hidden_act']!r}")
    first = values.get("max_window_layers", 0)
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise ModelLoadError(f"{path}: 'max_window_layers' must be a non-negative integer, got {first!r}")
    theta = values.get("rope_theta", 1.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ModelLoadError(f"{path}: 'rope_theta' must be a positive number, got {theta!r}")
    window = values.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise ModelLoadError(f"{path}: 'sliding_window' must be a positive integer or null, got {window!r}")
    heads, kv_heads = values["num_attention_heads"], values["num_key_value_heads"] or values["num_attention_heads"]
    if heads % kv_heads:
        raise ModelLoadError(f"{path}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads "
                             f"({kv_heads})")
    if values["head_dim"] is None and values["hidden_size"] % heads:
        raise ModelLoadError(f"{path}: hidden_size ({values['hidden_size']}) is not a multiple of "
                             f"num_attention_heads ({heads}) and there is no head_dim")
    for key in ("bos_token_id", "eos_token_id"):
        ids = values.get(key)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in (ids if isinstance(ids, list) else [ids])
                   if i is not None):
            raise ModelLoadError(f"{path}: {key!r} must be a token id, a list of them or null, got {ids!r}")


def _rope_parameters(values: dict[str, Any], path: str) -> dict[str, Any]:
    """transformers' `convert_rope_params_to_dict` + `standardize_rope_params` for a flat (one-type) dict."""
    params = values.get("rope_scaling") or values.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ModelLoadError(f"{path}: 'rope_scaling' / 'rope_parameters' must be an object, got {params!r}")
    params = dict(params)
    if params and all(isinstance(v, dict) for v in params.values()):
        return params  # per-layer-type parameters: rotary.rope_config says they are not supported
    params.setdefault("rope_theta", values.get("rope_theta", 10000.0))
    if values.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", values["partial_rotary_factor"])
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] in _SCALED_ROPE_TYPES:
        # A top-level original_max_position_embeddings (Phi-3 style) is not consulted here: transformers sets
        # unknown keys after this step. It stays an attribute, and rotary.rope_config gives it priority.
        params.setdefault("original_max_position_embeddings", values["max_position_embeddings"])
    return params
