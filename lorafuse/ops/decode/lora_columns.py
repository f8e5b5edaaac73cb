"""The Triton helpers that the decode-step kernels share: columns of a GEMM row over stacked weights [W; A], plus
their adapter's expand, read from the same row's shrink s = x A^T; and the deferred RMSNorm of a GEMM's input.

Deferred norm: lora_add_rms_norm may hand the next GEMM h * w instead of rms_norm(h) * w, with partial sums of h^2
(no program then waits for the whole row). A GEMM is linear in its rows, so the kernel after it scales the row,
the shrink s with it, by rstd = 1 / rms(h), then adds the bias: the same result without a second round trip."""
import torch
import triton
import triton.language as tl


def rank_tile(*ranks: int) -> int:
    """R for lora_b_rows and columns_with_lora: the largest rank rounded up to a power of two, 0 when no projection
    has an adapter (the expand is then compiled out)."""
    return triton.next_power_of_2(max(ranks)) if max(ranks) > 0 else 0


@triton.jit
def lora_b_rows(b_ptr, b_rows, stride_b, rank, mask, R: tl.constexpr):
    # B[b_rows] as one fp32 [columns, R] tile, zero past `rank` and where ~mask; R: rank_tile (0: no adapter, B
    # unread, a placeholder 0.0). Rows of B are contiguous, so the loads coalesce. fp32 whatever B's dtype, so that
    # tiles of adapters in different dtypes may meet in one variable (rope_cache_write's q or k/v branches). The
    # kernels load it before they wait for the kernel before them (common/dependent_launch.py): no kernel of a decode step
    # writes B.
    tile = 0.0
    if R > 0:
        ranks = tl.arange(0, R)
        tile = tl.load(b_ptr + b_rows[:, None] * stride_b + ranks[None, :],
                       mask=mask[:, None] & (ranks < rank)[None, :], other=0.0).to(tl.float32)
    return tile


@triton.jit
def columns_with_lora(row_ptr, cols, b, rank, s_col, scale, mult_ptr, mask, R: tl.constexpr,
                      ROW_SCALES: tl.constexpr):
    # row[cols] + scale * s b^T in fp32, s = row[s_col:s_col + rank]; b: lora_b_rows of these columns (R = 0: no
    # adapter). ROW_SCALES: the row's own scale per s column (mult[:rank]) instead of `scale`; a 0 drops that column
    # (an adapter of the bank that this row does not use).
    x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if R > 0:
        ranks = tl.arange(0, R)
        s = tl.load(row_ptr + s_col + ranks, mask=ranks < rank, other=0.0).to(tl.float32)
        if ROW_SCALES:
            s *= tl.load(mult_ptr + ranks, mask=ranks < rank, other=0.0)
        else:
            s *= scale
        x += tl.sum(b * s[None, :], axis=1)
    return x


def row_scales_args(row_scales, rows: int, ranks: int, placeholder, op: str):
    """Launch arguments (pointer, row stride, ROW_SCALES) of per-row scales fp32 [rows, ranks] (unit column stride),
    or of none (`placeholder` as the unread pointer)."""
    if row_scales is None:
        return placeholder, 0, False
    if row_scales.shape != (rows, ranks) or row_scales.dtype != torch.float32 or row_scales.stride(1) != 1:
        raise ValueError(f"{op}: row_scales {tuple(row_scales.shape)} {row_scales.dtype} must be float32 [rows, "
                         f"ranks] = [{rows}, {ranks}] with unit column stride")
    return row_scales, row_scales.stride(0), True


def deferred_parts(row_norm, placeholder):
    """Launch arguments (parts, programs, PARTS, width, eps) of a deferred norm (parts [M, programs] fp32, width,
    eps) from lora_add_rms_norm, or of none (PARTS 0: `placeholder` as the unread pointer)."""
    if row_norm is None:
        return placeholder, 0, 0, 1, 0.0
    parts, width, eps = row_norm
    return parts, parts.shape[1], triton.next_power_of_2(parts.shape[1]), width, float(eps)


@triton.jit
def row_rstd(parts_ptr, row, programs, width, eps, PARTS: tl.constexpr):
    # 1 / rms of a row of `width` from its partial sums of squares (parts: [M, programs] fp32; PARTS: a power of two
    # >= programs); PARTS = 0: 1 (no deferred norm: the GEMM's input came normalized)
    if PARTS == 0:
        rstd = 1.0
    else:
        offs = tl.arange(0, PARTS)
        parts = tl.load(parts_ptr + row * programs + offs, mask=offs < programs, other=0.0)
        rstd = tl.rsqrt(tl.sum(parts, axis=0) / width + eps)
    return rstd


def projections_reference(row, widths, lora_B, scales, bias=None, row_norm=None, row_scales=None):
    """The projections of a GEMM row over [W_1; ...; W_n; A...] as the decode-step kernels compute them, in the row's
    dtype: y_i + scale_i * s_i B_i^T, times the deferred norm's rstd, plus the bias (the references' common part).
    With row_scales each row's s columns are scaled by its own factors instead (see columns_with_lora)."""
    # row: [M, sum widths + ranks] ([y_1 | ... | y_n | s...], an s per projection with an adapter); lora_B: per
    # projection [width_i, r_i] or None; bias: [>= sum widths] or None; row_norm: (parts [M, P], width, eps) or None;
    # row_scales: fp32 [M, ranks] (the s columns' layout) or None
    wide = torch.promote_types(row.dtype, torch.float32)  # rstd's precision: fp32, or float64 for an exact reference
    rstd = None
    if row_norm is not None:
        parts, norm_width, eps = row_norm
        rstd = torch.rsqrt(parts.to(wide).sum(-1, keepdim=True) / norm_width + eps)
    outputs, start, s_start = [], 0, sum(widths)
    for width, B, scale in zip(widths, lora_B, scales):
        out = row[:, start:start + width]
        if B is not None:
            s = row[:, s_start:s_start + B.shape[1]]
            if row_scales is None:
                out = out + scale * (s @ B.t())
            else:
                first = s_start - sum(widths)
                out = out + (s * row_scales[:, first:first + B.shape[1]].to(s.dtype)) @ B.t()
            s_start += B.shape[1]
        if rstd is not None:
            out = (out.to(wide) * rstd).to(out.dtype)
        if bias is not None:
            out = out + bias[start:start + width]
        outputs.append(out)
        start += width
    return outputs
