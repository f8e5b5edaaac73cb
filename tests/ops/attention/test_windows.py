"""attention_windows: every builder against the dense relation it should describe, built here by
brute force from the definitions (loops over tokens, never the module's own intervals):

  - padding: query i (key position i + Nk - Nq) and key j may meet iff both are real tokens;
  - packed rows: iff both are real and in the same sequence, a sequence being a maximal run of
    real tokens whose position ids go up by one;
  - sliding window: the base relation, and key j > p - window for the query at key position p.

Every builder's windows must give that relation from both sides (key windows per query, query
windows per key), so the two sides agree exactly; empty windows are (length, 0).
"""
import random

import pytest
import torch

from lorafuse.ops.attention.windows import (AttentionWindows, UnpaddedWindows, allowed_keys, padding_mask_is_contiguous,
                                            windows_from_padding_mask, windows_from_position_ids,
                                            windows_of_one_query, with_sliding_window)


# ----------------------------------------------------------------------------------------------
# Brute-force relations [B, Nq, Nk] (bool), from the definitions. test_flash_attention.py uses
# them as its masks too.

def padding_relation(mask: torch.Tensor, q_len: int) -> torch.Tensor:
    rows = mask.bool().tolist()
    n_k = len(rows[0])
    rel = [[[bool(row[i + n_k - q_len] and row[j]) for j in range(n_k)] for i in range(q_len)] for row in rows]
    return torch.tensor(rel, dtype=torch.bool).reshape(len(rows), q_len, n_k)


def sequence_ids(position_ids: torch.Tensor, mask: torch.Tensor | None = None) -> list[list[int | None]]:
    """Per token, the index of its sequence (None for padding): a new sequence starts at every real
    token that does not continue the previous token (previous one padding, or position id not +1)."""
    ids = []
    for r, pos in enumerate(position_ids.tolist()):
        real = [True] * len(pos) if mask is None else [bool(m) for m in mask[r].tolist()]
        row, seq = [], -1
        for t in range(len(pos)):
            if not real[t]:
                row.append(None)
                continue
            if t == 0 or not real[t - 1] or pos[t] != pos[t - 1] + 1:
                seq += 1
            row.append(seq)
        ids.append(row)
    return ids


def packed_relation(position_ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    rel = [[[a is not None and a == c for c in row] for a in row] for row in sequence_ids(position_ids, mask)]
    return torch.tensor(rel, dtype=torch.bool).reshape(position_ids.shape[0], position_ids.shape[1],
                                                       position_ids.shape[1])


def sliding_relation(rel: torch.Tensor, window: int) -> torch.Tensor:
    b, n_q, n_k = rel.shape
    out = rel.clone()
    for i in range(n_q):
        for j in range(n_k):
            if not j > i + (n_k - n_q) - window:
                out[:, i, j] = False
    return out


def causal_relation(n_q: int, n_k: int) -> torch.Tensor:
    return torch.tensor([[j <= i + n_k - n_q for j in range(n_k)] for i in range(n_q)], dtype=torch.bool)


# ----------------------------------------------------------------------------------------------
# What windows say, from each side, by loops over their intervals.

def key_side(w: AttentionWindows, n_k: int) -> torch.Tensor:
    lo, hi = w.key_lo.tolist(), w.key_hi.tolist()
    return torch.tensor([[[lo[b][i] <= j < hi[b][i] for j in range(n_k)] for i in range(len(lo[b]))]
                         for b in range(len(lo))], dtype=torch.bool).reshape(len(lo), -1, n_k)


def query_side(w: AttentionWindows, n_q: int) -> torch.Tensor:
    lo, hi = w.query_lo.tolist(), w.query_hi.tolist()
    return torch.tensor([[[lo[b][j] <= i < hi[b][j] for j in range(len(lo[b]))] for i in range(n_q)]
                         for b in range(len(lo))], dtype=torch.bool).reshape(len(lo), n_q, -1)


def describe(rel):
    return "\n".join("".join("x" if a else "." for a in row) for row in rel.tolist())


def check_windows(w: AttentionWindows, rel: torch.Tensor):
    b, n_q, n_k = rel.shape
    assert isinstance(w, AttentionWindows)
    for name, t, shape in zip(w._fields, w, [(b, n_q), (b, n_q), (b, n_k), (b, n_k)]):
        assert t.dtype == torch.int32, f"{name}: {t.dtype}"
        assert tuple(t.shape) == shape, f"{name}: shape {tuple(t.shape)} != {shape}"
        assert t.is_contiguous(), name
    keys, queries = key_side(w, n_k), query_side(w, n_q)
    for r in range(b):
        assert torch.equal(keys[r], rel[r]), f"row {r}: key windows\n{describe(keys[r])}\n!= wanted\n{describe(rel[r])}"
        assert torch.equal(queries[r], rel[r]), \
            f"row {r}: query windows\n{describe(queries[r])}\n!= wanted\n{describe(rel[r])}"
    # exactness then holds; say it directly too: key j in query i's window iff i in j's window
    assert torch.equal(keys, queries)
    # empty windows are canonical, non-empty ones lie inside the sequence
    for lo, hi, length in ((w.key_lo, w.key_hi, n_k), (w.query_lo, w.query_hi, n_q)):
        empty = lo >= hi
        assert torch.all(lo[empty] == length) and torch.all(hi[empty] == 0), \
            f"empty windows must be ({length}, 0): {list(zip(lo[empty].tolist(), hi[empty].tolist()))}"
        assert torch.all((lo[~empty] >= 0) & (hi[~empty] <= length))
    # the module's own dense view (references, SDPA fallback) says the same, on the windows' device (the GPU mode of
    # the op tests makes them on the GPU)
    device = w.key_lo.device
    assert torch.equal(allowed_keys(w, n_q, n_k, False, device).expand(b, n_q, n_k), rel)
    assert torch.equal(allowed_keys(w, n_q, n_k, True, device).expand(b, n_q, n_k), rel & causal_relation(n_q, n_k))


# ----------------------------------------------------------------------------------------------
# Padding masks

PADDING_CASES = {
    # name: (mask rows, q_len)
    "none": ([[1] * 6, [1] * 6], 6),
    "right": ([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]], 6),
    "left": ([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1]], 6),
    "all_padding_row": ([[0, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 1, 1]], 6),
    "middle_run": ([[0, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]], 6),
    "decode_left": ([[0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1]], 1),
    "chunk_left": ([[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0, 0]], 3),
    "decode_right": ([[1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1]], 1),  # the query itself is padding
    "chunk_right": ([[1, 1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0, 0]], 3),  # some queries padding
    "single": ([[1]], 1),
    "single_padding": ([[0]], 1),
}


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float32], ids=str)
@pytest.mark.parametrize("name", PADDING_CASES)
def test_windows_from_padding_mask(name, dtype):
    rows, q_len = PADDING_CASES[name]
    mask = torch.tensor(rows).to(dtype)
    assert padding_mask_is_contiguous(mask)
    check_windows(windows_from_padding_mask(mask, q_len), padding_relation(mask, q_len))


