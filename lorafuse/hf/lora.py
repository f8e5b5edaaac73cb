"""Fused forward for PEFT's LoRA `Linear`, applied to a PeftModel in place.

`fuse_layers` swaps the class of every `peft.tuners.lora.Linear` on an `nn.Linear` or on
transformers' `Conv1D` (GPT-2; PEFT's fan_in_fan_out) to `FusedLoraLinear`, a subclass that
only overrides `forward` and reports PEFT's class name (repr, get_layer_status). Parameters,
state-dict keys, merge/unmerge, adapter switching and saving are PEFT's own code, untouched.
Other LoRA layers (Embedding, Conv2d, quantized bases...) keep PEFT's class, logged once per
kind at fuse time. Per call, the fused path covers the
common case (see `_unfused_reason`); anything else runs PEFT's forward, and the reason is logged once.
"""
from collections import defaultdict

import torch
from peft.tuners import lora
from torch import nn
from torch.nn.modules import module as module_hooks
from transformers.pytorch_utils import Conv1D

from .._logging import log_once
from ..nn import lora_forward

FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class FusedLoraLinear(lora.Linear):
    """PEFT's LoRA Linear whose forward runs `lorafuse.ops.lora.linear` when it can."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features], in x's dtype as PEFT returns it
        active = self.active_adapters
        reason = self._unfused_reason(x, args, kwargs, active)
        if reason is not None:
            log_once(f"lorafuse: LoRA Linear with {reason} runs through PEFT's forward (not fused)")
            return super().forward(x, *args, **kwargs)
        return lora_forward(self, active[0], x)

    def _get_name(self) -> str:
        # repr, and PEFT's get_layer_status/get_model_status that read it, name PEFT's class: "lora.Linear"
        return lora.Linear.__name__

    def _unfused_reason(self, x: torch.Tensor, args: tuple, kwargs: dict, active: list[str]) -> str | None:
        """Why PEFT's forward must run instead of the fused op, or None when the op computes the same."""
        # Runs on every call (decoding calls are bound by the host's time): the common case passes cheap tests first.
        if args or kwargs:
            if kwargs.get("adapter_names") is not None:
                return "a mixed-adapter batch (adapter_names=...)"
            extra = sorted(name for name, value in kwargs.items() if value is not None)
            if args or extra:
                return f"extra forward arguments ({len(args)} positional, keywords {extra})"
        if self.disable_adapters:
            return "adapters disabled"
        if self.merged:
            return "merged adapters"
        if len(active) != 1:
            return "several active adapters"
        adapter = active[0]
        modules = self._modules  # `self.lora_A` would go through Module.__getattr__ after a failed lookup
        if adapter not in modules["lora_A"]:
            return "no weights for the active adapter"
        if adapter in self.lora_variant:
            variant = type(self.lora_variant[adapter]).__name__.removesuffix("LinearVariant")
            return f"{variant} adapters (a LoRA variant)"
        base, lora_A, lora_B = modules["base_layer"], modules["lora_A"][adapter], modules["lora_B"][adapter]
        dropout = modules["lora_dropout"][adapter]
        # PEFT's forward calls these modules, so their hooks fire (accelerate's offload, activation probes, backward
        # hooks); the fused op reads their weights and calls none of them
        if any(map(_hooked, (base, lora_A, lora_B, dropout))) or _global_module_hooks():
            return "hooks on the base layer, lora_A, lora_B or lora_dropout, or global module hooks"
        if type(dropout) not in (nn.Dropout, nn.Identity):
            return f"a {type(dropout).__name__} lora_dropout (fused: nn.Dropout or nn.Identity)"
        autocast = torch.is_autocast_enabled(x.device.type)
        base_dtype = base.weight.dtype
        if not autocast and (x.dtype != base_dtype or x.dtype not in FUSED_DTYPES):
            # The op casts adapter tiles (PEFT keeps them in float32 for half-precision bases)
            # and follows autocast itself; input and frozen weight must share a fused dtype.
            return f"input {x.dtype} and base weight {base_dtype} (fused: one of float32, float16, bfloat16)"
        a_dtype, b_dtype = lora_A.weight.dtype, lora_B.weight.dtype
        if a_dtype != b_dtype or a_dtype not in FUSED_DTYPES:
            return (f"adapter weights in {sorted(map(str, {a_dtype, b_dtype}))} (fused: one of float32, float16, "
                    "bfloat16)")
        lora_bias = lora_B.bias
        if lora_bias is not None and lora_bias.dtype != x.dtype and not autocast:
            # PEFT adds lora_B's bias in the adapter dtype after the base output; folded into
            # the base bias (as the op takes it) it would have to be rounded to x's dtype first.
            return f"lora_bias in {lora_bias.dtype} on {x.dtype} inputs"
        return None


def _hooked(module: nn.Module) -> bool:
    """Whether calling `module` runs more than its class's forward: hooks, or a forward set on the instance."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or "forward" in vars(module))


def _global_module_hooks() -> bool:
    """Whether hooks registered for every module (torch.nn.modules.module.register_module_forward_hook...) are set."""
    return bool(module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks
                or module_hooks._global_backward_hooks or module_hooks._global_backward_pre_hooks)


def _unfusable_kind(layer: nn.Module) -> str | None:
    """The kind of a PEFT LoRA layer that never runs fused (a phrase for the log), or None if it can."""
    if type(layer) not in (lora.Linear, FusedLoraLinear):
        return f"LoRA {type(layer).__name__} layers"
    base = type(layer.base_layer)
    # fan_in_fan_out is how PEFT marks the [in, out] weight of Conv1D; PEFT sets it from the base's type.
    if (base is nn.Linear and not layer.fan_in_fan_out) or (base is Conv1D and layer.fan_in_fan_out):
        return None
    return f"LoRA Linear layers on a {base.__name__} base (fan_in_fan_out={layer.fan_in_fan_out})"


def fuse_layers(model: nn.Module) -> nn.Module:
    """Make every PEFT LoRA `Linear` on an `nn.Linear` or `Conv1D` in `model` run the fused op; returns `model`.

    In place, and reversible with `unfuse_layers`: saving, loading, merging and adapter switching are
    unaffected because only the modules' class (hence `forward`) changes.
    """
    unfusable = defaultdict(list)
    fusable = []
    for name, module in model.named_modules():
        if not isinstance(module, lora.LoraLayer):
            continue
        kind = _unfusable_kind(module)
        if kind is None:
            fusable.append(module)
        else:
            unfusable[kind].append(name)
    if not fusable and not unfusable:
        raise ValueError(f"fuse: {type(model).__name__} has no peft LoRA Linear layers; wrap it first with "
                         "peft.get_peft_model(model, LoraConfig(target_modules=[...]))")
    for kind, names in unfusable.items():
        log_once(f"lorafuse.fuse: {len(names)} {kind} (e.g. {names[0]}) run through PEFT's forward: lorafuse fuses "
                 "LoRA Linear layers on nn.Linear and on transformers' Conv1D")
    for layer in fusable:
        layer.__class__ = FusedLoraLinear
    return model


def unfuse_layers(model: nn.Module) -> nn.Module:
    """Give every fused layer in `model` back its stock `peft.tuners.lora.Linear` class; returns `model`."""
    for layer in model.modules():
        if type(layer) is FusedLoraLinear:
            layer.__class__ = lora.Linear
    return model
