"""Flash attention: softmax(scale * q k^T, masked) v without an N x N matrix in memory.

`flash_attention(q, k, v, causal, scale, windows)` is the entry point. q: [B, Hq, Nq, D],
k, v: [B, Hkv, Nk, D] with Hq a multiple of Hkv (grouped-query heads read their shared K/V in
place, never repeated). With causal=True query i attends keys j <= i + Nk - Nq: the diagonal
is aligned to the end, as for a decode step or a chunk of prefill against a cache. `windows`
(see windows.py) narrows each query to an interval of keys: padding, packed
sequences, sliding windows. A query with no key to attend outputs zeros.

Forward: online softmax over key tiles, the log-sum-exp kept per row. Backward: P recomputed
from it; one kernel accumulates dQ per query tile (and stores each row's delta = rowsum(o * dO)
on the way), then another accumulates dK and dV per key tile over the query tiles of every
query head sharing it (no atomics: deterministic). Double backward (create_graph=True) differentiates
attention_reference instead (ops/common/autograd.py).
The routes, decided in `flash_attention` and `_forward` (under torch.compile inside the custom op
lorafuse::flash_attention):
  "sdpa"    tensors off CUDA without TRITON_INTERPRET=1, dtypes other than float32/float16/bfloat16, head dims
            not in HEAD_DIMS, torch.func transforms: torch's scaled_dot_product_attention under the windows' dense
            mask (its math backend under a transform), the reason logged once.
  "decode"  no autograd, at most flash_decode.MAX_ROWS query rows per K/V head and fewer queries than keys
            (flash_decode.fits_decode): the split-KV kernels of flash_decode.py.
  "flash"   the rest: the forward kernel and the two backward kernels here, their tiles loaded by TMA on Hopper
            when every base and stride is 16-byte aligned (16-bit dtypes; _use_tma), else by pointers.
"""
import contextlib
import functools
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.tools.tensor_descriptor import TensorDescriptor

from ..._logging import log_once
from ..common.autograd import differentiable_backward, functorch_reason
from ..common.tiles import cdiv, dot_precision, kernels_run_on
from ..common.traceable_log import log_once_traceable
from .tiles import (LOG2_E, allowed_tile, fwd_tiles, heavy_first, key_range, load_rows, query_rows,
                               tile_ranges, window_bounds)
from .windows import AttentionWindows, UnpaddedWindows, allowed_keys
from .flash_decode import fits_decode, flash_decode

HEAD_DIMS = (16, 32, 64, 80, 96, 128)  # 80 and 96 run in 128-wide tiles, masked


def attention_reference(q, k, v, causal=False, scale=None, windows: AttentionWindows | None = None):
    """The plain computation, in q's dtype: the test oracle (call it on float64 inputs)."""
    # q: [B, Hq, Nq, D], k, v: [B, Hkv, Nk, D]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    allowed = allowed_keys(windows, q.shape[2], k.shape[2], causal, q.device)[:, None]  # [B|1, 1, Nq, Nk]
    # Padding may hold NaN: masked scores and the values of keys nobody sees must not reach sums.
    seen = allowed.any(-2)[..., None]
    q, k, v = torch.where(allowed.any(-1, keepdim=True), q, 0), torch.where(seen, k, 0), torch.where(seen, v, 0)
    scores = torch.where(allowed, scale * q @ k.transpose(-1, -2), -math.inf)
    probs = torch.where(allowed, torch.softmax(scores, -1), 0)  # rows without keys: 0, not NaN
    return probs @ v


def _sdpa_fallback(q, k, v, causal, scale, windows, math_backend=False):
    # q: [B, Hq, Nq, D]; the dense mask exists only on this path. math_backend: SDPA's plain-op backend only (inside
    # torch.func's vmap, whose batching rule handed SDPA's fused CUDA kernels the mask without its vmapped batch
    # dimension: "attn_bias: wrong shape (batch dimension)")
    allowed = allowed_keys(windows, q.shape[2], k.shape[2], causal, q.device)[:, None]
    has_key, seen = allowed.any(-1, keepdim=True), allowed.any(-2)[..., None]
    q, k, v = torch.where(has_key, q, 0), torch.where(seen, k, 0), torch.where(seen, v, 0)
    mask = allowed | ~has_key  # SDPA returns NaN on rows with no key: give them all, zero after
    with sdpa_kernel(SDPBackend.MATH) if math_backend else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
    return torch.where(has_key, out, 0)


def _unsupported_reason(q, k, v, windows):
    if not kernels_run_on(q.device):
        return "tensors are not on a CUDA device (set TRITON_INTERPRET=1 to run the kernel on CPU)"
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {q.dtype} is not float32, float16 or bfloat16"
    if q.shape[-1] not in HEAD_DIMS:
        return f"head dim {q.shape[-1]} is not one of {HEAD_DIMS}"
    return None


