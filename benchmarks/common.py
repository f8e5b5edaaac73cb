"""What every benchmark shares: timing, environment tags and the results CSV of DESIGN.md."""
import argparse
import csv
import datetime
import logging
import os
import shlex
import sys

import torch
import triton

COLUMNS = ["date", "gpu", "torch", "triton", "transformers", "bench", "shape", "provider", "mode", "median_ms",
           "p20_ms", "p80_ms", "metric", "value", "baseline", "ratio", "command"]


def environment():
    try:
        import transformers
        tf_version = transformers.__version__
    except ImportError:
        tf_version = "missing"
    return {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name().replace(",", " "),
            "torch": torch.__version__, "triton": triton.__version__, "transformers": tf_version,
            "command": " ".join(["python"] + [shlex.quote(a) for a in sys.argv])}


def probe_args(doc: str) -> argparse.Namespace:
    """The probes' command line: --rounds of time_alternating (30) and --out, the folder their CSV goes to ($OUT, or
    the current one)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    return parser.parse_args()


class LogWatch(logging.Handler):
    """Collects (and prints) what lorafuse logs, once per message: a fallback means a row would
    time PEFT or SDPA instead of lorafuse's kernels."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []
        logging.getLogger("lorafuse").addHandler(self)

    def emit(self, record):
        message = record.getMessage()
        print(f"  lorafuse says: {message}")
        self.messages.append(message)


def time_ms(fn, rep_ms=200):
    """(median, p20, p80) in ms over CUDA events, after warm-up; the caller rotates inputs."""
    med, p20, p80 = triton.testing.do_bench(fn, warmup=50, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    return med, p20, p80


def time_alternating(calls, rounds=100, warmup=10, order="rotate"):
    """{key: (median, p20, p80)} in ms for each callable of `calls` (CUDA-graph replays), timed call by call in turn,
    with CUDA events around each call and L2 flushed before it, as do_bench does.

    Ratios between calls are what the benchmarks compare, and the GPU's clocks drift between seconds: timed one after
    the other (do_bench per provider), the base fwd+bwd of one shape read 0.79 ms in one run and 0.90 ms (p20-p80
    0.85-0.98) in another, and two providers running the same kernels differed by 6 % (H200, NOTES_lora_layer.md).
    Alternating call by call, every provider sees the same clocks.

    order: "rotate" starts each round one call later, so each call keeps the same predecessor (the last call of a
    round aside); "shuffle" draws each round's order afresh (seeded), so that no call always follows the same one
    (probe_timing_order.py asks whether that matters)."""
    if order not in ("rotate", "shuffle"):
        raise ValueError(f"order must be 'rotate' or 'shuffle', got {order!r}")
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    keys = list(calls)
    events = {key: [] for key in keys}
    shuffler = torch.Generator().manual_seed(0)
    for i in range(warmup + rounds):
        if order == "rotate":
            round_keys = keys[i % len(keys):] + keys[:i % len(keys)]
        else:
            round_keys = [keys[j] for j in torch.randperm(len(keys), generator=shuffler).tolist()]
        for key in round_keys:
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            calls[key]()
            end.record()
            if i >= warmup:
                events[key].append((start, end))
    torch.cuda.synchronize()
    quantiles = torch.tensor([0.5, 0.2, 0.8], dtype=torch.float64)
    return {key: tuple(torch.quantile(torch.tensor([s.elapsed_time(e) for s, e in pairs], dtype=torch.float64),
                                      quantiles).tolist()) for key, pairs in events.items()}


def capture(fn):
    """(graph, outputs): fn() captured in a CUDA graph after warm-up on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs


def timing_rows(tags, bench, shape, mode, times, baseline, metric="", values=None):
    """A row of COLUMNS per provider of time_alternating's {provider: (median, p20, p80)}, with its ratio to
    `baseline`'s median; values: {provider: value of `metric`} (a provider without one gets neither)."""
    values = values or {}
    base = times[baseline][0]
    return [dict(tags, bench=bench, shape=shape, provider=provider, mode=mode, median_ms=median, p20_ms=p20,
                 p80_ms=p80, metric=metric if provider in values else "", value=values.get(provider, ""),
                 baseline=baseline, ratio=median / base)
            for provider, (median, p20, p80) in times.items()]


def adapter_probe(bench, mode, probe_case, shapes, rows, rank, args, metric="rel_err_fp64"):
    """Runs probe_case(k_in, n_out, adapter_dtype, rounds) -> ({provider: (median, p20, p80) ms}, {provider: `metric`,
    a relative error to float64}) for each (in, out) of `shapes` with float32 and bf16 adapters, and appends the rows
    to <args.out>/<bench>.csv (ratio to the "cublas" provider). Returns [(shape, cuBLAS ms, {provider: ratio},
    errors)] for the probe's table."""
    tags, table_rows, table = environment(), [], []
    for (k_in, n_out) in shapes:
        for adapter_dtype, adapters in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            shape = f"M{rows}_K{k_in}_N{n_out}_r{rank}_{adapters}_adapters"
            times, errors = probe_case(k_in, n_out, adapter_dtype, args.rounds)
            floor = times["cublas"][0]
            table_rows += timing_rows(tags, bench, shape, mode, times, "cublas", metric, errors)
            table.append((shape, floor, {key: t[0] / floor for key, t in times.items()}, errors))
            print(table[-1], flush=True)
    write_rows(table_rows, bench, [args.out])
    return table


def write_rows(rows, bench, out_dirs):
    """Append rows (dicts with the COLUMNS) to <dir>/<bench>.csv for each dir."""
    for out_dir in out_dirs:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"{bench}.csv")
        new = not os.path.exists(path)
        with open(path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            if new:
                writer.writeheader()
            writer.writerows(rows)


def print_profile(provider, step, steps=2, kernels=30):
    """The GPU kernels that take a step's time (torch.profiler over `steps` more steps), largest first."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events) / steps / 1e3
    print(f"  {provider}: GPU kernel time {total:.1f} ms per step; largest kernels (ms per step):")
    for e in events[:kernels]:
        print(f"    {e.self_device_time_total / steps / 1e3:8.3f}  {e.count // steps:4d}x  {e.key[:90]}")
