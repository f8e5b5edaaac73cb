"""Routes that only a GPU takes, on the compiled kernels: what the CPU suite declares by monkeypatching is checked here
for real.

- `_launch_bound` itself: an eager call of a few rows runs PyTorch's launches (the reference), the same call inside a
  CUDA-graph capture runs lora_decode's kernels, and the replayed graph gives lora_decode's result.
- dx through the fused TMA GEMM at its default 128x256 tiles (Hopper: the Gluon kernel): "auto" takes it at training
  sizes, with odd ranks, float32 adapters (bf16 pieces) and bf16 ones; on Hopper, up to the ranks that fit, the same
  GEMM also makes dA (two more steps a tile), checked alone against float64 and bit for bit on an x that picks rows.
- the Triton TMA kernel at those tiles, with the Gluon one turned off (what runs with an activation or a stored Z, on
  Blackwell, or on a Triton whose Gluon is not the tested one).
- lora_matmul's Gluon GEMM (Hopper) against float64: odd edges, ranks 1-64, bias in x's dtype or float32, x W^T and
  g W, one wave of tiles or several tiles per program.
- lora_expand_backward's Gluon kernel (Hopper, float32 adapters as bf16 pieces) against float64: odd edges, ranks
  8-64, dB added with atomics or as partial sums (deterministic mode).
- lora_shrink_backward's Gluon kernel for dropout with the dx term (Hopper; float32 adapters as bf16 pieces, and
  16-bit adapter math) against float64 and the reference mask: odd edges, ranks 8-32, dA added with atomics or as
  partial sums.

Run on the GPU machine in the op tests' GPU mode:
    LORAFUSE_TEST_DEVICE=cuda TRITON_INTERPRET=0 python -m pytest -q tests/ops/test_gpu_routes.py
"""
import importlib
from unittest import mock

import pytest
import torch

from benchmarks.common import capture
from lorafuse.ops import _gluon, _shrink_grad_beside_gluon, lora_linear, lora_linear_reference
from lorafuse.ops._bf16_pieces import uses_bf16_pieces
from lorafuse.ops._lora_matmul_gluon import (_gemm_rank_r_key, dx_and_shrink_grad_gluon, rank_r_width,
                                             shrink_grad_gemm_ready)
from lorafuse.ops._shrink_grad_beside_gluon import dx_beside_shrink_grad
from lorafuse.ops._tiles import padded_rank, sm_count
from lorafuse.ops.lora_decode import lora_decode, lora_decode_reference
from lorafuse.ops.dropout import keep_mask_reference, keep_scale
from lorafuse.ops.lora_expand import lora_expand_backward
from lorafuse.ops.lora_matmul import fills_the_gpu, lora_matmul, lora_matmul_reference, tma_ready
from lorafuse.ops.lora_shrink import lora_shrink_backward
from tests.ops._helpers import BIG_SEED, assert_close, poison, poison_unzeroed_sums, seed_tensor
from tests.ops.test_lora_linear import check

if torch.get_default_device().type != "cuda" or not torch.cuda.is_available():
    pytest.skip("GPU routes: run with LORAFUSE_TEST_DEVICE=cuda TRITON_INTERPRET=0 on a CUDA machine",
                allow_module_level=True)

lora_linear_module = importlib.import_module("lorafuse.ops.lora_linear")
lora_matmul_module = importlib.import_module("lorafuse.ops.lora_matmul")
lora_expand_module = importlib.import_module("lorafuse.ops.lora_expand")
lora_shrink_module = importlib.import_module("lorafuse.ops.lora_shrink")
SCALE = 0.7


def record_launches(monkeypatch, module, launcher: str, deterministic: bool) -> list:
    """A list that gains, whenever module.<launcher> (a Gluon kernel's launcher) is called, whether its kernel ran
    (a launcher returns None when its kernel failed and the Triton kernel runs instead); deterministic algorithms on
    or off for the test."""
    ran = []
    real = getattr(module, launcher)

    def launch(*args):
        result = real(*args)
        ran.append(result is not None)
        return result

    monkeypatch.setattr(module, launcher, launch)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: deterministic)
    return ran


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


