"""Does a whole LoRA training step get faster? lorafuse, eager and captured, against PEFT, torch.compile, Liger-Kernel
and Unsloth on Llama shapes.

    python benchmarks/bench_train_step.py                      # llama1B and llama8B_L8
    python benchmarks/bench_train_step.py --quick --dropout 0.05,0    # llama1B, every provider at both dropouts
    python benchmarks/bench_train_step.py --quick --providers peft,lorafuse,lorafuse_captured --tree head=/tmp/head
    python benchmarks/bench_train_step.py --out DIR            # rows to DIR/train_step.csv instead of the defaults

On a GPU machine without network: PYTHONPATH=/tmp/site:$PWD, /tmp/site holding hydra-core, omegaconf and
datasets (lorafuse.train, where CapturedStep lives, imports them) and liger-kernel; the Unsloth wheels installed into
their own folder, --unsloth-site (/tmp/unsloth_site; shared/gpu-wheels-unsloth/README.md).

Method: that of the anchors, the project's reference runs of PEFT and PEFT + Liger (docs/performance.md), so that
numbers compare with them. A
LlamaForCausalLM built from its config with random weights, created in bf16 on the GPU (no download;
the anchors drew them in fp32 and cast);
PEFT LoRA r=16, alpha 32 on all seven projections (q, k, v, o, gate, up, down), dropout --dropout (0.05; a list runs
every provider at each value, the shape key tagged _p<dropout>); AdamW (lr 1e-4) on the LoRA parameters; no gradient
checkpointing; one fixed batch of uniform random token ids, labels = input ids; a step = forward with labels,
loss.backward(), optimizer.step(), optimizer.zero_grad(set_to_none=True). Shapes (batch 4 x 2048 tokens):

    llama1B     Llama-3.2-1B: hidden 2048, 16 layers, 32 heads / 8 KV heads (head dim 64), MLP 8192,
                vocab 128256, tied embeddings, rope theta 500000 (the anchors' model)
    llama8B_L8  Llama-3.1-8B with 8 of its 32 layers: hidden 4096, 32 / 8 heads (head dim 128), MLP 14336,
                vocab 128256, untied lm_head (--quick leaves it out; out of memory -> skipped, said so)

Providers, each on a fresh model (previous one freed, CUDA cache emptied, peak stats reset), same seed:
  peft        PEFT's LoRA layers, attn_implementation="sdpa" (the baseline)
  lorafuse    lorafuse.get_peft_model with its defaults: fused LoRA layers, attn_implementation="lorafuse",
              RMSNorm and SwiGLU on lorafuse's kernels
  lorafuse_captured  the same model stepped as the recipe steps it, by lorafuse.train.captured_step.CapturedStep
              (the AdamW made fused and capturable by it, lr a device tensor; no clipping): its first
              CAPTURE_EAGER_STEPS (2) calls run eagerly, the next captures a CUDA graph, later ones copy the batch into
              its static buffers and replay. Needs CUDA
  lorafuse_layers_attention  fused LoRA layers and lorafuse attention, transformers' RMSNorm and MLP
  lorafuse_layers  fused LoRA layers only, attention left at "sdpa": what each part of lorafuse brings
  peft_compiled, lorafuse_compiled  torch.compile(model) (inductor, default mode) of the whole peft / lorafuse model,
              the optimizer eager; compile time (the check's step and the warm-up) is reported apart from the step
              time, with the graph breaks dynamo counted (torch._dynamo.utils.counters["graph_break"], summed)
  unsloth     Unsloth (FastLanguageModel, r=16, alpha 32, dropout 0, bias none, the seven projections, no gradient
              checkpointing) in a process of its own (import unsloth patches transformers): unsloth_train_step.py,
              on peft's model: its base weights saved to a temporary folder with the bundled tiny Llama's tokenizer,
              its adapters copied in by name. Dropout 0 only (its fast LoRA path); skipped without CUDA or without
              --unsloth-site
  peft_liger  peft after liger_kernel.transformers.apply_liger_kernel_to_llama(model=model) with its
              defaults (rope, RMSNorm, SwiGLU, fused linear cross-entropy), as the anchors; runs last and its
              patches of transformers' llama module are undone afterwards; skipped if liger is missing
  lorafuse@NAME, lorafuse_captured@NAME  (--tree NAME=PATH, repeatable) lorafuse and lorafuse_captured with the
              lorafuse package of another tree (an older commit), run by this script in a subprocess with PYTHONPATH
              PATH first, after this process's providers; checked against this process's peft. A tree without
              lorafuse.train.captured_step gets this tree's file, loaded into its lorafuse.train; where that file's
              imports fail there, its captured row is skipped, said so, and only eager is timed for it
  lorafuse#2, lorafuse_captured#2  a second, short timing pass (--second-pass-steps, 5; 0: none) of this tree's
              lorafuse and lorafuse_captured on fresh models once every other provider (the trees' included) has
              run: providers are timed one after another and the GPU's clocks drift, so the A/B against a tree
              reads as pass 1 -> tree -> pass 2

Check before timing: lora_B starts N(0, 0.02) instead of PEFT's zeros (the same draw for every provider)
so that the adapter path is exercised; one training forward+backward, the LoRA dropout modules' p set to
0 for it (PEFT and lorafuse draw different masks), gives the first loss and the LoRA gradients (of the compiled model
for the compiled providers: at dropout > 0 the model compiles twice, at 0 and at the dropout). Each
provider is compared with peft: loss relative difference, and gradient relative error
||g - g_peft|| / ||g_peft|| over all LoRA parameters. lorafuse beyond LOSS_RTOL (2e-2) or GRAD_RTOL (0.1)
prints FAIL, is not timed, and the script exits 1; the others' figures are printed (WARN when beyond)
as a yardstick of what a legitimate bf16 difference is. A provider that raises is reported (exit 1).
lorafuse's model is inspected (LoRA layers of class FusedLoraLinear, attn_implementation "lorafuse") and
what lorafuse logs (a layer or an attention call falling back to PEFT or sdpa) is printed; either kind of
shortfall is flagged in the summary.

Timing: --warmup (3) training steps (Triton compiles; the captured provider at least 3, so that the graph is captured;
the compiled providers and unsloth --compiled-warmup, 3), then --steps (10) steps, one CUDA event between
consecutive steps (no host sync inside the loop, as the anchors' wall-clock loop), synchronize at the end.
  median_ms, p20_ms, p80_ms   per-step times
  tokens_per_s                batch * seq / mean step time (the anchors' definition)
  peak_GiB                    torch.cuda.max_memory_allocated() / 2^30 over the timed steps (peak stats
                              reset after the warm-up, as the anchors): weights, optimizer state, activations;
                              the captured provider's over its whole run, since replays allocate nothing
  host_ms, gpu_ms             then 5 more steps, each after the GPU's queue is drained: host = wall time to enqueue
                              the step (captured: the batch copy and the replay's launch), GPU = CUDA events around
                              it; medians (common.host_and_gpu_ms, as profile_train_step.py)
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
  compile_s, graph_breaks     compiled providers: seconds of the check's step and the warm-up; dynamo's graph breaks
Rows: benchmarks/results/train_step.csv (and $OUT when set; --out replaces both), bench and mode
`train_step`, shape `<model>_B4_T2048_r16_p<dropout>`, one row per metric per provider. baseline = peft;
ratio = median step time / peft's median step time on every row, peak_GiB's included (DESIGN's ratio of
times: the summary prints the memory ratio, and for each @NAME row its time over this tree's same provider's).
CPU dry run of the script (1 warm-up step, 2 timed, unless given; captured and unsloth skip):
    TRITON_INTERPRET=1 python benchmarks/bench_train_step.py --device cpu --tiny --dtype float32 \\
        --providers peft,lorafuse,lorafuse_compiled
"""
import argparse
import contextlib
import gc
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.common import (LogWatch, adamw_step, chosen_providers, environment, first_step,  # noqa: E402
                               print_profile, result_dirs, stream_subprocess, time_ms, time_training, token_ids,
                               write_rows)

