"""How much GPU memory does a LoRA training step take as the context grows, and what does each way of saving it
cost in speed? PEFT, PEFT + Liger-Kernel, lorafuse in its three activation-checkpointing modes and Unsloth with and
without its offloaded checkpointing, on the Llama-3.2-1B shape from batch 4 x 2k to batch 1 x 128k tokens.

    python benchmarks/bench_memory.py                          # the whole grid
    python benchmarks/bench_memory.py --providers peft,peft_liger,lorafuse --contexts 2048x4,16384,32768
    python benchmarks/bench_memory.py --shape llama8B_L8 --contexts 2048x4   # Llama-3.1-8B's shape with 8 layers
    python benchmarks/bench_memory.py --out DIR                # rows to DIR/memory.csv instead of the defaults
    python benchmarks/plot_memory.py                           # docs/memory.png from the newest run's rows

On a GPU machine without network, bench_train_step's setup: PYTHONPATH=/tmp/site:$PWD with liger-kernel in
/tmp/site, the Unsloth wheels installed into their own folder, --unsloth-site (/tmp/unsloth_site).

Method: bench_train_step's (its docstring), dropout 0 so that Unsloth's fast LoRA path applies: its llama1B model
built from its config with random bf16 weights on the GPU, max_position_embeddings raised to 131072 (RoPE itself
unscaled: memory and time do not depend on its frequencies); PEFT LoRA r=16, alpha 32, dropout 0 on the seven
projections, lora_B drawn N(0, 0.02); AdamW (lr 1e-4) on the LoRA parameters; one fixed batch of random token ids,
labels = input ids; a step = forward with labels, loss.backward(), optimizer.step(), optimizer.zero_grad() (common's
adamw_step). No first-step check against peft: bench_train_step makes it at batch 4 x 2048.

Providers, those of this process each on a fresh model at every context (the previous one freed, the CUDA cache
emptied):
  peft              PEFT's LoRA layers, attn_implementation="sdpa", no checkpointing
  lorafuse          lorafuse.get_peft_model with its defaults, no checkpointing
  lorafuse_ckpt     the same with activation_checkpointing=True: each decoder layer recomputed in the backward
                    (lorafuse.nn.layer_checkpoint), its input kept on the GPU
  lorafuse_offload  activation_checkpointing="offload": that, each layer's saved input kept in pinned host memory
  unsloth           Unsloth (bench_train_step's unsloth provider), no checkpointing
  unsloth_gc        Unsloth with use_gradient_checkpointing="unsloth", its offloaded checkpointing
                    The two Unsloth providers each run unsloth_train_step.py in a process of their own, which loads
                    peft's model once and steps it at each context in turn; skipped without CUDA or --unsloth-site
  peft_liger        peft after liger_kernel.transformers.apply_liger_kernel_to_llama(model=model), defaults; runs
                    last, its patches of transformers' llama module undone afterwards; skipped without liger-kernel
PEFT and Liger run without checkpointing only.

Contexts (--contexts: SEQxBATCH, or SEQ for batch 1; SEQ may be written 16k): 2048x4, 16384, 32768, 65536, 131072.
A provider runs its contexts from fewest tokens to most; where a step runs out of memory (torch.OutOfMemoryError:
the model freed, the cache emptied) its status is oom, and its contexts of as many tokens or more are not tried:
status "oom (fewer tokens ran out)".

Per provider and context (common.time_training: --warmup steps (1), then --steps timed steps (2)):
  peak_GiB       torch.cuda.max_memory_allocated() / 2^30 over the timed steps, the peak stats reset after the
                 warm-up: all of a step (weights, LoRA gradients and AdamW state, activations, logits and loss),
                 not pinned host memory; empty on CPU, where it is not measured
  reserved_GiB   torch.cuda.max_memory_reserved() / 2^30 over the same steps: what the caching allocator held
  tokens_per_s   batch * seq / median step time
  status         ok, oom, "oom (fewer tokens ran out)", skipped (note: why) or error (note: the exception)
Rows: benchmarks/results/memory.csv (and $OUT/memory.csv when set; --out replaces both), one per provider and
context, written as each provider finishes; ratio = tokens_per_s / peft's at the same context in the same run. The
commit is git's (+dirty when tracked files differ from it), or --commit where the tree is no git checkout.
plot_memory.py plots the rows of the newest date and commit: a grid split across calls (--providers, --contexts) on
one commit plots as one run.

CPU dry run of the script (1 warm-up step, 2 timed; Unsloth skipped):
    TRITON_INTERPRET=1 python benchmarks/bench_memory.py --device cpu --tiny --dtype float32 \\
        --providers peft,lorafuse,lorafuse_ckpt,lorafuse_offload --contexts 64x2,128
"""
import argparse
import contextlib
import csv
import functools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from unittest import mock

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks import bench_train_step  # noqa: E402
from benchmarks.bench_train_step import (LORA, LR, SHAPES, UNSLOTH_ENV, UNSLOTH_SCRIPT, Skipped,  # noqa: E402
                                         available, build, free, fusion_warnings, liger_patches_undone)
