"""Cross-entropy of a causal-LM head without holding its logits: the sum over rows of lse(z) - z[label], z = h @ W^T,
divided by a given count (the loss's normalisation).

transformers computes the head's logits for every token ([tokens, vocab] in the model's dtype), copies them to float32,
and keeps float32 log-probabilities for the backward: at a 128k vocabulary that is several GB per 8k tokens, and
about ten passes over them. Here the rows go through the head in chunks. Per chunk, cuBLAS writes the logits into one
reused buffer, one kernel reads each row twice (its log-sum-exp in float32, then the gradient of the row's loss
written over its logits, already divided by the count), and cuBLAS turns that gradient into the chunk's dh (and dW
when the head trains). The gradients are thus made in the forward, rounded where transformers' are; the backward
multiplies them by the loss's incoming gradient (1 for loss.backward(): exact). In float16 the count is applied in
the backward instead, with that gradient: a gradient scaler's factor arrives only there, and logit gradients divided
by the count first would underflow float16 before it could lift them.
"""
import torch
import triton
import triton.language as tl

from ..common.autograd import differentiable_backward, functorch_reason
from ..common.tiles import kernels_run_on
from ..common.traceable_log import log_once_traceable

IGNORE_INDEX = -100  # transformers' and torch's default
# Logits held at a time (rows x vocab): the chunk's rows follow from the vocabulary. About a thousand rows at a 128k
# vocabulary: enough row tiles for the dh matmul ([rows, V] @ [V, H]) to fill the GPU.
CHUNK_ELEMENTS = 1 << 27
BLOCK_V = 4096  # vocabulary columns a program reads per step of its loops over the row
FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def linear_cross_entropy_reference(hidden, weight, labels, divisor=None, ignore_index=IGNORE_INDEX, softcap=None):
    # hidden: [N, H], weight: [V, H], labels: [N] -> the sum of the rows' losses over divisor (float32; float64 for
    # float64 inputs), as transformers' ForCausalLMLoss takes it: logits in the head's dtype, then float32
    logits = (hidden @ weight.t()).to(torch.promote_types(hidden.dtype, torch.float32))
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    total = torch.nn.functional.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
    return total if divisor is None else total / divisor


