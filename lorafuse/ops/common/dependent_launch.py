"""Programmatic dependent launch (PDL) for the decode step's chain of small kernels.

A decode step is ~160 launches in a row, most of them a few microseconds long, each reading what the one before it
wrote. Launched normally, a kernel's programs start only after the previous kernel has finished and its writes are
flushed, so every launch adds the GPU's launch latency to the step. With PDL (CUDA, compute capability >= 9) a
kernel may be launched while the previous one still runs: its programs start, then wait (`griddepcontrol.wait`)
until the previous kernel has completed and its writes are visible. This shortens the decode step by hiding part
of each launch's latency (benchmarks/bench_decode.py times the step; rows in benchmarks/results/decode.csv).

Rules for a kernel launched this way (`launch_options`, `wait_for_inputs`):
- before the wait it reads only what no kernel of the step writes: an adapter's lora_B (`lora_columns.lora_b_rows`),
  so that the latency of those loads overlaps the previous kernel; everything else comes after the wait;
- right after the wait it lets the next kernel launch (`gdc_launch_dependents`), not before: a chain of kernels
  that each launched the next before waiting would fill the SMs with programs that only wait;
- the wait covers every earlier kernel, not only the previous one: that one waited too before it finished.
Kernels are launched so only inside `dependent_launches()`, which the engine holds while it warms up and captures
its decode steps (warm-up and capture alike, so that Triton compiles each kernel once, not once per launch mode):
there the kernel before each one is a kernel of the same step, never one that writes an adapter (a swap copies into
lora_B between steps). Everywhere else (eager calls, other graphs), where anything may come right before, kernels
launch the usual way. The switch is per thread and per task (a context variable). LORAFUSE_PDL=0 turns it off (for
A/B timing and for bisecting).
"""
import contextlib
import contextvars
import functools
import os

import torch
import triton
import triton.language as tl


@functools.cache
def _supported(device: torch.device) -> bool:
    return (device.type == "cuda" and torch.version.hip is None
            and torch.cuda.get_device_capability(device)[0] >= 9)


_inside = contextvars.ContextVar("lorafuse_dependent_launches", default=False)


@contextlib.contextmanager
def dependent_launches():
    """Launches inside (this thread or task) are dependent ones (see the top: only for runs of steps whose every
    kernel is one this module's rules hold for)."""
    token = _inside.set(True)
    try:
        yield
    finally:
        _inside.reset(token)


def dependent_launch(device: torch.device) -> bool:
    """Whether kernels on `device` are launched now as dependents of the kernel before them (see the top)."""
    return _inside.get() and os.environ.get("LORAFUSE_PDL", "1") != "0" and _supported(device)


def launch_options(device: torch.device) -> dict:
    """The keyword arguments of a kernel launch, with `PDL` the kernel's constexpr flag for `wait_for_inputs`."""
    pdl = dependent_launch(device)
    return {"PDL": pdl, "launch_pdl": pdl}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Waits for the kernels before this one, then lets the next one launch (see the top). Nothing without PDL
    (and so under the CPU interpreter, which has no such instruction)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
