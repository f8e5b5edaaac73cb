"""The forward's shrink streamed beside the GEMM (_shrink_beside_gluon.py, Hopper, Gluon; GPU only:
LORAFUSE_TEST_DEVICE=cuda TRITON_INTERPRET=0 on an H100/H200).

The route against float64 on odd edges (ranks 8-64, float32 adapters as bf16 pieces or LORAFUSE_ADAPTER_MATH=fast,
bf16 and fp16 ones, biases in x's dtype or float32), with the stream's gate opened wherever SMs are free; the same
bits call after call and from a CUDA graph's replay; what it declines; the layer's route to it. With dropout: the
masked stream against float64 of the masked x, with and without a head of rows shrunk before it, and its seed; the
GEMM waiting on one stream program, or started after the whole stream; no stream before a GEMM that failed; on the
CPU too, how many row blocks the head takes.
"""
import importlib

import pytest
import torch

from benchmarks.common import capture
from lorafuse.ops import _gluon, _shrink_beside_gluon
from lorafuse.ops._lora_matmul_gluon import GROUP_M, _gemm_rank_r_key, rank_r_width
from lorafuse.ops._shrink_beside_gluon import MIN_STREAMED_BLOCKS, head_row_blocks, shrink_matmul_beside
from lorafuse.ops._tiles import sm_count
from lorafuse.ops.dropout import keep_mask_reference, keep_scale
from lorafuse.ops.lora_matmul import tma_ready
from tests.ops.test_lora_linear import check
from tests.ops.test_shrink_matmul_gluon import SCALE, assert_matches_float64, hopper, operands

SEED = 20261127

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
@pytest.mark.parametrize("m, k, n", [(1000, 776, 520), (8100, 2048, 2000)], ids=["one_wave", "last_wave_part_full"])
@pytest.mark.parametrize("r, dtype, adapter_dtype, math, p, bias_dtype", [
    (16, torch.bfloat16, torch.float32, "exact", 0.05, "x"), (16, torch.bfloat16, torch.float32, "exact", 0.5, "x"),
    (16, torch.bfloat16, torch.float32, "exact", 0.05, torch.float32),
    (16, torch.bfloat16, torch.float32, "fast", 0.05, "x"), (8, torch.bfloat16, torch.float32, "exact", 0.05, "x"),
    (8, torch.bfloat16, torch.bfloat16, "exact", 0.05, "x"), (64, torch.bfloat16, torch.bfloat16, "exact", 0.05, "x"),
    (16, torch.float16, torch.float16, "exact", 0.05, "x")],
    ids=["r16_pieces", "r16_pieces_p0.5", "r16_pieces_fp32_bias", "r16_fast", "r8_pieces", "r8_bf16", "r64_bf16",
         "r16_fp16"])
@pytest.mark.parametrize("head", [0, 5], ids=["all_streamed", "head_5_blocks"])
def test_shrink_matmul_beside_with_dropout_matches_float64(m, k, n, r, dtype, adapter_dtype, math, p, bias_dtype, head,
                                                           monkeypatch):
    # the masked stream: s = dropout(x) A^T with the mask that dropout.keep_mask_reference draws for the seed (x's
    # columns past K and the padded register-order columns of lora_A included at K = 776); y's GEMM on the unmasked x.
    # The head (lora_shrink's rows before the stream, counted in by the stream's program 0) is set here: none, or 5
    # row blocks
    monkeypatch.setenv("LORAFUSE_ADAPTER_MATH", math)
    monkeypatch.setattr(_shrink_beside_gluon, "head_row_blocks", lambda *args: head)
    x, weight, lora_A, lora_B, bias = operands(m, k, n, r, dtype, adapter_dtype, bias_dtype)
    seed = torch.tensor([SEED], dtype=torch.int64)
    y, s = shrink_matmul_beside(x, weight, lora_A, lora_B, SCALE, bias, p, seed)
    keep = keep_mask_reference(SEED, m, k, p, x.device) * keep_scale(p)
    assert 0.9 * (1 - p) < keep.bool().float().mean().item() < 1.1 * (1 - p)
    assert_matches_float64(y, s, x, weight, lora_A, lora_B, bias, keep=keep)


def test_the_head_holds_the_first_group_and_what_the_stream_would_not_make_in_time():
    # 8192 x 4096 -> 4096 on 4 stream programs (1 MB row blocks, a 344 us GEMM): the stream makes 26 of 64 row
    # blocks at 20 GB/s a program
    assert head_row_blocks(64, 4, 2**20, 344e-6, True) == 64 - int(4 * 20e9 * 344e-6 / 2**20) == 38
    # a GEMM long enough for the stream to make them all: the first group still goes first
    assert head_row_blocks(64, 4, 2**20, 5e-3, True) == GROUP_M
    # too few left to stream: no route
    assert head_row_blocks(GROUP_M + MIN_STREAMED_BLOCKS - 1, 4, 2**20, 5e-3, True) is None
    assert head_row_blocks(64, 4, 2**20, 50e-6, False) is None


