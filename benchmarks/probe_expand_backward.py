"""Probe: lora_expand_backward's kernels on the layer's dy sizes (identity activation, no dbias).

    python benchmarks/probe_expand_backward.py [--rounds 30] [--out DIR]

One pass over dy [8192, N] gives ds = scale * dy B and dB = scale * dy^T s. Providers, each the whole call (kernel,
B's pieces, reductions):
  triton           the Triton kernel, dB's row-block shares added with float32 atomics (the default)
  triton_partials  the same kernel writing partial sums that torch reduces (torch.use_deterministic_algorithms)
  gluon            the Gluon kernel (Hopper, float32 adapters as bf16 pieces), atomics
  gluon_partials   the same with partial sums
  gluon_rows128    the Gluon kernel on 128-row programs, its grid sized for three an SM: the config before 26b5add's
                   256-row programs (twice gluon's dB atomics; ranks <= 32), with today's column splits (rounded down)
float32 adapters (PEFT's default) at ranks 16, 32, 64, and bf16 ones at rank 16 (no Gluon kernel: the Triton one is
as fast there). Outputs are checked against float64 first; CUDA graphs alternate call by call. Rows:
<out>/expand_backward.csv (bench `expand_backward`, ratio to `triton_partials`, metric: read floor of dy in us at the
copy bandwidth measured in the run).
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (capture, environment, probe_args, time_alternating, timing_rows,  # noqa: E402
                               write_rows)

from lorafuse.ops._lora_expand_gluon import expand_backward_gluon  # noqa: E402
from lorafuse.ops._tiles import sm_count  # noqa: E402
from lorafuse.ops.lora_expand import _expand_backward_config, lora_expand_backward  # noqa: E402

ROWS, SCALE = 8192, 2.0
WIDTHS = (4096, 8192, 14336)
CASES = ((16, torch.float32), (32, torch.float32), (64, torch.float32), (16, torch.bfloat16))  # (rank, adapters)


def deterministic(fn):
    """fn run under torch.use_deterministic_algorithms(True): the kernels keep partial sums."""
    def call():
        torch.use_deterministic_algorithms(True)
        try:
            return fn()
        finally:
            torch.use_deterministic_algorithms(False)
    return call


def copy_bandwidth(nbytes):
    """GB/s of a device-to-device copy of nbytes (read and write), graph-replayed."""
    src = torch.empty(nbytes, device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)
    median = time_alternating({"copy": capture(lambda: dst.copy_(src))[0].replay}, rounds=20, warmup=5)["copy"][0]
    return 2 * nbytes / median / 1e6


def probe_case(n, r, adapter_dtype, rounds):
    """{provider: (median, p20, p80) ms}, largest relative error of (ds, dB) to float64 over the providers."""
    torch.manual_seed(0)
    dy = torch.randn(ROWS, n, device="cuda", dtype=torch.bfloat16)
    s = torch.randn(ROWS, r, device="cuda")
    B = (torch.randn(n, r, device="cuda") / r**0.5).to(adapter_dtype)
    config = _expand_backward_config(ROWS, n, False, sm_count(dy.device))  # a config keeps the Triton kernel
    calls = {"triton": lambda: lora_expand_backward(dy, None, s, B, SCALE, config=config)[1:3]}
    calls["triton_partials"] = deterministic(calls["triton"])
    if adapter_dtype == torch.float32:
        calls["gluon"] = lambda: expand_backward_gluon(dy, s, B, SCALE, sm_count(dy.device))
        calls["gluon_partials"] = deterministic(calls["gluon"])
        if r <= 32:
            calls["gluon_rows128"] = lambda: expand_backward_gluon(dy, s, B, SCALE, sm_count(dy.device),
                                                                   config=(128, True, 3, 3))
    exact = (SCALE * dy.double() @ B.double(), SCALE * dy.double().t() @ s.double())
    error = max(((got.double() - want).norm() / want.norm()).item()
                for fn in calls.values() for got, want in zip(fn(), exact))
    return time_alternating({key: capture(fn)[0].replay for key, fn in calls.items()}, rounds=rounds, warmup=5), error


def main():
    args = probe_args(__doc__)
    tags, rows = environment(), []
    gbps = copy_bandwidth(ROWS * max(WIDTHS) * 2)
    keys = ("triton_partials", "triton", "gluon_partials", "gluon", "gluon_rows128")
    print(f"copy {gbps:.0f} GB/s; us per call, graph-replayed, alternating")
    print(f"{'dy':>12s} {'r':>3s} {'adapters':>8s} " + " ".join(f"{k:>15s}" for k in keys) + "  floor    error")
    for n in WIDTHS:
        floor_us = ROWS * n * 2 / gbps / 1e3
        for r, adapter_dtype in CASES:
            times, error = probe_case(n, r, adapter_dtype, args.rounds)
            rows += timing_rows(tags, "expand_backward", f"M{ROWS}_N{n}_r{r}_{str(adapter_dtype)[6:]}", "bwd_graph",
                                times, "triton_partials", "dy_read_floor_us", dict.fromkeys(times, floor_us))
            cells = [f"{times[k][0] * 1e3:15.1f}" if k in times else f"{'-':>15s}" for k in keys]
            print(f"{ROWS:5d} x {n:5d} {r:3d} {str(adapter_dtype)[6:]:>8s} " + " ".join(cells)
                  + f" {floor_us:6.1f}  {error:.1e}", flush=True)
    write_rows(rows, "expand_backward", [args.out])


if __name__ == "__main__":
    main()
