"""Rotary position embedding of q and k for training, forward and backward, as transformers' apply_rotary_pos_emb.

transformers rotates q and k with about ten elementwise kernels a layer (rotate_half's slices, negation and cat, two
products and a sum, for each) and as many backward. Here one kernel each way: a program takes a tile of positions of
one batch row, loads their cos and sin once and rotates every q head and every k head there, in fp32, one rounding
to the output dtype. The backward is the same rotation by the opposite angles (rope_backward_reference); it needs
only cos and sin, so nothing of q or k is kept for it. Outputs are [B, T, H, D] in memory, seen as [B, H, T, D]: the
layout q_proj(x).view(B, T, H, D).transpose(1, 2) gives, which attention reads in place and whose gradient flows back
into q_proj's output without a copy.
"""
import functools

import torch
import triton
import triton.language as tl

from ..common.autograd import functorch_reason
from ..common.kernel_launch import launch
from ..common.tiles import PLANS, LaunchPlan, cdiv, kernels_run_on
from ..common.traceable_log import log_once_traceable

TILE = 2048  # elements of one half-head tile (positions x heads x D/2): each program loads two per step


def rotated(x, cos, sin):
    # x: [B, H, ..., D], cos, sin: [B, ..., D] -> x * cos + rotate_half(x) * sin, cos and sin broadcast over the
    # heads, as transformers' apply_rotary_pos_emb (unsqueeze_dim=1) with its rotate_half (halves, not interleaved)
    half = x.shape[-1] // 2
    rotate_half = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos[:, None] + rotate_half * sin[:, None]


def rope_reference(q, k, cos, sin):
    # q: [B, Hq, T, D], k: [B, Hk, T, D], cos, sin: [B | 1, T, D] -> q, k rotated, as transformers'
    # apply_rotary_pos_emb(q, k, cos, sin)
    return rotated(q, cos, sin), rotated(k, cos, sin)


