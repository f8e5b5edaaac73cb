"""lora_matmul's Hopper GEMM in Gluon: C = A @ B + L @ R, the rank-r term and the bias as the last K-steps of the
same software-pipelined loop. Its reference is lora_matmul_reference (identity activation); the packing's is
rank_r_operands_reference.

Why Gluon: Triton's own pipeliner keeps a persistent TMA GEMM at cuBLAS's speed only while its tile loop is a plain
K-loop; the rank-r term in the epilogue cost 2-9 %, and as an extra K-step the pipeliner fell back to one stage
(benchmarks/NOTES_lora_layer.md). Gluon (part of Triton) lets the kernel write its own pipeline: TMA loads run
NUM_BUFFERS - 1 steps ahead of the asynchronous warpgroup MMAs, across tile boundaries, and the rank-r step is one
more load of the ring from two more descriptors. H200, 8192 rows, r = 16: 1.01-1.05x cuBLAS's GEMM alone with the
packing launch (the kernel alone 1.00-1.03x), against 1.02-1.08x for the Triton kernel
(benchmarks/probe_rank_r_gemm.py, results/rank_r_gemm.csv).

The rank-r operands are packed by one Triton launch (`rank_r_operands`): L = [scale * low | 1] and R = [right; bias]
in A's dtype. float32 adapters on bf16 activations go as bf16 pieces along K (_bf16_pieces.py): L = [l0 | l1 | l0],
R = [r0; r0; r1], the three largest piece products, as the Triton kernel's epilogue adds them. A bias of another
dtype goes as two pieces. Widths are padded to 8 columns (TMA's 16-byte rows); the descriptors read zeros past them.
"""
import torch
import triton
import triton.language as tl

from ._bf16_pieces import bf16_pieces_reference, split_bf16
from ._gluon import (TensorDescriptor, fence_async_shared, gl, gluon, launch_or_fall_back, mbarrier,
                     ready_barriers, runs_gluon_hopper, tma, warpgroup_mma, warpgroup_mma_wait)
from ._tiles import lora_in_fp32

BLOCK_M, BLOCK_N, BLOCK_K = 128, 256, 64
NUM_BUFFERS, GROUP_M, WARPS = 3, 8, 8  # 3 x 48 KiB of operand ring + 64 KiB for C's store: 208 KiB of shared memory


def rank_r_width(r: int, pieces: bool, bias_columns: int) -> int:
    """Columns of L (rows of R), padded to 8: TMA needs 16-byte row strides."""
    return triton.cdiv((3 * r if pieces else r) + bias_columns, 8) * 8


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


def rank_r_operands_reference(low, right, scale, bias, dtype, pieces):
    """(L [M, W], R [W, N]) in `dtype`, L @ R == scale * low @ right + bias as rank_r_operands packs them (unpadded).
    pieces: float32 low and right as bf16 pieces (the three largest products)."""
    # low: [M, r] fp32, right: [r, N], bias: [N] or None
    low = low.float() * scale
    if pieces:
        (l0, l1, _), (r0, r1, _) = bf16_pieces_reference(low), bf16_pieces_reference(right)
        left, right = [l0, l1, l0], [r0, r0, r1]
    else:
        left, right = [low.to(dtype)], [right.to(dtype)]
    if bias is not None:  # a bias of another dtype as two pieces in `dtype`
        hi = bias.to(dtype)
        bias_parts = [hi] if bias.dtype == dtype else [hi, (bias.float() - hi.float()).to(dtype)]
        left += [torch.ones(low.shape[0], len(bias_parts), device=low.device, dtype=dtype)]
        right += [part[None, :] for part in bias_parts]
    return torch.cat(left, 1), torch.cat(right, 0)


