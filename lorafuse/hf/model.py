"""The model-level API: PEFT's LoRA entry points, returning models that run lorafuse's kernels.

`get_peft_model` and `from_pretrained` are PEFT's own functions followed by `fuse`; `fuse` swaps the
LoRA layers' class (lora.py), switches the transformers model to attn_implementation="lorafuse"
(attention.py), runs its Llama-style RMSNorms, SwiGLU MLPs and RoPE on lorafuse's kernels (model_kernels.py) and its
training loss without full logits (causal_lm_loss.py); `unfuse` undoes all four. Target specs, saving, loading and
merging stay PEFT's.
"""
import logging
import os
import re
from collections import defaultdict
from contextlib import contextmanager

import peft
from peft import PeftModel
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils.error import NoMatchingPeftModuleError
from torch import nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from .._logging import log_once
from .activation_checkpointing import enable_activation_checkpointing
from .attention import NAME as ATTENTION
from .causal_lm_loss import use_loss_kernels
from .lora import fuse_layers, unfuse_layers
from .model_kernels import drop_model_kernels, use_model_kernels

# Base layers PEFT's LoRA can wrap (peft.tuners.lora.layer.dispatch_default): named when targets match nothing.
TARGETABLE = (nn.Linear, Conv1D, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention)
_UNSUPPORTED_TARGET = re.compile(r"Target module .* is not supported")  # peft.tuners.lora.model's wording
_ATTENTION_BEFORE = "_lorafuse_attention_before"  # set on the transformers model by fuse, read by unfuse


def get_peft_model(model: nn.Module, peft_config: peft.PeftConfig, adapter_name: str = "default",
                   attention: bool = True, model_kernels: bool = True, loss_kernels: bool = True,
                   activation_checkpointing: bool | str = False, **kwargs) -> PeftModel:
    """`peft.get_peft_model(model, peft_config, adapter_name, **kwargs)`, then `fuse`: fused LoRA layers and, with
    `attention`, lorafuse attention, with `model_kernels`, RMSNorm, SwiGLU and RoPE on lorafuse's kernels, with
    `loss_kernels`, the training loss without full logits. `activation_checkpointing`: False, True (each decoder
    layer recomputed in the backward) or "offload" (its input also kept in pinned host memory meanwhile); see
    `enable_activation_checkpointing`. Target specs (names, regex, "all-linear", exclude_modules, rank/alpha
    patterns) are PEFT's."""
    with _naming_targets(model):
        peft_model = peft.get_peft_model(model, peft_config, adapter_name=adapter_name, **kwargs)
    fuse(peft_model, attention=attention, model_kernels=model_kernels, loss_kernels=loss_kernels)
    return enable_activation_checkpointing(peft_model, activation_checkpointing)


def from_pretrained(model: nn.Module, adapter: str | os.PathLike, activation_checkpointing: bool | str = False,
                    **kwargs) -> PeftModel:
    """`PeftModel.from_pretrained(model, adapter, **kwargs)`, then `fuse`: an adapter saved by PEFT or by lorafuse
    (a directory or a Hub id) loaded straight into a fused model. Pass is_trainable=True to train it further, with
    `activation_checkpointing` as in `get_peft_model`."""
    with _naming_targets(model):
        peft_model = PeftModel.from_pretrained(model, adapter, **kwargs)
    return enable_activation_checkpointing(fuse(peft_model), activation_checkpointing)


def fuse(model: nn.Module, attention: bool = True, model_kernels: bool = True, loss_kernels: bool = True
         ) -> nn.Module:
    """Run `model`'s (a PeftModel's) LoRA layers fused, with `attention` its attention on lorafuse's kernel, with
    `model_kernels` its Llama-style RMSNorms and SwiGLU MLPs (Llama, Mistral, Qwen2, Qwen3) and Llama attention's RoPE
    on lorafuse's kernels, and with `loss_kernels` the Llama-style causal LMs' training loss computed without their
    logits (a training forward with labels then returns logits=None); in place, returns `model`. Reversible with
    `unfuse`."""
    fuse_layers(model)
    if attention:
        _use_lorafuse_attention(model)
    if model_kernels:
        use_model_kernels(model)
    if loss_kernels:
        use_loss_kernels(model)
    return model


def unfuse(model: nn.Module) -> nn.Module:
    """Give `model` back PEFT's LoRA classes, the attention implementation it had before `fuse` and transformers'
    RMSNorm, MLP, attention and causal-LM forwards; returns `model`."""
    unfuse_layers(model)
    drop_model_kernels(model)  # every KernelForward: the norms', the MLPs', the attentions' and the loss's
    base = _transformers_model(model)
    before = getattr(base, _ATTENTION_BEFORE, None)  # None also without a transformers model
    if before is not None:
        base.set_attn_implementation(before)
        delattr(base, _ATTENTION_BEFORE)
    return model


def _transformers_model(model: nn.Module) -> PreTrainedModel | None:
    """The outermost transformers model in `model`: inside a PeftModel or PeftMixedModel, or `model` itself when
    transformers' add_adapter gave it adapters."""
    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


def _use_lorafuse_attention(model: nn.Module) -> None:
    """attn_implementation="lorafuse" on the transformers model inside `model`, where that model takes it."""
    base = _transformers_model(model)
    if base is None:
        log_once(f"lorafuse.fuse: {type(model).__name__} holds no transformers model: attention is left as it is",
                 level=logging.INFO)
        return
    before = base.config._attn_implementation
    if before == ATTENTION:
        return
    why = "it does not call transformers' attention interface"
    try:
        base.set_attn_implementation(ATTENTION)
    except (ValueError, ImportError) as err:
        why = str(err)
    if base.config._attn_implementation != ATTENTION:
        log_once(f"lorafuse.fuse: {type(base).__name__} keeps its {before} attention ({why}); "
                 "its LoRA layers run fused all the same")
        return
    setattr(base, _ATTENTION_BEFORE, before)


@contextmanager
def _naming_targets(model: nn.Module):
    """Adds the module names that targets could match to PEFT's errors for targets that match nothing or match a
    module LoRA cannot wrap: PEFT names only the spec, or the module's type."""
    try:
        yield
    except ValueError as err:
        if not isinstance(err, NoMatchingPeftModuleError) and not _UNSUPPORTED_TARGET.match(str(err)):
            raise
        raise type(err)(f"{err}\n{_targetable_names(model)}") from err


def _targetable_names(model: nn.Module) -> str:
    names, full_names = defaultdict(set), []
    wrapped = None
    for name, module in model.named_modules():
        if wrapped and name.startswith(wrapped):
            continue
        if isinstance(module, BaseTunerLayer):  # PEFT wrapped it before it raised: name its base layer
            wrapped, module = f"{name}.", module.get_base_layer()
        if isinstance(module, TARGETABLE):
            names[type(module).__name__].add(name.rsplit(".", 1)[-1])
            full_names.append((not isinstance(module, (nn.Linear, Conv1D)), name))  # a linear one is the example
    if not names:
        return (f"{type(model).__name__} holds no module that LoRA can wrap "
                f"({', '.join(t.__name__ for t in TARGETABLE)}).")
    found = "; ".join(f"{kind}: {', '.join(sorted(leaves))}" for kind, leaves in sorted(names.items()))
    example = min(full_names, key=lambda item: item[0])[1]
    return (f"Modules in {type(model).__name__} that LoRA can wrap - {found}. target_modules takes these names "
            f"(matched at the end of full names such as {example!r}), a regex matched against whole full names, "
            "or 'all-linear'; exclude_modules takes the same forms.")
