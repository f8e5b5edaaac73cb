"""lorafuse.fuse on PeftModels: the fused layer against PEFT's, fallbacks, and a tiny Llama end to end."""
import copy
import importlib

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners import lora
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import lorafuse
from lorafuse.hf import FusedLoraLinear
from lorafuse.ops.lora.dropout import new_seed
from tests.lora_check import (BIASES, DTYPES, HALF_DTYPES, LORA_ALPHA, RANKS, SHAPES, SeededDropout, assert_fp32_close,
                              assert_half_rule, check_against_peft, check_half, forward_backward, random_io,
                              randomize_lora_B, relative_error, shape_id)


class OneLinear(nn.Module):
    """The smallest model PEFT can wrap: one target, `proj`."""

    def __init__(self, k: int, n: int, bias: bool):
        super().__init__()
        self.proj = nn.Linear(k, n, bias=bias)

    def forward(self, x):
        return self.proj(x)


def peft_pair(k, n, r, bias="frozen", dtype=torch.float32, autocast_adapter_dtype=False, **config):
    """A fused PeftModel and the unfused PeftModel it was copied from: x [..., k] -> [..., n].

    `bias` is one of lora_check.BIASES; "trainable" is PEFT's bias="all" with lora_bias=True.
    autocast_adapter_dtype=False keeps half-precision adapters in the base dtype (PEFT's
    default upcasts them to float32; test_mixed_dtypes covers that).
    """
    trainable = bias == "trainable"
    config = LoraConfig(r=r, lora_alpha=LORA_ALPHA, target_modules=["proj"], bias="all" if trainable else "none",
                        lora_bias=trainable, **config)
    plain = get_peft_model(OneLinear(k, n, bias != "none").to(dtype), config,
                           autocast_adapter_dtype=autocast_adapter_dtype)
    randomize_lora_B(plain.base_model.model.proj)
    return lorafuse.fuse(copy.deepcopy(plain)), plain


@pytest.fixture
def op_calls(monkeypatch):
    """Counts calls of the fused op, so that a test knows which path ran: fused or PEFT's."""
    layer_module = importlib.import_module("lorafuse.nn.lora_linear")
    real, calls = layer_module.lora_linear, []

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(layer_module, "lora_linear", counted)
    return calls



@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("r", RANKS)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_matches_peft(shape, r, dtype, op_calls):
    x_shape, n = shape
    check_against_peft(*peft_pair(x_shape[-1], n, r), x_shape, n, dtype)
    assert op_calls


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", BIASES)
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[2]], ids=shape_id)
def test_bias_modes_match_peft(shape, bias, dtype, op_calls):
    x_shape, n = shape
    fused, plain = peft_pair(x_shape[-1], n, 8, bias)
    trainable_biases = [name for name, p in plain.named_parameters() if p.requires_grad and name.endswith("bias")]
    assert len(trainable_biases) == (2 if bias == "trainable" else 0)
    check_against_peft(fused, plain, x_shape, n, dtype)
    assert op_calls


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_mixed_dtypes_half_base_float32_adapters(dtype, op_calls):
    # PEFT's default for half-precision bases: adapters in float32, x cast to it on the adapter path.
    fused, plain = peft_pair(100, 36, 8, dtype=dtype, autocast_adapter_dtype=True)
    assert plain.base_model.model.proj.lora_A["default"].weight.dtype == torch.float32
    x, grad_out = random_io((113, 100), 36, dtype)
    check_half(lambda _: copy.deepcopy(fused), lambda _: copy.deepcopy(plain), x, grad_out, dtype)
    assert op_calls


def test_autocast_within_twice_torch_error(op_calls):
    fused, plain = peft_pair(100, 36, 8)
    x, grad_out = random_io((113, 100), 36)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused_results, plain_results = forward_backward(fused, x, grad_out), forward_backward(plain, x, grad_out)
    exact = forward_backward(copy.deepcopy(plain).double(), x.double(), grad_out.double())
    assert fused_results["out"].dtype == plain_results["out"].dtype == torch.bfloat16
    assert_half_rule(fused_results, plain_results, exact)
    assert op_calls


def test_dropout_matches_peft_with_our_mask(op_calls):
    fused, plain = peft_pair(48, 80, 8, lora_dropout=0.3)
    x, grad_out = random_io((3, 341, 48), 80)
    torch.manual_seed(99)
    seed = int(new_seed(x.device))  # the op draws its seed from torch's generator, first thing
    plain.base_model.model.proj.lora_dropout["default"] = SeededDropout(0.3, seed)
    torch.manual_seed(99)
    fused_results = forward_backward(fused.train(), x, grad_out)
    assert_fp32_close(fused_results, forward_backward(plain.train(), x, grad_out))
    assert op_calls


def test_dropout_seed_decides_the_mask():
    fused, _ = peft_pair(48, 80, 8, lora_dropout=0.3)
    x = torch.randn(113, 48)
    outputs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        outputs.append(fused.train()(x))
    assert torch.equal(outputs[0], outputs[1])
    assert (outputs[0] - outputs[2]).abs().max() > 1e-3


