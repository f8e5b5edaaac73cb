"""one_query_windows against windows_of_one_query (its torch reference): the same four tensors, exactly, for rows of
every run of kept slots (empty, at the start, in the middle, at the end, the whole row), masks longer than one
block, a strided mask; other inputs run the reference, said once."""
import logging
import random

import pytest
import torch

from lorafuse import _logging
from lorafuse.ops.attention.decode_windows import BLOCK, one_query_windows, one_query_windows_reference


def runs(rows: int, n_k: int, seed: int) -> torch.Tensor:
    # bool [rows, n_k]: one contiguous run of kept slots per row (row 0 empty, row 1 the whole row)
    rng = random.Random(seed)
    masks = []
    for row in range(rows):
        count = 0 if row == 0 else n_k if row == 1 else rng.randint(0, n_k)
        start = rng.choice([0, n_k - count, rng.randint(0, n_k - count)])
        masks.append([start <= t < start + count for t in range(n_k)])
    return torch.tensor(masks, dtype=torch.bool)


def check(keep: torch.Tensor):
    got = one_query_windows(keep)
    want = one_query_windows_reference(keep)
    for name, g, w in zip(want._fields, got, want):
        assert g.dtype == w.dtype == torch.int32 and g.shape == w.shape, name
        assert torch.equal(g, w), f"{name}: {g.tolist()} != {w.tolist()}"


@pytest.mark.parametrize("rows, n_k", [(1, 1), (2, 7), (5, 33), (6, 384), (3, BLOCK + 5), (4, 2 * BLOCK + 1)])
def test_windows_match_the_reference(rows, n_k):
    check(runs(rows, n_k, seed=rows * n_k))


def test_runs_inside_later_blocks():
    keep = torch.zeros(3, 3 * BLOCK, dtype=torch.bool)
    keep[0, BLOCK + 7:2 * BLOCK + 3] = True  # starts in the second block, ends in the third
    keep[1, 2 * BLOCK + 10:] = True  # only in the last block, up to the last slot
    keep[2, 5] = True  # one slot
    check(keep)


def test_strided_mask():
    keep = runs(5, 2 * 40, seed=3)[:, :40]  # a view with row stride 80
    assert keep.stride(0) == 80
    check(keep)


def test_other_masks_run_the_reference(monkeypatch, caplog):
    monkeypatch.setattr(_logging, "_said", set())
    caplog.set_level(logging.WARNING, logger="lorafuse")
    keep = runs(3, 10, seed=1).to(torch.int32)  # not bool
    got = one_query_windows(keep)
    one_query_windows(keep)
    want = one_query_windows_reference(keep.bool())
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert sum("one_query_windows" in r.getMessage() for r in caplog.records) == 1
