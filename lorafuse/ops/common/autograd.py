"""Where the ops' autograd Functions meet the rest of autograd: torch.func transforms and double backward.

The kernels' backward passes are hand-written launches, not differentiable torch code, and the Functions define no
vmap rule. Two uses of autograd need more, and PEFT's plain torch layers give them:
- torch.func transforms (grad, vmap: per-sample gradients, as Opacus computes them) wrap their tensors, which no
  Triton kernel can read. The ops hand such calls to their torch reference (`functorch_reason`).
- Double backward (create_graph=True: gradient penalties, MAML) differentiates the backward itself. There the
  Functions recompute their reference from the saved inputs and return its gradients, built with a graph
  (`differentiable_backward`); a plain backward keeps the kernels.
"""
import torch

try:  # the check torch.func's own error messages rely on; absent, no tensor is taken as wrapped
    from torch._C._functorch import is_functorch_wrapped_tensor as _is_wrapped
except ImportError:  # pragma: no cover
    def _is_wrapped(tensor: torch.Tensor) -> bool:
        return False


def functorch_reason(*tensors) -> str | None:
    """Why these tensors (None allowed) cannot reach the kernels: they are inside torch.func.grad/vmap/jacrev. None
    otherwise."""
    if torch.compiler.is_compiling():
        # Dynamo cannot call the check. It traces a transform's body with functorch's interpreter stack not empty
        # (tested with isinstance: Dynamo wraps an empty stack's None in an object that `is not None`); the custom
        # ops have no torch.func rules, so there the references run as in eager mode
        wrapped = isinstance(torch._C._functorch.peek_interpreter_stack(), torch._C._functorch.CInterpreter)
    else:
        wrapped = any(t is not None and _is_wrapped(t) for t in tensors)
    if wrapped:
        return "inputs are inside a torch.func transform (grad, vmap, ...), which the kernels do not support"
    return None


def differentiable_backward(reference, inputs: tuple, grad_output: torch.Tensor) -> tuple:
    """A Function's gradients as the reference computes them, with a graph: one per input (None for non-tensors and
    tensors that need none). `inputs` are the Function's inputs as saved (not detached copies), so the returned
    gradients stay differentiable with respect to them."""
    wanted = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    # in the dtypes the Function computed in: its launcher cast under autocast before the Function saw the inputs
    with torch.enable_grad(), torch.autocast(grad_output.device.type, enabled=False):
        out = reference(*inputs)
    grads = iter(torch.autograd.grad(out, wanted, grad_output, create_graph=True, allow_unused=True))
    return tuple(next(grads) if isinstance(t, torch.Tensor) and t.requires_grad else None for t in inputs)
