"""Activation checkpointing of a stack of layers: each layer keeps only its input between its forward and its
backward, on the GPU or (offload) in pinned host memory.

`LayerCheckpoint` is a checkpoint function, called as `torch.utils.checkpoint.checkpoint` is: `(function,
hidden_states, *args)`. transformers' decoder layers take one as their `_gradient_checkpointing_func`. Each call runs
`function` without autograd (nothing saved: no saved-tensor hooks per tensor, as torch's non-reentrant checkpoint
needs). Its backward runs `function` again with autograd under the forward's RNG state and autocast (the same dropout
masks) and backpropagates through it.

With offload, the input is copied to pinned host memory on a copy stream, overlapped with the next layers' forward;
the GPU copy goes once that copy is done, and the host waits for the oldest copy when more than MAX_COPIES_IN_FLIGHT
are running (the newest inputs, the last layers', stay on the GPU until their backward). The backward takes the copy
back, the layer below's prefetched on the copy stream meanwhile, overlapped with this layer's recompute. This is
Unsloth's offloaded gradient checkpointing and torchtune's activation offloading, per layer input. Off CUDA the input
stays where it is.

The layers' output takes part in autograd even when their input does not (embeddings frozen); the input's own
gradient is computed only when it requires one. Gradients come from `.backward()` (torch.autograd.grad is refused, as
with torch's reentrant checkpoint), several times with retain_graph. Under DDP, find_unused_parameters must be off:
the layers' parameters get their gradients inside the layers' backward, after DDP would have called them unused. The
RNG state is read and set on the host, so a checkpointed step cannot be captured in a CUDA graph.
"""
import collections
import weakref

import torch


MAX_COPIES_IN_FLIGHT = 2  # layer inputs held on the GPU until their copy to the host is known done
_TRACKED = torch.empty(0, requires_grad=True)  # an input of every checkpointed layer: its output then needs a backward


class LayerCheckpoint:
    """A checkpoint function for a stack of layers (one instance per model: with offload, it links each layer's stash
    to the one below, to prefetch it, and bounds the inputs still on the GPU while their copies run)."""

    def __init__(self, offload: bool = False):
        self.offload = offload
        self._copy_streams = {}  # device -> the stream that copies stashes to and from the host
        self._newest = None  # a weak reference to the last stash made: the one below the next
        self._copying = collections.deque()  # stashes whose device tensor may still be read by its copy

    def __call__(self, function, hidden_states: torch.Tensor, *args):
        # hidden_states: [..., H] -> function(hidden_states, *args)
        stash = _Stash(hidden_states, self._copy_stream(hidden_states.device), below=self._newest)
        self._newest = weakref.ref(stash)  # weak: a forward whose backward never runs frees its stashes
        if stash.source is not None:
            self._copying.append(stash)
        # Inputs whose copy is done go; past MAX_COPIES_IN_FLIGHT the host waits for the oldest copy: the GPU then
        # holds a bounded number of layer inputs, however far ahead of it the host runs.
        while self._copying and (len(self._copying) > MAX_COPIES_IN_FLIGHT or self._copying[0].copied()):
            self._copying.popleft().release_source()
        return _CheckpointedLayer.apply(function, stash, _TRACKED, hidden_states, *args)

    def _copy_stream(self, device: torch.device):
        if not self.offload or device.type != "cuda":
            return None
        if device not in self._copy_streams:
            self._copy_streams[device] = torch.cuda.Stream(device)
        return self._copy_streams[device]


