"""RMSNorm as Llama, Mistral and Qwen compute it, in one kernel: y = w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype).

transformers' RMSNorm runs seven kernels (cast, square, mean, add, rsqrt, multiply, cast and scale); a decode
step has two per layer, each moving a few kilobytes, so their launches are the cost. Forward only: it serves decoding
(lorafuse.inference), where nothing needs a gradient.
"""
import os

import torch
import triton
import triton.language as tl

from .._logging import log_once

MAX_WIDTH = 16384  # one row per program, held in registers


def rms_norm_reference(x, weight, eps):
    # x: [..., D], weight: [D] -> [..., D] in the promoted dtype of weight and x, as transformers' LlamaRMSNorm
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


@triton.jit
def _rms_norm(x_ptr, w_ptr, y_ptr, D, stride_x, eps, BLOCK_D: tl.constexpr):
    # x: [M, D] (row stride stride_x, unit column stride), w: [D], y: [M, D] contiguous; one program per row
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)  # rounded to x's dtype first, as transformers
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row.to(tl.int64) * D + cols, (w * normed).to(y_ptr.dtype.element_ty), mask=mask)


def _unsupported_reason(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "tensors not on a CUDA device run the PyTorch reference (TRITON_INTERPRET=1 runs the kernel on CPU)"
    if not {x.dtype, weight.dtype} <= {torch.float32, torch.float16, torch.bfloat16}:
        return f"{x.dtype} input or {weight.dtype} weight runs the PyTorch reference"
    if not 0 < x.shape[-1] <= MAX_WIDTH or x.numel() == 0 or weight.shape != x.shape[-1:]:
        return f"width {x.shape[-1]} (weight {tuple(weight.shape)}, {x.numel()} elements) runs the PyTorch reference"
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm_reference's result from one launch (no autograd); inputs the kernel does not take run the
    reference, the reason logged once."""
    # x: [..., D], weight: [D]
    reason = _unsupported_reason(x, weight)
    if reason is not None:
        log_once(f"lorafuse.rms_norm: {reason}")
        return rms_norm_reference(x, weight, eps)
    shape, D = x.shape, x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, device=x.device, dtype=torch.promote_types(weight.dtype, x.dtype))
    block = triton.next_power_of_2(D)
    _rms_norm[(x2.shape[0],)](x2, weight.contiguous(), y, D, x2.stride(0), eps, BLOCK_D=block,
                              num_warps=min(16, max(1, block // 256)))
    return y.view(shape)
