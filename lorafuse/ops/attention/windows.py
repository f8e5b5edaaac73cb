"""Which keys each query may attend, as per-row intervals instead of an N x N mask.

Padding (left or right), packed sequences and sliding windows all give every query a
contiguous interval of keys [key_lo, key_hi); the causal limit (key <= query + Nk - Nq, the
diagonal aligned to the end) is applied by the kernel on top. The kernel also needs the
transpose - for every key, the interval of queries [query_lo, query_hi) whose windows hold
it - to skip whole tiles in the backward. Both sides must describe the same relation
exactly: key j lies in query i's window if and only if query i lies in key j's window.

An empty window is stored as (lo, hi) = (length, 0), so that the min of `lo` and the max of
`hi` over a tile ignore it. Everything here is torch on the device (no host sync), so it can
run inside a captured CUDA graph.
"""
from typing import NamedTuple

import torch


class AttentionWindows(NamedTuple):
    key_lo: torch.Tensor    # int32 [B, Nq]: first key query i may attend
    key_hi: torch.Tensor    # int32 [B, Nq]: one past its last key
    query_lo: torch.Tensor  # int32 [B, Nk]: first query that may attend key j
    query_hi: torch.Tensor  # int32 [B, Nk]: one past the last one


class UnpaddedWindows(AttentionWindows):
    """Windows in which every query has keys and every key is seen (packed sequences without padding): no row is
    padding, so flash_attention need not zero padding rows (a pass over q, k, v and dO) before its kernels."""
    __slots__ = ()


def _empty_to_canonical(lo: torch.Tensor, hi: torch.Tensor, length: int):
    empty = lo >= hi
    return (torch.where(empty, length, lo).to(torch.int32).contiguous(),
            torch.where(empty, 0, hi).to(torch.int32).contiguous())


def padding_mask_is_contiguous(mask: torch.Tensor) -> bool:
    """Whether each row of a [B, Nk] keep-mask is one run of ones (left or right padding, or
    none). Reads the result on the host: call it outside CUDA-graph capture."""
    # mask: [B, Nk]
    keep = mask.bool().to(torch.int32)
    starts = (keep[:, 1:] > keep[:, :-1]).sum(-1) + keep[:, 0]  # steps from 0 to 1, a leading 1 counts
    return bool((starts <= 1).all())


def windows_from_padding_mask(mask: torch.Tensor, q_len: int) -> AttentionWindows:
    """Windows of a padded batch: `mask` [B, Nk] keeps the keys that are real tokens (one
    contiguous run per row, see `padding_mask_is_contiguous`). The q_len queries are the last
    q_len positions of the keys (a prefill has q_len = Nk, a decode step q_len = 1); a query
    that is itself padding gets an empty window."""
    # mask: [B, Nk]
    keep = mask.bool()
    n_k = keep.shape[-1]
    count = keep.sum(-1)                                   # [B]
    start = torch.where(count > 0, keep.to(torch.int32).argmax(-1), 0)
    end = start + count
    positions = torch.arange(n_k - q_len, n_k, device=mask.device)  # queries' key positions
    q_real = (positions >= start[:, None]) & (positions < end[:, None])        # [B, Nq]
    key_lo, key_hi = _empty_to_canonical(torch.where(q_real, start[:, None], n_k),
                                         torch.where(q_real, end[:, None], 0), n_k)
    # A real key is seen by every real query: those at positions [start, end), as query rows.
    q_first = (start - (n_k - q_len)).clamp(0, q_len)
    q_last = (end - (n_k - q_len)).clamp(0, q_len)
    keys = torch.arange(n_k, device=mask.device)
    k_real = (keys >= start[:, None]) & (keys < end[:, None])                  # [B, Nk]
    query_lo, query_hi = _empty_to_canonical(torch.where(k_real, q_first[:, None], q_len),
                                             torch.where(k_real, q_last[:, None], 0), q_len)
    return AttentionWindows(key_lo, key_hi, query_lo, query_hi)


