"""The fused layer inside torch.compile'd models: same outputs and gradients as eager."""
import pytest
import torch
from torch import nn

import lorafuse


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
    compiled = run(torch.compile(model, backend=backend))
    for name, got, want in zip(["out", "dx", "dA", "dB"], compiled, eager):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
    # The dropout really ran: another seed gives another output.
    torch.manual_seed(2)
    assert not torch.equal(model(x), eager[0])