@triton.jit
def _pack_rank_r(low_ptr, right_ptr, bias_ptr, l_ptr, r_ptr, split_ptr, split_out_ptr, zero_ptr, M, N, rank, scale,
                 stride_rr, stride_rn, width, split_n, zero_n, PIECES: tl.constexpr, BIAS_COLUMNS: tl.constexpr,
                 R_K_MAJOR: tl.constexpr, SPLIT: tl.constexpr, ZERO: tl.constexpr, W: tl.constexpr,
                 BLOCK: tl.constexpr, FLAT: tl.constexpr):
    # low: [M, rank] fp32 contiguous; right: [rank, N] (strides stride_rr, stride_rn); bias: [N]
    # L: [M, width], R: [N, width] when R_K_MAJOR else [width, N]; W: width rounded up to a power of two
    # split: [split_n] fp32 -> split_out: [SPLIT, split_n] (its bf16 pieces, or with SPLIT == 1 its cast); zero:
    # [zero_n] int32. Programs in turn: cdiv(M, BLOCK) write rows of L, cdiv(N, BLOCK) columns of R, then FLAT
    # elements each of split's pieces (with SPLIT) and of zeros (with ZERO). Column c of L (row of R) holds piece
    # c // rank of rank index c % rank, then the bias columns, then zeros.
    dtype = l_ptr.dtype.element_ty
    pid = tl.program_id(0)
    row_blocks = tl.cdiv(M, BLOCK)
    right_end = row_blocks + tl.cdiv(N, BLOCK)
    split_end = right_end + (tl.cdiv(split_n, FLAT) if SPLIT > 0 else 0)
    cols = tl.arange(0, W)
    term_cols = 3 * rank if PIECES else rank
    piece, j = cols // rank, cols % rank
    in_term = cols < term_cols
    bias_col = cols - term_cols
    if pid < row_blocks:
        rows = pid * BLOCK + tl.arange(0, BLOCK)
        v = scale * tl.load(low_ptr + rows[:, None].to(tl.int64) * rank + j[None, :],
                            mask=(rows[:, None] < M) & in_term[None, :], other=0.0)
        if PIECES:
            hi, mid, _ = split_bf16(v)
            v = tl.where(piece[None, :] == 1, mid, hi)  # l0 | l1 | l0
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
            v = tl.where(piece[None, :] == 2, mid, hi).to(tl.float32)  # r0; r0; r1
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
        t = tl.load(split_ptr + offs, mask=ok, other=0.0)
        if SPLIT == 3:
            hi, mid, lo = split_bf16(t)
            tl.store(split_out_ptr + offs, hi, mask=ok)
            tl.store(split_out_ptr + split_n + offs, mid, mask=ok)
            tl.store(split_out_ptr + 2 * split_n + offs, lo, mask=ok)
        else:
            tl.store(split_out_ptr + offs, t.to(split_out_ptr.dtype.element_ty), mask=ok)
    elif ZERO:
        offs = (pid - split_end) * FLAT + tl.arange(0, FLAT)
        tl.store(zero_ptr + offs, tl.zeros([FLAT], tl.int32), mask=offs < zero_n)


