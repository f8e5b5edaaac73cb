"""lora_expand_backward's pass over dy on Hopper, in Gluon: ds = scale * dy B and dB = scale * dy^T s with the dy
tiles in shared memory, read there by both products. Its reference is the autograd of lora_expand_reference.

Covers the identity activation without dbias (LoRA's usual backward) with float32 adapters on bf16 dy (PEFT's
default), as bf16 pieces: three products for each of ds and dB, in the Triton kernel's order (ds's smallest first
into a fresh accumulator joined with one rounded add, as _bf16_pieces.dot_pieces; dB's per tile, largest first).

Why: with six small products per [128, 64] tile (N = the rank), the pass is bound by its MMAs and by their reads of
the tile, not by dy's bytes: at r = 16 the Triton kernel runs at 2.2-2.8x dy's read floor, bf16 adapters (two
products a tile) 25 % faster, and ranks 32 and 64 slower in step with their products. Here TMA streams dy through a
ring of shared-memory tiles, and each tile is read into registers once per orientation for all three of its
products (rank <= 32; rank 64 runs out of registers that way and keeps A in shared memory). H200, 8192 x 14336,
r = 16, atomics in both: 126 us (Triton) -> 102 us (benchmarks/probe_expand_backward.py). Adapters in dy's dtype
keep the Triton kernel, as fast or faster there.

dB's adds bound the pass next: each program adds its [columns, r] rows of dB with float32 atomics, 8.4 M of them at
8192 x 8192 with 128-row programs, and they took 10 of its 57 us (H200: the same kernel with them masked off, 46.6
against dy.sum()'s 42.9). Programs of 256 rows add half as many; with two programs an SM (their registers) and the
grid sized to one wave of them, 8192 x 4096 / 8192 / 14336 went from 36.2 / 58.2 / 91.5 to 30.2 / 50.1 / 76.9 us at
r = 16 (twenty-sixth session, benchmarks/NOTES_lora_layer.md).
"""
import triton

from ._bf16_pieces import PIECES, bf16_pieces
from ._gluon import (TensorDescriptor, fence_async_shared, gl, gluon, launch_or_fall_back, mbarrier,
                     ready_barriers, runs_gluon_hopper, tma, warpgroup_mma, warpgroup_mma_wait)
from ._tiles import partial_sums, store_partial, summed

BLOCK_M, BLOCK_N, WARPS = 128, 64, 4


def _config(r):
    # (rows a program, A in registers, ring buffers, programs per SM that the grid is sized for: as many column splits
    # as fit that many programs), swept on an H200 at 8192 x 4096, 8192 x 8192 and 8192 x 14336 (256 rows: two
    # programs fit an SM, by registers; rank 64 keeps A in shared memory, by registers too)
    return (2 * BLOCK_M, True, 2, 2) if r <= 32 else (BLOCK_M, False, 4, 2)


def gluon_expand_backward_ready(dy, B, activation_id, need_dbias, pieces) -> bool:
    """Whether lora_expand_backward takes the Gluon kernel: Hopper, no activation or dbias, float32 adapters as bf16
    pieces on bf16 dy, rank 8-64 in steps of 8 and N a multiple of 8 (TMA's 16-byte rows), dy contiguous and 16-byte
    aligned, at least one 128-row block."""
    # dy: [M, N], B: [N, r]
    if not runs_gluon_hopper(dy):
        return False
    M, N, r = dy.shape[0], B.shape[0], B.shape[1]
    return (activation_id == 0 and not need_dbias and pieces and r % 8 == 0 and r <= 64 and N % 8 == 0
            and dy.is_contiguous() and dy.data_ptr() % 16 == 0 and M >= BLOCK_M)


