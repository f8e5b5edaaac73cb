"""Checkpoints that survive a crash: written to a temporary directory, published by one atomic rename.

A checkpoint is `<run_dir>/checkpoints/step-<N>/`, holding
- accelerate's state: the trainable weights only (frozen base weights are the model's own and never change),
  optimizer, scheduler, the RNG states of every process, the grad scaler;
- `adapter/`: the adapter in PEFT's format (usable on its own: PeftModel.from_pretrained loads it);
- `trainer_state.json`: the step and counters the loop resumes from.
A `step-*` directory exists only once complete: killing the process mid-save leaves a `.tmp-step-*` directory,
which the next save or resume ignores and removes, and the previous checkpoint as it was.
"""
import json
import logging
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

from accelerate import Accelerator

from ..hf.loading import save_adapter

logger = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step-(\d+)$")
_STATE_FILE = "trainer_state.json"


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint of `run_dir`, or None."""
    steps = _complete_checkpoints(checkpoints_dir(run_dir))
    return steps[-1] if steps else None


def save_checkpoint(accelerator: Accelerator, model, run_dir: str | os.PathLike, step: int, state: dict,
                    keep: int) -> Path:
    """Saves the run's state after optimizer step `step`; every process must call it. Returns the checkpoint."""
    root = checkpoints_dir(run_dir)
    final, tmp = root / f"step-{step:06d}", root / f".tmp-step-{step:06d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))  # every process writes its RNG state; weights through the save hook below
    state_dict = accelerator.get_state_dict(model)  # a collective under FSDP: every process takes part
    if accelerator.is_main_process:
        save_adapter(accelerator.unwrap_model(model), tmp / "adapter", state_dict)
        _write_json(tmp / _STATE_FILE, {**state, "step": step})
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        publish(tmp, final)
        logger.info("checkpoint saved: %s", final)
        _prune(root, keep, final)
    accelerator.wait_for_everyone()
    return final


def read_trainer_state(checkpoint: str | os.PathLike) -> dict | None:
    """The trainer state saved with `checkpoint`, or None when `checkpoint` is not a checkpoint."""
    state_file = Path(checkpoint) / _STATE_FILE
    return json.loads(state_file.read_text()) if state_file.is_file() else None


def load_checkpoint(accelerator: Accelerator, checkpoint: str | os.PathLike) -> dict:
    """Restores what `save_checkpoint` saved (weights, optimizer, scheduler, RNG) and returns the trainer state."""
    state = read_trainer_state(checkpoint)
    if state is None:
        raise FileNotFoundError(f"{checkpoint} is not a lorafuse checkpoint (no {_STATE_FILE})")
    accelerator.load_state(str(checkpoint), strict=False)  # strict=False: the frozen base weights are not in it
    return state


def keep_trainable_weights_only(accelerator: Accelerator) -> None:
    """Makes accelerate's save_state write only trainable parameters (a LoRA checkpoint stays megabytes, not the
    whole base model). FSDP saves through its own path and is left as it is."""
    def hook(models, weights, output_dir):
        for model, weight in zip(models, weights):
            trainable = {name for name, param in model.named_parameters() if param.requires_grad}
            for name in [name for name in weight if name not in trainable]:
                del weight[name]
    accelerator.register_save_state_pre_hook(hook)


def publish(tmp: Path, final: Path) -> None:
    """Makes `tmp`, a complete file or directory, `final` by one atomic rename: `final` is never seen half-written."""
    _fsync_tree(tmp)
    # A directory cannot be renamed onto an existing one (a step saved again, by a run resumed from an earlier
    # checkpoint): the old one moves aside first and is deleted only once the new one is in place, so a kill
    # in between leaves `.old-step-N`, complete, never nothing (latest_checkpoint finds it). A file replaces a file
    # in the rename itself.
    stale = final.with_name(f".old-{final.name}")
    if final.is_dir():
        shutil.rmtree(stale, ignore_errors=True)
        os.replace(final, stale)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    shutil.rmtree(stale, ignore_errors=True)


@contextmanager
def publishing(final: Path):
    """A temporary path beside `final` for the block to write a file or directory to, published as `final` when the
    block ends without error: a crash inside leaves `final` as it was, and the next call clears what it left."""
    tmp = final.with_name(f".tmp-{final.name}")
    shutil.rmtree(tmp, ignore_errors=True)  # a killed attempt's directory (a file is overwritten as it is written)
    yield tmp
    publish(tmp, final)


def _prune(root: Path, keep: int, just_saved: Path) -> None:
    """Deletes what killed saves left behind, and all but the newest `keep` checkpoints (0: keep all), never
    `just_saved`."""
    for stale in [*root.glob(".tmp-step-*"), *root.glob(".old-step-*")]:
        shutil.rmtree(stale, ignore_errors=True)
    for old in _complete_checkpoints(root)[:-keep] if keep > 0 else []:
        if old != just_saved:
            shutil.rmtree(old)


def _complete_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints under `root`, oldest first: each `step-N`, and a `.old-step-N` whose `step-N` is gone
    (a kill between publish's two renames left it: the one complete copy of that step)."""
    if not root.is_dir():
        return []
    steps = {}
    for path in root.iterdir():
        found = _STEP_DIR.match(path.name.removeprefix(".old-"))
        if path.is_dir() and found and (path.name.startswith("step-") or int(found.group(1)) not in steps):
            steps[int(found.group(1))] = path
    return [steps[step] for step in sorted(steps)]


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2))


def _fsync_tree(root: Path) -> None:
    """Flushes `root` (a file, or a directory: every file under it and every directory's entries) to disk, so that
    the rename never publishes data or names still in the page cache."""
    for path in [*root.rglob("*"), root]:  # a file has nothing under it
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        elif path.is_dir():
            _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
