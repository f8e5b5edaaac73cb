"""The in-kernel dropout generator: the kernels' keep_tile draws exactly keep_mask_reference's
mask, whatever the tile, and that mask keeps 1 - p of the elements, independently of the
seed, of its neighbours and of the other column blocks."""
import math

import pytest
import torch
import triton
import triton.language as tl

from lorafuse.ops.lora.dropout import PHILOX_ROUNDS, drop_threshold, keep_mask_reference, keep_scale, keep_tile, new_seed
from tests.ops._helpers import BIG_SEED, seed_tensor

ROWS, COLS = 1024, 1000  # ~1e6 draws per statistical check
SIGMAS = 5


def p_effective(p):
    return drop_threshold(p) / 16384


def assert_fraction(observed: float, expected: float, n: int, what: str):
    sigma = math.sqrt(expected * (1 - expected) / n)
    assert abs(observed - expected) <= SIGMAS * sigma, \
        f"{what}: {observed:.5f}, expected {expected:.5f} +- {SIGMAS} x {sigma:.1e} over {n} draws"


def equal_fraction(p):
    # two independent draws agree with probability p^2 + (1 - p)^2
    pe = p_effective(p)
    return pe * pe + (1 - pe) * (1 - pe)


@triton.jit
def _mask_kernel(seed_ptr, ones_ptr, out_ptr, M, N, threshold, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                 ROUNDS: tl.constexpr):
    # ones, out: [M, N] of one dtype; out = ones * keep_tile's mask (in that dtype), as the kernels apply it, tile by
    # tile
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    offsets, inside = rows[:, None] * N + cols[None, :], (rows[:, None] < M) & (cols[None, :] < N)
    ones = tl.load(ones_ptr + offsets, mask=inside)
    keep = keep_tile(seed_ptr, rows, tl.program_id(1) * BLOCK_K, threshold, BLOCK_K, ROUNDS, ones.dtype)
    tl.store(out_ptr + offsets, ones * keep, mask=inside)


def kernel_mask(seed, n_rows, n_cols, p, block_m, block_k, dtype=torch.bfloat16):
    out = torch.full((n_rows, n_cols), -1, dtype=dtype)
    grid = (triton.cdiv(n_rows, block_m), triton.cdiv(n_cols, block_k))
    _mask_kernel[grid](seed_tensor(seed), torch.ones(n_rows, n_cols, dtype=dtype), out, n_rows, n_cols,
                       drop_threshold(p), BLOCK_M=block_m, BLOCK_K=block_k, ROUNDS=PHILOX_ROUNDS)
    assert ((out == 0) | (out == 1)).all(), "keep_tile left elements unwritten, or not 0 or 1"
    return out == 1


@pytest.mark.parametrize("seed", [0, 0x1234_5678, BIG_SEED, 2**62 - 1])
@pytest.mark.parametrize("n_rows, n_cols, block_m, block_k", [
    (7, 300, 16, 128), (113, 100, 32, 64), (1023, 40, 64, 16), (33, 77, 16, 8)])
def test_kernel_draws_the_reference_mask(n_rows, n_cols, block_m, block_k, seed):
    # Same mask element for element, for any tile shape and for seeds using both key words.
    p = 0.3
    assert torch.equal(kernel_mask(seed, n_rows, n_cols, p, block_m, block_k),
                       keep_mask_reference(seed, n_rows, n_cols, p))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("p", [6e-5, 0.004, 0.5, 0.99994])
def test_kernel_mask_at_extreme_thresholds(p, dtype):
    # Thresholds 1 (an argument Triton specializes as a constant), 66 (a float16 subnormal as the paired compare reads
    # it), 8192 and 16383 (the largest: only the draw 16383 is kept), for each dtype the mask is made in (its own
    # instructions on a GPU).
    assert drop_threshold(p) in (1, 66, 8192, 16383)
    assert torch.equal(kernel_mask(BIG_SEED, 64, 256, p, 32, 128, dtype), keep_mask_reference(BIG_SEED, 64, 256, p))


def test_kernel_keep_rate():
    # The kernel's own draws, ~1e6 of them, keep 1 - p.
    p = 0.1
    keep = kernel_mask(BIG_SEED, ROWS, COLS, p, 64, 128)
    assert_fraction(keep.float().mean().item(), 1 - p_effective(p), keep.numel(), "kernel keep rate")


