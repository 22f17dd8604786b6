"""`llmserve serve`: listen first, load the model in a background thread, serve until a signal.

Startup: uvicorn binds the port (a port in use fails at once, before any loading), then the model
loads while /health and the model routes answer 503; when it is ready the address, the model and
the KV pool are logged.

Shutdown on SIGINT/SIGTERM: new connections are refused and new requests on open connections get
503; requests in flight have `shutdown_timeout` seconds to finish, then they are aborted (their
streams end with finish reason "abort"); the engine thread is joined; the exit code is 0. A second
SIGINT quits without waiting.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import threading
from types import FrameType

import uvicorn

from llmserve.config import ChatTemplateConfig, EngineConfig
from llmserve.engine import gc_heap
from llmserve.errors import LLMServeError
from llmserve.serve.app import create_app
from llmserve.serve.config import ServerConfig
from llmserve.serve.state import ServedModel, ServerState
from llmserve.serve.tls import tls_files

logger = logging.getLogger("llmserve.serve")


def serve(model: str | None, engine_config: EngineConfig, config: ServerConfig,
          chat_template: ChatTemplateConfig | None = None, log_level: str = "INFO") -> int:
    """Run the server in this thread until a signal; returns the process exit code."""
    _configure_logging(log_level)
    tls = tls_files(config)  # before anything loads: a bad certificate fails at once
    app = create_app(config)
    state: ServerState = app.state.llm
    server = _Server(uvicorn.Config(
        app, host=config.server_name, port=config.server_port, log_level=log_level.lower(),
        access_log=config.access_log, timeout_graceful_shutdown=config.shutdown_timeout + 5,
        timeout_keep_alive=5, ssl_certfile=tls and tls.certfile, ssl_keyfile=tls and tls.keyfile), state,
        _Loader(model, engine_config, chat_template, config, state, "https" if tls else "http"))
    for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn re-raises the signal it handled on exit
        signal.signal(sig, server.on_signal_before_start)
    server.run()
    if state.engine is not None:
        state.engine.shutdown()
        logger.info("engine stopped")
    if state.tracer is not None:
        state.tracer.shutdown()  # exports the spans still batched
    return server.exit_code


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("llmserve").setLevel(level.upper())


class _Loader(threading.Thread):
    """Loads the model and attaches the engine to the app (or asks the server to exit on failure)."""

    def __init__(self, model: str | None, engine_config: EngineConfig, chat_template: ChatTemplateConfig | None,
                 config: ServerConfig, state: ServerState, scheme: str) -> None:
        super().__init__(name="llmserve-loader", daemon=True)
        self.model, self.engine_config, self.chat_template = model, engine_config, chat_template
        self.config, self.state, self.scheme = config, state, scheme
        self.error: BaseException | None = None

    def run(self) -> None:
        from llmserve.api import default_generation_config
        from llmserve.engine.async_engine import AsyncEngine
        from llmserve.engine.llm_engine import LLMEngine
        from llmserve.models.loader import load_model

        if self.engine_config.dp > 1 and self.engine_config.num_threads is None:
            # the replicas split the cores, as tensor-parallel ranks do (each is a whole engine: sharing every core
            # between them measured 0.6-0.7x one engine on 2 cores)
            from llmserve.distributed.workers import threads_per_rank

            threads = threads_per_rank(dataclasses.replace(self.engine_config, tp=self.engine_config.dp * self.engine_config.tp))
            self.engine_config = dataclasses.replace(self.engine_config, num_threads=threads)
        try:
            loaded = load_model(self.model, self.engine_config)
            engine = LLMEngine(loaded, self.engine_config)
            served = ServedModel.of(engine, default_generation_config(loaded), self.config.model_name,
                                    self.chat_template, self.config.tool_call_parser, self.config.reasoning_parser)
        except BaseException as e:  # noqa: BLE001  (reported by the main thread)
            self.error = e
            return
        async_engine = AsyncEngine(engine)
        if self.engine_config.dp > 1:  # the other replicas load in their own processes, then the router serves
            from llmserve.serve.replicas import ReplicaSet

            try:
                async_engine = ReplicaSet(async_engine, self.model, self.engine_config)
            except BaseException as e:  # noqa: BLE001  (reported by the main thread)
                self.error = e
                return
            logger.info("%d data-parallel replicas", self.engine_config.dp)
        self.state.attach(async_engine, served)
        async_engine.warm_up_grammars()  # structured output's vocabulary, read in the background
        gc_heap.freeze()  # the startup heap, for the server's life
        c = self.config
        logger.info("serving %s (%s, %s on %s) at %s://%s:%d  [OpenAI: /v1, TGI: /generate, metrics: /metrics, "
                    "chat page: /]", served.name, loaded.model_dir, served.dtype, served.device, self.scheme,
                    c.server_name, c.server_port)
        logger.info("KV cache: %d blocks of %d tokens = %d tokens; up to %d tokens per sequence, %d sequences per "
                    "step", engine.kv.num_blocks, engine.kv.block_size, served.kv_tokens, served.session_len,
                    served.max_batch_size)
        logger.info("%s", _tools_line(served))


def _tools_line(served: ServedModel) -> str:
    if served.tool_parser is None:
        tools = "none (the chat template takes tools in a format llmserve cannot tell: name one with --tool-call-parser)"
    elif served.chat_template.supports_tools:
        tools = served.tool_parser.name
    else:
        tools = f"{served.tool_parser.name} (the chat template shows no tools: they are written in Hermes' format)"
    return f"tool calls: {tools}; reasoning parser: {served.reasoning.name if served.reasoning else 'none'}"


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, loader: _Loader) -> None:
        super().__init__(config)
        self.state = state
        self.loader = loader
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets)
        if not self.started:
            return
        self._loop = asyncio.get_running_loop()
        logger.info("listening on %s://%s:%d; loading the model (model routes answer 503 until it is ready)",
                    self.loader.scheme, self.config.host, self.config.port)
        self.loader.start()
        self._loop.create_task(self._watch_loader())

    async def _watch_loader(self) -> None:
        while self.loader.is_alive():
            await asyncio.sleep(0.1)
        if self.loader.error is not None:
            e = self.loader.error
            logger.error("could not load the model: %s", e, exc_info=not isinstance(e, LLMServeError))
            self.exit_code = 2
            self.should_exit = True
            return
        # An engine that stops on its own (a tensor-parallel rank died) ends the server: /health is 503 meanwhile
        while not self.should_exit:
            engine = self.state.engine
            if engine is not None and not engine.is_alive and not self.state.draining:
                logger.error("the engine has stopped (see the error above); exiting")
                self.exit_code = 1
                self.should_exit = True
            await asyncio.sleep(0.5)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first and self._loop is not None:
            logger.info("%s: shutting down; requests in flight have %.1f s to finish", signal.Signals(sig).name,
                        self.state.config.shutdown_timeout)
            self.state.draining = True
            self._loop.call_soon_threadsafe(self._loop.call_later, self.state.config.shutdown_timeout,
                                            self._abort_in_flight)

    def _abort_in_flight(self) -> None:
        n = self.state.abort_all()
        if n:
            logger.info("aborted %d request(s) still running after the grace period", n)

    def on_signal_before_start(self, sig: int, frame: FrameType | None) -> None:
        # Before uvicorn installs its handlers: quit at startup. After it restores ours on exit, it
        # re-raises the signal it handled: already shut down, nothing to do.
        self.should_exit = True
