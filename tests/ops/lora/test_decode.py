"""lora_decode (LoRA on a few rows, without autograd) against float64, and lora_linear sending decode calls
there: at most 16 rows, no gradient, no dropout."""
import importlib

import pytest
import torch

from lorafuse.ops import lora_linear
from lorafuse.ops.common.activation import activation_id
from lorafuse.ops.lora.decode import lora_decode, lora_decode_reference
from tests.ops._helpers import DTYPES, assert_close, dtype_id

lora_linear_module = importlib.import_module("lorafuse.ops.lora.linear")  # lorafuse.ops exports the function
lora_decode_module = importlib.import_module("lorafuse.ops.lora.decode")
SCALE = 0.7
# (M, K, N, r, activation): K = 100 (not a multiple of BLOCK_K), 300 (three K tiles, ragged); N not a multiple of
# the column blocks (32, 64); ranks 1 to 64 (64: the shrink's narrower K tile)
CASES = [(1, 100, 80, 8, "identity"), (7, 300, 150, 1, "silu"), (16, 300, 36, 64, "gelu"), (3, 64, 200, 16, "relu")]


def case_id(case):
    return "M{}_K{}_N{}_r{}_{}".format(*case)


def operands(m, k, n, r, dtype, adapter_dtype, bias=True):
    return dict(x=torch.randn(m, k).to(dtype), weight=(torch.randn(n, k) / k**0.5).to(dtype),
                bias=torch.randn(n).to(dtype) if bias else None, lora_A=(torch.randn(r, k) / k**0.5).to(adapter_dtype),
                lora_B=(torch.randn(n, r) / r**0.5).to(adapter_dtype))


def check(inputs, activation, dtype):
    got = lora_decode(*inputs.values(), SCALE, activation_id(activation))
    assert got.dtype == dtype and not got.isnan().any()
    exact = lora_decode_reference(*(None if t is None else t.double() for t in inputs.values()), SCALE, activation)
    plain = None if dtype == torch.float32 else lora_decode_reference(*inputs.values(), SCALE, activation)
    assert_close(got, exact, dtype, plain)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_reference(case, dtype):
    m, k, n, r, activation = case
    check(operands(m, k, n, r, dtype, dtype), activation, dtype)


@pytest.mark.parametrize("x_dtype, adapter_dtype", [(torch.bfloat16, torch.float32),  # bf16 pieces of A
                                                     (torch.float16, torch.float32),   # tf32x3
                                                     (torch.bfloat16, torch.bfloat16)], ids=["bf16_fp32", "fp16_fp32",
                                                                                             "bf16_bf16"])
@pytest.mark.parametrize("k, config", [(300, (32, 64, 3, 4, 2)),   # chunks of 128, 128 and 44: ragged K tiles
                                       (256, (64, 64, 2, 4, 3)),   # two chunks of whole K tiles (EVEN_K)
                                       (256, (16, 128, 1, 4, 2))])  # one chunk
def test_k_chunks_add_up(k, config, x_dtype, adapter_dtype):
    # K cut into chunks: each adds its x_k W_k^T and its shrink x_k A_k^T; _expand_chunks sums them and expands
    inputs = operands(11, k, 150, 24, x_dtype, adapter_dtype)
    got = lora_decode(*inputs.values(), SCALE, activation_id("gelu"), config=config)
    exact = lora_decode_reference(*(t.double() for t in inputs.values()), SCALE, "gelu")
    assert got.dtype == x_dtype and not got.isnan().any()
    assert_close(got, exact, x_dtype, lora_decode_reference(*inputs.values(), SCALE, "gelu"))


@pytest.mark.parametrize("r", [64, 100, 128])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
def test_large_ranks_of_float32_adapters(r, x_dtype):
    # the shrink's K tile narrows as A's rows grow (fp32 rank 128: 16 columns), and its partials come in fewer chunks
    inputs = operands(9, 1100, 150, r, x_dtype, torch.float32)
    got = lora_decode(*inputs.values(), SCALE, activation_id("identity"))
    exact = lora_decode_reference(*(t.double() for t in inputs.values()), SCALE)
    assert_close(got, exact, x_dtype, lora_decode_reference(*inputs.values(), SCALE))


def test_float32_adapters_on_bfloat16_no_bias_transposed_weight():
    # PEFT's float32 adapters on a bf16 base; a [K, N] weight passed transposed (fan_in_fan_out, GPT-2's Conv1D)
    inputs = operands(5, 300, 150, 8, torch.bfloat16, torch.float32, bias=False)
    inputs["weight"] = inputs["weight"].t().contiguous().t()
    assert inputs["weight"].stride(0) == 1
    check(inputs, "gelu_tanh", torch.bfloat16)


