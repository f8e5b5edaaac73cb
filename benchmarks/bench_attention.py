"""Is the Triton flash attention right, and as fast as PyTorch's best? lorafuse vs SDPA's back-ends.

    python benchmarks/bench_attention.py                 # checks, then the full grid (a few minutes)
    python benchmarks/bench_attention.py --quick         # checks, then N=2048 D=128 only, and the decode row
    python benchmarks/bench_attention.py --check-only    # correctness on the GPU, no timing
    python benchmarks/bench_attention.py --out DIR       # rows to DIR/attention.csv instead of the defaults

Checks come first, one PASS/FAIL line each; any FAIL exits 1 before timing (timings of wrong
kernels are not results). Output, dq, dk, dv against attention_reference in float64: bf16 and
fp16 within 2x the error of torch's own scaled_dot_product_attention (default back-end, same
dtype, same mask) + 1e-6; fp32 below 1e-5. Odd sequence lengths (Nq < Nk: the causal diagonal
sits at the end), GQA ratios 1/4/8, head dims 64/80/96/128, left- and right-padded batches whose
padding holds NaN, a decode step, bitwise determinism, CUDA-graph capture and replay.

Timing: bf16, H=32 (no GQA), B*N = 16384 tokens, N in 512..8192, D 64 and 128, causal and full;
`fwd` is the training forward (inputs require grad), `fwd_bwd` forward + backward with a fixed
random grad_output. Providers: lorafuse, sdpa_flash, sdpa_cudnn, sdpa_efficient (SDPA forced to
one back-end), eager (matmul, softmax, matmul in bf16; skipped where its N x N tensors would pass
40 GiB). TFLOPs: 4*B*H*N^2*D forward, halved when causal; fwd_bwd counts 3.5x that. Decode row:
one query against a 4096-key cache (GQA 4), GB/s of K/V read, eager launches (`decode`) and
replayed from a CUDA graph (`decode_graph`). A provider that fails on a shape is reported and
skipped. Every timed call (but the eager decode row's) is a CUDA-graph replay, the providers timed alternating
call by call (benchmarks.common.time_alternating). ratio = time / sdpa_flash time (same shape and mode). Rows go to
benchmarks/results/attention.csv (and $OUT when set).
"""
import argparse
import contextlib
import logging
import math
import os
import sys
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import LogWatch, capture, environment, time_alternating, time_ms, write_rows  # noqa: E402

from lorafuse.ops.attention.windows import allowed_keys, windows_from_padding_mask  # noqa: E402
from lorafuse.ops.attention.flash_attention import attention_reference, flash_attention  # noqa: E402

# correctness
SEQ_PAIRS = [(1, 1), (7, 33), (113, 203), (128, 217), (1023, 1024), (2048, 2048)]  # (Nq, Nk)
FP32_TOL = 1e-5
HALF_FLOOR = 1e-6  # lets a kernel exact up to fp32 rounding pass where torch is exact
# timing
TOKENS, HEADS = 16384, 32
GRID_N, GRID_D = (512, 1024, 2048, 4096, 8192), (64, 128)
QUICK_N, QUICK_D = (2048,), (128,)
DECODE = dict(b=8, hq=32, hkv=8, nk=4096, d=128)
SDPA_BACKENDS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                 "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}
PROVIDERS = ("lorafuse", *SDPA_BACKENDS, "eager")
BASELINE = "sdpa_flash"
EAGER_LIMIT_GIB = 40
REP_MS = 100
PER_MS = {"TFLOPs": 1e9, "GBps": 1e6}  # (flops or bytes) / ms / PER_MS = TFLOP/s or GB/s


# ------------------------------------------------------------------------------------------------
# The attentions compared

def sdpa_attention(q, k, v, causal=False, windows=None):
    """torch's own attention, default back-end, on exactly the relation lorafuse computes."""
    # q: [B, Hq, Nq, D], k, v: [B, Hkv, Nk, D]
    n_q, n_k = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if windows is None and (not causal or n_q == n_k):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    # SDPA's is_causal aligns the diagonal to the start: a dense mask for the end-aligned one
    allowed = allowed_keys(windows, n_q, n_k, causal, q.device)[:, None]  # [B|1, 1, Nq, Nk]
    has_key = allowed.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | ~has_key, enable_gqa=gqa)  # no NaN rows
    return torch.where(has_key, out, 0)


