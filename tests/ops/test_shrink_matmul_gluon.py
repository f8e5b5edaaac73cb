"""The forward GEMM with the shrink inside its K-loop (_shrink_matmul_gluon.py, Hopper, Gluon).

CPU: where contributors_for puts the shrink slices (each K-step shrunk once, every slice between START and the wait
for s, the contributors within the window of programs).
GPU (LORAFUSE_TEST_DEVICE=cuda TRITON_INTERPRET=0, compute capability 9): the kernel against float64 on odd edges,
ranks 8-64, float32 adapters (bf16 pieces, or LORAFUSE_ADAPTER_MATH=fast), bf16 and fp16 ones, biases in x's dtype or
float32, one wave of tiles or several per program, few programs; the same bits call after call; the shapes and layouts
it declines; the layer's route to it.
"""
import importlib

import pytest
import torch

from lorafuse.ops._lora_matmul_gluon import GROUP_M
from lorafuse.ops._shrink_matmul_gluon import (LEAD, START, WINDOW, _placement, contributors_for,
                                               shrink_matmul_gluon, shrink_matmul_ready)
from lorafuse.ops._tiles import lora_in_fp32, sm_count
from lorafuse.ops.lora_linear import lora_linear_reference
from lorafuse.ops.lora_matmul import lora_matmul_reference, tma_ready
from tests.ops._helpers import assert_close
from tests.ops.test_lora_linear import check

ON_HOPPER = (torch.get_default_device().type == "cuda" and torch.cuda.is_available()
             and torch.cuda.get_device_capability()[0] == 9)
hopper = pytest.mark.skipif(not ON_HOPPER, reason="Gluon's Hopper kernel: LORAFUSE_TEST_DEVICE=cuda on an H100/H200")
lora_linear_module = importlib.import_module("lorafuse.ops.lora_linear")
SCALE = 0.7


@pytest.mark.parametrize("k_steps", [4, 7, 10, 16, 32, 63, 64, 224])
@pytest.mark.parametrize("blocks_n", [1, 4, 16, 56])
@pytest.mark.parametrize("programs", [8, 114, 132])
def test_contributors_shrink_every_k_step_once_between_start_and_the_wait(k_steps, blocks_n, programs):
    c = contributors_for(blocks_n, k_steps, programs)
    assert c <= blocks_n and (c - 1) * GROUP_M < WINDOW * programs
    if programs >= 114 and k_steps >= 10 and blocks_n >= 16:  # the layer bench's shapes, and K of 640 up
        assert c > 0
    shrunk = []
    for j in range(c):
        lo, hi = j * k_steps // c, (j + 1) * k_steps // c
        rot, first = _placement(lo, k_steps)
        assert START <= first and first + hi - lo <= k_steps - LEAD
        shrunk += [(step + rot) % k_steps for step in range(first, first + hi - lo)]  # the loop reads step + rot
    assert sorted(shrunk) == (list(range(k_steps)) if c else [])


def operands(m, k, n, r, dtype, adapter_dtype, bias_dtype):
    x = torch.randn(m, k, dtype=dtype)
    weight = (torch.randn(n, k) / k**0.5).to(dtype)
    lora_A, lora_B = (torch.randn(r, k) / k**0.5).to(adapter_dtype), (torch.randn(n, r) / r**0.5).to(adapter_dtype)
    bias = None if bias_dtype is None else torch.randn(n).to(dtype if bias_dtype == "x" else bias_dtype)
    return x, weight, lora_A, lora_B, bias


def assert_matches_float64(y, s, x, weight, lora_A, lora_B, bias, keep=None):
    # s = x A^T and y = x W^T + SCALE * s B^T + bias against float64, by DESIGN.md's rule in x's dtype (s in float32
    # where the adapters are float32-class: bf16 pieces of lora_A); keep: dropout's [M, K] multipliers (the keep mask
    # times 1 / (1 - p)), applied to s's x
    dtype = x.dtype
    x_shrunk = x.double() if keep is None else x.double() * keep.double()
    s_exact = x_shrunk @ lora_A.double().t()
    if lora_in_fp32(dtype, lora_A.dtype):
        assert_close(s, s_exact, torch.float32, x_shrunk.float() @ lora_A.float().t(), "s")
    else:
        assert_close(s, s_exact, dtype, x_shrunk.to(dtype) @ lora_A.to(dtype).t(), "s")
    y_exact = lora_matmul_reference(x, weight.t(), s_exact, lora_B.t(), SCALE, bias, dtype=torch.float64)
    y_plain = lora_matmul_reference(x, weight.t(), s_exact.float(), lora_B.t(), SCALE, bias)
    assert_close(y, y_exact, dtype, y_plain, "y")


