"""Static-shape inference: a preallocated KV cache, decode steps captured as CUDA graphs per batch-size bucket,
on-device sampling, adapters merged or swapped in place (see engine.py)."""
from .engine import DEFAULT_BUCKETS, Engine
from .sampling import SamplingParams, filter_logits, sample

__all__ = ["DEFAULT_BUCKETS", "Engine", "SamplingParams", "filter_logits", "sample"]