# lorafuse from PYTHONPATH first (the tree of a --tree subprocess), else from this tree
sys.path.remove(ROOT)
sys.path.append(ROOT)
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
WARMUP, STEPS, COMPILED_WARMUP, SECOND_PASS_STEPS = 3, 10, 3, 5
DRY_WARMUP, DRY_STEPS = 1, 2  # --device cpu: every count not given on the command line
CAPTURE_EAGER_STEPS = 2
# liger last: it patches transformers' llama module
PROVIDERS = ("peft", "lorafuse", "lorafuse_captured", "lorafuse_layers_attention", "lorafuse_layers", "peft_compiled",
             "lorafuse_compiled", "unsloth", "peft_liger")
MODEL_OF = {"lorafuse_captured": "lorafuse", "peft_compiled": "peft", "lorafuse_compiled": "lorafuse"}
COMPILED = ("peft_compiled", "lorafuse_compiled")
TREE_PROVIDERS = ("lorafuse", "lorafuse_captured")  # what --tree and the second pass time
BASELINE = "peft"
LOSS_RTOL, GRAD_RTOL = 2e-2, 0.1
MATMUL_N = 8192
UNSLOTH_SCRIPT = os.path.join(ROOT, "benchmarks", "unsloth_train_step.py")
UNSLOTH_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "UNSLOTH_DISABLE_STATISTICS": "1"}


