"""Where does a training step's host time go? Host syncs, enqueue time against GPU time, and cProfile.

    python benchmarks/profile_train_step.py [--providers lorafuse,lorafuse_layers] [--layers 16]

Builds bench_train_step's llama1B model for each provider (the number of layers can be cut with --layers), warms
it up, then reports:
  - every host synchronisation in one step (torch.cuda.set_sync_debug_mode("warn")), with the Python line that
    asked for it: a sync drains the GPU's queue, so the host's next launches find the GPU idle;
  - host ms per step (the time to enqueue one step, read once the queue is drained) against GPU ms per step
    (CUDA events): a step is host-bound when the first is the larger;
  - the 25 functions with the most own time in cProfile over a few steps.
"""
import argparse
import cProfile
import os
import pstats
import sys
import time
import traceback
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import bench_train_step as bench  # noqa: E402


def training_step(model):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=bench.LR)

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def sync_sites(step, ids):
    """Python lines (innermost frames of this repository or transformers) that synchronised with the GPU."""
    sites = {}

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        inner = [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames[-4:]]
        key = " <- ".join(reversed(inner))
        sites[key] = sites.get(key, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(ids)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sites


def host_and_gpu_ms(step, ids, steps=5):
    host, gpu = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        step(ids)
        end.record()
        host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end))
    return sorted(host)[steps // 2], sorted(gpu)[steps // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--providers", default="lorafuse,lorafuse_layers,peft")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--profile-steps", type=int, default=3)
    args = parser.parse_args()
    bench.SHAPES["llama1B"]["num_hidden_layers"] = args.layers
    device = torch.device("cuda")
    vocab = bench.SHAPES["llama1B"]["vocab_size"]
    ids = torch.randint(0, vocab, (bench.BATCH, bench.SEQ), device=device)
    summary = []
    for provider in args.providers.split(","):
        bench.free(device)
        model = bench.build(provider, "llama1B", device, torch.bfloat16)
        step = training_step(model)
        for _ in range(3):
            step(ids)
        torch.cuda.synchronize()
        sites = sync_sites(step, ids)
        print(f"\n{provider}: {sum(sites.values())} host syncs in one step")
        for site, count in sorted(sites.items(), key=lambda kv: -kv[1]):
            print(f"  {count:4d}x  {site}")
        host, gpu = host_and_gpu_ms(step, ids)
        summary.append((provider, host, gpu))
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.profile_steps):
            step(ids)
        torch.cuda.synchronize()
        profile.disable()
        print(f"{provider}: cProfile of {args.profile_steps} steps, by own time")
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        del model, step
    print(f"\n{'provider':18s} {'host ms/step':>12s} {'GPU ms/step':>12s}   (llama1B, {args.layers} layers)")
    for provider, host, gpu in summary:
        print(f"{provider:18s} {host:12.1f} {gpu:12.1f}")


if __name__ == "__main__":
    main()
