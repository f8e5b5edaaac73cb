"""rms_norm (one kernel forward, one backward) against float64 and against transformers' own LlamaRMSNorm."""
import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from lorafuse.ops.model.rms_norm import rms_norm, rms_norm_reference
from tests.ops._helpers import DTYPES, assert_all_close, assert_close, cast, dtype_id, forward_backward


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", [(1, 64), (7, 100), (2, 113, 48), (1023, 5)], ids=str)
def test_matches_reference(shape, dtype):
    x = torch.randn(shape).to(dtype) * 3
    weight = (torch.rand(shape[-1]) + 0.5).to(dtype)
    got = rms_norm(x, weight, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    exact = rms_norm_reference(x.double(), weight.double(), 1e-6)
    assert_close(got, exact, dtype, rms_norm_reference(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_matches_transformers_llama_rms_norm(dtype):
    # bf16: the same roundings in the same order give transformers' module bit for bit (bf16 weight, and fp32
    # weight on bf16 input); fp32: equal up to the order of the sum of squares.
    module = LlamaRMSNorm(96, eps=1e-5)
    torch.nn.init.uniform_(module.weight, 0.5, 1.5)
    x = torch.randn(5, 3, 96).to(dtype)
    for weight in (module.weight.data.to(dtype), module.weight.data):
        module.weight.data = weight
        with torch.no_grad():
            got, want = rms_norm(x, module.weight, 1e-5), module(x)
        assert got.dtype == want.dtype
        if dtype == torch.bfloat16:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_strided_rows():
    x = torch.randn(6, 200)[:, :150]  # rows 200 apart
    out = rms_norm(x, torch.ones(150), 1e-6)
    assert out.is_contiguous()
    assert_close(out, rms_norm_reference(x.double(), torch.ones(150).double(), 1e-6), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", [(1, 64), (7, 100), (2, 113, 48), (1023, 5)], ids=str)
@pytest.mark.parametrize("weight_trains", [True, False], ids=["dw", "no_dw"])
def test_gradients_match_reference(shape, dtype, weight_trains):
    inputs = {"x": torch.randn(shape) * 3, "weight": torch.rand(shape[-1]) + 0.5}
    grad_out = torch.randn(shape)
    need = ("x", "weight") if weight_trains else ("x",)

    def run(fn, dt):
        return forward_backward(lambda x, weight: fn(x, weight, 1e-6), cast(inputs, dt), grad_out.to(dt), need)

    got = run(rms_norm, dtype)
    exact = run(rms_norm_reference, torch.float64)
    assert_all_close(got, exact, dtype, run(rms_norm_reference, dtype))
    assert all(g.dtype == dtype for g in got.values())


def test_gradients_of_fp32_weight_on_bf16_input_as_transformers():
    # transformers keeps a float32 norm weight on bf16 activations (and returns float32) in mixed setups
    module = LlamaRMSNorm(96, eps=1e-5)
    torch.nn.init.uniform_(module.weight, 0.5, 1.5)
    x = torch.randn(4, 96).bfloat16()
    grad_out = torch.randn(4, 96)
    got = forward_backward(lambda x, weight: rms_norm(x, weight, 1e-5), {"x": x, "weight": module.weight},
                           grad_out, ("x", "weight"))
    exact = forward_backward(lambda x, weight: rms_norm_reference(x, weight, 1e-5),
                             {"x": x.double(), "weight": module.weight.double()}, grad_out, ("x", "weight"))
    plain = forward_backward(lambda x, weight: rms_norm_reference(x, weight, 1e-5), {"x": x, "weight": module.weight},
                             grad_out, ("x", "weight"))
    assert got["out"].dtype == torch.float32 and got["x"].dtype == torch.bfloat16
    assert got["weight"].dtype == torch.float32
    assert_all_close(got, exact, torch.bfloat16, plain)


def test_gradients_through_strided_rows():
    base = torch.randn(6, 200, requires_grad=True)
    x = base[:, :150]  # rows 200 apart
    weight = torch.rand(150).requires_grad_()
    rms_norm(x, weight, 1e-6).pow(2).sum().backward()
    got = base.grad[:, :150].clone(), weight.grad.clone()
    base.grad, weight.grad = None, None
    rms_norm_reference(base[:, :150].double(), weight.double(), 1e-6).pow(2).sum().backward()
    assert_close(got[0], base.grad[:, :150], torch.float32, name="dx")
    assert_close(got[1], weight.grad, torch.float32, name="dw")
    assert torch.all(base.grad[:, 150:] == 0)
