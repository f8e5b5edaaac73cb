"""rms_norm (one kernel) against float64 and against transformers' own LlamaRMSNorm."""
import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from lorafuse.ops.rms_norm import rms_norm, rms_norm_reference
from tests.ops._helpers import DTYPES, assert_close, dtype_id


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
