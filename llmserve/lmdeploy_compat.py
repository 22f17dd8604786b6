"""LMDeploy's engine configs under their own names: `TurbomindEngineConfig` and `PytorchEngineConfig`, with
LMDeploy's field names and defaults, so LMDeploy code runs with only the import changed.

llmserve has one engine. Each config becomes an `EngineConfig` (`to_engine_config()`, which `pipeline(backend_config=
...)` calls), so `pipeline(m, backend_config=TurbomindEngineConfig(...))` builds exactly the engine of the
`EngineConfig` it maps to. Every field is one of three kinds (its field metadata says which):
- mapped: copied (or converted) onto an EngineConfig field and validated there; an error names the LMDeploy field;
- no effect: accepted, where it provably changes neither the output nor the memory used here (the reason is given);
- refused: an `InvalidRequestError` naming the field and saying why, unless its value asks for nothing (LMDeploy's
  default, or an equivalent), which is accepted.
A field LMDeploy added that is not listed here is refused as unknown. docs/compat.md has the whole table.

The defaults are LMDeploy's, not EngineConfig's: `TurbomindEngineConfig()` turns prefix caching off and asks for
8192-token steps, as TurboMind does, where `EngineConfig()` has prefix caching on and 4096-token steps.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmserve.config import EngineConfig
from llmserve.errors import InvalidRequestError

_OMIT = object()  # a converter's answer for "leave EngineConfig's default"


def _maps(default: Any, to: str | None = None, convert: Callable[[Any], Any] | None = None) -> Any:
    """Mapped onto EngineConfig's field `to` (the same name when None), through `convert` if given."""
    return field(default=default, metadata={"maps_to": to, "convert": convert})


def _no_effect(default: Any, why: str, kind: type | tuple[type, ...] = int, minimum: int | None = None) -> Any:
    return field(default=default, metadata={"no_effect": why, "kind": kind, "minimum": minimum})


def _refused(default: Any, why: str, accepted: tuple[Any, ...] | None = None) -> Any:
    """Refused with `why` unless the value is among `accepted` (the default alone when None)."""
    return field(default=default, metadata={"refused": why, "accepted": (default,) if accepted is None else accepted})


def _none_if_zero(value: Any) -> Any:
    return _OMIT if value in (0, None) else value


