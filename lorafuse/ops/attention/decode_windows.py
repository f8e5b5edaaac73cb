"""The attention windows of a decode step, one query per row, from its keep-mask of cache slots, in one launch.

`attention_windows.windows_of_one_query` (the reference) builds them with about seventeen small torch kernels (a
sum, an argmax, casts, wheres), which in a captured Llama-1B decode step cost about as much as a decoder layer's
attention. Here one program per row reads its mask once: the row's kept slots are one contiguous run (a static cache:
left padding, then the slots written so far), so its key window is [first kept slot, first + count).
"""

import torch
import triton
import triton.language as tl

from ..._logging import log_once
from ..common.dependent_launch import launch_options, wait_for_inputs
from ..common.tiles import kernels_run_on
from .windows import AttentionWindows, windows_of_one_query

BLOCK = 1024  # mask slots per step of a program's loop


def one_query_windows_reference(keep: torch.Tensor) -> AttentionWindows:
    # keep: bool [B, Nk], one contiguous run per row (not checked)
    return windows_of_one_query(keep)


@triton.jit
def _one_query_windows(keep_ptr, key_lo_ptr, key_hi_ptr, query_lo_ptr, query_hi_ptr, n_k, stride_keep,
                       BLOCK: tl.constexpr, PDL: tl.constexpr):
    # grid: (B,); keep: bool [B, Nk] (row stride stride_keep); key_lo, key_hi: int32 [B]; query_lo, query_hi: int32
    # [B, Nk]. Empty windows as attention_windows stores them: (length, 0).
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    count = 0
    first = n_k
    for start in range(0, n_k, BLOCK):
        slots = start + offs
        inside = slots < n_k
        kept = tl.load(keep_ptr + row * stride_keep + slots, mask=inside, other=0) != 0
        count += tl.sum(kept.to(tl.int32), axis=0)
        first = tl.minimum(first, tl.min(tl.where(kept, slots, n_k), axis=0))
        # the one query sees a kept key: its query window is [0, 1), else empty (1, 0)
        tl.store(query_lo_ptr + row * n_k + slots, tl.where(kept, 0, 1), mask=inside)
        tl.store(query_hi_ptr + row * n_k + slots, tl.where(kept, 1, 0), mask=inside)
    empty = count == 0
    tl.store(key_lo_ptr + row, tl.where(empty, n_k, first))
    tl.store(key_hi_ptr + row, tl.where(empty, 0, first + count))


def _unsupported_reason(keep: torch.Tensor) -> str | None:
    if not kernels_run_on(keep.device):
        return "tensors not on a CUDA device run the torch reference (TRITON_INTERPRET=1 runs the kernel on CPU)"
    if keep.dim() != 2 or keep.dtype != torch.bool or keep.stride(1) != 1 or 0 in keep.shape:
        return f"a {keep.dtype} mask of shape {tuple(keep.shape)} runs the torch reference (the kernel takes a bool " \
               "[B, Nk] with unit last stride)"
    return None


def one_query_windows(keep: torch.Tensor) -> AttentionWindows:
    """windows_of_one_query(keep) in one launch, without host synchronisation (graph-capturable)."""
    # keep: bool [B, Nk], one contiguous run per row -> key windows int32 [B, 1], query windows int32 [B, Nk]
    reason = _unsupported_reason(keep)
    if reason is not None:
        log_once(f"lorafuse.one_query_windows: {reason}")
        return one_query_windows_reference(keep)
    rows, n_k = keep.shape
    key_lo, key_hi = (torch.empty(rows, 1, dtype=torch.int32, device=keep.device) for _ in range(2))
    query_lo, query_hi = (torch.empty(rows, n_k, dtype=torch.int32, device=keep.device) for _ in range(2))
    _one_query_windows[(rows,)](keep, key_lo, key_hi, query_lo, query_hi, n_k, keep.stride(0),
                                BLOCK=min(BLOCK, triton.next_power_of_2(n_k)), num_warps=4,
                                **launch_options(keep.device))
    return AttentionWindows(key_lo, key_hi, query_lo, query_hi)
