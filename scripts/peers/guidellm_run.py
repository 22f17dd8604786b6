"""Run guidellm's CLI (`guidellm ARGS...`), optionally without vLLM's `stream_options.continuous_usage_stats`.

Run with the guidellm venv's python: `python guidellm_run.py [--drop-continuous-usage-stats] run ...`.

guidellm 0.8.1 sends `stream_options: {include_usage: true, continuous_usage_stats: true}` on every streaming
request. `continuous_usage_stats` is a vLLM extension (usage in every chunk, not only the last); a server that
does not know the field and refuses it (400) fails every request. With --drop-continuous-usage-stats the field is
removed from the request body and nothing else changes: guidellm keeps the last usage it sees
(`streaming_usage`), which `include_usage` still puts in the final chunk, so its token counts and timings are the
same. scripts/peers/guidellm.sh probes the server and sets the flag only when the server refuses the field.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

DROP_FLAG = "--drop-continuous-usage-stats"
DROP_ENV = "LLMSERVE_PEERS_DROP_CONTINUOUS_USAGE_STATS"


def _without_continuous_usage(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def format(self: Any, *args: Any, **kwargs: Any) -> Any:
        arguments = original(self, *args, **kwargs)
        options = (arguments.body or {}).get("stream_options")
        if isinstance(options, dict):
            options.pop("continuous_usage_stats", None)
        return arguments

    return format


def drop_continuous_usage_stats() -> None:
    """Wrap the text and chat completion handlers' `format` so the body's stream_options loses the field."""
    from guidellm.backends.openai import request_handlers

    for cls in (request_handlers.TextCompletionsRequestHandler, request_handlers.ChatCompletionsRequestHandler):
        cls.format = _without_continuous_usage(cls.__dict__["format"])


def main(argv: list[str]) -> int:
    if DROP_FLAG in argv:
        argv = [a for a in argv if a != DROP_FLAG]
        os.environ[DROP_ENV] = "1"  # for guidellm's worker processes, see below
        drop_continuous_usage_stats()
    from guidellm.__main__ import cli

    cli(args=argv, prog_name="guidellm")  # click exits with guidellm's own status
    return 0


# guidellm's workers (which format the requests) are spawned processes: each imports this file again as
# __mp_main__, not as __main__, and inherits the environment, so the patch is applied there too.
if __name__ == "__mp_main__" and os.environ.get(DROP_ENV) == "1":
    drop_continuous_usage_stats()

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
