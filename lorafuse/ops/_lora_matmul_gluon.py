"""lora_matmul's Hopper GEMM in Gluon: C = A @ B + L @ R, the rank-r term and the bias as the last K-steps of the
same software-pipelined loop. Its reference is lora_matmul_reference (identity activation); the packing's is
rank_r_operands_reference.

Why Gluon: Triton's own pipeliner keeps a persistent TMA GEMM at cuBLAS's speed only while its tile loop is a plain
K-loop; the rank-r term in the epilogue cost 2-9 %, and as an extra K-step the pipeliner fell back to one stage
(benchmarks/NOTES_lora_layer.md). Gluon (part of Triton) lets the kernel write its own pipeline, and the rank-r step
is one more load of the ring from two more descriptors.

_gemm_rank_r is warp-specialised (gl.warp_specialize, which Triton 3.6 compiles for sm_90 with setmaxnreg): one warp
issues the TMA loads, across tiles, into the ring slots as the MMA warps release them; the MMA warps wait only for
their slot's data, keep one MMA in flight and release the slot of the one before. Against the same pipeline run by
one set of warps (loads issued between the MMAs, each MMA waited for before the next): the same bits, and H200, 8192
rows, r = 16, float32 adapters, with the packing launch, x cuBLAS's GEMM alone: 4096 -> 4096 1.034 -> 1.031,
4096 -> 14336 1.030 -> 1.025, 14336 -> 4096 1.016 -> 1.011, 2048 -> 8192 1.045 -> 1.002 (a one-off probe,
benchmarks/NOTES_lora_layer.md; benchmarks/probe_rank_r_gemm.py's `gluon` column times this kernel).

The rank-r operands are packed by one Triton launch (`rank_r_operands`): L = [scale * low | 1] and R = [right; bias]
in A's dtype. float32 adapters on bf16 activations go as bf16 pieces along K (_bf16_pieces.py): L = [l0 | l1 | l0],
R = [r0; r0; r1], the three largest piece products, as the Triton kernel's epilogue adds them. A bias of another
dtype goes as two pieces. Widths are padded to 8 columns (TMA's 16-byte rows); the descriptors read zeros past them.

The backward's dx GEMM (dx = g W + ds A, no dropout) can also make dA = ds^T x (`dx_and_shrink_grad_gluon`): each
tile runs two more steps, L's box transposed against two boxes of x at the tile's rows and columns, so x's own pass
for dA goes. L then holds all three pieces of ds (L = [l0 | l1 | l0 | l2], R = [r0; r0; r1; 0]). H200, 8192 rows,
r = 16, x cuBLAS's g W alone, with the packing: 1.018-1.087 against 1.024-1.106 for dA's pass and the GEMM
(benchmarks/probe_shrink_grad_gemm.py, results/shrink_grad_gemm.csv).
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._bf16_pieces import bf16_pieces_reference, split_bf16
from ._gluon import (TensorDescriptor, failed, fence_async_shared, fence_proxy_async_global, gl, gluon,
                     launch_or_fall_back, mbarrier, ready_barriers, runs_gluon_hopper, tma, warpgroup_mma,
                     warpgroup_mma_wait)
from ._tiles import MAX_PARTS_BYTES, atomic_partial_sums, lora_in_fp32, padded_rank, store_partial, summed

BLOCK_M, BLOCK_N, BLOCK_K = 128, 256, 64
NUM_BUFFERS, GROUP_M, WARPS = 3, 8, 8  # 3 x 48 KiB of operand ring + 64 KiB for C's store: 208 KiB of shared memory
LOAD_REGISTERS = 40  # _gemm_rank_r's load warp (H200, x cuBLAS, 2048 -> 8192: 1.002; with 24, 1.030)


def rank_r_width(r: int, pieces: bool, bias_columns: int, all_low_pieces: bool = False) -> int:
    """Columns of L (rows of R), padded to 8: TMA needs 16-byte row strides."""
    return triton.cdiv(_low_groups(pieces, all_low_pieces) * _group_width(r, pieces, all_low_pieces) + bias_columns,
                       8) * 8


def _low_groups(pieces: bool, all_low_pieces: bool) -> int:
    # groups of columns in L: low's pieces l0 | l1 | l0 (| l2 with all_low_pieces), or low itself
    return (4 if all_low_pieces else 3) if pieces else 1


def _group_width(r: int, pieces: bool, all_low_pieces: bool) -> int:
    # columns a group of L takes: r, or for all of low's pieces padded_rank(r), so that the GEMM reads the groups of
    # L^T x as slices of rows whose sizes are powers of two
    return padded_rank(r) if pieces and all_low_pieces else r


def gluon_gemm_ready(a, b, right, pieces: bool) -> bool:
    """Whether lora_matmul's TMA route can take the Gluon GEMM: Hopper (warpgroup MMAs: compute capability 9.x),
    A and B in one 16-bit dtype (the caller checked TMA's alignment), and the rank-r product as 16-bit products:
    16-bit adapter math (adapters in A's dtype, or rounded to it: LORAFUSE_ADAPTER_MATH=fast) or bf16 pieces of
    float32 ones."""
    # a: [M, K], b: [K, N], right: [r, N]
    if not runs_gluon_hopper(a):
        return False
    return (a.dtype in (torch.bfloat16, torch.float16) and b.dtype == a.dtype
            and (pieces or not lora_in_fp32(a.dtype, right.dtype)))


def rank_r_operands_reference(low, right, scale, bias, dtype, pieces, all_low_pieces=False):
    """(L [M, W], R [W, N]) in `dtype`, L @ R == scale * low @ right + bias as rank_r_operands packs them (unpadded).
    pieces: float32 low and right as bf16 pieces (the three largest products). all_low_pieces (with pieces): L also
    holds low's third piece, against zeros in R, so that L's columns carry all of scale * low, and each group of
    columns is padded to padded_rank(r) (dx_and_shrink_grad_gluon)."""
    # low: [M, r] fp32, right: [r, N], bias: [N] or None
    low = low.float() * scale
    if pieces:
        (l0, l1, l2), (r0, r1, _) = bf16_pieces_reference(low), bf16_pieces_reference(right)
        left, right = [l0, l1, l0], [r0, r0, r1]
        if all_low_pieces:
            pad = padded_rank(low.shape[1]) - low.shape[1]
            left = [F.pad(piece, (0, pad)) for piece in left + [l2]]
            right = [F.pad(piece, (0, 0, 0, pad)) for piece in right + [torch.zeros_like(r0)]]
    else:
        left, right = [low.to(dtype)], [right.to(dtype)]
    if bias is not None:  # a bias of another dtype as two pieces in `dtype`
        hi = bias.to(dtype)
        bias_parts = [hi] if bias.dtype == dtype else [hi, (bias.float() - hi.float()).to(dtype)]
        left += [torch.ones(low.shape[0], len(bias_parts), device=low.device, dtype=dtype)]
        right += [part[None, :] for part in bias_parts]
    return torch.cat(left, 1), torch.cat(right, 0)


REGISTER_ORDER_BLOCK = tl.constexpr(64)  # columns a relabelling spans: _shrink_beside_gluon.THREAD_COLUMNS


@triton.jit
def register_order_column(c):
    # operand column c (0..63) of _shrink_beside_gluon's masked stream -> the column of x (and of lora_A) it holds:
    # c = 16c' + 8b + 2t + h holds 16t + 4c' + 2b + h (a lane's 16 neighbouring columns of x are its operand registers)
    return (c & 1) | ((c >> 3) & 1) << 1 | ((c >> 4) & 3) << 2 | ((c >> 1) & 3) << 4


def register_order_reference(t: torch.Tensor) -> torch.Tensor:
    """t's columns ([..., K]) in register_order_column's order within blocks of 64, zero-padded to a multiple of 64."""
    # t: [..., K] -> [..., cdiv(K, 64) * 64]
    padded = F.pad(t, (0, -t.shape[-1] % REGISTER_ORDER_BLOCK.value))
    blocks = padded.reshape(*t.shape[:-1], -1, 4, 4, 2, 2)  # column 16t + 4c + 2b + h of each block
    return blocks.movedim(-4, -2).reshape(padded.shape)  # to 16c + 8b + 2t + h


@triton.jit
def _pack_rank_r(low_ptr, right_ptr, bias_ptr, l_ptr, r_ptr, split_ptr, split_out_ptr, zero_ptr, M, N, rank, scale,
                 stride_rr, stride_rn, width, group_width, split_cols, split_out_cols, split_n, zero_n,
                 PIECES: tl.constexpr, BIAS_COLUMNS: tl.constexpr, GROUPS: tl.constexpr, R_K_MAJOR: tl.constexpr,
                 SPLIT: tl.constexpr, REGISTER_ORDER: tl.constexpr, ZERO: tl.constexpr, W: tl.constexpr,
                 BLOCK: tl.constexpr, FLAT: tl.constexpr):
    # low: [M, rank] fp32 contiguous; right: [rank, N] (strides stride_rr, stride_rn); bias: [N]
    # L: [M, width], R: [N, width] when R_K_MAJOR else [width, N]; W: width rounded up to a power of two
    # split: [rows, split_cols] fp32 -> split_out: [SPLIT, rows, split_out_cols] (its bf16 pieces, or with SPLIT == 1
    # its cast; with REGISTER_ORDER its columns in register_order_column's order, zero-padded), split_n of them a
    # piece; zero: [zero_n] int32. Programs in turn: cdiv(M, BLOCK) write rows of L, cdiv(N, BLOCK) columns of R,
    # then FLAT elements each of split's pieces (with SPLIT) and of zeros (with ZERO). Column c of L (row of R) holds
    # group c // group_width (of GROUPS: _low_groups) of rank index c % group_width (zero past rank), then the bias
    # columns, then zeros.
    dtype = l_ptr.dtype.element_ty
    pid = tl.program_id(0)
    row_blocks = tl.cdiv(M, BLOCK)
    right_end = row_blocks + tl.cdiv(N, BLOCK)
    split_end = right_end + (tl.cdiv(split_n, FLAT) if SPLIT > 0 else 0)
    cols = tl.arange(0, W)
    term_cols = GROUPS * group_width
    piece, j = cols // group_width, cols % group_width
    in_term = (cols < term_cols) & (j < rank)
    bias_col = cols - term_cols
    if pid < row_blocks:
        rows = pid * BLOCK + tl.arange(0, BLOCK)
        v = scale * tl.load(low_ptr + rows[:, None].to(tl.int64) * rank + j[None, :],
                            mask=(rows[:, None] < M) & in_term[None, :], other=0.0)
        if PIECES:
            hi, mid, lo = split_bf16(v)
            v = tl.where(piece[None, :] == 1, mid, tl.where(piece[None, :] == 3, lo, hi))  # l0 | l1 | l0 (| l2)
        ones = (bias_col >= 0) & (bias_col < BIAS_COLUMNS)
        v = tl.where(ones[None, :], 1.0, v.to(tl.float32))
        tl.store(l_ptr + rows[:, None].to(tl.int64) * width + cols[None, :], v.to(dtype),
                 mask=(rows[:, None] < M) & (cols[None, :] < width))
    elif pid < right_end:
        ns = (pid - row_blocks) * BLOCK + tl.arange(0, BLOCK)
        n_ok = ns < N
        v = tl.load(right_ptr + j[None, :] * stride_rr + ns[:, None] * stride_rn, mask=n_ok[:, None] & in_term[None, :],
                    other=0.0).to(tl.float32)
        if PIECES:
            hi, mid, _ = split_bf16(v)
            # r0; r0; r1 (; 0)
            v = tl.where(piece[None, :] == 2, mid, tl.where(piece[None, :] == 3, 0.0, hi)).to(tl.float32)
        if BIAS_COLUMNS > 0:
            b = tl.load(bias_ptr + ns, mask=n_ok, other=0.0).to(tl.float32)
            b_hi = b.to(dtype).to(tl.float32)
            v = tl.where(bias_col[None, :] == 0, b_hi[:, None], v)
            if BIAS_COLUMNS == 2:
                v = tl.where(bias_col[None, :] == 1, (b - b_hi).to(dtype).to(tl.float32)[:, None], v)
        # v: [BLOCK, W] as R^T's rows
        mask = n_ok[:, None] & (cols[None, :] < width)
        if R_K_MAJOR:
            tl.store(r_ptr + ns[:, None].to(tl.int64) * width + cols[None, :], v.to(dtype), mask=mask)
        else:
            tl.store(r_ptr + cols[None, :].to(tl.int64) * N + ns[:, None], v.to(dtype), mask=mask)
    elif pid < split_end:
        offs = (pid - right_end) * FLAT + tl.arange(0, FLAT)
        ok = offs < split_n
        source = offs
        if REGISTER_ORDER:
            col = offs % split_out_cols
            col = col // REGISTER_ORDER_BLOCK * REGISTER_ORDER_BLOCK + register_order_column(col % REGISTER_ORDER_BLOCK)
            source = offs // split_out_cols * split_cols + col
            ok = ok & (col < split_cols)
        t = tl.load(split_ptr + source, mask=ok, other=0.0)
        if SPLIT == 3:
            hi, mid, lo = split_bf16(t)
            stored = offs < split_n  # the padding's zeros too
            tl.store(split_out_ptr + offs, hi, mask=stored)
            tl.store(split_out_ptr + split_n + offs, mid, mask=stored)
            tl.store(split_out_ptr + 2 * split_n + offs, lo, mask=stored)
        else:
            tl.store(split_out_ptr + offs, t.to(split_out_ptr.dtype.element_ty), mask=offs < split_n)
    elif ZERO:
        offs = (pid - split_end) * FLAT + tl.arange(0, FLAT)
        tl.store(zero_ptr + offs, tl.zeros([FLAT], tl.int32), mask=offs < zero_n)


def rank_r_operands(low, right, scale, bias, dtype, pieces, r_k_major, split=None, zeroed=None, all_low_pieces=False,
                    split_register_order=False, left=None):
    """(L [M, width], R [N, width] if r_k_major else [width, N], split's pieces or None) in `dtype`:
    rank_r_operands_reference zero-padded to rank_r_width columns. The same launch also writes the bf16 pieces of a
    float32 `split` ([3, *split.shape], or with `pieces` False split cast to dtype: [1, *split.shape]) and zeroes the
    int32 tensor `zeroed`: the operands that _shrink_matmul_gluon's GEMM reads, without a launch each.
    split_register_order: split's columns as register_order_reference orders them (the masked shrink's lora_A),
    padded to a multiple of 64. all_low_pieces: as rank_r_operands_reference's (the dx GEMM that also makes dA).
    left: a contiguous buffer for L (the first rows of a longer L, for instance), or None for a new one."""
    # low: [M, r] fp32, right: [r, N] (any strides), bias: [N] or None, zeroed: int32; split: [..., K] fp32 (with
    # pieces False: any float dtype)
    M, r, N = low.shape[0], right.shape[0], right.shape[1]
    bias_columns = 0 if bias is None else 1 if bias.dtype == dtype else 2
    width = rank_r_width(r, pieces, bias_columns, all_low_pieces)
    if left is None:
        left = torch.empty(M, width, device=low.device, dtype=dtype)
    assert left.shape == (M, width) and left.dtype == dtype and left.is_contiguous()
    r_out = torch.empty((N, width) if r_k_major else (width, N), device=low.device, dtype=dtype)
    split_parts = 0 if split is None else 3 if pieces else 1
    split = low if split is None else split.contiguous()  # a float32 tensor that no program reads without `split`
    out_cols = split.shape[-1] + (-split.shape[-1] % REGISTER_ORDER_BLOCK.value if split_register_order else 0)
    split_out = torch.empty(split_parts, *split.shape[:-1], out_cols, device=low.device, dtype=dtype)
    split_n = split_out[0].numel() if split_parts else 0
    zero_n = 0 if zeroed is None else zeroed.numel()
    block, flat = 64, 1024
    programs = triton.cdiv(M, block) + triton.cdiv(N, block) + triton.cdiv(split_n, flat) + triton.cdiv(zero_n, flat)
    _pack_rank_r[(programs,)](
        low.contiguous(), right, bias, left, r_out, split, split_out, zeroed, M, N, r, scale, right.stride(0),
        right.stride(1), width, _group_width(r, pieces, all_low_pieces), split.shape[-1], out_cols, split_n, zero_n,
        PIECES=pieces, BIAS_COLUMNS=bias_columns, GROUPS=_low_groups(pieces, all_low_pieces), R_K_MAJOR=r_k_major,
        SPLIT=split_parts, REGISTER_ORDER=split_register_order, ZERO=zeroed is not None,
        W=triton.next_power_of_2(width), BLOCK=block, FLAT=flat)
    return left, r_out, split_out if split_parts else None


if gluon is not None:
    @gluon.jit
    def _gemm_buffers(a_desc, b_desc, c_desc, NUM_BUFFERS: gl.constexpr):
        # (A's ring, B's ring, C's staging tile, the rings' barriers) in shared memory, as the descriptors' boxes
        dtype: gl.constexpr = a_desc.dtype
        a_ring = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + a_desc.block_type.shape, a_desc.layout)
        b_ring = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + b_desc.block_type.shape, b_desc.layout)
        c_smem = gl.allocate_shared_memory(dtype, c_desc.block_type.shape, c_desc.layout)
        return a_ring, b_ring, c_smem, ready_barriers(NUM_BUFFERS)

    @gluon.jit
    def _tile_coords(tile, blocks_m, blocks_n, GROUP: gl.constexpr):
        # output tile -> (row block, column block), GROUP row blocks sweeping the columns together (B shared in L2)
        per_group = GROUP * blocks_n
        first_m = tile // per_group * GROUP
        group_m = gl.maximum(gl.minimum(blocks_m - first_m, GROUP), 1)  # >= 1 past the last tile (a predicated load)
        return first_m + (tile % per_group) % group_m, (tile % per_group) // group_m

    @gluon.jit
    def _tile_grid(M, N, K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
        # a persistent GEMM's (row blocks, column blocks, K-steps, this program's first tile, programs)
        return gl.cdiv(M, BLOCK_M), gl.cdiv(N, BLOCK_N), gl.cdiv(K, BLOCK_K), gl.program_id(0), gl.num_programs(0)

    @gluon.jit
    def _store_c(c, c_smem, c_desc, off_m, off_n):
        # A tile's C (in C's dtype) through c_smem, stored by TMA while the next tile's MMAs run, once the tile
        # before's store has left c_smem
        tma.store_wait(pendings=0)
        c_smem.store(c)
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)

    @gluon.jit
    def _load_step(loads, step, k_steps, off_m, off_n, a_desc, b_desc, l_desc, r_desc, ready, a_ring, b_ring,
                   B_K_MAJOR: gl.constexpr, pred):
        # TMA loads of K-step `step` of the tile at (off_m, off_n) into ring slot loads % buffers; the steps past
        # k_steps read L and R. Returns the loads issued so far.
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        index = loads % a_ring.type.shape[0]
        bar = ready.index(index)
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
        if step < k_steps:
            k = step * BLOCK_K
            tma.async_copy_global_to_shared(a_desc, [off_m, k], bar, a_ring.index(index), pred)
            if B_K_MAJOR:
                tma.async_copy_global_to_shared(b_desc, [off_n, k], bar, b_ring.index(index), pred)
            else:
                tma.async_copy_global_to_shared(b_desc, [k, off_n], bar, b_ring.index(index), pred)
        else:
            k = (step - k_steps) * BLOCK_K
            tma.async_copy_global_to_shared(l_desc, [off_m, k], bar, a_ring.index(index), pred)
            if B_K_MAJOR:
                tma.async_copy_global_to_shared(r_desc, [off_n, k], bar, b_ring.index(index), pred)
            else:
                tma.async_copy_global_to_shared(r_desc, [k, off_n], bar, b_ring.index(index), pred)
        return loads + 1

    @gluon.jit
    def _mma_step(mmas, acc, use_acc, ready, a_ring, b_ring, B_K_MAJOR: gl.constexpr):
        # Waits for slot mmas % buffers and for the MMA before (its slot may be refilled after this), then issues
        # this step's MMA asynchronously. Returns (MMAs issued so far, the pending accumulator).
        buffers: gl.constexpr = a_ring.type.shape[0]
        index = mmas % buffers
        mbarrier.wait(ready.index(index), mmas // buffers & 1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        b = b_ring.index(index)
        if B_K_MAJOR:
            b = b.permute((1, 0))
        return mmas + 1, warpgroup_mma(a_ring.index(index), b, acc, use_acc=use_acc, is_async=True)

    @gluon.jit
    def _load_grad_step(loads, half, off_m, off_n, l_desc, x_desc, ready, a_ring, b_ring):
        # The loads of a shrink-gradient step (_gemm_dx_and_shrink_grad's) into ring slot loads % buffers: L's first
        # box of the tile's rows (A's slot) and the `half`-th [BK, BN] box of x at the tile's rows and columns (B's).
        index = loads % a_ring.type.shape[0]
        bar = ready.index(index)
        mbarrier.expect(bar, l_desc.block_type.nbytes + x_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(l_desc, [off_m, 0], bar, a_ring.index(index))
        tma.async_copy_global_to_shared(x_desc, [off_m + half * x_desc.block_type.shape[0], off_n], bar,
                                        b_ring.index(index))
        return loads + 1

    @gluon.jit
    def _grad_mma_step(mmas, acc, grad, HALF: gl.constexpr, ready, a_ring, b_ring):
        # As _mma_step, for grad (+)= L[rows of this half, :BK]^T @ x[rows of this half, columns]: A is L's box
        # transposed in shared memory, [BK (L's columns), BK (rows)]; B is x's box, [BK (rows), BN].
        buffers: gl.constexpr = a_ring.type.shape[0]
        rows: gl.constexpr = b_ring.type.shape[1]
        index = mmas % buffers
        mbarrier.wait(ready.index(index), mmas // buffers & 1)
        acc, grad = warpgroup_mma_wait(num_outstanding=0, deps=(acc, grad))
        low_t = a_ring.index(index).slice(HALF * rows, rows, dim=0).permute((1, 0))
        return mmas + 1, acc, warpgroup_mma(low_t, b_ring.index(index), grad, use_acc=HALF > 0, is_async=True)

    @gluon.jit
    def _store_shrink_grad(grad, c_smem, grad_ptr, part, off_n, N, rank, GROUP_ROWS: gl.constexpr,
                           LOW_PIECES: gl.constexpr, ATOMIC: gl.constexpr, num_warps: gl.constexpr):
        # grad: [BK, BN] fp32, L[:, :BK]^T x for one tile: with LOW_PIECES row g * GROUP_ROWS + j holds group g
        # (l0, l1, l0, l2) of rank index j, else row j rank index j. Its rank rows (l0 + l1 + l2) are added into
        # grad_ptr ([rank, N], ATOMIC) or stored as partial sum number `part` ([parts, rank, N]). H200, 8192 x
        # 4096 -> 4096, x cuBLAS: the pieces summed through C's staging tile first, 1.080, against an atomic a piece
        # from the MMA's registers, 1.107; one group from the registers, 1.056-1.073, against 1.070-1.071 through
        # shared memory.
        BLOCK_N: gl.constexpr = grad.type.shape[1]
        if ATOMIC and not LOW_PIECES:
            mma_layout: gl.constexpr = grad.type.layout
            rows = gl.arange(0, grad.type.shape[0], layout=gl.SliceLayout(1, mma_layout))
            cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
            gl.atomic_add(grad_ptr + rows[:, None] * N + cols[None, :], grad,
                          mask=(rows < rank)[:, None] & (cols < N)[None, :], sem="relaxed")
        else:
            scratch = c_smem._reinterpret(gl.float32, grad.type.shape,
                                          gl.NVMMASharedLayout.get_default_for(grad.type.shape, gl.float32))
            tma.store_wait(pendings=0)  # the tile before's C has left it (long since: steps ago)
            scratch.store(grad)
            gl.thread_barrier()
            layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [num_warps, 1], [1, 0])
            cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
            for chunk in gl.static_range(0, GROUP_ROWS, 16):  # 16 rows at a time: 64 at once spilled (rank 64)
                total = scratch.slice(chunk, 16, dim=0).load(layout)
                if LOW_PIECES:  # group 2 repeats l0 (against R's r1)
                    total += scratch.slice(GROUP_ROWS + chunk, 16, dim=0).load(layout)
                    total += scratch.slice(3 * GROUP_ROWS + chunk, 16, dim=0).load(layout)
                rows = chunk + gl.arange(0, 16, layout=gl.SliceLayout(1, layout))
                store_partial(grad_ptr, part, rank * N, rows[:, None] * N + cols[None, :], total,
                              (rows < rank)[:, None] & (cols < N)[None, :], ATOMIC)
            gl.thread_barrier()  # read by every warp before the tile's C store may reuse it

    @gluon.jit
    def _k_steps(first, last, loads, mmas, acc, k_steps, off_m, off_n, a_desc, b_desc, l_desc, r_desc, ready, a_ring,
                 b_ring, B_K_MAJOR: gl.constexpr):
        # K-steps first .. last - 1 of a tile (its rank-r steps included): each loads its step into the ring and
        # issues the next MMA in order, NUM_BUFFERS - 1 steps behind the loads.
        for s in range(first, last):
            loads = _load_step(loads, s, k_steps, off_m, off_n, a_desc, b_desc, l_desc, r_desc, ready, a_ring, b_ring,
                               B_K_MAJOR, True)
            mmas, acc = _mma_step(mmas, acc, True, ready, a_ring, b_ring, B_K_MAJOR)
        return loads, mmas, acc

    @gluon.jit
    def _shrink_grad_steps(grad_at, loads, mmas, acc, k_steps, off_m, off_n, part, a_desc, b_desc, l_desc, r_desc,
                           x_desc, c_smem, grad_ptr, N, rank, ready, a_ring, b_ring, GROUP_ROWS: gl.constexpr,
                           LOW_PIECES: gl.constexpr, ATOMIC: gl.constexpr, num_warps: gl.constexpr):
        # L^T x's two steps between K-steps grad_at - 1 and grad_at of the tile at (off_m, off_n), beside the loads of
        # K-steps grad_at and grad_at + 1 (loads run two steps ahead of the MMAs); then _store_shrink_grad, while
        # K-step grad_at's MMA runs. B is not K-major.
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = c_smem.type.shape[1]
        grad_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, num_warps // 4], instr_shape=[16, BLOCK_N // (num_warps // 4), 16])
        grad = gl.zeros((BLOCK_K, BLOCK_N), gl.float32, grad_layout)  # one warpgroup's 64 rows cover L's box
        loads = _load_grad_step(loads, 0, off_m, off_n, l_desc, x_desc, ready, a_ring, b_ring)
        mmas, acc = _mma_step(mmas, acc, True, ready, a_ring, b_ring, False)
        loads = _load_grad_step(loads, 1, off_m, off_n, l_desc, x_desc, ready, a_ring, b_ring)
        mmas, acc, grad = _grad_mma_step(mmas, acc, grad, 0, ready, a_ring, b_ring)
        loads = _load_step(loads, grad_at, k_steps, off_m, off_n, a_desc, b_desc, l_desc, r_desc, ready, a_ring,
                           b_ring, False, True)
        mmas, acc, grad = _grad_mma_step(mmas, acc, grad, 1, ready, a_ring, b_ring)
        loads = _load_step(loads, grad_at + 1, k_steps, off_m, off_n, a_desc, b_desc, l_desc, r_desc, ready, a_ring,
                           b_ring, False, True)
        mmas, acc = _mma_step(mmas, acc, True, ready, a_ring, b_ring, False)
        grad = warpgroup_mma_wait(num_outstanding=1, deps=(grad,))  # K-step grad_at's MMA still runs
        _store_shrink_grad(grad, c_smem, grad_ptr, part, off_n, N, rank, GROUP_ROWS, LOW_PIECES, ATOMIC, num_warps)
        return loads, mmas, acc

    @gluon.jit
    def _gemm_dx_and_shrink_grad(a_desc, b_desc, l_desc, r_desc, c_desc, x_desc, grad_ptr, M, N, K, rank,
                                 GROUP_ROWS: gl.constexpr, LOW_PIECES: gl.constexpr, ATOMIC: gl.constexpr,
                                 NUM_BUFFERS: gl.constexpr, GROUP_M: gl.constexpr, num_warps: gl.constexpr):
        # A: [M, K] in [BM, BK] boxes; B: [K, N] in [BK, BN]; L: [M, width] in A's boxes, R: like B with width for
        # K; C: [M, N] in [BM, BN] boxes. Persistent: program p takes tiles p, p + programs, ... Each tile runs
        # cdiv(K, BK) + RANK_STEPS steps; the loads of a tile's first NUM_BUFFERS - 1 steps go out while the tile
        # before finishes, and its C store drains during the next. Two more steps a tile (width <= BK,
        # cdiv(K, BK) >= 3) make L[:, :BK]^T @ x for its rows and columns (x: [M, N] in B's boxes), which
        # _store_shrink_grad adds to grad (ATOMIC: [rank, N] fp32, zeroed) or stores as the row block's partial sum
        # ([cdiv(M, BM), rank, N]): the layer's dA = ds^T x beside dx = g W + ds A.
        BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        B_K_MAJOR: gl.constexpr = False
        RANK_STEPS: gl.constexpr = 1  # L's columns fit one K-step (shrink_grad_gemm_ready)
        dtype: gl.constexpr = a_desc.dtype
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        a_ring, b_ring, c_smem, ready = _gemm_buffers(a_desc, b_desc, c_desc, NUM_BUFFERS)

        blocks_m, blocks_n, k_steps, tile, programs = _tile_grid(M, N, K, BLOCK_M, BLOCK_N, BLOCK_K)
        steps = k_steps + RANK_STEPS
        loads = 0
        mmas = 0
        acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, acc_layout)
        pid_m, pid_n = _tile_coords(tile, blocks_m, blocks_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        for s in gl.static_range(NUM_BUFFERS - 1):
            loads = _load_step(loads, s, k_steps, off_m, off_n, a_desc, b_desc, l_desc, r_desc, ready, a_ring, b_ring,
                               B_K_MAJOR, True)
        gl.static_assert(NUM_BUFFERS == 3 and BLOCK_M == 2 * BLOCK_K,
                         "the shrink-gradient steps are placed for loads two steps ahead and read L's box as two "
                         "halves of BK rows")
        # The K-step before which this program's tiles run L^T x (in [2, steps - 2]), spread over the tile across
        # the programs, which run in step: at every tile's end, all programs' reads of x and atomics at once left
        # the tensor cores waiting (H200, 8192 x 4096 -> 4096, float32 adapters: 1.141 x cuBLAS against 1.095)
        grad_at = 2 + tile * (steps - 3) // programs
        for _ in range(gl.cdiv(blocks_m * blocks_n - tile, programs)):
            mmas, acc = _mma_step(mmas, acc, False, ready, a_ring, b_ring, B_K_MAJOR)
            loads, mmas, acc = _k_steps(NUM_BUFFERS - 1, grad_at, loads, mmas, acc, k_steps, off_m, off_n, a_desc,
                                        b_desc, l_desc, r_desc, ready, a_ring, b_ring, B_K_MAJOR)
            loads, mmas, acc = _shrink_grad_steps(grad_at, loads, mmas, acc, k_steps, off_m, off_n, pid_m, a_desc,
                                                  b_desc, l_desc, r_desc, x_desc, c_smem, grad_ptr, N, rank, ready,
                                                  a_ring, b_ring, GROUP_ROWS, LOW_PIECES, ATOMIC, num_warps)
            loads, mmas, acc = _k_steps(grad_at + 2, steps, loads, mmas, acc, k_steps, off_m, off_n, a_desc,
                                        b_desc, l_desc, r_desc, ready, a_ring, b_ring, B_K_MAJOR)
            store_m = off_m
            store_n = off_n
            tile += programs
            pid_m, pid_n = _tile_coords(tile, blocks_m, blocks_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            more = tile < blocks_m * blocks_n
            for s in gl.static_range(NUM_BUFFERS - 2):  # the next tile's first loads beside this tile's last MMAs
                loads = _load_step(loads, s, k_steps, off_m, off_n, a_desc, b_desc, l_desc, r_desc, ready, a_ring,
                                   b_ring, B_K_MAJOR, more)
                mmas, acc = _mma_step(mmas, acc, True, ready, a_ring, b_ring, B_K_MAJOR)
            loads = _load_step(loads, NUM_BUFFERS - 2, k_steps, off_m, off_n, a_desc, b_desc, l_desc, r_desc, ready,
                               a_ring, b_ring, B_K_MAJOR, more)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            _store_c(acc.to(dtype), c_smem, c_desc, store_m, store_n)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _wait_row_block(count_ptr):
        # Spins until another kernel has counted the row block in (release; its L rows stored), then orders this
        # program's TMA reads after it: TMA reads through the async proxy, the rows were written through the generic
        # one
        while gl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu") < 1:
            pass
        fence_proxy_async_global()

    @gluon.jit
    def _rank_r_loads(a_desc, b_desc, l_desc, r_desc, count_ptr, a_ring, b_ring, ready, empty, M, N, K,
                      RANK_STEPS: gl.constexpr, B_K_MAJOR: gl.constexpr, GROUP_M: gl.constexpr,
                      WAIT_ROWS: gl.constexpr):
        # _gemm_rank_r's load warp: every step of every tile of this program, in the order the MMAs take them, into
        # the ring slot that the MMA warps last released (`empty`). WAIT_ROWS: a tile's L rows come from a kernel
        # running beside this one (_shrink_beside_gluon.py), which counts each row block in when they are stored
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        buffers: gl.constexpr = a_ring.type.shape[0]
        BLOCK_N: gl.constexpr = b_ring.type.shape[1] if B_K_MAJOR else b_ring.type.shape[2]
        blocks_m, blocks_n, k_steps, tile, programs = _tile_grid(M, N, K, BLOCK_M, BLOCK_N, BLOCK_K)
        loads = 0
        for _ in range(gl.cdiv(blocks_m * blocks_n - tile, programs)):
            pid_m, pid_n = _tile_coords(tile, blocks_m, blocks_n, GROUP_M)
            for step in range(k_steps + RANK_STEPS):
                if WAIT_ROWS:
                    if step == k_steps:
                        _wait_row_block(count_ptr + pid_m)
                mbarrier.wait(empty.index(loads % buffers), (loads // buffers & 1) ^ 1)  # at first: free already
                loads = _load_step(loads, step, k_steps, pid_m * BLOCK_M, pid_n * BLOCK_N, a_desc, b_desc, l_desc,
                                   r_desc, ready, a_ring, b_ring, B_K_MAJOR, True)
            tile += programs

    @gluon.jit
    def _rank_r_mmas(c_desc, a_ring, b_ring, c_smem, ready, empty, M, N, K, RANK_STEPS: gl.constexpr,
                     B_K_MAJOR: gl.constexpr, GROUP_M: gl.constexpr, WAIT_ROWS: gl.constexpr):
        # _gemm_rank_r's MMA warps: each step's MMA issued as soon as its slot is loaded, one in flight; the slot of
        # the one before is released once it completes. Then the tile's C through c_smem, stored by TMA while the
        # next tile's MMAs run.
        BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
        BLOCK_K: gl.constexpr = a_ring.type.shape[2]
        buffers: gl.constexpr = a_ring.type.shape[0]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        blocks_m, blocks_n, k_steps, tile, programs = _tile_grid(M, N, K, BLOCK_M, BLOCK_N, BLOCK_K)
        steps = k_steps + RANK_STEPS
        mmas = 0
        for _ in range(gl.cdiv(blocks_m * blocks_n - tile, programs)):
            pid_m, pid_n = _tile_coords(tile, blocks_m, blocks_n, GROUP_M)
            acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, acc_layout)
            for step in range(steps):
                index = mmas % buffers
                mbarrier.wait(ready.index(index), mmas // buffers & 1)
                b = b_ring.index(index)
                if B_K_MAJOR:
                    b = b.permute((1, 0))
                acc = warpgroup_mma(a_ring.index(index), b, acc, use_acc=step > 0, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                # the MMA before this one has read its slot (Gluon syncs these warps before one of them arrives)
                mbarrier.arrive(empty.index((mmas + buffers - 1) % buffers), pred=step > 0)
                mmas += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index((mmas + buffers - 1) % buffers))
            _store_c(acc.to(c_desc.dtype), c_smem, c_desc, pid_m * BLOCK_M, pid_n * BLOCK_N)
            tile += programs
        tma.store_wait(pendings=0)
        if WAIT_ROWS:  # launched as the kernel beside's programmatic dependent: end only after it has
            tl.extra.cuda.gdc_wait()

    @gluon.jit
    def _gemm_rank_r(a_desc, b_desc, l_desc, r_desc, c_desc, count_ptr, M, N, K, RANK_STEPS: gl.constexpr,
                     B_K_MAJOR: gl.constexpr, NUM_BUFFERS: gl.constexpr, GROUP_M: gl.constexpr,
                     LOAD_REGISTERS: gl.constexpr, WAIT_ROWS: gl.constexpr, num_warps: gl.constexpr):
        # A: [M, K] in [BM, BK] boxes; B: [N, K] in [BN, BK] boxes when B_K_MAJOR (x @ W^T), else [K, N] in [BK, BN];
        # L: [M, width] in A's boxes, R: like B with width for K; C: [M, N] in [BM, BN] boxes. Persistent: program p
        # takes tiles p, p + programs, ..., each cdiv(K, BK) + RANK_STEPS steps. Warp-specialised: one warp
        # (LOAD_REGISTERS registers a thread) issues the TMA loads (_rank_r_loads) up to NUM_BUFFERS steps ahead,
        # across tiles; the num_warps warps run the MMAs and the stores (_rank_r_mmas). WAIT_ROWS: each row block's
        # L rows wait for count[row block] >= 1 (_rank_r_loads).
        a_ring, b_ring, c_smem, ready = _gemm_buffers(a_desc, b_desc, c_desc, NUM_BUFFERS)
        empty = ready_barriers(NUM_BUFFERS)  # a slot's MMA has completed: the load warp may refill it
        gl.warp_specialize([(_rank_r_mmas, (c_desc, a_ring, b_ring, c_smem, ready, empty, M, N, K, RANK_STEPS,
                                            B_K_MAJOR, GROUP_M, WAIT_ROWS)),
                            (_rank_r_loads, (a_desc, b_desc, l_desc, r_desc, count_ptr, a_ring, b_ring, ready, empty,
                                             M, N, K, RANK_STEPS, B_K_MAJOR, GROUP_M, WAIT_ROWS))], [1],
                           [LOAD_REGISTERS])


def _descriptors(a, b, left, r_op, c, b_k_major):
    # TMA descriptors of A, B, L, R and C for _gemm_rank_r (and _gemm_dx_and_shrink_grad), and B's box and layout
    # (x's, there)
    dtype = gl.bfloat16 if a.dtype == torch.bfloat16 else gl.float16
    a_box = [BLOCK_M, BLOCK_K]
    b_box = [BLOCK_N, BLOCK_K] if b_k_major else [BLOCK_K, BLOCK_N]
    a_layout = gl.NVMMASharedLayout.get_default_for(a_box, dtype)
    b_layout = gl.NVMMASharedLayout.get_default_for(b_box, dtype)
    c_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
    return (TensorDescriptor.from_tensor(a, a_box, a_layout),
            TensorDescriptor.from_tensor(b.t() if b_k_major else b, b_box, b_layout),
            TensorDescriptor.from_tensor(left, a_box, a_layout),
            TensorDescriptor.from_tensor(r_op, b_box, b_layout),
            TensorDescriptor.from_tensor(c, [BLOCK_M, BLOCK_N], c_layout)), b_box, b_layout


def lora_matmul_gluon(a, b, low, right, scale, bias, pieces, sms):
    """C = a @ b + scale * (low @ right) + bias through _gemm_rank_r (gluon_gemm_ready holds); None if the kernel
    failed to run the first time (_gluon.launch_or_fall_back)."""
    # a: [M, K], b: [K, N] (W^T view: K-major, or contiguous), low: [M, r] fp32, right: [r, N] view, bias: [N] or None
    M, N = a.shape[0], b.shape[1]
    left, r_op, _ = rank_r_operands(low, right, scale, bias, a.dtype, pieces, b.stride(0) == 1)
    c = torch.empty(M, N, device=a.device, dtype=a.dtype)
    programs = min(sms, triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N))
    return c if gemm_rank_r_packed(a, b, left, r_op, c, programs) else None


def _gemm_rank_r_key(b_k_major: bool, width: int, wait_rows: bool) -> str:
    # one key a compiled variant: one that ran must not hide another's first failure
    return f"_gemm_rank_r(b_k_major={b_k_major}, rank_steps={triton.cdiv(width, BLOCK_K)}, wait_rows={wait_rows})"


def gemm_rank_r_failed(b, width: int, wait_rows: bool) -> bool:
    """Whether gemm_rank_r_packed's variant for b's layout, L's width and wait_rows failed its first launch (logged
    once): the streams beside it check first, so as not to run before a GEMM that falls back."""
    # b: [K, N] (K-major or contiguous)
    return failed(_gemm_rank_r_key(b.stride(0) == 1, width, wait_rows))


def gemm_rank_r_packed(a, b, left, r_op, c, programs, row_counts=None) -> bool:
    """c = a @ b + left @ r_op through _gemm_rank_r on `programs` programs (rank_r_operands packed L and R); whether
    the kernel ran (_gluon.launch_or_fall_back). row_counts: L's rows are being written by the kernel launched just
    before, which counts each row block in (int32 [row blocks]); this one is launched as its programmatic dependent
    (launch_pdl: it starts once every program of that kernel has started, so that it never waits on one that has
    not) and waits for a row block's count before loading its L rows. Where the launch is not a programmatic
    dependent after all (PDL unsupported, another kernel enqueued between the two), it starts after that kernel has
    ended: slower, never stuck."""
    # a: [M, K], b: [K, N] (K-major or contiguous), left: [M, W], r_op: [N, W] if b is K-major else [W, N], c: [M, N]
    M, K = a.shape
    N = b.shape[1]
    b_k_major = b.stride(0) == 1
    descriptors, _, _ = _descriptors(a, b, left, r_op, c, b_k_major)
    rank_steps = triton.cdiv(left.shape[1], BLOCK_K)
    wait_rows = row_counts is not None
    return launch_or_fall_back(
        _gemm_rank_r_key(b_k_major, left.shape[1], wait_rows),
        lambda: _gemm_rank_r[(programs,)](*descriptors, row_counts if wait_rows else c, M, N, K, RANK_STEPS=rank_steps,
                                          B_K_MAJOR=b_k_major, NUM_BUFFERS=NUM_BUFFERS, GROUP_M=GROUP_M,
                                          LOAD_REGISTERS=LOAD_REGISTERS, WAIT_ROWS=wait_rows, num_warps=WARPS,
                                          launch_pdl=wait_rows))


def shrink_grad_gemm_ready(g, weight, lora_A, x, pieces) -> bool:
    """Whether dx_and_shrink_grad_gluon takes these operands: lora_matmul's Gluon GEMM with weight as B (contiguous)
    and at least three K-steps, x in g's dtype with TMA's alignment, L's columns (all of ds's pieces, or ds in x's
    dtype) in one K-step, and dA's partial sums, where deterministic algorithms keep them, within MAX_PARTS_BYTES."""
    # g: [M, N], weight: [N, K], lora_A: [r, K], x: [M, K]
    M, K, r = x.shape[0], x.shape[1], lora_A.shape[0]
    parts = triton.cdiv(M, BLOCK_M)
    return (gluon_gemm_ready(g, weight, lora_A, pieces) and weight.stride(1) == 1 and x.dtype == g.dtype
            and g.shape[1] > 2 * BLOCK_K  # L^T x's steps go between K-steps
            and x.stride(1) == 1 and (x.stride(0) * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0
            and rank_r_width(r, pieces, 0, all_low_pieces=pieces) <= BLOCK_K
            and (atomic_partial_sums(parts) or parts * r * K * 4 <= MAX_PARTS_BYTES))


def dx_and_shrink_grad_gluon(g, weight, ds, lora_A, x, pieces, sms):
    """(dx, dA) of the layer's backward without dropout, from one GEMM (shrink_grad_gemm_ready holds; the caller
    checked the GEMM's own TMA alignment): dx = g @ weight + ds @ lora_A, dA = ds^T @ x ([r, K] fp32; the row blocks'
    parts added with float32 atomics, or summed in order under deterministic algorithms: _tiles.atomic_partial_sums).
    None if the kernel failed to run the first time."""
    # g: [M, N], weight: [N, K], ds: [M, r] fp32, lora_A: [r, K], x: [M, K]
    M, N = g.shape
    K = weight.shape[1]
    r = lora_A.shape[0]
    parts = triton.cdiv(M, BLOCK_M)
    atomic = atomic_partial_sums(parts)
    da = torch.empty((r, K) if atomic else (parts, r, K), device=g.device, dtype=torch.float32)
    left, r_op, _ = rank_r_operands(ds, lora_A, 1.0, None, g.dtype, pieces, False,
                                    zeroed=da.view(torch.int32) if atomic else None, all_low_pieces=pieces)
    dx = torch.empty(M, K, device=g.device, dtype=g.dtype)
    descriptors, x_box, x_layout = _descriptors(g, weight, left, r_op, dx, False)
    programs = min(sms, parts * triton.cdiv(K, BLOCK_N))
    # one key a variant: the four compile apart, and one that ran must not hide another's first failure
    ran = launch_or_fall_back(f"_gemm_dx_and_shrink_grad(pieces={pieces}, atomic={atomic})",
                              lambda: _gemm_dx_and_shrink_grad[(programs,)](
        *descriptors, TensorDescriptor.from_tensor(x, x_box, x_layout), da, M, K, N, r, GROUP_ROWS=padded_rank(r),
        LOW_PIECES=pieces, ATOMIC=atomic, NUM_BUFFERS=NUM_BUFFERS, GROUP_M=GROUP_M, num_warps=WARPS))
    return (dx, summed(da, atomic)) if ran else None
