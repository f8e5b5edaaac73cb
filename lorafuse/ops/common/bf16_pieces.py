"""float32 operands as three bfloat16 pieces: hi + mid + lo == t (each piece rounds what the previous left).

PEFT keeps adapters in float32 on a bf16 model and runs their products in float32. A bf16 activation is exact
in bf16, and a product of two bf16 numbers is exact in the tensor cores' fp32 accumulator, so
x @ A == x @ hi + x @ mid + x @ lo: three bf16 dots give the float32 product up to the accumulation, at 16-bit
tensor-core speed, where tf32x3 splits both operands in every tile and runs fp32-sized tiles. The tensor cores'
adds truncate: reductions over a long K add each step's three products to their fp32 sum with one rounded add
(`dot_pieces`). Chained inside the tensor cores instead, the sums drifted 5-25x past PyTorch's fp32
error (K of 4096-14336).
The kernels split every fp32 tile they load (the adapters' A and B, s, ds) in registers (`split_bf16`): no launch
makes pieces ahead of them. Where both operands are fp32 (lora_matmul's epilogue: s times B) the kernel keeps the three
largest of the nine piece products (the term to about 2^-17 of itself, under its bf16 output's rounding). fp16
activations are not exact in bf16: they keep tf32x3.
"""
import torch
import triton
import triton.language as tl

from .tiles import lora_in_fp32

PIECES = 3  # 3 x (8 + 1) bits cover float32's 24-bit significand


def uses_bf16_pieces(x_dtype: torch.dtype, adapter_dtype: torch.dtype, mode: str | None = None) -> bool:
    """Whether the big rank-r products of float32 adapters on bf16 activations run on bf16 pieces (mode: as
    lora_in_fp32's)."""
    return x_dtype == torch.bfloat16 and lora_in_fp32(x_dtype, adapter_dtype, mode)


def bf16_pieces_reference(t: torch.Tensor) -> torch.Tensor:
    # t: [...] float32 -> [3, ...] bfloat16
    pieces, rest = [], t.float()
    for _ in range(PIECES):
        piece = rest.to(torch.bfloat16)
        pieces.append(piece)
        rest = rest - piece.float()
    return torch.stack(pieces)


@triton.jit
def split_bf16(t):
    # t: fp32 tile -> (hi, mid, lo) bf16 tiles, hi + mid + lo == t; each difference is exact in fp32
    hi = t.to(tl.bfloat16)
    rest = t - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def dot_pieces(a, hi, mid, lo, acc):
    # acc + a @ (hi + mid + lo): the three products summed smallest first in a fresh tensor-core accumulator, which
    # joins acc in one rounded fp32 add. Hopper's tensor cores truncate what they accumulate; chained through a long
    # reduction the running sum drifted (shrink of x 8192 x 4096: 1.4e-5 relative, PyTorch's fp32 5.7e-7).
    return acc + tl.dot(a, hi, tl.dot(a, mid, tl.dot(a, lo)))
