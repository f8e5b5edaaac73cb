"""lorafuse on a tiny random model of each family (tests/hf/families.py) against PEFT's own model: logits and
gradients, adapters saved by one and loaded by the other, merge_and_unload, BERT's padding, a 32-step training
run, and GPT-2's Conv1D layer on both GEMM routes."""
import collections
import copy
import importlib

import peft
import pytest
import torch
from peft import LoraConfig, PeftModel
from torch import nn
from transformers.pytorch_utils import Conv1D

import lorafuse
from lorafuse.ops.lora.dropout import new_seed
from tests.hf.families import FAMILIES, LORA_LAYERS, VOCAB, batch, logits, lora_config, lora_layer_kinds, tiny_model
from tests.lora_check import (SeededDropout, assert_fp32_close, forward_backward, random_io, randomize_lora_B,
                              relative_error)

LAYERS = 2  # attention calls per forward of every tiny model


def count_calls(monkeypatch, calls: collections.Counter, module_name: str, name: str) -> None:
    module = importlib.import_module(module_name)
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls[name] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


@pytest.fixture
def kernel_calls(monkeypatch) -> collections.Counter:
    """Calls of the fused LoRA op and of the flash-attention kernel: which path ran, fused or not."""
    calls = collections.Counter()
    count_calls(monkeypatch, calls, "lorafuse.nn.lora_linear", "lora_linear")
    count_calls(monkeypatch, calls, "lorafuse.hf.attention", "flash_attention")
    count_calls(monkeypatch, calls, "lorafuse.hf.model_kernels", "rms_norm")
    count_calls(monkeypatch, calls, "lorafuse.hf.model_kernels", "silu_mul")
    count_calls(monkeypatch, calls, "lorafuse.hf.causal_lm_loss", "linear_cross_entropy")
    return calls


def loss_and_grads(model: nn.Module, inputs: dict) -> dict:
    """The training loss, and its gradients of the input embeddings and of every trainable parameter."""
    inputs = dict(inputs)
    embeds = model.get_input_embeddings()(inputs.pop("input_ids")).detach().requires_grad_(True)
    out = model.train()(inputs_embeds=embeds, **inputs)
    out.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    return {"loss": out.loss.detach(), "inputs_embeds": embeds.grad, **grads}


# Llama-style RMSNorms (two per layer and the final one; Qwen3 adds q and k norms) and SwiGLU MLPs (one per layer)
# on lorafuse's kernels; Gemma's norm (1 + weight) and gelu MLP, GPT-2 and BERT keep transformers' modules.
LLAMA_STYLE = {"rms_norm": 2 * LAYERS + 1, "silu_mul": LAYERS}
MODEL_KERNELS = {"llama": LLAMA_STYLE, "mistral": LLAMA_STYLE, "qwen2": LLAMA_STYLE,
                 "qwen3": {"rms_norm": 4 * LAYERS + 1, "silu_mul": LAYERS}, "gemma3": {}, "gpt2": {}, "bert": {}}
