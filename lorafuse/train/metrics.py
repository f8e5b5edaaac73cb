"""Where training metrics go: `metrics.jsonl` in the run directory and accelerate's trackers (train.report_to:
TensorBoard in run_dir/tensorboard by default), main process only; and the loss-curve PNG drawn from the JSON lines
at the end."""
import json
import math
import os
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.tracking import GeneralTracker, MLflowTracker, WandBTracker

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"  # written last: a run has finished when its summary is of its last step
# accelerate's TensorBoard tracker writes to <logging_dir>/<project name>: with the run directory as logging_dir
# (trainer.py), this name puts the events in run_dir/tensorboard.
TENSORBOARD_PROJECT = "tensorboard"
PROJECT = "lorafuse"  # the W&B project and the MLflow experiment (MLFLOW_EXPERIMENT_NAME overrides it)


def trackers(report_to: list[str], run_dir: str | Path) -> list[str | GeneralTracker] | None:
    """Accelerator's log_with for train.report_to: TensorBoard by name (MetricsLog starts it); W&B and MLflow built
    here, so that they take lorafuse's project name rather than TensorBoard's directory name, and their run is named
    after the run directory. None for [none]."""
    run_name = Path(run_dir).name
    built = {"tensorboard": lambda: "tensorboard",
             "wandb": lambda: WandBTracker(PROJECT, name=run_name),
             "mlflow": lambda: MLflowTracker(PROJECT, run_name=run_name)}
    return [built[name]() for name in report_to if name != "none"] or None


class MetricsLog:
    """One JSON object per logged step in `metrics.jsonl`, each also logged to the accelerator's trackers.

    On resume from step `resumed_from`, rows after it (logged by the interrupted run past its last
    checkpoint) are dropped from both (TensorBoard's by purge_step), so that they read as one uninterrupted run.
    The trackers are ended by accelerator.end_training().
    """

    def __init__(self, run_dir: str | Path, accelerator: Accelerator, resumed_from: int = 0):
        self.path = Path(run_dir) / METRICS_FILE
        self.accelerator = accelerator
        rows = read_metrics(self.path) if resumed_from else []
        self.path.write_text("".join(json.dumps(row) + "\n" for row in rows if row["step"] <= resumed_from))
        accelerator.init_trackers(TENSORBOARD_PROJECT, init_kwargs={"tensorboard": {"purge_step": resumed_from + 1}})

    def log(self, step: int, **values: float) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps({"step": step, **values}) + "\n")
        self.accelerator.log(values, step=step)


def memory_stats(device: torch.device) -> dict[str, float]:
    """The GPU memory part of a log row, in GiB: allocated and reserved now, and the peak allocated since the previous
    call, whose window it closes by resetting the peak counter. Empty off CUDA. The allocator's own counts: no sync."""
    if device.type != "cuda":
        return {}
    stats = {"mem_allocated_GiB": torch.cuda.memory_allocated(device) / 2**30,
             "mem_reserved_GiB": torch.cuda.memory_reserved(device) / 2**30,
             "mem_peak_GiB": torch.cuda.max_memory_allocated(device) / 2**30}
    torch.cuda.reset_peak_memory_stats(device)
    return stats


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def plot_loss_curve(metrics_path: str | Path, png_path: str | Path) -> None:
    """Train loss (and eval loss where evaluated) against the optimizer step."""
    # matplotlib writes its font cache into its config directory (~/.cache/matplotlib by default): into the run
    # directory's cache instead, so that a run writes nowhere else (read when matplotlib is first imported)
    os.environ.setdefault("MPLCONFIGDIR", str(Path(png_path).parent / "cache" / "matplotlib"))
    import matplotlib
    matplotlib.use("Agg")  # no display: render to the file only
    from matplotlib import pyplot as plt

    rows = read_metrics(metrics_path)
    figure, axes = plt.subplots(figsize=(7, 4))
    for key, label in (("loss", "train loss"), ("eval_loss", "eval loss")):
        points = [(row["step"], row[key]) for row in rows if key in row and math.isfinite(row[key])]
        if points:
            axes.plot(*zip(*points), marker="o" if key == "eval_loss" else None, label=label)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("loss (nats per token)")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(png_path, dpi=120)
    plt.close(figure)