class Skipped(Exception):
    """A provider that cannot run here (no CUDA, a package or file missing): its reason is printed, nothing timed."""


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


def base_model(shape, device, dtype):
    """The frozen Llama of `shape`, random weights from seed 0: the same for every provider."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    config = LlamaConfig(**LLAMA, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def build(provider, shape, device, dtype, dropout):
    """A fresh LoRA Llama for `provider` (its eager model for the captured and compiled ones): same weights, same
    adapters for every provider."""
    from peft import LoraConfig, get_peft_model
    model = base_model(shape, device, dtype)
    kind = MODEL_OF.get(provider, provider)
    if kind == "peft_liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama(model=model)  # the anchors' call: defaults
    lora_config = LoraConfig(**dict(LORA, lora_dropout=dropout))
    if kind == "lorafuse":
        model = lorafuse.get_peft_model(model, lora_config)
    elif kind == "lorafuse_layers_attention":
        model = lorafuse.get_peft_model(model, lora_config, model_kernels=False)
    elif kind == "lorafuse_layers":
        model = lorafuse.get_peft_model(model, lora_config, attention=False, model_kernels=False)
    else:
        model = get_peft_model(model, lora_config)
    # lora_B ~ N(0, LORA_B_STD) instead of PEFT's zeros, the same draw for every provider: the adapter path is exercised
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
# Training steps

def training_step(provider, model, forward, ids):
    """`provider`'s training step: a callable that enqueues one step and returns its loss (a device tensor).
    forward: `model`, or its torch.compile for the compiled providers."""
    if provider != "lorafuse_captured":
        return adamw_step(model, ids, LR, forward)
    # torch's AdamW as the other providers', made fused and capturable (lr a device tensor) by CapturedStep, as in
    # the recipe
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    step = captured_step_class()(model, optimizer, lm_loss, max_grad_norm=None, eager_steps=CAPTURE_EAGER_STEPS)
    micro_batches = [{"input_ids": ids, "labels": ids}]
    items = float(ids.numel() - ids.shape[0])  # labels = inputs: every token but each row's first carries loss
    return lambda: step(micro_batches, items)[0]


def forward_of(provider, model):
    """What the step calls: torch.compile(model) for the compiled providers, else the model."""
    return torch.compile(model) if provider in COMPILED else model


def lm_loss(model, batch):
    """A micro-batch's loss: CapturedStep passes its items in the batch as num_items_in_batch, the model divides by it."""
    return model(**batch).loss


