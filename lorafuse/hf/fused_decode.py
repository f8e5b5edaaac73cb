"""The fused decode step of captured decoding (lorafuse.inference.Engine): one token per row through a Llama, Mistral,
Qwen2 or Qwen3 decoder stack in ten launches per layer, instead of transformers' ~300 small kernels per token.

Per layer, with h the residual stream and x its normed copy (both updated in place):
  1. one GEMM of x with [Wq; Wk; Wv; Aq; Ak; Av] (+ the stacked q/k/v bias, unless the norm of x was deferred): q,
     k, v and the adapters' shrinks;
  2. ops.rope_cache_write: LoRA expand (and rstd and the bias, where deferred), Qwen3's q/k norms, rotary embedding,
     q to a buffer, k and v into the StaticCache's layer tensors at the step's slot;
  3. ops.flash_attention (its flash-decoding kernels, two launches) over the cache, on the step's windows;
  4. one GEMM with [Wo; Ao], then ops.lora_add_rms_norm: h += o + LoRA, x = post-attention norm of h;
  5. one GEMM with [Wg; Wu; Ag; Au], then ops.lora_silu_mul;
  6. one GEMM with [Wd; Ad], then ops.lora_add_rms_norm with the next layer's input norm (the final norm after the
     last layer), so that no layer starts with a norm of its own.
Up to 16 rows the GEMMs (and lm_head) are ops.gemv: at batch 1 it reads the weights faster than cuBLAS's kernels, and
at every batch it lets the kernel after it launch as it starts, which cuBLAS's kernels do not (a shorter step at batch
8 too; bench_decode.py, rows in benchmarks/results/decode.csv). Merged and unmerged adapters run the same launches: an
unmerged adapter adds rank-r rows to the GEMMs and a few multiply-adds inside the kernels after them. A PeftModel
holding several LoRA adapters gets them all stacked (an adapter bank): each GEMM gives every adapter's shrink, and
each row of a batch scales the s columns of the adapter it picks (or none) by that adapter's scale and the others' by
0 (`row_scales` of the kernels after the GEMMs), so rows of one batch run different adapters in the same captured
step. With an adapter on o_proj (down_proj) the residual kernel spreads each row over programs and defers the norm: x
leaves as h * w with partial sums of h^2, and the kernel after the next GEMM (5, or 2 of the next layer) scales its
rows by rstd before adding the bias (ops/decode/lora_columns.py). Before the layers, one launch builds the attention
windows from the keep-mask (ops.decode_windows) and one gathers each row's cos and sin from a table of the model's
rotary embedding. Captured, the kernels take programmatic dependent launch (ops/common/dependent_launch.py). Prefill
stays on transformers' forward; both write the same cache.

The weights of each GEMM are stored one after another in one buffer (`StackedLinear`), and the modules' parameters
re-pointed to views of it, so that PEFT, swap_adapter (which copies into lora_A and lora_B in place) and the user's
model keep seeing the same parameters. A layout made once is kept: a second engine on the same model moves nothing
(the first one's captured graphs hold these addresses), and weights that another engine captured unstacked are not
laid out at all (this step then declines: decoding.mark_captured).
"""

import torch
from peft import PeftModel
from peft.tuners import lora
from torch import nn
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer
from transformers.models.mistral.modeling_mistral import MistralAttention, MistralDecoderLayer
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2DecoderLayer
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3DecoderLayer

from ..ops.common.tiles import kernels_run_on
from ..ops.attention.decode_windows import one_query_windows
from ..ops.attention.flash_attention import HEAD_DIMS, flash_attention
from ..ops.decode.gemv import FEW_ROWS, gemv
from ..ops.decode.lora_add_rms_norm import lora_add_rms_norm
from ..ops.decode.lora_silu_mul import lora_silu_mul
from ..ops.model.rms_norm import rms_norm
from ..ops.decode.rope_cache_write import rope_cache_write
from .decoding import adapter_bank, cast_adapters, causal_lm, weights_captured
from .lora import FusedLoraLinear
from .model_kernels import KernelForward, computes_as_llama_rms_norm, computes_as_swiglu_mlp

