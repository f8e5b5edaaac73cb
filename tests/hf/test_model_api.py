"""lorafuse's model API (get_peft_model, from_pretrained, fuse, unfuse): PEFT's target specs fused as PEFT targets
them, and what users are told - errors for targets that cannot work, one log line for what runs unfused."""
import collections
import copy

import peft
import pytest
import torch
import transformers
from packaging import version
from peft import LoraConfig, PeftModel
from transformers import BloomConfig, BloomForCausalLM
from transformers.integrations import peft as transformers_peft

import lorafuse
from lorafuse.hf import FusedLoraLinear
from tests.hf.families import batch, logits, lora_config, lora_layer_kinds, tiny_model
from tests.hf.test_fuse import OneLinear
from tests.lora_check import relative_error

LLAMA_LAYERS = [f"model.layers.{i}" for i in range(2)]
LLAMA_KERNELS = {"LlamaRMSNorm": 5, "LlamaMLP": 2, "LlamaAttention": 2}  # the modules on lorafuse's kernel forwards
# transformers' own adapter methods (add_adapter, load_adapter) refuse a PEFT older than their MIN_PEFT_VERSION:
# transformers 5.24 asks for PEFT 0.22.0, which is not released yet (PyPI's newest: 0.21.2, 2026-11-24).
PEFT_FOR_TRANSFORMERS = getattr(transformers_peft, "MIN_PEFT_VERSION", "0")
TRANSFORMERS_ADAPTERS_WORK = version.parse(peft.__version__) >= version.parse(PEFT_FOR_TRANSFORMERS)


def attention_of(model: PeftModel) -> str:
    return model.get_base_model().config._attn_implementation


def on_model_kernels(model: PeftModel) -> dict:
    """{class name: how many of its modules have lorafuse's forward} for the norms, MLPs and attentions of `model`."""
    found = collections.Counter()
    for module in model.modules():
        forward = vars(module).get("forward")
        if forward is not None and forward.__module__ == "lorafuse.hf.model_kernels":
            found[type(module).__name__] += 1
    return dict(found)


def test_get_peft_model_fuses_layers_attention_and_model_kernels_and_unfuse_restores_all():
    model = lorafuse.get_peft_model(tiny_model("llama"), lora_config("llama", target_modules=["q_proj", "v_proj"]))
    assert isinstance(model, PeftModel)
    assert (lora_layer_kinds(model), attention_of(model)) == ({"FusedLoraLinear": 4}, "lorafuse")
    assert on_model_kernels(model) == LLAMA_KERNELS
    assert lorafuse.unfuse(model) is model
    assert (lora_layer_kinds(model), attention_of(model), on_model_kernels(model)) == ({"Linear": 4}, "sdpa", {})
    assert lorafuse.fuse(model, attention=False, model_kernels=False) is model
    assert (lora_layer_kinds(model), attention_of(model), on_model_kernels(model)) == ({"FusedLoraLinear": 4},
                                                                                        "sdpa", {})


def test_fused_model_pickles_whole(tmp_path):
    # torch.save / torch.load of the whole model (not only its state): the kernels' forwards come back with it
    model = lorafuse.get_peft_model(tiny_model("llama"), lora_config("llama"))
    ids = batch("llama")["input_ids"]
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert on_model_kernels(loaded) == LLAMA_KERNELS
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    copied = copy.deepcopy(model)
    assert all(vars(m)["forward"].module is m for m in copied.modules() if "forward" in vars(m))


def test_from_pretrained_passes_peft_arguments(tmp_path):
    peft.get_peft_model(tiny_model("llama"), lora_config("llama")).save_pretrained(tmp_path)
    model = lorafuse.from_pretrained(tiny_model("llama"), tmp_path, adapter_name="mine", is_trainable=True)
    assert model.active_adapters == ["mine"]
    assert lora_layer_kinds(model) == {"FusedLoraLinear": 14}
    assert all(p.requires_grad for name, p in model.named_parameters() if "lora_" in name)


def scales(layers: list[str], modules: list[str], r: int = 4, alpha: float = 8) -> dict:
    """{module: (rank, scaling)} for each of `modules` in each of `layers`; lora_config's r and alpha by default."""
    return {f"{layer}.{module}": (r, alpha / r) for layer in layers for module in modules}


Q, K, V, OUT = "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"
GATE, UP, DOWN = "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"
FIRST, SECOND = LLAMA_LAYERS[:1], LLAMA_LAYERS[1:]
# name: (LoraConfig arguments, {module: (rank, scaling)} of the LoRA layers PEFT makes)
TARGET_SPECS = {
    "names": (dict(target_modules=["q_proj", "down_proj"]), scales(LLAMA_LAYERS, [Q, DOWN])),
    "regex": (dict(target_modules=r".*\.1\.self_attn\.(q|k)_proj"), scales(SECOND, [Q, K])),
    "all-linear": (dict(target_modules="all-linear"), scales(LLAMA_LAYERS, [Q, K, V, OUT, GATE, UP, DOWN])),
    "exclude_modules": (dict(target_modules="all-linear", exclude_modules=["gate_proj", "model.layers.0.mlp.up_proj"]),
                        scales(LLAMA_LAYERS, [Q, K, V, OUT, DOWN]) | scales(SECOND, [UP])),
    "rank_and_alpha_patterns": (
        dict(target_modules=["q_proj", "v_proj"], rank_pattern={"q_proj": 2, "layers.1.self_attn.v_proj": 6},
             alpha_pattern={"v_proj": 3}),
        scales(LLAMA_LAYERS, [Q], r=2) | scales(FIRST, [V], alpha=3) | scales(SECOND, [V], r=6, alpha=3)),
}


