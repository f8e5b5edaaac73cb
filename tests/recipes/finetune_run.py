"""Running recipes/finetune.py as a user does (a subprocess), and reading what a run leaves."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "finetune.py"
# A run of a few seconds: 240 samples, batch 4, two micro-steps per step, dropout on.
QUICK = ["data.max_samples=240", "train.batch_size=4", "train.grad_accum=2", "train.max_steps=6",
         "train.log_every=1", "train.eval_every=0", "train.save_every_n_steps=0", "lora.dropout=0.1", "lora.r=4"]

# Killed by SIGKILL while publishing the checkpoint named by $KILL_AT: after every file of it is written,
# before the rename that makes it a checkpoint.
KILL_DURING_SAVE = """
import os, runpy, signal, sys
import lorafuse.train.checkpoint as checkpoint
publish = checkpoint.publish
def publish_or_die(tmp, final):
    if final.name == os.environ["KILL_AT"]:
        os.kill(os.getpid(), signal.SIGKILL)
    publish(tmp, final)
checkpoint.publish = publish_or_die
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def recipe_env(home: Path | None = None) -> dict:
    # The recipe's CPU path is the ops' PyTorch reference, as a user's CPU run is (the kernels have their own tests).
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "HF_HOME", "HF_DATASETS_CACHE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["HF_HUB_OFFLINE"] = "1"
    if home is not None:
        env["HOME"] = str(home)
    return env


def run_recipe(*overrides: str, cwd: Path | None = None, home: Path | None = None, kill_at: str | None = None,
               launcher: list[str] = (), check: bool = True, timeout: int = 600) -> subprocess.CompletedProcess:
    """The recipe with Hydra `overrides`; `launcher`: python arguments before the recipe (e.g.
    torch.distributed.run)."""
    command = [sys.executable, *launcher, str(RECIPE), *overrides]
    env = recipe_env(home)
    if kill_at is not None:
        command = [sys.executable, "-c", KILL_DURING_SAVE, str(RECIPE), *overrides]
        env["KILL_AT"] = kill_at
    run = subprocess.run(command, env=env, cwd=cwd or ROOT, capture_output=True, text=True, timeout=timeout)
    if check and run.returncode != 0:
        raise AssertionError(f"recipe exited {run.returncode}\n--- stdout\n{run.stdout}\n--- stderr\n{run.stderr}")
    return run


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_rows(run_dir: Path) -> dict[int, dict]:
    return {row["step"]: row for row in metrics(run_dir) if "loss" in row}
