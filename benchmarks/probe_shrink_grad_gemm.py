"""Probe: the layer's backward without dropout with dA made by the dx GEMM (two more steps a tile:
ops/_lora_matmul_gluon.py's _gemm_dx_and_shrink_grad), against the route it replaces (lora_shrink_backward's pass
over x, then lora_matmul's Gluon GEMM with the rank-r K-step) and cuBLAS's g @ W alone. `fused` adds the row blocks'
parts of dA with float32 atomics; under deterministic algorithms (`_fixed_order`: recorded under
torch.use_deterministic_algorithms(True)) both routes store their parts for a sum in order. `beside`: the route the
layer takes where the dx GEMM's last wave leaves SMs free (ops/_shrink_grad_beside_gluon.py): the GEMM on fewer
programs in as many waves, dA streamed on the free SMs at the same time (no atomics: the same bits every run).

    python benchmarks/probe_shrink_grad_gemm.py [--rounds 30] [--out DIR]

8192 rows, the layer bench's four shapes, r = 16, float32 adapters (bf16 pieces) and bf16 ones. Each call includes
its packing launch. Outputs are checked against float64 first (the relative error of dA goes to the rows; dx's,
bf16's rounding in every route, is printed); then CUDA graphs alternate call by call
(benchmarks.common.time_alternating). Rows: <out>/shrink_grad_gemm.csv (DESIGN.md's schema; bench
`shrink_grad_gemm`, ratio to cuBLAS).
"""
import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import adapter_probe, capture, probe_args, time_alternating  # noqa: E402

from lorafuse.ops._bf16_pieces import uses_bf16_pieces  # noqa: E402
from lorafuse.ops._lora_matmul_gluon import dx_and_shrink_grad_gluon, shrink_grad_gemm_ready  # noqa: E402
from lorafuse.ops._shrink_grad_beside_gluon import dx_beside_shrink_grad  # noqa: E402
from lorafuse.ops._tiles import sm_count  # noqa: E402
from lorafuse.ops.lora_matmul import lora_matmul  # noqa: E402
from lorafuse.ops.lora_shrink import lora_shrink_backward  # noqa: E402

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (2048, 8192)]  # (in, out) features of the base linear
ROWS, RANK = 8192, 16


def separate(g, weight, ds, lora_A, x):
    dA = lora_shrink_backward(ds, x, lora_A)
    return lora_matmul(g, weight, ds, lora_A, 1.0, tma=True)[0], dA


def fused(g, weight, ds, lora_A, x):
    return dx_and_shrink_grad_gluon(g, weight, ds, lora_A, x, uses_bf16_pieces(x.dtype, lora_A.dtype),
                                    sm_count(x.device))


def beside(g, weight, ds, lora_A, x):
    return dx_beside_shrink_grad(g, weight, ds, lora_A, x, uses_bf16_pieces(x.dtype, lora_A.dtype))


def separate_fixed_order(g, weight, ds, lora_A, x):
    with deterministic_algorithms():
        return separate(g, weight, ds, lora_A, x)


def fused_fixed_order(g, weight, ds, lora_A, x):
    with deterministic_algorithms():
        return fused(g, weight, ds, lora_A, x)


@contextlib.contextmanager
def deterministic_algorithms():
    """torch.use_deterministic_algorithms(True) inside the block (the kernels that a CUDA graph records)."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def rel_err(got, exact):
    return ((got.double() - exact).norm() / exact.norm()).item()


def probe_case(k_in, n_out, adapter_dtype, rounds):
    """({provider: (median, p20, p80) ms}, {provider: relative error of dA to float64})."""
    # two sets of g and x (2 x 64+ MB each): every call reads its operands from memory, as in the layer
    gs = [torch.randn(ROWS, n_out, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    xs = [torch.randn(ROWS, k_in, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    weight = (torch.randn(n_out, k_in, device="cuda") / k_in**0.5).bfloat16()
    lora_A = (torch.randn(RANK, k_in, device="cuda") / k_in**0.5).to(adapter_dtype)
    ds = torch.randn(ROWS, RANK, device="cuda")
    assert shrink_grad_gemm_ready(gs[0], weight, lora_A, xs[0], uses_bf16_pieces(torch.bfloat16, adapter_dtype))
    dx_exact = gs[0].double() @ weight.double() + ds.double() @ lora_A.double()
    dA_exact = ds.double().t() @ xs[0].double()
    errors, dx_errors = {}, {}
    providers = {"separate": separate, "fused": fused, "beside": beside, "separate_fixed_order": separate_fixed_order,
                 "fused_fixed_order": fused_fixed_order}
    for name, fn in providers.items():
        dx, dA = fn(gs[0], weight, ds, lora_A, xs[0])
        errors[name], dx_errors[name] = rel_err(dA, dA_exact), rel_err(dx, dx_exact)
    print(f"in {k_in}, out {n_out}, {adapter_dtype}: relative error of dx {dx_errors}", flush=True)
    calls = {"cublas": lambda: [g @ weight for g in gs]}
    for name, fn in providers.items():
        calls[name] = lambda fn=fn: [fn(g, weight, ds, lora_A, x) for g, x in zip(gs, xs)]
    times = time_alternating({key: capture(fn)[0].replay for key, fn in calls.items()}, rounds=rounds, warmup=5)
    return {key: tuple(t / len(gs) for t in value) for key, value in times.items()}, errors


def main():
    table = adapter_probe("shrink_grad_gemm", "bwd_graph", probe_case, SHAPES, ROWS, RANK, probe_args(__doc__),
                          metric="dA_rel_err_fp64")
    print("\nratio to cuBLAS's g @ W alone (graph-replayed, alternating); error: dA's largest relative error to "
          "float64")
    print(f"{'shape':42s} {'cuBLAS us':>9s} {'separate':>9s} {'fused':>9s} {'beside':>9s} {'sep fixed':>9s} "
          f"{'fus fixed':>9s} {'error':>8s}")
    for shape, floor, ratios, errors in table:
        print(f"{shape:42s} {floor * 1000:9.1f} {ratios['separate']:9.3f} {ratios['fused']:9.3f} "
              f"{ratios['beside']:9.3f} {ratios['separate_fixed_order']:9.3f} {ratios['fused_fixed_order']:9.3f} "
              f"{max(errors.values()):8.1e}")


if __name__ == "__main__":
    main()