def test_weights_stacked_in_one_buffer_decode_alike():
    # the fused decode step's layout (lora_A right after the frozen weight): views into one buffer, same values
    inputs = operands(6, 300, 150, 8, torch.bfloat16, torch.bfloat16)
    alone = lora_decode(*inputs.values(), SCALE, activation_id("silu"))
    both = torch.cat([inputs["weight"], inputs["lora_A"]])
    inputs["weight"], inputs["lora_A"] = both[:150], both[150:]
    assert torch.equal(lora_decode(*inputs.values(), SCALE, activation_id("silu")), alone)
    check(inputs, "silu", torch.bfloat16)


@pytest.mark.parametrize("rows, grad, dropout_p, routed", [
    (1, False, 0.0, True), (16, False, 0.0, True),
    (17, False, 0.0, False),  # more rows than one tile
    (4, True, 0.0, False),    # training: the autograd Function
    (4, False, 0.1, False),   # dropout: the mask needs the shrink kernels
])
def test_lora_linear_sends_decode_calls_here(rows, grad, dropout_p, routed, monkeypatch):
    monkeypatch.setattr(lora_linear_module, "_launch_bound", lambda x: False)  # on a GPU: as if in a graph capture
    calls = []
    monkeypatch.setattr(lora_linear_module, "lora_decode",
                        lambda *args: calls.append(args[0].shape) or lora_decode(*args))
    inputs = operands(rows, 100, 80, 8, torch.float32, torch.float32)
    inputs["lora_A"].requires_grad_(grad)
    out = lora_linear(*inputs.values(), SCALE, dropout_p, "silu", seed=3)
    assert len(calls) == int(routed)
    if dropout_p == 0.0:
        exact = lora_decode_reference(*(t.detach().double() for t in inputs.values()), SCALE, "silu")
        assert_close(out.detach(), exact, torch.float32)


@pytest.mark.parametrize("x_dtype, adapter_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                     (torch.float16, torch.float32), (torch.float32, torch.float32)],
                         ids=["bf16_bf16", "bf16_fp32", "fp16_fp32", "fp32_fp32"])
@pytest.mark.parametrize("rows", [2, 1])
def test_every_adapter_dtype_decodes_here(rows, x_dtype, adapter_dtype, monkeypatch):
    # PEFT's fp32 adapters included: one row sums the shrink in fp32 in ops.gemv, more rows in _rows_chunks (a
    # float32 model's rows in PyTorch's GEMMs)
    monkeypatch.setattr(lora_linear_module, "_launch_bound", lambda x: False)  # on a GPU: as if in a graph capture
    calls = []
    monkeypatch.setattr(lora_linear_module, "lora_decode", lambda *args: calls.append(1) or lora_decode(*args))
    inputs = operands(rows, 100, 80, 8, x_dtype, adapter_dtype)
    with torch.no_grad():
        got = lora_linear(*inputs.values(), SCALE, 0.0, "identity")
    assert len(calls) == 1
    exact = lora_decode_reference(*(t.double() for t in inputs.values()), SCALE)
    assert_close(got, exact, x_dtype, lora_decode_reference(*inputs.values(), SCALE))


@pytest.mark.parametrize("adapter_dtype", [torch.float32, torch.bfloat16], ids=["fp32_adapters", "bf16_adapters"])
def test_one_row_runs_gemv_and_shrink(adapter_dtype, monkeypatch):
    # One row: ops.gemv gives x W^T and the fp32 shrink in one launch (PEFT's fp32 adapters on bf16 included), then
    # lora_expand; values against float64, and the shrink kernel of more rows never runs
    monkeypatch.setattr(lora_decode_module, "_rows_chunks", None)  # would raise if called
    inputs = operands(1, 300, 150, 8, torch.bfloat16, adapter_dtype)
    check(inputs, "silu", torch.bfloat16)


@pytest.mark.parametrize("rows", [2, 16])
def test_float32_rows_take_pytorchs_gemms(rows, monkeypatch):
    # A float32 model's rows: the kernels' float32 dots are slower than PyTorch's three GEMMs there, so more
    # than one row never launches them; values (activation and bias included) against float64
    monkeypatch.setattr(lora_decode_module, "_rows_chunks", None)  # would raise if called
    monkeypatch.setattr(lora_decode_module, "_expand_chunks", None)
    check(operands(rows, 100, 80, 8, torch.float32, torch.float32), "gelu", torch.float32)


def test_no_rows_give_an_empty_output():
    # the kernels read x's rows modulo M: no rows never reach them
    x = torch.randn(0, 40)
    y = lora_decode(x, torch.randn(24, 40), None, torch.randn(4, 40), torch.randn(24, 4), 2.0)
    assert y.shape == (0, 24) and y.dtype == x.dtype
