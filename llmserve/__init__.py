"""llmserve: serve and run large language models.

Names are imported lazily so that `import llmserve.engine.kv_cache` (or the CLI's --help) does not
pay for torch and transformers. The offline API lives in `llmserve.api` (as LMDeploy names its
own), not `llmserve.pipeline`: a submodule named like the `pipeline` function would replace it as
an attribute of the package once imported.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "ChatTemplateConfig": "llmserve.config", "EngineConfig": "llmserve.config",
    "GenerationConfig": "llmserve.config",
    "InvalidRequestError": "llmserve.errors", "LLMServeError": "llmserve.errors",
    "ModelLoadError": "llmserve.errors", "PromptTooLongError": "llmserve.errors",
    "Pipeline": "llmserve.api", "Response": "llmserve.api", "Session": "llmserve.api",
    "pipeline": "llmserve.api",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'llmserve' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
