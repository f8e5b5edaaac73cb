"""Probe: can the rank-r term ride in the persistent TMA GEMM's K-loop at cuBLAS's speed?

    python benchmarks/probe_rank_r_gemm.py [--rounds 30] [--out DIR]

The layer's fused GEMM (`ops.lora_matmul`, TMA route) adds scale * L R to A B as three bf16-piece dots in its epilogue
and runs 2-8 % behind cuBLAS. The same persistent kernel without the rank-r term, its tile loop flattened into the
K-loop (`tl.range(..., flatten=True)`), runs 0-2 % behind. Here the rank-r term is laid along K instead, as one more
K-step of the same shape: L_cat = [l0 | l1 | l0 | 0] ([M, 64] bf16, the scaled float32 rows as bf16 pieces) against
R_cat = [r0; r0; r1; 0] ([64, N]), the epilogue's three piece products (l0 r0 + l1 r0 + l0 r1). Variants:
  branch_flat   one flattened loop; each step picks (A, B) or (L_cat, R_cat) by a branch
  after         the K-loop, then the rank-r step from its own descriptors; 3 or 4 stages, C stored whole or in halves
  after_flat    the same with the tile loop flattened (2 stages: 3 do not fit in shared memory)
against torch.mm (cuBLAS, no rank-r term: the floor), lora_matmul's Triton TMA kernel (`lora_matmul`), its Gluon
kernel (`gluon`: the rank-r term as one more K-step of a hand-written pipeline, _lora_matmul_gluon.py; the call
includes the launch that packs L and R) and the flattened plain GEMM. Float32
adapters (PEFT's default), 8192 rows, the layer bench's four shapes, forward (x W^T) and dx (g W). Each output is
checked against float64 first; then CUDA graphs alternate call by call (benchmarks.common.time_alternating).
Rows: <out>/rank_r_gemm.csv (DESIGN.md's schema; bench `rank_r_gemm`, ratio to cuBLAS).
"""
import itertools
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (capture, environment, probe_args, time_alternating, timing_rows,  # noqa: E402
                               write_rows)

from lorafuse.ops._bf16_pieces import bf16_pieces_reference  # noqa: E402
from lorafuse.ops.lora_matmul import _config, _tile_coords, lora_matmul  # noqa: E402

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (2048, 8192)]  # (in, out) features of the base linear
ROWS, RANK, SCALE = 8192, 16, 2.0
BM, BN, BK = 128, 256, 64
VARIANTS = {  # name: (branch, flatten, split store, stages)
    "branch_flat": (True, True, False, 3),
    "after_st3": (False, False, False, 3),
    "after_split_st3": (False, False, True, 3),
    "after_split_st4": (False, False, True, 4),
    "after_flat_st2": (False, True, False, 2),
    "after_flat_split_st2": (False, True, True, 2),
}


@triton.jit
def _k_step(a_desc, b_desc, m0, n0, k0, acc, B_K_MAJOR: tl.constexpr):
    # acc + A[m0:, k0:] @ B[k0:, n0:] for one [BM, BK] x [BK, BN] step; B as [N, K] boxes when B_K_MAJOR
    a = a_desc.load([m0, k0])
    if B_K_MAJOR:
        acc = tl.dot(a, b_desc.load([n0, k0]).T, acc)
    else:
        acc = tl.dot(a, b_desc.load([k0, n0]), acc)
    return acc


