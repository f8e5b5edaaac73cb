"""Dropout masks drawn inside kernels from a seed: Philox4x32, 14-bit keep decisions.

A mask element depends only on (seed, row, column), never on tile sizes, so the forward
shrink, the backward dA kernel and the dx epilogue all redraw the same mask without storing
it. One Philox call yields four 32-bit words for eight neighbouring columns: column 8g + 2j + h
of column group g takes half h of word j, as a 14-bit draw (the half's low 14 bits).

Why 14 bits: a 14-bit draw is a positive, finite float16 bit pattern, so one paired half-precision
compare (`set.ge.u32.f16x2`, any NVIDIA GPU since sm_53) decides two neighbouring columns against
the threshold at once, and one AND makes their 0/1 multipliers in x's dtype: 1.5 instructions a
column where 16-bit draws took 3 (integer compares, selects and a repack).
Triton's interpreter has no inline assembly: there the same decisions run as integer compares.

The drop probability is rounded to a multiple of 1/16384 (at most 3.1e-5 away from the requested
p); kept values are scaled by 1/(1 - p_effective), so the expectation is exact.
`keep_mask_reference` is the same generator in plain PyTorch (int64 arithmetic).
"""
import torch
import triton
import triton.language as tl

KEEP_BITS = 14
DRAWS_PER_CALL = 8  # 4 words x 2 halves
PHILOX_ROUNDS = 7  # Philox4x32-7 passes BigCrush (Salmon et al., SC'11); 10 only adds margin, at 10/7 the cost
# Triton's interpreter (TRITON_INTERPRET, the CPU tests) runs no inline assembly: the plain compares instead
INTERPRETED = tl.constexpr(bool(triton.knobs.runtime.interpret))
DRAW_MASK = tl.constexpr((1 << KEEP_BITS) - 1)  # a draw: these bits of its half-word

_KEY_A, _KEY_B, _ROUND_A, _ROUND_B = 0x9E3779B9, 0xBB67AE85, 0xD2511F53, 0xCD9E8D57
PHILOX_KEY_A = tl.constexpr(_KEY_A)
PHILOX_KEY_B = tl.constexpr(_KEY_B)
PHILOX_ROUND_A = tl.constexpr(_ROUND_A)
PHILOX_ROUND_B = tl.constexpr(_ROUND_B)
_MASK32 = 0xFFFFFFFF


