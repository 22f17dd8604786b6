"""The same workload through plain `transformers.generate` (left-padded static batches), so a
throughput figure can be read as a ratio measured in the same run on the same machine."""

from __future__ import annotations

import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from llmserve.bench.datasets import BenchRequest
from llmserve.bench.sampling import SamplingKnobs
from llmserve.bench.throughput import (
    ThroughputResult,
    peak_device_mb,
    peak_rss_mb,
    reset_peak_device_memory,
    synchronize,
    workload_flop,
)


def run_transformers_throughput(model_dir: str, dtype: torch.dtype, device: torch.device,
                                requests: list[BenchRequest], batch_size: int, pad_token_id: int,
                                dummy: bool = False, sampling: SamplingKnobs = SamplingKnobs()) -> ThroughputResult:
    """dummy: random weights from config.json alone (the engine ran with load_format=dummy). sampling: as the
    engine's requests (greedy by default)."""
    if dummy:
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    reset_peak_device_memory(device)
    output_tokens = 0
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):  # left padding, as generation needs
            ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[row, width - len(r.prompt_token_ids):] = 1
        new = max(r.output_len for r in batch)
        with torch.inference_mode():
            model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new, min_new_tokens=new,
                           pad_token_id=pad_token_id, **sampling.hf_generate_kwargs())
        output_tokens += sum(r.output_len for r in batch)
    synchronize(device)
    elapsed = time.perf_counter() - start
    peak_device = peak_device_mb(device)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    flop = workload_flop(model.config, requests)
    del model
    return ThroughputResult(
        engine=f"transformers (batch {batch_size})", num_requests=len(requests), prompt_tokens=prompt_tokens,
        output_tokens=output_tokens, elapsed_s=elapsed, requests_per_s=len(requests) / elapsed,
        output_tokens_per_s=output_tokens / elapsed, total_tokens_per_s=(prompt_tokens + output_tokens) / elapsed,
        prefix_cache_hit_rate=0.0, peak_rss_mb=peak_rss_mb(), gflop=flop / 1e9,
        achieved_gflops=flop / elapsed / 1e9, peak_device_mb=peak_device)
