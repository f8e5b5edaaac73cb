"""Probe: ops.gemv's few-rows kernel (2-16 rows on the tensor cores, the next kernel launched early) against cuBLAS
at Llama-1B's decode GEMMs, and the fused decode step on it against the step on cuBLAS.

    python benchmarks/probe_few_rows.py [--sweep] [--steps] [--out DIR]

--sweep   every GEMM of the 1B decode step (stacked with r = 16 lora_A rows, and without: merged), 2, 4, 8 and 16
          rows: cuBLAS and the kernel at each launch config, each checked against float64 first, then timed as CUDA
          graphs of 16 calls over rotated weight copies (L2 cannot hold them), alternating call by call
          (benchmarks.common.time_alternating); us per call.
--steps   four engines on four 1B models (bench_decode.py's): merged and unmerged, their batches of 2-16 rows on
          the kernel or on cuBLAS (the step as it was: ops.gemv for one row only). Per engine and bucket (1-16): the
          forward graph replayed 32 times a call, 20 rounds of calls alternating between the engines
          (time_alternating), median per step; for buckets 1 and 8 also the stream step of bench_decode (fastest
          of 5 calls of 256 tokens); the first decode step's logits of both routes compared. (The rows of
          2026-11-26 came from the same alternation in a loop of the probe's own, without time_alternating's L2
          flush before each call.)
Rows: <out>/few_rows.csv (DESIGN.md's schema; bench `few_rows`).
"""
import argparse
import functools
import itertools
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_decode import PROMPT, engine_provider, lora_model  # noqa: E402
from benchmarks.common import environment, time_alternating, write_rows  # noqa: E402

from lorafuse.hf import fused_decode  # noqa: E402
from lorafuse.inference import Engine, SamplingParams  # noqa: E402
from lorafuse.ops.gemv import gemv  # noqa: E402

R = 16
BUCKETS = (1, 2, 4, 8, 16)
GEMMS = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
         "lm_head": (128256, 2048)}  # (N, K) of Llama-1B's decode GEMMs, merged
CONFIGS = [(bn, bk, w, s) for bn, bk in itertools.product((16, 32, 64), (128, 256, 512))
           for w, s in ((4, 3), (4, 4), (2, 4), (8, 3))]  # (BLOCK_N, BLOCK_K, num_warps, num_stages)


def rel_err(got, exact):
    return ((got.double() - exact).norm() / exact.norm()).item()


