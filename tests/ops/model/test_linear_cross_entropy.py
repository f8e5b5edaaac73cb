"""linear_cross_entropy (chunked head matmul + one kernel per row) against float64 and against transformers' loss: the
loss sum and the gradients of the hidden states and of the head's weight, odd token counts, vocabularies that are not
powers of two, ignored rows and all-ignored chunks, softcapping; the custom op under opcheck and torch.compile."""
import pytest
import torch

from lorafuse.ops.model import linear_cross_entropy as lce_module
from lorafuse.ops.model.linear_cross_entropy import (LabelledCount, linear_cross_entropy,
                                                     linear_cross_entropy_reference)
from tests.ops._helpers import DTYPES, assert_all_close, assert_close, cast, dtype_id, forward_backward


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of a few rows, so that a test's rows cross several chunks and end in a partial one."""
    def use(rows_per_chunk: int, vocab: int):
        monkeypatch.setattr(lce_module, "CHUNK_ELEMENTS", rows_per_chunk * vocab)
    return use


@pytest.fixture(params=[True, False], ids=["labelled_rows", "every_row"])
def labelled(request):
    """Twice: with a LabelledCount, ignored rows dropped before the head (eager forwards), and without, every row
    through the kernel (a captured or compiled step)."""
    return request.param


def head_inputs(rows, hidden, vocab, ignored=(), seed=0):
    torch.manual_seed(seed)
    labels = torch.randint(0, vocab, (rows,))
    labels[list(ignored)] = -100
    return {"hidden": torch.randn(rows, hidden), "weight": torch.randn(vocab, hidden) / hidden ** 0.5,
            "labels": labels}


def run(fn, inputs, dtype, need, softcap=None, divisor=None, grad_out=1.0, labelled=False):
    # grad_out 1: loss.backward(), the gradients as the forward made them (a real loss is divided by its token count
    # through `divisor`, not by a later multiplication); labelled: linear_cross_entropy given a LabelledCount
    def loss(hidden, weight, labels):
        count = {"labelled": LabelledCount(labels)} if labelled else {}
        return fn(hidden, weight, labels, divisor, softcap=softcap, **count)
    return forward_backward(loss, cast(inputs, dtype), torch.tensor(grad_out), need)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("rows,hidden,vocab", [(1, 16, 50), (7, 48, 1000), (113, 32, 333)], ids=str)
@pytest.mark.parametrize("softcap", [None, 3.0], ids=["plain", "softcap"])
def test_matches_reference(rows, hidden, vocab, dtype, softcap, small_chunks, labelled):
    small_chunks(16, vocab)
    inputs = head_inputs(rows, hidden, vocab, ignored=range(2, rows, 5))
    need = ("hidden", "weight")
    divisor = torch.tensor(rows + 3)  # num_items_in_batch: a device tensor
    got = run(linear_cross_entropy, inputs, dtype, need, softcap, divisor, labelled=labelled)
    exact = run(linear_cross_entropy_reference, inputs, torch.float64, need, softcap, divisor)
    assert_all_close(got, exact, dtype, run(linear_cross_entropy_reference, inputs, dtype, need, softcap, divisor))
    assert got["out"].dtype == torch.float32
    assert got["hidden"].dtype == dtype and got["weight"].dtype == dtype


def test_incoming_gradient_scales_the_gradients():
    # a loss that is multiplied after the op (a loss weight, a gradient scaler): fp32
    inputs = head_inputs(13, 16, 90, ignored=[2])
    got = run(linear_cross_entropy, inputs, torch.float32, ("hidden", "weight"), divisor=7, grad_out=0.37)
    exact = run(linear_cross_entropy_reference, inputs, torch.float64, ("hidden", "weight"), divisor=7, grad_out=0.37)
    assert_all_close(got, exact, torch.float32)


def test_float16_gradients_survive_a_gradient_scaler(small_chunks):
    # GradScaler's factor arrives in the backward; logit gradients divided by the count first would underflow float16
    small_chunks(16, 4096)
    inputs = head_inputs(40, 16, 4096, ignored=[3])
    need, divisor, scaler = ("hidden", "weight"), torch.tensor(8192), 65536.0
    got = run(linear_cross_entropy, inputs, torch.float16, need, divisor=divisor, grad_out=scaler)
    exact = run(linear_cross_entropy_reference, inputs, torch.float64, need, divisor=divisor, grad_out=scaler)
    assert_all_close(got, exact, torch.float16,
                     run(linear_cross_entropy_reference, inputs, torch.float16, need, divisor=divisor, grad_out=scaler))


def test_autocast_runs_the_kernel_in_autocast_dtype(small_chunks, monkeypatch):
    # float32 weights under autocast (accelerate's mixed precision): the head in bfloat16, as autocast runs it
    small_chunks(8, 300)
    launches = []
    real = lce_module._launch_rows
    monkeypatch.setattr(lce_module, "_launch_rows", lambda *args: launches.append(1) or real(*args))
    inputs = head_inputs(21, 16, 300, ignored=[5])
    need, divisor = ("hidden", "weight"), torch.tensor(20)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = run(linear_cross_entropy, inputs, torch.float32, need, divisor=divisor)
        plain = run(linear_cross_entropy_reference, inputs, torch.float32, need, divisor=divisor)
    assert launches and got["hidden"].dtype == torch.float32
    exact = run(linear_cross_entropy_reference, cast(cast(inputs, torch.bfloat16), torch.float64), torch.float64,
                need, divisor=divisor)
    assert_all_close(got, exact, torch.bfloat16, plain)


