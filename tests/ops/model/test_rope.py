"""rope (one kernel forward, one backward, for q and k together) against float64 and against transformers'
apply_rotary_pos_emb: outputs and both gradients, grouped-query heads, q and k laid out as attention layers make them
or contiguous, cos and sin per batch row or shared; the outputs' layout; fallbacks; double backward and torch.func."""
import pytest
import torch
from torch.func import grad, vmap
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from lorafuse.ops.model import rope as rope_module
from lorafuse.ops.model.rope import rope, rope_backward_reference, rope_reference
from tests.ops._helpers import DTYPES, assert_all_close, assert_close, cast, dtype_id

# (B, Hq, Hk, T, D): one position, a prime number of them, heads of 64, 128 and of widths that are not powers of two
SHAPES = [(1, 4, 2, 1, 64), (3, 4, 1, 7, 128), (1, 2, 2, 113, 80), (3, 6, 2, 7, 96)]


def shape_id(shape) -> str:
    return "B{}_Hq{}_Hk{}_T{}_D{}".format(*shape)


def heads(batch, n_heads, n, d, layout: str) -> torch.Tensor:
    # [B, H, T, D]: "transposed" as q_proj(x).view(B, T, H, D).transpose(1, 2) lays it out, or contiguous
    if layout == "transposed":
        return torch.randn(batch, n, n_heads, d).transpose(1, 2)
    return torch.randn(batch, n_heads, n, d)


def random_angles(batch, n, d):
    # cos, sin: [B, T, D] of angles drawn per element: the two halves differ, unlike RoPE's, so that the backward's
    # mixing of them shows
    angles = 4 * torch.randn(batch, n, d)
    return angles.cos(), angles.sin()


def forward_backward(fn, inputs: dict, grads_out: tuple) -> dict:
    """{'q_out', 'k_out': fn's outputs, 'q', 'k': the gradients of (q_out . dq_out + k_out . dk_out)} on detached
    copies of the inputs; cos and sin need no gradient."""
    leaves = {name: t.detach().clone().requires_grad_(name in ("q", "k")) for name, t in inputs.items()}
    q_out, k_out = fn(**leaves)
    dq, dk = torch.autograd.grad((q_out, k_out), (leaves["q"], leaves["k"]),
                                 tuple(g.to(q_out.dtype) for g in grads_out))
    return {"q_out": q_out.detach(), "k_out": k_out.detach(), "q": dq, "k": dk}


@pytest.fixture
def launches(monkeypatch) -> list:
    """The kernel's launches, each as its `backward` flag: which path ran."""
    real, calls = rope_module._launch, []

    def counted(*args, backward):
        calls.append(backward)
        return real(*args, backward=backward)

    monkeypatch.setattr(rope_module, "_launch", counted)
    return calls


