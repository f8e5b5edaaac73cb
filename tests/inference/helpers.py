"""Models, prompts and reference generations shared by the inference tests."""
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, PreTrainedModel

from lorafuse._paths import ASSETS

TINY_LLAMA = ASSETS / "tiny-llama"


def tiny_llama(attention: str = "sdpa") -> PreTrainedModel:
    """The bundled 4-layer Llama in fp32 (the same weights on every call)."""
    return AutoModelForCausalLM.from_pretrained(TINY_LLAMA, attn_implementation=attention, dtype=torch.float32).eval()


def prompts(n: int, vocab: int = 512) -> list[list[int]]:
    """n prompts of different lengths (1 to 11 tokens, in an order that puts short ones beside long ones), none
    holding the tiny Llama's special ids 0-2."""
    generator = torch.Generator().manual_seed(n)
    return [torch.randint(3, vocab, ((5 * i + 3) % 11 + 1,), generator=generator).tolist() for i in range(n)]


def with_lora(model: PreTrainedModel, seed: int, **config) -> PeftModel:
    """`model` with a LoRA adapter of random A and clearly non-zero random B (PEFT starts B at zero)."""
    peft_model = get_peft_model(model, LoraConfig(**{"target_modules": ["q_proj", "v_proj"], **config}))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return peft_model.eval()


def hf_greedy(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, **kwargs) -> list[list[int]]:
    """transformers' greedy generate on each prompt alone (no padding): the new tokens, up to EOS included."""
    return [model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)).long(),
                           max_new_tokens=max_new_tokens, do_sample=False, **kwargs)[0, len(prompt):].tolist()
            for prompt in prompts]
