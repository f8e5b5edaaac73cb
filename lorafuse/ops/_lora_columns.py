"""The Triton helper that the decode-step kernels share: columns of a GEMM row over stacked weights [W; A], plus
their adapter's expand, read from the same row's shrink s = x A^T."""
import triton
import triton.language as tl


def rank_tile(*ranks: int) -> int:
    """R for columns_with_lora: the largest rank rounded up to a power of two, 0 when no projection has an adapter
    (the expand is then compiled out)."""
    return triton.next_power_of_2(max(ranks)) if max(ranks) > 0 else 0


@triton.jit
def columns_with_lora(row_ptr, cols, b_ptr, b_rows, stride_b, rank, s_col, scale, mask, R: tl.constexpr):
    # row[cols] + scale * s B[b_rows]^T in fp32, s = row[s_col:s_col + rank]; R: rank_tile (0: no adapter, B
    # unread). B's rows are read whole, as one [columns, R] tile: rows of B are contiguous, so the loads coalesce.
    x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if R > 0:
        ranks = tl.arange(0, R)
        s = tl.load(row_ptr + s_col + ranks, mask=ranks < rank, other=0.0).to(tl.float32) * scale
        b = tl.load(b_ptr + b_rows[:, None] * stride_b + ranks[None, :], mask=mask[:, None] & (ranks < rank)[None, :],
                    other=0.0)
        x += tl.sum(b.to(tl.float32) * s[None, :], axis=1)
    return x
