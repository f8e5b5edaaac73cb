"""The fused LoRA linear op: y = act(x W^T + scale * (dropout(x) A^T) B^T + bias).

`lora_linear` is the entry point: Triton kernels on CUDA (and on CPU under TRITON_INTERPRET=1),
`lora_linear_reference` otherwise, with the reason logged once.

The routes, all decided in `_route` from the call's shape, dtypes and mode (LORAFUSE_GEMM=auto|cublas|triton, or the
`gemm` argument, forces the frozen-GEMM back-end):
  "cublas"  training sizes: the shrink kernel (dropout drawn in it) makes s, lora_expand writes scale * s B^T + bias
            into y and cuBLAS adds x W^T into it (addmm, beta=1). Backward: one pass over dy (ds, dB), one over x
            (dA and the dropout-masked dx term), then cuBLAS adds g W into dx. Few launches a layer, each cheap on
            the host: the eager training step is bound by the host's launches as much as by the GPU.
  "triton"  up to 64 rows with 16-bit adapter math: one Triton GEMM with the shrink in its K-loop and the rank-r term
            in its epilogue (forced on more rows: the shrink kernel, then that GEMM); without dropout the backward's
            dx GEMM adds ds A in its epilogue.
  "decode"  inference on at most 16 rows without dropout: lora_decode's split-K GEMV kernels.
  "torch"   the same rows called eagerly (outside a CUDA-graph capture): the reference's few PyTorch launches, since
            a Triton launch costs the host more than the GEMV costs the GPU.
"""
import contextlib
import os

import torch
import torch.nn.functional as F

from ..common.autograd import differentiable_backward, functorch_reason
from ..common.traceable_log import log_once_traceable
from ..common.tiles import adapter_math, lora_in_fp32
from ..common.activation import ACTIVATIONS, activation_id, activation_reference
from .dropout import dropout_args, keep_mask_reference, keep_scale, new_seed
from .decode import DECODE_MAX_ROWS, lora_decode
from .expand import lora_expand, lora_expand_backward
from .matmul import lora_matmul
from .shrink import lora_shrink, lora_shrink_backward, shrink_backward_partials

GEMM_BACKENDS = ("auto", "triton", "cublas")
FUSED_SHRINK_MAX_ROWS = 64  # up to here the shrink runs inside the GEMM's K-loop: one launch


def lora_linear_reference(x, weight, bias, lora_A, lora_B, scale, dropout_p=0.0, activation="identity", seed=None):
    # x: [..., K], weight: [N, K], bias: [N] or None, lora_A: [r, K], lora_B: [N, r], seed: int64 [1]
    activation_id(activation)
    xd = x
    if dropout_p > 0.0:
        x2 = x.reshape(-1, x.shape[-1])
        keep = keep_mask_reference(int(seed), x2.shape[0], x2.shape[1], dropout_p, x.device)
        xd = (x2 * keep * keep_scale(dropout_p)).reshape(x.shape)
    # As PEFT: the adapter path runs in the adapters' dtype, the sum is cast back to x's dtype.
    lora = F.linear(F.linear(xd.to(lora_A.dtype), lora_A), lora_B)
    z = torch.add(F.linear(x, weight, bias), lora, alpha=scale)  # one launch: eager decoding runs this path
    return activation_reference(z, activation).to(x.dtype)


def _route(gemm, x, lora_A, decoding, launch_bound=False, mode=None):
    """"cublas", "triton", "decode" or "torch": the module docstring's table (mode: the adapter math,
    tiles.lora_in_fp32's)."""
    # x: [M, K], lora_A: [r, K]
    gemm = gemm or os.environ.get("LORAFUSE_GEMM", "auto")
    if gemm not in GEMM_BACKENDS:
        raise ValueError(f"LORAFUSE_GEMM / gemm={gemm!r} is not one of {', '.join(GEMM_BACKENDS)}")
    if gemm != "auto":
        return gemm
    if launch_bound:
        return "torch"
    if decoding:
        return "decode"
    small = x.shape[0] <= FUSED_SHRINK_MAX_ROWS and not lora_in_fp32(x.dtype, lora_A.dtype, mode)
    return "triton" if small else "cublas"