from benchmarks.common import (LogWatch, adamw_step, chosen_providers, environment, result_dirs,  # noqa: E402
                               stream_subprocess, time_training, token_ids)
import lorafuse  # noqa: E402

# provider: (the bench_train_step provider it builds, activation checkpointing); liger last: it patches transformers
PROVIDERS = {"peft": ("peft", False), "lorafuse": ("lorafuse", False), "lorafuse_ckpt": ("lorafuse", True),
             "lorafuse_offload": ("lorafuse", "offload"), "unsloth": ("unsloth", False),
             "unsloth_gc": ("unsloth", "unsloth"), "peft_liger": ("peft_liger", False)}
BASELINE = "peft"
CONTEXTS = "2048x4,16384,32768,65536,131072"
TINY_CONTEXTS = "64x2,128"
MAX_POSITIONS = 131072
WARMUP, STEPS = 1, 2
COLUMNS = ["date", "commit", "gpu", "torch", "triton", "transformers", "bench", "shape", "provider", "checkpointing",
           "context", "batch", "seq", "tokens", "peak_GiB", "reserved_GiB", "tokens_per_s", "median_ms", "ratio",
           "status", "note", "command"]
SKIPPED_AFTER_OOM = "oom (fewer tokens ran out)"


# ------------------------------------------------------------------------------------------------
# One provider at one context

def build_model(provider, shape, device, dtype):
    """bench_train_step.build's model of `provider` at dropout 0 (same weights, same adapters); the checkpointing
    lorafuse providers get lorafuse.get_peft_model's activation_checkpointing, which build does not pass."""
    kind, checkpointing = PROVIDERS[provider]
    if kind != "lorafuse" or checkpointing is False:
        return build(kind, shape, device, dtype, 0.0)
    with_mode = functools.partial(lorafuse.get_peft_model, activation_checkpointing=checkpointing)
    with mock.patch.object(lorafuse, "get_peft_model", with_mode):
        return build(kind, shape, device, dtype, 0.0)


def run_cell(provider, shape, batch, seq, device, dtype, args):
    """time_training's dict of one in-process provider at one context, reserved_GiB added."""
    model = build_model(provider, shape, device, dtype)
    warnings = fusion_warnings(model) if provider.startswith("lorafuse") else []
    step = adamw_step(model, token_ids(SHAPES[shape]["vocab_size"], batch, seq, device), LR)
    result = time_training(step, args.warmup, args.steps, device, host_gpu=False)
    result["reserved_GiB"] = torch.cuda.max_memory_reserved() / 2 ** 30 if device.type == "cuda" else math.nan
    result["warnings"] = warnings
    return result


def attempt(run, device):
    """(result, status, note) of run(): ok, skipped (Skipped), oom (torch.OutOfMemoryError) or error (any other
    exception, its traceback printed); everything freed afterwards."""
    result, note = None, ""
    try:
        result, status = run(), "ok"
    except Skipped as exc:
        status, note = "skipped", str(exc)
    except torch.OutOfMemoryError as exc:
        status, note = "oom", str(exc).splitlines()[0][:160]
    except Exception as exc:
        traceback.print_exc(limit=-8)
        status, note = "error", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    free(device)  # out of the except block: the traceback's frames (the model, the activations) are gone
    return result, status, note


