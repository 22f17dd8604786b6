"""Data-parallel replicas (`llmserve serve --dp N`): one HTTP server, N engines, a router between them.

Replica 0 is the server process's own engine (it also gives the server its tokenizer and chat template); replicas
1..N-1 are processes the server starts (`torch.multiprocessing`, spawn), each a whole engine with its own KV cache
(and its own tensor-parallel group when tp > 1). A replica process talks to the server over a pipe: the server
sends requests and aborts, the replica streams back each sequence's outputs and, twice a second, its figures.

Routing: a request goes to the live replica with the fewest outstanding tokens (the prompt and max_new_tokens of
every request it has not finished), except that a request with a session id goes back to the replica that holds
that session's KV. A replica process that dies fails its in-flight requests with ReplicaDiedError (the server
answers 503), the others keep serving, /health reports it, and it is started again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from llmserve.config import EngineConfig, GenerationConfig
from llmserve.engine import gc_heap
from llmserve.engine.async_engine import AsyncEngine, EngineStats
from llmserve.engine.output import SequenceOutput
from llmserve.errors import EngineDeadError

logger = logging.getLogger(__name__)

STATS_PERIOD_S = 0.5
RESTART_DELAY_S = 1.0


class ReplicaDiedError(EngineDeadError):
    """The replica running a request died: the request is lost; retrying it reaches another replica."""


class RemoteEngine:
    """A replica in a process of its own, with the parts of AsyncEngine's interface the server uses."""

    def __init__(self, index: int, model: str | None, config: EngineConfig) -> None:
        import torch.multiprocessing as mp

        self.index = index
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_replica_main, args=(child, model, config), name=f"llmserve-dp{index}",
                                daemon=True)
        self.proc.start()
        child.close()
        try:
            kind, payload = self.conn.recv()  # blocks while the replica loads (the server's loader thread)
        except (EOFError, OSError):
            self.proc.join(10)
            kind, payload = "failed", f"the process exited with code {self.proc.exitcode} while loading"
        if kind != "ready":
            self.proc.join(10)
            raise RuntimeError(f"data-parallel replica {index} did not start: {payload}")
        self.stats = EngineStats(0, 0, 0, 0, 0.0, 0)
        self._send_lock = threading.Lock()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._alive = True
        self._reader = threading.Thread(target=self._read, name=f"llmserve-dp{index}-reader", daemon=True)
        self._reader.start()

    @property
    def is_alive(self) -> bool:
        return self._alive

    async def generate(self, request_id: str, prompt_token_ids: list[int], gen: GenerationConfig,
                       session_id: str | None = None, mm: Any = None,
                       adapter_name: str | None = None) -> AsyncIterator[SequenceOutput]:
        if not self._alive:
            raise ReplicaDiedError(f"data-parallel replica {self.index} is not running")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        unfinished = gen.n
        try:
            self._send(("add", request_id, prompt_token_ids, gen, session_id, mm, adapter_name))
            while unfinished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                unfinished -= item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if unfinished and self._alive:
                self.abort(request_id)

    async def embed(self, request_id: str, prompt_token_ids: list[int], params: Any = None,
                    adapter_name: str | None = None) -> SequenceOutput:
        if not self._alive:
            raise ReplicaDiedError(f"data-parallel replica {self.index} is not running")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        done = False
        try:
            self._send(("embed", request_id, prompt_token_ids, params, adapter_name))
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            done = True
            return item
        finally:
            self._streams.pop(request_id, None)
            if not done and self._alive:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        try:
            self._send(("abort", request_id))
        except (OSError, EOFError):
            pass

    def end_session(self, session_id: str) -> None:
        try:
            self._send(("end_session", session_id))
        except (OSError, EOFError):
            pass

    def shutdown(self) -> None:
        try:
            self._send(("stop",))
        except (OSError, EOFError, BrokenPipeError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self.conn.send(message)

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "out":
                self._put(message[1], message[2])
            elif kind == "error":
                self._put(message[1], message[2])
            elif kind == "stats":
                self.stats = message[1]
        self._alive = False
        self.proc.join(1)
        error = ReplicaDiedError(f"data-parallel replica {self.index} died (exit code {self.proc.exitcode}); "
                                 "retry the request")
        for rid in list(self._streams):
            self._put(rid, error)

    def _put(self, request_id: str, item: Any) -> None:
        entry = self._streams.get(request_id)
        if entry is not None:
            loop, queue = entry
            loop.call_soon_threadsafe(queue.put_nowait, item)


class ReplicaSet:
    """The router: AsyncEngine's interface over N replicas (index 0 the in-process engine)."""

    def __init__(self, local: AsyncEngine, model: str | None, config: EngineConfig) -> None:
        self.local = local
        self.engine = local.engine  # what routes that read the engine's settings see (replica 0's)
        self.model, self.config = model, config
        self.replicas: list[Any] = [local]
        self.outstanding: list[int] = [0]
        self.restarts: list[int] = [0]
        self._sessions: dict[str, int] = {}  # session id -> the replica holding its KV
        self._lock = threading.Lock()
        self._closing = False
        for i in range(1, config.dp):
            self.replicas.append(RemoteEngine(i, model, _replica_config(config)))
            self.outstanding.append(0)
            self.restarts.append(0)
        self._watcher = threading.Thread(target=self._watch, name="llmserve-dp-watch", daemon=True)
        self._watcher.start()

    # --- what the server calls ---------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        return self.local.is_alive

    @property
    def stats(self) -> EngineStats:
        return _sum_stats([r.stats for r in self.replicas])

    @property
    def on_step(self) -> Any:
        return self.local.on_step

    @on_step.setter
    def on_step(self, value: Any) -> None:
        self.local.on_step = value

    def replica_figures(self) -> list[tuple[EngineStats, bool, int, int]]:
        """Per replica: (its figures, whether it runs, outstanding tokens, restarts), for /metrics."""
        return [(r.stats, r.is_alive, self.outstanding[i], self.restarts[i]) for i, r in enumerate(self.replicas)]

    def replica_health(self) -> list[str]:
        return ["ok" if r.is_alive else "restarting" for r in self.replicas]

    async def generate(self, request_id: str, prompt_token_ids: list[int], gen: GenerationConfig,
                       session_id: str | None = None, mm: Any = None,
                       adapter_name: str | None = None) -> AsyncIterator[SequenceOutput]:
        index = self._route(session_id)
        cost = len(prompt_token_ids) + gen.max_new_tokens * gen.n
        self.outstanding[index] += cost
        try:
            async for out in self.replicas[index].generate(request_id, prompt_token_ids, gen, session_id, mm,
                                                           adapter_name):
                yield out
        finally:
            self.outstanding[index] -= cost

    async def embed(self, request_id: str, prompt_token_ids: list[int], params: Any = None,
                    adapter_name: str | None = None) -> SequenceOutput:
        index = self._route(None)
        self.outstanding[index] += len(prompt_token_ids)
        try:
            return await self.replicas[index].embed(request_id, prompt_token_ids, params, adapter_name)
        finally:
            self.outstanding[index] -= len(prompt_token_ids)

    async def compile_grammar(self, gen: GenerationConfig) -> None:
        await self.local.compile_grammar(gen)  # checks the schema here: refused before any replica sees it

    def warm_up_grammars(self) -> None:
        self.local.warm_up_grammars()

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """fn(engine) on replica 0's engine (debug reports, sessions there)."""
        return await self.local.call(fn)

    async def end_session(self, session_id: str) -> bool:
        """Close a session held by another replica than 0 (whose own the caller closes); whether there was one."""
        index = self._sessions.pop(session_id, None)
        if index is not None and index > 0 and self.replicas[index].is_alive:
            self.replicas[index].end_session(session_id)
            return True
        return False

    def abort(self, request_id: str) -> None:
        for r in self.replicas:
            r.abort(request_id)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._closing = True
        for r in self.replicas[1:]:
            r.shutdown()
        self.local.shutdown(timeout)

    # --- routing and restarts ------------------------------------------------------------

    def _route(self, session_id: str | None) -> int:
        with self._lock:
            if session_id is not None:
                held = self._sessions.get(session_id)
                if held is not None and self.replicas[held].is_alive:
                    return held
            live = [i for i, r in enumerate(self.replicas) if r.is_alive]
            if not live:
                raise ReplicaDiedError("no data-parallel replica is running")
            index = min(live, key=lambda i: (self.outstanding[i], i))
            if session_id is not None:
                self._sessions[session_id] = index
            return index

    def _watch(self) -> None:
        while not self._closing:
            time.sleep(RESTART_DELAY_S)
            for i, r in enumerate(self.replicas):
                if i == 0 or r.is_alive or self._closing:
                    continue
                logger.error("data-parallel replica %d died (exit code %s); starting it again", i, r.proc.exitcode)
                with self._lock:
                    self._sessions = {s: k for s, k in self._sessions.items() if k != i}
                try:
                    self.replicas[i] = RemoteEngine(i, self.model, _replica_config(self.config))
                    self.outstanding[i] = 0
                    self.restarts[i] += 1
                    logger.info("data-parallel replica %d is back", i)
                except Exception as e:  # noqa: BLE001 - logged; the watcher tries again
                    logger.error("data-parallel replica %d could not start again: %s", i, e)


def _replica_config(config: EngineConfig) -> EngineConfig:
    return dataclasses.replace(config, dp=1)


def _sum_stats(stats: list[EngineStats]) -> EngineStats:
    """The replicas' figures added up (counters and gauges alike); the prefix hit rate from the summed counts."""
    values = {f.name: getattr(stats[0], f.name) for f in dataclasses.fields(EngineStats)}
    for s in stats[1:]:
        for name, value in values.items():
            other = getattr(s, name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and name != "max_loras":
                values[name] = value + other
    queried = values["prefix_queried_tokens"]
    values["prefix_hit_rate"] = values["prefix_hit_tokens"] / queried if queried else 0.0
    return EngineStats(**values)


def _replica_main(conn: Any, model: str | None, config: EngineConfig) -> None:
    """A replica process: its own engine, fed over `conn` (see the module docstring)."""
    import os

    from llmserve.engine.llm_engine import LLMEngine
    from llmserve.models.loader import load_model

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s replica %(levelname)s %(name)s: %(message)s")
    try:
        loaded = load_model(model, config)
        engine = AsyncEngine(LLMEngine(loaded, config))
    except BaseException as e:  # noqa: BLE001 - reported to the server
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    gc_heap.freeze()  # the replica's startup heap, for its process's life
    loop = asyncio.new_event_loop()
    send_lock = threading.Lock()
    tasks: dict[str, asyncio.Task] = {}

    def send(message: tuple) -> None:
        with send_lock:
            conn.send(message)

    async def run(rid: str, args: tuple) -> None:
        try:
            async for out in engine.generate(rid, *args):
                send(("out", rid, out))
        except Exception as e:  # noqa: BLE001 - the request's own error, back to its caller
            send(("error", rid, e))
        finally:
            tasks.pop(rid, None)

    async def run_embed(rid: str, args: tuple) -> None:
        try:
            send(("out", rid, await engine.embed(rid, *args)))
        except Exception as e:  # noqa: BLE001 - the request's own error, back to its caller
            send(("error", rid, e))
        finally:
            tasks.pop(rid, None)

    def receive() -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                message = ("stop",)
            kind = message[0]
            if kind == "add":
                rid = message[1]
                loop.call_soon_threadsafe(lambda r=rid, a=message[2:]: tasks.__setitem__(r, loop.create_task(run(r, a))))
            elif kind == "embed":
                rid = message[1]
                loop.call_soon_threadsafe(
                    lambda r=rid, a=message[2:]: tasks.__setitem__(r, loop.create_task(run_embed(r, a))))
            elif kind == "abort":
                loop.call_soon_threadsafe(lambda r=message[1]: tasks[r].cancel() if r in tasks else None)
            elif kind == "end_session":
                loop.call_soon_threadsafe(lambda s=message[1]: loop.create_task(engine.call(
                    lambda e: e.end_session(s))))
            elif kind == "stop":
                loop.call_soon_threadsafe(loop.stop)
                return

    async def report() -> None:
        while True:
            send(("stats", engine.stats))
            await asyncio.sleep(STATS_PERIOD_S)

    send(("ready", None))
    threading.Thread(target=receive, name="llmserve-replica-reader", daemon=True).start()
    loop.create_task(report())
    loop.run_forever()
    engine.shutdown()
    os._exit(0)
