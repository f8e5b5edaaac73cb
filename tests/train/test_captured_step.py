"""train.cuda_graphs on a CPU: when the recipe captures its step and when it says why not, CapturedStep's step against
the trainer's eager one, the non-finite step skipped on the device, train.on_nonfinite acting at the read of a log
step, and resume. (A CPU never captures: CapturedStep runs its step eagerly there, with the same device-side logic;
tests/train/test_captured_step_gpu.py replays graphs.)"""
import logging

import pytest
import torch

import lorafuse.train.trainer as trainer
from lorafuse.train import ConfigError, NonFiniteLoss
from lorafuse.train.captured_step import CapturedStep
from lorafuse.train.checkpoint import latest_checkpoint
from lorafuse.train.config import DataConfig, FinetuneConfig, ModelConfig, TrainConfig, validate
from lorafuse.train.data import Collator, count_loss_tokens
from lorafuse.train.metrics import read_metrics
from lorafuse.train.optim import make_capturable
from lorafuse.train.trainer import use_cuda_graphs

from .test_trainer import _recipe_process, end_job, finetune  # noqa: F401  (the fixture sets up each test)

STATIC = {"packing": {"packing": True}, "pad_to_max_length": {"pad_to_max_length": True}}
PADDED = ["data.pad_to_max_length=true", "data.max_length=48"]  # one batch shape, short rows: quick on a CPU


def config(cuda_graphs="auto", data=None, **train) -> FinetuneConfig:
    return FinetuneConfig(model=ModelConfig(name_or_path="unused"), data=DataConfig(path="unused", **(data or {})),
                          train=TrainConfig(cuda_graphs=cuda_graphs, **train))


def capture_lines(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if "train.cuda_graphs" in record.getMessage()]


# --- when the step is captured ------------------------------------------------------------------------------------

@pytest.mark.parametrize("static", ["packing", "pad_to_max_length"])
def test_auto_captures_on_cuda_when_every_batch_has_one_shape(static, caplog):
    with caplog.at_level(logging.INFO, logger="lorafuse.train"):
        assert use_cuda_graphs(config(data=STATIC[static]), cuda=True, processes=1, precision="bf16")
        assert use_cuda_graphs(config("true", data=STATIC[static]), cuda=True, processes=1, precision="bf16")
    assert capture_lines(caplog) == []


@pytest.mark.parametrize("data, cuda, expected", [
    ({}, True, "train.cuda_graphs=auto: eager steps: each batch is padded to its own longest row, so batch shapes "
               "vary (set data.pad_to_max_length=true or data.packing=true to capture them)"),
    ({"packing": True}, False, "train.cuda_graphs=auto: eager steps: no CUDA device (run on a CUDA GPU to capture "
                               "them)"),
])
def test_auto_runs_eagerly_where_it_cannot_capture_and_says_why(data, cuda, expected, caplog):
    with caplog.at_level(logging.INFO, logger="lorafuse.train"):
        assert not use_cuda_graphs(config("auto", data), cuda=cuda, processes=1, precision="bf16")
    assert capture_lines(caplog) == [expected]


@pytest.mark.parametrize("cuda_graphs", ["auto", "true", True])
def test_several_processes_run_eagerly_said_once_by_the_main_process(cuda_graphs, caplog):
    cfg = config(cuda_graphs, STATIC["packing"])
    with caplog.at_level(logging.INFO, logger="lorafuse.train"):
        assert not use_cuda_graphs(cfg, cuda=True, processes=2, precision="bf16")
        assert not use_cuda_graphs(cfg, cuda=True, processes=2, precision="bf16", main_process=False)
    assert capture_lines(caplog) == [f"train.cuda_graphs={str(cuda_graphs).lower()}: eager steps: 2 processes "
                                     "(DDP/FSDP) are not captured"]


def test_false_runs_eagerly_without_a_word(caplog):
    with caplog.at_level(logging.INFO, logger="lorafuse.train"):
        assert not use_cuda_graphs(config(False, STATIC["packing"]), cuda=True, processes=1, precision="bf16")
    assert capture_lines(caplog) == []