@pytest.mark.parametrize("layout", ["transposed", "contiguous"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_outputs_and_gradients_match_reference(shape, dtype, layout, launches):
    batch, n_q_heads, n_k_heads, n, d = shape
    q, k = heads(batch, n_q_heads, n, d, layout), heads(batch, n_k_heads, n, d, layout)
    cos, sin = random_angles(batch, n, d)
    inputs = cast({"q": q, "k": k, "cos": cos, "sin": sin}, dtype)  # float64 takes the same rounded inputs
    grads_out = (heads(batch, n_q_heads, n, d, layout).to(dtype), heads(batch, n_k_heads, n, d, layout).to(dtype))

    got = forward_backward(rope, inputs, grads_out)
    assert launches == [False, True]
    assert all(t.dtype == dtype for t in got.values())
    assert got["q_out"].shape == q.shape and got["k_out"].shape == k.shape
    assert_all_close(got, forward_backward(rope_reference, cast(inputs, torch.float64), grads_out), dtype,
                     forward_backward(rope_reference, inputs, grads_out))


def test_backward_reference_is_the_forward_references_gradient():
    # the derivation the backward kernel follows, in float64 on angles whose halves differ
    q, k = torch.randn(2, 3, 5, 12, dtype=torch.float64), torch.randn(2, 1, 5, 12, dtype=torch.float64)
    cos, sin = (t.double() for t in random_angles(2, 5, 12))
    dq_out, dk_out = torch.randn_like(q), torch.randn_like(k)
    leaves = q.requires_grad_(), k.requires_grad_()
    want = torch.autograd.grad(rope_reference(*leaves, cos, sin), leaves, (dq_out, dk_out))
    for got, exact in zip(rope_backward_reference(dq_out, dk_out, cos, sin), want):
        torch.testing.assert_close(got, exact, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_matches_transformers_with_llamas_rotary_embedding(dtype):
    # cos, sin as LlamaModel makes them (one row for the batch: [1, T, D], in the model's dtype), q and k from
    # projections: what transformers' apply_rotary_pos_emb computes, within the tolerance rules
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    q, k = heads(3, 4, 9, 64, "transposed").to(dtype), heads(3, 2, 9, 64, "transposed").to(dtype)
    cos, sin = LlamaRotaryEmbedding(config)(q, torch.arange(9)[None])
    assert cos.shape == (1, 9, 64) and cos.dtype == dtype
    with torch.no_grad():
        got = rope(q, k, cos, sin)
        plain = apply_rotary_pos_emb(q, k, cos, sin)
        exact = apply_rotary_pos_emb(q.double(), k.double(), cos.double(), sin.double())
    for name, g, e, p in zip(("q_out", "k_out"), got, exact, plain):
        assert g.dtype == dtype
        assert_close(g, e, dtype, p, name)


def test_outputs_and_gradients_are_laid_out_as_projections():
    # [B, T, H, D] in memory: attention reads them in place, and dq, dk flow into q_proj's and k_proj's outputs
    # without a copy
    q = torch.randn(2, 4, 3, 16, requires_grad=True)  # contiguous [B, H, T, D]
    k = torch.randn(2, 3, 2, 16).transpose(1, 2).requires_grad_()
    q_out, k_out = rope(q, k, *random_angles(2, 3, 16))
    dq, dk = torch.autograd.grad((q_out, k_out), (q, k), (torch.randn(2, 4, 3, 16), torch.randn(2, 2, 3, 16)))
    for t in (q_out, k_out, dq, dk):
        assert t.transpose(1, 2).is_contiguous()


def test_bf16_heads_with_fp32_cos_sin_promote_as_transformers():
    # q * cos with float32 cos: float32 outputs; the gradients come back in q's and k's dtype
    q, k = heads(2, 4, 7, 32, "transposed").bfloat16(), heads(2, 2, 7, 32, "transposed").bfloat16()
    cos, sin = random_angles(2, 7, 32)
    inputs = {"q": q, "k": k, "cos": cos, "sin": sin}
    grads_out = (torch.randn(2, 4, 7, 32), torch.randn(2, 2, 7, 32))
    got = forward_backward(rope, inputs, grads_out)
    plain = forward_backward(rope_reference, inputs, grads_out)  # float32 products of the bf16 heads
    assert {name: t.dtype for name, t in got.items()} == {name: t.dtype for name, t in plain.items()}
    assert got["q_out"].dtype == torch.float32 and got["q"].dtype == torch.bfloat16
    assert_all_close(got, forward_backward(rope_reference, cast(inputs, torch.float64), grads_out), torch.bfloat16,
                     plain)


@pytest.mark.parametrize("case", ["odd_head_dim", "float64", "cos_for_one_position", "cos_needs_grad"])
def test_unsupported_inputs_run_the_reference_and_say_why(case, fallback_log, monkeypatch):
    monkeypatch.setattr(rope_module, "_launch", lambda *args, **kwargs: pytest.fail("the kernel ran"))
    d = 15 if case == "odd_head_dim" else 16
    q, k = torch.randn(2, 4, 5, d), torch.randn(2, 2, 5, d)
    cos, sin = random_angles(2, 5, d)
    if case == "float64":
        q, k, cos, sin = q.double(), k.double(), cos.double(), sin.double()
    elif case == "cos_for_one_position":  # [B, 1, D]: broadcast over the positions, which the kernels do not
        cos, sin = cos[:, :1], sin[:, :1]
    leaves = {"q": q.requires_grad_(), "k": k.requires_grad_(),
              "cos": cos.requires_grad_(case == "cos_needs_grad"), "sin": sin}
    q_out, k_out = rope(**leaves)
    for got, want in zip((q_out, k_out), rope_reference(**leaves)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    (q_out.sum() + k_out.sum()).backward()
    assert leaves["q"].grad is not None and (case != "cos_needs_grad" or leaves["cos"].grad is not None)
    said = [record.getMessage() for record in fallback_log.records]
    assert len(said) == 1 and said[0].startswith("lorafuse.rope: "), said


def test_double_backward_equals_reference():
    # a gradient penalty differentiates the backward: the reference's linear backward, given dq_out and dk_out
    q, k = torch.randn(2, 4, 5, 16, requires_grad=True), torch.randn(2, 2, 5, 16, requires_grad=True)
    cos, sin = random_angles(2, 5, 16)

    def penalty(fn):
        q_out, k_out = fn(q, k, cos, sin)
        firsts = torch.autograd.grad(q_out.pow(3).sum() + k_out.pow(3).sum(), (q, k), create_graph=True)
        return torch.autograd.grad(sum(g.pow(2).sum() for g in firsts), (q, k))

    for got, want in zip(penalty(rope), penalty(rope_reference)):
        assert_close(got, want.double(), torch.float32)


def test_per_sample_gradients_through_torch_func(fallback_log):
    q, k = torch.randn(3, 4, 5, 16), torch.randn(3, 2, 5, 16)
    cos, sin = random_angles(1, 5, 16)

    def per_sample(fn):
        return vmap(grad(lambda a, b: sum(t.pow(2).sum() for t in fn(a[None], b[None], cos, sin))))(q, k)

    assert_close(per_sample(rope), per_sample(rope_reference).double(), torch.float32)
    assert "torch.func transform" in fallback_log.text
