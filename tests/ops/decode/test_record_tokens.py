"""record_tokens against its torch reference: the same out, ids, pos, slot and made after a few steps, for batches
of one row, of an odd size, of a bucket's 32 rows and of more, with rows at different positions, the last column of
out written, and the buffers as views of larger ones."""
import pytest
import torch

from lorafuse.ops.decode.record_tokens import record_tokens, record_tokens_reference


def buffers(rows: int, length: int, seed: int):
    g = torch.Generator().manual_seed(seed)  # drawn on the CPU, then moved (the GPU mode's default device)
    out = torch.randint(0, 1000, (rows, length), generator=g, device="cpu")
    ids = torch.randint(0, 1000, (rows, 1), generator=g, device="cpu")
    pos = torch.randint(0, length // 2, (rows, 1), generator=g, device="cpu")  # rows of different prompt lengths
    slot, made = torch.tensor([length // 2], device="cpu"), torch.tensor([1], device="cpu")
    return [t.to(torch.get_default_device()) for t in (out, ids, pos, slot, made)]


def check_steps(got, want, rows, steps=3):
    for step in range(steps):
        token = torch.randint(0, 128256, (rows,), generator=torch.Generator().manual_seed(step), device="cpu")
        token = token.to(got[0].device)
        record_tokens(token, *got)
        record_tokens_reference(token, *want)
        for name, g, w in zip(("out", "ids", "pos", "slot", "made"), got, want):
            assert torch.equal(g, w), f"step {step}: {name} {g.tolist()} != {w.tolist()}"


@pytest.mark.parametrize("rows", [1, 5, 32, 33])
def test_steps_match_the_reference(rows):
    check_steps(buffers(rows, 24, seed=rows), buffers(rows, 24, seed=rows), rows)


def test_last_column_and_views():
    # made reaches out's last column; out, ids, pos, slot and made are views into shared, strided buffers
    def views(seed):
        out, ids, pos, slot, made = buffers(6, 10, seed)
        wide = torch.zeros(6, 17, dtype=torch.long, device=out.device)
        wide[:, 3:13] = out
        ids_pos = torch.cat([ids, pos], 1)  # [6, 2]: ids and pos are its columns (row stride 2)
        counters = torch.tensor([7, 9], device=out.device)  # slot and made side by side
        return [wide[:, 3:13], ids_pos[:, :1], ids_pos[:, 1:], counters[:1], counters[1:]]
    got, want = views(4), views(4)
    check_steps(got, want, rows=6, steps=1)
    assert int(got[4]) == 10 and torch.equal(got[0][:, 9], want[0][:, 9])
