"""Adapters in lorafuse.inference.Engine: unmerged and merged LoRA give PEFT's greedy tokens; swapping an adapter in
place (smaller rank, other alpha, rsLoRA, alpha_pattern) gives the tokens of a model built with the new one, and an
adapter that does not fit the buffers is refused before anything is copied. One test runs lorafuse's fused layers
and attention (Triton's interpreter: kept small)."""
import pytest
import torch
from peft import PeftModel

import lorafuse
from lorafuse.inference import Engine, SamplingParams
from tests.hf.families import lora_layer_kinds
from tests.inference.helpers import hf_greedy, prompts, tiny_llama, with_lora

NEW = 8
PROMPTS = prompts(5)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Adapters saved in PEFT's format, and PEFT's greedy tokens with each (and with none) on PROMPTS."""
    root = tmp_path_factory.mktemp("adapters")
    adapters = {  # name: (LoraConfig arguments, seed of the random weights)
        "A": ({"r": 8, "lora_alpha": 16}, 1),
        # Another rank, alpha, rsLoRA scaling (alpha / sqrt(r)), a per-module alpha: each changes the scale folded in B
        "B": ({"r": 4, "lora_alpha": 32, "use_rslora": True, "alpha_pattern": {"v_proj": 3}}, 2),
        "rank16": ({"r": 16, "lora_alpha": 16}, 3),
        "k_proj": ({"r": 4, "lora_alpha": 8, "target_modules": ["k_proj", "q_proj"]}, 4),
    }
    tokens = {"base": hf_greedy(tiny_llama(), PROMPTS, NEW)}
    for name, (config, seed) in adapters.items():
        model = with_lora(tiny_llama(), seed, **config)
        model.save_pretrained(root / name)
        tokens[name] = hf_greedy(model, PROMPTS, NEW)
    assert tokens["A"] != tokens["base"] and tokens["B"] != tokens["base"] and tokens["A"] != tokens["B"]
    return root, tokens


def peft_model(saved, name: str) -> PeftModel:
    return PeftModel.from_pretrained(tiny_llama(), saved[0] / name).eval()


@pytest.mark.parametrize("merge", [False, True])
def test_lora_greedy_equals_peft_generate(saved, merge):
    engine = Engine(peft_model(saved, "A"), max_length=24, buckets=(2, 4, 8), merge=merge, check_every=3)
    assert isinstance(engine.model, PeftModel) != merge
    assert engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW)) == saved[1]["A"]
    assert engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=NEW)) == saved[1]["A"][:2]


def test_swap_gives_the_new_adapters_tokens_and_refuses_what_does_not_fit(saved):
    root, tokens = saved
    engine = Engine(peft_model(saved, "A"), max_length=24, buckets=(8,), check_every=3)
    buffers = [p for name, p in engine.model.named_parameters() if "lora_" in name]
    addresses = [p.data_ptr() for p in buffers]
    engine.swap_adapter(root / "B")
    assert engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW)) == tokens["B"]
    # Beyond rank 4, lora_A's rows and lora_B's columns are zero (either alone would cancel the other's leftovers).
    padding = {name: p[4:] if "lora_A" in name else p[:, 4:] for name, p in engine.model.named_parameters()
               if "lora_" in name}
    assert len(padding) == 16 and not any(p.any() for p in padding.values())
    with pytest.raises(ValueError, match=r"rank16 has rank 16 on .*q_proj, larger than the rank 8 of the model's "
                                         r"adapter 'default'"):
        engine.swap_adapter(root / "rank16")
    with pytest.raises(ValueError, match=r"k_proj targets 8 modules \(k_proj, q_proj\) but the model's adapter "
                                         r"'default' targets 8 modules \(q_proj, v_proj\)"):
        engine.swap_adapter(root / "k_proj")
    assert engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW)) == tokens["B"]  # nothing was copied
    engine.swap_adapter(root / "A")  # back to the full rank: B's zero padding is overwritten
    assert engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW)) == tokens["A"]
    assert [p.data_ptr() for p in buffers] == addresses


def test_swap_needs_an_unmerged_adapter(saved):
    engine = Engine(peft_model(saved, "A"), max_length=24, buckets=(1,), merge=True)
    with pytest.raises(TypeError, match="unmerged PeftModel is needed, got LlamaForCausalLM"):
        engine.swap_adapter(saved[0] / "B")


def test_fused_layers_and_attention_decode_and_swap(saved, fallback_log):
    root, tokens = saved
    model = lorafuse.from_pretrained(tiny_llama(), root / "A")  # fused LoRA layers, attn_implementation="lorafuse"
    assert model.get_base_model().config._attn_implementation == "lorafuse"
    engine = Engine(model, max_length=16, buckets=(4,), check_every=5)
    short = SamplingParams(max_new_tokens=4)
    assert engine.generate(PROMPTS[:3], short) == [ids[:4] for ids in tokens["A"][:3]]
    # Decode steps run the flash-decoding kernel on the engine's windows (nothing falls back to sdpa), and their
    # logits are PEFT's with sdpa attention. (Inside a CUDA graph, where only those windows keep the kernel:
    # tests/inference/test_cuda_graphs.py.)
    assert not [r.message for r in fallback_log.records if "attention runs because of" in r.message]
    peft_engine = Engine(peft_model(saved, "A"), max_length=16, buckets=(4,), check_every=5)
    assert peft_engine.generate(PROMPTS[:3], short) == [ids[:4] for ids in tokens["A"][:3]]
    torch.testing.assert_close(engine.last_logits(), peft_engine.last_logits(), rtol=1e-4, atol=1e-4)
    engine.swap_adapter(root / "B")
    assert engine.generate(PROMPTS[:3], short) == [ids[:4] for ids in tokens["B"][:3]]
    assert lora_layer_kinds(model) == {"FusedLoraLinear": 8}


def test_transformers_step_leaves_the_adapter_as_it_is(saved, fallback_log):
    # PEFT keeps the adapter of a bf16 model in float32 (for training). Only the fused step (tests/inference/
    # test_fused_step.py) casts and re-lays it out; transformers' step decodes it as it is, through the fused LoRA
    # layers (lora_decode sums float32 adapters in fp32): same dtypes, values and addresses after two engines.
    model = PeftModel.from_pretrained(tiny_llama().to(torch.bfloat16), saved[0] / "A").eval()
    before = {name: (param.detach().clone(), param.data_ptr()) for name, param in model.named_parameters()}
    assert {param.dtype for name, param in model.named_parameters() if "lora_" in name} == {torch.float32}
    Engine(model, max_length=8, buckets=(1,), fused_step=False, stack_adapters=False)
    Engine(model, max_length=8, buckets=(1,), fused_step=False)
    assert not [r.message for r in fallback_log.records if "cast in place" in r.message]
    for name, param in model.named_parameters():
        assert param.dtype == before[name][0].dtype and torch.equal(param, before[name][0]), name
        assert param.data_ptr() == before[name][1], name


def test_an_adapter_decoded_by_an_engine_saves_and_merges_as_before(saved, tmp_path):
    model = peft_model(saved, "A")
    engine = Engine(model, max_length=24, buckets=(8,))
    tokens = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW))
    model.save_pretrained(tmp_path / "again")
    assert hf_greedy(PeftModel.from_pretrained(tiny_llama(), tmp_path / "again").eval(), PROMPTS, NEW) == tokens
    assert hf_greedy(model.merge_and_unload(), PROMPTS, NEW) == tokens == saved[1]["A"]
