"""The layer's backward without dropout on Hopper, dA = ds^T x run beside the dx GEMM on the SMs that the GEMM's last
wave leaves idle (Gluon). Its references are lora_matmul_reference (dx) and lora_shrink_backward's (dA = ds^T x).

Why: a persistent GEMM of T output tiles on S SMs takes cdiv(T, S) waves, and its time follows whole waves: at 8192
rows the layer's GEMMs have 7.76, 27.15, 15.52 or 3.88 waves of 128 x 256 tiles on 132 SMs, and 7.76 take as long
as 8 (benchmarks/probe_waves.py). The same waves fit on cdiv(T, waves) programs, 128 at every one of those shapes,
in the same time (measured), and 4 SMs are free for the GEMM's whole length. dA's pass over x (64 MB at 8192 x 4096)
fits there if it streams fast enough: then it costs nothing, where inside the dx GEMM its steps cost 2-5 % of it
(_lora_matmul_gluon.dx_and_shrink_grad_gluon).

How: one pack of L = ds's pieces side by side ([l0 | l1 | l0 | l2], or ds in x's dtype) and R (rank_r_operands with
all_low_pieces); the dx GEMM (_gemm_rank_r, L and R as its last K-steps) on `same_waves_programs` programs; on a
second stream at the same time `_shrink_grad_stream` on the free SMs. Each stream program owns column blocks p, p +
programs, ... of x and walks all rows. It is warp-specialised: one warp issues TMA loads of x's [128, 128] box and
L's [128, W] box into a ring; the other warps run one wgmma a step (acc [128, W] = x^T L: x's box transposed in
shared memory) and add each step's product in float32 registers (the precision rule of the fused kernels; chained
in the tensor cores over a column's 64 steps, dA's error to float64 grew from 1.9e-7 to 9.1e-6); at the column
block's end the groups l0, l1, l2 are summed and stored as dA's columns. No atomics: dA's bits are the same run after
run.
- The ring takes over half an SM's shared memory, and a GEMM program 208 KiB: a stream program shares its SM with
  neither, so it lands on a free SM whichever kernel starts first. Nothing waits for it: if other work holds the
  SMs, it runs after the GEMM, slower but never stuck.
- Bytes of x an SM streams a second (8192 x 4096, r = 16, 4 programs alone; one-off probes,
  benchmarks/NOTES_lora_layer.md, twenty-third session): with one set of warps 56 GB/s with float32 adapters (N =
  64) and 70 with bf16 ones (N = 16) on an H100; warp-specialised 57 and 84 on an H200 (53 and 76 there with one
  set). Each step's waits bound it, not the bytes in flight: 3 to 5 slots read the same. The route is taken only
  where the pass is predicted to end within the GEMM.

`python benchmarks/probe_shrink_grad_gemm.py` (H100, 8192 rows, r = 16, packing included, x cuBLAS's g W alone;
results/shrink_grad_gemm.csv), the fused dx GEMM -> this route, float32 / bf16 adapters: 4096 -> 4096 1.090 -> 1.045
/ 1.064 -> 1.033; 4096 -> 14336 1.021 -> 1.009 / 1.018 -> 1.010; 14336 -> 4096 1.085 -> 1.048 / 1.060 -> 1.037;
2048 -> 8192 1.049 -> 1.027 / 1.039 -> 1.023.
"""
import functools

import torch
import triton

from ._gluon import TensorDescriptor, gl, gluon, launch_or_fall_back, mbarrier, ready_barriers, tma, warpgroup_mma, \
    warpgroup_mma_wait
from ._lora_matmul_gluon import (BLOCK_M, BLOCK_N, LOAD_REGISTERS, gemm_rank_r_failed, gemm_rank_r_packed,
                                 gluon_gemm_ready, rank_r_operands, rank_r_width)
from ._tiles import padded_rank, sm_count

STREAM_BLOCK = (128, 128)  # x's box: rows, columns
STREAM_WARPS = 4
STREAM_RING_BYTES = 200 * 1024  # of the 227 KiB an SM gives a program; the rest for the store's layout change
# Bytes of x one stream program reads a second (float32 adapters as pieces, or 16-bit ones; below the docstring's
# measurements, to leave a margin), and the GEMM's FLOP a second (H100: cuBLAS's 8192 x 4096 x 4096 takes 340 us,
# 808 TFLOP/s).
STREAM_BYTES_PER_S = {True: 55e9, False: 68e9}
GEMM_FLOPS_PER_S = 800e12


def same_waves_programs(tiles: int, sms: int) -> int:
    """The fewest programs that run `tiles` tiles in as many waves as `sms` programs do."""
    return triton.cdiv(tiles, triton.cdiv(tiles, sms))


def _box_width(r: int, pieces: bool) -> int:
    # L's columns a stream step reads: its groups padded to powers of two (TMA reads zeros past L's own width)
    return padded_rank(r) * (4 if pieces else 1)


