"""lora_linear: act(x W^T + scale * (dropout(x) A^T) B^T + bias) through both GEMM back-ends, outputs and
the gradients of x, weight, bias, lora_A, lora_B, against lora_linear_reference in float64."""
import importlib

import pytest
import torch

from lorafuse.ops.lora.linear import lora_linear, lora_linear_reference
from tests.ops._helpers import BIG_SEED, assert_all_close, cast, dtype_id, forward_backward, seed_tensor

SCALE = 2.0  # lora_alpha / r != 1: a missing or doubled scale shows
GEMMS = ["triton", "cublas"]
# (x shape, N): rows 1, 7, 113 (one side of FUSED_SHRINK_MAX_ROWS = 64 and the other), 1023 as
# [3, 341] (narrow widths); widths that are not powers of two.
SHAPES = [((1, 48), 80), ((7, 100), 36), ((113, 48), 80), ((113, 100), 36)]
ROWS_1023 = ((3, 341, 24), 40)
RANKS = [1, 8, 64]
ALLOWED_ACTIVATIONS = "identity, relu, gelu, gelu_tanh, silu, sigmoid"
ALL_GRADS = ("x", "weight", "bias", "lora_A", "lora_B")
# The module (lorafuse.ops re-exports the function under the module's name).
lora_linear_module = importlib.import_module("lorafuse.ops.lora.linear")


def shape_id(shape):
    x_shape, n = shape
    return f"{'x'.join(map(str, x_shape))}to{n}"


@pytest.fixture(autouse=True)
def _kernels_only(monkeypatch):
    # These tests are about the kernels: a silent fallback to the reference must fail them.
    def no_fallback(*args, **kwargs):
        raise AssertionError("lora_linear fell back to lora_linear_reference")
    monkeypatch.setattr(lora_linear_module, "lora_linear_reference", no_fallback)
    monkeypatch.delenv("LORAFUSE_GEMM", raising=False)


def random_inputs(x_shape, n, r, bias=True):
    k = x_shape[-1]
    return {"x": torch.randn(x_shape), "weight": torch.randn(n, k) / k**0.5,
            "bias": torch.randn(n) if bias else None,
            "lora_A": torch.randn(r, k) / k**0.5, "lora_B": torch.randn(n, r) / r**0.5}


def run(fn, inputs, grad_out, need, **kwargs):
    def call(x, weight, bias, lora_A, lora_B):
        return fn(x, weight, bias, lora_A, lora_B, SCALE, **kwargs)
    return forward_backward(call, inputs, grad_out, need)


def check(x_shape, n, r, dtype, gemm, dropout_p=0.0, activation="identity", need=ALL_GRADS, bias=True,
          adapter_dtype=None):
    """Kernel vs float64 reference; in half precision also vs the reference in that dtype.

    adapter_dtype: the dtype of lora_A / lora_B when it differs from x's (PEFT keeps them in
    float32 under a bfloat16 model); the plain PyTorch bar is then PEFT's own mixed computation
    (the reference: adapter path in float32, the sum cast to x's dtype)."""
    adapters = ("lora_A", "lora_B")
    inputs = cast(random_inputs(x_shape, n, r, bias), dtype, keep=adapters if adapter_dtype is not None else ())
    if adapter_dtype is not None:  # full-precision adapter values, not half-precision ones cast up
        inputs = cast(inputs, adapter_dtype, keep=("x", "weight", "bias"))
    grad_out = torch.randn(*x_shape[:-1], n).to(dtype)
    kwargs = {"dropout_p": dropout_p, "activation": activation, "seed": seed_tensor(BIG_SEED)}
    got = run(lora_linear, inputs, grad_out, need, gemm=gemm, **kwargs)
    for name, value in got.items():
        want = dtype if name == "out" else inputs[name].dtype
        assert value.dtype == want, f"{name}: {value.dtype}, expected {want}"
    exact = run(lora_linear_reference, cast(inputs, torch.float64), grad_out.double(), need, **kwargs)
    plain = None
    if dtype != torch.float32:
        plain = run(lora_linear_reference, inputs, grad_out, need, **kwargs)
    assert_all_close(got, exact, dtype, plain)
    if adapter_dtype == torch.float32 and dtype != torch.float32:
        for name in ("lora_A", "lora_B"):
            if name in got:  # float32 values, not half-precision ones cast up
                assert not torch.equal(got[name], got[name].to(dtype).float()), f"{name}: only {dtype} precision"


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
@pytest.mark.parametrize("r", RANKS)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("gemm", GEMMS)
def test_float32(gemm, shape, r, dropout_p):
    # Activations and trainable sets vary along the grid, so each combination meets both GEMM
    # back-ends: the identity (cuBLAS: bias-only expand + addmm) and not (stored z, written g);
    # the frozen weight (PEFT) and a trainable one.
    x_shape, n = shape
    index = SHAPES.index(shape) + RANKS.index(r)
    activation = ["identity", "gelu", "silu"][index % 3]
    need = ALL_GRADS if index % 2 else ("x", "bias", "lora_A", "lora_B")
    check(x_shape, n, r, torch.float32, gemm, dropout_p, activation, need)


