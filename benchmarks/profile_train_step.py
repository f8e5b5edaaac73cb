"""Where does a training step's host time go? Host syncs, enqueue time against GPU time, and cProfile.

    python benchmarks/profile_train_step.py [--providers lorafuse,lorafuse_captured,peft] [--layers 16]

Builds bench_train_step's llama1B model for each provider (any of bench_train_step's but unsloth, which runs in a
process of its own; the number of layers can be cut with --layers), steps it as bench_train_step does (lorafuse_captured:
CapturedStep's replays; the compiled providers: torch.compile of the model), warms it up as bench_train_step does, then
reports:
  - every host synchronisation in one step (torch.cuda.set_sync_debug_mode("warn")), with the Python line that
    asked for it: a sync drains the GPU's queue, so the host's next launches find the GPU idle;
  - host ms per step (the time to enqueue one step, read once the queue is drained) against GPU ms per step
    (CUDA events; common.host_and_gpu_ms): a step is host-bound when the first is the larger;
  - the 25 functions with the most own time in cProfile over a few steps.
"""
import argparse
import contextlib
import cProfile
import os
import pstats
import sys
import traceback
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import bench_train_step as bench  # noqa: E402
from benchmarks.common import host_and_gpu_ms, token_ids  # noqa: E402

PROVIDERS = tuple(p for p in bench.PROVIDERS if p != "unsloth")


def sync_sites(step):
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
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sites


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--providers", default="lorafuse,lorafuse_layers,peft", help=f"comma-separated, of {PROVIDERS}")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dropout", type=float, default=bench.LORA["lora_dropout"])
    parser.add_argument("--profile-steps", type=int, default=3)
    args = parser.parse_args()
    providers = args.providers.split(",")
    if set(providers) - set(PROVIDERS):
        parser.error(f"unknown providers {sorted(set(providers) - set(PROVIDERS))}")
    bench.SHAPES["llama1B"]["num_hidden_layers"] = args.layers
    device = torch.device("cuda")
    ids = token_ids(bench.SHAPES["llama1B"]["vocab_size"], bench.BATCH, bench.SEQ, device)
    summary = []
    for provider in providers:
        bench.free(device)
        try:
            bench.available(provider, device, args.dropout, site=None)
        except bench.Skipped as exc:
            print(f"\n{provider}: skipped, {exc}")
            continue
        with bench.liger_patches_undone() if provider == "peft_liger" else contextlib.nullcontext():
            summary.append((provider, *profile_provider(provider, ids, args.dropout, args.profile_steps)))
    print(f"\n{'provider':26s} {'host ms/step':>12s} {'GPU ms/step':>12s}   (llama1B, {args.layers} layers)")
    for provider, host, gpu in summary:
        print(f"{provider:26s} {host:12.1f} {gpu:12.1f}")


def profile_provider(provider, ids, dropout, profile_steps):
    """Prints the host syncs of one step and the cProfile of `profile_steps`; returns (host ms, GPU ms) per step."""
    model = bench.build(provider, "llama1B", ids.device, torch.bfloat16, dropout)
    step = bench.training_step(provider, model, bench.forward_of(provider, model), ids)
    for _ in range(bench.warmup_steps(provider, bench.WARMUP, bench.COMPILED_WARMUP)):
        step()
    torch.cuda.synchronize()
    sites = sync_sites(step)
    print(f"\n{provider}: {sum(sites.values())} host syncs in one step")
    for site, count in sorted(sites.items(), key=lambda kv: -kv[1]):
        print(f"  {count:4d}x  {site}")
    host, gpu = host_and_gpu_ms(step)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(profile_steps):
        step()
    torch.cuda.synchronize()
    profile.disable()
    print(f"{provider}: cProfile of {profile_steps} steps, by own time")
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    return host, gpu


if __name__ == "__main__":
    main()
