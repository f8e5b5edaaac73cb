"""The layer's forward without dropout in one Hopper GEMM (Gluon): y = x W^T + scale * s B^T + bias, with the shrink
s = x A^T computed inside it. Its reference is lora_shrink_reference and lora_matmul_reference.

Why: the separate shrink is a pass over x before the GEMM that needs s (23 us of 360 at 8192 x 4096, H200). The
GEMM's K-loop already holds every x tile of a row block in shared memory, so the shrink costs one small MMA
(x tile @ A's bf16 pieces: N = 64 at r = 16) beside the big one.

How: the first `contributors` column tiles of each row block each take a slice of K: beside those K-steps, the small
MMA; then they add their part of s with float32 atomics and count themselves in (release). Every tile of the row
block waits for the count (acquire) LEAD steps before its rank-r steps, then reads s and builds L = [scale * s
pieces | 1] in registers for the rank-r K-steps of _lora_matmul_gluon's GEMM (R = [B pieces; bias] is packed as
there).
- A contributor starts its K-loop so that its slice comes early, at a K-step rounded down to a multiple of
  k_steps // 4: a row block's tiles then take a few K orders, and L2 still serves x's rows to them (one order per
  tile read x's rows from memory up to 16 times: 1.08x -> 1.05x cuBLAS at 14336 -> 4096).
- Waiting cannot deadlock while all programs are resident (one per SM): a row block's contributors lie within a
  window of fewer tiles than programs (tiles are dealt in order), and they publish before they wait. With
  fixed_order the other tiles also wait for the summer, the row block's first tile dealt and itself a contributor,
  which waits only for the contributors. The launch is not cooperative: a kernel on another stream that holds SMs
  (NCCL's, say) delays the programs that wait until it ends; one that waited on this GEMM would hang it.
- lora_A's pieces ride in c_smem between C's stores (the K-steps before START let the last store drain).
- Atomics add in no fixed order, so s and y vary in their last bits from run to run (13 float32 parts a row block at
  8192 x 4096 -> 4096 on 132 SMs: 0 of 6 repeats gave the same bits, H100). With fixed_order (inference, so that a
  batch gives the same logits on the same GPU run after run; and under torch.use_deterministic_algorithms) the
  contributors store their parts instead; the row block's first column tile, the summer, waits for all of them at its
  own wait, adds them in order into s and counts once more, and the other tiles wait for that count. Two parts need no
  order (0 + a + b is the same float either way): up to two contributors keep the atomics. The parts take
  contributors x M x r float32 (6.8 MB at 8192 rows, r = 16); past MAX_PARTS_BYTES the caller's separate shrink runs.
  It costs the summer's wait and sum, and still beats the separate shrink (benchmarks/probe_shrink_matmul.py, H100,
  float32 adapters, x cuBLAS: 4096 -> 4096 1.106 atomics, 1.125 fixed order, 1.146 separate; 14336 -> 4096 1.057,
  1.065, 1.079). The last contributor to arrive summing them instead cost 1.6-2.5 % more: its increment had to return
  the count before it could go on.
- With dropout the mask's Philox draws cost about an MMA per x tile; drawn in the shrink steps, or ahead as bits, the
  kernel ran 1.5-8 % behind the separate masked shrink (H100, benchmarks/NOTES_lora_layer.md): dropout keeps it.
  Tried again with the cheaper 14-bit mask, drawn and applied in the registers of the small MMA's operand (no trip
  through shared memory), it still lost: 1.159 against 1.114 x cuBLAS at 4096 -> 4096, 1.111 against 1.081 at
  14336 -> 4096 (H100). The draws do not hide behind the big MMAs in flight: they cost about their issue time.

benchmarks/probe_shrink_matmul.py (H100, 8192 rows, r = 16, packing launches included, graph-replayed, ratio to
cuBLAS's GEMM alone), against the separate shrink and _lora_matmul_gluon's GEMM: 4096 -> 4096 1.106 against 1.146
(float32 adapters) and 1.079 against 1.120 (bf16 ones); 14336 -> 4096 1.057 against 1.079 and 1.033 against 1.070.
Wider outputs gained nothing (SHRINK_IN_GEMM_UP_TO_N).
"""
import functools

