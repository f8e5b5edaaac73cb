"""Switching a PeftModel's LoRA adapter in place, so that decode steps captured with the first one stay valid.

A captured step holds the addresses of the active adapter's lora_A / lora_B tensors, and each layer's scale as
it was at capture (a Python float, fixed in the kernel launches). `swap_adapter` copies another adapter, saved
in PEFT's format, into those same tensors: a smaller rank is zero-padded (zero rows of A and columns of B add
nothing), and the ratio of the new scale to the layer's is folded into B, so that scale * B_buf @ A_buf equals
scale_new * B_new @ A_new. Modules, adapter names and scales stay as they are.
"""
import math
import os
import re
from collections import defaultdict

import torch
from peft import PeftConfig, PeftModel, PeftType
from peft.tuners.lora import LoraLayer
from peft.utils import load_peft_weights
from peft.utils.other import get_pattern_key

_PREFIX = "base_model.model."  # of module names in a PeftModel and of keys in PEFT's saved adapters
_LORA_KEY = re.compile(r"(.+)\.lora_([AB])\.weight")


def swap_adapter(model: PeftModel, adapter: str | os.PathLike, name: str | None = None) -> None:
    """Copy the LoRA adapter saved in the directory `adapter` into the weights of `model`'s adapter `name` (by
    default the active one), in place. The new adapter must target the same modules with a rank no larger than the
    model's; nothing is copied unless every layer fits."""
    active, layers = _buffers(model, name)
    incoming = _read_adapter(adapter)
    _check_fits(layers, incoming, active, adapter)
    with torch.no_grad():
        for name, layer in layers.items():
            lora_A, lora_B, scale = incoming[name]
            _copy_padded(layer.lora_A[active].weight, layer.lora_B[active].weight,
                         lora_A, lora_B.float() * (scale / layer.scaling[active]))


def _buffers(model: PeftModel, adapter: str | None) -> tuple[str, dict[str, LoraLayer]]:
    """(the adapter's name, the LoRA layers of `model`'s adapter `adapter` (None: the active one) by module name,
    without PEFT's prefix)."""
    if not isinstance(model, PeftModel):
        raise TypeError(f"swap_adapter: an unmerged PeftModel is needed, got {type(model).__name__} (an adapter "
                        "merged into the weights cannot be swapped in place)")
    adapter = model.active_adapter if adapter is None else adapter
    if adapter not in model.peft_config:
        raise ValueError(f"swap_adapter: the model holds no adapter {adapter!r} (it holds "
                         f"{', '.join(map(repr, model.peft_config))})")
    layers = {name.removeprefix(_PREFIX): module for name, module in model.named_modules()
              if isinstance(module, LoraLayer) and adapter in module.lora_A}
    for name, layer in layers.items():
        if layer.merged or layer.use_dora.get(adapter) or layer.lora_B[adapter].bias is not None:
            raise ValueError(f"swap_adapter: {name} holds a merged, DoRA or lora_bias adapter {adapter!r}: only "
                             "unmerged plain LoRA weights are swapped in place")
    return adapter, layers


def _read_adapter(adapter: str | os.PathLike) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """(lora_A [r, in], lora_B [out, r], scale) by module name, from an adapter saved by PEFT."""
    config = PeftConfig.from_pretrained(str(adapter))
    if config.peft_type != PeftType.LORA or config.use_dora:
        kind = "DoRA" if config.peft_type == PeftType.LORA else config.peft_type
        raise ValueError(f"swap_adapter: {adapter} holds a {kind} adapter; only plain LoRA is swapped in place")
    pairs, others = defaultdict(dict), []
    for key, tensor in load_peft_weights(str(adapter), device="cpu").items():
        match = _LORA_KEY.fullmatch(key)
        if match is None:
            others.append(key)
        else:
            pairs[match[1].removeprefix(_PREFIX)][match[2]] = tensor
    if others:
        raise ValueError(f"swap_adapter: {adapter} holds weights other than LoRA A and B matrices (e.g. {others[0]}; "
                         "lora_bias, embeddings or modules_to_save): they cannot be swapped in place")
    out = {}
    for name, weights in pairs.items():
        r = weights["A"].shape[0]  # rank_pattern already applied when it was saved
        alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), name), config.lora_alpha)
        out[name] = (weights["A"], weights["B"], alpha / math.sqrt(r) if config.use_rslora else alpha / r)
    return out


def _check_fits(layers: dict, incoming: dict, buffers_name: str, adapter) -> None:
    if layers.keys() != incoming.keys():
        only_new, only_old = sorted(incoming.keys() - layers.keys()), sorted(layers.keys() - incoming.keys())
        raise ValueError(
            f"swap_adapter: {adapter} targets {_leaves(incoming)} but the model's adapter {buffers_name!r} targets "
            f"{_leaves(layers)}; an in-place swap needs the same target modules "
            f"({len(only_new)} only in the new adapter{', e.g. ' + only_new[0] if only_new else ''}; "
            f"{len(only_old)} only in the model's{', e.g. ' + only_old[0] if only_old else ''})")
    for name, layer in layers.items():
        buffer_A, new_A = layer.lora_A[buffers_name].weight, incoming[name][0]
        if new_A.shape[0] > buffer_A.shape[0]:
            raise ValueError(f"swap_adapter: {adapter} has rank {new_A.shape[0]} on {name}, larger than the rank "
                             f"{buffer_A.shape[0]} of the model's adapter {buffers_name!r} there: build the model "
                             f"with an adapter of rank >= {new_A.shape[0]} to swap this one in")
        new_B, buffer_B = incoming[name][1], layer.lora_B[buffers_name].weight
        if new_A.shape[1] != buffer_A.shape[1] or new_B.shape[0] != buffer_B.shape[0]:
            raise ValueError(f"swap_adapter: {adapter}'s {name} maps {new_A.shape[1]} -> {new_B.shape[0]} "
                             f"features, the model's layer {buffer_A.shape[1]} -> {buffer_B.shape[0]}")


def _leaves(names) -> str:
    leaves = sorted({name.rsplit(".", 1)[-1] for name in names})
    return f"{len(names)} modules ({', '.join(leaves)})"


def _copy_padded(buffer_A: torch.Tensor, buffer_B: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor) -> None:
    # buffer_A: [R, in], buffer_B: [out, R]; lora_A: [r <= R, in], lora_B: [out, r]
    r = lora_A.shape[0]
    buffer_A[:r].copy_(lora_A)
    buffer_A[r:].zero_()
    buffer_B[:, :r].copy_(lora_B)
    buffer_B[:, r:].zero_()
