"""Probe: the layer's forward without dropout with the shrink inside the GEMM (ops/_shrink_matmul_gluon.py), against
the route it replaces (lora_shrink, then lora_matmul's Gluon GEMM with the rank-r K-steps) and cuBLAS's GEMM alone;
`fixed_order` is the fused kernel summing s's parts in a fixed order (inference, deterministic algorithms);
`beside` the shrink streamed on the SMs that the GEMM's last wave leaves free (ops/_shrink_beside_gluon.py), its gate
opened so that it runs at every shape (the rows set the gate, MAX_STREAM_SHARE). The `_dropout` providers draw a
dropout mask of p = 0.05 in their shrink: `separate_dropout` lora_shrink's masked pass before the GEMM, `beside_dropout`
the masked stream.

    python benchmarks/probe_shrink_matmul.py [--rounds 30] [--out DIR]

8192 rows, the layer bench's four shapes, r = 16, float32 adapters (bf16 pieces) and bf16 ones, no bias. Each call
includes its packing launches. Outputs are checked against float64 first (largest relative error of y and s, the
dropout providers' s against the masked x's); then
CUDA graphs alternate call by call (benchmarks.common.time_alternating). Rows: <out>/shrink_matmul.csv (DESIGN.md's
schema; bench `shrink_matmul`, ratio to cuBLAS).
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import adapter_probe, capture, probe_args, time_alternating  # noqa: E402

from lorafuse.ops import _shrink_beside_gluon  # noqa: E402
from lorafuse.ops._shrink_matmul_gluon import shrink_matmul_gluon, shrink_matmul_ready  # noqa: E402
from lorafuse.ops._tiles import sm_count  # noqa: E402
from lorafuse.ops.dropout import keep_mask_reference, keep_scale  # noqa: E402
from lorafuse.ops.lora_matmul import lora_matmul, lora_matmul_reference  # noqa: E402
from lorafuse.ops.lora_shrink import lora_shrink  # noqa: E402

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (2048, 8192)]  # (in, out) features of the base linear
ROWS, RANK, SCALE = 8192, 16, 2.0
DROPOUT, SEED = 0.05, 1234


def separate(x, weight, lora_A, lora_B):
    s = lora_shrink(x, lora_A)
    return lora_matmul(x, weight.t(), s, lora_B.t(), SCALE, tma=True)[0], s


def fused(x, weight, lora_A, lora_B):
    return shrink_matmul_gluon(x, weight, lora_A, lora_B, SCALE, None, sm_count(x.device))


def fused_fixed_order(x, weight, lora_A, lora_B):
    return shrink_matmul_gluon(x, weight, lora_A, lora_B, SCALE, None, sm_count(x.device), fixed_order=True)


def beside(x, weight, lora_A, lora_B):
    return _shrink_beside_gluon.shrink_matmul_beside(x, weight, lora_A, lora_B, SCALE, None)


def separate_dropout(x, weight, lora_A, lora_B, seed):
    s = lora_shrink(x, lora_A, DROPOUT, seed)
    return lora_matmul(x, weight.t(), s, lora_B.t(), SCALE, tma=True)[0], s


def beside_dropout(x, weight, lora_A, lora_B, seed):
    # its gate is the head's size (head_row_blocks), not MAX_STREAM_SHARE
    result = _shrink_beside_gluon.shrink_matmul_beside(x, weight, lora_A, lora_B, SCALE, None, DROPOUT, seed)
    assert result is not None, "the masked route declined this shape: too few row blocks left to stream"
    return result


def rel_err(got, exact):
    return ((got.double() - exact).norm() / exact.norm()).item()


def probe_case(k_in, n_out, adapter_dtype, rounds):
    """({provider: (median, p20, p80) ms}, {provider: largest relative error of y and s to float64})."""
    xs = [torch.randn(ROWS, k_in, device="cuda", dtype=torch.bfloat16) for _ in range(2)]  # 2 x 64+ MB: past L2
    weight = (torch.randn(n_out, k_in, device="cuda") / k_in**0.5).bfloat16()
    lora_A = (torch.randn(RANK, k_in, device="cuda") / k_in**0.5).to(adapter_dtype)
    lora_B = torch.randn(n_out, RANK, device="cuda").to(adapter_dtype)
    assert shrink_matmul_ready(xs[0], weight, lora_A, lora_B, None)
    s_exact = xs[0].double() @ lora_A.double().t()
    y_exact = lora_matmul_reference(xs[0], weight.t(), s_exact, lora_B.t(), SCALE, dtype=torch.float64)
    seed = torch.tensor([SEED], device="cuda")
    s_masked = (xs[0].double() * keep_mask_reference(SEED, ROWS, k_in, DROPOUT, "cuda") * keep_scale(DROPOUT)) @ \
        lora_A.double().t()
    y_masked = lora_matmul_reference(xs[0], weight.t(), s_masked, lora_B.t(), SCALE, dtype=torch.float64)
    errors = {}
    providers = {"separate": separate, "fused": fused, "fixed_order": fused_fixed_order, "beside": beside,
                 "separate_dropout": lambda *args: separate_dropout(*args, seed),
                 "beside_dropout": lambda *args: beside_dropout(*args, seed)}
    _shrink_beside_gluon.MAX_STREAM_SHARE, gate = float("inf"), _shrink_beside_gluon.MAX_STREAM_SHARE
    try:
        for name, fn in providers.items():
            y, s = fn(xs[0], weight, lora_A, lora_B)
            exact = (y_masked, s_masked) if "dropout" in name else (y_exact, s_exact)
            errors[name] = max(rel_err(y, exact[0]), rel_err(s, exact[1]))
        calls = {"cublas": lambda: [x @ weight.t() for x in xs]}
        for name, fn in providers.items():
            calls[name] = lambda fn=fn: [fn(x, weight, lora_A, lora_B) for x in xs]
        graphs = {key: capture(fn)[0].replay for key, fn in calls.items()}
    finally:
        _shrink_beside_gluon.MAX_STREAM_SHARE = gate
    times = time_alternating(graphs, rounds=rounds, warmup=5)
    return {key: tuple(t / len(xs) for t in value) for key, value in times.items()}, errors


def main():
    table = adapter_probe("shrink_matmul", "fwd_graph", probe_case, SHAPES, ROWS, RANK, probe_args(__doc__))
    print("\nratio to cuBLAS's GEMM alone (graph-replayed, alternating); error: largest relative error to float64")
    print(f"{'shape':42s} {'cuBLAS us':>9s} {'separate':>9s} {'fused':>9s} {'fixed':>9s} {'beside':>9s} "
          f"{'sep. p':>9s} {'beside p':>9s} {'error':>8s}")
    for shape, floor, ratios, errors in table:
        print(f"{shape:42s} {floor * 1000:9.1f} {ratios['separate']:9.3f} {ratios['fused']:9.3f} "
              f"{ratios['fixed_order']:9.3f} {ratios['beside']:9.3f} {ratios['separate_dropout']:9.3f} "
              f"{ratios['beside_dropout']:9.3f} {max(errors.values()):8.1e}")


if __name__ == "__main__":
    main()
