"""Does a whole LoRA training step get faster? PEFT vs PEFT + Liger-Kernel vs lorafuse on Llama shapes.

    python benchmarks/bench_train_step.py                # llama1B and llama8B_L8 (a few minutes on an H200)
    python benchmarks/bench_train_step.py --quick        # llama1B only
    python benchmarks/bench_train_step.py --out DIR      # rows to DIR/train_step.csv instead of the defaults

Method: that of anchors/baseline.py (`train` section), so that numbers compare with the anchors (H200,
2026-11-21: peft 34.4k tokens/s, 38.0 GiB; peft+liger 41.6k tokens/s, 21.9 GiB on llama1B). A
LlamaForCausalLM built from its config with random weights, created in bf16 on the GPU (no download;
the anchors drew them in fp32 and cast);
PEFT LoRA r=16, alpha 32, dropout 0.05 on all seven projections (q, k, v, o, gate, up, down); AdamW
(lr 1e-4) on the LoRA parameters; no gradient checkpointing; one fixed batch of uniform random token
ids, labels = input ids; a step = forward with labels, loss.backward(), optimizer.step(),
optimizer.zero_grad(set_to_none=True). Shapes (batch 4 x 2048 tokens):

    llama1B     Llama-3.2-1B: hidden 2048, 16 layers, 32 heads / 8 KV heads (head dim 64), MLP 8192,
                vocab 128256, tied embeddings, rope theta 500000 (the anchors' model)
    llama8B_L8  Llama-3.1-8B with 8 of its 32 layers: hidden 4096, 32 / 8 heads (head dim 128), MLP 14336,
                vocab 128256, untied lm_head (--quick leaves it out; out of memory -> skipped, said so)

Providers, each on a fresh model (previous one freed, CUDA cache emptied, peak stats reset), same seed:
  peft        PEFT's LoRA layers, attn_implementation="sdpa" (the baseline)
  lorafuse    lorafuse.get_peft_model with its defaults: fused LoRA layers, attn_implementation="lorafuse",
              RMSNorm and SwiGLU on lorafuse's kernels
  lorafuse_layers_attention  fused LoRA layers and lorafuse attention, transformers' RMSNorm and MLP
  lorafuse_layers  fused LoRA layers only, attention left at "sdpa": what each part of lorafuse brings
  peft_liger  peft after liger_kernel.transformers.apply_liger_kernel_to_llama(model=model) with its
              defaults (rope, RMSNorm, SwiGLU, fused linear cross-entropy), as the anchors; runs last and its
              patches of transformers' llama module are undone afterwards; skipped if liger is missing

Check before timing: lora_B starts N(0, 0.02) instead of PEFT's zeros (the same draw for every provider)
so that the adapter path is exercised; one training forward+backward, the LoRA dropout modules' p set to
0 for it (PEFT and lorafuse draw different masks), gives the first loss and the LoRA gradients. Each
provider is compared with peft: loss relative difference, and gradient relative error
||g - g_peft|| / ||g_peft|| over all LoRA parameters. lorafuse beyond LOSS_RTOL (2e-2) or GRAD_RTOL (0.1)
prints FAIL, is not timed, and the script exits 1; peft_liger's figures are printed (WARN when beyond)
as a yardstick of what a legitimate bf16 difference is. A provider that raises is reported (exit 1).
lorafuse's model is inspected (LoRA layers of class FusedLoraLinear, attn_implementation "lorafuse") and
what lorafuse logs (a layer or an attention call falling back to PEFT or sdpa) is printed; either kind of
shortfall is flagged in the summary.

Timing: WARMUP (3) training steps (Triton compiles), then STEPS (10) steps, one CUDA event between
consecutive steps (no host sync inside the loop, as the anchors' wall-clock loop), synchronize at the end.
  median_ms, p20_ms, p80_ms   per-step times
  tokens_per_s                batch * seq / mean step time (the anchors' definition)
  peak_GiB                    torch.cuda.max_memory_allocated() / 2^30 over the timed steps (peak stats
                              reset after the warm-up, as the anchors): weights, optimizer state, activations
  MFU                         model FLOP/s / measured peak: FLOPs per step / mean step time, over the bf16
                              matmul rate measured in the same run (8192^3 torch.matmul, median of do_bench),
                              stored as a fraction (printed as %); FLOPs per token, frozen base weights:
        4 * P_frozen                 forward 2 + input gradient 2, no weight gradient; P_frozen = the
                                     projections' weights of every layer + the lm_head (vocab * hidden)
      + 6 * r * sum(in + out)        LoRA, every adapted projection: forward 2, backward dA, dB, dx 4
      + 6 * L * T * Hq * head_dim    causal attention, forward 4*T*Hq*D halved, backward 2x forward
                                     (no recomputation counted), T = sequence length
    (norms, rope, SwiGLU, softmax, cross-entropy and the optimizer are not counted; layer 0's q/k/v input
    gradient, counted, is never computed: < 0.3%). llama1B: 5.41 GFLOP/token; llama8B_L8: 9.55.
Rows: benchmarks/results/train_step.csv (and $OUT when set; --out replaces both), bench and mode
`train_step`, shape `<model>_B4_T2048_r16`, one row per metric per provider. baseline = peft;
ratio = median step time / peft's median step time on every row, peak_GiB's included (DESIGN's ratio of
times: the summary prints the memory ratio).
"""
import argparse
import contextlib
import gc
import math
import os
import sys
import time
import traceback
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import LogWatch, environment, print_profile, time_ms, write_rows  # noqa: E402

