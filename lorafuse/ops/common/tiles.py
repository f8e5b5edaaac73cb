"""What the kernels' launchers share: rank padding, split sizing from the device's SM count,
the precision of the rank-r products (LORAFUSE_ADAPTER_MATH) and launch plans."""
import functools
import os
import torch
import triton
import triton.language as tl

ADAPTER_MATH = ("exact", "fast")
CPU_STAND_IN_SMS = 132  # Triton's interpreter has no SMs: plan as on a 132-SM Hopper GPU, so CPU tests split alike


PLANS = 1024  # launch plans each launcher keeps (functools.lru_cache): far more than a run's shapes


class LaunchPlan:
    """A launch as decided from shapes, dtypes and settings alone: the grid, the kernel's scalars after its tensors and
    sizes, its constexprs and launch options (a dict every call shares: never modified), and the compiled kernels that
    kernel_launch.launch found for it. Launchers cache their plans (functools.lru_cache of PLANS): the eager training
    step is bound by the host's time as much as by the GPU's."""
    __slots__ = ("grid", "scalars", "constants", "compiled")

    def __init__(self, grid: tuple, scalars: tuple, constants: dict):
        self.grid, self.scalars, self.constants = grid, scalars, constants
        self.compiled = {}


def kernels_run_on(device: torch.device) -> bool:
    """Whether the Triton kernels can take tensors on `device`: CUDA, or any device under TRITON_INTERPRET=1 (the
    CPU tests). Launchers hand other calls to their torch reference."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def sm_count(device: torch.device) -> int:
    """Multiprocessors of `device`: the launchers size split reductions to keep them busy."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_STAND_IN_SMS


def cdiv(n: int, block: int) -> int:
    """ceil(n / block) for launchers' host code: triton.cdiv is a constexpr function, whose wrapper is costly to call
    from the host."""
    return -(-n // block)


def padded_rank(r: int) -> int:
    # tl.dot needs every dimension >= 16 and a power of two (triton.next_power_of_2 without its constexpr wrapper)
    return max(16, 1 << (r - 1).bit_length())


def split_in_blocks(n: int, block: int, splits: int) -> tuple[int, int]:
    """Cut a length n into at most `splits` chunks of whole blocks: (chunk length, chunks).
    Launchers split a reduction this way to keep about two programs per SM busy."""
    chunk = cdiv(cdiv(n, max(1, splits)), block) * block
    return chunk, cdiv(n, chunk)


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs must not silently drop to tf32: the fp32 path is the exact one.
    return "ieee" if dtype == torch.float32 else "tf32"


def adapter_math() -> str:
    """LORAFUSE_ADAPTER_MATH: "exact" (default) computes float32 adapters on a 16-bit base in
    fp32-class precision, as PEFT does; "fast" rounds them to the base's dtype in-kernel."""
    mode = os.environ.get("LORAFUSE_ADAPTER_MATH", "exact")
    if mode not in ADAPTER_MATH:
        raise ValueError(f"LORAFUSE_ADAPTER_MATH={mode!r} is not one of {', '.join(ADAPTER_MATH)}")
    return mode


def lora_in_fp32(x_dtype: torch.dtype, adapter_dtype: torch.dtype, mode: str | None = None) -> bool:
    """Whether the rank-r products run in fp32 (as PEFT runs the adapter path in the adapters'
    dtype: float32 adapters on a bf16/fp16 base keep float32 precision there). mode: adapter_math()'s value, which
    a caller reads once a call and passes on; None reads it here."""
    if x_dtype == torch.float32:
        return True
    return adapter_dtype == torch.float32 and (mode or adapter_math()) == "exact"


def lora_precision(x_dtype: torch.dtype, adapter_dtype: torch.dtype, mode: str | None = None) -> str:
    """tl.dot precision of the rank-r products that run on float32 tiles. float32 adapters on a 16-bit base use
    three tf32 tensor-core passes (fp32-class accuracy; plain fp32 FMA dots would take several times the whole
    layer's budget) where the operands are not bf16 pieces (common/bf16_pieces.py: bf16 activations' big products);
    all-float32 inputs stay exact fp32."""
    if x_dtype == torch.float32:
        return "ieee"
    return "tf32x3" if lora_in_fp32(x_dtype, adapter_dtype, mode) else "tf32"


def atomic_partial_sums(parts: int, deterministic: bool, fixed_order: bool = False) -> bool:
    """Whether a kernel adds its `parts` partial sums of a small output (dB: [N, r]) into it with float32 atomics
    instead of writing them for a reduction afterwards: the partials cost a write and a read of parts x the output
    (8192 rows, 14336 columns, r = 16: 59 MB each way) and a launch; on small outputs (s, ds, dA: [8192, 16]) the
    reduction's extra launch still costs a launch's latency. Atomics add in no fixed order, so the last bits
    vary from run to run: under torch.use_deterministic_algorithms(True) (`deterministic`, which launchers read once
    a call) the partials are kept, as PyTorch does for its own atomic kernels. fixed_order: an output that must not
    vary from run to run (a forward's: the same prompt gives the same logits): atomics only for two parts, as
    0 + a + b is the same float in either order."""
    return parts > 1 and not deterministic and (parts <= 2 or not fixed_order)


def partial_sums(parts: int, shape, device, atomic: bool, to_zero: list | None = None) -> torch.Tensor:
    """The float32 buffer of a kernel's `parts` partial sums of an output of `shape`: with `atomic`
    (atomic_partial_sums) the output itself, zeroed, which they add into (store_partial); else [parts, *shape] for
    summed(), or for one part the output itself. to_zero: a list that an atomic buffer joins instead of being zeroed
    here, for the caller to zero it with the others in one launch (zero_all) before the kernel runs."""
    if parts > 1 and not atomic:
        return torch.empty(parts, *shape, device=device, dtype=torch.float32)
    if not atomic or to_zero is None:
        return (torch.zeros if atomic else torch.empty)(*shape, device=device, dtype=torch.float32)
    buffer = torch.empty(*shape, device=device, dtype=torch.float32)
    to_zero.append(buffer)
    return buffer


def zero_all(buffers: list) -> None:
    """Zeroes `buffers` (float32) with one launch, where torch.zeros takes one a buffer: a launch costs the host more
    than these small fills cost the GPU."""
    if buffers:
        torch._foreach_zero_(buffers)


def summed(buffer: torch.Tensor, parts: int, atomic: bool) -> torch.Tensor:
    """The output from partial_sums' buffer once the kernel has run."""
    return buffer.sum(0) if parts > 1 and not atomic else buffer


@triton.jit
def store_partial(buffer_ptr, part, part_size, offsets, value, mask, ATOMIC: tl.constexpr):
    # partial sum number `part` of an output (partial_sums' buffer): added into it (ATOMIC), or stored at its place
    # [part, ...] for summed()
    if ATOMIC:
        tl.atomic_add(buffer_ptr + offsets, value, mask=mask, sem="relaxed")
    else:
        tl.store(buffer_ptr + part * part_size + offsets, value, mask=mask)
