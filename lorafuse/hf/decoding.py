"""What captured decoding (lorafuse.inference) asks of transformers and PEFT: which models it covers, a static
KV cache with views for smaller batches, one forward that returns each row's next-token logits (its attention
windows), the model's EOS and padding ids, merging an adapter or stacking it under the
frozen weights, and transformers' generate for the models it does not cover.
"""
import contextlib
import copy

import torch
from peft import PeftModel, PeftType
from peft.tuners.lora import LoraLayer
from transformers import PreTrainedModel, StaticCache

from .._logging import log_once
from ..ops.attention.decode_windows import one_query_windows
from . import attention

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ATTENTION = ("sdpa", "eager", "lorafuse")  # those that take decode_mask's 4-D masks
BASE = "__base__"  # PEFT's adapter_names entry for a row without an adapter


def causal_lm(model: torch.nn.Module) -> PreTrainedModel:
    """The transformers model: `model` itself, or the one inside a PeftModel (LoRA layers in place). Decoding
    calls it directly: for LoRA adapters, a PeftModel's forward adds nothing but per-call Python."""
    return model.get_base_model() if isinstance(model, PeftModel) else model


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why captured decoding cannot run `model`, or None when it can."""
    config = causal_lm(model).config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {config.model_type!r} (captured decoding covers {', '.join(SUPPORTED_MODEL_TYPES)})"
    if config._attn_implementation not in SUPPORTED_ATTENTION:
        return (f"attn_implementation={config._attn_implementation!r} (captured decoding runs "
                f"{', '.join(SUPPORTED_ATTENTION)})")
    if isinstance(model, PeftModel) and model.active_peft_config.peft_type != PeftType.LORA:
        return f"a {model.active_peft_config.peft_type} adapter (captured decoding runs LoRA adapters)"
    # The cache is built lazily: no memory is taken to ask it which layers slide.
    if any(layer.is_sliding for layer in StaticCache(config=config, max_cache_len=1).layers):
        return "sliding-window layers (transformers' static sliding-window cache tracks its fill on the host)"
    on_host = [kind for kind in _rope_types(causal_lm(model)) if "dynamic" in kind or kind == "longrope"]
    if on_host:
        return (f"rope_type {on_host[0]!r} (transformers recomputes its frequencies from the positions, read on the "
                "host, which a captured step cannot do)")
    return None


def _rope_types(lm: PreTrainedModel) -> list[str]:
    # a model's rotary embedding keeps its rope_type as a string, or a dict per layer type
    kind = getattr(getattr(getattr(lm, "model", None), "rotary_emb", None), "rope_type", "default")
    return list(kind.values()) if isinstance(kind, dict) else [kind]


def static_cache(model: torch.nn.Module, batch_size: int, max_length: int) -> StaticCache:
    """A StaticCache for `batch_size` rows of `max_length` tokens, allocated now in the model's dtype and device."""
    lm = causal_lm(model)
    config = lm.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache = StaticCache(config=lm.config, max_cache_len=max_length)
    cache.early_initialization(batch_size, config.num_key_value_heads, head_dim, lm.dtype, lm.device)
    return cache


def cache_rows(cache: StaticCache, rows: int) -> StaticCache:
    """A cache over the first `rows` rows of `cache`'s tensors, sharing their memory and each layer's write
    position (`cumulative_length`, a tensor updated in place): batches of several sizes use one allocation,
    one at a time."""
    view = copy.copy(cache)
    view.layers = [copy.copy(layer) for layer in cache.layers]
    for layer in view.layers:
        layer.keys, layer.values = layer.keys[:rows], layer.values[:rows]
        layer.batch_size = rows
    return view


def decode_mask(model: torch.nn.Module, keep: torch.Tensor) -> torch.Tensor:
    """The attention mask of a decode step in the form the model's attention takes it whole: bool, or additive
    for eager attention. transformers passes a 4-D mask through untouched, so it must say everything: the slots
    not yet written are not kept, which makes it causal too. (lorafuse's attention reads a 2-D mask as keys that
    end at the query, which a static cache's fixed-length mask does not; it takes decode_attention_kwargs'
    windows instead of this mask.)"""
    # keep: bool [B, K], the cache slots each row attends to -> [B, 1, 1, K]
    mask = keep[:, None, None, :]
    lm = causal_lm(model)
    if lm.config._attn_implementation != "eager":
        return mask
    return torch.zeros(mask.shape, dtype=lm.dtype, device=mask.device).masked_fill_(~mask, torch.finfo(lm.dtype).min)


def decode_attention_kwargs(model: torch.nn.Module, keep: torch.Tensor) -> dict:
    """Extra forward keywords of a decode step: for lorafuse attention, the windows of `keep` (each row's kept
    slots are one run: left padding, then the slots written so far), so that the step runs the flash-decoding
    kernel even inside a CUDA graph, where the attention function cannot check a 4-D mask on the host. One launch
    (ops.decode_windows), as in the fused step, instead of torch's ~17 small kernels."""
    # keep: bool [B, K]
    if causal_lm(model).config._attn_implementation != attention.NAME:
        return {}
    return {attention.WINDOWS_KWARG: one_query_windows(keep)}


