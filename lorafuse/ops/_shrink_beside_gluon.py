"""The layer's forward on Hopper, the shrink s = dropout(x) A^T run beside the GEMM on the SMs that the GEMM's last
wave leaves idle (Gluon). Its references are lora_shrink_reference and lora_matmul_reference.

Why: as for dA beside the dx GEMM (_shrink_grad_beside_gluon.py, whose docstring has the waves), the GEMM's tiles fit
on fewer programs in as many waves, and the SMs left free can stream x for the shrink at no cost to the GEMM. Inside
the GEMM (_shrink_matmul_gluon.py) the shrink costs its tiles about 5 % (a small MMA a step, and one set of warps:
that kernel is not warp-specialised); as its own pass before the GEMM, a read of x (16-80 us at 8192 rows).

How: a packing launch (R, lora_A's bf16 pieces, the zeroed counts); then `_shrink_stream` on the free SMs: each
program takes row blocks p, p + programs, ... in order and streams the row block's x through a TMA ring against
lora_A's pieces side by side (warp-specialised: one warp issues the loads; the others run one wgmma a step and add
each step's product in float32 registers, as the fused kernels' precision rule), then stores s's rows (fp32), L's
rows (scale * s as the GEMM's rank-r operand: bf16 pieces [l0 | l1 | l0], or s in x's dtype, then the bias columns'
ones, as rank_r_operands packs them) and counts the row block in.
The GEMM (_lora_matmul_gluon's warp-specialised _gemm_rank_r on same_waves_programs programs) is launched as the
stream's programmatic dependent: it starts once every stream program has started, so its waits are only ever on
running programs, and its load warp waits for a row block's count before the tile's rank-r steps, the last of its
K-loop. No atomics but the counts: the same bits every run, as inference and deterministic algorithms need.
- A stream program takes over half an SM's shared memory, a GEMM program 208 KiB: they never share an SM.
- The first wave's tiles need the first row blocks by the end of their K-loop, and each wave as many row blocks
  more: the route is taken only where the stream is predicted to stay ahead (MAX_STREAM_SHARE).

With dropout the mask's Philox draws bound the stream: 24-31 GB/s of x an SM against 51-82 without (H100, 4 programs
alone), too slow to shrink all of x within the GEMM at most shapes. So the stream takes only the row blocks it can
make in time, from the end; lora_shrink's masked pass shrinks the head before it on every SM (head_row_blocks), and
the packing launch writes the head's L rows. The stream's warps (8: the draws take most of their issue slots) draw
each step's mask, read x's box from shared memory into registers (THREAD_COLUMNS), mask it there and give it to the
MMA as its register operand; lora_A's pieces come with their columns in that operand's order.

`python benchmarks/probe_shrink_matmul.py` (H100, 8192 rows, r = 16, x cuBLAS's GEMM alone; results/
shrink_matmul.csv), the shrink inside the GEMM -> beside, float32 / bf16 adapters: 4096 -> 4096 1.102 -> 1.050 /
1.076 -> 1.036; 4096 -> 14336 1.067 -> 1.032 / 1.053 -> 1.030; 14336 -> 4096 1.057 -> 1.025 / 0.999 -> 1.008; 2048 ->
8192 1.090 -> 1.035 / 1.075 -> 1.041. With one set of warps in the stream it lost with float32 adapters at 4096 ->
4096 (1.118) and 14336 -> 4096 (1.102). With dropout (p 0.05), lora_shrink's masked pass then the GEMM -> the head
and the stream, float32 / bf16 adapters: 4096 -> 4096 1.137 -> 1.135 / 1.137 -> 1.114; 4096 -> 14336 1.054 -> 1.050 /
1.049 -> 1.039; 14336 -> 4096 1.092 -> 1.069 / 1.077 -> 1.055; 2048 -> 8192 1.089 -> 1.087 / 1.069 -> 1.066: the head
takes 8-38 of the 64 row blocks there (benchmarks/NOTES_lora_layer.md, twenty-fourth session).
"""
import torch
import triton
import triton.language as tl

