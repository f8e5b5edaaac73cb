"""Which checkpoint a run resumes from, after kills at any point of a save."""
import json

from lorafuse.train.checkpoint import latest_checkpoint


def make(root, name, step):
    (root / name).mkdir(parents=True)
    (root / name / "trainer_state.json").write_text(json.dumps({"step": step}))


def test_latest_checkpoint_skips_half_written_saves_and_finds_a_moved_aside_one(tmp_path):
    root = tmp_path / "checkpoints"
    make(root, "step-000002", 2)
    make(root, ".tmp-step-000006", 6)  # killed while writing: never a checkpoint
    assert latest_checkpoint(tmp_path) == root / "step-000002"
    # killed between publish's renames, re-saving step 4: the old copy moved aside, the new one not yet in place
    make(root, ".old-step-000004", 4)
    assert latest_checkpoint(tmp_path) == root / ".old-step-000004"
    make(root, "step-000004", 4)  # the new one in place: it wins over the old copy
    assert latest_checkpoint(tmp_path) == root / "step-000004"
