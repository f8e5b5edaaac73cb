"""lora_matmul: C = act(a @ b + scale * (low @ right) + bias), Z, and the fused
shrink (low = dropout(a) @ shrink_weight^T written by the kernel), against float64."""

import pytest
import torch

from lorafuse.ops.common.activation import activation_id, activation_reference
from lorafuse.ops.lora.dropout import drop_threshold, keep_mask_reference, keep_scale
from lorafuse.ops.lora.matmul import lora_matmul
from tests.ops._helpers import BIG_SEED, DTYPES, assert_close, dtype_id, poison, seed_tensor

SCALE = 1.3
# (M, K, N, r, activation): rows 1, 7, 113, 1023 (narrow); K = 100 (not a multiple of any
# BLOCK_K) and 128 (a multiple of all: the unmasked EVEN_K loop); N not powers of two.
CASES = [(1, 100, 80, 8, "gelu"), (7, 128, 36, 1, "identity"), (113, 100, 80, 64, "silu"),
         (113, 128, 150, 8, "relu"), (1023, 24, 40, 8, "gelu_tanh")]


def case_id(case):
    return "M{}_K{}_N{}_r{}_{}".format(*case)


def operands(m, k, n, r, dtype, transposed):
    """a [M, K]; b [K, N] and right [r, N], as W.t() / lora_B.t() views or contiguous; low fp32."""
    a = torch.randn(m, k).to(dtype)
    if transposed:
        b = (torch.randn(n, k) / k**0.5).to(dtype).t()
        right = (torch.randn(n, r) / r**0.5).to(dtype).t()
    else:
        b = (torch.randn(k, n) / k**0.5).to(dtype)
        right = (torch.randn(r, n) / r**0.5).to(dtype)
    return a, b, torch.randn(m, r), right, torch.randn(n).to(dtype)


def expected(a, b, low, right, bias, activation, keep=None, dtype=torch.float64):
    """(C, Z) computed in `dtype` (float64: the exact result; a half dtype: plain PyTorch)."""
    a, b, right, bias = (t.to(dtype) for t in (a, b, right, bias))
    lr = low.to(dtype) @ right
    if keep is not None:
        lr = lr * keep.to(dtype)
    z = a @ b + SCALE * lr + bias
    return activation_reference(z, activation), z


def check(c, z, a, b, low, right, bias, activation, dtype, keep=None):
    assert c.dtype == dtype and (z is None or z.dtype == dtype)
    exact_c, exact_z = expected(a, b, low, right, bias, activation, keep)
    plain_c, plain_z = expected(a, b, low, right, bias, activation, keep, dtype) if dtype != torch.float32 else (None,
                                                                                                                None)
    assert_close(c, exact_c, dtype, plain_c, "C")
    if z is not None:
        assert_close(z, exact_z, dtype, plain_z, "Z")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed_views"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_reference(case, transposed, dtype):
    m, k, n, r, activation = case
    a, b, low, right, bias = operands(m, k, n, r, dtype, transposed)
    c, z = lora_matmul(a, b, low, right, SCALE, bias, activation_id(activation), store_z=True)
    check(c, z, a, b, low, right, bias, activation, dtype)


@pytest.mark.parametrize("store_z", [False, True])
@pytest.mark.parametrize("has_bias", [False, True])
def test_without_bias_or_z(has_bias, store_z):
    m, k, n, r = 113, 100, 80, 8
    a, b, low, right, bias = operands(m, k, n, r, torch.float32, True)
    c, z = lora_matmul(a, b, low, right, SCALE, bias if has_bias else None, activation_id("sigmoid"), store_z=store_z)
    assert (z is None) != store_z
    check(c, z, a, b, low, right, bias if has_bias else torch.zeros(n), "sigmoid", torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mask_input", [False, True], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("m, k, n, activation", [(1, 100, 80, "gelu"), (7, 128, 36, "identity"),
                                                 (64, 100, 150, "silu"), (113, 100, 80, "identity")],
                         ids=["M1", "M7", "M64", "M113"])
def test_fused_shrink(m, k, n, activation, mask_input, dtype):
    # low = dropout(a) @ shrink_weight^T, accumulated in the K-loop and written (poisoned first)
    # by the first column block's programs, then used in the epilogue.
    p, r = 0.3, 8
    a, b, _, right, bias = operands(m, k, n, r, dtype, True)
    shrink_weight = (torch.randn(r, k) / k**0.5).to(dtype)
    low = poison(torch.empty(m, r))
    keep = keep_mask_reference(BIG_SEED, m, k, p).double() * keep_scale(p) if mask_input else torch.ones(m, k)
    c, z = lora_matmul(a, b, low, right, SCALE, bias, activation_id(activation), seed=seed_tensor(BIG_SEED),
                       threshold=drop_threshold(p), drop_scale=keep_scale(p), shrink_weight=shrink_weight,
                       mask_input=mask_input, store_z=True)
    exact_low = (a.double() * keep) @ shrink_weight.double().t()
    plain_low = ((a * keep.to(dtype)) @ shrink_weight.t()) if dtype != torch.float32 else None
    assert low.dtype == torch.float32
    assert_close(low, exact_low, dtype, plain_low, "low")
    check(c, z, a, b, exact_low, right, bias, activation, dtype)


def test_float32_adapters_with_half_inputs():
    # PEFT's default: lora weights (right, shrink weight) in float32, a and b in bfloat16.
    m, k, n, r = 7, 100, 80, 8
    a, b, _, right, bias = operands(m, k, n, r, torch.bfloat16, True)
    right = torch.randn(n, r).t() / r**0.5  # full float32 values, a lora_B.t() view
    shrink_weight = torch.randn(r, k) / k**0.5
    low = poison(torch.empty(m, r))
    c, z = lora_matmul(a, b, low, right, SCALE, bias, activation_id("gelu"), shrink_weight=shrink_weight, store_z=True)
    assert c.dtype == torch.bfloat16
    assert z.dtype == torch.float32  # kept for act' in backward in float32, as PEFT's adapter path keeps it
    # the bar is PEFT's computation: the adapter path in float32, the sum cast to bfloat16
    exact_low = a.double() @ shrink_weight.double().t()
    plain_low = a.float() @ shrink_weight.t()
    assert_close(low, exact_low, torch.bfloat16, plain_low, "low")
    exact_c, _ = expected(a, b, exact_low, right, bias, "gelu")
    plain_c = activation_reference(a @ b + SCALE * (plain_low @ right) + bias, "gelu").to(torch.bfloat16)
    assert_close(c, exact_c, torch.bfloat16, plain_c, "C")


@pytest.mark.parametrize("config", [(16, 16, 32, 1, 4, 1), (32, 64, 16, 4, 4, 1), (64, 32, 64, 2, 4, 1)])
def test_tiling_does_not_change_the_result(config):
    # Other tiles and group orders.
    m, k, n = 113, 100, 150
    a, b, low, right, bias = operands(m, k, n, 8, torch.float32, True)
    c, z = lora_matmul(a, b, low, right, SCALE, bias, activation_id("gelu"), store_z=True, config=config)
    check(c, z, a, b, low, right, bias, "gelu", torch.float32)