def test_eval_applies_no_dropout(op_calls):
    fused, plain = peft_pair(48, 80, 8, lora_dropout=0.3)
    x, grad_out = random_io((113, 48), 80)
    assert_fp32_close(forward_backward(fused.eval(), x, grad_out), forward_backward(plain.eval(), x, grad_out))
    assert op_calls


def test_set_adapter_runs_the_chosen_adapter(op_calls):
    fused, plain = peft_pair(48, 80, 8)
    for model in (fused, plain):
        model.add_adapter("second", LoraConfig(r=4, lora_alpha=LORA_ALPHA, target_modules=["proj"]))
    randomize_lora_B(plain.base_model.model.proj)
    fused.load_state_dict(plain.state_dict())
    x, grad_out = random_io((7, 48), 80)
    for adapter in ("second", "default"):
        fused.set_adapter(adapter)
        plain.set_adapter(adapter)
        assert_fp32_close(forward_backward(fused, x, grad_out), forward_backward(plain, x, grad_out))
    assert len(op_calls) == 2


def check_fallback(fused, plain, reason, fallback_log, op_calls):
    """Fused and PEFT agree, the op never ran, and the reason was logged."""
    x, grad_out = random_io((7, 48), 80)
    assert_fp32_close(forward_backward(fused, x, grad_out), forward_backward(plain, x, grad_out))
    assert not op_calls
    assert any(reason in record.getMessage() and "PEFT's forward" in record.getMessage()
               for record in fallback_log.records), fallback_log.text


def test_dora_falls_back_to_peft(fallback_log, op_calls):
    fused, plain = peft_pair(48, 80, 8, use_dora=True)
    # B was randomised after DoRA stored |W|, so DoRA's output differs from plain LoRA's.
    nn.init.uniform_(plain.base_model.model.proj.lora_magnitude_vector["default"].weight, 0.5, 1.5)
    fused.load_state_dict(plain.state_dict())
    check_fallback(fused, plain, "Dora adapters", fallback_log, op_calls)


def test_disabled_adapter_falls_back_to_peft(fallback_log, op_calls):
    fused, plain = peft_pair(48, 80, 8)
    with fused.disable_adapter(), plain.disable_adapter():
        check_fallback(fused, plain, "adapters disabled", fallback_log, op_calls)
        x = torch.randn(7, 48)
        assert torch.equal(fused(x), plain.base_model.model.proj.base_layer(x))


def test_merged_adapter_falls_back_to_peft(fallback_log, op_calls):
    fused, plain = peft_pair(48, 80, 8)
    x = torch.randn(7, 48)
    unmerged = fused(x)
    op_calls.clear()
    fused.merge_adapter()
    plain.merge_adapter()
    check_fallback(fused, plain, "merged adapters", fallback_log, op_calls)
    assert relative_error(fused(x), unmerged) < 1e-5


def test_lora_bias_with_float32_adapters_falls_back(fallback_log, op_calls):
    fused, plain = peft_pair(48, 80, 8, "trainable", torch.bfloat16, autocast_adapter_dtype=True)
    x = torch.randn(7, 48, dtype=torch.bfloat16)
    assert torch.equal(fused(x), plain(x))
    assert not op_calls
    assert "lora_bias in torch.float32 on torch.bfloat16 inputs" in fallback_log.text


HOOKS = {  # where a hook sits -> how to put one there that records its calls
    "base forward": lambda layer, calls: layer.base_layer.register_forward_hook(lambda *_: calls.append(1)),
    "base full backward": lambda layer, calls: layer.base_layer.register_full_backward_hook(
        lambda *_: calls.append(1)),
    "lora_A forward": lambda layer, calls: layer.lora_A["default"].register_forward_hook(lambda *_: calls.append(1)),
    "lora_B pre-forward": lambda layer, calls: layer.lora_B["default"].register_forward_pre_hook(
        lambda *_: calls.append(1)),
    "lora_dropout forward": lambda layer, calls: layer.lora_dropout["default"].register_forward_hook(
        lambda *_: calls.append(1)),
    "global forward": lambda layer, calls: nn.modules.module.register_module_forward_hook(lambda *_: calls.append(1)),
}


@pytest.mark.parametrize("where", HOOKS)
def test_hooks_that_peft_would_fire_fall_back_and_fire(where, fallback_log, op_calls):
    # Activation probes, gradient hooks and global hooks (module trackers) fire in PEFT's forward, which calls these
    # modules; the fused op only reads their weights, so a hooked layer runs PEFT's forward.
    fused, plain = peft_pair(48, 80, 8)
    calls = []
    handle = HOOKS[where](fused.base_model.model.proj, calls)
    try:
        check_fallback(fused, plain, "hooks on the base layer", fallback_log, op_calls)
    finally:
        handle.remove()
    assert calls
    x, grad_out = random_io((7, 48), 80)
    forward_backward(fused, x, grad_out)  # without the hook: fused again
    assert op_calls


