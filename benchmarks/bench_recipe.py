"""Does the recipe train faster? recipes/finetune.py timed as a user runs it: its step captured, eager, and on PEFT's
LoRA layers.

    python benchmarks/bench_recipe.py                      # llama1b_random, packed 2048-token rows, batch 4, 50 steps
    python benchmarks/bench_recipe.py lora.dropout=0       # overrides of the recipe's config, given to every run
    python benchmarks/bench_recipe.py --model tiny --max-length 128 --steps 3 --log-every 1 --warmup-rows 1  # CPU

The recipe needs hydra-core, omegaconf and datasets: on a GPU machine without network, PYTHONPATH=/tmp/site:$PWD with
shared/gpu-wheels installed into /tmp/site.

Method: one run of the recipe per variant, one after the other, each in a subprocess and a temporary run_dir:

    python recipes/finetune.py model=<--model> data.packing=true data.max_length=<--max-length> data.eval_fraction=0
        train.batch_size=<--batch> train.max_steps=<--steps> train.log_every=<--log-every> train.eval_every=0
        train.save_every_n_steps=0 run_dir=<temporary> <variant's overrides> <the command line's overrides>

  lorafuse_captured  train.cuda_graphs=true: the step is one CUDA graph replay (lorafuse.train.captured_step); the
                     trainer pads packed rows to max_length then, so that every batch has one shape. Without CUDA
                     train.cuda_graphs=auto, which trains eagerly and says why in the log (a dry run of the plumbing)
  lorafuse           train.cuda_graphs=false: eager steps, rows padded to the batch's longest
  peft               lora.fused=false lora.model_kernels=false train.cuda_graphs=false: PEFT's LoRA layers, the
                     baseline; attention stays lorafuse's, which packing needs (the recipe refuses sdpa with packing)

The bundled demo data (conf/data/demo.yaml, 3000 samples) packs into about 42 rows of 2048 tokens with the bundled
tokenizer: 10 steps of 4 rows an epoch, and the sampler loops over epochs (lorafuse/train/batches.py), so any
--steps runs. No eval split (data.eval_fraction=0) and no checkpoint before the last: the runs time training alone.

Each run's metrics.jsonl (lorafuse.train.metrics) holds a row every --log-every steps, its tokens_per_s taken over the
steps since the previous row (sample tokens, padding not counted; eval and checkpoint time left out). The first
--warmup-rows rows (Triton compiles, the captured step's eager steps and its capture) are dropped; of the rest:
  tokens_per_s               the median
  median_ms, p20_ms, p80_ms  of each row's time per step: tokens since the previous row / tokens_per_s / steps
  peak_GiB                   the largest mem_peak_GiB of the rows (each row's is the peak since the previous row),
                             where the trainer logs one: on CUDA (blank otherwise)
Prints a table with ratios to peft; rows to benchmarks/results/recipe.csv (and $OUT when set; --out replaces both;
a run without CUDA writes none unless given --out): bench and mode `recipe`, shape `<model>_packed_B<batch>_T<max
length>_r<lora.r>_p<lora.dropout>` (the values the run resolved), baseline peft, ratio = median step time / peft's.
"""
import argparse
import glob
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.common import environment, median_p20_p80, result_dirs, stream_subprocess, write_rows  # noqa: E402

RECIPE = os.path.join(ROOT, "recipes", "finetune.py")
VARIANTS = {
    "lorafuse_captured": ["train.cuda_graphs=true"],
    "lorafuse": ["train.cuda_graphs=false"],
    "peft": ["lora.fused=false", "lora.model_kernels=false", "train.cuda_graphs=false"],
}
BASELINE = "peft"


def main():
    args = parse_args()
    cuda = torch.cuda.is_available()
    env = environment()
    results, problems = {}, []
    with tempfile.TemporaryDirectory() as runs:
        for variant in args.variants:
            run_dir = os.path.join(runs, variant)
            command = [sys.executable, RECIPE] + recipe_overrides(args, variant, cuda) + [f"run_dir={run_dir}"]
            print(f"\n=== {variant}: {' '.join(command)}", flush=True)
            code, _ = stream_subprocess(command)
            if code != 0:
                problems.append(f"ERROR {variant}: the recipe exited with status {code} (its output above)")
                continue
            try:
                results[variant] = measure(run_dir, args.model, args.warmup_rows)
            except ValueError as exc:
                problems.append(f"ERROR {variant}: {exc}")
    rows = rows_of(env, results)
    dirs = result_dirs(args.out, dry_run=not cuda)
    if rows and dirs:
        write_rows(rows, "recipe", dirs)
    print("\n" + ("rows appended to " + ", ".join(os.path.join(d, "recipe.csv") for d in dirs) if rows and dirs
                  else "no rows written"))
    for problem in problems:
        print(problem)
    print_summary(results)
    sys.exit(1 if problems else 0)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="recipe config overrides given to every run, e.g. lora.dropout=0")
    parser.add_argument("--model", default="llama1b_random", help="a file of conf/model/")
    parser.add_argument("--max-length", type=int, default=2048, help="tokens per packed row")
    parser.add_argument("--batch", type=int, default=4, help="rows per step")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--log-every", type=int, default=5, help="steps per metrics row (a host read of the losses)")
    parser.add_argument("--warmup-rows", type=int, default=2, help="metrics rows dropped at the start")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {tuple(VARIANTS)}")
    parser.add_argument("--out", action="append", metavar="DIR",
                        help="write recipe.csv under DIR (repeatable) instead of benchmarks/results and $OUT")
    args = parser.parse_args()
    args.variants = [v for v in args.variants.split(",") if v]
    if set(args.variants) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(set(args.variants) - set(VARIANTS))}")
    if args.steps // args.log_every <= args.warmup_rows:
        parser.error(f"--steps {args.steps} logs {args.steps // args.log_every} rows every --log-every "
                     f"{args.log_every} steps: none left after --warmup-rows {args.warmup_rows}")
    return args


