"""Where does the host time of a fused LoRA call go? Wall time per eager call (the GPU work is a few microseconds,
so the host sets the pace) of a bare torch launch, a bare Triton launch, the op and PEFT's layer, then cProfile of
the fused layer's call.

    python benchmarks/profile_host.py [--calls 2000] [--rows 1]

Layer: 4096 -> 4096, r=16, bf16, eval (no dropout), under torch.no_grad (decoding) and, with --train, forward +
backward at the given rows. Prints a table and the 25 functions with the most own time.
"""
import argparse
import cProfile
import copy
import os
import pstats
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lorafuse  # noqa: E402
from benchmarks.bench_lora_layer import peft_model  # noqa: E402
from lorafuse.ops import lora_linear  # noqa: E402


@triton.jit
def _touch(ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(ptr + offs, 1.0, mask=offs < n)


def us_per_call(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--train", action="store_true")
    args = parser.parse_args()
    k = n = 4096
    peft = peft_model(k, n, 0.0, torch.bfloat16).eval()
    fused = lorafuse.fuse(copy.deepcopy(peft))
    fused_bf16 = copy.deepcopy(fused).to(torch.bfloat16)
    layer = fused.base_model.model.proj
    base = layer.base_layer
    x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16, requires_grad=args.train)
    small = torch.empty(64, device="cuda")
    w, a, b = base.weight, layer.lora_A["default"].weight, layer.lora_B["default"].weight
    a16, b16 = a.detach().bfloat16(), b.detach().bfloat16()
    cases = {
        "torch: x.add_(1) (one launch)": lambda: small.add_(1),
        "triton: a 3-argument kernel": lambda: _touch[(1,)](small, 64, BLOCK=64),
        "base nn.Linear": lambda: base(x),
        "peft LoRA Linear": lambda: peft(x),
        "lorafuse.ops.lora_linear (fp32 adapters)": lambda: lora_linear(x, w, None, a, b, 2.0),
        "lorafuse.ops.lora_linear (bf16 adapters)": lambda: lora_linear(x, w, None, a16, b16, 2.0),
        "fused PeftModel (fp32 adapters)": lambda: fused(x),
        "fused PeftModel (bf16 adapters)": lambda: fused_bf16(x),
    }
    grad = torch.enable_grad() if args.train else torch.no_grad()
    print(f"rows {args.rows}, {'forward + backward' if args.train else 'forward, no_grad'}; us per eager call")
    with grad:
        for name, fn in cases.items():
            call = (lambda fn=fn: fn().sum().backward()) if args.train and "add_" not in name and "kernel" not in name \
                else fn
            print(f"  {us_per_call(call, args.calls):8.1f}  {name}")
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            fused(x) if not args.train else fused(x).sum().backward()
        torch.cuda.synchronize()
        profile.disable()
    print(f"\ncProfile of {args.calls} calls of the fused PeftModel (fp32 adapters), by own time:")
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
