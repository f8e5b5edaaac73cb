"""AdamW over the trainable parameters, and the learning-rate schedule: linear warmup, then cosine or linear decay
toward lr * min_lr_ratio, or a constant lr. The decay reaches its end one step after the last, as transformers' and
torchtune's schedules do (the scheduler steps after each optimizer step): the last step runs just above the minimum,
and a run of one step at the full rate. A run resumed with another train.max_steps continues its decay from the rate
its last step ran at (`Schedule.continued`). `make_capturable` readies the optimizer for a captured step."""
import math
from dataclasses import dataclass, replace

import torch
from torch.optim.lr_scheduler import LambdaLR

from .config import OptimConfig, Scheduler


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    params = [param for param in model.parameters() if param.requires_grad]
    # fused=True runs one kernel for all parameters on CUDA; it is not implemented on CPU.
    fused = all(param.is_cuda for param in params)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay,
                             fused=fused or None)


def make_capturable(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Makes an Adam or AdamW optimizer (or accelerate's wrapper of one) one that a CUDA graph can capture, in place,
    and returns the torch optimizer.

    - the fused kernel, which skips its update and un-counts its step on the device when `found_inf` is a device
      float tensor holding 1 (GradScaler's protocol, which lorafuse.train.captured_step uses for non-finite steps);
    - capturable=True on CUDA, which torch requires of an optimizer stepped inside a capture;
    - the learning rate a float32 tensor on the parameters' device: a schedule writes a tensor lr in place (fill_),
      so each replay reads the current rate, where a float would stay baked into the graph.

    Its state_dict keeps the eager form (lr a float, capturable off), so that a checkpoint resumes with capture on
    or off. Load state before calling this: load_state_dict replaces the learning-rate tensor a graph reads."""
    torch_optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps one
    if not isinstance(torch_optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(f"a captured step needs torch.optim.Adam or AdamW (their fused kernel skips a non-finite "
                        f"step on the device), not {type(torch_optimizer).__name__}")
    for group in torch_optimizer.param_groups:
        device = group["params"][0].device
        group.update(fused=True, foreach=None, capturable=device.type == "cuda")
        if not isinstance(group["lr"], torch.Tensor) or group["lr"].device != device:
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
        for param in group["params"]:
            state = torch_optimizer.state.get(param, {})
            if "step" in state:  # the fused kernel counts steps in a float32 tensor beside the parameter
                state["step"] = state["step"].to(device=param.device, dtype=torch.float32)
    if not getattr(torch_optimizer, "_saves_eager_form", False):
        torch_optimizer.register_state_dict_post_hook(_eager_form)
        torch_optimizer._saves_eager_form = True
    return torch_optimizer


def _eager_form(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """A captured optimizer's state_dict as an eager one's: learning rates as floats (read on the host once, at a
    save), capturable off."""
    for group in state_dict["param_groups"]:
        for key in ("lr", "initial_lr"):
            if isinstance(group.get(key), torch.Tensor):
                group[key] = group[key].item()
        group["capturable"] = False
    return state_dict


@dataclass(frozen=True)
class Schedule:
    """Where a run's decay goes: from `start_factor` at step `decay_start` (0-based; None: the end of warmup, at the
    full rate) to min_lr_ratio one step after the last of `total_steps`. Saved with each checkpoint."""
    total_steps: int
    decay_start: int | None = None
    start_factor: float = 1.0

    def factor(self, step: int, cfg: OptimConfig) -> float:
        """The multiplier of cfg.lr for optimizer step `step` (0-based)."""
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.scheduler is Scheduler.constant:
            return 1.0
        start = cfg.warmup_steps if self.decay_start is None else self.decay_start
        progress = min(1.0, (step - start) / max(1, self.total_steps - start))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.scheduler is Scheduler.cosine else 1 - progress
        return cfg.min_lr_ratio + (self.start_factor - cfg.min_lr_ratio) * decay

    def continued(self, steps_done: int, total_steps: int, cfg: OptimConfig) -> "Schedule":
        """This schedule after `steps_done` steps, run to `total_steps` instead: the decay starts again from the rate
        of the last step done, so that the rate does not jump. A warmup not yet finished is finished first (it does
        not depend on the total), and the decay then runs over the new total."""
        if total_steps == self.total_steps:
            return self
        if steps_done <= cfg.warmup_steps:
            return replace(self, total_steps=total_steps)
        return Schedule(total_steps, steps_done - 1, self.factor(steps_done - 1, cfg))


def lr_factor(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """The multiplier of cfg.lr for optimizer step `step` (0-based) of a fresh run of `total_steps`."""
    return Schedule(total_steps).factor(step, cfg)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, cfg))


def resume_schedule(scheduler: LambdaLR, schedule: Schedule, cfg: OptimConfig, steps_done: int) -> None:
    """Sets `scheduler` to follow `schedule` after `steps_done` steps: the optimizer's rate, and the scheduler's last
    rate, become the rate of the next step."""
    scheduler.lr_lambdas = [lambda step: schedule.factor(step, cfg)] * len(scheduler.lr_lambdas)
    rates = [base * schedule.factor(steps_done, cfg) for base in scheduler.base_lrs]
    for group, rate in zip(scheduler.optimizer.param_groups, rates):
        group["lr"] = rate
    scheduler.load_state_dict({**scheduler.state_dict(), "last_epoch": steps_done, "_last_lr": rates})