def _fused_forward(x, weight, bias, lora_A, lora_B, scale, dropout_p, seed, act, gemm, mode, store_z):
    """Returns (y, s, z): the output, the shrink s = dropout(x) A^T (fp32) and, with store_z, z."""
    # x: [M, K] (unit column stride), weight: [N, K], lora_A: [r, K], lora_B: [N, r]
    M = x.shape[0]
    if gemm == "triton" and M <= FUSED_SHRINK_MAX_ROWS:
        threshold, drop_scale = dropout_args(dropout_p)
        s = torch.empty(M, lora_A.shape[0], device=x.device, dtype=torch.float32)
        y, z = lora_matmul(x, weight.t(), s, lora_B.t(), scale, bias, act, seed, threshold, drop_scale,
                           shrink_weight=lora_A, mask_input=dropout_p > 0.0, store_z=store_z, mode=mode)
        return y, s, z
    s = lora_shrink(x, lora_A, dropout_p, seed, mode=mode)
    if gemm == "triton":
        y, z = lora_matmul(x, weight.t(), s, lora_B.t(), scale, bias, act, store_z=store_z, mode=mode)
    elif act == 0:
        y, z = lora_expand(None, s, lora_B, scale, bias,
                           out=torch.empty(M, weight.shape[0], device=x.device, dtype=x.dtype), mode=mode)
        y.addmm_(x, weight.t())
    else:
        y, z = lora_expand(x @ weight.t(), s, lora_B, scale, bias, act, store_z=store_z, mode=mode)
    return y, s, z


def _backward(dy, x, weight, lora_A, lora_B, s, seed, z, scale, dropout_p, act, gemm, mode, needs):
    """(dx, dW, dbias, dA, dB) in fp32 or x's dtype, None where `needs` (x, weight, bias, lora_A, lora_B) says no."""
    # dy: [M, N], x: [M, K], weight: [N, K], lora_A: [r, K], lora_B: [N, r], s: [M, r] fp32, z: [M, N] or None
    need_x, need_w, need_bias, need_a, need_b = needs
    dx_in_epilogue = need_x and gemm == "triton" and dropout_p == 0.0  # ds A in the dx GEMM's epilogue
    # else the masked dx term is written by the pass over x (which gives dA), cuBLAS's g W added into it
    with_dx = need_x and not dx_in_epilogue
    to_zero = []  # dA's atomic sums, zeroed in the launch that zeroes the pass over dy's
    da_part = shrink_backward_partials(x, lora_A, dropout_p, with_dx, mode, to_zero) if need_a or with_dx else None
    g, ds, dB, dbias = lora_expand_backward(dy.contiguous(), z, s, lora_B, scale, act, need_bias, mode=mode,
                                            zero_also=to_zero)
    dx = dA = None
    if dx_in_epilogue:
        dx, _ = lora_matmul(g, weight, ds, lora_A, 1.0, mode=mode)
    elif need_x:
        dx = torch.empty_like(x)
    if da_part is not None:
        dA = lora_shrink_backward(ds, x, lora_A, dropout_p, seed, dx_out=dx if with_dx else None, mode=mode,
                                  da_part=da_part)
    if with_dx:
        dx.addmm_(g, weight)
    dW = g.t() @ x if need_w else None
    return dx, dW, dbias, dA if need_a else None, dB if need_b else None