def _ring_slots(width: int) -> int:
    return STREAM_RING_BYTES // (STREAM_BLOCK[0] * (STREAM_BLOCK[1] + width) * 2)


if gluon is not None:
    @gluon.jit
    def _stream_steps(M, K, BM: gl.constexpr, BK: gl.constexpr):
        # (row blocks, this program's steps: its column blocks p, p + programs, ... times the row blocks)
        row_steps = gl.cdiv(M, BM)
        return row_steps, gl.cdiv(gl.cdiv(K, BK) - gl.program_id(0), gl.num_programs(0)) * row_steps

    @gluon.jit
    def _stream_loads(x_desc, l_desc, x_ring, l_ring, ready, empty, M, K):
        # _shrink_grad_stream's load warp: step i -> (column block, row block) by TMA into slot i % slots, once the
        # MMA warps have released it (`empty`)
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        slots: gl.constexpr = x_ring.type.shape[0]
        row_steps, steps = _stream_steps(M, K, BM, BK)
        for i in range(steps):
            index = i % slots
            mbarrier.wait(empty.index(index), (i // slots & 1) ^ 1)  # at first: free already
            bar = ready.index(index)
            col = (gl.program_id(0) + i // row_steps * gl.num_programs(0)) * BK
            row = i % row_steps * BM
            mbarrier.expect(bar, x_desc.block_type.nbytes + l_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [row, col], bar, x_ring.index(index))
            tma.async_copy_global_to_shared(l_desc, [row, 0], bar, l_ring.index(index))

    @gluon.jit
    def _stream_mmas(x_ring, l_ring, ready, empty, da_ptr, M, K, rank, GROUP_ROWS: gl.constexpr,
                     LOW_PIECES: gl.constexpr):
        # _shrink_grad_stream's MMA warps: each step's product once its slot is loaded, the slot released once the
        # MMA has read it, the product added in float32 registers; at a column block's last step its dA stored
        slots: gl.constexpr = x_ring.type.shape[0]
        BM: gl.constexpr = x_ring.type.shape[1]
        BK: gl.constexpr = x_ring.type.shape[2]
        W: gl.constexpr = l_ring.type.shape[2]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                             instr_shape=[16, W, 16])
        row_steps, steps = _stream_steps(M, K, BM, BK)
        total = gl.zeros((BK, W), gl.float32, acc_layout)
        for i in range(steps):
            index = i % slots
            mbarrier.wait(ready.index(index), i // slots & 1)
            part = warpgroup_mma(x_ring.index(index).permute((1, 0)), l_ring.index(index),
                                 gl.zeros((BK, W), gl.float32, acc_layout), use_acc=False, is_async=True)
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
            mbarrier.arrive(empty.index(index))
            row_step = i % row_steps
            total = gl.where(row_step == 0, part, total + part)
            if row_step == row_steps - 1:
                _store_columns(total, da_ptr, (gl.program_id(0) + i // row_steps * gl.num_programs(0)) * BK, K,
                               rank, GROUP_ROWS, LOW_PIECES, gl.num_warps())

    @gluon.jit
    def _shrink_grad_stream(x_desc, l_desc, da_ptr, M, K, rank, GROUP_ROWS: gl.constexpr, LOW_PIECES: gl.constexpr,
                            SLOTS: gl.constexpr, LOAD_REGISTERS: gl.constexpr, num_warps: gl.constexpr):
        # x: [M, K] in [BM, BK] boxes; L: [M, W] in [BM, W] boxes; da: [rank, K] fp32. W = GROUP_ROWS, or with
        # LOW_PIECES four groups of GROUP_ROWS columns: l0 | l1 | l0 | l2. Warp-specialised: one warp issues the TMA
        # loads up to SLOTS steps ahead (_stream_loads), the num_warps warps run the MMAs, the sums and the stores
        # (_stream_mmas).
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        W: gl.constexpr = l_desc.block_type.shape[1]
        x_ring = gl.allocate_shared_memory(x_desc.dtype, [SLOTS, BM, BK], x_desc.layout)
        l_ring = gl.allocate_shared_memory(x_desc.dtype, [SLOTS, BM, W], l_desc.layout)
        ready = ready_barriers(SLOTS)  # a slot's loads have landed
        empty = ready_barriers(SLOTS)  # a slot's MMA has completed: the load warp may refill it
        gl.warp_specialize([(_stream_mmas, (x_ring, l_ring, ready, empty, da_ptr, M, K, rank, GROUP_ROWS,
                                            LOW_PIECES)),
                            (_stream_loads, (x_desc, l_desc, x_ring, l_ring, ready, empty, M, K))], [1],
                           [LOAD_REGISTERS])

    @gluon.jit
    def _store_columns(total, da_ptr, col0, K, rank, GROUP_ROWS: gl.constexpr, LOW_PIECES: gl.constexpr,
                       num_warps: gl.constexpr):
        # total: [BK, W] fp32 = x[:, cols]^T L -> dA[j, col0 + c] = the sum of total[c, g * GROUP_ROWS + j] over the
        # groups l0, l1, l2 (0, 1, 3; group 2 repeats l0 for the dx GEMM's R)
        BK: gl.constexpr = total.type.shape[0]
        W: gl.constexpr = total.type.shape[1]
        if LOW_PIECES:
            grouped = gl.reshape(total, [BK, W // GROUP_ROWS, GROUP_ROWS])
            group = gl.arange(0, W // GROUP_ROWS, layout=gl.SliceLayout(0, gl.SliceLayout(2, grouped.type.layout)))
            total = gl.sum(gl.where((group == 2)[None, :, None], 0.0, grouped), axis=1)  # x's infinities stay
        layout: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, num_warps], [0, 1])  # x's columns fastest
        total = gl.convert_layout(total, layout)
        cols = col0 + gl.arange(0, BK, layout=gl.SliceLayout(1, layout))
        ranks = gl.arange(0, GROUP_ROWS, layout=gl.SliceLayout(0, layout))
        gl.store(da_ptr + ranks[None, :] * K + cols[:, None], total, mask=(cols < K)[:, None] & (ranks < rank)[None, :])


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def dx_beside_shrink_grad(g, weight, ds, lora_A, x, pieces):
    """(dx, dA) of the layer's backward without dropout: dx = g W + ds A on _gemm_rank_r, dA = ds^T x ([r, K] fp32)
    on the SMs its last wave leaves free, at the same time. None where no SM is free, the pass would outlast the
    GEMM, the kernels do not take the operands, or a kernel failed its first launch (logged once; the GEMM's failure
    is checked before the pass is launched)."""
    # g: [M, N], weight: [N, K], ds: [M, r] fp32, lora_A: [r, K], x: [M, K]
    M, N = g.shape
    K, r = weight.shape[1], lora_A.shape[0]
    if not (gluon_gemm_ready(g, weight, lora_A, pieces) and weight.stride(1) == 1 and x.dtype == g.dtype
            and x.stride(1) == 1 and (x.stride(0) * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0
            and _box_width(r, pieces) <= 64):  # the stream's two [128, W] float32 sums in registers
        return None
    sms = sm_count(x.device)
    programs = same_waves_programs(triton.cdiv(M, BLOCK_M) * triton.cdiv(K, BLOCK_N), sms)
    stream_programs = min(sms - programs, triton.cdiv(K, STREAM_BLOCK[1]))
    pass_s = x.numel() * x.element_size() / (max(stream_programs, 1) * STREAM_BYTES_PER_S[pieces])
    if (stream_programs == 0 or pass_s > 2 * M * N * K / GEMM_FLOPS_PER_S
            or gemm_rank_r_failed(weight, rank_r_width(r, pieces, 0, all_low_pieces=pieces), False)):
        return None
    left, r_op, _ = rank_r_operands(ds, lora_A, 1.0, None, g.dtype, pieces, False, all_low_pieces=pieces)
    dA = torch.empty(r, K, device=x.device, dtype=torch.float32)
    dx = torch.empty(M, K, device=x.device, dtype=x.dtype)
    main, side = torch.cuda.current_stream(x.device), _side_stream(x.device)
    side.wait_stream(main)  # L and x are ready
    try:
        with torch.cuda.stream(side):
            ran = _launch_stream(x, left, dA, r, pieces, stream_programs)
        ran = ran and gemm_rank_r_packed(g, weight, left, r_op, dx, programs)
    finally:  # also if a launch raised: before anyone frees or reuses what the pass reads, or reads dA
        main.wait_stream(side)
    return (dx, dA) if ran else None


def _launch_stream(x, left, dA, r, pieces, programs) -> bool:
    # x: [M, K], left: [M, W], dA: [r, K] fp32
    dtype = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    x_box, l_box = list(STREAM_BLOCK), [STREAM_BLOCK[0], _box_width(r, pieces)]
    x_desc = TensorDescriptor.from_tensor(x, x_box, gl.NVMMASharedLayout.get_default_for(x_box, dtype))
    l_desc = TensorDescriptor.from_tensor(left, l_box, gl.NVMMASharedLayout.get_default_for(l_box, dtype))
    slots = _ring_slots(l_box[1])
    key = f"_shrink_grad_stream(pieces={pieces}, rank={padded_rank(r)}, slots={slots}, dtype={x.dtype})"
    return launch_or_fall_back(key, lambda: _shrink_grad_stream[
        (programs,)](x_desc, l_desc, dA, x.shape[0], x.shape[1], r, GROUP_ROWS=padded_rank(r), LOW_PIECES=pieces,
                     SLOTS=slots, LOAD_REGISTERS=LOAD_REGISTERS, num_warps=STREAM_WARPS))
