"""Causal-LM training losses on lorafuse.ops.model.linear_cross_entropy: in training, the head's logits are never held.

`use_loss_kernels` gives each transformers causal LM whose forward is transformers' own LlamaForCausalLM.forward
(Mistral, Qwen2 and Qwen3 share its code; compared as bytecode, docstring aside) an instance forward. A training call
with labels (module.train(), gradients on) returns transformers' loss, computed as ForCausalLMLoss computes it
(next-token shift, ignore_index, num_items_in_batch or the mean over labelled tokens), and `logits=None`. Every other
call (eval mode, no labels, a cache, return_dict=False) runs transformers' forward and returns its logits: a user who
needs training logits calls the model in eval mode, or fuses with loss_kernels=False.
"""
import inspect

import torch
from torch import nn
from transformers.loss.loss_utils import LOSS_MAPPING
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import LlamaForCausalLM

from .._logging import log_once
from ..ops.model.linear_cross_entropy import IGNORE_INDEX, LabelledCount, linear_cross_entropy
from .model_kernels import KernelForward, code_keys


def next_token_labels(labels: torch.Tensor | None, shift_labels: torch.Tensor | None = None,
                      ignore_index: int = IGNORE_INDEX, **_) -> torch.Tensor:
    """Each position's next token, as ForCausalLMLoss shifts labels (ignore_index after the last), flat; or
    shift_labels, already shifted."""
    # labels: [B, T] (or shift_labels: [B, T]) -> [B * T]
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shift_labels.reshape(-1)


def causal_lm_loss(hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor,
                   num_items_in_batch=None, ignore_index: int = IGNORE_INDEX, labelled: LabelledCount | None = None,
                   **_) -> torch.Tensor:
    """transformers' ForCausalLMLoss of the logits hidden @ head_weight^T, without them: the token losses' sum over
    num_items_in_batch, or their mean over the labelled tokens when it is None. `labelled` (a LabelledCount of
    targets) lets the head skip the ignored rows."""
    # hidden: [B, T, H], head_weight: [V, H], targets: [B * T] (next_token_labels) -> [] fp32
    targets = targets.to(hidden.device)
    divisor = (targets != ignore_index).sum() if num_items_in_batch is None else num_items_in_batch
    return linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), head_weight, targets, divisor,
                                ignore_index, labelled=labelled)


def _computes_as_llama_causal_lm(module: nn.Module) -> bool:
    forward = getattr(type(module), "forward", None)
    return (isinstance(getattr(module, "lm_head", None), nn.Module) and forward is not None
            and code_keys(forward) == code_keys(LlamaForCausalLM.forward))


def _unfused_reason(module: nn.Module, args: tuple, kwargs: dict) -> str | None:
    """Why this call runs transformers' forward; None when the fused loss computes what it would return."""
    if kwargs.get("labels") is None or not module.training or not torch.is_grad_enabled():
        return ""  # not a training call with labels: transformers' forward, logits included, nothing to say
    if args or kwargs.get("return_dict") is False:
        return "positional arguments or return_dict=False"
    if any(kwargs.get(name) is not None for name in ("cache", "past_key_values", "past_key_value")):
        return "a KV cache passed to a training forward"
    if not (isinstance(kwargs.get("logits_to_keep", 0), int) and kwargs.get("logits_to_keep", 0) == 0):
        return "logits_to_keep"
    if module.loss_function is not LOSS_MAPPING["ForCausalLM"]:
        return "a loss function other than transformers' ForCausalLMLoss"
    head = module.lm_head
    if type(head) is not nn.Linear or head.bias is not None or head._forward_hooks or head._forward_pre_hooks:
        return (f"an lm_head of type {type(head).__name__} (a LoRA or modules_to_save on it, a bias, or hooks; "
                "fused: a plain nn.Linear without bias)")
    if type(head.weight) not in (nn.Parameter, torch.Tensor):
        return f"an lm_head weight of type {type(head.weight).__name__} (sharded)"
    return None


def _fused_loss_forward(module: nn.Module, *args, **kwargs):
    # kwargs: transformers' CausalLM forward's (input_ids [B, T] or inputs_embeds [B, T, H], labels [B, T], ...)
    reason = _unfused_reason(module, args, kwargs)
    if reason is not None:
        if reason:
            log_once(f"lorafuse: {type(module).__name__} with {reason} computes its loss from full logits "
                     "(transformers' forward)")
        return type(module).forward(module, *args, **kwargs)
    targets = next_token_labels(kwargs.pop("labels"), **kwargs)
    labelled = LabelledCount.start(targets, kwargs.get("ignore_index", IGNORE_INDEX))  # on the host by the loss
    kwargs.pop("logits_to_keep", None)
    outputs = module.model(**kwargs)  # the loss arguments go to the model too, as transformers passes them
    loss = causal_lm_loss(outputs.last_hidden_state, module.lm_head.weight, targets, labelled=labelled, **kwargs)
    rest = {name: value for name, value in outputs.items() if name != "last_hidden_state"}
    return CausalLMOutputWithPast(loss=loss, logits=None, **rest)


class LossForward(KernelForward):
    """The fused-loss forward of a causal LM, showing transformers' signature: HF's Trainer reads a model's forward
    signature to keep the dataset's columns, and to decide whether it takes num_items_in_batch."""

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(type(self.module).forward.__get__(self.module))


def use_loss_kernels(model: nn.Module) -> int:
    """Give every Llama-style causal LM in `model` the fused training loss; returns how many. Models that already
    have an instance forward (accelerate's hooks set one) are left alone."""
    taken = [m for m in model.modules() if _computes_as_llama_causal_lm(m) and "forward" not in vars(m)]
    for module in taken:
        module.forward = LossForward(module, _fused_loss_forward)
    return len(taken)