def _step_budget(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and value < 0:
        raise ValueError("must be >= 0 (0: max_prefill_token_num is the step's budget)")
    return _none_if_zero(value)


def _batch_size(value: Any) -> Any:
    return _OMIT if value is None else value  # LMDeploy's None: chosen by the engine (EngineConfig's default)


def _device(value: Any) -> Any:
    if value in (None, "auto"):
        return "auto"
    if isinstance(value, str) and (value in ("cuda", "cpu") or value.startswith("cuda:")):
        return value
    raise ValueError("llmserve runs on cuda or cpu (LMDeploy's ascend, maca and camb back ends are not supported)")


def _model_format(value: Any) -> Any:
    """TurboMind's model_format: None / "hf" a checkpoint as it is (whatever its quantization_config says), "awq" /
    "gptq" a checkpoint that must be of that method (EngineConfig.quantization's names for them)."""
    if value in (None, "hf"):
        return _OMIT
    if value in ("awq", "gptq"):
        return value
    raise ValueError("llmserve loads Hugging Face checkpoints (safetensors: unquantized, AWQ or GPTQ) and GGUF files: "
                     "model_format is None, 'hf', 'awq' or 'gptq' (Meta's llama layout and fp8 weights are not "
                     "supported)")


_TP_REASON = "expert parallelism is not implemented (tensor parallelism is: tp; data-parallel replicas are a server " \
             "option: llmserve serve --dp N)"
_SCHEDULING = ("llmserve has no prefill and decode phases: every step mixes decode tokens and prefill chunks under "
               "the token budget (max_prefill_token_num), so there is no interval or pass count to set; the output "
               "and the KV memory are the same whatever the value")


class _LMDeployConfig:
    """What both configs share: validation at construction (as LMDeploy's __post_init__ asserts) and the mapping."""

    def __post_init__(self) -> None:
        self.to_engine_config()

    def to_engine_config(self) -> EngineConfig:
        """The EngineConfig this config asks for; an InvalidRequestError names the bad LMDeploy field(s)."""
        refusals, kwargs, names = [], {}, {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            meta = f.metadata
            if "refused" in meta:
                if value not in meta["accepted"]:
                    refusals.append((f.name, f"{self._name(f.name)}={value!r}: {meta['refused']}"))
            elif "no_effect" in meta:
                self._check_no_effect(f.name, value, meta)
            else:  # mapped; a later field overrides an earlier one mapped to the same target
                target = meta["maps_to"] or f.name
                converted = self._convert(f.name, value, meta["convert"])
                if converted is not _OMIT:
                    kwargs[target], names[target] = converted, f.name
        if refusals:
            raise InvalidRequestError("; ".join(message for _, message in refusals), param=refusals[0][0])
        try:
            return EngineConfig(**kwargs)
        except InvalidRequestError as e:
            raise self._renamed(e, names) from None

    def _convert(self, name: str, value: Any, convert: Callable[[Any], Any] | None) -> Any:
        try:
            return convert(value) if convert is not None else value
        except ValueError as e:  # a converter's refusal: the reason, to be named here
            raise InvalidRequestError(f"{self._name(name)}={value!r}: {e}", param=name) from None

    def _name(self, field_name: str) -> str:
        return f"{type(self).__name__}.{field_name}"

    def _check_no_effect(self, name: str, value: Any, meta: Any) -> None:
        kind, minimum = meta["kind"], meta["minimum"]
        wrong_type = not isinstance(value, kind) or (isinstance(value, bool) and kind is int)
        if wrong_type or (minimum is not None and value < minimum):
            kinds = kind if isinstance(kind, tuple) else (kind,)
            want = " or ".join(k.__name__ for k in kinds) + (f" >= {minimum}" if minimum is not None else "")
            raise InvalidRequestError(f"{self._name(name)}: expected {want}, got {value!r}", param=name)

    def _renamed(self, e: InvalidRequestError, names: dict[str, str]) -> InvalidRequestError:
        """EngineConfig's error, naming the LMDeploy field the value came from ("block_size: ..." ->
        "TurbomindEngineConfig.cache_block_seq_len: ...")."""
        ours = e.param or ""
        theirs = names.get(ours, ours)
        message = str(e)
        if ours and message.startswith(ours + ":"):
            message = self._name(theirs) + message[len(ours):]
        return InvalidRequestError(message, param=theirs or None)


def _known_fields_only(cls: type) -> type:
    """An unknown keyword (a field of a newer LMDeploy, or a typo) is an InvalidRequestError naming it, not a
    TypeError: llmserve does not know what it asks for, so it refuses it rather than ignore it."""
    init = cls.__init__
    known = {f.name for f in dataclasses.fields(cls)}

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise InvalidRequestError(f"{cls.__name__}.{unknown[0]}: not a field llmserve knows (it takes "
                                      f"{', '.join(sorted(known))}); refused rather than ignored", param=unknown[0])
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


@_known_fields_only
@dataclass
class TurbomindEngineConfig(_LMDeployConfig):
    """LMDeploy's TurboMind engine config (its fields as of LMDeploy 0.7 and the seeds' older ones)."""

    dtype: str = _maps("auto")
    model_format: str | None = _maps(None, to="quantization", convert=_model_format)
    tp: int = _maps(1)
    session_len: int | None = _maps(None)
    max_batch_size: int | None = _maps(None, convert=_batch_size)
    cache_max_entry_count: float = _maps(0.8)
    cache_chunk_size: int = _refused(-1, "TurboMind's policy of growing its KV pool in chunks; llmserve allocates "
                                         "its pool once at start (size it with cache_max_entry_count or "
                                         "EngineConfig.num_blocks)", (-1, 1))
    cache_block_seq_len: int = _maps(64, to="block_size")
    enable_prefix_caching: bool = _maps(False)
    quant_policy: int = _maps(0)
    rope_scaling_factor: float = _refused(0.0, "dynamic NTK scaling is read from the model's config.json "
                                               "(rope_scaling); llmserve has no override for it", (0.0, 0))
    use_logn_attn: bool = _refused(False, "logarithmic attention scaling is not implemented")
    download_dir: str | None = _maps(None)
    revision: str | None = _maps(None)
    max_prefill_token_num: int = _maps(8192)
    # TurboMind's step budget (decode plus prefill tokens; 0: max_prefill_token_num), which is what EngineConfig's
    # max_prefill_token_num means: when > 0 it wins (it comes after max_prefill_token_num).
    num_tokens_per_iter: int = _maps(0, to="max_prefill_token_num", convert=_step_budget)
    max_prefill_iters: int = _no_effect(1, _SCHEDULING, minimum=1)
    communicator: str = _no_effect("nccl", "how tensor-parallel ranks talk: llmserve's always use torch.distributed "
                                           "(NCCL on GPUs, gloo on CPUs)",
                                   kind=str)
    model_name: str | None = _refused(None, "deprecated in LMDeploy (no effect since 0.2.1); name a chat template "
                                            "with ChatTemplateConfig(model_name=...)", (None, ""))


@_known_fields_only
@dataclass
class PytorchEngineConfig(_LMDeployConfig):
    """LMDeploy's PyTorch engine config (its fields as of LMDeploy 0.7 and the seeds' older ones)."""

    dtype: str = _maps("auto")
    tp: int = _maps(1)
    dp: int = _maps(1)  # data-parallel replicas: a server option (llmserve serve --dp N; a pipeline refuses it)
    ep: int = _refused(1, _TP_REASON)
    dp_rank: int = _refused(0, "llmserve starts its data-parallel replicas itself (dp); there is no rank to name")
    session_len: int | None = _maps(None)
    max_batch_size: int | None = _maps(None, convert=_batch_size)
    cache_max_entry_count: float = _maps(0.8)
    prefill_interval: int = _no_effect(16, _SCHEDULING, minimum=1)
    block_size: int = _maps(64)
    num_cpu_blocks: int = _refused(0, "LMDeploy's host-memory swap space for preempted sequences; llmserve does not "
                                      "swap (a preempted request is recomputed), so there is nothing to size; "
                                      "num_gpu_blocks sizes the KV pool")
    num_gpu_blocks: int = _maps(0, to="num_blocks", convert=_none_if_zero)
    adapters: dict[str, str] | None = _maps(None, convert=lambda v: _OMIT if v in (None, {}) else v)  # docs/lora.md
    max_prefill_token_num: int = _maps(4096)
    thread_safe: bool = _refused(False, "a pipeline is driven by one thread; for concurrent callers run `llmserve "
                                        "serve` and send it requests")
    enable_prefix_caching: bool = _maps(False)
    device_type: str | None = _maps(None, to="device", convert=_device)  # LMDeploy: 'cuda', its only choice
    eager_mode: bool = _maps(False, to="enforce_eager")
    custom_module_map: dict[str, str] | None = _refused(None, "llmserve's model code is its own, one file per "
                                                              "architecture; modules cannot be swapped in",
                                                        (None, {}))
    download_dir: str | None = _maps(None)
    revision: str | None = _maps(None)
    quant_policy: int = _maps(0)
    distributed_executor_backend: str | None = _refused(None, "llmserve starts its tensor-parallel ranks itself, as "
                                                              "processes (torch.multiprocessing)", (None, "uni", "mp"))
    should_execute_dummy_batch: bool = _refused(False, _TP_REASON)
    eviction_type: str = _refused("recompute", "llmserve evicts by recompute only (LMDeploy's 'copy' swaps to host "
                                               "memory)")
    model_name: str | None = _refused("", "deprecated in LMDeploy; name a chat template with "
                                          "ChatTemplateConfig(model_name=...)", (None, ""))


BackendConfig = EngineConfig | TurbomindEngineConfig | PytorchEngineConfig


@_known_fields_only
@dataclass
class VisionConfig:
    """LMDeploy's vision-model config: `pipeline(model, vision_config=VisionConfig(max_batch_size=8))`.

    max_batch_size: images per vision-encoder pass (EngineConfig.vision_max_batch_size). thread_safe: no effect
    here: the engine's own thread runs the encoder, whatever thread calls the pipeline."""

    max_batch_size: int = 1
    thread_safe: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_batch_size, int) or isinstance(self.max_batch_size, bool) or self.max_batch_size < 1:
            raise InvalidRequestError(f"VisionConfig.max_batch_size: expected int >= 1, got {self.max_batch_size!r}",
                                      param="max_batch_size")
        if not isinstance(self.thread_safe, bool):
            raise InvalidRequestError(f"VisionConfig.thread_safe: expected bool, got {self.thread_safe!r}",
                                      param="thread_safe")


def as_engine_config(config: BackendConfig | None) -> EngineConfig:
    """What `pipeline(backend_config=...)` takes: None (EngineConfig()), an EngineConfig, or one of LMDeploy's."""
    if config is None:
        return EngineConfig()
    if isinstance(config, EngineConfig):
        return config
    if isinstance(config, _LMDeployConfig):
        return config.to_engine_config()
    raise InvalidRequestError(f"backend_config must be an EngineConfig, TurbomindEngineConfig or PytorchEngineConfig, "
                              f"got {type(config).__name__}", param="backend_config")
