"""Tensor parallelism over torch.distributed (gloo on CPUs, NCCL on GPUs): the process's place in its group, the
collectives the sharded layers call, and the worker processes the engine starts (workers.py)."""

from llmserve.distributed.state import TPState, all_gather_last, all_reduce_, set_tp_state, shard, tp_state

__all__ = ["TPState", "all_gather_last", "all_reduce_", "set_tp_state", "shard", "tp_state"]