def captured_step_class():
    """lorafuse.train.captured_step.CapturedStep of the lorafuse imported. A tree that lacks it (an older commit, under
    --tree) gets this tree's captured_step.py, loaded as a module of that tree's lorafuse.train so that its relative
    imports resolve there; Skipped where that fails."""
    try:
        from lorafuse.train.captured_step import CapturedStep
        return CapturedStep
    except ImportError as exc:
        here = os.path.join(ROOT, "lorafuse")
        if os.path.realpath(os.path.dirname(lorafuse.__file__)) == os.path.realpath(here):
            raise Skipped(f"lorafuse.train.captured_step does not import ({exc})") from None
        missing = exc
    name, path = "lorafuse.train.captured_step", os.path.join(ROOT, "lorafuse", "train", "captured_step.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up there
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        del sys.modules[name]
        raise Skipped(f"the lorafuse at {os.path.dirname(lorafuse.__file__)} has no captured step ({missing}), and "
                      f"this tree's {path} does not import into it ({exc}): only eager is timed for it") from None
    print(f"  lorafuse_captured: this tree's {path}, loaded into the lorafuse at {os.path.dirname(lorafuse.__file__)}")
    return module.CapturedStep


def warmup_steps(provider, warmup, compiled_warmup):
    """Steps before timing: the compiled providers and unsloth compile; the captured one captures at call
    CAPTURE_EAGER_STEPS + 1."""
    if provider in COMPILED or provider == "unsloth":
        return compiled_warmup
    if provider == "lorafuse_captured":
        return max(warmup, CAPTURE_EAGER_STEPS + 1)
    return warmup


# ------------------------------------------------------------------------------------------------
# One provider: build, check, warm up, time

def free(device):
    gc.collect()
    torch._dynamo.reset()  # compiled code keeps its model alive
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


def check(result, reference):
    """Prints `result`'s first step against peft's `reference` (None: unchecked); a lorafuse provider beyond the
    tolerances gets status FAIL."""
    provider = result["provider"]
    if reference is None:
        note = "" if provider == BASELINE else " (no peft reference: unchecked)"
        print(f"  {provider}: first loss {result['loss']:.5f}{note}")
        return
    loss_diff, grad_err, worst = compare(result, reference)
    ok = loss_diff <= LOSS_RTOL and grad_err <= GRAD_RTOL
    result.update(loss_diff=loss_diff, grad_err=grad_err)
    verdict = "PASS" if ok else ("FAIL" if provider.startswith("lorafuse") else "WARN")
    print(f"  {verdict} {provider}: first loss {result['loss']:.5f} (peft {reference['loss']:.5f}, rel. diff "
          f"{loss_diff:.1e} <= {LOSS_RTOL:g}?); LoRA gradients rel. error {grad_err:.2e} (<= {GRAD_RTOL:g}?), "
          f"worst {worst}")
    if not ok and provider.startswith("lorafuse"):
        result["status"] = "FAIL"


def run_provider(provider, shape, ids, device, dtype, dropout, reference, warmup, steps, profile=False,
                 second_pass=False):
    """Result dict of one provider on one shape: status ok / FAIL, loss, grads (peft's only) and, when ok, timings.
    second_pass: no check, no host/GPU split, no profile: the timing alone."""
    from torch._dynamo.utils import counters
    free(device)
    counters.clear()
    model = build(provider, shape, device, dtype, dropout)
    warnings = fusion_warnings(model) if MODEL_OF.get(provider, provider) == "lorafuse" else []
    forward = forward_of(provider, model)
    result = {"provider": provider, "status": "ok", "warnings": warnings, "check_s": 0.0}
    if not second_pass:
        start = time.perf_counter()
        result["loss"], result["grads"] = first_step(model, ids, forward)
        result["check_s"] = time.perf_counter() - start
        check(result, reference)
        if provider != BASELINE:
            del result["grads"]  # only peft's are compared with
        if result["status"] == "FAIL":
            return result  # a wrong model is not timed
    step = training_step(provider, model, forward, ids)
    if device.type == "cuda" and provider == "lorafuse_captured":
        torch.cuda.reset_peak_memory_stats()  # its peak is taken over the capture, not over the replays
    result.update(time_training(step, warmup, steps, device, peak_from_start=provider == "lorafuse_captured",
                                host_gpu=not second_pass))
    if provider in COMPILED:
        breaks = counters["graph_break"]
        result.update(compile_s=result["check_s"] + result["warm_s"], graph_breaks=sum(breaks.values()))
        print(f"  {provider}: compiled in {result['compile_s']:.0f} s (check {result['check_s']:.0f} s, warm-up "
              f"{result['warm_s']:.0f} s), {counters['stats']['unique_graphs']} graphs, {result['graph_breaks']} "
              f"graph breaks" + "".join(f"\n    {n}x {reason[:160]}" for reason, n in breaks.most_common(5)))
    print_timing(provider, result)
    if profile and device.type == "cuda" and not second_pass:
        print_profile(provider, step)
    return result


def print_timing(provider, r):
    split = f"; host {r['host_ms']:.1f} ms, GPU {r['gpu_ms']:.1f} ms per step" if "host_ms" in r else ""
    print(f"  {provider}: warm-up {r['warm_s']:.1f} s (first training loss {r['train_loss']:.5f}); "
          f"step {r['mean_ms']:.1f} ms mean, {r['median_ms']:.1f} median; peak {r['peak_GiB']:.2f} GiB{split}")


# ------------------------------------------------------------------------------------------------
# Providers in subprocesses: Unsloth, other trees

def run_unsloth(shape, device, dtype, reference, warmup, steps, site):
    """Unsloth's result: unsloth_train_step.py in a process of its own (PYTHONPATH `site` first, offline), on peft's
    model at dropout 0 (weights saved to a temporary folder with the bundled tiny Llama's tokenizer, adapters to a
    file), checked against peft."""
    from transformers import AutoTokenizer
    from lorafuse._paths import ASSETS
    batch, seq = batch_seq(shape)
    config = dict(batch=batch, seq=seq, vocab=SHAPES[shape]["vocab_size"], warmup=warmup, steps=steps, lr=LR,
                  lora=dict(LORA, lora_dropout=0.0))
    with tempfile.TemporaryDirectory() as folder:
        model = build("peft", shape, device, dtype, 0.0)
        adapters, first = os.path.join(folder, "adapters.pt"), os.path.join(folder, "first_step.pt")
        torch.save({name: p.detach().cpu() for name, p in model.named_parameters() if p.requires_grad}, adapters)
        model.unload().save_pretrained(os.path.join(folder, "model"))
        del model
        free(device)
        AutoTokenizer.from_pretrained(ASSETS / "tiny-llama").save_pretrained(os.path.join(folder, "model"))
        paths = [site, ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), **UNSLOTH_ENV)
        command = [sys.executable, UNSLOTH_SCRIPT, "--model", os.path.join(folder, "model"), "--adapters", adapters,
                   "--config", json.dumps(config), "--first-step", first]
        code, report = stream_subprocess(command, env)
        if code != 0 or report is None:
            raise RuntimeError(f"unsloth_train_step.py exited with status {code}"
                               + ("" if report else " and printed no JSON line") + " (its output above)")
        result = dict(report, provider="unsloth", status="ok", **torch.load(first))
    check(result, reference)
    del result["grads"]
    print_timing("unsloth", result)
    return result


