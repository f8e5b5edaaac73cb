"""The fused layer inside torch.compile'd models: same outputs and gradients as eager."""
import pytest
import torch
from torch import nn

import lorafuse
from tests.ops._helpers import rel_err


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_model_matches_eager(backend):
    layer = lorafuse.LoraLinear(nn.Linear(48, 80), r=8, lora_alpha=16, lora_dropout=0.1)
    nn.init.normal_(layer.lora_B["default"].weight)
    model = nn.Sequential(nn.LayerNorm(48), layer, nn.SiLU()).train()
    x = torch.randn(2, 7, 48, requires_grad=True)
    leaves = [x, layer.lora_A["default"].weight, layer.lora_B["default"].weight]

    def run(fn):
        torch.manual_seed(1)  # the op draws its dropout seed from torch's generator
        out = fn(x)
        return [out, *torch.autograd.grad((out * out).sum(), leaves)]

    eager = run(model)
    torch._dynamo.reset()
    # inductor draws random numbers (here the dropout seed) with its own generator unless told to use eager's
    with torch._inductor.config.patch(fallback_random=True):
        compiled = run(torch.compile(model, backend=backend))
    for name, got, want in zip(["out", "dx", "dA", "dB"], compiled, eager):
        # fp32: inductor fuses the LayerNorm and SiLU around the op in another order, so the bar is DESIGN's fp32 one
        assert rel_err(got, want) < 1e-5, f"{name}: relative error {rel_err(got, want):.2e}"
    # The dropout really ran: another seed gives another output.
    torch.manual_seed(2)
    assert not torch.equal(model(x), eager[0])


def test_lora_layer_traces_without_graph_breaks():
    layer = lorafuse.LoraLinear(nn.Linear(48, 80), r=8, lora_alpha=16, lora_dropout=0.1)
    model = nn.Sequential(nn.LayerNorm(48), layer, nn.SiLU()).train()
    explained = torch._dynamo.explain(model)(torch.randn(2, 7, 48, requires_grad=True))
    assert explained.graph_break_count == 0, [str(reason) for reason in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.parametrize("training, activation_id", [(True, 0), (True, 4), (False, 0)], ids=["train", "silu", "infer"])
def test_lora_custom_op_passes_opcheck(training, activation_id):
    # schema, fake (meta) shapes and strides, autograd registration of lorafuse::lora_linear; 113 rows, rank 5
    x = torch.randn(113, 48, requires_grad=training)
    weight, bias = torch.randn(80, 48), torch.randn(80)
    lora_A = torch.randn(5, 48, requires_grad=training)
    lora_B = torch.randn(80, 5, requires_grad=training)
    seed = torch.tensor([7], dtype=torch.int64)
    args = (x, weight, bias, lora_A, lora_B, 0.5, 0.1, seed, activation_id, "", training)
    torch.library.opcheck(torch.ops.lorafuse.lora_linear.default, args)
