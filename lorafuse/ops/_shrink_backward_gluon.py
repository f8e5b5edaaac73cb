"""lora_shrink_backward's dropout pass on Hopper, in Gluon: dA = drop_scale * ds^T (x * keep) and the adapter's share
of dx, keep * drop_scale * (ds A), in one pass over x. Its reference is lora_shrink_backward's (the autograd of
lora_shrink_reference, and the masked dx term that lora_linear_reference's backward holds).

Covers what the Triton kernel computes in 16-bit products, with the same products and roundings:
- float32 adapters on bf16 x (PEFT's default), as bf16 pieces: dA from the three piece products of ds, smallest first
  into a fresh accumulator joined with one rounded add; dx from the three largest piece products (hi A_hi + hi A_mid
  + mid A_hi), rounded once to x's dtype after drop_scale;
- 16-bit adapter math (adapters in x's dtype, or rounded to it: LORAFUSE_ADAPTER_MATH=fast): ds and A rounded to x's
  dtype, one product each. Here each step's dA product also joins the running sum with one rounded add, where the
  Triton kernel chains them in the tensor cores.
dx comes out bit for bit as the Triton kernel's; dA, summed over other row blocks and splits, within about 2e-7.

Why: the Triton kernel draws the mask in one register layout and needs it in two more (x's, and the dx product's),
and the compiler moves the Philox words and the mask between them through shared memory: at 8192 x 4096 it took
75 us where torch's copy of the same bytes (x read, dx written) takes 48 (H100, benchmarks/probe_pass_floor.py).
Here every elementwise step runs in one layout, 8 neighbouring columns a thread (one Philox call's eight draws):
x is read from its TMA tile in it, masked there and written back for dA's MMA, and the dx product is moved into it
once, in x's dtype, to be masked and stored.
"""
import torch
import triton

from ._bf16_pieces import bf16_pieces, uses_bf16_pieces
from ._gluon import (TensorDescriptor, fence_async_shared, gl, gluon, launch_or_fall_back, mbarrier,
                     ready_barriers, runs_gluon_hopper, tma, tma_aligned, warpgroup_mma, warpgroup_mma_wait)
from ._tiles import padded_rank, partial_sums, split_in_blocks, store_partial, summed
from .dropout import PHILOX_ROUNDS, dropout_args, keep_of_words, philox

BLOCK_M, BLOCK_K, BUFFERS, WARPS = 64, 128, 3, 4


def gluon_shrink_backward_ready(x, A, dropout_p, dx_out, pieces, fp32_math) -> bool:
    """Whether lora_shrink_backward takes the Gluon kernel: Hopper, dropout with the dx term, bf16 or fp16 x, the
    products in 16 bits (float32 adapters as bf16 pieces, or 16-bit adapter math), rank 8-32 in steps of 8, x
    contiguous with K a positive multiple of 8 (TMA's 16-byte rows) and 16-byte aligned, dx_out contiguous in x's
    dtype and shape (the kernel rounds dx to x's dtype), at least one row block."""
    # x: [M, K], A: [r, K], dx_out: [M, K] or None
    sixteen_bits = pieces or (x.dtype in (torch.bfloat16, torch.float16) and not fp32_math)
    if not runs_gluon_hopper(x) or dx_out is None or dropout_p == 0.0 or not sixteen_bits:
        return False
    M, K, r = x.shape[0], x.shape[1], A.shape[0]
    return (0 < r <= 32 and r % 8 == 0 and 0 < K and K % 8 == 0 and x.is_contiguous() and x.data_ptr() % 16 == 0
            and dx_out.is_contiguous() and dx_out.dtype == x.dtype and dx_out.shape == x.shape and M >= BLOCK_M)


