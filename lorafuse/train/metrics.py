"""Where training metrics go: `metrics.jsonl` and TensorBoard in the run directory (main process only), and the
loss-curve PNG drawn from the JSON lines at the end."""
import json
import math
import os
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"  # written last: a run has finished when its summary is of its last step


class MetricsLog:
    """One JSON object per logged step in `metrics.jsonl`, each number also a TensorBoard scalar.

    On resume from step `resumed_from`, rows after it (logged by the interrupted run past its last
    checkpoint) are dropped from both, so that the files read as one uninterrupted run.
    """

    def __init__(self, run_dir: str | Path, resumed_from: int = 0):
        self.path = Path(run_dir) / METRICS_FILE
        rows = read_metrics(self.path) if resumed_from else []
        self.path.write_text("".join(json.dumps(row) + "\n" for row in rows if row["step"] <= resumed_from))
        self.tensorboard = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=resumed_from + 1)

    def log(self, step: int, **values: float) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps({"step": step, **values}) + "\n")
        for name, value in values.items():
            self.tensorboard.add_scalar(name, value, step)

    def close(self) -> None:
        self.tensorboard.close()


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
