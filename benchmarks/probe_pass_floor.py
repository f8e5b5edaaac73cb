"""Probe: how near the layer's memory-bound passes are to what torch's own streaming kernels take on the same bytes,
and the fwd+bwd ratio that separate passes at that speed would leave.

    python benchmarks/probe_pass_floor.py [--rounds 30] [--out DIR]

8192 rows, the layer bench's four shapes, r = 16, float32 adapters (as PEFT keeps them). CUDA graphs alternate call
by call with L2 flushed before each (benchmarks.common.time_alternating), as the layer bench times its rows. Each
graph runs its call twice on two inputs (past L2) and rows give the time of one.
- torch's streaming kernels: `x.sum()` reads x, `dy.sum()` reads dy, `x.clone()` reads and writes x;
- the layer's passes: the shrink (x, with and without dropout), the pass over dy (ds, dB), dA's pass over x, and
  dropout's dA pass that also writes the masked dx term;
- the base's two cuBLAS GEMMs (x W^T and dy W).
Rows: <out>/pass_floor.csv (DESIGN.md's schema; bench `pass_floor`, ratio to the base's forward+backward).
The closing table's "floor" column is (base fwd+bwd + x read + dy read + x read) / base fwd+bwd: separate passes as
fast as torch's reads, no other cost.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (capture, environment, probe_args, time_alternating, timing_rows,  # noqa: E402
                               write_rows)

from lorafuse.ops.dropout import new_seed  # noqa: E402
from lorafuse.ops.lora_expand import lora_expand_backward  # noqa: E402
from lorafuse.ops.lora_shrink import lora_shrink, lora_shrink_backward  # noqa: E402

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (2048, 8192)]  # (in, out) features of the base linear
ROWS, RANK, SCALE, P = 8192, 16, 2.0, 0.05


def probe_shape(k_in, n_out, rounds):
    """{provider: (median, p20, p80) ms of one call}."""
    xs = [torch.randn(ROWS, k_in, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    dys = [torch.randn(ROWS, n_out, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    weight = (torch.randn(n_out, k_in, device="cuda") / k_in**0.5).bfloat16()
    lora_A = torch.randn(RANK, k_in, device="cuda") / k_in**0.5
    lora_B = torch.randn(n_out, RANK, device="cuda")
    s = torch.randn(ROWS, RANK, device="cuda")
    ds = torch.randn(ROWS, RANK, device="cuda")
    dx = torch.empty(ROWS, k_in, device="cuda", dtype=torch.bfloat16)
    seed = new_seed("cuda")
    calls = {
        "x_sum": lambda x, dy: x.sum(),
        "dy_sum": lambda x, dy: dy.sum(),
        "x_clone": lambda x, dy: x.clone(),
        "shrink": lambda x, dy: lora_shrink(x, lora_A),
        "shrink_dropout": lambda x, dy: lora_shrink(x, lora_A, P, seed),
        "expand_backward": lambda x, dy: lora_expand_backward(dy, None, s, lora_B, SCALE),
        "shrink_backward": lambda x, dy: lora_shrink_backward(ds, x, lora_A),
        "shrink_backward_dropout_dx": lambda x, dy: lora_shrink_backward(ds, x, lora_A, P, seed, dx_out=dx),
        "base_fwd": lambda x, dy: x @ weight.t(),
        "base_dx": lambda x, dy: dy @ weight,
    }
    graphs = {name: capture(lambda fn=fn: [fn(x, dy) for x, dy in zip(xs, dys)])[0].replay
              for name, fn in calls.items()}
    times = time_alternating(graphs, rounds=rounds, warmup=5)
    return {name: tuple(t / len(xs) for t in value) for name, value in times.items()}


def main():
    args = probe_args(__doc__)
    tags, rows, table = environment(), [], []
    for k_in, n_out in SHAPES:
        shape = f"M{ROWS}_K{k_in}_N{n_out}_r{RANK}"
        times = probe_shape(k_in, n_out, args.rounds)
        times["base_fwd_bwd"] = tuple(f + d for f, d in zip(times["base_fwd"], times["base_dx"]))
        rows += timing_rows(tags, "pass_floor", shape, "graph", times, "base_fwd_bwd")
        table.append((shape, {name: t[0] * 1000 for name, t in times.items()}))
    write_rows(rows, "pass_floor", [args.out])
    print("\nus per call (graph-replayed, alternating, L2 flushed); floor = (base fwd+bwd + x + dy + x reads) / base")
    names = ["x_sum", "shrink", "shrink_dropout", "shrink_backward", "dy_sum", "expand_backward", "x_clone",
             "shrink_backward_dropout_dx", "base_fwd_bwd"]
    print(f"{'shape':24s} " + " ".join(f"{n[:14]:>14s}" for n in names) + f" {'floor':>6s}")
    for shape, us in table:
        floor = (us["base_fwd_bwd"] + 2 * us["x_sum"] + us["dy_sum"]) / us["base_fwd_bwd"]
        print(f"{shape:24s} " + " ".join(f"{us[n]:14.1f}" for n in names) + f" {floor:6.3f}")


if __name__ == "__main__":
    main()
