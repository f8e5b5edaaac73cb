"""Activation checkpointing of a tiny fused Llama, in transformers' way (True) and offloaded ("offload"), through
lorafuse.get_peft_model: the forward runs again in the backward, with the same dropout masks."""
import pytest
import torch
from peft import LoraConfig
from transformers.modeling_layers import GradientCheckpointingLayer

import lorafuse
from lorafuse.nn.layer_checkpoint import LayerCheckpoint

from .families import batch, tiny_model


def loss_and_grads(checkpointing) -> tuple[torch.Tensor, dict, int]:
    """One training forward and backward with dropout on: (loss, the LoRA gradients, q_proj's forward calls)."""
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.3, target_modules="all-linear", init_lora_weights=False)
    model = lorafuse.get_peft_model(tiny_model("llama"), config, attention=False,
                                    activation_checkpointing=checkpointing)
    model.train()
    calls = []
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    q_proj.register_forward_hook(lambda *_: calls.append(1))
    inputs = batch("llama")
    torch.manual_seed(3)  # the dropout masks' seeds
    loss = model(**inputs).loss
    loss.backward()
    grads = {name: param.grad for name, param in model.named_parameters() if param.requires_grad}
    return loss.detach(), grads, len(calls)


@pytest.mark.parametrize("checkpointing", [True, "offload"])
def test_activation_checkpointing_recomputes_the_forward_with_the_same_dropout_masks(checkpointing):
    loss, grads, calls = loss_and_grads(checkpointing=False)
    loss_again, grads_again, calls_again = loss_and_grads(checkpointing=checkpointing)
    assert (calls, calls_again) == (1, 2)  # the layer's forward ran again in the backward
    assert torch.equal(loss, loss_again)
    assert all(grad is not None and grad.abs().sum() > 0 for grad in grads.values())
    for name, grad in grads.items():
        torch.testing.assert_close(grads_again[name], grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("checkpointing", [True, "offload"])
def test_every_decoder_layer_gets_one_layer_checkpoint(checkpointing):
    model = lorafuse.get_peft_model(tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj"]),
                                    activation_checkpointing=checkpointing)
    functions = {id(layer._gradient_checkpointing_func) for layer in model.modules()
                 if isinstance(layer, GradientCheckpointingLayer)}
    layers = [layer for layer in model.modules() if isinstance(layer, GradientCheckpointingLayer)]
    assert len(layers) == 2 and len(functions) == 1
    assert isinstance(layers[0]._gradient_checkpointing_func, LayerCheckpoint)
    assert layers[0]._gradient_checkpointing_func.offload == (checkpointing == "offload")
    # transformers' call turns it off (its newer name where it has one)
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
    assert not any(layer.gradient_checkpointing for layer in layers)


@pytest.mark.parametrize("value", ["sometimes", 2, None])
def test_an_unknown_mode_names_the_allowed_values(value):
    with pytest.raises(ValueError, match="activation_checkpointing=.*allowed values are false, true, offload"):
        lorafuse.get_peft_model(tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj"]),
                                activation_checkpointing=value)


def test_a_model_without_checkpointable_layers_is_refused(monkeypatch):
    from lorafuse.hf import activation_checkpointing

    class NotALayer:
        pass

    monkeypatch.setattr(activation_checkpointing, "GradientCheckpointingLayer", NotALayer)
    with pytest.raises(ValueError, match="has no decoder layers that transformers checkpoints"):
        lorafuse.get_peft_model(tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj"]),
                                activation_checkpointing=True)
