"""A Triton GEMM with the LoRA term fused into it: C = act(A @ B + scale * (L @ R) + bias).

Used where cuBLAS plus a separate epilogue pass would cost a read and a write of C:
  forward   y  = act(x @ W^T + scale * s @ B_lora^T + bias)      (L = s, R = B_lora^T)
  backward  dx = g @ W + ds @ A_lora                             (L = ds, R = A_lora; no dropout)
With FUSE_SHRINK the rank-r input L = dropout(A_op) @ A_lora^T is itself accumulated in the
K-loop (decode sizes: one launch, x read once); programs of the first column block store it.
A dropout mask on dx's adapter term is not fused here (drawn in this epilogue it spilled registers): that case takes
the cuBLAS route (linear.py).
"""
import torch
import triton
import triton.language as tl

from ..common.bf16_pieces import split_bf16, uses_bf16_pieces
from ..common.tiles import adapter_math, cdiv, dot_precision, lora_in_fp32, lora_precision, padded_rank
from ..common.activation import activate
from .dropout import PHILOX_ROUNDS, keep_tile


@triton.jit
def _lora_matmul(a_ptr, b_ptr, c_ptr, z_ptr, l_ptr, r_ptr, shrink_ptr, bias_ptr, seed_ptr,
                 M, N, K, rank, scale, threshold, drop_scale,
                 stride_am, stride_ak, stride_bk, stride_bn, stride_rr, stride_rn, stride_sr, stride_sk,
                 ACT: tl.constexpr, HAS_BIAS: tl.constexpr, FUSE_SHRINK: tl.constexpr, MASK_INPUT: tl.constexpr,
                 STORE_Z: tl.constexpr, EVEN_K: tl.constexpr, LORA_FP32: tl.constexpr, ON_PIECES: tl.constexpr,
                 R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, ROUNDS: tl.constexpr, PRECISION: tl.constexpr, LORA_PRECISION: tl.constexpr):
    # A: [M, K], B: [K, N] (any strides); C, Z: [M, N] contiguous; L: [M, rank] fp32 contiguous;
    # R: [rank, N] (strides stride_rr, stride_rn); shrink weight: [rank, K] (FUSE_SHRINK)
    # LORA_FP32: the rank-r products run in fp32 (float32 adapters), else in C's dtype
    cd = tl.float32 if LORA_FP32 else c_ptr.dtype.element_ty
    pid_m, pid_n = _tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    ranks = tl.arange(0, R)
    # Tile offsets stay int32 (int64 pointer tensors cost registers the MMA pipeline needs);
    # the program's corner moves the base pointers in int64. Rows/cols past the edge wrap
    # (modulo) instead of being masked in the K-loop; their results are never stored.
    local_m = (rows % M) - pid_m * BLOCK_M
    local_n = (cols % N) - pid_n * BLOCK_N
    a_ptrs = a_ptr + (pid_m * BLOCK_M).to(tl.int64) * stride_am + local_m[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + (pid_n * BLOCK_N).to(tl.int64) * stride_bn + ks[:, None] * stride_bk + local_n[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if FUSE_SHRINK:
        low = tl.zeros([BLOCK_M, R], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=k0 + ks[None, :] < K, other=0.0)
            b = tl.load(b_ptrs, mask=k0 + ks[:, None] < K, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if FUSE_SHRINK:
            if MASK_INPUT:
                a = a * keep_tile(seed_ptr, rows, k0, threshold, BLOCK_K, ROUNDS, a.dtype)  # as x * mask
            w = tl.load(shrink_ptr + ranks[:, None] * stride_sr + (k0 + ks[None, :]) * stride_sk,
                        mask=(ranks[:, None] < rank) & (k0 + ks[None, :] < K), other=0.0)
            low = tl.dot(a.to(cd), tl.trans(w.to(cd)), low, input_precision=LORA_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    # Epilogue: the rank-r term, dropout mask, bias and activation, on the tile in registers.
    if FUSE_SHRINK:
        if MASK_INPUT:
            low *= drop_scale
        if pid_n == 0:
            tl.store(l_ptr + rows[:, None] * rank + ranks[None, :], low,
                     mask=(rows[:, None] < M) & (ranks[None, :] < rank))
    else:
        low = _rank_r_rows(l_ptr, rows, M, rank, R)
    _epilogue(acc, low, rows, cols, c_ptr, z_ptr, r_ptr, bias_ptr, M, N, rank, scale, stride_rr, stride_rn,
              ACT, HAS_BIAS, STORE_Z, LORA_FP32, ON_PIECES, R, LORA_PRECISION)


@triton.jit
def _tile_coords(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Output tile number `tile` as (row block, column block), in grouped order: GROUP_M neighbouring row
    # blocks sweep the column blocks together, so their B tiles are shared through L2.
    blocks_n = tl.cdiv(N, BLOCK_N)
    first_m = tile // (GROUP_M * blocks_n) * GROUP_M
    group_m = min(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    return first_m + (tile % (GROUP_M * blocks_n)) % group_m, (tile % (GROUP_M * blocks_n)) // group_m


@triton.jit
def _rank_r_rows(l_ptr, rows, M, rank, R: tl.constexpr):
    # L[rows] as a [BM, R] fp32 tile (L: [M, rank] contiguous; ranks past `rank` and rows past M read zeros)
    ranks = tl.arange(0, R)
    return tl.load(l_ptr + rows[:, None] * rank + ranks[None, :], mask=(rows[:, None] < M) & (ranks[None, :] < rank),
                   other=0.0)


@triton.jit
def _rank_r_tile(r_ptr, cols, N, rank, stride_rr, stride_rn, R: tl.constexpr):
    # R[:, cols] as a [R, BN] tile (ranks past `rank` read zeros)
    ranks = tl.arange(0, R)
    return tl.load(r_ptr + ranks[:, None] * stride_rr + cols[None, :] * stride_rn,
                   mask=(ranks[:, None] < rank) & (cols[None, :] < N), other=0.0)


@triton.jit
def add_rank_r(acc, low, r, scale, CD: tl.constexpr, ON_PIECES: tl.constexpr, LORA_PRECISION: tl.constexpr):
    # acc: [BM, BN] fp32 tile of A @ B; low: [BM, R] fp32 rank-r input of its rows; r: [R, BN] tile of R.
    # Returns acc + scale * low @ r, as one more K-step of rank r into the same accumulator (no second [BM, BN]
    # tile). CD: the dtype of the rank-r product (fp32 for float32 adapter math, else C's).
    if ON_PIECES:
        # float32 operands as bf16 pieces: bf16 dots like the K-loop's (a tf32x3 dot into this accumulator spills).
        # The three largest piece products carry the term to about 2^-17 of itself: C is rounded to 16 bits (2^-9),
        # and Z, kept for act', needs no more. The other three products would add a visible share of the GEMM's time.
        l0, l1, _ = split_bf16(low * scale)
        r0, r1, _ = split_bf16(r.to(tl.float32))
        acc = tl.dot(l0, r1, tl.dot(l1, r0, tl.dot(l0, r0, acc)))
    else:
        acc = tl.dot((low * scale).to(CD), r.to(CD), acc, input_precision=LORA_PRECISION)
    return acc


@triton.jit
def _epilogue(acc, low, rows, cols, c_ptr, z_ptr, r_ptr, bias_ptr, M, N, rank, scale, stride_rr, stride_rn,
              ACT: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_Z: tl.constexpr, LORA_FP32: tl.constexpr,
              ON_PIECES: tl.constexpr, R: tl.constexpr, LORA_PRECISION: tl.constexpr):
    # acc: [BM, BN] fp32 tile of A @ B at (rows, cols); low: [BM, R] fp32 rank-r input of those rows
    r = _rank_r_tile(r_ptr, cols, N, rank, stride_rr, stride_rn, R)
    acc = add_rank_r(acc, low, r, scale, tl.float32 if LORA_FP32 else c_ptr.dtype.element_ty, ON_PIECES,
                      LORA_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    if STORE_Z:
        tl.store(z_ptr + offs, acc.to(z_ptr.dtype.element_ty), mask=mask)
    tl.store(c_ptr + offs, activate(acc, ACT).to(c_ptr.dtype.element_ty), mask=mask)


def _config(M, N, K, dtype):
    """(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages), fixed per shape class so that
    no autotuning ever runs inside a CUDA-graph capture."""
    if M <= 16:
        return 16, 64, 128, 1, 4, 4
    if M <= 64:
        return 64, 64, 64, 8, 4, 4
    if dtype == torch.float32:
        return 64, 64, 32, 8, 4, 3
    return 128, 256, 64, 8, 8, 4


def lora_matmul(a, b, low, right, scale, bias=None, activation_id=0, seed=None, threshold=0, drop_scale=1.0,
                shrink_weight=None, mask_input=False, store_z=False, config=None, mode=None):
    """C = act(a @ b + scale * (low @ right) + bias); returns (C, Z or None).

    a: [M, K], b: [K, N] (views with any strides: pass W.t() for x @ W^T), right: [r, N] view,
    low: [M, r] fp32 (read; or written when shrink_weight [r, K] fuses the shrink into the K-loop,
    with the dropout mask of (seed, threshold, drop_scale) on a when mask_input).
    config: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) overrides the table (benchmarks); mode: the
    adapter math (tiles.lora_in_fp32's).
    """
    M, K = a.shape
    N = b.shape[1]
    r = right.shape[0]
    mode = mode or adapter_math()
    fp32 = lora_in_fp32(a.dtype, right.dtype, mode)
    on_pieces = uses_bf16_pieces(a.dtype, right.dtype, mode)
    sw = shrink_weight
    c = torch.empty(M, N, device=a.device, dtype=a.dtype)
    # The pre-activation for act'(z) in backward: fp32 when the adapter path is fp32, as in PEFT.
    z = torch.empty(M, N, device=a.device, dtype=torch.float32 if fp32 else a.dtype) if store_z else None
    block_m, block_n, block_k, group_m, warps, stages = config or _config(M, N, K, a.dtype)
    grid = (cdiv(M, block_m) * cdiv(N, block_n),)
    _lora_matmul[grid](
        a, b, c, z, low, right, sw, bias, seed, M, N, K, r, scale, threshold, drop_scale,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), right.stride(0), right.stride(1),
        sw.stride(0) if sw is not None else 0, sw.stride(1) if sw is not None else 0,
        ACT=activation_id, HAS_BIAS=bias is not None, FUSE_SHRINK=sw is not None, MASK_INPUT=mask_input,
        STORE_Z=store_z, EVEN_K=K % block_k == 0, LORA_FP32=fp32, ON_PIECES=on_pieces, R=padded_rank(r),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, ROUNDS=PHILOX_ROUNDS,
        PRECISION=dot_precision(a.dtype), LORA_PRECISION=lora_precision(a.dtype, right.dtype, mode),
        num_warps=warps, num_stages=stages)
    return c, z
