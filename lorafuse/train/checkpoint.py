"""Checkpoints that survive a crash: written to a temporary directory, published by one atomic rename.

A checkpoint is `<run_dir>/checkpoints/step-<N>/`, holding
- accelerate's state: the trainable weights only (frozen base weights are the model's own and never change),
  optimizer, scheduler, the RNG states of every process, the grad scaler;
- `adapter/`: the adapter in PEFT's format (usable on its own: PeftModel.from_pretrained loads it);
- `trainer_state.json`: the step, counters and schedule the loop resumes from, and the size of every other file.
A `step-*` directory exists only once complete: killing the process mid-save leaves a `.tmp-step-*` directory,
which the next save or resume ignores and removes, and the previous checkpoint as it was. A save that fails (a full
disk) removes its `.tmp-step-*` directory and stops the run. A resume reads every file first (`unreadable_files`).
"""
import json
import logging
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import load
from safetensors.torch import load_file

from ..hf.loading import save_adapter
from .config import ConfigError

logger = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step-(\d+)$")
_STATE_FILE = "trainer_state.json"
# The files that only make a resumed run exact (optimizer moments, the scheduler's position, RNG states, the grad
# scaler): train.resume_lenient puts this run's starting state in their place. Weights and trainer state it cannot.
_REPLACEABLE = re.compile(r"^(optimizer(_\d+)?(\.bin)?|custom_checkpoint_\d+\.pkl|random_states_\d+\.pkl|scaler\.pt)$")
_MODEL_CARD = "adapter/README.md"  # PEFT's: nothing reads it


