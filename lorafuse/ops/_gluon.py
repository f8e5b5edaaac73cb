"""Gluon, Triton's lower-level language, for the Hopper kernels that need a hand-written pipeline or their own
register layouts (_lora_matmul_gluon.py, _shrink_matmul_gluon.py, _lora_expand_gluon.py, _shrink_backward_gluon.py,
_shrink_grad_beside_gluon.py, _shrink_beside_gluon.py): its imports, where those kernels may run, their rings'
barriers, and the proxy fence of kernels that run beside each other.

Gluon's API is experimental and has changed between Triton releases; the kernels are written and tested against
Triton 3.6 (the GPU machines'). Triton 3.9 (this project's CPU pin) renamed the TMA copies they call
(tma.async_copy_global_to_shared -> async_load, async_copy_shared_to_global -> async_store) and dropped
shared_memory_descriptor._reinterpret: there each Gluon kernel fails its first launch and its Triton counterpart runs
(launch_or_fall_back, logged once). Triton's interpreter does not run them: the CPU tests cover the Triton kernels
beside them."""
import functools

import torch
import triton

from .._logging import log_once

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


def tma_aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it where its data does not start on a 16-byte boundary (a view of an odd offset): TMA reads
    from 16-byte aligned addresses."""
    return t.clone() if t.data_ptr() % 16 else t


_working: set[str] = set()
_broken: set[str] = set()


def launch_or_fall_back(kernel: str, launch) -> bool:
    """Runs launch() (a launch of the Gluon kernel `kernel`) and says whether it ran. If it failed before the kernel
    ever ran (its compilation on a Triton whose Gluon changed, say), the reason is logged once and the kernel is off
    for the process: the caller runs its Triton counterpart. Once the kernel has run, its errors propagate."""
    if failed(kernel):
        return False
    if kernel in _working:
        launch()
        return True
    try:
        launch()
    except Exception as error:  # noqa: BLE001 - any failure of a first launch: the Triton kernels still work
        _broken.add(kernel)
        log_once(f"lorafuse: the Gluon kernel {kernel} failed on Triton {triton.__version__} "
                 f"({type(error).__name__}: {str(error)[:200]}); its Triton counterpart runs instead")
        return False
    _working.add(kernel)
    return True


def failed(kernel: str) -> bool:
    """Whether the Gluon kernel `kernel` (launch_or_fall_back's key) failed its first launch: it is off."""
    return kernel in _broken


if gluon is not None:
    @gluon.jit
    def ready_barriers(buffers: gl.constexpr):
        # one mbarrier per ring slot, in shared memory, with one arrival a phase: TMA's loads of the slot (`ready`), or
        # the warps that release it (a warp-specialised kernel's `empty`)
        ready = gl.allocate_shared_memory(gl.int64, [buffers, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(buffers):
            mbarrier.init(ready.index(i), count=1)
        return ready

    @gluon.jit
    def fence_proxy_async_global():
        # Orders this thread's global memory accesses through the generic proxy (plain loads, stores, atomics)
        # against those through the async proxy (TMA): needed where rows one kernel stores with plain stores are
        # read by another kernel's TMA while both run (_shrink_beside_gluon.py)
        gl.inline_asm_elementwise("fence.proxy.async.global;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
else:  # pragma: no cover - no Gluon: its kernels are not defined either
    ready_barriers = fence_proxy_async_global = None