import torch
import triton

from ._bf16_pieces import uses_bf16_pieces
from ._gluon import (TensorDescriptor, fence_async_shared, gl, gluon, launch_or_fall_back, mbarrier, tma, tma_aligned,
                     warpgroup_mma, warpgroup_mma_wait)
from ._lora_matmul_gluon import (BLOCK_K, BLOCK_M, BLOCK_N, GROUP_M, NUM_BUFFERS, WARPS, gluon_gemm_ready,
                                 rank_r_operands, rank_r_width)
from ._tiles import MAX_PARTS_BYTES

START = 4  # a contributor's first possible shrink step: by then the last tile's C store has left c_smem
LEAD = 3  # K-steps between a tile's wait for s and its first rank-r step: L2's latency hides behind their MMAs
WINDOW = 3 / 4  # of the programs: the most tiles that one row block's contributors span
MAX_SHRINK_ROWS = 128  # lora_A's pieces (P * rank rounded up to a power of two): 3 ring slots of them share c_smem
# Measured faster than the separate shrink up to this many output columns (benchmarks/probe_shrink_matmul.py, H100,
# 8192 rows, r = 16): 4096 -> 4096 1.106 against 1.146 x cuBLAS, 14336 -> 4096 1.057 against 1.079 (float32
# adapters). Wider, most tiles only wait for the contributors: 4096 -> 14336 1.065 against 1.059, 2048 -> 8192 1.091
# against 1.101, within one run's spread of each other.
SHRINK_IN_GEMM_UP_TO_N = 4096


def _shrink_rows(rank: int, pieces: bool) -> int:
    return triton.next_power_of_2(3 * rank if pieces else rank)