def run_tree(name, path, shape, dropout, reference, args):
    """({provider@name: result}, problems): TREE_PROVIDERS with the lorafuse package of the tree at `path`, timed by
    this script in a subprocess (--child) whose PYTHONPATH starts with `path`, checked against `reference`."""
    providers = [p for p in TREE_PROVIDERS if p in args.providers]
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, os.path.abspath(__file__), "--child", "--shapes", shape, "--dropout", f"{dropout:g}",
                   "--providers", ",".join(providers), "--warmup", str(args.warmup), "--steps", str(args.steps),
                   "--second-pass-steps", "0", "--device", args.device, "--dtype", args.dtype]
        if reference is not None:
            torch.save({"loss": reference["loss"], "grads": reference["grads"]}, os.path.join(folder, "peft.pt"))
            command += ["--reference", os.path.join(folder, "peft.pt")]
        paths = [path] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        print(f"  @{name}: {', '.join(providers)} with the lorafuse of {path}, in a subprocess")
        code, report = stream_subprocess(command, dict(os.environ, PYTHONPATH=os.pathsep.join(paths)))
    if code not in (0, 1) or report is None:
        return {}, [f"ERROR @{name}: its subprocess exited with status {code} (its output above)"]
    imported = os.path.realpath(report["lorafuse"])
    if imported != os.path.realpath(os.path.join(path, "lorafuse")):
        return {}, [f"ERROR @{name}: its subprocess imported lorafuse from {imported}, not from {path}: not compared"]
    results = {f"{p}@{name}": dict(r, provider=f"{p}@{name}", same_as=p) for p, r in report["results"].items()}
    return results, [f"@{name}: {problem}" for problem in report["problems"]]


# ------------------------------------------------------------------------------------------------
# Driver

def batch_seq(shape):
    return (TINY_BATCH, TINY_SEQ) if shape == "tiny" else (BATCH, SEQ)