@pytest.mark.parametrize("cfg, cuda, precision, message", [
    (config("true", STATIC["packing"]), False, "no",
     "train.cuda_graphs=true: no CUDA device; run on a CUDA GPU, or use train.cuda_graphs=auto"),
    (config(True), True, "bf16", "train.cuda_graphs=true: each batch is padded to its own longest row, so batch shapes "
                                 "vary; set data.pad_to_max_length=true or data.packing=true, or use "
                                 "train.cuda_graphs=auto"),
    (config(True, STATIC["pad_to_max_length"]), True, "fp16",
     "train.cuda_graphs=true: fp16's grad scaler reads its overflow check on the host every step; use "
     "train.precision=bf16"),
    (config(True, STATIC["packing"], activation_checkpointing=True), True, "bf16",
     "train.cuda_graphs=true: activation checkpointing saves and restores the RNG state on the host"),
    (config(True, STATIC["packing"], activation_checkpointing="offload"), True, "bf16",
     "train.cuda_graphs=true: activation checkpointing saves and restores the RNG state on the host"),
])
def test_true_where_capture_cannot_work_names_the_key_the_value_and_the_fix(cfg, cuda, precision, message):
    with pytest.raises(ConfigError) as error:
        use_cuda_graphs(cfg, cuda=cuda, processes=1, precision=precision)
    assert str(error.value).startswith(message)


@pytest.mark.parametrize("value", ["yes", 1, "captured"])
def test_a_value_outside_auto_true_false_is_refused(value):
    with pytest.raises(ConfigError, match=f"train.cuda_graphs={value!r}: allowed values are auto, true, false"):
        validate(config(value))


def test_pad_to_max_length_gives_every_batch_one_shape():
    rows = [{"input_ids": [1] * n, "labels": [1] * n} for n in (3, 11)]
    assert Collator(pad_token_id=0)(rows)["input_ids"].shape == (2, 16)  # its longest row, rounded up to 8
    assert Collator(pad_token_id=0)(rows[:1])["input_ids"].shape == (1, 8)
    fixed = Collator(pad_token_id=0, pad_to_length=30)
    assert fixed(rows)["input_ids"].shape == (2, 32) and fixed(rows[:1])["input_ids"].shape == (1, 32)


# --- CapturedStep against the trainer's eager step ---------------------------------------------------------------

def trainable(job) -> list[torch.nn.Parameter]:
    return [param for param in job.model.parameters() if param.requires_grad]


def micro_batches_and_items(batches, count: int) -> tuple[list[dict], int]:
    micro_batches = [next(batches) for _ in range(count)]
    return micro_batches, sum(count_loss_tokens(batch["labels"]) for batch in micro_batches)


def test_the_captured_step_is_the_trainers_eager_step(tmp_path):
    """Loss, gradient norm, clipped gradients and updated weights, step after step, with 2 micro-steps, clipping,
    warmup and dropout (both draw the same masks from the same generator state). The eager optimizer is made
    capturable too, so that both run the fused AdamW kernel with a tensor lr: the CPU's default AdamW rounds
    otherwise."""
    overrides = [*PADDED, "train.grad_accum=2", "optim.max_grad_norm=0.05", "optim.warmup_steps=2", "lora.dropout=0.1"]
    eager = finetune(tmp_path / "eager", *overrides)
    eager_params, clipped = trainable(eager), []
    make_capturable(eager.optimizer).register_step_pre_hook(
        lambda *_: clipped.append([param.grad.clone() for param in eager_params]))
    end_job()
    job = finetune(tmp_path / "captured", *overrides)
    step = CapturedStep(job.model, job.optimizer, job._captured_micro_batch_loss, job.cfg.optim.max_grad_norm)
    params, lr = trainable(job), job.optimizer.param_groups[0]["lr"]
    eager_batches, batches = eager._train_batches(0), job._train_batches(0)
    for _ in range(3):
        generator_state = torch.get_rng_state()
        loss, grad_norm, _, finite = eager._train_step([next(eager_batches) for _ in range(2)])
        torch.set_rng_state(generator_state)
        captured = step(*micro_batches_and_items(batches, 2))
        assert finite and grad_norm > 0.05  # clipped
        assert [value.item() for value in captured] == [loss, grad_norm, False]
        assert all(torch.equal(gradient, param.grad) for gradient, param in zip(clipped[-1], params, strict=True))
        assert all(torch.equal(eager_param, param) for eager_param, param in zip(eager_params, params, strict=True))
        eager.scheduler.step()
        job.scheduler.step()
    assert job.optimizer.param_groups[0]["lr"] is lr  # the schedule writes into the tensor a graph reads
    assert lr.item() == eager.optimizer.param_groups[0]["lr"].item() < job.cfg.optim.lr


