"""Launching a Triton kernel from a launch plan, with Triton's per-call binding done once per specialisation.

`kernel[grid](*args, **constants)` binds every argument by name, specialises each one, builds a cache key from
its options and checks the kernel's globals on every call, then hands Triton's launcher an (empty) hook chain to
call: host time that an eager training step pays on each of its hundreds of launches. `launch` keys the compiled
kernel on what Triton specialises a call on (each tensor's dtype and 16-byte alignment, each integer's being 1, a
multiple of 16 or past 32 bits, which arguments are None), the kernel and the current device. It launches the
first call of each key through `kernel[grid]`, later ones through the compiled kernel's launcher on the current
stream.

Calls that Triton must see go through `kernel[grid]` every time: interpreted kernels (TRITON_INTERPRET=1) and any
call while launch hooks are set (profilers such as Proton).
"""
import torch
import triton
from triton.runtime.jit import JITFunction

_INT32 = (-(1 << 31), 1 << 31)


def _specialisation(arg):
    """What Triton's specialisation of one runtime argument depends on (a key at least as fine as Triton's own)."""
    if arg is None:
        return None
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    kind = type(arg)
    if kind is int:
        return arg == 1, arg % 16 == 0, _INT32[0] <= arg < _INT32[1]
    if kind is float or kind is bool:
        return kind
    raise TypeError(f"launch: a kernel argument of type {kind.__name__} (tensors, ints, floats, bools or None)")


def _direct(kernel, args) -> bool:
    """Whether this call may skip kernel[grid]: a compiled (not interpreted) kernel on CUDA tensors, no launch hooks."""
    runtime = triton.knobs.runtime
    # a hook is a HookChain (Triton 3.5 and later: set when it holds calls) or a callable or None (3.4)
    hooks = (getattr(hook, "calls", hook) for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook))
    return isinstance(kernel, JITFunction) and args[0].is_cuda and not any(hooks)


def launch(kernel, plan, *args) -> None:
    """kernel[plan.grid](*args, **plan.constants), where args are the kernel's runtime arguments in order (the first a
    tensor) and plan.constants its constexprs (the parameters after them) and launch options. plan: a
    tiles.LaunchPlan, whose `compiled` dict holds this launch site's compiled kernels."""
    direct = _direct(kernel, args)
    if direct:
        key = (torch.cuda.current_device(), id(kernel), *map(_specialisation, args))
        found = plan.compiled.get(key)
        if found is not None:
            run, function, metadata, grid, tail = found
            run(*grid, torch._C._cuda_getCurrentRawStream(key[0]), function, metadata, None, None, None, *args, *tail)
            return
    compiled = kernel[plan.grid](*args, **plan.constants)
    if direct:
        plan.compiled[key] = _launcher(kernel, compiled, plan, len(args))


def _launcher(kernel, compiled, plan, n_args):
    """(launcher, function, packed metadata, grid of three, constexpr values in parameter order) of a compiled
    kernel: the arguments that Triton's launch passes after the stream."""
    if hasattr(compiled, "result"):  # a compile future (Triton's async compile mode)
        compiled = compiled.result()
    grid = (*plan.grid, 1, 1)[:3]
    tail = tuple(plan.constants[name] for name in kernel.arg_names[n_args:])
    return compiled.run, compiled.function, compiled.packed_metadata, grid, tail
