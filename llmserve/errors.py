"""The exceptions a user can cause. Each message says what to change.

`InvalidRequestError` is a bad parameter or prompt (the server maps it to 400);
`ModelLoadError` is a model that cannot be found or read (names the file or tensor).
Both derive from `LLMServeError`, itself a `ValueError`, so callers can catch one type.
"""

from __future__ import annotations


class LLMServeError(ValueError):
    """Base class of every error a user can cause."""


class InvalidRequestError(LLMServeError):
    """A request parameter or prompt the engine refuses; `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple:  # pickled whole (param included): a data-parallel replica sends it back
        return type(self), (str(self), self.param)


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus the requested output) does not fit the context or the KV pool."""


class ModelLoadError(LLMServeError):
    """A model path, hub id, file or tensor that cannot be loaded."""


class EngineDeadError(RuntimeError):
    """The engine cannot go on: a tensor-parallel rank died or stopped answering. Not the user's doing; the message
    names the rank. The async engine stops on it (the server's /health turns 503 and the server exits non-zero)."""
