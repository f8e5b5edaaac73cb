"""Is the fused LoRA layer nearly free? lorafuse vs PEFT's LoRA Linear vs the frozen base linear.

    python benchmarks/bench_lora_layer.py                 # checks, then the issue's table
    python benchmarks/bench_lora_layer.py --sweep         # also time GEMM tile configs vs cuBLAS
    python benchmarks/bench_lora_layer.py --no-compiled   # skip torch.compile of PEFT (slow to build)
    python benchmarks/bench_lora_layer.py --check-only    # correctness on the GPU, no timing
    python benchmarks/bench_lora_layer.py --decode-only   # checks, then decode sizes only
    python benchmarks/bench_lora_layer.py --no-decode     # checks, then training sizes only
    python benchmarks/bench_lora_layer.py --profile       # also each training shape's kernels (base, lorafuse)
    python benchmarks/bench_lora_layer.py --no-check --sweep-decode  # lora_decode launch configs, nothing else

Providers: base (the frozen nn.Linear alone: the floor), peft, peft_compiled, lorafuse
(`lorafuse.fuse` on the same PeftModel: defaults, PEFT's float32 adapters computed exactly),
lorafuse_fast (LORAFUSE_ADAPTER_MATH=fast: adapter products in bf16), and lorafuse_triton /
lorafuse_cublas (the two GEMM back-ends forced). bf16, r=16, 8192 tokens, forward and
forward+backward (frozen base weight, input requiring grad); decode sizes forward only, with two more
providers there: lorafuse_bf16 (the adapters cast to bf16, as lorafuse.inference.Engine serves them) and
lorafuse_matmul (that, with the single Triton GEMM that fuses the shrink into its K-loop, LORAFUSE_GEMM=triton).
Modes: fwd and fwd_bwd are eager calls of the one layer; fwd_graph and fwd_bwd_graph the same calls replayed from a
CUDA graph, the GPU time alone (an eager call of one layer also waits on Python and the kernel launchers, which a
model's many layers hide as the host runs ahead of the GPU), timed alternating call by call across providers
(benchmarks.common.time_alternating).
Rows go to benchmarks/results/lora_layer.csv (and $OUT when set); ratio = time / base time.
"""
import argparse
import copy
import os
import sys
from unittest import mock

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import capture, environment, print_profile, time_alternating, time_ms, write_rows  # noqa: E402

import lorafuse  # noqa: E402
from lorafuse.ops import lora_linear_reference  # noqa: E402
from lorafuse.ops.lora.linear import lora_linear  # noqa: E402
from lorafuse.ops.lora.matmul import lora_matmul  # noqa: E402

TRAIN_SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (2048, 8192)]
TOKENS = 8192
RANK = 16


class One(nn.Module):
    def __init__(self, k, n):
        super().__init__()
        self.proj = nn.Linear(k, n, bias=False)

    def forward(self, x):
        return self.proj(x)


