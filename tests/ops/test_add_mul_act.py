"""add_mul_act: act(base + scale * other + bias) and its gradients, against add_mul_act_reference."""
import pytest
import torch

from lorafuse.ops.activation import ACTIVATIONS
from lorafuse.ops.add_mul_act import add_mul_act, add_mul_act_reference
from tests.ops._helpers import (DTYPES, assert_all_close, assert_close, cast, dtype_id, forward_backward, poison,
                                rel_err)

# Leading shapes of any rank; widths that are not powers of two (300 spans two column blocks);
# 1023 rows (64 row blocks) with a narrow width.
SHAPES = [(1, 37), (7, 300), (3, 5, 37), (1023, 24)]
SCALE = 0.7
ALLOWED = "identity, relu, gelu, gelu_tanh, silu, sigmoid"


def shape_id(shape):
    return "x".join(map(str, shape))


def random_inputs(shape, bias=True):
    n = shape[-1]
    return {"base": torch.randn(shape), "other": torch.randn(shape), "bias": torch.randn(n) if bias else None}


def reference64(inputs, activation):
    inputs = cast(inputs, torch.float64)
    return add_mul_act_reference(inputs["base"].detach(), inputs["other"].detach(), SCALE, inputs["bias"].detach(),
                                 activation)


def check(shape, activation, dtype, bias=True, scale=SCALE):
    """Kernel vs float64 reference (outputs, grads of base, other, bias); in half precision
    also vs the reference computed in that dtype."""
    inputs = cast(random_inputs(shape, bias), dtype)
    grad_out = torch.randn(shape).to(dtype)
    need = ("base", "other", "bias")

    def kernel(base, other, bias):
        return add_mul_act(base, other, scale, bias, activation)

    def reference(base, other, bias):
        return add_mul_act_reference(base, other, scale, bias, activation)

    got = forward_backward(kernel, inputs, grad_out, need)
    exact = forward_backward(reference, cast(inputs, torch.float64), grad_out.double(), need)
    plain = forward_backward(reference, inputs, grad_out, need) if dtype != torch.float32 else None
    for name, value in got.items():
        assert value.dtype == dtype, f"{name}: {value.dtype}"
    assert_all_close(got, exact, dtype, plain)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_matches_reference(shape, activation, dtype):
    check(shape, activation, dtype)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_without_bias(activation):
    check((3, 5, 37), activation, torch.float32, bias=False, scale=-1.5)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_in_place_identity_under_autograd(dtype):
    # base is an intermediate (as x @ W^T is), so it can be overwritten; its grad flows to its leaf.
    shape = (3, 5, 37)
    leaf = torch.randn(shape).to(dtype).requires_grad_()
    other = torch.randn(shape).to(dtype).requires_grad_()
    bias = torch.randn(37).to(dtype).requires_grad_()
    grad_out = torch.randn(shape).to(dtype)
    base = leaf * 1.0
    y = add_mul_act(base, other, SCALE, bias, out=base)
    assert y is base
    y.backward(grad_out)
    got = {"out": y.detach(), "leaf": leaf.grad, "other": other.grad, "bias": bias.grad}

    def reference(leaf, other, bias):
        return add_mul_act_reference(leaf * 1.0, other, SCALE, bias)

    inputs = {"leaf": leaf, "other": other, "bias": bias}
    exact = forward_backward(reference, cast(inputs, torch.float64), grad_out.double(), inputs)
    plain = forward_backward(reference, inputs, grad_out, inputs) if dtype != torch.float32 else None
    assert_all_close(got, exact, dtype, plain)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_in_place_under_no_grad(activation):
    # Trainable inputs, but no graph: every activation may then write in place.
    inputs = random_inputs((7, 300))
    base = inputs["base"].clone()
    other, bias = inputs["other"].requires_grad_(), inputs["bias"].requires_grad_()
    with torch.no_grad():
        y = add_mul_act(base, other, SCALE, bias, activation, out=base)
    assert y is base
    exact = reference64(inputs, activation)
    assert_close(base, exact, torch.float32)