def rank_r_operands(low, right, scale, bias, dtype, pieces, r_k_major, split=None, zeroed=None):
    """(L [M, width], R [N, width] if r_k_major else [width, N], split's pieces or None) in `dtype`:
    rank_r_operands_reference zero-padded to rank_r_width columns. The same launch also writes the bf16 pieces of a
    float32 `split` ([3, *split.shape], or with `pieces` False split cast to dtype: [1, *split.shape]) and zeroes the
    int32 tensor `zeroed`: the operands that _shrink_matmul_gluon's GEMM reads, without a launch each."""
    # low: [M, r] fp32, right: [r, N] (any strides), bias: [N] or None, split: fp32 (any shape), zeroed: int32
    M, r, N = low.shape[0], right.shape[0], right.shape[1]
    bias_columns = 0 if bias is None else 1 if bias.dtype == dtype else 2
    width = rank_r_width(r, pieces, bias_columns)
    left = torch.empty(M, width, device=low.device, dtype=dtype)
    r_out = torch.empty((N, width) if r_k_major else (width, N), device=low.device, dtype=dtype)
    split_parts = 0 if split is None else 3 if pieces else 1
    split = low if split is None else split.contiguous()  # a float32 tensor that no program reads without `split`
    split_out = torch.empty(split_parts, *split.shape, device=low.device, dtype=dtype)
    zero_n = 0 if zeroed is None else zeroed.numel()
    block, flat = 64, 1024
    programs = triton.cdiv(M, block) + triton.cdiv(N, block) + triton.cdiv(split.numel(), flat) * (split_parts > 0) + \
        triton.cdiv(zero_n, flat)
    _pack_rank_r[(programs,)](
        low.contiguous(), right, bias, left, r_out, split, split_out, zeroed, M, N, r, scale, right.stride(0),
        right.stride(1), width, split.numel(), zero_n, PIECES=pieces, BIAS_COLUMNS=bias_columns, R_K_MAJOR=r_k_major,
        SPLIT=split_parts, ZERO=zeroed is not None, W=triton.next_power_of_2(width), BLOCK=block, FLAT=flat)
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
    def _gemm_rank_r(a_desc, b_desc, l_desc, r_desc, c_desc, M, N, K, RANK_STEPS: gl.constexpr,
                     B_K_MAJOR: gl.constexpr, NUM_BUFFERS: gl.constexpr, GROUP_M: gl.constexpr,
                     num_warps: gl.constexpr):
        # A: [M, K] in [BM, BK] boxes; B: [N, K] in [BN, BK] boxes when B_K_MAJOR (x @ W^T), else [K, N] in [BK, BN];
        # L: [M, width] in A's boxes, R: like B with width for K; C: [M, N] in [BM, BN] boxes. Persistent: program p
        # takes tiles p, p + programs, ... Each tile runs cdiv(K, BK) + RANK_STEPS steps; the loads of a tile's
        # first NUM_BUFFERS - 1 steps go out while the tile before finishes, and its C store drains during the next.
        BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        dtype: gl.constexpr = a_desc.dtype
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        a_ring, b_ring, c_smem, ready = _gemm_buffers(a_desc, b_desc, c_desc, NUM_BUFFERS)

        blocks_m = gl.cdiv(M, BLOCK_M)
        blocks_n = gl.cdiv(N, BLOCK_N)
        k_steps = gl.cdiv(K, BLOCK_K)
        steps = k_steps + RANK_STEPS
        tile = gl.program_id(0)
        programs = gl.num_programs(0)
        loads = 0
        mmas = 0
        acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, acc_layout)
        pid_m, pid_n = _tile_coords(tile, blocks_m, blocks_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        for s in gl.static_range(NUM_BUFFERS - 1):
            loads = _load_step(loads, s, k_steps, off_m, off_n, a_desc, b_desc, l_desc, r_desc, ready, a_ring, b_ring,
                               B_K_MAJOR, True)
        for _ in range(gl.cdiv(blocks_m * blocks_n - tile, programs)):
            mmas, acc = _mma_step(mmas, acc, False, ready, a_ring, b_ring, B_K_MAJOR)
            for s in range(NUM_BUFFERS - 1, steps):
                loads = _load_step(loads, s, k_steps, off_m, off_n, a_desc, b_desc, l_desc, r_desc, ready, a_ring,
                                   b_ring, B_K_MAJOR, True)
                mmas, acc = _mma_step(mmas, acc, True, ready, a_ring, b_ring, B_K_MAJOR)
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
            c = acc.to(dtype)
            tma.store_wait(pendings=0)  # the previous tile's store has left c_smem
            c_smem.store(c)
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [store_m, store_n], c_smem)
        tma.store_wait(pendings=0)


def lora_matmul_gluon(a, b, low, right, scale, bias, pieces, sms):
    """C = a @ b + scale * (low @ right) + bias through _gemm_rank_r (gluon_gemm_ready holds); None if the kernel
    failed to run the first time (_gluon.launch_or_fall_back)."""
    # a: [M, K], b: [K, N] (W^T view: K-major, or contiguous), low: [M, r] fp32, right: [r, N] view, bias: [N] or None
    M, K = a.shape
    N = b.shape[1]
    b_k_major = b.stride(0) == 1
    left, r_op, _ = rank_r_operands(low, right, scale, bias, a.dtype, pieces, b_k_major)
    c = torch.empty(M, N, device=a.device, dtype=a.dtype)
    dtype = gl.bfloat16 if a.dtype == torch.bfloat16 else gl.float16
    a_box = [BLOCK_M, BLOCK_K]
    b_box = [BLOCK_N, BLOCK_K] if b_k_major else [BLOCK_K, BLOCK_N]
    a_layout = gl.NVMMASharedLayout.get_default_for(a_box, dtype)
    b_layout = gl.NVMMASharedLayout.get_default_for(b_box, dtype)
    descriptors = (TensorDescriptor.from_tensor(a, a_box, a_layout),
                   TensorDescriptor.from_tensor(b.t() if b_k_major else b, b_box, b_layout),
                   TensorDescriptor.from_tensor(left, a_box, a_layout),
                   TensorDescriptor.from_tensor(r_op, b_box, b_layout),
                   TensorDescriptor.from_tensor(c, [BLOCK_M, BLOCK_N],
                                                gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)))
    programs = min(sms, triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N))
    ran = launch_or_fall_back("_gemm_rank_r", lambda: _gemm_rank_r[(programs,)](
        *descriptors, M, N, K, RANK_STEPS=triton.cdiv(left.shape[1], BLOCK_K), B_K_MAJOR=b_k_major,
        NUM_BUFFERS=NUM_BUFFERS, GROUP_M=GROUP_M, num_warps=WARPS))
    return c if ran else None
