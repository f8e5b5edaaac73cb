"""model_kernels' attention forward (ops.rope for transformers' rotation) on tiny models: the modules it takes (Llama's
attention and the classes sharing its code and helpers; not Mistral's, Qwen2's or Qwen3's, nor GLM's, whose forward
is Llama's but whose rotation is not), training and cached forwards equal to transformers', the calls it hands to
transformers' forward, and drop_model_kernels giving that forward back."""
import collections
import copy

import peft
import pytest
import torch
from transformers import DynamicCache, GemmaConfig, GlmConfig, StaticCache
from transformers.models.gemma.modeling_gemma import GemmaAttention
from transformers.models.glm.modeling_glm import GlmAttention
from transformers.models.llama.modeling_llama import LlamaAttention

from lorafuse.hf import model_kernels
from tests.hf.families import DECODER, FAMILIES, batch, lora_config, tiny_model
from tests.hf.test_families import LAYERS, count_calls
from tests.lora_check import assert_fp32_close

# Llama-style modules of a tiny Llama: 2 norms a layer and the final one, an MLP and an attention a layer
LLAMA_MODULES = 2 * LAYERS + 1 + LAYERS + LAYERS
# Mistral and Qwen2 pass a sliding window to the attention function, Qwen3 and Gemma 3 norm q and k: not Llama's code
ATTENTIONS_TAKEN = {family: LAYERS if family == "llama" else 0 for family in FAMILIES}


@pytest.fixture
def rope_calls(monkeypatch) -> collections.Counter:
    """Calls of the attention forward's rope and of the kernel's launches (forward and backward)."""
    calls = collections.Counter()
    count_calls(monkeypatch, calls, "lorafuse.hf.model_kernels", "rope")
    count_calls(monkeypatch, calls, "lorafuse.ops.model.rope", "_launch")
    return calls


def loss_and_lora_grads(model, inputs: dict) -> dict:
    loss = model.train()(**inputs).loss
    loss.backward()
    return {"loss": loss.detach(), **{name: p.grad for name, p in model.named_parameters() if p.requires_grad}}


@pytest.mark.parametrize("family", FAMILIES)
def test_attentions_taken_are_those_computing_as_llamas(family):
    model = tiny_model(family)
    assert len(model_kernels.llama_attentions(model)) == ATTENTIONS_TAKEN[family]


def test_a_llama_forward_with_another_rotation_is_left_and_a_shared_one_taken():
    # GLM's attention forward is Llama's to the byte, but its module's apply_rotary_pos_emb rotates interleaved pairs
    # of part of the head; Gemma's shares Llama's forward and helpers
    config = dict(DECODER, num_hidden_layers=1)
    glm, gemma = GlmAttention(GlmConfig(**config), layer_idx=0), GemmaAttention(GemmaConfig(**config), layer_idx=0)
    assert model_kernels.code_keys(GlmAttention.forward) == model_kernels.code_keys(LlamaAttention.forward)
    assert model_kernels.llama_attentions(glm) == [] and model_kernels.llama_attentions(gemma) == [gemma]


@pytest.mark.parametrize("use_cache", [None, False], ids=["dynamic_cache", "no_cache"])
def test_training_step_on_the_rope_kernel_equals_transformers(use_cache, rope_calls):
    # A training forward makes a DynamicCache unless use_cache=False: the kernel forward takes both
    plain = peft.get_peft_model(tiny_model("llama"), lora_config("llama"))
    patched = copy.deepcopy(plain)
    assert model_kernels.use_model_kernels(patched) == LLAMA_MODULES
    inputs = dict(batch("llama"), use_cache=use_cache)
    got = loss_and_lora_grads(patched, inputs)
    assert rope_calls == {"rope": LAYERS, "_launch": 2 * LAYERS}  # one launch forward, one backward, per layer
    assert_fp32_close(got, loss_and_lora_grads(plain, inputs))


def test_cached_forwards_equal_transformers_and_other_caches_run_its_forward(rope_calls):
    # A prompt then one token on a DynamicCache: the kernel forward. A StaticCache (captured decoding's): transformers'
    plain = tiny_model("llama").eval()
    patched = copy.deepcopy(plain)
    model_kernels.use_model_kernels(patched)
    ids = batch("llama")["input_ids"]

    def prompt_then_token(model, cache_class) -> dict:
        cache = cache_class(config=model.config, **({"max_cache_len": 16} if cache_class is StaticCache else {}))
        with torch.no_grad():
            return {"prompt": model(input_ids=ids[:, :-1], past_key_values=cache).logits,
                    "token": model(input_ids=ids[:, -1:], past_key_values=cache).logits}

    for cache_class in (DynamicCache, StaticCache):
        got = prompt_then_token(patched, cache_class)
        assert rope_calls["rope"] == 2 * LAYERS, cache_class.__name__  # the DynamicCache's two forwards only
        assert_fp32_close(got, prompt_then_token(plain, cache_class))


def test_drop_model_kernels_gives_transformers_forward_back():
    model = tiny_model("llama")
    model_kernels.use_model_kernels(model)
    attentions = [m for m in model.modules() if isinstance(m, LlamaAttention)]
    assert all(vars(m)["forward"].fn is model_kernels._llama_attention_forward for m in attentions)
    model_kernels.drop_model_kernels(model)
    assert not any("forward" in vars(m) for m in model.modules())
    assert model_kernels.llama_attentions(model) == attentions