def run_provider(provider, shape, contexts, device, dtype, args, watch):
    """{(batch, seq): (result, status, note)} of one in-process provider over `contexts` (fewest tokens first)."""
    cells, ran_out = {}, None
    for batch, seq in contexts:
        if ran_out is not None:
            cells[batch, seq] = None, SKIPPED_AFTER_OOM, f"ran out at {label(*ran_out)}"
            continue
        seen, start = len(watch.messages), time.perf_counter()
        result, status, note = attempt(lambda: run_cell(provider, shape, batch, seq, device, dtype, args), device)
        if result is not None:
            fallbacks = watch.messages[seen:] + result["warnings"]
            note = "; ".join(fallbacks)
        cells[batch, seq] = result, status, note
        report_cell(provider, batch, seq, result, status, note, time.perf_counter() - start)
        if status == "oom":
            ran_out = batch, seq
    return cells


def report_cell(provider, batch, seq, result, status, note, seconds=None):
    if result is None:
        print(f"  {provider} {label(batch, seq)}: {status}{', ' + note if note else ''}")
        return
    print(f"  {provider} {label(batch, seq)}: peak {gib(result['peak_GiB'], 2)} GiB (reserved "
          f"{gib(result['reserved_GiB'], 2)}), step {result['median_ms']:.1f} ms median, "
          f"{tokens_per_s(result, batch, seq):.0f} tokens/s" + (f"; {seconds:.0f} s in all" if seconds else ""))


# ------------------------------------------------------------------------------------------------
# Unsloth: a process of its own per provider

def run_unsloth(provider, shape, contexts, device, dtype, args):
    """{(batch, seq): (result, status, note)} of an Unsloth provider: unsloth_train_step.py, PYTHONPATH
    --unsloth-site first, offline, given peft's model at dropout 0 (weights saved to a temporary folder with the
    bundled tiny Llama's tokenizer, adapters to a file) and `contexts`, which it steps in turn on one model."""
    from transformers import AutoTokenizer
    from lorafuse._paths import ASSETS
    config = dict(vocab=SHAPES[shape]["vocab_size"], warmup=args.warmup, steps=args.steps, lr=LR,
                  lora=dict(LORA, lora_dropout=0.0), contexts=contexts,
                  gradient_checkpointing=PROVIDERS[provider][1], host_gpu=False)
    with tempfile.TemporaryDirectory() as folder:
        model = build("peft", shape, device, dtype, 0.0)
        adapters = os.path.join(folder, "adapters.pt")
        torch.save({name: p.detach().cpu() for name, p in model.named_parameters() if p.requires_grad}, adapters)
        model.unload().save_pretrained(os.path.join(folder, "model"))
        del model
        free(device)
        AutoTokenizer.from_pretrained(ASSETS / "tiny-llama").save_pretrained(os.path.join(folder, "model"))
        paths = [args.unsloth_site, ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), **UNSLOTH_ENV)
        command = [sys.executable, UNSLOTH_SCRIPT, "--model", os.path.join(folder, "model"), "--adapters", adapters,
                   "--config", json.dumps(config)]
        start = time.perf_counter()
        code, report = stream_subprocess(command, env)
    if code != 0 or report is None:
        note = f"unsloth_train_step.py exited with status {code}" + ("" if report else ", no JSON line")
        return {context: (None, "error", note) for context in contexts}
    print(f"  {provider}: {time.perf_counter() - start:.0f} s in all")
    cells, ran_out = {}, None
    for (batch, seq), result in zip(contexts, report["contexts"] + [None] * len(contexts)):
        if ran_out is not None:
            cells[batch, seq] = None, SKIPPED_AFTER_OOM, f"ran out at {label(*ran_out)}"
        elif result is None:
            cells[batch, seq] = None, "error", "unsloth_train_step.py gave no result"
        elif "oom" in result:
            cells[batch, seq], ran_out = (None, "oom", result["oom"]), (batch, seq)
        else:
            cells[batch, seq] = result, "ok", ""
        report_cell(provider, batch, seq, *cells[batch, seq])
    return cells


# ------------------------------------------------------------------------------------------------
# Rows, table

def label(batch, seq):
    """A context as the table heads it: 2k x4, 16k, 128k."""
    text = f"{seq // 1024}k" if seq % 1024 == 0 else str(seq)
    return text if batch == 1 else f"{text} x{batch}"


def context_key(batch, seq):
    """A context as --contexts and the rows write it: 2048x4, 16384."""
    return str(seq) if batch == 1 else f"{seq}x{batch}"