DECODER_LAYERS = (LlamaDecoderLayer, MistralDecoderLayer, Qwen2DecoderLayer, Qwen3DecoderLayer)
ATTENTIONS = (LlamaAttention, MistralAttention, Qwen2Attention, Qwen3Attention)
LORA_LINEARS = (lora.Linear, FusedLoraLinear)  # FusedLoraLinear changes PEFT's forward only
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The kernels after the GEMMs hold a [columns, ranks] tile of B: a bank's ranks on one projection add up, and past
# the largest single adapter rank these kernels were written for their tiles would spill (untried: such banks are
# declined).
MAX_BANK_RANK = 64
# transformers' rope types whose frequencies do not change with the positions seen: their cos and sin are tabulated
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("self_attn", ("o_proj",)),
          ("mlp", ("gate_proj", "up_proj")), ("mlp", ("down_proj",)))  # the projections of each GEMM


def stacked_rows(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The [sum of rows, K] view over `tensors` when they lie one after another in one buffer, else None."""
    # tensors: [N_i, K], one dtype
    first, K = tensors[0], tensors[0].shape[1]
    offset = first.storage_offset()
    for t in tensors:
        if t.dtype != first.dtype or t.device != first.device or t.shape[1] != K or not t.is_contiguous():
            return None
        # One storage, each tensor's rows right after the previous one's: two allocations that merely touch do not
        # count.
        if t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or t.storage_offset() != offset:
            return None
        offset += t.numel()
    return first.as_strided((sum(t.shape[0] for t in tensors), K), (K, 1))


def stack_rows(tensors: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """New tensors holding the same values in `dtype`, stored one after another in one buffer (see stacked_rows)."""
    # tensors: [N_i, K]
    both = torch.cat([t.detach().to(dtype) for t in tensors])
    return list(both.split([t.shape[0] for t in tensors]))


def side_by_side(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The [N, sum of columns] view over `tensors` when they are column blocks of one buffer, one after another
    (an adapter bank's lora_B), else None."""
    # tensors: [N, r_i], one dtype
    first, rows = tensors[0], tensors[0].shape[0]
    width = sum(t.shape[1] for t in tensors)
    offset = first.storage_offset()
    for t in tensors:
        if t.dtype != first.dtype or t.device != first.device or t.shape[0] != rows or t.stride(1) != 1 or \
                (rows > 1 and t.stride(0) != width):
            return None
        if t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or t.storage_offset() != offset:
            return None
        offset += t.shape[1]
    return first.as_strided((rows, width), (width, 1))


def lay_side_by_side(params: list[nn.Parameter]) -> torch.Tensor:
    """Moves `params` ([N, r_i]) into one [N, sum r_i] buffer, each re-pointed to its column block; returns it."""
    both = torch.cat([p.detach() for p in params], 1)
    start = 0
    for param in params:
        param.data = both[:, start:start + param.shape[1]]
        start += param.shape[1]
    return both


def shares_buffer(weight: torch.Tensor) -> bool:
    """Whether `weight` is a view into a larger buffer: laid out for decoding by an engine (stack_rows), whose
    captured steps hold the buffer's address, so it must not be moved again."""
    return weight.untyped_storage().nbytes() > weight.numel() * weight.element_size()


def unsupported_reason(model: nn.Module, stack_adapters: bool = True) -> str | None:
    """Why the fused step cannot run `model` (a model that captured decoding runs: decoding.unsupported_reason),
    or None when it can. Without `stack_adapters` a PeftModel's adapters must stay as they are: it cannot."""
    lm = causal_lm(model)
    device, dtype = lm.device, lm.get_input_embeddings().weight.dtype
    if not kernels_run_on(device):
        return f"a model on {device} (its Triton kernels need CUDA, or TRITON_INTERPRET=1 on a CPU)"
    if dtype not in DTYPES:
        return f"a {dtype} model (the kernels take {', '.join(map(str, DTYPES))})"
    if type(lm.get_input_embeddings()) is not nn.Embedding or type(lm.get_output_embeddings()) is not nn.Linear:
        return (f"input embeddings {type(lm.get_input_embeddings()).__name__}, output embeddings "
                f"{type(lm.get_output_embeddings()).__name__} (the fused step runs nn.Embedding and nn.Linear)")
    if not computes_as_llama_rms_norm(lm.model.norm):
        return f"a final norm {type(lm.model.norm).__name__} that does not compute as LlamaRMSNorm"
    if isinstance(model, PeftModel) and not stack_adapters:
        return "stack_adapters=False (the fused step stores the adapters with the frozen weights)"
    if isinstance(model, PeftModel) and len(model.active_adapters) != 1:
        return f"{len(model.active_adapters)} active adapters (the fused step runs one)"
    hooks = _hooks_on(lm.model, lm.model.norm, lm.model.rotary_emb, lm.get_input_embeddings(),
                      lm.get_output_embeddings())
    if hooks:
        return f"{hooks} (e.g. accelerate offload); the fused step would skip them"
    captured, bank = weights_captured(model), adapter_bank(model)
    for i, layer in enumerate(lm.model.layers):
        reason = _layer_reason(layer, dtype, captured, bank)
        if reason is not None:
            return f"decoder layer {i}: {reason}"
    head_dim = lm.model.layers[0].self_attn.head_dim
    if head_dim not in HEAD_DIMS:
        return f"head dim {head_dim} (flash decoding runs {HEAD_DIMS}; others would take its SDPA fallback)"
    cos, _ = lm.model.rotary_emb(lm.get_input_embeddings().weight[:1], torch.zeros(1, 1, dtype=torch.long,
                                                                                   device=device))
    if cos.shape[-1] != head_dim:
        return f"rotary embeddings of {cos.shape[-1]} dims on heads of {head_dim} (partial rotary)"
    return None


def _layer_reason(layer: nn.Module, dtype: torch.dtype, captured: bool, bank: tuple[str, ...] | None) -> str | None:
    # captured: CUDA graphs of another engine read the weights where they are (decoding.mark_captured); bank: see
    # adapter_bank
    attn, mlp = layer.self_attn, layer.mlp
    if type(layer) not in DECODER_LAYERS or type(attn) not in ATTENTIONS:
        return (f"{type(layer).__name__} with {type(attn).__name__} (the fused step computes "
                f"{', '.join(cls.__name__ for cls in DECODER_LAYERS)} as transformers does)")
    hooks = _hooks_on(layer, attn, mlp, layer.input_layernorm, layer.post_attention_layernorm)
    if hooks:
        return f"{hooks} (e.g. accelerate offload); the fused step would skip them"
    if getattr(attn, "sliding_window", None) is not None:
        return f"sliding-window attention ({attn.sliding_window})"
    if not computes_as_swiglu_mlp(mlp):
        return f"an MLP {type(mlp).__name__} that does not compute as LlamaMLP with SiLU"
    norms = [layer.input_layernorm, layer.post_attention_layernorm] + [getattr(attn, name) for name in
                                                                      ("q_norm", "k_norm") if hasattr(attn, name)]
    if not all(map(computes_as_llama_rms_norm, norms)):
        return "a norm that does not compute as LlamaRMSNorm"
    for parent, names in GROUPS:
        for name in names:
            reason = _projection_reason(getattr(layer, parent).get_submodule(name), dtype, bank)
            if reason is not None:
                return f"{name}: {reason}"
        if _moved_by_another_layout([getattr(layer, parent).get_submodule(name) for name in names], captured, bank):
            return (f"{', '.join(names)} laid out or captured by another engine on this model (views into another "
                    "buffer, or read by CUDA graphs of transformers' step): moving them would strand what holds "
                    "them there")
    return None


def _hooks_on(*modules: nn.Module) -> str:
    """What would run around these modules' forward that the fused step does not call: '' when nothing. lorafuse's
    own kernel forwards (model_kernels.use_model_kernels) compute what the fused step computes: not hooks."""
    found = []
    for module in modules:
        hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
        names = [getattr(hook, "__qualname__", type(hook).__name__) for hook in hooks]
        own = vars(module).get("forward")
        if own is not None and not isinstance(own, KernelForward):
            names.append("a forward set on the instance")
        if names:
            found.append(f"{type(module).__name__} with {', '.join(names)}")
    return "; ".join(found)


def _projection_reason(module: nn.Module, dtype: torch.dtype, bank: tuple[str, ...] | None) -> str | None:
    """Why a q/k/v/o/gate/up/down projection cannot join a stacked GEMM, or None: an nn.Linear, or a plain LoRA
    Linear on one (with an active adapter or none; with every adapter of a bank or none)."""
    base = module.get_base_layer() if type(module) in LORA_LINEARS else module
    if type(base) is not nn.Linear:
        return f"a {type(module).__name__} (the fused step runs nn.Linear, with or without a LoRA Linear on it)"
    hooks = _hooks_on(module) if module is base else _hooks_on(module, base)
    if hooks:
        return f"{hooks} (e.g. accelerate offload)"
    if base.weight.dtype != dtype:
        return f"a {base.weight.dtype} weight in a {dtype} model"
    if module is base:
        return None
    if module.merged or module.disable_adapters:
        return "adapters merged into the weights, or disabled, on an unmerged model"
    ranks = sum(module.lora_A[adapter].weight.shape[0] for adapter in _adapter_names(module, bank))
    if bank is not None and ranks > MAX_BANK_RANK:
        return (f"the bank's adapters on it add up to rank {ranks} > {MAX_BANK_RANK} (the decode kernels hold "
                "[columns, ranks] tiles of lora_B)")
    for adapter in _adapter_names(module, bank):
        if adapter in module.lora_variant or module.use_dora.get(adapter):
            return f"a DoRA adapter {adapter!r} (a LoRA variant)"
        if module.fan_in_fan_out or module.lora_B[adapter].bias is not None:
            return f"fan_in_fan_out or lora_bias (adapter {adapter!r})"
        if type(module.lora_dropout[adapter]) not in (nn.Dropout, nn.Identity):
            return f"a {type(module.lora_dropout[adapter]).__name__} lora_dropout (inference runs none)"
    return None


def _adapter_names(module: nn.Module, bank: tuple[str, ...] | None) -> list[str]:
    """The adapters on a projection that the fused step runs: its active one, or those of the bank (in its order);
    none on a plain nn.Linear or where no such adapter targets the projection."""
    if type(module) not in LORA_LINEARS:
        return []
    return [name for name in (bank or module.active_adapters[:1]) if name in module.lora_A]


def _adapters(module: nn.Module, bank: tuple[str, ...] | None) -> dict[str, tuple[nn.Parameter, nn.Parameter, float]]:
    """(lora_A, lora_B, scale) by adapter name, of the adapters the fused step runs on a projection."""
    return {name: (module.lora_A[name].weight, module.lora_B[name].weight, float(module.scaling[name]))
            for name in _adapter_names(module, bank)}


def _stacked_tensors(modules: list[nn.Module], bank: tuple[str, ...] | None) -> list[nn.Parameter]:
    """What one GEMM stacks, in order: the frozen weights, then the lora_A of each projection's adapters."""
    weights = [m.get_base_layer().weight if type(m) in LORA_LINEARS else m.weight for m in modules]
    return weights + [a[0] for m in modules for a in _adapters(m, bank).values()]


def _moved_by_another_layout(modules: list[nn.Module], captured: bool, bank: tuple[str, ...] | None) -> bool:
    # laying these out would move weights that another layout, or another engine's graphs, hold where they are
    tensors = _stacked_tensors(modules, bank)
    if stacked_rows(tensors) is None and (captured or any(map(shares_buffer, tensors))):
        return True
    if bank is None:
        return False
    for module in modules:  # a bank also lays each projection's lora_B side by side
        bs = [a[1] for a in _adapters(module, bank).values()]
        if len(bs) > 1 and side_by_side(bs) is None and (captured or any(map(shares_buffer, bs))):
            return True
    return False


class StackedLinear:
    """The projections of one input (q/k/v, o, gate/up or down) as one GEMM over [W_1; ...; W_n; A_1; ...]: its
    output row is [y_1 | ... | y_n | s_1 | ...], with s = x A^T for the projections that have an adapter. The kernel
    after the GEMM adds scale * s B^T (`lora_B`, `scales`: per projection, None / 0 without an adapter), and the bias
    where the input comes with a deferred norm (which scales the rows first; bias_in_gemm False).

    With an adapter bank each projection's s is its adapters' shrinks side by side, `lora_B` their B side by side
    in one buffer (PEFT's lora_B parameters re-pointed to its column blocks, as lora_A to the GEMM's rows), and
    `table` [len(bank) + 1, ranks] holds the per-row scales of the s columns for each choice of adapter (the last:
    none); FusedDecoder sets `row_scales`."""

    def __init__(self, modules: list[nn.Module], bank: tuple[str, ...] | None = None):
        tensors = _stacked_tensors(modules, bank)
        self.weight = stacked_rows(tensors)
        if self.weight is None:  # laid out once, here; a second engine on the model finds it so
            for param, view in zip(tensors, stack_rows(tensors, tensors[0].dtype)):
                param.data = view
            self.weight = stacked_rows(tensors)
        adapters = [_adapters(m, bank) for m in modules]
        self.row_scales = None  # [rows, ranks] view of FusedDecoder's buffer, with a bank
        if bank is None:
            self.lora_B = tuple(next((a[1] for a in found.values()), None) for found in adapters)
            self.scales = tuple(next((a[2] for a in found.values()), 0.0) for found in adapters)
            self.table = None
        else:
            self.lora_B = tuple(self._bank_b([a[1] for a in found.values()]) for found in adapters)
            self.scales = tuple(0.0 for _ in modules)  # the row scales stand in for them
            self.table = self._scale_table(adapters, bank)
        self.bias = self._stacked_bias([m.get_base_layer() if type(m) in LORA_LINEARS else m for m in modules])
        self.bias_in_gemm = True  # FusedLayer / FusedDecoder clear it where the input comes with a deferred norm

    def _scale_table(self, adapters: list[dict], bank: tuple[str, ...]) -> torch.Tensor | None:
        # [len(bank) + 1, ranks] fp32: row c scales the s columns of adapter bank[c] by its scale, all others by 0
        columns = [(name, a[2]) for found in adapters for name, a in found.items() for _ in range(a[0].shape[0])]
        if not columns:
            return None
        table = torch.zeros(len(bank) + 1, len(columns), dtype=torch.float32, device=self.weight.device)
        for j, (name, scale) in enumerate(columns):
            table[bank.index(name), j] = scale
        return table

    @staticmethod
    def _bank_b(params: list[nn.Parameter]) -> torch.Tensor | None:
        # [N, sum r] over the adapters' lora_B of one projection, laid out once (a later engine finds it so)
        if not params:
            return None
        found = side_by_side(params)
        return found if found is not None else lay_side_by_side(params)

    def row_scales_of(self, rows: int) -> torch.Tensor | None:
        return None if self.row_scales is None else self.row_scales[:rows]

    def _stacked_bias(self, bases: list[nn.Linear]) -> torch.Tensor | None:
        # [b_1; ...; b_n; 0 for the shrinks], a copy: frozen biases never change at inference (swaps copy lora_A
        # and lora_B only); the GEMM's epilogue or the kernel after it adds them (Qwen2's q/k/v, Llama's biases)
        if all(base.bias is None for base in bases):
            return None
        weight = self.weight
        parts = [torch.zeros(b.out_features, dtype=weight.dtype, device=weight.device) if b.bias is None
                 else b.bias.detach() for b in bases]
        return torch.cat(parts + [weight.new_zeros(weight.shape[0] - sum(b.out_features for b in bases))])

    def bias_after(self) -> torch.Tensor | None:
        """The bias for the kernel after the GEMM to add, or None (none, or the GEMM adds it)."""
        return None if self.bias_in_gemm else self.bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, K] -> [B, sum N + sum r]
        bias = self.bias if self.bias_in_gemm else None
        if x.shape[0] <= FEW_ROWS and x.stride(1) == 1:
            return gemv(x, self.weight, bias)  # lets the kernel after it launch early, as cuBLAS's kernels do not
        return x @ self.weight.t() if bias is None else torch.addmm(bias, x, self.weight.t())