@hopper
@pytest.mark.parametrize("m, k, n, programs", [(300, 4096, 1000, None), (1000, 2056, 4000, None),
                                               (4096, 640, 8192, None), (9000, 1024, 4096, None),
                                               (2000, 1024, 4096, 16)],
                         ids=["one_wave", "odd_k", "many_tiles", "partial_group", "16_programs"])
@pytest.mark.parametrize("r, dtype, adapter_dtype, math", [(8, torch.bfloat16, torch.float32, "exact"),
                                                           (16, torch.bfloat16, torch.float32, "exact"),
                                                           (32, torch.bfloat16, torch.float32, "exact"),
                                                           (16, torch.bfloat16, torch.float32, "fast"),
                                                           (8, torch.bfloat16, torch.bfloat16, "exact"),
                                                           (32, torch.bfloat16, torch.bfloat16, "exact"),
                                                           (64, torch.bfloat16, torch.bfloat16, "exact"),
                                                           (16, torch.float16, torch.float16, "exact")],
                         ids=["r8_pieces", "r16_pieces", "r32_pieces", "r16_fast", "r8_bf16", "r32_bf16", "r64_bf16",
                              "r16_fp16"])
@pytest.mark.parametrize("bias_dtype", [None, "x", torch.float32], ids=["no_bias", "bias", "fp32_bias"])
def test_shrink_matmul_matches_float64(m, k, n, programs, r, dtype, adapter_dtype, math, bias_dtype, monkeypatch):
    # Rows, K and columns not multiples of the 128 x 256 x 64 tiles. "many_tiles": each program walks several tiles
    # (and waits for contributors of row blocks it did not see); "partial_group": the last group of row blocks has 7
    # of 8; "16_programs": two contributors a row block, each program a tile of many row blocks in turn
    monkeypatch.setenv("LORAFUSE_ADAPTER_MATH", math)
    x, weight, lora_A, lora_B, bias = operands(m, k, n, r, dtype, adapter_dtype, bias_dtype)
    assert tma_ready(x, weight.t()) and shrink_matmul_ready(x, weight, lora_A, lora_B, bias)
    y, s = shrink_matmul_gluon(x, weight, lora_A, lora_B, SCALE, bias, programs or sm_count(x.device))
    assert_matches_float64(y, s, x, weight, lora_A, lora_B, bias)


@hopper
def test_a_16_bit_lora_A_at_an_odd_offset_is_copied_for_tma():
    # A bf16 lora_A viewed 2 bytes into its storage: TMA's descriptor needs a 16-byte aligned base, so the launcher
    # copies it (_gluon.tma_aligned) instead of raising or falling back
    x, weight, _, lora_B, bias = operands(1000, 2056, 4000, 16, torch.bfloat16, torch.bfloat16, None)
    lora_A = (torch.randn(16 * 2056 + 1) / 2056**0.5).to(torch.bfloat16)[1:].view(16, 2056)
    assert lora_A.data_ptr() % 16 != 0 and shrink_matmul_ready(x, weight, lora_A, lora_B, bias)
    y, s = shrink_matmul_gluon(x, weight, lora_A, lora_B, SCALE, bias, sm_count(x.device))
    assert_matches_float64(y, s, x, weight, lora_A, lora_B, bias)


@hopper
@pytest.mark.parametrize("m, k, n, programs", [(4096, 4096, 4096, None), (9000, 1000, 4096, None),
                                               (300, 4096, 1000, None)],
                         ids=["many_tiles", "partial_group_odd_k", "two_contributors"])
@pytest.mark.parametrize("r, dtype, adapter_dtype, math, bias_dtype", [
    (16, torch.bfloat16, torch.float32, "exact", "x"), (32, torch.bfloat16, torch.float32, "exact", None),
    (8, torch.bfloat16, torch.bfloat16, "exact", torch.float32), (64, torch.bfloat16, torch.bfloat16, "exact", "x"),
    (16, torch.float16, torch.float16, "exact", None), (16, torch.bfloat16, torch.float32, "fast", "x")],
    ids=["r16_pieces", "r32_pieces", "r8_bf16", "r64_bf16", "r16_fp16", "r16_fast"])