import lorafuse  # noqa: E402

LLAMA = dict(max_position_embeddings=4096, rope_theta=500000.0, attn_implementation="sdpa")
SHAPES = {
    "llama1B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "llama8B_L8": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=8, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    # --tiny (CPU dry run of the script itself)
    "tiny": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
}
QUICK_SHAPES = ("llama1B",)
BATCH, SEQ = 4, 2048
TINY_BATCH, TINY_SEQ = 2, 64
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=TARGETS)
LR = 1e-4
LORA_B_STD = 0.02
WARMUP, STEPS = 3, 10
# liger last: it patches transformers' llama module
PROVIDERS = ("peft", "lorafuse", "lorafuse_layers_attention", "lorafuse_layers", "peft_liger")
BASELINE = "peft"
LOSS_RTOL, GRAD_RTOL = 2e-2, 0.1
MATMUL_N = 8192


# ------------------------------------------------------------------------------------------------
# Models

@contextlib.contextmanager
def liger_patches_undone():
    """apply_liger_kernel_to_llama swaps functions and classes in transformers' llama module (rope,
    RMSNorm, MLP): put them back afterwards so that later models are stock again."""
    from transformers.models.llama import modeling_llama
    namespaces = [modeling_llama, modeling_llama.LlamaForCausalLM]
    saved = [dict(vars(ns)) for ns in namespaces]
    try:
        yield
    finally:
        for ns, before in zip(namespaces, saved):
            for name in [n for n in vars(ns) if n not in before]:
                delattr(ns, name)
            for name, value in before.items():
                if vars(ns).get(name) is not value:
                    setattr(ns, name, value)


