"""The fused LoRA Linear: a torch-only drop-in for PEFT's `lora.Linear`.

`LoraLinear` lays out its parameters exactly as PEFT does (`base_layer`, `lora_A.<adapter>`,
`lora_B.<adapter>`, `lora_dropout.<adapter>`, `scaling[<adapter>]`), so its state dict loads
into PEFT and back. `lora_forward` runs the fused op on any module with that layout: this
module and the PEFT subclass in `lorafuse.hf` both call it.
"""
import math

import torch
from torch import nn

from ..ops import lora_linear


def lora_forward(layer: nn.Module, adapter: str, x: torch.Tensor, seed: torch.Tensor | None = None) -> torch.Tensor:
    """The fused LoRA forward of `layer`'s adapter `adapter` (any module with PEFT's layout).

    Dropout follows `layer.training`; `seed` (int64 [1]) fixes its mask, None draws a fresh one.
    """
    # x: [..., K]; base_layer.weight: [N, K] ([K, N] with fan_in_fan_out); lora_A.weight: [r, K]; lora_B.weight: [N, r]
    modules = layer._modules  # `layer.lora_A` would go through Module.__getattr__ after a failed lookup
    base, lora_A, lora_B = modules["base_layer"], modules["lora_A"][adapter], modules["lora_B"][adapter]
    # PEFT's fan_in_fan_out marks a base stored [K, N] (transformers' Conv1D, GPT-2): the op takes
    # the transposed view as it is, on either GEMM route (strided operands, no copy).
    weight = base.weight
    if getattr(layer, "fan_in_fan_out", False):
        weight = weight.t()
    scale = layer.scaling[adapter]
    dropout = modules["lora_dropout"][adapter]
    dropout_p = dropout.p if isinstance(dropout, nn.Dropout) and dropout.training else 0.0  # as PEFT's nn.Dropout
    # PEFT adds lora_B's bias after scaling: y = x W^T + b + scale * (B (A x) + b_B).
    bias, lora_bias = base.bias, lora_B.bias
    if lora_bias is not None:
        bias = scale * lora_bias if bias is None else bias + scale * lora_bias
    return lora_linear(x, weight, bias, lora_A.weight, lora_B.weight, scale, dropout_p, seed=seed)


class LoraLinear(nn.Module):
    """One LoRA adapter on a frozen `nn.Linear`, initialised as PEFT does (A kaiming, B zero)."""

    def __init__(self, base_layer: nn.Linear, r: int, lora_alpha: float = 1, lora_dropout: float = 0.0,
                 use_rslora: bool = False, lora_bias: bool = False, adapter_name: str = "default"):
        super().__init__()
        if not isinstance(base_layer, nn.Linear):
            raise TypeError(f"LoraLinear: base_layer must be an nn.Linear, got {type(base_layer).__name__}")
        if not (isinstance(r, int) and r > 0):
            raise ValueError(f"LoraLinear: r must be a positive int, got r={r!r}")
        if not 0.0 <= lora_dropout < 1.0:
            raise ValueError(f"LoraLinear: lora_dropout must lie in [0, 1), got lora_dropout={lora_dropout!r}")
        self.base_layer = base_layer.requires_grad_(False)
        self.adapter_name = adapter_name
        self.r = {adapter_name: r}
        self.lora_alpha = {adapter_name: lora_alpha}
        self.scaling = {adapter_name: lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r}
        dropout = nn.Dropout(lora_dropout) if lora_dropout > 0 else nn.Identity()
        self.lora_dropout = nn.ModuleDict({adapter_name: dropout})
        like_base = {"device": base_layer.weight.device, "dtype": base_layer.weight.dtype}
        self.lora_A = nn.ModuleDict({adapter_name: nn.Linear(base_layer.in_features, r, bias=False, **like_base)})
        self.lora_B = nn.ModuleDict({adapter_name: nn.Linear(r, base_layer.out_features, bias=lora_bias, **like_base)})
        self.reset_lora_parameters()

    def reset_lora_parameters(self) -> None:
        # PEFT's default (init_lora_weights=True): the adapter starts as an exact no-op.
        nn.init.kaiming_uniform_(self.lora_A[self.adapter_name].weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B[self.adapter_name].weight)
        if self.lora_B[self.adapter_name].bias is not None:
            nn.init.zeros_(self.lora_B[self.adapter_name].bias)

    def forward(self, x: torch.Tensor, seed: torch.Tensor | None = None) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        weight_dtype = self.base_layer.weight.dtype
        if x.dtype != weight_dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(f"LoraLinear: x is {x.dtype} but the layer's weights are {weight_dtype}; "
                            "cast one to the other")
        return lora_forward(self, self.adapter_name, x, seed)