def test_fuse_again_fuses_the_layers_of_an_adapter_added_later(tmp_path, op_calls):
    # load_adapter/add_adapter wrap modules that had no LoRA layer in PEFT's own class; fusing again reaches them
    base = tiny_llama()
    second = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, target_modules=["q_proj", "o_proj"]))
    for layer in second.modules():
        if isinstance(layer, lora.Linear):
            randomize_lora_B(layer)
    second.save_pretrained(tmp_path)
    model = lorafuse.get_peft_model(base, LoraConfig(r=8, target_modules=["q_proj"]))
    model.load_adapter(tmp_path, adapter_name="second")
    added = model.base_model.model.model.layers[0].self_attn.o_proj
    assert type(added) is lora.Linear
    assert lorafuse.fuse(model) is model
    assert type(added) is FusedLoraLinear
    model.set_adapter("second")
    ids = torch.randint(0, LLAMA["vocab_size"], (2, 9))
    op_calls.clear()
    logits = model(input_ids=ids).logits
    assert len(op_calls) == 2 * len(model.base_model.model.model.layers)  # q_proj and o_proj of every layer
    reference = PeftModel.from_pretrained(copy.deepcopy(tiny_llama()), tmp_path)
    assert relative_error(logits, reference(input_ids=ids).logits) < 1e-5


def test_unfuse_restores_peft_classes():
    fused, plain = peft_pair(48, 80, 8)
    assert type(fused.base_model.model.proj) is FusedLoraLinear
    assert lorafuse.unfuse(fused) is fused
    assert type(fused.base_model.model.proj) is lora.Linear
    x = torch.randn(7, 48)
    assert torch.equal(fused(x), plain(x))


def test_fused_layers_report_peft_type_names():
    # PEFT's repr, get_layer_status and get_model_status of a fused model equal the unfused model's; isinstance holds
    plain = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    fused = lorafuse.fuse(copy.deepcopy(plain))
    layer = fused.base_model.model.model.layers[0].self_attn.q_proj
    assert type(layer) is FusedLoraLinear and isinstance(layer, lora.Linear)
    assert repr(layer).startswith("lora.Linear(") and repr(fused) == repr(plain)
    assert {status.module_type for status in fused.get_layer_status()} == {"lora.Linear"}
    assert fused.get_layer_status() == plain.get_layer_status()
    assert fused.get_model_status() == plain.get_model_status()


def test_fuse_without_lora_layers_says_what_to_do():
    with pytest.raises(ValueError, match="OneLinear has no peft LoRA Linear layers; wrap it first"):
        lorafuse.fuse(OneLinear(4, 4, True))


# A tiny Llama: random weights from a config, widths that are not powers of two where allowed.
LLAMA = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(1)  # the same base weights every call: save/load tests rebuild it
    return LlamaForCausalLM(LlamaConfig(**LLAMA))


def llama_pair():
    """A fused PeftModel of the tiny Llama and its unfused copy; LoRA with random A and B."""
    config = LoraConfig(r=8, lora_alpha=LORA_ALPHA, target_modules=TARGETS, lora_dropout=0.0,
                        init_lora_weights=False)
    plain = get_peft_model(tiny_llama(), config)
    return lorafuse.fuse(copy.deepcopy(plain)), plain


def lora_grads(model) -> dict:
    return {name: p.grad for name, p in model.named_parameters() if "lora_" in name}


def test_llama_logits_and_lora_grads_match_peft(op_calls):
    fused, plain = llama_pair()
    assert sum(type(m) is FusedLoraLinear for m in fused.modules()) == 2 * len(TARGETS)
    ids = torch.randint(0, LLAMA["vocab_size"], (2, 13))
    results = []
    for model in (fused, plain):
        out = model(input_ids=ids, labels=ids)  # training: the fused model returns no logits (loss_kernels)
        out.loss.backward()
        with torch.no_grad():
            logits = model.eval()(input_ids=ids).logits
        results.append({"loss": out.loss.detach(), "logits": logits, **lora_grads(model)})
    assert len(results[1]) == 2 + 2 * 2 * len(TARGETS)
    assert_fp32_close(*results)
    assert len(op_calls) == 2 * 2 * len(TARGETS)  # the training forward and the eval one


def test_llama_saved_fused_loads_in_plain_peft(tmp_path):
    fused, _ = llama_pair()
    ids = torch.randint(0, LLAMA["vocab_size"], (2, 13))
    fused.eval().save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path).eval()
    assert not any(type(m) is FusedLoraLinear for m in loaded.modules())
    with torch.no_grad():
        assert relative_error(loaded(input_ids=ids).logits, fused(input_ids=ids).logits) < 1e-5


def test_llama_merge_and_unload_matches_fused():
    fused, _ = llama_pair()
    ids = torch.randint(0, LLAMA["vocab_size"], (2, 13))
    with torch.no_grad():
        unmerged = fused.eval()(input_ids=ids).logits
        merged = fused.merge_and_unload()
        assert not any(isinstance(m, lora.LoraLayer) for m in merged.modules())
        assert relative_error(merged(input_ids=ids).logits, unmerged) < 1e-5
