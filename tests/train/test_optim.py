"""The learning-rate schedule: warmup, then the decay to lr * min_lr_ratio at the last step."""
import math

import pytest
import torch

from lorafuse.train.config import OptimConfig, Scheduler
from lorafuse.train.optim import build_scheduler, lr_factor


@pytest.mark.parametrize("scheduler", list(Scheduler))
def test_warmup_then_decay(scheduler):
    cfg = OptimConfig(scheduler=scheduler, warmup_steps=4, min_lr_ratio=0.1)
    factors = [lr_factor(step, 20, cfg) for step in range(21)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == 1.0
    if scheduler is Scheduler.constant:
        assert factors[4:] == [1.0] * 17
    else:
        assert factors[20] == pytest.approx(0.1)
        assert all(a >= b for a, b in zip(factors[4:], factors[5:]))
        middle = 0.1 + 0.9 * (0.5 if scheduler is Scheduler.linear else 0.5 * (1 + math.cos(math.pi * 0.5)))
        assert factors[12] == pytest.approx(middle)


@pytest.mark.parametrize("scheduler", [Scheduler.cosine, Scheduler.linear])
@pytest.mark.parametrize("total_steps, warmup_steps", [(6, 0), (6, 2), (1, 0)])
def test_the_rates_the_steps_run_at(scheduler, total_steps, warmup_steps):
    """Driven as the trainer drives it (each optimizer step runs at the optimizer's lr, then the scheduler steps): the
    peak at the end of warmup (or the first step), decay after it, and the minimum one step past the last, as in
    transformers' get_cosine_schedule_with_warmup."""
    cfg = OptimConfig(lr=1.0, scheduler=scheduler, warmup_steps=warmup_steps, min_lr_ratio=0.1)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    schedule = build_scheduler(optimizer, cfg, total_steps)
    used = []
    for _ in range(total_steps):
        used.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert used[max(warmup_steps - 1, 0)] == 1.0
    assert all(a > b for a, b in zip(used[warmup_steps:], used[warmup_steps + 1:]))
    assert used[-1] > 0.1
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)  # the rate a step after the last would run at