@pytest.mark.parametrize("trainable", ["base", "other", "bias"])
@pytest.mark.parametrize("activation", [a for a in ACTIVATIONS if a != "identity"])
def test_in_place_activation_under_autograd_raises(activation, trainable):
    # The backward of these activations needs the pre-activation, which out=base overwrites:
    # with any input needing a gradient the call must refuse (not return wrong gradients).
    inputs = random_inputs((7, 37))
    inputs[trainable].requires_grad_()
    base = inputs["base"] * 1.0 if trainable == "base" else inputs["base"]
    with pytest.raises(ValueError, match="in place"):
        add_mul_act(base, inputs["other"], SCALE, inputs["bias"], activation, out=base)


@pytest.mark.parametrize("activation", ["identity", "gelu"])
def test_out_buffer(activation):
    # out= another tensor: every element written (NaN-poisoned first), base untouched.
    inputs = random_inputs((113, 37))
    base_before = inputs["base"].clone()
    out = poison(torch.empty(113, 37))
    y = add_mul_act(inputs["base"], inputs["other"], SCALE, inputs["bias"], activation, out=out)
    assert y is out
    assert torch.equal(inputs["base"], base_before)
    assert_close(out, reference64(inputs, activation), torch.float32)


@pytest.mark.parametrize("activation", ["identity", "silu"])
def test_non_contiguous_inputs(activation):
    # base a transposed (column-major) view, other a column slice: same results and grads.
    inputs = random_inputs((7, 37))
    grad_out = torch.randn(7, 37)
    need = ("base", "other", "bias")

    def strided(fn):
        def run(base, other, bias):
            base_t = base.t().contiguous().t()  # same values, column-major
            other_s = torch.cat([other, other], 1)[:, :37]  # same values, row stride 74
            assert not base_t.is_contiguous() and not other_s.is_contiguous()
            return fn(base_t, other_s, SCALE, bias, activation)
        return run

    got = forward_backward(strided(add_mul_act), inputs, grad_out, need)
    exact = forward_backward(strided(add_mul_act_reference), cast(inputs, torch.float64), grad_out.double(), need)
    assert_all_close(got, exact, torch.float32)


@pytest.mark.parametrize("activation", ["identity", "gelu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
def test_float32_bias_with_half_inputs(dtype, activation):
    # Mixed precision: activations in half, the trainable bias kept in float32. The bias
    # gradient must come back in float32 and be as accurate as PyTorch's.
    inputs = cast(random_inputs((113, 37)), dtype, keep=("bias",))
    grad_out = torch.randn(113, 37).to(dtype)
    need = ("base", "other", "bias")

    def kernel(base, other, bias):
        return add_mul_act(base, other, SCALE, bias, activation)

    def reference(base, other, bias):
        return add_mul_act_reference(base, other, SCALE, bias, activation)

    got = forward_backward(kernel, inputs, grad_out, need)
    assert got["out"].dtype == dtype and got["bias"].dtype == torch.float32
    exact = forward_backward(reference, cast(inputs, torch.float64), grad_out.double(), need)
    plain = forward_backward(reference, inputs, grad_out, need)
    assert_all_close(got, exact, dtype, plain)


def test_scale_is_applied_to_other_only():
    # A sign or factor slip that a symmetric case would hide: base and other differ in scale.
    base, other = torch.randn(7, 37) * 3, torch.randn(7, 37)
    y = add_mul_act(base, other, -2.5)
    assert rel_err(y, base.double() - 2.5 * other.double()) < 1e-6


def test_bad_arguments_raise():
    base = torch.randn(7, 37)
    with pytest.raises(ValueError, match=f"activation='tanh'.*{ALLOWED}"):
        add_mul_act(base, base, activation="tanh")
    with pytest.raises(ValueError, match="one shape"):
        add_mul_act(base, torch.randn(7, 36))
