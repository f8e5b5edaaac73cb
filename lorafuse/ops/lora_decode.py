"""LoRA on a few rows (decoding): y = act(x W^T + bias + scale * (x A^T) B^T) in two launches, without autograd.

At decode sizes reading the weights is all the work, and a Triton GEMM with one program per output tile does not
reach cuBLAS's GEMV bandwidth with so few rows (lora_matmul, shrink in its K-loop: 1.2-2.4x the GEMV alone,
benchmarks/results/lora_layer.csv). Three ways, inference only (no dropout, no saved tensors):
  one row   ops.gemv reads W (faster than cuBLAS at batch 1) and A in one launch: x W^T and the shrink s = x A^T in
            fp32, whatever A's dtype; lora_expand adds scale * s B^T + bias (and the activation) in one pass over y;
  stacked   lora_A's rows lie right after the frozen weight's in memory (lorafuse.inference.Engine lays the
            weights out so): one cuBLAS GEMM of x with [W; A] gives x W^T and the shrink together, then lora_expand;
  otherwise cuBLAS computes x W^T + bias, and `_lora_delta` recomputes the small shrink in every program (from
            L2) before its columns' expand, in place: its K-loop costs 5-12 us on an H100 (the sweep in
            bench_lora_layer.py --sweep-decode), which the other two avoid.
"""
import torch
import triton
import triton.language as tl

from ._tiles import lora_in_fp32, lora_precision, padded_rank
from .activation import activate, activation_reference
from .gemv import gemv_and_shrink
from .lora_expand import lora_expand

DECODE_MAX_ROWS = 16  # rows of one tl.dot tile: the shrink is recomputed per program, cheap only while M is small


def lora_decode_reference(x, weight, bias, lora_A, lora_B, scale, activation="identity"):
    # x: [M, K], weight: [N, K], bias: [N] or None, lora_A: [r, K], lora_B: [N, r] -> [M, N] in x's dtype
    lora = (x.to(lora_A.dtype) @ lora_A.t()) @ lora_B.t()
    z = torch.nn.functional.linear(x, weight, bias).float() + scale * lora.float()
    return activation_reference(z, activation).to(x.dtype)


