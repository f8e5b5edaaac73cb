"""Probe (not yet run on a GPU): can the LoRA shrink, memory-bound, hide beside the frozen GEMM, compute-bound?

    python benchmarks/probe_shrink_overlap.py        # one Hopper GPU; prints one line per (shape, dropout, k, tiles)

The layer's misses (NOTES_lora_layer.md) are the shrink passes that run alone: the forward shrink before the GEMM
that needs s, dA beside the dx GEMM. Here k programs stream the shrink (a copy of `_shrink_fwd`, persistent over row
blocks, float32 adapters on bf16 pieces) on a side stream while the persistent TMA GEMM runs on sms - k programs, and
the pair is timed against the two run one after the other. The overlap pays only if k SMs stream x fast enough: the
GEMM loses k/sms of its SMs for its whole length. Per-SM GB/s is printed for that reason. Graph-replayed, us.
"""
import os
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import capture  # noqa: E402
from lorafuse.ops import lora_matmul as LM  # noqa: E402
from lorafuse.ops.lora_shrink import lora_shrink  # noqa: E402
from lorafuse.ops._bf16_pieces import bf16_pieces, dot_pieces  # noqa: E402
from lorafuse.ops.dropout import PHILOX_ROUNDS, dropout_args, keep_tile, new_seed  # noqa: E402
from lorafuse.ops._tiles import dot_precision, lora_precision, sm_count  # noqa: E402


@triton.jit
def _shrink_persist(x_ptr, a_ptr, s_ptr, seed_ptr, M, K, rank, stride_xm, threshold, drop_scale,
                    HAS_DROPOUT: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                    ROUNDS: tl.constexpr):
    ranks = tl.arange(0, R)
    for rb in range(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
        acc = tl.zeros([BLOCK_M, R], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :],
                        mask=(rows[:, None] < M) & (cols[None, :] < K), other=0.0)
            if HAS_DROPOUT:
                x = x * keep_tile(seed_ptr, rows, k0, threshold, BLOCK_K, ROUNDS).to(x.dtype)
            a_offs = ranks[:, None] * K + cols[None, :]
            a_mask = (ranks[:, None] < rank) & (cols[None, :] < K)
            a_hi = tl.load(a_ptr + a_offs, mask=a_mask, other=0.0)
            a_mid = tl.load(a_ptr + rank * K + a_offs, mask=a_mask, other=0.0)
            a_lo = tl.load(a_ptr + 2 * rank * K + a_offs, mask=a_mask, other=0.0)
            acc = dot_pieces(x, tl.trans(a_hi), tl.trans(a_mid), tl.trans(a_lo), acc)
        if HAS_DROPOUT:
            acc *= drop_scale
        tl.store(s_ptr + rows[:, None] * rank + ranks[None, :], acc,
                 mask=(rows[:, None] < M) & (ranks[None, :] < rank))


def shrink_persist(x, pieces, r, p, seed, programs, cfg):
    # x: [M, K] bf16, pieces: [3, r, K] bf16 -> s [M, r] fp32 on `programs` programs; cfg: (BM, BK, warps, stages)
    M, K = x.shape
    bm, bk, warps, stages = cfg
    s = torch.empty(M, r, device=x.device, dtype=torch.float32)
    th, ds = dropout_args(p)
    _shrink_persist[(programs,)](x, pieces, s, seed, M, K, r, x.stride(0), th, ds, HAS_DROPOUT=p > 0, R=16,
                                 BLOCK_M=bm, BLOCK_K=bk, ROUNDS=PHILOX_ROUNDS, num_warps=warps, num_stages=stages)
    return s


def gemm(a, b, low, right, scale, programs):
    # a: [M, K], b: [K, N] (W^T), low: [M, r] fp32, right: [r, N] fp32: lora_matmul's TMA launch on `programs` programs
    (M, K), N, r = a.shape, b.shape[1], right.shape[0]
    c = torch.empty(M, N, device=a.device, dtype=a.dtype)
    bm, bn, bk, gm, warps, stages = LM._config(M, N, K, a.dtype)
    b_k_major = b.stride(0) == 1
    b_host = b.t() if b_k_major else b
    b_block = [bn, bk] if b_k_major else [bk, bn]
    c_desc = TensorDescriptor.from_tensor(c, [bm, bn // 2])
    LM._lora_matmul_tma[(programs,)](
        TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(b_host, b_block), c_desc, c_desc,
        low, right, None, M, N, K, r, scale, right.stride(0), right.stride(1), ACT=0, HAS_BIAS=False, STORE_Z=False,
        B_K_MAJOR=b_k_major, LORA_FP32=True, ON_PIECES=True, R=16, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm,
        PRECISION=dot_precision(a.dtype), LORA_PRECISION=lora_precision(a.dtype, right.dtype), num_warps=warps,
        num_stages=LM._tma_stages(stages, False))
    return c


def replay_us(fn):
    # min time of fn replayed from a CUDA graph (warmed up on a side stream first), us
    graph, _ = capture(fn)
    return 1000 * do_bench(graph.replay, warmup=50, rep=300, return_mode="min")


def concurrent(side, first, second):
    # first on the side stream, launched first, second on this one; joined
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        first()
    second()
    main.wait_stream(side)


def main():
    torch.manual_seed(0)
    side = torch.cuda.Stream()
    sms = sm_count(torch.device("cuda"))
    print("sms", sms)
    for K, N in [(4096, 4096), (14336, 4096), (2048, 8192)]:
        M, r = 8192, 16
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        W = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        A = torch.randn(r, K, device="cuda") / K ** 0.5
        B = torch.randn(N, r, device="cuda") * 0.02
        pieces = bf16_pieces(A)
        seed = new_seed(x.device)
        for p in (0.0, 0.05):
            s_ref = lora_shrink(x, A, p, seed)
            t_shrink = replay_us(lambda: lora_shrink(x, A, p, seed))
            t_gemm = {k: replay_us(lambda k=k: gemm(x, W.t(), s_ref, B.t(), 2.0, sms - k)) for k in (0, 4, 8, 16)}
            t_seq = replay_us(lambda: gemm(x, W.t(), lora_shrink(x, A, p, seed), B.t(), 2.0, sms))
            print(f"K{K} N{N} p{p}: shrink {t_shrink:.1f}  gemm(sms-k) "
                  + " ".join(f"k{k}:{t:.1f}" for k, t in t_gemm.items()) + f"  seq {t_seq:.1f}", flush=True)
            for k in (4, 8, 16):
                for cfg in ((64, 128, 4, 4), (128, 128, 8, 4), (64, 256, 8, 3)):
                    s_k = shrink_persist(x, pieces, r, p, seed, k, cfg)
                    err = ((s_k - s_ref).norm() / s_ref.norm()).item()
                    t_alone = replay_us(lambda: shrink_persist(x, pieces, r, p, seed, k, cfg))
                    t_conc = replay_us(lambda: concurrent(side, lambda: shrink_persist(x, pieces, r, p, seed, k, cfg),
                                                          lambda: gemm(x, W.t(), s_ref, B.t(), 2.0, sms - k)))
                    per_sm = x.numel() * 2 / t_alone / 1e3 / k
                    print(f"  k{k} tiles{cfg}: alone {t_alone:.1f} ({per_sm:.0f} GB/s per SM), concurrent "
                          f"{t_conc:.1f} (one after the other {t_seq:.1f}: gain {t_seq - t_conc:+.1f}), "
                          f"s error {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
