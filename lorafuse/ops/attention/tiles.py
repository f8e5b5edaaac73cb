"""The tile loops that flash attention's kernels share (flash_attention.py, flash_decode.py).

Scores run in base 2: qk_scale = scale * log2(e), and the saved log-sum-exp `lse` is log2 of
each row's softmax denominator, so P = exp2(q k^T * qk_scale - lse).

Every program walks its tiles in three ranges: masked tiles where the first rows' windows
begin, unmasked tiles that every row sees whole, masked tiles at the causal diagonal, the
windows' ends and the sequence's end. Only masked tiles pay for the mask; only they can hold
padding, whose K, V, Q or dO may be NaN. flash_attention zeroes those rows once per call before its kernels
run (a select on loaded tiles would slow every loop of a kernel); flash_decode,
which would copy its whole key cache each step, zeroes what no allowed score reaches inside the tiles
(fwd_tiles with PADDED).
"""
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634


@triton.jit
def tile_ranges(lo, full_lo, full_hi, hi, BLOCK: tl.constexpr):
    # [lo, f1) masked, [f1, f2) unmasked, [f2, hi) masked; lo, f1, f2 are tile-aligned
    lo = lo // BLOCK * BLOCK
    f1 = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK) * BLOCK, lo), hi)
    f2 = tl.minimum(tl.maximum(full_hi // BLOCK * BLOCK, f1), hi)
    return lo, f1, f2


@triton.jit
def heavy_first(CAUSAL: tl.constexpr):
    # Causal query tiles further down see more keys: launch them first, so that the cheap ones
    # fill the last wave instead of leaving SMs idle behind one long tile.
    if CAUSAL:
        return tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        return tl.program_id(0)


@triton.jit
def query_rows(KEY_LO, KEY_HI, b, offs_m, n_q, n_k, WINDOWED: tl.constexpr):
    """Key windows of a tile of query rows; rows past n_q get empty ones."""
    if WINDOWED:
        klo = tl.load(KEY_LO + b * n_q + offs_m, mask=offs_m < n_q, other=n_k)
        khi = tl.load(KEY_HI + b * n_q + offs_m, mask=offs_m < n_q, other=0)
    else:
        klo = tl.where(offs_m < n_q, 0, n_k)
        khi = tl.where(offs_m < n_q, n_k, 0)
    return klo, khi


@triton.jit
def window_bounds(lo_of_row, hi_of_row, first_row, last_row, n_rows, n_cols, WINDOWED: tl.constexpr):
    """(lo, hi, full_lo, full_hi): the columns that some of rows first_row..last_row see, and those that all of them
    see, from per-row windows [lo_of_row, hi_of_row). Without windows every row below n_rows sees columns
    0..n_cols-1, which scalars give without the reductions over the rows (those add a small cost to the causal
    forward)."""
    if WINDOWED:
        lo = tl.min(lo_of_row, 0)
        hi = tl.max(hi_of_row, 0)
        full_lo = tl.max(lo_of_row, 0)
        full_hi = tl.min(hi_of_row, 0)
    else:
        lo = tl.where(first_row < n_rows, 0, n_cols)
        hi = tl.where(first_row < n_rows, n_cols, 0)
        full_lo = tl.where(last_row < n_rows, 0, n_cols)
        full_hi = tl.where(last_row < n_rows, n_cols, 0)
    return lo, hi, full_lo, full_hi


@triton.jit
def key_range(klo, khi, first_row, last_row, n_q, n_k, diag, WINDOWED: tl.constexpr, CAUSAL: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """Key tiles that query rows first_row..last_row visit, split into masked and unmasked ranges."""
    lo, hi, full_lo, full_hi = window_bounds(klo, khi, first_row, last_row, n_q, n_k, WINDOWED)
    if CAUSAL:  # query i sees keys j <= i + diag
        hi = tl.minimum(hi, last_row + diag + 1)
        full_hi = tl.minimum(full_hi, first_row + diag + 1)
    lo, f1, f2 = tile_ranges(lo, full_lo, full_hi, hi, BLOCK_N)
    return lo, f1, f2, hi


@triton.jit
def allowed_tile(offs_m, offs_n, klo, khi, n_k, diag, CAUSAL: tl.constexpr, PER_ROW: tl.constexpr):
    # [BLOCK_M, BLOCK_N] (or [1, BLOCK_N]). PER_ROW: each row's window [klo, khi), which also drops rows past n_q
    # and keys past n_k; else every row sees keys 0..n_k-1 (no windows): one test per key. Rows past n_q then
    # compute on zeros: never stored, and in dK/dV they add exactly zero (their q and dO load as zeros, their lse
    # and delta as 0: P = 1 times zero factors). Both are right without windows; which is faster depends on the kernel
    # (non-causal, triton 3.6: the forward is faster per row, the backward per key).
    if PER_ROW:
        ok = (offs_n[None, :] >= klo[:, None]) & (offs_n[None, :] < khi[:, None])
    else:
        ok = (offs_n < n_k)[None, :]
    if CAUSAL:
        ok = ok & (offs_n[None, :] <= offs_m[:, None] + diag)
    return ok


@triton.jit
def load_rows(X, b, h, offs, start, stride, n, offs_d, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
               D_TILE: tl.constexpr, TMA: tl.constexpr):
    # a [BLOCK, D_TILE] tile of rows start.. of head h (zeros past n and past HEAD_DIM); X is a
    # 4-D TMA descriptor of [B, H, N, D] when TMA, else a pointer already at (b, h)
    if TMA:
        return X.load([b, h, start, 0]).reshape(BLOCK, D_TILE)
    else:
        mask = (offs < n)[:, None] & (offs_d < HEAD_DIM)[None, :]
        return tl.load(X + offs[:, None] * stride + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def fwd_tiles(acc, l_i, m_i, q, K, V, b, hk, skn, svn, offs_m, offs_d, klo, khi, start, stop, n_k, diag, qk_scale,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, PADDED: tl.constexpr, PER_ROW: tl.constexpr,
               HEAD_DIM: tl.constexpr, D_TILE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
               TMA: tl.constexpr):
    # PADDED: windows may leave keys unseen (padding) whose V rows were not zeroed and may hold NaN.
    # PER_ROW: masked tiles test each row's window (allowed_tile); it must be set where there are windows.
    for start_n in range(start, stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = load_rows(K, b, hk, offs_n, start_n, skn, n_k, offs_d, HEAD_DIM, BLOCK_N, D_TILE, TMA)
        v = load_rows(V, b, hk, offs_n, start_n, svn, n_k, offs_d, HEAD_DIM, BLOCK_N, D_TILE, TMA)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if MASKED:
            ok = allowed_tile(offs_m, offs_n, klo, khi, n_k, diag, CAUSAL, PER_ROW)
            s = tl.where(ok, qk * qk_scale, -float("inf"))
            if PADDED:  # keys no row here sees may hold NaN
                v = tl.where(tl.max(ok.to(tl.int32), 0)[:, None] > 0, v, 0.0)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # rows with no key yet keep max -inf, but subtract 0 (not -inf - -inf = NaN)
            m_sub = tl.where(m_new == -float("inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_sub[:, None])
        else:
            # scale and shift in one FMA per score: the non-matmul work bounds this loop
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_sub = m_new
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i
