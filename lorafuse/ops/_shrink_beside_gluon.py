"""The layer's forward without dropout on Hopper, the shrink s = x A^T run beside the GEMM on the SMs that the GEMM's
last wave leaves idle (Gluon). Its references are lora_shrink_reference and lora_matmul_reference.

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

`python benchmarks/probe_shrink_matmul.py` (H100, 8192 rows, r = 16, x cuBLAS's GEMM alone; results/
shrink_matmul.csv), the shrink inside the GEMM -> beside, float32 / bf16 adapters: 4096 -> 4096 1.102 -> 1.050 /
1.076 -> 1.036; 4096 -> 14336 1.067 -> 1.032 / 1.053 -> 1.030; 14336 -> 4096 1.057 -> 1.025 / 0.999 -> 1.008; 2048 ->
8192 1.090 -> 1.035 / 1.075 -> 1.041. With one set of warps in the stream it lost with float32 adapters at 4096 ->
4096 (1.118) and 14336 -> 4096 (1.102) (benchmarks/NOTES_lora_layer.md).
"""
import torch
import triton
import triton.language as tl

from ._bf16_pieces import uses_bf16_pieces
from ._gluon import (TensorDescriptor, fence_proxy_async_global, gl, gluon, launch_or_fall_back, mbarrier,
                     ready_barriers, tma, tma_aligned, warpgroup_mma, warpgroup_mma_wait)
from ._lora_matmul_gluon import (BLOCK_M, BLOCK_N, LOAD_REGISTERS, gemm_rank_r_packed, rank_r_operands,
                                 rank_r_width)
from ._shrink_grad_beside_gluon import (GEMM_FLOPS_PER_S, STREAM_BLOCK, STREAM_BYTES_PER_S, STREAM_RING_BYTES,
                                        STREAM_WARPS, same_waves_programs)
from ._shrink_matmul_gluon import _shrink_rows, shrink_matmul_ready
from ._tiles import sm_count

STREAM_K = STREAM_BLOCK[1]  # x's box: BLOCK_M rows (one GEMM row block, one count) by STREAM_K columns
MAX_SHRINK_ROWS = 64  # lora_A's rows (or pieces' rows) a step: two [128, 64] float32 sums in registers
# The stream's predicted time over the GEMM's, at most. At STREAM_BYTES_PER_S the probe's shapes predict 0.21-0.89,
# and the stream won at every one of them but 14336 -> 4096 with bf16 adapters (0.72; within 0.01) (H100, layer bench
# at 1.0 against 0.8, NOTES_lora_layer.md)
MAX_STREAM_SHARE = 1.0


def _ring_slots(shrink_rows: int) -> int:
    return STREAM_RING_BYTES // ((BLOCK_M + shrink_rows) * STREAM_K * 2)


