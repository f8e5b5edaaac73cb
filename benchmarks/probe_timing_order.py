"""Do the benchmarks' ratios depend on the order in which providers alternate?

    python benchmarks/probe_timing_order.py                # attention N=2048 D=128 and one layer shape, 6 reps
    python benchmarks/probe_timing_order.py --reps 3 --out DIR

benchmarks.common.time_alternating replays the providers' graphs call by call. With order="rotate" (what the benches
used up to 2026-11-25) each round starts one call later, so a call always follows the same call (but at a round's
start). If a call's time depends on what ran just before it (clocks after a heavy or a light call), rotation gives
each provider a fixed bias; order="shuffle" draws each round's order afresh. Two questions, on the graphs the benches
time, built by their own code:
  1. does a ratio move between the two orders?
  2. does one graph, captured twice and placed at two points of the cycle, read two times? (a copy of lorafuse's
     forward after the heaviest call, eager attention's fwd_bwd; a copy of the layer bench's base after PEFT's)
Each repetition times both orders back to back, `reps` times; the table gives the median ratio over repetitions and
their spread. Rows go to benchmarks/results/timing_order.csv (mode = <mode>_<order>, ratio against the bench's
baseline timed in the same call of time_alternating) and $OUT when set.
"""
import argparse
import copy
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import bench_attention, bench_lora_layer  # noqa: E402
from benchmarks.common import capture, environment, time_alternating, write_rows  # noqa: E402

import lorafuse  # noqa: E402

ORDERS = ("rotate", "shuffle")


def attention_graphs(n, d, causal):
    """bench_attention.bench_shape's graphs (same providers, modes and key order), plus a second capture of
    lorafuse's forward keyed ("lorafuse_copy", "fwd") and placed last, after eager's fwd_bwd."""
    b = bench_attention.TOKENS // n
    h = bench_attention.HEADS
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    calls = {}
    for mode in ("fwd", "fwd_bwd"):
        for provider in bench_attention.PROVIDERS:
            call = bench_attention.timed_call(provider, mode, q, k, v, do, causal)
            replay = bench_attention.graphed_provider(provider, call, f"{provider} {mode}")
            if replay is not None:
                calls[(provider, mode)] = replay
    copy_call = bench_attention.timed_call("lorafuse", "fwd", q, k, v, do, causal)
    calls[("lorafuse_copy", "fwd")] = bench_attention.graphed_provider("lorafuse", copy_call, "lorafuse copy")
    shape = f"B{b}_H{h}_N{n}_D{d}_{'causal' if causal else 'full'}"
    return shape, calls, "sdpa_flash", (q, k, v, do)


