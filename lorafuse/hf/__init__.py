"""The Hugging Face side: the only package that imports transformers and peft.

Importing it registers attn_implementation="lorafuse" with transformers (see attention.py).
"""
from .activation_checkpointing import enable_activation_checkpointing
from .attention import register as register_attention
from .lora import FusedLoraLinear
from .model import from_pretrained, fuse, get_peft_model, unfuse

register_attention()

__all__ = ["FusedLoraLinear", "enable_activation_checkpointing", "from_pretrained", "fuse", "get_peft_model",
           "register_attention", "unfuse"]
