"""flash_attention, rms_norm, silu_mul and rope as PyTorch custom ops (lorafuse::<op>, lorafuse::<op>_backward):
torch.library.opcheck (schema, fake shapes and strides, autograd registration, AOT dispatch), and torch.compile with
fullgraph=True (no graph break) through them giving eager's outputs and gradients, the ops in its forward and
backward graphs. Eager calls keep the direct route; fallbacks and torch.func transforms stay traceable."""

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch.func import grad, vmap

from lorafuse.ops.attention import flash_attention as attention_module
from lorafuse.ops.model import rms_norm as rms_norm_module
from lorafuse.ops.model import rope as rope_module
from lorafuse.ops.model import silu_mul as silu_mul_module
from lorafuse.ops.attention.windows import windows_from_padding_mask, windows_from_position_ids
from lorafuse.ops.attention.flash_attention import attention_reference, flash_attention
from lorafuse.ops.model.rms_norm import rms_norm, rms_norm_reference
from lorafuse.ops.model.rope import rope, rope_reference
from lorafuse.ops.model.silu_mul import silu_mul, silu_mul_reference

EPS = 1e-5


def leaves(*tensors):
    return tuple(t.detach().requires_grad_() for t in tensors)


def attention_inputs(n_q=9, n_k=9):
    # q: [2, 4, Nq, 16] laid out [B, Nq, H, D] as transformers' attention layers make it; k, v: [2, 2, Nk, 16]
    q = torch.randn(2, n_q, 4, 16).transpose(1, 2)
    return q, torch.randn(2, 2, n_k, 16), torch.randn(2, 2, n_k, 16)


def rope_inputs():
    # q: [2, 4, 5, 16], k: [2, 2, 5, 16] laid out [B, T, H, D] as attention layers make them; cos, sin: [1, 5, 16]
    angles = torch.randn(1, 5, 16)
    return (torch.randn(2, 5, 4, 16).transpose(1, 2), torch.randn(2, 5, 2, 16).transpose(1, 2), angles.cos(),
            angles.sin())


def rotated_flat(rotate, cos, sin):
    """q, k -> rotate(q, k, cos, sin)'s two outputs flattened into one tensor (compiled_and_eager takes one)."""
    return lambda q, k: torch.cat([t.flatten() for t in rotate(q, k, cos, sin)])


def attention_windows(kind: str):
    if kind == "padded":  # left padding: the first row starts 3 tokens late
        mask = torch.ones(2, 9, dtype=torch.long)
        mask[0, :3] = 0
        return windows_from_padding_mask(mask, 9)
    if kind == "packed":  # UnpaddedWindows: two sequences in each row
        return windows_from_position_ids(torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]] * 2))
    return None


def window_args(windows) -> tuple:
    # the custom ops' arguments for `windows`: key_lo, key_hi, query_lo, query_hi, unpadded
    return attention_module._window_tensors(windows)


# ---------------------------------------------------------------------------------------------------------------
# opcheck


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)],
                         ids=["fp32", "bf16_x_fp32_weight"])
def test_rms_norm_ops_pass_opcheck(dtypes):
    x_dtype, w_dtype = dtypes
    x = torch.randn(7, 20).to(x_dtype)[:, :13]  # rows 20 apart
    weight = torch.rand(13).to(w_dtype) + 0.5
    torch.library.opcheck(torch.ops.lorafuse.rms_norm.default, (*leaves(x, weight), EPS))
    _, rstd = torch.ops.lorafuse.rms_norm(x, weight, EPS)
    dy = torch.randn(7, 13).to(torch.promote_types(x_dtype, w_dtype))
    for need_dw in (True, False):
        torch.library.opcheck(torch.ops.lorafuse.rms_norm_backward.default, (x, weight, rstd, dy, need_dw))


