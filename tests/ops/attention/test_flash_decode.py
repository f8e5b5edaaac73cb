"""flash_decode (the no-grad forward for a few query rows against a longer cache, reached through
flash_attention) against the float64 oracle of test_flash_attention.py, by docs/design.md's rule: GQA
rows stacked in one tile, the keys split in chunks and merged, padding (NaN) and windows."""
import math

import pytest
import torch

from lorafuse.ops.attention import flash_decode as decode_module
from lorafuse.ops.attention.windows import windows_from_padding_mask, with_sliding_window
from lorafuse.ops.attention.flash_attention import flash_attention
from tests.ops._helpers import DTYPES, assert_close, dtype_id
from tests.ops.attention.test_windows import padding_relation, sliding_relation
from tests.ops.attention.test_flash_attention import dense_mask, fill_padding, oracle, plain, qkv


@pytest.fixture
def decode_calls(monkeypatch):
    """Counts calls of the decode kernel, so that each test knows it ran that path."""
    calls = []
    real = decode_module.flash_decode

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr("lorafuse.ops.attention.flash_attention.flash_decode", counted)
    return calls


def check_decode(q, k, v, causal, windows, allowed, dtype, calls):
    # q: [B, Hq, Nq, D]; allowed: [B, Nq, Nk], the oracle's relation
    scale = q.shape[-1] ** -0.5
    with torch.no_grad():
        got = flash_attention(q, k, v, causal=causal, windows=windows)
        exact = oracle(q, k, v, allowed, scale)
        torch_out = None if dtype == torch.float32 else plain(q, k, v, allowed, scale)
    assert calls, "the decode kernel did not run"
    assert_close(got, exact, dtype, torch_out, "flash_decode out")


CASES = [  # (B, Hq, Hkv, Nq, Nk, D)
    (2, 4, 4, 1, 37, 16),      # no GQA, one query
    (3, 8, 2, 1, 300, 32),     # GQA 4, many chunks
    (2, 8, 1, 1, 129, 16),     # GQA 8 (multi-query)
    (2, 4, 1, 16, 130, 16),    # a 16-query chunk of prefill against a cache
    (1, 4, 2, 3, 200, 80),     # head dim 80 in a 128-wide tile
]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}_Hq{}_Hkv{}_Nq{}_Nk{}_D{}".format(*c))
def test_decode(case, causal, dtype, decode_calls):
    b, hq, hkv, n_q, n_k, d = case
    q, k, v = qkv(b, hq, hkv, n_q, n_k, d, dtype)
    check_decode(q, k, v, causal, None, dense_mask(b, n_q, n_k, causal), dtype, decode_calls)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("n_q", [1, 5])
def test_decode_left_padded_with_nan(n_q, dtype, decode_calls):
    b, hq, hkv, n_k, d = 3, 8, 2, 150, 32
    mask = torch.ones(b, n_k, dtype=torch.bool)
    mask[0, :70] = False        # left padding
    mask[2, : n_k - 1] = False  # one real token: the last query's own key
    q, k, v = qkv(b, hq, hkv, n_q, n_k, d, dtype)
    q, k, v = fill_padding(q, k, v, mask, n_q, math.nan)
    windows = windows_from_padding_mask(mask, n_q)
    allowed = dense_mask(b, n_q, n_k, True, padding_relation(mask, n_q))
    check_decode(q, k, v, True, windows, allowed, dtype, decode_calls)
    with torch.no_grad():
        out = flash_attention(q, k, v, causal=True, windows=windows)
    real_q = mask[:, n_k - n_q:]
    assert torch.equal(out.transpose(1, 2)[~real_q], torch.zeros_like(out.transpose(1, 2)[~real_q]))


@pytest.mark.parametrize("window", [1, 40])
def test_decode_sliding_window(window, decode_calls):
    b, hq, hkv, n_q, n_k, d = 2, 4, 2, 2, 160, 16
    q, k, v = qkv(b, hq, hkv, n_q, n_k, d, torch.float32)
    full = windows_from_padding_mask(torch.ones(b, n_k, dtype=torch.bool), n_q)
    windows = with_sliding_window(full, window, n_q, n_k)
    allowed = sliding_relation(dense_mask(b, n_q, n_k, True), window)
    check_decode(q, k, v, True, windows, allowed, torch.float32, decode_calls)


def test_decode_is_deterministic(decode_calls):
    q, k, v = qkv(2, 8, 2, 1, 300, 32, torch.bfloat16)
    with torch.no_grad():
        first = flash_attention(q, k, v, causal=True)
        second = flash_attention(q, k, v, causal=True)
    assert len(decode_calls) == 2 and torch.equal(first, second)
