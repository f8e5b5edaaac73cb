"""Activations of the fused epilogues: Triton helpers and their PyTorch references.

The kernels take the activation as a constexpr id (`ACT`); users pass a name. Every
activation has a derivative written in terms of the pre-activation `z`, which is what the
fused backward kernels recompute or keep.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

ACTIVATIONS = ("identity", "relu", "gelu", "gelu_tanh", "silu", "sigmoid")

IDENTITY = tl.constexpr(0)
RELU = tl.constexpr(1)
GELU = tl.constexpr(2)
GELU_TANH = tl.constexpr(3)
SILU = tl.constexpr(4)
SIGMOID = tl.constexpr(5)

SQRT_HALF = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
GELU_TANH_C = tl.constexpr(0.044715)


def activation_id(name: str) -> int:
    """The kernels' constexpr id of an activation name; a bad name lists the allowed ones."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation={name!r} is not supported; choose one of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS.index(name)


def activation_reference(z: torch.Tensor, name: str) -> torch.Tensor:
    """PyTorch reference of `activate` (autograd gives the reference derivative)."""
    activation_id(name)
    if name == "identity":
        return z
    if name == "relu":
        return F.relu(z)
    if name == "gelu":
        return F.gelu(z)
    if name == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    if name == "silu":
        return F.silu(z)
    return torch.sigmoid(z)


@triton.jit
def _tanh(u):
    # tanh through exp keeps the helper portable across Triton versions and the interpreter;
    # the clamp keeps exp finite (tanh(40) is 1 in fp32 already).
    return 1.0 - 2.0 / (1.0 + tl.exp(tl.minimum(2.0 * u, 80.0)))


@triton.jit
def activate(z, ACT: tl.constexpr):
    # z: fp32 tile of pre-activations
    if ACT == RELU:
        return tl.maximum(z, 0.0)
    elif ACT == GELU:
        return 0.5 * z * (1.0 + tl.erf(z * SQRT_HALF))
    elif ACT == GELU_TANH:
        return 0.5 * z * (1.0 + _tanh(SQRT_2_OVER_PI * (z + GELU_TANH_C * z * z * z)))
    elif ACT == SILU:
        return z * tl.sigmoid(z)
    elif ACT == SIGMOID:
        return tl.sigmoid(z)
    else:
        return z


@triton.jit
def activate_grad(z, ACT: tl.constexpr):
    # d act(z) / dz for an fp32 tile z
    if ACT == RELU:
        return tl.where(z > 0.0, 1.0, 0.0)
    elif ACT == GELU:
        return 0.5 * (1.0 + tl.erf(z * SQRT_HALF)) + z * INV_SQRT_2PI * tl.exp(-0.5 * z * z)
    elif ACT == GELU_TANH:
        t = _tanh(SQRT_2_OVER_PI * (z + GELU_TANH_C * z * z * z))
        du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_TANH_C * z * z)
        return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * du
    elif ACT == SILU:
        sg = tl.sigmoid(z)
        return sg * (1.0 + z * (1.0 - sg))
    elif ACT == SIGMOID:
        sg = tl.sigmoid(z)
        return sg * (1.0 - sg)
    else:
        return tl.full(z.shape, 1.0, tl.float32)