def test_silu_mul_ops_pass_opcheck():
    gate, up = torch.randn(37, 3).t(), torch.randn(3, 37)  # gate transposed: the op computes on a contiguous copy
    torch.library.opcheck(torch.ops.lorafuse.silu_mul.default, leaves(gate, up))
    torch.library.opcheck(torch.ops.lorafuse.silu_mul_backward.default, (gate, up, torch.randn(3, 37)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rope_ops_pass_opcheck(dtype):
    q, k, cos, sin = (t.to(dtype) for t in rope_inputs())
    torch.library.opcheck(torch.ops.lorafuse.rope.default, (*leaves(q, k), cos, sin))
    # dq_out laid out as the forward's outputs, dk_out contiguous
    dq_out, dk_out = torch.randn(2, 5, 4, 16).transpose(1, 2).to(dtype), torch.randn(2, 2, 5, 16).to(dtype)
    torch.library.opcheck(torch.ops.lorafuse.rope_backward.default, (dq_out, dk_out, cos, sin, dtype))


@pytest.mark.parametrize("windows_kind", [None, "padded", "packed"], ids=str)
def test_flash_attention_ops_pass_opcheck(windows_kind):
    q, k, v = attention_inputs()
    windows = attention_windows(windows_kind)
    args = (True, 0.3, *window_args(windows))
    torch.library.opcheck(torch.ops.lorafuse.flash_attention.default, (*leaves(q, k, v), *args, True))
    out, lse = torch.ops.lorafuse.flash_attention(q, k, v, *args, True)
    # dout laid out as q: the padded case's zeroed copies decide the gradients' strides, which the fake must match
    dout = torch.randn(2, 9, 4, 16).transpose(1, 2)
    torch.library.opcheck(torch.ops.lorafuse.flash_attention_backward.default, (q, k, v, out, lse, dout, *args))


def test_flash_attention_op_without_lse_passes_opcheck_and_refuses_a_backward():
    # store_lse=False: the forward of a call without autograd (a decode step here, which the split-KV kernel takes)
    q, k, v = attention_inputs(n_q=1)
    torch.library.opcheck(torch.ops.lorafuse.flash_attention.default, (q, k, v, True, 0.25, *window_args(None), False))
    q, k, v = leaves(q, k, v)
    out, _ = torch.ops.lorafuse.flash_attention(q, k, v, True, 0.25, *window_args(None), False)
    with pytest.raises(RuntimeError, match="store_lse=False"):
        out.sum().backward()


# ---------------------------------------------------------------------------------------------------------------
# torch.compile


def aot_eager_recording(graphs: list):
    """aot_eager (AOTAutograd, graphs run as traced) that keeps the code of each forward and backward graph."""
    def keep(gm, example_inputs):
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)
    return aot_autograd(fw_compiler=keep, bw_compiler=keep)


def compiled_and_eager(fn, inputs, grad_out):
    """(compiled, eager) results of fn: its output and the gradients of (output * grad_out).sum() for every input,
    and the code of the compiled graphs (forward first, then backward)."""
    def run(f):
        xs = leaves(*inputs)
        out = f(*xs)
        return [out.detach(), *torch.autograd.grad(out, xs, grad_out)]

    graphs = []
    torch._dynamo.reset()
    compiled = run(torch.compile(fn, backend=aot_eager_recording(graphs), fullgraph=True))
    return compiled, run(fn), graphs


def assert_equal_results(compiled, eager):
    # the same kernels on the same inputs: equal to the bit
    for i, (got, want) in enumerate(zip(compiled, eager)):
        assert got.shape == want.shape and got.dtype == want.dtype, f"result {i}"
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"result {i}")


def test_compiled_rms_norm_equals_eager_through_the_custom_ops():
    x, weight = torch.randn(2, 5, 24), torch.rand(24) + 0.5
    compiled, eager, graphs = compiled_and_eager(lambda x, w: 2.0 * rms_norm(x + 1.0, w, EPS), (x, weight),
                                                 torch.randn(2, 5, 24))
    assert_equal_results(compiled, eager)
    assert "lorafuse.rms_norm.default" in graphs[0] and "lorafuse.rms_norm_backward.default" in graphs[1]


def test_compiled_silu_mul_equals_eager_through_the_custom_ops():
    gate, up = torch.randn(3, 41), torch.randn(3, 41)
    compiled, eager, graphs = compiled_and_eager(lambda g, u: silu_mul(g * 2.0, u) + 1.0, (gate, up),
                                                 torch.randn(3, 41))
    assert_equal_results(compiled, eager)
    assert "lorafuse.silu_mul.default" in graphs[0] and "lorafuse.silu_mul_backward.default" in graphs[1]


def test_compiled_rope_equals_eager_through_the_custom_ops():
    q, k, cos, sin = rope_inputs()
    rotate = rotated_flat(lambda q, k, cos, sin: rope(q * 2.0, k, cos, sin), cos, sin)
    compiled, eager, graphs = compiled_and_eager(rotate, (q, k), torch.randn(2 * 5 * 6 * 16))
    assert_equal_results(compiled, eager)
    assert "lorafuse.rope.default" in graphs[0] and "lorafuse.rope_backward.default" in graphs[1]