@triton.jit
def _gemm_rank_r_steps(a_desc, b_desc, l_desc, r_desc, c_desc, M, N, K, HAS_RANK_R: tl.constexpr,
                       BRANCH: tl.constexpr, FLATTEN: tl.constexpr, SPLIT_STORE: tl.constexpr,
                       B_K_MAJOR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr):
    # a_desc: A [M, K]; b_desc: B [N, K] (B_K_MAJOR) or [K, N]; l_desc: L_cat [M, BK]; r_desc: R_cat like B with
    # K = BK; c_desc: C [M, N] in [BM, BN] boxes, or [BM, BN / 2] when SPLIT_STORE. C = A B (+ L_cat R_cat).
    k_steps = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N), tl.num_programs(0),
                         flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if BRANCH:
            for ki in range(0, k_steps + 1):
                if ki < k_steps:
                    acc = _k_step(a_desc, b_desc, m0, n0, ki * BLOCK_K, acc, B_K_MAJOR)
                else:
                    acc = _k_step(l_desc, r_desc, m0, n0, 0, acc, B_K_MAJOR)
        else:
            for ki in range(0, k_steps):
                acc = _k_step(a_desc, b_desc, m0, n0, ki * BLOCK_K, acc, B_K_MAJOR)
            if HAS_RANK_R:
                acc = _k_step(l_desc, r_desc, m0, n0, 0, acc, B_K_MAJOR)
        if SPLIT_STORE:
            left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            c_desc.store([m0, n0], left.to(c_desc.dtype))
            c_desc.store([m0, n0 + BLOCK_N // 2], right.to(c_desc.dtype))
        else:
            c_desc.store([m0, n0], acc.to(c_desc.dtype))


def rank_r_along_k(low, right, scale):
    """(L_cat [M, BK], R_cat [BK, N]) bf16: L_cat @ R_cat = the three largest bf16-piece products of
    (scale * low) @ right, as lora_matmul's epilogue adds them."""
    # low: [M, r] fp32, right: [r, N] fp32
    (l0, l1, _), (r0, r1, _) = bf16_pieces_reference(low * scale), bf16_pieces_reference(right)
    r = low.shape[1]
    l_cat = torch.zeros(low.shape[0], BK, device=low.device, dtype=torch.bfloat16)
    r_cat = torch.zeros(BK, right.shape[1], device=low.device, dtype=torch.bfloat16)
    l_cat[:, :3 * r] = torch.cat([l0, l1, l0], 1)
    r_cat[:3 * r] = torch.cat([r0, r0, r1], 0)
    return l_cat, r_cat


def launcher(a, w, c, l_cat, r_cat, forward, variant):
    """A call of _gemm_rank_r_steps; variant None: the plain flattened GEMM (no rank-r term)."""
    # a: [M, K_in]; w: [N, K] (the base weight); c: [M, n_out]; forward: c = a w^T, else c = a w
    branch, flatten, split, stages = variant or (False, True, False, 3)
    M, n_out = c.shape
    b_block = [BN, BK] if forward else [BK, BN]
    r_host = r_cat.t().contiguous() if forward else r_cat
    descs = (TensorDescriptor.from_tensor(a, [BM, BK]), TensorDescriptor.from_tensor(w, b_block),
             TensorDescriptor.from_tensor(l_cat, [BM, BK]), TensorDescriptor.from_tensor(r_host, b_block),
             TensorDescriptor.from_tensor(c, [BM, BN // 2] if split else [BM, BN]))
    programs = min(torch.cuda.get_device_properties(0).multi_processor_count,
                   triton.cdiv(M, BM) * triton.cdiv(n_out, BN))

    def call():
        _gemm_rank_r_steps[(programs,)](*descs, M, n_out, a.shape[1], HAS_RANK_R=variant is not None, BRANCH=branch,
                                        FLATTEN=flatten, SPLIT_STORE=split, B_K_MAJOR=forward, BLOCK_M=BM,
                                        BLOCK_N=BN, BLOCK_K=BK, GROUP_M=8, num_warps=8, num_stages=stages)
    return call


def probe_case(k_in, n_out_features, forward, rounds):
    """{provider: (median, p20, p80) ms}, {provider: relative error to float64} for one GEMM."""
    torch.manual_seed(0)
    n_in, n_out = (k_in, n_out_features) if forward else (n_out_features, k_in)
    a = torch.randn(ROWS, n_in, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n_out_features, k_in, device="cuda", dtype=torch.bfloat16) / n_in ** 0.5
    b = w.t() if forward else w
    low = torch.randn(ROWS, RANK, device="cuda")
    right = torch.randn(RANK, n_out, device="cuda") * 0.5  # float32 adapters, PEFT's default
    exact = a.double() @ b.double() + SCALE * (low.double() @ right.double())
    l_cat, r_cat = rank_r_along_k(low, right, SCALE)
    c = torch.empty(ROWS, n_out, device="cuda", dtype=torch.bfloat16)
    triton_tiles = _config(ROWS, n_out, n_in, a.dtype)  # a config: the Triton TMA kernel, not the Gluon one
    calls = {"cublas": lambda: torch.mm(a, b, out=c),
             "lora_matmul": lambda: lora_matmul(a, b, low, right, SCALE, tma=True, config=triton_tiles),
             "gluon": lambda: lora_matmul(a, b, low, right, SCALE, tma=True),
             "plain_flat": launcher(a, w, c, l_cat, r_cat, forward, None)}
    outputs = {key: calls[key]()[0] for key in ("lora_matmul", "gluon")}
    for name, variant in VARIANTS.items():
        calls[name] = launcher(a, w, c, l_cat, r_cat, forward, variant)
        c.fill_(float("nan"))
        calls[name]()
        outputs[name] = c.clone()
    errors = {key: ((out.double() - exact).norm() / exact.norm()).item() for key, out in outputs.items()}
    times = time_alternating({key: capture(fn)[0].replay for key, fn in calls.items()}, rounds=rounds, warmup=5)
    return times, errors


def main():
    args = probe_args(__doc__)
    tags, rows, table = environment(), [], []
    for (k_in, n_out), forward in itertools.product(SHAPES, (True, False)):
        shape = f"M{ROWS}_K{k_in}_N{n_out}_r{RANK}"
        mode = "fwd_graph" if forward else "dx_graph"
        times, errors = probe_case(k_in, n_out, forward, args.rounds)
        floor = times["cublas"][0]
        rows += timing_rows(tags, "rank_r_gemm", shape, mode, times, "cublas", "rel_err_fp64", errors)
        table.append((f"{shape}_{mode}", floor, {key: t[0] / floor for key, t in times.items()}, errors))
        print(table[-1], flush=True)
    write_rows(rows, "rank_r_gemm", [args.out])
    keys = ["lora_matmul", "gluon", "plain_flat", *VARIANTS]
    print("\nratio to cuBLAS (graph-replayed, alternating); errors: largest relative error to float64 of the variants")
    print(f"{'case':30s} {'cuBLAS us':>9s} " + " ".join(f"{key:>20s}" for key in keys) + f" {'error':>8s}")
    for case, floor, ratios, errors in table:
        print(f"{case:30s} {floor * 1000:9.1f} " + " ".join(f"{ratios[key]:20.3f}" for key in keys)
              + f" {max(errors.values()):8.1e}")


if __name__ == "__main__":
    main()