@hopper
def test_shrink_matmul_beside_with_dropout_follows_its_seed(monkeypatch):
    # the same seed: the same bits, eagerly and from a graph's replay; another seed: another mask (and y with it)
    monkeypatch.setattr(_shrink_beside_gluon, "head_row_blocks", lambda *args: 8)
    x, weight, lora_A, lora_B, bias = operands(8100, 2000, 2000, 16, torch.bfloat16, torch.float32, None)
    seed = torch.tensor([SEED], dtype=torch.int64)
    first = shrink_matmul_beside(x, weight, lora_A, lora_B, SCALE, bias, 0.1, seed)
    y, s = shrink_matmul_beside(x, weight, lora_A, lora_B, SCALE, bias, 0.1, seed)
    assert torch.equal(y, first[0]) and torch.equal(s, first[1])
    graph, (y_replay, s_replay) = capture(lambda: shrink_matmul_beside(x, weight, lora_A, lora_B, SCALE, bias, 0.1,
                                                                       seed))
    s_replay.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_replay, first[0]) and torch.equal(s_replay, first[1])
    seed.fill_(SEED + 1)
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(s_replay, first[1]) and not torch.equal(y_replay, first[0])


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
    # with dropout, 8 row blocks: all of them the head (the GEMM's first group), none left to stream
    x, weight, lora_A, lora_B, bias = operands(1000, 776, 520, 16, torch.bfloat16, torch.float32, None)
    seed = torch.tensor([SEED], dtype=torch.int64)
    assert shrink_matmul_beside(x, weight, lora_A, lora_B, SCALE, bias, 0.1, seed) is None


@hopper
@pytest.mark.parametrize("p", [0.0, 0.1], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("order", ["one_stream_program", "gemm_not_a_dependent"])
def test_the_gemm_waits_for_the_stream_however_late_it_runs(p, order, monkeypatch):
    # "one_stream_program": 512 tiles (3.88 waves) on 128 programs and one stream program (129 SMs said), which makes
    # the 64 row blocks one after the other: most of the GEMM's tiles wait on it. "gemm_not_a_dependent": a kernel
    # enqueued between the stream and the GEMM, so that the GEMM is no programmatic dependent and starts only after
    # the whole stream (PDL off). Either way: the same bits as the route's usual run.
    monkeypatch.setattr(_shrink_beside_gluon, "MAX_STREAM_SHARE", float("inf"))
    monkeypatch.setattr(_shrink_beside_gluon, "head_row_blocks", lambda *args: 5)  # with dropout: 5, counted in first
    x, weight, lora_A, lora_B, bias = operands(8100, 2000, 2000, 16, torch.bfloat16, torch.float32, "x")
    seed = torch.tensor([SEED], dtype=torch.int64)
    usual = shrink_matmul_beside(x, weight, lora_A, lora_B, SCALE, bias, p, seed)
    if order == "one_stream_program":
        monkeypatch.setattr(_shrink_beside_gluon, "sm_count", lambda device: 129)
    else:
        real = _shrink_beside_gluon.gemm_rank_r_packed

        def after_another_kernel(*args, **kwargs):
            torch.cuda._sleep(1000)
            return real(*args, **kwargs)

        monkeypatch.setattr(_shrink_beside_gluon, "gemm_rank_r_packed", after_another_kernel)
    y, s = shrink_matmul_beside(x, weight, lora_A, lora_B, SCALE, bias, p, seed)
    assert torch.equal(y, usual[0]) and torch.equal(s, usual[1])


@hopper
@pytest.mark.parametrize("p", [0.0, 0.1], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("broken", ["gemm", "stream"])
def test_nothing_runs_before_a_kernel_that_failed(p, broken, monkeypatch):
    # the GEMM variant's, or the stream's, first launch failed (logged, off for the process): the route declines
    # before the head's shrink, the packing and the stream
    x, weight, lora_A, lora_B, bias = operands(8100, 2000, 2000, 16, torch.bfloat16, torch.float32, None)
    seed = torch.tensor([SEED], dtype=torch.int64)
    monkeypatch.setattr(_shrink_beside_gluon, "MAX_STREAM_SHARE", float("inf"))
    monkeypatch.setattr(_shrink_beside_gluon, "head_row_blocks", lambda *args: 8)
    launched = []
    monkeypatch.setattr(_shrink_beside_gluon, "launch_or_fall_back", lambda kernel, launch: launched.append(kernel))
    monkeypatch.setattr(_shrink_beside_gluon, "lora_shrink", lambda *args: launched.append("lora_shrink"))
    monkeypatch.setattr(_shrink_beside_gluon, "rank_r_operands", lambda *args, **kwargs: launched.append("packing"))
    stream = f"_shrink_stream(pieces=True, r=16, bias_columns=0, dtype=torch.bfloat16, masked={p > 0})"
    monkeypatch.setattr(_gluon, "_broken", {_gemm_rank_r_key(True, rank_r_width(16, True, 0), True)
                                            if broken == "gemm" else stream})
    assert shrink_matmul_beside(x, weight, lora_A, lora_B, SCALE, bias, p, seed) is None and launched == []


@hopper
@pytest.mark.parametrize("dropout_p", [0.0, 0.1], ids=["no_dropout", "dropout"])
def test_the_layer_streams_the_shrink_beside_the_gemm(dropout_p, monkeypatch):
    # 4096 rows, 1024 -> 8192: 1024 tiles, 8 waves on 128 programs, 4 SMs free; x's 8 MB stream in under the GEMM's
    # time (with dropout, after a head of 8 of the 32 row blocks). The layer's forward (and the backward's checks)
    # take the route.
    ran = []
    real = lora_linear_module.shrink_matmul_beside

    def recorded(*args):
        result = real(*args)
        ran.append(result is not None)
        return result

    monkeypatch.setattr(lora_linear_module, "shrink_matmul_beside", recorded)
    check((4096, 1024), 8192, 16, torch.bfloat16, "auto", dropout_p=dropout_p, adapter_dtype=torch.float32)
    assert ran == [True]