def tokens_per_s(result, batch, seq):
    return batch * seq / (result["median_ms"] / 1e3)


def commit(given):
    """--commit, else git's HEAD (short) with +dirty when tracked files differ from it, else "unknown"."""
    if given:
        return given
    try:
        git = functools.partial(subprocess.run, capture_output=True, text=True, check=True, cwd=ROOT)
        head = git(["git", "rev-parse", "--short", "HEAD"]).stdout.strip()
        dirty = git(["git", "status", "--porcelain", "--untracked-files=no"]).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def rows_of(env, shape, provider, cells, table):
    """CSV rows of one provider's cells; ratio against peft's cells of `table` at the same context."""
    rows = []
    for (batch, seq), (result, status, note) in cells.items():
        row = dict(env, bench="memory", shape=shape, provider=provider, checkpointing=str(PROVIDERS[provider][1]),
                   context=context_key(batch, seq), batch=batch, seq=seq, tokens=batch * seq, status=status,
                   note=note, peak_GiB="", reserved_GiB="", tokens_per_s="", median_ms="", ratio="")
        if result is not None:
            row.update(median_ms=result["median_ms"], tokens_per_s=tokens_per_s(result, batch, seq),
                       **{k: "" if math.isnan(result[k]) else result[k] for k in ("peak_GiB", "reserved_GiB")})
            base = table.get(BASELINE, {}).get((batch, seq), (None,))[0]
            if base is not None:
                row["ratio"] = row["tokens_per_s"] / tokens_per_s(base, batch, seq)
        rows.append(row)
    return rows


def write_rows(rows, dirs):
    """Append rows to <dir>/memory.csv for each dir; a file whose header is not COLUMNS is refused."""
    for out_dir in dirs:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "memory.csv")
        if os.path.exists(path):
            with open(path, newline="") as f:
                header = next(csv.reader(f), None)
            if header != COLUMNS:
                raise SystemExit(f"{path}: its columns are not bench_memory's {COLUMNS}: move it aside")
        with open(path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            if f.tell() == 0:
                writer.writeheader()
            writer.writerows(rows)


def cell_text(cell, batch, seq):
    result, status, _ = cell
    if result is None:
        return {"oom": "OOM", SKIPPED_AFTER_OOM: "(OOM)", "skipped": "skipped", "error": "ERROR"}[status]
    return f"{gib(result['peak_GiB'])} / {si(tokens_per_s(result, batch, seq))}"


def gib(value, digits=1):
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def si(value):
    return f"{value / 1e3:.1f}k" if value >= 1e3 else f"{value:.0f}"


def print_table(table, contexts, device):
    width = max(len(p) for p in table) + 2 if table else 10
    print(f"\n{'peak GiB / tokens/s':{width}}" + "".join(f"{label(*c):>15}" for c in contexts))
    for provider, cells in table.items():
        print(f"{provider:{width}}" + "".join(f"{cell_text(cells[c], *c):>15}" for c in contexts))
    base = table.get(BASELINE, {})
    compared = [c for c in contexts if base.get(c, (None,))[0] is not None]
    if compared:
        print(f"\n{'tokens/s / peft':{width}}" + "".join(f"{label(*c):>15}" for c in compared))
        for provider, cells in table.items():
            ratios = [cells[c][0] and tokens_per_s(cells[c][0], *c) / tokens_per_s(base[c][0], *c) for c in compared]
            print(f"{provider:{width}}" + "".join(f"{r:14.2f}x" if r else f"{'-':>15}" for r in ratios))
    print("(peak GiB: max_memory_allocated over the timed steps" + (", not measured on CPU" if device.type != "cuda"
          else "") + "; tokens/s from the median step; OOM: ran out of memory, (OOM): not tried, fewer tokens ran "
          "out)")
    for provider, cells in table.items():
        notes = {}  # (status, note): contexts, so that a provider skipped everywhere is said once
        for c, (_, status, note) in cells.items():
            if status in ("skipped", "error") or (status == "ok" and note):
                notes.setdefault((status, note), []).append(label(*c))
        for (status, note), labels in notes.items():
            print(f"  {provider} {', '.join(labels)}: {status}: {note}")


# ------------------------------------------------------------------------------------------------
# Driver

def parse_contexts(text, parser):
    """[(batch, seq)] of --contexts, fewest tokens first."""
    contexts = []
    for item in (i for i in text.split(",") if i):
        seq, _, batch = item.lower().partition("x")
        try:
            seq = int(seq[:-1]) * 1024 if seq.endswith("k") else int(seq)
            batch = int(batch) if batch else 1
        except ValueError:
            parser.error(f"--contexts {item}: SEQxBATCH or SEQ (e.g. 2048x4, 16384, 16k)")
        if not 0 < seq <= MAX_POSITIONS or batch < 1:
            parser.error(f"--contexts {item}: seq in 1..{MAX_POSITIONS}, batch >= 1")
        contexts.append((batch, seq))
    return sorted(dict.fromkeys(contexts), key=lambda c: (c[0] * c[1], c[1]))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--providers", default=",".join(PROVIDERS),
                        help=f"comma-separated subset of {tuple(PROVIDERS)}")
    parser.add_argument("--contexts", help=f"comma-separated SEQxBATCH or SEQ (batch 1) (default {CONTEXTS})")
    parser.add_argument("--warmup", type=int, default=WARMUP, help=f"training steps before timing (>= 1; {WARMUP})")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"timed training steps ({STEPS})")
    parser.add_argument("--out", action="append", metavar="DIR",
                        help="write memory.csv under DIR (repeatable) instead of benchmarks/results and $OUT")
    parser.add_argument("--shape", default="llama1B", choices=[s for s in SHAPES if s != "tiny"],
                        help="bench_train_step's model shape (llama1B; llama8B_L8: Llama-3.1-8B with 8 layers)")
    parser.add_argument("--commit", help="the commit the rows record (default: git's; for a tree without .git)")
    parser.add_argument("--unsloth-site", default="/tmp/unsloth_site",
                        help="the folder the Unsloth wheels are installed into (shared/gpu-wheels-unsloth/README.md)")
    # CPU dry run of the script (TRITON_INTERPRET=1 for lorafuse's kernels): --device cpu --tiny
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.providers = chosen_providers(parser, args.providers, PROVIDERS)
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be >= 1")
    args.contexts = parse_contexts(args.contexts or (TINY_CONTEXTS if args.tiny else CONTEXTS), parser)
    return args