class _Stash:
    """One layer's input: a pinned host copy (offload on CUDA), taken back on demand; or the tensor itself."""

    def __init__(self, tensor: torch.Tensor, copy_stream, below: "weakref.ref[_Stash] | None"):
        # tensor: [..., H], the layer's input
        tensor = tensor.detach()
        self.device, self.copy_stream, self.below = tensor.device, copy_stream, below
        self.on_device = self.ready = self.source = None
        if copy_stream is None:
            self.host = tensor
            return
        copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # the tensor is written
        with torch.cuda.stream(copy_stream):
            self.host = torch.empty_like(tensor, device="cpu", pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.stored = torch.cuda.Event()
            self.stored.record(copy_stream)
        self.source = tensor  # kept until the copy has read it (release_source)

    def copied(self) -> bool:
        return self.stored.query()

    def release_source(self) -> None:
        """Let go of the device tensor once its copy is done (waiting for it on the host if need be)."""
        self.stored.synchronize()
        self.source = None

    def prefetch(self) -> None:
        """Start the copy back to the device (on the copy stream), unless the device tensor is still held."""
        if self.copy_stream is None or self.source is not None or self.on_device is not None:
            return
        with torch.cuda.stream(self.copy_stream):
            self.on_device = self.host.to(self.device, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record(self.copy_stream)

    def take(self) -> torch.Tensor:
        """The input on its device, usable on the current stream; the stash keeps only the host copy (a second
        backward, with retain_graph, takes it again; the graph's end frees it)."""
        # -> [..., H] on self.device
        if self.copy_stream is None:
            return self.host
        if self.source is not None:  # still held (one of the last layers): no round trip
            tensor, self.source = self.source, None
            return tensor
        self.prefetch()
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(self.ready)
        tensor, self.on_device = self.on_device, None
        tensor.record_stream(compute)  # allocated on the copy stream, used on this one
        return tensor


def _rng_states(device: torch.device) -> tuple:
    states = (torch.get_rng_state(),)
    if device.type != "cpu":
        states += (torch.get_device_module(device.type).get_rng_state(device),)
    return states


class _CheckpointedLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, function, stash, _tracked, hidden_states, *args):
        # hidden_states: [..., H]; args: the layer's other positional inputs -> function(hidden_states, *args)
        device = hidden_states.device
        ctx.function, ctx.stash, ctx.rng = function, stash, _rng_states(device)
        ctx.autocast = (torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))
        tensors = [i for i, arg in enumerate(args) if isinstance(arg, torch.Tensor)]
        ctx.args, ctx.tensor_positions = list(args), tensors
        ctx.save_for_backward(*(args[i] for i in tensors))
        for i in tensors:
            ctx.args[i] = None
        return function(hidden_states, *args)  # autograd is off inside Function.forward

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():  # torch's reentrant checkpoint's own test
            raise RuntimeError("activation checkpointing (lorafuse.nn.layer_checkpoint) works with .backward(), not "
                               "torch.autograd.grad: the layers' recompute accumulates into their parameters' .grad")
        below = ctx.stash.below and ctx.stash.below()
        hidden_states = ctx.stash.take()
        if below is not None:  # the next backward's input comes back while this layer recomputes
            below.prefetch()
        return _recompute_and_backward(ctx, hidden_states, grads)


def _recompute_and_backward(ctx, hidden_states, grads):
    # hidden_states: the layer's input back on its device; grads: the gradients of the layer's outputs
    device = hidden_states.device
    hidden_states = hidden_states.detach().requires_grad_(ctx.needs_input_grad[3])
    args = list(ctx.args)
    for i, saved in zip(ctx.tensor_positions, ctx.saved_tensors):
        args[i] = saved.detach().requires_grad_(saved.requires_grad)
    with torch.random.fork_rng(devices=[device] if device.type != "cpu" else [], device_type=device.type), \
            torch.enable_grad(), torch.autocast(device.type, dtype=ctx.autocast[1], enabled=ctx.autocast[0]):
        torch.set_rng_state(ctx.rng[0])
        if device.type != "cpu":
            torch.get_device_module(device.type).set_rng_state(ctx.rng[1], device)
        outputs = ctx.function(hidden_states, *args)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    pairs = [(out, grad) for out, grad in zip(outputs, grads)
             if isinstance(out, torch.Tensor) and out.requires_grad and grad is not None]
    if pairs:
        torch.autograd.backward(*zip(*pairs))
    arg_grads = [None] * len(args)
    for i in ctx.tensor_positions:
        arg_grads[i] = args[i].grad if args[i].requires_grad else None
    return (None, None, None, hidden_states.grad, *arg_grads)
