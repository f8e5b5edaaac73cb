"""What every benchmark shares: timing, environment tags and the results CSVs (benchmarks/results/); and what the
training-step benchmarks share (bench_train_step, its Unsloth subprocess unsloth_train_step, profile_train_step):
their batch, their check step, their AdamW step and how it is timed."""
import csv
import datetime
import json
import logging
import os
import shlex
import subprocess
import sys
import time

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
    gpu = torch.cuda.get_device_name().replace(",", " ") if torch.cuda.is_available() else "cpu"
    return {"date": datetime.date.today().isoformat(), "gpu": gpu,
            "torch": torch.__version__, "triton": triton.__version__, "transformers": tf_version,
            "command": " ".join(["python"] + [shlex.quote(a) for a in sys.argv])}


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
    the other (do_bench per provider), the same call's median moved between runs by more than the differences being
    compared, and two providers running the same kernels read several percent apart. Alternating call by call, every
    provider sees the same clocks.

    order: "rotate" starts each round one call later, so each call keeps the same predecessor (the last call of a
    round aside); "shuffle" draws each round's order afresh (seeded), so that no call always follows the same one
    (rows of both orders in benchmarks/results/timing_order.csv)."""
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
    return {key: median_p20_p80([s.elapsed_time(e) for s, e in pairs]) for key, pairs in events.items()}


def median_p20_p80(times):
    """(median, p20, p80) of `times`."""
    quantiles = torch.tensor([0.5, 0.2, 0.8], dtype=torch.float64)
    return tuple(torch.quantile(torch.tensor(times, dtype=torch.float64), quantiles).tolist())


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


def result_dirs(out, dry_run=False):
    """Where a benchmark's rows go: the folders of --out (a list) when given, else benchmarks/results and $OUT when
    set; a dry run (no GPU) writes nowhere unless given --out."""
    if out:
        return out
    if dry_run:
        return []
    return [os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")] + (
        [os.environ["OUT"]] if os.environ.get("OUT") else [])


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


def stream_subprocess(cmd, env=None, prefix="    | "):
    """(exit status, the last line of its output that is a JSON object, or None) of `cmd`; the other lines of its
    output (stdout and stderr) are echoed as they come, each after `prefix`."""
    report = None
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            if line.startswith("{"):
                try:
                    report = json.loads(line)
                    continue
                except json.JSONDecodeError:
                    pass  # a line of the child's log that only looks like JSON: echoed
            print(prefix + line, end="", flush=True)
    return proc.returncode, report


# ------------------------------------------------------------------------------------------------
# Training steps: bench_train_step, unsloth_train_step, profile_train_step

def token_ids(vocab, batch, seq, device):
    """The training steps' one batch: uniform random token ids [batch, seq], the same in every process."""
    return torch.randint(0, vocab, (batch, seq), device=device, generator=torch.Generator(device).manual_seed(2))


def first_step(model, ids, forward=None):
    """(loss, {name: grad}) of one training forward+backward of `forward` (default: `model`; a torch.compile of it
    otherwise) with the LoRA dropout modules' p set to 0, the optimizer untouched; names are `model`'s."""
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    saved = [m.p for m in dropouts]
    for m in dropouts:  # p is read at each call, by nn.Dropout and by lorafuse alike
        m.p = 0.0
    try:
        loss = (model if forward is None else forward)(input_ids=ids, labels=ids).loss
        loss.backward()
    finally:
        for m, p in zip(dropouts, saved):
            m.p = p
    grads = {name: p.grad.detach().float().cpu() for name, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def adamw_step(model, ids, lr, forward=None):
    """The eager providers' training step, a callable that enqueues one step and returns its loss (on the device):
    forward with labels, loss.backward(), AdamW (torch's default implementation) over the trainable parameters,
    zero_grad(set_to_none=True). forward: `model` or a torch.compile of it."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    forward = model if forward is None else forward

    def step():
        loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss
    return step


def time_training(step, warmup, steps, device, peak_from_start=False, host_gpu=True):
    """`warmup` steps, then `steps` timed ones: {"train_loss" (the first step's), "warm_s", "times" (ms per step),
    "mean_ms", "median_ms", "p20_ms", "p80_ms", "peak_GiB"} and, on CUDA with host_gpu, "host_ms" and "gpu_ms"
    (host_and_gpu_ms). The peak (max_memory_allocated) is over the timed steps, its stats reset after the warm-up;
    peak_from_start keeps what the caller's last reset saw (a CUDA graph: its replays allocate nothing)."""
    start = time.perf_counter()
    result = {"train_loss": step().item()}  # a host sync, in the warm-up only
    for _ in range(warmup - 1):
        step()
    sync(device)
    result["warm_s"] = time.perf_counter() - start
    cuda = device.type == "cuda"
    if cuda and not peak_from_start:
        torch.cuda.reset_peak_memory_stats()
    times = time_steps(step, steps, device)
    median, p20, p80 = median_p20_p80(times)
    result.update(times=times, mean_ms=sum(times) / len(times), median_ms=median, p20_ms=p20, p80_ms=p80,
                  peak_GiB=torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else float("nan"))
    if cuda and host_gpu:
        result["host_ms"], result["gpu_ms"] = host_and_gpu_ms(step)
    return result


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_steps(step, n, device):
    """Per-step times (ms) of n consecutive steps; one event between steps, one sync at the end (no host sync inside
    the loop, as the anchors' wall-clock loop)."""
    if device.type != "cuda":
        ticks = [time.perf_counter()]
        for _ in range(n):
            step()
            ticks.append(time.perf_counter())
        return [(b - a) * 1e3 for a, b in zip(ticks, ticks[1:])]
    events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    events[0].record()
    for i in range(n):
        step()
        events[i + 1].record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in zip(events, events[1:])]


def host_and_gpu_ms(step, steps=5):
    """(host ms, GPU ms) of one step, medians over `steps`: host = wall time to enqueue the step with the GPU's queue
    drained first; GPU = CUDA events around the same step. A step is host-bound when the first is the larger."""
    host, gpu = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        step()
        end.record()
        host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end))
    return sorted(host)[steps // 2], sorted(gpu)[steps // 2]


def chosen_providers(parser, names: str, providers: tuple) -> list:
    """The comma-separated `names`, in the order of `providers` (the order a script runs them in);
    a name not among them is a usage error."""
    requested = [name for name in names.split(",") if name]
    unknown = sorted(set(requested) - set(providers))
    if unknown:
        parser.error(f"unknown providers {unknown}")
    return [provider for provider in providers if provider in requested]