def shape_key(shape, dropout):
    batch, seq = batch_seq(shape)
    return f"{shape}_B{batch}_T{seq}_r{LORA['r']}_p{dropout:g}"


def available(provider, device, dropout, site):
    """Raises Skipped, with the reason, where `provider` cannot run."""
    if provider == "peft_liger":
        try:
            import liger_kernel.transformers  # noqa: F401
        except ImportError as exc:
            raise Skipped(f"liger_kernel is not importable ({exc})") from None
    if provider in ("lorafuse_captured", "unsloth") and device.type != "cuda":
        raise Skipped("it needs CUDA")
    if provider == "lorafuse_captured":
        captured_step_class()
    if provider == "unsloth" and dropout != 0:
        raise Skipped("Unsloth runs at dropout 0 only (its fast LoRA path): --dropout ...,0 adds that pass")
    if provider == "unsloth" and not os.path.isdir(site):
        raise Skipped(f"no {site}: install shared/gpu-wheels-unsloth there (its README), or name the folder with "
                      "--unsloth-site")


def attempt(label, run, device, watch, problems):
    """run()'s result with what lorafuse logged meanwhile added to its warnings; None when it is skipped, runs out
    of memory or raises (said; an error is added to `problems`)."""
    seen, start = len(watch.messages), time.perf_counter()
    failure = None
    try:
        result = run()
    except Skipped as exc:
        failure = f"skipped, {exc}"
    except torch.OutOfMemoryError as exc:
        failure = f"skipped, out of memory ({str(exc).splitlines()[0][:160]})"
    except Exception:
        failure = "ERROR, not timed\n" + traceback.format_exc(limit=-8)
        problems.append(f"ERROR {label}: raised (traceback above)")
    free(device)  # out of the except block: the traceback's frames (the model) are gone
    if failure is not None:
        print(f"  {label}: {failure}")
        return None
    print(f"  {label}: {time.perf_counter() - start:.0f} s in all")
    result["warnings"] = watch.messages[seen:] + result.get("warnings", [])
    return result


def bench_shape(shape, dropout, providers, device, dtype, args, watch, reference=None):
    """({provider: result}, problems) of one shape at one dropout: the providers, then the trees (--tree), then the
    second pass. reference: peft's first step (given to a --child), else peft's own once it has run."""
    key = shape_key(shape, dropout)
    batch, seq = batch_seq(shape)
    ids = token_ids(SHAPES[shape]["vocab_size"], batch, seq, device)
    results, problems = {}, []

    def timed(provider, second_pass=False):
        available(provider, device, dropout, args.unsloth_site)
        peft = reference if reference is not None else results.get(BASELINE)
        warmup = warmup_steps(provider, args.warmup, args.compiled_warmup)
        steps = args.second_pass_steps if second_pass else args.steps
        if provider == "unsloth":
            return run_unsloth(shape, device, dtype, peft, warmup, steps, args.unsloth_site)
        with liger_patches_undone() if provider == "peft_liger" else contextlib.nullcontext():
            return run_provider(provider, shape, ids, device, dtype, dropout, peft, warmup, steps, args.profile,
                                second_pass)

    for provider in providers:
        result = attempt(f"{key} {provider}", lambda: timed(provider), device, watch, problems)
        if result is not None:
            if result["status"] == "FAIL":
                problems.append(f"FAIL {key} {provider}: its first step differs from peft's (see above); not timed")
            results[provider] = result
    for name, path in args.tree:
        tree_results, tree_problems = run_tree(name, path, shape, dropout, results.get(BASELINE), args)
        results.update(tree_results)
        problems += tree_problems
    for provider in TREE_PROVIDERS if args.second_pass_steps else ():
        if "times" in results.get(provider, {}):
            print(f"  {provider}: second pass")
            result = attempt(f"{key} {provider}#2", lambda: timed(provider, second_pass=True), device, watch, problems)
            if result is not None:
                results[f"{provider}#2"] = dict(result, provider=f"{provider}#2", same_as=provider)
    return results, problems


def derive(results, shape, flops, peak_tflops):
    """tokens_per_s and MFU of every timed result."""
    batch, seq = batch_seq(shape)
    for r in results.values():
        if "times" in r:
            r["tokens_per_s"] = batch * seq / (r["mean_ms"] / 1e3)
            r["MFU"] = flops * r["tokens_per_s"] / (peak_tflops * 1e12)


