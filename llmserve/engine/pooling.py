"""Embeddings (OpenAI's /v1/embeddings, vLLM's LLM.embed): a prompt's final hidden states pooled into one vector.

An embedding request is a prefill that samples nothing: it is scheduled, chunked, batched beside generation and
preempted as any prompt is, and each step that computes some of its positions hands their hidden states (after
the final norm, before the LM head) to its `Pooling` (worker/model_runner.py). When the last prompt position is
computed the request ends with the vector.

How rows become a vector (`Pooler`), in the order vLLM resolves it:
1. EngineConfig.pooler_config (vLLM's --pooler-config): {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": bool};
2. the checkpoint's sentence-transformers modules (modules.json: its Pooling module's mode, and whether a Normalize
   module follows), as sentence-transformers itself computes the embedding;
3. else LAST with L2 normalization (vLLM's default for a decoder-only model's embed task).
Modules that change the vector further (Dense projections, or pooling modes other than the three) are not run, so
such a checkpoint's embeddings are refused rather than answered differently.

Prefix caching: LAST pooling reads the last position, which is always computed (the cache never serves a prompt's
last token), so it takes cache hits; MEAN and CLS read positions a hit would skip, so they compute every position.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

# sentence-transformers' Pooling config keys -> ours; any other mode set true is refused
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
_ST_TYPES = "sentence_transformers.models."


@dataclass(frozen=True)
class Pooler:
    """How this model's embeddings are made, and where that came from (default, sentence-transformers,
    pooler_config)."""

    pooling_type: str  # LAST | MEAN | CLS
    normalize: bool
    source: str
    refused: str | None = None  # why embeddings cannot be made as the checkpoint defines them
    # Matryoshka: the output sizes a request's `dimensions` may ask for (() with matryoshka: any up to the hidden
    # size); None: the model was not trained for truncation, and `dimensions` is refused (as vLLM does)
    matryoshka: tuple[int, ...] | None = None
    # sentence-transformers' named prompts (config_sentence_transformers.json), prepended to a text by name (TEI's
    # prompt_name)
    prompts: tuple[tuple[str, str], ...] = ()


def resolve_pooler(model_dir: str, hf_config: Any, override: dict[str, Any] | None) -> Pooler:
    """The model's Pooler: `override` (EngineConfig.pooler_config) over its sentence-transformers modules over the
    default (LAST, normalized)."""
    kind, normalize, source, refused = "LAST", True, "default", None
    try:
        modules = _read_json(os.path.join(model_dir, "modules.json"))
        if modules is not None:
            source = "sentence-transformers"
            if not isinstance(modules, list):
                raise ValueError(f"{model_dir}/modules.json: expected a list of modules")
            kind, normalize, refused = _sentence_transformers(model_dir, modules)
    except ValueError as e:  # the model still serves generation; its embeddings say why they cannot be made
        refused = str(e)
    if override:
        kind = override.get("pooling_type", kind)
        normalize = override.get("normalize", normalize)
        source = "pooler_config"
        if "pooling_type" in override:
            refused = None  # the pooling is the one asked for, not the checkpoint's
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    matryoshka = (tuple(int(d) for d in dims) if isinstance(dims, list) and dims
                  else () if getattr(hf_config, "is_matryoshka", False) else None)
    return Pooler(kind, normalize, source, refused, matryoshka, _prompts(model_dir))


def _prompts(model_dir: str) -> tuple[tuple[str, str], ...]:
    try:
        cfg = _read_json(os.path.join(model_dir, "config_sentence_transformers.json"))
    except ValueError:
        return ()
    prompts = cfg.get("prompts") if isinstance(cfg, dict) else None
    if not isinstance(prompts, dict):
        return ()
    return tuple((k, v) for k, v in prompts.items() if isinstance(k, str) and isinstance(v, str))


def _sentence_transformers(model_dir: str, modules: list) -> tuple[str, bool, str | None]:
    """(pooling type, normalize, why refused) from sentence-transformers' modules.json and its Pooling config."""
    kind, normalize, refused = "LAST", False, None
    has_pooling = False
    for m in modules:
        mtype = str(m.get("type", "")) if isinstance(m, dict) else ""
        name = mtype.removeprefix(_ST_TYPES)
        if name == "Transformer":
            continue
        if name == "Normalize":
            normalize = True
        elif name == "Pooling":
            has_pooling = True
            cfg = _read_json(os.path.join(model_dir, str(m.get("path", "")), "config.json"))
            if not isinstance(cfg, dict):
                raise ValueError(f"{model_dir}: modules.json names a Pooling module at {m.get('path')!r} "
                                 "without a readable config.json")
            modes = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
            ours = [_ST_MODES[k] for k in modes if k in _ST_MODES]
            if len(modes) != 1 or not ours:
                refused = (f"its sentence-transformers pooling ({', '.join(modes) or 'none'}) is not one this engine "
                           "runs (lasttoken, mean_tokens or cls_token, one of them)")
            else:
                kind = ours[0]
        else:
            refused = (f"its sentence-transformers module {mtype or m!r} is not run by this engine (it runs "
                       "Transformer, Pooling and Normalize)")
    if not has_pooling and refused is None:
        refused = "its sentence-transformers modules.json has no Pooling module"
    return kind, normalize, refused


def _read_json(path: str) -> Any:
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not readable JSON: {e}") from None


@dataclass(frozen=True)
class EmbedParams:
    """What one embedding request asks for: `dimensions` (Matryoshka truncation, before normalization) and
    `normalize` (None: the model's Pooler decides)."""

    dimensions: int | None = None
    normalize: bool | None = None


@dataclass(eq=False)
class Pooling:
    """One embedding request's pooling: the rows seen while its prompt is computed, then its vector."""

    pooling_type: str
    num_prompt_tokens: int
    normalize: bool
    dimensions: int | None = None  # Matryoshka: the vector's first values kept, before normalization
    total: torch.Tensor | None = None  # MEAN: fp32 sum of the rows of positions < counted
    counted: int = 0  # MEAN: prompt positions summed (a recompute after preemption adds none twice)
    vector: torch.Tensor | None = None  # the pooled rows, fp32, once the positions it needs are computed

    def add(self, rows: torch.Tensor, start: int) -> None:
        """rows [n, hidden]: the final hidden states of prompt positions start .. start + n."""
        end = start + rows.shape[0]
        if self.pooling_type == "LAST":
            if end == self.num_prompt_tokens:
                self.vector = rows[-1].to(torch.float32, copy=True)  # (a copy: not a view keeping the step's rows)
        elif self.pooling_type == "CLS":
            if start == 0:
                self.vector = rows[0].to(torch.float32, copy=True)
        elif end > self.counted:
            part = rows[max(self.counted - start, 0):].float().sum(0)
            self.total = part if self.total is None else self.total + part
            self.counted = end
            if end == self.num_prompt_tokens:
                self.vector = self.total / self.num_prompt_tokens

    def embedding(self) -> list[float]:
        """The vector as returned: its first `dimensions` values, then L2-normalized where asked."""
        assert self.vector is not None, "the prompt's last position is not computed yet"
        v = self.vector if self.dimensions is None else self.vector[:self.dimensions]
        if self.normalize:
            v = torch.nn.functional.normalize(v, dim=0)
        return v.cpu().tolist()
