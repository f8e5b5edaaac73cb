"""The SwiGLU product of Llama-family MLPs, forward and backward: y = silu(gate) * up.

transformers computes it as two kernels forward (silu, then the product, keeping silu(gate) for the backward: one
more activation-sized tensor per layer) and about five backward. Here one kernel each way; the backward recomputes
silu(gate) from gate, which it reads anyway.
"""

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..common.autograd import differentiable_backward, functorch_reason
from ..common.kernel_launch import launch
from ..common.tiles import PLANS, LaunchPlan, cdiv, kernels_run_on
from ..common.traceable_log import log_once_traceable

BLOCK = 2048  # elements per program: memory-bound, 16-byte vectors on every thread of 8 warps


def silu_mul_reference(gate, up):
    # gate, up: [...] -> [...], as transformers' LlamaMLP: act_fn(gate_proj(x)) * up_proj(x)
    return F.silu(gate) * up


@triton.jit
def _silu_mul_fwd(gate_ptr, up_ptr, y_ptr, n, BLOCK: tl.constexpr):
    # gate, up, y: [n] contiguous
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (gate * tl.sigmoid(gate)).to(y_ptr.dtype.element_ty).to(tl.float32)  # rounded as transformers' silu
    tl.store(y_ptr + offs, (silu * up).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_bwd(gate_ptr, up_ptr, dy_ptr, dgate_ptr, dup_ptr, n, BLOCK: tl.constexpr):
    # gate, up, dy, dgate, dup: [n] contiguous
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    # d silu / d gate = sig * (1 + gate * (1 - sig))
    tl.store(dgate_ptr + offs, (dy * up * sig * (1.0 + gate * (1.0 - sig))).to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + offs, (dy * silu.to(gate_ptr.dtype.element_ty).to(tl.float32)).to(dup_ptr.dtype.element_ty),
             mask=mask)


def _unsupported_reason(gate: torch.Tensor, up: torch.Tensor) -> str | None:
    if not kernels_run_on(gate.device):
        return "tensors not on a CUDA device run the PyTorch reference (TRITON_INTERPRET=1 runs the kernel on CPU)"
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        return (f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} differ in shape, dtype "
                "or device: the PyTorch reference broadcasts and promotes")
    if gate.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"{gate.dtype} inputs run the PyTorch reference"
    if gate.numel() == 0:
        return "empty inputs run the PyTorch reference"
    return None


@functools.lru_cache(maxsize=PLANS)
def _plan(n: int) -> LaunchPlan:
    # n elements, BLOCK a program, either way
    return LaunchPlan((cdiv(n, BLOCK),), (), dict(BLOCK=BLOCK, num_warps=8))


def _forward(gate, up):
    # gate, up: [...] contiguous -> y [...] contiguous
    y = torch.empty_like(gate)
    launch(_silu_mul_fwd, _plan(gate.numel()), gate, up, y, gate.numel())
    return y


def _backward(gate, up, dy):
    # gate, up: [...] contiguous, dy: [...] -> dgate, dup [...] contiguous
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    launch(_silu_mul_bwd, _plan(gate.numel()), gate, up, dy.contiguous(), dgate, dup, gate.numel())
    return dgate, dup


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _forward(gate, up)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: gradients that autograd can differentiate again
            return differentiable_backward(silu_mul_reference, (gate, up), dy)
        return _backward(gate, up, dy)


# The same launches as custom ops, which torch.compile traces through (the Function above costs less host time per
# call in eager mode, so eager calls keep it). Double backward is not theirs to give: compiled graphs have none.

@torch.library.custom_op("lorafuse::silu_mul", mutates_args=())
def _silu_mul_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _forward(gate.contiguous(), up.contiguous())


@_silu_mul_op.register_fake
def _silu_mul_fake(gate, up):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("lorafuse::silu_mul_backward", mutates_args=())
def _silu_mul_backward_op(gate: torch.Tensor, up: torch.Tensor,
                          dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(gate.contiguous(), up.contiguous(), dy)


@_silu_mul_backward_op.register_fake
def _silu_mul_backward_fake(gate, up, dy):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _silu_mul_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _silu_mul_op_backward(ctx, dy):
    return _silu_mul_backward_op(*ctx.saved_tensors, dy)


_silu_mul_op.register_autograd(_silu_mul_op_backward, setup_context=_silu_mul_setup_context)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in one kernel, differentiable in both; inputs the kernels do not take run the reference, the
    reason logged once. Under torch.compile, the custom op lorafuse::silu_mul."""
    # gate, up: [...] (same shape and dtype) -> [...]
    reason = functorch_reason(gate, up) or _unsupported_reason(gate, up)
    if reason is not None:
        log_once_traceable(f"lorafuse.silu_mul: {reason}")
        return silu_mul_reference(gate, up)
    gate_c, up_c = gate.contiguous(), up.contiguous()
    if torch.compiler.is_compiling():
        return _silu_mul_op(gate_c, up_c)
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SiluMul.apply(gate_c, up_c)
    return _forward(gate_c, up_c)
