"""Fused forward for PEFT's LoRA `Linear`, applied to a PeftModel in place.

`fuse` swaps the class of every `peft.tuners.lora.Linear` to `FusedLoraLinear`, a subclass
that only overrides `forward`. Parameters, state-dict keys, merge/unmerge, adapter switching
and saving are PEFT's own code, untouched. The fused path covers the common case (see
`_unfused_reason`); everything else runs PEFT's forward, and the reason is logged once.
"""
import torch
from peft.tuners import lora
from torch import nn

from .._logging import log_once
from ..nn import lora_forward

FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class FusedLoraLinear(lora.Linear):
    """PEFT's LoRA Linear whose forward runs `lorafuse.ops.lora_linear` when it can."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features], in x's dtype as PEFT returns it
        reason = self._unfused_reason(x, args, kwargs)
        if reason is not None:
            log_once(f"lorafuse: LoRA Linear with {reason} runs through PEFT's forward (not fused)")
            return super().forward(x, *args, **kwargs)
        return lora_forward(self, self.active_adapters[0], x)

    def _unfused_reason(self, x: torch.Tensor, args: tuple, kwargs: dict) -> str | None:
        """Why PEFT's forward must run instead of the fused op, or None when the op computes the same."""
        if kwargs.get("adapter_names") is not None:
            return "a mixed-adapter batch (adapter_names=...)"
        extra = sorted(name for name, value in kwargs.items() if value is not None)
        if args or extra:
            return f"extra forward arguments ({len(args)} positional, keywords {extra})"
        if self.disable_adapters:
            return "adapters disabled"
        if self.merged:
            return "merged adapters"
        if len(self.active_adapters) != 1:
            return "several active adapters"
        adapter = self.active_adapters[0]
        if adapter not in self.lora_A:
            return "no weights for the active adapter"
        if adapter in self.lora_variant:
            variant = type(self.lora_variant[adapter]).__name__.removesuffix("LinearVariant")
            return f"{variant} adapters (a LoRA variant)"
        base = self.base_layer
        if type(base) is not nn.Linear or self.fan_in_fan_out:
            return f"a {type(base).__name__} base layer (fused: plain nn.Linear)"
        if base._forward_hooks or base._forward_pre_hooks or "forward" in vars(base):
            return "a hooked base layer (e.g. accelerate offload)"
        dropout = self.lora_dropout[adapter]
        if type(dropout) not in (nn.Dropout, nn.Identity):
            return f"a {type(dropout).__name__} lora_dropout (fused: nn.Dropout or nn.Identity)"
        autocast = torch.is_autocast_enabled(x.device.type)
        if not autocast and (x.dtype != base.weight.dtype or x.dtype not in FUSED_DTYPES):
            # The op casts adapter tiles (PEFT keeps them in float32 for half-precision bases)
            # and follows autocast itself; input and frozen weight must share a fused dtype.
            return f"input {x.dtype} and base weight {base.weight.dtype} (fused: one of float32, float16, bfloat16)"
        lora_B = self.lora_B[adapter]
        adapter_dtypes = {self.lora_A[adapter].weight.dtype, lora_B.weight.dtype}
        if len(adapter_dtypes) != 1 or not adapter_dtypes <= set(FUSED_DTYPES):
            return f"adapter weights in {sorted(map(str, adapter_dtypes))} (fused: one of float32, float16, bfloat16)"
        if lora_B.bias is not None and lora_B.bias.dtype != x.dtype and not autocast:
            # PEFT adds lora_B's bias in the adapter dtype after the base output; folded into
            # the base bias (as the op takes it) it would have to be rounded to x's dtype first.
            return f"lora_bias in {lora_B.bias.dtype} on {x.dtype} inputs"
        return None


def fuse(model: nn.Module) -> nn.Module:
    """Make every PEFT LoRA `Linear` in `model` (a PeftModel) run the fused op; returns `model`.

    In place, and reversible with `unfuse`: saving, loading, merging and adapter switching are
    unaffected because only the modules' class (hence `forward`) changes.
    """
    layers = [m for m in model.modules() if type(m) in (lora.Linear, FusedLoraLinear)]
    if not layers:
        raise ValueError(f"fuse: {type(model).__name__} has no peft LoRA Linear layers; wrap it first with "
                         "peft.get_peft_model(model, LoraConfig(target_modules=[...]))")
    for layer in layers:
        layer.__class__ = FusedLoraLinear
    return model


def unfuse(model: nn.Module) -> nn.Module:
    """Give every fused layer in `model` back its stock `peft.tuners.lora.Linear` class; returns `model`."""
    for layer in model.modules():
        if type(layer) is FusedLoraLinear:
            layer.__class__ = lora.Linear
    return model
