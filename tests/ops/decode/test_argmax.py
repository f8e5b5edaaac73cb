"""argmax_rows against torch.argmax: exactly the same index, on rows of one and of several chunks, ties inside a chunk
and across chunks, NaN, infinities, strided rows; inputs the kernels do not take run torch.argmax, said once."""
import math

import pytest
import torch

from lorafuse.ops.decode.argmax import BLOCK, argmax_reference, argmax_rows
from tests.ops._helpers import DTYPES, dtype_id


def check(x):
    got = argmax_rows(x)
    want = argmax_reference(x.cpu()).to(got.device)  # torch's CPU argmax: the first maximum, the first NaN
    assert got.dtype == torch.int64 and got.shape == want.shape
    assert torch.equal(got, want), f"argmax {got.tolist()} != torch.argmax {want.tolist()}"


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("rows, n", [(1, 1), (3, 7), (2, 1000), (1, BLOCK), (2, BLOCK + 1), (3, 3 * BLOCK + 17)])
def test_random_rows(rows, n, dtype):
    check(torch.randn(rows, n).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_ties_take_the_first_index(dtype):
    # few distinct values: ties inside every chunk; the maximum also in a later chunk than the first one holding it
    x = torch.randint(0, 4, (3, 2 * BLOCK + 5)).to(dtype)
    x[1, :] = 0
    x[1, [BLOCK + 3, 5, 2 * BLOCK + 1]] = 2  # first maximum in chunk 0, others in chunks 1 and 2
    x[2, :] = -1
    x[2, [2 * BLOCK + 4, BLOCK + 7]] = 1  # first maximum in the middle chunk
    check(x)


def test_nan_counts_above_every_number():
    x = torch.randn(4, 2 * BLOCK + 9)
    x[0, BLOCK + 2] = math.nan  # a NaN in a later chunk than the maximum
    x[0, 3] = 100.0
    x[1, [BLOCK + 5, 7, 2 * BLOCK]] = math.nan  # several NaN: the first one
    x[2, :] = math.inf
    x[2, 11] = math.nan
    x[3, :] = math.nan
    check(x)


def test_infinities():
    x = torch.full((3, BLOCK + 40), -math.inf)
    x[1, BLOCK + 30] = math.inf
    x[1, BLOCK + 31] = math.inf
    x[2, 9] = -1e30
    check(x)


def test_strided_rows():
    # a view of wider rows (the engine's logits buffer may be one): the row stride is read, the tail ignored
    wide = torch.randn(3, BLOCK + 100)
    wide[:, BLOCK + 50:] = 1e9  # past the view: must not be seen
    check(wide[:, :BLOCK + 50])


@pytest.mark.parametrize("case", ["column_stride", "three_dims", "int_dtype", "empty"])
def test_other_inputs_run_torch_argmax(case, fallback_log):
    x = {"column_stride": lambda: torch.randn(50, 3).t(), "three_dims": lambda: torch.randn(2, 3, 50),
         "int_dtype": lambda: torch.randint(0, 9, (2, 50)), "empty": lambda: torch.randn(2, 0)}[case]()
    if case == "empty":
        with pytest.raises(IndexError):  # as torch.argmax on an empty dimension
            argmax_rows(x)
    else:
        assert torch.equal(argmax_rows(x), x.argmax(-1))
    said = [r.getMessage() for r in fallback_log.records if "argmax_rows" in r.getMessage()]
    assert len(said) == 1 and "torch.argmax" in said[0], said


def test_kernel_path_does_not_log(fallback_log):
    check(torch.randn(2, 300))
    assert not [r for r in fallback_log.records if r.name == "lorafuse"]
