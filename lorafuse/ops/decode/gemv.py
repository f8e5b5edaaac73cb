"""A few rows times a weight matrix: y = x W^T + bias for x of 1 to 16 rows (decoding); `gemv_and_shrink` also gives
the LoRA shrink s = x A^T of one row in the same launch.

Decoding reads every weight once per step, and what matters is keeping every SM streaming them:
  one row    `_gemv`: one or two rows of W a program over all of K, no tensor cores, no split-K reduction. It reads
             the weights faster than cuBLAS's kernels at every one of Llama-1B's projection shapes (q/k/v, o,
             gate/up, down, lm_head);
  2-16 rows  `_few_rows`: one 16-row tensor-core tile of x against a block of W's rows over all of K (no split-K, so
             one launch and no reduction). 16-bit weights only: float32 rows take PyTorch's GEMM (cuBLAS), which is
             faster there than the kernel's float32 dots.
Both let the next kernel of a captured decode step launch as soon as they start (ops/common/dependent_launch.py), which
cuBLAS's kernels do not: the decode step's adapter kernels then load their lora_B while the GEMM still runs. The
sums run in fp32; y is rounded to the weight's dtype first even when `out` is fp32 (so logits equal those of the
layer in the weight's dtype up to the order of the sum).
"""
import torch
import triton
import triton.language as tl

from ..._logging import log_once
from ..common.bf16_pieces import split_bf16
from ..common.dependent_launch import launch_options, wait_for_inputs
from ..common.tiles import sm_count


FEW_ROWS = 16  # rows of x in one tensor-core tile of _few_rows; more rows are a GEMM for cuBLAS
_too_large = set()  # default tiles of _few_rows that a device could not launch (see _launch_few_rows)


def gemv_reference(x, weight, bias=None, out=None):
    # x: [M, K], weight: [N, K], bias: [N] or None, out: [M, N] or None
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


