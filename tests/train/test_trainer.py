"""The training loop in this process, on the bundled tiny Llama: what one job leaves behind in the process, which
checkpoints it continues, the loss it takes, the metrics it logs and the files it publishes.

The recipe's CPU path runs here, the ops' PyTorch reference, as in tests/recipes (the kernels have their own tests).
"""
import gc
import itertools
import json
import logging
import weakref
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import lorafuse.train.trainer as trainer
from lorafuse.hf import loading
from lorafuse.train import ConfigError, Finetune, register_configs
from lorafuse.train.batches import ShardedBatches
from lorafuse.train.checkpoint import latest_checkpoint
from lorafuse.train.metrics import read_metrics
from lorafuse.train.trainer import accepts_loss_kwargs

CONF = Path(__file__).resolve().parents[2] / "conf"
# A few steps of a few seconds: 32 samples, batch 4, no eval before or between steps, one eval batch at the end.
QUICK = ["data.max_samples=32", "train.batch_size=4", "train.max_steps=2", "train.log_every=1", "train.eval_every=0",
         "train.eval_batches=1", "train.save_every_n_steps=0", "lora.r=4"]


@pytest.fixture(autouse=True)
def _recipe_process(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # read at each call: the ops take their CPU path
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path / "matplotlib"))
    register_configs()
    yield
    end_job()


def end_job() -> None:
    """Accelerate's process-wide state forgotten: the next Finetune is a job of its own, free to pick its own mixed
    precision."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def finetune(run_dir: Path, *overrides: str) -> Finetune:
    """The recipe's Finetune for conf/finetune.yaml with QUICK and `overrides`."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="finetune", overrides=[f"run_dir={run_dir}", *QUICK, *overrides])
    return Finetune(OmegaConf.to_object(cfg), run_dir)


# --- one job after another in one process ---------------------------------------------------------------------

def test_a_finished_job_leaves_its_model_collectable(tmp_path):
    """A Hydra multirun trains its jobs in one process: each job's model must become garbage once the job is done,
    also where a reference cycle holds it (accelerate's mixed-precision forward makes one; one is made here)."""
    job = finetune(tmp_path / "run")
    model = job.accelerator.unwrap_model(job.model)
    model.held_by_a_cycle = [model]
    model_ref = weakref.ref(model)
    del model
    job.train()
    del job
    gc.collect()
    assert gc.get_freeze_count() == 0
    assert model_ref() is None


def run_out_of_memory(*args, **kwargs):
    raise MemoryError("out of memory")


def test_a_failed_job_unfreezes_the_collector_too(tmp_path, monkeypatch):
    job = finetune(tmp_path / "run")
    monkeypatch.setattr(job, "_train_step", run_out_of_memory)
    with pytest.raises(MemoryError):
        job.train()
    assert gc.get_freeze_count() == 0


# --- resuming --------------------------------------------------------------------------------------------------

def test_resume_compares_the_resolved_weight_dtype_and_precision(tmp_path, monkeypatch):
    """model.dtype=auto resolves to train.precision's dtype: what must match is the resolved dtype and precision,
    not the words written in the config."""
    run_dir = tmp_path / "run"
    finetune(run_dir, "train.max_steps=1").train()  # CPU: precision "no", the base in float32
    end_job()
    # the same weights, written out: resumes
    resumed = finetune(run_dir, "train.max_steps=2", "train.resume=true", "model.dtype=float32")
    assert resumed.state["step"] == 1
    end_job()
    # what train.precision=auto resolves to on a CUDA machine: bf16 mixed precision, the base stored in bfloat16
    monkeypatch.setattr(trainer, "_resolve_precision", lambda precision: "bf16")
    with pytest.raises(ConfigError) as refused:
        finetune(run_dir, "train.max_steps=2", "train.resume=true")
    assert "model.dtype (frozen weights, auto resolved): 'float32' in the checkpoint, 'bfloat16' now" in \
        str(refused.value)
    assert "train.precision (auto resolved): 'no' in the checkpoint, 'bf16' now" in str(refused.value)


