"""Tiny random models of the families lorafuse is tested on, one batch for each, and what tests read off them.

Seven families: five decoders on nn.Linear (Llama, Mistral, Qwen2, Qwen3, Gemma 3), GPT-2 (transformers'
Conv1D, PEFT's fan_in_fan_out) and BERT (an encoder: sequence classification on a padded batch).
fp32, dropout 0, head dim 16 (the attention kernel takes 16-128), widths small for Triton's interpreter.
"""
import collections
import copy

import torch
from peft import LoraConfig
from peft.tuners import lora
from torch import nn
from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, BertConfig, Gemma3TextConfig,
                          GPT2Config, LlamaConfig, MistralConfig, PreTrainedModel, Qwen2Config, Qwen3Config)

VOCAB = 61
# 4 query heads sharing 2 key/value heads of dim 16 on a hidden size of 32: q_proj is 32 -> 64. Weights of std
# 0.1, not HF's 0.02: near-uniform attention and q/k norms make gradients cancel so much that two correct fp32
# computations (sdpa and eager attention) would already differ by 1e-5.
DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=32, pad_token_id=0, initializer_range=0.1)
SLIDING = dict(sliding_window=4)  # shorter than the batch: the kernel's windows run
FAMILIES = {
    "llama": LlamaConfig(**DECODER),
    "mistral": MistralConfig(**DECODER, **SLIDING),
    "qwen2": Qwen2Config(**DECODER),  # q/k/v with bias
    "qwen3": Qwen3Config(**DECODER),  # q/k norms
    "gemma3": Gemma3TextConfig(**DECODER, **SLIDING, layer_types=["sliding_attention", "full_attention"],
                               query_pre_attn_scalar=16),  # scaling 1/sqrt(head_dim), as Gemma 3 models have it
    "gpt2": GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0,
                       embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1),
    "bert": BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=2, max_position_embeddings=32, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, num_labels=3),
}
ENCODERS = {"bert"}
# What "all-linear" wraps in 2 layers: q, k, v, o, gate, up, down; GPT-2 c_attn, c_proj x2, c_fc; BERT query, key,
# value, 3 dense, and the pooler's dense.
LORA_LAYERS = {family: 2 * 7 for family in FAMILIES} | {"gpt2": 2 * 4, "bert": 2 * 6 + 1}


def tiny_model(family: str, **overrides) -> PreTrainedModel:
    """The same random fp32 weights on every call (save/load tests rebuild the base model); overrides: config keys."""
    torch.manual_seed(1)
    auto = AutoModelForSequenceClassification if family in ENCODERS else AutoModelForCausalLM
    # A copy of the config: fuse switches the model's config to lorafuse attention.
    config = copy.deepcopy(FAMILIES[family])
    config.update(overrides)
    return auto.from_config(config, attn_implementation="sdpa").float()


def lora_config(family: str, **overrides) -> LoraConfig:
    """"all-linear", random A and B (PEFT's zero B would hide B's bugs), alpha != r so that scaling shows."""
    args = dict(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False,
                task_type="SEQ_CLS" if family in ENCODERS else "CAUSAL_LM", fan_in_fan_out=family == "gpt2")
    return LoraConfig(**{**args, **overrides})


def batch(family: str) -> dict:
    """Model inputs and labels: decoders 2 x 7 tokens; BERT 3 x 9 tokens, two rows right-padded."""
    if family in ENCODERS:
        ids = torch.randint(3, VOCAB, (3, 9))
        mask = torch.ones_like(ids)
        mask[1, 6:] = 0
        mask[2, 3:] = 0
        return dict(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 2, 1]))
    ids = torch.randint(3, VOCAB, (2, 7))
    return dict(input_ids=ids, labels=ids)


def lora_layer_kinds(model: nn.Module) -> dict:
    """{class name: count} of the model's LoRA layers: fused ones are FusedLoraLinear, PEFT's are Linear."""
    return dict(collections.Counter(type(m).__name__ for m in model.modules() if isinstance(m, lora.LoraLayer)))


def logits(model: nn.Module, inputs: dict) -> torch.Tensor:
    """The logits in eval mode, without autograd (labels ignored)."""
    with torch.no_grad():
        return model.eval()(**{k: v for k, v in inputs.items() if k != "labels"}).logits
