"""The worker processes of tensor parallelism: ranks 1..tp-1, started by the engine (rank 0).

Rank 0 keeps everything above the model runner: the scheduler, the KV block tables, sampling. Every rank holds its
shard of the weights (each loads only its rows and columns of each checkpoint tensor) and a KV cache for its heads,
with the same block ids. Each step rank 0 broadcasts what to run (the step's spans, pickled) and every rank runs the
same forward: the sharded layers' all-reduces and the vocabulary-parallel logits' all-gather meet inside it. Only
rank 0 samples.

Commands travel by torch.distributed's broadcast over the same group as the collectives (gloo on CPUs, NCCL on
GPUs), started by `torch.multiprocessing` (spawn). On a CPU the ranks split the cores (each rank's torch threads:
the cores / tp, unless num_threads says otherwise).

Several machines (nnodes > 1): every node runs `llmserve serve` with the same model and flags and its own
node_rank; node k starts ranks k * tp/nnodes .. (k+1) * tp/nnodes - 1, and all meet at master_addr:master_port.
Node 0 holds rank 0 and serves HTTP; the others only run their ranks (run_worker_node). Under torchrun (RANK and
WORLD_SIZE set) each process is one rank already: rank 0 serves, the others run the worker loop in place.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import logging
import os
import socket
from typing import TYPE_CHECKING, Any

import torch

from llmserve.distributed.state import TPState, set_tp_state, tp_state
from llmserve.errors import EngineDeadError, ModelLoadError

if TYPE_CHECKING:
    from llmserve.config import EngineConfig
    from llmserve.worker.model_runner import Span

logger = logging.getLogger(__name__)

# How long a collective waits for a rank that does not answer (a hung or dead worker) before it fails with an error
# naming the ranks, instead of hanging the engine.
def timeout_s() -> float:
    return float(os.environ.get("LLMSERVE_TP_TIMEOUT", "120"))

# The model classes whose layers shard (models/llama.py's and gemma2.py's attention and MLP, layers/moe.py's experts):
# every architecture llmserve runs.
TP_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                    "InternLM3ForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                    "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                    # vision-language models: the language model shards, the vision tower runs whole on every rank
                    "LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                    "InternVLForConditionalGeneration", "Idefics3ForConditionalGeneration",
                    "SmolVLMForConditionalGeneration", "Qwen2VLForConditionalGeneration",
                    "Qwen2_5_VLForConditionalGeneration")


def check_tp_supported(config: EngineConfig, architecture: str) -> None:
    if architecture not in TP_ARCHITECTURES:
        raise ModelLoadError(f"tp={config.tp}: tensor parallelism runs {', '.join(TP_ARCHITECTURES)}; "
                             f"{architecture} runs with tp=1")


def threads_per_rank(config: EngineConfig) -> int:
    """Each rank's CPU threads: num_threads if set, else an even share of the cores this process may use."""
    if config.num_threads is not None:
        return config.num_threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // config.tp)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_rank() -> int | None:
    """This process's rank when torchrun (or another launcher setting RANK and WORLD_SIZE > 1) started it."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:
        return int(os.environ["RANK"])
    return None


def node_ranks(config: EngineConfig) -> list[int]:
    """The ranks this node runs (node 0 includes rank 0, the engine's own)."""
    per_node = config.tp // config.nnodes
    return list(range(config.node_rank * per_node, (config.node_rank + 1) * per_node))


def _local_rank(rank: int, config: EngineConfig) -> int:
    """The rank's index on its machine (its GPU's number): torchrun's LOCAL_RANK, or from node_rank."""
    if torchrun_rank() is not None and "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    return rank - config.node_rank * (config.tp // config.nnodes)


def _init_method(config: EngineConfig, port: int | None) -> str:
    if torchrun_rank() is not None:
        return "env://"
    return f"tcp://{config.master_addr}:{port}"


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def rank_device(device: str, rank: int) -> str:
    """One GPU per rank (cuda:rank); the CPU for every rank on a CPU."""
    return f"cuda:{rank}" if device.startswith("cuda") else device


class TPWorkers:
    """Rank 0's handle on the other ranks: starts them, joins the group, and sends each step."""

    def __init__(self, model: str | None, config: EngineConfig, device: str) -> None:
        import torch.distributed as dist
        import torch.multiprocessing as mp

        if tp_state().size > 1:
            raise ModelLoadError("this process already runs a tensor-parallel engine; one per process")
        self.size = config.tp
        if torchrun_rank() is not None and int(os.environ["WORLD_SIZE"]) != self.size:
            raise ModelLoadError(f"tp={self.size} but the launcher started {os.environ['WORLD_SIZE']} processes "
                                 "(WORLD_SIZE): they must be equal")
        port = config.master_port or _free_port()
        backend = _backend(device)
        ctx = mp.get_context("spawn")
        # this node's other ranks (none under torchrun: it started them)
        local = [] if torchrun_rank() is not None else [r for r in node_ranks(config) if r != 0]
        self.procs = [ctx.Process(target=_worker_main, name=f"llmserve-tp{rank}", daemon=True,
                                  args=(rank, self.size, port, backend, model, config, device))
                      for rank in local]
        self.ranks = local
        for p in self.procs:
            p.start()
        try:
            dist.init_process_group(backend, init_method=_init_method(config, port), rank=0, world_size=self.size,
                                    timeout=datetime.timedelta(seconds=timeout_s()))
        except Exception as e:
            self._kill()
            raise ModelLoadError(f"tp={self.size}: the worker ranks did not join: {self._dead() or e}") from None
        set_tp_state(TPState(0, self.size, dist.group.WORLD))
        self.closed = False
        atexit.register(self.close)  # a pipeline never closed: the workers still get their stop at exit

    def build(self, num_blocks: int, block_size: int, kv_cache_dtype: str) -> None:
        """The workers load their shards and bind KV caches of the same blocks, after rank 0 built its own runner
        (so that they reuse the kernel timings rank 0 measured instead of timing while it does)."""
        self._send(("build", (num_blocks, block_size, kv_cache_dtype)))
        errors = self._gather_status()
        bad = [(rank, e) for rank, e in enumerate(errors) if e]
        if bad:
            self.close()
            raise ModelLoadError("; ".join(f"tensor-parallel rank {rank}: {e}" for rank, e in bad))

    def forward(self, spans: list[Span]) -> None:
        self._send(("forward", [_for_workers(s) for s in spans]))

    def failed(self, error: BaseException) -> EngineDeadError:
        """What a failure inside a tensor-parallel forward means: the ranks are out of step, so the engine stops."""
        cause = self._dead() or f"a rank did not answer within {timeout_s():.0f} s (LLMSERVE_TP_TIMEOUT), or failed"
        return EngineDeadError(f"tensor parallelism: {cause}: {type(error).__name__}: {error}")

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self._send(("copy_blocks", pairs))

    def close(self) -> None:
        import torch.distributed as dist

        if self.closed:
            return
        self.closed = True
        try:
            if not self._dead():
                self._send(("stop", None))
        except EngineDeadError:
            pass
        for p in self.procs:
            p.join(10)
        self._kill()
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the group may be broken already (a dead rank)
            pass
        set_tp_state(TPState())

    def _send(self, command: tuple[str, Any]) -> None:
        import torch.distributed as dist

        dead = self._dead()
        if dead:
            raise EngineDeadError(f"tensor parallelism: {dead}; the engine cannot go on")
        try:
            dist.broadcast_object_list([command], src=0)
        except Exception as e:
            cause = self._dead() or f"a rank did not answer within {timeout_s():.0f} s (LLMSERVE_TP_TIMEOUT)"
            raise EngineDeadError(f"tensor parallelism: {cause} ({e})") from None

    def _gather_status(self) -> list[str | None]:
        import torch.distributed as dist

        statuses: list[Any] = [None] * self.size
        dist.all_gather_object(statuses, None)
        return statuses

    def _dead(self) -> str:
        gone = [f"rank {rank} exited with code {p.exitcode}" for rank, p in zip(self.ranks, self.procs)
                if not p.is_alive()]
        return ", ".join(gone)

    def _kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)


