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


@pytest.mark.parametrize("rows", [7, 40, 113])
@pytest.mark.parametrize("case", ["train", "silu", "infer", "bf16_fp32_adapters", "no_bias", "frozen_A",
                                  "transposed_weight_trained"])
def test_lora_custom_op_passes_opcheck(rows, case):
    # schema, fake (meta) shapes, dtypes and strides, autograd registration of lorafuse::lora_linear and its backward:
    # the decode, small-batch Triton and cuBLAS row counts, rank 5, adapters frozen or not, a weight given as a
    # transposed view (fan_in_fan_out) that is trained
    training, act = case != "infer", 4 if case == "silu" else 0
    dtype = torch.bfloat16 if case == "bf16_fp32_adapters" else torch.float32
    x = torch.randn(rows, 48, dtype=dtype, requires_grad=training)
    weight = torch.randn(48, 80, dtype=dtype).t()
    weight = weight if case == "transposed_weight_trained" else weight.contiguous()
    weight.requires_grad_(case == "transposed_weight_trained")
    bias = None if case == "no_bias" else torch.randn(80, dtype=dtype)
    lora_A = torch.randn(5, 48, requires_grad=training and case != "frozen_A")
    lora_B = torch.randn(80, 5, requires_grad=training)
    seed = torch.tensor([7], dtype=torch.int64)
    args = (x, weight, bias, lora_A, lora_B, 0.5, 0.1, seed, act, "", training)
    torch.library.opcheck(torch.ops.lorafuse.lora_linear.default, args)


@pytest.mark.parametrize("case", ["train", "silu_mixed_adapters", "infer", "frozen_A", "transposed_weight_trained"])
@pytest.mark.parametrize("rows", [7, 40, 113])
def test_lora_fakes_match_the_real_outputs(rows, case):
    # the fake kernels' shapes, dtypes and strides are what the real ops return, forward and backward (inductor plans
    # its buffers by them): lora_A float32 and lora_B bfloat16 with an activation decide z's dtype by lora_B
    from torch._subclasses.fake_tensor import FakeTensorMode
    training, act = case != "infer", 4 if case.startswith("silu") else 0
    x = torch.randn(rows, 48, dtype=torch.bfloat16)
    weight = torch.randn(48, 80).bfloat16()
    weight = weight.t() if case == "transposed_weight_trained" else weight.t().contiguous()
    lora_A = torch.randn(5, 48)
    lora_B = torch.randn(80, 5, dtype=torch.bfloat16 if case == "silu_mixed_adapters" else torch.float32)
    bias, seed = torch.randn(80).bfloat16(), torch.tensor([7], dtype=torch.int64)
    needs = [True, case == "transposed_weight_trained", False, case != "frozen_A", True]
    forward = (x, weight, bias, lora_A, lora_B, 0.5, 0.1, seed, act, "", training)

    def layouts(outputs):
        return [(tuple(t.shape), t.dtype, t.stride()) for t in outputs]

    real = torch.ops.lorafuse.lora_linear(*forward)
    backward = (torch.randn(rows, 80).bfloat16(), x, weight, bias, lora_A, lora_B, real[1], seed, real[2], 0.5, 0.1,
                act, "", needs)
    real_grads = torch.ops.lorafuse.lora_linear_backward(*backward) if training else []
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = torch.ops.lorafuse.lora_linear(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                                 for a in forward))
        fake_grads = torch.ops.lorafuse.lora_linear_backward(
            *(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in backward)) if training else []
    assert layouts(fake) == layouts(real)
    assert layouts(fake_grads) == layouts(real_grads)