class _LoraLinear(torch.autograd.Function):
    """The eager route: launches straight from the Function (the custom ops below cost more host time a call). It
    takes x and gives y with their leading dimensions, so that no view nodes stand around it in the graph."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_A, lora_B, scale, dropout_p, seed, act, gemm, mode):
        # x: [..., K] -> [..., N]; gemm: the caller's back-end (None: LORAFUSE_GEMM), routed here
        x2 = _rows(x)
        route = _route(gemm, x2, lora_A, decoding=False, mode=mode)
        y, s, z = _fused_forward(x2, weight, bias, lora_A, lora_B, scale, dropout_p, seed, act, route, mode,
                                 store_z=act != 0 and any(ctx.needs_input_grad[:5]))
        ctx.save_for_backward(x, weight, bias, lora_A, lora_B, s, seed, z)
        ctx.scale, ctx.dropout_p, ctx.act, ctx.gemm, ctx.mode = scale, dropout_p, act, route, mode
        # detached: a view made here would be an output that refuses in-place changes
        return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[1]).detach()

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, lora_A, lora_B, s, seed, z = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: gradients that autograd can differentiate again
            return differentiable_backward(_reference_of_apply, (x, weight, bias, lora_A, lora_B, ctx.scale,
                                                                 ctx.dropout_p, seed, ctx.act, ctx.gemm, ctx.mode), dy)
        dx, *grads = _backward(dy.reshape(-1, dy.shape[-1]), _rows(x), weight, lora_A, lora_B, s, seed, z, ctx.scale,
                               ctx.dropout_p, ctx.act, ctx.gemm, ctx.mode, ctx.needs_input_grad[:5])
        grads = (None if dx is None else dx.view(x.shape), *grads)
        return (*_in_dtypes_of(grads, (x, weight, bias, lora_A, lora_B)), None, None, None, None, None, None)


def _in_dtypes_of(grads, inputs):
    # each gradient in its input's dtype (None stays None; one already in it is not handed to .to, a call's cost)
    return tuple(g if g is None or g.dtype == t.dtype else g.to(t.dtype) for g, t in zip(grads, inputs))


# The same computation as custom ops, which torch.compile traces through: the forward returns s (and z) for the
# backward, which it saves as the Function does. Custom ops return no None: empty tensors stand for what is not there.

@torch.library.custom_op("lorafuse::lora_linear", mutates_args=())
def _lora_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_A: torch.Tensor,
                    lora_B: torch.Tensor, scale: float, dropout_p: float, seed: torch.Tensor | None, act: int,
                    gemm: str, training: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # x: [M, K] -> y [M, N], s [M, r] fp32 (training; else [0]), z [M, N] (training with an activation; else [0])
    gemm, mode = gemm or None, adapter_math()
    if not training:
        y = _inference(x, weight, bias, lora_A, lora_B, scale, dropout_p, seed, act, gemm, mode)
        return y, x.new_empty(0), x.new_empty(0)
    route = _route(gemm, x, lora_A, decoding=False, mode=mode)
    y, s, z = _fused_forward(x, weight, bias, lora_A, lora_B, scale, dropout_p, seed, act, route, mode,
                             store_z=act != 0)
    return y, s, x.new_empty(0) if z is None else z


@_lora_linear_op.register_fake
def _lora_linear_fake(x, weight, bias, lora_A, lora_B, scale, dropout_p, seed, act, gemm, training):
    y = x.new_empty(x.shape[0], weight.shape[0])
    if not training:
        return y, x.new_empty(0), x.new_empty(0)
    z_dtype = torch.float32 if lora_in_fp32(x.dtype, lora_B.dtype) else x.dtype  # as the epilogues decide it
    z = x.new_empty(x.shape[0], weight.shape[0], dtype=z_dtype) if act != 0 else x.new_empty(0)
    return y, x.new_empty(x.shape[0], lora_A.shape[0], dtype=torch.float32), z


@torch.library.custom_op("lorafuse::lora_linear_backward", mutates_args=())
def _lora_linear_backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             lora_A: torch.Tensor, lora_B: torch.Tensor, s: torch.Tensor, seed: torch.Tensor | None,
                             z: torch.Tensor, scale: float, dropout_p: float, act: int, gemm: str,
                             needs: list[bool]) -> list[torch.Tensor]:
    # -> [dx, dW, dbias, dA, dB], each contiguous in its input's dtype (as the fake says), [0] where not needed
    mode = adapter_math()
    route = _route(gemm or None, x, lora_A, decoding=False, mode=mode)
    grads = _backward(dy, x, weight, lora_A, lora_B, s, seed, z if act != 0 else None, scale, dropout_p, act, route,
                      mode, needs)
    inputs = (x, weight, bias, lora_A, lora_B)
    return [x.new_empty(0) if g is None else g.contiguous() for g in _in_dtypes_of(grads, inputs)]


@_lora_linear_backward_op.register_fake
def _lora_linear_backward_fake(dy, x, weight, bias, lora_A, lora_B, s, seed, z, scale, dropout_p, act, gemm, needs):
    inputs = (x, weight, bias, lora_A, lora_B)
    return [t.new_empty(t.shape) if need else x.new_empty(0) for t, need in zip(inputs, needs)]


def _lora_linear_setup_context(ctx, inputs, output):
    x, weight, bias, lora_A, lora_B, scale, dropout_p, seed, act, gemm, _ = inputs
    ctx.save_for_backward(x, weight, bias, lora_A, lora_B, output[1], seed, output[2])
    ctx.scale, ctx.dropout_p, ctx.act, ctx.gemm = scale, dropout_p, act, gemm


def _lora_linear_op_backward(ctx, dy, _ds, _dz):
    x, weight, bias, lora_A, lora_B, s, seed, z = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:5])
    grads = _lora_linear_backward_op(dy, x, weight, bias, lora_A, lora_B, s, seed, z, ctx.scale, ctx.dropout_p,
                                     ctx.act, ctx.gemm, needs)
    return (*(g if need else None for g, need in zip(grads, needs)), None, None, None, None, None, None)


_lora_linear_op.register_autograd(_lora_linear_op_backward, setup_context=_lora_linear_setup_context)


def _rows(x):
    """x as rows with unit column stride: a view where it can be."""
    # x: [..., K] -> [M, K]
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _reference_of_apply(x, weight, bias, lora_A, lora_B, scale, dropout_p, seed, act, gemm, mode):
    # _LoraLinear.apply's arguments -> lora_linear_reference's output (the same mask from the same seed)
    return lora_linear_reference(x, weight, bias, lora_A, lora_B, scale, dropout_p, ACTIVATIONS[act], seed)


def _check_inputs(x, weight, bias, lora_A, lora_B, seed):
    """Shape, device and dtype errors that no path could compute through: said at once."""
    # x: [..., K], weight: [N, K], bias: [N], lora_A: [r, K], lora_B: [N, r], seed: int64 [1]
    N, K = weight.shape
    r = lora_A.shape[0]
    bias_ok = bias is None or bias.shape == (N,)
    if x.shape[-1] != K or lora_A.shape != (r, K) or lora_B.shape != (N, r) or not bias_ok:
        raise ValueError(f"lora_linear: shapes do not fit: x {tuple(x.shape)} (last dim K), weight "
                         f"{tuple(weight.shape)} [N, K], bias {None if bias is None else tuple(bias.shape)} [N], "
                         f"lora_A {tuple(lora_A.shape)} [r, K], lora_B {tuple(lora_B.shape)} [N, r]")
    tensors = [t for t in (x, weight, bias, lora_A, lora_B, seed) if t is not None]
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"lora_linear: inputs on several devices: {sorted({str(t.device) for t in tensors})}")
    if seed is not None and (seed.dtype != torch.int64 or seed.numel() != 1):
        raise ValueError(f"lora_linear: seed must be an int64 tensor of one element, "
                         f"got {seed.dtype} {tuple(seed.shape)}")
    if weight.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(f"lora_linear: input is {x.dtype} but the frozen weight is {weight.dtype}; cast one to the "
                        "other, or run under torch.autocast")


def _kernel_unsupported(x, weight, lora_A, mode):
    """Why the kernels cannot take these inputs, or None (mode: the adapter math, tiles.lora_in_fp32's)."""
    device_type = x.device.type
    if device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "CPU tensors run the PyTorch reference (TRITON_INTERPRET=1 runs the Triton kernels on CPU)"
    if device_type not in ("cuda", "cpu"):
        return f"{device_type} tensors run the PyTorch reference"
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"{x.dtype} inputs run the PyTorch reference (kernels take float32, float16, bfloat16)"
    if lora_A.shape[0] > 128:
        return f"rank {lora_A.shape[0]} > 128 runs the PyTorch reference"
    if lora_A.shape[0] > 64 and lora_in_fp32(x.dtype, lora_A.dtype, mode):
        # fp32 rank tiles of 128 overflow shared memory in the backward
        return f"rank {lora_A.shape[0]} > 64 with float32 adapter math runs the PyTorch reference"
    if x.numel() == 0:
        return "an empty batch runs the PyTorch reference"
    return None


def _launch_bound(x):
    """Whether a call on these rows is bound by its launches: a few rows on a GPU, not being captured in a graph."""
    # x: [M, K]
    return x.is_cuda and x.shape[0] <= DECODE_MAX_ROWS and not torch.cuda.is_current_stream_capturing()


def _inference(x, weight, bias, lora_A, lora_B, scale, dropout_p, seed, act, gemm, mode):
    """The forward without an autograd node: y [M, N] (mode: the adapter math, tiles.lora_in_fp32's)."""
    # x: [M, K] (unit column stride)
    decoding = x.shape[0] <= DECODE_MAX_ROWS and dropout_p == 0.0
    # the reference computes in the operands' dtypes: one dtype for bias and x, one for the adapters
    launch_bound = (decoding and _launch_bound(x) and (bias is None or bias.dtype == x.dtype)
                    and lora_A.dtype == lora_B.dtype)
    route = _route(gemm, x, lora_A, decoding, launch_bound, mode)
    if route == "torch":
        return lora_linear_reference(x, weight, bias, lora_A, lora_B, scale, 0.0, ACTIVATIONS[act])
    if route == "decode":
        return lora_decode(x, weight, bias, lora_A, lora_B, scale, act)
    return _fused_forward(x, weight, bias, lora_A, lora_B, scale, dropout_p, seed, act, route, mode,
                          store_z=False)[0]


def lora_linear(x, weight, bias, lora_A, lora_B, scale, dropout_p=0.0, activation="identity", seed=None, gemm=None):
    """Fused LoRA linear. `dropout_p` applies to the adapter path only (pass 0.0 in eval);
    `seed` (int64 tensor [1] on x's device) fixes the mask, a fresh one is drawn when None.
    Under torch.compile it is the custom op lorafuse::lora_linear (no graph break)."""
    # x: [..., K], weight: [N, K], bias: [N] or None, lora_A: [r, K], lora_B: [N, r]
    act = activation_id(activation)
    mode = adapter_math()  # read once a call (a bad LORAFUSE_ADAPTER_MATH raises whichever route the call takes)
    if dropout_p > 0.0 and seed is None:
        seed = new_seed(x.device)
    elif isinstance(seed, int):
        seed = torch.tensor([seed], dtype=torch.int64, device=x.device)
    _check_inputs(x, weight, bias, lora_A, lora_B, seed)
    if bias is not None:
        bias = bias.contiguous()  # the kernels read bias[n] at n
    autocast = torch.is_autocast_enabled(x.device.type)
    if autocast:
        # Autocast (accelerate's mixed precision) computes every linear layer in its dtype, the
        # adapters' too (PEFT's lora_A/lora_B under autocast); so do we. Casts are differentiable.
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight, lora_A, lora_B = x.to(dtype), weight.to(dtype), lora_A.to(dtype), lora_B.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    reason = _kernel_unsupported(x, weight, lora_A, mode) or functorch_reason(x, weight, bias, lora_A, lora_B)
    if reason is not None:
        log_once_traceable(f"lorafuse.lora_linear: {reason}")
        return lora_linear_reference(x, weight, bias, lora_A, lora_B, scale, dropout_p, activation, seed)
    training = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                               for t in (x, weight, bias, lora_A, lora_B))
    tensors, scalars = (weight, bias, lora_A, lora_B), (float(scale), float(dropout_p), seed, act)
    with torch.autocast(x.device.type, enabled=False) if autocast else contextlib.nullcontext():
        if torch.compiler.is_compiling():
            y = _lora_linear_op(_rows(x), *tensors, *scalars, gemm or "", training)[0]
        elif training:
            return _LoraLinear.apply(x, *tensors, *scalars, gemm, mode)
        else:
            y = _inference(_rows(x), *tensors, *scalars, gemm, mode)
    return y.view(*x.shape[:-1], weight.shape[0])
