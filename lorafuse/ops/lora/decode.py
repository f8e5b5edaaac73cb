"""LoRA on a few rows (decoding): y = act(x W^T + bias + scale * (x A^T) B^T) without autograd.

At decode sizes reading the weights is all the work; what matters is keeping every SM streaming them and adding
no launch that waits on a full pass. Inference only (no dropout, no saved tensors):
  one row    ops.gemv reads W (faster than cuBLAS at batch 1) and A in one launch: x W^T and the shrink s = x A^T in
             fp32, whatever A's dtype; lora_expand adds scale * s B^T + bias (and the activation) in one pass over y;
  2-16 rows  `_rows_chunks` splits K into chunks over about 1.5 programs per SM: each sums x_k W_k^T for a block of
             columns, a few more sum the shrink x_k A_k^T once (not per column block), and `_expand_chunks` adds the
             chunks up with scale * s B^T, bias and the activation. Since the LoRA term is linear in x, no chunk needs
             the whole shrink before its own sum. Two launches, faster than cuBLAS's GEMM of x with [W; A] plus
             lora_expand at r = 16 (bench_lora_layer.py --decode-only, rows in benchmarks/results/lora_layer.csv;
             --sweep-decode for the configs). Larger ranks are tested for correctness only. 16-bit x only: float32
             models' rows take PyTorch's GEMMs (`_float32_rows`), which are faster there than the kernels' float32
             dots.
"""
import torch
import triton
import triton.language as tl

from ..common.bf16_pieces import uses_bf16_pieces
from ..common.tiles import dot_precision, lora_in_fp32, lora_precision, padded_rank, sm_count, split_in_blocks
from ..common.activation import ACTIVATIONS, activate, activation_reference
from ..decode.gemv import FEW_ROWS, chunk_product, gemv_and_shrink
from .expand import lora_expand
from .matmul import add_rank_r

DECODE_MAX_ROWS = FEW_ROWS  # rows of one tl.dot tile (chunk_product's, shared with gemv)
EXPAND_BLOCK_N = 64  # columns a program of _expand_chunks sums and expands
MAX_SPLITS = 8  # _expand_chunks holds [splits, 16, 64] fp32 partials in registers
SHRINK_TILE_BYTES = 8192  # of A per K tile of the shrink programs (x4 stages: 32 KB of shared memory)
SHRINK_PARTIALS = 4096  # fp32 values of the shrink's partials that _expand_chunks sums at once (16 chunks at r <= 16)


def lora_decode_reference(x, weight, bias, lora_A, lora_B, scale, activation="identity"):
    # x: [M, K], weight: [N, K], bias: [N] or None, lora_A: [r, K], lora_B: [N, r] -> [M, N] in x's dtype
    lora = (x.to(lora_A.dtype) @ lora_A.t()) @ lora_B.t()
    z = torch.nn.functional.linear(x, weight, bias).float() + scale * lora.float()
    return activation_reference(z, activation).to(x.dtype)


def takes_gemv(x: torch.Tensor, weight: torch.Tensor, lora_A: torch.Tensor) -> bool:
    """Whether lora_decode runs these on ops.gemv: one row, row-major weights (any adapter dtype: fp32 sums)."""
    # x: [M, K], weight: [N, K], lora_A: [r, K]
    return x.shape[0] == 1 and weight.stride(1) == 1 and lora_A.stride(1) == 1