def windows_of_one_query(keep: torch.Tensor) -> AttentionWindows:
    """Windows of one query per row (a decode step) whose keys are the kept slots of `keep` [B, Nk], the caller
    guaranteeing one contiguous run per row (a static cache: left padding, then the slots written so far).
    Nothing is checked on the host, so that a captured decode step can build them."""
    # keep: bool [B, Nk]
    keep = keep.bool()
    n_k = keep.shape[-1]
    count = keep.sum(-1, keepdim=True)                     # [B, 1]
    start = torch.where(count > 0, keep.to(torch.int32).argmax(-1, keepdim=True), 0)
    key_lo, key_hi = _empty_to_canonical(start, start + count, n_k)
    query_lo, query_hi = _empty_to_canonical(torch.zeros_like(keep, dtype=torch.int32), keep.to(torch.int32), 1)
    return AttentionWindows(key_lo, key_hi, query_lo, query_hi)


def windows_from_position_ids(position_ids: torch.Tensor, mask: torch.Tensor | None = None) -> AttentionWindows:
    """Windows of packed rows: a sequence starts wherever the position id does not continue the
    previous one (position_ids [B, N]; queries and keys are the same N tokens). Tokens attend
    only within their own sequence. `mask` [B, N], if given, also drops padding tokens."""
    # position_ids: [B, N]; computed in int32, the windows' dtype, in few ops (this runs once per forward)
    n = position_ids.shape[-1]
    idx = torch.arange(n, device=position_ids.device, dtype=torch.int32)
    starts = position_ids != position_ids.roll(1, -1) + 1
    starts[:, :1] = True
    if mask is not None:
        real = mask.bool()
        starts |= real != real.roll(1, -1)  # padding never shares a sequence with tokens
    lo = torch.where(starts, idx, 0).cummax(-1).values                          # own sequence's start
    # own sequence's end: the next start to the right, or n (rolled left, the first column's start marks the last
    # token as an end), by a reversed running minimum
    hi = torch.where(starts.roll(-1, -1), idx + 1, n).flip(-1).cummin(-1).values.flip(-1)
    if mask is None:  # every token attends at least to itself, and is attended by itself: no window is empty
        return UnpaddedWindows(lo, hi, lo, hi)
    hi = torch.where(real, hi, 0)  # padding sees nothing; its sequences hold no real token
    key_lo, key_hi = _empty_to_canonical(lo, hi, n)
    return AttentionWindows(key_lo, key_hi, key_lo, key_hi)


def with_sliding_window(windows: AttentionWindows, window: int, n_q: int, n_k: int) -> AttentionWindows:
    """Narrow causal windows to the last `window` keys of each query (Mistral-style: query at
    key position p sees keys (p - window, p])."""
    # key position of query i is i + n_k - n_q
    pos_q = torch.arange(n_q, device=windows.key_lo.device) + (n_k - n_q)
    key_lo = torch.maximum(windows.key_lo, pos_q - window + 1)
    keys = torch.arange(n_k, device=windows.key_lo.device)
    query_hi = torch.minimum(windows.query_hi, keys + window - (n_k - n_q))
    key_lo, key_hi = _empty_to_canonical(key_lo, windows.key_hi, n_k)
    query_lo, query_hi = _empty_to_canonical(windows.query_lo, query_hi, n_q)
    return AttentionWindows(key_lo, key_hi, query_lo, query_hi)


def allowed_keys(windows: AttentionWindows | None, n_q: int, n_k: int, causal: bool, device) -> torch.Tensor:
    """The dense [B or 1, Nq, Nk] bool relation: for references and the SDPA fallback only."""
    i = torch.arange(n_q, device=device)[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    allowed = torch.ones(1, n_q, n_k, dtype=torch.bool, device=device)
    if causal:
        allowed = allowed & (j <= i + (n_k - n_q))
    if windows is not None:
        allowed = allowed & (j >= windows.key_lo[:, :, None]) & (j < windows.key_hi[:, :, None])
    return allowed