def recipe_overrides(args, variant, cuda):
    variant_overrides = VARIANTS[variant] if cuda or variant != "lorafuse_captured" else ["train.cuda_graphs=auto"]
    return [f"model={args.model}", "data.packing=true", f"data.max_length={args.max_length}", "data.eval_fraction=0",
            f"train.batch_size={args.batch}", f"train.max_steps={args.steps}", f"train.log_every={args.log_every}",
            "train.eval_every=0", "train.save_every_n_steps=0"] + variant_overrides + args.overrides


def measure(run_dir, model, warmup_rows):
    """A run's figures from its metrics.jsonl (the docstring's), and its shape key from the config it resolved."""
    from omegaconf import OmegaConf
    from lorafuse.train.metrics import METRICS_FILE, read_metrics
    logged = [row for row in read_metrics(os.path.join(run_dir, METRICS_FILE)) if "tokens_per_s" in row]
    kept = logged[warmup_rows:]
    if not kept:
        raise ValueError(f"{len(logged)} metrics rows, none after the {warmup_rows} warm-up rows")
    median, p20, p80 = median_p20_p80(step_ms(logged)[warmup_rows:])
    peaks = [row["mem_peak_GiB"] for row in kept if "mem_peak_GiB" in row]
    config = OmegaConf.load(glob.glob(os.path.join(run_dir, ".hydra", "*", "config.yaml"))[0])
    shape = (f"{model}_packed_B{config.train.batch_size}_T{config.data.max_length}_r{config.lora.r}"
             f"_p{config.lora.dropout:g}")
    return {"shape": shape, "tokens_per_s": median_p20_p80([row["tokens_per_s"] for row in kept])[0],
            "median_ms": median, "p20_ms": p20, "p80_ms": p80, "peak_GiB": max(peaks) if peaks else None,
            "rows": len(kept)}


def step_ms(logged):
    """Time per step (ms) of each metrics row: the tokens since the previous row at its tokens_per_s, over its steps."""
    times, tokens_before, step_before = [], 0, 0
    for row in logged:
        seconds = (row["tokens"] - tokens_before) / row["tokens_per_s"]
        times.append(seconds / (row["step"] - step_before) * 1e3)
        tokens_before, step_before = row["tokens"], row["step"]
    return times


def rows_of(env, results):
    rows = []
    base = results.get(BASELINE)
    for variant, r in results.items():
        ratio = r["median_ms"] / base["median_ms"] if base else ""
        metrics = {"tokens_per_s": r["tokens_per_s"]} | ({"peak_GiB": r["peak_GiB"]} if r["peak_GiB"] is not None
                                                          else {})
        for metric, value in metrics.items():
            rows.append(dict(env, bench="recipe", shape=r["shape"], provider=variant, mode="recipe",
                             median_ms=r["median_ms"], p20_ms=r["p20_ms"], p80_ms=r["p80_ms"], metric=metric,
                             value=value, baseline=BASELINE, ratio=ratio))
    return rows


def print_summary(results):
    base = results.get(BASELINE)
    print(f"\n{'variant':18} {'shape':40} {'tokens/s':>9} {'step ms':>8} {'p20-p80 ms':>14} {'peak GiB':>9} "
          f"{'speedup':>8} {'rows':>5}")
    for variant, r in results.items():
        speedup = f"{base['median_ms'] / r['median_ms']:7.2f}x" if base else f"{'-':>8}"
        peak = f"{r['peak_GiB']:9.2f}" if r["peak_GiB"] is not None else f"{'-':>9}"
        spread = f"{r['p20_ms']:.1f}-{r['p80_ms']:.1f}"
        print(f"{variant:18} {r['shape']:40} {r['tokens_per_s']:9.0f} {r['median_ms']:8.1f} {spread:>14} {peak} "
              f"{speedup} {r['rows']:5d}")
    print("(medians over the metrics rows after the warm-up rows; speedup = peft's median step time / the variant's)")


if __name__ == "__main__":
    main()