@triton.jit
def _rows_chunks(x_ptr, w_ptr, a_ptr, part_ptr, low_ptr, M, N, K, k_chunk, shrink_chunk, shrink_splits, rank,
                 stride_xm, stride_wn, stride_wk, stride_ar, stride_ak, EVEN_K: tl.constexpr, LORA_FP32: tl.constexpr,
                 ON_PIECES: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SHRINK_BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                 LORA_PRECISION: tl.constexpr):
    # x: [M <= BLOCK_M, K], W: [N, K], A: [rank, K]; partials: [splits, M, N] fp32, low partials:
    # [shrink_splits, M, R] fp32. The first shrink_splits programs sum the shrink x_k A_k^T over chunks of
    # shrink_chunk (once, not in every column block; short chunks, as fp32 adapters' pieces cost three dots a step);
    # the others sum x_k W_k^T over chunks of k_chunk for BLOCK_N columns each. The shrink's K tile is narrower where
    # A's rows are many or fp32 (SHRINK_BLOCK_K): its pipeline stages must fit shared memory beside the W programs'.
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    if pid < shrink_splits:
        ranks = tl.arange(0, R)
        k_start = pid * shrink_chunk
        cd = tl.float32 if LORA_FP32 else x_ptr.dtype.element_ty
        low = chunk_product(x_ptr, a_ptr, ranks, rank, k_start, tl.minimum(k_start + shrink_chunk, K), M,
                            stride_xm, stride_ar, stride_ak, EVEN_K, cd, ON_PIECES, BLOCK_M, SHRINK_BLOCK_K,
                            LORA_PRECISION)
        tl.store(low_ptr + (pid * M + rows[:, None]) * R + ranks[None, :], low, mask=rows[:, None] < M)
    else:
        blocks_n = tl.cdiv(N, BLOCK_N)
        pid_n, pid_k = (pid - shrink_splits) % blocks_n, (pid - shrink_splits) // blocks_n
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        k_start = pid_k * k_chunk
        acc = chunk_product(x_ptr, w_ptr, cols, N, k_start, tl.minimum(k_start + k_chunk, K), M, stride_xm,
                            stride_wn, stride_wk, EVEN_K, x_ptr.dtype.element_ty, False, BLOCK_M, BLOCK_K, PRECISION)
        offs = (pid_k * M + rows[:, None]).to(tl.int64) * N + cols[None, :]
        tl.store(part_ptr + offs, acc, mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _expand_chunks(part_ptr, low_ptr, b_ptr, bias_ptr, y_ptr, M, N, rank, splits, shrink_splits, scale, stride_bn,
                   stride_br, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, LORA_FP32: tl.constexpr,
                   ON_PIECES: tl.constexpr, R: tl.constexpr, SPLITS: tl.constexpr, SHRINK_SPLITS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    # y[:, cols] = act(sum of the chunks' x_k W_k^T + scale * (sum of their x_k A_k^T) B^T + bias): y: [M, N]
    # contiguous, B: [N, rank]; the partials as `_rows_chunks` wrote them. Each sum is one [chunks, rows, cols] load
    # (SPLITS, SHRINK_SPLITS: the chunk counts padded to powers of two), so its loads are in flight together.
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, R)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    chunks = tl.arange(0, SPLITS)[:, None, None]
    # int32 offsets: splits * 16 * N stays below 2^31 for N < 16.7M columns; int64 ones would slow every call
    acc = tl.sum(tl.load(part_ptr + (chunks * M + rows[None, :, None]) * N + cols[None, None, :],
                         mask=(chunks < splits) & mask[None, :, :], other=0.0), 0)
    chunks = tl.arange(0, SHRINK_SPLITS)[:, None, None]
    low = tl.sum(tl.load(low_ptr + (chunks * M + rows[None, :, None]) * R + ranks[None, None, :],
                         mask=(chunks < shrink_splits) & (rows[None, :, None] < M), other=0.0), 0)
    b = tl.load(b_ptr + cols[None, :] * stride_bn + ranks[:, None] * stride_br,
                mask=(ranks[:, None] < rank) & (cols[None, :] < N), other=0.0)
    acc = add_rank_r(acc, low, b, scale, tl.float32 if LORA_FP32 else y_ptr.dtype.element_ty, ON_PIECES, PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], activate(acc, ACT).to(y_ptr.dtype.element_ty), mask=mask)


def _rows_config(N, K, device):
    """(BLOCK_N, BLOCK_K, splits, num_warps, num_stages): the fastest of bench_lora_layer.py --sweep-decode's configs
    (M = 4 and 16, r = 16, Llama-1B/8B shapes): about 1.5 programs per SM, narrow column blocks where the weight has
    few rows."""
    block_n, block_k = (32 if N <= 4096 else 64), 128
    splits = round(1.5 * sm_count(device) / triton.cdiv(N, block_n))
    return block_n, block_k, max(1, min(splits, MAX_SPLITS, triton.cdiv(K, 4 * block_k))), 4, 4