def optimizer_snapshot(job) -> list[torch.Tensor]:
    state = job.optimizer.state
    return [tensor.detach().clone() for param in trainable(job)
            for tensor in (param, state[param]["exp_avg"], state[param]["exp_avg_sq"], state[param]["step"])]


@pytest.mark.parametrize("poisoned", ["loss", "gradient"])
def test_a_non_finite_step_is_skipped_on_the_device(tmp_path, poisoned):
    """NaN in the loss, or Inf in one gradient only: the step's flag is set, and weights, moments and the step count
    stay as they were; the next finite step updates them."""
    job = finetune(tmp_path / "run", *PADDED)
    poison = torch.ones(())
    first = trainable(job)[0]
    if poisoned == "loss":
        step = CapturedStep(job.model, job.optimizer,
                            lambda model, batch: job._captured_micro_batch_loss(model, batch) * poison)
    else:
        first.register_hook(lambda gradient: gradient * poison)
        step = CapturedStep(job.model, job.optimizer, job._captured_micro_batch_loss)
    batches = job._train_batches(0)
    assert not step(*micro_batches_and_items(batches, 1))[2]  # the optimizer's state exists from here
    before = optimizer_snapshot(job)

    poison.fill_(float("nan") if poisoned == "loss" else float("inf"))
    loss, grad_norm, nonfinite = step(*micro_batches_and_items(batches, 1))
    assert nonfinite.item() and loss.isnan().item() == (poisoned == "loss") and grad_norm.isfinite().item() is False
    assert all(torch.equal(now, then) for now, then in zip(optimizer_snapshot(job), before, strict=True))
    assert job.optimizer.state[first]["step"].item() == 1
    assert not hasattr(step.torch_optimizer, "found_inf")  # no stale flag for a later step() to read

    poison.fill_(1.0)
    assert not step(*micro_batches_and_items(batches, 1))[2].item()
    assert job.optimizer.state[first]["step"].item() == 2 and not torch.equal(first, before[0])


# --- the recipe's loop with a captured step -----------------------------------------------------------------------

@pytest.fixture
def captured(monkeypatch):
    """The recipe's captured loop on this CPU: CapturedStep runs each step eagerly, and the host reads the steps'
    results at log and save steps only, as it does on a GPU."""
    monkeypatch.setattr(trainer, "use_cuda_graphs", lambda *args, **kwargs: True)


def test_a_run_that_cannot_capture_says_why_once(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="lorafuse.train"):
        finetune(tmp_path / "run", "train.max_steps=3").train()  # batches of varying shape, and on a CPU: eager
    lines = capture_lines(caplog)
    assert len(lines) == 1 and lines[0].startswith("train.cuda_graphs=auto: eager steps: "), lines


def test_a_captured_run_pads_packed_rows_to_max_length(tmp_path, captured):
    job = finetune(tmp_path / "run", "data=demo_text", "data.packing=true")
    shapes = {tuple(next(job._train_batches(start))["input_ids"].shape) for start in range(4)}
    assert shapes == {(job.cfg.train.batch_size, job.cfg.data.max_length)}


def stopped(job) -> tuple[str, int]:
    """The message the run stopped with, and the step it stopped in (the scheduler steps after each step)."""
    with pytest.raises(NonFiniteLoss) as stop:
        job.train()
    return str(stop.value), job.scheduler.last_epoch + (not job.cuda_graphs)  # eager: before the step's scheduling


