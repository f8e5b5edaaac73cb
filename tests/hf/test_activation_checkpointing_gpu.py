"""Offloaded activation checkpointing on the GPU: the same loss and gradients as no checkpointing (dropout on), layer
inputs waiting in pinned host memory, and less GPU memory than checkpointing that keeps them on the GPU.

Needs CUDA and Triton's compiled kernels:
    TRITON_INTERPRET=0 python -m pytest -q tests/hf/test_activation_checkpointing_gpu.py
"""
import os

import pytest
import torch
from peft import LoraConfig
from transformers import LlamaConfig, LlamaForCausalLM

import lorafuse
from lorafuse.nn import layer_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs a GPU and Triton's compiled kernels (TRITON_INTERPRET=0)")

BATCH, LENGTH, HIDDEN, LAYERS = 2, 2048, 512, 16


def step(checkpointing) -> dict:
    """One training step of a fresh bf16 Llama with dropout: loss, LoRA gradients, and the peak GPU memory."""
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=HIDDEN, intermediate_size=1024,
                                        num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=4,
                                        max_position_embeddings=LENGTH))
    model = lorafuse.get_peft_model(base.to("cuda", torch.bfloat16),
                                    LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules="all-linear",
                                               init_lora_weights=False),
                                    activation_checkpointing=checkpointing).train()
    ids = torch.randint(0, 1000, (BATCH, LENGTH), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    torch.manual_seed(1)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.cuda.synchronize()
    grads = {name: p.grad.float() for name, p in model.named_parameters() if p.requires_grad}
    return {"loss": loss.item(), "grads": grads, "peak": torch.cuda.max_memory_allocated() - start}


def test_offload_equals_no_checkpointing_and_keeps_less_on_the_gpu(monkeypatch):
    stashed = []
    real_stash = layer_checkpoint._Stash

    def recorded(tensor, copy_stream, below):
        stash = real_stash(tensor, copy_stream, below)
        stashed.append((stash.host.device.type, stash.host.is_pinned()))
        return stash

    monkeypatch.setattr(layer_checkpoint, "_Stash", recorded)
    plain, kept, offloaded = step(False), step(True), step("offload")
    assert stashed == [("cuda", False)] * LAYERS + [("cpu", True)] * LAYERS  # kept, then offloaded
    assert offloaded["loss"] == plain["loss"]
    for name, grad in plain["grads"].items():
        torch.testing.assert_close(offloaded["grads"][name], grad, rtol=2e-2, atol=1e-3, msg=name)
    # offloaded, the GPU holds at most MAX_COPIES_IN_FLIGHT layer inputs, the one in use and the one prefetched
    layer_input = BATCH * LENGTH * HIDDEN * 2  # bytes of one layer's bf16 input
    assert offloaded["peak"] < kept["peak"] - (LAYERS - 6) * layer_input < plain["peak"]