def eager_attention(q, k, v, causal):
    """matmul -> softmax -> matmul in the inputs' dtype, the N x N scores in memory."""
    # q, k, v: [B, H, N, D]
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2)
    if causal:
        n_q, n_k = scores.shape[-2:]
        future = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).triu(n_k - n_q + 1)
        scores = scores.masked_fill(future, -math.inf)
    return torch.softmax(scores, -1) @ v


def attend(provider):
    """fn(q, k, v, causal) -> out; an SDPA provider needs backend_of(provider) around its calls."""
    if provider == "lorafuse":
        return lambda q, k, v, causal: flash_attention(q, k, v, causal=causal)
    if provider == "eager":
        return eager_attention
    return lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                  enable_gqa=q.shape[1] != k.shape[1])


def backend_of(provider):
    # entered around the whole timing, not per call: its Python cost would show in decode times
    return sdpa_kernel(SDPA_BACKENDS[provider]) if provider in SDPA_BACKENDS else contextlib.nullcontext()


# ------------------------------------------------------------------------------------------------
# Correctness

class Case(NamedTuple):
    b: int
    hq: int
    hkv: int
    nq: int
    nk: int
    d: int
    causal: bool
    dtype: torch.dtype = torch.bfloat16
    padded: bool = False  # rows left/right padded (windows_from_padding_mask), padding filled with NaN

    def label(self):
        return (f"{str(self.dtype).removeprefix('torch.'):8} B{self.b} Hq{self.hq} Hkv{self.hkv} Nq{self.nq} "
                f"Nk{self.nk} D{self.d} {'causal' if self.causal else 'full'}{' padded+NaN' if self.padded else ''}")


def correctness_cases():
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    both = (False, True)
    cases = [Case(2, 8, 2, nq, nk, 128, c) for nq, nk in SEQ_PAIRS for c in both]         # GQA 4
    cases += [Case(2, 8, 2, nq, nk, 128, c, fp16) for nq, nk in ((113, 203), (2048, 2048)) for c in both]
    cases += [Case(2, 8, hkv, 113, 203, 128, c) for hkv in (8, 1) for c in both]          # GQA 1, 8
    cases.append(Case(2, 8, 1, 1023, 1024, 128, True))
    cases += [Case(2, 8, 2, nq, nk, d, c) for d in (64, 80, 96) for nq, nk in ((113, 203), (1023, 1024))
              for c in both]
    cases += [Case(2, 8, 2, nq, nk, d, c, fp32) for nq, nk, d in ((113, 203, 128), (1023, 1024, 128), (113, 203, 80))
              for c in both]
    cases += [Case(4, 8, 2, nq, nk, 128, c, dt, padded=True) for nq, nk in ((113, 203), (1024, 1024), (1, 4096))
              for c in both for dt in (bf16, fp32)]
    cases.append(Case(4, 32, 8, 1, 4096, 128, True))  # decode: one query against a 4096-key cache, GQA 4
    return cases


def rel_err(got, exact):
    """||got - exact|| / ||exact|| in float64 (the RMS of the difference where exact is all zero);
    NaN or inf in got gives NaN or inf, which no bound passes."""
    diff = torch.linalg.vector_norm(got.double() - exact.double())
    norm = torch.linalg.vector_norm(exact.double())
    return (diff / (norm if norm > 0 else math.sqrt(exact.numel()))).item()


def report(ok, what, detail=""):
    print(f"{'PASS' if ok else 'FAIL'}  {what:52} {detail}", flush=True)
    return ok