def test_windows_from_padding_mask_random():
    rng = random.Random(1)
    for _ in range(60):
        b, n_k = rng.randint(1, 4), rng.randint(1, 20)
        q_len = rng.choice([1, n_k, rng.randint(1, n_k)])
        rows = []
        for _ in range(b):
            count = rng.randint(0, n_k)
            start = rng.choice([0, n_k - count, rng.randint(0, n_k - count)])
            rows.append([int(start <= t < start + count) for t in range(n_k)])
        mask = torch.tensor(rows)
        check_windows(windows_from_padding_mask(mask, q_len), padding_relation(mask, q_len))


def test_windows_of_one_query_random():
    # A static cache's decode step: one query per row sees the row's run of kept slots, wherever it ends.
    rng = random.Random(2)
    for _ in range(60):
        b, n_k = rng.randint(1, 4), rng.randint(1, 20)
        rows = []
        for _ in range(b):
            count = rng.randint(0, n_k)
            start = rng.randint(0, n_k - count)
            rows.append([int(start <= t < start + count) for t in range(n_k)])
        keep = torch.tensor(rows, dtype=torch.bool)
        check_windows(windows_of_one_query(keep), keep[:, None, :])


@pytest.mark.parametrize("rows, contiguous", [
    ([[1, 1, 1, 1]], True),
    ([[0, 0, 0, 0]], True),
    ([[0, 0, 1, 1], [1, 1, 0, 0]], True),
    ([[0, 1, 1, 0]], True),
    ([[1]], True),
    ([[0]], True),
    ([[1, 0, 1]], False),
    ([[0, 1, 0, 1, 0]], False),
    ([[1, 1, 1, 1], [1, 0, 0, 1]], False),  # one bad row is enough
    ([[0, 0, 0, 0], [0, 1, 1, 1], [1, 1, 0, 1]], False),
], ids=lambda x: str(x).replace(" ", "") if isinstance(x, list) else str(x))
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float32], ids=str)
def test_padding_mask_is_contiguous(rows, contiguous, dtype):
    assert padding_mask_is_contiguous(torch.tensor(rows).to(dtype)) is contiguous


def test_padding_mask_is_contiguous_random():
    rng = random.Random(2)
    for _ in range(200):
        row = [rng.randint(0, 1) for _ in range(rng.randint(1, 12))]
        runs = sum(1 for t, m in enumerate(row) if m and (t == 0 or not row[t - 1]))
        assert padding_mask_is_contiguous(torch.tensor([row])) is (runs <= 1), row


# ----------------------------------------------------------------------------------------------
# Packed rows (position ids)

