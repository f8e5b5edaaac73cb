"""nn.Modules built on lorafuse.ops. Imports torch and ops only (no transformers, no peft)."""
from .lora_linear import LoraLinear, lora_forward

__all__ = ["LoraLinear", "lora_forward"]
