"""kernel_launch.launch: a plan's launches equal kernel[grid]'s, keyed on everything Triton specialises on.

On CPU (Triton's interpreter) every call goes through kernel[grid] and nothing is cached. On a GPU
(LORAFUSE_TEST_DEVICE=cuda TRITON_INTERPRET=0): a misaligned view gets a kernel of its own, repeated calls skip
kernel[grid], launches land on the current stream (a CUDA-graph capture replays them), and launch hooks see every call.
"""
import pytest
import torch
import triton
import triton.language as tl

from lorafuse.ops.common.kernel_launch import _specialisation, launch
from lorafuse.ops.common.tiles import LaunchPlan

ON_GPU = torch.get_default_device().type == "cuda" and torch.cuda.is_available()
gpu_only = pytest.mark.skipif(not ON_GPU, reason="run with LORAFUSE_TEST_DEVICE=cuda TRITON_INTERPRET=0 on a GPU")
BLOCK = 128


@triton.jit
def _scaled_copy(x_ptr, y_ptr, n, alpha, BLOCK: tl.constexpr, NEGATE: tl.constexpr):
    # y[i] = alpha * x[i] (negated with NEGATE), i < n
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n).to(tl.float32)
    y = -alpha * x if NEGATE else alpha * x
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=offs < n)


def _plan(n, negate=False):
    return LaunchPlan((triton.cdiv(n, BLOCK),), (), dict(NEGATE=negate, BLOCK=BLOCK, num_warps=4))


def _copy(x, plan, alpha=1.5):
    y = torch.empty_like(x)
    launch(_scaled_copy, plan, x, y, x.numel(), alpha)
    return y


def test_specialisation_tells_apart_what_triton_specialises_on():
    base = torch.zeros(64, dtype=torch.float16, device="cpu")
    assert _specialisation(base) == (torch.float16, True)
    assert _specialisation(base[1:]) == (torch.float16, False)  # 2 bytes in: not 16-byte aligned
    assert _specialisation(base[8:]) == (torch.float16, True)
    assert _specialisation(base.float()) == (torch.float32, True)
    assert _specialisation(None) is None
    assert len({_specialisation(v) for v in (1, 16, 17, 32, 2 ** 40)}) == 4  # 16 and 32 alike
    assert _specialisation(True) is bool and _specialisation(0.5) is float
    with pytest.raises(TypeError, match="str"):
        _specialisation("x")


def test_launch_equals_the_reference_constexprs_after_the_arguments():
    x = torch.randn(300)
    plan = _plan(x.numel(), negate=True)
    torch.testing.assert_close(_copy(x, plan), -1.5 * x)
    torch.testing.assert_close(_copy(x, plan, alpha=0.25), -0.25 * x)  # a runtime float, not part of the key
    if not ON_GPU:
        assert plan.compiled == {}  # the interpreter: kernel[grid] every call


@gpu_only
def test_misaligned_view_gets_its_own_kernel_and_the_cache_skips_kernel_grid(monkeypatch):
    x = torch.randn(1025, dtype=torch.bfloat16)
    plan = _plan(1024)
    aligned, misaligned = x[:1024], x[1:]
    for view in (aligned, misaligned, aligned, misaligned):
        torch.testing.assert_close(_copy(view, plan), (1.5 * view.float()).to(view.dtype))
    assert len(plan.compiled) == 2
    calls = []
    getitem = type(_scaled_copy).__getitem__
    monkeypatch.setattr(type(_scaled_copy), "__getitem__", lambda self, grid: calls.append(grid) or getitem(self, grid))
    torch.testing.assert_close(_copy(misaligned, plan), (1.5 * misaligned.float()).to(x.dtype))
    assert calls == []


@gpu_only
def test_launches_land_on_the_current_stream_under_capture():
    x = torch.randn(1000)
    plan = _plan(x.numel())
    _copy(x, plan)  # compiled and cached outside the capture
    y = torch.empty_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        launch(_scaled_copy, plan, x, y, x.numel(), 2.0)
    torch.cuda.current_stream().wait_stream(stream)
    x.copy_(torch.arange(1000.0))
    y.zero_()
    graph.replay()
    torch.testing.assert_close(y, 2.0 * torch.arange(1000.0))


@gpu_only
def test_launch_hooks_see_every_call():
    x = torch.randn(256)
    plan = _plan(x.numel())
    _copy(x, plan)
    seen = []

    def hook(metadata):
        seen.append(metadata.get()["name"])

    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        _copy(x, plan)
        _copy(x, plan)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert seen == ["_scaled_copy", "_scaled_copy"]
