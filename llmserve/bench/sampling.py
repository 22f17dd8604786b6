"""How a benchmark's requests sample: greedy unless a flag says otherwise. The flags are vLLM's benchmark names
(--temperature, --top-p, --top-k, --min-p) plus --repetition-penalty, and the same knobs reach the engine
(`bench throughput`, `bench latency`), transformers' generate (the `--baseline`) and a server (`bench serving`), so
a sampled workload is measured the same way on each side."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from llmserve.config import GenerationConfig
from llmserve.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingKnobs:
    temperature: float = 0.0  # 0: greedy, and the other knobs are ignored
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and 0 < self.top_p <= 1 and self.top_k >= 0 and 0 <= self.min_p <= 1
                and self.repetition_penalty > 0):
            raise InvalidRequestError(
                f"need --temperature >= 0, 0 < --top-p <= 1, --top-k >= 0, 0 <= --min-p <= 1 and "
                f"--repetition-penalty > 0, got {self.temperature}, {self.top_p}, {self.top_k}, {self.min_p} and "
                f"{self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generation_config(self, max_new_tokens: int, ignore_eos: bool) -> GenerationConfig:
        return GenerationConfig(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                                repetition_penalty=self.repetition_penalty, max_new_tokens=max_new_tokens,
                                ignore_eos=ignore_eos)

    def hf_generate_kwargs(self) -> dict[str, Any]:
        """transformers' generate() arguments for the same sampling (its top_k=0 and min_p=None are off too)."""
        if self.greedy:
            return {"do_sample": False, "repetition_penalty": self.repetition_penalty}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "min_p": self.min_p or None, "repetition_penalty": self.repetition_penalty}

    def request_fields(self) -> dict[str, Any]:
        """An OpenAI-compatible request's fields: temperature and top_p are OpenAI's; top_k, min_p and
        repetition_penalty are the extra fields vLLM, SGLang and llmserve accept, sent only when set."""
        fields: dict[str, Any] = {"temperature": self.temperature}
        if self.top_p != 1.0:
            fields["top_p"] = self.top_p
        if self.top_k:
            fields["top_k"] = self.top_k
        if self.min_p:
            fields["min_p"] = self.min_p
        if self.repetition_penalty != 1.0:
            fields["repetition_penalty"] = self.repetition_penalty
        return fields

    def describe(self) -> str:
        if self.greedy:
            return "greedy" + (f", repetition_penalty {self.repetition_penalty:g}"
                               if self.repetition_penalty != 1.0 else "")
        parts = [f"temperature {self.temperature:g}"] + [
            f"{name} {value:g}" for name, value, off in (("top_p", self.top_p, 1.0), ("top_k", self.top_k, 0),
                                                         ("min_p", self.min_p, 0.0),
                                                         ("repetition_penalty", self.repetition_penalty, 1.0))
            if value != off]
        return ", ".join(parts)


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling (default: greedy)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1: off)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0: off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p times the top one (default 0)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="over prompt and output (default 1: off)")


def knobs_from_args(args: argparse.Namespace) -> SamplingKnobs:
    return SamplingKnobs(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                         repetition_penalty=args.repetition_penalty)