@pytest.mark.parametrize("r, dropout_p, activation", [(1, 0.1, "gelu"), (8, 0.0, "identity")])
@pytest.mark.parametrize("gemm", GEMMS)
def test_1023_rows(gemm, r, dropout_p, activation):
    x_shape, n = ROWS_1023
    check(x_shape, n, r, torch.float32, gemm, dropout_p, activation)


@pytest.mark.parametrize("activation", ["identity", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[2]], ids=shape_id)
@pytest.mark.parametrize("gemm", GEMMS)
def test_half(gemm, shape, dtype, activation):
    x_shape, n = shape
    check(x_shape, n, 8, dtype, gemm, 0.1, activation)


@pytest.mark.parametrize("gemm", GEMMS)
def test_half_1023_rows(gemm):
    x_shape, n = ROWS_1023
    check(x_shape, n, 1, torch.bfloat16, gemm, 0.1, "silu")


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[2]], ids=shape_id)
@pytest.mark.parametrize("gemm", GEMMS)
def test_float32_adapters_with_bfloat16_input(gemm, shape, dropout_p):
    # PEFT's default under a bfloat16 model: lora_A / lora_B stay float32, x / W / bias bfloat16.
    # The output is bfloat16, the adapters' gradients float32.
    x_shape, n = shape
    check(x_shape, n, 8, torch.bfloat16, gemm, dropout_p, "gelu", adapter_dtype=torch.float32)


@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[2]], ids=shape_id)
@pytest.mark.parametrize("gemm", GEMMS)
def test_autocast_bfloat16(gemm, shape):
    # accelerate's mixed precision: float32 parameters and input, the op computing in bfloat16
    # as autocast's linear does; gradients come back in float32.
    x_shape, n = shape
    inputs = random_inputs(x_shape, n, 8)
    grad_out = torch.randn(*x_shape[:-1], n).to(torch.bfloat16)
    kwargs = {"dropout_p": 0.1, "activation": "silu", "seed": seed_tensor(BIG_SEED)}
    with torch.autocast(torch.get_default_device().type, dtype=torch.bfloat16):  # cuda in the tests' GPU mode
        got = run(lora_linear, inputs, grad_out, ALL_GRADS, gemm=gemm, **kwargs)
        plain = run(lora_linear_reference, inputs, grad_out, ALL_GRADS, **kwargs)
    assert got["out"].dtype == torch.bfloat16
    for name in ALL_GRADS:
        assert got[name].dtype == torch.float32, f"{name}: {got[name].dtype}"
    # exact: the same computation in float64 on the inputs autocast rounds to bfloat16
    exact = run(lora_linear_reference, cast(cast(inputs, torch.bfloat16), torch.float64), grad_out.double(),
                ALL_GRADS, **kwargs)
    assert_all_close(got, exact, torch.bfloat16, plain)


