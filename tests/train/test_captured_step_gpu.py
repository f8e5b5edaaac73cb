"""CapturedStep replaying CUDA graphs: a captured run's losses against eager steps', dropout masks drawn anew by every
replay, and a captured recipe run resumed from its checkpoint against the uninterrupted one.

Needs CUDA and Triton's compiled kernels: TRITON_INTERPRET=0 python -m pytest -q tests/train/test_captured_step_gpu.py
"""
import os

import pytest
import torch
from peft import LoraConfig
from transformers import LlamaConfig, LlamaForCausalLM

import lorafuse
import lorafuse.train.trainer as trainer
from lorafuse.train.captured_step import CapturedStep
from lorafuse.train.config import OptimConfig
from lorafuse.train.metrics import read_metrics
from lorafuse.train.optim import lr_factor

from .test_captured_step import stop_after_saving
from .test_trainer import _recipe_process, end_job, finetune  # noqa: F401  (the fixture sets up each test)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="CUDA graphs need a GPU and Triton's compiled kernels (TRITON_INTERPRET=0)")

BATCH, LENGTH, MICRO_STEPS, VOCAB = 4, 64, 2, 512
OPTIM = OptimConfig(lr=5e-3, warmup_steps=5, max_grad_norm=1.0)
DISTINCT_BATCHES = 2  # the steps cycle through these few batches, which the model learns: its loss falls


def lora_llama(dropout: float) -> torch.nn.Module:
    """A small random Llama in bf16 with fused LoRA layers whose B starts non-zero, so that dropout shows in the loss
    from the first step."""
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))
    model = lorafuse.get_peft_model(base.to("cuda", torch.bfloat16),
                                    LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.02)
    return model.train()


def loss_fn(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The token-loss sum over num_items_in_batch, as the recipe's bf16 mixed precision computes it."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return model(**batch).loss


def micro_batches(step: int) -> tuple[list[dict], int]:
    """Step `step`'s micro-batches (pinned, as the recipe's DataLoader hands them), labels -100 on each row's tail."""
    generator = torch.Generator().manual_seed(step % DISTINCT_BATCHES)
    batches = []
    for _ in range(MICRO_STEPS):
        ids = torch.randint(3, VOCAB, (BATCH, LENGTH), generator=generator)
        labels = ids.clone()
        labels[:, LENGTH - int(torch.randint(1, LENGTH // 2, (), generator=generator)):] = -100
        batches.append({"input_ids": ids.pin_memory(), "labels": labels.pin_memory()})
    return batches, sum(int((batch["labels"][:, 1:] != -100).sum()) for batch in batches)


def optimizer_and_schedule(model: torch.nn.Module, lr: float = OPTIM.lr):
    params = [param for param in model.parameters() if param.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, 50, OPTIM))


def eager_losses(steps: int) -> list[float]:
    """The same training written plainly: zero, forward and backward per micro-step, clip, AdamW, schedule."""
    model = lora_llama(dropout=0.0)
    optimizer, schedule = optimizer_and_schedule(model)
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        batches, items = micro_batches(step)
        items = torch.tensor(float(items), dtype=torch.float64, device="cuda")
        loss_sum = 0.0
        for batch in batches:
            loss = loss_fn(model, {**{name: t.cuda() for name, t in batch.items()}, "num_items_in_batch": items})
            loss.backward()
            loss_sum += loss.item()
        torch.nn.utils.clip_grad_norm_(optimizer.param_groups[0]["params"], OPTIM.max_grad_norm)
        optimizer.step()
        schedule.step()
        losses.append(loss_sum)
    return losses


def test_a_captured_run_takes_the_eager_runs_losses():
    steps = 50
    model = lora_llama(dropout=0.0)
    optimizer, schedule = optimizer_and_schedule(model)
    step = CapturedStep(model, optimizer, loss_fn, max_grad_norm=OPTIM.max_grad_norm)
    losses, flags = [], []
    for index in range(steps):
        loss, _, nonfinite = step(*micro_batches(index))
        schedule.step()  # writes the lr tensor the graph reads
        losses.append(loss.clone())
        flags.append(nonfinite.clone())
    assert step.graph is not None and step.calls == steps
    assert not torch.stack(flags).any()
    expected = eager_losses(steps)
    assert expected[-1] < expected[0] - 0.05  # it learns: the comparison is not of constants
    # bf16 noise: the same kernels, but cuBLAS may choose other algorithms under capture
    torch.testing.assert_close(torch.stack(losses).tolist(), expected, rtol=1e-2, atol=1e-2)


def replayed_twice(dropout: float) -> tuple[list[float], list[list[torch.Tensor]]]:
    """Losses and gradients of two replays on one batch, the weights held still (lr 0)."""
    model = lora_llama(dropout)
    optimizer, _ = optimizer_and_schedule(model, lr=0.0)
    step = CapturedStep(model, optimizer, loss_fn)
    batches, items = micro_batches(0)
    params = optimizer.param_groups[0]["params"]
    losses, grads = [], []
    for call in range(4):  # 2 eager, the capture, a replay
        loss, _, _ = step(batches, items)
        if call >= 2:
            losses.append(loss.item())
            grads.append([param.grad.clone() for param in params])
    assert step.graph is not None
    return losses, grads


def test_every_replay_draws_new_dropout_masks():
    losses, grads = replayed_twice(dropout=0.1)
    assert losses[0] != losses[1]
    assert not all(torch.allclose(a, b, rtol=1e-3, atol=1e-6) for a, b in zip(*grads))
    losses, grads = replayed_twice(dropout=0.0)
    assert losses[0] == losses[1]
    assert all(torch.allclose(a, b, rtol=1e-3, atol=1e-6) for a, b in zip(*grads))  # atomics may reorder sums


def test_a_resumed_captured_run_continues_as_the_uninterrupted_one(tmp_path, monkeypatch):
    """The bundled tiny Llama in the recipe, captured (bf16, dropout on): stopped after its step-3 checkpoint and
    resumed, it re-enters the eager steps and the capture, and logs the uninterrupted run's losses: the same data,
    weights, optimizer state and CUDA generator state (eager steps and replays draw the same numbers)."""
    made = []

    class Recorded(CapturedStep):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(trainer, "CapturedStep", Recorded)
    overrides = ["data.pad_to_max_length=true", "data.max_length=64", "train.max_steps=6", "train.save_every_n_steps=3",
                 "train.keep_checkpoints=3", "lora.dropout=0.1", "train.cuda_graphs=true"]
    whole = finetune(tmp_path / "whole", *overrides)
    assert whole.cuda_graphs
    whole.train()
    end_job()
    stop_after_saving(finetune(tmp_path / "resumed", *overrides), at_step=3)
    end_job()
    finetune(tmp_path / "resumed", *overrides, "train.resume=true").train()
    assert [(step.calls, step.graph is not None) for step in made] == [(6, True), (3, True), (3, True)]
    rows = {name: [row for row in read_metrics(tmp_path / name / "metrics.jsonl") if "loss" in row]
            for name in ("whole", "resumed")}
    assert [row["step"] for row in rows["resumed"]] == [row["step"] for row in rows["whole"]] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close([row[key] for row in rows["resumed"]], [row[key] for row in rows["whole"]],
                                   rtol=1e-2, atol=1e-3, msg=key)
    assert [row["lr"] for row in rows["resumed"]] == [row["lr"] for row in rows["whole"]]