def sweep(tags, rows_out, table):
    ratios = {}  # {config: [time / cuBLAS's for each case]}
    for (name, (n, k)), stacked, rows in itertools.product(GEMMS.items(), (False, True), (2, 4, 8, 16)):
        if name == "lm_head" and stacked:
            continue
        n += 3 * R if stacked and name == "qkv" else 2 * R if stacked and name == "gate_up" else R if stacked else 0
        copies = max(2, min(16, (512 << 20) // (n * k * 2)))
        torch.manual_seed(0)
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
        exact = x.double() @ weights[0].double().t()
        bound = 2 * rel_err(x @ weights[0].t(), exact) + 1e-6
        providers = {"cublas": lambda w: torch.mm(x, w.t(), out=out)}
        for config in CONFIGS:
            try:
                err = rel_err(gemv(x, weights[0], config=config), exact)
            except triton.runtime.errors.OutOfResources:
                continue
            if not err <= bound:
                print(f"  FAIL {name} stacked={stacked} rows={rows} {config}: error {err:.2e} > {bound:.2e}")
                continue
            providers[config] = functools.partial(lambda w, config: gemv(x, w, out=out, config=config),
                                                  config=config)
        graphs = {}
        for key, fn in providers.items():
            for w in weights:
                fn(w)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for w in weights:
                    fn(w)
            graphs[key] = graph.replay
        times = time_alternating(graphs, rounds=20, warmup=3)
        shape = f"{name}_N{n}_K{k}_M{rows}"
        base = times["cublas"][0]
        for key, (med, p20, p80) in times.items():
            provider = "cublas" if key == "cublas" else "few_rows_bn{}_bk{}_w{}_s{}".format(*key)
            rows_out.append(dict(tags, bench="few_rows", shape=shape, provider=provider, mode="fwd_graph",
                                 median_ms=med / copies, p20_ms=p20 / copies, p80_ms=p80 / copies, metric="", value="",
                                 baseline="cublas", ratio=med / base))
        best = min((k for k in times if k != "cublas"), key=lambda k: times[k][0])
        table.append((shape, 1000 * base / copies, 1000 * times[best][0] / copies, best))
        for key in times:
            ratios.setdefault(key, []).append(times[key][0] / base)
        del weights, graphs
        torch.cuda.empty_cache()
    for key, values in sorted(ratios.items(), key=lambda kv: sum(kv[1]) / len(kv[1]))[:8]:
        table.append((f"config {key}", sum(values) / len(values), max(values), f"mean, max ratio to cuBLAS over "
                      f"{len(values)} cases"))


def cublas_beyond_one_row(x, weight, bias=None, out=None, config=None):
    # the fused step's GEMMs as they were: ops.gemv on one row, cuBLAS on more
    if x.shape[0] == 1:
        return gemv(x, weight, bias, out)
    y = torch.nn.functional.linear(x, weight, bias)
    return y if out is None else out.copy_(y)


def steps(tags, rows_out, table, new=256):
    engines = {}
    for merge, route in itertools.product((True, False), ("cublas", "few_rows")):
        name = f"{'merged' if merge else 'unmerged'}_{route}"
        fused_decode.gemv = cublas_beyond_one_row if route == "cublas" else gemv  # read at capture
        engines[name] = Engine(lora_model("1B"), max_length=PROMPT + new, merge=merge, buckets=BUCKETS)
        fused_decode.gemv = gemv
        print(f"  {name}: captured in {engines[name].capture_seconds:.2f} s")
    for batch in BUCKETS:
        prompts = torch.randint(3, 120000, (batch, PROMPT), generator=torch.Generator().manual_seed(batch)).tolist()
        logits, stream = {}, {}
        for name, engine in engines.items():
            engine.generate(prompts, SamplingParams(max_new_tokens=2))  # one decode step after the same prefill
            logits[name] = engine.last_logits().double()
            stream[name] = engine_provider(engine, prompts, new)[1] if batch in (1, 8) else float("nan")
        for kind in ("merged", "unmerged"):
            a, b = logits[f"{kind}_cublas"], logits[f"{kind}_few_rows"]
            print(f"B{batch} {kind}: the first decode step's logits, few rows against cuBLAS: rel. diff "
                  f"{rel_err(b, a):.2e}, argmax equal in {(a.argmax(-1) == b.argmax(-1)).sum().item()} of {batch} rows")
        # each call: the forward graph replayed 32 times (ms per call / 32 = ms per step)
        calls = {name: lambda graph=engine._rows[batch].forward_graph: [graph.replay() for _ in range(32)]
                 for name, engine in engines.items()}
        medians = {}
        for name, times in time_alternating(calls, rounds=20, warmup=3).items():
            med, p20, p80 = (t / 32 for t in times)
            medians[name] = med
            shape = f"llama1B_B{batch}_P{PROMPT}_G{new}"
            baseline = f"{name.split('_')[0]}_cublas"
            rows_out += [dict(tags, bench="few_rows", shape=shape, provider=name, mode="decode_graph", median_ms=med,
                              p20_ms=p20, p80_ms=p80, metric="", value="", baseline=baseline, ratio=""),
                         dict(tags, bench="few_rows", shape=shape, provider=name, mode="decode_stream",
                              median_ms=1000 * stream[name], p20_ms="", p80_ms="", metric="", value="",
                              baseline=baseline, ratio="")]
            table.append((f"B{batch} {name} (us: graph, stream)", med * 1000, stream[name] * 1e6, ""))
        for route in ("cublas", "few_rows"):
            table.append((f"B{batch} unmerged/merged {route}", medians[f"unmerged_{route}"] /
                          medians[f"merged_{route}"], stream[f"unmerged_{route}"] / stream[f"merged_{route}"],
                          "ratio: graph, stream"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--steps", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    tags, rows_out, table = environment(), [], []
    if args.sweep:
        sweep(tags, rows_out, table)
    if args.steps:
        steps(tags, rows_out, table)
    write_rows(rows_out, "few_rows", [args.out])
    print(f"\n{'case':40s} {'a':>10s} {'b':>10s}  note")
    for case, a, b, note in table:
        print(f"{case:40s} {a:10.3f} {b:10.3f}  {note}")


if __name__ == "__main__":
    main()