if gluon is not None:
    @gluon.jit
    def _load_chunk(chunk, n0, off_m, dy_desc, b_desc, N, ready, dy_ring, b_ring, P: gl.constexpr, pred):
        # TMA loads of chunk `chunk` of this program's columns (dy[off_m:, n0:] and B's pieces at those rows) into
        # ring slot chunk % buffers
        BN: gl.constexpr = dy_desc.block_type.shape[1]
        index = chunk % dy_ring.type.shape[0]
        bar = ready.index(index)
        col = n0 + chunk * BN
        mbarrier.expect(bar, dy_desc.block_type.nbytes + P * b_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(dy_desc, [off_m, col], bar, dy_ring.index(index), pred)
        # Piece p of B is rows p * N ... of its [P * N, r] view. A last partial chunk's box runs on into the next
        # piece's rows: harmless, as dy's box reads zeros past column N and multiplies them.
        for p in gl.static_range(P):
            tma.async_copy_global_to_shared(b_desc, [p * N + col, 0], bar, b_ring.index(index * P + p), pred)

    @gluon.jit
    def _expand_bwd(dy_desc, b_desc, s_ptr, ds_part_ptr, db_part_ptr, M, N, rank, scale, cols_per_split,
                    P: gl.constexpr, R: gl.constexpr, BUFFERS: gl.constexpr, ATOMIC_DS: gl.constexpr,
                    ATOMIC_DB: gl.constexpr, A_IN_REGISTERS: gl.constexpr, num_warps: gl.constexpr):
        # dy: [M, N] in [BM, BN] boxes; B: [P * N, rank] (its P bf16 pieces stacked) in [BN, R] boxes; s: [M, rank]
        # fp32; ds_part: partial_sums' buffer of [M, rank] over column splits (as _tiles.store_partial writes it),
        # db_part: [row_blocks, N, rank] (fp32, scale applied), or with ATOMIC_DB dB [N, rank] itself, zeroed, which
        # the row blocks add into. Program (i, j): rows i * BM..., columns j * cols_per_split... in chunks of BN.
        BM: gl.constexpr = dy_desc.block_type.shape[0]
        BN: gl.constexpr = dy_desc.block_type.shape[1]
        dtype: gl.constexpr = dy_desc.dtype
        buffers: gl.constexpr = BUFFERS
        off_m = gl.program_id(0) * BM
        split = gl.program_id(1)
        n0 = split * cols_per_split
        chunks = gl.cdiv(gl.minimum(N - n0, cols_per_split), BN)

        dy_ring = gl.allocate_shared_memory(dtype, [buffers] + dy_desc.block_type.shape, dy_desc.layout)
        b_ring = gl.allocate_shared_memory(dtype, [buffers * P] + b_desc.block_type.shape, b_desc.layout)
        ready = ready_barriers(buffers)
        for c in gl.static_range(buffers - 1):
            _load_chunk(c, n0, off_m, dy_desc, b_desc, N, ready, dy_ring, b_ring, P, c < chunks)

        # s's rows of this program as P pieces in shared memory: dB's B operand ([BM, R], rows along K)
        s_layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (R // 4), R // 4], [num_warps, 1], [1, 0])
        rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, s_layout))
        ranks = gl.arange(0, R, layout=gl.SliceLayout(0, s_layout))
        s_mask = (rows[:, None] < M) & (ranks[None, :] < rank)
        s = gl.load(s_ptr + rows[:, None] * rank + ranks[None, :], mask=s_mask, other=0.0)
        s_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, R], dtype)
        s_pieces = gl.allocate_shared_memory(dtype, [P, BM, R], s_smem_layout)
        rest = s
        for p in gl.static_range(P):
            piece = rest.to(dtype)
            s_pieces.index(p).store(piece)
            rest = rest - piece.to(gl.float32)
        fence_async_shared()
        gl.thread_barrier()  # every warp's pieces are in before any MMA reads them

        acc_ds_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                                instr_shape=[16, R, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_ds_layout, k_width=2)
        ds = gl.zeros((BM, R), gl.float32, acc_ds_layout)
        db_rows = gl.arange(0, BN, layout=gl.SliceLayout(1, acc_ds_layout))
        db_ranks = gl.arange(0, R, layout=gl.SliceLayout(0, acc_ds_layout))
        db_base = db_part_ptr if ATOMIC_DB else db_part_ptr + gl.program_id(0).to(gl.int64) * N * rank
        for c in range(chunks):
            # the slot of chunk c - 1, whose MMAs have completed
            _load_chunk(c + buffers - 1, n0, off_m, dy_desc, b_desc, N, ready, dy_ring, b_ring, P,
                        c + buffers - 1 < chunks)
            index = c % buffers
            mbarrier.wait(ready.index(index), c // buffers & 1)
            tile = dy_ring.index(index)
            if A_IN_REGISTERS:  # read once per orientation for all P products (from shared memory: P reads)
                tile_a = tile.load(a_layout)
                tile_t = tile.permute((1, 0)).load(a_layout)
            else:
                tile_a = tile
                tile_t = tile.permute((1, 0))
            # ds += tile @ (B pieces), smallest first into a fresh accumulator, joined with one rounded add
            part = gl.zeros((BM, R), gl.float32, acc_ds_layout)
            for p in gl.static_range(P):
                part = warpgroup_mma(tile_a, b_ring.index(index * P + P - 1 - p), part, is_async=True)
            # dB's rows of these columns: tile^T @ (s pieces)
            db = gl.zeros((BN, R), gl.float32, acc_ds_layout)
            for p in gl.static_range(P):
                db = warpgroup_mma(tile_t, s_pieces.index(p), db, is_async=True)
            part, db = warpgroup_mma_wait(num_outstanding=0, deps=(part, db))
            ds += part
            cols = n0 + c * BN + db_rows
            db_mask = (cols[:, None] < gl.minimum(N, n0 + cols_per_split)) & (db_ranks[None, :] < rank)
            if ATOMIC_DB:
                gl.atomic_add(db_base + cols[:, None] * rank + db_ranks[None, :], scale * db, mask=db_mask,
                              sem="relaxed")
            else:
                gl.store(db_base + cols[:, None] * rank + db_ranks[None, :], scale * db, mask=db_mask)
        ds_rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_ds_layout))
        ds_offsets = ds_rows[:, None] * rank + db_ranks[None, :]
        ds_mask = (ds_rows[:, None] < M) & (db_ranks[None, :] < rank)
        store_partial(ds_part_ptr, split, M * rank, ds_offsets, scale * ds, ds_mask, ATOMIC_DS)


