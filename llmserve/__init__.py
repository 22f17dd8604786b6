"""llmserve: serve and run large language models.

Names are imported lazily so that `import llmserve.engine.kv_cache` (or the CLI's --help) does not
pay for torch and transformers. The offline API lives in `llmserve.api` (as LMDeploy names its
own), not `llmserve.pipeline`: a submodule named like the `pipeline` function would replace it as
an attribute of the package once imported.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

__version__ = "0.1.0"

# Transparent huge pages for torch's CPU tensors of 2 MiB and more (PyTorch's own switch, read once at its
# first allocation, so only when llmserve comes before torch, as in the CLI; THP_MEM_ALLOC_ENABLE=0 keeps
# 4 KiB pages). Large temporaries are fresh mappings each step, and their page faults cost: measured on
# the 64-request throughput workload (bf16 + w8a8, 2 cores) 333-353 output tok/s with it, 314 without.
if "torch" not in sys.modules:
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

_EXPORTS = {
    "ChatTemplateConfig": "llmserve.config", "EngineConfig": "llmserve.config",
    "GenerationConfig": "llmserve.config",
    "InvalidRequestError": "llmserve.errors", "LLMServeError": "llmserve.errors",
    "ModelLoadError": "llmserve.errors", "PromptTooLongError": "llmserve.errors",
    "Pipeline": "llmserve.api", "Response": "llmserve.api", "Session": "llmserve.api",
    "EmbeddingResponse": "llmserve.api",
    "pipeline": "llmserve.api",
    "PytorchEngineConfig": "llmserve.lmdeploy_compat", "TurbomindEngineConfig": "llmserve.lmdeploy_compat",
    "VisionConfig": "llmserve.lmdeploy_compat",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'llmserve' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
