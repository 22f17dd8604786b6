"""Our config.json reader (llmserve/models/model_config.py) against transformers' AutoConfig: every field the
model code reads, and what it derives from them, agree on a table of configs per model type; malformed
fields are a ModelLoadError naming the field; the tokenizer loads as AutoTokenizer alone would load it;
and loading a model imports neither torch._dynamo nor torch.distributed.tensor."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from typing import Any

import pytest
from transformers import AutoConfig, AutoTokenizer

from llmserve.errors import ModelLoadError
from llmserve.layers.rotary import rope_config, rope_max_positions
from llmserve.models import model_config
from llmserve.models.llama import head_dim_of
from llmserve.models.loader import _as_dtype, load_tokenizer, read_hf_config
from llmserve.models.registry import MODEL_TYPES, get_model_class
from tests.tiny_models import _BASE, TINY_CONFIGS

FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "hidden_act", "rms_norm_eps", "tie_word_embeddings",
          "max_position_embeddings", "bos_token_id", "eos_token_id", "attention_bias", "mlp_bias",
          "sliding_window", "use_sliding_window", "max_window_layers", "rope_parameters",
          "original_max_position_embeddings", "partial_rotary_factor", "extra_key")
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 3}


def _cases() -> list[tuple[str, dict[str, Any]]]:
    cases: list[tuple[str, dict[str, Any]]] = []
    for model_type in MODEL_TYPES:
        cases += [
            (f"{model_type}-defaults", {"model_type": model_type}),
            (f"{model_type}-legacy-rope", {"model_type": model_type, **SMALL, "rope_theta": 500000.0,
                                           "rope_scaling": {"type": "linear", "factor": 2.0}}),
            (f"{model_type}-llama3-rope", {"model_type": model_type, **SMALL, "rope_scaling": dict(LLAMA3)}),
            (f"{model_type}-yarn-top-level-original", {
                "model_type": model_type, **SMALL, "max_position_embeddings": 4096,
                "original_max_position_embeddings": 1024, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}),
            (f"{model_type}-both-rope-keys", {"model_type": model_type, **SMALL, "rope_theta": 1e6,
                                              "rope_parameters": {"rope_type": "default", "rope_theta": 5.0},
                                              "rope_scaling": {"rope_type": "dynamic", "factor": 3.0}}),
            # (Mistral's strict config rejects a null num_key_value_heads; we read it as MHA, as the others do.)
            (f"{model_type}-nulls", {"model_type": model_type, **SMALL,
                                     "num_key_value_heads": 4 if model_type == "mistral" else None,
                                     "sliding_window": None, "eos_token_id": [7, 2], "bos_token_id": None,
                                     "torch_dtype": "bfloat16", "dtype": None, "tie_word_embeddings": True,
                                     "extra_key": {"kept": True}}),
            (f"{model_type}-windows", {"model_type": model_type, **SMALL, "use_sliding_window": True,
                                       "sliding_window": 16, "max_window_layers": 1, "dtype": "float32"}),
        ]
    cases += [
        ("llama-biases-head-dim", {"model_type": "llama", **SMALL, "attention_bias": True, "mlp_bias": True,
                                   "head_dim": 32, "num_key_value_heads": 2}),
        ("mistral-head-dim-null", {"model_type": "mistral", **SMALL, "head_dim": None, "num_key_value_heads": 1}),
        ("qwen3-layer-types", {"model_type": "qwen3", **SMALL, "head_dim": 16, "sliding_window": 8,
                               "layer_types": ["full_attention", "sliding_attention", "full_attention"]}),
        ("qwen2-window-without-switch", {"model_type": "qwen2", **SMALL, "sliding_window": 8,
                                         "max_window_layers": 0}),
    ]
    for name, (model_type, overrides) in TINY_CONFIGS.items():
        if not model_config.handles({"model_type": model_type}, False):
            continue  # (Gemma, Phi-3, InternLM3: transformers reads their configs)
        cases.append((f"tiny-{name}", {"model_type": model_type, **_BASE, **overrides}))
    return cases


def _write(tmp_path, raw: dict[str, Any]) -> str:
    raw = {"architectures": [MODEL_TYPES[raw["model_type"]]], **raw}
    with open(tmp_path / "config.json", "w") as f:
        json.dump(raw, f)
    return str(tmp_path)


def _used(cfg: Any) -> dict[str, Any]:
    """What our model code and loader read from a config, and what they derive from it."""
    rc = rope_config(cfg)
    spec = get_model_class(cfg.architectures[0]).decoder_spec(cfg)
    return {**{k: getattr(cfg, k, None) for k in FIELDS}, "head_dim": head_dim_of(cfg),
            "architectures": cfg.architectures, "dtype": _as_dtype(getattr(cfg, "dtype", None)),
            "spec": dataclasses.asdict(spec), "rope": dataclasses.asdict(rc), "max_model_len": rope_max_positions(rc)}


@pytest.mark.parametrize("name,raw", _cases(), ids=[n for n, _ in _cases()])
def test_matches_autoconfig(tmp_path, name: str, raw: dict[str, Any]) -> None:
    directory = _write(tmp_path, raw)
    ours = read_hf_config(directory)
    assert isinstance(ours, model_config.ModelConfig)
    theirs = AutoConfig.from_pretrained(directory)
    assert _used(ours) == _used(theirs)


@pytest.mark.parametrize("edit,message", [
    ({"hidden_size": "64"}, "'hidden_size' must be a positive integer, got '64'"),
    ({"num_hidden_layers": 0}, "'num_hidden_layers' must be a positive integer, got 0"),
    ({"vocab_size": True}, "'vocab_size' must be a positive integer, got True"),
    ({"rms_norm_eps": "1e-6"}, "'rms_norm_eps' must be a positive number"),
    ({"hidden_act": None}, "'hidden_act' must be a string"),
    ({"sliding_window": -1}, "'sliding_window' must be a positive integer or null, got -1"),
    ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) is not a multiple of num_key_value_heads \(3\)"),
    ({"hidden_size": 66}, r"hidden_size \(66\) is not a multiple of num_attention_heads \(4\)"),
    ({"eos_token_id": "</s>"}, "'eos_token_id' must be a token id"),
    ({"rope_scaling": "linear"}, "'rope_scaling' / 'rope_parameters' must be an object"),
    ({"rope_theta": "1e4"}, "'rope_theta' must be a positive number, got '1e4'"),
    ({"max_window_layers": "2"}, "'max_window_layers' must be a non-negative integer"),
    ({"model_type": ["llama"]}, "'model_type' must be a string, got \\['llama'\\]"),
    ({"architectures": "LlamaForCausalLM"}, "'architectures' must be a list of class names"),
])
def test_malformed_fields_name_the_field(tmp_path, edit: dict[str, Any], message: str) -> None:
    raw = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **SMALL, **edit}
    with open(tmp_path / "config.json", "w") as f:
        json.dump(raw, f)
    with pytest.raises(ModelLoadError, match=f"config.json: {message}"):
        read_hf_config(str(tmp_path))


def test_other_model_types_and_remote_code_use_autoconfig(tmp_path) -> None:
    assert not model_config.handles({"model_type": "gpt2"}, False)
    remote = {"model_type": "llama", "auto_map": {"AutoConfig": "configuration_x.XConfig"}}
    assert model_config.handles(remote, False)  # auto_map is ignored without trust_remote_code
    assert not model_config.handles(remote, True)
    # a model type this reader does not know, served by one of our classes: transformers reads it
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"model_type": "mixtral", "architectures": ["MistralForCausalLM"], **SMALL}, f)
    cfg = read_hf_config(str(tmp_path))
    assert type(cfg).__name__ == "MixtralConfig" and cfg.architectures == ["MistralForCausalLM"]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])  # qwen2: AutoTokenizer overrides the class
@pytest.mark.parametrize("declared", ["TokenizersBackend", "PreTrainedTokenizerFast", None])
def test_tokenizer_as_autotokenizer_loads_it(tiny_model_dir, tmp_path, arch: str, declared: str | None) -> None:
    directory = shutil.copytree(tiny_model_dir(arch), tmp_path / arch)
    with open(directory / "tokenizer_config.json") as f:
        tokenizer_config = {k: v for k, v in json.load(f).items() if k != "tokenizer_class"}
    with open(directory / "tokenizer_config.json", "w") as f:
        json.dump({**tokenizer_config, **({"tokenizer_class": declared} if declared else {})}, f)
    hf_config = read_hf_config(str(directory))
    assert model_config.tokenizer_class(str(directory), hf_config) == declared
    ours = load_tokenizer(str(directory), hf_config=hf_config)
    theirs = AutoTokenizer.from_pretrained(str(directory))
    assert type(ours) is type(theirs)
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert ours.chat_template == theirs.chat_template
    for text in ("The capital of France is Paris.", " leading space", "<|im_start|>user\nhi<|im_end|>"):
        assert ours(text).input_ids == theirs(text).input_ids


def test_tokenizer_class_is_only_trusted_without_remote_code(tmp_path) -> None:
    cfg = model_config.from_dict({"model_type": "llama"}, str(tmp_path))
    assert model_config.tokenizer_class(str(tmp_path), cfg) is None  # no tokenizer_config.json
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    assert model_config.tokenizer_class(str(tmp_path), cfg) == "LlamaTokenizer"
    assert model_config.tokenizer_class(str(tmp_path), AutoConfig.for_model("llama")) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer",
                                                                "auto_map": {"AutoTokenizer": ["a.B", None]}}))
    assert model_config.tokenizer_class(str(tmp_path), cfg) is None
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    assert model_config.tokenizer_class(str(tmp_path), cfg) is None


def test_loading_a_model_skips_transformers_heavy_imports(tiny_model_dir) -> None:
    code = ("import sys; from llmserve.config import EngineConfig; from llmserve.models import load_model; "
            f"lm = load_model({tiny_model_dir('qwen2')!r}, EngineConfig(device='cpu', dtype='float32')); "
            "print(type(lm.hf_config).__name__, "
            "[m for m in ('torch._dynamo', 'torch.distributed.tensor', 'transformers.activations') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[-2] == "ModelConfig []"
