"""A whole optimizer step captured as one CUDA graph: zeroing the gradients, every micro-step's forward and backward,
the loss, gradient clipping, the non-finite check and the AdamW update, replayed without a host sync.

Nothing in the step reads a value on the host: a non-finite step (NaN or Inf in the loss or the gradient norm) is
skipped on the device, by the fused AdamW kernel's `found_inf` (GradScaler's protocol: the kernel leaves parameters
and moments as they were and its step count is taken back), and its flag is returned as a device tensor for the
caller to read when it likes. The first `eager_steps` calls run the same step eagerly, on a side stream, so that
Triton compiles, cuBLAS workspaces and optimizer state are made before the capture, which may make none of them; on
a CPU every call runs eagerly, with the same device-side logic.

Dropout: lorafuse's kernels draw their seed with torch.randint on the device (lorafuse.ops.lora.dropout.new_seed), and
torch's CUDA generator is graph-safe, so every replay draws new masks, as eager steps do.
"""
from collections.abc import Callable

import torch

from .optim import make_capturable

ITEMS = "num_items_in_batch"  # the batch key under which loss_fn finds the step's loss normaliser


class CapturedStep:
    """`step(micro_batches, items)` runs one optimizer step and returns (loss, grad_norm, nonfinite), 0-d device
    tensors: nothing is read on the host.

    - `loss_fn(model, batch)` returns one micro-batch's loss, already divided as the caller wants its gradients
      summed; `batch` is the micro-batch's device tensors plus `batch[ITEMS]`, the step's `items` as a 0-d float64
      device tensor (transformers' causal LMs take it as `num_items_in_batch`). loss_fn may pop it.
    - `micro_batches`: one dict of tensors per micro-step (gradient accumulation), every call the same names and
      shapes; they are copied into static device buffers (non-blocking: pin CPU tensors). `items`: a float or a
      0-d tensor, copied into a static buffer too.
    - the loss returned is the sum of the micro-steps' losses, in float64 (summed as the recipe's eager step sums
      them): with losses that are token-loss sums over `items`, the step's mean loss per token.
    - gradients are clipped to `max_grad_norm` (None or 0: only their norm is taken), and zeroed in place at the
      start of the next call (they stay allocated: a graph reads and writes the same memory every replay).
    - on CUDA the first `eager_steps` calls run eagerly on a side stream, the next one captures the step and replays
      it, and every later one replays it; each call is a real training step.

    `optimizer` (Adam or AdamW, or accelerate's wrapper of one) is made capturable in place (optim.make_capturable):
    load its state before building the step. The tensors returned by a replay are the graph's own outputs: the next
    call overwrites them, so copy or accumulate them before it.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[[torch.nn.Module, dict], torch.Tensor], max_grad_norm: float | None = None,
                 eager_steps: int = 2):
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.max_grad_norm = max_grad_norm or None
        self.eager_steps = eager_steps
        self.torch_optimizer = make_capturable(optimizer)
        self.params = [param for group in self.torch_optimizer.param_groups for param in group["params"]]
        self.device = self.params[0].device
        self.captures = self.device.type == "cuda"
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # the graph's (loss, norm, flag)
        self.calls = 0
        self.inputs: list[dict[str, torch.Tensor]] | None = None  # static copies of the micro-batches
        self.items = torch.zeros((), dtype=torch.float64, device=self.device)
        self.found_inf = torch.zeros((), dtype=torch.float32, device=self.device)  # 1: the optimizer skips its step

    def __call__(self, micro_batches: list[dict[str, torch.Tensor]],
                 items: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self._copy_inputs(micro_batches, items)
        self.calls += 1
        if self.graph is not None:
            self.graph.replay()
            return self.outputs
        if not self.captures:
            return self._step()
        if self.calls <= self.eager_steps:
            return self._eager_step_on_side_stream()
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: the DataLoader's pin-memory thread may allocate pinned memory while this thread captures
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.outputs = self._step()
        self.graph.replay()  # the capture ran nothing: this is the step
        return self.outputs

    def _copy_inputs(self, micro_batches: list[dict[str, torch.Tensor]], items: float | torch.Tensor) -> None:
        if self.inputs is None:
            self.inputs = [{name: torch.empty_like(tensor, device=self.device) for name, tensor in batch.items()}
                           for batch in micro_batches]
        shapes = [{name: tuple(tensor.shape) for name, tensor in batch.items()} for batch in micro_batches]
        static = [{name: tuple(tensor.shape) for name, tensor in batch.items()} for batch in self.inputs]
        if shapes != static:
            raise ValueError(f"a captured step takes micro-batches of one layout, {static}; got {shapes}: pad every "
                             "batch to one length (in the recipe: data.pad_to_max_length=true or data.packing=true)")
        for buffers, batch in zip(self.inputs, micro_batches):
            for name, tensor in batch.items():
                buffers[name].copy_(tensor, non_blocking=True)
        if isinstance(items, torch.Tensor):
            self.items.copy_(items, non_blocking=True)
        else:
            self.items.fill_(items)

    def _eager_step_on_side_stream(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            outputs = self._step()
        torch.cuda.current_stream().wait_stream(side)
        return outputs

    def _step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step itself, run eagerly or under capture alike."""
        self.optimizer.zero_grad(set_to_none=False)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for batch in self.inputs:
            loss = self.loss_fn(self.model, {**batch, ITEMS: self.items})
            loss.backward()
            loss_sum += loss.detach().double() * self.items
        loss = loss_sum / self.items
        # foreach=None: torch's foreach kernels where the device has them (CUDA), a loop elsewhere (CPU)
        if self.max_grad_norm:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm, foreach=None)
        else:
            grads = [param.grad for param in self.params if param.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm(grads, foreach=None)
        nonfinite = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        self.found_inf.copy_(nonfinite)
        self.torch_optimizer.found_inf = self.found_inf  # read by the fused kernel in step(), as GradScaler sets it
        try:
            self.optimizer.step()
        finally:
            del self.torch_optimizer.found_inf
        return loss, grad_norm, nonfinite
