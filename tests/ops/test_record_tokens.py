"""record_tokens against its torch reference: the same out, ids, pos, slot and made after a few steps, for batches
of one row, of an odd size and of a bucket's 32 rows, with rows at different positions."""
import pytest
import torch

from lorafuse.ops.record_tokens import record_tokens, record_tokens_reference


def buffers(rows: int, length: int, seed: int):
    g = torch.Generator().manual_seed(seed)  # drawn on the CPU, then moved (the GPU mode's default device)
    out = torch.randint(0, 1000, (rows, length), generator=g, device="cpu")
    ids = torch.randint(0, 1000, (rows, 1), generator=g, device="cpu")
    pos = torch.randint(0, length // 2, (rows, 1), generator=g, device="cpu")  # rows of different prompt lengths
    slot, made = torch.tensor([length // 2], device="cpu"), torch.tensor([1], device="cpu")
    return [t.to(torch.get_default_device()) for t in (out, ids, pos, slot, made)]


@pytest.mark.parametrize("rows", [1, 5, 32])
def test_steps_match_the_reference(rows):
    got, want = buffers(rows, 24, seed=rows), buffers(rows, 24, seed=rows)
    for step in range(3):
        token = torch.randint(0, 128256, (rows,), generator=torch.Generator().manual_seed(step), device="cpu")
        token = token.to(got[0].device)
        record_tokens(token, *got)
        record_tokens_reference(token, *want)
        for name, g, w in zip(("out", "ids", "pos", "slot", "made"), got, want):
            assert torch.equal(g, w), f"step {step}: {name} {g.tolist()} != {w.tolist()}"
