"""gemv: 1 to 16 rows times a weight matrix (decoding), against float64, with and without bias, odd widths, rows of a
larger (stacked) buffer, and an fp32 output rounded as the weight's dtype."""
import importlib
import logging
import math

import pytest
import torch
import triton

from lorafuse import _logging
from lorafuse.ops.decode.gemv import gemv, gemv_and_shrink, gemv_and_shrink_reference, gemv_reference
from tests.ops._helpers import DTYPES, assert_close, dtype_id, poison

gemv_module = importlib.import_module("lorafuse.ops.decode.gemv")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("n, k", [(1, 64), (7, 100), (113, 1030), (37, 4500)], ids=str)
@pytest.mark.parametrize("has_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("rows", [1, 2, 7, 16])
@pytest.mark.parametrize("tiles", ["default_tiles", "small_tiles"])
def test_matches_reference(tiles, rows, n, k, has_bias, dtype, monkeypatch):
    # K on both sides of the one-row config switch (4096) and not a multiple of the K tile, N not one of the row
    # tile; small tiles (one row: one row of W a program, the config of wide weights, whose real widths are too slow
    # for the interpreter; more rows: 16 columns a program) put several programs and K steps on small weights
    if tiles == "small_tiles":
        monkeypatch.setattr(gemv_module, "_config", lambda n, k: (1, 256))
        monkeypatch.setattr(gemv_module, "_few_rows_config", lambda n, k, device: (16, 64, 4, 2))
    x = torch.randn(rows, k).to(dtype)
    weight = (torch.randn(n, k) / k**0.5).to(dtype)
    bias = torch.randn(n).to(dtype) if has_bias else None
    got = gemv(x, weight, bias)
    assert got.dtype == dtype and got.shape == (rows, n)
    exact = gemv_reference(x.double(), weight.double(), None if bias is None else bias.double())
    assert_close(got, exact, dtype, gemv_reference(x, weight, bias))


@pytest.mark.parametrize("rows", [2, 3, 15, 16])
@pytest.mark.parametrize("n, k", [(45, 256), (3000, 520)], ids=str)
def test_views_with_other_row_strides_into_a_poisoned_buffer(rows, n, k):
    # weight rows 2K + 8 apart and not at column 0, x rows K + 24 apart, out rows N + 40 apart inside a NaN buffer
    # with more than 16 rows below it: a row stride taken for the width, or a store to rows >= M, shows. (45, 256):
    # 16-column tiles over whole K tiles; (3000, 520): 32-column tiles over three K tiles, the last one partial.
    weight = (torch.randn(n + 3, 2 * k + 8) / k**0.5).to(torch.bfloat16)[2:n + 2, 5:k + 5]
    x = torch.randn(rows + 2, k + 24).to(torch.bfloat16)[1:rows + 1, 3:k + 3]
    bias = torch.randn(n).to(torch.bfloat16)
    buffer = poison(torch.empty(rows + 20, n + 40))
    out = buffer[1:rows + 1, 7:n + 7]
    gemv(x, weight, bias, out=out)
    assert torch.equal(out, out.to(torch.bfloat16).float())
    assert_close(out.to(torch.bfloat16), gemv_reference(x.double(), weight.double(), bias.double()), torch.bfloat16,
                 gemv_reference(x, weight, bias))
    outside = buffer.clone()
    outside[1:rows + 1, 7:n + 7] = math.nan
    assert outside.isnan().all(), "gemv wrote outside out"


@pytest.mark.parametrize("rows", [2, 16])
@pytest.mark.parametrize("n, k", [(2000, 1024), (3000, 768), (8200, 384), (8200, 300)], ids=str)
def test_default_tiles_over_several_k_steps(rows, n, k):
    # each default tile over several K tiles, K a multiple of the tile (as every real model's) and not
    x = torch.randn(rows, k).to(torch.bfloat16)
    weight = (torch.randn(n, k) / k**0.5).to(torch.bfloat16)
    assert_close(gemv(x, weight), gemv_reference(x.double(), weight.double()), torch.bfloat16,
                 gemv_reference(x, weight))


@pytest.mark.parametrize("rows", [1, 5])
def test_rows_of_a_stacked_buffer_into_an_fp32_output(rows):
    # The decode step's weights are views into one buffer (rows K apart, not at its start), its inputs rows of a
    # larger buffer, and its logits fp32: the output is rounded as the weight's dtype first, so it equals the bf16
    # layer's output cast up.
    buffer = (torch.randn(300, 96) / 96**0.5).to(torch.bfloat16)
    weight = buffer[40:253]
    x = torch.randn(rows, 2, 96).to(torch.bfloat16)[:, 1]  # row stride 192
    out = poison(torch.empty(rows, 213))
    gemv(x, weight, out=out)
    assert torch.equal(out, out.to(torch.bfloat16).float())
    assert_close(out.to(torch.bfloat16), gemv_reference(x.double(), weight.double()), torch.bfloat16,
                 gemv_reference(x, weight))


@pytest.mark.parametrize("rows", [2, 16])
def test_float32_rows_take_pytorchs_gemm(rows, monkeypatch):
    # The few-rows kernel's float32 dots are slower than cuBLAS: float32 weights of 2-16 rows never launch
    # it, and give PyTorch's own result; one row keeps the GEMV kernel, which beat cuBLAS there too
    monkeypatch.setattr(gemv_module, "_few_rows", None)  # a launch would raise
    x, weight, bias = torch.randn(rows, 100), torch.randn(30, 100) / 10, torch.randn(30)
    out = poison(torch.empty(rows, 30))
    gemv(x, weight, bias, out=out)
    assert torch.equal(out, gemv_reference(x, weight, bias))
    with pytest.raises(ValueError, match=r"out \(1, 30\) must be \[2, 30\]"):
        gemv(x[:2], weight, out=torch.empty(1, 30))


def test_bad_shapes_say_what_they_need():
    with pytest.raises(ValueError, match="x has 17 rows; it takes 1 to 16"):
        gemv(torch.randn(17, 64), torch.randn(8, 64))
    with pytest.raises(ValueError, match=r"must be \[2, 64\]"):
        gemv(torch.randn(2, 63), torch.randn(8, 64))
    with pytest.raises(ValueError, match="unit column stride"):
        gemv(torch.randn(1, 64), torch.randn(64, 8).t())
    with pytest.raises(ValueError, match="unit column stride"):
        gemv(torch.randn(64, 3).t(), torch.randn(8, 64))
    with pytest.raises(ValueError, match=r"out \(2, 8\) must be \[1, 8\]"):
        gemv(torch.randn(1, 64), torch.randn(8, 64), out=torch.empty(2, 8))
    with pytest.raises(ValueError, match=r"out \(1, 8\) must be \[3, 8\]"):
        gemv(torch.randn(3, 64), torch.randn(8, 64), out=torch.empty(1, 8))
    with pytest.raises(ValueError, match="a contiguous"):
        gemv(torch.randn(1, 64), torch.randn(8, 64), torch.randn(16)[::2])
    with pytest.raises(ValueError, match="of more than one row must share a dtype"):
        gemv(torch.randn(4, 64).to(torch.bfloat16), torch.randn(8, 64))


@pytest.mark.parametrize("x_dtype, adapter_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                    (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)],
                         ids=["fp32", "bf16_fp32_adapters", "bf16", "fp16"])
@pytest.mark.parametrize("r", [1, 7, 16])
def test_gemv_and_shrink(r, x_dtype, adapter_dtype):
    # One launch: the base output (as gemv) and s = x A^T summed in fp32, held to the fp32 bar whatever A's dtype
    n, k = 113, 1030
    x = torch.randn(1, k).to(x_dtype)
    weight = (torch.randn(n, k) / k**0.5).to(x_dtype)
    lora_A = (torch.randn(r, k) / k**0.5).to(adapter_dtype)
    y, s = gemv_and_shrink(x, weight, lora_A)
    assert y.dtype == x_dtype and s.dtype == torch.float32 and s.shape == (1, r)
    exact_y, exact_s = gemv_and_shrink_reference(x.double(), weight.double(), lora_A.double())
    plain_y, plain_s = gemv_and_shrink_reference(x, weight, lora_A)
    assert_close(y, exact_y, x_dtype, plain_y, "y")
    assert_close(s, exact_s, torch.float32, plain_s, "s")


def test_tiles_a_gpu_cannot_launch_fall_back_to_pytorch_said_once(monkeypatch, caplog):
    # The default tiles fit Hopper's shared memory; a GPU with less raises OutOfResources at the first launch: the
    # rows then run PyTorch's GEMM (rounded as the weight's dtype, as the kernel), said once, not tried again
    launches = []

    class TooLarge:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(grid)
                raise triton.runtime.errors.OutOfResources(245760, 232448, "shared memory")
            return launch

    monkeypatch.setattr(gemv_module, "_few_rows", TooLarge())
    monkeypatch.setattr(gemv_module, "_too_large", set())
    monkeypatch.setattr(_logging, "_said", set())
    caplog.set_level(logging.WARNING, logger="lorafuse")
    x = torch.randn(4, 96).to(torch.bfloat16)
    weight = (torch.randn(40, 96) / 96**0.5).to(torch.bfloat16)
    for _ in range(2):
        out = poison(torch.empty(4, 40))
        gemv(x, weight, out=out)
        assert torch.equal(out, gemv_reference(x, weight).float())
    assert len(launches) == 1
    said = [r.getMessage() for r in caplog.records if "lorafuse.gemv" in r.getMessage()]
    assert len(said) == 1 and "PyTorch's GEMM runs them" in said[0] and "shared memory" in said[0]
    with pytest.raises(triton.runtime.errors.OutOfResources):  # a benchmark's own tiles are not replaced
        gemv(x, weight, config=(16, 64, 4, 2))