def _for_workers(span: Span) -> Span:
    """The span as the workers need it: prompt logprobs go to a scratch list of the same length (only rank 0's are
    kept), not a copy of the request's; an embedding's pooling is rank 0's alone."""
    task = span.prompt_logprobs
    if span.pooling is not None:
        span = dataclasses.replace(span, pooling=None)
    if task is None:
        return span
    return dataclasses.replace(span, prompt_logprobs=dataclasses.replace(task, sink=[None] * len(task.sink)))


def _worker_main(rank: int, size: int, port: int, backend: str, model: str | None, config: EngineConfig,
                 device: str) -> None:
    import torch.distributed as dist

    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s tp{rank} %(levelname)s %(name)s: %(message)s")
    dist.init_process_group(backend, init_method=_init_method(config, port), rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s()))
    set_tp_state(TPState(rank, size, dist.group.WORLD))
    runner = None
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        command, arg = box[0]
        if command == "forward":
            runner.forward(arg)
        elif command == "build":
            runner = _build(rank, model, config, device, *arg)
        elif command == "copy_blocks":
            runner.copy_blocks(arg)
        elif command == "stop":
            break
    # Stopped cleanly. Leave without running C++ destructors: gloo's threads, torn down at interpreter exit while
    # rank 0 closes its side, abort the process now and then ("terminate called without an active exception").
    logging.shutdown()
    os._exit(0)


