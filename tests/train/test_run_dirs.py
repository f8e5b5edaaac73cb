"""A run directory holds one run: a fresh start refuses one that holds a started or finished run, whatever of it is
left, and a finished run extended with a higher train.max_steps goes on from the rate its last step ran at."""
import math
import re
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lorafuse.train import ConfigError, FinetuneConfig
from lorafuse.train.config import OptimConfig, Scheduler
from lorafuse.train.metrics import read_metrics
from lorafuse.train.optim import Schedule
from lorafuse.train.resume import RUN_FILES, checkpoint_to_resume

from .test_checkpoint_corruption import recipe_process
from .test_trainer import CONF, QUICK, end_job, finetune, train_interrupted


@pytest.fixture(autouse=True)
def _recipe_process(tmp_path):
    with recipe_process(tmp_path / "matplotlib"):
        yield


def config(run_dir: Path, *overrides: str) -> FinetuneConfig:
    """The config finetune() would train with, without building the job."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="finetune", overrides=[f"run_dir={run_dir}", *QUICK, *overrides])
    return OmegaConf.to_object(cfg)


def run_files_of(run_dir: Path) -> dict[Path, bytes]:
    return {path: path.read_bytes() for path in run_dir.rglob("*") if path.is_file() and "cache" not in path.parts}


# --- fresh starts ----------------------------------------------------------------------------------------------

def test_a_fresh_run_refuses_a_finished_run_whose_checkpoints_were_deleted(tmp_path):
    run_dir = tmp_path / "run"
    finetune(run_dir).train()
    end_job()
    shutil.rmtree(run_dir / "checkpoints")  # to save space
    finished = run_files_of(run_dir)
    with pytest.raises(ConfigError) as refused:
        finetune(run_dir)
    assert str(refused.value) == (
        f"run_dir={run_dir} already holds a run (metrics.jsonl, summary.json, loss_curve.png, adapter/, tensorboard/) "
        "and no checkpoint to continue it from: start this one in another run_dir, or delete those to start over "
        "there")
    assert run_files_of(run_dir) == finished


@pytest.mark.parametrize("name", RUN_FILES)
def test_any_file_of_a_run_is_refused_by_a_fresh_start(tmp_path, name):
    run_dir = tmp_path / "run"
    path = run_dir / name
    if path.suffix:
        path.parent.mkdir(parents=True)
        path.write_text("{}\n")
    else:
        path.mkdir(parents=True)
        (path / "file").write_text("")
    listed = name if path.suffix else f"{name}/"
    with pytest.raises(ConfigError, match=re.escape(f"run_dir={run_dir} already holds a run ({listed})")):
        checkpoint_to_resume(config(run_dir), run_dir, {})


def test_a_run_refused_at_start_up_leaves_nothing_a_fresh_start_refuses(tmp_path):
    run_dir = tmp_path / "run"
    for made in (".hydra/2026-01-01_00-00-00", "cache/json", "checkpoints"):  # an empty checkpoints/ too
        (run_dir / made).mkdir(parents=True)
    (run_dir / "finetune.log").write_text("ConfigError: ...\n")
    assert checkpoint_to_resume(config(run_dir), run_dir, {}) is None


def test_another_runs_checkpoint_is_not_continued_into_a_used_run_dir(tmp_path):
    checkpoint = tmp_path / "other" / "checkpoints" / "step-000002"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text('{"step": 2, "config": {}}')
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    with pytest.raises(ConfigError, match=re.escape(f"run_dir={run_dir} holds files of its own run (metrics.jsonl)")):
        checkpoint_to_resume(config(run_dir, f"train.resume={checkpoint}"), run_dir, {})


# --- extending a finished run ----------------------------------------------------------------------------------

def test_an_extended_run_goes_on_from_the_rate_of_its_last_step(tmp_path):
    """4 steps, then extended to 8: steps 5-8 decay from step 4's rate to lr * min_lr_ratio one step past step 8, in
    the shape of the schedule (cosine), with no jump at step 5. A resume in the middle of the extension keeps it."""
    run_dir, warmup = tmp_path / "run", "optim.warmup_steps=1"
    finetune(run_dir, "train.max_steps=4", warmup).train()
    end_job()
    job = finetune(run_dir, "train.max_steps=8", "train.resume=true", "train.save_every_n_steps=2", warmup)
    train_interrupted(job, steps=2)  # steps 5 and 6 trained, step 6 saved
    end_job()
    finetune(run_dir, "train.max_steps=8", "train.resume=true", warmup).train()

    rates = {row["step"]: row["lr"] for row in read_metrics(run_dir / "metrics.jsonl") if "loss" in row}
    assert sorted(rates) == list(range(1, 9))
    lowest = job.cfg.optim.lr * job.cfg.optim.min_lr_ratio
    cosine = [0.5 * (1 + math.cos(math.pi * k / 5)) for k in range(1, 5)]  # 5: steps 5-8 and the one past them
    assert [rates[step] for step in range(5, 9)] == pytest.approx([lowest + (rates[4] - lowest) * c for c in cosine])
    assert rates[3] > rates[4] > rates[5] > lowest


@pytest.mark.parametrize("scheduler", list(Scheduler))
def test_an_extension_finishes_the_warmup_and_then_decays_from_the_last_rate(scheduler):
    cfg = OptimConfig(scheduler=scheduler, warmup_steps=4, min_lr_ratio=0.1)
    assert Schedule(6).continued(3, 12, cfg) == Schedule(12)  # 3 steps done, in warmup: the decay is over 12 steps
    extended = Schedule(6).continued(6, 12, cfg)  # a finished run of 6 steps
    factors = [extended.factor(step, cfg) for step in range(5, 13)]
    assert factors[0] == Schedule(6).factor(5, cfg)  # its last step, as it ran
    assert all(a >= b for a, b in zip(factors, factors[1:]))
    assert factors[-1] == (1.0 if scheduler is Scheduler.constant else pytest.approx(0.1))
