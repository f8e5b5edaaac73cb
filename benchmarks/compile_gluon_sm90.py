"""Compile every Gluon kernel of lorafuse/ops for an sm_90 GPU on a machine without one, and print what ptxas says of
each (and of the Triton kernels their launchers run): registers, spills, and whether it serialised the warpgroup MMAs
(C7512, C7514). A serialised kernel runs, and is correct, but each MMA then waits for the one before: the
twenty-first session's warp-specialised dx GEMM read 1.32x cuBLAS that way against 1.08
(benchmarks/NOTES_lora_layer.md).

    python benchmarks/compile_gluon_sm90.py [--out DIR]

Needs the GPU machines' Triton (3.6: its Gluon API is the one the kernels are written against) beside a CPU torch;
here, for instance, `python -m venv /tmp/t36 && /tmp/t36/bin/pip install torch==2.13.0 triton==3.6.0`. A stand-in
driver answers "sm_90" and each launcher's kernel launch becomes a compilation (`warmup`); the launchers run on CPU
tensors of the layer bench's 8192 x 4096 -> 4096 shape, r = 16, float32 and bf16 adapters: the variants the layer's
default routes compile there (not, for instance, the dx GEMM's partial sums of deterministic mode, nor a bias). PTX,
cubin and SASS of each go to DIR (default /tmp/gluon_sm90), emptied of an earlier run's first.
"""
import argparse
import os
import subprocess
import sys
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import jit

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Sm90Driver:
    """What Triton asks of its active driver to compile (not to launch) a kernel."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def compile_launches(compiled: list):
    """Turns each launch into a compilation whose kernel goes to `compiled` ((name, kernel)), and lets a Gluon
    launcher's failure raise instead of falling back."""
    launch = jit.JITFunction.run

    def compile_only(self, *args, grid, warmup=False, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    jit.JITFunction.run = compile_only
    from lorafuse.ops import (_gluon, _lora_expand_gluon, _lora_matmul_gluon, _shrink_backward_gluon,
                              _shrink_beside_gluon, _shrink_grad_beside_gluon, _shrink_matmul_gluon)

    def raise_on_failure(kernel, run):
        run()
        return True

    modules = (_lora_expand_gluon, _lora_matmul_gluon, _shrink_backward_gluon, _shrink_beside_gluon,
               _shrink_grad_beside_gluon, _shrink_matmul_gluon)
    for module in (_gluon,) + modules:
        module.launch_or_fall_back = raise_on_failure
    return modules


def launch_every_kernel(expand, matmul, shrink_backward, shrink_beside, shrink_grad_beside, shrink_matmul, sms=132):
    # each launcher on CPU tensors: what it launches is compiled, not run
    M, K, N, r = 8192, 4096, 4096, 16
    x, weight = torch.randn(M, K, dtype=torch.bfloat16), torch.randn(N, K, dtype=torch.bfloat16)
    dy, s, ds = torch.randn(M, N, dtype=torch.bfloat16), torch.randn(M, r), torch.randn(M, r)
    seed = torch.tensor([7], dtype=torch.int64)
    for adapter_dtype in (torch.float32, torch.bfloat16):
        pieces = adapter_dtype == torch.float32
        A, B = torch.randn(r, K, dtype=adapter_dtype), torch.randn(N, r, dtype=adapter_dtype)
        matmul.lora_matmul_gluon(x, weight.t(), s, B.t(), 2.0, None, pieces, sms)
        matmul.dx_and_shrink_grad_gluon(dy, weight, ds, A, x, pieces, sms)
        # dx_beside_shrink_grad's two launches (its checks need a Hopper: the launchers are called past them)
        left = torch.empty(M, matmul.rank_r_width(r, pieces, 0, all_low_pieces=pieces), dtype=torch.bfloat16)
        shrink_grad_beside._launch_stream(x, left, torch.empty(r, K), r, pieces, sms - 128)
        matmul.gemm_rank_r_packed(dy, weight, left, torch.empty(left.shape[1], K, dtype=torch.bfloat16),
                                  torch.empty_like(x), 128)
        for fixed_order in (False, True):
            shrink_matmul.shrink_matmul_gluon(x, weight, A, B, 2.0, None, sms, fixed_order=fixed_order)
        # the shrink beside the GEMM: its Hopper check passed here, and its stream taken wherever SMs are free
        with mock.patch.object(shrink_beside, "shrink_matmul_ready", lambda *args: True), \
                mock.patch.object(shrink_beside, "MAX_STREAM_SHARE", float("inf")):
            for bias in (None, torch.randn(N, dtype=torch.bfloat16)):
                assert shrink_beside.shrink_matmul_beside(x, weight, A, B, 2.0, bias) is not None
            assert shrink_beside.shrink_matmul_beside(x, weight, A, B, 2.0, None, 0.05, seed) is not None
        if pieces:
            expand.expand_backward_gluon(dy, s, B, 2.0, sms)
        shrink_backward.shrink_backward_gluon(ds, x, A, 0.05, seed, torch.empty_like(x), sms)


def report(compiled: list, out: str):
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    cuobjdump = os.path.join(os.path.dirname(ptxas), "cuobjdump")
    seen = set()
    for name, kernel in compiled:
        if kernel.hash in seen:
            continue
        seen.add(kernel.hash)
        stem = os.path.join(out, f"{name}_{kernel.hash[:8]}")
        with open(stem + ".ptx", "w") as f:
            f.write(kernel.asm["ptx"])
        with open(stem + ".cubin", "wb") as f:
            f.write(kernel.asm["cubin"])
        with open(stem + ".sass", "w") as f:
            f.write(subprocess.run([cuobjdump, "-sass", stem + ".cubin"], capture_output=True, text=True).stdout)
        said = subprocess.run([ptxas, "-arch=sm_90a", "-v", stem + ".ptx", "-o", os.devnull], capture_output=True,
                              text=True).stderr.splitlines()
        said = [line.split("info    :")[-1].strip() for line in said]
        usage = "; ".join(line for line in said if "registers" in line or "spill" in line)
        serialised = [line for line in said if "C751" in line]
        print(f"{name} ({kernel.hash[:8]}): {usage}")
        for line in serialised:
            print(f"    SERIALISED: {line}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/gluon_sm90")
    out = parser.parse_args().out
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(out):  # files are named by kernel hash: a run before must not mix into this one's
        if name.endswith((".ptx", ".cubin", ".sass")):
            os.remove(os.path.join(out, name))
    triton.runtime.driver.set_active(Sm90Driver())
    compiled = []
    launch_every_kernel(*compile_launches(compiled))
    report(compiled, out)


if __name__ == "__main__":
    main()