def peft_model(k, n, p, dtype):
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(One(k, n).cuda().to(dtype), LoraConfig(r=RANK, lora_alpha=32, lora_dropout=p,
                                                                   target_modules=["proj"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(param, std=0.02)  # a real adapter path, not an exact no-op
    return model


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check_correctness():
    """Kernels vs the float64 reference: fp32 tight; bf16 within 2x PyTorch's own bf16 error."""
    torch.manual_seed(0)
    failures = []
    M, K, N, r = 1023, 1000, 1500, 16
    for gemm in ("triton", "cublas"):
        for p in (0.0, 0.1):
            for act in ("identity", "silu"):
                for dtype, adapter_dtype in ((torch.float32, None), (torch.bfloat16, None),
                                             (torch.bfloat16, torch.float32)):  # PEFT's default: fp32 adapters
                    for rows in (M, 7):
                        x = torch.randn(rows, K, device="cuda")
                        w, b = torch.randn(N, K, device="cuda") / K ** 0.5, torch.randn(N, device="cuda")
                        A, B = torch.randn(r, K, device="cuda") / K ** 0.5, torch.randn(N, r, device="cuda") * 0.1
                        g = torch.randn(rows, N, device="cuda")
                        seed = torch.tensor([987654321], device="cuda")

                        def run(fn, dt, **kw):
                            adt = adapter_dtype if adapter_dtype and dt != torch.float64 else dt
                            leaves = [t.to(d).requires_grad_() for t, d in ((x, dt), (b, dt), (A, adt), (B, adt))]
                            xx, bb, AA, BB = leaves
                            y = fn(xx, w.to(dt), bb, AA, BB, 0.5, p, act, seed, **kw)
                            return [y] + list(torch.autograd.grad(y, leaves, g.to(dt)))

                        ref = run(lora_linear_reference, torch.float64)
                        got = run(lora_linear, dtype, gemm=gemm)
                        plain = run(lora_linear_reference, dtype)
                        for name, o, t, pl in zip(("y", "dx", "dbias", "dA", "dB"), got, ref, plain):
                            e, e_torch = rel_err(o, t), rel_err(pl, t)
                            bound = 1e-5 if dtype == torch.float32 else 2 * e_torch + 1e-6
                            if not (e <= bound):  # NaN fails here too
                                failures.append(f"{gemm} p={p} {act} {dtype}/{adapter_dtype} M={rows} {name}: "
                                                f"{e:.2e} > {bound:.2e}")
    # Decoding (no gradient, <= 16 rows, no dropout): lora_decode's kernels, as a CUDA-graph capture runs them (eager
    # calls of so few rows take PyTorch's launches).
    for dtype, adapter_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                 (torch.bfloat16, torch.float32)):
        for rows, act in ((1, "identity"), (7, "silu"), (16, "gelu")):
            x, w, b = torch.randn(rows, K, device="cuda"), torch.randn(N, K, device="cuda") / K ** 0.5, None
            A, B = torch.randn(r, K, device="cuda") / K ** 0.5, torch.randn(N, r, device="cuda") * 0.1

            def infer(fn, dt, adt):
                with torch.no_grad(), mock.patch("lorafuse.ops.lora.linear._launch_bound", lambda x: False):
                    return fn(x.to(dt), w.to(dt), b, A.to(adt), B.to(adt), 0.5, 0.0, act)

            ref = infer(lora_linear_reference, torch.float64, torch.float64)
            e = rel_err(infer(lora_linear, dtype, adapter_dtype), ref)
            e_torch = rel_err(infer(lora_linear_reference, dtype, adapter_dtype), ref)
            bound = 1e-5 if dtype == torch.float32 else 2 * e_torch + 1e-6
            if not (e <= bound):
                failures.append(f"decode {act} {dtype}/{adapter_dtype} M={rows} y: {e:.2e} > {bound:.2e}")
    # One CUDA-graph capture of forward+backward replays what eager computed: bit for bit under deterministic
    # algorithms; else within float32 rounding, as split sums add with atomics in no fixed order (tiles.partial_sums).
    layer = lorafuse.LoraLinear(nn.Linear(1000, 1500).cuda().to(torch.bfloat16), r=16, lora_alpha=32)
    nn.init.normal_(layer.lora_B["default"].weight, std=0.02)
    x = torch.randn(512, 1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(512, 1500, device="cuda", dtype=torch.bfloat16)
    for deterministic in (True, False):
        torch.use_deterministic_algorithms(deterministic, warn_only=True)
        try:
            eager = torch.autograd.grad(layer(x), [x, layer.lora_A["default"].weight], gy)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    torch.autograd.grad(layer(x), [x, layer.lora_A["default"].weight], gy)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = torch.autograd.grad(layer(x), [x, layer.lora_A["default"].weight], gy)
            graph.replay()
            torch.cuda.synchronize()
        finally:
            torch.use_deterministic_algorithms(False)
        for e, c in zip(eager, captured):
            if not (torch.equal(e, c) if deterministic else rel_err(c, e) <= 1e-4):
                failures.append(f"CUDA graph replay differs from eager (deterministic {deterministic}): "
                                f"{rel_err(c, e):.2e}")
    # Inside a torch.compile'd model (inductor) the layer gives eager's numbers (up to the atomics' order, as above).
    model = nn.Sequential(nn.LayerNorm(1000).cuda().to(torch.bfloat16), layer)
    eager = model(x)
    torch._dynamo.reset()
    compiled = torch.compile(model)(x)
    if not rel_err(compiled, eager) <= 1e-4:
        failures.append(f"torch.compile'd model differs from eager: {rel_err(compiled, eager):.2e}")
    print("correctness:", "all passed" if not failures else f"{len(failures)} FAILED")
    for f in failures:
        print("  FAIL", f)
    return not failures


def sweep_configs():
    """lora_matmul tile configs vs cuBLAS on the training shapes (forward y and backward dx)."""
    configs = [(128, 256, 64, 8, 8, 3), (128, 256, 64, 8, 8, 4), (128, 128, 64, 8, 8, 4), (128, 128, 64, 8, 4, 4),
               (128, 256, 128, 8, 8, 2)]
    print("\nGEMM sweep: ms (ratio to cuBLAS)")
    for k, n in TRAIN_SHAPES:
        x = torch.randn(TOKENS, k, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(TOKENS, n, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        A = torch.randn(RANK, k, device="cuda", dtype=torch.bfloat16)
        B = torch.randn(n, RANK, device="cuda", dtype=torch.bfloat16)
        s = torch.randn(TOKENS, RANK, device="cuda")
        fwd_cublas = time_ms(lambda: x @ w.t())[0]
        bwd_cublas = time_ms(lambda: g @ w)[0]
        line = [f"K{k}_N{n}: cuBLAS fwd {fwd_cublas:.3f} bwd {bwd_cublas:.3f}"]
        for cfg in configs:
            try:
                f = time_ms(lambda: lora_matmul(x, w.t(), s, B.t(), 2.0, config=cfg))[0]
                b = time_ms(lambda: lora_matmul(g, w, s, A, 1.0, config=cfg))[0]
                line.append(f"  {cfg}: fwd {f:.3f} ({f / fwd_cublas:.2f}) bwd {b:.3f} ({b / bwd_cublas:.2f})")
            except Exception as exc:  # a config that does not fit shared memory
                line.append(f"  {cfg}: {type(exc).__name__} {str(exc)[:80]}")
        print("\n".join(line))


def sweep_decode():
    """lora_decode launch configs at decode sizes (4 and 16 rows): GPU time per call replayed from a CUDA graph over
    layer copies whose weights rotate past the L2, against cuBLAS's GEMM alone (the base); bf16 and fp32 adapters."""
    from lorafuse.ops.lora.decode import MAX_SPLITS, lora_decode
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print("\ndecode sweep: us per call (ratio to the base GEMM); the default, then the best configs")
    for (k, n), m, adapter_dtype in ((shape, m, a) for shape in DECODE_SHAPES for m in (4, 16)
                                     for a in (torch.bfloat16, torch.float32)):
        copies = max(8, 256 * 2**20 // (k * n * 2))
        layers = [(torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
                   torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5,
                   (torch.randn(RANK, k, device="cuda") / k ** 0.5).to(adapter_dtype),
                   (torch.randn(n, RANK, device="cuda") * 0.02).to(adapter_dtype)) for _ in range(copies)]

        def us(fn):
            graph = capture(lambda: [fn(*layer) for layer in layers])[0]
            return time_ms(graph.replay, rep_ms=50)[0] / copies * 1e3

        # (BLOCK_N, BLOCK_K, splits, num_warps, num_stages), splits for about 0.7, 1.5 or 2.5 programs per SM
        configs = sorted({(bn, bk, max(1, min(round(per_sm * sms / -(-n // bn)), k // (2 * bk), MAX_SPLITS)), 4, 4)
                          for bn in (32, 64) for bk in (128, 256) for per_sm in (0.7, 1.5, 2.5)})
        base = us(lambda x, w, a, b: x @ w.t())
        timed = sorted((us(lambda x, w, a, b, c=cfg: lora_decode(x, w, None, a, b, 2.0, config=c)), cfg)
                       for cfg in configs)
        default = us(lambda x, w, a, b: lora_decode(x, w, None, a, b, 2.0))
        print(f"  M{m}_K{k}_N{n} {str(adapter_dtype)[6:]} adapters: base {base:.1f}, default {default:.1f} "
              f"({default / base:.2f}); " + ", ".join(f"{cfg} {t:.1f} ({t / base:.2f})" for t, cfg in timed[:3]))


def breakdown():
    """Each kernel of the layer alone (ms), against the passes it is meant to cost."""
    from lorafuse.ops.lora.expand import lora_expand, lora_expand_backward
    from lorafuse.ops.lora.shrink import lora_shrink, lora_shrink_backward
    print("\nbreakdown (ms); 'pass' = one read or write of the [M, N] / [M, K] tensor at 4.1 TB/s")
    for k, n in TRAIN_SHAPES:
        x = torch.randn(TOKENS, k, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(TOKENS, n, device="cuda", dtype=torch.bfloat16)
        A = torch.randn(RANK, k, device="cuda", dtype=torch.bfloat16)
        B = torch.randn(n, RANK, device="cuda", dtype=torch.bfloat16)
        s = torch.randn(TOKENS, RANK, device="cuda")
        y = torch.empty(TOKENS, n, device="cuda", dtype=torch.bfloat16)
        dx = torch.empty_like(x)
        seed = torch.tensor([1], device="cuda")
        parts = {
            "shrink": lambda: lora_shrink(x, A),
            "shrink_p": lambda: lora_shrink(x, A, 0.05, seed),
            "expand_prewrite": lambda: lora_expand(None, s, B, 2.0, out=y),
            "expand_bwd": lambda: lora_expand_backward(g, None, s, B, 2.0),
            "cublas_ds_dB": lambda: (g @ B, g.t() @ s.to(g.dtype)),
            "shrink_bwd": lambda: lora_shrink_backward(s, x, A),
            "shrink_bwd_p": lambda: lora_shrink_backward(s, x, A, 0.05, seed),
            "shrink_bwd_dx": lambda: lora_shrink_backward(s, x, A, dx_out=dx),
            "shrink_bwd_p_dx": lambda: lora_shrink_backward(s, x, A, 0.05, seed, dx_out=dx),
        }
        if (k, n) == (4096, 4096):  # launch-config sweep of the memory-bound kernels on one shape
            for cfg in [(16, 128, 4, 3, 132), (32, 128, 4, 3, 132), (32, 128, 4, 4, 132), (64, 64, 4, 3, 132),
                        (64, 128, 4, 5, 132), (64, 128, 4, 4, 264)]:
                parts[f"shrink{cfg}"] = lambda cfg=cfg: lora_shrink(x, A, config=cfg)
                parts[f"shrink_p{cfg}"] = lambda cfg=cfg: lora_shrink(x, A, 0.05, seed, config=cfg)
            for cfg in [(64, 128, 4, 3, 264), (128, 128, 8, 3, 264), (64, 64, 4, 3, 528), (32, 128, 4, 3, 528),
                        (64, 256, 8, 3, 264)]:
                parts[f"expand_bwd{cfg}"] = lambda cfg=cfg: lora_expand_backward(g, None, s, B, 2.0, config=cfg)
            for cfg in [(64, 128, 4, 3, 264), (128, 64, 4, 3, 264), (64, 64, 4, 3, 528), (32, 128, 4, 3, 528),
                        (64, 128, 8, 3, 528)]:
                parts[f"shrink_bwd{cfg}"] = lambda cfg=cfg: lora_shrink_backward(s, x, A, config=cfg)
                parts[f"shrink_bwd_p_dx{cfg}"] = lambda cfg=cfg: lora_shrink_backward(s, x, A, 0.05, seed, dx_out=dx,
                                                                                       config=cfg)
        mk, mn = TOKENS * k * 2 / 4.1e9, TOKENS * n * 2 / 4.1e9
        print(f"K{k}_N{n}: pass MK {mk:.3f} MN {mn:.3f}")
        for name, fn in parts.items():
            print(f"    {name:40} {time_ms(fn)[0]:.3f}")


def graph_of(call, name, mode):
    """`call` captured in a CUDA graph, or None (said) where it cannot be captured."""
    try:
        return capture(call)[0]
    except Exception as exc:  # e.g. a compiled provider that does not capture
        print(f"  {name} {mode}: no graph timing ({type(exc).__name__}: {str(exc).splitlines()[0][:80]})")
        torch.cuda.synchronize()
        return None


def bench_training(env, compiled, profile=False):
    rows = []
    for k, n in TRAIN_SHAPES:
        for p in (0.0, 0.05):
            shape = f"M{TOKENS}_K{k}_N{n}_r{RANK}_p{p}"
            torch.manual_seed(0)
            peft = peft_model(k, n, p, torch.bfloat16).train()
            base = peft.base_model.model.proj.base_layer
            fused = lorafuse.fuse(copy.deepcopy(peft)).train()
            x = torch.randn(TOKENS, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            gy = torch.randn(TOKENS, n, device="cuda", dtype=torch.bfloat16)
            providers = {"base": (base, {}), "peft": (peft, {}), "lorafuse": (fused, {}),
                         "lorafuse_fast": (fused, {"LORAFUSE_ADAPTER_MATH": "fast"}),
                         "lorafuse_triton": (fused, {"LORAFUSE_GEMM": "triton"}),
                         "lorafuse_cublas": (fused, {"LORAFUSE_GEMM": "cublas"})}
            if compiled:
                providers["peft_compiled"] = (torch.compile(peft), {})
            # Eager calls of one layer wait on Python and the launchers between kernels (a model's layers hide that:
            # the host runs ahead). The same calls replayed from CUDA graphs give the GPU time alone: the rows the
            # targets are read from, timed alternating call by call across providers.
            times, graphs = {}, {}
            for name, (model, settings) in providers.items():
                params = [x] + [q for q in model.parameters() if q.requires_grad]
                calls = {"fwd": lambda: model(x), "fwd_bwd": lambda: torch.autograd.grad(model(x), params, gy)}
                with mock.patch.dict(os.environ, settings):
                    for mode, call in calls.items():
                        times[(name, mode)] = time_ms(call)
                        graph = graph_of(call, name, mode)
                        if graph is not None:
                            graphs[(name, f"{mode}_graph")] = graph.replay
            times.update(time_alternating(graphs))
            if profile:
                for name in ("base", "lorafuse"):
                    model = providers[name][0]
                    params = [x] + [q for q in model.parameters() if q.requires_grad]
                    print_profile(f"{shape} {name} fwd+bwd (eager calls, ms per call)",
                                  lambda: torch.autograd.grad(model(x), params, gy), steps=5, kernels=12)
            for (name, mode), (med, p20, p80) in times.items():
                if ("base", mode) not in times:
                    continue
                flops = 2 * TOKENS * k * n * (2 if mode.startswith("fwd_bwd") else 1)
                rows.append(dict(env, bench="lora_layer", shape=shape, provider=name, mode=mode, median_ms=med,
                                 p20_ms=p20, p80_ms=p80, metric="TFLOPs", value=flops / med / 1e9, baseline="base",
                                 ratio=med / times[("base", mode)][0]))
    return rows


DECODE_SHAPES = [(4096, 4096), (2048, 2048), (2048, 512), (2048, 8192), (8192, 2048)]  # (K, N); then Llama-1B's


def bench_decode(env):
    # torch.compile would build one graph per rotated layer copy: decode compares eager PEFT only.
    rows = []
    for (k, n), m in ((shape, m) for shape in DECODE_SHAPES for m in (1, 16)):
        copies = max(8, 256 * 2**20 // (k * n * 2))  # layers whose weights rotate past the L2
        shape = f"M{m}_K{k}_N{n}_r{RANK}_p0.0"
        peft = [peft_model(k, n, 0.0, torch.bfloat16).eval() for _ in range(copies)]
        fused = [lorafuse.fuse(copy.deepcopy(p)) for p in peft]
        fused_bf16 = [copy.deepcopy(f).to(torch.bfloat16) for f in fused]
        providers = {"base": [p.base_model.model.proj.base_layer for p in peft], "peft": peft, "lorafuse": fused,
                     "lorafuse_fast": fused, "lorafuse_bf16": fused_bf16, "lorafuse_matmul": fused_bf16}
        xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        times, graphs = {}, {}
        for name, models in providers.items():
            step = [0]

            def call():
                i = step[0] = (step[0] + 1) % copies
                return models[i](xs[i])

            def call_all():
                return [model(x) for model, x in zip(models, xs)]

            settings = {"lorafuse_fast": {"LORAFUSE_ADAPTER_MATH": "fast"},
                        "lorafuse_matmul": {"LORAFUSE_GEMM": "triton"}}.get(name, {})
            with torch.no_grad(), mock.patch.dict(os.environ, settings):
                times[(name, "fwd")] = time_ms(call)
                # The same calls replayed from a CUDA graph: GPU time without Python launch overhead.
                graphs[(name, "fwd_graph")] = capture(call_all)[0].replay
        for key, (med, p20, p80) in time_alternating(graphs).items():
            times[key] = (med / copies, p20 / copies, p80 / copies)
        for (name, mode), (med, p20, p80) in times.items():
            rows.append(dict(env, bench="lora_layer", shape=shape, provider=name, mode=mode, median_ms=med,
                             p20_ms=p20, p80_ms=p80, metric="GBps", value=k * n * 2 / med / 1e6, baseline="base",
                             ratio=med / times[("base", mode)][0]))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--no-compiled", action="store_true")
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument("--check-only", action="store_true")
    parser.add_argument("--decode-only", action="store_true")
    parser.add_argument("--no-decode", action="store_true", help="training rows only")
    parser.add_argument("--profile", action="store_true", help="also print base's and lorafuse's kernels per "
                        "training shape (torch.profiler)")
    parser.add_argument("--sweep-decode", action="store_true")
    args = parser.parse_args()
    ok = True if args.no_check else check_correctness()
    if args.check_only or not ok:  # timings of wrong kernels are not results
        sys.exit(0 if ok else 1)
    if args.sweep:
        sweep_configs()
    if args.breakdown:
        breakdown()
    if args.sweep_decode:
        sweep_decode()
        return
    env = environment()
    rows = (([] if args.decode_only else bench_training(env, not args.no_compiled, args.profile))
            + ([] if args.no_decode else bench_decode(env)))
    out_dirs = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")]
    if os.environ.get("OUT"):
        out_dirs.append(os.environ["OUT"])
    write_rows(rows, "lora_layer", out_dirs)
    print(f"\n{'shape':34} {'mode':9} " + " ".join(f"{p:>16}" for p in
                                                   ("peft", "peft_compiled", "lorafuse", "lf_fast", "lf_triton",
                                                    "lf_cublas", "lf_bf16", "lf_matmul")))
    names = ("peft", "peft_compiled", "lorafuse", "lorafuse_fast", "lorafuse_triton", "lorafuse_cublas",
             "lorafuse_bf16", "lorafuse_matmul")
    keys = sorted({(r["shape"], r["mode"]) for r in rows}, key=lambda t: (t[0].startswith("M1"), t))
    for shape, mode in keys:
        by = {r["provider"]: r for r in rows if r["shape"] == shape and r["mode"] == mode}
        cells = [f"{by[p]['ratio']:6.3f}x {by[p]['median_ms']:7.3f}" if p in by else f"{'-':>16}" for p in names]
        print(f"{shape:34} {mode:9} " + " ".join(cells))
    print("(ratio to base, median ms)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