@pytest.mark.parametrize("windows_kind", [None, "padded", "packed"], ids=str)
def test_compiled_flash_attention_equals_eager_through_the_custom_ops(windows_kind):
    windows = attention_windows(windows_kind)

    def attend(q, k, v):
        return flash_attention(q, k, v, causal=True, windows=windows).transpose(1, 2) * 2.0

    compiled, eager, graphs = compiled_and_eager(attend, attention_inputs(), torch.randn(2, 9, 4, 16))
    assert_equal_results(compiled, eager)
    assert "lorafuse.flash_attention.default" in graphs[0]
    assert "lorafuse.flash_attention_backward.default" in graphs[1]


def test_compiled_decode_step_takes_the_split_kv_kernel(monkeypatch):
    # without autograd, a few query rows: the custom op runs flash_decode as eager calls do
    calls = []
    real = attention_module.flash_decode
    monkeypatch.setattr(attention_module, "flash_decode", lambda *args: calls.append(1) or real(*args))
    q, k, v = attention_inputs(n_q=1, n_k=20)
    with torch.no_grad():
        eager = flash_attention(q, k, v, causal=True)
        torch._dynamo.reset()
        compiled = torch.compile(lambda *qkv: flash_attention(*qkv, causal=True), backend="aot_eager",
                                 fullgraph=True)(q, k, v)
    assert len(calls) == 2
    assert_equal_results([compiled], [eager])


@pytest.mark.parametrize("op", ["rms_norm", "silu_mul", "flash_attention", "rope"])
def test_compiled_fallback_runs_the_reference_and_says_why(op, fallback_log):
    # float64: the kernels decline; the reason is said while Dynamo traces, without a graph break
    if op == "rms_norm":
        fn, reference, inputs = (lambda x, w: rms_norm(x, w, EPS), lambda x, w: rms_norm_reference(x, w, EPS),
                                 (torch.randn(3, 24), torch.rand(24)))
    elif op == "silu_mul":
        fn, reference, inputs = silu_mul, silu_mul_reference, (torch.randn(3, 24), torch.randn(3, 24))
    elif op == "rope":
        cos, sin = (t.double() for t in rope_inputs()[2:])
        fn, reference, inputs = rotated_flat(rope, cos, sin), rotated_flat(rope_reference, cos, sin), rope_inputs()[:2]
    else:
        fn, reference = (lambda *qkv: flash_attention(*qkv, causal=True),
                         lambda *qkv: attention_reference(*qkv, causal=True))
        inputs = attention_inputs()
    inputs = tuple(t.double() for t in inputs)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    for _ in range(2):
        torch.testing.assert_close(compiled(*inputs), reference(*inputs))
    said = [record.getMessage() for record in fallback_log.records]
    assert len(said) == 1 and "float64" in said[0], said


def test_compiled_torch_func_transforms_run_the_references(fallback_log):
    # per-sample gradients (vmap over grad): the custom ops have no torch.func rules, the references run
    weight, xs = torch.rand(24) + 0.5, torch.randn(4, 24)

    def per_sample_grads(norm):
        def loss(w, row):
            return silu_mul(norm(row[None], w, EPS), row[None]).pow(2).sum()
        return vmap(grad(loss), in_dims=(None, 0))(weight, xs)

    want = per_sample_grads(rms_norm_reference)
    torch._dynamo.reset()
    got = torch.compile(lambda: per_sample_grads(rms_norm), backend="aot_eager", fullgraph=True)()
    torch.testing.assert_close(got, want)
    assert "torch.func transform" in fallback_log.text


@pytest.mark.parametrize("op", ["rms_norm", "silu_mul", "flash_attention", "rope"])
def test_eager_calls_keep_the_direct_route(op, monkeypatch):
    # the custom ops cost more host time per call: eager forwards and backwards never reach them
    module, name = {"rms_norm": (rms_norm_module, "_rms_norm_op"), "silu_mul": (silu_mul_module, "_silu_mul_op"),
                    "flash_attention": (attention_module, "_flash_attention_op"),
                    "rope": (rope_module, "_rope_op")}[op]
    monkeypatch.setattr(module, name, lambda *args, **kwargs: pytest.fail("the custom op ran in eager mode"))
    if op == "rms_norm":
        out = rms_norm(*leaves(torch.randn(3, 24), torch.rand(24)), EPS)
    elif op == "silu_mul":
        out = silu_mul(*leaves(torch.randn(3, 24), torch.randn(3, 24)))
    elif op == "rope":
        q, k, cos, sin = rope_inputs()
        out = rotated_flat(rope, cos, sin)(*leaves(q, k))
    else:
        out = flash_attention(*leaves(*attention_inputs()), causal=True)
    out.sum().backward()