def test_fixed_order_matches_float64_and_repeats_its_bits(m, k, n, programs, r, dtype, adapter_dtype, math, bias_dtype,
                                                          monkeypatch):
    # fixed_order: the contributors' parts of s are summed in order by the row block's summer, not by atomics; y and s
    # are the same bits call after call (with atomics 0 of 6 repeats matched at 8192 x 4096 -> 4096, H100). Two
    # contributors keep the atomics, whose two-part sums need no order.
    monkeypatch.setenv("LORAFUSE_ADAPTER_MATH", math)
    x, weight, lora_A, lora_B, bias = operands(m, k, n, r, dtype, adapter_dtype, bias_dtype)
    sms = programs or sm_count(x.device)
    programs_used = min(sms, -(-m // 128) * -(-n // 256))
    contributors = contributors_for(-(-n // 256), -(-k // 64), programs_used)
    assert contributors == 2 if m == 300 else contributors > 2  # the summer's cases do run the summer
    first = shrink_matmul_gluon(x, weight, lora_A, lora_B, SCALE, bias, sms, fixed_order=True)
    assert_matches_float64(*first, x, weight, lora_A, lora_B, bias)
    for _ in range(3):
        y, s = shrink_matmul_gluon(x, weight, lora_A, lora_B, SCALE, bias, sms, fixed_order=True)
        assert torch.equal(y, first[0]) and torch.equal(s, first[1])


@hopper
def test_shapes_it_declines():
    x, weight, lora_A, lora_B, bias = operands(512, 192, 512, 16, torch.bfloat16, torch.float32, None)
    assert shrink_matmul_gluon(x, weight, lora_A, lora_B, SCALE, bias, sm_count(x.device)) is None  # 3 K-steps
    for r, adapter_dtype in [(12, torch.bfloat16), (64, torch.float32), (4, torch.bfloat16)]:
        x, weight, lora_A, lora_B, bias = operands(512, 1024, 512, r, torch.bfloat16, adapter_dtype, None)
        assert not shrink_matmul_ready(x, weight, lora_A, lora_B, bias), (r, adapter_dtype)
    x, weight, lora_A, lora_B, bias = operands(512, 1024, 512, 16, torch.float16, torch.float32, None)
    assert not shrink_matmul_ready(x, weight, lora_A, lora_B, bias)  # fp16 x keeps tf32x3 for float32 adapters
    x, weight, lora_A, lora_B, bias = operands(512, 1024, 512, 16, torch.bfloat16, torch.float32, None)
    assert shrink_matmul_gluon(x, weight, lora_A, lora_B, SCALE, bias, 8) is None  # one contributor: K does not fit


@hopper
def test_a_transposed_weight_keeps_the_other_route():
    # GPT-2's Conv1D under fan_in_fan_out: the layer passes W as a [N, K] view with unit stride along N
    x, weight, lora_A, lora_B, bias = operands(4096, 1024, 4096, 16, torch.bfloat16, torch.float32, "x")
    transposed = weight.t().contiguous().t()
    assert not shrink_matmul_ready(x, transposed, lora_A, lora_B, bias)
    y = lora_linear_module.lora_linear(x, transposed, bias, lora_A, lora_B, SCALE)
    exact = lora_linear_reference(*(t.double() for t in (x, weight, bias, lora_A, lora_B)), SCALE)
    assert_close(y, exact, torch.bfloat16, lora_linear_reference(x, weight, bias, lora_A, lora_B, SCALE), "y")


@hopper
@pytest.mark.parametrize("n, dropout_p, deterministic, routed", [(4096, 0.0, False, True), (4096, 0.1, False, False),
                                                                 (4096, 0.0, True, True), (8192, 0.0, False, False)],
                         ids=["no_dropout", "dropout", "deterministic", "wide"])
def test_the_layer_shrinks_inside_the_gemm_without_dropout(n, dropout_p, deterministic, routed, monkeypatch):
    # training's forward sums s's parts in a fixed order only under deterministic algorithms; inference always does.
    # The shrink streamed beside the GEMM, which the layer tries first (test_shrink_beside_gluon.py), declines here.
    monkeypatch.setattr(lora_linear_module, "shrink_matmul_beside", lambda *args: None)
    calls, fixed_orders = [], []
    real = lora_linear_module.shrink_matmul_gluon

    def recorded(*args, fixed_order):
        fixed_orders.append(fixed_order)
        calls.append(real(*args, fixed_order=fixed_order))
        return calls[-1]

    monkeypatch.setattr(lora_linear_module, "shrink_matmul_gluon", recorded)
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    try:
        check((4096, 1000), n, 16, torch.bfloat16, "auto", dropout_p=dropout_p, adapter_dtype=torch.float32)
        assert fixed_orders == [deterministic] * routed
        x, weight, lora_A, lora_B, bias = operands(4096, 1000, n, 16, torch.bfloat16, torch.float32, "x")
        with torch.no_grad():
            y = lora_linear_module.lora_linear(x, weight, bias, lora_A, lora_B, SCALE, dropout_p, seed=7)
        exact = lora_linear_reference(*(t.double() for t in (x, weight, bias, lora_A, lora_B)), SCALE, dropout_p,
                                      seed=7)
        assert_close(y, exact, torch.bfloat16, lora_linear_reference(x, weight, bias, lora_A, lora_B, SCALE, dropout_p,
                                                                     seed=7), "y")
    finally:
        torch.use_deterministic_algorithms(False)
    assert fixed_orders == [deterministic] * routed + [True] * routed
    assert all(result is not None for result in calls)  # it ran, it did not fall back