from ._bf16_pieces import uses_bf16_pieces
from ._gluon import (TensorDescriptor, failed, fence_proxy_async_global, gl, gluon, launch_or_fall_back, mbarrier,
                     ready_barriers, tma, tma_aligned, warpgroup_mma, warpgroup_mma_wait)
from ._lora_matmul_gluon import (BLOCK_M, BLOCK_N, GROUP_M, LOAD_REGISTERS, gemm_rank_r_failed, gemm_rank_r_packed,
                                 rank_r_operands, rank_r_width)
from ._shrink_grad_beside_gluon import (GEMM_FLOPS_PER_S, STREAM_BLOCK, STREAM_BYTES_PER_S, STREAM_RING_BYTES,
                                        STREAM_WARPS, same_waves_programs)
from ._shrink_matmul_gluon import _shrink_rows, shrink_matmul_ready
from ._tiles import sm_count
from .dropout import PHILOX_ROUNDS, dropout_args
from .lora_shrink import lora_shrink

STREAM_K = STREAM_BLOCK[1]  # x's box: BLOCK_M rows (one GEMM row block, one count) by STREAM_K columns
MAX_SHRINK_ROWS = 64  # lora_A's rows (or pieces' rows) a step: two [128, 64] float32 sums in registers
# The stream's predicted time over the GEMM's, at most. At STREAM_BYTES_PER_S the probe's shapes predict 0.21-0.89,
# and the stream won at every one of them but 14336 -> 4096 with bf16 adapters (0.72; within 0.01) (H100, layer bench
# at 1.0 against 0.8, NOTES_lora_layer.md)
MAX_STREAM_SHARE = 1.0
# Bytes of x a stream program masks and reads a second beside the GEMM (H100; float32 adapters as pieces, or 16-bit
# ones): alone it streamed 24-27 and 29-31 GB/s (NOTES_lora_layer.md, twenty-fourth session)
MASKED_STREAM_BYTES_PER_S = {True: 20e9, False: 24e9}
# Fewer row blocks left to stream, and the route declines: too few to pay for the stream's launch (a guess, not
# measured)
MIN_STREAMED_BLOCKS = 8
MASKED_WARPS = 8  # with dropout: two warpgroups issue the mask's draws, the stream's bound (4 warps were not tried)


def _ring_slots(shrink_rows: int) -> int:
    return STREAM_RING_BYTES // ((BLOCK_M + shrink_rows) * STREAM_K * 2)


