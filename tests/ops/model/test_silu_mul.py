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