# The training loss without full logits: the causal LMs whose forward is LlamaForCausalLM's.
LOSS_KERNEL = {family: {"linear_cross_entropy": 1} if family in ("llama", "mistral", "qwen2", "qwen3") else {}
               for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_grads_match_peft(family, kernel_calls):
    plain = peft.get_peft_model(tiny_model(family), lora_config(family))
    fused = lorafuse.fuse(copy.deepcopy(plain))
    assert lora_layer_kinds(fused) == {"FusedLoraLinear": LORA_LAYERS[family]}
    assert fused.get_base_model().config._attn_implementation == "lorafuse"
    inputs = batch(family)
    fused_results = loss_and_grads(fused, inputs)
    assert kernel_calls == {"lora_linear": LORA_LAYERS[family], "flash_attention": LAYERS, **MODEL_KERNELS[family],
                            **LOSS_KERNEL[family]}
    plain_results = loss_and_grads(plain, inputs)
    fused_results["logits"], plain_results["logits"] = logits(fused, inputs), logits(plain, inputs)
    assert_fp32_close(fused_results, plain_results)


def test_encoder_ignores_padding(kernel_calls):
    """Each row of BERT's padded batch classifies as that row alone without padding."""
    fused = lorafuse.get_peft_model(tiny_model("bert"), lora_config("bert"))
    inputs = batch("bert")
    padded = logits(fused, inputs)
    assert kernel_calls["flash_attention"] == LAYERS
    for row, keep in enumerate(inputs["attention_mask"].bool()):
        alone = logits(fused, dict(input_ids=inputs["input_ids"][row, keep][None]))
        assert relative_error(padded[row], alone[0]) < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_adapters_load_across_peft_and_lorafuse(family, tmp_path):
    """Saved fused, loaded by plain PEFT; saved by PEFT, loaded straight into a fused model: the same logits."""
    inputs = batch(family)
    fused = lorafuse.get_peft_model(tiny_model(family), lora_config(family))
    fused.save_pretrained(tmp_path / "lorafuse")
    plain = PeftModel.from_pretrained(tiny_model(family), tmp_path / "lorafuse")
    plain.save_pretrained(tmp_path / "peft")
    loaded = lorafuse.from_pretrained(tiny_model(family), tmp_path / "peft")
    assert lora_layer_kinds(plain) == {"Linear": LORA_LAYERS[family]}
    assert lora_layer_kinds(loaded) == {"FusedLoraLinear": LORA_LAYERS[family]}
    want = logits(plain, inputs)
    assert relative_error(logits(fused, inputs), want) < 1e-5
    assert relative_error(logits(loaded, inputs), want) < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_merge_and_unload_matches_unmerged(family):
    fused = lorafuse.get_peft_model(tiny_model(family), lora_config(family))
    inputs = batch(family)
    unmerged = logits(fused, inputs)
    merged = fused.merge_and_unload()
    assert lora_layer_kinds(merged) == {}
    assert relative_error(logits(merged, inputs), unmerged) < 1e-5


def test_training_losses_match_peft_step_by_step():
    """32 AdamW steps on the tiny Llama from PEFT's init (B = 0), fused and unfused: equal losses at every step.
    Two query heads, one row of 16 tokens: the interpreter runs attention once per row and head."""
    runs = []
    for get_peft_model in (lorafuse.get_peft_model, peft.get_peft_model):
        model = get_peft_model(tiny_model("llama", num_attention_heads=2, num_key_value_heads=1),
                               LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        data = torch.Generator().manual_seed(0)
        losses = []
        for _ in range(32):
            ids = (torch.randint(3, 19, (1, 1), generator=data) + torch.arange(16)) % VOCAB  # counting: learnable
            loss = model.train()(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        runs.append(torch.tensor(losses))
    fused, plain = runs
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=0)
    assert plain[-1] < 0.8 * plain[0]  # it trained


class OneConv1D(nn.Module):
    """GPT-2's layer kind alone: transformers' Conv1D, weight stored [in, out]."""

    def __init__(self, k: int, n: int):
        super().__init__()
        self.proj = Conv1D(n, k)

    def forward(self, x):
        return self.proj(x)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("rows", [7, 113])  # the Triton GEMM fuses the shrink into its K-loop up to 64 rows
@pytest.mark.parametrize("gemm", ["cublas", "triton"])
def test_conv1d_layer_matches_peft(gemm, rows, dropout, monkeypatch, kernel_calls):
    """The op takes Conv1D's weight as its transposed view on both GEMM routes, dropout included."""
    monkeypatch.setenv("LORAFUSE_GEMM", gemm)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["proj"], fan_in_fan_out=True, lora_dropout=dropout)
    plain = peft.get_peft_model(OneConv1D(48, 80), config)
    randomize_lora_B(plain.base_model.model.proj)
    fused = lorafuse.fuse(copy.deepcopy(plain)).train()
    x, grad_out = random_io((rows, 48), 80)
    torch.manual_seed(99)
    if dropout:  # PEFT drops exactly what the op drops: the op draws its seed first thing
        plain.base_model.model.proj.lora_dropout["default"] = SeededDropout(dropout, int(new_seed(x.device)))
        torch.manual_seed(99)
    fused_results = forward_backward(fused, x, grad_out)
    assert kernel_calls == {"lora_linear": 1}
    assert_fp32_close(fused_results, forward_backward(plain.train(), x, grad_out))
