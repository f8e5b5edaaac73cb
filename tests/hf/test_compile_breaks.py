"""torch.compile of whole lorafuse models: a training forward has no graph break (torch._dynamo.explain counts them,
the assertion lists where), and the compiled loss and gradients equal eager ones."""
import os

import pytest
import torch

import lorafuse
import lorafuse.hf  # noqa: F401  (registers attn_implementation="lorafuse")
from lorafuse.hf.model_kernels import use_model_kernels
from tests.hf.families import batch, lora_config, tiny_model

LORAFUSE_OPS = {"lorafuse.flash_attention.default", "lorafuse.rms_norm.default", "lorafuse.silu_mul.default"}


def training_inputs(family: str, padded: bool) -> dict:
    inputs = batch(family)
    if padded:  # left padding in the first row
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        inputs["attention_mask"][0, :3] = 0
    return inputs


def explained(model, inputs: dict):
    torch._dynamo.reset()
    return torch._dynamo.explain(model.train())(**inputs)


def breaks_message(explanation) -> str:
    lines = [f"{explanation.graph_break_count} graph breaks, {explanation.graph_count} graphs"]
    for reason in explanation.break_reasons:
        where = " <- ".join(f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.name}"
                            for frame in reversed(reason.user_stack[-3:]))
        lines.append(f"- {reason.reason.splitlines()[0]} at {where}")
    if not explanation.break_reasons:
        lines.append("(explain kept no reasons: run with TORCH_LOGS=graph_breaks)")
    return "\n".join(lines)


@pytest.mark.parametrize("padded", [False, True], ids=["full_rows", "left_padding"])
@pytest.mark.parametrize("family", ["llama", "mistral"])  # mistral: a sliding window shorter than the batch
def test_peft_model_training_forward_has_no_graph_break(family, padded):
    model = lorafuse.get_peft_model(tiny_model(family), lora_config(family, r=8))
    explanation = explained(model, training_inputs(family, padded))
    assert explanation.graph_break_count == 0, breaks_message(explanation)


@pytest.mark.parametrize("padded", [False, True], ids=["full_rows", "left_padding"])
@pytest.mark.parametrize("family", ["llama", "mistral"])  # Llama's attention takes the rope kernel, Mistral's not
def test_attention_and_model_kernels_trace_into_one_graph(family, padded):
    # Without LoRA layers: lorafuse's attention, RMSNorm, SwiGLU and RoPE alone, their custom ops in the graph
    model = tiny_model(family)
    model.set_attn_implementation("lorafuse")
    use_model_kernels(model)
    explanation = explained(model, training_inputs(family, padded))
    assert explanation.graph_break_count == 0, breaks_message(explanation)
    traced = {str(op) for graph_ops in explanation.ops_per_graph for op in graph_ops}
    assert LORAFUSE_OPS | ({"lorafuse.rope.default"} if family == "llama" else set()) <= traced, sorted(traced)


def test_compiled_loss_and_gradients_equal_eager():
    model = lorafuse.get_peft_model(tiny_model("llama"), lora_config("llama", r=8, lora_dropout=0.0),
                                    attention=True, model_kernels=True).train()
    inputs = training_inputs("llama", padded=True)

    def loss_and_grads(forward):
        model.zero_grad(set_to_none=True)
        loss = forward(**inputs).loss
        loss.backward()
        return [loss.detach()] + [p.grad for p in model.parameters() if p.requires_grad]

    eager = loss_and_grads(model)
    torch._dynamo.reset()
    compiled = loss_and_grads(torch.compile(model, backend="aot_eager"))
    assert len(compiled) == len(eager) > 1
    for i, (got, want) in enumerate(zip(compiled, eager)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"loss and gradients, entry {i}")