def _check_inputs(q, k, v, windows):
    q_shape, k_shape, v_shape = q.shape, k.shape, v.shape
    if len(q_shape) != 4 or len(k_shape) != 4 or len(v_shape) != 4:
        raise ValueError(f"q, k, v must be [B, H, N, D]; got {tuple(q_shape)}, {tuple(k_shape)}, {tuple(v_shape)}")
    if k_shape != v_shape or q_shape[0] != k_shape[0] or q_shape[3] != k_shape[3]:
        raise ValueError(f"q {tuple(q_shape)}, k {tuple(k_shape)}, v {tuple(v_shape)}: k and v must match, "
                         "and share batch and head dim with q")
    if q_shape[1] % k_shape[1]:
        raise ValueError(f"{q_shape[1]} query heads are not a multiple of {k_shape[1]} key/value heads")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if windows is not None:
        queries, keys = (q_shape[0], q_shape[2]), (q_shape[0], k_shape[2])
        key_lo, key_hi, query_lo, query_hi = windows
        if not (key_lo.shape == key_hi.shape == queries and query_lo.shape == query_hi.shape == keys):
            raise ValueError(f"windows (key_lo, key_hi, query_lo, query_hi) must have shapes "
                             f"{[queries, queries, keys, keys]}, got {[tuple(w.shape) for w in windows]}")


def flash_attention(q, k, v, causal: bool = False, scale: float | None = None,
                    windows: AttentionWindows | None = None, transposed: bool = False):
    """Attention of q [B, Hq, Nq, D] over k, v [B, Hkv, Nk, D]; returns [B, Hq, Nq, D], or with transposed=True its
    transpose [B, Nq, Hq, D] (as transformers' attention functions return it; contiguous where the kernels wrote it,
    and no transpose in the autograd graph). Under torch.compile, the custom op lorafuse::flash_attention."""
    _check_inputs(q, k, v, windows)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    in_transform = functorch_reason(q, k, v)
    reason = in_transform or _unsupported_reason(q, k, v, windows)
    if reason is not None:
        log_once_traceable(f"lorafuse flash_attention: using torch SDPA because {reason}")
        out = _sdpa_fallback(q, k, v, causal, scale, windows, math_backend=in_transform is not None)
        return out.transpose(1, 2) if transposed else out
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    windows = _int32_windows(windows, q.device)
    training = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if torch.compiler.is_compiling():
        out = _flash_attention_op(q, k, v, causal, scale, *_window_tensors(windows), store_lse=training)[0]
    elif training:
        return FlashAttention.apply(q, k, v, causal, scale, windows, transposed)
    else:
        out = _forward(q, k, v, causal, scale, windows, store_lse=False)[0]
    return out.transpose(1, 2) if transposed else out


# ----------------------------------------------------------------------------------------------
# Kernels (their tile loops: attention/tiles.py)