@pytest.mark.parametrize("policy, message", [
    (["train.on_nonfinite=stop"], "stopped (train.on_nonfinite=stop)"),
    (["train.on_nonfinite=skip", "train.max_skipped_steps=3"], "3 non-finite steps in a row"),
])
def test_on_nonfinite_acts_at_the_next_read_with_the_eager_loops_message(tmp_path, monkeypatch, caplog, policy,
                                                                         message):
    """Adam moves every weight by about lr: 1e30 makes step 2 non-finite, and (the weights left as they were) the steps
    after it. The eager loop stops at the step that decides; the captured one at the next log step's read (every 3),
    with the same message, naming the same step, after the same skipped-step warnings."""
    overrides = [*PADDED, "optim.lr=1e30", "train.max_steps=9", "train.log_every=3", *policy]
    eager_message, eager_stop = stopped(finetune(tmp_path / "eager", *overrides))
    eager_warnings = caplog.text.count("step skipped (train.on_nonfinite=skip)")
    end_job()
    caplog.clear()
    monkeypatch.setattr(trainer, "use_cuda_graphs", lambda *args, **kwargs: True)
    captured_message, captured_stop = stopped(finetune(tmp_path / "captured", *overrides))
    assert message in eager_message and captured_message == eager_message
    assert caplog.text.count("step skipped (train.on_nonfinite=skip)") == eager_warnings
    assert captured_stop == -(-eager_stop // 3) * 3 > eager_stop  # ran on to the read


def stop_after_saving(job, at_step: int) -> None:
    """Runs `job` until its checkpoint of `at_step` is saved, then stops it as a kill would."""
    save = job._save

    def save_then_stop(step):
        checkpoint = save(step)
        if step == at_step:
            raise KeyboardInterrupt
        return checkpoint

    job._save = save_then_stop
    with pytest.raises(KeyboardInterrupt):
        job.train()


def test_a_resumed_captured_run_continues_as_the_uninterrupted_one(tmp_path, captured, monkeypatch):
    """Per-step losses, norms, rates and tokens bit for bit, the optimizer's step count, and the log line after the
    resume averaging steps from both runs (the steps before the save are read into the checkpoint's log window). The
    checkpoint holds the optimizer in its eager form, so that the run resumes without capture too."""
    overrides = [*PADDED, "train.max_steps=4", "train.log_every=3", "train.save_every_n_steps=2",
                 "train.keep_checkpoints=3", "lora.dropout=0.1"]
    whole = finetune(tmp_path / "whole", *overrides)
    whole.train()
    end_job()
    stop_after_saving(finetune(tmp_path / "resumed", *overrides), at_step=2)
    end_job()
    resumed = finetune(tmp_path / "resumed", *overrides, "train.resume=true")
    resumed.train()
    rows = {name: [{key: value for key, value in row.items() if key != "tokens_per_s"}  # the one timed value
                   for row in read_metrics(tmp_path / name / "metrics.jsonl") if "loss" in row]
            for name in ("whole", "resumed")}
    assert [row["step"] for row in rows["resumed"]] == [3, 4] and rows["resumed"] == rows["whole"]
    assert all(state["step"].item() == 4 for state in resumed.optimizer.state.values())
    for parameter, whole_parameter in zip(trainable(resumed), trainable(whole), strict=True):
        assert torch.equal(parameter, whole_parameter)

    checkpoint = latest_checkpoint(tmp_path / "resumed").parent / "step-000002"
    saved = torch.load(checkpoint / "optimizer.bin", weights_only=True)["param_groups"][0]
    assert isinstance(saved["lr"], float) and not saved["capturable"] and saved["fused"]
    end_job()
    monkeypatch.setattr(trainer, "use_cuda_graphs", use_cuda_graphs)  # capture off: the checkpoint resumes eagerly
    eager = finetune(tmp_path / "eager", *overrides, f"train.resume={checkpoint}")
    assert not eager.cuda_graphs and eager.optimizer.param_groups[0]["lr"] == saved["lr"]
    eager.train()
    assert [row["step"] for row in read_metrics(tmp_path / "eager" / "metrics.jsonl") if "loss" in row] == [3, 4]