def padding_mask(b, n_k, device, shift=0):
    """[B, Nk] keep-mask, rows cycling: right-padded, left-padded, unpadded, one real token (at the end)."""
    keys = torch.arange(n_k, device=device)
    starts = [0, n_k // 4 + shift, 0, n_k - 1]
    ends = [n_k - n_k // 3 - shift, n_k, n_k, n_k]
    return torch.stack([(keys >= starts[i % 4]) & (keys < ends[i % 4]) for i in range(b)])


def random_inputs(case, device, seed=0):
    """q, k, v, grad_output in the case's dtype, random normal."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = [(case.b, case.hq, case.nq, case.d), (case.b, case.hkv, case.nk, case.d),
              (case.b, case.hkv, case.nk, case.d), (case.b, case.hq, case.nq, case.d)]
    return [torch.randn(s, generator=gen, device=device).to(case.dtype) for s in shapes]


def forward_backward(fn, q, k, v, do, **kwargs):
    """[out, dq, dk, dv] of fn on fresh leaf copies of q, k, v."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, **kwargs)
    return [out.detach(), *torch.autograd.grad(out, leaves, do)]


def check_case(case, device):
    """Errors of lorafuse's out, dq, dk, dv against float64, with their bounds; True if all pass."""
    q, k, v, do = random_inputs(case, device)
    windows, real_q, tested = None, None, (q, k, v)
    if case.padded:
        mask = padding_mask(case.b, case.nk, device)
        windows = windows_from_padding_mask(mask, case.nq)
        real_q = mask[:, case.nk - case.nq:, None][:, None]  # [B, 1, Nq, 1]: queries that are tokens
        real_k = mask[:, None, :, None]
        tested = (q.masked_fill(~real_q, math.nan), k.masked_fill(~real_k, math.nan),
                  v.masked_fill(~real_k, math.nan))
    kw = dict(causal=case.causal, windows=windows)
    exact = forward_backward(attention_reference, q.double(), k.double(), v.double(), do.double(), **kw)
    got = forward_backward(flash_attention, *tested, do, **kw)
    plain = None if case.dtype == torch.float32 else forward_backward(sdpa_attention, q, k, v, do, **kw)
    if real_q is not None:  # the outputs of padding rows are not results; all gradients are
        for result in (r for r in (exact, got, plain) if r is not None):
            result[0] = torch.where(real_q, result[0], 0)
    ok, cells = True, []
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        err = rel_err(got[i], exact[i])
        bound = FP32_TOL if plain is None else 2 * rel_err(plain[i], exact[i]) + HALF_FLOOR
        passed = err < bound if plain is None else err <= bound  # false for NaN
        ok &= passed
        cells.append(f"{name} {err:.1e}{'<=' if passed else ' > '}{bound:.1e}")
    return report(ok, case.label(), "  ".join(cells))


def check_decode(case, device):
    """The no-grad decode kernel (flash_decode: GQA rows stacked, keys split in chunks) on a
    left-padded cache whose padding holds NaN: out against float64, within 2x SDPA's error."""
    q, k, v, _ = random_inputs(case, device)
    mask = padding_mask(case.b, case.nk, device)
    windows = windows_from_padding_mask(mask, case.nq)
    real_q = mask[:, case.nk - case.nq:, None][:, None]
    real_k = mask[:, None, :, None]
    nan_q, nan_k, nan_v = q.masked_fill(~real_q, math.nan), k.masked_fill(~real_k, math.nan), \
        v.masked_fill(~real_k, math.nan)
    with torch.no_grad():
        got = torch.where(real_q, flash_attention(nan_q, nan_k, nan_v, causal=True, windows=windows), 0)
        exact = torch.where(real_q, attention_reference(q.double(), k.double(), v.double(), True, None, windows), 0)
        plain = torch.where(real_q, sdpa_attention(q, k, v, True, windows), 0)
    err, bound = rel_err(got, exact), 2 * rel_err(plain, exact) + HALF_FLOOR
    return report(err <= bound, "decode kernel (no grad) " + case.label(), f"out {err:.1e}<={bound:.1e}")


def check_determinism(device, case=Case(2, 8, 2, 2048, 2048, 128, True)):
    q, k, v, do = random_inputs(case, device)
    first = forward_backward(flash_attention, q, k, v, do, causal=case.causal)
    second = forward_backward(flash_attention, q, k, v, do, causal=case.causal)
    fwd = report(torch.equal(first[0], second[0]), "deterministic forward", case.label())
    bwd = report(all(torch.equal(a, b) for a, b in zip(first[1:], second[1:])), "deterministic backward",
                 case.label())
    return fwd and bwd


def max_diff(xs, ys):
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(xs, ys))


def check_cuda_graph(backward, padded, case=Case(2, 8, 2, 1023, 1024, 128, True)):
    """Capture, copy new inputs into the static buffers, replay: bitwise what eager gives on them."""
    what = f"CUDA graph {'fwd+bwd' if backward else 'fwd'}{', windows built in the graph' if padded else ''}"
    static = random_inputs(case, "cuda", seed=0)
    q, k, v, do = [t.requires_grad_(backward and i < 3) for i, t in enumerate(static)]
    mask = padding_mask(case.b, case.nk, "cuda")

    def step():
        windows = windows_from_padding_mask(mask, case.nq) if padded else None
        out = flash_attention(q, k, v, causal=case.causal, windows=windows)
        return [out, *torch.autograd.grad(out, (q, k, v), do)] if backward else [out]

    graph, captured = capture(step)
    with torch.no_grad():
        for buffer, new in zip(static, random_inputs(case, "cuda", seed=1)):
            buffer.copy_(new)
        mask.copy_(padding_mask(case.b, case.nk, "cuda", shift=5))
    graph.replay()
    replayed = [t.clone() for t in captured]
    eager = step()
    same = all(torch.equal(r, e) for r, e in zip(replayed, eager))
    return report(same, what, case.label() + ("" if same else f"  max diff {max_diff(replayed, eager):.2e}"))


def guarded(what, check, *args):
    """check(*args), or a FAIL line if it raises (a kernel that does not compile fails its check)."""
    try:
        return check(*args)
    except Exception as exc:
        return report(False, what, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:120]}")