def _shrink_chunks(K, block_k, R):
    # (chunk length, chunks): at least two K tiles a chunk, few enough chunks that _expand_chunks holds their
    # [chunks, 16, R] partials in registers
    chunk = max(2 * block_k, split_in_blocks(K, block_k, SHRINK_PARTIALS // (DECODE_MAX_ROWS * R))[0])
    return chunk, triton.cdiv(K, chunk)


def _float32_rows(x, weight, bias, lora_A, lora_B, scale, activation_id):
    # x: [M, K] fp32. Three cuBLAS GEMMs, the last adding the LoRA term into the base output (addmm, beta = 1)
    low = x @ lora_A.t().float()
    y = torch.addmm(torch.nn.functional.linear(x, weight, bias), low, lora_B.t().float(), alpha=scale)
    return activation_reference(y, ACTIVATIONS[activation_id])


def lora_decode(x, weight, bias, lora_A, lora_B, scale, activation_id=0, config=None):
    """act(x W^T + bias + scale * (x A^T) B^T) for at most DECODE_MAX_ROWS rows, without autograd.
    config: (BLOCK_N, BLOCK_K, splits, num_warps, num_stages) of `_rows_chunks` overrides its defaults (benchmarks; one
    row takes ops.gemv, which has no config)."""
    # x: [M <= 16, K] (unit column stride), weight: [N, K] (or a transposed view), bias: [N] or None,
    # lora_A: [r, K], lora_B: [N, r]
    M, K = x.shape
    N, r = lora_B.shape
    if M > DECODE_MAX_ROWS:
        raise ValueError(f"lora_decode: x has {M} rows; at most {DECODE_MAX_ROWS} fit its tiles")
    if M == 0:  # the kernels read x's rows modulo M
        return torch.empty(0, N, device=x.device, dtype=x.dtype)
    if takes_gemv(x, weight, lora_A):
        y, s = gemv_and_shrink(x, weight, lora_A)
        return lora_expand(y, s, lora_B, scale, bias, activation_id)[0]
    if x.dtype == torch.float32:  # cuBLAS is faster there (module docstring)
        return _float32_rows(x, weight, bias, lora_A, lora_B, scale, activation_id)
    block_n, block_k, splits, warps, stages = config or _rows_config(N, K, x.device)
    k_chunk, splits = split_in_blocks(K, block_k, min(splits, MAX_SPLITS))
    R = padded_rank(r)
    # at most SHRINK_TILE_BYTES of A a pipeline stage: rank 16 takes the W programs' tile, fp32 rank 128 one of 16
    shrink_block_k = max(16, min(block_k, SHRINK_TILE_BYTES // (R * lora_A.element_size())))
    partials = torch.empty(splits, M, N, device=x.device, dtype=torch.float32)
    shrink_chunk, shrink_splits = _shrink_chunks(K, block_k, R)
    low = torch.empty(shrink_splits, M, R, device=x.device, dtype=torch.float32)
    lora_fp32, on_pieces = lora_in_fp32(x.dtype, lora_A.dtype), uses_bf16_pieces(x.dtype, lora_A.dtype)
    precision = lora_precision(x.dtype, lora_A.dtype)
    _rows_chunks[(shrink_splits + triton.cdiv(N, block_n) * splits,)](
        x, weight, lora_A, partials, low, M, N, K, k_chunk, shrink_chunk, shrink_splits, r, x.stride(0),
        weight.stride(0), weight.stride(1), lora_A.stride(0), lora_A.stride(1), EVEN_K=K % block_k == 0,
        LORA_FP32=lora_fp32, ON_PIECES=on_pieces, R=R, BLOCK_M=DECODE_MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
        SHRINK_BLOCK_K=shrink_block_k, PRECISION=dot_precision(x.dtype), LORA_PRECISION=precision, num_warps=warps,
        num_stages=stages)
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    _expand_chunks[(triton.cdiv(N, EXPAND_BLOCK_N),)](
        partials, low, lora_B, bias, y, M, N, r, splits, shrink_splits, scale, lora_B.stride(0), lora_B.stride(1),
        ACT=activation_id, HAS_BIAS=bias is not None, LORA_FP32=lora_fp32, ON_PIECES=on_pieces, R=R,
        SPLITS=triton.next_power_of_2(splits), SHRINK_SPLITS=triton.next_power_of_2(shrink_splits),
        BLOCK_M=DECODE_MAX_ROWS, BLOCK_N=EXPAND_BLOCK_N, PRECISION=precision)
    return y
