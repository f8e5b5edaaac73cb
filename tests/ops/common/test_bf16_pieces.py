"""bf16 pieces: float32 tensors as three bfloat16 pieces summing to them exactly, and the rank-r products of float32
adapters on bf16 activations that run on those pieces: as accurate as float32 (docs/design.md's fp32 bar), not merely
within the bf16 rule."""
import torch

from lorafuse.ops.common.bf16_pieces import bf16_pieces_reference
from lorafuse.ops.lora.expand import lora_expand_backward
from lorafuse.ops.lora.shrink import lora_shrink, lora_shrink_backward
from tests.ops._helpers import rel_err


def test_pieces_sum_to_the_float32_values():
    # magnitudes from 1e-30 to 1e30, signs mixed: three pieces hold every float32 exactly (what split_bf16 computes in
    # the kernels; its products are checked against float64 below)
    t = torch.randn(37, 29) * torch.logspace(-30, 30, 29)
    pieces = bf16_pieces_reference(t)
    assert pieces.dtype == torch.bfloat16 and pieces.shape == (3, 37, 29)
    assert torch.equal(pieces.double().sum(0), t.double())
    assert not torch.equal(pieces[:2].double().sum(0), t.double())  # two would not


def test_rank_products_on_pieces_are_float32_accurate():
    # each product within 2x PyTorch's own float32 computation of it (about 1e-7 here) plus 1e-6 for the tensor
    # cores' accumulation (about 5.7e-7 on a GPU; the interpreter's is exact fp32): without the lo piece the error
    # would be ~2.5e-6, without mid ~1e-3
    m, k, n, r, scale = 113, 100, 72, 8, 0.5
    x = torch.randn(m, k).bfloat16()
    A, B = torch.randn(r, k) / k**0.5, torch.randn(n, r) / r**0.5
    ds, dy = torch.randn(m, r), torch.randn(m, n).bfloat16()
    s = lora_shrink(x, A)
    _, ds2, dB, _ = lora_expand_backward(dy, None, s, B, scale)
    products = {  # name: (kernel, float32 PyTorch, float64 exact)
        "s": (s, x.float() @ A.t(), x.double() @ A.double().t()),
        "dA": (lora_shrink_backward(ds, x, A), ds.t() @ x.float(), ds.double().t() @ x.double()),
        "ds": (ds2, scale * dy.float() @ B, scale * dy.double() @ B.double()),
        "dB": (dB, scale * dy.float().t() @ s, scale * dy.double().t() @ s.double()),
    }
    for name, (got, plain, exact) in products.items():
        err, plain_err = rel_err(got, exact), rel_err(plain, exact)
        assert err <= 2 * plain_err + 1e-6, f"{name}: relative error {err:.2e} > 2 x PyTorch fp32's {plain_err:.2e}"