@pytest.mark.parametrize("case", ["no_bias", "frozen_bias", "frozen_x"])
@pytest.mark.parametrize("gemm", GEMMS)
def test_trainable_subsets(gemm, case):
    # No bias at all; PEFT's frozen base bias; an input that needs no gradient (the first
    # adapted layer over frozen embeddings): only the requested gradients, all correct.
    x_shape, n = SHAPES[2]
    need = {"no_bias": ("x", "lora_A", "lora_B"), "frozen_bias": ("x", "lora_A", "lora_B"),
            "frozen_x": ("lora_A", "lora_B")}[case]
    check(x_shape, n, 8, torch.float32, gemm, 0.1, "gelu", need, bias=case != "no_bias")


@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[2]], ids=shape_id)
def test_auto_back_end(shape):
    # gemm="auto" (the default) picks a back-end per row count: either way, correct results.
    x_shape, n = shape
    check(x_shape, n, 8, torch.float32, "auto", 0.1, "gelu")
    check(x_shape, n, 8, torch.float32, None, 0.1, "identity")


def test_route_table():
    # Training sizes take the cuBLAS route; up to 64 rows with 16-bit adapter math, the one-launch Triton GEMM;
    # inference on up to 16 rows, the decode kernels, or PyTorch's launches when called eagerly on a GPU.
    route = lora_linear_module._route
    x = torch.randn(113, 48, dtype=torch.bfloat16)
    fp32_adapters, half_adapters = torch.randn(16, 48), torch.randn(16, 48, dtype=torch.bfloat16)
    assert route(None, x, fp32_adapters, False) == "cublas"
    assert route(None, x, half_adapters, False) == "cublas"
    assert route(None, x[:64], half_adapters, False) == "triton"  # one launch
    assert route(None, x[:64], fp32_adapters, False) == "cublas"  # fp32 math in the small-batch K-loop
    assert route(None, x[:7], half_adapters, True) == "decode"
    assert route(None, x[:7], half_adapters, True, launch_bound=True) == "torch"
    assert route("triton", x, fp32_adapters, False) == "triton"  # forced
    with pytest.raises(ValueError, match="LORAFUSE_GEMM"):
        route("cutlass", x, fp32_adapters, False)


@pytest.mark.parametrize("activation", ["identity", "silu"])
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[2]], ids=shape_id)
@pytest.mark.parametrize("gemm", GEMMS)
def test_inference(gemm, shape, activation):
    # No gradient needed (no_grad, or nothing trainable): the forward runs without an autograd node.
    x_shape, n = shape
    inputs = random_inputs(x_shape, n, 8)
    seed = seed_tensor(BIG_SEED)
    exact = lora_linear_reference(*cast(inputs, torch.float64).values(), SCALE, 0.1, activation, seed)
    with torch.no_grad():
        trainable = {name: t.clone().requires_grad_() for name, t in inputs.items()}
        got = lora_linear(*trainable.values(), SCALE, 0.1, activation, seed, gemm)
    assert got.grad_fn is None
    assert_all_close({"out": got}, {"out": exact}, torch.float32)
    frozen = lora_linear(*inputs.values(), SCALE, 0.1, activation, seed, gemm)
    assert frozen.grad_fn is None
    assert_all_close({"out": frozen}, {"out": exact}, torch.float32)


@pytest.mark.parametrize("gemm", GEMMS)
def test_non_contiguous_input(gemm):
    x_shape, n = SHAPES[2]
    inputs = random_inputs(x_shape, n, 8)
    x_t = inputs["x"].t().contiguous().t()  # a transposed view: column stride != 1
    assert x_t.stride(-1) != 1
    seed = seed_tensor(BIG_SEED)
    got = lora_linear(x_t, inputs["weight"], inputs["bias"], inputs["lora_A"], inputs["lora_B"], SCALE, 0.1,
                      "gelu", seed, gemm)
    exact = lora_linear_reference(*cast(inputs, torch.float64).values(), SCALE, 0.1, "gelu", seed)
    assert_all_close({"out": got}, {"out": exact}, torch.float32)


@pytest.mark.parametrize("gemm", GEMMS)
def test_same_seed_same_output_different_seed_different(gemm):
    inputs = random_inputs(*SHAPES[2], 8)

    def forward(seed):
        return lora_linear(*inputs.values(), SCALE, 0.1, "identity", seed, gemm)

    first = forward(seed_tensor(7))
    assert torch.equal(first, forward(seed_tensor(7)))
    assert (first - forward(seed_tensor(8))).abs().max() > 1e-2
    # no seed: a fresh one per call
    assert (forward(None) - forward(None)).abs().max() > 1e-2


