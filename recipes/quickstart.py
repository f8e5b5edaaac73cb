"""Quickstart: LoRA-train a tiny Llama with lorafuse's fused layers, on CPU in seconds.

    python recipes/quickstart.py

Builds a 2-layer Llama from a config (random weights, fixed seed: nothing is downloaded),
wraps it with PEFT LoRA (dropout 0.05), calls `lorafuse.fuse`, and trains 30 AdamW steps on
a counting pattern (next token = this token + 1, mod 16), printing the loss as it falls.

Which path runs: on CUDA, the op's Triton kernels. On CPU, the op's PyTorch reference, unless
TRITON_INTERPRET=1 is set before Python starts, which runs the same Triton kernels in Triton's
interpreter (much slower: use it to debug kernels, not to train).
"""
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import lorafuse

STEPS = 30
PRINT_EVERY = 5
PERIOD = 16  # the pattern counts 0, 1, ..., 15, 0, 1, ...
BATCH, SEQ = 8, 32


def tiny_llama() -> LlamaForCausalLM:
    # initializer_range 0.2 (HF's default is 0.02): with a frozen random lm_head that small,
    # logits could not grow large enough for the loss to fall far, whatever LoRA learns.
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         initializer_range=0.2)
    return LlamaForCausalLM(config)


def counting_batch(generator: torch.Generator) -> torch.Tensor:
    """[BATCH, SEQ] token ids: each row counts modulo PERIOD from a random start."""
    starts = torch.randint(0, PERIOD, (BATCH, 1), generator=generator)
    return (starts + torch.arange(SEQ)) % PERIOD


def main() -> float:
    torch.manual_seed(0)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = lorafuse.fuse(get_peft_model(tiny_llama(), lora))
    model.print_trainable_parameters()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    data = torch.Generator().manual_seed(0)
    model.train()
    for step in range(1, STEPS + 1):
        ids = counting_batch(data)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 1 or step % PRINT_EVERY == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}")
    print(f"final loss {loss.item():.4f}")
    return loss.item()


if __name__ == "__main__":
    main()
