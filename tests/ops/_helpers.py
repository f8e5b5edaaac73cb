"""What the op tests share: docs/design.md's tolerance rules, NaN poisoning, forward+backward runs.

Rules (docs/design.md), on the relative error ||got - exact|| / ||exact|| against a float64
computation on the same (rounded) inputs:
  - float32: error < 1e-5, or (given PyTorch's own float32 result) below 2x its error where that is larger:
    inputs no fp32 computation takes to 1e-5;
  - bfloat16 / float16: the kernel's error is at most 2x the error of the plain PyTorch
    computation in that dtype. A floor of 1e-6 (far below half an ulp of either dtype: 3.9e-3,
    4.9e-4) lets a kernel that is exact up to fp32 rounding pass where PyTorch is exact.
NaN never passes: every comparison is written `err < bound` / `err <= bound`, false for NaN.
"""
import math

import torch

FP32_TOL = 1e-5
HALF_FLOOR = 1e-6
HALF_DTYPES = (torch.bfloat16, torch.float16)
DTYPES = (torch.float32, *HALF_DTYPES)


def dtype_id(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def rel_err(got: torch.Tensor, exact: torch.Tensor) -> float:
    """||got - exact|| / ||exact|| in float64; NaN or inf in `got` gives NaN or inf."""
    got, exact = got.double(), exact.double()
    return (torch.linalg.vector_norm(got - exact) / torch.linalg.vector_norm(exact)).item()


def bank_row_scales(rows: int, ranks: int) -> torch.Tensor:
    """Per-row scales of an adapter bank's s columns (the decode-step kernels' row_scales): float32 factors of 0.5-2,
    about half of them 0 (the columns of adapters that a row does not use)."""
    return (torch.rand(rows, ranks) * 1.5 + 0.5) * (torch.rand(rows, ranks) < 0.5)


def poison(tensor: torch.Tensor) -> torch.Tensor:
    """Fill with NaN (in place) so that elements a kernel does not write show as NaN."""
    with torch.no_grad():
        return tensor.fill_(math.nan)


def assert_close(got: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype, plain: torch.Tensor | None = None,
                 name: str = "out") -> None:
    """docs/design.md's tolerance rule for a computation whose inputs are in `dtype`.

    exact: float64 result on the same inputs; plain: PyTorch's result computed in `dtype`
    (needed for bf16/fp16)."""
    assert got.shape == exact.shape, f"{name}: shape {tuple(got.shape)} != {tuple(exact.shape)}"
    err = rel_err(got, exact)
    if dtype in (torch.float32, torch.float64):
        # Inputs that PyTorch itself cannot compute to 1e-5 in fp32 (scores shifted far from 0) are held to 2x
        # PyTorch's own error, as half-precision inputs are.
        plain_err = 0.0 if plain is None else rel_err(plain, exact)
        bound = max(FP32_TOL, 2 * plain_err)
        assert err < bound, (f"{name}: relative error {err:.3e} (allowed < {FP32_TOL:.0e}, or 2 x PyTorch's "
                             f"{plain_err:.3e})")
        return
    assert plain is not None, f"{name}: a {dtype} check needs PyTorch's own {dtype} result"
    plain_err = rel_err(plain, exact)
    bound = 2 * plain_err + HALF_FLOOR
    assert err <= bound, f"{name}: relative error {err:.3e} > 2 x PyTorch's {plain_err:.3e} (+{HALF_FLOOR:.0e})"


def assert_all_close(got: dict, exact: dict, dtype: torch.dtype, plain: dict | None = None) -> None:
    """assert_close for every entry; the same entries (outputs, gradients) must be present."""
    assert got.keys() == exact.keys(), f"{sorted(got)} != {sorted(exact)}"
    for name in exact:
        assert_close(got[name], exact[name], dtype, None if plain is None else plain[name], name)


def forward_backward(fn, inputs: dict, grad_out: torch.Tensor, need_grad=()) -> dict:
    """{'out': fn(**inputs), name: d(out . grad_out)/d(input)} for the inputs named in need_grad.

    Inputs are detached copies, so the caller's tensors are never modified or connected."""
    leaves = {name: None if t is None else t.detach().clone().requires_grad_(name in need_grad)
              for name, t in inputs.items()}
    out = fn(**leaves)
    result = {"out": out.detach()}
    names = [name for name in need_grad if leaves.get(name) is not None]
    if names:
        grads = torch.autograd.grad(out, [leaves[name] for name in names], grad_out.to(out.dtype))
        result.update(zip(names, grads))
    return result


def cast(inputs: dict, dtype: torch.dtype, keep=()) -> dict:
    """Floating tensors to `dtype`, except those named in `keep`; others (None, ints) unchanged."""
    return {name: t.to(dtype) if t is not None and t.is_floating_point() and name not in keep else t
            for name, t in inputs.items()}


def seed_tensor(seed: int) -> torch.Tensor:
    """The kernels' seed argument: an int64 tensor [1]."""
    return torch.tensor([seed], dtype=torch.int64)


# A seed above 2**32, so both 32-bit key words of Philox matter.
BIG_SEED = 2**40 + 12345