@triton.jit(do_not_specialize=["n_q", "n_k", "n_heads", "group"])  # one compile for all lengths
def _attn_fwd_kernel(Q, K, V, OUT, LSE, KEY_LO, KEY_HI,
                     sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
                     n_q, n_k, n_heads, group, qk_scale,
                     CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, PER_ROW: tl.constexpr, STORE_LSE: tl.constexpr,
                     HEAD_DIM: tl.constexpr, D_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     PRECISION: tl.constexpr, TMA: tl.constexpr):
    # grid: (query tiles, B * Hq); q: [B, Hq, Nq, D], k, v: [B, Hkv, Nk, D] (TMA descriptors when TMA)
    pid_m = heavy_first(CAUSAL)
    bh = tl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_TILE)
    io_mask = (offs_m < n_q)[:, None] & (offs_d < HEAD_DIM)[None, :]
    hk = h // group
    if not TMA:
        Q += b.to(tl.int64) * sqb + h * sqh
        K += b.to(tl.int64) * skb + hk * skh
        V += b.to(tl.int64) * svb + hk * svh
    q = load_rows(Q, b, h, offs_m, pid_m * BLOCK_M, sqm, n_q, offs_d, HEAD_DIM, BLOCK_M, D_TILE, TMA)

    diag = n_k - n_q
    klo, khi = query_rows(KEY_LO, KEY_HI, b, offs_m, n_q, n_k, WINDOWED)
    lo, f1, f2, hi = key_range(klo, khi, pid_m * BLOCK_M, pid_m * BLOCK_M + BLOCK_M - 1, n_q, n_k, diag, WINDOWED,
                               CAUSAL, BLOCK_N)

    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_TILE], tl.float32)
    acc, l_i, m_i = fwd_tiles(acc, l_i, m_i, q, K, V, b, hk, skn, svn, offs_m, offs_d, klo, khi, lo, f1, n_k, diag,
                               qk_scale, True, CAUSAL, False, PER_ROW, HEAD_DIM, D_TILE, BLOCK_N, PRECISION, TMA)
    acc, l_i, m_i = fwd_tiles(acc, l_i, m_i, q, K, V, b, hk, skn, svn, offs_m, offs_d, klo, khi, f1, f2, n_k, diag,
                               qk_scale, False, CAUSAL, False, PER_ROW, HEAD_DIM, D_TILE, BLOCK_N, PRECISION, TMA)
    acc, l_i, m_i = fwd_tiles(acc, l_i, m_i, q, K, V, b, hk, skn, svn, offs_m, offs_d, klo, khi, f2, hi, n_k, diag,
                               qk_scale, True, CAUSAL, False, PER_ROW, HEAD_DIM, D_TILE, BLOCK_N, PRECISION, TMA)

    empty = l_i == 0.0  # no key at all: output zeros, and lse = inf makes every P zero
    acc = acc / tl.where(empty, 1.0, l_i)[:, None]
    OUT += b.to(tl.int64) * sob + h * soh
    tl.store(OUT + offs_m[:, None] * som + offs_d[None, :], acc.to(OUT.dtype.element_ty), mask=io_mask)
    if STORE_LSE:
        lse = tl.where(empty, float("inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
        tl.store(LSE + bh.to(tl.int64) * n_q + offs_m, lse, mask=offs_m < n_q)


@triton.jit
def _dkdv_tiles(dk, dv, k, v, Q, DO, LSE, DELTA, KEY_LO, KEY_HI, b, h, sqm, sdm, offs_n, offs_d, start, stop,
                n_q, n_k, diag, qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
                HEAD_DIM: tl.constexpr, D_TILE: tl.constexpr, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr,
                TMA: tl.constexpr):
    for start_m in range(start, stop, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = load_rows(Q, b, h, offs_m, start_m, sqm, n_q, offs_d, HEAD_DIM, BLOCK_M, D_TILE, TMA)
        do = load_rows(DO, b, h, offs_m, start_m, sdm, n_q, offs_d, HEAD_DIM, BLOCK_M, D_TILE, TMA)
        # rows past n_q: lse 0 makes P finite (1) for their zero q and dO, so they add nothing (not -inf: inf * 0)
        lse = tl.load(LSE + offs_m, mask=offs_m < n_q, other=0.0)
        delta = tl.load(DELTA + offs_m, mask=offs_m < n_q, other=0.0)
        st = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale  # [BLOCK_N, BLOCK_M]
        pt = tl.math.exp2(st - lse[None, :])
        if MASKED:
            klo, khi = query_rows(KEY_LO, KEY_HI, b, offs_m, n_q, n_k, WINDOWED)
            ok = tl.trans(allowed_tile(offs_m, offs_n, klo, khi, n_k, diag, CAUSAL, WINDOWED))
            pt = tl.where(ok, pt, 0.0)
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dst = pt * (dpt - delta[None, :])
        dk = tl.dot(dst.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["n_q", "n_k", "n_kv_heads", "group"])  # one compile for all lengths
def _attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, KEY_LO, KEY_HI, QUERY_LO, QUERY_HI,
                          sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdb, sdh, sdm,
                          sdkb, sdkh, sdkn, sdvb, sdvh, sdvn,
                          n_q, n_k, n_kv_heads, group, scale, qk_scale,
                          CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, HEAD_DIM: tl.constexpr,
                          D_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          PRECISION: tl.constexpr, TMA: tl.constexpr):
    # grid: (key tiles, B * Hkv); each program sums over the query tiles of all `group` query
    # heads that share its K/V head, so dK and dV are written once, without atomics. Q and dO
    # are TMA descriptors when TMA.
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // n_kv_heads
    hk = bh % n_kv_heads
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_TILE)
    kv_mask = (offs_n < n_k)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(K + b.to(tl.int64) * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + b.to(tl.int64) * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :], mask=kv_mask, other=0.0)

    # queries that see this key tile: i >= j - diag (causal) and i in the keys' query windows
    diag = n_k - n_q
    if WINDOWED:
        qlo = tl.load(QUERY_LO + b * n_k + offs_n, mask=offs_n < n_k, other=n_q)
        qhi = tl.load(QUERY_HI + b * n_k + offs_n, mask=offs_n < n_k, other=0)
    else:
        qlo = tl.where(offs_n < n_k, 0, n_q)
        qhi = tl.where(offs_n < n_k, n_q, 0)
    lo, hi, full_lo, full_hi = window_bounds(qlo, qhi, pid_n * BLOCK_N, pid_n * BLOCK_N + BLOCK_N - 1, n_k, n_q,
                                             WINDOWED)
    if CAUSAL:
        lo = tl.maximum(lo, pid_n * BLOCK_N - diag)
        full_lo = tl.maximum(full_lo, (pid_n + 1) * BLOCK_N - 1 - diag)
    lo = tl.maximum(lo, 0)
    lo, f1, f2 = tile_ranges(lo, full_lo, full_hi, hi, BLOCK_M)

    dk = tl.zeros([BLOCK_N, D_TILE], tl.float32)
    dv = tl.zeros([BLOCK_N, D_TILE], tl.float32)
    for g in range(group):
        h = hk * group + g
        if TMA:
            q_ptr, do_ptr = Q, DO
        else:
            q_ptr = Q + b.to(tl.int64) * sqb + h * sqh
            do_ptr = DO + b.to(tl.int64) * sdb + h * sdh
        row = (b * n_kv_heads * group + h).to(tl.int64) * n_q
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_ptr, do_ptr, LSE + row, DELTA + row, KEY_LO, KEY_HI, b, h, sqm, sdm,
                             offs_n, offs_d, lo, f1, n_q, n_k, diag, qk_scale,
                             True, CAUSAL, WINDOWED, HEAD_DIM, D_TILE, BLOCK_M, PRECISION, TMA)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_ptr, do_ptr, LSE + row, DELTA + row, KEY_LO, KEY_HI, b, h, sqm, sdm,
                             offs_n, offs_d, f1, f2, n_q, n_k, diag, qk_scale,
                             False, CAUSAL, WINDOWED, HEAD_DIM, D_TILE, BLOCK_M, PRECISION, TMA)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_ptr, do_ptr, LSE + row, DELTA + row, KEY_LO, KEY_HI, b, h, sqm, sdm,
                             offs_n, offs_d, f2, hi, n_q, n_k, diag, qk_scale,
                             True, CAUSAL, WINDOWED, HEAD_DIM, D_TILE, BLOCK_M, PRECISION, TMA)
    # s = scale * q k^T: dK carries the scale, dV does not
    tl.store(DK + b.to(tl.int64) * sdkb + hk * sdkh + offs_n[:, None] * sdkn + offs_d[None, :],
             (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + b.to(tl.int64) * sdvb + hk * sdvh + offs_n[:, None] * sdvn + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_tiles(dq, q, do, lse, delta, K, V, b, hk, skn, svn, offs_m, offs_d, klo, khi, start, stop, n_k, diag,
              qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, HEAD_DIM: tl.constexpr,
              D_TILE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr):
    for start_n in range(start, stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = load_rows(K, b, hk, offs_n, start_n, skn, n_k, offs_d, HEAD_DIM, BLOCK_N, D_TILE, TMA)
        v = load_rows(V, b, hk, offs_n, start_n, svn, n_k, offs_d, HEAD_DIM, BLOCK_N, D_TILE, TMA)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        p = tl.math.exp2(s - lse[:, None])
        if MASKED:
            ok = allowed_tile(offs_m, offs_n, klo, khi, n_k, diag, CAUSAL, WINDOWED)
            p = tl.where(ok, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    return dq


@triton.jit(do_not_specialize=["n_q", "n_k", "n_heads", "group"])  # one compile for all lengths
def _attn_bwd_dq_kernel(Q, K, V, OUT, DO, LSE, DELTA, DQ, KEY_LO, KEY_HI,
                        sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som, sdb, sdh, sdm, sdqb, sdqh, sdqm,
                        n_q, n_k, n_heads, group, scale, qk_scale,
                        CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, HEAD_DIM: tl.constexpr,
                        D_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        PRECISION: tl.constexpr, TMA: tl.constexpr):
    # grid: (query tiles, B * Hq); K and V are TMA descriptors when TMA. Runs before the dK/dV kernel: it also
    # stores delta = rowsum(o * dO), the row term of dS = P * (dP - delta), which that kernel reads.
    pid_m = heavy_first(CAUSAL)
    bh = tl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_TILE)
    io_mask = (offs_m < n_q)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(Q + b.to(tl.int64) * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :], mask=io_mask, other=0.0)
    do = tl.load(DO + b.to(tl.int64) * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :], mask=io_mask,
                 other=0.0)
    o = tl.load(OUT + b.to(tl.int64) * sob + h * soh + offs_m[:, None] * som + offs_d[None, :], mask=io_mask,
                other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh.to(tl.int64) * n_q + offs_m, delta, mask=offs_m < n_q)
    lse = tl.load(LSE + bh.to(tl.int64) * n_q + offs_m, mask=offs_m < n_q, other=float("inf"))
    hk = h // group
    if not TMA:
        K += b.to(tl.int64) * skb + hk * skh
        V += b.to(tl.int64) * svb + hk * svh

    diag = n_k - n_q
    klo, khi = query_rows(KEY_LO, KEY_HI, b, offs_m, n_q, n_k, WINDOWED)
    lo, f1, f2, hi = key_range(klo, khi, pid_m * BLOCK_M, pid_m * BLOCK_M + BLOCK_M - 1, n_q, n_k, diag, WINDOWED,
                               CAUSAL, BLOCK_N)

    dq = tl.zeros([BLOCK_M, D_TILE], tl.float32)
    dq = _dq_tiles(dq, q, do, lse, delta, K, V, b, hk, skn, svn, offs_m, offs_d, klo, khi, lo, f1, n_k, diag,
                   qk_scale, True, CAUSAL, WINDOWED, HEAD_DIM, D_TILE, BLOCK_N, PRECISION, TMA)
    dq = _dq_tiles(dq, q, do, lse, delta, K, V, b, hk, skn, svn, offs_m, offs_d, klo, khi, f1, f2, n_k, diag,
                   qk_scale, False, CAUSAL, WINDOWED, HEAD_DIM, D_TILE, BLOCK_N, PRECISION, TMA)
    dq = _dq_tiles(dq, q, do, lse, delta, K, V, b, hk, skn, svn, offs_m, offs_d, klo, khi, f2, hi, n_k, diag,
                   qk_scale, True, CAUSAL, WINDOWED, HEAD_DIM, D_TILE, BLOCK_N, PRECISION, TMA)
    tl.store(DQ + b.to(tl.int64) * sdqb + h * sdqh + offs_m[:, None] * sdqm + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=io_mask)


# ----------------------------------------------------------------------------------------------
# Launchers. Tile shapes per kernel, for head dims up to 64 and up to 128 (16-bit inputs);
# fp32 (exact "ieee" dots) and Triton's interpreter use smaller tiles.
# TILE_CONFIGS: the fastest tiles at N=2048, bf16 (bench_attention.py; rows in benchmarks/results/attention.csv).
TILE_CONFIGS = {  # (kernel, head dim up to, causal)
    ("fwd", 64, True): dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    ("fwd", 64, False): dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    ("fwd", 128, True): dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    ("fwd", 128, False): dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
    ("dkdv", 64, True): dict(BLOCK_M=32, BLOCK_N=128, num_warps=4, num_stages=3),
    ("dkdv", 64, False): dict(BLOCK_M=32, BLOCK_N=128, num_warps=4, num_stages=3),
    ("dkdv", 128, True): dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2),
    ("dkdv", 128, False): dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2),
    ("dq", 64, True): dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    ("dq", 64, False): dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    ("dq", 128, True): dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    ("dq", 128, False): dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
}
FP32_TILES = dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=2)
INTERPRETER_TILES = dict(BLOCK_M=16, BLOCK_N=16)
DECODE_BLOCK_M = 16  # tl.dot's smallest tile: a decode step's 1..16 query rows in one
USE_TMA = True


