"""The Hugging Face side: the only package that imports transformers and peft.

Importing it registers attn_implementation="lorafuse" with transformers (see attention.py).
"""
from .attention import register as register_attention
from .lora import FusedLoraLinear, fuse, unfuse

register_attention()

__all__ = ["FusedLoraLinear", "fuse", "register_attention", "unfuse"]
