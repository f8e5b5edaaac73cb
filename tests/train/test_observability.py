"""What a run reports besides its loss: GPU memory in each log row, and the trackers of train.report_to."""
import importlib.util
import re

import pytest
import torch
from accelerate import Accelerator
from accelerate.tracking import MLflowTracker, WandBTracker
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import lorafuse.train.config as config
from lorafuse.train import register_configs
from lorafuse.train.config import ConfigError, check_report_to
from lorafuse.train.metrics import MetricsLog, memory_stats, read_metrics, trackers
from lorafuse.train.trainer import _memory_postfix

from .test_trainer import end_job, finetune

GiB = 2**30


@pytest.fixture(autouse=True)
def _recipe_process(monkeypatch, tmp_path):
    """The process as tests/train/test_trainer.py sets it up for a job, and the job forgotten after."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path / "matplotlib"))
    register_configs()
    yield
    end_job()


# --- GPU memory ------------------------------------------------------------------------------------------------

class FakeAllocator:
    """torch.cuda's memory counters, set by the test: the peak counter resets to what is allocated, as CUDA's does."""

    def __init__(self, allocated: int, reserved: int, peak: int):
        self.allocated, self.reserved, self.peak = allocated, reserved, peak

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset_peak)

    def reset_peak(self, device=None) -> None:
        self.peak = self.allocated


def test_a_cuda_row_holds_allocated_reserved_and_the_peak_of_its_own_window(monkeypatch):
    allocator = FakeAllocator(allocated=2 * GiB, reserved=6 * GiB, peak=5 * GiB)
    allocator.install(monkeypatch)
    cuda = torch.device("cuda", 0)
    assert memory_stats(cuda) == {"mem_allocated_GiB": 2.0, "mem_reserved_GiB": 6.0, "mem_peak_GiB": 5.0}
    allocator.peak = 3 * GiB  # the next window's peak, below the first one's
    assert memory_stats(cuda)["mem_peak_GiB"] == 3.0
    assert memory_stats(cuda)["mem_peak_GiB"] == 2.0  # nothing above what stayed allocated since


def test_a_cpu_row_has_no_memory_keys(monkeypatch):
    FakeAllocator(allocated=GiB, reserved=GiB, peak=GiB).install(monkeypatch)  # even where CUDA would answer
    assert memory_stats(torch.device("cpu")) == {}


def test_the_progress_bar_shows_allocated_reserved_and_peak_on_cuda_only():
    row = {"loss": 1.0, "mem_allocated_GiB": 1.25, "mem_reserved_GiB": 4.0, "mem_peak_GiB": 3.5}
    assert _memory_postfix(row) == {"mem_GiB": "1.2/4.0/3.5"}
    assert _memory_postfix({"loss": 1.0}) == {}


# --- train.report_to -------------------------------------------------------------------------------------------

def without_package(monkeypatch, missing: str) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(config.importlib.util, "find_spec", lambda name: None if name == missing else find_spec(name))


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_a_tracker_whose_package_is_missing_stops_the_run_before_the_model_loads(tracker, tmp_path, monkeypatch):
    without_package(monkeypatch, tracker)
    monkeypatch.setattr("lorafuse.train.trainer.Finetune._build_model", pytest.fail)  # never reached
    with pytest.raises(ConfigError, match=re.escape(f"train.report_to: {tracker} needs the {tracker} package, which "
                                                    f"is not installed: pip install {tracker}")):
        finetune(tmp_path / "run", f"train.report_to=[tensorboard,{tracker}]")


@pytest.mark.parametrize("trackers", [["comet"], [], ["none", "tensorboard"]])
def test_a_bad_report_to_is_refused_naming_the_key_and_the_allowed_values(trackers):
    with pytest.raises(ConfigError, match=r"^train\.report_to=\[.*\]: .*") as refused:
        check_report_to(trackers)
    if "none" not in trackers:
        assert "a list of tensorboard, wandb, mlflow, none" in str(refused.value)
    else:
        assert "stands alone: [none]" in str(refused.value)


@pytest.mark.parametrize("trackers", [["tensorboard"], ["none"], ["tensorboard", "wandb", "mlflow"]])
def test_known_trackers_whose_packages_are_installed_pass(trackers, monkeypatch):
    monkeypatch.setattr(config.importlib.util, "find_spec", lambda name: object())  # every package installed
    check_report_to(trackers)


def test_wandb_and_mlflow_are_named_after_lorafuse_and_the_run_dir_and_tensorboard_by_its_directory():
    wandb, mlflow = trackers(["wandb", "mlflow"], "/runs/2026-11-29_03-00-00")[0:2]
    assert isinstance(wandb, WandBTracker) and wandb.run_name == "lorafuse"
    assert wandb.init_kwargs == {"name": "2026-11-29_03-00-00"}
    assert isinstance(mlflow, MLflowTracker) and mlflow.run_name == "2026-11-29_03-00-00"
    assert trackers(["tensorboard"], "/runs/a") == ["tensorboard"]
    assert trackers(["none"], "/runs/a") is None


def scalars(tensorboard_dir, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(tensorboard_dir))
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


def test_by_default_a_run_logs_to_tensorboard_in_its_run_dir_and_to_metrics_jsonl(tmp_path):
    run_dir = tmp_path / "run"
    job = finetune(run_dir)
    assert job.cfg.train.report_to == ["tensorboard"]
    job.train()
    rows = [row for row in read_metrics(run_dir / "metrics.jsonl") if "loss" in row]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(set(row) == {"step", "loss", "lr", "grad_norm", "tokens_per_s", "tokens"} for row in rows)  # CPU
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert scalars(run_dir / "tensorboard", "loss") == [(row["step"], pytest.approx(row["loss"])) for row in rows]
    eval_loss = [(row["step"], row["eval_loss"]) for row in read_metrics(run_dir / "metrics.jsonl")
                 if "eval_loss" in row]
    assert scalars(run_dir / "tensorboard", "eval_loss") == [(step, pytest.approx(value)) for step, value in eval_loss]


def test_report_to_none_writes_metrics_jsonl_alone(tmp_path):
    run_dir = tmp_path / "run"
    finetune(run_dir, "train.report_to=[none]").train()
    assert [row["step"] for row in read_metrics(run_dir / "metrics.jsonl") if "loss" in row] == [1, 2]
    assert not (run_dir / "tensorboard").exists()


def test_a_resumed_log_drops_the_tensorboard_rows_after_its_step(tmp_path):
    """TensorBoard's rows past the checkpoint resumed from (logged by the interrupted run) are purged, as
    metrics.jsonl's are."""
    for resumed_from, losses in ((0, [3.0, 2.0, 1.0]), (1, [0.5, 0.25])):
        accelerator = Accelerator(cpu=True, log_with=["tensorboard"], project_dir=str(tmp_path))
        log = MetricsLog(tmp_path, accelerator, resumed_from=resumed_from)
        for step, loss in enumerate(losses, start=resumed_from + 1):
            log.log(step, loss=loss)
        accelerator.end_training()
        end_job()
    expected = [(1, 3.0), (2, 0.5), (3, 0.25)]
    assert [row["loss"] for row in read_metrics(tmp_path / "metrics.jsonl")] == [loss for _, loss in expected]
    assert scalars(tmp_path / "tensorboard", "loss") == expected