@functools.cache
def _launch_constants(kernel: str, head_dim: int, dtype: torch.dtype, on_cuda: bool, causal: bool,
                      few_rows: bool = False) -> dict:
    """A kernel's constexpr arguments and launch options, all but the per-call flags (WINDOWED, TMA; the forward's
    PER_ROW and STORE_LSE): decided once per kernel, head dim, dtype, device kind and causal. few_rows: the forward's
    queries fit one decode tile. Every such call shares the dict: never modify it."""
    d_tile = triton.next_power_of_2(head_dim)
    if not on_cuda:
        tiles = dict(INTERPRETER_TILES)
    elif dtype == torch.float32:
        tiles = dict(FP32_TILES)
    else:
        tiles = dict(TILE_CONFIGS[(kernel, 64 if d_tile <= 64 else 128, causal)])
        if kernel == "fwd" and few_rows:
            tiles["BLOCK_M"] = DECODE_BLOCK_M
    return dict(CAUSAL=causal, HEAD_DIM=head_dim, D_TILE=d_tile, PRECISION=dot_precision(dtype), **tiles)


@functools.cache
def _tma_device(device: torch.device) -> bool:
    # Hopper or later; off CUDA the interpreter emulates TMA
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9


def _use_tma(*tensors) -> bool:
    """Hopper's TMA loads tiles when every stride and base is 16-byte aligned (off CUDA the
    interpreter emulates it). Set USE_TMA = False to compare with plain pointer loads."""
    first = tensors[0]
    if not USE_TMA or first.dtype == torch.float32 or not _tma_device(first.device):
        return False
    size = first.element_size()
    for t in tensors:
        # every stride is 16-byte aligned exactly when their greatest common divisor is
        if t.data_ptr() % 16 or math.gcd(*t.stride()[:-1]) * size % 16:
            return False
    return True


