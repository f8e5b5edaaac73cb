"""The Hugging Face side: the only package that imports transformers and peft.

Importing it registers attn_implementation="lorafuse" with transformers (see attention.py).
"""
from .attention import register as register_attention
from .lora import FusedLoraLinear
from .model import from_pretrained, fuse, get_peft_model, unfuse

register_attention()

__all__ = ["FusedLoraLinear", "from_pretrained", "fuse", "get_peft_model", "register_attention", "unfuse"]
