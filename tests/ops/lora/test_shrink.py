"""lora_shrink: s = dropout(x) @ A^T (fp32), and lora_shrink_backward: dA = ds^T @ dropout(x) and the
adapter's dx = keep * (ds @ A) * keep_scale, against float64 and lora_shrink_reference."""
import importlib

import pytest
import torch

from lorafuse.ops.lora.dropout import keep_mask_reference, keep_scale
from lorafuse.ops.lora.shrink import lora_shrink, lora_shrink_backward, lora_shrink_reference
from tests.ops._helpers import (BIG_SEED, DTYPES, assert_close, dtype_id, poison,
                                seed_tensor)

lora_shrink_module = importlib.import_module("lorafuse.ops.lora.shrink")

# (M, K, r): rows 1, 7, 113, 1023 (narrow); K not a multiple of the 64/128 column blocks
# except 128 itself; ranks 1..64 (padded to 16 and 64 in the kernels).
CASES = [(1, 48, 8), (7, 100, 1), (113, 48, 64), (113, 128, 8), (1023, 24, 8)]


def case_id(case):
    return "M{}_K{}_r{}".format(*case)


def inputs(m, k, r, dtype):
    return torch.randn(m, k).to(dtype), (torch.randn(r, k) / k**0.5).to(dtype)


def keep_factor(m, k, p, seed):
    """keep * keep_scale as float64 ([M, K]), or 1 without dropout."""
    if p == 0.0:
        return torch.ones(m, k, dtype=torch.float64)
    return keep_mask_reference(seed, m, k, p).double() * keep_scale(p)


def check_forward(x, A, p, seed, config=None):
    m, k = x.shape
    s = lora_shrink(x, A, p, seed_tensor(seed) if p > 0 else None, config=config)
    assert s.dtype == torch.float32 and s.shape == (m, A.shape[0])
    exact = (x.double() * keep_factor(m, k, p, seed)) @ A.double().t()
    plain = lora_shrink_reference(x, A, p, seed)
    assert_close(s, exact, x.dtype, plain, "s")
    assert_close(plain, exact, x.dtype, plain, "lora_shrink_reference")  # the fallback path itself
    return s