def _build(rank: int, model: str | None, config: EngineConfig, device: str, num_blocks: int, block_size: int,
           kv_cache_dtype: str) -> Any:
    import torch.distributed as dist

    from llmserve.kernels import calibrate
    from llmserve.models.loader import load_model
    from llmserve.worker.model_runner import CpuOptions, ModelRunner

    runner, error = None, None
    try:
        config = dataclasses.replace(config, device=rank_device(device, _local_rank(rank, config)))
        loaded = load_model(model, config)
        cpu = CpuOptions(threads_per_rank(config), config.kernel_choice, calibrate.row_limits(config))
        runner = ModelRunner(loaded, num_blocks, block_size, cpu, kv_cache_dtype)
    except Exception as e:  # noqa: BLE001 - reported to rank 0, which names this rank
        error = f"{type(e).__name__}: {e}"
    statuses: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(statuses, error)
    torch.set_grad_enabled(False)
    return runner


def run_worker_node(model: str | None, config: EngineConfig) -> int:
    """A node other than 0 (node_rank > 0), or a non-zero rank under torchrun: run this node's ranks until rank 0
    stops them. Returns the exit code: 0, or 1 when a rank failed."""
    from llmserve.models.loader import resolve_device

    device = str(resolve_device(config.device))
    backend = _backend(device)
    rank = torchrun_rank()
    if rank is not None:  # torchrun started this process as one rank
        _worker_main(rank, config.tp, None, backend, model, config, device)
        return 0
    if not config.master_port:
        raise ModelLoadError("node_rank > 0 needs --master-port (and --master-addr): where node 0 listens")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker_main, name=f"llmserve-tp{r}", args=(r, config.tp, config.master_port,
                                                                             backend, model, config, device))
             for r in node_ranks(config)]
    for p in procs:
        p.start()
    logger.warning("node %d of %d: ranks %s joining %s:%d", config.node_rank, config.nnodes, node_ranks(config),
                   config.master_addr, config.master_port)
    for p in procs:
        p.join()
    failed = [f"rank {r} exited with code {p.exitcode}" for r, p in zip(node_ranks(config), procs) if p.exitcode]
    if failed:
        logger.error("node %d: %s", config.node_rank, ", ".join(failed))
    return 1 if failed else 0
