"""AdamW over the trainable parameters, and the learning-rate schedule: linear warmup, then cosine or linear decay
toward lr * min_lr_ratio, or a constant lr. The decay reaches its end one step after the last, as transformers' and
torchtune's schedules do (the scheduler steps after each optimizer step): the last step runs just above the minimum,
and a run of one step at the full rate."""
import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from .config import OptimConfig, Scheduler


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    params = [param for param in model.parameters() if param.requires_grad]
    # fused=True runs one kernel for all parameters on CUDA; it is not implemented on CPU.
    fused = all(param.is_cuda for param in params)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay,
                             fused=fused or None)


def lr_factor(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """The multiplier of cfg.lr for optimizer step `step` (0-based) of `total_steps`."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.scheduler is Scheduler.constant:
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.scheduler is Scheduler.cosine else 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, cfg))
