"""Row-wise argmax over a long last dimension: a decode step's choice of the next token from its logits.

torch.argmax reduces a row in one thread block, slow on a row of Llama-3's 128256 logits (a visible share of a
Llama-1B decode step in `bench_decode.py --profile`). Here each row is cut into chunks, one program each, and a second
launch picks the first chunk holding the row's maximum. The result is torch.argmax's: the first index of the maximum,
and a NaN counts as larger than any number (the first NaN wins).
"""

import torch
import triton
import triton.language as tl

from ..._logging import log_once
from ..common.tiles import kernels_run_on

BLOCK = 4096  # elements per program: 32 programs for a row of 128256
NO_INDEX = 2**31 - 1  # larger than any index of a row


def argmax_reference(x: torch.Tensor) -> torch.Tensor:
    # x: [B, V] -> int64 [B]
    return x.argmax(-1)


@triton.jit
def _first_max(values, index, valid, NONE: tl.constexpr):
    # (value, index) of the first maximum among the valid lanes, a NaN above every number; the value is NaN where
    # one was found, -inf where no lane is valid (index NONE then)
    nan = (values != values) & valid
    first_nan = tl.min(tl.where(nan, index, NONE), 0)
    numbers = tl.where(nan | ~valid, -float("inf"), values)
    top = tl.max(numbers, 0)
    first_top = tl.min(tl.where((numbers == top) & valid, index, NONE), 0)
    found_nan = first_nan < NONE
    return tl.where(found_nan, float("nan"), top), tl.where(found_nan, first_nan, first_top)


@triton.jit
def _chunk_argmax(x_ptr, part_value_ptr, part_index_ptr, n, stride, chunks, BLOCK: tl.constexpr,
                  NONE: tl.constexpr):
    # grid: (B, chunks); x: [B, n] (row stride `stride`); part_value, part_index: [B, chunks]
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    x = tl.load(x_ptr + row * stride + offs, mask=valid, other=0.0).to(tl.float32)
    value, index = _first_max(x, offs, valid, NONE)
    tl.store(part_value_ptr + row * chunks + tl.program_id(1), value)
    tl.store(part_index_ptr + row * chunks + tl.program_id(1), index)


@triton.jit
def _pick_chunk(part_value_ptr, part_index_ptr, out_ptr, chunks, CHUNKS: tl.constexpr, NONE: tl.constexpr):
    # grid: (B,); the chunks are in index order, so the first chunk holding the row's maximum holds its first one
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS)
    valid = c < chunks
    values = tl.load(part_value_ptr + row * chunks + c, mask=valid, other=0.0)
    indices = tl.load(part_index_ptr + row * chunks + c, mask=valid, other=0)
    _, chunk = _first_max(values, c, valid, NONE)
    tl.store(out_ptr + row, tl.sum(tl.where(c == chunk, indices, 0), 0).to(tl.int64))


def _unsupported_reason(x: torch.Tensor) -> str | None:
    if not kernels_run_on(x.device):
        return "tensors not on a CUDA device run torch.argmax (TRITON_INTERPRET=1 runs the kernels on CPU)"
    if x.dim() != 2 or x.shape[0] == 0 or x.shape[1] == 0 or x.shape[1] >= NO_INDEX:
        return f"a tensor of shape {tuple(x.shape)} runs torch.argmax (the kernels take [B, V], 0 < V < 2^31 - 1)"
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or x.stride(1) != 1:
        return f"{x.dtype} or non-unit last stride runs torch.argmax"
    return None


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) of a [B, V] float tensor in two launches (no host synchronisation: graph-capturable)."""
    # x: [B, V] -> int64 [B]
    reason = _unsupported_reason(x)
    if reason is not None:
        log_once(f"lorafuse.argmax_rows: {reason}")
        return argmax_reference(x)
    rows, n = x.shape
    chunks = triton.cdiv(n, BLOCK)
    part_value = torch.empty(rows, chunks, device=x.device, dtype=torch.float32)
    part_index = torch.empty(rows, chunks, device=x.device, dtype=torch.int32)
    out = torch.empty(rows, device=x.device, dtype=torch.int64)
    _chunk_argmax[(rows, chunks)](x, part_value, part_index, n, x.stride(0), chunks, BLOCK=BLOCK, NONE=NO_INDEX,
                                  num_warps=8)
    _pick_chunk[(rows,)](part_value, part_index, out, chunks, CHUNKS=triton.next_power_of_2(chunks), NONE=NO_INDEX)
    return out