if gluon is not None:
    from ._shrink_backward_gluon import _keep  # a Gluon function: defined only where Triton has Gluon's Hopper API

    @gluon.jit
    def _stream_steps(M, K, first_block, BM: gl.constexpr, BK: gl.constexpr):
        # (K-steps a row block, this program's steps: its row blocks first_block + p, + programs, ... times the
        # K-steps)
        k_steps = gl.cdiv(K, BK)
        return k_steps, gl.cdiv(gl.cdiv(M, BM) - first_block - gl.program_id(0), gl.num_programs(0)) * k_steps

    @gluon.jit
    def _row_block(i, k_steps, first_block):
        # the row block of this program's step i
        return first_block + gl.program_id(0) + i // k_steps * gl.num_programs(0)

    @gluon.jit
    def _stream_loads(x_desc, la_desc, x_ring, la_ring, ready, empty, M, K, first_block):
        # _shrink_stream's load warp: step i -> (row block, K-step) by TMA into slot i % slots, once the MMA warps
        # have released it (`empty`)
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        slots: gl.constexpr = x_ring.type.shape[0]
        k_steps, steps = _stream_steps(M, K, first_block, BM, BK)
        for i in range(steps):
            index = i % slots
            mbarrier.wait(empty.index(index), (i // slots & 1) ^ 1)  # at first: free already
            bar = ready.index(index)
            row = _row_block(i, k_steps, first_block) * BM
            k = i % k_steps * BK
            mbarrier.expect(bar, x_desc.block_type.nbytes + la_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [row, k], bar, x_ring.index(index))
            tma.async_copy_global_to_shared(la_desc, [0, k], bar, la_ring.index(index))

    # With dropout, x's box ([128, 128]) in the MMA warps' registers (8 warps): warp w holds rows 16w..,
    # lane (g, t) rows 16w + g and + 8, columns 64c + 16t..64c + 16t + 15 (two Philox calls a row and 64 columns:
    # dropout's draws, none wasted). Relabelled as operand column 64c + 16c' + 8b + 2t + h for x's column
    # 64c + 16t + 4c' + 2b + h (lora_A's pieces come in that order: _lora_matmul_gluon.register_order_column), it is
    # the warpgroup MMA's register operand layout: the lanes and registers hold what that layout's would.
    THREAD_COLUMNS = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [8, 0], [0, 2], [0, 4], [0, 8], [0, 64]],
        lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0], [64, 0]],
        block_bases=[], shape=[BLOCK_M, STREAM_K]))
    # its Philox calls, [BLOCK_M, STREAM_K // 8] column groups: a lane's groups 8c + 2t, + 1 of rows 16w + g, + 8
    THREAD_WORDS = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [8, 0], [0, 8]], lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0], [64, 0]], block_bases=[], shape=[BLOCK_M, STREAM_K // 8]))

    @gluon.jit
    def _masked_operand(x_slot, keep, operand_layout: gl.constexpr):
        # x's box read into registers (THREAD_COLUMNS), masked there, and relabelled (no data moves: column
        # 64c + 16t + 4c' + 2b + h -> 64c + 16c' + 8b + 2t + h) as the warpgroup MMA's register operand
        BM: gl.constexpr = x_slot.type.shape[0]
        BK: gl.constexpr = x_slot.type.shape[1]
        gl.static_assert(gl.num_warps() == 8 and BM == 128 and BK == 128, "THREAD_COLUMNS: 8 warps, [128, 128] boxes")
        x = x_slot.load(THREAD_COLUMNS) * keep
        x = gl.reshape(gl.permute(gl.reshape(x, [BM, BK // 64, 4, 4, 2, 2]), (0, 1, 3, 4, 2, 5)), [BM, BK])
        return gl.convert_layout(x, operand_layout, assert_trivial=True)

    @gluon.jit
    def _stream_mmas(x_ring, la_ring, ready, empty, s_ptr, l_ptr, count_ptr, seed_ptr, M, K, first_block, width,
                     scale, threshold, drop_scale, R: gl.constexpr, PIECES: gl.constexpr, BIAS_COLUMNS: gl.constexpr,
                     MASKED: gl.constexpr, ROUNDS: gl.constexpr):
        # _shrink_stream's MMA warps: each step's product once its slot is loaded, the slot released once the MMA
        # has read it, the product added in float32 registers; at a row block's last step its rows stored. MASKED:
        # each step's mask is drawn while its slot's loads land (drawn while the MMA before ran instead, the stream
        # was 15-20 % slower: more registers live), and the MMA takes x's masked box from registers
        slots: gl.constexpr = x_ring.type.shape[0]
        BM: gl.constexpr = x_ring.type.shape[1]
        BK: gl.constexpr = x_ring.type.shape[2]
        SHRINK_ROWS: gl.constexpr = la_ring.type.shape[1]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                             instr_shape=[16, SHRINK_ROWS, 16])
        k_steps, steps = _stream_steps(M, K, first_block, BM, BK)
        total = gl.zeros((BM, SHRINK_ROWS), gl.float32, acc_layout)
        for i in range(steps):
            index = i % slots
            if MASKED:
                row = _row_block(i, k_steps, first_block) * BM
                keep = _keep(seed_ptr, row, i % k_steps * BK, threshold, BM, BK, THREAD_WORDS, THREAD_COLUMNS,
                             x_ring.dtype, ROUNDS)
            mbarrier.wait(ready.index(index), i // slots & 1)
            if MASKED:
                x = _masked_operand(x_ring.index(index), keep,
                                    gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2))
            else:
                x = x_ring.index(index)
            part = warpgroup_mma(x, la_ring.index(index).permute((1, 0)),
                                 gl.zeros((BM, SHRINK_ROWS), gl.float32, acc_layout), use_acc=False, is_async=True)
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
            mbarrier.arrive(empty.index(index))
            k_step = i % k_steps
            total = gl.where(k_step == 0, part, total + part)
            if k_step == k_steps - 1:
                done = total
                if MASKED:
                    done = total * drop_scale
                block = _row_block(i, k_steps, first_block)
                _store_row_block(done, s_ptr, l_ptr, count_ptr, block, M, width, scale, R, PIECES, BIAS_COLUMNS,
                                 gl.num_warps())

    @gluon.jit
    def _shrink_stream(x_desc, la_desc, s_ptr, l_ptr, count_ptr, seed_ptr, M, K, first_block, width, scale,
                       threshold, drop_scale, R: gl.constexpr, PIECES: gl.constexpr, BIAS_COLUMNS: gl.constexpr,
                       MASKED: gl.constexpr, ROUNDS: gl.constexpr, SLOTS: gl.constexpr, LOAD_REGISTERS: gl.constexpr,
                       num_warps: gl.constexpr):
        # x: [M, K] in [BM, BK] boxes; LA: lora_A's pieces [3 R, K] (PIECES) or lora_A [R, K] in x's dtype (with
        # MASKED: their columns in register order, padded to a multiple of 64), in [SHRINK_ROWS, BK] boxes; s: [M, R]
        # fp32; L: [M, width] in x's dtype; count: [row blocks] int32, zeroed; seed: int64 [1] (MASKED: dropout's
        # keep decisions against `threshold`, kept values scaled by drop_scale). The row blocks before first_block
        # are the head: their s and L rows were written before this launch, and program 0 counts them in. The rest
        # are streamed, warp-specialised: one warp issues the TMA loads up to SLOTS steps ahead (_stream_loads), the
        # num_warps warps run the masks, the MMAs, the sums and the stores (_stream_mmas).
        tl.extra.cuda.gdc_launch_dependents()  # the GEMM may start once every program of this one has
        if gl.program_id(0) == 0:
            head_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
            for start in range(0, first_block, 32 * num_warps):
                blocks = start + gl.arange(0, 32 * num_warps, layout=head_layout)
                gl.store(count_ptr + blocks, gl.full([32 * num_warps], 1, gl.int32, head_layout),
                         mask=blocks < first_block)
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        SHRINK_ROWS: gl.constexpr = la_desc.block_type.shape[0]
        x_ring = gl.allocate_shared_memory(x_desc.dtype, [SLOTS, BM, BK], x_desc.layout)
        la_ring = gl.allocate_shared_memory(x_desc.dtype, [SLOTS, SHRINK_ROWS, BK], la_desc.layout)
        ready = ready_barriers(SLOTS)  # a slot's loads have landed
        empty = ready_barriers(SLOTS)  # a slot's MMA has completed: the load warp may refill it
        gl.warp_specialize([(_stream_mmas, (x_ring, la_ring, ready, empty, s_ptr, l_ptr, count_ptr, seed_ptr, M, K,
                                            first_block, width, scale, threshold, drop_scale, R, PIECES,
                                            BIAS_COLUMNS, MASKED, ROUNDS)),
                            (_stream_loads, (x_desc, la_desc, x_ring, la_ring, ready, empty, M, K, first_block))],
                           [1], [LOAD_REGISTERS])

    @gluon.jit
    def _store_row_block(total, s_ptr, l_ptr, count_ptr, block, M, width, scale, R: gl.constexpr,
                         PIECES: gl.constexpr, BIAS_COLUMNS: gl.constexpr, num_warps: gl.constexpr):
        # total: [BM, SHRINK_ROWS] fp32 = x's row block @ LA^T. s's rows = the sum of its R-column groups that hold
        # the pieces (3, or 1; the columns past them, against TMA's zero rows, are left out: x's infinities would make
        # NaNs there); L's rows as rank_r_operands packs them; then the count (release)
        BM: gl.constexpr = total.type.shape[0]
        SHRINK_ROWS: gl.constexpr = total.type.shape[1]
        dtype: gl.constexpr = l_ptr.dtype.element_ty
        s_tile = total
        if SHRINK_ROWS > R:
            grouped = gl.reshape(total, [BM, SHRINK_ROWS // R, R])
            group = gl.arange(0, SHRINK_ROWS // R, layout=gl.SliceLayout(0, gl.SliceLayout(2, grouped.type.layout)))
            s_tile = gl.sum(gl.where((group < (3 if PIECES else 1))[None, :, None], grouped, 0.0), axis=1)
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (R // 4), R // 4], [num_warps, 1], [1, 0])
        s_tile = gl.convert_layout(s_tile, layout)
        rows = block * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))[:, None]
        ranks = gl.arange(0, R, layout=gl.SliceLayout(0, layout))[None, :]
        in_rows = rows < M
        gl.store(s_ptr + rows * R + ranks, s_tile, mask=in_rows)
        low = s_tile * scale
        high = low.to(dtype)
        gl.store(l_ptr + rows * width + ranks, high, mask=in_rows)
        groups: gl.constexpr = 3 if PIECES else 1
        if PIECES:  # [l0 | l1 | l0]: R pairs them with [r0; r0; r1] (_lora_matmul_gluon's docstring)
            gl.store(l_ptr + rows * width + R + ranks, (low - high.to(gl.float32)).to(dtype), mask=in_rows)
            gl.store(l_ptr + rows * width + 2 * R + ranks, high, mask=in_rows)
        if BIAS_COLUMNS > 0:  # ones against the bias's pieces, then zeros to the width (a multiple of 8)
            tail_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [num_warps, 1], [1, 0])
            tail_rows = block * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, tail_layout))[:, None]
            tail = gl.arange(0, 8, layout=gl.SliceLayout(0, tail_layout))[None, :]
            ones = gl.where(tail < BIAS_COLUMNS, 1.0, 0.0) + gl.zeros((BM, 8), gl.float32, tail_layout)
            gl.store(l_ptr + tail_rows * width + groups * R + tail, ones.to(dtype), mask=tail_rows < M)
        fence_proxy_async_global()  # the GEMM reads L's rows by TMA
        gl.thread_barrier()  # every warp's stores before the count
        gl.atomic_add(count_ptr + block, 1, sem="release", scope="gpu")


def shrink_matmul_beside(x, weight, lora_A, lora_B, scale, bias, dropout_p=0.0, seed=None):
    """(y, s) as _shrink_matmul_gluon.shrink_matmul_gluon: y = x W^T + scale * s B^T + bias, s = dropout(x) A^T (fp32),
    with the shrink streamed beside the GEMM; with dropout_p > 0, x's mask drawn from seed (int64 [1]) as every kernel
    draws it (dropout.keep_mask_reference), and the head's rows (head_row_blocks) shrunk by lora_shrink first. None
    where no SM is free, the stream would not stay ahead, the kernels do not take the operands, or one failed its
    first launch (logged once)."""
    # x: [M, K], weight: [N, K], lora_A: [r, K], lora_B: [N, r], bias: [N] or None
    M, K = x.shape
    N, r = weight.shape[0], lora_A.shape[0]
    pieces = uses_bf16_pieces(x.dtype, lora_A.dtype)
    masked = dropout_p > 0.0
    shrink_rows = _shrink_rows(r, pieces)
    if not (shrink_matmul_ready(x, weight, lora_A, lora_B, bias) and shrink_rows <= MAX_SHRINK_ROWS
            and K * x.element_size() % 16 == 0):  # lora_A's pieces, K wide, read by TMA: 16-byte row strides
        return None
    sms = sm_count(x.device)
    blocks_m = triton.cdiv(M, BLOCK_M)
    programs = same_waves_programs(blocks_m * triton.cdiv(N, BLOCK_N), sms)
    stream_programs = min(sms - programs, blocks_m)
    gemm_s = 2 * M * N * K / GEMM_FLOPS_PER_S
    if masked:
        head = head_row_blocks(blocks_m, stream_programs, BLOCK_M * K * x.element_size(), gemm_s, pieces)
        if head is None:
            return None
    else:
        head = 0
        stream_s = x.numel() * x.element_size() / (max(stream_programs, 1) * STREAM_BYTES_PER_S[pieces])
        if stream_programs == 0 or stream_s > MAX_STREAM_SHARE * gemm_s:
            return None
    bias_columns = 0 if bias is None else 1 if bias.dtype == x.dtype else 2
    width = rank_r_width(r, pieces, bias_columns)
    stream_key = (f"_shrink_stream(pieces={pieces}, r={r}, bias_columns={bias_columns}, dtype={x.dtype}, "
                  f"masked={masked})")
    if failed(stream_key) or gemm_rank_r_failed(weight.t(), width, True):  # no head, nor a stream, before a fallback
        return None
    head_rows = head * BLOCK_M  # below M: head_row_blocks leaves the stream MIN_STREAMED_BLOCKS at least
    s = torch.empty(M, r, device=x.device, dtype=torch.float32)
    s_head = lora_shrink(x[:head_rows], lora_A, dropout_p, seed, out=s[:head_rows]) if head_rows else s[:0]
    left = torch.empty(M, width, device=x.device, dtype=x.dtype)
    counts = torch.empty(blocks_m, device=x.device, dtype=torch.int32)
    copied = lora_A.dtype != x.dtype or masked
    # one launch: the head's L rows, R, lora_A's bf16 pieces (or its cast: LORAFUSE_ADAPTER_MATH=fast; with dropout,
    # in the masked stream's register order), the zeroed counts
    _, r_op, split = rank_r_operands(s_head, lora_B.t(), scale, bias, x.dtype, pieces, True,
                                     split=lora_A if copied else None, zeroed=counts, split_register_order=masked,
                                     left=left[:head_rows])
    # [3r | r, K] (with dropout K padded to a multiple of 64)
    shrink_weight = tma_aligned(split.reshape(-1, split.shape[-1]) if copied else lora_A.contiguous())
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    dtype = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    x_box, la_box = [BLOCK_M, STREAM_K], [shrink_rows, STREAM_K]
    x_desc = TensorDescriptor.from_tensor(x, x_box, gl.NVMMASharedLayout.get_default_for(x_box, dtype))
    la_desc = TensorDescriptor.from_tensor(shrink_weight, la_box, gl.NVMMASharedLayout.get_default_for(la_box, dtype))
    threshold, drop_scale = dropout_args(dropout_p)
    slots = _ring_slots(shrink_rows)
    ran = launch_or_fall_back(
        stream_key,
        lambda: _shrink_stream[(min(stream_programs, blocks_m - head),)](
            x_desc, la_desc, s, left, counts, seed if masked else counts, M, K, head, width, scale, threshold,
            drop_scale, R=r, PIECES=pieces, BIAS_COLUMNS=bias_columns, MASKED=masked, ROUNDS=PHILOX_ROUNDS,
            SLOTS=slots, LOAD_REGISTERS=LOAD_REGISTERS, num_warps=MASKED_WARPS if masked else STREAM_WARPS))
    ran = ran and gemm_rank_r_packed(x, weight.t(), left, r_op, y, programs, row_counts=counts)
    return (y, s) if ran else None


def head_row_blocks(blocks_m: int, stream_programs: int, block_bytes: int, gemm_s: float, pieces: bool) -> int | None:
    """With dropout: how many row blocks, from the first, lora_shrink's masked pass shrinks before the stream and the
    GEMM start; None where the stream would take too few to pay for its launch. The head holds the GEMM's first
    group of row blocks (GROUP_M: its first wave's tiles need them by the end of their K-loop, sooner than a few
    stream programs make them) and the row blocks that the stream would not make within the GEMM's time."""
    streamed = int(stream_programs * MASKED_STREAM_BYTES_PER_S[pieces] * gemm_s / block_bytes)
    head = max(GROUP_M, blocks_m - streamed)
    return head if blocks_m - head >= MIN_STREAMED_BLOCKS else None