class FusedLayer:
    """One decoder layer's part of the fused step."""

    def __init__(self, layer: nn.Module, bank: tuple[str, ...] | None):
        attn, mlp = layer.self_attn, layer.mlp
        # the q/k/v and gate/up inputs may come with a deferred norm: then their kernels add the bias after its scaling
        self.qkv = StackedLinear([attn.q_proj, attn.k_proj, attn.v_proj], bank)
        self.o = StackedLinear([attn.o_proj], bank)
        self.gate_up = StackedLinear([mlp.gate_proj, mlp.up_proj], bank)
        self.down = StackedLinear([mlp.down_proj], bank)
        self.gemms = (self.qkv, self.o, self.gate_up, self.down)
        # With an adapter on o_proj (down_proj) the residual kernel spreads each row over programs; deferring the
        # norm spares it the wait for the whole row. Not after the last layer (the final norm feeds lm_head: see
        # FusedDecoder), nor in fp16, whose range may not hold rows scaled by rms(h) (bf16's is fp32's). An input
        # that comes normalized keeps its bias in the GEMM's epilogue, rounded once as transformers' linear does.
        can_defer = self.qkv.weight.dtype != torch.float16
        self.defers_attention_norm = can_defer and self.o.lora_B[0] is not None
        self.defers_next_norm = can_defer and self.down.lora_B[0] is not None
        self.gate_up.bias_in_gemm = not self.defers_attention_norm
        self.input_norm, self.post_attention_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)  # Qwen3's
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.n_heads = attn.q_proj.out_features // attn.head_dim
        self.intermediate = mlp.gate_proj.out_features

    def __call__(self, hidden, normed, row_norm, cos, sin, slot, windows, cache_layer, next_norm: nn.Module):
        """Returns the deferred norm of `normed` on exit (see ops/decode/lora_columns.py), or None."""
        # hidden, normed: [B, H], the residual stream and its input-normed copy, both updated in place (normed by
        # next_norm on exit); row_norm: normed's deferred norm on entry or None; cos, sin: [B, D]; slot: int64 [1];
        # cache_layer: its keys, values [B, Hkv, L, D]
        batch = hidden.shape[0]
        q = torch.empty(batch, self.n_heads, 1, self.head_dim, dtype=hidden.dtype, device=hidden.device)
        qk_norms = (None, None, 0.0) if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight,
                                                                   self.q_norm.variance_epsilon)
        rope_cache_write(self.qkv(normed), self.qkv.lora_B, self.qkv.scales, cos, sin, *qk_norms, slot, q,
                         cache_layer.keys, cache_layer.values, bias=self.qkv.bias_after(), row_norm=row_norm,
                         row_scales=self.qkv.row_scales_of(batch))
        attended = flash_attention(q, cache_layer.keys, cache_layer.values, causal=False, scale=self.scaling,
                                   windows=windows)  # [B, Hq, 1, D]
        row_norm = _add_and_norm(self.o, self.o(attended.transpose(1, 2).reshape(batch, -1)), hidden,
                                 self.post_attention_norm, normed, self.defers_attention_norm)
        activated = torch.empty(batch, self.intermediate, dtype=hidden.dtype, device=hidden.device)
        lora_silu_mul(self.gate_up(normed), self.gate_up.lora_B, self.gate_up.scales, activated,
                      bias=self.gate_up.bias_after(), row_norm=row_norm, row_scales=self.gate_up.row_scales_of(batch))
        return _add_and_norm(self.down, self.down(activated), hidden, next_norm, normed, self.defers_next_norm)


