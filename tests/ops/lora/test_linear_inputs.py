"""lora_linear on awkward inputs: bad shapes, int seeds, strided tensors, empty batches."""
import pytest
import torch

from lorafuse.ops import lora_linear, lora_linear_reference


def operands(m=7, k=48, n=80, r=8):
    x = torch.randn(m, k, requires_grad=True)
    w = torch.randn(n, k) / k**0.5
    A = (torch.randn(r, k) / k**0.5).requires_grad_()
    B = torch.randn(n, r).requires_grad_()
    return x, w, A, B


@pytest.mark.parametrize("bad", ["x_width", "lora_B_rank", "bias_length"])
def test_shapes_that_do_not_fit_are_named(bad):
    x, w, A, B = operands()
    bias = torch.randn(80)
    if bad == "x_width":
        x = torch.randn(7, 50)
    elif bad == "lora_B_rank":
        B = torch.randn(80, 4)
    else:
        bias = torch.randn(10)
    with pytest.raises(ValueError, match=r"shapes do not fit: x \(7, (48|50)\)"):
        lora_linear(x, w, bias, A, B, 2.0)


def test_input_and_weight_dtypes_must_agree_outside_autocast():
    x, w, A, B = operands()
    with pytest.raises(TypeError, match="input is torch.bfloat16 but the frozen weight is torch.float32"):
        lora_linear(x.detach().bfloat16(), w, None, A, B, 2.0)


def test_int_seed_is_the_tensor_seed():
    x, w, A, B = operands()
    with torch.no_grad():
        by_int = lora_linear(x, w, None, A, B, 2.0, 0.3, seed=123456789)
        by_tensor = lora_linear(x, w, None, A, B, 2.0, 0.3, seed=torch.tensor([123456789]))
    assert torch.equal(by_int, by_tensor)
    with pytest.raises(ValueError, match="seed must be an int64 tensor"):
        lora_linear(x, w, None, A, B, 2.0, 0.3, seed=torch.tensor([1.0]))


def test_strided_bias_and_input():
    x, w, A, B = operands()
    wide = torch.randn(80, 3)
    bias = wide[:, 1].requires_grad_()  # a column: stride 3
    xt = torch.randn(48, 7).t().requires_grad_()  # transposed input
    got = lora_linear(xt, w, bias, A, B, 2.0)
    want = lora_linear_reference(xt, w, bias, A, B, 2.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(got.sum(), (xt, bias, A, B))
    want_grads = torch.autograd.grad(want.sum(), (xt, bias, A, B))
    for g, wg in zip(grads, want_grads):
        torch.testing.assert_close(g, wg, rtol=1e-5, atol=1e-5)


def test_empty_batch():
    _, w, A, B = operands()
    x = torch.randn(0, 48, requires_grad=True)
    y = lora_linear(x, w, None, A, B, 2.0, 0.1)
    assert y.shape == (0, 80)
    dx, dA = torch.autograd.grad(y.sum(), (x, A))
    assert dx.shape == (0, 48) and torch.equal(dA, torch.zeros_like(A))
