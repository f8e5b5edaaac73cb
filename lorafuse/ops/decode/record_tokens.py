"""The end of a decode step, in one launch: each row's new token recorded and fed next, the step's counters advanced.

transformers-style bookkeeping takes five small torch kernels here (an index_copy, a copy, three increments); in a
captured decode step each costs a launch's latency. One program does all of it (a batch is at most a few dozen rows).
"""

import triton
import triton.language as tl

from ..._logging import log_once
from ..common.dependent_launch import launch_options, wait_for_inputs
from ..common.tiles import kernels_run_on


def record_tokens_reference(token, out, ids, pos, slot, made) -> None:
    # token: int64 [B]; out: int64 [B, L], the tokens made so far (column made <- token, made < L); ids, pos: int64
    # [B, 1] (ids <- token, pos += 1); slot, made: int64 [1] (+= 1), two tensors (not one aliased)
    out.index_copy_(1, made, token[:, None])
    ids.copy_(token[:, None])
    for counter in (pos, slot, made):
        counter.add_(1)


@triton.jit(do_not_specialize=["rows", "length"])  # one compile for every bucket up to 32 rows
def _record_tokens(token_ptr, out_ptr, ids_ptr, pos_ptr, slot_ptr, made_ptr, rows, length, stride_out, stride_ids,
                   stride_pos, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # grid: (1,); one program for all rows, so that `made` is read before it is advanced. A `made` past out's length
    # writes nothing there (the reference raises; the engine never gets there: prompt + new tokens <= max_length)
    wait_for_inputs(PDL)
    r = tl.arange(0, BLOCK)
    real = r < rows
    made = tl.load(made_ptr)
    token = tl.load(token_ptr + r, mask=real, other=0)
    tl.store(out_ptr + r * stride_out + made, token, mask=real & (r * 0 + made < length))  # vector: the mask's shape
    tl.store(ids_ptr + r * stride_ids, token, mask=real)
    tl.store(pos_ptr + r * stride_pos, tl.load(pos_ptr + r * stride_pos, mask=real, other=0) + 1, mask=real)
    tl.store(slot_ptr, tl.load(slot_ptr) + 1)
    tl.store(made_ptr, made + 1)


def record_tokens(token, out, ids, pos, slot, made) -> None:
    """record_tokens_reference's writes in one launch (no host synchronisation: graph-capturable)."""
    # shapes: see record_tokens_reference
    if not kernels_run_on(token.device):
        log_once("lorafuse.record_tokens: tensors not on a CUDA device run the torch reference (TRITON_INTERPRET=1 "
                 "runs the kernel on CPU)")
        record_tokens_reference(token, out, ids, pos, slot, made)
        return
    rows = token.shape[0]
    if out.shape[0] != rows or ids.shape != (rows, 1) or pos.shape != (rows, 1) or slot.numel() != 1 or \
            made.numel() != 1 or token.stride(0) != 1 or out.stride(1) != 1:
        raise ValueError(f"record_tokens: token {tuple(token.shape)} (contiguous), out {tuple(out.shape)} (unit "
                         f"column stride), ids {tuple(ids.shape)} and pos {tuple(pos.shape)} must be [B], [B, L], "
                         f"[B, 1], [B, 1]; slot and made one element each")
    _record_tokens[(1,)](token, out, ids, pos, slot, made, rows, out.shape[1], out.stride(0), ids.stride(0),
                         pos.stride(0), BLOCK=max(32, triton.next_power_of_2(rows)), num_warps=1,
                         **launch_options(token.device))
