"""RMSNorm as Llama, Mistral and Qwen compute it, forward and backward: y = w * (x * rsqrt(mean(x^2) + eps)).to(dtype).

transformers' RMSNorm runs seven kernels forward (cast, square, mean, add, rsqrt, multiply, cast and scale) and
about as many backward, keeping float32 copies of the activations for the backward. Here the forward is one kernel
that keeps only rstd (one float per row), and the backward one more: dx (and, when the weight trains, per-program
partial sums of dw). A decode step's norms move a few kilobytes each, so there the launches are the cost; in
training the float32 copies are (a Llama-1B step: 33 norms over [8192, 2048]).
"""

import functools

import torch
import triton
import triton.language as tl

from ..common.autograd import differentiable_backward, functorch_reason
from ..common.kernel_launch import launch
from ..common.tiles import PLANS, LaunchPlan, kernels_run_on, sm_count
from ..common.traceable_log import log_once_traceable

MAX_WIDTH = 16384  # one row at a time, held in registers
BWD_PROGRAMS_PER_SM = 4  # backward programs loop over rows, each keeping its own dw partial sum


def rms_norm_reference(x, weight, eps):
    # x: [..., D], weight: [D] -> [..., D] in the promoted dtype of weight and x, as transformers' LlamaRMSNorm
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