def test_a_checkpoint_that_predates_a_setting_resumes_saying_it_is_not_compared(tmp_path, caplog):
    run_dir = tmp_path / "run"
    finetune(run_dir, "train.max_steps=1").train()
    end_job()
    state_file = latest_checkpoint(run_dir) / "trainer_state.json"
    state = json.loads(state_file.read_text())
    del state["config"]["train.precision (auto resolved)"]  # as an earlier lorafuse saved it
    state_file.write_text(json.dumps(state))
    with caplog.at_level(logging.WARNING, logger="lorafuse"):
        resumed = finetune(run_dir, "train.max_steps=2", "train.resume=true")
    assert resumed.state["step"] == 1
    assert "records no train.precision (auto resolved)" in caplog.text and "not compared" in caplog.text
    end_job()


# --- the loss of a step ------------------------------------------------------------------------------------------

class WithoutLossKwargs(torch.nn.Module):
    """A causal LM whose forward takes neither num_items_in_batch nor **kwargs, as some remote-code models."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask=None, position_ids=None, labels=None):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, labels=labels)


class WithLossKwargs(WithoutLossKwargs):
    def forward(self, input_ids, attention_mask=None, position_ids=None, labels=None, **kwargs):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, labels=labels,
                          **kwargs)


class SaysItTakesNone(WithLossKwargs):
    accepts_loss_kwargs = False  # transformers' flag for a forward whose **kwargs take no loss arguments


def test_which_models_are_given_num_items_in_batch(tmp_path):
    job = finetune(tmp_path / "run")
    peft_model = job.accelerator.unwrap_model(job.model)
    assert accepts_loss_kwargs(peft_model)  # its base model's forward: Llama's, with **kwargs
    assert accepts_loss_kwargs(WithLossKwargs(peft_model))
    assert not accepts_loss_kwargs(WithoutLossKwargs(peft_model))
    assert not accepts_loss_kwargs(SaysItTakesNone(peft_model))


def step_gradients(job: Finetune, micro_batches: list[dict]) -> tuple[float, float, list[torch.Tensor]]:
    """One optimizer step's loss, gradient norm and the gradients the optimizer steps with (the step itself is
    left out, so the weights stay as they were)."""
    stepped = []
    trainable = [param for param in job.model.parameters() if param.requires_grad]
    job.optimizer.step = lambda: stepped.append([param.grad.clone() for param in trainable])
    loss, grad_norm, _, finite = job._train_step(micro_batches)
    assert finite
    return loss, grad_norm, stepped[0]


def test_a_model_without_loss_kwargs_gets_the_loss_per_token_of_the_whole_accumulated_batch(tmp_path):
    """Its loss is taken from its logits and divided by the step's token count: the same loss and gradients as a
    model that takes num_items_in_batch, where averaging each micro-batch alone would weigh its tokens unequally."""
    job = finetune(tmp_path / "run", "lora.dropout=0", "optim.max_grad_norm=0", "train.grad_accum=2")
    samples = [job.train_set[i] for i in range(8)]
    micro_batches = [job.collate(samples[:2]), job.collate(samples[2:])]  # 2 and 6 samples: unequal token counts
    expected = step_gradients(job, micro_batches)
    job.model = WithoutLossKwargs(job.model)
    job.takes_num_items = accepts_loss_kwargs(job.model)  # as set-up decides it for the model it prepares
    loss, grad_norm, gradients = step_gradients(job, micro_batches)
    assert (loss, grad_norm) == expected[:2]
    for gradient, expected_gradient in zip(gradients, expected[2], strict=True):
        assert torch.equal(gradient, expected_gradient)


# --- metrics ---------------------------------------------------------------------------------------------------

def test_each_step_logs_the_rate_it_ran_at_and_the_tokens_of_its_samples(tmp_path):
    """The lr of a step's row is the one its optimizer step used (not the next step's, which the scheduler has moved
    to by the time the row is logged), and the tokens are its samples' tokens, the padding of packed rows left out."""
    job = finetune(tmp_path / "run", "data=demo_text", "data.packing=true", "train.max_steps=4",
                   "optim.warmup_steps=1")
    used, optimizer_step = [], job.optimizer.step
    job.optimizer.step = lambda: (used.append(job.optimizer.param_groups[0]["lr"]), optimizer_step())
    job.train()
    rows = [row for row in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in row]
    assert [row["lr"] for row in rows] == used
    assert used[0] == used[1] == job.cfg.optim.lr and len(set(used)) == len(used) - 1  # warmup, then decay
    assert job.scheduler.get_last_lr()[0] not in used  # the rate after the last step

    batches = iter(ShardedBatches(len(job.train_set), job.cfg.train.batch_size, job.cfg.train.seed))
    steps = [[job.train_set[i] for i in next(batches)] for _ in rows]  # each step's packed rows
    tokens = [sum(len(row["input_ids"]) for row in packed_rows) for packed_rows in steps]
    assert [row["tokens"] for row in rows] == list(itertools.accumulate(tokens))
    assert sum(job.collate(packed_rows)["input_ids"].numel() for packed_rows in steps) > sum(tokens)  # padded


