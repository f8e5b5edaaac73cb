"""lora_expand: y = act(base + scale * s @ B^T + bias) with the pre-activation z, and
lora_expand_backward: (g, ds, dB, dbias), against lora_expand_reference and its autograd."""
import importlib

import pytest
import torch

from lorafuse.ops.common.activation import ACTIVATIONS, activation_id, activation_reference
from lorafuse.ops.common.tiles import atomic_partial_sums
from lorafuse.ops.lora.expand import lora_expand, lora_expand_backward, lora_expand_reference
from tests.ops._helpers import DTYPES, assert_all_close, assert_close, cast, dtype_id, forward_backward, poison

SCALE = 1.7
lora_expand_module = importlib.import_module("lorafuse.ops.lora.expand")
# (M, N, r): rows 1, 7, 113, 1023 (narrow); N over one and several 128-column blocks (300),
# not powers of two; ranks 1, 8, 64.
CASES = [(1, 80, 8), (7, 36, 1), (113, 300, 64), (1023, 40, 8)]


def case_id(case):
    return "M{}_N{}_r{}".format(*case)


def random_inputs(m, n, r, dtype, bias=True):
    """base [M, N], s [M, r] fp32 (the shrink's output), B [N, r], bias [N]."""
    return {"base": torch.randn(m, n).to(dtype), "s": torch.randn(m, r), "B": (torch.randn(n, r) / r**0.5).to(dtype),
            "bias": torch.randn(n).to(dtype) if bias else None}


def plain_expand(base, s, B, bias, activation):
    """PyTorch in B's dtype, every operand in it (s rounded to it, as the kernel does). On float64
    inputs this is the exact result (lora_expand_reference runs the rank-r product in float32)."""
    z = SCALE * (s.to(B.dtype) @ B.t())
    if base is not None:
        z = z + base
    if bias is not None:
        z = z + bias
    return activation_reference(z, activation)


def reference(base, s, B, bias, activation):
    return lora_expand_reference(base, s, B, SCALE, bias, activation)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_forward_and_backward(case, activation, dtype):
    m, n, r = case
    inputs = random_inputs(m, n, r, dtype)
    act = activation_id(activation)

    # forward: y and, stored, z (z overwrites base: pass a copy)
    y, z = lora_expand(inputs["base"].clone(), inputs["s"], inputs["B"], SCALE, inputs["bias"], act, store_z=True)
    assert y.dtype == dtype and z.dtype == dtype
    exact64 = cast(inputs, torch.float64)
    plain = plain_expand(*inputs.values(), activation) if dtype != torch.float32 else None
    plain_z = plain_expand(*inputs.values(), "identity") if dtype != torch.float32 else None
    assert_close(y, plain_expand(*exact64.values(), activation), dtype, plain, "y")
    assert_close(z, plain_expand(*exact64.values(), "identity"), dtype, plain_z, "z")
    if dtype == torch.float32:
        assert_close(reference(*inputs.values(), activation), plain_expand(*exact64.values(), activation), dtype,
                     name="lora_expand_reference")

    # backward from the kernel's z: g = dL/dz (= dL/dbase), ds, dB, dbias
    dy = torch.randn(m, n).to(dtype)
    g, ds, dB, dbias = lora_expand_backward(dy, z if act != 0 else None, inputs["s"], inputs["B"], SCALE, act,
                                            need_dbias=True)
    if act == 0:
        assert g is dy
    assert (g.dtype, ds.dtype, dB.dtype, dbias.dtype) == (dtype, torch.float32, torch.float32, torch.float32)
    # The backward is a function of (dy, z, s, B): checked against that function at the kernel's z (z itself is
    # checked above). A z within rounding of 0 may come out of the forward with either sign, and relu' follows it.
    got = {"base": g, "s": ds, "B": dB, "bias": dbias}
    exact = grads_at(z.double(), dy, inputs["s"], inputs["B"], activation)
    plain_grads = None if dtype == torch.float32 else grads_at(z, dy, inputs["s"], inputs["B"], activation)
    assert_all_close(got, exact, dtype, plain_grads)


@pytest.mark.parametrize("store_z", [False, True])
@pytest.mark.parametrize("use_out", [False, True])
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("has_base", [False, True])
def test_forward_variants(has_base, has_bias, use_out, store_z):
    # With or without base (the cuBLAS path adds x W^T afterwards), bias, an out buffer
    # (NaN-poisoned: every element must be written) and the stored pre-activation.
    m, n, r = 113, 300, 8
    activation = "gelu"
    inputs = random_inputs(m, n, r, torch.float32, has_bias)
    if not has_base:
        inputs["base"] = None
    out = poison(torch.empty(m, n)) if use_out else None
    base = None if inputs["base"] is None else inputs["base"].clone()
    y, z = lora_expand(base, inputs["s"], inputs["B"], SCALE, inputs["bias"], activation_id(activation), out=out,
                       store_z=store_z)
    exact64 = cast(inputs, torch.float64)
    assert_close(y, plain_expand(*exact64.values(), activation), torch.float32, name="y")
    if use_out:
        assert y is out
    if store_z:
        assert_close(z, plain_expand(*exact64.values(), "identity"), torch.float32, name="z")
        assert z is not y
    else:
        assert z is None


@pytest.mark.parametrize("activation", ["identity", "silu"])
def test_backward_without_dbias(activation):
    m, n, r = 113, 80, 8
    inputs = random_inputs(m, n, r, torch.float32)
    act = activation_id(activation)
    _, z = lora_expand(inputs["base"].clone(), inputs["s"], inputs["B"], SCALE, inputs["bias"], act, store_z=True)
    dy = torch.randn(m, n)
    g, ds, dB, dbias = lora_expand_backward(dy, z, inputs["s"], inputs["B"], SCALE, act, need_dbias=False)
    assert dbias is None
    exact = forward_backward(lambda **t: plain_expand(**t, activation=activation), cast(inputs, torch.float64),
                             dy.double(), ("base", "s", "B"))
    exact.pop("out")
    assert_all_close({"base": g, "s": ds, "B": dB}, exact, torch.float32)


