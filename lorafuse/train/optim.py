"""AdamW over the trainable parameters, and the learning-rate schedule: linear warmup, then cosine or linear decay
toward lr * min_lr_ratio, or a constant lr. The decay reaches its end one step after the last, as transformers' and
torchtune's schedules do (the scheduler steps after each optimizer step): the last step runs just above the minimum,
and a run of one step at the full rate. `make_capturable` readies the optimizer for a captured step."""
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