# --- the files a run leaves ------------------------------------------------------------------------------------

def merge_until_out_of_memory(base, adapter_dir, out_dir, tokenizer):
    Path(out_dir).mkdir()
    (Path(out_dir) / "config.json").write_text('{"architectures": ')  # the merge's first file, half written
    raise MemoryError("out of memory while merging")


def test_a_crash_while_writing_the_last_files_leaves_none_half_written_and_resume_writes_them(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(loading, "save_merged", merge_until_out_of_memory)
        with pytest.raises(MemoryError):
            finetune(run_dir, "train.save_merged=true").train()
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()  # published before the merge
    assert not (run_dir / "merged").exists() and not (run_dir / "summary.json").exists()
    logged = read_metrics(run_dir / "metrics.jsonl")
    end_job()

    summary = finetune(run_dir, "train.save_merged=true", "train.resume=true").train()
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    assert json.loads((run_dir / "merged" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert read_metrics(run_dir / "metrics.jsonl") == logged  # nothing trained or evaluated again
    assert summary["eval_loss"] == [row["eval_loss"] for row in logged if "eval_loss" in row][-1]
    assert summary["checkpoint"] == str(run_dir / "checkpoints" / "step-000002")
    end_job()
    with pytest.raises(ConfigError, match="is at step 2, and train.max_steps=2: raise train.max_steps"):
        finetune(run_dir, "train.resume=true")  # finished: nothing left to do


def test_a_run_extended_past_its_end_is_finished_by_resume_despite_the_earlier_summary(tmp_path, monkeypatch):
    # The summary of the first end (step 2) stays while the run is extended to step 4; a crash while writing the
    # second end's files must still leave the run resumable to write them.
    run_dir = tmp_path / "run"
    finetune(run_dir).train()
    end_job()
    with monkeypatch.context() as patch:
        patch.setattr(loading, "save_merged", merge_until_out_of_memory)
        with pytest.raises(MemoryError):
            finetune(run_dir, "train.max_steps=4", "train.resume=true", "train.save_merged=true").train()
    assert json.loads((run_dir / "summary.json").read_text())["step"] == 2
    end_job()
    summary = finetune(run_dir, "train.max_steps=4", "train.resume=true", "train.save_merged=true").train()
    assert summary["step"] == 4 and json.loads((run_dir / "summary.json").read_text()) == summary
    assert (run_dir / "merged" / "config.json").is_file()


def train_interrupted(job, steps: int) -> None:
    """Trains `job` until a KeyboardInterrupt in the step after its first `steps` steps (as a Ctrl-C would)."""
    train_step, done = job._train_step, []

    def killed_after(micro_batches):
        if len(done) == steps:
            raise KeyboardInterrupt
        done.append(1)
        return train_step(micro_batches)

    job._train_step = killed_after
    with pytest.raises(KeyboardInterrupt):
        job.train()


def test_a_checkpoint_before_the_end_is_not_taken_for_a_finished_run(tmp_path):
    # A run of 4 steps with a checkpoint every 2, stopped after step 2's save, resumed with train.max_steps=2: the
    # step-2 checkpoint was not its run's last, so there is no run to finish, only steps to train
    run_dir = tmp_path / "run"
    train_interrupted(finetune(run_dir, "train.max_steps=4", "train.save_every_n_steps=2"), steps=2)
    assert latest_checkpoint(run_dir).name == "step-000002"
    end_job()
    with pytest.raises(ConfigError, match="is at step 2, and train.max_steps=2: raise train.max_steps"):
        finetune(run_dir, "train.max_steps=2", "train.resume=true")