def build(provider, shape, device, dtype):
    """A fresh LoRA Llama for `provider`: same weights, same adapters for every provider."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig
    config = LlamaConfig(**LLAMA, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if provider == "peft_liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama(model=model)  # the anchors' call: defaults
    lora_config = LoraConfig(**LORA)
    if provider == "lorafuse":
        model = lorafuse.get_peft_model(model, lora_config)
    elif provider == "lorafuse_layers_attention":
        model = lorafuse.get_peft_model(model, lora_config, model_kernels=False)
    elif provider == "lorafuse_layers":
        model = lorafuse.get_peft_model(model, lora_config, attention=False, model_kernels=False)
    else:
        model = get_peft_model(model, lora_config)
    generator = torch.Generator(device).manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, LORA_B_STD, generator=generator)
    return model.train()


def flops_per_token(shape, seq, r=LORA["r"]):
    """Model FLOPs of one training token with frozen base weights (the formula of the docstring)."""
    c = SHAPES[shape]
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    head_dim = h // c["num_attention_heads"]
    q_out, kv_out = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    projections = {"q_proj": (h, q_out), "k_proj": (h, kv_out), "v_proj": (h, kv_out), "o_proj": (q_out, h),
                   "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}  # (in, out)
    frozen = layers * sum(k * n for k, n in projections.values()) + c["vocab_size"] * h
    lora = layers * sum(r * (k + n) for name, (k, n) in projections.items() if name in TARGETS)
    attention = layers * seq * q_out
    return 4 * frozen + 6 * lora + 6 * attention


def matmul_tflops(device):
    """Peak bf16 matmul rate of this device, measured now (TFLOP/s)."""
    n = MATMUL_N if device.type == "cuda" else 256
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    if device.type == "cuda":
        ms = time_ms(lambda: a @ b)[0]
    else:
        start = time.perf_counter()
        for _ in range(5):
            a @ b
        ms = (time.perf_counter() - start) / 5 * 1e3
    return 2 * n ** 3 / ms / 1e9


# ------------------------------------------------------------------------------------------------
# One provider: build, check, warm up, time

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def fusion_warnings(model):
    """What of lorafuse is not in `model`: LoRA layers left unfused, attention other than lorafuse's."""
    from peft.tuners.lora import Linear
    from lorafuse.hf import FusedLoraLinear
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    fused = sum(isinstance(m, FusedLoraLinear) for m in layers)
    attention = model.get_base_model().config._attn_implementation
    print(f"  lorafuse: {fused} of {len(layers)} LoRA layers fused, attn_implementation={attention!r}")
    warnings = [f"{len(layers) - fused} LoRA layers not fused"] if fused < len(layers) or not layers else []
    if attention != "lorafuse":
        warnings.append(f"attn_implementation={attention!r}")
    for warning in warnings:
        print(f"  WARNING lorafuse: {warning}")
    return warnings


def first_step(model, ids):
    """(loss, {name: grad}) of one training forward+backward with LoRA dropout 0, optimizer untouched."""
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    saved = [m.p for m in dropouts]
    for m in dropouts:  # p is read at each call, by nn.Dropout and by lorafuse alike
        m.p = 0.0
    try:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    finally:
        for m, p in zip(dropouts, saved):
            m.p = p
    grads = {name: p.grad.detach().float().cpu() for name, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def compare(got, ref):
    """(loss relative difference, gradient relative error, worst parameter) of `got` against `ref`."""
    loss_diff = abs(got["loss"] - ref["loss"]) / abs(ref["loss"])
    if got["grads"].keys() != ref["grads"].keys():
        return loss_diff, math.inf, "different LoRA parameter names"
    num = den = 0.0
    worst, worst_err = "", -1.0
    for name, g_ref in ref["grads"].items():
        err2, ref2 = (got["grads"][name] - g_ref).double().square().sum().item(), g_ref.double().square().sum().item()
        num, den = num + err2, den + ref2
        err = math.sqrt(err2 / ref2) if ref2 > 0 else (0.0 if err2 == 0 else math.inf)
        if not err <= worst_err:  # NaN is the worst
            worst, worst_err = f"{name} {err:.1e}", err
    grad_err = math.sqrt(num / den) if den > 0 else math.inf
    return loss_diff, grad_err, worst


def time_steps(step, n, device):
    """Per-step times (ms) of n consecutive steps; one event between steps, one sync at the end."""
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


def run_provider(provider, shape, ids, device, dtype, reference, warmup, steps, profile=False):
    """Result dict of one provider on one shape: status ok / FAIL, loss, grads and, when ok, timings."""
    free(device)
    model = build(provider, shape, device, dtype)
    warnings = fusion_warnings(model) if provider == "lorafuse" else []
    loss, grads = first_step(model, ids)
    result = {"provider": provider, "loss": loss, "grads": grads, "status": "ok", "warnings": warnings}
    if reference is None:
        note = "" if provider == BASELINE else " (no peft reference: unchecked)"
        print(f"  {provider}: first loss {loss:.5f}{note}")
    else:
        loss_diff, grad_err, worst = compare(result, reference)
        ok = loss_diff <= LOSS_RTOL and grad_err <= GRAD_RTOL
        result.update(loss_diff=loss_diff, grad_err=grad_err)
        verdict = "PASS" if ok else ("FAIL" if provider.startswith("lorafuse") else "WARN")
        print(f"  {verdict} {provider}: first loss {loss:.5f} (peft {reference['loss']:.5f}, rel. diff {loss_diff:.1e}"
              f" <= {LOSS_RTOL:g}?); LoRA gradients rel. error {grad_err:.2e} (<= {GRAD_RTOL:g}?), worst {worst}")
        if not ok and provider.startswith("lorafuse"):
            result["status"] = "FAIL"
            return result  # a wrong model is not timed
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)

    def step():
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return out.loss

    start = time.perf_counter()
    train_loss = [step().item()] + [step() for _ in range(warmup - 1)]  # the first training step's loss
    sync(device)
    warm_s = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = time_steps(step, steps, device)
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else float("nan")
    q = torch.tensor(times, dtype=torch.float64).quantile(torch.tensor([0.5, 0.2, 0.8], dtype=torch.float64))
    result.update(times=times, mean_ms=sum(times) / len(times), median_ms=q[0].item(), p20_ms=q[1].item(),
                  p80_ms=q[2].item(), peak_GiB=peak, train_loss=train_loss[0])
    print(f"  {provider}: warm-up {warm_s:.1f} s (first training loss {train_loss[0]:.5f}); "
          f"step {result['mean_ms']:.1f} ms mean, {result['median_ms']:.1f} median; peak {peak:.2f} GiB")
    if profile and device.type == "cuda":
        print_profile(provider, step)
    return result


