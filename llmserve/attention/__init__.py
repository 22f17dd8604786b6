from llmserve.attention.layer import Attention
from llmserve.attention.metadata import AttentionMetadata, SeqSpec, build_attention_metadata

__all__ = ["Attention", "AttentionMetadata", "SeqSpec", "build_attention_metadata"]
