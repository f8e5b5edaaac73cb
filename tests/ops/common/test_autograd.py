"""The ops inside the rest of autograd (ops/common/autograd.py): double backward (create_graph=True) gives the
reference's second derivatives (the LoRA layer in float32 and in bf16 with PEFT's float32 adapters, attention with
grouped-query heads and NaN padding), and torch.func transforms (per-sample gradients with vmap over grad) run the
reference, said once in the log, where the kernels' Functions would raise."""
import logging

import pytest
import torch
from torch.func import grad, vmap

from lorafuse import _logging
from lorafuse.ops.attention.windows import windows_from_padding_mask
from lorafuse.ops.attention.flash_attention import attention_reference, flash_attention
from lorafuse.ops.lora.linear import lora_linear, lora_linear_reference
from lorafuse.ops.model.rms_norm import rms_norm, rms_norm_reference
from lorafuse.ops.model.silu_mul import silu_mul, silu_mul_reference
from tests.lora_check import relative_error

TOL = 1e-5  # fp32: the kernels' first derivatives are the reference's up to rounding, and so are the second


def lora_inputs(rows=7, k=24, n=20, r=4):
    # x: [rows, k], W: [n, k] frozen, bias: [n], A: [r, k], B: [n, r]
    x = torch.randn(rows, k, requires_grad=True)
    weight = 0.2 * torch.randn(n, k)
    bias = torch.randn(n, requires_grad=True)
    lora_A = (0.3 * torch.randn(r, k)).requires_grad_()
    lora_B = (0.3 * torch.randn(n, r)).requires_grad_()
    return x, weight, bias, lora_A, lora_B


def gradient_penalty_grads(fn, inputs, first_wrt, second_wrt):
    """d/d(second_wrt) of |d(sum y^2)/d(first_wrt)|^2: a gradient penalty, which differentiates the backward."""
    y = fn(*inputs)
    firsts = torch.autograd.grad(y.pow(2).sum(), first_wrt, create_graph=True)
    return torch.autograd.grad(sum(g.pow(2).sum() for g in firsts), second_wrt)


@pytest.mark.parametrize("activation", ["identity", "gelu"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_lora_linear_double_backward_equals_reference(dropout_p, activation):
    x, weight, bias, lora_A, lora_B = inputs = lora_inputs()
    seed = torch.tensor([7], dtype=torch.int64)

    def fused(*args):
        return lora_linear(*args, 2.0, dropout_p, activation, seed)

    def reference(*args):
        return lora_linear_reference(*args, 2.0, dropout_p, activation, seed)

    got = gradient_penalty_grads(fused, inputs, (x, lora_A), (x, bias, lora_A, lora_B))
    want = gradient_penalty_grads(reference, inputs, (x, lora_A), (x, bias, lora_A, lora_B))
    for g, w in zip(got, want):
        assert relative_error(g, w) < TOL


def test_lora_linear_double_backward_in_bf16_with_float32_adapters():
    # PEFT's set-up on a bf16 model: x, W and bias in bf16, lora_A and lora_B in float32; gelu, so that every input
    # has a second derivative. The first loss is (y c) for a fixed c, so its gradients do not depend on y's rounding:
    # both sides then differentiate the same reference backward, in the dtypes the layer computed in, and must agree
    # to the bit.
    x, weight, bias, lora_A, lora_B = lora_inputs(rows=9, k=40, n=24, r=8)
    x, weight, bias = (t.detach().to(torch.bfloat16).requires_grad_(t.requires_grad) for t in (x, weight, bias))
    inputs = (x, weight, bias, lora_A, lora_B)
    c = torch.randn(9, 24, dtype=torch.bfloat16)

    def penalty(linear):
        y = linear(*inputs, 2.0, 0.0, "gelu")
        firsts = torch.autograd.grad((y * c).sum(), (x, lora_A), create_graph=True)
        return torch.autograd.grad(sum(g.float().pow(2).sum() for g in firsts), (x, bias, lora_A, lora_B))

    got, want = penalty(lora_linear), penalty(lora_linear_reference)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.isfinite(g).all() and w.abs().max() > 0
        assert torch.equal(g, w)


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "left_padding_nan"])
def test_attention_double_backward_equals_reference(padded, monkeypatch, caplog):
    # Causal, four query heads over two key/value heads. Padded: the first sequence starts 3 tokens late, and its
    # padding in q, k and v is NaN, which must reach no gradient. The dense computation's memory is said once.
    monkeypatch.setattr(_logging, "_said", set())
    b, hq, hkv, n, d = 2, 4, 2, 9, 16
    q, k, v = torch.randn(b, hq, n, d), torch.randn(b, hkv, n, d), torch.randn(b, hkv, n, d)
    windows = None
    if padded:
        mask = torch.ones(b, n, dtype=torch.long)
        mask[0, :3] = 0
        for t in (q, k, v):
            t.transpose(1, 2)[~mask.bool()] = float("nan")
        windows = windows_from_padding_mask(mask, n)
    inputs = tuple(t.requires_grad_() for t in (q, k, v))

    def penalty(attention):
        return gradient_penalty_grads(lambda *qkv: attention(*qkv, causal=True, windows=windows), inputs,
                                      inputs[:2], inputs)

    with caplog.at_level(logging.WARNING, logger="lorafuse"):
        got = penalty(flash_attention)
    for g, w in zip(got, penalty(attention_reference)):
        assert relative_error(g, w) < TOL
    assert caplog.text.count("double backward (create_graph=True) differentiates the plain attention") == 1