# ------------------------------------------------------------------------------------------------
# Driver

def bench_shape(shape, providers, device, dtype, batch, seq, warmup, steps, watch, profile=False):
    """{provider: result} for one shape; providers that fail to build or run are reported and left out."""
    vocab = SHAPES[shape]["vocab_size"]
    ids = torch.randint(0, vocab, (batch, seq), device=device, generator=torch.Generator(device).manual_seed(2))
    results, problems = {}, []
    for provider in providers:
        if provider == "peft_liger":
            try:
                import liger_kernel.transformers  # noqa: F401
            except ImportError as exc:
                print(f"  peft_liger: skipped, liger_kernel is not importable ({exc})")
                continue
        seen = len(watch.messages)
        patches = liger_patches_undone() if provider == "peft_liger" else contextlib.nullcontext()
        failure = None
        try:
            with patches:
                result = run_provider(provider, shape, ids, device, dtype, results.get(BASELINE), warmup, steps,
                                      profile)
        except torch.OutOfMemoryError as exc:
            failure = f"skipped, out of memory ({str(exc).splitlines()[0][:160]})"
        except Exception:
            failure = "ERROR, not timed\n" + traceback.format_exc(limit=-8)
            problems.append(f"ERROR {shape} {provider}: raised (traceback above)")
        if failure is not None:  # out of the except block: the traceback's frames (the model) are gone
            free(device)
            print(f"  {provider}: {failure}")
            continue
        result["warnings"] = watch.messages[seen:] + result.get("warnings", [])
        if result["status"] == "FAIL":
            problems.append(f"FAIL {shape} lorafuse: its first step differs from peft's (see above); not timed")
        results[provider] = result
        free(device)
    return results, problems


def rows_of(env, shape_key, results):
    rows = []
    base = results.get(BASELINE)
    for provider, r in results.items():
        if "times" not in r:
            continue
        metrics = {"tokens_per_s": r["tokens_per_s"], "peak_GiB": r["peak_GiB"], "MFU": r["MFU"]}
        ratio = r["median_ms"] / base["median_ms"] if base and "times" in base else ""
        for metric, value in metrics.items():
            rows.append(dict(env, bench="train_step", shape=shape_key, provider=provider, mode="train_step",
                             median_ms=r["median_ms"], p20_ms=r["p20_ms"], p80_ms=r["p80_ms"], metric=metric,
                             value=value, baseline=BASELINE, ratio=ratio))
    return rows


def out_dirs(args):
    if args.out:
        return args.out
    if args.device != "cuda":
        return []  # a dry run writes nothing unless asked to
    dirs = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")]
    if os.environ.get("OUT"):
        dirs.append(os.environ["OUT"])
    return dirs