def _placement(lo, k_steps):
    """(K rotation, first loop step) of a contributor's shrink slice of K-steps from lo, as _plan places it."""
    quantum = max(k_steps // 4, 1)
    rot = ((lo - START + k_steps) // quantum * quantum - k_steps) % k_steps
    return rot, (lo - rot) % k_steps


@functools.cache
def contributors_for(blocks_n: int, k_steps: int, programs: int) -> int:
    """Column tiles per row block that share its shrink, or 0 where the shape cannot fuse it: each one's slice of K
    must fall between START and the wait for s."""
    def fits(lo, hi):
        first = _placement(lo, k_steps)[1]
        return START <= first and first + hi - lo <= k_steps - LEAD

    c = min(blocks_n, int(WINDOW * programs - 1) // GROUP_M + 1, k_steps)
    while c > 0 and not all(fits(j * k_steps // c, (j + 1) * k_steps // c) for j in range(c)):
        c -= 1
    return c


def shrink_matmul_ready(x, weight, lora_A, lora_B, bias) -> bool:
    """Whether shrink_matmul_gluon takes these inputs: Hopper (_gluon.runs_gluon_hopper), x and W in one 16-bit dtype
    with W's rows contiguous (a transposed weight, GPT-2's Conv1D under fan_in_fan_out, keeps the other route; the
    caller checked TMA's alignment), 16-bit rank-r products (as gluon_gemm_ready) with a rank of 8 to 64, a power of
    two, whose pieces fit c_smem."""
    # x: [M, K], weight: [N, K], lora_A: [r, K], lora_B: [N, r]
    r = lora_A.shape[0]
    pieces = uses_bf16_pieces(x.dtype, lora_A.dtype)
    return (gluon_gemm_ready(x, weight.t(), lora_B.t(), pieces) and weight.stride(1) == 1
            and 8 <= r <= 64 and r & (r - 1) == 0
            and _shrink_rows(r, pieces) <= MAX_SHRINK_ROWS)


if gluon is not None:  # no Gluon Hopper API (Triton before 3.5), none of these: the Triton kernels run
    from ._lora_matmul_gluon import _gemm_buffers, _mma_step, _store_c, _tile_coords, _tile_grid

    @gluon.jit
    def _plan(tile, blocks_m, blocks_n, k_steps, contributors, GROUP: gl.constexpr, START: gl.constexpr):
        # tile -> (row block, column block, K rotation, shrink steps, first shrink step). Column blocks below
        # `contributors` shrink x's K-steps [lo, lo + per), at loop steps first.. of a K-loop that starts at K-step
        # rot, lo - START rounded down to a multiple of k_steps // 4 (_placement is the same on the host)
        pid_m, pid_n = _tile_coords(tile, blocks_m, blocks_n, GROUP)
        contributes = pid_n < contributors
        lo = pid_n * k_steps // gl.maximum(contributors, 1)
        per = gl.where(contributes, (pid_n + 1) * k_steps // gl.maximum(contributors, 1) - lo, 0)
        quantum = gl.maximum(k_steps // 4, 1)
        rot = (lo - START + k_steps) // quantum * quantum - k_steps
        rot = gl.where(contributes, gl.where(rot < 0, rot + k_steps, rot), 0)
        first = lo - rot
        return pid_m, pid_n, rot, per, gl.where(first < 0, first + k_steps, first)

    @gluon.jit
    def _load_step(loads, step, k_steps, rot, per, first, off_m, off_n, a_desc, b_desc, la_desc, r_desc, ready,
                   a_ring, b_ring, la_ring, START: gl.constexpr, pred):
        # TMA loads of loop step `step` of the tile at (off_m, off_n) into ring slot loads % buffers: x's and W's
        # K-step (step + rot) % k_steps, with lora_A's pieces on the shrink steps; past k_steps R's K-steps (L is
        # made in registers). Returns the loads issued so far.
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        index = loads % a_ring.type.shape[0]
        bar = ready.index(index)
        if step < k_steps:
            k = step + rot
            k = gl.where(k >= k_steps, k - k_steps, k) * BLOCK_K
            if (step == START) & (per > 0):
                tma.store_wait(pendings=0)  # la_ring lives in c_smem: the last tile's C has left it
            if (step >= first) & (step < first + per):
                mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes + la_desc.block_type.nbytes,
                                pred=pred)
                tma.async_copy_global_to_shared(la_desc, [0, k], bar, la_ring.index(index), pred)
            else:
                mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
            tma.async_copy_global_to_shared(a_desc, [off_m, k], bar, a_ring.index(index), pred)
            tma.async_copy_global_to_shared(b_desc, [off_n, k], bar, b_ring.index(index), pred)
        else:
            mbarrier.expect(bar, r_desc.block_type.nbytes, pred=pred)
            tma.async_copy_global_to_shared(r_desc, [off_n, (step - k_steps) * BLOCK_K], bar, b_ring.index(index),
                                            pred)
        return loads + 1

    @gluon.jit
    def _mma_shrink(mmas, acc, acc_s, ready, a_ring, b_ring, la_ring, R: gl.constexpr, S_LAYOUT: gl.constexpr,
                    PART_LAYOUT: gl.constexpr):
        # A shrink step: acc_s += x tile @ A^T (lora_A's bf16 pieces side by side in one MMA, their products summed
        # in fp32 as dot_pieces does), then the step's big MMA. The small MMA goes first, so that waiting for it
        # leaves the big one in flight. Returns (MMAs issued so far, the pending accumulator, acc_s).
        buffers: gl.constexpr = a_ring.type.shape[0]
        BLOCK_M: gl.constexpr = a_ring.type.shape[1]
        index = mmas % buffers
        mbarrier.wait(ready.index(index), mmas // buffers & 1)
        la = la_ring.index(index)  # [SHRINK_ROWS, BK]: the pieces' rows, then zeros (TMA's fill past them)
        SHRINK_ROWS: gl.constexpr = la.type.shape[0]
        part = warpgroup_mma(a_ring.index(index), la.permute((1, 0)),
                             gl.zeros((BLOCK_M, SHRINK_ROWS), gl.float32, PART_LAYOUT), use_acc=False, is_async=True)
        acc = warpgroup_mma(a_ring.index(index), b_ring.index(index).permute((1, 0)), acc, is_async=True)
        part = warpgroup_mma_wait(num_outstanding=1, deps=(part,))
        if SHRINK_ROWS > R:
            part = gl.sum(gl.reshape(part, [BLOCK_M, SHRINK_ROWS // R, R]), axis=1)
        return mmas + 1, acc, acc_s + gl.convert_layout(part, S_LAYOUT)

    @gluon.jit
    def _sum_parts(part_ptr, s_ptr, off_m, M, rank, contributors, UNROLL: gl.constexpr, BM: gl.constexpr,
                   R: gl.constexpr, LAYOUT: gl.constexpr):
        # s's rows off_m.. = the contributors' parts ([contributors, M, rank] fp32) added in order, UNROLL loads in
        # flight at once: the same float run after run
        rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, LAYOUT))
        ranks = gl.arange(0, R, layout=gl.SliceLayout(0, LAYOUT))
        offsets = rows[:, None] * rank + ranks[None, :]
        mask = (rows[:, None] < M) & (ranks[None, :] < rank)
        total = gl.zeros((BM, R), gl.float32, LAYOUT)
        for j0 in range(0, contributors, UNROLL):
            for jj in gl.static_range(UNROLL):
                j = j0 + jj
                total += gl.load(part_ptr + j.to(gl.int64) * M * rank + offsets, mask=mask & (j < contributors),
                                 other=0.0, cache_modifier=".cg")
        gl.store(s_ptr + offsets, total, mask=mask)

    @gluon.jit
    def _s_columns(s_ptr, off_m, step, M, rank, PIECES: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr,
                   LAYOUT: gl.constexpr):
        # s under K-step `step` of L: column c holds s[:, c % rank], zero past the pieces' columns. [BM, BK] fp32,
        # read from L2 (where the contributors' atomics or the summer's stores live)
        rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, LAYOUT))
        cols = step * BK + gl.arange(0, BK, layout=gl.SliceLayout(0, LAYOUT))
        term_cols = 3 * rank if PIECES else rank
        return gl.load(s_ptr + rows[:, None] * rank + (cols % rank)[None, :],
                       mask=(rows[:, None] < M) & (cols < term_cols)[None, :], other=0.0, cache_modifier=".cg")

    @gluon.jit
    def _left_tile(s_cols, step, rank, scale, PIECES: gl.constexpr, BIAS_COLUMNS: gl.constexpr, BK: gl.constexpr,
                   dtype: gl.constexpr, LAYOUT: gl.constexpr):
        # K-step `step` of L = [scale * s (bf16 pieces l0 | l1 | l0, as rank_r_operands packs them) | ones for the
        # bias | 0], from _s_columns: [BM, BK] in dtype
        cols = step * BK + gl.arange(0, BK, layout=gl.SliceLayout(0, LAYOUT))
        term_cols = 3 * rank if PIECES else rank
        v = scale * s_cols
        if PIECES:
            hi = v.to(gl.bfloat16).to(gl.float32)
            mid = (v - hi).to(gl.bfloat16).to(gl.float32)
            v = gl.where((cols // rank == 1)[None, :], mid, hi)
        ones = (cols >= term_cols) & (cols < term_cols + BIAS_COLUMNS)
        return gl.where(ones[None, :], 1.0, v).to(dtype)

    @gluon.jit
    def _gemm_shrink_rank_r(a_desc, b_desc, la_desc, r_desc, c_desc, s_ptr, part_ptr, count_ptr, M, N, K, rank, scale,
                            contributors, RANK_STEPS: gl.constexpr, R: gl.constexpr, PIECES: gl.constexpr,
                            BIAS_COLUMNS: gl.constexpr, NUM_BUFFERS: gl.constexpr, GROUP_M: gl.constexpr,
                            START: gl.constexpr, LEAD: gl.constexpr, FIXED_ORDER: gl.constexpr,
                            SUM_UNROLL: gl.constexpr, num_warps: gl.constexpr):
        # A (x): [M, K] in [BM, BK] boxes; B (W): [N, K] in [BN, BK] boxes; LA (lora_A's pieces, [3, rank, K] or
        # [rank, K]): [rows, K] in [SHRINK_ROWS, BK] boxes; R: [N, width] in B's boxes; C: [M, N] in [BM, BN];
        # s: [M, rank] fp32, zeroed unless FIXED_ORDER; part: [contributors, M, rank] fp32 (FIXED_ORDER);
        # count: [row blocks] int32 zeroed. Persistent: program p takes tiles p,
        # p + programs, ...; the loads run NUM_BUFFERS - 1 steps ahead of the MMAs, across tiles, as in
        # _lora_matmul_gluon._gemm_dx_and_shrink_grad.
        BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        SHRINK_ROWS: gl.constexpr = la_desc.block_type.shape[0]
        dtype: gl.constexpr = a_desc.dtype
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, R, 16])
        part_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                              instr_shape=[16, SHRINK_ROWS, 16])
        left_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_K // 8), BLOCK_K // 8], [num_warps, 1],
                                                     [1, 0])
        a_ring, b_ring, c_smem, ready = _gemm_buffers(a_desc, b_desc, c_desc, NUM_BUFFERS)
        # between C's stores c_smem holds lora_A's ring (views of shared memory have power-of-two shapes: 4 slots)
        la_ring = c_smem._reinterpret(dtype, [4, SHRINK_ROWS, BLOCK_K], la_desc.layout)

        blocks_m, blocks_n, k_steps, tile, programs = _tile_grid(M, N, K, BLOCK_M, BLOCK_N, BLOCK_K)
        loads = 0
        mmas = 0
        acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, acc_layout)
        pid_m, pid_n, rot, per, first = _plan(tile, blocks_m, blocks_n, k_steps, contributors, GROUP_M, START)
        for s in gl.static_range(NUM_BUFFERS - 1):
            loads = _load_step(loads, s, k_steps, rot, per, first, pid_m * BLOCK_M, pid_n * BLOCK_N, a_desc, b_desc,
                               la_desc, r_desc, ready, a_ring, b_ring, la_ring, START, True)
        for _ in range(gl.cdiv(blocks_m * blocks_n - tile, programs)):
            # A tile's steps, each loop a plain run of them (branches inside the K-loop cost 5-10 %): K-steps up to
            # the shrink steps [first, first + per) of a contributor, the shrink steps, K-steps up to the wait for
            # the row block's s, the last K-steps, the rank-r steps.
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            nxt = tile + programs
            n_m, n_n, n_rot, n_per, n_first = _plan(nxt, blocks_m, blocks_n, k_steps, contributors, GROUP_M, START)
            mmas, acc = _mma_step(mmas, acc, False, ready, a_ring, b_ring, True)
            for step in range(1, gl.where(per > 0, first, k_steps - LEAD)):
                loads = _load_step(loads, step + 1, k_steps, rot, per, first, off_m, off_n, a_desc, b_desc, la_desc,
                                   r_desc, ready, a_ring, b_ring, la_ring, START, True)
                mmas, acc = _mma_step(mmas, acc, True, ready, a_ring, b_ring, True)
            if per > 0:
                acc_s = gl.zeros((BLOCK_M, R), gl.float32, s_layout)
                for step in range(first, first + per):
                    loads = _load_step(loads, step + 1, k_steps, rot, per, first, off_m, off_n, a_desc, b_desc,
                                       la_desc, r_desc, ready, a_ring, b_ring, la_ring, START, True)
                    mmas, acc, acc_s = _mma_shrink(mmas, acc, acc_s, ready, a_ring, b_ring, la_ring, R, s_layout,
                                                   part_layout)
                # this tile's part of s is complete: add it to s (or store it for the summer), then count it in
                # (after every thread's atomics or stores)
                rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
                ranks = gl.arange(0, R, layout=gl.SliceLayout(0, s_layout))
                s_offsets = rows[:, None] * rank + ranks[None, :]
                s_mask = (rows[:, None] < M) & (ranks[None, :] < rank)
                if FIXED_ORDER:
                    gl.store(part_ptr + pid_n.to(gl.int64) * M * rank + s_offsets, acc_s, mask=s_mask)
                else:
                    gl.atomic_add(s_ptr + s_offsets, acc_s, mask=s_mask, sem="relaxed")
                gl.thread_barrier()
                gl.atomic_add(count_ptr + pid_m, 1, sem="release", scope="gpu")
                for step in range(first + per, k_steps - LEAD):
                    loads = _load_step(loads, step + 1, k_steps, rot, per, first, off_m, off_n, a_desc, b_desc,
                                       la_desc, r_desc, ready, a_ring, b_ring, la_ring, START, True)
                    mmas, acc = _mma_step(mmas, acc, True, ready, a_ring, b_ring, True)
            # the wait for the row block's contributors and the read of L's first s values go beside an MMA
            loads = _load_step(loads, k_steps - LEAD + 1, k_steps, rot, per, first, off_m, off_n, a_desc, b_desc,
                               la_desc, r_desc, ready, a_ring, b_ring, la_ring, START, True)
            mmas, acc = _mma_step(mmas, acc, True, ready, a_ring, b_ring, True)
            if FIXED_ORDER and pid_n == 0:  # the row block's summer: once every part is in, s = their sum in order
                while gl.atomic_add(count_ptr + pid_m, 0, sem="acquire", scope="gpu") < contributors:
                    pass
                _sum_parts(part_ptr, s_ptr, off_m, M, rank, contributors, SUM_UNROLL, BLOCK_M, R, s_layout)
                gl.thread_barrier()
                gl.atomic_add(count_ptr + pid_m, 1, sem="release", scope="gpu")
            while gl.atomic_add(count_ptr + pid_m, 0, sem="acquire", scope="gpu") < contributors + FIXED_ORDER:
                pass
            s_cols = _s_columns(s_ptr, off_m, 0, M, rank, PIECES, BLOCK_M, BLOCK_K, left_layout)
            for step in range(k_steps - LEAD + 1, k_steps):
                loads = _load_step(loads, step + 1, k_steps, rot, per, first, off_m, off_n, a_desc, b_desc, la_desc,
                                   r_desc, ready, a_ring, b_ring, la_ring, START, True)
                mmas, acc = _mma_step(mmas, acc, True, ready, a_ring, b_ring, True)
            for j in gl.static_range(RANK_STEPS):  # L, made beside the MMA before, into A's slot
                left = _left_tile(s_cols, j, rank, scale, PIECES, BIAS_COLUMNS, BLOCK_K, dtype, left_layout)
                if j + 1 < RANK_STEPS:
                    loads = _load_step(loads, k_steps + j + 1, k_steps, rot, per, first, off_m, off_n, a_desc,
                                       b_desc, la_desc, r_desc, ready, a_ring, b_ring, la_ring, START, True)
                    s_cols = _s_columns(s_ptr, off_m, j + 1, M, rank, PIECES, BLOCK_M, BLOCK_K, left_layout)
                else:  # the next tile's first loads beside this tile's last MMAs
                    loads = _load_step(loads, 0, k_steps, n_rot, n_per, n_first, n_m * BLOCK_M, n_n * BLOCK_N,
                                       a_desc, b_desc, la_desc, r_desc, ready, a_ring, b_ring, la_ring, START,
                                       nxt < blocks_m * blocks_n)
                index = mmas % NUM_BUFFERS
                mbarrier.wait(ready.index(index), mmas // NUM_BUFFERS & 1)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                a_ring.index(index).store(left)
                fence_async_shared()
                gl.thread_barrier()
                acc = warpgroup_mma(a_ring.index(index), b_ring.index(index).permute((1, 0)), acc, is_async=True)
                mmas += 1
            loads = _load_step(loads, 1, k_steps, n_rot, n_per, n_first, n_m * BLOCK_M, n_n * BLOCK_N, a_desc,
                               b_desc, la_desc, r_desc, ready, a_ring, b_ring, la_ring, START,
                               nxt < blocks_m * blocks_n)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            _store_c(acc.to(dtype), c_smem, c_desc, off_m, off_n)
            tile = nxt
            pid_m, pid_n, rot, per, first = n_m, n_n, n_rot, n_per, n_first
        tma.store_wait(pendings=0)


def shrink_matmul_gluon(x, weight, lora_A, lora_B, scale, bias, sms, fixed_order=None):
    """(y, s): y = x W^T + scale * s B^T + bias and s = x A^T (fp32) from one GEMM, through _gemm_shrink_rank_r
    (shrink_matmul_ready holds); None where the shape cannot fuse the shrink, or the kernel failed to run the first
    time (_gluon.launch_or_fall_back), or fixed_order's parts would take more than MAX_PARTS_BYTES. fixed_order: the
    same inputs give the same bits (s's parts summed in order, not by atomics), at a cost (module docstring); None:
    under torch.use_deterministic_algorithms."""
    # x: [M, K], weight: [N, K], lora_A: [r, K], lora_B: [N, r], bias: [N] or None
    M, K = x.shape
    N, r = weight.shape[0], lora_A.shape[0]
    blocks_m, blocks_n, k_steps = triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N), triton.cdiv(K, BLOCK_K)
    programs = min(sms, blocks_m * blocks_n)
    contributors = contributors_for(blocks_n, k_steps, programs)
    if contributors == 0:
        return None
    if fixed_order is None:
        fixed_order = torch.are_deterministic_algorithms_enabled()
    fixed_order = fixed_order and contributors > 2  # two parts add to the same float in either order
    if fixed_order and contributors * M * r * 4 > MAX_PARTS_BYTES:
        return None
    pieces = uses_bf16_pieces(x.dtype, lora_A.dtype)
    bias_columns = 0 if bias is None else 1 if bias.dtype == x.dtype else 2
    width = rank_r_width(r, pieces, bias_columns)
    # One launch packs R, makes lora_A's bf16 pieces (or its cast: LORAFUSE_ADAPTER_MATH=fast) and zeroes s (which
    # atomics add into) and the counts: a launch each cost 1.5 % more at 4096 -> 4096 (H100,
    # benchmarks/NOTES_lora_layer.md)
    part_size = contributors * M * r if fixed_order else 0
    work = torch.empty(M * r + part_size + blocks_m, device=x.device, dtype=torch.int32)
    s, parts, counts = work.split([M * r, part_size, blocks_m])  # s and the parts as float32 bits
    cast = lora_A.dtype != x.dtype
    _, r_op, split = rank_r_operands(x.new_empty(0, r, dtype=torch.float32), lora_B.t(), scale, bias, x.dtype, pieces,
                                     True, split=lora_A if cast else None, zeroed=counts if fixed_order else work)
    shrink_weight = tma_aligned((split if cast else lora_A.contiguous()).reshape(-1, K))  # [3r|r, K]
    s, parts = s.view(torch.float32).view(M, r), parts.view(torch.float32)
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    dtype = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    shrink_box = [_shrink_rows(r, pieces), BLOCK_K]

    def descriptor(t, box):
        return TensorDescriptor.from_tensor(t, box, gl.NVMMASharedLayout.get_default_for(box, dtype))

    def launch():  # the descriptors inside: an input they refuse falls back too
        _gemm_shrink_rank_r[(programs,)](
            descriptor(x, [BLOCK_M, BLOCK_K]), descriptor(weight, [BLOCK_N, BLOCK_K]),
            descriptor(shrink_weight, shrink_box), descriptor(r_op, [BLOCK_N, BLOCK_K]),
            descriptor(y, [BLOCK_M, BLOCK_N]), s, parts, counts, M, N, K, r, scale, contributors,
            RANK_STEPS=triton.cdiv(width, BLOCK_K), R=r, PIECES=pieces, BIAS_COLUMNS=bias_columns,
            NUM_BUFFERS=NUM_BUFFERS, GROUP_M=GROUP_M, START=START, LEAD=LEAD, FIXED_ORDER=fixed_order,
            SUM_UNROLL=max(1, 64 // r), num_warps=WARPS)  # 64 // r parts' loads in flight: no spills up to r = 64

    # each variant on its own: one that fails to compile falls back without turning the other off
    ran = launch_or_fall_back(f"_gemm_shrink_rank_r{'_fixed_order' if fixed_order else ''}", launch)
    return (y, s) if ran else None