def next_token_logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                      cache: StaticCache, adapter_names: list[str] | None = None, **attention_kwargs) -> torch.Tensor:
    """One forward that appends `ids` to `cache` and returns the logits after each row's last token; with
    adapter_names (a PeftModel's), row i runs adapter adapter_names[i] ("__base__": none), as PEFT's mixed batches."""
    # ids, positions: [B, T]; mask: [B, K] keep-mask of the cache slots each row attends to (a prefill's K = T),
    # or decode_mask's [B, 1, 1, K] -> [B, V]
    rows = contextlib.nullcontext()
    if adapter_names is not None:
        rows = model.base_model._enable_peft_forward_hooks(adapter_names=adapter_names)  # PEFT's own per-row routing
    with rows:
        out = causal_lm(model)(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                               use_cache=True, logits_to_keep=1, **attention_kwargs)
    return out.logits[:, -1]


def vocab_size(model: torch.nn.Module) -> int:
    """The width of the model's logits (its output embedding's rows, padding included)."""
    return causal_lm(model).get_output_embeddings().weight.shape[0]


def eos_token_ids(model: torch.nn.Module) -> list[int]:
    """The ids that end a row: the generation config's, else the model config's."""
    lm = causal_lm(model)
    eos = getattr(lm.generation_config, "eos_token_id", None)
    eos = lm.config.eos_token_id if eos is None else eos
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def pad_token_id(model: torch.nn.Module) -> int:
    """An id to pad prompts with (masked out, so any id would do), the one transformers' generate uses."""
    lm = causal_lm(model)
    pad = getattr(lm.generation_config, "pad_token_id", None)
    return pad if pad is not None else (eos_token_ids(model) or [0])[0]


def adapter_bank(model: torch.nn.Module) -> tuple[str, ...] | None:
    """The LoRA adapters of a PeftModel that holds more than one, in the order they were added: the fused step then
    stacks them all and each row picks one (fused_decode). None for a single adapter, or none."""
    if not isinstance(model, PeftModel):
        return None
    names = tuple(name for name, config in model.peft_config.items() if config.peft_type == PeftType.LORA)
    return names if len(names) > 1 else None


def active_adapter(model: torch.nn.Module) -> str:
    """The adapter a PeftModel runs by default, or "__base__" (PEFT's name for none) for a model without one."""
    return model.active_adapter if isinstance(model, PeftModel) else BASE


def adapter_names(model: torch.nn.Module) -> tuple[str, ...]:
    """The LoRA adapters that rows of a batch may name: those of a PeftModel's adapter bank, its active adapter if
    it holds one, none for a model without adapters (or with its adapter merged)."""
    if not isinstance(model, PeftModel):
        return ()
    return adapter_bank(model) or (model.active_adapter,)


def merge_adapter(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with its LoRA adapter folded into the base weights (PEFT's merge_and_unload); others as they are."""
    return model.merge_and_unload() if isinstance(model, PeftModel) else model


CAPTURED_MARK = "_lorafuse_graphs_hold_weights"


def mark_captured(model: torch.nn.Module) -> None:
    """Record that CUDA graphs now read `model`'s weights at their addresses (an engine captured its decode step):
    no later layout may move them (the fused step's stacking), or those graphs would read freed memory."""
    setattr(causal_lm(model), CAPTURED_MARK, True)


def weights_captured(model: torch.nn.Module) -> bool:
    """Whether mark_captured was called on `model`."""
    return getattr(causal_lm(model), CAPTURED_MARK, False)


def cast_adapters(model: torch.nn.Module) -> None:
    """A PeftModel's LoRA weights cast in place to the dtype of its embeddings (PEFT keeps adapters of a 16-bit model
    in float32: they are rounded, and that is logged once), so that the fused decode step runs them in one GEMM with
    the frozen weights. Models without adapters are left as they are."""
    if not isinstance(model, PeftModel):
        return
    dtype = causal_lm(model).get_input_embeddings().weight.dtype
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        cast = {p.dtype for p in [*module.lora_A.parameters(), *module.lora_B.parameters()]} - {dtype}
        if cast:
            log_once(f"lorafuse.inference: LoRA adapters cast in place from {', '.join(sorted(map(str, cast)))} to "
                     f"the model's {dtype} for decoding (Engine(stack_adapters=False) keeps them)")
        module.lora_A.to(dtype)
        module.lora_B.to(dtype)


def hf_generate(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, *, max_new_tokens: int,
                temperature: float, top_k: int, top_p: float, adapter_names: list[str] | None = None) -> torch.Tensor:
    """transformers' generate on a left-padded batch, with lorafuse's sampling settings (temperature 0: greedy);
    returns the new tokens only. Draws from torch's global generator. adapter_names: as next_token_logits'."""
    # ids, mask: [B, T] -> [B, <= max_new_tokens]
    sampling = {"do_sample": False}
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature, "top_k": top_k, "top_p": top_p}
    # num_beams=1: a model's generation config may ask for beam search, which captured decoding never does.
    rows = {} if adapter_names is None else {"adapter_names": adapter_names}  # PeftModel.generate routes them
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, num_beams=1,
                         eos_token_id=eos_token_ids(model), pad_token_id=pad_token_id(model), **sampling, **rows)
    return out[:, ids.shape[1]:]
