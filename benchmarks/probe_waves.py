"""Probe: what the last, part-filled wave of output tiles costs the layer's GEMMs. A persistent GEMM of 128 x 256
tiles on 132 SMs runs 8192 x 4096 -> 4096 as 1024 tiles, 7.76 waves; if its time follows whole waves, 7.76 take as
long as 8 and about 3 % of the SMs' time is idle. Here each GEMM runs at row counts around 8192 (7680, 7936, 8192,
8448: 7.27, 7.52, 7.76 and 8.00 waves there) and its time per 8192 rows is compared across them: the same time
at 7.27-8.00 waves says the tail wave costs a whole wave.

    python benchmarks/probe_waves.py [--rounds 30] [--out DIR]

Providers: cuBLAS (x @ W^T, g @ W) and lora_matmul's Gluon GEMMs (`gluon`: the forward's _gemm_rank_r,
ops/_lora_matmul_gluon.py, and the backward's _gemm_dx_and_shrink_grad with dA), r = 16, float32 adapters, each call
with its packing launch; the layer bench's four shapes; all row counts of one GEMM in one alternating session
(benchmarks.common.time_alternating, CUDA graphs, L2 flushed before each call). Rows: <out>/gemm_waves.csv
(DESIGN.md's schema; bench `gemm_waves`, ratio to cuBLAS at the same rows; metric `waves`, the tiles over the SMs).
"""
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import capture, environment, probe_args, time_alternating, timing_rows, write_rows  # noqa: E402

from lorafuse.ops._lora_matmul_gluon import BLOCK_M, BLOCK_N, dx_and_shrink_grad_gluon, lora_matmul_gluon  # noqa: E402
from lorafuse.ops._tiles import sm_count  # noqa: E402

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (2048, 8192)]  # (in, out) features of the base linear
ROW_COUNTS = [7680, 7936, 8192, 8448]
RANK, SCALE = 16, 2.0


def gemm_calls(rows, k_in, n_out, mode, sms):
    """(cuBLAS's call, the Gluon GEMM's call, output columns) for one row count; fresh operands."""
    x = torch.randn(rows, k_in, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(n_out, k_in, device="cuda") / k_in**0.5).bfloat16()
    low = torch.randn(rows, RANK, device="cuda")
    if mode == "fwd_graph":
        lora_B = torch.randn(n_out, RANK, device="cuda") / RANK
        return (lambda: x @ weight.t(),
                lambda: lora_matmul_gluon(x, weight.t(), low, lora_B.t(), SCALE, None, True, sms), n_out)
    g = torch.randn(rows, n_out, device="cuda", dtype=torch.bfloat16)
    lora_A = torch.randn(RANK, k_in, device="cuda") / k_in**0.5
    return lambda: g @ weight, lambda: dx_and_shrink_grad_gluon(g, weight, low, lora_A, x, True, sms), k_in


def main():
    args = probe_args(__doc__)
    tags, sms, rows_out, table = environment(), sm_count(torch.device("cuda")), [], []
    for k_in, n_out in SHAPES:
        for mode in ("fwd_graph", "dx_graph"):
            calls, waves = {}, {}
            for rows in ROW_COUNTS:
                cublas, gluon, columns = gemm_calls(rows, k_in, n_out, mode, sms)
                calls[f"cublas@{rows}"], calls[f"gluon@{rows}"] = cublas, gluon
                waves[rows] = triton.cdiv(rows, BLOCK_M) * triton.cdiv(columns, BLOCK_N) / sms
            times = time_alternating({key: capture(fn)[0].replay for key, fn in calls.items()}, rounds=args.rounds,
                                     warmup=5)
            per_rows = {}
            for rows in ROW_COUNTS:
                shape = f"M{rows}_K{k_in}_N{n_out}_r{RANK}"
                now = {provider: times[f"{provider}@{rows}"] for provider in ("cublas", "gluon")}
                rows_out += timing_rows(tags, "gemm_waves", shape, mode, now, "cublas", "waves",
                                        {provider: round(waves[rows], 3) for provider in now})
                per_rows[rows] = {provider: t[0] / rows * 8192 for provider, t in now.items()}
            table.append((f"{k_in} -> {n_out} {mode[:-6]}", waves, per_rows))
            print(table[-1][0], {rows: {p: round(v, 4) for p, v in t.items()} for rows, t in per_rows.items()},
                  flush=True)
    write_rows(rows_out, "gemm_waves", [args.out])
    print("\ntime per 8192 rows, relative to 8192 rows (graph-replayed, alternating). Time in step with the rows reads "
          "1.000 throughout; time in step with whole waves reads 8192 / rows (1.067, 1.032, 1, 0.970)")
    for name, waves, per_rows in table:
        for provider in ("cublas", "gluon"):
            cells = "  ".join(f"{rows} ({waves[rows]:.2f} w) {per_rows[rows][provider] / per_rows[8192][provider]:.3f}"
                              for rows in ROW_COUNTS)
            print(f"{name:22s} {provider:6s} {cells}")


if __name__ == "__main__":
    main()