@triton.jit
def _rms_norm_fwd(x_ptr, w_ptr, y_ptr, rstd_ptr, D, stride_x, eps, BLOCK_D: tl.constexpr, STORE_RSTD: tl.constexpr):
    # x: [M, D] (row stride stride_x, unit column stride), w: [D], y: [M, D] contiguous, rstd: [M]; a program per row
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)  # rounded to x's dtype first, as transformers
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row.to(tl.int64) * D + cols, (w * normed).to(y_ptr.dtype.element_ty), mask=mask)
    if STORE_RSTD:
        tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_bwd(x_ptr, w_ptr, rstd_ptr, dy_ptr, dx_ptr, dw_ptr, M, D, stride_x, stride_dy,
                  BLOCK_D: tl.constexpr, HAS_DW: tl.constexpr):
    # x: [M, D] (row stride stride_x), dy: [M, D] (row stride stride_dy), dx: [M, D] contiguous, rstd: [M],
    # dw: [programs, D] fp32 partial sums; program p takes rows p, p + programs, ...
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], tl.float32)
    x_row = x_ptr + pid.to(tl.int64) * stride_x  # 64-bit row offsets, advanced a stride of rows per step
    dy_row = dy_ptr + pid.to(tl.int64) * stride_dy
    dx_row = dx_ptr + pid.to(tl.int64) * D
    for row in tl.range(pid, M, programs):
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_row + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        normed = x * rstd
        dnormed = dy * w  # the rounding of normed to x's dtype passes gradients through unchanged
        # d/dx of x * rsqrt(mean(x^2) + eps): rstd * (dn - n * mean(dn * n))
        dx = rstd * (dnormed - normed * (tl.sum(dnormed * normed, axis=0) / D))
        tl.store(dx_row + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_DW:
            dw += dy * normed.to(x_ptr.dtype.element_ty).to(tl.float32)
        x_row += programs.to(tl.int64) * stride_x
        dy_row += programs.to(tl.int64) * stride_dy
        dx_row += programs.to(tl.int64) * D
    if HAS_DW:
        tl.store(dw_ptr + pid.to(tl.int64) * D + cols, dw, mask=mask)


def _unsupported_reason(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    if not kernels_run_on(x.device):
        return "tensors not on a CUDA device run the PyTorch reference (TRITON_INTERPRET=1 runs the kernel on CPU)"
    if not {x.dtype, weight.dtype} <= {torch.float32, torch.float16, torch.bfloat16}:
        return f"{x.dtype} input or {weight.dtype} weight runs the PyTorch reference"
    if not 0 < x.shape[-1] <= MAX_WIDTH or x.numel() == 0 or weight.shape != x.shape[-1:]:
        return f"width {x.shape[-1]} (weight {tuple(weight.shape)}, {x.numel()} elements) runs the PyTorch reference"
    return None


def _rows(t: torch.Tensor) -> torch.Tensor:
    # [..., D] -> [M, D] with unit column stride (a view when the layout allows)
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def row_warps(block: int) -> int:
    """Warps of a program that holds one row of `block` columns (norms): a few columns per thread."""
    return min(16, max(1, block // 256))


@functools.lru_cache(maxsize=PLANS)
def _forward_plan(M: int, D: int, store_rstd: bool) -> LaunchPlan:
    block = triton.next_power_of_2(D)
    return LaunchPlan((M,), (), dict(BLOCK_D=block, STORE_RSTD=store_rstd, num_warps=row_warps(block)))


def _forward(x2: torch.Tensor, weight: torch.Tensor, eps: float, store_rstd: bool):
    # x2: [M, D] -> y [M, D] (promoted dtype), rstd [M] fp32 (or None)
    M, D = x2.shape
    y = torch.empty(x2.shape, device=x2.device, dtype=torch.promote_types(weight.dtype, x2.dtype))
    rstd = torch.empty(M, device=x2.device, dtype=torch.float32) if store_rstd else None
    launch(_rms_norm_fwd, _forward_plan(M, D, store_rstd), x2, weight, y, rstd if store_rstd else y, D, x2.stride(0),
           eps)
    return y, rstd


@functools.lru_cache(maxsize=PLANS)
def _backward_plan(M: int, D: int, need_dw: bool, device: torch.device) -> LaunchPlan:
    # one program a row, or (need_dw) a few per SM, each summing its rows' share of dw
    programs = min(M, sm_count(device) * BWD_PROGRAMS_PER_SM) if need_dw else M
    block = triton.next_power_of_2(D)
    return LaunchPlan((programs,), (), dict(BLOCK_D=block, HAS_DW=need_dw, num_warps=row_warps(block)))


def _backward(x2, weight, rstd, dy2, need_dw: bool):
    # x2, dy2: [M, D], rstd: [M] -> dx [M, D] in x's dtype, dw [D] in weight's dtype (or None)
    M, D = x2.shape
    plan = _backward_plan(M, D, need_dw, x2.device)
    dx = torch.empty(x2.shape, device=x2.device, dtype=x2.dtype)
    dw_partial = torch.empty(plan.grid[0], D, device=x2.device, dtype=torch.float32) if need_dw else dx
    launch(_rms_norm_bwd, plan, x2, weight, rstd, dy2, dx, dw_partial, M, D, x2.stride(0), dy2.stride(0))
    return dx, dw_partial.sum(0).to(weight.dtype) if need_dw else None


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, eps):
        y, rstd = _forward(x2, weight, eps, store_rstd=True)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: gradients that autograd can differentiate again
            return differentiable_backward(rms_norm_reference, (x2, weight, ctx.eps), dy)
        dx, dw = _backward(x2, weight, rstd, _rows(dy), ctx.needs_input_grad[1])
        return dx, dw, None


# The same launches as custom ops, which torch.compile traces through (the Function above costs less host time per
# call in eager mode, so eager calls keep it). Double backward is not theirs to give: compiled graphs have none.

@torch.library.custom_op("lorafuse::rms_norm", mutates_args=())
def _rms_norm_op(x2: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    # x2: [M, D] -> y [M, D], rstd [M] (for the backward; written also when none follows: one float a row)
    return _forward(_rows(x2), weight.contiguous(), eps, store_rstd=True)


@_rms_norm_op.register_fake
def _rms_norm_fake(x2, weight, eps):
    y = x2.new_empty(x2.shape, dtype=torch.promote_types(weight.dtype, x2.dtype))
    return y, x2.new_empty(x2.shape[0], dtype=torch.float32)


@torch.library.custom_op("lorafuse::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(x2: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor,
                          need_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # x2, dy: [M, D], rstd: [M] -> dx [M, D], dw [D] (empty without need_dw: custom ops return no None)
    dx, dw = _backward(_rows(x2), weight.contiguous(), rstd, _rows(dy), need_dw)
    return dx, dw if need_dw else weight.new_empty(0)


@_rms_norm_backward_op.register_fake
def _rms_norm_backward_fake(x2, weight, rstd, dy, need_dw):
    return x2.new_empty(x2.shape), weight.new_empty(weight.shape[0] if need_dw else 0)


def _rms_norm_setup_context(ctx, inputs, output):
    x2, weight = inputs[:2]
    ctx.save_for_backward(x2, weight, output[1])


def _rms_norm_op_backward(ctx, dy, _drstd):
    need_dw = ctx.needs_input_grad[1]
    dx, dw = _rms_norm_backward_op(*ctx.saved_tensors, dy, need_dw)
    return dx, dw if need_dw else None, None


_rms_norm_op.register_autograd(_rms_norm_op_backward, setup_context=_rms_norm_setup_context)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm_reference's result, differentiable in x and weight: one kernel forward, one backward. Inputs the
    kernels do not take run the reference, the reason logged once. Under torch.compile, the custom op
    lorafuse::rms_norm."""
    # x: [..., D], weight: [D] -> [..., D]
    reason = functorch_reason(x, weight) or _unsupported_reason(x, weight)
    if reason is not None:
        log_once_traceable(f"lorafuse.rms_norm: {reason}")
        return rms_norm_reference(x, weight, eps)
    x2 = _rows(x)
    if torch.compiler.is_compiling():
        y = _rms_norm_op(x2, weight, float(eps))[0]
    elif torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        y = _RMSNorm.apply(x2, weight.contiguous(), float(eps))
    else:
        y = _forward(x2, weight.contiguous(), float(eps), store_rstd=False)[0]
    return y.view(x.shape)