@functools.lru_cache(maxsize=1024)
def _descriptor_layout(shape: torch.Size, strides: tuple, dtype: torch.dtype, box: tuple) -> dict:
    # A TensorDescriptor's fields but its base, which its constructor checks (aligned strides, a legal box): once per
    # layout here, on an empty stand-in for the tensor. _use_tma checks every call's base address.
    checked = TensorDescriptor(torch.empty(0, dtype=dtype), list(shape), list(strides), list(box))
    return {name: value for name, value in vars(checked).items() if name != "base"}


def _descriptor(t, rows, d_tile):
    # t: [B, H, N, D] with unit last stride; one load is a [1, 1, rows, d_tile] box. A descriptor binds its tensor
    # (Triton encodes the TMA map from its address at each launch): only the checked layout is shared between calls.
    descriptor = object.__new__(TensorDescriptor)
    descriptor.__dict__.update(_descriptor_layout(t.shape, t.stride(), t.dtype, (1, 1, rows, d_tile)), base=t)
    return descriptor


# Padding: queries that see no key and keys no query sees. Their rows of q, k, v and dO may hold NaN, which a zero
# weight (0 * NaN) would carry into the kernels' sums. Those rows are zeroed in copies before the kernels run, only
# where a kernel multiplies them: v for the forward (scores of masked keys are replaced, so q and k may stay); q, k
# and dO for the backward. A pass over each copied tensor costs less than guarding inside the kernels: a select on
# loaded tiles slows every tile loop.

