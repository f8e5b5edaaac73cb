"""The step of a decode token between the q/k/v GEMM and attention, in one kernel: LoRA expand, Qwen3's per-head
q/k RMSNorm, rotary embedding, and the writes of q to its buffer and of k, v into the static KV cache.

Input is the row of one GEMM over the stacked weights [Wq; Wk; Wv; Aq; Ak; Av]: [q | k | v | s_q | s_k | s_v], the
shrinks s = x A^T of the projections that have an adapter. transformers spends about twenty launches on this (the
rotation alone is ~10 elementwise ops for q and k, then the cache's index_copy); at decode sizes each moves a few
kilobytes, so the launches are the cost. One program per (row, head) holds the head in registers as its two halves,
the pair that rotate_half mixes. With a deferred norm (row_norm, see decode/lora_columns.py) each row is scaled by its
rstd before the bias is added.
"""
import torch
import triton
import triton.language as tl

from ..common.dependent_launch import launch_options, wait_for_inputs
from .lora_columns import (columns_with_lora, deferred_parts, lora_b_rows, projections_reference, rank_tile, row_rstd,
                            row_scales_args)
from ..model.rope import rotated


def rope_cache_write_reference(qkv, lora_B, scales, cos, sin, q_norm, k_norm, eps, slot, q_out, k_cache, v_cache,
                               bias=None, row_norm=None, row_scales=None):
    # qkv: [B, Nq + 2 Nkv + (r_q + r_k + r_v)]: [q | k | v | s_q | s_k | s_v], the s of projections with an adapter;
    # lora_B: (B_q [Nq, r_q], B_k [Nkv, r_k], B_v [Nkv, r_v]), None where a projection has no adapter; scales: 3
    # floats; cos, sin: [B, D]; q_norm, k_norm: [D] or None; slot: int64 [1]; q_out: [B, Hq, 1, D];
    # k_cache, v_cache: [B, Hkv, L, D]; bias: [>= Nq + 2 Nkv] ([b_q | b_k | b_v | ...]) or None; row_norm: (parts
    # [B, P], width, eps) of a deferred norm or None; row_scales: fp32 [B, r_q + r_k + r_v], each row's factors for
    # its s in place of the scales (an adapter bank), or None. Writes q_out and k_cache[:, :, slot], v_cache[:, :,
    # slot].
    batch, n_heads, _, d = q_out.shape
    widths = (n_heads * d, k_cache.shape[1] * d, k_cache.shape[1] * d)
    q, k, v = (out.view(batch, -1, d) for out in projections_reference(qkv, widths, lora_B, scales, bias, row_norm,
                                                                       row_scales))
    if q_norm is not None:
        q, k = rms_norm_of_heads(q, q_norm, eps), rms_norm_of_heads(k, k_norm, eps)
    q, k = rotated(q, cos, sin), rotated(k, cos, sin)
    q_out.copy_(q[:, :, None])
    k_cache.index_copy_(2, slot, k[:, :, None].to(k_cache.dtype))
    v_cache.index_copy_(2, slot, v[:, :, None].to(v_cache.dtype))


def rms_norm_of_heads(x, weight, eps):
    # x: [B, H, D], weight: [D]
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@triton.jit
def _b_halves(b_ptr, stride_b, b_row, rank, offs, mask, HALF_D: tl.constexpr, R: tl.constexpr):
    # the rows of B of one head's two halves (rows b_row... of B), as lora_b_rows tiles
    return (lora_b_rows(b_ptr, b_row + offs, stride_b, rank, mask, R),
            lora_b_rows(b_ptr, b_row + HALF_D + offs, stride_b, rank, mask, R))


