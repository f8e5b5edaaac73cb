"""A checkpoint with a file that cannot be read: the resume stops, naming the file and the ways on, or with
train.resume_lenient goes on without it. A save that cannot be written stops the run, the last checkpoint kept.

The cases damage copies of one real checkpoint of the bundled tiny model, made once for the module.
"""
import errno
import logging
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lorafuse.train import ConfigError, register_configs
from lorafuse.train import checkpoint as checkpoint_module
from lorafuse.train.checkpoint import CheckpointError, unreadable_files

from .test_trainer import end_job, finetune

# every file of a checkpoint but PEFT's model card, which nothing reads
CHECKPOINT_FILES = ["adapter/adapter_config.json", "adapter/adapter_model.safetensors", "custom_checkpoint_0.pkl",
                    "model.safetensors", "optimizer.bin", "random_states_0.pkl", "trainer_state.json"]
STATE_FILES = ["custom_checkpoint_0.pkl", "optimizer.bin", "random_states_0.pkl"]  # what resume_lenient replaces


@contextmanager
def recipe_process(matplotlib_dir: Path):
    """The process as tests/train/test_trainer.py sets it up for a job, and the job forgotten after."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("TRITON_INTERPRET", raising=False)  # the ops take their CPU path
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("MPLCONFIGDIR", str(matplotlib_dir))
        register_configs()
        try:
            yield
        finally:
            end_job()


@pytest.fixture(scope="module")
def made_run(tmp_path_factory) -> Path:
    """A finished run of 2 steps with a checkpoint after each."""
    run_dir = tmp_path_factory.mktemp("made") / "run"
    with recipe_process(tmp_path_factory.mktemp("matplotlib")):
        finetune(run_dir, "train.save_every_n_steps=1").train()
    return run_dir


@pytest.fixture(autouse=True)
def _recipe_process(tmp_path):
    with recipe_process(tmp_path / "matplotlib"):
        yield


@pytest.fixture
def run_dir(made_run, tmp_path) -> Path:
    """A copy of the made run, for the test to damage."""
    return Path(shutil.copytree(made_run, tmp_path / "run"))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def test_the_cases_cover_every_file_of_a_checkpoint(made_run):
    for checkpoint in (made_run / "checkpoints").iterdir():
        files = {path.relative_to(checkpoint).as_posix() for path in checkpoint.rglob("*") if path.is_file()}
        assert files - {"adapter/README.md"} == set(CHECKPOINT_FILES)
        assert unreadable_files(checkpoint) == {}


@pytest.mark.parametrize("name", CHECKPOINT_FILES)
def test_a_truncated_file_stops_the_resume_naming_it_and_the_ways_on(run_dir, name):
    checkpoints = run_dir / "checkpoints"
    truncate(checkpoints / "step-000002" / name)
    with pytest.raises(CheckpointError) as refused:
        finetune(run_dir, "train.max_steps=3", "train.resume=true")
    message = str(refused.value)
    assert isinstance(refused.value, ConfigError)  # the recipe says it in one line and exits with code 2
    assert message.startswith(f"cannot resume {checkpoints / 'step-000002'}: {name} (")
    assert f"resume the checkpoint before it with train.resume={checkpoints / 'step-000001'}" in message
    assert ("train.resume_lenient=true" in message) == (name in STATE_FILES)
    assert "\n" not in message


def test_a_missing_file_stops_the_resume_too(run_dir):
    (run_dir / "checkpoints" / "step-000002" / "optimizer.bin").unlink()
    with pytest.raises(CheckpointError, match=r"optimizer.bin \(missing\)"):
        finetune(run_dir, "train.max_steps=3", "train.resume=true")


def test_lenient_resume_goes_on_without_the_unreadable_state_files_and_warns(run_dir, caplog):
    checkpoint = run_dir / "checkpoints" / "step-000002"
    for name in STATE_FILES:
        truncate(checkpoint / name)
    with caplog.at_level(logging.WARNING, logger="lorafuse"):
        job = finetune(run_dir, "train.max_steps=3", "train.resume=true", "train.resume_lenient=true")
    assert "no longer exact" in caplog.text and all(name in caplog.text for name in STATE_FILES)
    assert job.state["step"] == 2
    weights = load_file(checkpoint / "model.safetensors")
    state = job.model.state_dict()
    assert all(torch.equal(state[name], weight) for name, weight in weights.items())
    # the schedule's position comes from trainer_state.json: step 3 runs at 3/10 of optim.lr (warmup_steps=10)
    assert job.scheduler.last_epoch == 2
    assert job.optimizer.param_groups[0]["lr"] == job.scheduler.get_last_lr()[0] == job.cfg.optim.lr * (3 / 10)
    assert not (run_dir / "checkpoints" / ".tmp-resume").exists()
    assert job.train()["step"] == 3


def test_lenient_resume_still_refuses_unreadable_weights(run_dir):
    truncate(run_dir / "checkpoints" / "step-000002" / "model.safetensors")
    with pytest.raises(CheckpointError, match="not the weights") as refused:
        finetune(run_dir, "train.max_steps=3", "train.resume=true", "train.resume_lenient=true")
    assert "train.resume_lenient=true" not in str(refused.value)


def test_a_save_that_cannot_be_written_stops_the_run_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    job = finetune(run_dir, "train.save_every_n_steps=1")
    save_adapter, saves = checkpoint_module.save_adapter, []

    def disk_full_at_the_second_save(model, out_dir, state_dict):
        saves.append(out_dir)
        if len(saves) == 2:
            Path(out_dir).mkdir()
            (Path(out_dir) / "adapter_model.safetensors").write_bytes(b"\0" * 64)  # half written
            raise OSError(errno.ENOSPC, "No space left on device")
        save_adapter(model, out_dir, state_dict)

    monkeypatch.setattr(checkpoint_module, "save_adapter", disk_full_at_the_second_save)
    with pytest.raises(CheckpointError) as failed:
        job.train()
    checkpoints = run_dir / "checkpoints"
    assert str(failed.value) == (
        f"the checkpoint {checkpoints / 'step-000002'} could not be saved (OSError: [Errno 28] No space left on "
        f"device); the run stopped, and the last checkpoint, {checkpoints / 'step-000001'}, is intact: make room (or "
        "fix the permissions) and continue with train.resume=true")
    assert [path.name for path in checkpoints.iterdir()] == ["step-000001"]  # the temporary directory removed
    assert unreadable_files(checkpoints / "step-000001") == {}