def main():
    args = parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1" and dtype == torch.bfloat16:
        from tests import triton_interpreter  # noqa: F401  (bf16 in the interpreter computes as on a GPU)
    # bench_train_step.base_model builds every model from its LLAMA: room for the longest context
    bench_train_step.LLAMA["max_position_embeddings"] = MAX_POSITIONS
    shape = "tiny" if args.tiny else args.shape
    env = dict(environment(), commit=commit(args.commit))
    dirs = result_dirs(args.out, dry_run=device.type != "cuda")
    start, watch, table = time.perf_counter(), LogWatch(), {}
    print(f"{shape}, LoRA r={LORA['r']} dropout 0, commit {env['commit']}; contexts "
          f"{', '.join(label(*c) for c in args.contexts)}; providers {', '.join(args.providers)}")
    for provider in args.providers:
        kind = PROVIDERS[provider][0]
        print(f"\n{provider}")
        try:
            available(kind, device, 0.0, args.unsloth_site)
        except Skipped as exc:
            cells = {c: (None, "skipped", str(exc)) for c in args.contexts}
            print(f"  {provider}: skipped, {exc}")
        else:
            if kind == "unsloth":
                cells = run_unsloth(provider, shape, args.contexts, device, dtype, args)
            else:
                with liger_patches_undone() if kind == "peft_liger" else contextlib.nullcontext():
                    cells = run_provider(provider, shape, args.contexts, device, dtype, args, watch)
        table[provider] = cells
        if dirs:  # each provider's rows as soon as they exist: a run stopped later keeps them
            write_rows(rows_of(env, shape, provider, cells, table), dirs)
    print_table(table, args.contexts, device)
    errors = [(p, c) for p, cells in table.items() for c, cell in cells.items() if cell[1] == "error"]
    written = ("rows appended to " + ", ".join(os.path.join(d, "memory.csv") for d in dirs) if dirs
               else "no rows written")
    print(f"\ntotal {time.perf_counter() - start:.0f} s; {written}"
          + (f"; {len(errors)} cells raised (above)" if errors else ""))
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