def run_checks(device, cases):
    """Every check, printed as it runs; True if all pass."""
    start, watch = time.perf_counter(), LogWatch()
    results = [guarded(case.label(), check_case, case, device) for case in cases]
    decode_cases = (Case(4, 32, 8, 1, 4096, 128, True, padded=True), Case(4, 32, 4, 4, 1000, 64, True, padded=True))
    results += [guarded(f"decode {case.label()}", check_decode, case, device) for case in decode_cases]
    results.append(guarded("determinism", check_determinism, device))
    if device == "cuda":
        results += [guarded(f"CUDA graph backward={backward} padded={padded}", check_cuda_graph, backward, padded)
                    for backward, padded in ((False, False), (False, True), (True, False))]
    fallbacks = [m for m in watch.messages if "flash_attention" in m]
    results.append(report(not fallbacks, "kernel ran (no SDPA fallback)", "; ".join(fallbacks)))
    logging.getLogger("lorafuse").removeHandler(watch)
    failed = results.count(False)
    print(f"correctness: {len(results) - failed} passed, {failed} failed ({time.perf_counter() - start:.0f} s)")
    return not failed


# ------------------------------------------------------------------------------------------------
# Timing

def graphed_provider(provider, fn, what):
    """fn under the provider's back-end, captured in a CUDA graph: its replay, or None, reported, if the provider fails
    on this input. Providers are then timed alternating call by call (benchmarks.common.time_alternating): timed one
    after the other, identical kernels read several percent apart (benchmarks.common.time_alternating)."""
    try:
        with backend_of(provider):
            fn()  # an unsupported input raises here, before capture
            return capture(fn)[0].replay
    except Exception as exc:
        print(f"  {provider:14} {what}: skipped ({type(exc).__name__}: {str(exc).strip().splitlines()[0][:100]})")
        torch.cuda.empty_cache()
        return None


def eager_gib(b, h, n, mode):
    # live N x N bf16 tensors at the peak: scores, masked scores, probs (fwd); plus grads (fwd_bwd)
    return b * h * n * n * 2 * (3 if mode == "fwd" else 6) / 2 ** 30


def rows_of(env, shape, times, work, metric):
    """CSV rows from times {(provider, mode): (median, p20, p80)} and work {mode: flops or bytes}."""
    rows = []
    for (provider, mode), (med, p20, p80) in times.items():
        base = times.get((BASELINE, mode))
        rows.append(dict(env, bench="attention", shape=shape, provider=provider, mode=mode, median_ms=med,
                         p20_ms=p20, p80_ms=p80, metric=metric, value=work[mode] / med / PER_MS[metric],
                         baseline=BASELINE if base else "", ratio=med / base[0] if base else ""))
    return rows


def timed_call(provider, mode, q, k, v, do, causal):
    fn = attend(provider)
    if mode == "fwd":
        return lambda: fn(q, k, v, causal)
    # the autograd graph is built inside the timed call: nothing is retained between calls
    return lambda: torch.autograd.grad(fn(q, k, v, causal), (q, k, v), do)