def test_hidden_gradient_alone_matches_the_reference(small_chunks):
    # a frozen head (LoRA training): no dW is made
    small_chunks(8, 203)
    inputs = head_inputs(37, 24, 203, ignored=[3, 4])
    got = run(linear_cross_entropy, inputs, torch.bfloat16, ("hidden",))
    exact = run(linear_cross_entropy_reference, inputs, torch.float64, ("hidden",))
    assert_all_close(got, exact, torch.bfloat16,
                     run(linear_cross_entropy_reference, inputs, torch.bfloat16, ("hidden",)))


def test_all_ignored_chunk_gives_zero_loss_and_gradient_rows(small_chunks, labelled):
    # rows 8..15 fill one chunk and are all ignored: their loss is 0 and their gradient rows are exactly 0
    small_chunks(8, 90)
    inputs = head_inputs(20, 16, 90, ignored=range(8, 16))
    got = run(linear_cross_entropy, inputs, torch.float32, ("hidden", "weight"), labelled=labelled)
    exact = run(linear_cross_entropy_reference, inputs, torch.float64, ("hidden", "weight"))
    assert_all_close(got, exact, torch.float32)
    assert torch.equal(got["hidden"][8:16], torch.zeros(8, 16))


def test_ignored_rows_skip_the_head_matmul(monkeypatch):
    rows_seen, forward = [], lce_module._forward
    monkeypatch.setattr(lce_module, "_forward", lambda hidden, *args: rows_seen.append(len(hidden)) or
                        forward(hidden, *args))
    inputs = head_inputs(12, 16, 40, ignored=[0, 1, 2, 7, 11])
    got = run(linear_cross_entropy, inputs, torch.float32, ("hidden", "weight"), labelled=True)
    assert rows_seen == [7]
    assert_all_close(got, run(linear_cross_entropy_reference, inputs, torch.float64, ("hidden", "weight")),
                     torch.float32)
    assert torch.equal(got["hidden"][[0, 1, 2, 7, 11]], torch.zeros(5, 16))


def test_every_row_ignored_gives_zero_not_nan(labelled):
    inputs = head_inputs(6, 16, 40, ignored=range(6))
    got = run(linear_cross_entropy, inputs, torch.float32, ("hidden", "weight"), labelled=labelled)
    assert got["out"].item() == 0.0
    assert torch.equal(got["hidden"], torch.zeros(6, 16)) and torch.equal(got["weight"], torch.zeros(40, 16))


def test_without_grad_gives_the_loss_alone(small_chunks):
    small_chunks(4, 77)
    inputs = head_inputs(11, 16, 77, ignored=[0])
    with torch.no_grad():
        got = linear_cross_entropy(**inputs)
    assert_close(got, linear_cross_entropy_reference(**cast(inputs, torch.float64)), torch.float32)


def test_equals_transformers_causal_lm_loss():
    # ForCausalLMLoss on logits from the same head: the sum over labelled tokens, divided by num_items_in_batch
    from transformers.loss.loss_utils import ForCausalLMLoss
    inputs = head_inputs(2 * 9, 16, 61, ignored=[2, 3])
    hidden, weight, labels = inputs["hidden"], inputs["weight"], inputs["labels"].view(2, 9)
    want = ForCausalLMLoss((hidden @ weight.t()).view(2, 9, 61), labels, 61, num_items_in_batch=torch.tensor(13))
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].reshape(-1)
    got = linear_cross_entropy(hidden, weight, shifted, torch.tensor(13))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_double_backward_matches_the_reference():
    # create_graph=True: the gradient is the reference's, itself differentiable
    inputs = head_inputs(5, 8, 30, ignored=[1])
    results = []
    for fn in (linear_cross_entropy, linear_cross_entropy_reference):
        hidden = inputs["hidden"].clone().requires_grad_()
        (dh,) = torch.autograd.grad(fn(hidden, inputs["weight"], inputs["labels"]), hidden, create_graph=True)
        results.append((dh, torch.autograd.grad(dh.square().sum(), hidden)[0]))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_float64_runs_the_reference():
    inputs = cast(head_inputs(4, 8, 20), torch.float64)
    assert torch.equal(linear_cross_entropy(**inputs), linear_cross_entropy_reference(**inputs))


@pytest.mark.parametrize("need", [(True, True), (True, False), (False, False)], ids=["dh_dw", "dh", "loss"])
def test_custom_op_passes_opcheck(need):
    inputs = head_inputs(9, 16, 70, ignored=[4])
    hidden, weight = inputs["hidden"].requires_grad_(need[0]), inputs["weight"].requires_grad_(need[1])
    torch.library.opcheck(torch.ops.lorafuse.linear_cross_entropy.default,
                          (hidden, weight, inputs["labels"], torch.tensor([0.25]), -100, 0.0, *need))


def test_compiled_loss_equals_eager_through_the_custom_op(small_chunks):
    from tests.ops.test_compile_ops import assert_equal_results, compiled_and_eager
    small_chunks(4, 70)
    inputs = head_inputs(9, 16, 70, ignored=[4])
    labels = inputs["labels"]
    compiled, eager, graphs = compiled_and_eager(
        lambda h, w: linear_cross_entropy(h * 2.0, w, labels, 5) * 3.0, (inputs["hidden"], inputs["weight"]),
        torch.tensor(1.0))
    assert_equal_results(compiled, eager)
    assert "lorafuse.linear_cross_entropy.default" in graphs[0]