@triton.jit
def _cross_entropy_rows(z_ptr, labels_ptr, losses_ptr, scale_ptr, V, stride_z, ignore_index, softcap,
                        BLOCK_V: tl.constexpr, SOFTCAP: tl.constexpr, WRITE_GRAD: tl.constexpr, SCALED: tl.constexpr):
    # z: [rows, V] logits (row stride stride_z), labels: [rows], losses: [rows] fp32, scale: [1] fp32 (read when
    # SCALED); a program per row. With WRITE_GRAD, the row's d(scale * loss)/dz (scale * (softmax - one-hot), scale 1
    # unless SCALED, 0 for an ignored row) is written over its logits.
    row = tl.program_id(0)
    z_row = z_ptr + row.to(tl.int64) * stride_z
    label = tl.load(labels_ptr + row)
    ignored = label == ignore_index
    row_max = -float("inf")
    sum_exp = 0.0
    for start in range(0, V, BLOCK_V):  # online log-sum-exp, in float32
        cols = start + tl.arange(0, BLOCK_V)
        z = tl.load(z_row + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        if SOFTCAP:  # softcap * tanh(z / softcap); the columns past V stay -inf
            z = tl.where(cols < V, softcap * (2 * tl.sigmoid(2 * z / softcap) - 1), -float("inf"))
        new_max = tl.maximum(row_max, tl.max(z, axis=0))
        sum_exp = sum_exp * tl.exp(row_max - new_max) + tl.sum(tl.exp(z - new_max), axis=0)
        row_max = new_max
    lse = row_max + tl.log(sum_exp)
    in_range = (label >= 0) & (label < V)
    z_label = tl.load(z_row + label, mask=in_range & ~ignored, other=0.0).to(tl.float32)
    if SOFTCAP:
        z_label = softcap * (2 * tl.sigmoid(2 * z_label / softcap) - 1)
    tl.store(losses_ptr + row, tl.where(ignored, 0.0, lse - z_label))
    if WRITE_GRAD:
        keep = tl.where(ignored, 0.0, tl.load(scale_ptr) if SCALED else 1.0)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            z = tl.load(z_row + cols, mask=cols < V, other=0.0).to(tl.float32)
            if SOFTCAP:
                capped = 2 * tl.sigmoid(2 * z / softcap) - 1  # tanh(z / softcap)
                grad = tl.exp(softcap * capped - lse) - tl.where(cols == label, 1.0, 0.0)
                grad = grad * (1 - capped * capped)
            else:
                grad = tl.exp(z - lse) - tl.where(cols == label, 1.0, 0.0)
            tl.store(z_row + cols, (grad * keep).to(z_ptr.dtype.element_ty), mask=cols < V)


def chunk_rows(rows: int, vocab: int) -> int:
    """Rows per chunk: CHUNK_ELEMENTS logits at a time, a multiple of 128 rows where that many fit."""
    chunk = max(1, CHUNK_ELEMENTS // vocab)
    return min(rows, chunk // 128 * 128 if chunk >= 128 else chunk)


def _launch_rows(z, labels, losses, scale, ignore_index, softcap, write_grad):
    # z: [rows, V], labels: [rows], losses: [rows] fp32, scale: [1] fp32 or None (gradients unscaled)
    rows, vocab = z.shape
    block = min(BLOCK_V, triton.next_power_of_2(vocab))
    _cross_entropy_rows[(rows,)](z, labels, losses, losses if scale is None else scale, vocab, z.stride(0),
                                 ignore_index, 1.0 if softcap is None else float(softcap), BLOCK_V=block,
                                 SOFTCAP=softcap is not None, WRITE_GRAD=write_grad, SCALED=scale is not None,
                                 num_warps=8 if block >= 2048 else 4)


def _scale(divisor, device) -> torch.Tensor:
    """1 / divisor as a float32 tensor [1] on `device`: the kernel reads it there (a count on the device, such as a
    captured step's num_items_in_batch, is never read by the host)."""
    if divisor is None:
        return torch.ones(1, device=device)
    return torch.reciprocal(torch.as_tensor(divisor, device=device, dtype=torch.float32).reshape(1))


def _scaled_in_kernel(dtype: torch.dtype) -> bool:
    """Whether the kernel divides the gradients by the count (the module docstring: all but float16)."""
    return dtype != torch.float16


def _forward(hidden, weight, labels, scale, ignore_index, softcap, need_dh: bool, need_dw: bool):
    # hidden: [N, H], weight: [V, H], labels: [N], scale: [1] fp32 or None -> losses [N] fp32 (unscaled), dh [N, H]
    # or None, dw [V, H] fp32 or None: the gradients of scale * losses.sum() (of losses.sum() for scale None)
    rows, vocab = hidden.shape[0], weight.shape[0]
    losses = torch.empty(rows, device=hidden.device, dtype=torch.float32)
    dh = torch.empty_like(hidden) if need_dh else None
    dw = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if need_dw else None
    if rows == 0:
        return losses, dh, dw
    step = chunk_rows(rows, vocab)
    logits = torch.empty(step, vocab, device=hidden.device, dtype=hidden.dtype)  # reused by every chunk
    for start in range(0, rows, step):
        end = min(rows, start + step)
        h, z = hidden[start:end], logits[:end - start]
        torch.mm(h, weight.t(), out=z)
        _launch_rows(z, labels[start:end], losses[start:end], scale, ignore_index, softcap, need_dh or need_dw)
        if need_dh:
            torch.mm(z, weight, out=dh[start:end])
        if need_dw:
            dw += (z.t() @ h).float()
    return losses, dh, dw


def _unsupported_reason(hidden, weight, labels) -> str | None:
    if not kernels_run_on(hidden.device):
        return "tensors not on a CUDA device run the PyTorch reference (TRITON_INTERPRET=1 runs the kernel on CPU)"
    if hidden.dtype != weight.dtype or hidden.dtype not in FUSED_DTYPES:
        return (f"hidden states in {hidden.dtype} and head weight in {weight.dtype} run the PyTorch reference "
                "(fused: both float32, float16 or bfloat16)")
    if hidden.dim() != 2 or weight.dim() != 2 or labels.shape != hidden.shape[:1] or labels.dtype != torch.int64:
        return (f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, labels {tuple(labels.shape)} "
                f"{labels.dtype} run the PyTorch reference (fused: [N, H], [V, H], int64 [N])")
    return None


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, scale, ignore_index, softcap):
        # hidden: [N, H], weight: [V, H], labels: [N], scale: [1] fp32 -> []
        in_kernel = _scaled_in_kernel(hidden.dtype)
        losses, dh, dw = _forward(hidden, weight, labels, scale if in_kernel else None, ignore_index, softcap,
                                  *ctx.needs_input_grad[:2])
        ctx.save_for_backward(hidden, weight, labels, scale, dh, dw)
        ctx.ignore_index, ctx.softcap, ctx.in_kernel = ignore_index, softcap, in_kernel
        return losses.sum() * scale[0]

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, labels, scale, dh, dw = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: gradients that autograd can differentiate again
            return differentiable_backward(linear_cross_entropy_reference,
                                           (hidden, weight, labels, 1 / scale[0], ctx.ignore_index, ctx.softcap),
                                           grad)[:2] + (None,) * 4
        factor = grad if ctx.in_kernel else grad * scale[0]
        return (None if dh is None else dh * factor, None if dw is None else (dw * factor).to(weight.dtype),
                None, None, None, None)


# The same computation as a custom op, which torch.compile traces through (eager calls keep the Function above: less
# host time per call). The gradients are outputs of the forward; the backward scales them.

@torch.library.custom_op("lorafuse::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy_op(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor,
                             ignore_index: int, softcap: float, need_dh: bool, need_dw: bool
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # -> loss [] fp32, dh [N, H] (empty without need_dh), dw [V, H] fp32 (empty without need_dw)
    in_kernel = _scaled_in_kernel(hidden.dtype)
    losses, dh, dw = _forward(hidden.contiguous(), weight.contiguous(), labels.contiguous(),
                              scale if in_kernel else None, ignore_index, softcap or None, need_dh, need_dw)
    return (losses.sum() * scale[0], hidden.new_empty(0) if dh is None else dh,
            weight.new_empty(0, dtype=torch.float32) if dw is None else dw)


@_linear_cross_entropy_op.register_fake
def _linear_cross_entropy_fake(hidden, weight, labels, scale, ignore_index, softcap, need_dh, need_dw):
    return (hidden.new_empty((), dtype=torch.float32), hidden.new_empty(hidden.shape if need_dh else (0,)),
            weight.new_empty(weight.shape if need_dw else (0,), dtype=torch.float32))


def _linear_cross_entropy_setup_context(ctx, inputs, output):
    ctx.weight_dtype, ctx.in_kernel = inputs[1].dtype, _scaled_in_kernel(inputs[0].dtype)
    ctx.save_for_backward(inputs[3], output[1], output[2])


def _linear_cross_entropy_op_backward(ctx, grad, _ddh, _ddw):
    scale, dh, dw = ctx.saved_tensors
    factor = grad if ctx.in_kernel else grad * scale[0]
    return (dh * factor if ctx.needs_input_grad[0] else None,
            (dw * factor).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None, None, None, None, None, None, None)


_linear_cross_entropy_op.register_autograd(_linear_cross_entropy_op_backward,
                                           setup_context=_linear_cross_entropy_setup_context)


class LabelledCount:
    """The number of labels other than ignore_index, counted on the device and copied to the host without waiting:
    made at the start of a forward and read at its loss, so that the host rarely waits for it (only when the GPU is
    more than a forward behind). None where no host read may happen (`start`)."""

    def __init__(self, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX):
        # labels: [N] -> a count of one element, on its way to pinned host memory
        count = (labels != ignore_index).sum()
        if not labels.is_cuda:
            self._host, self._copied = count, None
            return
        self._host = torch.empty((), dtype=count.dtype, device="cpu", pin_memory=True)
        self._host.copy_(count, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(labels.device))  # the copy's stream, current device or not

    @classmethod
    def start(cls, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> "LabelledCount | None":
        """A count of `labels`; None while a CUDA graph is captured or torch.compile traces."""
        if torch.compiler.is_compiling() or (labels.is_cuda and torch.cuda.is_current_stream_capturing()):
            return None
        return cls(labels, ignore_index)

    def count(self) -> int:
        if self._copied is not None:
            self._copied.synchronize()
        return int(self._host)


def _labelled_rows(hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int, count: int):
    """hidden and labels without the rows labelled ignore_index (count rows stay), in order: the head's matmuls skip
    prompt tokens and padding."""
    # hidden: [N, H], labels: [N] -> [count, H], [count]
    if count == labels.numel():
        return hidden, labels
    kept = torch.argsort((labels == ignore_index).to(torch.int8), stable=True)[:count]  # labelled rows first
    return hidden.index_select(0, kept), labels.index_select(0, kept)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, divisor=None,
                         ignore_index: int = IGNORE_INDEX, softcap: float | None = None,
                         labelled: LabelledCount | None = None) -> torch.Tensor:
    """linear_cross_entropy_reference's result (the sum of the rows' losses over `divisor`, a number or a tensor of
    one element, None for 1; float32), differentiable in hidden and weight, with no [N, V] tensor kept. softcap:
    logits become softcap * tanh(logits / softcap) first (Gemma 2). Labels other than ignore_index must lie in
    [0, V): they are not checked. With `labelled` (LabelledCount.start(labels, ignore_index), made before the
    hidden states were), the rows labelled ignore_index are dropped before the head's matmul. Inputs the kernel does
    not take run the reference, the reason logged once. Under torch.compile, the custom op
    lorafuse::linear_cross_entropy, every row kept."""
    # hidden: [N, H], weight: [V, H], labels: [N] int64 -> []
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):  # the head's matmul in autocast's dtype, as autocast would run it
        dtype = torch.get_autocast_dtype(device_type)
        with torch.autocast(device_type, enabled=False):
            return linear_cross_entropy(hidden.to(dtype), weight.to(dtype), labels, divisor, ignore_index, softcap,
                                        labelled)
    reason = functorch_reason(hidden, weight) or _unsupported_reason(hidden, weight, labels)
    if reason is not None:
        log_once_traceable(f"lorafuse.linear_cross_entropy: {reason}")
        return linear_cross_entropy_reference(hidden, weight, labels, divisor, ignore_index, softcap)
    grad_on = torch.is_grad_enabled()
    need_dh, need_dw = grad_on and hidden.requires_grad, grad_on and weight.requires_grad
    scale = _scale(divisor, hidden.device)
    if torch.compiler.is_compiling():
        return _linear_cross_entropy_op(hidden, weight, labels, scale, ignore_index, float(softcap or 0.0),
                                        need_dh, need_dw)[0]
    if labelled is not None:
        hidden, labels = _labelled_rows(hidden, labels, ignore_index, labelled.count())
    if need_dh or need_dw:
        return _LinearCrossEntropy.apply(hidden.contiguous(), weight.contiguous(), labels.contiguous(), scale,
                                         ignore_index, softcap)
    return _forward(hidden.contiguous(), weight.contiguous(), labels.contiguous(), None, ignore_index, softcap,
                    False, False)[0].sum() * scale[0]
