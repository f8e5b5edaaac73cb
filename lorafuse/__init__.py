"""lorafuse: LoRA fine-tuning with fused Triton adapters, inside the Hugging Face / PEFT ecosystem."""
from .nn import LoraLinear
from .ops import lora_linear

_HF_API = ("enable_activation_checkpointing", "from_pretrained", "fuse", "get_peft_model", "register_attention",
           "unfuse")

__all__ = ["LoraLinear", "lora_linear", *_HF_API]


def __getattr__(name):
    # lorafuse.hf imports transformers and peft: load it only when asked for, so that
    # `import lorafuse.ops` and `import lorafuse.nn` stay torch-only.
    if name in _HF_API:
        from . import hf
        return getattr(hf, name)
    raise AttributeError(f"module 'lorafuse' has no attribute {name!r}")
