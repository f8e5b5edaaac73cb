"""Fixtures of the op tests: default switches, poisoned buffers.

(bf16 in Triton's interpreter is patched for the whole suite by tests/triton_interpreter.py.)
1. The environment switches of the ops (LORAFUSE_GEMM, LORAFUSE_ADAPTER_MATH) are cleared, so
   each test sees the defaults unless it sets one itself.
2. Every float buffer that a launcher allocates with torch.empty / torch.empty_like (outputs,
   per-split partial sums, dropout buffers) starts as NaN, so an element a kernel fails to
   write shows up as NaN, and NaN fails every check.
"""
import math

import pytest
import torch


_empty, _empty_like = torch.empty, torch.empty_like


def _poisoned(tensor):
    if tensor.is_floating_point() or tensor.is_complex():
        with torch.no_grad():
            tensor.fill_(math.nan)
    return tensor


@pytest.fixture(autouse=True)
def _default_environment(monkeypatch):
    for name in ("LORAFUSE_GEMM", "LORAFUSE_ADAPTER_MATH"):
        monkeypatch.delenv(name, raising=False)


def _empty_on_default_device(*args, **kwargs):
    # torch.set_default_device (the tests' GPU mode) recognises torch.empty by identity: this stand-in passes it on
    if kwargs.get("device") is None:
        kwargs["device"] = torch.get_default_device()
    return _empty(*args, **kwargs)


@pytest.fixture(autouse=True)
def _poison_empty(monkeypatch):
    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: _poisoned(_empty_on_default_device(*args, **kwargs)))
    monkeypatch.setattr(torch, "empty_like", lambda *args, **kwargs: _poisoned(_empty_like(*args, **kwargs)))