def _padding_rows(windows):
    # -> (queries with keys [B, Nq], keys some query sees [B, Nk]) as bool, or None when the windows hold no padding
    if windows is None or isinstance(windows, UnpaddedWindows):
        return None
    return windows.key_lo < windows.key_hi, windows.query_lo < windows.query_hi


def _rows_zeroed(t, keep):
    # t: [B, H, N, D], keep: [B, N] bool -> a copy of t with the rows not kept zeroed
    return torch.where(keep[:, None, :, None], t, 0)


def _unseen_keys_zeroed(v, windows):
    # what the forward kernels need: v without the rows of keys no query sees (v itself when there are none)
    padding = _padding_rows(windows)
    return v if padding is None else _rows_zeroed(v, padding[1])


def _int32_windows(windows, device):
    # the windows as the kernels read them: int32, contiguous, on q's device (attention_windows builds them so)
    if windows is None or all(w.dtype == torch.int32 and w.device == device and w.is_contiguous() for w in windows):
        return windows
    return type(windows)(*(w.to(device=device, dtype=torch.int32).contiguous() for w in windows))


def _window_args(windows, q):
    # the kernels read the windows only when WINDOWED; any pointer stands in otherwise
    return (q, q, q, q) if windows is None else windows


def _flash_forward(q, k, v, causal, scale, windows, store_lse):
    # q: [B, Hq, Nq, D], k, v: [B, Hkv, Nk, D] -> out (a [B, Hq, Nq, D] view of [B, Nq, Hq, D]), lse [B, Hq, Nq]
    b, n_heads, n_q, d = q.shape
    n_k = k.shape[2]
    # [B, Nq, Hq, D] memory is what Hugging Face's attention layers reshape to [B, Nq, Hq * D]
    out = torch.empty_strided((b, n_heads, n_q, d), (n_q * n_heads * d, d, n_heads * d, 1), device=q.device,
                              dtype=q.dtype)
    lse = torch.empty(b, n_heads, n_q, device=q.device, dtype=torch.float32) if store_lse else q
    key_lo, key_hi, _, _ = _window_args(windows, q)
    constants = _launch_constants("fwd", d, q.dtype, q.is_cuda, causal, n_q <= DECODE_BLOCK_M)
    d_tile = constants["D_TILE"]
    grid = (cdiv(n_q, constants["BLOCK_M"]), b * n_heads)
    tma = _use_tma(q, k, v)
    if tma:
        q_in, k_in, v_in = (_descriptor(q, constants["BLOCK_M"], d_tile), _descriptor(k, constants["BLOCK_N"], d_tile),
                            _descriptor(v, constants["BLOCK_N"], d_tile))
    else:
        q_in, k_in, v_in = q, k, v
    # Without windows the masked tiles may test keys instead of rows (allowed_tile's PER_ROW): the causal forward
    # runs faster so, the non-causal one slower
    _attn_fwd_kernel[grid](
        q_in, k_in, v_in, out, lse, key_lo, key_hi, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        *out.stride()[:3], n_q, n_k, n_heads, n_heads // k.shape[1], scale * LOG2_E,
        WINDOWED=windows is not None, PER_ROW=windows is not None or not causal, STORE_LSE=store_lse, TMA=tma,
        **constants)
    return out, lse if store_lse else None