def expand_backward_gluon(dy, s, B, scale, sms, config=None):
    """(ds, dB) of lora_expand_backward through _expand_bwd (gluon_expand_backward_ready holds); None if the kernel
    failed to run the first time (_gluon.launch_or_fall_back). config: (rows a program, A in registers, ring buffers,
    programs per SM), _config's by default (benchmarks sweep it)."""
    # dy: [M, N] bf16 contiguous, s: [M, r] fp32, B: [N, r] fp32
    M, N = dy.shape
    r = B.shape[1]
    block_m, a_in_registers, buffers, grid_per_sm = config or _config(r)
    block_m = min(block_m, BLOCK_M * (M // BLOCK_M))  # a box no taller than dy
    programs = grid_per_sm * sms
    P = PIECES
    R = max(16, triton.next_power_of_2(r))
    dtype = gl.bfloat16
    row_blocks = triton.cdiv(M, block_m)
    splits = max(1, min(triton.cdiv(N, BLOCK_N), programs // row_blocks))  # within the programs: no wave's tail
    cols_per_split = triton.cdiv(triton.cdiv(N, splits), BLOCK_N) * BLOCK_N
    splits = triton.cdiv(N, cols_per_split)
    ds_part, atomic_ds = partial_sums(splits, (M, r), dy.device, zeroed=False)
    db_part, atomic = partial_sums(row_blocks, (N, r), dy.device, zeroed=False)
    # B's pieces, [3, N, r] bf16, from the launch that zeroes what the atomics add into: two fills fewer
    b_pieces = bf16_pieces(B, zero=[part for part, adds in ((ds_part, atomic_ds), (db_part, atomic)) if adds])
    dy_desc = TensorDescriptor.from_tensor(dy, [block_m, BLOCK_N],
                                           gl.NVMMASharedLayout.get_default_for([block_m, BLOCK_N], dtype))
    b_desc = TensorDescriptor.from_tensor(b_pieces.reshape(P * N, r), [BLOCK_N, R],
                                          gl.NVMMASharedLayout.get_default_for([BLOCK_N, R], dtype))
    if not launch_or_fall_back(f"_expand_bwd(block_m={block_m})", lambda: _expand_bwd[(row_blocks, splits)](
            dy_desc, b_desc, s.contiguous(), ds_part, db_part, M, N, r, scale, cols_per_split, P=P, R=R,
            BUFFERS=buffers, ATOMIC_DS=atomic_ds, ATOMIC_DB=atomic, A_IN_REGISTERS=a_in_registers, num_warps=WARPS)):
        return None
    ds = summed(ds_part, atomic_ds)
    db = summed(db_part, atomic)
    return ds, db
