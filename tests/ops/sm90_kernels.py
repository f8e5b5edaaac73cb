"""Compiles the training step's Triton kernels for sm_90 (Hopper) with the installed Triton, without a GPU.

Run as `python -m tests.ops.sm90_kernels` with TRITON_INTERPRET unset (test_sm90_compile.py does): the launchers run
on small CPU tensors with `launch` (and the loss's kernel) replaced by a recorder, so each kernel is compiled with
the arguments, constexprs and options its launcher really passes: the LoRA passes (16-bit and float32 adapters, with
and without dropout, whose mask uses inline PTX that Triton's interpreter never sees), RMSNorm, SwiGLU, RoPE and the
cross-entropy rows. Prints one JSON line: {kernel variant: size of its cubin}.
"""
import json
import os

import torch

assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "run without TRITON_INTERPRET: it compiles, not interprets"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from lorafuse.ops.lora import expand, shrink  # noqa: E402
from lorafuse.ops.model import linear_cross_entropy, rms_norm, rope, silu_mul  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
POINTEE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
           torch.int32: "i32"}
recorded = []


def record(kernel, plan, *args):
    recorded.append((kernel, args, plan.constants))


class _Recorder:
    """Stands in for a kernel launched as kernel[grid](*args, **constants)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **constants: recorded.append((self.kernel, args, constants))


def compile_for_hopper(kernel, args, constants):
    # args: the runtime arguments in parameter order; constants: constexprs by name and launch options
    signature, constexprs = {}, {}
    for name, arg in zip(kernel.arg_names, args):
        if arg is None:
            signature[name], constexprs[name] = "constexpr", None
        elif isinstance(arg, torch.Tensor):
            signature[name] = "*" + POINTEE[arg.dtype]
        elif isinstance(arg, bool):
            signature[name] = "i1"
        elif isinstance(arg, int):
            signature[name] = "i32" if -(1 << 31) <= arg < 1 << 31 else "i64"
        else:
            signature[name] = "fp32"
    for name in kernel.arg_names[len(args):]:
        signature[name], constexprs[name] = "constexpr", constants[name]
    options = {k: v for k, v in constants.items() if k not in kernel.arg_names}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=HOPPER, options=options)
    return len(compiled.asm["cubin"])


def run_launchers():
    seed = torch.tensor([1234], dtype=torch.int64)
    x = torch.randn(256, 192, dtype=torch.bfloat16)
    for a_dtype in (torch.bfloat16, torch.float32):
        A, B = torch.randn(16, 192, dtype=a_dtype), torch.randn(320, 16, dtype=a_dtype)
        for p in (0.0, 0.1):
            s = shrink.lora_shrink(x, A, p, seed if p else None)
            dy = torch.randn(256, 320, dtype=torch.bfloat16)
            expand.lora_expand(None, s, B, 0.5, out=torch.empty(256, 320, dtype=torch.bfloat16))
            g, ds, _, _ = expand.lora_expand_backward(dy, None, s, B, 0.5)
            shrink.lora_shrink_backward(ds, x, A, p, seed if p else None, dx_out=torch.empty_like(x))
    z = torch.randn(256, 320, dtype=torch.bfloat16)
    expand.lora_expand(z, s, B, 0.5, torch.randn(320, dtype=torch.bfloat16), activation_id=4, store_z=True)
    expand.lora_expand_backward(z, z, s, B, 0.5, activation_id=4, need_dbias=True)
    w = torch.randn(192, dtype=torch.bfloat16)
    y, rstd = rms_norm._forward(x, w, 1e-5, store_rstd=True)
    rms_norm._backward(x, w, torch.ones(256), x, need_dw=True)
    silu_mul._forward(x, x)
    silu_mul._backward(x, x, x)
    q, k = torch.randn(2, 4, 64, 64, dtype=torch.bfloat16), torch.randn(2, 2, 64, 64, dtype=torch.bfloat16)
    cos = torch.randn(1, 64, 64, dtype=torch.bfloat16)
    for backward in (False, True):
        rope._launch(q, k, cos, cos, torch.bfloat16, backward)
    linear_cross_entropy._launch_rows(torch.randn(8, 1000, dtype=torch.bfloat16), torch.randint(0, 1000, (8,)),
                                      torch.empty(8), torch.ones(1), -100, None, write_grad=True)


def main():
    for module in (shrink, expand, rms_norm, silu_mul, rope):
        module.launch = record
    linear_cross_entropy._cross_entropy_rows = _Recorder(linear_cross_entropy._cross_entropy_rows)
    run_launchers()
    sizes = {}
    for kernel, args, constants in recorded:
        key = f"{kernel.__name__}{sorted((k, str(v)) for k, v in constants.items())}"
        if key not in sizes:
            sizes[key] = compile_for_hopper(kernel, args, constants)
    print(json.dumps(sizes))


if __name__ == "__main__":
    main()