if gluon is not None:
    @gluon.jit
    def _stream_steps(M, K, BM: gl.constexpr, BK: gl.constexpr):
        # (K-steps a row block, this program's steps: its row blocks p, p + programs, ... times the K-steps)
        k_steps = gl.cdiv(K, BK)
        return k_steps, gl.cdiv(gl.cdiv(M, BM) - gl.program_id(0), gl.num_programs(0)) * k_steps

    @gluon.jit
    def _stream_loads(x_desc, la_desc, x_ring, la_ring, ready, empty, M, K):
        # _shrink_stream's load warp: step i -> (row block, K-step) by TMA into slot i % slots, once the MMA warps
        # have released it (`empty`)
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        slots: gl.constexpr = x_ring.type.shape[0]
        k_steps, steps = _stream_steps(M, K, BM, BK)
        for i in range(steps):
            index = i % slots
            mbarrier.wait(empty.index(index), (i // slots & 1) ^ 1)  # at first: free already
            bar = ready.index(index)
            row = (gl.program_id(0) + i // k_steps * gl.num_programs(0)) * BM
            k = i % k_steps * BK
            mbarrier.expect(bar, x_desc.block_type.nbytes + la_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [row, k], bar, x_ring.index(index))
            tma.async_copy_global_to_shared(la_desc, [0, k], bar, la_ring.index(index))

    @gluon.jit
    def _stream_mmas(x_ring, la_ring, ready, empty, s_ptr, l_ptr, count_ptr, M, K, width, scale, R: gl.constexpr,
                     PIECES: gl.constexpr, BIAS_COLUMNS: gl.constexpr):
        # _shrink_stream's MMA warps: each step's product once its slot is loaded, the slot released once the MMA
        # has read it, the product added in float32 registers; at a row block's last step its rows stored
        slots: gl.constexpr = x_ring.type.shape[0]
        BM: gl.constexpr = x_ring.type.shape[1]
        BK: gl.constexpr = x_ring.type.shape[2]
        SHRINK_ROWS: gl.constexpr = la_ring.type.shape[1]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                             instr_shape=[16, SHRINK_ROWS, 16])
        k_steps, steps = _stream_steps(M, K, BM, BK)
        total = gl.zeros((BM, SHRINK_ROWS), gl.float32, acc_layout)
        for i in range(steps):
            index = i % slots
            mbarrier.wait(ready.index(index), i // slots & 1)
            part = warpgroup_mma(x_ring.index(index), la_ring.index(index).permute((1, 0)),
                                 gl.zeros((BM, SHRINK_ROWS), gl.float32, acc_layout), use_acc=False, is_async=True)
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
            mbarrier.arrive(empty.index(index))
            k_step = i % k_steps
            total = gl.where(k_step == 0, part, total + part)
            if k_step == k_steps - 1:
                block = gl.program_id(0) + i // k_steps * gl.num_programs(0)
                _store_row_block(total, s_ptr, l_ptr, count_ptr, block, M, width, scale, R, PIECES, BIAS_COLUMNS,
                                 gl.num_warps())

    @gluon.jit
    def _shrink_stream(x_desc, la_desc, s_ptr, l_ptr, count_ptr, M, K, width, scale, R: gl.constexpr,
                       PIECES: gl.constexpr, BIAS_COLUMNS: gl.constexpr, SLOTS: gl.constexpr,
                       LOAD_REGISTERS: gl.constexpr, num_warps: gl.constexpr):
        # x: [M, K] in [BM, BK] boxes; LA: lora_A's pieces [3 R, K] (PIECES) or lora_A [R, K] in x's dtype, in
        # [SHRINK_ROWS, BK] boxes; s: [M, R] fp32; L: [M, width] in x's dtype; count: [row blocks] int32, zeroed.
        # Warp-specialised: one warp issues the TMA loads up to SLOTS steps ahead (_stream_loads), the num_warps
        # warps run the MMAs, the sums and the stores (_stream_mmas).
        tl.extra.cuda.gdc_launch_dependents()  # the GEMM may start once every program of this one has
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        SHRINK_ROWS: gl.constexpr = la_desc.block_type.shape[0]
        x_ring = gl.allocate_shared_memory(x_desc.dtype, [SLOTS, BM, BK], x_desc.layout)
        la_ring = gl.allocate_shared_memory(x_desc.dtype, [SLOTS, SHRINK_ROWS, BK], la_desc.layout)
        ready = ready_barriers(SLOTS)  # a slot's loads have landed
        empty = ready_barriers(SLOTS)  # a slot's MMA has completed: the load warp may refill it
        gl.warp_specialize([(_stream_mmas, (x_ring, la_ring, ready, empty, s_ptr, l_ptr, count_ptr, M, K, width,
                                            scale, R, PIECES, BIAS_COLUMNS)),
                            (_stream_loads, (x_desc, la_desc, x_ring, la_ring, ready, empty, M, K))], [1],
                           [LOAD_REGISTERS])

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


def shrink_matmul_beside(x, weight, lora_A, lora_B, scale, bias):
    """(y, s) as _shrink_matmul_gluon.shrink_matmul_gluon: y = x W^T + scale * s B^T + bias, s = x A^T (fp32), with
    the shrink streamed beside the GEMM. None where no SM is free, the stream would not stay ahead, the kernels do
    not take the operands, or one failed its first launch (logged once)."""
    # x: [M, K], weight: [N, K], lora_A: [r, K], lora_B: [N, r], bias: [N] or None
    M, K = x.shape
    N, r = weight.shape[0], lora_A.shape[0]
    pieces = uses_bf16_pieces(x.dtype, lora_A.dtype)
    shrink_rows = _shrink_rows(r, pieces)
    if not (shrink_matmul_ready(x, weight, lora_A, lora_B, bias) and shrink_rows <= MAX_SHRINK_ROWS
            and K * x.element_size() % 16 == 0):  # lora_A's pieces, K wide, read by TMA: 16-byte row strides
        return None
    sms = sm_count(x.device)
    blocks_m = triton.cdiv(M, BLOCK_M)
    programs = same_waves_programs(blocks_m * triton.cdiv(N, BLOCK_N), sms)
    stream_programs = min(sms - programs, blocks_m)
    stream_s = x.numel() * x.element_size() / (max(stream_programs, 1) * STREAM_BYTES_PER_S[pieces])
    if stream_programs == 0 or stream_s > MAX_STREAM_SHARE * 2 * M * N * K / GEMM_FLOPS_PER_S:
        return None
    bias_columns = 0 if bias is None else 1 if bias.dtype == x.dtype else 2
    width = rank_r_width(r, pieces, bias_columns)
    counts = torch.empty(blocks_m, device=x.device, dtype=torch.int32)
    cast = lora_A.dtype != x.dtype
    # one launch: R, lora_A's bf16 pieces (or its cast: LORAFUSE_ADAPTER_MATH=fast), the zeroed counts
    _, r_op, split = rank_r_operands(x.new_empty(0, r, dtype=torch.float32), lora_B.t(), scale, bias, x.dtype, pieces,
                                     True, split=lora_A if cast else None, zeroed=counts)
    shrink_weight = tma_aligned((split if cast else lora_A.contiguous()).reshape(-1, K))  # [3r | r, K]
    s = torch.empty(M, r, device=x.device, dtype=torch.float32)
    left = torch.empty(M, width, device=x.device, dtype=x.dtype)
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    dtype = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    x_box, la_box = [BLOCK_M, STREAM_K], [shrink_rows, STREAM_K]
    x_desc = TensorDescriptor.from_tensor(x, x_box, gl.NVMMASharedLayout.get_default_for(x_box, dtype))
    la_desc = TensorDescriptor.from_tensor(shrink_weight, la_box, gl.NVMMASharedLayout.get_default_for(la_box, dtype))
    slots = _ring_slots(shrink_rows)
    ran = launch_or_fall_back(
        f"_shrink_stream(pieces={pieces}, r={r}, bias_columns={bias_columns}, dtype={x.dtype})",
        lambda: _shrink_stream[(stream_programs,)](x_desc, la_desc, s, left, counts, M, K, width, scale, R=r,
                                                   PIECES=pieces, BIAS_COLUMNS=bias_columns, SLOTS=slots,
                                                   LOAD_REGISTERS=LOAD_REGISTERS, num_warps=STREAM_WARPS))
    ran = ran and gemm_rank_r_packed(x, weight.t(), left, r_op, y, programs, row_counts=counts)
    return (y, s) if ran else None
