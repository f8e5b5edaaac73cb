"""The rank-r operands that lora_matmul's Gluon GEMM (Hopper) reads: against their reference column for column, and
L @ R against the exact rank-r term plus bias. The GEMM itself (Gluon: TMA and warpgroup MMAs, which Triton's
interpreter does not run) is tested in test_gpu_routes.py."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lorafuse.ops import _gluon

from lorafuse.ops._bf16_pieces import bf16_pieces_reference
from lorafuse.ops._lora_matmul_gluon import (rank_r_operands, rank_r_operands_reference, rank_r_width,
                                             register_order_reference)
from lorafuse.ops._tiles import padded_rank

SCALE = 1.3


def rank_r_inputs(m, n, r, right_dtype, bias_dtype):
    low = torch.randn(m, r) * 3
    right = (torch.randn(n, r) / r**0.5).to(right_dtype).t()  # lora_B.t(): a transposed view
    bias = None if bias_dtype is None else torch.randn(n).to(bias_dtype)
    return low, right, bias


@pytest.mark.parametrize("r", [1, 5, 16, 24, 64])
@pytest.mark.parametrize("pieces, all_low_pieces", [(True, False), (False, False), (True, True)],
                         ids=["fp32_pieces", "bf16", "fp32_all_low_pieces"])  # all of low's pieces: pieces only
@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16, torch.float32], ids=["no_bias", "bias", "fp32_bias"])
@pytest.mark.parametrize("r_k_major", [True, False], ids=["k_major", "rows"])
def test_rank_r_operands_match_the_reference(r, pieces, all_low_pieces, bias_dtype, r_k_major):
    m, n = 70, 136  # neither a multiple of the packing block (64)
    low, right, bias = rank_r_inputs(m, n, r, torch.float32 if pieces else torch.bfloat16, bias_dtype)
    left, r_op, _ = rank_r_operands(low, right, SCALE, bias, torch.bfloat16, pieces, r_k_major,
                                    all_low_pieces=all_low_pieces)
    ref_left, ref_right = rank_r_operands_reference(low, right, SCALE, bias, torch.bfloat16, pieces, all_low_pieces)
    width = rank_r_width(r, pieces, 0 if bias is None else 1 if bias_dtype == torch.bfloat16 else 2, all_low_pieces)
    used = ref_left.shape[1]
    assert left.shape == (m, width) and width % 8 == 0 and width - used < 8
    assert r_op.shape == ((n, width) if r_k_major else (width, n))
    r_rows = r_op.t() if r_k_major else r_op
    # Compiled, the kernel may fuse scale * low - hi into one rounding (an FMA): a middle piece then differs from the
    # reference's by up to float32's rounding of the value it splits (2^-24 of it), which may be many of its own
    # bits when it is small, and the last piece (all_low_pieces) may take what the middle one rounded the other way:
    # so the two are compared as their sum. Anything else (order of the pieces, bias, ones) is off by far more.
    got_left, ref_left = left[:, :used].float(), ref_left.float()
    if pieces and all_low_pieces:
        group = padded_rank(r)  # columns a piece takes
        for t in (got_left, ref_left):
            t[:, group:2 * group] += t[:, 3 * group:4 * group]  # mid + lo: exact in float32
            t[:, 3 * group:4 * group] = 0
    for got, ref in ((got_left, ref_left), (r_rows[:used], ref_right)):
        torch.testing.assert_close(got.float(), ref.float(), rtol=2**-7, atol=2**-22 * ref.float().abs().max().item())
    assert not left[:, used:].any() and not r_rows[used:].any()  # the padding multiplies to nothing


@pytest.mark.parametrize("pieces", [True, False], ids=["fp32_pieces", "bf16"])
@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16, torch.float32], ids=["no_bias", "bias", "fp32_bias"])
def test_rank_r_operands_multiply_to_the_rank_r_term(pieces, bias_dtype):
    # float32 adapters as pieces keep the product to float32 class (the three largest of nine piece products: about
    # 2^-17 relative); bf16 ones round scale * low once (2^-9).
    low, right, bias = rank_r_inputs(50, 40, 12, torch.float32 if pieces else torch.bfloat16, bias_dtype)
    left, r_op, _ = rank_r_operands(low, right, SCALE, bias, torch.bfloat16, pieces, False)
    exact = SCALE * (low.double() @ right.double()) + (0 if bias is None else bias.double())
    err = ((left.double() @ r_op.double() - exact).norm() / exact.norm()).item()
    assert err < (3e-5 if pieces else 4e-3)


@pytest.mark.parametrize("r", [5, 12, 16])
def test_all_low_pieces_add_a_group_that_only_the_shrink_gradient_reads(r):
    # The dx GEMM's L with all of ds's pieces (its shrink-gradient steps read L^T x): L @ R is the same rank-r term as
    # without the fourth group, and groups l0 + l1 + l2, each padded to 16 columns, give scale * low to float32's
    # rounding.
    low, right, _ = rank_r_inputs(50, 40, r, torch.float32, None)
    left, r_op, _ = rank_r_operands(low, right, SCALE, None, torch.bfloat16, True, False, all_low_pieces=True)
    three, r_three, _ = rank_r_operands(low, right, SCALE, None, torch.bfloat16, True, False)
    assert left.shape[1] == rank_r_width(r, True, 0, all_low_pieces=True) == 64
    torch.testing.assert_close(left.double() @ r_op.double(), three.double() @ r_three.double(), rtol=1e-12, atol=0)
    groups = left.view(50, 4, 16)
    assert not groups[:, :, r:].any() and not r_op.view(4, 16, 40)[:, r:].any() and not r_op.view(4, 16, 40)[3].any()
    assert torch.equal(groups[:, 2], groups[:, 0])  # l0 again, against R's r1
    l0, l1, l2 = (groups[:, g, :r].float() for g in (0, 1, 3))
    torch.testing.assert_close(l0 + l1 + l2, SCALE * low, rtol=2**-23, atol=0)
    assert l2.abs().max() > 0  # the third piece carries bits, so dA needs it


@pytest.mark.parametrize("pieces", [True, False], ids=["fp32_pieces", "cast"])
@pytest.mark.parametrize("split_shape, zero_n", [((16, 1030), 1025), ((3, 5), 7), ((48, 64), 0)],
                         ids=["odd", "tiny", "no_zeros"])
def test_the_same_launch_splits_a_weight_and_zeroes_a_buffer(pieces, split_shape, zero_n):
    # _shrink_matmul_gluon's operands: lora_A's pieces (or its cast under LORAFUSE_ADAPTER_MATH=fast) and its zeroed
    # s and counts, beside R; neither a multiple of the 1024 elements a program takes
    low, right, bias = rank_r_inputs(0, 136, 16, torch.float32, torch.float32)
    weight = torch.randn(*split_shape) / 7
    zeroed = torch.randint(1, 100, (zero_n,), dtype=torch.int32) if zero_n else None
    left, r_op, split = rank_r_operands(low, right, SCALE, bias, torch.bfloat16, pieces, True, split=weight,
                                        zeroed=zeroed)
    if pieces:
        assert torch.equal(split, bf16_pieces_reference(weight))
    else:
        assert torch.equal(split, weight.to(torch.bfloat16)[None])
    if zeroed is not None:
        assert not zeroed.any()
    _, ref_right = rank_r_operands_reference(low, right, SCALE, bias, torch.bfloat16, pieces)
    torch.testing.assert_close(r_op.t()[:ref_right.shape[0]].float(), ref_right.float(), rtol=2**-7,
                               atol=2**-22 * ref_right.float().abs().max().item())
    assert left.shape[0] == 0


@pytest.mark.parametrize("pieces", [True, False], ids=["fp32_pieces", "cast"])
@pytest.mark.parametrize("cols", [1030, 64, 5], ids=["odd", "one_block", "part_block"])
def test_a_split_weight_in_register_order(pieces, cols):
    # the masked stream's lora_A (_shrink_beside_gluon): its pieces (or cast) with each 64 columns in
    # register_order_column's order, zero-padded to a multiple of 64
    low, right, _ = rank_r_inputs(0, 136, 16, torch.float32, torch.float32)
    weight = torch.randn(16, cols) / 7
    _, _, split = rank_r_operands(low, right, SCALE, None, torch.bfloat16, pieces, True, split=weight,
                                  split_register_order=True)
    expected = bf16_pieces_reference(weight) if pieces else weight.to(torch.bfloat16)[None]
    assert torch.equal(split, register_order_reference(expected))
    # the order is a permutation of each block's columns: sorted back, the padded weight again
    order = register_order_reference(torch.arange(64.0)).long()
    assert sorted(order.tolist()) == list(range(64))
    # operand column 16c + 8b + 2t + h holds x's column 16t + 4c + 2b + h
    assert [order[c].item() for c in (1, 2, 8, 16, 63)] == [1, 16, 2, 4, 63]
    blocks = order + torch.arange(0, split.shape[-1], 64)[:, None]
    restored = torch.empty_like(split).index_copy_(-1, blocks.flatten(), split)
    assert torch.equal(restored[..., :cols], expected) and not restored[..., cols:].any()


def test_float16_operands_with_a_float32_bias():
    # 16-bit adapter math on float16 activations: a float32 bias goes as two float16 pieces, L and R stay float16.
    low, right, bias = rank_r_inputs(70, 136, 8, torch.float16, torch.float32)
    left, r_op, _ = rank_r_operands(low, right, SCALE, bias, torch.float16, False, True)
    ref_left, ref_right = rank_r_operands_reference(low, right, SCALE, bias, torch.float16, False)
    assert left.dtype == r_op.dtype == ref_left.dtype == ref_right.dtype == torch.float16
    used = ref_left.shape[1]
    assert used == 8 + 2
    torch.testing.assert_close(left[:, :used].float(), ref_left.float(), rtol=2**-10, atol=0)
    torch.testing.assert_close(r_op.t()[:used].float(), ref_right.float(), rtol=2**-10, atol=0)
    exact = SCALE * (low.double() @ right.double()) + bias.double()
    err = ((left.double() @ r_op.t().double() - exact).norm() / exact.norm()).item()
    assert err < 2e-3  # float16 rounding of scale * low and of lora_B's values: 2^-11 each


def test_a_gluon_kernel_that_fails_to_launch_is_turned_off(monkeypatch, caplog):
    # A Gluon kernel whose first launch fails (an API change in an untested Triton) is logged once and turned off, so
    # its caller runs the Triton kernel; one that has run lets its later errors through.
    monkeypatch.setattr(_gluon, "_working", set())
    monkeypatch.setattr(_gluon, "_broken", set())
    launches = []

    def failing():
        launches.append("failing")
        raise RuntimeError("no such Gluon op")

    with caplog.at_level("WARNING", logger="lorafuse"):
        assert _gluon.launch_or_fall_back("kernel_a", failing) is False
        assert _gluon.launch_or_fall_back("kernel_a", failing) is False  # not launched again
    assert launches == ["failing"]
    assert "kernel_a" in caplog.text and "no such Gluon op" in caplog.text
    assert _gluon.launch_or_fall_back("kernel_b", lambda: launches.append("ok")) is True
    with pytest.raises(RuntimeError):
        _gluon.launch_or_fall_back("kernel_b", failing)


def test_the_layer_imports_and_trains_on_a_triton_without_gluons_hopper_api():
    # Triton 3.4 (torch 2.8's) has Gluon but not its Hopper warpgroup MMA: the import in _gluon fails, the Gluon
    # kernels are not defined, and the layer must still import and run its Triton kernels. A fresh interpreter with
    # that name removed imports the op (lorafuse 3182e07 did not: a Gluon-only helper was imported unconditionally),
    # and a training step runs Triton's kernels (counted) to the reference's output and gradients. On the CPU the
    # kernels run in Triton's interpreter, in float32; in GPU mode compiled, in bf16 (where a Hopper would otherwise
    # take Gluon's), held to DESIGN.md's rule.
    device = torch.get_default_device().type
    code = f"""