def test_rms_norm_and_silu_mul_double_backward_equal_reference():
    x, weight = torch.randn(5, 16, requires_grad=True), torch.randn(16, requires_grad=True)
    got = gradient_penalty_grads(lambda a, b: rms_norm(a, b, 1e-6), (x, weight), (x,), (x, weight))
    want = gradient_penalty_grads(lambda a, b: rms_norm_reference(a, b, 1e-6), (x, weight), (x,), (x, weight))
    gate, up = torch.randn(5, 16, requires_grad=True), torch.randn(5, 16, requires_grad=True)
    got += gradient_penalty_grads(silu_mul, (gate, up), (gate,), (gate, up))
    want += gradient_penalty_grads(silu_mul_reference, (gate, up), (gate,), (gate, up))
    for g, w in zip(got, want):
        assert relative_error(g, w) < TOL


def test_plain_backward_still_runs_the_kernels(monkeypatch):
    # Only create_graph=True takes the reference: a plain backward must not.
    ops = __import__("lorafuse.ops.lora.linear", fromlist=["differentiable_backward"])
    monkeypatch.setattr(ops, "differentiable_backward", lambda *args: pytest.fail("reference backward ran"))
    x, weight, bias, lora_A, lora_B = lora_inputs()
    lora_linear(x, weight, bias, lora_A, lora_B, 2.0).sum().backward()
    assert x.grad is not None and lora_A.grad is not None


def per_sample_grads(loss, params, xs):
    return vmap(grad(loss, argnums=tuple(range(len(params)))), in_dims=(*([None] * len(params)), 0))(*params, xs)


def test_per_sample_gradients_through_torch_func(caplog):
    # Opacus-style per-sample gradients: vmap over grad; the kernels' Functions define no vmap rule.
    x, weight, bias, lora_A, lora_B = lora_inputs()
    params = (lora_A.detach(), lora_B.detach())

    def loss_with(linear):
        return lambda a, b, row: linear(row[None], weight, None, a, b, 2.0).pow(2).sum()

    with caplog.at_level(logging.INFO, logger="lorafuse"):
        got = per_sample_grads(loss_with(lora_linear), params, x.detach())
    want = per_sample_grads(loss_with(lora_linear_reference), params, x.detach())
    for g, w in zip(got, want):
        assert g.shape == (7, *w.shape[1:]) and relative_error(g, w) < TOL
    assert "torch.func transform" in caplog.text

    gate, up = torch.randn(5, 16), torch.randn(5, 16)
    got = vmap(grad(lambda g, u: silu_mul(g, u).sum()))(gate, up)
    assert relative_error(got, vmap(grad(lambda g, u: silu_mul_reference(g, u).sum()))(gate, up)) < TOL
    norm_weight = torch.randn(16)
    got = vmap(grad(lambda w, row: rms_norm(row, w, 1e-6).pow(2).sum()), in_dims=(None, 0))(norm_weight, gate)
    want = vmap(grad(lambda w, row: rms_norm_reference(row, w, 1e-6).pow(2).sum()), in_dims=(None, 0))(norm_weight,
                                                                                                        gate)
    assert relative_error(got, want) < TOL


def test_attention_under_torch_func_falls_back():
    q, k, v = (torch.randn(3, 2, 5, 16) for _ in range(3))
    got = vmap(grad(lambda a, b, c: flash_attention(a[None], b[None], c[None], causal=True).pow(2).sum()))(q, k, v)
    want = vmap(grad(lambda a, b, c: attention_reference(a[None], b[None], c[None], causal=True).pow(2).sum()))(q, k,
                                                                                                              v)
    assert relative_error(got, want) < TOL