@pytest.mark.parametrize("spec", TARGET_SPECS)
def test_target_specs_fuse_what_peft_targets(spec):
    """Each spec passes through PEFT: the fused model has PEFT's layers, ranks and scales, and PEFT's logits."""
    config, expected = TARGET_SPECS[spec]
    fused = lorafuse.get_peft_model(tiny_model("llama"), lora_config("llama", **config))
    plain = peft.get_peft_model(tiny_model("llama"), lora_config("llama", **config))
    got = {}
    for name, module in fused.base_model.model.named_modules():
        if hasattr(module, "lora_A"):
            assert type(module) is FusedLoraLinear
            assert module.lora_A["default"].weight.shape[0] == module.r["default"]
            got[name] = (module.r["default"], module.scaling["default"])
    assert got == expected
    inputs = batch("llama")
    assert relative_error(logits(fused, inputs), logits(plain, inputs)) < 1e-5


def test_targets_not_found_name_the_modules_found():
    with pytest.raises(ValueError, match="not found in the base model") as error:
        lorafuse.get_peft_model(tiny_model("llama"), LoraConfig(target_modules=["query", "value"]))
    message = str(error.value)
    for hint in ("Linear: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj",
                 "Embedding: embed_tokens", "'model.layers.0.self_attn.q_proj'", "regex", "'all-linear'"):
        assert hint in message


def test_adapter_for_another_model_names_the_modules_found(tmp_path):
    peft.get_peft_model(tiny_model("llama"), lora_config("llama")).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="Conv1D: c_attn, c_fc, c_proj"):  # no q_proj, ... in GPT-2
        lorafuse.from_pretrained(tiny_model("gpt2"), tmp_path)


def test_unsupported_base_layer_fails_at_once():
    with pytest.raises(ValueError, match=r"(?s)LlamaRMSNorm.* is not supported.*Linear: down_proj"):
        lorafuse.get_peft_model(tiny_model("llama"), LoraConfig(target_modules=["q_proj", "input_layernorm"]))


def test_other_lora_layer_kinds_run_unfused_said_once(fallback_log):
    config = lora_config("llama", target_modules=["embed_tokens", "q_proj"])
    plain = peft.get_peft_model(tiny_model("llama"), config)
    fused = lorafuse.fuse(copy.deepcopy(plain))
    lorafuse.fuse(fused)
    assert lora_layer_kinds(fused) == {"Embedding": 1, "FusedLoraLinear": 2}
    inputs = batch("llama")
    assert relative_error(logits(fused, inputs), logits(plain, inputs)) < 1e-5
    said = [r.getMessage() for r in fallback_log.records if "LoRA Embedding" in r.getMessage()]
    assert said == ["lorafuse.fuse: 1 LoRA Embedding layers (e.g. base_model.model.model.embed_tokens) run through "
                    "PEFT's forward: lorafuse fuses LoRA Linear layers on nn.Linear and on transformers' Conv1D"]


def test_model_without_attention_interface_keeps_its_attention(fallback_log):
    """Bloom computes attention itself (no transformers attention interface): its LoRA layers still run fused."""
    torch.manual_seed(1)
    bloom = BloomForCausalLM(BloomConfig(vocab_size=61, hidden_size=32, n_layer=2, n_head=2))
    plain = peft.get_peft_model(bloom, LoraConfig(target_modules=["query_key_value"], init_lora_weights=False))
    fused = lorafuse.fuse(copy.deepcopy(plain))
    assert lora_layer_kinds(fused) == {"FusedLoraLinear": 2}
    assert attention_of(fused) == attention_of(plain) != "lorafuse"
    assert f"BloomForCausalLM keeps its {attention_of(plain)} attention" in fallback_log.text
    ids = torch.randint(0, 61, (2, 7))
    assert relative_error(logits(fused, dict(input_ids=ids)), logits(plain, dict(input_ids=ids))) < 1e-5


def test_model_outside_transformers_gets_fused_layers(fallback_log):
    model = lorafuse.get_peft_model(OneLinear(16, 24, True), LoraConfig(target_modules=["proj"]))
    assert lora_layer_kinds(model) == {"FusedLoraLinear": 1}
    assert "PeftModel holds no transformers model: attention is left as it is" in fallback_log.text


@pytest.mark.skipif(not TRANSFORMERS_ADAPTERS_WORK,
                    reason=f"transformers {transformers.__version__}'s add_adapter needs "
                           f"PEFT >= {PEFT_FOR_TRANSFORMERS}; PEFT {peft.__version__} is installed")
def test_fuse_takes_a_transformers_model_given_adapters_by_add_adapter():
    model = tiny_model("llama")
    model.add_adapter(LoraConfig(target_modules=["q_proj"]))
    assert lorafuse.fuse(model) is model
    assert (lora_layer_kinds(model), model.config._attn_implementation) == ({"FusedLoraLinear": 2}, "lorafuse")
    lorafuse.unfuse(model)
    assert (lora_layer_kinds(model), model.config._attn_implementation) == ({"Linear": 2}, "sdpa")
