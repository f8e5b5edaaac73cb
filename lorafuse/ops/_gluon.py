"""Gluon, Triton's lower-level language, for the Hopper kernels that need a hand-written pipeline
(_lora_matmul_gluon.py, _lora_expand_gluon.py): its imports, and where those kernels may run.

Gluon's API is experimental and has changed between Triton releases; the kernels are written and tested against
Triton 3.6 (the GPU machines') and use names that 3.9 (this project's CPU pin) still has. Triton's interpreter does
not run them: the CPU tests cover the Triton kernels beside them."""
import functools

import torch
import triton

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                 warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - Triton without Gluon's Hopper API: the Triton kernels run
    gluon = gl = fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = TensorDescriptor = None

TESTED_FROM = (3, 6)


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


@functools.cache
def _hopper(device: torch.device) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(device)[0] == 9


def runs_gluon_hopper(t: torch.Tensor) -> bool:
    """Whether the Gluon kernels can take tensors like t: on a compute capability 9.x GPU (warpgroup MMAs, which
    Blackwell does not have), with a Triton whose Gluon they were tested against."""
    return (gluon is not None and t.is_cuda and _version(triton.__version__) >= TESTED_FROM and _hopper(t.device))