def grads_at(z, dy, s, B, activation):
    """The backward's exact function of its inputs: g = dy * act'(z), ds, dB, dbias (in z's dtype)."""
    z = z.clone().requires_grad_()
    (g,) = torch.autograd.grad(activation_reference(z, activation), z, dy.to(z.dtype))
    s, B = s.to(z.dtype), B.to(z.dtype)
    return {"base": g, "s": SCALE * g @ B, "B": SCALE * g.t() @ s, "bias": g.sum(0)}


@pytest.mark.parametrize("activation", ["identity", "gelu", "silu"])
def test_float32_adapter_with_half_base(activation):
    # PEFT's default: lora_B in float32, the layer (base, y, dy) in bfloat16. The bar is PyTorch
    # running the adapter path in float32 as PEFT does: forward, the sum cast to bfloat16;
    # backward (a function of dy, the kept z, s, B), act' and the rank-r products in float32.
    m, n, r = 113, 80, 8
    dtype = torch.bfloat16
    inputs = random_inputs(m, n, r, dtype)
    inputs["B"] = torch.randn(n, r) / r**0.5  # full float32 values
    act = activation_id(activation)
    y, z = lora_expand(inputs["base"].clone(), inputs["s"], inputs["B"], SCALE, inputs["bias"], act, store_z=True)
    assert y.dtype == dtype
    exact64 = cast(inputs, torch.float64)
    assert_close(y, plain_expand(*exact64.values(), activation), dtype,
                 reference(*inputs.values(), activation).to(dtype), "y")
    # z, kept for act' in backward, is as accurate as PEFT's (float32: bf16 base + float32 adapter term)
    assert_close(z, plain_expand(*exact64.values(), "identity"), dtype, reference(*inputs.values(), "identity"), "z")

    dy = torch.randn(m, n).to(dtype)
    g, ds, dB, dbias = lora_expand_backward(dy, z if act != 0 else None, inputs["s"], inputs["B"], SCALE, act,
                                            need_dbias=True)
    assert (g.dtype, ds.dtype, dB.dtype, dbias.dtype) == (dtype, torch.float32, torch.float32, torch.float32)
    s, B = inputs["s"], inputs["B"]
    exact = grads_at(z.double(), dy, s, B, activation)
    plain = grads_at(z.float(), dy, s, B, activation)
    plain["base"] = plain["base"].to(dtype)
    assert_all_close({"base": g, "s": ds, "B": dB, "bias": dbias}, exact, dtype, plain)


# the last two: what training sizes get with fp32 adapter math (narrow and wide dy)
@pytest.mark.parametrize("config", [(16, 32, 4, 1, 8), (64, 128, 4, 1, 1), (16, 64, 4, 1, 264), (32, 128, 4, 3, 528),
                                    (128, 64, 4, 3, 528)])
def test_backward_tiling(config):
    # Other tiles and column splits (several partial ds sums, or one): same gradients.
    m, n, r = 300, 600, 8
    inputs = random_inputs(m, n, r, torch.float32)
    act = activation_id("gelu_tanh")
    _, z = lora_expand(inputs["base"].clone(), inputs["s"], inputs["B"], SCALE, inputs["bias"], act, store_z=True)
    dy = torch.randn(m, n)
    g, ds, dB, dbias = lora_expand_backward(dy, z, inputs["s"], inputs["B"], SCALE, act, need_dbias=True, config=config)
    exact = forward_backward(lambda **t: plain_expand(**t, activation="gelu_tanh"), cast(inputs, torch.float64),
                             dy.double(), ("base", "s", "B", "bias"))
    exact.pop("out")
    assert_all_close({"base": g, "s": ds, "B": dB, "bias": dbias}, exact, torch.float32)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dB", "deterministic"])
def test_backward_adds_dB_and_ds_with_atomics_unless_deterministic(deterministic, monkeypatch):
    # Row blocks add their dB shares, column splits their ds shares with float32 atomics (no partial sums to write
    # and reduce), except under
    # torch.use_deterministic_algorithms(True), where they write partials that a reduction sums in a fixed order.
    # Both give the exact gradient.
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: deterministic)
    assert atomic_partial_sums(5, deterministic) is not deterministic and not atomic_partial_sums(1, deterministic)
    launched = []
    kernel = lora_expand_module._expand_bwd

    class Spy:  # records how the kernel was launched, then launches it
        def __getitem__(self, grid):
            return lambda *args, **kwargs: (launched.append((kwargs["ATOMIC_DS"], kwargs["ATOMIC_DB"]))
                                            or kernel[grid](*args, **kwargs))

    monkeypatch.setattr(lora_expand_module, "_expand_bwd", Spy())
    m, n, r = 300, 600, 8  # 5 row blocks of 64; ds over 2 column splits, added the same way
    inputs = random_inputs(m, n, r, torch.float32)
    dy = torch.randn(m, n)
    _, ds, dB, _ = lora_expand_backward(dy, None, inputs["s"], inputs["B"], SCALE, config=(64, 64, 4, 2, 10))
    assert launched == [(not deterministic, not deterministic)]
    exact = grads_at(torch.zeros(m, n, dtype=torch.float64), dy, inputs["s"], inputs["B"], "identity")
    assert_all_close({"s": ds, "B": dB}, {"s": exact["s"], "B": exact["B"]}, torch.float32)
