"""silu_mul (one kernel forward, one backward) against float64 and against transformers' LlamaMLP product."""
import pytest
import torch
from transformers.activations import ACT2FN

from lorafuse.ops.model.silu_mul import silu_mul, silu_mul_reference
from tests.ops._helpers import DTYPES, assert_all_close, cast, dtype_id, forward_backward


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", [(1,), (7, 100), (2, 113, 48), (3, 1023)], ids=str)
def test_output_and_gradients_match_reference(shape, dtype):
    inputs = {"gate": torch.randn(shape) * 4, "up": torch.randn(shape)}
    grad_out = torch.randn(shape)

    def run(fn, dt):
        return forward_backward(fn, cast(inputs, dt), grad_out.to(dt), ("gate", "up"))

    got = run(silu_mul, dtype)
    assert all(t.dtype == dtype and t.shape == shape for t in got.values())
    assert_all_close(got, run(silu_mul_reference, torch.float64), dtype, run(silu_mul_reference, dtype))


def test_bf16_forward_equals_transformers_bit_for_bit():
    # the same roundings in the same order: silu rounded to bf16, then the product rounded
    gate, up = torch.randn(5, 300).bfloat16() * 4, torch.randn(5, 300).bfloat16()
    with torch.no_grad():
        assert torch.equal(silu_mul(gate, up), ACT2FN["silu"](gate) * up)


def test_strided_inputs_and_broadcast_fall_back_correctly():
    both = torch.randn(6, 400)
    gate, up = both[:, :200], both[:, 200:]  # halves of one projection, rows 400 apart
    torch.testing.assert_close(silu_mul(gate, up), silu_mul_reference(gate, up), rtol=1e-6, atol=1e-6)
    row = torch.randn(200)
    torch.testing.assert_close(silu_mul(gate, row), silu_mul_reference(gate, row))  # broadcast: the reference


def test_a_product_saved_within_product_recomputed_is_recomputed_in_the_backward(monkeypatch):
    # the product feeds a matmul that saves it for its weight gradient: within the context, the backward recomputes it
    # from gate and up (one more forward kernel) and every gradient is the same
    from lorafuse.ops.model import silu_mul as module
    torch.manual_seed(0)
    gate, up, weight = torch.randn(6, 40), torch.randn(6, 40), torch.randn(40, 24)
    results, calls, real = [], [], module._forward
    monkeypatch.setattr(module, "_forward", lambda *args: calls.append(1) or real(*args))
    for recompute in (False, True):
        calls.clear()
        inputs = [t.clone().requires_grad_() for t in (gate, up, weight)]
        product = module.silu_mul(inputs[0], inputs[1])
        with module.product_recomputed(product, inputs[0], inputs[1]) if recompute else torch.enable_grad():
            out = product @ inputs[2]
        out.backward(torch.ones_like(out))
        results.append(([t.grad for t in inputs], len(calls)))
    (grads, forwards), (grads_recomputed, forwards_recomputed) = results
    assert (forwards, forwards_recomputed) == (1, 2)
    for got, want in zip(grads_recomputed, grads):
        assert torch.equal(got, want)


def test_a_product_of_the_reference_is_saved_as_it_is():
    from lorafuse.ops.model.silu_mul import product_recomputed
    gate, up = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    product = silu_mul_reference(gate, up)
    weight = torch.randn(8, 3, requires_grad=True)
    with product_recomputed(product, gate, up):
        out = product @ weight
    out.sum().backward()
    torch.testing.assert_close(weight.grad, product.detach().t() @ torch.ones(4, 3))
