"""Llama-family modules on lorafuse's kernels: RMSNorm (ops.rms_norm) and the MLP's SwiGLU product (ops.silu_mul).

A module is taken only when its forward is transformers' own code for it - LlamaRMSNorm's, or LlamaMLP's with a SiLU
activation (Mistral, Qwen2 and Qwen3 share both) - compared as bytecode, names and constants, so a model whose norm
or MLP computes anything else keeps it. Its instance then gets a `forward` attribute (a KernelForward) that computes
the same on the kernels, forward and backward; deleting that attribute gives transformers' forward back. Modules that
already have an instance forward (accelerate's hooks set one) are left alone.
"""
import contextlib

import torch
from torch import nn
from transformers.activations import SiLUActivation
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from ..ops.rms_norm import rms_norm
from ..ops.silu_mul import silu_mul


def _code_key(code) -> tuple:
    return code.co_code, code.co_names, code.co_consts


def _runs_code_of(module: nn.Module, reference, kernel_forward=None) -> bool:
    # the class's forward is transformers' `reference` forward; an instance forward is allowed only when it is
    # `kernel_forward` (set by use_model_kernels: the same computation on lorafuse's kernels)
    own = vars(module).get("forward")
    if own is not None and not (isinstance(own, KernelForward) and kernel_forward is not None
                                and own.fn is kernel_forward):
        return False
    code = getattr(type(module).forward, "__code__", None)
    return code is not None and _code_key(code) == _code_key(reference.forward.__code__)


def _rms_norm_forward(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, module.weight, module.variance_epsilon)


def _swiglu_mlp_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # as LlamaMLP.forward, the projections called in the same order (dropout draws stay in step)
    return module.down_proj(silu_mul(module.gate_proj(x), module.up_proj(x)))


class KernelForward:
    """`fn(module, ...)` as a module's instance forward. Unlike a bound method, it pickles (torch.save of a whole
    model; a bound method would pickle as a lookup of its name on the module, which fails on load)."""

    def __init__(self, module: nn.Module, fn):
        self.module, self.fn = module, fn

    def __call__(self, *args, **kwargs):
        return self.fn(self.module, *args, **kwargs)


def llama_rms_norms(model: nn.Module) -> list[nn.Module]:
    """The RMSNorm modules of `model` that compute exactly as LlamaRMSNorm, with transformers' forward."""
    return [m for m in model.modules() if _runs_code_of(m, LlamaRMSNorm)]


def swiglu_mlps(model: nn.Module) -> list[nn.Module]:
    """The MLP modules of `model` that compute exactly as LlamaMLP with a SiLU activation, with transformers'
    forward."""
    return [m for m in model.modules() if _is_swiglu_mlp(m)]


def _is_swiglu_mlp(module: nn.Module, kernel_forward=None) -> bool:
    return (_runs_code_of(module, LlamaMLP, kernel_forward)
            and isinstance(getattr(module, "act_fn", None), (SiLUActivation, nn.SiLU)))


def computes_as_llama_rms_norm(module: nn.Module) -> bool:
    """Whether `module` computes exactly as LlamaRMSNorm: transformers' forward, or this file's kernel in its place."""
    return _runs_code_of(module, LlamaRMSNorm, _rms_norm_forward)


def computes_as_swiglu_mlp(module: nn.Module) -> bool:
    """Whether `module` computes exactly as LlamaMLP with a SiLU activation: transformers' forward, or this file's
    kernel in its place."""
    return _is_swiglu_mlp(module, _swiglu_mlp_forward)


def use_model_kernels(model: nn.Module) -> int:
    """Give every Llama-style RMSNorm and SwiGLU MLP of `model` lorafuse's kernels; returns how many modules."""
    norms, mlps = llama_rms_norms(model), swiglu_mlps(model)
    for module in norms:
        module.forward = KernelForward(module, _rms_norm_forward)
    for module in mlps:
        module.forward = KernelForward(module, _swiglu_mlp_forward)
    return len(norms) + len(mlps)


def drop_model_kernels(model: nn.Module) -> None:
    """Give the modules that use_model_kernels changed transformers' forward back."""
    for module in model.modules():
        if isinstance(vars(module).get("forward"), KernelForward):
            del module.forward


@contextlib.contextmanager
def rms_norms_on_kernel(norms: list[nn.Module]):
    """Within: each of `norms` (from llama_rms_norms) runs lorafuse.ops.rms_norm. Given transformers' forward back
    on exit: captured decoding uses the kernel in its own forwards only, on models that did not ask for it."""
    for module in norms:
        module.forward = KernelForward(module, _rms_norm_forward)
    try:
        yield
    finally:
        for module in norms:
            del module.forward