def _add_and_norm(linear: StackedLinear, proj, hidden, norm: nn.Module, normed, defer: bool):
    return lora_add_rms_norm(proj, linear.lora_B[0], linear.scales[0], hidden, norm.weight, norm.variance_epsilon,
                             normed, defer=defer, row_scales=linear.row_scales_of(hidden.shape[0]))


class FusedDecoder:
    """The fused decode step of `model` (unsupported_reason(model) must be None) for batches of up to `max_rows`.
    Building it casts a PeftModel's adapters to the model's dtype and lays out its weights for the stacked GEMMs (in
    place, kept: see the top). With an adapter bank (`bank`: its names) `select_adapters` says which adapter each row
    runs."""

    def __init__(self, model: nn.Module, max_rows: int = 1, max_length: int | None = None):
        cast_adapters(model)
        lm = causal_lm(model)
        self.embed, self.lm_head = lm.get_input_embeddings(), lm.get_output_embeddings()
        self.rotary, self.final_norm = lm.model.rotary_emb, lm.model.norm
        self._rope_table = self._rotary_table(max_length)
        self.bank = adapter_bank(model)
        self.layers = [FusedLayer(layer, self.bank) for layer in lm.model.layers]
        self._table, self._row_scales = self._bank_scales(max_rows)
        self.layers[-1].defers_next_norm = False  # the final norm feeds lm_head
        for previous, layer in zip(self.layers, self.layers[1:]):
            layer.qkv.bias_in_gemm = not previous.defers_next_norm
        # each layer ends with the next one's input norm (the final norm after the last): no layer starts with one
        self.next_norms = [layer.input_norm for layer in self.layers[1:]] + [self.final_norm]

    def _bank_scales(self, max_rows: int):
        # (table [choices, columns], buffer [max_rows, columns]) of every GEMM's per-row scales, side by side; each
        # GEMM's row_scales is a column slice of the buffer, so one copy per batch sets them all
        gemms = [g for layer in self.layers for g in layer.gemms if g.table is not None]
        if not gemms:
            return None, None
        table = torch.cat([g.table for g in gemms], 1)
        buffer = torch.zeros(max_rows, table.shape[1], dtype=table.dtype, device=table.device)
        start = 0
        for g in gemms:
            g.row_scales = buffer[:, start:start + g.table.shape[1]]
            start += g.table.shape[1]
        return table, buffer

    @torch.no_grad()
    def _rotary_table(self, max_length: int | None) -> torch.Tensor | None:
        # [max_length, 2, D]: the cos and sin of every position below max_length (the engine's positions stay there),
        # from the model's own rotary embedding, so that a step gathers its rows' in one launch instead of the
        # rotary's ~9 small kernels. Only for rope types whose frequencies are fixed (STATIC_ROPE_TYPES); None for
        # the others (dynamic and longrope scaling change with the positions seen: the step calls the rotary
        # embedding as before).
        if max_length is None or getattr(self.rotary, "rope_type", None) not in STATIC_ROPE_TYPES:
            return None
        weight = self.embed.weight
        positions = torch.arange(max_length, device=weight.device)[None]
        cos, sin = self.rotary(weight[:1], positions)  # [1, L, D]: the same values, position by position
        return torch.stack((cos[0], sin[0]), 1)

    def _cos_sin(self, hidden: torch.Tensor, positions: torch.Tensor):
        # ([B, D], [B, D]) of each row's position (positions: int64 [B, 1])
        if self._rope_table is None:
            cos, sin = self.rotary(hidden, positions)  # [B, 1, D]
            return cos[:, 0], sin[:, 0]
        both = self._rope_table[positions[:, 0]]  # [B, 2, D]
        return both[:, 0], both[:, 1]

    def select_adapters(self, choices: list[int]) -> None:
        """Row i of the next batches runs adapter bank[choices[i]], or none where choices[i] == len(bank)."""
        if self._row_scales is not None:
            index = torch.tensor(choices, device=self._table.device)
            self._row_scales[:len(choices)].copy_(self._table[index])

    @torch.no_grad()
    def __call__(self, ids, positions, slot, keep, cache, logits) -> None:
        """Feeds each row its token: appends its keys and values to `cache` at `slot` and leaves the logits of its
        next token in `logits`. Reads nothing on the host (capturable). The cache layers' own write counters
        (cumulative_length) are not advanced: the engine's slot says where to write, and its prefill resets them."""
        # ids, positions: int64 [B, 1]; slot: int64 [1]; keep: bool [B, L], the cache slots each row attends to (the
        # slot included); cache: a StaticCache of B rows; logits: float32 [B, V]
        windows = one_query_windows(keep)
        hidden = self.embed(ids[:, 0])  # [B, H]
        cos, sin = self._cos_sin(hidden, positions)  # [B, D]: the model's own rope, whatever its scaling
        first = self.layers[0].input_norm
        normed = rms_norm(hidden, first.weight, first.variance_epsilon)
        row_norm = None
        for layer, cache_layer, next_norm in zip(self.layers, cache.layers, self.next_norms):
            row_norm = layer(hidden, normed, row_norm, cos, sin, slot, windows, cache_layer, next_norm)
        if normed.shape[0] <= FEW_ROWS and self.lm_head.weight.stride(1) == 1:
            gemv(normed, self.lm_head.weight, self.lm_head.bias, out=logits)
        else:
            logits.copy_(self.lm_head(normed))