PACKED_CASES = {
    # name: (position id rows, mask rows or None)
    "one_sequence": ([[0, 1, 2, 3, 4, 5]], None),
    "three_sequences": ([[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 0, 1, 2, 3]], None),
    "length_one_sequences": ([[0, 0, 0, 1, 0, 0]], None),
    "offset_start": ([[5, 6, 7, 0, 1, 2]], None),  # a row may start mid-sequence (continuation)
    "restart_same_id": ([[0, 1, 1, 2, 3, 3]], None),  # a repeated id starts a sequence
    "trailing_padding_zeros": ([[0, 1, 2, 0, 1, 0, 0, 0], [0, 1, 2, 3, 4, 5, 6, 7]],
                               [[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]]),
    "trailing_padding_continuing": ([[0, 1, 2, 0, 1, 2, 3, 4]], [[1, 1, 1, 1, 1, 0, 0, 0]]),
    "trailing_padding_hf_ones": ([[0, 1, 0, 1, 2, 1, 1, 1]], [[1, 1, 1, 1, 1, 0, 0, 0]]),
    "left_padding": ([[1, 1, 1, 0, 1, 2, 0, 1]], [[0, 0, 0, 1, 1, 1, 1, 1]]),
    "all_padding_row": ([[0, 1, 2, 3], [0, 0, 0, 0]], [[1, 1, 1, 1], [0, 0, 0, 0]]),
}


@pytest.mark.parametrize("name", PACKED_CASES)
def test_windows_from_position_ids(name):
    pos, rows = PACKED_CASES[name]
    position_ids = torch.tensor(pos)
    mask = None if rows is None else torch.tensor(rows)
    check_windows(windows_from_position_ids(position_ids, mask), packed_relation(position_ids, mask))


def random_packed(rng, b, n, padding):
    pos, mask = [], []
    for _ in range(b):
        row, real = [], []
        n_real = rng.randint(0, n) if padding else n
        while len(row) < n_real:
            length = rng.randint(1, n_real - len(row))
            row += list(range(length))
        row += rng.choice([[0] * (n - n_real), [1] * (n - n_real), list(range(n_real, n))])
        real = [1] * n_real + [0] * (n - n_real)
        pos.append(row)
        mask.append(real)
    return torch.tensor(pos), torch.tensor(mask)


@pytest.mark.parametrize("padding", [False, True])
def test_windows_from_position_ids_random(padding):
    rng = random.Random(3)
    for _ in range(40):
        position_ids, mask = random_packed(rng, rng.randint(1, 3), rng.randint(1, 16), padding)
        check_windows(windows_from_position_ids(position_ids, mask), packed_relation(position_ids, mask))
        if not padding:
            windows = windows_from_position_ids(position_ids)
            check_windows(windows, packed_relation(position_ids))
            # what UnpaddedWindows promises the kernels (they then skip their NaN guards): no query without keys,
            # no key without queries
            assert isinstance(windows, UnpaddedWindows)
            assert (windows.key_lo < windows.key_hi).all() and (windows.query_lo < windows.query_hi).all()
        else:
            assert not isinstance(windows_from_position_ids(position_ids, mask), UnpaddedWindows)


def test_packed_relation_oracle():
    # the oracle itself, on a case worked by hand: sequences {0,1,2}, {3,4}, padding {5,6}
    rel = packed_relation(torch.tensor([[0, 1, 2, 0, 1, 0, 0]]), torch.tensor([[1, 1, 1, 1, 1, 0, 0]]))[0]
    want = torch.zeros(7, 7, dtype=torch.bool)
    want[:3, :3] = True
    want[3:5, 3:5] = True
    assert torch.equal(rel, want)


# ----------------------------------------------------------------------------------------------
# Sliding windows, on top of each kind of base windows

@pytest.mark.parametrize("window", [1, 2, 3, 5, 100])
@pytest.mark.parametrize("base", ["full", "left", "right", "decode", "chunk", "packed", "packed_padding"])
def test_with_sliding_window(base, window):
    if base in ("packed", "packed_padding"):
        position_ids = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]])
        mask = torch.tensor([[1] * 8 + [0] * 2, [1] * 10]) if base == "packed_padding" else None
        w, rel = windows_from_position_ids(position_ids, mask), packed_relation(position_ids, mask)
    else:
        mask, q_len = {
            "full": ([[1] * 9, [1] * 9], 9),
            "left": ([[0, 0, 0, 1, 1, 1, 1, 1, 1], [0] * 9, [0, 0, 0, 0, 0, 0, 0, 0, 1]], 9),
            "right": ([[1, 1, 1, 1, 1, 1, 0, 0, 0], [1] * 9], 9),
            "decode": ([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 9], 1),
            "chunk": ([[0, 0, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 1, 1]], 4),
        }[base]
        mask = torch.tensor(mask)
        w, rel = windows_from_padding_mask(mask, q_len), padding_relation(mask, q_len)
    n_q, n_k = rel.shape[1:]
    check_windows(with_sliding_window(w, window, n_q, n_k), sliding_relation(rel, window))


def test_sliding_relation_oracle():
    # query at position p sees (p - window, p] under causal: 3 keys for window 3
    rel = sliding_relation(torch.ones(1, 6, 6, dtype=torch.bool), 3) & causal_relation(6, 6)
    assert rel[0].sum(-1).tolist() == [1, 2, 3, 3, 3, 3]
    assert rel[0, 5].tolist() == [False, False, False, True, True, True]
