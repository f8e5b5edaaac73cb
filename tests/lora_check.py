"""What the fused LoRA layer tests share: odd shapes, PEFT's reference layer, the mask-injecting
dropout, one forward+backward that collects every gradient, and docs/design.md's tolerance rules."""
import copy
import math

import torch
from peft import LoraConfig
from peft.tuners import lora
from torch import nn

from lorafuse.ops.lora.dropout import keep_mask_reference, keep_scale

# (x shape, out features): row counts 1, 7, 113, 1023 (1023 as [3, 341] batch dims, with
# small widths so the interpreter stays fast); widths that are not powers of two.
SHAPES = [((1, 48), 80), ((7, 100), 36), ((113, 48), 80), ((113, 100), 36), ((3, 341, 24), 40)]
RANKS = [1, 8, 64]
HALF_DTYPES = [torch.bfloat16, torch.float16]
DTYPES = [torch.float32, *HALF_DTYPES]
LORA_ALPHA = 16  # scaling != 1, so a missing or doubled scale shows
# Bias modes: no bias at all; PEFT's default (base bias frozen); PEFT's bias="all" with
# lora_bias=True (base bias and lora_B's bias both trainable).
BIASES = ["none", "frozen", "trainable"]


def shape_id(shape) -> str:
    x_shape, n = shape
    return f"{'x'.join(map(str, x_shape))}to{n}"


def randomize_lora_B(layer: nn.Module) -> None:
    """Non-zero B (and lora_B bias), as after some training: PEFT's zero init hides B's bugs."""
    for linear in layer.lora_B.values():
        nn.init.kaiming_uniform_(linear.weight, a=math.sqrt(5))
        if linear.bias is not None:
            nn.init.uniform_(linear.bias, -0.5, 0.5)


def peft_lora_linear(k: int, n: int, r: int, bias: str = "frozen", lora_dropout: float = 0.0,
                     use_rslora: bool = False) -> lora.Linear:
    """PEFT's own LoRA Linear on a fresh nn.Linear(k, n), trainable as get_peft_model leaves it."""
    config = LoraConfig(r=r, lora_alpha=LORA_ALPHA, lora_dropout=lora_dropout, use_rslora=use_rslora,
                        lora_bias=bias == "trainable")
    layer = lora.Linear(nn.Linear(k, n, bias=bias != "none"), "default", config=config, r=r, lora_alpha=LORA_ALPHA)
    randomize_lora_B(layer)
    layer.base_layer.weight.requires_grad_(False)
    if layer.base_layer.bias is not None:
        layer.base_layer.bias.requires_grad_(bias == "trainable")
    return layer


class SeededDropout(nn.Module):
    """Stand-in for PEFT's nn.Dropout that drops exactly what the fused op drops for `seed`."""

    def __init__(self, p: float, seed: int):
        super().__init__()
        self.p, self.seed = p, seed

    def forward(self, x):
        # x: [..., K]; the op's mask is indexed by (row, column) of x.reshape(-1, K)
        x2 = x.reshape(-1, x.shape[-1])
        keep = keep_mask_reference(self.seed, x2.shape[0], x2.shape[1], self.p, x.device)
        return (x2 * keep * keep_scale(self.p)).reshape(x.shape)


def forward_backward(module: nn.Module, x: torch.Tensor, grad_out: torch.Tensor, **forward_kwargs) -> dict:
    """The output, x's gradient and every parameter gradient that backward produced, by name.

    Comparing two such dicts checks that both produced the same set of gradients."""
    x = x.detach().requires_grad_(True)
    out = module(x, **forward_kwargs)
    out.backward(grad_out)
    results = {"out": out.detach(), "x.grad": x.grad}
    results.update({name: p.grad for name, p in module.named_parameters() if p.grad is not None})
    return results


def random_io(x_shape, n: int, dtype=torch.float32):
    """Fresh input and output gradient: x [..., K], grad_out [..., N]."""
    x = torch.randn(x_shape).to(dtype)
    return x, torch.randn(*x_shape[:-1], n).to(dtype)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    # NaN or inf anywhere makes this NaN or inf, and so fails every `<` below.
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def assert_fp32_close(got: dict, want: dict) -> None:
    """fp32 rule: every tensor within relative error 1e-5 of PEFT's."""
    assert got.keys() == want.keys()
    for name in want:
        error = relative_error(got[name], want[name])
        assert error < 1e-5, f"{name}: relative error {error:.2e} (allowed < 1e-5)"


def max_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return (got.double() - exact).abs().max().item()


def assert_half_rule(fused: dict, plain: dict, exact: dict) -> None:
    """bf16/fp16 rule: fused error vs float64 at most 2x plain PyTorch's error in that dtype.

    The floor (1e-6 of the largest magnitude, far below one half-precision ulp) matters only
    where PyTorch's result is exact, e.g. a bias gradient summed over a single row: there a
    fused result that is exact up to fp32 accumulation must not fail on a zero bound.
    """
    assert fused.keys() == plain.keys() == exact.keys()
    for name in exact:
        assert torch.isfinite(fused[name]).all(), f"{name}: non-finite values in the fused result"
        fused_error, torch_error = max_error(fused[name], exact[name]), max_error(plain[name], exact[name])
        allowed = 2 * torch_error + 1e-6 * exact[name].abs().max().item()
        assert fused_error <= allowed, \
            f"{name}: fused error {fused_error:.3e} > {allowed:.3e} (torch {torch_error:.3e})"


def check_half(make_fused, make_plain, x, grad_out, dtype) -> None:
    """Run the fused module and PEFT's module in `dtype` and PEFT's in float64, then apply the rule.

    make_fused(dtype) / make_plain(dtype) return the two modules with the same weights in dtype;
    the float64 reference is PEFT's module with those (rounded) weights upcast.
    """
    plain = make_plain(dtype)
    exact = forward_backward(make_plain(dtype).double(), x.to(dtype).double(), grad_out.to(dtype).double())
    assert_half_rule(forward_backward(make_fused(dtype), x.to(dtype), grad_out.to(dtype)),
                     forward_backward(plain, x.to(dtype), grad_out.to(dtype)), exact)


def check_against_peft(fused: nn.Module, plain: nn.Module, x_shape, n: int, dtype) -> None:
    """Fused vs PEFT's module (same weights, given in float32) on fresh inputs: the fp32 rule,
    or in half precision the 2x-torch-error rule against float64."""
    x, grad_out = random_io(x_shape, n)
    if dtype == torch.float32:
        assert_fp32_close(forward_backward(fused, x, grad_out), forward_backward(plain, x, grad_out))
    else:
        check_half(lambda d: copy.deepcopy(fused).to(d), lambda d: copy.deepcopy(plain).to(d), x, grad_out, dtype)
