"""Triton kernels with their PyTorch references: one op a file."""
from .lora.linear import lora_linear, lora_linear_reference

__all__ = ["lora_linear", "lora_linear_reference"]
