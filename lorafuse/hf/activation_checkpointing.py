"""Activation checkpointing of a transformers model's decoder layers (lorafuse.nn.layer_checkpoint): recomputed in the
backward, their inputs kept on the GPU (True) or in pinned host memory ("offload").

transformers' own checkpointing sets the layers' flags and makes the embeddings' output require grad; the checkpoint
function it gives each layer (torch's non-reentrant checkpoint, whose saved-tensor hooks cost host time on every saved
tensor) is then replaced by lorafuse's."""
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from ..nn.layer_checkpoint import LayerCheckpoint

MODES = (False, True, "offload")


def checkpointing_mode(value, key: str = "activation_checkpointing"):
    """`value` as one of MODES (the strings "false" and "true" as booleans, as Hydra and command lines give them);
    anything else is a ValueError naming `key` and the allowed values."""
    by_text = {str(mode).lower(): mode for mode in MODES}
    text = str(value).lower() if isinstance(value, (bool, str)) else None
    if text not in by_text:
        raise ValueError(f"{key}={value!r}: allowed values are {', '.join(by_text)}")
    return by_text[text]


def enable_activation_checkpointing(model: nn.Module, mode=True) -> nn.Module:
    """Checkpoint every decoder layer of `model` (a transformers model, or a PeftModel around one) in `mode`
    (MODES; False leaves the model as it is); returns `model`. Turned off by transformers'
    `model.activation_checkpointing_disable()` (`gradient_checkpointing_disable()` before transformers 5.2x).

    The recomputed forward draws the same dropout masks as the first. Gradients come from `.backward()`; under DDP,
    find_unused_parameters must be off (HF Trainer: ddp_find_unused_parameters=False). A model whose layers
    transformers cannot checkpoint is a ValueError."""
    mode = checkpointing_mode(mode)
    if mode is False:
        return model
    kwargs = {"use_reentrant": False}  # torch's checkpoint, replaced below
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x; the old name warns there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    checkpoint = LayerCheckpoint(offload=mode == "offload")  # one for all layers: each prefetches the one below's input
    layers = [layer for layer in model.modules()
              if isinstance(layer, GradientCheckpointingLayer) and layer.gradient_checkpointing]
    if not layers:
        raise ValueError(f"activation_checkpointing={mode!r}: {type(model).__name__} has no decoder layers that "
                         "transformers checkpoints (GradientCheckpointingLayer)")
    for layer in layers:
        layer._gradient_checkpointing_func = checkpoint
    return model
