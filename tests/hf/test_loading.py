"""lorafuse.hf.loading's training helpers on a tiny fused Llama."""
import torch

from lorafuse.hf import loading

from .families import batch, tiny_model


def loss_and_grads(checkpointing: bool) -> tuple[torch.Tensor, dict, int]:
    """One training forward and backward with dropout on: (loss, the LoRA gradients, q_proj's forward calls)."""
    model = loading.add_lora(tiny_model("llama"), fused=True, attention=False, r=4, lora_alpha=8,
                             lora_dropout=0.3, target_modules="all-linear", init_lora_weights=False)
    if checkpointing:
        loading.enable_activation_checkpointing(model)
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


def test_activation_checkpointing_recomputes_the_forward_with_the_same_dropout_masks():
    loss, grads, calls = loss_and_grads(checkpointing=False)
    loss_again, grads_again, calls_again = loss_and_grads(checkpointing=True)
    assert (calls, calls_again) == (1, 2)  # the layer's forward ran again in the backward
    assert torch.equal(loss, loss_again)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_again[name], grad, rtol=1e-6, atol=1e-7, msg=name)
