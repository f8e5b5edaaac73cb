"""Routes that only a GPU takes, on the compiled kernels.

- `_launch_bound` itself: an eager call of a few rows runs PyTorch's launches (the reference), the same call inside a
  CUDA-graph capture runs lora_decode's kernels, and the replayed graph gives lora_decode's result.
- the training route at a training size (cuBLAS GEMMs and the Triton passes over x and dy), forward and every
  gradient against float64, with and without dropout, float32 and bf16 adapters.

Run on the GPU machine: LORAFUSE_TEST_DEVICE=cuda TRITON_INTERPRET=0 python -m pytest tests/ops/lora/test_gpu_routes.py
"""
import importlib

import pytest
import torch

from lorafuse.ops import lora_linear, lora_linear_reference
from lorafuse.ops.lora.decode import lora_decode, lora_decode_reference
from tests.ops._helpers import assert_close, seed_tensor

if torch.get_default_device().type != "cuda" or not torch.cuda.is_available():
    pytest.skip("GPU routes: run with LORAFUSE_TEST_DEVICE=cuda TRITON_INTERPRET=0 on a CUDA machine",
                allow_module_level=True)

lora_linear_module = importlib.import_module("lorafuse.ops.lora.linear")
SCALE = 0.7


def test_launch_bound_eagerly_and_kernels_under_capture(monkeypatch):
    references, decodes = [], []
    monkeypatch.setattr(lora_linear_module, "lora_linear_reference",
                        lambda *a, **k: references.append(1) or lora_linear_reference(*a, **k))
    monkeypatch.setattr(lora_linear_module, "lora_decode", lambda *a: decodes.append(1) or lora_decode(*a))
    k, n, r = 1000, 700, 12
    x = torch.randn(6, k, dtype=torch.bfloat16)
    weight, bias = (torch.randn(n, k) / k**0.5).bfloat16(), torch.randn(n).bfloat16()
    lora_A, lora_B = torch.randn(r, k) / k**0.5, torch.randn(n, r) / r**0.5  # PEFT's float32 adapters
    args = (x, weight, bias, lora_A, lora_B, SCALE)
    with torch.no_grad():
        eager = lora_linear(*args, activation="silu")
        assert (references, decodes) == ([1], [])
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the capture compiles nothing: it is launch-bound too
            lora_linear(*args, activation="silu")
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = lora_linear(*args, activation="silu")
        assert (references, decodes) == ([1, 1], [1])
        graph.replay()
        torch.cuda.synchronize()
    exact = lora_decode_reference(*(t.double() for t in args[:5]), SCALE, "silu")
    plain = lora_decode_reference(*args, "silu")
    assert_close(captured, exact, torch.bfloat16, plain, "replayed")
    assert_close(eager, exact, torch.bfloat16, plain, "eager")
    assert torch.equal(captured, lora_decode(x, weight, bias, lora_A, lora_B, SCALE, 4))  # 4: silu


@pytest.mark.parametrize("gemm", [None, "triton"], ids=["auto", "triton_forced"])
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("adapter_dtype", [torch.float32, torch.bfloat16], ids=["fp32_adapters", "bf16_adapters"])
def test_training_route_at_a_training_size(p, adapter_dtype, gemm):
    # 2 x 1030 rows of K 1000 -> N 1500 (odd edges), r 12: the cuBLAS route (or the Triton GEMM at its 128 x 256
    # tiles, forced); the whole step replayed from a CUDA graph is tests/train/test_captured_step_gpu.py's
    m, k, n, r = 2060, 1000, 1500, 12
    x = torch.randn(2, m // 2, k, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(n, k) / k**0.5).bfloat16()
    lora_A = (torch.randn(r, k) / k**0.5).to(adapter_dtype).requires_grad_()
    lora_B = (torch.randn(n, r) / r**0.5).to(adapter_dtype).requires_grad_()
    dy = torch.randn(2, m // 2, n, dtype=torch.bfloat16)
    seed = seed_tensor(12345)
    assert lora_linear_module._route(None, x.view(m, k), lora_A, False) == "cublas"

    def run():
        y = lora_linear(x, weight, None, lora_A, lora_B, SCALE, p, seed=seed, gemm=gemm)
        return [y, *torch.autograd.grad(y, (x, lora_A, lora_B), dy)]

    leaves = (x, weight, lora_A, lora_B)
    exact_in = [t.detach().double().requires_grad_(t.requires_grad) for t in leaves]
    exact_y = lora_linear_reference(*exact_in[:2], None, *exact_in[2:], SCALE, p, seed=seed)
    exact = [exact_y, *torch.autograd.grad(exact_y, (exact_in[0], exact_in[2], exact_in[3]), dy.double())]
    plain_in = [t.detach().requires_grad_(t.requires_grad) for t in leaves]
    plain_y = lora_linear_reference(*plain_in[:2], None, *plain_in[2:], SCALE, p, seed=seed)
    plain = [plain_y, *torch.autograd.grad(plain_y, (plain_in[0], plain_in[2], plain_in[3]), dy)]
    eager = run()
    for name, got, want, base in zip(["y", "dx", "dA", "dB"], eager, exact, plain):
        assert_close(got, want, got.dtype, base, name)