def stacked_rows(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The [sum of rows, K] view over `tensors` when they lie one after another in one buffer, else None."""
    # tensors: [N_i, K], one dtype
    first, K = tensors[0], tensors[0].shape[1]
    offset = first.storage_offset()
    for t in tensors:
        if t.dtype != first.dtype or t.device != first.device or t.shape[1] != K or not t.is_contiguous():
            return None
        # One storage, each tensor's rows right after the previous one's: two allocations that merely touch do not
        # count.
        if t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or t.storage_offset() != offset:
            return None
        offset += t.numel()
    return first.as_strided((sum(t.shape[0] for t in tensors), K), (K, 1))


def takes_gemv(x: torch.Tensor, weight: torch.Tensor, lora_A: torch.Tensor) -> bool:
    """Whether lora_decode runs these on ops.gemv: one row, row-major weights (any adapter dtype: fp32 sums)."""
    # x: [M, K], weight: [N, K], lora_A: [r, K]
    return x.shape[0] == 1 and weight.stride(1) == 1 and lora_A.stride(1) == 1


def stack_rows(tensors: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """New tensors holding the same values in `dtype`, stored one after another in one buffer (see stacked_rows)."""
    # tensors: [N_i, K]
    both = torch.cat([t.detach().to(dtype) for t in tensors])
    return list(both.split([t.shape[0] for t in tensors]))


def shares_buffer(weight: torch.Tensor) -> bool:
    """Whether `weight` is a view into a larger buffer: laid out for decoding by an engine (stack_rows), whose
    captured steps hold the buffer's address, so it must not be moved again."""
    return weight.untyped_storage().nbytes() > weight.numel() * weight.element_size()


def stacked_weights(weight: torch.Tensor, lora_A: torch.Tensor) -> torch.Tensor | None:
    """[W; A] as one [N + r, K] view when lora_A's rows follow the frozen weight's in memory, else None."""
    # weight: [N, K], lora_A: [r, K]
    return stacked_rows([weight, lora_A])


def stack_weights(weight: torch.Tensor, lora_A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """New (weight, lora_A) holding the same values, lora_A cast to weight's dtype and stored right after it in
    one buffer (see stacked_weights)."""
    # weight: [N, K], lora_A: [r, K]
    return tuple(stack_rows([weight, lora_A], weight.dtype))


@triton.jit
def _lora_delta(y_ptr, x_ptr, a_ptr, b_ptr, M, N, K, rank, scale, stride_xm, stride_ar, stride_ak, stride_bn,
                stride_br, ACT: tl.constexpr, LORA_FP32: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    # y: [M, N] contiguous (the base output x W^T + bias, updated in place); x: [M, K] (unit column stride);
    # A: [rank, K], B: [N, rank]. One program per BLOCK_N columns, every row.
    cd = tl.float32 if LORA_FP32 else y_ptr.dtype.element_ty
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, R)
    ks = tl.arange(0, BLOCK_K)
    low = tl.zeros([BLOCK_M, R], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks)[None, :] < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + ks)[None, :], mask=(rows[:, None] < M) & k_ok, other=0.0)
        a = tl.load(a_ptr + ranks[:, None] * stride_ar + (k0 + ks)[None, :] * stride_ak,
                    mask=(ranks[:, None] < rank) & k_ok, other=0.0)
        low = tl.dot(x.to(cd), tl.trans(a.to(cd)), low, input_precision=PRECISION)
    b = tl.load(b_ptr + cols[:, None] * stride_bn + ranks[None, :] * stride_br,
                mask=(cols[:, None] < N) & (ranks[None, :] < rank), other=0.0)
    delta = tl.dot((low * scale).to(cd), tl.trans(b.to(cd)), input_precision=PRECISION)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows[:, None] * N + cols[None, :]
    z = tl.load(y_ptr + offs, mask=mask).to(tl.float32) + delta
    tl.store(y_ptr + offs, activate(z, ACT).to(y_ptr.dtype.element_ty), mask=mask)


def lora_decode(x, weight, bias, lora_A, lora_B, scale, activation_id=0, config=None):
    """act(x W^T + bias + scale * (x A^T) B^T) for at most DECODE_MAX_ROWS rows, without autograd.
    config: (BLOCK_N, BLOCK_K, num_warps, num_stages) of `_lora_delta` overrides its defaults (benchmarks; one row
    takes ops.gemv, which has no config)."""
    # x: [M <= 16, K] (unit column stride), weight: [N, K] (or a transposed view), bias: [N] or None,
    # lora_A: [r, K], lora_B: [N, r]
    M, K = x.shape
    N, r = lora_B.shape
    if takes_gemv(x, weight, lora_A):
        y, s = gemv_and_shrink(x, weight, lora_A)
        return lora_expand(y, s, lora_B, scale, bias, activation_id)[0]
    stacked = stacked_weights(weight, lora_A)
    if stacked is not None:
        both = x @ stacked.t()  # [M, N + r]: x W^T, then s
        return lora_expand(both[:, :N], both[:, N:], lora_B, scale, bias, activation_id)[0]
    y = torch.nn.functional.linear(x, weight, bias)  # cuBLAS, bias included
    # measured best on an H100 for r = 16 (--sweep-decode); larger ranks narrow the K tile to stay in registers
    block_n, block_k, warps, stages = config or (32, 512 if r <= 16 else 128, 4, 4)
    _lora_delta[(triton.cdiv(N, block_n),)](
        y, x, lora_A, lora_B, M, N, K, r, scale, x.stride(0), lora_A.stride(0), lora_A.stride(1),
        lora_B.stride(0), lora_B.stride(1), ACT=activation_id, LORA_FP32=lora_in_fp32(x.dtype, lora_A.dtype),
        R=padded_rank(r), BLOCK_M=DECODE_MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION=lora_precision(x.dtype, lora_A.dtype), num_warps=warps, num_stages=stages)
    return y
