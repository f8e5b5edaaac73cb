"""One row times a weight matrix: y = x W^T + bias for x of one row (decoding at batch 1); `gemv_and_shrink` also
gives the LoRA shrink s = x A^T in the same launch.

At batch 1 the GEMM is a read of W, and cuBLAS's kernels for it reach 1.3-3.4 TB/s on an H200 at Llama-1B's
projection shapes. This kernel gives each program one or two rows of W over all of K, with no tensor cores and no
split-K reduction, and reaches 1.9-4.2 TB/s on the same shapes (`.scratch` sweep, H200: q/k/v 5.5 against 7.1 us,
o 4.4 against 6.6, gate/up 18.5 against 19.9, down 10.9 against 13.8, lm_head 126 against 132). The sums run in
fp32; y is rounded to the weight's dtype first even when `out` is fp32 (so logits equal those of the layer in the
weight's dtype up to the order of the sum).
"""
import torch
import triton
import triton.language as tl

from ._dependent_launch import launch_options, wait_for_inputs


def gemv_reference(x, weight, bias=None, out=None):
    # x: [1, K], weight: [N, K], bias: [N] or None, out: [1, N] or None
    y = torch.nn.functional.linear(x, weight, bias)
    return y if out is None else out.copy_(y)


def gemv_and_shrink_reference(x, weight, lora_A):
    # x: [1, K], weight: [N, K], lora_A: [r, K] -> ([1, N] in weight's dtype, [1, r] fp32)
    return torch.nn.functional.linear(x, weight), torch.nn.functional.linear(x.float(), lora_A.float())


@triton.jit
def _row_sums(x_ptr, w_ptr, rows, n_rows, K, stride_wn, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    # x: [K], W: [n_rows, K] (row stride stride_wn, unit column stride); rows: [BLOCK_N] -> W[rows] . x in fp32.
    # The products accumulate elementwise and are summed once at the end.
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    acc = tl.zeros([rows.shape[0], BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN:
            w = tl.load(w_ptrs, eviction_policy="evict_first")  # read once: keep L2 for x and what follows
            x = tl.load(x_ptr + k0 + ks)
        else:
            w = tl.load(w_ptrs, mask=(rows[:, None] < n_rows) & (k0 + ks[None, :] < K), other=0.0,
                        eviction_policy="evict_first")
            x = tl.load(x_ptr + k0 + ks, mask=k0 + ks < K, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
    return tl.sum(acc, 1)


@triton.jit
def _weight_rows(x_ptr, w_ptr, bias_ptr, y_ptr, block, N, K, stride_wn, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    # y[rows] = W[rows] . x + bias[rows], rounded to W's dtype, for the rows of block `block`
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    y = _row_sums(x_ptr, w_ptr, rows, N, K, stride_wn, BLOCK_K, EVEN)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    y = y.to(w_ptr.dtype.element_ty)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def _gemv(x_ptr, w_ptr, bias_ptr, y_ptr, a_ptr, s_ptr, N, K, rank, stride_wn, stride_ar, HAS_BIAS: tl.constexpr,
          SHRINK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
          PDL: tl.constexpr):
    # x: [K], W: [N, K], bias: [N], y: [N]; with SHRINK also s = A . x in fp32 (A: [rank, K], row stride stride_ar,
    # s: [rank]) by the programs after W's: one launch gives the base output and the LoRA shrink.
    wait_for_inputs(PDL)
    block = tl.program_id(0)
    w_blocks = tl.cdiv(N, BLOCK_N)
    if SHRINK:
        if block >= w_blocks:
            ranks = (block - w_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
            s = _row_sums(x_ptr, a_ptr, ranks, rank, K, stride_ar, BLOCK_K, False)
            tl.store(s_ptr + ranks, s, mask=ranks < rank)
        else:
            _weight_rows(x_ptr, w_ptr, bias_ptr, y_ptr, block, N, K, stride_wn, HAS_BIAS, BLOCK_N, BLOCK_K, EVEN)
    else:
        _weight_rows(x_ptr, w_ptr, bias_ptr, y_ptr, block, N, K, stride_wn, HAS_BIAS, BLOCK_N, BLOCK_K, EVEN)


def _config(N, K):
    # (BLOCK_N, BLOCK_K): the sweep's best, all at 4 warps, 1-2 stages within 1 %; narrow and short weights need
    # two rows a program to keep enough loads in flight, wide or long ones one (N / BLOCK_N programs).
    return (2, 1024) if N <= 4096 and K <= 4096 else (1, 512)


def _launch(x, weight, bias, y, lora_A, s):
    N, K = weight.shape
    if x.shape != (1, K) or weight.stride(1) != 1 or x.stride(-1) != 1:
        raise ValueError(f"gemv: x {tuple(x.shape)} must be [1, {K}] and both x and weight {tuple(weight.shape)} "
                         "must have unit column stride")
    if y.shape != (1, N) or y.stride(-1) != 1 or (bias is not None and (bias.shape != (N,) or bias.stride(0) != 1)):
        raise ValueError(f"gemv: out {tuple(y.shape)} must be [1, {N}] with unit column stride, and bias "
                         f"{None if bias is None else tuple(bias.shape)} a contiguous [{N}]")
    block_n, block_k = _config(N, K)
    rank = 0 if lora_A is None else lora_A.shape[0]
    _gemv[(triton.cdiv(N, block_n) + triton.cdiv(rank, block_n),)](
        x, weight, bias, y, lora_A, s, N, K, rank, weight.stride(0), 0 if lora_A is None else lora_A.stride(0),
        HAS_BIAS=bias is not None, SHRINK=lora_A is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN=N % block_n == 0 and K % block_k == 0, num_warps=4, num_stages=2, **launch_options(x.device))


def gemv(x, weight, bias=None, out=None):
    """x W^T + bias for one row; into `out` ([1, N], any float dtype) when given."""
    # x: [1, K] (unit column stride), weight: [N, K] (unit column stride), bias: [N] contiguous or None
    y = out if out is not None else torch.empty(1, weight.shape[0], device=x.device, dtype=weight.dtype)
    _launch(x, weight, bias, y, None, None)
    return y


def gemv_and_shrink(x, weight, lora_A):
    """(x W^T, x A^T) for one row in one launch: the base output in W's dtype and the LoRA shrink in fp32 (the
    products of x and A summed in fp32, whatever A's dtype, as PEFT's float32 adapters compute it)."""
    # x: [1, K], weight: [N, K], lora_A: [r, K] (unit column strides)
    if lora_A.stride(1) != 1:
        raise ValueError(f"gemv_and_shrink: lora_A {tuple(lora_A.shape)} must have unit column stride")
    y = torch.empty(1, weight.shape[0], device=x.device, dtype=weight.dtype)
    s = torch.empty(1, lora_A.shape[0], device=x.device, dtype=torch.float32)
    _launch(x, weight, None, y, lora_A, s)
    return y, s
