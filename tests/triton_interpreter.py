"""Triton's interpreter, made to compute bf16 as a GPU does (imported by tests/conftest.py).

Triton's interpreter (TRITON_INTERPRET=1, how the kernels run on CPU) does not support
bfloat16 arithmetic: it stores bf16 as uint16 bit patterns, so `tl.dot` of two bf16 tiles
multiplies the bit patterns (values ~1e10; triton-lang/triton#11584, "we just don't support
it yet"), and its fp32 -> bf16 cast truncates instead of rounding to nearest even (twice a
GPU's error). Both are patched to what the GPU does: bf16 dot operands widen exactly to fp32
(products exact, fp32 accumulation), fp32 -> bf16 rounds to nearest even. Without this no
bf16 kernel result on CPU means anything. Only the interpreter is touched; compiled GPU
kernels are unaffected.
"""
import numpy as np
import triton.language as tl
from triton.runtime import interpreter as _interp


def _bf16_as_f32(handle):
    # bf16 bits -> the same value in fp32 (exact: bf16 is the top half of an fp32)
    if handle.dtype == tl.bfloat16:
        return _interp.TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
    return handle


def _f32_to_bf16_bits(data):
    # round to nearest even, as the GPU's cvt.rn.bf16.f32; NaN stays NaN (quiet bit set)
    data = np.asarray(data, dtype=np.float32)
    bits = data.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(data), ((bits >> 16) | np.uint32(0x40)).astype(np.uint16), rounded)


_create_dot = _interp.InterpreterBuilder.create_dot
_cast_impl = _interp.InterpreterBuilder.cast_impl


def _patched_create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    return _create_dot(self, _bf16_as_f32(a), _bf16_as_f32(b), d, input_precision, max_num_imprecise_acc)


def _patched_cast_impl(self, src, dst_type):
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        return _interp.TensorHandle(_f32_to_bf16_bits(src.data), tl.bfloat16)
    return _cast_impl(self, src, dst_type)


_interp.InterpreterBuilder.create_dot = _patched_create_dot
_interp.InterpreterBuilder.cast_impl = _patched_cast_impl