def _flash_backward(q, k, v, out, lse, dout, causal, scale, windows):
    # dout: [B, Hq, Nq, D] -> dq, dk, dv shaped and strided as q, k, v
    b, n_heads, n_q, d = q.shape
    n_kv_heads, n_k = k.shape[1], k.shape[2]
    group = n_heads // n_kv_heads
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    key_lo, key_hi, query_lo, query_hi = _window_args(windows, q)

    delta = torch.empty(b, n_heads, n_q, device=q.device, dtype=torch.float32)  # the dQ kernel fills it
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    q_strides, k_strides, v_strides, do_strides = q.stride()[:3], k.stride()[:3], v.stride()[:3], dout.stride()[:3]
    tma = _use_tma(q, k, v, dout)
    flags = dict(WINDOWED=windows is not None, TMA=tma)
    constants = _launch_constants("dq", d, q.dtype, q.is_cuda, causal)
    d_tile = constants["D_TILE"]
    k_in, v_in = k, v
    if tma:
        k_in, v_in = _descriptor(k, constants["BLOCK_N"], d_tile), _descriptor(v, constants["BLOCK_N"], d_tile)
    _attn_bwd_dq_kernel[(cdiv(n_q, constants["BLOCK_M"]), b * n_heads)](
        q, k_in, v_in, out, dout, lse, delta, dq, key_lo, key_hi, *q_strides, *k_strides, *v_strides,
        *out.stride()[:3], *do_strides, *dq.stride()[:3],
        n_q, n_k, n_heads, group, scale, scale * LOG2_E, **flags, **constants)
    constants = _launch_constants("dkdv", d, q.dtype, q.is_cuda, causal)
    q_in, do_in = q, dout
    if tma:
        q_in, do_in = _descriptor(q, constants["BLOCK_M"], d_tile), _descriptor(dout, constants["BLOCK_M"], d_tile)
    _attn_bwd_dkdv_kernel[(cdiv(n_k, constants["BLOCK_N"]), b * n_kv_heads)](
        q_in, k, v, do_in, lse, delta, dk, dv, key_lo, key_hi, query_lo, query_hi, *q_strides, *k_strides, *v_strides,
        *do_strides, *dk.stride()[:3], *dv.stride()[:3],
        n_q, n_k, n_kv_heads, group, scale, scale * LOG2_E, **flags, **constants)
    return dq, dk, dv


def _forward(q, k, v, causal, scale, windows, store_lse):
    # -> out [B, Hq, Nq, D], lse [B, Hq, Nq] (None without store_lse: then a decode step takes the split-KV kernel)
    if not store_lse and fits_decode(q, k):
        return flash_decode(q, k, v, causal, scale, windows, _use_tma(k, v)), None
    return _flash_forward(q, k, _unseen_keys_zeroed(v, windows), causal, scale, windows, store_lse)


def _backward_inputs(q, k, v, dout, windows):
    # q, k, v, dout as the backward kernels read them: the rows of padding zeroed (copies where there is padding)
    padding = _padding_rows(windows)
    if padding is None:
        return q, k, v, dout
    queries, keys = padding
    return _rows_zeroed(q, queries), _rows_zeroed(k, keys), _rows_zeroed(v, keys), _rows_zeroed(dout, queries)


def _backward(q, k, v, out, lse, dout, causal, scale, windows):
    # -> dq, dk, dv shaped and strided as _backward_inputs' q, k, v
    q, k, v, dout = _backward_inputs(q, k, v, dout, windows)
    return _flash_backward(q, k, v, out, lse, dout, causal, scale, windows)


class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, windows, transposed):
        out, lse = _forward(q, k, v, causal, scale, windows, store_lse=True)
        # v as given, not the zeroed copy: double backward differentiates with respect to the inputs themselves
        ctx.save_for_backward(q, k, v, out, lse, *(windows or ()))
        ctx.causal, ctx.scale, ctx.windows_type, ctx.transposed = causal, scale, type(windows), transposed
        return out.transpose(1, 2) if transposed else out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *windows = ctx.saved_tensors
        windows = ctx.windows_type(*windows) if windows else None
        if ctx.transposed:
            dout = dout.transpose(1, 2)
        if torch.is_grad_enabled():  # create_graph=True: gradients that autograd can differentiate again
            log_once("lorafuse flash_attention: double backward (create_graph=True) differentiates the plain "
                     "attention, whose memory grows with the square of the sequence length")
            return *differentiable_backward(attention_reference, (q, k, v, ctx.causal, ctx.scale, windows), dout), None
        return *_backward(q, k, v, out, lse, dout, ctx.causal, ctx.scale, windows), None, None, None, None


