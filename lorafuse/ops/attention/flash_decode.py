"""Flash decoding: the forward of flash attention for a few query rows against a long cache.

A decode step has 1..16 queries per sequence. flash_attention's forward kernel would give each
query head one program walking the whole cache: B * Hq programs (too few to fill the GPU at
small batch) that read each K/V head `group` times. Here one program takes every query row of
one K/V head (group x Nq rows, grouped-query heads stacked in one tile) over one chunk of the
keys; a second kernel merges the chunks by their log-sum-exp. Same semantics as flash_attention
(causal diagonal at the end, windows, empty rows give zeros); forward only, so it serves calls
without autograd (generation), through `flash_attention`.
"""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..common.tiles import dot_precision, sm_count, split_in_blocks
from .tiles import LOG2_E, fwd_tiles, key_range
from ..common.dependent_launch import launch_options, wait_for_inputs

MAX_ROWS = 64       # group x Nq rows stacked in one tile at most
BLOCK_N = 128       # keys per tile
NUM_WARPS, NUM_STAGES = 4, 2  # of the chunk kernel (with BLOCK_N: the fastest of the configs tried)
PROGRAMS_PER_SM = 2


def fits_decode(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether a call is a decode step this kernel takes: few query rows per K/V head."""
    # q: [B, Hq, Nq, D], k: [B, Hkv, Nk, D]
    return q.shape[2] * (q.shape[1] // k.shape[1]) <= MAX_ROWS and q.shape[2] < k.shape[2]


@triton.jit(do_not_specialize=["n_q", "n_k", "n_kv_heads", "group", "chunk"])
def _decode_chunk_kernel(Q, K, V, PART_O, PART_LSE, KEY_LO, KEY_HI,
                         sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
                         n_q, n_k, n_kv_heads, group, chunk, n_chunks, qk_scale,
                         CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, HEAD_DIM: tl.constexpr,
                         D_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         PRECISION: tl.constexpr, TMA: tl.constexpr, PDL: tl.constexpr):
    # grid: (key chunks, B * Hkv). Row r of the tile is query r % Nq of head hk * group + r // Nq.
    # PART_O: [B, Hq, Nq, chunks, D] fp32 (normalised within the chunk), PART_LSE: [B, Hq, Nq, chunks]
    wait_for_inputs(PDL)
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // n_kv_heads
    hk = bh % n_kv_heads
    rows = tl.arange(0, BLOCK_M)
    real_row = rows < group * n_q
    head = hk * group + rows // n_q
    qi = rows % n_q
    offs_d = tl.arange(0, D_TILE)
    n_heads = n_kv_heads * group
    q_mask = real_row[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(Q + b.to(tl.int64) * sqb + head[:, None] * sqh + qi[:, None] * sqm + offs_d[None, :], mask=q_mask,
                other=0.0)
    # rows past group * Nq copy a real row's window (not an empty one) so as not to shrink
    # the unmasked key range; their q is zero and their output is not stored
    if WINDOWED:
        klo = tl.load(KEY_LO + b * n_q + qi)
        khi = tl.load(KEY_HI + b * n_q + qi)
        q = tl.where((klo < khi)[:, None], q, 0.0)  # padded queries may hold NaN
    else:
        klo = tl.zeros([BLOCK_M], tl.int32)
        khi = tl.full([BLOCK_M], n_k, tl.int32)
    if not TMA:
        K += b.to(tl.int64) * skb + hk * skh
        V += b.to(tl.int64) * svb + hk * svh

    diag = n_k - n_q
    lo, f1, f2, hi = key_range(klo, khi, 0, n_q - 1, n_q, n_k, diag, WINDOWED, CAUSAL, BLOCK_N)
    # this program's chunk of keys (chunk is a multiple of BLOCK_N)
    c_lo = split * chunk
    c_hi = c_lo + chunk
    lo = tl.maximum(lo, c_lo)
    hi = tl.minimum(hi, c_hi)
    f1 = tl.minimum(tl.maximum(f1, lo), hi)
    f2 = tl.minimum(tl.maximum(f2, f1), hi)

    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_TILE], tl.float32)
    acc, l_i, m_i = fwd_tiles(acc, l_i, m_i, q, K, V, b, hk, skn, svn, qi, offs_d, klo, khi, lo, f1, n_k, diag,
                               qk_scale, True, CAUSAL, WINDOWED, True, HEAD_DIM, D_TILE, BLOCK_N, PRECISION, TMA)
    acc, l_i, m_i = fwd_tiles(acc, l_i, m_i, q, K, V, b, hk, skn, svn, qi, offs_d, klo, khi, f1, f2, n_k, diag,
                               qk_scale, False, CAUSAL, WINDOWED, True, HEAD_DIM, D_TILE, BLOCK_N, PRECISION, TMA)
    acc, l_i, m_i = fwd_tiles(acc, l_i, m_i, q, K, V, b, hk, skn, svn, qi, offs_d, klo, khi, f2, hi, n_k, diag,
                               qk_scale, True, CAUSAL, WINDOWED, True, HEAD_DIM, D_TILE, BLOCK_N, PRECISION, TMA)

    empty = l_i == 0.0  # no key of this chunk: weight zero in the merge
    part_row = ((b * n_heads + head) * n_q + qi).to(tl.int64) * n_chunks + split
    tl.store(PART_O + part_row[:, None] * D_TILE + offs_d[None, :], acc / tl.where(empty, 1.0, l_i)[:, None],
             mask=real_row[:, None])
    lse = tl.where(empty, -float("inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
    tl.store(PART_LSE + part_row, lse, mask=real_row)


@triton.jit
def _decode_merge_kernel(PART_O, PART_LSE, OUT, sob, soh, som, n_q, n_heads, n_chunks,
                         HEAD_DIM: tl.constexpr, D_TILE: tl.constexpr, CHUNKS: tl.constexpr, PDL: tl.constexpr):
    # grid: (B * Hq * Nq,): out = sum_c 2^(lse_c - max) o_c / sum_c 2^(lse_c - max)
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    i = row % n_q
    h = (row // n_q) % n_heads
    b = row // (n_q * n_heads)
    chunks = tl.arange(0, CHUNKS)
    offs_d = tl.arange(0, D_TILE)
    lse = tl.load(PART_LSE + row.to(tl.int64) * n_chunks + chunks, mask=chunks < n_chunks, other=-float("inf"))
    m = tl.max(lse, 0)
    weight = tl.math.exp2(lse - tl.where(m == -float("inf"), 0.0, m))  # all -inf: weights 0, output 0
    parts = tl.load(PART_O + (row.to(tl.int64) * n_chunks + chunks[:, None]) * D_TILE + offs_d[None, :],
                    mask=(chunks < n_chunks)[:, None], other=0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(OUT + b.to(tl.int64) * sob + h * soh + i * som + offs_d, out.to(OUT.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def flash_decode(q, k, v, causal, scale, windows, use_tma):
    """flash_attention's forward for a decode step (see `fits`); returns [B, Hq, Nq, D]."""
    # q: [B, Hq, Nq, D], k, v: [B, Hkv, Nk, D] (unit last stride)
    b, n_heads, n_q, d = q.shape
    n_kv_heads, n_k = k.shape[1], k.shape[2]
    group = n_heads // n_kv_heads
    d_tile = triton.next_power_of_2(d)
    chunk, n_chunks = split_in_blocks(n_k, BLOCK_N, triton.cdiv(PROGRAMS_PER_SM * sm_count(q.device),
                                                                 b * n_kv_heads))
    out = torch.empty(b, n_q, n_heads, d, device=q.device, dtype=q.dtype).transpose(1, 2)
    part_o = torch.empty(b, n_heads, n_q, n_chunks, d_tile, device=q.device, dtype=torch.float32)
    part_lse = torch.empty(b, n_heads, n_q, n_chunks, device=q.device, dtype=torch.float32)
    if windows is None:
        key_lo = key_hi = q
    else:
        key_lo, key_hi = (w.to(device=q.device, dtype=torch.int32).contiguous() for w in windows[:2])
    k_in, v_in = k, v
    launch = launch_options(q.device)  # both kernels launch alike
    if use_tma:
        k_in, v_in = (TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, BLOCK_N, d_tile]) for t in (k, v))
    _decode_chunk_kernel[(n_chunks, b * n_kv_heads)](
        q, k_in, v_in, part_o, part_lse, key_lo, key_hi,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), n_q, n_k, n_kv_heads, group, chunk, n_chunks, scale * LOG2_E,
        CAUSAL=causal, WINDOWED=windows is not None, HEAD_DIM=d, D_TILE=d_tile,
        BLOCK_M=max(16, triton.next_power_of_2(group * n_q)), BLOCK_N=BLOCK_N, PRECISION=dot_precision(q.dtype),
        TMA=use_tma, num_warps=NUM_WARPS, num_stages=NUM_STAGES, **launch)
    _decode_merge_kernel[(b * n_heads * n_q,)](
        part_o, part_lse, out, out.stride(0), out.stride(1), out.stride(2), n_q, n_heads, n_chunks,
        HEAD_DIM=d, D_TILE=d_tile, CHUNKS=triton.next_power_of_2(n_chunks), **launch)
    return out
