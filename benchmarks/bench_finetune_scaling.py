"""Does recipes/finetune.py scale to several GPUs? One GPU against `accelerate launch` DDP (and FSDP) at the
same global batch: per-step losses side by side, and tokens/s.

    python benchmarks/bench_finetune_scaling.py --gpus 2 [--steps 40] [--fsdp] [--micro-batch 4]

Runs the recipe itself (subprocesses) on the Llama-3.2-1B shape with random weights (conf/model/
llama1b_random.yaml), the bundled demo data packed into 2048-token rows, --micro-batch rows (4) per GPU per
micro-step, LoRA r=16 on all linear layers, dropout 0 (so that the runs differ only by the reduction order).
One GPU takes grad_accum=N micro-batches per step, N GPUs one each: the same samples per step.
Rows go to <out>/finetune_scaling.csv (commit the ones kept to benchmarks/results/).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from common import environment, write_rows

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "finetune.py"
WARMUP_STEPS = 5  # compilation, autotuning and allocator growth: left out of tokens/s
LENGTH = 2048


def recipe_args(run_dir: Path, steps: int, grad_accum: int, micro_batch: int) -> list[str]:
    return ["model=llama1b_random", "data.packing=true", f"data.max_length={LENGTH}", "data.eval_fraction=0",
            f"train.batch_size={micro_batch}", f"train.grad_accum={grad_accum}", f"train.max_steps={steps}",
            "train.log_every=1", "train.eval_every=0", "train.save_every_n_steps=0", "lora.dropout=0",
            "optim.lr=2e-4", f"run_dir={run_dir}"]


def run(name: str, command: list[str], run_dir: Path, out: Path, env: dict) -> Path:
    """Runs `command` (a recipe run into `run_dir`); its metrics (and its log, if it fails) are copied to `out`."""
    print(f"\n=== {name}: {' '.join(command)}", flush=True)
    log = run_dir.parent / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as handle:
        done = subprocess.run(command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        shutil.copy(log, out / log.name)
        print(log.read_text()[-6000:])
        raise SystemExit(f"{name} failed with exit code {done.returncode}")
    shutil.copy(run_dir / "metrics.jsonl", out / f"{name}_metrics.jsonl")
    return run_dir


def steps_of(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows if "loss" in row}


def median_tokens_per_s(by_step: dict[int, dict]) -> float:
    return statistics.median(row["tokens_per_s"] for step, row in by_step.items() if step > WARMUP_STEPS)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--fsdp", action="store_true", help="also run FSDP2 (conf/accelerate/fsdp.yaml)")
    parser.add_argument("--micro-batch", type=int, default=4, help="rows of 2048 tokens per GPU per micro-step")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_finetune_scaling"),
                        help="logs, per-step metrics and the CSV rows")
    parser.add_argument("--runs", default="/tmp/bench_finetune_scaling_runs", help="the recipe's run directories")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))

    runs_dir = Path(args.runs)
    one_gpu = dict(env, CUDA_VISIBLE_DEVICES="0")

    def one_gpu_run(name):
        command = [sys.executable, str(RECIPE), *recipe_args(runs_dir / name, args.steps, args.gpus, args.micro_batch)]
        return run(name, command, runs_dir / name, out, one_gpu)

    runs = {"1gpu": one_gpu_run("1gpu")}
    launchers = {"ddp": "conf/accelerate/ddp.yaml"} | ({"fsdp": "conf/accelerate/fsdp.yaml"} if args.fsdp else {})
    for kind, config in launchers.items():
        name = f"{kind}{args.gpus}"
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config,
                   "--num_processes", str(args.gpus), str(RECIPE),
                   *recipe_args(runs_dir / name, args.steps, 1, args.micro_batch)]
        runs[name] = run(name, command, runs_dir / name, out, env)
    # One GPU again, last: this machine's single-GPU speed moved by up to 20% between runs (the step is partly
    # host-bound); the faster of the two is the baseline, so that the speed-ups are not flattered.
    runs["1gpu_again"] = one_gpu_run("1gpu_again")

    steps = {name: steps_of(run_dir) for name, run_dir in runs.items()}
    base = steps["1gpu"]
    tags = environment()
    rows, table = [], []
    base_tps = max(median_tokens_per_s(steps[name]) for name in ("1gpu", "1gpu_again"))
    shape = f"llama1B_random_T{LENGTH}_B{args.micro_batch * args.gpus}_r16"
    for name, by_step in steps.items():
        tokens_per_s = median_tokens_per_s(by_step)
        step_ms = 1000 * args.micro_batch * args.gpus * LENGTH / tokens_per_s
        rel = max(abs(by_step[s]["loss"] - base[s]["loss"]) / abs(base[s]["loss"]) for s in base)
        common = dict(tags, bench="finetune_scaling", shape=shape, provider=name, mode="train_step",
                      median_ms=step_ms, p20_ms="", p80_ms="", baseline="1gpu_best",
                      ratio=base_tps / tokens_per_s)
        rows.append(dict(common, metric="tokens_per_s", value=tokens_per_s))
        rows.append(dict(common, metric="loss_max_rel_diff", value=rel))
        table.append((name, tokens_per_s, tokens_per_s / base_tps, by_step[args.steps]["loss"], rel))

    print("\nper-step loss (first 10 and last):")
    for step in [*range(1, 11), args.steps]:
        print(f"  step {step:3d}  " + "  ".join(f"{name} {steps[name][step]['loss']:.5f}" for name in steps))
    write_rows(rows, "finetune_scaling", [out])
    print(f"\n{'run':8s} {'tokens/s':>10s} {'speed-up':>9s} {'final loss':>11s} {'max rel. loss diff':>19s}")
    for name, tps, speedup, final, rel in table:
        print(f"{name:8s} {tps:10.0f} {speedup:9.2f} {final:11.5f} {rel:19.2e}")


if __name__ == "__main__":
    main()