import triton.experimental.gluon.language.nvidia.hopper as hopper
del hopper.warpgroup_mma  # as on Triton 3.4
import torch
import triton.runtime.interpreter as interpreter
import triton.runtime.jit as jit
from lorafuse.ops import _gluon, lora_linear, lora_linear_reference
from tests.ops._helpers import assert_close
assert _gluon.gluon is None and _gluon.ready_barriers is None
torch.manual_seed(0)
device = {device!r}
kernels = interpreter.InterpretedFunction if device == "cpu" else jit.JITFunction
rows, dtype = (40, torch.float32) if device == "cpu" else (300, torch.bfloat16)  # past the few-row route
launched = []
run = kernels.run
kernels.run = lambda self, *a, **kw: launched.append(self.fn.__name__) or run(self, *a, **kw)
inputs = [torch.randn(rows, 24, device=device), torch.randn(32, 24, device=device) / 5,
          torch.randn(4, 24, device=device) / 5, torch.randn(32, 4, device=device) / 2]
results = []
for op, op_dtype in ((lora_linear, dtype), (lora_linear_reference, torch.float64), (lora_linear_reference, dtype)):
    x, w, a, b = [t.to(op_dtype, copy=True).requires_grad_(i != 1) for i, t in enumerate(inputs)]
    y = op(x, w, None, a, b, 0.5)
    y.backward(torch.ones_like(y))
    results.append([y, x.grad, a.grad, b.grad])
for name, got, exact, plain in zip(["y", "dx", "dA", "dB"], *results):
    assert_close(got, exact, dtype, plain, name)
assert {{"_shrink_fwd", "_expand_fwd", "_shrink_bwd", "_expand_bwd"}} <= set(launched), launched
print("ran", sorted(set(launched)))
"""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1" if device == "cpu" else "0",
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, timeout=600)
    assert done.returncode == 0 and "ran" in done.stdout, done.stdout[-500:] + done.stderr[-2000:]


def test_tma_aligned_copies_only_a_view_of_an_odd_offset():
    # TMA reads from 16-byte aligned addresses: the Gluon launchers pass weights through tma_aligned, which copies a
    # view that starts off a 16-byte boundary (here 2 bytes in) and leaves an aligned tensor as it is.
    flat = torch.randn(1 + 4 * 64).to(torch.bfloat16)
    odd = flat[1:].view(4, 64)
    assert odd.data_ptr() % 16 != 0
    copied = _gluon.tma_aligned(odd)
    assert copied.data_ptr() % 16 == 0 and torch.equal(copied, odd)
    aligned = torch.randn(4, 64).to(torch.bfloat16)
    assert aligned.data_ptr() % 16 == 0 and _gluon.tma_aligned(aligned) is aligned
