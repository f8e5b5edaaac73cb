"""LoRA shrink: s = dropout(x) @ A^T, the mask drawn in-kernel and never stored.

Forward: one pass over x; s is kept in fp32 ([M, r] is tiny) for the expand and for dB. The mask multiplies x (as
PEFT's nn.Dropout does: a NaN or inf at a dropped position still reaches the sums, as in the reference).
Backward: dA = ds^T @ dropout(x), redrawing the same mask from the seed; optionally it also
writes dx_lora = keep * (ds @ A) * keep_scale, the adapter's share of dx, in the same pass
(used when the dx GEMM runs on cuBLAS and adds into that buffer).
float32 adapters on bf16 activations run as three bf16 dots on pieces of A and ds (common/bf16_pieces.py).
"""
import functools

import torch
import triton
import triton.language as tl

from ..common.bf16_pieces import dot_pieces, split_bf16, uses_bf16_pieces
from ..common.kernel_launch import launch
from ..common.tiles import (PLANS, LaunchPlan, adapter_math, atomic_partial_sums, cdiv, lora_in_fp32, lora_precision,
                     padded_rank, partial_sums, sm_count, split_in_blocks, store_partial, summed)
from .dropout import PHILOX_ROUNDS, dropout_args, keep_mask_reference, keep_scale, keep_tile


def lora_shrink_reference(x, A, dropout_p=0.0, seed=None):
    # x: [M, K], A: [r, K] -> s: [M, r] fp32
    if dropout_p > 0.0:
        x = x * keep_mask_reference(int(seed), x.shape[0], x.shape[1], dropout_p, x.device) * keep_scale(dropout_p)
    return (x.float() @ A.float().t())