def bench_shape(env, b, n, d, causal, device="cuda"):
    """Every provider, fwd and fwd_bwd, on one [B, H, N, D] bf16 shape."""
    shape = f"B{b}_H{HEADS}_N{n}_D{d}_{'causal' if causal else 'full'}"
    q, k, v, do = (torch.randn(b, HEADS, n, d, device=device, dtype=torch.bfloat16) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    calls = {}
    for mode in ("fwd", "fwd_bwd"):
        for provider in PROVIDERS:
            if provider == "eager" and eager_gib(b, HEADS, n, mode) > EAGER_LIMIT_GIB:
                print(f"  {'eager':14} {shape} {mode}: skipped (~{eager_gib(b, HEADS, n, mode):.0f} GiB of N x N "
                      f"tensors > {EAGER_LIMIT_GIB} GiB)")
                continue
            replay = graphed_provider(provider, timed_call(provider, mode, q, k, v, do, causal), f"{shape} {mode}")
            if replay is not None:
                calls[(provider, mode)] = replay
    times = time_alternating(calls, rounds=50)
    del calls  # the graphs' memory, the eager provider's N x N blocks among it
    flops = 4 * b * HEADS * n * n * d * (0.5 if causal else 1)
    torch.cuda.empty_cache()
    return rows_of(env, shape, times, {"fwd": flops, "fwd_bwd": 3.5 * flops}, "TFLOPs")


def bench_grid(env, quick, device="cuda"):
    rows = []
    for d in QUICK_D if quick else GRID_D:
        for n in QUICK_N if quick else GRID_N:
            for causal in (True, False):
                print(f"timing B{TOKENS // n} H{HEADS} N{n} D{d} {'causal' if causal else 'full'}", flush=True)
                rows += bench_shape(env, TOKENS // n, n, d, causal, device)
    return rows


def bench_decode(env, device="cuda"):
    """One decode step: 1 query per sequence, a full K/V cache (K/V larger than L2), GQA."""
    b, hq, hkv, n_k, d = (DECODE[key] for key in ("b", "hq", "hkv", "nk", "d"))
    shape = f"B{b}_Hq{hq}_Hkv{hkv}_Nq1_Nk{n_k}_D{d}_decode"
    print(f"timing {shape}", flush=True)
    q = torch.randn(b, hq, 1, d, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(b, hkv, n_k, d, device=device, dtype=torch.bfloat16) for _ in range(2))
    times, calls = {}, {}
    for provider in ("lorafuse", *SDPA_BACKENDS):
        # causal with one query at the end sees every key; SDPA's is_causal would align it to key 0
        fn = (lambda: flash_attention(q, k, v, causal=True)) if provider == "lorafuse" else (
            lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        with torch.no_grad():
            replay = graphed_provider(provider, fn, f"{shape} decode_graph")
            if replay is None:
                continue
            calls[(provider, "decode_graph")] = replay
            with backend_of(provider):  # eager calls: the launch overhead a host-bound decode step sees
                times[(provider, "decode")] = time_ms(fn, rep_ms=REP_MS)
    times.update(time_alternating(calls))
    kv_bytes = 2 * k.numel() * k.element_size()
    return rows_of(env, shape, times, {"decode": kv_bytes, "decode_graph": kv_bytes}, "GBps")


def print_summary(rows):
    names = {"lorafuse": "lorafuse", "sdpa_flash": "flash", "sdpa_cudnn": "cudnn", "sdpa_efficient": "efficient",
             "eager": "eager"}
    print(f"\n{'shape':36} {'mode':12} " + " ".join(f"{names[p]:>9}" for p in PROVIDERS) + f" {'lf/flash':>9}")
    for shape, mode in dict.fromkeys((r["shape"], r["mode"]) for r in rows):
        by = {r["provider"]: r for r in rows if r["shape"] == shape and r["mode"] == mode}
        cells = [f"{by[p]['value']:9.1f}" if p in by else f"{'-':>9}" for p in PROVIDERS]
        lf = by.get("lorafuse")
        speedup = f"{1 / lf['ratio']:8.2f}x" if lf and lf["ratio"] != "" else f"{'-':>9}"
        print(f"{shape:36} {mode:12} " + " ".join(cells) + f" {speedup}")
    print("(TFLOP/s; decode rows: GB/s of K/V read; lf/flash = sdpa_flash time / lorafuse time)")


def out_dirs(args):
    if args.out:
        return args.out
    dirs = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")]
    if os.environ.get("OUT"):
        dirs.append(os.environ["OUT"])
    return dirs


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check-only", action="store_true", help="run the correctness checks, then stop")
    parser.add_argument("--quick", action="store_true", help="time N=2048 D=128 only (and the decode row)")
    parser.add_argument("--out", action="append", metavar="DIR",
                        help="write attention.csv under DIR (repeatable) instead of benchmarks/results and $OUT")
    args = parser.parse_args()
    ok = run_checks("cuda", correctness_cases())
    if args.check_only or not ok:  # timings of wrong kernels are not results
        sys.exit(0 if ok else 1)
    env = environment()
    start, watch = time.perf_counter(), LogWatch()
    rows = bench_grid(env, args.quick) + bench_decode(env)
    if watch.messages:
        print("WARNING: lorafuse fell back to SDPA while timing; its rows time the fallback")
    dirs = out_dirs(args)
    write_rows(rows, "attention", dirs)
    print(f"timing: {time.perf_counter() - start:.0f} s; rows appended to "
          + ", ".join(os.path.join(d, "attention.csv") for d in dirs))
    print_summary(rows)


if __name__ == "__main__":
    main()