def layer_graphs(k, n, p):
    """bench_lora_layer's base, peft and lorafuse graphs (fwd and fwd_bwd, in its key order), plus a second capture of
    the base forward keyed ("base_copy", "fwd_graph") after PEFT's fwd_bwd."""
    torch.manual_seed(0)
    peft = bench_lora_layer.peft_model(k, n, p, torch.bfloat16).train()
    base = peft.base_model.model.proj.base_layer
    fused = lorafuse.fuse(copy.deepcopy(peft)).train()
    x = torch.randn(bench_lora_layer.TOKENS, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(bench_lora_layer.TOKENS, n, device="cuda", dtype=torch.bfloat16)
    calls = {}
    for name, model in (("base", base), ("peft", peft), ("lorafuse", fused)):
        params = [x] + [w for w in model.parameters() if w.requires_grad]
        calls[(name, "fwd_graph")] = capture(lambda model=model: model(x))[0].replay
        calls[(name, "fwd_bwd_graph")] = capture(
            lambda model=model, params=params: torch.autograd.grad(model(x), params, gy))[0].replay
        if name == "peft":
            calls[("base_copy", "fwd_graph")] = capture(lambda: base(x))[0].replay
    shape = f"M{bench_lora_layer.TOKENS}_K{k}_N{n}_r{bench_lora_layer.RANK}_p{p}"
    return shape, calls, "base", (peft, fused, x, gy)


def probe(bench, shape, calls, baseline, reps, rounds):
    """{(provider, mode, order): [median ms of each repetition]}, both orders timed back to back in every rep."""
    times = {}
    for rep in range(reps):
        for order in ORDERS:
            for (provider, mode), (med, _, _) in time_alternating(calls, rounds=rounds, order=order).items():
                times.setdefault((provider, mode, order), []).append(med)
        print(f"  {bench} {shape}: rep {rep + 1}/{reps} done", flush=True)
    return times


def ratio_of(times, provider, mode, order, baseline):
    """Per-repetition ratios of provider's time to the baseline's (same mode, repetition and order)."""
    base = times[(baseline, mode, order)]
    return [t / b for t, b in zip(times[(provider, mode, order)], base)]


def rows_of(env, bench, shape, times, baseline):
    rows = []
    for (provider, mode, order), meds in times.items():
        ratios = ratio_of(times, provider, mode, order, baseline)
        q20, _, _, q80 = statistics.quantiles(meds, n=5, method="inclusive")  # of the repetitions' medians
        rows.append(dict(env, bench=bench, shape=shape, provider=provider, mode=f"{mode}_{order}",
                         median_ms=statistics.median(meds), p20_ms=q20, p80_ms=q80, metric="ratio",
                         value=statistics.median(ratios), baseline=baseline, ratio=statistics.median(ratios)))
    return rows


def spread(values):
    return f"{statistics.median(values):.4f} ({min(values):.4f}-{max(values):.4f})"


def summarize(bench, shape, times, baseline, subject, copy_of):
    """Lines: the subject's speed-up over the baseline per order (baseline time / subject time), and the copy's time
    over the original's (the same graph at another point of the cycle)."""
    lines = []
    modes = sorted({mode for (provider, mode, _) in times if provider == subject})
    for mode in modes:
        cells = []
        for order in ORDERS:
            speedups = [1 / r for r in ratio_of(times, subject, mode, order, baseline)]
            cells.append(f"{order} {spread(speedups)}")
        lines.append(f"{bench:10} {shape:30} {mode:14} {baseline}/{subject}: " + "   ".join(cells))
    copy_key, original = copy_of
    for order in ORDERS:
        same = [c / o for c, o in zip(times[(*copy_key, order)], times[(*original, order)])]
        lines.append(f"{bench:10} {shape:30} {copy_key[1]:14} {copy_key[0]} / {original[0]} ({order}): {spread(same)}")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--out", default=None, help="also append rows to DIR/timing_order.csv")
    args = parser.parse_args()
    if args.reps < 2:
        parser.error("--reps must be at least 2 (the rows give the spread over repetitions)")
    env = environment()
    out_dirs = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")]
    out_dirs = list(dict.fromkeys(out_dirs + [d for d in (args.out, os.environ.get("OUT")) if d]))
    summary = []
    for causal in (True, False):
        shape, calls, baseline, keep = attention_graphs(2048, 128, causal)
        times = probe("attention", shape, calls, baseline, args.reps, rounds=40)
        write_rows(rows_of(env, "timing_order", shape, times, baseline), "timing_order", out_dirs)
        summary += summarize("attention", shape, times, baseline, "lorafuse",
                             (("lorafuse_copy", "fwd"), ("lorafuse", "fwd")))
        del calls, keep  # keep: the tensors the graphs read, alive while they replay
        torch.cuda.empty_cache()
    shape, calls, baseline, keep = layer_graphs(4096, 4096, 0.05)
    times = probe("lora_layer", shape, calls, baseline, args.reps, rounds=100)
    write_rows(rows_of(env, "timing_order", shape, times, baseline), "timing_order", out_dirs)
    summary += summarize("lora_layer", shape, times, baseline, "lorafuse",
                         (("base_copy", "fwd_graph"), ("base", "fwd_graph")))
    print(f"\n{env['gpu']}: median over {args.reps} repetitions (min-max); speed-up = baseline time / lorafuse time")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
