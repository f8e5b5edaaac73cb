"""lora_add_rms_norm (LoRA expand, residual add and RMSNorm in one kernel) against its reference in float64."""
import pytest
import torch

from lorafuse.ops.decode.lora_add_rms_norm import _counts, lora_add_rms_norm, lora_add_rms_norm_reference
from tests.ops._helpers import DTYPES, assert_close, bank_row_scales, dtype_id, poison

SCALE = 1.7
EPS = 1e-6
CASES = [(1, 48, None), (7, 300, 1), (3, 1023, 16), (2, 96, 5)]  # (rows, width, rank: None = no adapter)


def case_id(case):
    return "M{}_N{}_r{}".format(*case)


def run(fn, inputs, dtype):
    """fn on copies of the inputs in `dtype` (row_scales stay float32); returns the new residual and the normed
    output."""
    args = {name: t.to(dtype).clone() if isinstance(t, torch.Tensor) and name != "row_scales" else t
            for name, t in inputs.items()}
    poison(args["normed"])
    fn(**args)
    return args["residual"], args["normed"]


def _reference_in_float64(inputs, residual):
    """(new residual, normed) of the reference in float64 on `inputs` and a copy of `residual`."""
    args = {name: t.double() if isinstance(t, torch.Tensor) else t for name, t in inputs.items()}
    expected_residual, expected = residual.double(), torch.empty(residual.shape, dtype=torch.float64)
    lora_add_rms_norm_reference(**args, residual=expected_residual, normed=expected)
    return expected_residual, expected


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("per_row", [False, True], ids=["", "row_scales"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_residual_and_norm_match_reference(case, per_row, dtype):
    # per_row: each row's own scales of its s columns (an adapter bank) instead of SCALE
    m, n, r = case
    inputs = {"proj": torch.randn(m, n + (r or 0)), "lora_B": None if r is None else torch.randn(n, r) / r**0.5,
              "scale": SCALE, "residual": torch.randn(m, n) * 3, "weight": torch.rand(n) + 0.5, "eps": EPS,
              "normed": torch.empty(m, n), **({"row_scales": bank_row_scales(m, r or 0)} if per_row else {})}
    got = run(lora_add_rms_norm, inputs, dtype)
    exact = run(lora_add_rms_norm_reference, inputs, torch.float64)
    plain = run(lora_add_rms_norm_reference, inputs, dtype) if dtype != torch.float32 else (None, None)
    for name, g, e, p in zip(("residual", "normed"), got, exact, plain):
        assert_close(g, e, dtype, p, name)


def test_rows_of_a_wider_buffer():
    # proj and the residual as column slices of wider buffers (row strides larger than their widths)
    m, n, r = 3, 40, 4
    proj, residual = torch.randn(m, n + r + 7)[:, :n + r], torch.randn(m, n + 5)[:, :n]
    inputs = {"proj": proj, "lora_B": torch.randn(n, r), "scale": SCALE, "weight": torch.rand(n), "eps": EPS}
    expected_residual, expected = _reference_in_float64(inputs, residual)
    normed = poison(torch.empty(m, n))
    lora_add_rms_norm(**inputs, residual=residual, normed=normed)
    assert_close(residual, expected_residual, torch.float32, name="residual")
    assert_close(normed, expected, torch.float32, name="normed")


def test_split_rows_leave_their_counts_zeroed():
    # with an adapter a row spreads over programs (3 here) whose last one normalizes it, found by an atomic count
    # that it zeroes again: repeated calls (CUDA graph replays) must each be right
    m, n, r = 2, 700, 8
    inputs = {"proj": torch.randn(m, n + r), "lora_B": torch.randn(n, r), "scale": SCALE, "weight": torch.rand(n),
              "eps": EPS}
    residual = torch.randn(m, n)
    for _ in range(3):
        expected_residual, expected = _reference_in_float64(inputs, residual)
        normed = poison(torch.empty(m, n))
        lora_add_rms_norm(**inputs, residual=residual, normed=normed)
        assert_close(residual, expected_residual, torch.float32, name="residual")
        assert_close(normed, expected, torch.float32, name="normed")
        assert not _counts[residual.device][:m].any()


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_deferred_norm(case):
    # defer: normed <- h * w and each program's sum of squares of h; the kernel after the next GEMM scales by
    # rstd = 1 / rms(h) from those sums, which gives back rms_norm(h) * w
    m, n, r = case
    inputs = {"proj": torch.randn(m, n + (r or 0)), "lora_B": None if r is None else torch.randn(n, r) / r**0.5,
              "scale": SCALE, "weight": torch.rand(n) + 0.5, "eps": EPS}
    start = torch.randn(m, n) * 3
    residual, normed = start.clone(), poison(torch.empty(m, n))
    parts, width, eps = lora_add_rms_norm(**inputs, residual=residual, normed=normed, defer=True)
    assert parts.dtype == torch.float32 and parts.shape[0] == m and (width, eps) == (n, EPS)
    exact = {name: t.double() if isinstance(t, torch.Tensor) else t for name, t in inputs.items()}
    exact_residual, exact_normed = start.double(), torch.empty(m, n, dtype=torch.float64)
    lora_add_rms_norm_reference(**exact, residual=exact_residual, normed=exact_normed)
    assert_close(residual, exact_residual, torch.float32, name="residual")
    assert_close(normed, exact_residual * exact["weight"], torch.float32, name="h * w")
    rstd = torch.rsqrt(parts.double().sum(-1, keepdim=True) / width + eps)
    assert_close(normed * rstd, exact_normed, torch.float32, name="rstd * h * w")
