"""lorafuse.nn.LoraLinear against PEFT's LoRA Linear: init, state dict, outputs, gradients, dropout."""
import copy
import math
import subprocess
import sys

import pytest
import torch
from peft import LoraConfig
from peft.tuners import lora
from torch import nn

from lorafuse.nn import LoraLinear
from tests.lora_check import (BIASES, DTYPES, LORA_ALPHA, RANKS, SHAPES, SeededDropout, assert_fp32_close,
                              check_against_peft, forward_backward, peft_lora_linear, random_io, shape_id)


def pair(x_shape, n, r, bias="frozen", lora_dropout=0.0):
    """PEFT's layer and a LoraLinear with the same weights and trainability: x [..., K] -> [..., N]."""
    peft_layer = peft_lora_linear(x_shape[-1], n, r, bias, lora_dropout)
    base = copy.deepcopy(peft_layer.base_layer)
    ours = LoraLinear(base, r, LORA_ALPHA, lora_dropout, lora_bias=bias == "trainable")
    ours.load_state_dict(peft_layer.state_dict())  # strict: the keys must be PEFT's
    if base.bias is not None:
        base.bias.requires_grad_(bias == "trainable")
    return ours, peft_layer


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("r", RANKS)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_matches_peft(shape, r, dtype):
    x_shape, n = shape
    check_against_peft(*pair(x_shape, n, r), x_shape, n, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", BIASES)
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[2]], ids=shape_id)
def test_bias_modes_match_peft(shape, bias, dtype):
    x_shape, n = shape
    check_against_peft(*pair(x_shape, n, 8, bias), x_shape, n, dtype)


@pytest.mark.parametrize("use_rslora", [False, True])
def test_init_scaling_and_keys_match_peft(use_rslora):
    # Same RNG stream and construction order: PEFT's init and ours give identical tensors.
    base = nn.Linear(100, 36)
    config = LoraConfig(r=8, lora_alpha=LORA_ALPHA, use_rslora=use_rslora)
    torch.manual_seed(1)
    peft_layer = lora.Linear(copy.deepcopy(base), "default", config=config, r=8, lora_alpha=LORA_ALPHA)
    torch.manual_seed(1)
    ours = LoraLinear(copy.deepcopy(base), 8, LORA_ALPHA, use_rslora=use_rslora)
    assert ours.scaling == peft_layer.scaling
    assert ours.scaling["default"] == pytest.approx(LORA_ALPHA / (math.sqrt(8) if use_rslora else 8))
    assert ours.state_dict().keys() == peft_layer.state_dict().keys()
    for key, value in peft_layer.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key
    assert not ours.lora_B["default"].weight.any()
    trainable = [name for name, p in ours.named_parameters() if p.requires_grad]
    assert trainable == ["lora_A.default.weight", "lora_B.default.weight"]


@pytest.mark.parametrize("shape", [SHAPES[2], SHAPES[4]], ids=shape_id)
def test_dropout_matches_peft_with_our_mask(shape):
    x_shape, n = shape
    ours, peft_layer = pair(x_shape, n, 8, lora_dropout=0.3)
    peft_layer.lora_dropout["default"] = SeededDropout(0.3, seed=1234)
    x, grad_out = random_io(x_shape, n)
    assert_fp32_close(forward_backward(ours, x, grad_out, seed=torch.tensor([1234])),
                      forward_backward(peft_layer, x, grad_out))


def test_dropout_seed_decides_the_mask():
    ours, _ = pair((113, 48), 80, 8, lora_dropout=0.3)
    x = torch.randn(113, 48)
    first, again = ours(x, seed=torch.tensor([7])), ours(x, seed=torch.tensor([7]))
    other = ours(x, seed=torch.tensor([8]))
    assert torch.equal(first, again)
    assert (first - other).abs().max() > 1e-3


def test_eval_applies_no_dropout():
    ours, peft_layer = pair((113, 48), 80, 8, lora_dropout=0.3)
    x, grad_out = random_io((113, 48), 80)
    no_dropout, _ = pair((113, 48), 80, 8)
    no_dropout.load_state_dict(ours.state_dict())
    evaluated = forward_backward(ours.eval(), x, grad_out, seed=torch.tensor([7]))
    assert_fp32_close(evaluated, forward_backward(peft_layer.eval(), x, grad_out))
    assert torch.equal(evaluated["out"], no_dropout(x))


def test_errors_name_the_bad_value():
    with pytest.raises(TypeError, match="base_layer must be an nn.Linear, got Conv1d"):
        LoraLinear(nn.Conv1d(4, 4, 1), 8)
    with pytest.raises(ValueError, match="r=0"):
        LoraLinear(nn.Linear(4, 4), 0)
    with pytest.raises(ValueError, match="lora_dropout=1.0"):
        LoraLinear(nn.Linear(4, 4), 2, lora_dropout=1.0)
    with pytest.raises(TypeError, match="x is torch.float64 but the layer's weights are torch.float32"):
        LoraLinear(nn.Linear(4, 4), 2)(torch.randn(3, 4, dtype=torch.float64))


def test_nn_and_ops_import_without_transformers_or_peft():
    code = ("import sys, lorafuse, lorafuse.nn, lorafuse.ops; "
            "loaded = {'transformers', 'peft'} & set(sys.modules); assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], check=True)