def check_backward(x, A, p, seed, config=None):
    # ds: [M, r] fp32, as lora_expand_backward returns it
    m, k = x.shape
    ds = torch.randn(m, A.shape[0])
    seed_t = seed_tensor(seed) if p > 0 else None
    factor = keep_factor(m, k, p, seed)
    dA = lora_shrink_backward(ds, x, A, p, seed_t, config=config)
    dx = poison(torch.empty_like(x))
    dA_too = lora_shrink_backward(ds, x, A, p, seed_t, dx_out=dx, config=config)
    assert dA.dtype == torch.float32 and dA.shape == A.shape
    exact_dA = ds.double().t() @ (x.double() * factor)
    exact_dx = (ds.double() @ A.double()) * factor
    # PyTorch in x's dtype: ds rounded to it, as the kernel does.
    dtype = x.dtype
    plain_dA = ds.to(dtype).t() @ (x * factor.to(dtype))
    plain_dx = (ds.to(dtype) @ A) * factor.to(dtype)
    assert_close(dA, exact_dA, dtype, plain_dA, "dA")
    assert_close(dA_too, exact_dA, dtype, plain_dA, "dA (with dx_out)")
    assert_close(dx, exact_dx, dtype, plain_dx, "dx")
    if p > 0:
        # dropped elements are exactly zero: the kernel's mask is the reference mask
        assert torch.equal(dx != 0, factor != 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_forward(case, p, dtype):
    check_forward(*inputs(*case, dtype), p, BIG_SEED)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_backward(case, p, dtype):
    check_backward(*inputs(*case, dtype), p, BIG_SEED)


@pytest.mark.parametrize("seed", [0, 77, 2**62 - 1])
def test_seeds(seed):
    # low-word-only, small and full-width seeds draw the reference's mask
    x, A = inputs(113, 100, 8, torch.float32)
    check_forward(x, A, 0.3, seed)
    check_backward(x, A, 0.3, seed)


def test_mask_depends_on_seed():
    x, A = inputs(113, 100, 8, torch.float32)
    a, b = (lora_shrink(x, A, 0.3, seed_tensor(seed)) for seed in (1, 2))
    assert torch.equal(a, lora_shrink(x, A, 0.3, seed_tensor(1)))
    assert (a - b).abs().max() > 0.1


def test_row_strided_input():
    # x a column slice of a wider buffer: unit column stride, row stride > K.
    wide = torch.randn(113, 160)
    x = wide[:, 30:130]
    assert not x.is_contiguous()
    A = torch.randn(8, 100) / 10
    check_forward(x, A, 0.1, BIG_SEED)
    check_backward(x, A, 0.1, BIG_SEED)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
def test_float32_adapter_with_half_input(dtype):
    # PEFT's default: lora_A in float32, x in half precision. The bar is PEFT's computation,
    # the adapter path in float32 (x upcast), dx cast to x's dtype.
    m, k, r, p = 113, 100, 8, 0.1
    x = torch.randn(m, k).to(dtype)
    A = torch.randn(r, k) / k**0.5
    factor = keep_factor(m, k, p, BIG_SEED)
    s = lora_shrink(x, A, p, seed_tensor(BIG_SEED))
    assert_close(s, (x.double() * factor) @ A.double().t(), dtype, (x.float() * factor.float()) @ A.t(), "s")
    ds = torch.randn(m, r)
    dx = poison(torch.empty_like(x))
    dA = lora_shrink_backward(ds, x, A, p, seed_tensor(BIG_SEED), dx_out=dx)
    assert dA.dtype == torch.float32 and dx.dtype == dtype
    assert_close(dA, ds.double().t() @ (x.double() * factor), dtype, ds.t() @ (x.float() * factor.float()), "dA")
    assert_close(dx, (ds.double() @ A.double()) * factor, dtype, ((ds @ A) * factor.float()).to(dtype), "dx")


@pytest.mark.parametrize("forward_config, backward_config", [
    ((16, 32, 4, 1, 132), (16, 32, 4, 1, 8)),
    ((64, 16, 4, 1, 1), (32, 16, 4, 1, 1)),
    ((16, 64, 4, 1, 400), (64, 64, 4, 1, 100)),
    ((128, 128, 8, 3, 132), (32, 128, 4, 3, 528)),  # what training sizes get with fp32 adapter math
])
def test_tiling_does_not_change_the_result(forward_config, backward_config):
    # Other tiles and row splits (several partial dA sums, or one): same mask, same values.
    x, A = inputs(300, 100, 8, torch.float32)
    check_forward(x, A, 0.1, BIG_SEED, forward_config)
    check_backward(x, A, 0.1, BIG_SEED, backward_config)


def test_pieces_with_atomic_split_sums(monkeypatch):
    # float32 A on bf16 x runs on bf16 pieces of A split in the kernels; s's column splits and dA's row splits add
    # into zeroed outputs with atomics; dx's product takes A's pieces too
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: False)
    m, k, p = 600, 256, 0.1
    x, A, ds = torch.randn(m, k).bfloat16(), torch.randn(8, k) / 16, torch.randn(m, 8)
    factor = keep_factor(m, k, p, 5)
    s = lora_shrink(x, A, p, seed_tensor(5), config=(64, 64, 4, 2, 20))  # 2 column splits
    dA = lora_shrink_backward(ds, x, A, p, seed_tensor(5), dx_out=poison(torch.empty_like(x)),
                              config=(64, 64, 4, 2, 8))  # 2 row splits
    # float32 adapters: the bar is PyTorch's float32 computation of the same products
    assert_close(s, (x.double() * factor) @ A.double().t(), torch.bfloat16, (x.float() * factor.float()) @ A.t(), "s")
    assert_close(dA, ds.double().t() @ (x.double() * factor), torch.bfloat16, ds.t() @ (x.float() * factor.float()),
                 "dA")


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
def test_split_sums_add_with_atomics_unless_deterministic(deterministic, monkeypatch):
    # s's column splits and dA's row splits add their shares into the output with float32 atomics (no partial sums to
    # write and reduce in a launch of their own), except under torch.use_deterministic_algorithms(True), where they
    # write partials summed in a fixed order (s's by its row blocks' last programs, dA's by a reduction); s, a
    # forward's output, only for two splits (whose sum does not depend on the order). Both give the exact result.
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: deterministic)
    launched = []
    for name in ("_shrink_fwd", "_shrink_bwd"):
        kernel = getattr(lora_shrink_module, name)

        class Spy:  # records how the kernel was launched, then launches it
            def __getitem__(self, grid, kernel=kernel, name=name):
                return lambda *args, **kwargs: (launched.append((name, grid[1], kwargs["ATOMIC"]))
                                                or kernel[grid](*args, **kwargs))

        monkeypatch.setattr(lora_shrink_module, name, Spy())
    x, A = inputs(600, 256, 8, torch.float32)
    check_forward(x, A, 0.1, 5, config=(64, 64, 4, 2, 20))  # 10 row blocks, 2 column splits
    check_backward(x, A, 0.1, 5, config=(64, 64, 4, 2, 8))  # 4 column blocks, 2 row splits
    assert [name for name, _, _ in launched] == ["_shrink_fwd", "_shrink_bwd", "_shrink_bwd"]  # dA, then with dx
    assert all(splits == 2 and atomic is not deterministic for _, splits, atomic in launched)
    # More than two splits add in no fixed order: the forward's s (the same prompt, the same logits) keeps partials,
    # which each row block's last program adds in their order (SERIAL_SUM): the same bits call after call
    launched.clear()
    s = check_forward(x, A, 0.1, 5, config=(64, 64, 4, 2, 40))  # 4 column splits
    check_backward(x, A, 0.1, 5, config=(64, 64, 4, 2, 12))  # 3 row splits
    assert [(name, splits, atomic) for name, splits, atomic in launched] == [
        ("_shrink_fwd", 4, False), ("_shrink_bwd", 3, not deterministic), ("_shrink_bwd", 3, not deterministic)]
    assert torch.equal(s, lora_shrink(x, A, 0.1, seed_tensor(5), config=(64, 64, 4, 2, 40)))


