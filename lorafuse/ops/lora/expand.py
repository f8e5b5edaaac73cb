"""LoRA expand fused into the epilogue: y = act(base + scale * (s @ B^T) + bias), one pass over y.

`base` is the frozen layer's output x W^T (from cuBLAS); without it the kernel writes
scale * s B^T + bias alone, which cuBLAS then accumulates into (addmm with beta=1), so the
adapter costs one write of y instead of a read and a write.
Backward: one pass over dy gives ds = scale * g B, dB = scale * g^T s and dbias = sum(g),
with g = dy * act'(z); g itself is written only when the activation is not the identity
(the dx GEMM then needs it). float32 adapters on bf16 activations without an activation (g == dy, exact in
bf16) run the backward's dots on bf16 pieces of B and s (common/bf16_pieces.py).
"""
import functools

import torch
import triton
import triton.language as tl

from ..common.bf16_pieces import dot_pieces, split_bf16, uses_bf16_pieces
from ..common.kernel_launch import launch
from ..common.tiles import (PLANS, LaunchPlan, adapter_math, atomic_partial_sums, cdiv, lora_in_fp32, lora_precision,
                     padded_rank, partial_sums, sm_count, split_in_blocks, store_partial, summed, zero_all)
from ..common.activation import activate, activate_grad, activation_reference


def lora_expand_reference(base, s, B, scale, bias=None, activation="identity"):
    # base: [M, N] or None, s: [M, r], B: [N, r], bias: [N] -> act(z), z fp32
    z = scale * (s.float() @ B.float().t())
    if base is not None:
        z = z + base.float()
    if bias is not None:
        z = z + bias.float()
    return activation_reference(z, activation)


