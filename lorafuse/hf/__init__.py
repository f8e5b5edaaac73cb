"""The Hugging Face side: the only package that imports transformers and peft."""
from .lora import FusedLoraLinear, fuse, unfuse

__all__ = ["FusedLoraLinear", "fuse", "unfuse"]