@pytest.mark.parametrize("p", [0.05, 0.1, 0.3, 0.5])
def test_keep_rate(p):
    keep = keep_mask_reference(BIG_SEED, ROWS, COLS, p)
    assert keep.dtype == torch.bool and keep.shape == (ROWS, COLS)
    assert_fraction(keep.float().mean().item(), 1 - p_effective(p), keep.numel(), "keep rate")


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate_of_each_lane(p):
    # One Philox call feeds 8 neighbouring columns from 4 words' halves: each lane of the
    # 8 (and each row parity) must keep 1 - p, a swapped or reused half would not.
    keep = keep_mask_reference(7, ROWS, 1024, p).float()
    for lane in range(8):
        column = keep[:, lane::8]
        assert_fraction(column.mean().item(), 1 - p_effective(p), column.numel(), f"lane {lane}")
    for parity in range(2):
        rows = keep[parity::2]
        assert_fraction(rows.mean().item(), 1 - p_effective(p), rows.numel(), f"row parity {parity}")


@pytest.mark.parametrize("p", [0.05, 0.3])
@pytest.mark.parametrize("seeds", [(1, 2), (5, 5 + 2**32), (2**40, 2**40 + 1), (0, 2**62 - 1)],
                         ids=["low", "high_word_only", "big", "extremes"])
def test_seeds_give_independent_masks(seeds, p):
    a, b = (keep_mask_reference(seed, ROWS, COLS, p) for seed in seeds)
    assert_fraction((a == b).float().mean().item(), equal_fraction(p), a.numel(), f"agreement of seeds {seeds}")


@pytest.mark.parametrize("p", [0.05, 0.3])
@pytest.mark.parametrize("lag", [(0, 1), (0, 2), (0, 4), (0, 7), (0, 8), (0, 16), (0, 64), (0, 128), (1, 0), (1, 1)],
                         ids=lambda lag: f"rows{lag[0]}_cols{lag[1]}")
def test_neighbours_are_uncorrelated(lag, p):
    # Elements at a fixed distance agree as independent draws do: neighbouring columns of one
    # Philox call, neighbouring calls, column blocks 64 and 128 apart (tile widths), next rows.
    dr, dc = lag
    keep = keep_mask_reference(BIG_SEED, ROWS + dr, COLS + dc, p)
    a, b = keep[:ROWS, :COLS], keep[dr:, dc:]
    assert_fraction((a == b).float().mean().item(), equal_fraction(p), a.numel(), f"agreement at lag {lag}")


def test_mask_is_a_function_of_seed_row_and_column():
    # Neither the mask's extent nor the call order changes an element: what lets every kernel
    # (any tile, any grid) redraw the same mask.
    big = keep_mask_reference(BIG_SEED, 200, 300, 0.3)
    assert torch.equal(keep_mask_reference(BIG_SEED, 50, 77, 0.3), big[:50, :77])
    assert torch.equal(keep_mask_reference(BIG_SEED, 200, 300, 0.3), big)


def test_zero_probability_keeps_everything():
    assert keep_mask_reference(BIG_SEED, 64, 100, 0.0).all()
    assert keep_scale(0.0) == 1.0


@pytest.mark.parametrize("p", [0.0, 1e-6, 0.05, 0.1, 1 / 3, 0.5, 0.999])
def test_threshold_and_scale(p):
    t = drop_threshold(p)
    assert isinstance(t, int) and t == round(p * 16384)
    assert abs(t / 16384 - p) <= 0.5 / 16384
    assert keep_scale(p) == 16384 / (16384 - t)  # exact expectation: (1 - p_eff) * scale == 1
    assert abs((1 - t / 16384) * keep_scale(p) - 1) < 1e-12


@pytest.mark.parametrize("p", [1.0, 1.5, -0.1, math.nan])
def test_bad_probability_raises(p):
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        drop_threshold(p)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        keep_scale(p)


def test_probability_that_rounds_to_one_raises():
    with pytest.raises(ValueError, match="rounds to 1 .* 1/16384"):
        drop_threshold(0.99999)


def test_new_seed():
    seeds = [new_seed("cpu") for _ in range(4)]
    for seed in seeds:
        assert seed.dtype == torch.int64 and seed.shape == (1,) and seed.device.type == "cpu"
        assert 0 <= seed.item() < 2**62
    assert len({seed.item() for seed in seeds}) == 4
    torch.manual_seed(3)
    first = new_seed("cpu")
    torch.manual_seed(3)
    assert torch.equal(first, new_seed("cpu"))  # drawn from torch's generator: reproducible
