"""The SwiGLU product of a decode step with the gate and up adapters' expand, in one kernel:
y = silu(gate + scale_g * s_g B_g^T) * (up + scale_u * s_u B_u^T).

Input is the row of one GEMM over the stacked weights [W_gate; W_up; A_gate; A_up]: [gate | up | s_gate | s_up]
(an s for each projection that has an adapter). silu_mul is the same product without the adapters. With a deferred
norm (row_norm, see decode/lora_columns.py) each row is scaled by its rstd before the bias is added.
"""
import torch
import triton
import triton.language as tl

from ..common.dependent_launch import launch_options, wait_for_inputs
from .lora_columns import (columns_with_lora, deferred_parts, lora_b_rows, projections_reference, rank_tile, row_rstd,
                            row_scales_args)
from ..model.silu_mul import silu_mul_reference

BLOCK = 1024  # columns per program: a decode row of an MLP (a few thousand) spreads over a few programs per row
LORA_BLOCK = 128  # with adapters: a program also holds [columns, rank] tiles of B (128: fastest of 64-512)


def lora_silu_mul_reference(proj, lora_B, scales, out, bias=None, row_norm=None, row_scales=None):
    # proj: [M, 2 I + r_g + r_u] ([gate | up | s_gate | s_up]); lora_B: (B_gate [I, r_g], B_up [I, r_u]), None
    # where a projection has no adapter; scales: 2 floats; bias: [>= 2 I] ([b_gate | b_up | ...]) or None;
    # row_norm: (parts [M, P], width, eps) of a deferred norm or None; row_scales: fp32 [M, r_g + r_u], each row's
    # factors for its s in place of the scales (an adapter bank), or None; out: [M, I] <- silu(gate') * up'
    width = out.shape[1]
    halves = projections_reference(proj, (width, width), lora_B, scales, bias, row_norm, row_scales)
    out.copy_(silu_mul_reference(*halves))


@triton.jit
def _lora_silu_mul(proj_ptr, bg_ptr, bu_ptr, bias_ptr, parts_ptr, out_ptr, mult_ptr, width, rank_g, rank_u,
                   stride_proj, stride_bg, stride_bu, stride_out, stride_mult, scale_g, scale_u, programs, norm_width,
                   eps, BLOCK: tl.constexpr, R: tl.constexpr, HAS_BIAS: tl.constexpr, PARTS: tl.constexpr,
                   ROW_SCALES: tl.constexpr, PDL: tl.constexpr):
    # grid: (M, column blocks); proj: [M, 2 width + rank_g + rank_u], B_g: [width, rank_g], B_u: [width, rank_u];
    # bias: [2 width] (HAS_BIAS); parts: [M, programs] sums of squares of a deferred norm (PARTS > 0)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    b_gate = lora_b_rows(bg_ptr, cols, stride_bg, rank_g, mask, R)
    b_up = lora_b_rows(bu_ptr, cols, stride_bu, rank_u, mask, R)
    wait_for_inputs(PDL)
    proj = proj_ptr + row * stride_proj
    rstd = row_rstd(parts_ptr, row, programs, norm_width, eps, PARTS)
    mult = mult_ptr + row * stride_mult  # the row's scales of [s_g | s_u] (ROW_SCALES)
    gate = rstd * columns_with_lora(proj, cols, b_gate, rank_g, 2 * width, scale_g, mult, mask, R, ROW_SCALES)
    up = rstd * columns_with_lora(proj, width + cols, b_up, rank_u, 2 * width + rank_g, scale_u, mult + rank_g, mask, R,
                                  ROW_SCALES)
    if HAS_BIAS:
        gate += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        up += tl.load(bias_ptr + width + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded as transformers' silu
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def lora_silu_mul(proj: torch.Tensor, lora_B, scales, out: torch.Tensor, bias=None, row_norm=None,
                  row_scales=None) -> None:
    """lora_silu_mul_reference's write in one launch."""
    # shapes: see lora_silu_mul_reference
    M, width = out.shape
    ranks = [0 if B is None else B.shape[1] for B in lora_B]
    if proj.shape != (M, 2 * width + sum(ranks)):
        raise ValueError(f"lora_silu_mul: proj {tuple(proj.shape)} must be [M, 2 I + ranks] = "
                         f"[{M}, {2 * width + sum(ranks)}] for out {tuple(out.shape)} and adapters of ranks {ranks}")
    if {proj.stride(1), out.stride(1)} | {B.stride(1) for B in lora_B if B is not None} != {1}:
        raise ValueError("lora_silu_mul: every operand needs a unit last stride")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] < 2 * width or bias.stride(0) != 1):
        raise ValueError(f"lora_silu_mul: bias {tuple(bias.shape)} must be contiguous [>= 2 I] = [>= {2 * width}]")
    bs = [proj if B is None else B for B in lora_B]  # no adapter: rank 0 (B unread), any pointer
    r_tile = rank_tile(*ranks)
    block = LORA_BLOCK if r_tile else BLOCK
    parts, programs, parts_tile, norm_width, eps = deferred_parts(row_norm, proj)
    mult, stride_mult, per_row = row_scales_args(row_scales, M, sum(ranks), proj, "lora_silu_mul")
    _lora_silu_mul[(M, triton.cdiv(width, block))](
        proj, *bs, proj if bias is None else bias, parts, out, mult, width, *ranks, proj.stride(0),
        *(B.stride(0) for B in bs), out.stride(0), stride_mult, *map(float, scales), programs, norm_width, eps,
        BLOCK=block, R=r_tile, HAS_BIAS=bias is not None, PARTS=parts_tile, ROW_SCALES=per_row, num_warps=4,
        **launch_options(proj.device))