def rows_of(env, key, results):
    rows = []
    base = results.get(BASELINE)
    for provider, r in results.items():
        if "times" not in r:
            continue
        metrics = [m for m in ("tokens_per_s", "peak_GiB", "MFU", "host_ms", "gpu_ms", "compile_s", "graph_breaks")
                   if m in r]
        ratio = r["median_ms"] / base["median_ms"] if base and "times" in base else ""
        for metric in metrics:
            rows.append(dict(env, bench="train_step", shape=key, provider=provider, mode="train_step",
                             median_ms=r["median_ms"], p20_ms=r["p20_ms"], p80_ms=r["p80_ms"], metric=metric,
                             value=r[metric], baseline=BASELINE, ratio=ratio))
    return rows


def print_summary(table, peak_tflops):
    print(f"\n{'shape':30} {'provider':25} {'tokens/s':>9} {'step ms':>8} {'host ms':>8} {'GPU ms':>8} "
          f"{'peak GiB':>9} {'MFU':>6} {'speedup':>8} {'memory':>7}  notes")
    for key, results in table.items():
        base = results.get(BASELINE)
        for provider, r in results.items():
            if "times" not in r:
                print(f"{key:30} {provider:25} not timed ({r['status']})")
                continue
            has_base = base is not None and "times" in base
            speedup = f"{base['median_ms'] / r['median_ms']:7.2f}x" if has_base else f"{'-':>8}"
            memory = f"{r['peak_GiB'] / base['peak_GiB']:6.2f}x" if has_base else f"{'-':>7}"
            host, gpu = (f"{r[m]:8.1f}" if m in r else f"{'-':>8}" for m in ("host_ms", "gpu_ms"))
            print(f"{key:30} {provider:25} {r['tokens_per_s']:9.0f} {r['median_ms']:8.1f} {host} {gpu} "
                  f"{r['peak_GiB']:9.2f} {100 * r['MFU']:5.1f}% {speedup} {memory}  {'; '.join(notes(r, results))}")
    print(f"(tokens/s from the mean step; speedup = peft median step / median step; memory = peak / peft's peak; "
          f"MFU against {peak_tflops:.0f} TFLOP/s of bf16 matmul measured in this run; host ms = time to enqueue one "
          f"step with the GPU idle, GPU ms = its time on the GPU; #2 = the second timing pass, @NAME = --tree NAME)")


