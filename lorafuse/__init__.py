"""lorafuse: LoRA fine-tuning with fused Triton adapters, inside the Hugging Face / PEFT ecosystem."""
from .nn import LoraLinear
from .ops import lora_linear

__all__ = ["LoraLinear", "fuse", "lora_linear", "register_attention", "unfuse"]


def __getattr__(name):
    # lorafuse.hf imports transformers and peft: load it only when asked for, so that
    # `import lorafuse.ops` and `import lorafuse.nn` stay torch-only.
    if name in ("fuse", "register_attention", "unfuse"):
        from . import hf
        return getattr(hf, name)
    raise AttributeError(f"module 'lorafuse' has no attribute {name!r}")
