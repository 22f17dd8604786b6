from llmserve.sampling.batch import SamplingBatch, SequenceState, seeded_generator
from llmserve.sampling.logprobs import TokenLogprobs
from llmserve.sampling.params import SamplingParams
from llmserve.sampling.sampler import Sampler, SamplerOutput

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingParams",
    "SequenceState",
    "TokenLogprobs",
    "seeded_generator",
]
