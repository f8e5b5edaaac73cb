"""Fused add-mul-activation: out = act(base + scale * other + bias), and its backward.

base, other: [..., N] (same shape), bias: [N] broadcast over rows. One pass reads base and
other and writes out, instead of PyTorch's mul, add, add, act (four passes). `out=base`
computes in place; under autograd that is allowed for the identity activation only, since
the other activations' backward needs the pre-activation that an in-place call overwrites.
"""
import torch
import triton
import triton.language as tl

from .activation import activate, activate_grad, activation_id, activation_reference

BLOCK_M = 16
BLOCK_N = 256


def add_mul_act_reference(base, other, scale=1.0, bias=None, activation="identity", out=None):
    z = base + scale * other
    if bias is not None:
        z = z + bias
    y = activation_reference(z, activation).to(base.dtype)
    return y if out is None else out.copy_(y)


@triton.jit
def _add_mul_act_fwd(base_ptr, other_ptr, bias_ptr, out_ptr, M, N, scale,
                     ACT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # base, other, out: [M, N] contiguous; bias: [N]
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    z = tl.load(base_ptr + offs, mask=mask).to(tl.float32) + scale * tl.load(other_ptr + offs, mask=mask).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(bias_ptr + cols, mask=cols < N).to(tl.float32)[None, :]
    tl.store(out_ptr + offs, activate(z, ACT).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_mul_act_bwd(grad_ptr, base_ptr, other_ptr, bias_ptr, dbase_ptr, dother_ptr, dbias_part_ptr, M, N, scale,
                     ACT: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_DBASE: tl.constexpr,
                     STORE_DOTHER: tl.constexpr, STORE_DBIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # grad, base, other: [M, N]; dbias_part: [cdiv(M, BLOCK_M), N] fp32 partial column sums
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    dz = tl.load(grad_ptr + offs, mask=mask).to(tl.float32)
    if ACT != 0:  # the pre-activation is recomputed, never stored
        z = tl.load(base_ptr + offs, mask=mask).to(tl.float32)
        z += scale * tl.load(other_ptr + offs, mask=mask).to(tl.float32)
        if HAS_BIAS:
            z += tl.load(bias_ptr + cols, mask=cols < N).to(tl.float32)[None, :]
        dz = tl.where(mask, dz * activate_grad(z, ACT), 0.0)
    if STORE_DBASE:
        tl.store(dbase_ptr + offs, dz.to(dbase_ptr.dtype.element_ty), mask=mask)
    if STORE_DOTHER:
        tl.store(dother_ptr + offs, (scale * dz).to(dother_ptr.dtype.element_ty), mask=mask)
    if STORE_DBIAS:
        tl.store(dbias_part_ptr + tl.program_id(0) * N + cols, tl.sum(dz, axis=0), mask=cols < N)


def _grid(M, N):
    return (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))


class _AddMulAct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, base, other, bias, scale, act, out):
        # base, other: [M, N] contiguous; bias: [N] or None
        M, N = base.shape
        y = torch.empty_like(base) if out is None else out
        _add_mul_act_fwd[_grid(M, N)](base, other, bias, y, M, N, scale, ACT=act, HAS_BIAS=bias is not None,
                                     BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
        if out is not None:
            ctx.mark_dirty(y)
        ctx.save_for_backward(*((base, other, bias) if act != 0 else ()))
        ctx.scale, ctx.act, ctx.has_bias = scale, act, bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, grad):
        base, other, bias = ctx.saved_tensors if ctx.act != 0 else (None, None, None)
        grad = grad.contiguous()
        M, N = grad.shape
        need_base, need_other, need_bias = ctx.needs_input_grad[:3]
        dbase = torch.empty_like(grad) if need_base else None
        dother = torch.empty_like(grad) if need_other else None
        dbias_part = None
        if need_bias:
            dbias_part = torch.empty(triton.cdiv(M, BLOCK_M), N, device=grad.device, dtype=torch.float32)
        _add_mul_act_bwd[_grid(M, N)](grad, base, other, bias, dbase, dother, dbias_part, M, N, ctx.scale,
                                     ACT=ctx.act, HAS_BIAS=ctx.has_bias, STORE_DBASE=need_base,
                                     STORE_DOTHER=need_other, STORE_DBIAS=need_bias,
                                     BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
        dbias = dbias_part.sum(0).to(ctx.bias_dtype) if need_bias else None
        return dbase, dother, dbias, None, None, None


def add_mul_act(base, other, scale=1.0, bias=None, activation="identity", out=None):
    """act(base + scale * other + bias) in one pass; `out=base` writes in place."""
    # base, other: [..., N]; bias: [N]
    act = activation_id(activation)
    if base.shape != other.shape:
        raise ValueError(f"add_mul_act: base {tuple(base.shape)} and other {tuple(other.shape)} must have one shape")
    needs_grad = base.requires_grad or other.requires_grad or (bias is not None and bias.requires_grad)
    if out is not None and act != 0 and torch.is_grad_enabled() and needs_grad:
        raise ValueError(f"add_mul_act: in place with activation={activation!r} cannot be differentiated "
                         "(the pre-activation is overwritten); pass out=None")
    if out is not None and not (out.is_contiguous() and out.shape == base.shape):
        raise ValueError(f"add_mul_act: out must be contiguous and shaped like base {tuple(base.shape)}")
    if out is base:
        base2 = out.view(-1, base.shape[-1])
    else:  # the kernels index rows * N + cols: every operand contiguous
        base2 = base.contiguous().view(-1, base.shape[-1])
    shape, N = base.shape, base.shape[-1]
    other2 = other.contiguous().view(-1, N)
    out2 = None if out is None else out.view(-1, N)
    bias = bias.contiguous() if bias is not None else None
    y = _AddMulAct.apply(base2, other2, bias, float(scale), act, out2)
    return y.view(shape) if out is None else out