def print_summary(table, peak_tflops):
    print(f"\n{'shape':26} {'provider':25} {'tokens/s':>9} {'step ms':>8} {'peak GiB':>9} {'MFU':>6} "
          f"{'speedup':>8} {'memory':>7}")
    for shape_key, results in table.items():
        base = results.get(BASELINE)
        for provider, r in results.items():
            if "times" not in r:
                print(f"{shape_key:26} {provider:25} not timed ({r['status']})")
                continue
            has_base = base is not None and "times" in base
            speedup = f"{base['median_ms'] / r['median_ms']:7.2f}x" if has_base else f"{'-':>8}"
            memory = f"{r['peak_GiB'] / base['peak_GiB']:6.2f}x" if has_base else f"{'-':>7}"
            flag = "  (not fully fused: see above)" if r.get("warnings") else ""
            print(f"{shape_key:26} {provider:25} {r['tokens_per_s']:9.0f} {r['median_ms']:8.1f} {r['peak_GiB']:9.2f} "
                  f"{100 * r['MFU']:5.1f}% {speedup} {memory}{flag}")
    print(f"(tokens/s from the mean step; speedup = peft median step / median step; memory = peak / peft's peak; "
          f"MFU against {peak_tflops:.0f} TFLOP/s of bf16 matmul measured in this run)")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="llama1B only")
    parser.add_argument("--out", action="append", metavar="DIR",
                        help="write train_step.csv under DIR (repeatable) instead of benchmarks/results and $OUT")
    parser.add_argument("--providers", default=",".join(PROVIDERS), help=f"comma-separated subset of {PROVIDERS}")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="training steps before timing (>= 1)")
    parser.add_argument("--steps", type=int, default=STEPS, help="timed training steps")
    parser.add_argument("--profile", action="store_true", help="after timing, print each provider's largest kernels")
    # CPU dry run of the script (TRITON_INTERPRET=1 for lorafuse's kernels): --device cpu --tiny
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    providers = [p for p in args.providers.split(",") if p]
    unknown = sorted(set(providers) - set(PROVIDERS))
    if unknown or args.warmup < 1 or args.steps < 1:
        parser.error(f"unknown providers {unknown}" if unknown else "--warmup and --steps must be >= 1")
    providers = [p for p in PROVIDERS if p in providers]  # liger last, whatever the order given
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1" and dtype == torch.bfloat16:
        from tests import triton_interpreter  # noqa: F401  (bf16 in the interpreter computes as on a GPU)
    shapes = ("tiny",) if args.tiny else QUICK_SHAPES if args.quick else ("llama1B", "llama8B_L8")
    batch, seq = (TINY_BATCH, TINY_SEQ) if args.tiny else (BATCH, SEQ)

    if device.type == "cuda":
        env = environment()
    else:
        with mock.patch("torch.cuda.get_device_name", return_value=device.type):
            env = environment()
    start, watch = time.perf_counter(), LogWatch()
    peak_tflops = matmul_tflops(device)
    print(f"bf16 matmul {MATMUL_N if device.type == 'cuda' else 256}^3: {peak_tflops:.1f} TFLOP/s (the MFU peak)")
    rows, table, problems = [], {}, []
    for shape in shapes:
        shape_key = f"{shape}_B{batch}_T{seq}_r{LORA['r']}"
        flops = flops_per_token(shape, seq)
        print(f"\n{shape_key}: {flops / 1e9:.3f} GFLOP/token, providers {', '.join(providers)}")
        results, shape_problems = bench_shape(shape, providers, device, dtype, batch, seq, args.warmup, args.steps,
                                              watch, args.profile)
        problems += shape_problems
        for r in results.values():
            if "times" in r:
                r["tokens_per_s"] = batch * seq / (r["mean_ms"] / 1e3)
                r["MFU"] = flops * r["tokens_per_s"] / (peak_tflops * 1e12)
        rows += rows_of(env, shape_key, results)
        table[shape_key] = results
    dirs = out_dirs(args)
    if rows and dirs:
        write_rows(rows, "train_step", dirs)
    print(f"\ntotal {time.perf_counter() - start:.0f} s; "
          + ("rows appended to " + ", ".join(os.path.join(d, "train_step.csv") for d in dirs) if dirs and rows
             else "no rows written"))
    if any(r.get("warnings") for results in table.values() for r in results.values()):
        print("WARNING: lorafuse is not fully fused (see above): its rows time partly PEFT's or sdpa's code")
    for problem in problems:
        print(problem)
    print_summary(table, peak_tflops)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