# The same launches as custom ops, which torch.compile traces through (the Function above costs less host time per
# call in eager mode, so eager calls keep it). Double backward is not theirs to give: compiled graphs have none.
# Custom ops take tensors and scalars: the windows go as their four tensors (None without windows) and whether
# they are UnpaddedWindows.

def _window_tensors(windows: AttentionWindows | None) -> tuple:
    # -> key_lo, key_hi, query_lo, query_hi, unpadded: the custom ops' arguments for `windows`
    if windows is None:
        return None, None, None, None, False
    return *windows, isinstance(windows, UnpaddedWindows)


def _windows_of(key_lo, key_hi, query_lo, query_hi, unpadded) -> AttentionWindows | None:
    # _window_tensors' inverse
    if key_lo is None:
        return None
    return (UnpaddedWindows if unpadded else AttentionWindows)(key_lo, key_hi, query_lo, query_hi)


@torch.library.custom_op("lorafuse::flash_attention", mutates_args=())
def _flash_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                        key_lo: torch.Tensor | None, key_hi: torch.Tensor | None,
                        query_lo: torch.Tensor | None, query_hi: torch.Tensor | None, unpadded: bool,
                        store_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # q: [B, Hq, Nq, D], k, v: [B, Hkv, Nk, D] (unit last stride), windows int32 and contiguous on q's device
    # -> out [B, Hq, Nq, D], lse [B, Hq, Nq] fp32 (with store_lse, which a backward needs; else empty: custom ops
    # return no None)
    windows = _windows_of(key_lo, key_hi, query_lo, query_hi, unpadded)
    out, lse = _forward(q, k, v, causal, scale, windows, store_lse)
    return out, lse if store_lse else q.new_empty(0, dtype=torch.float32)


@_flash_attention_op.register_fake
def _flash_attention_fake(q, k, v, causal, scale, key_lo, key_hi, query_lo, query_hi, unpadded, store_lse):
    b, n_heads, n_q, d = q.shape
    out = q.new_empty(b, n_q, n_heads, d).transpose(1, 2)  # the kernels' layout: [B, Nq, Hq, D] memory
    return out, q.new_empty((b, n_heads, n_q) if store_lse else (0,), dtype=torch.float32)


@torch.library.custom_op("lorafuse::flash_attention_backward", mutates_args=())
def _flash_attention_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                                 lse: torch.Tensor, dout: torch.Tensor, causal: bool, scale: float,
                                 key_lo: torch.Tensor | None, key_hi: torch.Tensor | None,
                                 query_lo: torch.Tensor | None, query_hi: torch.Tensor | None,
                                 unpadded: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # dout: [B, Hq, Nq, D] -> dq, dk, dv
    windows = _windows_of(key_lo, key_hi, query_lo, query_hi, unpadded)
    return _backward(q, k, v, out, lse, dout, causal, scale, windows)


@_flash_attention_backward_op.register_fake
def _flash_attention_backward_fake(q, k, v, out, lse, dout, causal, scale, key_lo, key_hi, query_lo, query_hi,
                                   unpadded):
    # the gradients take the layouts of the kernels' inputs, which zeroing padding rows may change
    windows = _windows_of(key_lo, key_hi, query_lo, query_hi, unpadded)
    q, k, v, _ = _backward_inputs(q, k, v, dout, windows)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _flash_attention_setup_context(ctx, inputs, output):
    q, k, v, causal, scale, key_lo, key_hi, query_lo, query_hi, unpadded, store_lse = inputs
    ctx.save_for_backward(q, k, v, *output, key_lo, key_hi, query_lo, query_hi)
    ctx.causal, ctx.scale, ctx.unpadded, ctx.store_lse = causal, scale, unpadded, store_lse


def _flash_attention_op_backward(ctx, dout, _dlse):
    if not ctx.store_lse:
        raise RuntimeError("lorafuse::flash_attention ran with store_lse=False, which keeps nothing for a backward: "
                           "pass store_lse=True when its inputs need gradients")
    q, k, v, out, lse, *windows = ctx.saved_tensors
    dq, dk, dv = _flash_attention_backward_op(q, k, v, out, lse, dout, ctx.causal, ctx.scale, *windows, ctx.unpadded)
    return dq, dk, dv, None, None, None, None, None, None, None, None


_flash_attention_op.register_autograd(_flash_attention_op_backward, setup_context=_flash_attention_setup_context)