def notes(r, results):
    """The summary's last column: shortfalls, compilation, and the A/B of a tree's or a second pass's row against
    this tree's same provider (median step time over median step time)."""
    said = ["not fully fused: see above"] if r.get("warnings") else []
    if "compile_s" in r:
        said.append(f"compiled in {r['compile_s']:.0f} s, {r['graph_breaks']} graph breaks")
    for own in (r["same_as"], r["same_as"] + "#2") if "same_as" in r else ():
        if own != r["provider"] and "times" in results.get(own, {}):
            said.append(f"{r['median_ms'] / results[own]['median_ms']:.3f}x {own}'s time")
    return said


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="llama1B only")
    parser.add_argument("--shapes", help=f"comma-separated subset of {tuple(SHAPES)} (default llama1B,llama8B_L8)")
    parser.add_argument("--out", action="append", metavar="DIR",
                        help="write train_step.csv under DIR (repeatable) instead of benchmarks/results and $OUT")
    parser.add_argument("--providers", default=",".join(PROVIDERS), help=f"comma-separated subset of {PROVIDERS}")
    parser.add_argument("--dropout", default=f"{LORA['lora_dropout']:g}",
                        help="LoRA dropout, or a comma-separated list: every provider at each value (unsloth at 0)")
    parser.add_argument("--warmup", type=int, help=f"training steps before timing (>= 1; {WARMUP})")
    parser.add_argument("--steps", type=int, help=f"timed training steps ({STEPS})")
    parser.add_argument("--compiled-warmup", type=int,
                        help=f"steps before timing of the compiled providers and unsloth ({COMPILED_WARMUP})")
    parser.add_argument("--second-pass-steps", type=int,
                        help=f"timed steps of the second pass of lorafuse and lorafuse_captured ({SECOND_PASS_STEPS}; "
                             "0: no second pass)")
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                        help="also time lorafuse and lorafuse_captured with the lorafuse package under PATH (a "
                             "checkout of another commit), as provider@NAME; repeatable")
    parser.add_argument("--unsloth-site", default="/tmp/unsloth_site",
                        help="the folder the Unsloth wheels are installed into (shared/gpu-wheels-unsloth/README.md)")
    parser.add_argument("--profile", action="store_true", help="after timing, print each provider's largest kernels")
    # CPU dry run of the script (TRITON_INTERPRET=1 for lorafuse's kernels): --device cpu --tiny
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help=argparse.SUPPRESS)
    # run_tree's subprocess: its results as a JSON line, checked against peft's first step saved by the parent
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--reference", help=argparse.SUPPRESS)
    args = parser.parse_args()

    args.providers = chosen_providers(parser, args.providers, PROVIDERS)
    dry = args.device != "cuda"
    for name, default in (("warmup", WARMUP), ("steps", STEPS), ("compiled_warmup", COMPILED_WARMUP),
                          ("second_pass_steps", SECOND_PASS_STEPS)):
        if getattr(args, name) is None:
            setattr(args, name, (DRY_WARMUP if "warmup" in name else DRY_STEPS) if dry else default)
    if min(args.warmup, args.steps, args.compiled_warmup) < 1 or args.second_pass_steps < 0:
        parser.error("--warmup, --steps and --compiled-warmup must be >= 1, --second-pass-steps >= 0")
    args.dropout = [float(p) for p in args.dropout.split(",")]
    if not all(0 <= p < 1 for p in args.dropout):
        parser.error(f"--dropout {args.dropout}: each in [0, 1)")
    args.shapes = (["tiny"] if args.tiny else args.shapes.split(",") if args.shapes
                   else list(QUICK_SHAPES) if args.quick else ["llama1B", "llama8B_L8"])
    if set(args.shapes) - set(SHAPES):
        parser.error(f"unknown shapes {sorted(set(args.shapes) - set(SHAPES))}")
    trees = []
    for tree in args.tree:
        name, _, path = tree.partition("=")
        if not name or not os.path.isfile(os.path.join(path, "lorafuse", "__init__.py")):
            parser.error(f"--tree {tree}: NAME=PATH, PATH a folder holding the lorafuse package")
        trees.append((name, os.path.abspath(path)))
    args.tree = trees
    return args


def child_main(args, device, dtype):
    """--child, run by run_tree: the providers on one shape at one dropout with the lorafuse of PYTHONPATH, checked
    against --reference; the results as one JSON line."""
    reference = torch.load(args.reference) if args.reference else None
    results, problems = bench_shape(args.shapes[0], args.dropout[0], args.providers, device, dtype, args, LogWatch(),
                                    reference)
    print(json.dumps({"lorafuse": os.path.dirname(lorafuse.__file__), "results": results, "problems": problems}))
    sys.exit(1 if problems else 0)


def main():
    args = parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1" and dtype == torch.bfloat16:
        from tests import triton_interpreter  # noqa: F401  (bf16 in the interpreter computes as on a GPU)
    if args.child:
        child_main(args, device, dtype)  # exits
    env = environment()
    start, watch = time.perf_counter(), LogWatch()
    peak_tflops = matmul_tflops(device)
    print(f"bf16 matmul {MATMUL_N if device.type == 'cuda' else 256}^3: {peak_tflops:.1f} TFLOP/s (the MFU peak)")
    rows, table, problems = [], {}, []
    dirs = result_dirs(args.out, dry_run=device.type != "cuda")
    for shape in args.shapes:
        flops = flops_per_token(shape, batch_seq(shape)[1])
        for dropout in args.dropout:
            key = shape_key(shape, dropout)
            print(f"\n{key}: {flops / 1e9:.3f} GFLOP/token, providers {', '.join(args.providers)}"
                  + "".join(f", @{name}" for name, _ in args.tree))
            results, found = bench_shape(shape, dropout, args.providers, device, dtype, args, watch)
            problems += found
            derive(results, shape, flops, peak_tflops)
            key_rows = rows_of(env, key, results)
            if key_rows and dirs:  # each shape's rows as soon as they exist: a run stopped later keeps them
                write_rows(key_rows, "train_step", dirs)
            rows += key_rows
            table[key] = results
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
