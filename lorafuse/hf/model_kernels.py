"""Llama-family modules on lorafuse's kernels: RMSNorm (ops.rms_norm), the MLP's SwiGLU product (ops.silu_mul) and
the attention's rotary embedding of q and k (ops.rope).

A module is taken only when its forward is transformers' own code for it - LlamaRMSNorm's, LlamaMLP's with a SiLU
activation (Mistral, Qwen2 and Qwen3 share both), or LlamaAttention's with Llama's rotation and eager attention
(Gemma, Granite, Qwen2-MoE and others share it; Mistral, Qwen2 and Qwen3 pass a sliding window and do not) -
compared as bytecode, names and constants, so a model whose module computes anything else keeps it. Its instance then
gets a `forward` attribute (a KernelForward) that computes the same on the kernels, forward and backward; deleting
that attribute gives transformers' forward back. Modules that already have an instance forward (accelerate's hooks
set one) are left alone.
"""
import contextlib
import inspect

import torch
from torch import nn
from transformers.activations import SiLUActivation
from transformers.cache_utils import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, eager_attention_forward

from ..ops.model.rms_norm import rms_norm
from ..ops.model.rope import rope
from ..ops.model.silu_mul import silu_mul

# What LlamaAttention.forward calls by name from its module: a model file with the same forward may define them
# otherwise (GLM's and Helium's rotations are interleaved or partial)
ATTENTION_HELPERS = ("apply_rotary_pos_emb", "rotate_half", "eager_attention_forward", "repeat_kv")
# The keyword of LlamaAttention.forward's KV cache: `cache` in transformers 5.24 (whose decorator renames a
# past_key_values to it), past_key_values in 5.17. Any of these names given a value the kernel forward does not take
# runs transformers' forward.
CACHE_KEYWORDS = ("cache", "past_key_values", "past_key_value")
_CACHE = next(name for name in CACHE_KEYWORDS if name in inspect.signature(LlamaAttention.forward).parameters)


def code_keys(fn) -> tuple:
    """The bytecode, names and constants of fn and of each function it wraps (functools.wraps' __wrapped__:
    transformers' decorators wrap forwards), a leading docstring left out (a model's example names the model)."""
    keys = []
    while fn is not None:
        code = getattr(fn, "__code__", None)
        if code is None:
            keys.append(None)
        else:
            consts = code.co_consts
            keys.append((code.co_code, code.co_names, consts[1:] if consts and isinstance(consts[0], str) else consts))
        fn = getattr(fn, "__wrapped__", None)
    return tuple(keys)


def _runs_code_of(module: nn.Module, reference, kernel_forward=None) -> bool:
    # the class's forward is transformers' `reference` forward; an instance forward is allowed only when it is
    # `kernel_forward` (set by use_model_kernels: the same computation on lorafuse's kernels)
    own = vars(module).get("forward")
    if own is not None and not (isinstance(own, KernelForward) and kernel_forward is not None
                                and own.fn is kernel_forward):
        return False
    return code_keys(getattr(type(module), "forward", None)) == code_keys(reference.forward)


def _rms_norm_forward(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, module.weight, module.variance_epsilon)


def _swiglu_mlp_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # as LlamaMLP.forward, the projections called in the same order (dropout draws stay in step)
    return module.down_proj(silu_mul(module.gate_proj(x), module.up_proj(x)))


def _llama_attention_forward(module: nn.Module, hidden_states: torch.Tensor, position_embeddings=None,
                             attention_mask=None, *args, **kwargs):
    # hidden_states: [B, T, hidden], position_embeddings: (cos, sin) [B | 1, T, D]. As LlamaAttention.forward with
    # ops.rope for apply_rotary_pos_emb, where the KV cache is none or a DynamicCache (training forwards make one
    # unless use_cache=False), whose update ignores the keywords 5.24 passes it; any other call runs that forward
    cache = kwargs.get(_CACHE)
    if (args or (cache is not None and type(cache) is not DynamicCache)
            or any(kwargs.get(name) is not None for name in CACHE_KEYWORDS if name != _CACHE)):
        return type(module).forward(module, hidden_states, position_embeddings, attention_mask, *args, **kwargs)
    kwargs = {name: value for name, value in kwargs.items() if name not in CACHE_KEYWORDS}
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, module.head_dim)

    query_states = module.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key_states = module.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value_states = module.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

    cos, sin = position_embeddings
    query_states, key_states = rope(query_states, key_states, cos, sin)

    if cache is not None:
        key_states, value_states = cache.update(key_states, value_states, module.layer_idx)

    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation,
                                                                eager_attention_forward)
    attn_output, attn_weights = attention_interface(
        module, query_states, key_states, value_states, attention_mask,
        dropout=0.0 if not module.training else module.attention_dropout, scaling=module.scaling, **kwargs)

    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return module.o_proj(attn_output), attn_weights


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


def llama_attentions(model: nn.Module) -> list[nn.Module]:
    """The attention modules of `model` that compute exactly as LlamaAttention, with transformers' forward."""
    return [m for m in model.modules() if _is_llama_attention(m)]


def _is_llama_attention(module: nn.Module) -> bool:
    if not _runs_code_of(module, LlamaAttention):
        return False
    names = inspect.unwrap(type(module).forward).__globals__
    return all(code_keys(names.get(name)) == code_keys(getattr(modeling_llama, name)) for name in ATTENTION_HELPERS)


def computes_as_llama_rms_norm(module: nn.Module) -> bool:
    """Whether `module` computes exactly as LlamaRMSNorm: transformers' forward, or this file's kernel in its place."""
    return _runs_code_of(module, LlamaRMSNorm, _rms_norm_forward)


def computes_as_swiglu_mlp(module: nn.Module) -> bool:
    """Whether `module` computes exactly as LlamaMLP with a SiLU activation: transformers' forward, or this file's
    kernel in its place."""
    return _is_swiglu_mlp(module, _swiglu_mlp_forward)


def use_model_kernels(model: nn.Module) -> int:
    """Give every Llama-style RMSNorm, SwiGLU MLP and attention of `model` lorafuse's kernels; returns how many
    modules."""
    taken = ((llama_rms_norms(model), _rms_norm_forward), (swiglu_mlps(model), _swiglu_mlp_forward),
             (llama_attentions(model), _llama_attention_forward))
    for modules, forward in taken:
        for module in modules:
            module.forward = KernelForward(module, forward)
    return sum(len(modules) for modules, _ in taken)


def drop_model_kernels(model: nn.Module) -> None:
    """Give the modules that use_model_kernels changed transformers' forward back."""
    for module in model.modules():
        if isinstance(vars(module).get("forward"), KernelForward):
            del module.forward


@contextlib.contextmanager
def rms_norms_on_kernel(norms: list[nn.Module]):
    """Within: each of `norms` (from llama_rms_norms) runs lorafuse.ops.model.rms_norm. Given transformers' forward back
    on exit: captured decoding uses the kernel in its own forwards only, on models that did not ask for it."""
    for module in norms:
        module.forward = KernelForward(module, _rms_norm_forward)
    try:
        yield
    finally:
        for module in norms:
            del module.forward