class CheckpointError(ConfigError):
    """A checkpoint that cannot be saved or resumed: the message names the file and the way out. A ConfigError, so
    that the recipe reports it in one line and exits with code 2."""


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint of `run_dir`, or None."""
    steps = _complete_checkpoints(checkpoints_dir(run_dir))
    return steps[-1] if steps else None


def save_checkpoint(accelerator: Accelerator, model, run_dir: str | os.PathLike, step: int, state: dict,
                    keep: int) -> Path:
    """Saves the run's state after optimizer step `step`; every process must call it. Returns the checkpoint.
    A save that cannot be written raises CheckpointError, its temporary directory removed."""
    root = checkpoints_dir(run_dir)
    final, tmp = root / f"step-{step:06d}", root / f".tmp-step-{step:06d}"
    try:
        _write_checkpoint(accelerator, model, tmp, {**state, "step": step})
        if accelerator.is_main_process:
            publish(tmp, final)
    except (OSError, RuntimeError) as err:  # torch's writer reports a full disk as a RuntimeError
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise _save_failed(run_dir, final, err) from err
    if accelerator.is_main_process:
        logger.info("checkpoint saved: %s", final)
        _prune(root, keep, final)
    accelerator.wait_for_everyone()
    return final


def read_trainer_state(checkpoint: str | os.PathLike) -> dict | None:
    """The trainer state saved with `checkpoint`, or None when `checkpoint` is not a checkpoint."""
    state_file = Path(checkpoint) / _STATE_FILE
    if not state_file.is_file():
        return None
    try:
        return json.loads(state_file.read_text())
    except (OSError, ValueError) as err:  # a truncated file, or bytes that are not UTF-8 text
        raise _cannot_resume(Path(checkpoint), {_STATE_FILE: _reason(err)}) from err


def load_checkpoint(accelerator: Accelerator, checkpoint: str | os.PathLike, run_dir: str | os.PathLike,
                    lenient: bool = False) -> dict:
    """Restores what `save_checkpoint` saved (weights, optimizer, scheduler, RNG) and returns the trainer state.

    Every file is read first. One that cannot be read stops the resume (CheckpointError, naming it); with `lenient`,
    one that only makes the run exact (_REPLACEABLE) is replaced with this run's starting state instead, and the
    log warns that the run is no longer exact."""
    checkpoint = Path(checkpoint)
    state = read_trainer_state(checkpoint)
    if state is None:
        raise FileNotFoundError(f"{checkpoint} is not a lorafuse checkpoint (no {_STATE_FILE})")
    unreadable = unreadable_files(checkpoint)
    if unreadable and not (lenient and all(_replaceable(name) for name in unreadable)):
        raise _cannot_resume(checkpoint, unreadable, lenient)
    if unreadable:
        if accelerator.is_main_process:
            logger.warning("train.resume_lenient=true: %s: %s cannot be read, so that state starts afresh, as this "
                           "run set it up: the run is no longer exact (it will not match an uninterrupted run)",
                           checkpoint, _listed(unreadable))
        _load_replacing(accelerator, checkpoint, unreadable, checkpoints_dir(run_dir) / ".tmp-resume")
    else:
        accelerator.load_state(str(checkpoint), strict=False)  # strict=False: the frozen base weights are not in it
    state.pop("files", None)  # what this checkpoint holds, not the run's state
    return state


def unreadable_files(checkpoint: Path) -> dict[str, str]:
    """The files of `checkpoint` (paths inside it) that a resume could not read, each with why: missing or of another
    size than when saved (as trainer_state.json records them), or failing to load as what its name says it is."""
    recorded = read_trainer_state(checkpoint).get("files", {})  # a checkpoint of an earlier lorafuse records none
    present = {path.relative_to(checkpoint).as_posix() for path in checkpoint.rglob("*") if path.is_file()}
    unreadable = {}
    for name in sorted((recorded.keys() | present) - {_STATE_FILE, _MODEL_CARD}):
        why = _why_unreadable(checkpoint / name, recorded.get(name))
        if why is not None:
            unreadable[name] = why
    return unreadable


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


def _write_checkpoint(accelerator: Accelerator, model, tmp: Path, state: dict) -> None:
    """Writes the checkpoint of `state` to `tmp`, every process its part."""
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))  # every process writes its RNG state; weights through the save hook below
    state_dict = accelerator.get_state_dict(model)  # a collective under FSDP: every process takes part
    accelerator.wait_for_everyone()  # every process's files are written: the main one records their sizes
    if accelerator.is_main_process:
        save_adapter(accelerator.unwrap_model(model), tmp / "adapter", state_dict)
        _write_json(tmp / _STATE_FILE, {**state, "files": _file_sizes(tmp)})
    accelerator.wait_for_everyone()


def _save_failed(run_dir: str | os.PathLike, final: Path, err: Exception) -> CheckpointError:
    """The one-line error of a save of `final` that failed with `err`, naming the checkpoint that stays."""
    previous = latest_checkpoint(run_dir)
    kept = (f"the last checkpoint, {previous}, is intact: make room (or fix the permissions) and continue with "
            "train.resume=true" if previous else "no checkpoint was saved before it: make room (or fix the "
            "permissions) and start again")
    return CheckpointError(f"the checkpoint {final} could not be saved ({_reason(err)}); the run stopped, and {kept}")


def _cannot_resume(checkpoint: Path, unreadable: dict[str, str], lenient: bool = False) -> CheckpointError:
    """The refusal of `checkpoint`, naming its `unreadable` files, the checkpoint before it, and train.resume_lenient
    where that could resume it."""
    previous = _previous_checkpoint(checkpoint)
    replaceable = all(_replaceable(name) for name in unreadable)
    ways = [f"resume the checkpoint before it with train.resume={previous}" if previous
            else "start again in another run_dir"]
    if replaceable:
        ways.append("resume this one with train.resume_lenient=true, which starts the unreadable state afresh (the run "
                    "is then no longer exact)")
    note = (f" (train.resume_lenient replaces optimizer, scheduler and RNG states, not the weights or {_STATE_FILE})"
            if lenient and not replaceable else "")
    return CheckpointError(f"cannot resume {checkpoint}: {_listed(unreadable)} cannot be read{note}; "
                           + ", or ".join(ways))


def _why_unreadable(path: Path, saved_size: int | None) -> str | None:
    """Why a resume could not read `path`, or None where it can."""
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if saved_size is not None and size != saved_size:
        return f"{size} bytes, {saved_size} when saved"
    try:
        _load(path)
    except Exception as err:  # whatever the reader raises (OSError, pickle's, safetensors'), the resume would too
        return _reason(err)
    return None


def _load(path: Path) -> None:
    """Loads `path` as the resume will, by its kind; files of other kinds (a README, FSDP's sharded files) are checked
    by their size alone."""
    if path.suffix == ".json":
        json.loads(path.read_text())
    elif path.suffix == ".safetensors":
        load_file(path)
    elif path.suffix in (".bin", ".pkl", ".pt"):
        # as accelerate loads them: its own files restricted to weights, a registered object's (the scheduler) not
        load(path, map_location="cpu", weights_only=not path.name.startswith("custom_checkpoint_"))


def _load_replacing(accelerator: Accelerator, checkpoint: Path, replaced: dict[str, str], scratch: Path) -> None:
    """accelerate's load_state of `checkpoint` with its `replaced` files taken from this run's own state: save_state
    writes that state to `scratch` (in accelerate's layout, whatever the distributed setting), every other entry of
    the checkpoint is linked over it, and the state is loaded from there."""
    replaced_entries = {name.split("/")[0] for name in replaced}
    if accelerator.is_main_process:
        shutil.rmtree(scratch, ignore_errors=True)  # what a killed resume left
    accelerator.wait_for_everyone()
    accelerator.save_state(str(scratch))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        for entry in checkpoint.iterdir():
            if entry.name not in replaced_entries:
                target = scratch / entry.name
                if target.is_dir():
                    shutil.rmtree(target)
                else:
                    target.unlink(missing_ok=True)
                target.symlink_to(entry.resolve())
    accelerator.wait_for_everyone()
    try:
        accelerator.load_state(str(scratch), strict=False)
        accelerator.wait_for_everyone()
    finally:
        if accelerator.is_main_process:
            shutil.rmtree(scratch, ignore_errors=True)


def _previous_checkpoint(checkpoint: Path) -> Path | None:
    """The newest complete checkpoint beside `checkpoint` of an earlier step, or None."""
    step = _step_number(checkpoint)
    if step is None:  # a directory not named as a checkpoint: no order to go by
        return None
    earlier = [path for path in _complete_checkpoints(checkpoint.parent) if _step_number(path) < step]
    return earlier[-1] if earlier else None


def _step_number(path: Path) -> int | None:
    found = _STEP_DIR.match(path.name.removeprefix(".old-"))
    return int(found.group(1)) if found else None


def _replaceable(name: str) -> bool:
    return _REPLACEABLE.match(name.split("/")[0]) is not None


def _listed(unreadable: dict[str, str]) -> str:
    return "; ".join(f"{name} ({why})" for name, why in unreadable.items())


def _reason(err: Exception) -> str:
    """`err` in one line, with its type."""
    return f"{type(err).__name__}: {' '.join(str(err).split())}"


def _file_sizes(root: Path) -> dict[str, int]:
    return {path.relative_to(root).as_posix(): path.stat().st_size for path in sorted(root.rglob("*"))
            if path.is_file()}


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
        step = _step_number(path)
        if path.is_dir() and step is not None and (path.name.startswith("step-") or step not in steps):
            steps[step] = path
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