@triton.jit
def _shrink_fwd(x_ptr, a_ptr, s_ptr, seed_ptr, count_ptr, out_ptr, M, K, rank, stride_xm, cols_per_split, splits,
                threshold, drop_scale, HAS_DROPOUT: tl.constexpr, LORA_FP32: tl.constexpr, ON_PIECES: tl.constexpr,
                ATOMIC: tl.constexpr, SERIAL_SUM: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_K: tl.constexpr, ROUNDS: tl.constexpr, PRECISION: tl.constexpr):
    # x: [M, K] (row stride stride_xm), A: [rank, K] contiguous (fp32, split into bf16 pieces when ON_PIECES),
    # s: partial_sums' buffer of [M, rank] fp32 over `splits` column splits of cols_per_split (a multiple of BLOCK_K)
    # LORA_FP32: the product runs in fp32 (float32 adapters), else in x's 16-bit dtype. SERIAL_SUM: the last program
    # of a row block to finish (count: int32 [row blocks], zeroed) adds the splits' parts in their order into out.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(1)
    ranks = tl.arange(0, R)
    acc = tl.zeros([BLOCK_M, R], tl.float32)
    for k0 in range(split * cols_per_split, tl.minimum(K, (split + 1) * cols_per_split), BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :],
                    mask=(rows[:, None] < M) & (cols[None, :] < K), other=0.0)
        if HAS_DROPOUT:
            x = x * keep_tile(seed_ptr, rows, k0, threshold, BLOCK_K, ROUNDS, x.dtype)  # as x * mask
        a_offs = ranks[:, None] * K + cols[None, :]
        a_mask = (ranks[:, None] < rank) & (cols[None, :] < K)
        if ON_PIECES:
            a_hi, a_mid, a_lo = split_bf16(tl.load(a_ptr + a_offs, mask=a_mask, other=0.0))
            acc = dot_pieces(x, tl.trans(a_hi), tl.trans(a_mid), tl.trans(a_lo), acc)
        else:
            a = tl.load(a_ptr + a_offs, mask=a_mask, other=0.0)
            cd = tl.float32 if LORA_FP32 else x.dtype
            acc = tl.dot(x.to(cd), tl.trans(a.to(cd)), acc, input_precision=PRECISION)
    if HAS_DROPOUT:
        acc *= drop_scale
    offsets = rows[:, None] * rank + ranks[None, :]
    mask = (rows[:, None] < M) & (ranks[None, :] < rank)
    store_partial(s_ptr, split, M * rank, offsets, acc, mask, ATOMIC)
    if SERIAL_SUM:  # one order whichever program ends last: the same s run after run, without a reduction's launch
        tl.debug_barrier()  # every thread's part is stored before the count releases it
        if tl.atomic_add(count_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu") == splits - 1:
            total = tl.zeros([BLOCK_M, R], tl.float32)
            for part in range(splits):
                total += tl.load(s_ptr + part * M * rank + offsets, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + offsets, total, mask=mask)


@triton.jit
def _shrink_bwd(x_ptr, ds_ptr, a_ptr, dx_ptr, da_part_ptr, seed_ptr, M, K, rank, stride_xm, rows_per_split,
                threshold, drop_scale, HAS_DROPOUT: tl.constexpr, STORE_DX: tl.constexpr, LORA_FP32: tl.constexpr,
                ON_PIECES: tl.constexpr, ATOMIC: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_K: tl.constexpr, ROUNDS: tl.constexpr, PRECISION: tl.constexpr):
    # x: [M, K], ds: [M, rank] fp32, A: [rank, K] contiguous (fp32, split into bf16 pieces when ON_PIECES), dx: [M, K],
    # da_part: partial_sums' buffer of [rank, K] fp32 over row splits
    cols = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    split = tl.program_id(1)
    ranks = tl.arange(0, R)
    col_ok = cols < K
    if STORE_DX:
        a_offs = ranks[:, None] * K + cols[None, :]
        a_mask = (ranks[:, None] < rank) & col_ok[None, :]
        a = tl.load(a_ptr + a_offs, mask=a_mask, other=0.0)
        if ON_PIECES:
            a, a_mid, _ = split_bf16(a)
    # dA^T = x^T ds, so that the long side (K) is the MMA's M and the rank its N: as ds^T x (M = rank) the kernel ran
    # slower at training sizes.
    acc = tl.zeros([BLOCK_K, R], tl.float32)
    row_end = tl.minimum(M, (split + 1) * rows_per_split)
    for m0 in range(split * rows_per_split, row_end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :],
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        cd = tl.float32 if LORA_FP32 else x.dtype
        ds = tl.load(ds_ptr + rows[:, None] * rank + ranks[None, :], mask=row_ok[:, None] & (ranks[None, :] < rank),
                     other=0.0)
        if HAS_DROPOUT:
            # The mask as 0/1 in x's dtype (products with it are exact): dx needs it in the dot's layout too, and
            # moving a 16-bit tile between layouts is cheaper than moving an i1 one (same outputs).
            keep = keep_tile(seed_ptr, rows, tl.program_id(0) * BLOCK_K, threshold, BLOCK_K, ROUNDS, x.dtype)
            x = x * keep
        if ON_PIECES:
            ds_hi, ds_mid, ds_lo = split_bf16(ds)
            acc = dot_pieces(tl.trans(x), ds_hi, ds_mid, ds_lo, acc)
        else:
            ds = ds.to(cd)
            acc = tl.dot(tl.trans(x.to(cd)), ds, acc, input_precision=PRECISION)
        if STORE_DX:
            if ON_PIECES:  # dx is rounded to bf16: the three largest piece products are ample
                dx = tl.dot(ds_hi, a, tl.dot(ds_hi, a_mid, tl.dot(ds_mid, a)))
            else:
                dx = tl.dot(ds, a.to(cd), input_precision=PRECISION)
            if HAS_DROPOUT:
                dx = (dx * drop_scale).to(dx_ptr.dtype.element_ty) * keep  # one rounding; times 0 or 1 is exact
            tl.store(dx_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], dx.to(dx_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & col_ok[None, :])
    if HAS_DROPOUT:
        acc *= drop_scale
    store_partial(da_part_ptr, split, rank * K, ranks[None, :] * K + cols[:, None], acc,
                  (ranks[None, :] < rank) & col_ok[:, None], ATOMIC)


def _shrink_config(M, math, masked, sms):
    # (BLOCK_M, BLOCK_K, num_warps, num_stages, programs): enough programs in flight to stream x. math: "16-bit",
    # "pieces" (float32 A as bf16 pieces) or "tf32x3". Few row blocks split K to reach `programs`.
    # Chosen by timing configs with bench_lora_layer.py --breakdown at training sizes: with tf32x3 wider
    # tiles stream x faster, with 16-bit adapter math they lose; at 4096 rows and more, 5 stages of 64 x 128 without the
    # dropout mask, two programs per SM with it (its arithmetic wants more warps in flight).
    if M >= 4096 and math == "tf32x3":
        return (128, 128, 8, 3, sms)
    if M >= 4096:
        return (64, 128, 4, 4, 2 * sms) if masked else (64, 128, 4, 5, sms)
    return (32, 128, 4, 4, sms) if M > 16 else (16, 128, 4, 3, sms)


def _math(x_dtype, a_dtype, mode):
    if uses_bf16_pieces(x_dtype, a_dtype, mode):
        return "pieces"
    return "tf32x3" if lora_in_fp32(x_dtype, a_dtype, mode) else "16-bit"


@functools.lru_cache(maxsize=PLANS)
def _forward_plan(M, K, r, x_dtype, a_dtype, dropout_p, device, deterministic, mode, config):
    """lora_shrink's launch but its tensors (a LaunchPlan; scalars: cols_per_split, splits, threshold, drop_scale)."""
    block_m, block_k, warps, stages, programs = config or _shrink_config(
        M, _math(x_dtype, a_dtype, mode), dropout_p > 0.0, sm_count(device))
    # Fewer row blocks than programs (small batches, the mask's two programs per SM) split K: partial sums, added
    # with atomics (two parts: the same float in either order) or, in a fixed order, by each row block's last program
    # (SERIAL_SUM).
    row_blocks = cdiv(M, block_m)
    cols_per_split, splits = split_in_blocks(K, block_k, programs // row_blocks)
    atomic = atomic_partial_sums(splits, deterministic, fixed_order=True)
    threshold, drop_scale = dropout_args(dropout_p)
    return LaunchPlan((row_blocks, splits), (cols_per_split, splits, threshold, drop_scale), dict(
        HAS_DROPOUT=dropout_p > 0.0, LORA_FP32=lora_in_fp32(x_dtype, a_dtype, mode),
        ON_PIECES=uses_bf16_pieces(x_dtype, a_dtype, mode), ATOMIC=atomic, SERIAL_SUM=splits > 1 and not atomic,
        R=padded_rank(r), BLOCK_M=block_m, BLOCK_K=block_k, ROUNDS=PHILOX_ROUNDS,
        PRECISION=lora_precision(x_dtype, a_dtype, mode), num_warps=warps, num_stages=stages))


def lora_shrink(x, A, dropout_p=0.0, seed=None, config=None, mode=None):
    """s = dropout(x) @ A^T in fp32. x: [M, K] with unit column stride, A: [r, K].
    config: a tuple (BLOCK_M, BLOCK_K, num_warps, num_stages, programs) overrides the default (benchmarks); mode: the
    adapter math (tiles.lora_in_fp32's)."""
    M, K = x.shape
    r = A.shape[0]
    plan = _forward_plan(M, K, r, x.dtype, A.dtype, dropout_p, x.device, torch.are_deterministic_algorithms_enabled(),
                         mode or adapter_math(), config)
    (row_blocks, splits), constants = plan.grid, plan.constants
    atomic, serial = constants["ATOMIC"], constants["SERIAL_SUM"]
    s = partial_sums(splits, (M, r), x.device, atomic)
    out = torch.empty(M, r, device=x.device, dtype=torch.float32) if serial else s
    counts = torch.zeros(row_blocks, device=x.device, dtype=torch.int32) if serial else s  # s: an unread placeholder
    launch(_shrink_fwd, plan, x, A.contiguous(), s, seed, counts, out, M, K, r, x.stride(0), *plan.scalars)
    return out if serial else summed(s, splits, atomic)


@functools.lru_cache(maxsize=PLANS)
def _backward_plan(M, K, r, x_dtype, a_dtype, dropout_p, with_dx, device, deterministic, mode, config):
    """lora_shrink_backward's launch but its tensors (a LaunchPlan; scalars: rows_per_split, threshold, drop_scale)."""
    # The fastest of the configs tried, graph-replayed, at x of 8192 x 2048 / 4096 / 8192 / 14336 with float32 and
    # bf16 adapters (bench_lora_layer.py --breakdown times them): dA alone and dx with the mask want 32 x 128 /
    # 16 x 256 blocks, dx without the mask on pieces 64 x 128.
    programs = 4 * sm_count(device)
    if M <= 32:
        default = (16, 64, 4, 3, programs)
    elif not with_dx:
        default = (32, 128, 4, 3, programs)
    elif dropout_p > 0.0:
        default = (16, 256, 4, 3, programs)
    else:
        default = (64 if _math(x_dtype, a_dtype, mode) == "pieces" else 32, 128, 4, 3, programs)
    block_m, block_k, warps, stages, programs = config or default
    k_blocks = cdiv(K, block_k)
    # At most `programs`: one more row split than fits in a wave leaves a second, nearly empty wave.
    rows_per_split, splits = split_in_blocks(M, block_m, min(cdiv(M, 256), max(1, programs // k_blocks)))
    threshold, drop_scale = dropout_args(dropout_p)
    return LaunchPlan((k_blocks, splits), (rows_per_split, threshold, drop_scale), dict(
        HAS_DROPOUT=dropout_p > 0.0, STORE_DX=with_dx, LORA_FP32=lora_in_fp32(x_dtype, a_dtype, mode),
        ON_PIECES=uses_bf16_pieces(x_dtype, a_dtype, mode), ATOMIC=atomic_partial_sums(splits, deterministic),
        R=padded_rank(r), BLOCK_M=block_m, BLOCK_K=block_k, ROUNDS=PHILOX_ROUNDS,
        PRECISION=lora_precision(x_dtype, a_dtype, mode), num_warps=warps, num_stages=stages))


def _backward_plan_of(x, A, dropout_p, with_dx, config, mode):
    # x: [M, K], A: [r, K] -> the plan of this call's settings (mode None: LORAFUSE_ADAPTER_MATH)
    M, K = x.shape
    return _backward_plan(M, K, A.shape[0], x.dtype, A.dtype, dropout_p, with_dx, x.device,
                          torch.are_deterministic_algorithms_enabled(), mode or adapter_math(), config)


def shrink_backward_partials(x, A, dropout_p, with_dx, mode, to_zero):
    """dA's partial-sum buffer for lora_shrink_backward(..., da_part=) of the same arguments (with_dx: dx_out is
    given), made ahead so that a caller zeroes it with other buffers in one launch: joins `to_zero` when the launch
    adds into it (tiles.partial_sums)."""
    # x: [M, K], A: [r, K] -> [r, K] fp32 (or [splits, r, K] for summed)
    plan = _backward_plan_of(x, A, dropout_p, with_dx, None, mode)
    return partial_sums(plan.grid[1], (A.shape[0], x.shape[1]), x.device, plan.constants["ATOMIC"], to_zero)


def lora_shrink_backward(ds, x, A, dropout_p=0.0, seed=None, dx_out=None, config=None, mode=None, da_part=None):
    """dA = ds^T @ dropout(x) -> [r, K] fp32. With dx_out ([M, K]), also writes the adapter's dx.
    config: a tuple (BLOCK_M, BLOCK_K, num_warps, num_stages, programs) overrides the default (benchmarks); mode: the
    adapter math (tiles.lora_in_fp32's); da_part: shrink_backward_partials' buffer, zeroed by the caller where it
    joined to_zero (None: made here)."""
    # ds: [M, r] fp32, x: [M, K], A: [r, K]
    M, K = x.shape
    r = A.shape[0]
    plan = _backward_plan_of(x, A, dropout_p, dx_out is not None, config, mode)
    atomic = plan.constants["ATOMIC"]
    if da_part is None:
        da_part = partial_sums(plan.grid[1], (r, K), x.device, atomic)
    launch(_shrink_bwd, plan, x, ds, A.contiguous(), dx_out, da_part, seed, M, K, r, x.stride(0), *plan.scalars)
    return summed(da_part, plan.grid[1], atomic)
