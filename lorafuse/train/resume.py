"""Which checkpoint a run continues from, and the refusals that keep a resumed run the same run.

A run directory belongs to one run: a fresh start refuses one that holds a started or finished run (`run_files`:
checkpoints, metrics, the adapter, ...), a run resumed from another run's checkpoint refuses one too, and a resumed
run must keep the settings that decide its base model, data order, adapter and optimizer state (`fixed_settings`), and
have steps left, or final files left to write.
"""
import json
import logging
from enum import Enum
from pathlib import Path

import torch

from .checkpoint import checkpoints_dir, latest_checkpoint, read_trainer_state
from .config import ConfigError, FinetuneConfig
from .metrics import METRICS_FILE, SUMMARY_FILE

logger = logging.getLogger(__name__)
# What a run writes to its run_dir once training starts. (Hydra's config and log, and the data cache, are written
# before: a run refused at start-up leaves them too.)
RUN_FILES = ("checkpoints", METRICS_FILE, SUMMARY_FILE, "adapter", "merged", "loss_curve.png", "tensorboard",
             "profile")


def fixed_settings(cfg: FinetuneConfig, processes: int, precision: str, storage_dtype: torch.dtype) -> dict:
    """The settings a resumed run must share with its checkpoint, `precision` (accelerate's mixed-precision mode) and
    `storage_dtype` (the frozen weights' dtype) as this run resolved them. (train.max_steps, logging, saving and eval
    settings, the attention implementation and trust_remote_code may change.)"""
    settings = {f"{group}.{key}": value.value if isinstance(value, Enum) else value
                for group in ("data", "lora", "optim") for key, value in vars(getattr(cfg, group)).items()
                if key != "cache_dir"}
    # the base model the adapter was trained on (the checkpoint holds the adapter alone)
    settings |= {f"model.{key}": getattr(cfg.model, key)
                 for key in ("name_or_path", "tokenizer", "random_init", "config_overrides")}
    # Resolved, not as written: model.dtype=auto stores the base in train.precision's dtype, and train.precision=auto
    # is bf16 on CUDA and no elsewhere. Another storage dtype changes the frozen weights the adapter was trained on,
    # and another mixed-precision mode the numerics (fp16's grad scaler state exists in fp16 checkpoints only).
    settings["model.dtype (frozen weights, auto resolved)"] = str(storage_dtype).removeprefix("torch.")
    settings["train.precision (auto resolved)"] = precision
    settings["train.seed"] = cfg.train.seed
    settings["processes"] = processes  # each restores its own RNG state
    settings["global batch (train.batch_size x processes x train.grad_accum)"] = (
        cfg.train.batch_size * processes * cfg.train.grad_accum)
    return settings


def checkpoint_to_resume(cfg: FinetuneConfig, run_dir: Path, settings: dict) -> Path | None:
    """The checkpoint that train.resume names (None: a fresh start), after checking it may be continued with
    `settings` (fixed_settings of this run)."""
    resume = cfg.train.resume
    if resume in (False, "false", "False"):
        _refuse_a_used_run_dir(run_dir)
        return None
    checkpoint = latest_checkpoint(run_dir) if resume in (True, "true", "True") else Path(resume)
    if checkpoint is None:
        raise ConfigError(f"train.resume=true: {run_dir}/checkpoints holds no checkpoint yet "
                          "(pass run_dir=<the run to resume>, or a checkpoint directory as train.resume)")
    saved = read_trainer_state(checkpoint)
    if saved is None:
        raise ConfigError(f"train.resume={resume}: not a checkpoint (a step-N directory under "
                          "<run_dir>/checkpoints, holding trainer_state.json)")
    own = checkpoint.resolve().parent == checkpoints_dir(run_dir).resolve()
    listing = ", ".join(run_files(run_dir))
    if not own and listing:
        held = "checkpoints" if latest_checkpoint(run_dir) is not None else "files"
        raise ConfigError(f"train.resume={resume}: run_dir={run_dir} holds {held} of its own run ({listing}); "
                          "continue another run's checkpoint in a fresh run_dir, so that the two runs' metrics and "
                          "checkpoints stay apart")
    # A run whose training ended but whose last files were not all written (a crash while merging, say) resumes
    # its final checkpoint to write them. The summary is written last, so the run is unfinished unless a summary of
    # this step exists (a run extended past an earlier end keeps that end's summary until it writes its own).
    unfinished = (own and saved.get("final", False) and saved["step"] == cfg.train.max_steps
                  and _summary_step(run_dir) != saved["step"])
    if saved["step"] >= cfg.train.max_steps and not unfinished:
        raise ConfigError(f"train.resume: {checkpoint} is at step {saved['step']}, and train.max_steps="
                          f"{cfg.train.max_steps}: raise train.max_steps to train further")
    unchecked = [key for key in settings if key not in saved["config"]]
    if unchecked:  # a checkpoint from a version that did not record them: resumable, with what it did record
        logger.warning("train.resume: %s records no %s (saved by an earlier lorafuse): not compared", checkpoint,
                       ", ".join(unchecked))
    changed = [f"{key}: {saved['config'][key]!r} in the checkpoint, {value!r} now"
               for key, value in settings.items() if key in saved["config"] and saved["config"][key] != value]
    if changed:
        raise ConfigError("train.resume: these settings differ from the checkpoint's, so the run would not "
                          "continue as it was: " + "; ".join(changed))
    return checkpoint


def run_files(run_dir: Path) -> list[str]:
    """The RUN_FILES that `run_dir` holds, directories with a trailing slash (an empty one does not count)."""
    paths = [run_dir / name for name in RUN_FILES]
    return [path.name for path in paths if path.is_file()] + [
        f"{path.name}/" for path in paths if path.is_dir() and any(path.iterdir())]


def _refuse_a_used_run_dir(run_dir: Path) -> None:
    """Refuses a fresh start in a run_dir that holds a started or finished run: the start would overwrite its metrics
    and mix its files with the new run's."""
    listing = ", ".join(run_files(run_dir))
    if not listing:
        return
    if latest_checkpoint(run_dir) is not None:
        raise ConfigError(f"run_dir={run_dir} already holds checkpoints: continue that run with train.resume=true, or "
                          f"start this one in another run_dir (it holds {listing}, which a fresh run would "
                          "overwrite)")
    raise ConfigError(f"run_dir={run_dir} already holds a run ({listing}) and no checkpoint to continue it "
                      "from: start this one in another run_dir, or delete those to start over there")


def _summary_step(run_dir: Path) -> int | None:
    """The step of the run's summary, or None where it has none (or one that cannot be read)."""
    try:
        return json.loads((run_dir / SUMMARY_FILE).read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