@pytest.mark.parametrize("adapter_dtype", [torch.float32, torch.bfloat16], ids=["pieces", "bf16_adapters"])
@pytest.mark.parametrize("programs, splits", [(10, 1), (20, 2), (40, 4)], ids=["one_split", "two", "four"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
def test_split_sums_of_s(adapter_dtype, programs, splits, deterministic, monkeypatch):
    # s's column splits add with atomics (two), in a fixed order by a row block's last program (four, or two under
    # deterministic algorithms: the counts zeroed by a fill of their own, int32 empties poisoned here so that a missed
    # zero shows; the sum is split 0's part + split 1's + ..., bit for bit) or not at all (one); the same s every call
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: deterministic)
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(7) if t.dtype == torch.int32 else t

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    launched = []
    kernel = lora_shrink_module._shrink_fwd

    class Spy:  # records the launch and, after a serial one, the left fold of its parts
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                kernel[grid](*args, **kwargs)
                folded = None
                if kwargs["SERIAL_SUM"]:
                    folded = torch.zeros_like(args[2][0])
                    for part in args[2]:
                        folded = folded + part
                launched.append((grid[1], kwargs["SERIAL_SUM"], folded))
            return launch

    monkeypatch.setattr(lora_shrink_module, "_shrink_fwd", Spy())
    m, k, r, p = 600, 256, 8, 0.1
    x, A = torch.randn(m, k).bfloat16(), (torch.randn(r, k) / 16).to(adapter_dtype)
    config = (64, 64, 4, 2, programs)
    got = lora_shrink(x, A, p, seed_tensor(5), config=config)
    assert torch.equal(got, lora_shrink(x, A, p, seed_tensor(5), config=config))
    serial = splits > 2 or (deterministic and splits == 2)
    assert [(n, ser) for n, ser, _ in launched] == [(splits, serial)] * 2
    if serial:
        assert torch.equal(got, launched[0][2])
    factor = keep_factor(m, k, p, 5)
    plain = (x.float() * factor.float()) @ A.float().t() if adapter_dtype == torch.float32 else \
        lora_shrink_reference(x, A, p, 5)
    assert_close(got, (x.double() * factor) @ A.double().t(), torch.bfloat16, plain, "s")


@pytest.mark.skipif(torch.get_default_device().type != "cuda", reason="one program at a time under the interpreter: "
                    "which program ends last only varies on a GPU")
def test_serial_split_sums_give_the_same_bits_whichever_program_ends_last():
    # The dropout forward's head at 4096 -> 4096 (34 row blocks of 128 rows, three column splits a row block): the
    # programs of a row block end in any order, and its last one adds the parts in split order, so 50 calls give one s
    x = torch.randn(4352, 4096).bfloat16()
    A = torch.randn(16, 4096) / 64
    first = lora_shrink(x, A, 0.05, seed_tensor(5))
    for _ in range(50):
        assert torch.equal(lora_shrink(x, A, 0.05, seed_tensor(5)), first)
