"""The forward's shrink streamed beside the GEMM (_shrink_beside_gluon.py, Hopper, Gluon; GPU only:
LORAFUSE_TEST_DEVICE=cuda TRITON_INTERPRET=0 on an H100/H200).

The route against float64 on odd edges (ranks 8-64, float32 adapters as bf16 pieces or LORAFUSE_ADAPTER_MATH=fast,
bf16 and fp16 ones, biases in x's dtype or float32), with the stream's gate opened wherever SMs are free; the same
bits call after call and from a CUDA graph's replay; what it declines; the layer's route to it.
"""
import importlib

import pytest
import torch

from benchmarks.common import capture
from lorafuse.ops import _shrink_beside_gluon
from lorafuse.ops._shrink_beside_gluon import shrink_matmul_beside
from lorafuse.ops._tiles import sm_count
from lorafuse.ops.lora_matmul import tma_ready
from tests.ops.test_lora_linear import check
from tests.ops.test_shrink_matmul_gluon import SCALE, assert_matches_float64, hopper, operands

lora_linear_module = importlib.import_module("lorafuse.ops.lora_linear")


@hopper
@pytest.mark.parametrize("m, k, n", [(1000, 776, 520), (8100, 2000, 2000)], ids=["one_wave", "last_wave_part_full"])
@pytest.mark.parametrize("r, dtype, adapter_dtype, math", [(8, torch.bfloat16, torch.float32, "exact"),
                                                           (16, torch.bfloat16, torch.float32, "exact"),
                                                           (16, torch.bfloat16, torch.float32, "fast"),
                                                           (8, torch.bfloat16, torch.bfloat16, "exact"),
                                                           (32, torch.bfloat16, torch.bfloat16, "exact"),
                                                           (64, torch.bfloat16, torch.bfloat16, "exact"),
                                                           (16, torch.float16, torch.float16, "exact")],
                         ids=["r8_pieces", "r16_pieces", "r16_fast", "r8_bf16", "r32_bf16", "r64_bf16", "r16_fp16"])
@pytest.mark.parametrize("bias_dtype", [None, "x", torch.float32], ids=["no_bias", "bias", "fp32_bias"])
def test_shrink_matmul_beside_matches_float64(m, k, n, r, dtype, adapter_dtype, math, bias_dtype, monkeypatch):
    # Rows, K and columns not multiples of the tiles. "one_wave": 24 tiles, 108 SMs free, 8 row blocks: 8 stream
    # programs; "last_wave_part_full": 512 tiles (3.88 waves) on 128 programs, 4 stream programs of 16 row blocks
    # each, the last one part-full. The gate is opened so that the stream runs whatever its predicted speed.
    monkeypatch.setenv("LORAFUSE_ADAPTER_MATH", math)
    monkeypatch.setattr(_shrink_beside_gluon, "MAX_STREAM_SHARE", float("inf"))
    x, weight, lora_A, lora_B, bias = operands(m, k, n, r, dtype, adapter_dtype, bias_dtype)
    assert tma_ready(x, weight.t())
    y, s = shrink_matmul_beside(x, weight, lora_A, lora_B, SCALE, bias)
    assert_matches_float64(y, s, x, weight, lora_A, lora_B, bias)


@hopper
def test_shrink_matmul_beside_repeats_its_bits_and_replays_them_from_a_graph(monkeypatch):
    # no atomics but the counts: the same bits every call; captured in a CUDA graph (the GEMM a programmatic
    # dependent of the stream), the replay gives them too
    monkeypatch.setattr(_shrink_beside_gluon, "MAX_STREAM_SHARE", float("inf"))
    x, weight, lora_A, lora_B, bias = operands(8100, 2000, 2000, 16, torch.bfloat16, torch.float32, "x")
    first = shrink_matmul_beside(x, weight, lora_A, lora_B, SCALE, bias)
    for _ in range(3):
        y, s = shrink_matmul_beside(x, weight, lora_A, lora_B, SCALE, bias)
        assert torch.equal(y, first[0]) and torch.equal(s, first[1])
    graph, (y_replay, s_replay) = capture(lambda: shrink_matmul_beside(x, weight, lora_A, lora_B, SCALE, bias))
    y_replay.zero_()
    s_replay.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_replay, first[0]) and torch.equal(s_replay, first[1])


@hopper
def test_shrink_matmul_beside_declines():
    # 33 x 4 tiles: a whole wave on 132 SMs (H100 and H200 have 132), none free
    assert sm_count(torch.device("cuda")) == 132
    x, weight, lora_A, lora_B, bias = operands(33 * 128, 1000, 1000, 16, torch.bfloat16, torch.float32, None)
    assert shrink_matmul_beside(x, weight, lora_A, lora_B, SCALE, bias) is None
    # x of 8192 x 14336 (235 MB) on 4 free SMs against a GEMM of 512 outputs: the stream would fall far behind
    x, weight, lora_A, lora_B, bias = operands(8192, 14336, 512, 16, torch.bfloat16, torch.float32, None)
    assert shrink_matmul_beside(x, weight, lora_A, lora_B, SCALE, bias) is None
    # float32 adapters at rank 32: 96 rows of pieces a step, past the stream's two float32 sums in registers
    x, weight, lora_A, lora_B, bias = operands(8192, 1024, 8192, 32, torch.bfloat16, torch.float32, None)
    assert shrink_matmul_beside(x, weight, lora_A, lora_B, SCALE, bias) is None


@hopper
@pytest.mark.parametrize("dropout_p, routed", [(0.0, True), (0.1, False)], ids=["no_dropout", "dropout"])
def test_the_layer_streams_the_shrink_beside_the_gemm(dropout_p, routed, monkeypatch):
    # 4096 rows, 1024 -> 8192: 1024 tiles, 8 waves on 128 programs, 4 SMs free; x's 8 MB stream in about half the
    # GEMM's time. The layer's forward (and the backward's checks) take the route without dropout.
    ran = []
    real = lora_linear_module.shrink_matmul_beside

    def recorded(*args):
        result = real(*args)
        ran.append(result is not None)
        return result

    monkeypatch.setattr(lora_linear_module, "shrink_matmul_beside", recorded)
    check((4096, 1024), 8192, 16, torch.bfloat16, "auto", dropout_p=dropout_p, adapter_dtype=torch.float32)
    assert ran == ([True] if routed else [])
