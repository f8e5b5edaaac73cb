"""The residual step after a decoder layer's o_proj or down_proj, in one kernel: the LoRA expand, the residual add and
the next RMSNorm. h = residual + y + scale * s B^T is written over the residual, and rms_norm(h) * w beside it.

Input is the row of one GEMM over the stacked weights [W; A]: [y | s]. transformers runs the adapter's expand, its
scaling, two adds and the norm's seven kernels here; at decode sizes each moves a few kilobytes, so the launches are
the cost. Without an adapter one program holds a whole row (the norm needs all of it), as rms_norm does. With one,
reading B ([N, r]) from one program costs more than the rest of the kernel, so the row's columns
are spread over programs: each adds its columns and stores its partial sum of squares, and the last program of the
row to finish (an atomic count) normalizes the whole row. With `defer` no program waits for the row: each writes
h * w for its columns and its partial sum, and the kernel after the next GEMM scales by rstd (decode/lora_columns.py).
"""
import torch
import triton
import triton.language as tl

from ..common.dependent_launch import launch_options, wait_for_inputs
from .lora_columns import columns_with_lora, lora_b_rows, projections_reference, rank_tile, row_scales_args
from ..model.rms_norm import MAX_WIDTH, rms_norm_reference, row_warps

LORA_BLOCK = 256  # columns per program with an adapter


def lora_add_rms_norm_reference(proj, lora_B, scale, residual, weight, eps, normed, defer=False, row_scales=None):
    # proj: [M, N + r] ([y | s]); lora_B: [N, r] or None (no adapter: r = 0); residual: [M, N], updated in place to
    # h = residual + y + scale * s B^T; weight: [N]; normed: [M, N] <- rms_norm(h) * weight, or with defer h * weight,
    # and returns (sums of h^2 [M, 1] fp32, N, eps): what the kernel after the next GEMM scales its rows by;
    # row_scales: fp32 [M, r], each row's factors for its s in place of scale (an adapter bank), or None
    n = residual.shape[1]
    y = projections_reference(proj, (n,), (lora_B,), (scale,), row_scales=row_scales)[0]
    residual += y
    if not defer:
        normed.copy_(rms_norm_reference(residual, weight, eps))
        return None
    h = residual.float()
    normed.copy_(h * weight.float())
    return h.pow(2).sum(-1, keepdim=True), n, eps


@triton.jit
def _store_normed(x, cols, mask, res_ptr, w_ptr, out_ptr, row, N, stride_out, sum_squares, eps):
    # out[row, cols] = rms_norm(h) * w; x: h as stored in the residual's dtype (as transformers' next layer reads
    # it), in fp32
    rstd = tl.rsqrt(sum_squares / N + eps)
    normed = (x * rstd).to(res_ptr.dtype.element_ty).to(tl.float32)  # rounded to h's dtype first, as rms_norm
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lora_add_rms_norm(proj_ptr, b_ptr, res_ptr, w_ptr, out_ptr, part_ptr, count_ptr, mult_ptr, N, rank, stride_proj,
                       stride_b, stride_res, stride_out, stride_mult, scale, eps, BLOCK: tl.constexpr,
                       BLOCK_N: tl.constexpr, PARTS: tl.constexpr, DEFER: tl.constexpr, R: tl.constexpr,
                       ROW_SCALES: tl.constexpr, PDL: tl.constexpr):
    # grid: (M, programs per row), BLOCK columns each; PARTS: a power of two >= programs per row, 1 when a program
    # takes the whole row (BLOCK = BLOCK_N). proj: [M, N + rank], B: [N, rank], residual, out: [M, N] (unit column
    # strides); part: fp32 [M, PARTS] and count: int32 [M], zero (both unread when PARTS = 1). DEFER: out <- h * w,
    # part: fp32 [M, programs] <- each program's sum of squares (count unread)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    b = lora_b_rows(b_ptr, cols, stride_b, rank, mask, R)
    wait_for_inputs(PDL)
    h = columns_with_lora(proj_ptr + row * stride_proj, cols, b, rank, N, scale, mult_ptr + row * stride_mult, mask, R,
                          ROW_SCALES)
    h += tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
    h = h.to(res_ptr.dtype.element_ty)
    tl.store(res_ptr + row * stride_res + cols, h, mask=mask)
    x = h.to(tl.float32)
    if DEFER:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, (x * w).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(part_ptr + row * tl.num_programs(1) + tl.program_id(1), tl.sum(x * x, axis=0))
    elif PARTS == 1:  # the whole row is here
        _store_normed(x, cols, mask, res_ptr, w_ptr, out_ptr, row, N, stride_out, tl.sum(x * x, axis=0), eps)
    else:
        programs = tl.num_programs(1)
        tl.store(part_ptr + row * PARTS + tl.program_id(1), tl.sum(x * x, axis=0))
        tl.debug_barrier()  # every thread's stores precede the count's release
        if tl.atomic_add(count_ptr + row, 1, sem="acq_rel") == programs - 1:  # the row's last program: all stored
            tl.atomic_xchg(count_ptr + row, 0)  # zero again for the next call (graph replays reuse the counts)
            # .cg: the other programs' stores from L2, not a stale L1 line
            parts = tl.load(part_ptr + row * PARTS + tl.arange(0, PARTS), mask=tl.arange(0, PARTS) < programs,
                            other=0.0, cache_modifier=".cg")
            all_cols = tl.arange(0, BLOCK_N)
            all_mask = all_cols < N
            whole = tl.load(res_ptr + row * stride_res + all_cols, mask=all_mask, other=0.0, cache_modifier=".cg")
            _store_normed(whole.to(tl.float32), all_cols, all_mask, res_ptr, w_ptr, out_ptr, row, N, stride_out,
                          tl.sum(parts, axis=0), eps)