if gluon is not None:
    @gluon.jit
    def _keep(seed_ptr, m0, k0, threshold, BM: gl.constexpr, BK: gl.constexpr, words_layout: gl.constexpr,
              layout: gl.constexpr, dtype: gl.constexpr, ROUNDS: gl.constexpr):
        # The [BM, BK] keep mask (0 or 1 in dtype) of rows m0..., columns k0... in `layout` (8 neighbouring columns a
        # thread), as dropout.keep_tile draws it: Philox on (column group, row) in words_layout (a call a thread),
        # four words a call, each deciding two neighbouring columns (dropout.keep_of_words).
        rows = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, words_layout))
        groups = k0 // 8 + gl.arange(0, BK // 8, layout=gl.SliceLayout(0, words_layout))
        seed = gl.load(seed_ptr).to(gl.uint64)
        c0 = gl.zeros([BM, BK // 8], gl.uint32, words_layout) + groups.to(gl.uint32)[None, :]
        c1 = gl.zeros([BM, BK // 8], gl.uint32, words_layout) + rows.to(gl.uint32)[:, None]
        zero = gl.zeros([BM, BK // 8], gl.uint32, words_layout)
        w0, w1, w2, w3 = philox(c0, c1, zero, zero, (seed & 0xFFFFFFFF).to(gl.uint32), (seed >> 32).to(gl.uint32),
                                ROUNDS)
        words = gl.reshape(gl.join(gl.join(w0, w2), gl.join(w1, w3)), [BM, BK // 2])
        low, high = keep_of_words(words, threshold, dtype)
        return gl.convert_layout(gl.reshape(gl.join(low, high), [BM, BK]), layout)

    @gluon.jit
    def _shrink_bwd_dropout(x_desc, a_desc, ds_ptr, dx_ptr, da_part_ptr, seed_ptr, M, K, rank, rows_per_split,
                            threshold, drop_scale, P: gl.constexpr, R: gl.constexpr, BUFFERS: gl.constexpr,
                            ATOMIC: gl.constexpr, ROUNDS: gl.constexpr, num_warps: gl.constexpr):
        # x: [M, K] 16-bit in [BM, BK] boxes; A: [P * rank, K] in x's dtype (P = 3: its bf16 pieces stacked) in
        # [R, BK] boxes; ds: [M, rank] fp32; dx: [M, K] in x's dtype (the adapter's masked term, written); da_part:
        # partial_sums' buffer of [rank, K] fp32 over row splits. Program (i, j): columns i * BK..., rows
        # j * rows_per_split... in steps of BM.
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        dtype: gl.constexpr = x_desc.dtype
        k0 = gl.program_id(0) * BK
        split = gl.program_id(1)
        m_first = split * rows_per_split
        steps = gl.cdiv(gl.minimum(M - m_first, rows_per_split), BM)

        x_ring = gl.allocate_shared_memory(dtype, [BUFFERS, BM, BK], x_desc.layout)
        ready = ready_barriers(BUFFERS)
        for s in gl.static_range(BUFFERS - 1):
            mbarrier.expect(ready.index(s), x_desc.block_type.nbytes, pred=s < steps)
            tma.async_copy_global_to_shared(x_desc, [m_first + s * BM, k0], ready.index(s), x_ring.index(s),
                                            s < steps)
        # A at these columns (its hi and mid pieces): dx's B operands ([R, BK], K = the rank), loaded once. Below rank
        # R a piece's box runs on into the next piece's rows: harmless, as ds's columns past the rank are zeros.
        A_TILES: gl.constexpr = 2 if P == 3 else 1
        a_pieces = gl.allocate_shared_memory(dtype, [A_TILES, R, BK], a_desc.layout)
        a_bar = ready_barriers(1)
        mbarrier.expect(a_bar.index(0), A_TILES * a_desc.block_type.nbytes)
        for p in gl.static_range(A_TILES):
            tma.async_copy_global_to_shared(a_desc, [p * rank, k0], a_bar.index(0), a_pieces.index(p))
        mbarrier.wait(a_bar.index(0), 0)

        # elementwise work: 8 neighbouring columns a thread, a warp's rows 16 groups wide
        x_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BK // 8), BK // 8], [num_warps, 1], [1, 0])
        words_layout: gl.constexpr = gl.BlockedLayout([1, 1], [32 // (BK // 8), BK // 8], [num_warps, 1], [1, 0])
        ds_layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (R // 4), R // 4], [num_warps, 1], [1, 0])
        ds_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, R], dtype)
        ds_pieces = gl.allocate_shared_memory(dtype, [P, BM, R], ds_smem_layout)
        da_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                            instr_shape=[16, R, 16])
        dx_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                            instr_shape=[16, BK, 16])
        da = gl.zeros((BK, R), gl.float32, da_layout)
        ds_cols = gl.arange(0, R, layout=gl.SliceLayout(0, ds_layout))
        x_rows = gl.arange(0, BM, layout=gl.SliceLayout(1, x_layout))
        x_cols = k0 + gl.arange(0, BK, layout=gl.SliceLayout(0, x_layout))
        ds_rows = m_first + gl.arange(0, BM, layout=gl.SliceLayout(1, ds_layout))
        ds_next = gl.load(ds_ptr + ds_rows[:, None] * rank + ds_cols[None, :],
                          mask=(ds_rows[:, None] < M) & (ds_cols[None, :] < rank), other=0.0)
        for i in range(steps):
            m0 = m_first + i * BM
            # the slot of step i - 1, whose MMAs have completed (its masked store was fenced before them)
            nxt = i + BUFFERS - 1
            mbarrier.expect(ready.index(nxt % BUFFERS), x_desc.block_type.nbytes, pred=nxt < steps)
            tma.async_copy_global_to_shared(x_desc, [m_first + nxt * BM, k0], ready.index(nxt % BUFFERS),
                                            x_ring.index(nxt % BUFFERS), nxt < steps)
            # ds's rows in x's dtype (P pieces) in shared memory: dA's B operands and dx's A operands; the next step's
            # rows are loaded now, so that their latency hides behind this step
            rest = ds_next
            ds_rows += BM
            ds_next = gl.load(ds_ptr + ds_rows[:, None] * rank + ds_cols[None, :],
                              mask=(ds_rows[:, None] < gl.minimum(M, m_first + steps * BM)) &
                              (ds_cols[None, :] < rank), other=0.0)
            for p in gl.static_range(P):
                piece = rest.to(dtype)
                ds_pieces.index(p).store(piece)
                rest = rest - piece.to(gl.float32)
            fence_async_shared()
            gl.thread_barrier()
            # dx's product runs while the mask is drawn
            dx = gl.zeros((BM, BK), gl.float32, dx_layout)
            if P == 3:
                dx = warpgroup_mma(ds_pieces.index(1), a_pieces.index(0), dx, is_async=True)
                dx = warpgroup_mma(ds_pieces.index(0), a_pieces.index(1), dx, is_async=True)
            dx = warpgroup_mma(ds_pieces.index(0), a_pieces.index(0), dx, is_async=True)
            keep = _keep(seed_ptr, m0, k0, threshold, BM, BK, words_layout, x_layout, dtype, ROUNDS)
            slot = i % BUFFERS
            mbarrier.wait(ready.index(slot), i // BUFFERS & 1)
            tile = x_ring.index(slot)
            tile.store(tile.load(x_layout) * keep)  # x * mask, as the reference multiplies (NaN and inf stay)
            fence_async_shared()
            gl.thread_barrier()
            # dA^T's rows of these columns: (x * keep)^T @ ds, smallest piece first into a fresh accumulator
            part = gl.zeros((BK, R), gl.float32, da_layout)
            for p in gl.static_range(P):
                part = warpgroup_mma(tile.permute((1, 0)), ds_pieces.index(P - 1 - p), part, is_async=True)
            dx, part = warpgroup_mma_wait(num_outstanding=0, deps=(dx, part))
            da += part
            masked = gl.convert_layout((dx * drop_scale).to(dtype), x_layout) * keep  # one rounding, then exact
            rows = m0 + x_rows
            gl.store(dx_ptr + rows[:, None].to(gl.int64) * K + x_cols[None, :], masked,
                     mask=(rows[:, None] < M) & (x_cols[None, :] < K))
        da_cols = k0 + gl.arange(0, BK, layout=gl.SliceLayout(1, da_layout))
        da_ranks = gl.arange(0, R, layout=gl.SliceLayout(0, da_layout))
        offsets = da_ranks[None, :] * K + da_cols[:, None]
        mask = (da_ranks[None, :] < rank) & (da_cols[:, None] < K)
        store_partial(da_part_ptr, split, rank * K, offsets, drop_scale * da, mask, ATOMIC)


def shrink_backward_gluon(ds, x, A, dropout_p, seed, dx_out, sms):
    """dA of lora_shrink_backward with dropout, writing dx_out's masked term, through _shrink_bwd_dropout
    (gluon_shrink_backward_ready holds); None if the kernel failed to run the first time
    (_gluon.launch_or_fall_back). float32 A on bf16 x runs as its three bf16 pieces, else rounded to x's dtype."""
    # ds: [M, r] fp32, x: [M, K] 16-bit contiguous, A: [r, K], dx_out: [M, K] like x
    M, K = x.shape
    r = A.shape[0]
    on_pieces = uses_bf16_pieces(x.dtype, A.dtype)
    R = padded_rank(r)
    dtype = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    k_blocks = triton.cdiv(K, BLOCK_K)
    # about two programs an SM (each 3 x 16 KB of ring): at most cdiv(M, 256) row splits, as the Triton kernel's
    rows_per_split, splits = split_in_blocks(M, BLOCK_M, min(triton.cdiv(M, 256), max(1, 2 * sms // k_blocks)))
    x_desc = TensorDescriptor.from_tensor(x, [BLOCK_M, BLOCK_K],
                                          gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype))
    da_part, atomic = partial_sums(splits, (r, K), x.device, zeroed=not on_pieces)
    # [P, r, K] in x's dtype: A's bf16 pieces (P = 3), made by the launch that zeroes dA, or A rounded (P = 1)
    a_pieces = tma_aligned(bf16_pieces(A, zero=[da_part] if atomic else []) if on_pieces
                           else A.to(x.dtype).contiguous()[None])
    pieces = a_pieces.shape[0]
    a_desc = TensorDescriptor.from_tensor(a_pieces.reshape(pieces * r, K), [R, BLOCK_K],
                                          gl.NVMMASharedLayout.get_default_for([R, BLOCK_K], dtype))
    threshold, drop_scale = dropout_args(dropout_p)
    if not launch_or_fall_back("_shrink_bwd_dropout", lambda: _shrink_bwd_dropout[(k_blocks, splits)](
            x_desc, a_desc, ds.contiguous(), dx_out, da_part, seed, M, K, r, rows_per_split, threshold, drop_scale,
            P=pieces, R=R, BUFFERS=BUFFERS, ATOMIC=atomic, ROUNDS=PHILOX_ROUNDS, num_warps=WARPS)):
        return None
    return summed(da_part, atomic)