def drop_threshold(p: float) -> int:
    """Integer threshold t: an element is kept when its 14-bit draw is >= t."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must lie in [0, 1), got {p}")
    t = round(p * (1 << KEEP_BITS))
    if t == 1 << KEEP_BITS:
        raise ValueError(f"dropout probability {p} rounds to 1 at the kernels' resolution of 1/{1 << KEEP_BITS}: "
                         "use a smaller p")
    return t


def keep_scale(p: float) -> float:
    """1 / (1 - p_effective): the factor applied to kept elements."""
    return (1 << KEEP_BITS) / ((1 << KEEP_BITS) - drop_threshold(p))


def dropout_args(p: float) -> tuple[int, float]:
    """(threshold, keep scale): the two numbers every kernel with a mask takes."""
    return drop_threshold(p), keep_scale(p)


def new_seed(device) -> torch.Tensor:
    """A fresh seed as a 1-element int64 tensor drawn from torch's generator on `device`.

    Kept on the device so that kernels read it there: no host sync, and CUDA-graph replays
    draw new masks (torch's CUDA generator is graph-safe)."""
    return torch.randint(0, 2**62, (1,), device=device, dtype=torch.int64)


@triton.jit
def philox(c0, c1, c2, c3, k0, k1, ROUNDS: tl.constexpr):
    for _ in tl.static_range(ROUNDS):
        # one 32 x 32 bit product into 64 bits gives both words (one IMAD.WIDE on sm_90, where umulhi and a multiply
        # take two instructions: the masked shrink's kernel compiles to fewer instructions)
        product_b = c2.to(tl.uint64) * PHILOX_ROUND_B
        product_a = c0.to(tl.uint64) * PHILOX_ROUND_A
        c0 = (product_b >> 32).to(tl.uint32) ^ c1 ^ k0
        c2 = (product_a >> 32).to(tl.uint32) ^ c3 ^ k1
        c1 = product_b.to(tl.uint32)
        c3 = product_a.to(tl.uint32)
        k0 = k0 + PHILOX_KEY_A
        k1 = k1 + PHILOX_KEY_B
    return c0, c1, c2, c3


@triton.jit
def keep_tile(seed_ptr, rows, col_start, THRESHOLD, BLOCK_K: tl.constexpr, ROUNDS: tl.constexpr, dtype: tl.constexpr):
    # rows: [BM] row indices; columns col_start .. col_start + BLOCK_K (col_start % 8 == 0).
    # Returns the [BM, BLOCK_K] keep mask of those elements: 1 (kept) or 0 in dtype.
    seed = tl.load(seed_ptr).to(tl.uint64)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = (seed >> 32).to(tl.uint32)
    groups = (col_start // 8 + tl.arange(0, BLOCK_K // 8)).to(tl.uint32)
    c0 = tl.zeros([rows.shape[0], BLOCK_K // 8], tl.uint32) + groups[None, :]
    c1 = tl.zeros([rows.shape[0], BLOCK_K // 8], tl.uint32) + rows.to(tl.uint32)[:, None]
    zero = tl.zeros([rows.shape[0], BLOCK_K // 8], tl.uint32)
    w0, w1, w2, w3 = philox(c0, c1, zero, zero, k0, k1, ROUNDS)
    # tl.join appends its new axis last: join(join(w0, w2), join(w1, w3))[..., a, b] is word 2a + b, so column pair
    # 4g + j takes word j of group g's call
    words = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), [rows.shape[0], BLOCK_K // 2])
    low, high = keep_of_words(words, THRESHOLD, dtype)
    return tl.reshape(tl.join(low, high), [rows.shape[0], BLOCK_K])


# each half: its draw as a float16 >= the threshold's: ONE's half (1 in the dtype), else 0
_KEEP_ASM = f"""{{ .reg .b32 d;
and.b32 d, $1, {DRAW_MASK.value * 0x10001:#x};
set.ge.u32.f16x2 d, d, $2;
and.b32 $0, d, ONE; }}"""
_KEEP_BF16_ASM = tl.constexpr(_KEEP_ASM.replace("ONE", "0x3F803F80"))
_KEEP_F16_ASM = tl.constexpr(_KEEP_ASM.replace("ONE", "0x3C003C00"))


@triton.jit
def keep_of_words(words, THRESHOLD, dtype: tl.constexpr):
    # words: uint32, each drawing a pair of neighbouring columns (its low half the first). Returns (first, second):
    # 1 where the half's draw (its DRAW_MASK bits) is >= THRESHOLD, else 0, in dtype, shaped as words. 16-bit
    # dtypes take one paired float16 compare (the module's top); the interpreter and float32 the integer compares.
    if INTERPRETED or dtype == tl.float32:  # one return at the end: Triton traces the code after an early one
        # Under the interpreter a bool cast to bf16 holds the bit pattern 0x0001, which its bf16 product with x reads
        # as 1 (its multiplies work on the bits): x * keep is right there, keep's own value is not
        first = ((words & DRAW_MASK) >= THRESHOLD).to(dtype)
        second = (((words >> 16) & DRAW_MASK) >= THRESHOLD).to(dtype)
    else:
        limit = tl.cast(THRESHOLD, tl.uint32) * 0x10001  # in both halves: a float16 bit pattern like the draws'
        if dtype == tl.bfloat16:
            pair = tl.inline_asm_elementwise(_KEEP_BF16_ASM, "=r,r,r", [words, limit], dtype=tl.uint32,
                                             is_pure=True, pack=1)
        else:
            tl.static_assert(dtype == tl.float16, "keep_of_words makes float32, bfloat16 or float16 multipliers")
            pair = tl.inline_asm_elementwise(_KEEP_F16_ASM, "=r,r,r", [words, limit], dtype=tl.uint32,
                                             is_pure=True, pack=1)
        first = (pair & 0xFFFF).to(tl.uint16).to(dtype, bitcast=True)
        second = (pair >> 16).to(tl.uint16).to(dtype, bitcast=True)
    return first, second


def _mulhilo(a: torch.Tensor, b: int):
    # a: uint32 values held in int64, b < 2**32; returns (hi, lo) 32-bit words of a * b without overflow: b is cut in
    # 16-bit halves, so that each partial product stays under 2**48.
    by_lo = a * (b & 0xFFFF)
    by_hi = a * (b >> 16)
    lo = (by_lo + ((by_hi & 0xFFFF) << 16)) & _MASK32
    hi = (by_hi + (by_lo >> 16)) >> 16
    return hi, lo


def keep_mask_reference(seed: int, n_rows: int, n_cols: int, p: float, device=None) -> torch.Tensor:
    """The [n_rows, n_cols] keep mask that the kernels draw for `seed`, in plain PyTorch."""
    groups = (n_cols + 7) // 8
    c0 = torch.arange(groups, device=device, dtype=torch.int64).expand(n_rows, groups)
    c1 = torch.arange(n_rows, device=device, dtype=torch.int64)[:, None].expand(n_rows, groups)
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(PHILOX_ROUNDS):
        hi_b, lo_b = _mulhilo(c2, _ROUND_B)
        hi_a, lo_a = _mulhilo(c0, _ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _KEY_A) & _MASK32
        k1 = (k1 + _KEY_B) & _MASK32
    words = torch.stack([c0, c1, c2, c3], dim=-1)  # [rows, groups, j]: column 8g + 2j + h takes half h of word j
    draws = torch.stack([words, words >> 16], dim=-1) & DRAW_MASK.value
    return draws.reshape(n_rows, groups * 8)[:, :n_cols] >= drop_threshold(p)