@triton.jit
def _expand_fwd(y_ptr, base_ptr, s_ptr, b_ptr, bias_ptr, z_ptr, M, N, rank, scale, stride_base, stride_s,
                ACT: tl.constexpr, HAS_BASE: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_Z: tl.constexpr,
                LORA_FP32: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                PRECISION: tl.constexpr):
    # y, z: [M, N] contiguous; base: [M, N], s: [M, rank] (row strides stride_base, stride_s); B: [N, rank]
    # contiguous; bias: [N]
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, R)
    rank_ok = ranks[None, :] < rank
    b = tl.load(b_ptr + cols[:, None] * rank + ranks[None, :], mask=(cols[:, None] < N) & rank_ok, other=0.0)
    s = tl.load(s_ptr + rows[:, None] * stride_s + ranks[None, :], mask=(rows[:, None] < M) & rank_ok, other=0.0)
    cd = tl.float32 if LORA_FP32 else y_ptr.dtype.element_ty
    z = scale * tl.dot(s.to(cd), tl.trans(b.to(cd)), input_precision=PRECISION)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    if HAS_BASE:
        z += tl.load(base_ptr + rows[:, None].to(tl.int64) * stride_base + cols[None, :], mask=mask).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(bias_ptr + cols, mask=cols < N).to(tl.float32)[None, :]
    if STORE_Z:
        tl.store(z_ptr + offs, z.to(z_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + offs, activate(z, ACT).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _expand_bwd(dy_ptr, z_ptr, s_ptr, b_ptr, g_ptr, ds_part_ptr, db_part_ptr, dbias_part_ptr, M, N, rank, scale,
                cols_per_split, ACT: tl.constexpr, STORE_G: tl.constexpr, STORE_DBIAS: tl.constexpr,
                LORA_FP32: tl.constexpr, ON_PIECES: tl.constexpr, ATOMIC_DS: tl.constexpr, ATOMIC_DB: tl.constexpr,
                R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    # dy, z, g: [M, N]; s: [M, rank] fp32; B: [N, rank] contiguous (fp32, split into bf16 pieces when ON_PIECES)
    # ds_part: partial_sums' buffer of [M, rank] over column splits, db_part: [row_blocks, rank, N] (dB transposed),
    # dbias_part: [row_blocks, N] (fp32); ATOMIC_DB: db_part is dB^T itself, [rank, N] zeroed, and the row blocks
    # add into it
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(1)
    ranks = tl.arange(0, R)
    row_ok = rows < M
    offs_rank_ok = ranks[None, :] < rank
    s = tl.load(s_ptr + rows[:, None] * rank + ranks[None, :], mask=row_ok[:, None] & offs_rank_ok, other=0.0)
    cd = tl.float32 if LORA_FP32 else dy_ptr.dtype.element_ty
    # s transposed once ([R, BM]): dB^T = s^T g needs no transpose of g
    if ON_PIECES:
        s_hi, s_mid, s_lo = split_bf16(s)
        s_hi, s_mid, s_lo = tl.trans(s_hi), tl.trans(s_mid), tl.trans(s_lo)
    else:
        s_t = tl.trans(s.to(cd))
    ds = tl.zeros([BLOCK_M, R], tl.float32)
    col_end = tl.minimum(N, (split + 1) * cols_per_split)
    for n0 in range(split * cols_per_split, col_end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < col_end
        mask = row_ok[:, None] & col_ok[None, :]
        offs = rows[:, None].to(tl.int64) * N + cols[None, :]
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0)
        if ACT != 0:
            g32 = dy.to(tl.float32) * activate_grad(tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32), ACT)
            g = g32.to(dy.dtype)
            if STORE_G:
                tl.store(g_ptr + offs, g, mask=mask)
        else:
            g32 = dy.to(tl.float32)
            g = dy
        b_offs = cols[:, None] * rank + ranks[None, :]
        b_mask = col_ok[:, None] & offs_rank_ok
        if ON_PIECES:
            b_hi, b_mid, b_lo = split_bf16(tl.load(b_ptr + b_offs, mask=b_mask, other=0.0))
            ds = dot_pieces(g, b_hi, b_mid, b_lo, ds)
            db_t = tl.dot(s_lo, g, tl.dot(s_mid, g, tl.dot(s_hi, g)))
        else:
            b = tl.load(b_ptr + b_offs, mask=b_mask, other=0.0)
            # An fp32 adapter path sees the unrounded gradient (PEFT's float32 adapters do).
            g_lora = g32.to(cd) if LORA_FP32 else g
            ds = tl.dot(g_lora, b.to(cd), ds, input_precision=PRECISION)
            db_t = tl.dot(s_t, g_lora, input_precision=PRECISION)
        db_mask = (ranks[:, None] < rank) & col_ok[None, :]
        if ATOMIC_DB:
            tl.atomic_add(db_part_ptr + ranks[:, None] * N + cols[None, :], scale * db_t, mask=db_mask, sem="relaxed")
        else:
            db_offs = tl.program_id(0).to(tl.int64) * N * rank + ranks[:, None] * N + cols[None, :]  # may pass 2^31
            tl.store(db_part_ptr + db_offs, scale * db_t, mask=db_mask)
        if STORE_DBIAS:
            tl.store(dbias_part_ptr + tl.program_id(0) * N + cols, tl.sum(g32, axis=0), mask=col_ok)
    store_partial(ds_part_ptr, split, M * rank, rows[:, None] * rank + ranks[None, :], scale * ds,
                  row_ok[:, None] & offs_rank_ok, ATOMIC_DS)


@functools.lru_cache(maxsize=PLANS)
def _forward_plan(M, N, r, dtype, b_dtype, activation_id, has_base, has_bias, store_z, mode):
    """lora_expand's launch but its tensors (a LaunchPlan without scalars)."""
    block_m = 64 if M > 32 else 16
    return LaunchPlan((cdiv(M, block_m), cdiv(N, 128)), (), dict(
        ACT=activation_id, HAS_BASE=has_base, HAS_BIAS=has_bias, STORE_Z=store_z,
        LORA_FP32=lora_in_fp32(dtype, b_dtype, mode), R=padded_rank(r), BLOCK_M=block_m, BLOCK_N=128,
        PRECISION=lora_precision(dtype, b_dtype, mode), num_warps=4))


def lora_expand(base, s, B, scale, bias=None, activation_id=0, out=None, store_z=False, mode=None):
    """y = act(base + scale * s B^T + bias); returns (y, z) with z the pre-activation when store_z.
    mode: the adapter math (tiles.lora_in_fp32's)."""
    # base: [M, N] or None, s: [M, r] fp32 or in the adapters' dtype (both: unit column stride), B: [N, r]
    M, N, r = s.shape[0], B.shape[0], B.shape[1]
    dtype = base.dtype if base is not None else out.dtype if out is not None else B.dtype
    plan = _forward_plan(M, N, r, dtype, B.dtype, activation_id, base is not None, bias is not None, store_z,
                         mode or adapter_math())

    def new(dt=dtype):
        return torch.empty(M, N, device=s.device, dtype=dt)

    # The pre-activation is kept for act'(z) in backward, in fp32 when the adapter path is fp32
    # (as PEFT differentiates it); else it overwrites base (same element, same program) and y
    # gets its own buffer.
    z = None
    if store_z:
        fp32 = plan.constants["LORA_FP32"]
        z = new(torch.float32) if fp32 else base if base is not None and base.is_contiguous() else new()
    in_place = base is not None and z is not base and base.is_contiguous()  # y over base: rows N apart
    y = out if out is not None else base if in_place else new()
    launch(_expand_fwd, plan, y, base, s, B.contiguous(), bias, z, M, N, r, scale,
           N if base is None else base.stride(0), s.stride(0))
    return y, z


def _expand_backward_config(M, N, tf32x3, sms):
    # (BLOCK_M, BLOCK_N, num_warps, num_stages, programs). With tf32x3 adapter math (three tf32 products per tile) the
    # kernel is compute-heavy: more column splits for wide dy and narrow tiles for narrow dy, the fastest of the
    # configs tried at Llama-1B shapes (bench_lora_layer.py --breakdown times them). 16-bit math and bf16 pieces keep
    # the defaults, which were fastest at the four layer shapes of bench_lora_layer.py.
    block_m = 128 if M >= 2048 else 64 if M > 32 else 16
    if tf32x3 and M >= 2048:
        return (32, 128, 4, 3, 4 * sms) if N <= 512 else (block_m, 64, 4, 3, 4 * sms)
    return (block_m, 64, 4, 3, 2 * sms)


@functools.lru_cache(maxsize=PLANS)
def _backward_plan(M, N, r, dtype, b_dtype, activation_id, need_dbias, device, deterministic, mode, config):
    """lora_expand_backward's launch but its tensors (a LaunchPlan; scalars: cols_per_split)."""
    fp32 = lora_in_fp32(dtype, b_dtype, mode)
    on_pieces = activation_id == 0 and uses_bf16_pieces(dtype, b_dtype, mode)
    block_m, block_n, warps, stages, programs = config or _expand_backward_config(M, N, fp32 and not on_pieces,
                                                                                  sm_count(device))
    row_blocks = cdiv(M, block_m)
    cols_per_split, splits = split_in_blocks(N, block_n, min(cdiv(N, 512), cdiv(programs, row_blocks)))
    return LaunchPlan((row_blocks, splits), (cols_per_split,), dict(
        ACT=activation_id, STORE_G=activation_id != 0, STORE_DBIAS=need_dbias, LORA_FP32=fp32, ON_PIECES=on_pieces,
        ATOMIC_DS=atomic_partial_sums(splits, deterministic), ATOMIC_DB=atomic_partial_sums(row_blocks, deterministic),
        R=padded_rank(r), BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=lora_precision(dtype, b_dtype, mode),
        num_warps=warps, num_stages=stages))


def lora_expand_backward(dy, z, s, B, scale, activation_id=0, need_dbias=False, config=None, mode=None, zero_also=()):
    """One pass over dy: returns (g, ds, dB, dbias); g is dy when the activation is the identity.
    config: a tuple (BLOCK_M, BLOCK_N, num_warps, num_stages, programs) overrides the default (benchmarks); mode: the
    adapter math (tiles.lora_in_fp32's); zero_also: a caller's other float32 buffers, zeroed in the same launch as
    this pass's atomic sums."""
    # dy: [M, N] contiguous, z: [M, N] or None, s: [M, r] fp32, B: [N, r]
    M, N, r = dy.shape[0], B.shape[0], B.shape[1]
    plan = _backward_plan(M, N, r, dy.dtype, B.dtype, activation_id, need_dbias, dy.device,
                          torch.are_deterministic_algorithms_enabled(), mode or adapter_math(), config)
    (row_blocks, splits), constants = plan.grid, plan.constants
    atomic_ds, atomic_db = constants["ATOMIC_DS"], constants["ATOMIC_DB"]
    g = torch.empty_like(dy) if constants["STORE_G"] else dy
    to_zero = list(zero_also)
    ds_part = partial_sums(splits, (M, r), dy.device, atomic_ds, to_zero)
    db_part = partial_sums(row_blocks, (r, N), dy.device, atomic_db, to_zero)
    zero_all(to_zero)
    dbias_part = torch.empty(row_blocks, N, device=dy.device, dtype=torch.float32) if need_dbias else None
    launch(_expand_bwd, plan, dy, z, s, B.contiguous(), g, ds_part, db_part, dbias_part, M, N, r, scale, *plan.scalars)
    ds = summed(ds_part, splits, atomic_ds)
    db = summed(db_part, row_blocks, atomic_db).t()
    dbias = dbias_part.sum(0) if need_dbias else None
    return g, ds, db, dbias