@triton.jit
def chunk_product(x_ptr, m_ptr, m_rows, n_m, k_start, k_end, M, stride_xm, stride_mr, stride_mk,
                  EVEN_K: tl.constexpr, CD: tl.constexpr, ON_PIECES: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    # x[:, k_start:k_end] @ Mat[m_rows, k_start:k_end]^T as a [BLOCK_M, len(m_rows)] fp32 tile on the tensor cores
    # (x: [M, K] with unit column stride, Mat: [n_m, K]; rows past n_m read zeros). ON_PIECES: Mat is fp32 and
    # x bf16 (exact), so three bf16 dots with Mat's pieces give the fp32 product (lora_decode's float32 adapters).
    # Rows past M repeat x's rows (their results are never stored): x's loads need no row mask, which made the kernel
    # slower at 2-8 rows than at 16.
    rows = tl.arange(0, BLOCK_M) % M
    ks = tl.arange(0, BLOCK_K)
    m_ok = m_rows[:, None] < n_m
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + (k_start + ks)[None, :]
    m_ptrs = m_ptr + m_rows[:, None].to(tl.int64) * stride_mr + (k_start + ks)[None, :].to(tl.int64) * stride_mk
    acc = tl.zeros([BLOCK_M, m_rows.shape[0]], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            m = tl.load(m_ptrs, mask=m_ok, other=0.0, eviction_policy="evict_first")  # weights are read once
        else:
            k_ok = (k0 + ks)[None, :] < k_end
            x = tl.load(x_ptrs, mask=k_ok, other=0.0)
            m = tl.load(m_ptrs, mask=m_ok & k_ok, other=0.0, eviction_policy="evict_first")
        if ON_PIECES:
            # chained in the tensor cores' accumulator (not dot_pieces): lora_decode rounds its output to 16 bits,
            # far above the chain's drift, and the promoted sum is slower
            hi, mid, lo = split_bf16(m)
            acc = tl.dot(x, tl.trans(lo), tl.dot(x, tl.trans(mid), tl.dot(x, tl.trans(hi), acc)))
        else:
            acc = tl.dot(x.to(CD), tl.trans(m.to(CD)), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        m_ptrs += BLOCK_K * stride_mk
    return acc


@triton.jit
def _few_rows(x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, HAS_BIAS: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
              PDL: tl.constexpr):
    # x: [M <= BLOCK_M, K], W: [N, K], bias: [N], y: [M, N] (unit column strides): BLOCK_N columns of y a program
    wait_for_inputs(PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = chunk_product(x_ptr, w_ptr, cols, N, 0, K, M, stride_xm, stride_wn, 1, EVEN_K, x_ptr.dtype.element_ty,
                        False, BLOCK_M, BLOCK_K, "tf32")  # 16-bit x and W: the precision is unused
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    rows = tl.arange(0, BLOCK_M)
    y = acc.to(w_ptr.dtype.element_ty)
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def _config(N, K):
    # (BLOCK_N, BLOCK_K) of _gemv: the fastest of the configs tried, at 4 warps (1 or 2 stages alike); narrow and
    # short weights need two rows a program to keep enough loads in flight, wide or long ones one (N / BLOCK_N
    # programs).
    return (2, 1024) if N <= 4096 and K <= 4096 else (1, 512)


def _few_rows_config(N, K, device):
    # (BLOCK_N, BLOCK_K, num_warps, num_stages) of _few_rows, the fastest of the configs tried at Llama-1B's bf16
    # GEMMs (rows in benchmarks/results/few_rows.csv): 16 columns a program while that makes at most one program per
    # SM (o, down: the longest K tiles), 32 for mid-sized weights (q/k/v), 64 for wide ones (gate/up, lm_head).
    if triton.cdiv(N, 16) <= sm_count(device):
        return 16, 512, 2, 4
    return (32, 256, 4, 4) if N < 8192 else (64, 128, 4, 4)


def _check(x, weight, bias, y, rows):
    # x: [M, K], weight: [N, K], bias: [N] or None, y: [M, N]
    N, K = weight.shape
    if x.shape != (rows, K) or weight.stride(1) != 1 or x.stride(-1) != 1:
        raise ValueError(f"gemv: x {tuple(x.shape)} must be [{rows}, {K}] and both x and weight "
                         f"{tuple(weight.shape)} must have unit column stride")
    if y.shape != (rows, N) or y.stride(-1) != 1 or (bias is not None and (bias.shape != (N,) or bias.stride(0) != 1)):
        raise ValueError(f"gemv: out {tuple(y.shape)} must be [{rows}, {N}] with unit column stride, and bias "
                         f"{None if bias is None else tuple(bias.shape)} a contiguous [{N}]")


def _launch_one_row(x, weight, bias, y, lora_A, s):
    _check(x, weight, bias, y, 1)
    N, K = weight.shape
    block_n, block_k = _config(N, K)
    rank = 0 if lora_A is None else lora_A.shape[0]
    _gemv[(triton.cdiv(N, block_n) + triton.cdiv(rank, block_n),)](
        x, weight, bias, y, lora_A, s, N, K, rank, weight.stride(0), 0 if lora_A is None else lora_A.stride(0),
        HAS_BIAS=bias is not None, SHRINK=lora_A is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN=N % block_n == 0 and K % block_k == 0, num_warps=4, num_stages=2, **launch_options(x.device))


def _launch_few_rows(x, weight, bias, y, config):
    _check(x, weight, bias, y, x.shape[0])
    if x.dtype != weight.dtype:  # its dots take both in x's dtype (one row sums any pair in fp32)
        raise ValueError(f"gemv: x ({x.dtype}) and weight ({weight.dtype}) of more than one row must share a dtype")
    N, K = weight.shape
    block_n, block_k, warps, stages = config or _few_rows_config(N, K, x.device)
    key = (block_n, block_k, warps, stages, x.dtype, x.device)
    if key in _too_large:
        gemv_reference(x, weight, bias, y)
        return
    try:
        _few_rows[(triton.cdiv(N, block_n),)](
            x, weight, bias, y, x.shape[0], N, K, x.stride(0), weight.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=FEW_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=K % block_k == 0,
            num_warps=warps, num_stages=stages, **launch_options(x.device))
    except triton.runtime.errors.OutOfResources as error:
        if config is not None:  # a benchmark's own tiles: it wants to know
            raise
        # The tiles were sized for Hopper's shared memory: other GPUs may have less
        _too_large.add(key)
        log_once(f"lorafuse.gemv: {x.shape[0]} rows of {x.dtype} in tiles of {block_n} x {block_k} need more "
                 f"than this GPU has ({error}); PyTorch's GEMM runs them")
        gemv_reference(x, weight, bias, y)


def gemv(x, weight, bias=None, out=None, config=None):
    """x W^T + bias for 1 to FEW_ROWS rows; into `out` ([M, N], any float dtype) when given. config: (BLOCK_N,
    BLOCK_K, num_warps, num_stages) of the few-rows kernel overrides its default (benchmarks)."""
    # x: [M, K] (unit column stride), weight: [N, K] (unit column stride), bias: [N] contiguous or None
    if not 1 <= x.shape[0] <= FEW_ROWS:
        raise ValueError(f"gemv: x has {x.shape[0]} rows; it takes 1 to {FEW_ROWS} (more rows are a GEMM)")
    y = out if out is not None else torch.empty(x.shape[0], weight.shape[0], device=x.device, dtype=weight.dtype)
    if x.shape[0] == 1:
        _launch_one_row(x, weight, bias, y, None, None)
    elif x.dtype == weight.dtype == torch.float32:  # cuBLAS is faster there (module docstring)
        _check(x, weight, bias, y, x.shape[0])
        return gemv_reference(x, weight, bias, out)  # without `out`, cuBLAS's own output: no copy
    else:
        _launch_few_rows(x, weight, bias, y, config)
    return y


def gemv_and_shrink(x, weight, lora_A):
    """(x W^T, x A^T) for one row in one launch: the base output in W's dtype and the LoRA shrink in fp32 (the
    products of x and A summed in fp32, whatever A's dtype, as PEFT's float32 adapters compute it)."""
    # x: [1, K], weight: [N, K], lora_A: [r, K] (unit column strides)
    if lora_A.stride(1) != 1:
        raise ValueError(f"gemv_and_shrink: lora_A {tuple(lora_A.shape)} must have unit column stride")
    y = torch.empty(1, weight.shape[0], device=x.device, dtype=weight.dtype)
    s = torch.empty(1, lora_A.shape[0], device=x.device, dtype=torch.float32)
    _launch_one_row(x, weight, None, y, lora_A, s)
    return y, s