@pytest.mark.skipif(torch.cuda.get_device_capability()[0] < 9, reason="TMA needs compute capability >= 9")
@pytest.mark.parametrize("r", [1, 5, 24, 64])
@pytest.mark.parametrize("adapter_dtype", [torch.float32, torch.bfloat16], ids=["fp32_adapters", "bf16_adapters"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dA", "deterministic"])
def test_dx_through_the_tma_gemm_at_its_default_tiles(r, adapter_dtype, deterministic, monkeypatch):
    m, k, n = 4096, 520, 8192  # K not a multiple of the 64-wide K tile
    x = torch.randn(m, k, dtype=torch.bfloat16)
    weight = torch.randn(n, k, dtype=torch.bfloat16)
    assert tma_ready(x, weight.t()) and fills_the_gpu(m, n, x.device)
    assert lora_linear_module._resolve_gemm(None, x, weight, torch.randn(r, k, dtype=adapter_dtype), 0, False) == \
        "triton"
    tma_calls = []
    real = lora_linear_module.lora_matmul
    monkeypatch.setattr(lora_linear_module, "lora_matmul",
                        lambda *a, **kw: tma_calls.append(kw.get("tma")) or real(*a, **kw))
    # the forward's y through lora_matmul: the shrink streamed beside the GEMM (bf16 adapters at rank 64 would take
    # it; test_shrink_beside_gluon.py) declines here
    monkeypatch.setattr(lora_linear_module, "shrink_matmul_beside", lambda *args: None)
    fused = record_launches(monkeypatch, lora_linear_module, "dx_and_shrink_grad_gluon", deterministic)
    beside = record_launches(monkeypatch, lora_linear_module, "dx_beside_shrink_grad", deterministic)
    check((m, k), n, r, torch.bfloat16, "auto", adapter_dtype=adapter_dtype)
    pieces = adapter_dtype == torch.float32
    if torch.cuda.get_device_capability()[0] == 9 and padded_rank(r) * (4 if pieces else 1) <= 64:
        # forward y; backward dx on 96 of the SMs (96 tiles) and dA streamed beside it on 5 others (520 columns)
        assert tma_calls == [True] and beside == [True] and fused == []
    else:  # forward y and backward dx; dA from its own pass (L's groups too wide for one MMA of the stream)
        assert tma_calls == [True, True] and beside == [False] and fused == []


@pytest.mark.skipif(torch.cuda.get_device_capability()[0] != 9, reason="the Gluon GEMM runs on compute capability 9")
@pytest.mark.parametrize("r, adapter_dtype", [(5, torch.float32), (16, torch.bfloat16)],
                         ids=["fp32_adapters", "bf16_adapters"])
def test_dx_takes_the_fused_gemm_where_no_sm_is_free(r, adapter_dtype, monkeypatch):
    # 33 row blocks x 4 column blocks of dx: 132 tiles, a whole wave on 132 SMs and none free (H100 and H200 have
    # 132): dA from the dx GEMM's own steps. 1104 outputs: the forward's 165 tiles fill the GPU (the Triton route),
    # and g's rows keep TMA's 16-byte alignment
    assert sm_count(torch.device("cuda")) == 132
    fused = record_launches(monkeypatch, lora_linear_module, "dx_and_shrink_grad_gluon", False)
    beside = record_launches(monkeypatch, lora_linear_module, "dx_beside_shrink_grad", False)
    check((33 * 128, 4 * 256), 1104, r, torch.bfloat16, "auto", adapter_dtype=adapter_dtype)
    assert beside == [False] and fused == [True]


@pytest.mark.skipif(torch.cuda.get_device_capability()[0] != 9, reason="the Gluon GEMM runs on compute capability 9")
@pytest.mark.parametrize("m, k, n", [(300, 776, 136), (300, 776, 520), (4100, 8200, 1000)],
                         ids=["fewest_steps", "one_wave", "many_tiles"])
@pytest.mark.parametrize("dtype, adapter_dtype, math, r", [
    (torch.bfloat16, torch.float32, "exact", 1), (torch.bfloat16, torch.float32, "exact", 5),
    (torch.bfloat16, torch.float32, "exact", 16), (torch.bfloat16, torch.bfloat16, "exact", 5),
    (torch.bfloat16, torch.bfloat16, "exact", 16), (torch.bfloat16, torch.bfloat16, "exact", 64),
    (torch.float16, torch.float16, "exact", 16), (torch.bfloat16, torch.float32, "fast", 24)],
    ids=["pieces_r1", "pieces_r5", "pieces_r16", "bf16_r5", "bf16_r16", "bf16_r64", "fp16_r16", "fast_r24"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dA", "deterministic"])
def test_gluon_dx_and_shrink_grad_match_float64(m, k, n, dtype, adapter_dtype, math, r, deterministic, monkeypatch):
    # dx = g W + ds A and dA = ds^T x from one GEMM (the layer's backward without dropout): rows, dx's columns (x's)
    # and g's columns not multiples of the 128 x 256 x 64 tiles. "fewest_steps": three K-steps, the fewest it takes;
    # "many_tiles": each program walks several tiles, and 33 row blocks add into each column of dA, with atomics or
    # as partial sums summed in order (deterministic algorithms: the same bits twice).
    monkeypatch.setenv("LORAFUSE_ADAPTER_MATH", math)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: deterministic)
    g, weight, ds, A, x = backward_operands(m, k, n, r, dtype, adapter_dtype)
    pieces = uses_bf16_pieces(dtype, adapter_dtype)
    assert pieces == (math == "exact" and adapter_dtype == torch.float32)
    assert tma_ready(g, weight) and shrink_grad_gemm_ready(g, weight, A, x, pieces)
    dx, dA = dx_and_shrink_grad_gluon(g, weight, ds, A, x, pieces, sm_count(x.device))
    assert_dx_and_dA(dx, dA, g, weight, ds, A, x, pieces)
    if deterministic:
        dx_again, dA_again = dx_and_shrink_grad_gluon(g, weight, ds, A, x, pieces, sm_count(x.device))
        assert torch.equal(dx_again, dx) and torch.equal(dA_again, dA)


def backward_operands(m, k, n, r, dtype, adapter_dtype):
    """(g [m, n], weight [n, k], ds [m, r] fp32, A [r, k], x [m, k]) of the layer's backward, random."""
    return (torch.randn(m, n, dtype=dtype), (torch.randn(n, k) / n**0.5).to(dtype), torch.randn(m, r),
            (torch.randn(r, k) / k**0.5).to(adapter_dtype), torch.randn(m, k, dtype=dtype))


def assert_dx_and_dA(dx, dA, g, weight, ds, A, x, pieces):
    """dx = g W + ds A and dA = ds^T x against float64, by DESIGN.md's rule; dA's bar: PEFT's float32 adapter path,
    or PyTorch in x's dtype (ds rounded to it, as the kernels do)."""
    exact_dx = lora_matmul_reference(g, weight, ds, A, 1.0, dtype=torch.float64)
    assert_close(dx, exact_dx, x.dtype, lora_matmul_reference(g, weight, ds, A, 1.0), "dx")
    plain_dA = ds.t() @ x.float() if pieces else ds.to(x.dtype).t() @ x
    assert dA.dtype == torch.float32 and dA.shape == A.shape
    assert_close(dA, ds.double().t() @ x.double(), x.dtype, plain_dA, "dA")


@pytest.mark.skipif(torch.cuda.get_device_capability()[0] != 9, reason="the Gluon GEMM runs on compute capability 9")
@pytest.mark.parametrize("m, k, n", [(1000, 2000, 8200), (8100, 2000, 8200)], ids=["one_wave", "last_wave_part_full"])
@pytest.mark.parametrize("dtype, adapter_dtype, math, r", [
    (torch.bfloat16, torch.float32, "exact", 1), (torch.bfloat16, torch.float32, "exact", 16),
    (torch.bfloat16, torch.bfloat16, "exact", 5), (torch.bfloat16, torch.bfloat16, "exact", 64),
    (torch.bfloat16, torch.float32, "fast", 24), (torch.float16, torch.float16, "exact", 16)],
    ids=["pieces_r1", "pieces_r16", "bf16_r5", "bf16_r64", "fast_r24", "fp16_r16"])
def test_dx_beside_shrink_grad_matches_float64_and_replays(m, k, n, dtype, adapter_dtype, math, r, monkeypatch):
    # dx = g W + ds A on the Gluon GEMM with fewer programs in as many waves, dA = ds^T x beside it on a second
    # stream: odd edges; "one_wave": 64 tiles, 68 SMs free (16 column blocks of x: 16 stream programs);
    # "last_wave_part_full": 512 tiles (3.88 waves), 4 free.
    # Captured in a CUDA graph (the second stream forks from and joins the captured one), the replay gives the
    # same bits as the eager call.
    monkeypatch.setenv("LORAFUSE_ADAPTER_MATH", math)
    g, weight, ds, A, x = backward_operands(m, k, n, r, dtype, adapter_dtype)
    pieces = uses_bf16_pieces(dtype, adapter_dtype)
    dx, dA = dx_beside_shrink_grad(g, weight, ds, A, x, pieces)
    assert_dx_and_dA(dx, dA, g, weight, ds, A, x, pieces)
    graph, (dx_replay, dA_replay) = capture(lambda: dx_beside_shrink_grad(g, weight, ds, A, x, pieces))
    dx_replay.zero_()
    dA_replay.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(dx_replay, dx) and torch.equal(dA_replay, dA)


@pytest.mark.skipif(torch.cuda.get_device_capability()[0] != 9, reason="the Gluon GEMM runs on compute capability 9")
def test_dx_beside_shrink_grad_declines_a_pass_that_would_outlast_the_gemm():
    # 14336 -> 1024: x of 8192 x 14336 (235 MB) on 4 free SMs would take over three times the dx GEMM's time
    g = torch.randn(8192, 1024, dtype=torch.bfloat16)
    weight = torch.randn(1024, 14336, dtype=torch.bfloat16)
    x = torch.randn(8192, 14336, dtype=torch.bfloat16)
    assert dx_beside_shrink_grad(g, weight, torch.randn(8192, 16), torch.randn(16, 14336), x, True) is None
    # and one whose GEMM variant failed its first launch (logged, off for the process): declined before the pass
    g, weight, x = torch.randn(8100, 8200, dtype=torch.bfloat16), torch.randn(8200, 2000, dtype=torch.bfloat16), \
        torch.randn(8100, 2000, dtype=torch.bfloat16)
    key = _gemm_rank_r_key(False, rank_r_width(16, True, 0, all_low_pieces=True), False)
    with mock.patch.object(_gluon, "_broken", {key}), \
            mock.patch.object(_shrink_grad_beside_gluon, "_launch_stream", side_effect=AssertionError("launched")):
        assert dx_beside_shrink_grad(g, weight, torch.randn(8100, 16), torch.randn(16, 2000), x, True) is None
    # and one whose tiles fill the SMs' waves: nothing free (H100 and H200 have 132 SMs)
    assert sm_count(torch.device("cuda")) == 132
    g, weight, x = torch.randn(33 * 128, 704, dtype=torch.bfloat16), torch.randn(704, 1024, dtype=torch.bfloat16), \
        torch.randn(33 * 128, 1024, dtype=torch.bfloat16)
    assert dx_beside_shrink_grad(g, weight, torch.randn(33 * 128, 16), torch.randn(16, 1024), x, True) is None


@pytest.mark.skipif(torch.cuda.get_device_capability()[0] != 9, reason="the Gluon GEMM runs on compute capability 9")
@pytest.mark.parametrize("m, k, n", [(100, 776, 520), (300, 776, 520), (4100, 8200, 1000)],
                         ids=["one_row_block", "one_wave", "many_tiles"])
@pytest.mark.parametrize("adapter_dtype, math, r", [(torch.float32, "exact", 16), (torch.float32, "exact", 5),
                                                     (torch.bfloat16, "exact", 64), (torch.float32, "fast", 24)],
                         ids=["pieces_r16", "pieces_r5", "bf16_r64", "fast_r24"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dA", "deterministic"])
def test_gluon_shrink_grad_picks_rows_exactly(m, k, n, adapter_dtype, math, r, deterministic, monkeypatch):
    # x = [I 0] makes dA = ds^T x equal ds^T in its first m columns and zero past them, bit for bit: each sum has
    # one nonzero term, and ds's three bf16 pieces add back to ds exactly (16-bit math: ds rounded to bf16). A wrong
    # piece, group, row half, row block or column shows. "one_row_block": one partial sum, stored even outside
    # deterministic algorithms.
    monkeypatch.setenv("LORAFUSE_ADAPTER_MATH", math)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: deterministic)
    g = torch.randn(m, n, dtype=torch.bfloat16)
    weight = (torch.randn(n, k) / n**0.5).bfloat16()
    A = (torch.randn(r, k) / k**0.5).to(adapter_dtype)
    ds = torch.randn(m, r)
    x = torch.eye(m, k, dtype=torch.bfloat16)
    pieces = uses_bf16_pieces(torch.bfloat16, adapter_dtype)
    assert shrink_grad_gemm_ready(g, weight, A, x, pieces)
    _, dA = dx_and_shrink_grad_gluon(g, weight, ds, A, x, pieces, sm_count(x.device))
    want = ds if pieces else ds.bfloat16().float()
    assert torch.equal(dA[:, :m], want.t()) and not dA[:, m:].any()


@pytest.mark.skipif(torch.cuda.get_device_capability()[0] != 9, reason="the Gluon GEMM runs on compute capability 9")
def test_shrink_grad_gemm_declines_what_it_cannot_take(monkeypatch):
    # L's columns past one K-step (float32 adapters above rank 16: four groups of pieces), fewer than three K-steps,
    # fp16 activations with float32 adapters (no 16-bit products), x at an offset TMA cannot read, and dA's partial
    # sums past MAX_PARTS_BYTES where deterministic algorithms keep them
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: False)
    g = torch.randn(300, 520, dtype=torch.bfloat16)
    weight = torch.randn(520, 776, dtype=torch.bfloat16)
    x = torch.randn(300, 776, dtype=torch.bfloat16)
    assert shrink_grad_gemm_ready(g, weight, torch.randn(16, 776), x, True)
    assert not shrink_grad_gemm_ready(g, weight, torch.randn(17, 776), x, True)
    assert shrink_grad_gemm_ready(g[:, :136], weight[:136], torch.randn(16, 776), x, True)
    assert not shrink_grad_gemm_ready(g[:, :128].contiguous(), weight[:128], torch.randn(16, 776), x, True)
    assert not shrink_grad_gemm_ready(g.half(), weight.half(), torch.randn(8, 776), x.half(), False)
    odd = torch.randn(300 * 776 + 1, dtype=torch.bfloat16)[1:].view(300, 776)
    assert not shrink_grad_gemm_ready(g, weight, torch.randn(8, 776, dtype=torch.bfloat16), odd, False)
    m, k, r = 8192, 16392, 64  # 64 row blocks x 64 x 16392 float32 partial sums: just past 256 MiB
    g, weight, x = (torch.empty(m, 256, dtype=torch.bfloat16), torch.empty(256, k, dtype=torch.bfloat16),
                    torch.empty(m, k, dtype=torch.bfloat16))
    A = torch.empty(r, k, dtype=torch.bfloat16)
    assert shrink_grad_gemm_ready(g, weight, A, x, False)  # atomics: dA itself
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert not shrink_grad_gemm_ready(g, weight, A, x, False)
    assert shrink_grad_gemm_ready(g, weight, A[:63], x, False)


def tma_gemm_operands(m, k, n, r, dtype, adapter_dtype, bias_dtype, forward):
    """(a, b, low, right, bias) for lora_matmul: forward b is W^T (a K-major view) and right lora_B^T, dx's b is W
    itself and right lora_A; bias_dtype None, "x" (x's dtype) or a dtype."""
    a = torch.randn(m, k, dtype=dtype)
    weight = (torch.randn(n, k) / k**0.5).to(dtype) if forward else (torch.randn(k, n) / k**0.5).to(dtype)
    right = ((torch.randn(n, r) / r**0.5).to(adapter_dtype).t() if forward
             else (torch.randn(r, n) / r**0.5).to(adapter_dtype))
    bias = None if bias_dtype is None else torch.randn(n).to(dtype if bias_dtype == "x" else bias_dtype)
    return a, weight.t() if forward else weight, torch.randn(m, r), right, bias


def check_tma_gemm(operands, dtype):
    """lora_matmul's TMA route on the operands against float64, bounded by PyTorch's own result in x's dtype."""
    a, b, low, right, bias = operands
    assert tma_ready(a, b)
    c, z = lora_matmul(a, b, low, right, SCALE, bias, tma=True)
    assert z is None
    exact = lora_matmul_reference(a, b, low, right, SCALE, bias, dtype=torch.float64)
    assert_close(c, exact, dtype, lora_matmul_reference(a, b, low, right, SCALE, bias), "C")


@pytest.mark.skipif(torch.cuda.get_device_capability()[0] < 9, reason="TMA needs compute capability >= 9")
@pytest.mark.parametrize("r", [5, 16])
@pytest.mark.parametrize("adapter_dtype", [torch.float32, torch.bfloat16], ids=["fp32_adapters", "bf16_adapters"])
@pytest.mark.parametrize("forward", [True, False], ids=["x_WT", "g_W"])
def test_triton_tma_gemm_at_its_default_tiles(r, adapter_dtype, forward, monkeypatch):
    monkeypatch.setattr(lora_matmul_module, "gluon_gemm_ready", lambda *args: False)
    # K not a multiple of the 64-wide K tile
    check_tma_gemm(tma_gemm_operands(4096, 520, 8192, r, torch.bfloat16, adapter_dtype, "x", forward), torch.bfloat16)


@pytest.mark.skipif(torch.cuda.get_device_capability()[0] != 9, reason="the Gluon GEMM runs on compute capability 9")
@pytest.mark.parametrize("m, k, n", [(300, 520, 776), (4096, 1000, 8192), (4096, 56, 8192)],
                         ids=["one_wave", "many_tiles", "one_k_step"])
@pytest.mark.parametrize("r", [1, 5, 16, 64])
@pytest.mark.parametrize("dtype, adapter_dtype, math", [(torch.bfloat16, torch.float32, "exact"),
                                                        (torch.bfloat16, torch.float32, "fast"),
                                                        (torch.bfloat16, torch.bfloat16, "exact"),
                                                        (torch.float16, torch.float16, "exact")],
                         ids=["bf16_fp32_adapters", "bf16_fp32_adapters_fast", "bf16", "fp16"])
@pytest.mark.parametrize("bias_dtype", [None, "x", torch.float32], ids=["no_bias", "bias", "fp32_bias"])
@pytest.mark.parametrize("forward", [True, False], ids=["x_WT", "g_W"])
def test_gluon_gemm_matches_float64(m, k, n, r, dtype, adapter_dtype, math, bias_dtype, forward, monkeypatch):
    # Odd edges: rows, K and columns not multiples of the 128 x 256 x 64 tiles. "many_tiles": each program walks
    # several tiles, and the next tile's loads overlap. "one_k_step": K within one step, so that the load warp runs a
    # whole tile ahead of the MMA warps (the ring holds all of a tile's steps). "fast": float32 adapters rounded to
    # bf16 (LORAFUSE_ADAPTER_MATH=fast), held to PyTorch's bf16 computation like bf16 ones.
    monkeypatch.setenv("LORAFUSE_ADAPTER_MATH", math)
    ran = record_launches(monkeypatch, lora_matmul_module, "lora_matmul_gluon", deterministic=False)
    check_tma_gemm(tma_gemm_operands(m, k, n, r, dtype, adapter_dtype, bias_dtype, forward), dtype)
    assert ran == [True]


@pytest.mark.skipif(torch.cuda.get_device_capability()[0] != 9, reason="the Gluon kernel runs on compute capability 9")
@pytest.mark.parametrize("m, n", [(200, 776), (300, 776), (4100, 8200)],
                         ids=["one_row_block", "small", "many_programs"])
@pytest.mark.parametrize("r", [8, 16, 24, 32, 64])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dB", "deterministic"])
def test_gluon_expand_backward_matches_float64(m, n, r, deterministic, monkeypatch):
    # ds = scale * dy B and dB = scale * dy^T s for float32 adapters on bf16 dy (PEFT's default); rows and columns
    # not multiples of the programs' 256 (or 128) x 64 tiles, several column splits (partial ds sums) and row blocks
    # (dB added with atomics, or partial sums under torch.use_deterministic_algorithms). "one_row_block": fewer than
    # 256 rows, one 128-row box (no box taller than dy).
    ran = record_launches(monkeypatch, lora_expand_module, "expand_backward_gluon", deterministic)
    dy = torch.randn(m, n, dtype=torch.bfloat16)
    s = torch.randn(m, r)
    B = torch.randn(n, r) / r**0.5
    g, ds, dB, dbias = lora_expand_backward(dy, None, s, B, SCALE)
    assert ran == [True] and g is dy and dbias is None
    exact = {"s": SCALE * dy.double() @ B.double(), "B": SCALE * dy.double().t() @ s.double()}
    plain = {"s": SCALE * dy.float() @ B, "B": SCALE * dy.float().t() @ s}  # PEFT's float32 adapter path
    for name, got in (("s", ds), ("B", dB)):
        assert got.dtype == torch.float32
        assert_close(got, exact[name], torch.float32, plain[name], name)


@pytest.mark.skipif(torch.cuda.get_device_capability()[0] != 9, reason="the Gluon kernels run on compute capability 9")
def test_gluon_passes_zero_their_atomic_sums(monkeypatch):
    # The Gluon pass over dy (ds, dB) and dropout's dA pass ask for the outputs their atomics add into unzeroed: the
    # launch that splits B or A into pieces zeroes them. NaN here, so a missed zero shows.
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: False)
    expand_calls = poison_unzeroed_sums(monkeypatch, importlib.import_module("lorafuse.ops._lora_expand_gluon"))
    shrink_calls = poison_unzeroed_sums(monkeypatch, importlib.import_module("lorafuse.ops._shrink_backward_gluon"))
    m, n, k, r, p = 4100, 8200, 776, 16, 0.1
    dy, s, B = torch.randn(m, n, dtype=torch.bfloat16), torch.randn(m, r), torch.randn(n, r) / r**0.5
    _, ds, dB, _ = lora_expand_backward(dy, None, s, B, SCALE)
    assert_close(ds, SCALE * dy.double() @ B.double(), torch.float32, SCALE * dy.float() @ B, "ds")
    assert_close(dB, SCALE * dy.double().t() @ s.double(), torch.float32, SCALE * dy.float().t() @ s, "dB")
    x, A, ds = torch.randn(m, k).to(torch.bfloat16), torch.randn(r, k) / k**0.5, torch.randn(m, r)
    dA = lora_shrink_backward(ds, x, A, p, seed_tensor(BIG_SEED), dx_out=poison(torch.empty_like(x)))
    factor = keep_mask_reference(BIG_SEED, m, k, p).double() * keep_scale(p)
    assert_close(dA, ds.double().t() @ (x.double() * factor), torch.bfloat16,
                 ds.t() @ (x.float() * factor.float()), "dA")
    assert expand_calls == [(True, False), (True, False)] and shrink_calls == [(True, False)]


# (x dtype, adapter dtype, LORAFUSE_ADAPTER_MATH): float32 adapters as bf16 pieces (PEFT's default), adapters in x's
# dtype, and float32 adapters rounded to x's dtype in-kernel
SHRINK_BACKWARD_MATH = [(torch.bfloat16, torch.float32, "exact"), (torch.bfloat16, torch.bfloat16, "exact"),
                        (torch.float16, torch.float16, "exact"), (torch.bfloat16, torch.float32, "fast")]


@pytest.mark.skipif(torch.cuda.get_device_capability()[0] != 9, reason="the Gluon kernel runs on compute capability 9")
@pytest.mark.parametrize("m, k", [(64, 136), (300, 776), (4100, 8200)], ids=["one_step", "small", "many_programs"])
@pytest.mark.parametrize("r", [8, 16, 24, 32])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dA", "deterministic"])
@pytest.mark.parametrize("dtype, adapter_dtype, math", SHRINK_BACKWARD_MATH,
                         ids=["pieces", "bf16_adapters", "fp16_adapters", "fast_math"])
def test_gluon_shrink_backward_matches_float64(m, k, r, deterministic, dtype, adapter_dtype, math, monkeypatch):
    # dA = ds^T (x * keep) * keep_scale and dx's term keep * keep_scale * (ds A) with dropout; rows and columns not
    # multiples of the 64 x 128 tiles, several row splits (dA added with atomics, or partial sums under
    # torch.use_deterministic_algorithms).
    ran = record_launches(monkeypatch, lora_shrink_module, "shrink_backward_gluon", deterministic)
    monkeypatch.setenv("LORAFUSE_ADAPTER_MATH", math)
    p = 0.1
    x = torch.randn(m, k).to(dtype)
    A = (torch.randn(r, k) / k**0.5).to(adapter_dtype)
    ds = torch.randn(m, r)
    dx = poison(torch.empty_like(x))
    dA = lora_shrink_backward(ds, x, A, p, seed_tensor(BIG_SEED), dx_out=dx)
    assert ran == [True] and dA.dtype == torch.float32 and dA.shape == A.shape
    factor = keep_mask_reference(BIG_SEED, m, k, p).double() * keep_scale(p)
    if adapter_dtype == torch.float32 and math == "exact":  # the bar is PEFT's float32 adapter path
        plain_dA, plain_dx = ds.t() @ (x.float() * factor.float()), ((ds @ A) * factor.float()).to(dtype)
    else:  # PyTorch in x's dtype: ds and A rounded to it, as the kernel does
        plain_dA = ds.to(dtype).t() @ (x * factor.to(dtype))
        plain_dx = (ds.to(dtype) @ A.to(dtype)) * factor.to(dtype)
    exact_dx = (ds.double() @ A.double()) * factor
    assert_close(dA, ds.double().t() @ (x.double() * factor), dtype, plain_dA, "dA")
    assert_close(dx, exact_dx, dtype, plain_dx, "dx")
    # the kernel's mask is the reference mask: dropped elements are exactly zero, and a kept one is zero only where
    # its 16-bit products cancel (2 of the 34M elements of the larger case at rank 16 with bf16 adapters)
    dropped = factor == 0
    assert torch.equal(dx[dropped], torch.zeros_like(dx[dropped]))
    assert (exact_dx[~dropped & (dx == 0)].abs() <= 0.05 * exact_dx.abs().mean()).all()
    # the same mask, products and roundings as the Triton kernel (config= keeps it): dx bit for bit
    dx_triton = poison(torch.empty_like(x))
    lora_shrink_backward(ds, x, A, p, seed_tensor(BIG_SEED), dx_out=dx_triton, config=(16, 256, 4, 3, 528))
    assert torch.equal(dx, dx_triton)


@pytest.mark.skipif(torch.cuda.get_device_capability()[0] != 9, reason="the Gluon kernel runs on compute capability 9")
def test_gluon_shrink_backward_copies_a_16_bit_A_at_an_odd_offset(monkeypatch):
    # A bf16 A viewed 2 bytes into its storage: TMA's descriptor needs a 16-byte aligned base, so the launcher copies
    # it (_gluon.tma_aligned); the kernel runs and gives the Triton kernel's dx bit for bit
    ran = record_launches(monkeypatch, lora_shrink_module, "shrink_backward_gluon", deterministic=False)
    m, k, r, p = 300, 776, 16, 0.1
    x = torch.randn(m, k).to(torch.bfloat16)
    A = (torch.randn(r * k + 1) / k**0.5).to(torch.bfloat16)[1:].view(r, k)
    ds = torch.randn(m, r)
    dx, dx_triton = poison(torch.empty_like(x)), poison(torch.empty_like(x))
    dA = lora_shrink_backward(ds, x, A, p, seed_tensor(BIG_SEED), dx_out=dx)
    assert A.data_ptr() % 16 != 0 and ran == [True]
    lora_shrink_backward(ds, x, A, p, seed_tensor(BIG_SEED), dx_out=dx_triton, config=(16, 256, 4, 3, 528))
    assert torch.equal(dx, dx_triton)
    factor = keep_mask_reference(BIG_SEED, m, k, p).double() * keep_scale(p)
    plain_dA = ds.to(torch.bfloat16).t() @ (x * factor.to(torch.bfloat16))
    assert_close(dA, ds.double().t() @ (x.double() * factor), torch.bfloat16, plain_dA, "dA")