_counts: dict[torch.device, torch.Tensor] = {}  # per device, the latest
_every_counts: list[torch.Tensor] = []  # all ever made: a captured CUDA graph may still use an older one


def _zeroed_counts(device: torch.device, rows: int) -> torch.Tensor:
    """int32 [>= rows] of zeros that the kernel leaves zeroed: made once per device, again for a larger batch."""
    counts = _counts.get(device)
    if counts is None or counts.numel() < rows:
        counts = _counts[device] = torch.zeros(max(rows, 64), dtype=torch.int32, device=device)
        _every_counts.append(counts)
    return counts


def lora_add_rms_norm(proj, lora_B, scale, residual, weight, eps, normed, defer=False, row_scales=None):
    """lora_add_rms_norm_reference's writes in one launch; with defer, returns (parts [M, programs] fp32, N, eps) for
    the kernel after the next GEMM (rope_cache_write, lora_silu_mul: row_norm)."""
    # shapes: see lora_add_rms_norm_reference
    M, N = residual.shape
    rank = 0 if lora_B is None else lora_B.shape[1]
    if proj.shape != (M, N + rank) or normed.shape != (M, N) or weight.shape != (N,) or not 0 < N <= MAX_WIDTH:
        raise ValueError(f"lora_add_rms_norm: proj {tuple(proj.shape)} must be [M, N + r] for a residual "
                         f"{tuple(residual.shape)} (N <= {MAX_WIDTH}), rank {rank}, weight {tuple(weight.shape)} "
                         f"and normed {tuple(normed.shape)} [M, N]")
    if {proj.stride(1), residual.stride(1), normed.stride(1), weight.stride(0)} != {1} or \
            (lora_B is not None and lora_B.stride(1) != 1):
        raise ValueError("lora_add_rms_norm: every operand needs a unit last stride")
    block = triton.next_power_of_2(N)
    r_tile = rank_tile(rank)
    columns = min(LORA_BLOCK, block) if r_tile or defer else block
    programs = triton.cdiv(N, columns)  # per row
    parts = triton.next_power_of_2(programs)
    if defer:
        split = (torch.empty(M, programs, dtype=torch.float32, device=proj.device), proj)  # count unread
    elif programs > 1:
        split = (torch.empty(M, parts, dtype=torch.float32, device=proj.device), _zeroed_counts(proj.device, M))
    else:
        split = (proj, proj)  # one program per row: any pointers, unread
    mult, stride_mult, per_row = row_scales_args(row_scales, M, rank, proj, "lora_add_rms_norm")
    _lora_add_rms_norm[(M, programs)](
        proj, proj if lora_B is None else lora_B, residual, weight, normed, *split, mult, N, rank,
        proj.stride(0), 0 if lora_B is None else lora_B.stride(0), residual.stride(0), normed.stride(0), stride_mult,
        float(scale), float(eps), BLOCK=columns, BLOCK_N=block, PARTS=parts, DEFER=defer, R=r_tile,
        ROW_SCALES=per_row, num_warps=4 if programs > 1 else row_warps(block), **launch_options(proj.device))
    return (split[0], N, eps) if defer else None