@triton.jit
def _head_halves(row_ptr, col, b1, b2, rank, s_col, scale, mult_ptr, rstd, bias_ptr, offs, mask,
                 HALF_D: tl.constexpr, R: tl.constexpr, HAS_BIAS: tl.constexpr, ROW_SCALES: tl.constexpr):
    # the head at columns [col, col + 2 HALF_D) of one GEMM row plus its adapter's expand (b1, b2: _b_halves), times
    # the row's rstd (1 without a deferred norm), plus the bias: its two halves in fp32
    x1 = rstd * columns_with_lora(row_ptr, col + offs, b1, rank, s_col, scale, mult_ptr, mask, R, ROW_SCALES)
    x2 = rstd * columns_with_lora(row_ptr, col + HALF_D + offs, b2, rank, s_col, scale, mult_ptr, mask, R, ROW_SCALES)
    if HAS_BIAS:
        x1 += tl.load(bias_ptr + col + offs, mask=mask, other=0.0).to(tl.float32)
        x2 += tl.load(bias_ptr + col + HALF_D + offs, mask=mask, other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def _normed_and_rotated(x1, x2, norm_ptr, cos1, cos2, sin1, sin2, eps, offs, mask,
                        HALF_D: tl.constexpr, QK_NORM: tl.constexpr):
    # x1, x2: the halves of one head (fp32) -> the halves of rms_norm(x) * w (Qwen3) rotated
    if QK_NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF_D) + eps)
        x1 *= rstd * tl.load(norm_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x2 *= rstd * tl.load(norm_ptr + HALF_D + offs, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2


@triton.jit
def _rope_cache_write(qkv_ptr, bq_ptr, bk_ptr, bv_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, slot_ptr, q_ptr, k_ptr, v_ptr,
                      bias_ptr, parts_ptr, mult_ptr, stride_qkv, stride_bq, stride_bk, stride_bv, stride_cos,
                      stride_sin, stride_qb, stride_qh, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
                      stride_vn, n_heads,
                      n_kv_heads, rank_q, rank_k, rank_v, scale_q, scale_k, scale_v, eps, programs, norm_width,
                      norm_eps, stride_mult, HALF_D: tl.constexpr, BLOCK: tl.constexpr, QK_NORM: tl.constexpr,
                      R: tl.constexpr, HAS_BIAS: tl.constexpr, PARTS: tl.constexpr, ROW_SCALES: tl.constexpr,
                      PDL: tl.constexpr):
    # grid: (B, Hq + Hkv). Programs h < Hq take query head h; the others key/value head h - Hq. bias: [Nq + 2 Nkv]
    # (HAS_BIAS); parts: [B, programs] sums of squares of a deferred norm (PARTS > 0); mult: [B, r_q + r_k + r_v]
    # per-row scales of the s columns (ROW_SCALES)
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF_D
    head_dim = 2 * HALF_D
    hk = h - n_heads
    # the adapters' rows of B for this program's heads, before the wait (see lora_b_rows): q's, or k's and v's
    if h < n_heads:
        b1, b2 = _b_halves(bq_ptr, stride_bq, h * head_dim, rank_q, offs, mask, HALF_D, R)
        b3, b4 = b1, b2  # unread for query heads; Triton needs both branches to define them
    else:
        b1, b2 = _b_halves(bk_ptr, stride_bk, hk * head_dim, rank_k, offs, mask, HALF_D, R)
        b3, b4 = _b_halves(bv_ptr, stride_bv, hk * head_dim, rank_v, offs, mask, HALF_D, R)
    wait_for_inputs(PDL)
    row = qkv_ptr + b.to(tl.int64) * stride_qkv
    cos1 = tl.load(cos_ptr + b * stride_cos + offs, mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + b * stride_cos + HALF_D + offs, mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + b * stride_sin + offs, mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + b * stride_sin + HALF_D + offs, mask=mask, other=0.0).to(tl.float32)
    q_width = n_heads * head_dim
    kv_width = n_kv_heads * head_dim
    s_q = q_width + 2 * kv_width  # the shrinks follow the three projections
    rstd = row_rstd(parts_ptr, b.to(tl.int64), programs, norm_width, norm_eps, PARTS)
    mult = mult_ptr + b.to(tl.int64) * stride_mult
    if h < n_heads:
        x1, x2 = _head_halves(row, h * head_dim, b1, b2, rank_q, s_q, scale_q, mult, rstd, bias_ptr, offs, mask,
                              HALF_D, R, HAS_BIAS, ROW_SCALES)
        x1, x2 = _normed_and_rotated(x1, x2, qn_ptr, cos1, cos2, sin1, sin2, eps, offs, mask, HALF_D, QK_NORM)
        out = q_ptr + b.to(tl.int64) * stride_qb + h * stride_qh
        tl.store(out + offs, x1.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(out + HALF_D + offs, x2.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        slot = tl.load(slot_ptr)
        x1, x2 = _head_halves(row, q_width + hk * head_dim, b1, b2, rank_k, s_q + rank_q, scale_k, mult + rank_q,
                              rstd, bias_ptr, offs, mask, HALF_D, R, HAS_BIAS, ROW_SCALES)
        x1, x2 = _normed_and_rotated(x1, x2, kn_ptr, cos1, cos2, sin1, sin2, eps, offs, mask, HALF_D, QK_NORM)
        out = k_ptr + b.to(tl.int64) * stride_kb + hk * stride_kh + slot * stride_kn
        tl.store(out + offs, x1.to(k_ptr.dtype.element_ty), mask=mask)
        tl.store(out + HALF_D + offs, x2.to(k_ptr.dtype.element_ty), mask=mask)
        x1, x2 = _head_halves(row, q_width + kv_width + hk * head_dim, b3, b4, rank_v, s_q + rank_q + rank_k,
                              scale_v, mult + rank_q + rank_k, rstd, bias_ptr, offs, mask, HALF_D, R, HAS_BIAS,
                              ROW_SCALES)
        out = v_ptr + b.to(tl.int64) * stride_vb + hk * stride_vh + slot * stride_vn
        tl.store(out + offs, x1.to(v_ptr.dtype.element_ty), mask=mask)
        tl.store(out + HALF_D + offs, x2.to(v_ptr.dtype.element_ty), mask=mask)


def _check(qkv, lora_B, cos, sin, q_out, k_cache, v_cache):
    batch, n_heads, _, d = q_out.shape
    n_kv = k_cache.shape[1]
    ranks = sum(0 if B is None else B.shape[1] for B in lora_B)
    if qkv.shape != (batch, (n_heads + 2 * n_kv) * d + ranks) or qkv.stride(1) != 1:
        raise ValueError(f"rope_cache_write: qkv {tuple(qkv.shape)} (unit column stride) must be [B, (Hq + 2 Hkv) "
                         f"* D + ranks] = [{batch}, {(n_heads + 2 * n_kv) * d + ranks}] for q_out "
                         f"{tuple(q_out.shape)}, a cache of {n_kv} heads and adapters of ranks {ranks}")
    if d % 2 or cos.shape != (batch, d) or sin.shape != cos.shape or v_cache.shape != k_cache.shape or \
            k_cache.shape[-1] != d:
        raise ValueError(f"rope_cache_write: head dim {d} must be even and match cos, sin {tuple(cos.shape)}, "
                         f"{tuple(sin.shape)} and the caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    strides = [t.stride(-1) for t in (cos, sin, q_out, k_cache, v_cache)]
    strides += [B.stride(1) for B in lora_B if B is not None]
    if set(strides) != {1}:
        raise ValueError("rope_cache_write: cos, sin, q_out, the caches and lora_B need a unit last stride")


def rope_cache_write(qkv, lora_B, scales, cos, sin, q_norm, k_norm, eps, slot, q_out, k_cache, v_cache, bias=None,
                     row_norm=None, row_scales=None):
    """rope_cache_write_reference's writes in one launch, without host syncs (the slot is read on the device)."""
    # shapes: see rope_cache_write_reference
    _check(qkv, lora_B, cos, sin, q_out, k_cache, v_cache)
    batch, n_heads, _, d = q_out.shape
    n_kv = k_cache.shape[1]
    if bias is not None and (bias.dim() != 1 or bias.shape[0] < (n_heads + 2 * n_kv) * d or bias.stride(0) != 1):
        raise ValueError(f"rope_cache_write: bias {tuple(bias.shape)} must be contiguous [>= (Hq + 2 Hkv) * D] = "
                         f"[>= {(n_heads + 2 * n_kv) * d}]")
    # a projection without an adapter: rank 0 (B unread), any pointer
    bs = [qkv if B is None else B for B in lora_B]
    ranks = [0 if B is None else B.shape[1] for B in lora_B]
    norms = (qkv, qkv) if q_norm is None else (q_norm, k_norm)
    block = triton.next_power_of_2(d // 2)
    parts, programs, parts_tile, norm_width, norm_eps = deferred_parts(row_norm, qkv)
    mult, stride_mult, per_row = row_scales_args(row_scales, batch, sum(ranks), qkv, "rope_cache_write")
    _rope_cache_write[(batch, n_heads + n_kv)](
        qkv, *bs, cos, sin, *norms, slot, q_out, k_cache, v_cache, qkv if bias is None else bias, parts, mult,
        qkv.stride(0),
        *(B.stride(0) for B in bs), cos.stride(0), sin.stride(0), q_out.stride(0), q_out.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], n_heads, n_kv, *ranks, *map(float, scales), float(eps), programs,
        norm_width, norm_eps, stride_mult, HALF_D=d // 2, BLOCK=block, QK_NORM=q_norm is not None,
        R=rank_tile(*ranks), HAS_BIAS=bias is not None, PARTS=parts_tile, ROW_SCALES=per_row, num_warps=1,
        **launch_options(qkv.device))
