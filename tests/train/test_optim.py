"""The learning-rate schedule: warmup, then the decay to lr * min_lr_ratio at the last step."""
import math

import pytest

from lorafuse.train.config import OptimConfig, Scheduler
from lorafuse.train.optim import lr_factor


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