def rope_backward_reference(dq_out, dk_out, cos, sin):
    # dq_out: [B, Hq, T, D], dk_out: [B, Hk, T, D], cos, sin: [B | 1, T, D] -> dq, dk (D even)
    # out1 = x1 c1 - x2 s1, out2 = x2 c2 + x1 s2 (halves 1, 2 of D) give dx1 = g1 c1 + g2 s2, dx2 = g2 c2 - g1 s1:
    # the forward's rotation with sin' = (-s2 | -s1), by the opposite angles where sin's halves agree (RoPE's do)
    return rope_reference(dq_out, dk_out, cos, -sin.roll(sin.shape[-1] // 2, -1))


@triton.jit
def _rotate_heads(x_ptr, y_ptr, heads, stride_h, stride_t, t, d, mask_td, cos1, cos2, sin1, sin2,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    # x: one batch row's [H, T, D] (strides stride_h, stride_t, 1), y: its [T, H, D] contiguous; t: [BLOCK_T, 1, 1]
    # int64 positions, d: [1, 1, HALF_BLOCK]; cos1, cos2, sin1, sin2: [BLOCK_T, 1, HALF_BLOCK] fp32, the halves of
    # cos and sin. Heads BLOCK_H at a time
    for h0 in tl.range(0, heads, BLOCK_H):
        h = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)[None, :, None]
        mask = mask_td & (h < heads)
        x_offs = t * stride_t + h * stride_h + d
        y_offs = (t * heads + h) * (2 * HALF) + d
        x1 = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + x_offs + HALF, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + y_offs, (x1 * cos1 - x2 * sin1).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(y_ptr + y_offs + HALF, (x2 * cos2 + x1 * sin2).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, T, n_q_heads, n_k_heads,
                 stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_cb, stride_ct,
                 HALF: tl.constexpr, HALF_BLOCK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HQ: tl.constexpr,
                 BLOCK_HK: tl.constexpr, BACKWARD: tl.constexpr):
    # q: [B, Hq, T, D], k: [B, Hk, T, D] (unit stride along D); cos, sin: [B, T, D] alike strided (stride_cb 0: one
    # row for all); qo: [B, T, Hq, D], ko: [B, T, Hk, D] contiguous. Grid: (cdiv(T, BLOCK_T), B). BACKWARD: q, k are
    # the outputs' gradients, rotated back (rope_backward_reference)
    b = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, HALF_BLOCK)[None, None, :]
    mask_td = (t < T)[:, None, None] & (d < HALF)
    t = t.to(tl.int64)[:, None, None]
    cs = b * stride_cb + t * stride_ct + d
    cos1 = tl.load(cos_ptr + cs, mask=mask_td, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + cs + HALF, mask=mask_td, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + cs, mask=mask_td, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + cs + HALF, mask=mask_td, other=0.0).to(tl.float32)
    if BACKWARD:
        sin1, sin2 = -sin2, -sin1
    _rotate_heads(q_ptr + b * stride_qb, qo_ptr + b * T * n_q_heads * (2 * HALF), n_q_heads, stride_qh, stride_qt, t,
                  d, mask_td, cos1, cos2, sin1, sin2, HALF, BLOCK_HQ)
    _rotate_heads(k_ptr + b * stride_kb, ko_ptr + b * T * n_k_heads * (2 * HALF), n_k_heads, stride_kh, stride_kt, t,
                  d, mask_td, cos1, cos2, sin1, sin2, HALF, BLOCK_HK)


def _unsupported_reason(q, k, cos, sin) -> str | None:
    if not kernels_run_on(q.device):
        return "tensors not on a CUDA device run the PyTorch reference (TRITON_INTERPRET=1 runs the kernel on CPU)"
    if (q.dtype != k.dtype or cos.dtype != sin.dtype
            or not {q.dtype, cos.dtype} <= {torch.float32, torch.float16, torch.bfloat16}):
        return f"q {q.dtype}, k {k.dtype}, cos {cos.dtype}, sin {sin.dtype} run the PyTorch reference"
    if (q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape or q.shape[0] != k.shape[0]
            or q.shape[2:] != k.shape[2:] or cos.shape[1:] != q.shape[2:] or cos.shape[0] not in (1, q.shape[0])
            or q.shape[-1] % 2 or q.numel() == 0 or k.numel() == 0):
        return (f"q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)} are not "
                "[B, Hq, T, D], [B, Hk, T, D], [B | 1, T, D] with D even: the PyTorch reference runs")
    if cos.requires_grad or sin.requires_grad:
        return "cos or sin needs a gradient, which the kernels do not give: the PyTorch reference runs"
    if not q.device == k.device == cos.device == sin.device:
        return "q, k, cos and sin on different devices run the PyTorch reference"
    return None


@functools.lru_cache(maxsize=PLANS)
def _launch_plan(batch: int, n: int, head_dim: int, n_q_heads: int, n_k_heads: int, backward: bool) -> LaunchPlan:
    """The kernel's tile shape for a head dim and head counts: a tile of up to TILE elements per half of the heads,
    as many heads as fit, then positions; one program a block of positions of one sequence."""
    half_block = triton.next_power_of_2(head_dim // 2)
    heads = max(1, TILE // half_block)
    block_hq, block_hk = (min(triton.next_power_of_2(n), heads) for n in (n_q_heads, n_k_heads))
    block_t = max(1, TILE // (max(block_hq, block_hk) * half_block))
    return LaunchPlan((cdiv(n, block_t), batch), (), dict(
        BACKWARD=backward, HALF=head_dim // 2, HALF_BLOCK=half_block, BLOCK_HQ=block_hq, BLOCK_HK=block_hk,
        BLOCK_T=block_t, num_warps=4))


def _outputs(x_q, x_k, dtype):
    # x_q: [B, Hq, T, D], x_k: [B, Hk, T, D] -> two new [B, T, H, D] tensors of `dtype`, seen as [B, H, T, D]
    batch, _, n, d = x_q.shape
    return tuple(torch.empty(batch, n, x.shape[1], d, device=x.device, dtype=dtype).transpose(1, 2)
                 for x in (x_q, x_k))


def _launch(x_q, x_k, cos, sin, dtype, backward: bool):
    # x_q: [B, Hq, T, D], x_k: [B, Hk, T, D], cos, sin: [B | 1, T, D] -> x_q, x_k rotated (backward: rotated back)
    # into _outputs of `dtype`
    if x_q.stride(-1) != 1 or x_k.stride(-1) != 1:
        x_q, x_k = x_q.contiguous(), x_k.contiguous()
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    batch, n_q_heads, n, d = x_q.shape
    y_q, y_k = _outputs(x_q, x_k, dtype)
    launch(_rope_kernel, _launch_plan(batch, n, d, n_q_heads, x_k.shape[1], backward),
           x_q, x_k, cos, sin, y_q, y_k, n, n_q_heads, x_k.shape[1], *x_q.stride()[:3], *x_k.stride()[:3],
           cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1))
    return y_q, y_k


def _out_dtype(q, cos):
    return torch.promote_types(q.dtype, cos.dtype)  # as q * cos: bf16 q and fp32 cos give fp32


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        # q: [B, Hq, T, D], k: [B, Hk, T, D], cos, sin: [B | 1, T, D] -> q, k rotated
        ctx.save_for_backward(cos, sin)
        ctx.dtype = q.dtype
        return _launch(q, k, cos, sin, _out_dtype(q, cos), backward=False)

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        cos, sin = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the gradients are linear in dq_out, dk_out; no q, k needed
            dq, dk = rope_backward_reference(dq_out, dk_out, cos, sin)
            return dq.to(ctx.dtype), dk.to(ctx.dtype), None, None
        return *_launch(dq_out, dk_out, cos, sin, ctx.dtype, backward=True), None, None


# The same launches as custom ops, which torch.compile traces through (the Function above costs less host time per
# call in eager mode, so eager calls keep it). Double backward is not theirs to give: compiled graphs have none.

@torch.library.custom_op("lorafuse::rope", mutates_args=())
def _rope_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # q: [B, Hq, T, D], k: [B, Hk, T, D], cos, sin: [B | 1, T, D] -> q, k rotated, [B, T, H, D] in memory
    return _launch(q, k, cos, sin, _out_dtype(q, cos), backward=False)


@_rope_op.register_fake
def _rope_fake(q, k, cos, sin):
    return _outputs(q, k, _out_dtype(q, cos))


@torch.library.custom_op("lorafuse::rope_backward", mutates_args=())
def _rope_backward_op(dq_out: torch.Tensor, dk_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # dq_out: [B, Hq, T, D], dk_out: [B, Hk, T, D] -> dq, dk of `dtype` (q's), [B, T, H, D] in memory
    return _launch(dq_out, dk_out, cos, sin, dtype, backward=True)


@_rope_backward_op.register_fake
def _rope_backward_fake(dq_out, dk_out, cos, sin, dtype):
    return _outputs(dq_out, dk_out, dtype)


def _rope_setup_context(ctx, inputs, output):
    q, _, cos, sin = inputs
    ctx.save_for_backward(cos, sin)
    ctx.dtype = q.dtype


def _rope_op_backward(ctx, dq_out, dk_out):
    return *_rope_backward_op(dq_out, dk_out, *ctx.saved_tensors, ctx.dtype), None, None


_rope_op.register_autograd(_rope_op_backward, setup_context=_rope_setup_context)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_reference's (q, k), differentiable in q and k: one kernel forward, one backward, each for q and k
    together. Returned as [B, H, T, D] views of [B, T, H, D] tensors. Inputs the kernels do not take run the
    reference, the reason logged once. Under torch.compile, the custom op lorafuse::rope."""
    # q: [B, Hq, T, D], k: [B, Hk, T, D], cos, sin: [B | 1, T, D] -> [B, Hq, T, D], [B, Hk, T, D]
    reason = functorch_reason(q, k, cos, sin) or _unsupported_reason(q, k, cos, sin)
    if reason is not None:
        log_once_traceable(f"lorafuse.rope: {reason}")
        return rope_reference(q, k, cos, sin)
    if torch.compiler.is_compiling():
        return _rope_op(q, k, cos, sin)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _Rope.apply(q, k, cos, sin)
    return _launch(q, k, cos, sin, _out_dtype(q, cos), backward=False)