@pytest.mark.parametrize("gemm", GEMMS)
def test_gemm_argument_picks_the_back_end(gemm, monkeypatch):
    # The back-end runs as asked: "triton" computes the forward GEMM with lora_matmul, "cublas"
    # never calls it. (Which kernel computes dx is the op's own choice.)
    calls = []
    real = lora_linear_module.lora_matmul

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(lora_linear_module, "lora_matmul", spy)
    for x_shape, n in (SHAPES[1], SHAPES[2]):
        check(x_shape, n, 8, torch.float32, gemm, 0.1, "gelu")
    forward_calls = [shape for shape in calls if shape[1] in (SHAPES[1][0][1], SHAPES[2][0][1])]  # a = x: [M, K]
    assert (len(forward_calls) >= 2) if gemm == "triton" else not calls


def test_environment_variable_picks_the_back_end(monkeypatch):
    calls = []
    real = lora_linear_module.lora_matmul
    monkeypatch.setattr(lora_linear_module, "lora_matmul", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("LORAFUSE_GEMM", "cublas")
    check(*SHAPES[1], 8, torch.float32, None, 0.1, "gelu")
    assert not calls
    monkeypatch.setenv("LORAFUSE_GEMM", "triton")
    check(*SHAPES[1], 8, torch.float32, None, 0.1, "gelu")
    assert calls


@pytest.mark.parametrize("gemm", GEMMS)
def test_fast_adapter_math(gemm, monkeypatch):
    # LORAFUSE_ADAPTER_MATH=fast: float32 adapters rounded to the base's dtype in-kernel; the bar
    # is then the whole layer computed in bfloat16. Gradients still come back in float32.
    monkeypatch.setenv("LORAFUSE_ADAPTER_MATH", "fast")
    x_shape, n = SHAPES[2]
    dtype = torch.bfloat16
    inputs = cast(random_inputs(x_shape, n, 8), dtype, keep=("lora_A", "lora_B"))
    grad_out = torch.randn(*x_shape[:-1], n).to(dtype)
    kwargs = {"dropout_p": 0.1, "activation": "gelu", "seed": seed_tensor(BIG_SEED)}
    got = run(lora_linear, inputs, grad_out, ALL_GRADS, gemm=gemm, **kwargs)
    assert got["lora_A"].dtype == got["lora_B"].dtype == torch.float32
    exact = run(lora_linear_reference, cast(inputs, torch.float64), grad_out.double(), ALL_GRADS, **kwargs)
    plain = run(lora_linear_reference, cast(inputs, dtype), grad_out, ALL_GRADS, **kwargs)
    assert_all_close(got, exact, dtype, plain)


def test_bad_arguments_raise(monkeypatch):
    inputs = random_inputs(*SHAPES[1], 8)
    with pytest.raises(ValueError, match=f"activation='tanh'.*{ALLOWED_ACTIVATIONS}"):
        lora_linear(*inputs.values(), SCALE, activation="tanh")
    with pytest.raises(ValueError, match="gemm='foo'.*auto, triton, cublas"):
        lora_linear(*inputs.values(), SCALE, gemm="foo")
    for p in (1.0, -0.1):
        with pytest.raises(ValueError, match=r"\[0, 1\)"):
            lora_linear(*inputs.values(), SCALE, dropout_p=p)
    monkeypatch.setenv("LORAFUSE_GEMM", "foo")
    with pytest.raises(ValueError, match="LORAFUSE_GEMM.*'foo'.*auto, triton, cublas"):
        lora_linear(*inputs.values(), SCALE)
    monkeypatch.delenv("LORAFUSE_GEMM")
    monkeypatch.setenv("LORAFUSE_ADAPTER_MATH", "foo")
    mixed = cast(inputs, torch.bfloat16, keep=("lora_A", "lora_B"))
    with pytest.raises(ValueError, match="LORAFUSE_ADAPTER_MATH='foo'.*exact, fast"):
        lora_linear(*mixed.values(), SCALE)
    monkeypatch.setattr(lora_linear_module, "_launch_bound", lambda x: True)  # a GPU's eager route of a few rows
    with pytest.raises(ValueError, match="LORAFUSE_ADAPTER_MATH='foo'.*exact, fast"):
        lora_linear(*mixed.values(), SCALE)


@pytest.mark.parametrize("case", ["float64", "rank_over_128"])
def test_unsupported_inputs_fall_back_to_the_reference(case, monkeypatch):
    monkeypatch.setattr(lora_linear_module, "lora_linear_reference", lora_linear_reference)
    r = 130 if case == "rank_over_128" else 8
    inputs = random_inputs(*SHAPES[1], r)
    if case == "float64":
        inputs = cast(inputs, torch.float64)
    grad_out = torch.randn(7, 36).to(inputs["x"].dtype)
    kwargs = {"dropout_p": 0.1, "activation": "gelu", "seed": seed_tensor(BIG_SEED)}
    got = run(lora_linear, inputs, grad_out, ALL_GRADS, **kwargs)
    exact = run(lora_linear_reference, cast(inputs, torch.float64), grad_out.double(), ALL_GRADS, **kwargs)
    assert_all_close(got, exact, torch.float32)


def test_eager_calls_on_few_rows_take_pytorch_launches(monkeypatch):
    # Outside a CUDA-graph capture a few rows on a GPU are bound by their launches: "auto" computes them with
    # PyTorch's (the reference). An explicit back-end, training, dropout or more rows keep the kernels. On CPU no call
    # is launch-bound, so the GPU's answer is declared here.
    monkeypatch.setattr(lora_linear_module, "_launch_bound", lambda x: x.shape[0] <= 16)
    calls = []
    monkeypatch.setattr(lora_linear_module, "lora_linear_reference",
                        lambda *a, **k: calls.append(a[0].shape) or lora_linear_reference(*a, **k))
    inputs = random_inputs((7, 100), 36, 8)
    args = [inputs[name] for name in ("x", "weight", "bias", "lora_A", "lora_B")]
    with torch.no_grad():
        got = lora_linear(*args, SCALE, activation="silu")
        assert calls == [(7, 100)]
        assert torch.equal(got, lora_linear_reference(*args, SCALE, activation="silu"))
        lora_linear(*args, SCALE, gemm="triton")
        lora_linear(*args, SCALE, dropout_p=0.1)
        lora_linear(torch.randn(17, 100), *args[1:], SCALE)
    x = inputs["x"].requires_grad_()
    lora_linear(x, *args[1:], SCALE).sum().backward()
    assert calls == [(7, 100)]


PLAN_FLAGS = ("LORA_FP32", "ON_PIECES", "ATOMIC", "ATOMIC_DS", "ATOMIC_DB")


def spy_launches(monkeypatch):
    """[(kernel name, its PLAN_FLAGS)] of every launch of the shrink's two kernels and of the expand's backward."""
    launched = []
    for module_name, name in (("lora.shrink", "_shrink_fwd"), ("lora.shrink", "_shrink_bwd"),
                              ("lora.expand", "_expand_bwd")):
        module = importlib.import_module(f"lorafuse.ops.{module_name}")
        kernel = getattr(module, name)

        class Spy:  # records the launch's flags, then launches the kernel
            def __getitem__(self, grid, kernel=kernel, name=name):
                return lambda *args, **kwargs: (launched.append((name, {k: kwargs[k] for k in PLAN_FLAGS
                                                                        if k in kwargs}))
                                                or kernel[grid](*args, **kwargs))

        monkeypatch.setattr(module, name, Spy())
    return launched


def test_launch_plans_follow_dtypes_and_settings(monkeypatch):
    # The launchers decide a launch once per shapes, dtypes and settings (a cache): the same shapes called again with
    # LORAFUSE_ADAPTER_MATH=fast, under deterministic algorithms or with bfloat16 adapters launch as those decide
    launched = spy_launches(monkeypatch)
    x_shape, n = (300, 48), 600  # two column splits of dy, two row splits of x: atomic sums

    def flags(adapter_dtype):
        launched.clear()
        inputs = cast(random_inputs(x_shape, n, 8), torch.bfloat16, keep=("lora_A", "lora_B"))
        inputs = cast(inputs, adapter_dtype, keep=("x", "weight", "bias"))
        run(lora_linear, inputs, torch.randn(300, n).bfloat16(), ALL_GRADS, gemm="cublas", dropout_p=0.1)
        assert [name for name, _ in launched] == ["_shrink_fwd", "_expand_bwd", "_shrink_bwd"]
        return {name: tuple(values.values()) for name, values in launched}

    exact = {"_shrink_fwd": (True, True, False), "_expand_bwd": (True, True, True, True),
             "_shrink_bwd": (True, True, True)}
    assert flags(torch.float32) == exact
    monkeypatch.setenv("LORAFUSE_ADAPTER_MATH", "fast")
    assert flags(torch.float32) == {"_shrink_fwd": (False, False, False), "_expand_bwd": (False, False, True, True),
                                    "_shrink_bwd": (False, False, True)}
    monkeypatch.delenv("LORAFUSE_ADAPTER_MATH")
    assert flags(torch.float32) == exact
    assert flags(torch.bfloat16) == {"_shrink_fwd": (False, False, False), "_expand_bwd": (False, False, True, True),
                                     "_shrink_bwd": (False, False, True)}
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert flags(torch.float32) == {"_shrink_fwd": (True, True, False), "_expand_bwd": (True, True, False, False),
                                    "_shrink_bwd": (True, True, False)}


def test_backward_zeroes_its_sums_in_one_launch(monkeypatch):
    # The atomic sums of the backward's two passes (ds and dB over dy, dA over x) are zeroed by one launch, not a
    # torch.zeros each; a buffer left out would hold the NaN of the tests' poisoned empties
    zeroed, filled = [], []
    foreach_zero, zeros = torch._foreach_zero_, torch.zeros
    monkeypatch.setattr(torch, "_foreach_zero_", lambda ts: zeroed.append([tuple(t.shape) for t in ts])
                        or foreach_zero(ts))
    x_shape, n = (300, 48), 600  # two column splits of dy, two row splits of x, one split of K in the forward
    inputs = random_inputs(x_shape, n, 8)
    grad_out = torch.randn(300, n)
    kwargs = {"dropout_p": 0.1, "seed": seed_tensor(BIG_SEED)}
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: filled.append(a) or zeros(*a, **k))
    got = run(lora_linear, inputs, grad_out, ALL_GRADS, gemm="cublas", **kwargs)
    monkeypatch.setattr(torch, "zeros", zeros)
    assert zeroed == [[(8, 48), (300, 8), (8, 600)]] and not filled  # dA, ds, dB^T
    exact = run(lora_linear_reference, cast(inputs, torch.float64), grad_out.double(), ALL_GRADS, **kwargs)
    assert_all_close(got, exact, torch.float32)


@pytest.mark.parametrize("x_shape", [(2, 7, 48), (48,)], ids=["3d", "1d"])
def test_output_of_any_leading_shape_takes_in_place_changes(x_shape):
    # The autograd Function takes x and gives y with their leading dimensions (no view nodes around it); its output
    # is no view of the kernels' [M, N] buffer, which autograd would keep from changing in place
    inputs = random_inputs(x_shape, 36, 8)
    grad_out = torch.randn(*x_shape[:-1], 36)

    def doubled(**tensors):
        return lora_linear(**tensors, scale=SCALE, dropout_p=0.1, seed=seed_tensor(BIG_SEED)).mul_(2.0)

    def reference(**tensors):
        return 2.0 * lora_linear_reference(**tensors, scale=SCALE, dropout_p=0.1, seed=seed_tensor(BIG_SEED))

    got = forward_backward(doubled, inputs, grad_out, ALL_GRADS)
    assert got["out"].shape == (*x_shape[:-1], 36) and got["x"].shape == x_shape
    exact = forward_backward(reference, cast(inputs, torch.float64), grad_out.double(), ALL_GRADS)
    assert_all_close(got, exact, torch.float32)
